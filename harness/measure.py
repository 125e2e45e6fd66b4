"""The one measurement core: every variant and backend is timed and measured by the same code.

Per point (see ../shared/docs/measurement.md):
1. Fresh seeded ``randn`` inputs q, k, v (requiring grad) and an output gradient, never zeros.
2. Warm-up: ``warmup_iters`` forward+backward calls, timed as a whole (``warmup_s``), so module load,
   plan building, autotuning and compilation stay out of the timed region.
3. Peak memory of one forward+backward with the input gradients reset (``harness.memory``): extra over
   the inputs; on GPU also the allocator's absolute and reserved peaks.
4. Time, separately: the forward (of training: autograd records the graph), the backward
   (``out.backward(grad, retain_graph=True)`` on one forward run outside the timer, input gradients
   reset in every call) and forward+backward. CPU: ``torch.utils.benchmark.Timer`` on all of torch's
   threads with ``blocked_autorange`` (or ``adaptive_autorange``); GPU: ``triton.testing.do_bench``
   (CUDA events, L2 flushed between calls) when triton imports, else the same Timer, which
   synchronises CUDA. Median and interquartile range of the per-call times.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Callable

# The profiler behind harness.memory.cpu_peak_bytes makes kineto print two "USDT ... profiler_start/stop"
# lines to stderr per call; level 6 (above ERROR and USDT) silences them. Read when the first profile
# starts, so setting it here, before any measurement, is enough; an explicit setting is kept.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
from torch.utils import benchmark  # noqa: E402

from .config import PASSES, MeasureOptions  # noqa: E402
from .memory import peak_memory  # noqa: E402

@dataclass(frozen=True)
class Timing:
    median_ms: float
    iqr_ms: float | None  # None when fewer than two samples were taken (no spread to report)
    samples: int | None  # timed samples (blocks of calls); None where do_bench does not say


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def timer_name(device: torch.device, opts: MeasureOptions) -> str:
    if device.type == "cuda" and triton_available():
        return "triton.do_bench"
    return f"torch.utils.benchmark.{opts.timer}_autorange"


def time_fn(fn: Callable[[], object], device: torch.device, opts: MeasureOptions) -> Timing:
    """Median and IQR of one call of ``fn`` in milliseconds."""
    if device.type == "cuda" and triton_available():
        from triton.testing import do_bench

        q25, q50, q75 = do_bench(fn, rep=max(1.0, opts.min_run_time * 1e3), quantiles=[0.25, 0.5, 0.75],
                                 return_mode="median")
        return Timing(q50, q75 - q25, None)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    if opts.timer == "adaptive":
        m = timer.adaptive_autorange(min_run_time=opts.min_run_time, max_run_time=10 * opts.min_run_time)
    else:
        m = timer.blocked_autorange(min_run_time=opts.min_run_time)
    samples = len(m.times)
    return Timing(m.median * 1e3, m.iqr * 1e3 if samples > 1 else None, samples)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_point(attn: torch.nn.Module, *, batch_size: int, num_heads: int, seq_len: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device, causal: bool, seed: int, opts: MeasureOptions,
                  record: dict, on_phase: Callable[[str], None] = lambda phase: None) -> None:
    """Measures one point into ``record`` (fields of harness.results.Result), filled as each measurement
    finishes so that what was measured before a failure (an OOM in the backward) is kept."""
    if not opts.passes and not opts.memory:
        return  # a quality-only point: nothing to time or measure
    shape = (batch_size, num_heads, seq_len, head_dim)  # (B, H, N, D)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    leaves = (q, k, v, *(p for p in attn.parameters() if p.requires_grad))

    def reset_grads() -> None:
        for t in leaves:
            t.grad = None

    def forward() -> torch.Tensor:
        return attn(q, k, v, causal=causal)

    def fwd_bwd() -> None:
        reset_grads()
        forward().backward(dout)

    on_phase("warm-up")
    start = time.perf_counter()
    for _ in range(opts.warmup_iters):
        fwd_bwd()
    synchronize(device)
    record["warmup_s"] = time.perf_counter() - start

    if opts.memory:
        on_phase("memory")
        reset_grads()  # gradients left by the warm-up would be freed inside the window and hide as much
        peak = peak_memory(fwd_bwd, device)
        record.update(peak_mem_bytes=peak.extra_bytes, peak_mem_abs_bytes=peak.abs_bytes,
                      peak_mem_reserved_bytes=peak.reserved_bytes)

    for name in PASSES:
        if name not in opts.passes:
            continue
        on_phase(name)
        if name == "fwd":
            timing = time_fn(forward, device, opts)
        elif name == "bwd":
            out = forward()  # once, outside the timer; the graph is kept for every timed backward

            def backward() -> None:
                reset_grads()
                out.backward(dout, retain_graph=True)

            timing = time_fn(backward, device, opts)
            del out, backward
        else:
            timing = time_fn(fwd_bwd, device, opts)
        record.update({f"{name}_ms": timing.median_ms, f"{name}_iqr_ms": timing.iqr_ms,
                       f"{name}_samples": timing.samples})
    reset_grads()
