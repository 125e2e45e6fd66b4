"""Attention patterns as pure functions: element predicates ``allowed(i, j)`` and block layouts.

Written once, used three ways: the dense mask (test oracle, plots), the block layout that tells the
block-sparse engine which key blocks each query block needs, and (on GPU) FlexAttention's mask_mod.
Every predicate broadcasts over index tensors and excludes causality: callers add ``causal_allowed``,
the one causal rule (element level, and through ``causal_blocks`` block level).
Conventions follow docs/variants.md: windows are one-sided, blocks are I = i // b.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

Predicate = Callable[[Tensor, Tensor], Tensor]  # (i, j) broadcastable int tensors -> bool tensor


def causal_allowed(i: Tensor | int, j: Tensor | int) -> Tensor | bool:
    """The causal rule: query i may use key j only if j ≤ i. A decoder predicts position i + 1 from
    positions ≤ i, so no query may see a key after itself. On index tensors (broadcast) or plain ints;
    on block indices it is the block rule (``causal_blocks``)."""
    return j <= i


def causal_pairs(seq_len: int, causal: bool) -> int:
    """Pairs (i, j) of N positions the causal rule allows: N(N + 1)/2 (j ≤ i), or all N² without it."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def reordered(pred: Predicate, order: Tensor) -> Predicate:
    """``pred`` on positions taken in ``order`` (a kernel's position p is position order[p]):
    allowed(order[p], order[p']). Indices past N (a kernel's padded last tile) read as position N, never
    out of bounds. ``order`` lives where the predicate runs (FlexAttention: on the inputs' device)."""
    n = len(order)
    extended = torch.cat([order, order.new_tensor([n])])

    def allowed(i: Tensor, j: Tensor) -> Tensor:
        return pred(extended[i.clamp(max=n)], extended[j.clamp(max=n)])

    return allowed


def sliding_window(window: int, dilation: int = 1, global_tokens: int = 0) -> Predicate:
    """Longformer: |i − j| ≤ w·d and (i − j) mod d == 0, or either position among the first g."""

    # w·d capped at int64's largest: past it the comparison with an index tensor overflowed (w = 10^18,
    # d = 10 allowed no pair at all, not every d-th key), and no distance between positions comes near it.
    reach = min(window * dilation, 2**63 - 1)

    # Terms that allow everything or nothing (d = 1, g = 0) are left out: FlexAttention's kernel evaluates
    # the predicate on every element of its partial tiles.
    def allowed(i: Tensor, j: Tensor) -> Tensor:
        dist = i - j
        local = dist.abs() <= reach
        if dilation > 1:
            local = local & (dist % dilation == 0)
        if global_tokens > 0:
            local = local | (i < global_tokens) | (j < global_tokens)
        return local

    return allowed


def layout_predicate(layout: Tensor, block_size: int) -> Predicate:
    """Element predicate of a block layout: allowed(i, j) = layout[i // b, j // b]."""

    def allowed(i: Tensor, j: Tensor) -> Tensor:
        lay = layout.to(i.device)
        return lay[i // block_size, j // block_size]

    return allowed


def dense_mask(allowed: Predicate, seq_len: int, causal: bool) -> Tensor:
    """(N, N) bool: the predicate on the full grid. O(N²): for tests and pictures only."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    m = allowed(i, j)
    return m & causal_allowed(i, j) if causal else m


def num_blocks(seq_len: int, block_size: int) -> int:
    return math.ceil(seq_len / block_size)


def _block_grid(nb: int) -> tuple[Tensor, Tensor]:
    return torch.arange(nb)[:, None], torch.arange(nb)[None, :]  # I (nb, 1), J (1, nb)


def causal_blocks(layout: Tensor) -> Tensor:
    """Drops key blocks entirely in the future: they are skipped, not masked. The causal rule on block
    indices: with one block size for queries and keys, block J holds a key j ≤ i of some query i of
    block I exactly when J ≤ I (and the diagonal block J = I is the only partly allowed one)."""
    I, J = _block_grid(layout.shape[0])
    return layout & causal_allowed(I, J)


def window_layout(nb: int, block_size: int, window: int, dilation: int, global_tokens: int) -> Tensor:
    """Key blocks holding at least one pair within the window (ignoring the dilation residue, which the
    element predicate applies) or a global position."""
    I, J = _block_grid(nb)
    # Closest pair of blocks |I−J| apart is (|I−J|−1)·b + 1 positions apart.
    reach = math.ceil(window * dilation / block_size)
    g = math.ceil(global_tokens / block_size)
    return ((I - J).abs() <= reach) | (I < g) | (J < g)


def local_layout(nb: int) -> Tensor:
    """Block-diagonal (BlockBERT / LRA local attention): allowed = (I == J)."""
    return torch.eye(nb, dtype=torch.bool)


def fixed_layout(nb: int, local_blocks: int, summary_blocks: int) -> Tensor:
    """Sparse Transformer "fixed", bidirectional block form (DeepSpeed FixedSparsityConfig)."""
    I, J = _block_grid(nb)
    L, c = local_blocks, summary_blocks
    return (I // L == J // L) | (J % L >= L - c)


def strided_layout(nb: int, stride: int) -> Tensor:
    """Sparse Transformer "strided": |I − J| < s or (I − J) mod s == 0."""
    I, J = _block_grid(nb)
    return ((I - J).abs() < stride) | ((I - J) % stride == 0)


def bigbird_layout(nb: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int,
                   causal: bool) -> Tensor:
    """BigBird: window, global and, per row, min(r, available) random blocks drawn from those not
    already allowed (J ≤ I under causal) by a CPU generator seeded with ``seed``, so the layout is the
    same on every run and device."""
    I, J = _block_grid(nb)
    base = ((I - J).abs() <= (window_blocks - 1) // 2) | (I < global_blocks) | (J < global_blocks)
    candidates = ~base & causal_allowed(I, J) if causal else ~base
    if random_blocks == 0:
        return base
    # One uniform key per (I, J) from the seeded generator; each row takes its r largest among the
    # candidates. Vectorised, and equal to drawing r distinct candidates uniformly without replacement.
    keys = torch.rand(nb, nb, generator=torch.Generator().manual_seed(seed))
    keys = keys.masked_fill(~candidates, -1.0)
    top = keys.topk(min(random_blocks, nb), dim=1)
    chosen = torch.zeros(nb, nb, dtype=torch.bool)
    chosen.scatter_(1, top.indices, top.values >= 0)
    return base | chosen
