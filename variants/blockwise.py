"""blockwise: exact attention by online softmax over key blocks, or block-local attention.

``exact`` (Rabe & Staats 2021; Blockwise Parallel Transformer, Liu & Abbeel 2023) computes the same
function as ``full`` one key block at a time, keeping a running max ``m``, running sum ``l`` and
unnormalised output. Its backward (as in FlashAttention-2) recomputes each block's probabilities from
the saved log-sum-exp instead of keeping them, so forward+backward peak memory is O(N·D) plus a few
tiles. It is the block-sparse engine (blocksparse.py) on the all-ones layout: every key block is shared
by all query rows, so each tile is one matmul over all (or a slice of) the queries; causal skips the
future blocks. Plain autograd through the same loop would keep every block's probabilities: O(N²).

``local`` (BlockBERT / LRA local attention) is block-diagonal: allowed(i, j) = (i // b == j // b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import require, whole
from .blocksparse import MaskedAttention
from .masks import Predicate, causal_pairs, local_layout, num_blocks

MODES = ("exact", "local")


@dataclass(frozen=True)
class BlockwiseOptions:
    mode: str = "exact"  # exact: equals full | local: block-diagonal
    block_size: int = 128  # query/key chunk length (exact) or the local block (local)
    backend: str | None = None  # exact: online | dense | flex ; local: blocksparse | dense | flex | xformers

    def __post_init__(self) -> None:
        require(self.mode in MODES, f"blockwise: unknown mode {self.mode!r}; allowed: {', '.join(MODES)}")
        require(whole(self.block_size, 1),
                f"blockwise: block_size must be an integer > 0; got {self.block_size!r}")


class Blockwise(MaskedAttention):
    name = "blockwise"
    Options = BlockwiseOptions
    backends = {"online": False, "blocksparse": False, "dense": False, "flex": True, "xformers": True}

    def backend_names(self) -> list[str]:
        return ["online", "dense", "flex"] if self.options.mode == "exact" else ["blocksparse", "dense", "flex", "xformers"]

    @property
    def is_exact(self) -> bool:
        return self.options.mode == "exact"

    # local: the shared block-sparse engine on the diagonal layout.
    def layout(self, seq_len: int, causal: bool) -> Tensor:
        nb = num_blocks(seq_len, self.engine_block_size(seq_len))
        return local_layout(nb) if self.options.mode == "local" else torch.ones(nb, nb, dtype=torch.bool)

    def layout_rule(self, seq_len: int) -> Predicate | None:
        if self.options.mode != "local":  # exact: every block (flex needs no element rule)
            return None
        b = self.engine_block_size(seq_len)
        return lambda i, j: i // b == j // b  # the diagonal blocks, as the contract states them

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        if self.options.mode == "exact":  # counted, not enumerated: the layout is every block
            return causal_pairs(seq_len, causal)
        return super().allowed_pairs(seq_len, causal)

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        if self.options.mode == "exact" and self.backend == "dense":
            return seq_len * seq_len  # counted: the engine's pair count would enumerate N² elements
        return super().executed_pairs(seq_len, causal, device)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        if backend == "online":  # the engine: its plan of the all-ones layout
            return super()._attend(q, k, v, causal, "blocksparse")
        if backend == "xformers":  # local only (backend_names)
            from .xformers_backend import block_local_attention

            return block_local_attention(q, k, v, self.options.block_size, causal, self.scale(q.shape[-1]))
        return super()._attend(q, k, v, causal, backend)

