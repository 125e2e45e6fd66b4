"""The engine shared by every mask-defined variant: attention computed only on allowed key blocks.

Given a block layout (which key blocks each query block needs, causal future blocks already dropped)
and an optional element predicate for partly allowed blocks, the engine runs FlashAttention's
algorithm over the allowed blocks, vectorised over query blocks (no Python loop per block pair):

- A *plan* (built once per length and causal flag) puts each query block's key blocks in slots and
  cuts the slots into chunks of about ``TILE_KEYS`` keys. A chunk whose slots hold the same key blocks
  for every query block (exact attention, global and summary columns) is *shared*: its keys are read
  once and multiplied with all its query rows in one matmul. Otherwise each query block gathers its
  own key blocks. Partly allowed block pairs get an element mask from a small table of distinct
  (b × b) patterns (a band has a handful), so no mask is rebuilt per call.
  A tile is sized per device type (``tile_elements``): cache-sized on CPU, launch-amortising on a GPU.
- The forward keeps a running max and sum per row (online softmax) and saves only the output and the
  log-sum-exp; the backward recomputes each tile's probabilities from them (FlashAttention-2's
  backward). A variant whose rows see a bounded number of keys (a band) may keep the probability tiles
  instead (``save_probabilities``): memory O(N·band), the backward spared the recomputation. A tile's
  scores hold at most ``tile_elements(device)`` elements, and so do a gathered chunk's copies of its keys and
  values together (query rows are split to fit); no two tiles are alive at once. Peak memory is O(N·D)
  plus a few tiles, forward and backward, whatever the number of key blocks per row; time follows the
  computed blocks.
- Scores are in base 2 (FlashAttention-3's exp2): the softmax scale times log2(e) is folded into each
  chunk's keys, the queries are used as they are (no scaled copy of Q), and the exponentials are exp2,
  which torch computed about 3x faster than exp on the AMD EPYC we measured (on an AVX512 Xeon exp is
  the faster, and the base moved the engine's time by about 1%); the gradients are brought back to base e.

Rows with many more blocks than the rest (global query rows of Longformer or BigBird) would make every
row's slot list long, so the leading ``dense_rows`` query blocks are planned as their own group.
``blockwise`` exact is this engine on the all-ones layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Attention, dense_attention, resolved
from .flex import BlockMasks, block_mask_stats
from .masks import Predicate, causal_allowed, causal_blocks, dense_mask, layout_predicate, reordered

FUSED_BACKENDS = ("flex", "xformers")  # GPU kernels that tile internally: no gathered blocks in memory
TILE_KEYS = 128  # keys per chunk (rounded to whole blocks): small tiles stay in cache between passes
TILE_ELEMENTS = 1 << 19  # most elements in a tile's scores, and in its gathered keys and values together
# On a GPU a tile costs about thirty kernel launches whatever its size, and CPU-sized tiles left the engine
# launch-bound: 1268 tiles for sliding_window at N=16384 (B=16, H=8) took 1.07 s forward+backward on an
# H100, FlexAttention 5.4 ms. A GPU tile of 2^26 float32 scores (256 MiB; the loop holds about four such
# tensors) is still a constant beside O(N·D), and far larger than the launches it amortises.
CUDA_TILE_ELEMENTS = 1 << 26
PATTERN_BATCH = 256  # block pairs whose element masks are evaluated at once when planning (≤ 1M elements for b=64)
ALLOWED, EMPTY = 0, 1  # pattern ids of a wholly allowed and a wholly masked block pair
LOG2E = math.log2(math.e)  # scores in base 2: exp2 cost a third of exp per element in torch on the EPYC


@dataclass(frozen=True)
class Chunk:
    rows: tuple[int, int]  # query blocks [r0, r1) that have an allowed pair among this chunk's slots
    keys: Tensor  # (c,) key blocks shared by every row, or (r1 - r0, c) per query block
    masked: tuple[int, int] | None  # query blocks [a, b) ⊆ rows with a partly allowed pair; None: none
    pattern: Tensor | None  # (b - a, c) ids into BlockPlan.patterns for the masked rows
    first: bool  # no earlier chunk touched these rows: the online softmax starts here
    start: int | None  # shared keys that are consecutive blocks start here (read as a view, not gathered)

    @property
    def shared(self) -> bool:
        return self.keys.dim() == 1


@dataclass(frozen=True)
class BlockPlan:
    seq_len: int
    block_size: int
    causal: bool
    chunks: tuple[Chunk, ...]
    patterns: Tensor  # (P, b, b) bool, True where a score is masked; [ALLOWED] none, [EMPTY] all
    allowed_pairs: int  # pairs (i, j) the engine lets through, per (batch, head)
    computed_blocks: int  # block pairs the engine multiplies (allowed or not), per (batch, head)
    layout_blocks: int  # block pairs of the layout (holding an allowed pair)
    _on: dict = field(default_factory=dict, compare=False, repr=False)  # device -> (chunks, patterns)

    @staticmethod
    def build(layout: Tensor, seq_len: int, block_size: int, causal: bool, dense_rows: int = 0,
              allowed: Predicate | None = None) -> "BlockPlan":
        """``layout``: (nb, nb) bool, causal already applied; ``allowed``: the element predicate, or None
        when every pair of an allowed block is allowed (then only edge and diagonal blocks get a mask)."""
        nb, b = layout.shape[0], block_size
        c = max(1, TILE_KEYS // b)
        table = Patterns(seq_len, b, causal, allowed)
        chunks, allowed_pairs, computed = [], 0, 0
        for lo, hi in ((0, min(dense_rows, nb)), (min(dense_rows, nb), nb)):
            if hi <= lo:
                continue
            kv = _slots(layout[lo:hi])  # (R, K), -1 where a row has fewer blocks
            ids = table.ids(torch.arange(lo, hi)[:, None].expand_as(kv), kv)  # (R, K)
            allowed_pairs += table.count(ids)
            for k0 in range(0, kv.shape[1], c):
                kc, ic = kv[:, k0:k0 + c], ids[:, k0:k0 + c]
                used = (kc >= 0).any(dim=1).nonzero().flatten()
                r0, r1 = int(used[0]), int(used[-1]) + 1
                kc, ic = kc[r0:r1], ic[r0:r1]
                column = kc.clamp(min=0).amax(dim=0)  # (c,) each slot's block where it is constant
                keys = column if bool(((kc == column) | (kc < 0)).all()) else kc.clamp(min=0)
                partial = (ic != ALLOWED).any(dim=1).nonzero().flatten()
                masked = None if len(partial) == 0 else (int(partial[0]), int(partial[-1]) + 1)
                pattern = None if masked is None else ic[masked[0]:masked[1]].contiguous()
                start = int(keys[0]) if keys.dim() == 1 and bool((keys.diff() == 1).all()) else None
                chunks.append(Chunk((lo + r0, lo + r1), keys, masked, pattern, k0 == 0, start))
                computed += (r1 - r0) * kc.shape[1]
        return BlockPlan(seq_len, b, causal, tuple(chunks), table.tensor(), allowed_pairs, computed,
                         int(layout.sum()))

    def on(self, device: torch.device) -> tuple[tuple[Chunk, ...], Tensor]:
        """The plan's tensors on ``device`` (copied once per device)."""
        if device not in self._on:
            move = lambda t: None if t is None else t.to(device)  # noqa: E731
            self._on[device] = (tuple(Chunk(ch.rows, move(ch.keys), ch.masked, move(ch.pattern), ch.first, ch.start)
                                      for ch in self.chunks), self.patterns.to(device))
        return self._on[device]


