"""linear: Linformer-style low-rank projection along the sequence (Wang et al. 2020).

K̃ = E[:, :N] · k and Ṽ = F[:, :N] · v project the N keys and values onto k = proj_dim rows
(E, F ∈ ℝ^{k×n}, n = max_seq_len, initialised N(0, 1/k)); output = softmax(q K̃ᵀ · scale) Ṽ.
Time and memory O(N·k). Every projected key mixes all positions, the future included, so no mask can
make it causal: ``causal=True`` is refused, never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Attention, Flops, dense_attention, require, require_seed, score_tensors, whole

SHARING = ("headwise", "kv", "none")


@dataclass(frozen=True)
class LinearOptions:
    proj_dim: int = 256  # k, rows of E and F
    max_seq_len: int = 65536  # n, the longest N accepted (E, F have n columns: 2 × 64 MiB at k=256)
    share: str = "headwise"  # headwise: one E, one F | kv: E = F | none: E_h, F_h per head
    num_heads: int | None = None  # needed only by share=none (one E_h, F_h per head)
    seed: int = 0  # initialises E and F reproducibly
    backend: str | None = None  # math | sdpa

    def __post_init__(self) -> None:
        for name in ("proj_dim", "max_seq_len"):
            value = getattr(self, name)
            require(whole(value, 1), f"linear: {name} must be an integer > 0; got {value!r}")
        require(self.share in SHARING, f"linear: unknown share {self.share!r}; allowed: {', '.join(SHARING)}")
        require(self.share != "none" or whole(self.num_heads, 1),
                f"linear: share=none needs num_heads (an integer > 0, one E_h and F_h per head); "
                f"got {self.num_heads!r}")
        require_seed("linear: seed", self.seed)


class Linear(Attention):
    name = "linear"
    Options = LinearOptions
    backends = {"math": False, "sdpa": False}
    supports_causal = False

    def __init__(self, **options) -> None:
        super().__init__(**options)
        o = self.options
        shape = (o.num_heads, o.proj_dim, o.max_seq_len) if o.share == "none" else (o.proj_dim, o.max_seq_len)
        gen = torch.Generator().manual_seed(o.seed)
        std = 1.0 / math.sqrt(o.proj_dim)  # N(0, 1/k)
        self.E = nn.Parameter(torch.randn(shape, generator=gen) * std)
        self.F = self.E if o.share == "kv" else nn.Parameter(torch.randn(shape, generator=gen) * std)

    def causal_error(self) -> str:
        return ("linear does not support causal=True: every projected key mixes all positions, future ones "
                "included, so no mask can make it causal; use causal=False")

    def mask(self, seq_len: int, causal: bool = False) -> None:
        return None  # no allowed mask: every query sees k mixtures of all keys

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return seq_len * self.options.proj_dim  # score entries: N × k (k projected keys even when k > N)

    def density(self, seq_len: int, causal: bool = False) -> float:
        return self.options.proj_dim / seq_len  # N·k / N²: above 1 when k > N (more scores than full)

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False,
              device: torch.device | str | None = None) -> Flops:
        # Attention on k projected keys (4·N·k·D) plus the two projections E·K, F·V (2·2·k·N·D).
        total = 8 * B * H * N * self.options.proj_dim * D
        return Flops(executed=total, useful=total)

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        """The larger of two peaks, each measured to the byte on CPU at some shape and an upper bound at
        the others (tests/test_memory_scaling.py)."""
        o, k = self.options, self.options.proj_dim
        # E[:, :N] and F[:, :N] cast to the inputs' dtype where it is not theirs (float32): copies the
        # backward keeps, (k, N) each, or (H, k, N) with share=none
        copies = 0 if element_size == 4 else element_size * k * N * (H if o.share == "none" else 1) * 2
        # The softmax backward over the N×k scores, as dense attention's over N×N (Attention.memory_bytes):
        # P, dP, dS (CUDA: and dP ∘ P), the output and K̃, Ṽ, and the 0-dim float64 of the scale. sdpa's
        # fused kernel keeps no scores: for it an upper bound, room for its per-thread workspaces.
        attention = element_size * B * H * (score_tensors(device) * N * k + N * D + 2 * k * D) + copies + 8
        # The projections' backward (dk = E[:, :N]ᵀ dK̃, dv = Fᵀ dṼ): dq, dk, dv and the einsum's permuted
        # copies, up to five (B, H, N, D); with shared E, F a transposed copy of each cast slice too; and
        # small host tensors (80 bytes measured at B=2, H=2, N=777, D=16, k=8 in bfloat16).
        projection = element_size * B * H * 5 * N * D + copies * (1 if o.share == "none" else 2) + 128
        return max(attention, projection)

    def projections(self, seq_len: int, num_heads: int) -> tuple[Tensor, Tensor]:
        """E[:, :N], F[:, :N] as (k, N), or with share=none the call's heads' (H, k, N) (those of its head
        shard under ulysses)."""
        o = self.options
        require(seq_len <= o.max_seq_len,
                f"linear: sequence length N={seq_len} exceeds max_seq_len={o.max_seq_len}; "
                f"raise max_seq_len to at least {seq_len}")
        if o.share != "none":
            return self.E[:, :seq_len], self.F[:, :seq_len]
        heads, total = self.heads(num_heads)
        require(total == o.num_heads, f"linear: share=none was built for num_heads={o.num_heads}; got H={total}")
        return self.E[heads, :, :seq_len], self.F[heads, :, :seq_len]

    def _project(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        E, F_ = (p.to(k.dtype) for p in self.projections(k.shape[-2], k.shape[1]))
        eq = "hpn,bhnd->bhpd" if E.dim() == 3 else "pn,bhnd->bhpd"
        return torch.einsum(eq, E, k), torch.einsum(eq, F_, v)  # K̃, Ṽ: (B, H, k, D)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        k_proj, v_proj = self._project(q, k, v)
        if backend == "sdpa":
            return F.scaled_dot_product_attention(q, k_proj, v_proj)
        return dense_attention(q, k_proj, v_proj, None, self.scale(q.shape[-1]))  # (B, H, N, D)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        require(not causal, self.causal_error())
        q, k, v = (t.double() for t in (q, k, v))
        E, F_ = (p.double() for p in self.projections(k.shape[-2], k.shape[1]))
        # Written as broadcast matmuls, independently of the einsums of the fast path.
        return dense_attention(q, E @ k, F_ @ v, None, self.scale(q.shape[-1]))
