"""adaptive_span: attention whose span each head learns (Sukhbaatar et al. 2019, "Adaptive Attention Span").

Each head h has a parameter z_h (``self.z``, in tokens), clamped to [0, S] (S = ``max_span``) in the
forward. A soft mask of the distance x between query i and key j, x = i − j (causal: only j ≤ i) or
x = |i − j| (non-causal), ramps from 1 to 0 over ``ramp`` = R positions past the span:

    m_h(x) = min(max((R + z_h − x) / R, 0), 1)

and the output renormalises the masked weights (the paper's ``attn * mask / sum``):

    a_ij = m_h(x_ij)·exp(s_ij) / Σ_j' m_h(x_ij')·exp(s_ij')  =  softmax_j(s_ij + log m_h(x_ij)),  log 0 = −∞.

m_h(0) = 1 for every span, so no row is empty. Keys at distance x ≥ z_h + R have weight 0, so the
``band`` backend computes only distances below ⌈max_h z_h⌉ + R: O(N·span) time, O(N·D) memory, forward
and backward, never an N×N tensor. Gradients reach q, k, v and every z_h (through the ramp: dm/dz = 1/R
where 0 < m < 1). The span penalty of the paper's loss belongs to training (harness/quality/task.py).

Backends: ``band`` (query chunks against their band of keys, vectorised over chunks; the backward
computes the scores again, as FlashAttention-2's does), ``dense`` (the N×N scores plus the log-mask: the
readable path), ``flex`` (CUDA: FlexAttention with the log-mask as a ``score_mod`` and the band as its
block mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import flex
from .base import Attention, Flops, require, resolved, whole
from .blocksparse import tile_elements
from .masks import Predicate, causal_allowed, dense_mask

CHUNK = 64  # query rows per band tile: the tile is CHUNK × (CHUNK + reach on each side)


@dataclass(frozen=True)
class AdaptiveSpanOptions:
    max_span: int = 1024  # S: the longest span a head can learn (z_h is clamped to [0, S])
    ramp: int = 32  # R: positions over which the soft mask falls from 1 to 0 past the span
    init_span: float | None = None  # z_h at construction; null: S (every head starts at the longest span)
    num_heads: int | None = None  # one z_h per head; null: one span shared by every head
    backend: str | None = None  # band | dense | flex (CUDA)

    def __post_init__(self) -> None:
        for name, minimum in (("max_span", 0), ("ramp", 1)):
            value = getattr(self, name)
            require(whole(value, minimum),
                    f"adaptive_span: {name} must be an integer >= {minimum}; got {value!r}")
        init = self.init_span
        require(init is None or (isinstance(init, (int, float)) and not isinstance(init, bool)
                                 and 0 <= init <= self.max_span),
                f"adaptive_span: init_span must be a number in [0, max_span={self.max_span}] or null; got {init!r}")
        require(self.num_heads is None or whole(self.num_heads, 1),
                f"adaptive_span: num_heads must be an integer > 0 or null (one shared span); got {self.num_heads!r}")


# ----- the soft mask -----------------------------------------------------------------------------------
def soft_mask(x: Tensor, z: Tensor, ramp: int) -> Tensor:
    """m(x) = clamp((R + z − x) / R, 0, 1): 1 up to the span z, 0 from z + R on. Broadcasts x and z."""
    return ((ramp + z - x) / ramp).clamp(0, 1)


def log_mask(m: Tensor) -> Tensor:
    """log m with log 0 = −∞. The clamp keeps log's backward finite where m = 0 (those entries take the
    −∞ branch, whose gradient is 0; without it autograd would form 0/0 there)."""
    return torch.where(m > 0, m.clamp_min(torch.finfo(m.dtype).tiny).log(), float("-inf"))


def distance(i: Tensor, j: Tensor, causal: bool) -> Tensor:
    """x = i − j under causal (negative: the future, masked by the caller), else |i − j|."""
    return i - j if causal else (i - j).abs()


def span_bias(i: Tensor, j: Tensor, z: Tensor, ramp: int, causal: bool) -> Tensor:
    """(H, *grid) additive score bias log m_h(x_ij), −∞ in the future under causal. z: (H,)."""
    x = distance(i, j, causal).to(z.dtype)
    bias = log_mask(soft_mask(x, z.view(-1, *[1] * x.dim()), ramp))
    return bias.masked_fill(~causal_allowed(i, j), float("-inf")) if causal else bias


def band_tile(seq_len: int, reach: int, causal: bool, chunk: int | None = None) -> tuple[int, int, int, bool]:
    """(chunk rows c, keys left and right of the chunk, whole) of the band tile: c = 64 rows, ``reach`` keys
    back and (non-causal) ahead. When a tile row would be at least as wide as the sequence (short
    sequences or long spans), ``whole``: each chunk of c rows is computed against the N keys themselves,
    unpadded (left = right = 0, a tile row of N ≤ c + left + right keys), still a group of chunks at a
    time, so that no tile holds the N × N scores of every row at once."""
    c, left, right = min(chunk or CHUNK, seq_len), reach, 0 if causal else reach  # causal: no key after i
    return (c, 0, 0, True) if c + left + right >= seq_len else (c, left, right, False)


def band_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: int, reach: int, causal: bool,
                   scale: float, chunk: int | None = None) -> Tensor:
    """Attention on keys at distance ≤ ``reach`` only (every key with m > 0 when reach ≥ ⌈max z⌉ + R − 1).

    Query chunk t (rows t·c … t·c + c − 1) attends to the L = c + reach (+ reach, non-causal) keys
    around it (``band_tile``), cut from k and v padded on both sides with ``unfold`` (a view; no Python
    loop over chunks). Row a of a chunk and column b of its band are at distance i − j = a − b + left
    whatever the chunk, so the log-mask is one (H, c, L) tile shared by every chunk. A band holds every
    key a row can weigh, so each row's softmax is whole in its chunk: FlashAttention-2's backward without
    its online softmax. The forward keeps the output and each row's log-sum-exp, and the backward computes
    the scores again, a group of chunks at a time (``BandAttention``). Time O(N·L); memory O(N·D) plus one
    group's tiles, forward and backward. z: (H,), the heads' spans (its gradient is returned).
    """
    return BandAttention.apply(q, k, v, z, ramp, reach, causal, scale, chunk)


class BandAttention(torch.autograd.Function):
    """softmax(q·kᵀ·scale + log m) v over each chunk's band; O(N·D) saved, tiles recomputed."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: int, reach: int, causal: bool,
                scale: float, chunk: int | None) -> Tensor:
        B, H, N, D = q.shape
        band = Band(N, reach, causal, chunk, q.device)
        acc = torch.promote_types(q.dtype, torch.float32)  # half inputs are computed in float32
        qc, kw, vw = band.views(q, k, v, scale, acc)
        bias = band.bias(z, ramp, acc)  # (t0, t1) -> the group's log-mask
        out = torch.empty(B, H, band.nc, band.c, D, dtype=acc, device=q.device)
        lse = torch.empty(B, H, band.nc, band.c, 1, dtype=acc, device=q.device)  # each row's log-sum-exp
        for t0, t1 in band.groups(B * H):
            s = band.scores(qc, kw, bias, t0, t1)  # (B, H, g, c, L)
            m = s.amax(dim=-1, keepdim=True)
            p = s.sub_(m).exp_()  # in place: no second tile
            l = p.sum(dim=-1, keepdim=True)
            lse[:, :, t0:t1] = m + l.log()
            out[:, :, t0:t1] = band.mul(p, vw, t0, t1).div_(l)  # (B, H, g, c, D)
            del s, p  # before the next group's tiles are made
        ctx.save_for_backward(q, k, v, z, out, lse)  # out in float32: Δ below is read from it
        ctx.args = ramp, reach, causal, scale, chunk
        return out.view(B, H, band.rows, D)[:, :, :N].to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, z, out, lse = ctx.saved_tensors
        ramp, reach, causal, scale, chunk = ctx.args
        B, H, N, D = q.shape
        band, acc = Band(N, reach, causal, chunk, q.device), lse.dtype
        nc, c = band.nc, band.c
        qc, kw, vw = band.views(q, k, v, scale, acc)
        bias = band.bias(z, ramp, acc)
        dz_factor = band.span_factor(z, ramp, acc) if ctx.needs_input_grad[3] else None  # (H, c, L) or per group
        doc = F.pad(dout.to(acc), (0, 0, 0, band.rows - N)).view(B, H, nc, c, D)  # padded rows: dO = 0, so dS = 0
        delta = (doc * out).sum(dim=-1, keepdim=True)  # (B, H, nc, c, 1) Δ = rowsum(dO ∘ O)
        dq = torch.empty(B, H, nc, c, D, dtype=acc, device=q.device)
        dkp, dvp = (torch.zeros(B, H, band.keys, D, dtype=acc, device=q.device) for _ in range(2))  # padded
        dz = torch.zeros(z.shape, dtype=acc, device=q.device) if dz_factor is not None else None
        for t0, t1 in band.groups(B * H):
            p = band.scores(qc, kw, bias, t0, t1).sub_(lse[:, :, t0:t1]).exp_()  # (B, H, g, c, L)
            do = doc[:, :, t0:t1]  # (B, H, g, c, D)
            band.add_keys(dvp, p, do, t0)  # dV = Pᵀ dO
            ds = p.mul_(band.mul(do, vw.transpose(-2, -1), t0, t1).sub_(delta[:, :, t0:t1]))  # dS = P ∘ (dO Vᵀ − Δ)
            if dz_factor is not None and band.whole:  # each group's own factor (H, g, c, N)
                dz += (ds.sum(dim=0) * dz_factor(t0, t1)).sum(dim=(1, 2, 3))
            elif dz_factor is not None:  # the log-mask is added to every chunk's scores: dz sums dS over them
                dz += (ds.sum(dim=(0, 2)) * dz_factor).sum(dim=(1, 2))
            dq[:, :, t0:t1] = band.mul(ds, kw.transpose(-2, -1), t0, t1)  # dS K (q was scaled: times scale below)
            band.add_keys(dkp, ds, qc[:, :, t0:t1], t0)  # dK = dSᵀ (q·scale)
            del p, ds  # before the next group's tiles are made
        dq = dq.view(B, H, band.rows, D)[:, :, :N] * scale
        dk, dv = (g[:, :, band.left:band.left + N] for g in (dkp, dvp))
        dz = dz.to(z.dtype) if dz_factor is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dz, None, None, None, None, None


