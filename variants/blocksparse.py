"""The engine shared by every mask-defined variant: attention computed only on allowed key blocks.

Given a block layout (which key blocks each query block needs, causal future blocks already dropped)
and an optional element predicate for partial blocks, each query block gathers its K key blocks and
computes one (b × K·b) score tile; all query blocks at once, vectorised (no Python loop per block
pair). Memory and time are O(N · K · b) forward and, through autograd, backward: the saved tensors are
the gathered keys/values and the tile probabilities, never an N×N matrix.

Rows with many more blocks than the rest (global query rows of Longformer or BigBird) would force K
to nb for every row, so the leading ``dense_rows`` query blocks form their own group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Attention, dense_attention
from .masks import Predicate, causal_blocks, dense_mask, layout_predicate

FUSED_BACKENDS = ("flex", "xformers")  # GPU kernels that tile internally: no gathered blocks in memory
COUNT_CHUNK = 1 << 20  # elements of the largest temporary (int64 index tensors: 8 MiB each) when counting pairs


@dataclass(frozen=True)
class Group:
    rows: Tensor  # (R,) query block indices, a contiguous range
    kv_blocks: Tensor  # (R, K) key block indices per query block, allowed ones first, ascending
    kv_valid: Tensor  # (R, K) whether each gathered block is allowed (rows with fewer pad with False)


@dataclass(frozen=True)
class BlockPlan:
    seq_len: int
    block_size: int
    causal: bool
    groups: tuple[Group, ...]

    @staticmethod
    def build(layout: Tensor, seq_len: int, block_size: int, causal: bool, dense_rows: int = 0) -> "BlockPlan":
        """``layout``: (nb, nb) bool, causal already applied."""
        nb = layout.shape[0]
        groups = []
        for lo, hi in ((0, min(dense_rows, nb)), (min(dense_rows, nb), nb)):
            if hi <= lo:
                continue
            lay = layout[lo:hi]  # (R, nb)
            K = int(lay.sum(dim=1).max())
            order = torch.argsort(lay.to(torch.int8), dim=1, descending=True, stable=True)[:, :K]
            groups.append(Group(torch.arange(lo, hi), order, lay.gather(1, order)))
        return BlockPlan(seq_len, block_size, causal, tuple(groups))

    def element_mask(self, group: Group, allowed: Predicate | None, device: torch.device) -> Tensor:
        """(R, b, K·b) bool: which gathered scores are used. Padded query rows (i ≥ N) see every real key,
        so their softmax stays finite (their outputs are dropped; NaN there would poison dk, dv)."""
        b, N = self.block_size, self.seq_len
        ar = torch.arange(b, device=device)
        rows, kv, valid = (t.to(device) for t in (group.rows, group.kv_blocks, group.kv_valid))
        i = (rows[:, None] * b + ar)[:, :, None]  # (R, b, 1)
        j = (kv[:, :, None] * b + ar).flatten(1)[:, None, :]  # (R, 1, K·b)
        m = valid.repeat_interleave(b, dim=1)[:, None, :] & (j < N)  # (R, 1, K·b)
        if self.causal:
            m = m & (j <= i)
        if allowed is not None:
            m = m & allowed(i, j)
        return torch.where(i < N, m, valid.repeat_interleave(b, dim=1)[:, None, :] & (j < N))

    def pair_counts(self, allowed: Predicate | None) -> tuple[int, int]:
        """(allowed pairs, executed pairs) per (batch, head). Counted a few query blocks at a time, so
        no temporary exceeds COUNT_CHUNK elements whatever N is (it runs before the memory budget check:
        sparse fixed at N=65536 would otherwise build a 1e9-element mask)."""
        useful = executed = 0
        b, N = self.block_size, self.seq_len
        for g in self.groups:
            executed += g.kv_blocks.numel() * b * b
            if allowed is None:  # whole blocks: sizes times sizes, a triangle on the causal diagonal
                size = (N - torch.arange(-(-N // b)) * b).clamp(max=b)  # (nb,) the last block is shorter
                r, c = size[g.rows][:, None], size[g.kv_blocks]  # (R, 1), (R, K)
                diagonal = self.causal & (g.kv_blocks == g.rows[:, None])
                useful += int(torch.where(diagonal, r * (r + 1) // 2, r * c)[g.kv_valid].sum())
                continue
            step = max(1, COUNT_CHUNK // (b * b * g.kv_blocks.shape[1]))
            for lo in range(0, len(g.rows), step):
                part = Group(g.rows[lo:lo + step], g.kv_blocks[lo:lo + step], g.kv_valid[lo:lo + step])
                m = self.element_mask(part, allowed, torch.device("cpu"))  # (r, b, K·b)
                i = (part.rows[:, None] * b + torch.arange(b))[:, :, None]
                useful += int((m & (i < N)).sum())
        return useful, executed

    def num_computed_blocks(self) -> int:
        return sum(g.kv_blocks.numel() for g in self.groups)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, allowed: Predicate | None,
                           scale: float) -> Tensor:
    B, H, N, D = q.shape
    b = plan.block_size
    pad = -N % b
    # (B, H, nb, b, D): pad the ragged last block; padded keys are masked, padded queries dropped.
    qb, kb, vb = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, b)) for t in (q, k, v))
    outs = []
    for g in plan.groups:
        kv = g.kv_blocks.to(q.device)
        kg = kb[:, :, kv].flatten(3, 4)  # (B, H, R, K·b, D)
        vg = vb[:, :, kv].flatten(3, 4)  # (B, H, R, K·b, D)
        s = (qb[:, :, g.rows[0]:g.rows[-1] + 1] @ kg.transpose(-2, -1)) * scale  # (B, H, R, b, K·b)
        s = s.masked_fill(~plan.element_mask(g, allowed, q.device), float("-inf"))
        outs.append(s.softmax(dim=-1) @ vg)  # (B, H, R, b, D)
    return torch.cat(outs, dim=2).flatten(2, 3)[:, :, :N]  # (B, H, N, D)


class MaskedAttention(Attention):
    """Base of the mask-defined variants (blockwise local, sliding_window, sparse).

    A subclass says which key blocks each query block needs (``layout``) and, where blocks are only
    partly allowed, the element predicate; this class turns them into the dense mask, the block plan,
    pair counts and the two CPU backends: ``blocksparse`` (the engine) and ``dense`` (the mask path).
    """

    # flex: FlexAttention from the element predicate (GPU: it has no CPU backward; see flex.py).
    backends = {"blocksparse": False, "dense": False, "flex": True}

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._plans: dict[tuple[int, bool], BlockPlan] = {}
        self._counts: dict[tuple[int, bool], tuple[int, int]] = {}

    # What a subclass defines ------------------------------------------------------------------------
    def engine_block_size(self, seq_len: int) -> int:
        raise NotImplementedError

    def layout(self, seq_len: int, causal: bool) -> Tensor:
        """(nb, nb) bool at ``engine_block_size``: key blocks holding any allowed pair (causal not applied)."""
        raise NotImplementedError

    def predicate(self, seq_len: int, causal: bool) -> Predicate | None:
        """Element predicate, or None when every pair of an allowed block is allowed."""
        return None

    def dense_rows(self, seq_len: int) -> int:
        """Leading query blocks that see (almost) every key: computed as their own group."""
        return 0

    # What follows from it ---------------------------------------------------------------------------
    def plan(self, seq_len: int, causal: bool) -> BlockPlan:
        key = (seq_len, causal)
        if key not in self._plans:
            lay = self.layout(seq_len, causal)
            lay = causal_blocks(lay) if causal else lay
            self._plans[key] = BlockPlan.build(lay, seq_len, self.engine_block_size(seq_len), causal,
                                               self.dense_rows(seq_len))
        return self._plans[key]

    def element_predicate(self, seq_len: int, causal: bool) -> Predicate:
        pred = self.predicate(seq_len, causal)
        if pred is None:
            pred = layout_predicate(self.layout(seq_len, causal), self.engine_block_size(seq_len))
        return pred

    def mask(self, seq_len: int, causal: bool = False) -> Tensor:
        return dense_mask(self.element_predicate(seq_len, causal), seq_len, causal)

    def pair_counts(self, seq_len: int, causal: bool) -> tuple[int, int]:
        """(allowed, executed by the block-sparse engine) pairs per (batch, head)."""
        key = (seq_len, causal)
        if key not in self._counts:
            self._counts[key] = self.plan(seq_len, causal).pair_counts(self.predicate(seq_len, causal))
        return self._counts[key]

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return self.pair_counts(seq_len, causal)[0]

    def executed_pairs(self, seq_len: int, causal: bool = False) -> int:
        if self.backend == "dense":
            return seq_len * seq_len
        if self.backend in FUSED_BACKENDS:
            # Counted on the allowed pairs, as for fused SDPA kernels (FlashAttention's convention);
            # the harness replaces flex's figure with its BlockMask's computed tiles after measuring.
            return self.allowed_pairs(seq_len, causal)
        return self.pair_counts(seq_len, causal)[1]

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False) -> int:
        if self.backend in FUSED_BACKENDS:
            return element_size * B * H * 8 * N * D  # fused kernels: O(N·D), as full's fused backends
        if self.backend == "dense":
            return super().memory_bytes(B, H, N, D, element_size, causal)
        # Score tiles (scores, probabilities, their gradient) and the gathered keys and values with
        # their gradients: executed pairs / b keys of D elements per query block row.
        pairs = self.executed_pairs(N, causal)
        gathered = pairs * D // self.engine_block_size(N)
        return element_size * B * H * (3 * pairs + 4 * gathered + 6 * N * D)

    def block_density(self, seq_len: int, causal: bool = False) -> float:
        """Computed key blocks over all nb² blocks (the block-sparse layout's density)."""
        plan = self.plan(seq_len, causal)
        nb = -(-seq_len // plan.block_size)
        return sum(int(g.kv_valid.sum()) for g in plan.groups) / nb**2

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        N, scale = q.shape[-2], self.scale(q.shape[-1])
        if backend == "dense":
            return dense_attention(q, k, v, self.mask(N, causal).to(q.device), scale)
        if backend == "flex":
            from .flex import flex_forward

            return flex_forward(self, q, k, v, causal)
        return block_sparse_attention(q, k, v, self.plan(N, causal), self.predicate(N, causal), scale)
