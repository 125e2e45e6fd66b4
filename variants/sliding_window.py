"""sliding_window: Longformer-style local attention with dilation and global tokens.

allowed(i, j) = (|i − j| ≤ w·d and (i − j) mod d == 0) or i < g or j < g

``window`` is one-sided: a non-causal query sees up to 2w+1 local keys, a causal one w+1. Longformer's
"attention window 512" is ``window=256``. The first g positions are global (symmetric, shared
projections). The efficient path runs the block-sparse engine on the band of blocks within w of the
diagonal plus the global blocks: O(N·(w + g)) time and memory, never an N×N tensor. With dilation d the
engine (and flex) run the positions in another order (``engine_order``): the global ones, then each residue class
mod d in turn, in which a query's local keys are its w neighbours on either side, so the band it computes
is w wide, not w·d (every d-th key of a w·d band).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import require, whole
from .blocksparse import MaskedAttention
from .masks import Predicate, num_blocks, sliding_window, window_layout
from .xformers_backend import check_sliding_window


def _nonneg_int(name: str, value, minimum: int) -> None:
    require(whole(value, minimum),
            f"sliding_window: {name} must be an integer >= {minimum}; got {value!r}")


@dataclass(frozen=True)
class SlidingWindowOptions:
    window: int = 256  # w, one-sided: keys i−w·d … i+w·d (Longformer's "window 512" is 256)
    dilation: int = 1  # d: every d-th key inside the window
    global_tokens: int = 0  # g: the first g positions attend to and are attended by all
    backend: str | None = None  # blocksparse | dense | flex | xformers (dilation 1, no global tokens)

    def __post_init__(self) -> None:
        _nonneg_int("window", self.window, 0)
        _nonneg_int("dilation", self.dilation, 1)
        _nonneg_int("global_tokens", self.global_tokens, 0)
        if self.backend == "xformers":
            check_sliding_window(self.window, self.dilation, self.global_tokens)


class SlidingWindow(MaskedAttention):
    name = "sliding_window"
    Options = SlidingWindowOptions
    backends = {**MaskedAttention.backends, "xformers": True}
    # Each row computes at most the band's 2w·d + 1 keys (global rows: N, for g of them), so the engine
    # keeps the probability tiles for the backward, O(N·(w·d + g)) as Longformer's own memory, instead of
    # recomputing them: one matmul of five and the mask and exp passes spared in the backward.
    save_probabilities = True

    def backend_names(self) -> list[str]:
        # xformers' local bias is a plain band: offered only where the pattern is one.
        o = self.options
        plain_band = o.dilation == 1 and o.global_tokens == 0
        return [b for b in self.backends if b != "xformers" or plain_band]

    @property
    def is_exact(self) -> bool:
        return False

    def engine_block_size(self, seq_len: int) -> int:
        # Small blocks waste less of the band's corners; 64 keeps the tile matmuls efficient. The engine's
        # band is w wide (engine_order), whatever the dilation.
        return 64 if self.options.window >= 32 else 16

    def layout(self, seq_len: int, causal: bool) -> Tensor:
        o = self.options
        b = self.engine_block_size(seq_len)
        return window_layout(num_blocks(seq_len, b), b, o.window, o.dilation, o.global_tokens)

    def engine_order(self, seq_len: int) -> Tensor | None:
        """With dilation d > 1: the g global positions, then positions i ≥ g by (i mod d, i). Allowed local
        pairs are one class apart by multiples of d, so in this order they are at most w apart, and their
        order is kept (causality holds as j ≤ i in either order; global pairs keep it too)."""
        d, g = self.options.dilation, min(self.options.global_tokens, seq_len)
        if d == 1:
            return None
        i = torch.arange(g, seq_len)  # asked where it is kept: the plan, the BlockMask, in_engine_order's copies
        return torch.cat([torch.arange(g), i[torch.argsort((i % d) * seq_len + i)]])

    def engine_layout(self, seq_len: int, causal: bool) -> Tensor:
        o = self.options
        b = self.engine_block_size(seq_len)
        return window_layout(num_blocks(seq_len, b), b, o.window, 1, o.global_tokens)  # a w band in engine order

    def predicate(self, seq_len: int, causal: bool) -> Predicate:
        o = self.options
        return sliding_window(o.window, o.dilation, o.global_tokens)

    def dense_rows(self, seq_len: int) -> int:
        # Query blocks holding global rows see every key: their own group, so others keep K small.
        return -(-self.options.global_tokens // self.engine_block_size(seq_len))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        if backend == "xformers":
            from . import xformers_backend as xf

            o = self.options
            xf.check_sliding_window(o.window, o.dilation, o.global_tokens)
            xf.check_window_dtype(q.dtype)
            return xf.attention(q, k, v, xf.sliding_window_bias(o.window, q.shape[-2], causal), self.scale(q.shape[-1]))
        return super()._attend(q, k, v, causal, backend)
