"""full: exact softmax attention, softmax(QKᵀ/√d_k) V, with the decoder's causal mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Attention, causal_mask, dense_attention


@dataclass(frozen=True)
class FullOptions:
    backend: str | None = None  # math | sdpa (default: math, the readable reference)


class Full(Attention):
    name = "full"
    Options = FullOptions
    # math: the seeds' explicit formula, materialising the N×N scores. sdpa: PyTorch's fused kernel,
    # whichever one it picks on this device (issue 6 pins kernels on GPU).
    backends = {"math": False, "sdpa": False}

    @property
    def is_exact(self) -> bool:
        return True

    def mask(self, seq_len: int, causal: bool = False) -> Tensor:
        return causal_mask(seq_len) if causal else torch.ones(seq_len, seq_len, dtype=torch.bool)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len

    def executed_pairs(self, seq_len: int, causal: bool = False) -> int:
        # The math path computes every score and masks; fused kernels skip future blocks.
        return seq_len * seq_len if self.backend == "math" else self.allowed_pairs(seq_len, causal)

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4) -> int:
        if self.backend == "math":
            # Scores, probabilities and their gradient: three N×N matrices at the peak.
            return element_size * B * H * (3 * N * N + 6 * N * D)
        return element_size * B * H * 8 * N * D  # fused: O(N·D), log-sum-exp and gradients

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        if backend == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        mask = causal_mask(q.shape[-2], q.device) if causal else None
        return dense_attention(q, k, v, mask, self.scale(q.shape[-1]))
