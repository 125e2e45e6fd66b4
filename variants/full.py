"""full: exact softmax attention, softmax(QKᵀ/√d_k) V, with the decoder's causal mask."""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .base import Attention, VariantError, causal_mask, dense_attention
from .masks import causal_pairs

# Pinned SDPA kernels: ``sdpa_kernel([one])`` makes SDPA run that kernel or raise, never fall back.
SDPA_KERNELS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}
# What ``auto`` times, in order (xformers only where it imports); sdpa_math only when none of them runs
# (never the fastest on a GPU, and slow to time at large N).
AUTO_CANDIDATES = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "xformers")
AUTO_FALLBACK = "sdpa_math"
AUTO_REPEATS = 5


@dataclass(frozen=True)
class FullOptions:
    # sdpa (default, as in conf/variant/full.yaml) | math (the readable reference) | sdpa_flash
    # | sdpa_efficient | sdpa_cudnn | sdpa_math | xformers | auto
    backend: str | None = None


class Full(Attention):
    name = "full"
    Options = FullOptions
    # sdpa (the default): PyTorch's fused kernel, whichever one it picks on this device (``last_backend``
    # names it, as the pinned backend of that kernel). math: the
    # seeds' explicit formula, materialising the N×N scores (the readable reference).
    # sdpa_<kernel>: SDPA pinned to one kernel (sdpa_math also runs on CPU). xformers:
    # memory_efficient_attention. auto: times the pinned kernels once per (shape, dtype, causal, grad)
    # and runs the fastest; ``last_backend`` says which one ran.
    backends = {"sdpa": False, "math": False, "sdpa_flash": True, "sdpa_efficient": True, "sdpa_cudnn": True,
                "sdpa_math": False, "xformers": True, "auto": True}

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.auto_choices: dict[tuple, str] = {}  # (shape, dtype, causal, device, grad) -> backend
        self.auto_timings: dict[tuple, dict[str, float | str]] = {}  # same key -> ms per candidate or error
        self.sdpa_choices: dict[tuple, str] = {}  # input signature -> the kernel unpinned sdpa runs

    @property
    def is_exact(self) -> bool:
        return True

    def mask(self, seq_len: int, causal: bool = False) -> Tensor:
        return causal_mask(seq_len) if causal else torch.ones(seq_len, seq_len, dtype=torch.bool)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return causal_pairs(seq_len, causal)

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        # The math path computes every score and masks; fused kernels skip future blocks. backend_ran: the
        # kernel sdpa or auto chose in the last call (the measured one, where the harness asks after it).
        return seq_len * seq_len if self.backend_ran in ("math", "sdpa_math") else self.allowed_pairs(seq_len, causal)

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        if self.backend == "math":
            return super().memory_bytes(B, H, N, D, element_size, causal, device)  # three N×N at the peak (CUDA: four)
        if self.backend == "sdpa_math":  # the same, its scores in float32 for half inputs (SDPA's math upcasts)
            return super().memory_bytes(B, H, N, D, max(element_size, 4), causal, device)
        return element_size * B * H * 8 * N * D  # fused: O(N·D), log-sum-exp and gradients

    def mask_bytes(self, B: int, H: int, N: int, causal: bool) -> int:
        # math keeps its causal mask; sdpa_math, causal or not, up to four (N, N) bytes more (measured)
        return 4 * N * N if self.backend == "sdpa_math" else N * N if causal and self.backend == "math" else 0

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        if backend == "auto":
            backend = self._auto_choice(q, causal)
        self.last_backend = backend  # the backend (for auto: the kernel) this call runs
        if backend in SDPA_KERNELS:
            return self._pinned_sdpa(q, k, v, causal, backend)
        if backend == "xformers":
            from . import xformers_backend as xf

            return xf.attention(q, k, v, xf.causal_bias(causal), self.scale(q.shape[-1]))
        if backend == "sdpa":  # SDPA's is_causal on N×N is the causal rule j ≤ i (masks.causal_allowed)
            self.last_backend = self._sdpa_choice(q, k, v, causal)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        mask = causal_mask(q.shape[-2], q.device) if causal else None
        return dense_attention(q, k, v, mask, self.scale(q.shape[-1]))

    def _sdpa_choice(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> str:
        """The kernel unpinned SDPA runs for these inputs, by its own rule (``torch._fused_sdp_choice``,
        under the sdpa_kernel context in force), as its pinned name: sdpa_flash on an H100 in fp16, the CPU
        flash kernel here. Asked once per signature; "sdpa" where torch does not say."""
        enabled = tuple(f() for f in (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
                                      torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.math_sdp_enabled))
        key = (tuple(q.shape), tuple(q.stride()), q.dtype, str(q.device), causal, q.requires_grad, enabled)
        if key not in self.sdpa_choices:
            try:
                kernel = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))
                self.sdpa_choices[key] = next(n for n, b in SDPA_KERNELS.items() if b == kernel)
            except (AttributeError, TypeError, ValueError, RuntimeError, StopIteration):
                self.sdpa_choices[key] = "sdpa"
        return self.sdpa_choices[key]

    def _pinned_sdpa(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        try:
            with sdpa_kernel([SDPA_KERNELS[backend]]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale(q.shape[-1]))
        except RuntimeError as err:
            if "No available kernel" not in str(err):
                raise
            raise VariantError(f"full: backend {backend!r} has no kernel for {q.dtype}, shape {tuple(q.shape)}, "
                               f"causal={causal} on {q.device} (torch's warning above says why)") from err

    # ----- auto: the fastest pinned kernel, chosen once per input signature ----------------------------
    def _auto_choice(self, q: Tensor, causal: bool) -> str:
        grad = torch.is_grad_enabled() and q.requires_grad
        key = (tuple(q.shape), q.dtype, causal, str(q.device), grad)
        if key not in self.auto_choices:
            timings = self._time_candidates(q, causal, grad)
            ok = {b: t for b, t in timings.items() if isinstance(t, float)}
            if not ok and any(str(t).startswith("OutOfMemoryError") for t in timings.values()):
                # an oom, as the harness records it (and stops the series there), not an error
                raise torch.OutOfMemoryError(f"full: backend 'auto': no candidate ran for {q.dtype}, shape "
                                             f"{tuple(q.shape)}, causal={causal}: {timings}")
            if not ok:
                raise VariantError(f"full: backend 'auto' found no kernel for {q.dtype}, shape {tuple(q.shape)}, "
                                   f"causal={causal} on {q.device}: {timings}")
            self.auto_timings[key] = timings
            self.auto_choices[key] = min(ok, key=ok.get)
        return self.auto_choices[key]

    def _time_candidates(self, q: Tensor, causal: bool, grad: bool) -> dict[str, float | str]:
        """Median ms of each candidate (forward, plus backward when grad), with CUDA events, on fresh
        random inputs of the same shape and dtype; a candidate that cannot run maps to its error."""
        device = q.device
        x = [torch.randn(q.shape, device=device, dtype=q.dtype, requires_grad=grad) for _ in range(3)]
        dout = torch.randn(q.shape, device=device, dtype=q.dtype)
        timings: dict[str, float | str] = {}
        for backend in AUTO_CANDIDATES + (AUTO_FALLBACK,):
            if backend == AUTO_FALLBACK and any(isinstance(t, float) for t in timings.values()):
                break
            if (reason := self.unavailable(backend, device)) is not None:  # xformers that runs nothing here
                timings[backend] = reason
                continue

            def step(backend=backend):
                with torch.set_grad_enabled(grad):
                    out = self._attend(*x, causal, backend)
                    if grad:
                        torch.autograd.grad(out, x, dout)

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # SDPA warns why a pinned kernel cannot run
                    step()  # warm-up (and the check that it runs at all)
                    ms = []
                    for _ in range(AUTO_REPEATS):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        step()
                        end.record()
                        end.synchronize()
                        ms.append(start.elapsed_time(end))
                timings[backend] = float(statistics.median(ms))
            except (RuntimeError, NotImplementedError, ValueError) as err:  # VariantError is a ValueError
                timings[backend] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return timings