def _slots(layout: Tensor) -> Tensor:
    """(R, K) key block per slot of each query block, -1 where a row has fewer. Blocks allowed for at
    least half the rows come first, each in the same slot for every row, so their chunks are shared; each
    row's other blocks follow ascending (under causal, block J is then the same slot for every row ≥ J)."""
    R = layout.shape[0]
    common = layout.sum(dim=0) * 2 >= R  # (nb,)
    kv_common = torch.where(layout[:, common], common.nonzero().flatten()[None, :], -1)  # (R, n_common)
    own = layout & ~common
    order = torch.argsort(own.to(torch.int8), dim=1, descending=True, stable=True)[:, :int(own.sum(dim=1).max())]
    kv_own = torch.where(own.gather(1, order), order, -1)  # (R, K_own) allowed ones first, ascending
    return torch.cat([kv_common, kv_own], dim=1)


class Patterns:
    """Distinct element masks of block pairs, so a call gathers (b × b) patterns instead of evaluating
    the predicate on every score. A pair's pattern: allowed(i, j), j ≤ i under causal, i, j < N."""

    def __init__(self, seq_len: int, block_size: int, causal: bool, allowed: Predicate | None) -> None:
        self.N, self.b, self.causal, self.allowed = seq_len, block_size, causal, allowed
        b = block_size
        self.masks = [torch.zeros(b, b, dtype=torch.bool), torch.ones(b, b, dtype=torch.bool)]
        self.index = {np.packbits(m.numpy()).tobytes(): i for i, m in enumerate(self.masks)}

    def ids(self, I: Tensor, J: Tensor) -> Tensor:
        """(R, K) pattern id of each block pair; J = -1 (no block) is EMPTY."""
        N, b = self.N, self.b
        ids = torch.where(J >= 0, ALLOWED, EMPTY)
        special = J >= 0
        # Whole blocks: only the ragged last block and, under the causal rule on blocks (causal_blocks),
        # the diagonal ones are partly allowed.
        if self.allowed is None:
            last = (N - 1) // b
            edge = (I == last) | (J == last) if N % b else torch.zeros_like(special)
            special &= edge | ((J == I) if self.causal else torch.zeros_like(special))
        where = special.nonzero()  # (M, 2)
        ar = torch.arange(b)
        for lo in range(0, len(where), PATTERN_BATCH):
            rc = where[lo:lo + PATTERN_BATCH]
            i = (I[rc[:, 0], rc[:, 1]][:, None] * b + ar)[:, :, None]  # (m, b, 1)
            j = (J[rc[:, 0], rc[:, 1]][:, None] * b + ar)[:, None, :]  # (m, 1, b)
            ok = (i < N) & (j < N)
            if self.causal:
                ok = ok & causal_allowed(i, j)
            if self.allowed is not None:
                ok = ok & self.allowed(i, j)
            packed = np.packbits((~ok).reshape(len(rc), -1).numpy(), axis=1)
            found = [self.index.setdefault(p.tobytes(), len(self.index)) for p in packed]
            for n, m in enumerate(found):
                if m == len(self.masks):
                    self.masks.append(~ok[n])
            ids[rc[:, 0], rc[:, 1]] = torch.tensor(found, dtype=ids.dtype)
        return ids

    def count(self, ids: Tensor) -> int:
        """Allowed pairs in the block pairs ``ids``."""
        per_pattern = torch.tensor([int((~m).sum()) for m in self.masks])
        return int(per_pattern[ids].sum())

    def tensor(self) -> Tensor:
        return torch.stack(self.masks)


