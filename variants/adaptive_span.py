"""adaptive_span: attention whose span each head learns (Sukhbaatar et al. 2019, "Adaptive Attention Span").

Each head h has a parameter z_h (``self.z``, in tokens), clamped to [0, S] (S = ``max_span``) in the
forward. A soft mask of the distance x between query i and key j, x = i − j (causal: only j ≤ i) or
x = |i − j| (non-causal), ramps from 1 to 0 over ``ramp`` = R positions past the span:

    m_h(x) = min(max((R + z_h − x) / R, 0), 1)

and the output renormalises the masked weights (the paper's ``attn * mask / sum``):

    a_ij = m_h(x_ij)·exp(s_ij) / Σ_j' m_h(x_ij')·exp(s_ij')  =  softmax_j(s_ij + log m_h(x_ij)),  log 0 = −∞.

m_h(0) = 1 for every span, so no row is empty. Keys at distance x ≥ z_h + R have weight 0, so the
``band`` backend computes only distances below ⌈max_h z_h⌉ + R: O(N·span) time and memory, forward and
backward, never an N×N tensor. Gradients reach q, k, v and every z_h (through the ramp: dm/dz = 1/R
where 0 < m < 1). The span penalty of the paper's loss belongs to training (harness/quality/task.py).

Backends: ``band`` (query chunks against a gathered key band, vectorised over chunks), ``dense`` (the
N×N scores plus the log-mask: the readable path), ``flex`` (CUDA: FlexAttention with the log-mask as a
``score_mod`` and the band as its block mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import flex
from .base import Attention, Flops, require
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
            require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
                    f"adaptive_span: {name} must be an integer >= {minimum}; got {value!r}")
        init = self.init_span
        require(init is None or (isinstance(init, (int, float)) and not isinstance(init, bool)
                                 and 0 <= init <= self.max_span),
                f"adaptive_span: init_span must be a number in [0, max_span={self.max_span}] or null; got {init!r}")
        require(self.num_heads is None or (isinstance(self.num_heads, int) and self.num_heads > 0),
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


def band_tile(seq_len: int, reach: int, causal: bool, chunk: int | None = None) -> tuple[int, int, int]:
    """(chunk rows c, keys left and right of the chunk) of the band tile: c = 64 rows, ``reach`` keys
    back and (non-causal) ahead. When a tile row would be at least as wide as the sequence (short
    sequences or long spans), one chunk of all N rows against the N keys holds the whole band with no
    padding: a tile of N·N ≤ N·(c + left + right)."""
    c, left, right = min(chunk or CHUNK, seq_len), reach, 0 if causal else reach  # causal: no key after i
    return (seq_len, 0, 0) if c + left + right >= seq_len else (c, left, right)


def band_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: int, reach: int, causal: bool,
                   scale: float, chunk: int | None = None) -> Tensor:
    """Attention on keys at distance ≤ ``reach`` only (every key with m > 0 when reach ≥ ⌈max z⌉ + R − 1).

    Query chunk t (rows t·c … t·c + c − 1) attends to the L = c + reach (+ reach, non-causal) keys
    around it (``band_tile``), cut from k and v padded on both sides with ``unfold`` (a view; no Python
    loop over chunks). Row a of a chunk and column b of its band are at distance i − j = a − b + left
    whatever the chunk, so the log-mask is one (H, c, L) tile shared by every chunk. Time and memory
    O(N·L), forward and backward (autograd saves the gathered band and the tile probabilities).
    """
    B, H, N, D = q.shape
    c, left, right = band_tile(N, reach, causal, chunk)
    nc = -(-N // c)
    pad = nc * c - N  # padded query rows of the last chunk: computed, then dropped
    L = c + left + right
    qc = F.pad(q * scale, (0, 0, 0, pad)).view(B, H, nc, c, D)  # (B, H, nc, c, D)
    kw = F.pad(k, (0, 0, left, pad + right)).unfold(2, L, c)  # (B, H, nc, D, L): chunk t's band of keys
    vw = F.pad(v, (0, 0, left, pad + right)).unfold(2, L, c).transpose(-2, -1)  # (B, H, nc, L, D)
    a = torch.arange(c, device=q.device)[:, None]  # (c, 1) row in the chunk
    b = torch.arange(L, device=q.device)[None, :]  # (1, L) column in the band
    bias = span_bias(a + left, b, z.to(q.dtype), ramp, causal)  # (H, c, L): i − j = a + left − b
    t = torch.arange(nc, device=q.device)[:, None, None]  # (nc, 1, 1)
    j = t * c - left + b  # (nc, 1, L) key position of each band column
    # Padding keys are excluded, except for padded query rows, which see their band whole (their own
    # padded position included) so that their softmax stays finite: NaN there would reach dk and dv.
    keep = ((j >= 0) & (j < N)) | (t * c + a >= N)  # (nc, c, L)
    s = qc @ kw  # (B, H, nc, c, L)
    s = s.add_(bias[:, None]).masked_fill_(~keep, float("-inf"))
    out = s.softmax(dim=-1) @ vw  # (B, H, nc, c, D)
    return out.view(B, H, nc * c, D)[:, :, :N]  # (B, H, N, D)


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

    def band_shape(self, seq_len: int, causal: bool) -> tuple[int, int, int]:
        """(chunks, chunk rows, band columns) of the band backend's tile at this length."""
        c, left, right = band_tile(seq_len, min(self.reach(), seq_len - 1), causal)
        return -(-seq_len // c), c, c + left + right

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
        if self.backend == "dense":  # plus the (H, N, N) log-mask and what its graph to z keeps (measured)
            return super().memory_bytes(B, H, N, D, element_size, causal, device) + (3 * element_size + 1) * H * N * N
        # Band tiles (scores, probabilities, their gradient) and the gathered keys and values with
        # their gradients (nc·L keys of D elements each).
        nc, c, L = self.band_shape(N, causal)
        return element_size * B * H * (3 * nc * c * L + 4 * nc * L * D + 6 * N * D)

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