def _span_factor(i: Tensor, j: Tensor, z: Tensor, ramp: int, causal: bool, dtype: torch.dtype) -> Tensor:
    """(H, *grid) ∂ log m_h(x_ij) / ∂z_h (``Band.span_factor``), built in place."""
    x = distance(i, j, causal).to(dtype)
    u = z.view(-1, *[1] * x.dim()).add(ramp).sub(x).div_(ramp)  # as soft_mask
    tiny = torch.finfo(dtype).tiny
    zero = (u > 1) | (u < tiny)  # clamped at 1, or m below log_mask's clamp (0 included)
    return u.clamp_min_(tiny).mul_(ramp).reciprocal_().masked_fill_(zero, 0)


class Band:
    """The band backend's geometry at one length: ``nc`` chunks of ``c`` query rows (the last padded to
    c), chunk t against the L keys at padded positions t·c … t·c + L − 1 of k padded by ``left`` in front
    (``band_tile``); ``groups`` of chunks whose scores hold at most ``tile_elements`` elements. ``whole``
    (the band covers the sequence): every chunk against the L = N keys, unpadded, its log-mask and z's
    derivative made per group ((H, g, c, N): the distance depends on the chunk), padded rows unmasked."""

    def __init__(self, seq_len: int, reach: int, causal: bool, chunk: int | None, device: torch.device) -> None:
        self.N, self.causal, self.device = seq_len, causal, device
        self.c, self.left, self.right, self.whole = band_tile(seq_len, reach, causal, chunk)
        self.L = seq_len if self.whole else self.c + self.left + self.right
        self.nc = -(-seq_len // self.c)
        self.rows = self.nc * self.c  # query rows, padded
        self.keys = seq_len if self.whole else (self.nc - 1) * self.c + self.L  # k and v padded: left + N + pad + right
        # Chunks [inner_lo, inner_hi) have no padding key in their band and no padded row: no mask there.
        # whole: no padding key at all; padded rows get a zero log-mask (bias) instead.
        self.inner_lo = 0 if self.whole else -(-self.left // self.c)
        self.inner_hi = self.nc if self.whole else min(self.nc - (1 if self.rows > seq_len else 0),
                                                       (seq_len + self.left - self.L) // self.c + 1)

    def views(self, q: Tensor, k: Tensor, v: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """q·scale in chunks (B, H, nc, c, D); each chunk's band of keys (B, H, nc, D, L) and of values
        (B, H, nc, L, D), views of k and v padded by ``left`` in front; all three in ``dtype``. whole: the
        keys transposed (B, H, D, N) and the values (B, H, N, D), shared by every chunk."""
        B, H, N, D = q.shape
        pad = self.rows - N
        qc = F.pad(q.to(dtype) * scale, (0, 0, 0, pad)).view(B, H, self.nc, self.c, D)
        if self.whole:
            return qc, k.to(dtype).transpose(-2, -1), v.to(dtype)
        kw, vw = (F.pad(t.to(dtype), (0, 0, self.left, pad + self.right)).unfold(2, self.L, self.c) for t in (k, v))
        return qc, kw, vw.transpose(-2, -1)

    def positions(self) -> tuple[Tensor, Tensor]:
        """(c, 1) row a and (1, L) band column b of every chunk as positions i, j whose difference is the
        chunk's: i − j = a + left − b."""
        return (torch.arange(self.c, device=self.device)[:, None] + self.left,
                torch.arange(self.L, device=self.device)[None, :])

    def group_positions(self, t0: int, t1: int) -> tuple[Tensor, Tensor]:
        """whole: (g, c, 1) query positions of chunks [t0, t1) and (1, 1, N) key positions."""
        i = (torch.arange(t0, t1, device=self.device)[:, None, None] * self.c
             + torch.arange(self.c, device=self.device)[:, None])
        return i, torch.arange(self.N, device=self.device)[None, None, :]

    def bias(self, z: Tensor, ramp: int, dtype: torch.dtype) -> Callable[[int, int], Tensor]:
        """The log-mask of the group [t0, t1) as a function of (t0, t1): log m_h(x), −∞ where m = 0 and in
        the future under causal. Every chunk's is the same (H, c, L) tile, made once (as (H, 1, c, L));
        whole: the group's own (H, g, c, N), 0 on padded rows (which then see every key, so that their
        softmax stays finite)."""
        z = z.detach().to(self.device, dtype)
        if not self.whole:
            tile = span_bias(*self.positions(), z, ramp, self.causal)[:, None]
            return lambda t0, t1: tile

        def of(t0: int, t1: int) -> Tensor:
            i, j = self.group_positions(t0, t1)
            b = span_bias(i, j, z, ramp, self.causal)
            return b.masked_fill_(i >= self.N, 0) if t1 * self.c > self.N else b
        return of

    def span_factor(self, z: Tensor, ramp: int, dtype: torch.dtype):
        """(H, c, L) ∂ log m_h(x) / ∂z_h as autograd takes it of ``span_bias``: 1/(R·m) where m > 0 and
        u = (R + z_h − x)/R ≤ 1 (torch's clamp passes the gradient at both of its ends), 0 elsewhere (the
        future under causal has u > 1). One (H, c, L) tile, built in place. whole: a function of the
        group [t0, t1) giving its (H, g, c, N) factor (padded rows have dS = 0)."""
        z = z.detach().to(self.device, dtype)
        if not self.whole:
            return _span_factor(*self.positions(), z, ramp, self.causal, dtype)
        return lambda t0, t1: _span_factor(*self.group_positions(t0, t1), z, ramp, self.causal, dtype)

    def group_size(self, BH: int) -> int:
        """Chunks per group: their scores, B·H·g·c·L elements, fit ``tile_elements`` (one chunk at least)."""
        return min(self.nc, max(1, tile_elements(self.device) // (BH * self.c * self.L)))

    def groups(self, BH: int):
        """[t0, t1) chunk ranges of ``group_size`` chunks."""
        step = self.group_size(BH)
        return ((t0, min(t0 + step, self.nc)) for t0 in range(0, self.nc, step))

    def mul(self, x: Tensor, w: Tensor, t0: int, t1: int) -> Tensor:
        """Chunks [t0, t1) of x (B, H, g, c, ·) times their band's w: (B, H, nc, ·, ·) sliced, or whole's
        (B, H, ·, ·) shared by every chunk (one matmul over the group's rows)."""
        if not self.whole:
            return x @ w[:, :, t0:t1]
        return (x.flatten(2, 3) @ w).unflatten(2, x.shape[2:4])

    def scores(self, qc: Tensor, kw: Tensor, bias: Callable[[int, int], Tensor], t0: int,
               t1: int) -> Tensor:
        """(B, H, g, c, L) scores plus the log-mask for chunks [t0, t1); padding keys at −∞, except for
        padded query rows, which see their band whole (their own padded position included) so that their
        softmax stays finite: NaN there would reach dk and dv."""
        s = self.mul(qc[:, :, t0:t1], kw, t0, t1).add_(bias(t0, t1))
        if t0 < self.inner_lo or t1 > self.inner_hi:
            t = torch.arange(t0, t1, device=self.device)[:, None, None]  # (g, 1, 1) chunk
            a = torch.arange(self.c, device=self.device)[:, None]  # (c, 1) row in the chunk
            j = t * self.c - self.left + torch.arange(self.L, device=self.device)  # (g, 1, L) key position
            keep = ((j >= 0) & (j < self.N)) | (t * self.c + a >= self.N)  # (g, c, L)
            s.masked_fill_(~keep, float("-inf"))
        return s

    def add_keys(self, grad: Tensor, p: Tensor, x: Tensor, t0: int) -> None:
        """Adds the bands' key (or value) gradients pᵀ x (B, H, g, L, D) of chunks t0… (p: (B, H, g, c, L),
        x: (B, H, g, c, D)) into ``grad`` (B, H, keys, D), the padded keys: chunk t's band is keys t·c …
        t·c + L − 1. Bands overlap, so one add per chunk (a group holds a few), no index_add. whole: every
        chunk's band is the N keys: one matmul over the group's rows."""
        if self.whole:
            grad += p.flatten(2, 3).transpose(-2, -1) @ x.flatten(2, 3)
            return
        part = p.transpose(-2, -1) @ x
        for n in range(part.shape[2]):
            t = (t0 + n) * self.c
            grad[:, :, t:t + self.L] += part[:, :, n]


class AdaptiveSpan(Attention):
    name = "adaptive_span"
    Options = AdaptiveSpanOptions
    # flex: FlexAttention with the log-mask as score_mod (GPU: FlexAttention has no CPU backward).
    backends = {"band": False, "dense": False, "flex": True}
    reach_kept_on = ("cuda",)  # devices where reach() keeps its value until z changes (reading z syncs)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        o = self.options
        init = float(o.max_span if o.init_span is None else o.init_span)
        self.z = nn.Parameter(torch.full((o.num_heads or 1,), init))  # (H,) or (1,) shared, in tokens
        self.block_masks = flex.BlockMasks()  # the flex backend's band, per (N, causal, device), for one reach
        self._reach: tuple[tuple, int] | None = None  # (z's identity and version, reach): see reach()

    # ----- spans ---------------------------------------------------------------------------------------
    def spans(self, num_heads: int | None = None) -> Tensor:
        """z clamped to [0, S]: every head's (None), or those of a call's ``num_heads`` heads, (H,) (a
        shared span expanded; per-head spans: the call's heads, those of its shard under ulysses)."""
        o = self.options
        z = self.z.clamp(0, o.max_span)
        if num_heads is None:
            return z
        if o.num_heads is None:
            return z.expand(num_heads)
        heads, total = self.heads(num_heads)
        require(total == o.num_heads,
                f"adaptive_span: built for num_heads={o.num_heads} (one span per head); got H={total}")
        return z[heads]

    # Training as the paper does (the task calls these on every attention layer)
    def regulariser(self) -> Tensor:
        """The paper's loss term per layer, before its coefficient: the mean span over the heads
        (λ/M · Σ_h z_h for M heads, as in the authors' code: λ · S · mean of z/S)."""
        return self.spans().mean()

    def param_groups(self) -> list[dict]:
        """z steps at lr·S: under Adam the same as the paper's parameter z/S in [0, 1] at lr (at lr itself
        a span would move about one token in 300 steps); no weight decay."""
        return [{"params": [self.z], "weight_decay": 0.0, "lr_scale": float(self.options.max_span or 1)}]

    @torch.no_grad()
    def after_step(self) -> None:
        """Keeps the parameter itself in [0, S] (the paper clamps after every optimiser step, so that a
        span pushed past either end can come back)."""
        self.z.clamp_(0, self.options.max_span)
        self._reach = None  # z may have changed unseen by its version (a fused optimiser's step)

    def training_metrics(self) -> dict[str, list[float]]:
        return {"span": self.spans().detach().tolist()}

    def reach(self) -> int:
        """Largest distance with m > 0 for some head: ⌈max z⌉ + R − 1 (m(x) > 0 ⇔ x < z + R).

        On a GPU, reading z on the host waits for the device, so the value is kept until z changes: its
        storage (``.to``, a new parameter) or its version (every in-place update: optimiser steps,
        ``after_step``'s clamp, ``copy_``). Without this every call would wait for the work queued before
        it. An update the version does not see (through ``z.data``, or a fused optimiser's step, which
        the harness's training follows with ``after_step``) needs ``after_step`` before the next call.
        On the CPU reading z costs nothing: it is read on every call (``reach_kept_on``)."""
        key = (self.z.data_ptr(), self.z.device, self.z._version)
        if self._reach is None or self._reach[0] != key or self.z.device.type not in self.reach_kept_on:
            self._reach = key, math.ceil(float(self.spans().detach().max())) + self.options.ramp - 1
        return self._reach[1]

    # ----- facts -----------------------------------------------------------------------------------------
    def _head_reaches(self) -> list[int]:
        return [math.ceil(z) + self.options.ramp - 1 for z in self.spans().detach().tolist()]

    def mask(self, seq_len: int, causal: bool = False) -> Tensor:
        """Support of the soft mask, m_h(x) > 0: (N, N) for a shared span, else (H, N, N)."""
        masks = [dense_mask(self.predicate(seq_len, causal, r), seq_len, causal) for r in self._head_reaches()]
        return masks[0] if len(masks) == 1 else torch.stack(masks)

    def predicate(self, seq_len: int, causal: bool, reach: int | None = None) -> Predicate:
        """allowed(i, j) = |i − j| ≤ reach (causality added by callers): the band, all heads' union."""
        r = self.reach() if reach is None else reach

        def allowed(i: Tensor, j: Tensor) -> Tensor:
            return (i - j).abs() <= r

        return allowed

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        """Pairs with m > 0, per (batch, head) (averaged over heads): N + (1 or 2)·Σ_{d=1..reach} (N − d)
        (one side, j < i, under the causal rule)."""
        N, sides = seq_len, 1 if causal else 2
        counts = [N + sides * (t * N - t * (t + 1) // 2) for t in (min(r, N - 1) for r in self._head_reaches())]
        return sum(counts) // len(counts)

    def band(self, seq_len: int, causal: bool, device: torch.device | str | None = None) -> Band:
        """The band backend's geometry at this length (its groups sized for ``device``, CPU by default)."""
        return Band(seq_len, min(self.reach(), seq_len - 1), causal, None, resolved(device or "cpu"))

    def band_shape(self, seq_len: int, causal: bool) -> tuple[int, int, int]:
        """(chunks, chunk rows, band columns) of the band backend's tile at this length."""
        band = self.band(seq_len, causal)
        return band.nc, band.c, band.L

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        if self.backend == "dense":
            return seq_len * seq_len
        if self.backend == "flex":  # the tiles of its BlockMask on ``device``; without one, the allowed pairs
            if device is None:
                return self.allowed_pairs(seq_len, causal)
            self._renew_block_masks(seq_len)
            return flex.block_mask_stats(self, seq_len, causal, device)["executed_pairs"]
        nc, c, L = self.band_shape(seq_len, causal)
        return nc * c * L

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False,
              device: torch.device | str | None = None) -> Flops:
        return Flops(executed=4 * B * H * D * self.executed_pairs(N, causal, device),
                     useful=4 * B * H * D * self.allowed_pairs(N, causal))

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        if self.backend == "flex":
            return element_size * B * H * 8 * N * D  # fused: O(N·D), as the other flex backends
        if self.backend == "dense":  # plus the (H, N, N) log-mask and what its graph to z keeps (measured), and
            # z's cast to the inputs' dtype and its gradient, (H,) each
            return (super().memory_bytes(B, H, N, D, element_size, causal, device) + (3 * element_size + 1) * H * N * N
                    + (element_size + 4) * H)
        # The backward's peak, O(N·D) plus one group's tiles (BandAttention). a: the element size of the
        # computation (float32 at least). Per (batch, head): the saved output and log-sum-exp, q·scale, k, v
        # and dO padded, Δ, dq and the padded key and value gradients. Beside them, the loop's tiles (the
        # probabilities, dP and a band's copy of keys or values, or its gradient) or, at the end, dq·scale
        # and the gradients cast back to the inputs' dtype.
        a, BH = max(element_size, 4), B * H
        band = self.band(N, causal, device)
        rows, keys, g = band.rows, band.keys, band.group_size(BH)
        end = BH * N * D * (a + (3 * element_size if element_size != a else 0))
        if band.whole:  # the band covers the sequence: chunks against the N keys themselves
            # Per (batch, head): as below, but k and v are not padded (copied only when cast) and the key
            # and value gradients are N rows. The loop: the probabilities and dP, a key gradient (N, D), and
            # the group's log-mask or z's derivative, (H, g, c, N), with span_bias's temporaries (two of
            # them a head, and the int64 distances).
            per_head = a * (4 * rows * D + 2 * rows + 2 * N * D) + (2 * a * N * D if element_size != a else 0)
            loop = a * BH * (2 * g * band.c * band.L + N * D) + a * g * band.c * band.L * (2 * H + 2)
            return BH * per_head + max(loop, end)
        per_head = a * (4 * rows * D + 2 * rows + 4 * keys * D)
        loop = a * BH * g * (2 * band.c * band.L + 2 * band.L * D)
        # The log-mask and z's derivative, (H, c, L) each, and span_bias's temporaries: tiles of c × L a head.
        return BH * per_head + max(loop, end) + 7 * a * H * band.c * band.L // 2

    # ----- call ------------------------------------------------------------------------------------------
    def prepare(self, seq_len: int, causal: bool, device: torch.device | str) -> None:
        if self.backend == "flex":  # the band's BlockMask for the current reach
            self._renew_block_masks(seq_len)
            flex.block_mask(self, seq_len, causal, device)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        B, H, N, D = q.shape
        z = self.spans(H)  # (H,)
        if backend == "dense":
            i = torch.arange(N, device=q.device)
            bias = span_bias(i[:, None], i[None, :], z.to(q.dtype), self.options.ramp, causal)  # (H, N, N)
            scores = (q @ k.transpose(-2, -1)) * self.scale(D) + bias  # (B, H, N, N)
            return scores.softmax(dim=-1) @ v
        if backend == "flex":
            return self.flex_forward(q, k, v, causal)
        return band_attention(q, k, v, z, self.options.ramp, min(self.reach(), N - 1), causal, self.scale(D))

    def flex_forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, compiled: bool = True) -> Tensor:
        """FlexAttention: score + log m_h(x) as ``score_mod`` (z captured, so its gradient flows), and the
        band |i − j| ≤ reach (j ≤ i under causal) as the block mask, rebuilt when the reach changes.
        On CPU it runs forward only (pass inputs that do not require grad); ``compiled=False`` runs
        eager FlexAttention (materialises the scores: for checking only)."""
        from torch.nn.attention.flex_attention import flex_attention

        H, N = q.shape[1], q.shape[-2]
        self._renew_block_masks(N)
        # contiguous: a shared span is an expanded (stride-0) view, which the compiled score_mod refuses
        z, ramp = self.spans(H).float().contiguous(), self.options.ramp

        def score_mod(score, b, h, q_idx, kv_idx):
            x = q_idx - kv_idx if causal else (q_idx - kv_idx).abs()
            m = ((ramp + z[h] - x) / ramp).clamp(0, 1)
            return torch.where(m > 0, score + m.clamp_min(torch.finfo(torch.float32).tiny).log(), float("-inf"))

        fn = flex.compiled_flex_attention() if compiled else flex_attention
        return fn(q, k, v, score_mod=score_mod, block_mask=flex.block_mask(self, N, causal, q.device),
                  scale=self.scale(q.shape[-1]))

    def _renew_block_masks(self, seq_len: int) -> None:
        """The band's BlockMasks are built for one reach: training moves it, and then they are rebuilt."""
        self.block_masks.renew(min(self.reach(), seq_len - 1))

    def reference(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        """The contract's formula in float64, written as the paper's renormalisation of masked weights
        (not the log-mask of the fast paths): a_ij = m·exp(s_ij) / Σ_j' m·exp(s_ij'). Differentiable in
        q, k, v and z."""
        q, k, v = (t.double() for t in (q, k, v))
        B, H, N, D = q.shape
        i = torch.arange(N, device=q.device)[:, None]
        j = torch.arange(N, device=q.device)[None, :]
        x = distance(i, j, causal).double()
        m = soft_mask(x, self.spans(H).double()[:, None, None], self.options.ramp)  # (H, N, N)
        if causal:
            m = m * causal_allowed(i, j)
        s = (q @ k.transpose(-2, -1)) * self.scale(D)  # (B, H, N, N)
        s = s.masked_fill(m == 0, float("-inf"))  # exp(−∞) = 0: no inf·0 where m = 0
        e = m * torch.exp(s - s.amax(dim=-1, keepdim=True))
        return (e / e.sum(dim=-1, keepdim=True)) @ v

    def extra_repr(self) -> str:
        return super().extra_repr() + f", spans={[round(z, 2) for z in self.spans().detach().tolist()]}"


__all__ = ["AdaptiveSpan", "AdaptiveSpanOptions", "soft_mask", "log_mask", "span_bias", "band_tile", "band_attention"]