class BlockSparseAttention(torch.autograd.Function):
    """softmax over the plan's allowed pairs, FlashAttention-style: O(N·D) saved, tiles recomputed."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float, save_probs: bool) -> Tensor:
        B, H, N, D = q.shape
        # save_probs: keep each tile's probabilities (under the max of their tile) for the backward instead
        # of recomputing them: O(computed pairs) memory, worth it only where that is O(N·window).
        saved: list[tuple[Tensor, Tensor]] | None = [] if save_probs and any(ctx.needs_input_grad[:3]) else None
        acc = torch.promote_types(q.dtype, torch.float32)  # half inputs accumulate in float32
        qb, kb, vb = (_blocks(t, plan.block_size, acc) for t in (q, k, v))  # views unless padded or cast
        chunks, patterns = plan.on(q.device)
        o = torch.zeros_like(qb)  # (B, H, nb, b, D) unnormalised output
        m = torch.full(qb.shape[:-1] + (1,), torch.finfo(acc).min, dtype=acc, device=q.device)  # running max (base 2)
        l = torch.zeros_like(m)  # running sum of 2^(s - m)
        for ch, p0, p1, kc, vc in _tiles(chunks, qb, kb, vb, scale * LOG2E, tile_elements(q.device)):
            s = _scores(qb, kc, ch, p0, p1, patterns)  # (B, H, r, b, C), log2(e)·q·k/√D
            m_tile = s.amax(dim=-1, keepdim=True)
            o_r, l_r, m_r = o[:, :, p0:p1], l[:, :, p0:p1], m[:, :, p0:p1]  # views: updated in place
            m_new = m_tile if ch.first else torch.maximum(m_r, m_tile)
            p = s.sub_(m_new).exp2_()
            if not ch.first:  # rescale what was summed under the old max
                alpha = (m_r - m_new).exp2_()
                o_r.mul_(alpha)
                l_r.mul_(alpha)
            l_r += p.sum(dim=-1, keepdim=True)
            _add_mul(o_r, p, vc)  # o += P V
            m_r.copy_(m_new)
            if saved is not None:
                saved.append((p, m_new))
            del s, p, kc, vc  # before the next tile is made: two tiles never coexist
        o /= l
        lse = m + l.log2()  # (B, H, nb, b, 1), base 2
        out = o.flatten(2, 3)[:, :, :N].to(q.dtype)
        out = out if out.is_contiguous() else out.contiguous()  # saved so: a saved view would keep o alive
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.probs = plan, scale, saved
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        N, b, acc = q.shape[-2], plan.block_size, lse.dtype
        qb, kb, vb, dob = (_blocks(t, b, acc) for t in (q, k, v, dout))
        delta = (dob * _blocks(out, b, acc)).sum(dim=-1, keepdim=True)  # (B, H, nb, b, 1) rowsum(dO ∘ O)
        chunks, patterns = plan.on(q.device)
        dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
        probs = iter(ctx.probs) if ctx.probs is not None else None
        for ch, p0, p1, kc, vc in _tiles(chunks, qb, kb, vb, scale * LOG2E, tile_elements(q.device)):
            if probs is None:  # recomputed
                p = _scores(qb, kc, ch, p0, p1, patterns).sub_(lse[:, :, p0:p1]).exp2_()
            else:  # saved under its tile's max: P = 2^(s − m) · 2^(m − lse)
                p_tile, m_tile = next(probs)
                p = p_tile * (m_tile - lse[:, :, p0:p1]).exp2_()
            do = dob[:, :, p0:p1]  # (B, H, r, b, D)
            _add_keys(dv, ch, p0, _mul_t(p, do, ch.shared))  # dV = Pᵀ dO
            ds = _mul_kt(do, vc).sub_(delta[:, :, p0:p1]).mul_(p)  # dS = P ∘ (dO Vᵀ − Δ)
            del p
            _add_mul(dq[:, :, p0:p1], ds, kc)  # dQ = dS K·scale·log2(e)
            _add_keys(dk, ch, p0, _mul_t(ds, qb[:, :, p0:p1], ch.shared))  # dK = dSᵀ Q
            del ds, kc, vc  # before the next tile is made: two tiles never coexist
        # dS is the gradient of the natural-base scores q·k·scale; the keys above carried scale·log2(e).
        dq /= LOG2E
        dk *= scale
        grads = (t.flatten(2, 3)[:, :, :N].to(x.dtype) for t, x in ((dq, q), (dk, k), (dv, v)))
        return (*(g if g.is_contiguous() else g.contiguous() for g in grads), None, None, None)


def _blocks(t: Tensor, b: int, dtype: torch.dtype) -> Tensor:
    """(B, H, N, D) -> (B, H, nb, b, D) in ``dtype``; the ragged last block padded with zeros (its pairs
    are masked). A view when nothing changes."""
    pad = -t.shape[-2] % b
    if t.dtype != dtype:
        t = t.to(dtype)
    if pad:
        t = F.pad(t, (0, 0, 0, pad))
    return t.unflatten(2, (-1, b))


def tile_elements(device: torch.device | str | None) -> int:
    """The most elements of a tile's scores (and of its gathered keys and values together) on ``device``
    (None: CPU)."""
    return CUDA_TILE_ELEMENTS if device is not None and torch.device(device).type == "cuda" else TILE_ELEMENTS


def _tiles(chunks, qb: Tensor, kb: Tensor, vb: Tensor, key_scale: float, tile: int):
    """Each chunk's keys (times ``key_scale``) and values, split over query blocks so that a tile's scores,
    and its gathered keys and values together, hold at most ``tile`` elements. Yields (chunk, p0, p1,
    keys, values): shared keys (B, H, C, D), gathered ones (B, H, p1 - p0, C, D). The keys carry the
    scale, not the queries: a chunk's keys are few (shared) or a copy already (gathered), where scaled
    queries would be one more (B, H, N, D) tensor."""
    B, H, nb, b, D = qb.shape
    for ch in chunks:
        r0, r1 = ch.rows
        step = rows_per_tile(ch, B * H, b, D, tile)
        if ch.shared:
            c = len(ch.keys)  # consecutive blocks are a view (decided when planning: no device sync here)
            kc, vc = ((t[:, :, ch.start:ch.start + c] if ch.start is not None else t.index_select(2, ch.keys))
                      .flatten(2, 3) for t in (kb, vb))  # (B, H, C, D)
            kc = kc * key_scale
        for p0 in range(r0, r1, step):
            p1 = min(p0 + step, r1)
            if ch.shared:
                yield ch, p0, p1, kc, vc
            else:  # gathered here, held by no name of this frame: freed as soon as the caller drops them
                yield ch, p0, p1, *_gather(kb, vb, ch.keys[p0 - r0:p1 - r0], key_scale)


def rows_per_tile(ch: Chunk, BH: int, b: int, D: int, tile: int) -> int:
    """Query blocks per tile: at most ``tile`` elements in the scores (r·b·C per batch and head) and, where
    gathered, in the copies of the keys and values together (2·r·C·D: twice the scores for D = b)."""
    C = ch.keys.shape[-1] * b
    return max(1, tile // (BH * C * (b if ch.shared else max(b, 2 * D))))


def largest_tile(plan: BlockPlan, BH: int, D: int, tile: int) -> tuple[int, int]:
    """Elements of the largest tile's scores and of the keys and values it copies (gathered, or shared
    ones scaled), over B·H = ``BH``: what one step of the loops below holds beside the accumulators."""
    b, scores, copied = plan.block_size, 0, 0
    for ch in plan.chunks:
        r, C = min(rows_per_tile(ch, BH, b, D, tile), ch.rows[1] - ch.rows[0]), ch.keys.shape[-1] * b
        scores = max(scores, BH * r * b * C)
        copied = max(copied, BH * C * D * (1 if ch.start is not None else 2) if ch.shared else 2 * BH * r * C * D)
    return scores, copied


def _gather(kb: Tensor, vb: Tensor, idx: Tensor, key_scale: float) -> tuple[Tensor, Tensor]:
    """Key blocks ``idx`` (r, c) of each query block: keys (times ``key_scale``) and values (B, H, r, C, D)."""
    kc, vc = (t.index_select(2, idx.flatten()).unflatten(2, idx.shape).flatten(3, 4) for t in (kb, vb))
    return kc.mul_(key_scale), vc


def _scores(qb: Tensor, kc: Tensor, ch: Chunk, p0: int, p1: int, patterns: Tensor) -> Tensor:
    """(B, H, r, b, C) scores of query blocks [p0, p1) against the chunk's keys, masked pairs at the
    lowest finite value (a row with no allowed key in this tile then adds nothing: exp(min − m) = 0)."""
    s = _mul_kt(qb[:, :, p0:p1], kc)
    if ch.masked is not None:
        a, z = max(ch.masked[0] + ch.rows[0], p0), min(ch.masked[1] + ch.rows[0], p1)
        if a < z:
            ids = ch.pattern[a - ch.rows[0] - ch.masked[0]:z - ch.rows[0] - ch.masked[0]]  # (r', c)
            b = qb.shape[3]
            mask = patterns[ids].transpose(1, 2)  # (r', b, c, b): query row, key block, key column
            s[:, :, a - p0:z - p0].view(*s.shape[:2], z - a, b, -1, b).masked_fill_(mask, torch.finfo(s.dtype).min)
    return s


def _mul_kt(x: Tensor, kc: Tensor) -> Tensor:
    """x (B, H, r, b, D) times keys transposed: (B, H, r, b, C)."""
    if kc.dim() == 4:  # shared: one matmul for every row of the tile
        return (x.flatten(2, 3) @ kc.transpose(-2, -1)).unflatten(2, x.shape[2:4])
    return x @ kc.transpose(-2, -1)


def _add_mul(out: Tensor, p: Tensor, x: Tensor) -> None:
    """out += p x: out (B, H, r, b, D), p (B, H, r, b, C), x shared (B, H, C, D) or gathered (B, H, r, C, D).
    In place (no temporary) where ``out`` is contiguous, i.e. the tile spans every query block: on a
    strided slice torch splits baddbmm_ into one matmul per batch, which costs more than the temporary."""
    if not out.is_contiguous():
        out += _mul(p, x)
        return
    rows = out.view(-1, *out.shape[-2:]) if x.dim() == 5 else out.view(-1, out.shape[2] * out.shape[3], out.shape[4])
    p = p.reshape(rows.shape[0], -1, p.shape[-1])
    rows.baddbmm_(p, x.reshape(rows.shape[0], *x.shape[-2:]))


def _mul(p: Tensor, x: Tensor) -> Tensor:
    """p (B, H, r, b, C) times keys or values x, shared (B, H, C, D) or gathered (B, H, r, C, D): (B, H, r, b, D)."""
    if x.dim() == 4:  # shared: one matmul for every row of the tile
        return (p.flatten(2, 3) @ x).unflatten(2, p.shape[2:4])
    return p @ x


def _mul_t(p: Tensor, x: Tensor, shared: bool) -> Tensor:
    """pᵀ x per tile: (B, H, C, D) summed over the rows for shared keys, else (B, H, r, C, D)."""
    if shared:
        return p.flatten(2, 3).transpose(-2, -1) @ x.flatten(2, 3)
    return p.transpose(-2, -1) @ x


def _add_keys(grad: Tensor, ch: Chunk, p0: int, part: Tensor) -> None:
    """Adds a tile's key (or value) gradient into ``grad`` (B, H, nb, b, D) at the chunk's key blocks."""
    b = grad.shape[3]
    if ch.shared:
        blocks = ch.keys
        part = part.unflatten(2, (-1, b))  # (B, H, c, b, D)
    else:
        r = part.shape[2]
        blocks = ch.keys[p0 - ch.rows[0]:p0 - ch.rows[0] + r].flatten()
        part = part.flatten(2, 3).unflatten(2, (-1, b))  # (B, H, r·c, b, D)
    grad.index_add_(2, blocks, part)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float,
                           save_probs: bool = False) -> Tensor:
    """(B, H, N, D) attention over the plan's allowed pairs; ``save_probs``: the backward reads the
    forward's probability tiles instead of recomputing them (memory O(computed pairs))."""
    return BlockSparseAttention.apply(q, k, v, plan, scale, save_probs)


