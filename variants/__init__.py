"""What each attention variant computes, and nothing about measuring it: one file per variant behind
one interface (base.py: ``attn(q, k, v, causal=False)`` on (B, H, N, D), the float64 reference and the
facts the harness reads), masks.py (the mask predicates and the one causal rule), blocksparse.py (the
engine of the mask-defined variants), flex.py and xformers_backend.py (GPU kernels); ring and ulysses
split the sequence over the ranks of a process group (seqpar.py).

    >>> import variants
    >>> attn = variants.build("sliding_window", window=64)
    >>> out = attn(q, k, v, causal=True)

From Hydra, ``conf/variant/<name>.yaml`` holds ``_target_: variants.<Class>`` and the options.
"""

from .adaptive_span import AdaptiveSpan
from .base import Attention, Flops, VariantError, dense_attention
from .blockwise import Blockwise
from .full import Full
from .linear import Linear
from .reformer import Reformer
from .ring import Ring
from .sliding_window import SlidingWindow
from .sparse import Sparse
from .ulysses import Ulysses

REGISTRY: dict[str, type[Attention]] = {cls.name: cls for cls in (Full, Sparse, Blockwise, SlidingWindow, Linear,
                                                                 Reformer, AdaptiveSpan, Ring, Ulysses)}


def build(name: str, **options) -> Attention:
    """Builds a variant by name; unknown names and options raise VariantError naming the allowed ones."""
    if name not in REGISTRY:
        raise VariantError(f"unknown variant {name!r}; allowed: {', '.join(REGISTRY)}")
    return REGISTRY[name](**options)


__all__ = ["Attention", "Flops", "VariantError", "REGISTRY", "build", "dense_attention",
           "Full", "Sparse", "Blockwise", "SlidingWindow", "Linear", "Reformer", "AdaptiveSpan", "Ring", "Ulysses"]
