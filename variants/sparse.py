"""sparse: block-sparse layouts: Sparse Transformer fixed and strided, and BigBird.

Every pattern is a block layout over I = i // b, J = j // b (see docs/variants.md):
- fixed:   (I // L == J // L) or (J mod L ≥ L − c)
- strided: (|I − J| < s) or ((I − J) mod s == 0)
- bigbird: (|I − J| ≤ (w−1)/2) or I < g or J < g or J ∈ R(I), R(I) seeded, min(r, available) blocks
The efficient path computes only allowed blocks: O(N·b·blocks-per-row).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import require, require_seed, whole
from .blocksparse import MaskedAttention
from .masks import bigbird_layout, fixed_layout, num_blocks, strided_layout

PATTERNS = ("fixed", "strided", "bigbird")
# Each pattern's own options and their defaults. An option of another pattern is refused (it would
# change nothing and make a separate series of identical numbers); the ones not given stay None.
PATTERN_OPTIONS = {
    "fixed": {"local_blocks": 4, "summary_blocks": 1},
    "strided": {"stride": 4},
    "bigbird": {"window_blocks": 3, "global_blocks": 1, "random_blocks": 2, "seed": 0},
}
MINIMUM = {"local_blocks": 1, "summary_blocks": 0, "stride": 1, "window_blocks": 1, "global_blocks": 0,
           "random_blocks": 0}


@dataclass(frozen=True)
class SparseOptions:
    pattern: str = "fixed"  # fixed | strided | bigbird
    block_size: int = 64  # b
    local_blocks: int | None = None  # fixed: L, blocks per chunk (default 4)
    summary_blocks: int | None = None  # fixed: c ≤ L, the last c blocks of each chunk are seen by all (default 1)
    stride: int | None = None  # strided: s, in blocks (default 4)
    window_blocks: int | None = None  # bigbird: w, odd (default 3)
    global_blocks: int | None = None  # bigbird: g (default 1)
    random_blocks: int | None = None  # bigbird: r (default 2)
    seed: int | None = None  # bigbird: seeds the random blocks (default 0); same seed and N, same layout
    backend: str | None = None  # blocksparse | dense

    def __post_init__(self) -> None:
        require(self.pattern in PATTERNS,
                f"sparse: unknown pattern {self.pattern!r}; allowed: {', '.join(PATTERNS)}")
        own = PATTERN_OPTIONS[self.pattern]
        for pattern, names in PATTERN_OPTIONS.items():
            for name in names:
                value = getattr(self, name)
                if name in own:
                    if value is None:
                        object.__setattr__(self, name, own[name])  # the pattern's default, recorded as such
                    continue
                require(value is None, f"sparse: option {name!r} belongs to pattern={pattern}, not "
                                       f"pattern={self.pattern}; allowed for {self.pattern}: {', '.join(own)}")
        require(whole(self.block_size, 1),
                f"sparse: block_size must be an integer >= 1; got {self.block_size!r}")
        for name in own:
            value = getattr(self, name)
            if name == "seed":
                require_seed("sparse: seed", value)
                continue
            require(whole(value, MINIMUM[name]),
                    f"sparse: {name} must be an integer >= {MINIMUM[name]}; got {value!r}")
        if self.pattern == "fixed":
            require(self.summary_blocks <= self.local_blocks,
                    f"sparse: summary_blocks ({self.summary_blocks}) must be <= local_blocks ({self.local_blocks})")
        if self.pattern == "bigbird":
            require(self.window_blocks % 2 == 1,
                    f"sparse: window_blocks must be odd (a centred window); got {self.window_blocks}")


class Sparse(MaskedAttention):
    name = "sparse"
    Options = SparseOptions

    def layout(self, seq_len: int, causal: bool) -> Tensor:
        o = self.options
        nb = num_blocks(seq_len, self.engine_block_size(seq_len))
        if o.pattern == "fixed":
            return fixed_layout(nb, o.local_blocks, o.summary_blocks)
        if o.pattern == "strided":
            return strided_layout(nb, o.stride)
        return bigbird_layout(nb, o.window_blocks, o.global_blocks, o.random_blocks, o.seed, causal)

    def dense_rows(self, seq_len: int) -> int:
        return self.options.global_blocks if self.options.pattern == "bigbird" else 0