class MaskedAttention(Attention):
    """Base of the mask-defined variants (blockwise, sliding_window, sparse).

    A subclass says which key blocks each query block needs (``layout``) and, where blocks are only
    partly allowed, the element predicate; this class turns them into the dense mask, the block plan,
    pair counts and the two CPU backends: ``blocksparse`` (the engine) and ``dense`` (the mask path).
    """

    # flex: FlexAttention from the element predicate (GPU: it has no CPU backward; see flex.py).
    backends = {"blocksparse": False, "dense": False, "flex": True}
    # The engine keeps the forward's probability tiles for the backward (no recomputation) when a variant
    # says so: only where the keys per row are bounded whatever N (a band), so that they cost O(N·window).
    save_probabilities: ClassVar[bool] = False

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._plans: dict[tuple[int, bool], BlockPlan] = {}
        self.block_masks = BlockMasks()  # the flex backend's, per (N, causal, device)
        # The dense backend's (N, N) mask on the device of the last call, (N, causal, device) -> mask: built
        # once, as a user of the mask path would (rebuilding it on the host per call is what a GPU timing
        # would measure); one kept, so a sweep over N does not pile up N² masks.
        self._dense_mask: tuple[tuple[int, bool, str], Tensor] | None = None

    # What a subclass defines ------------------------------------------------------------------------
    def engine_block_size(self, seq_len: int) -> int:
        """The block size the engine tiles with: the options' ``block_size`` (sparse, blockwise) unless a
        subclass chooses its own. A block past N is the whole sequence: one block of N rows, not b (padded
        to b, a call would cost b² per head, and its (b, b) patterns b² bytes: gigabytes for N=32 at b=10^5)."""
        return min(self.options.block_size, seq_len)

    def layout(self, seq_len: int, causal: bool) -> Tensor:
        """(nb, nb) bool at ``engine_block_size``: key blocks holding any allowed pair (causal not applied)."""
        raise NotImplementedError

    def predicate(self, seq_len: int, causal: bool) -> Predicate | None:
        """Element predicate, or None when every pair of an allowed block is allowed."""
        return None

    def layout_rule(self, seq_len: int) -> Predicate | None:
        """The layout as arithmetic on positions, allowed(i, j) from i and j alone, where it has such a
        closed form; None where only the table says (the flex backend then looks the layout up in a tensor).
        Why FlexAttention's mask_mod prefers it: on an H100 at N=16K, blockwise local with the lookup took
        1.13x the time of FlexAttention with ``q // b == kv // b``, in one process, on equal BlockMasks with
        no partial tile, where the mask_mod never runs. Our reading (not verified): a kernel's registers
        are allocated for its masked path whether or not a tile takes it, so a lookup there can cost
        occupancy in every tile, and most where each program computes one tile."""
        return None

    def dense_rows(self, seq_len: int) -> int:
        """Leading query blocks that see (almost) every key: planned as their own group."""
        return 0

    def engine_layout(self, seq_len: int, causal: bool) -> Tensor:
        """The layout in ``engine_order`` (causal not applied)."""
        return self.layout(seq_len, causal)

    # What follows from it ---------------------------------------------------------------------------
    def plan(self, seq_len: int, causal: bool) -> BlockPlan:
        key = (seq_len, causal)
        if key not in self._plans:
            order, pred = self.engine_order(seq_len), self.predicate(seq_len, causal)
            lay = self.layout(seq_len, causal) if order is None else self.engine_layout(seq_len, causal)
            if order is not None and pred is not None:  # engine positions p, p' are positions order[p], order[p']
                pred = reordered(pred, order)
            lay = causal_blocks(lay) if causal else lay
            self._plans[key] = BlockPlan.build(lay, seq_len, self.engine_block_size(seq_len), causal,
                                               self.dense_rows(seq_len), pred)
        return self._plans[key]

    def element_predicate(self, seq_len: int, causal: bool) -> Predicate:
        """The predicate, or the layout's rule where whole blocks are allowed."""
        pred = self.predicate(seq_len, causal)
        if pred is None:
            pred = layout_predicate(self.layout(seq_len, causal), self.engine_block_size(seq_len))
        return pred

    def mask(self, seq_len: int, causal: bool = False) -> Tensor:
        return dense_mask(self.element_predicate(seq_len, causal), seq_len, causal)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return self.plan(seq_len, causal).allowed_pairs

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        if self.backend == "dense":
            return seq_len * seq_len
        if self.backend == "flex" and device is not None:  # the tiles of its BlockMask on that device
            return block_mask_stats(self, seq_len, causal, device)["executed_pairs"]
        if self.backend in FUSED_BACKENDS:
            # Counted on the allowed pairs, as for fused SDPA kernels (FlashAttention's convention).
            return self.allowed_pairs(seq_len, causal)
        return self.plan(seq_len, causal).computed_blocks * self.engine_block_size(seq_len) ** 2

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        if self.backend in FUSED_BACKENDS:  # fused kernels: O(N·D), as full's fused backends
            return element_size * B * H * 8 * N * D + self.reordering_bytes(B, H, N, D, element_size)
        if self.backend == "dense":
            return super().memory_bytes(B, H, N, D, element_size, causal, device)
        # The backward's peak, O(N·D) plus one tile. a: the accumulators' element size (float32 at least).
        # Per (batch, head): the saved output and log-sum-exp, Δ, the accumulators dq, dk, dv over whole
        # blocks, and q, k, v, dO in blocks where they are cast or padded (views otherwise). Beside them,
        # the loop's tile (probabilities, dS, a bool mask tile; the keys and values it copies and a tile's
        # key gradient) or, at the end, the gradients cast back to the inputs' dtype.
        a, BH, b = max(element_size, 4), B * H, self.engine_block_size(N)
        Np = -(-N // b) * b
        copies = element_size != a or Np != N
        per_head = element_size * N * D + 2 * a * Np + 3 * a * Np * D + (4 * a * Np * D if copies else 0)
        scores, copied = largest_tile(self.plan(N, causal), BH, D, tile_elements(device))
        loop = a * (2 * scores + copied + copied // 2) + scores
        end = 3 * element_size * BH * N * D if copies else 0
        # The probability tiles, and each tile's row maxima beside them, (B, H, r, b, 1) a tile: b rows per
        # query block of every chunk.
        saved = 0
        if self.save_probabilities:
            rows = b * sum(ch.rows[1] - ch.rows[0] for ch in self.plan(N, causal).chunks)
            saved = a * BH * (self.executed_pairs(N, causal) + rows)
        return BH * per_head + max(loop, end) + saved + self.reordering_bytes(B, H, N, D, element_size)

    def reordering_bytes(self, B: int, H: int, N: int, D: int, element_size: int) -> int:
        """In another order (engine_order): q, k, v and the output reordered, and a gradient on the way back."""
        return 5 * element_size * B * H * N * D if self.engine_order(N) is not None else 0

    def block_density(self, seq_len: int, causal: bool = False) -> float:
        """Allowed key blocks over all nb² blocks (the block-sparse layout's density)."""
        nb = -(-seq_len // self.engine_block_size(seq_len))
        return self.plan(seq_len, causal).layout_blocks / nb**2

    def prepare(self, seq_len: int, causal: bool, device: torch.device | str) -> None:
        if self.backend == "flex":
            from .flex import block_mask

            block_mask(self, seq_len, causal, device)
        elif self.backend == "dense":
            self.dense_mask_on(seq_len, causal, resolved(device))
        elif self.backend not in FUSED_BACKENDS:
            self.plan(seq_len, causal).on(resolved(device))

    def dense_mask_on(self, seq_len: int, causal: bool, device: torch.device) -> Tensor:
        """The dense backend's (N, N) mask on ``device``, kept until another (N, causal, device) asks."""
        key = (seq_len, causal, str(device))
        if self._dense_mask is None or self._dense_mask[0] != key:
            self._dense_mask = None  # freed before the next one is built
            self._dense_mask = key, self.mask(seq_len, causal).to(device)
        return self._dense_mask[1]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        N, scale = q.shape[-2], self.scale(q.shape[-1])
        if backend == "dense":
            return dense_attention(q, k, v, self.dense_mask_on(N, causal, q.device), scale)
        if backend == "flex":
            from .flex import flex_forward

            return flex_forward(self, q, k, v, causal)  # in engine_order, as the engine
        plan = self.plan(N, causal)
        return self.in_engine_order(lambda q, k, v: block_sparse_attention(q, k, v, plan, scale, self.save_probabilities),
                                    q, k, v)
