"""blockwise: exact attention by online softmax over key blocks, or block-local attention.

``exact`` (Rabe & Staats 2021; Blockwise Parallel Transformer, Liu & Abbeel 2023) computes the same
function as ``full`` one key block at a time, keeping a running max ``m``, running sum ``l`` and
unnormalised output. Its backward (as in FlashAttention-2) recomputes each block's probabilities from
the saved log-sum-exp instead of keeping them, so forward+backward peak memory is O(N·block_size) per
head. Plain autograd through the same Python loop would keep every block's probabilities: O(N²).

``local`` (BlockBERT / LRA local attention) is block-diagonal: allowed(i, j) = (i // b == j // b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import require
from .blocksparse import MaskedAttention
from .masks import local_layout, num_blocks

MODES = ("exact", "local")


@dataclass(frozen=True)
class BlockwiseOptions:
    mode: str = "exact"  # exact: equals full | local: block-diagonal
    block_size: int = 128  # query/key chunk length (exact) or the local block (local)
    backend: str | None = None  # exact: online | dense | flex ; local: blocksparse | dense | flex | xformers

    def __post_init__(self) -> None:
        require(self.mode in MODES, f"blockwise: unknown mode {self.mode!r}; allowed: {', '.join(MODES)}")
        require(isinstance(self.block_size, int) and self.block_size > 0,
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
    def engine_block_size(self, seq_len: int) -> int:
        return self.options.block_size

    def layout(self, seq_len: int, causal: bool) -> Tensor:
        nb = num_blocks(seq_len, self.options.block_size)
        return local_layout(nb) if self.options.mode == "local" else torch.ones(nb, nb, dtype=torch.bool)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        if self.options.mode == "exact":  # counted, not enumerated: the layout is every block
            return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
        return super().allowed_pairs(seq_len, causal)

    def executed_pairs(self, seq_len: int, causal: bool = False) -> int:
        if self.options.mode == "exact" and self.backend == "dense":
            return seq_len * seq_len  # counted: the engine's pair count would enumerate N² elements
        if self.backend != "online":
            return super().executed_pairs(seq_len, causal)
        # Key block [s, e) is computed against queries [s, N) under causal, all N otherwise.
        b = self.options.block_size
        return sum((seq_len - (s if causal else 0)) * (min(s + b, seq_len) - s) for s in range(0, seq_len, b))

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False) -> int:
        if self.backend != "online":
            return super().memory_bytes(B, H, N, D, element_size, causal)
        # One (N × b) tile for scores, probabilities and their gradients, plus O(N·D) accumulators.
        return element_size * B * H * (4 * N * min(self.options.block_size, N) + 8 * N * D)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        if backend == "online":
            return OnlineSoftmaxAttention.apply(q, k, v, self.options.block_size, causal, self.scale(q.shape[-1]))
        if backend == "xformers":  # local only (backend_names)
            from .xformers_backend import block_local_attention

            return block_local_attention(q, k, v, self.options.block_size, causal, self.scale(q.shape[-1]))
        return super()._attend(q, k, v, causal, backend)


def _block_scores(q: Tensor, k_blk: Tensor, start: int, causal: bool, scale: float) -> Tensor:
    """Scores of queries [q0, N) against one key block starting at ``start``; q0 = start under causal
    because earlier queries see nothing of this block (skipped, not masked)."""
    s = (q @ k_blk.transpose(-2, -1)) * scale  # (B, H, N - q0, bk)
    if causal:
        i = torch.arange(start, start + q.shape[-2], device=q.device)[:, None]
        j = torch.arange(start, start + k_blk.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    return s


class OnlineSoftmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, block_size: int, causal: bool, scale: float) -> Tensor:
        B, H, N, D = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate half inputs in float32
        m = torch.full((B, H, N, 1), float("-inf"), dtype=acc, device=q.device)  # running max
        l = torch.zeros((B, H, N, 1), dtype=acc, device=q.device)  # running sum of exp(s - m)
        o = torch.zeros((B, H, N, D), dtype=acc, device=q.device)  # running unnormalised output
        for start in range(0, N, block_size):
            end = min(start + block_size, N)
            q0 = start if causal else 0
            s = _block_scores(q[:, :, q0:], k[:, :, start:end], start, causal, scale).to(acc)
            m_new = torch.maximum(m[:, :, q0:], s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)  # (B, H, N - q0, bk)
            alpha = torch.exp(m[:, :, q0:] - m_new)  # rescales what was summed under the old max
            l[:, :, q0:] = l[:, :, q0:] * alpha + p.sum(dim=-1, keepdim=True)
            o[:, :, q0:] = o[:, :, q0:] * alpha + p.to(v.dtype) @ v[:, :, start:end]
            m[:, :, q0:] = m_new
        out = (o / l).to(q.dtype)
        lse = m + torch.log(l)  # (B, H, N, 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block_size, ctx.causal, ctx.scale = block_size, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        b, causal, scale = ctx.block_size, ctx.causal, ctx.scale
        acc = lse.dtype
        N = q.shape[-2]
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1, keepdim=True)  # (B, H, N, 1) = rowsum(dO ∘ O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        for start in range(0, N, b):
            end = min(start + b, N)
            q0 = start if causal else 0
            qs, dos = q[:, :, q0:], dout[:, :, q0:]
            k_blk, v_blk = k[:, :, start:end], v[:, :, start:end]
            p = torch.exp(_block_scores(qs, k_blk, start, causal, scale).to(acc) - lse[:, :, q0:])  # recomputed
            dv[:, :, start:end] = (p.transpose(-2, -1) @ dos.to(acc)).to(v.dtype)
            dp = dos.to(acc) @ v_blk.to(acc).transpose(-2, -1)  # (B, H, N - q0, bk)
            ds = p * (dp - delta[:, :, q0:]) * scale
            dq[:, :, q0:] += ds @ k_blk.to(acc)
            dk[:, :, start:end] = (ds.transpose(-2, -1) @ qs.to(acc)).to(k.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None
