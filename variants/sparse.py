"""sparse: block-sparse layouts: Sparse Transformer fixed and strided, and BigBird.

Every pattern is a block layout over I = i // b, J = j // b (see ../shared/docs/variants.md):
- fixed:   (I // L == J // L) or (J mod L ≥ L − c)
- strided: (|I − J| < s) or ((I − J) mod s == 0)
- bigbird: (|I − J| ≤ (w−1)/2) or I < g or J < g or J ∈ R(I), R(I) seeded, min(r, available) blocks
The efficient path computes only allowed blocks: O(N·b·blocks-per-row).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import require
from .blocksparse import MaskedAttention
from .masks import bigbird_layout, fixed_layout, num_blocks, strided_layout

PATTERNS = ("fixed", "strided", "bigbird")


@dataclass(frozen=True)
class SparseOptions:
    pattern: str = "fixed"  # fixed | strided | bigbird
    block_size: int = 64  # b
    local_blocks: int = 4  # fixed: L, blocks per chunk
    summary_blocks: int = 1  # fixed: c ≤ L, the last c blocks of each chunk are seen by all
    stride: int = 4  # strided: s, in blocks
    window_blocks: int = 3  # bigbird: w, odd
    global_blocks: int = 1  # bigbird: g
    random_blocks: int = 2  # bigbird: r
    seed: int = 0  # bigbird: seeds the random blocks; same seed and N give the same layout everywhere
    backend: str | None = None  # blocksparse | dense

    def __post_init__(self) -> None:
        require(self.pattern in PATTERNS,
                f"sparse: unknown pattern {self.pattern!r}; allowed: {', '.join(PATTERNS)}")
        for name, minimum in (("block_size", 1), ("local_blocks", 1), ("summary_blocks", 0), ("stride", 1),
                              ("window_blocks", 1), ("global_blocks", 0), ("random_blocks", 0), ("seed", 0)):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= minimum,
                    f"sparse: {name} must be an integer >= {minimum}; got {value!r}")
        require(self.summary_blocks <= self.local_blocks,
                f"sparse: summary_blocks ({self.summary_blocks}) must be <= local_blocks ({self.local_blocks})")
        require(self.window_blocks % 2 == 1,
                f"sparse: window_blocks must be odd (a centred window); got {self.window_blocks}")


class Sparse(MaskedAttention):
    name = "sparse"
    Options = SparseOptions

    def engine_block_size(self, seq_len: int) -> int:
        return self.options.block_size

    def layout(self, seq_len: int, causal: bool) -> Tensor:
        o = self.options
        nb = num_blocks(seq_len, o.block_size)
        if o.pattern == "fixed":
            return fixed_layout(nb, o.local_blocks, o.summary_blocks)
        if o.pattern == "strided":
            return strided_layout(nb, o.stride)
        return bigbird_layout(nb, o.window_blocks, o.global_blocks, o.random_blocks, o.seed, causal)

    def dense_rows(self, seq_len: int) -> int:
        return self.options.global_blocks if self.options.pattern == "bigbird" else 0
