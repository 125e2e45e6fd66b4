"""The one measurement core: every variant and backend is timed and measured by the same code.

Per point:
1. Fresh seeded ``randn`` inputs q, k, v (requiring grad) and an output gradient, never zeros.
2. Set-up and warm-up: the variant's ``prepare`` (BlockMask, mask or plan on the device; ``setup_s``),
   then ``warmup_iters`` forward+backward calls, timed as a whole (``warmup_s``), so module load,
   plan building, autotuning and compilation stay out of the timed region.
3. Peak memory of one forward+backward with the input gradients reset (``harness.memory``): extra over
   the inputs; on GPU also the allocator's absolute and reserved peaks.
4. Time, separately: the forward (of training: autograd records the graph), the backward
   (``out.backward(grad, retain_graph=True)`` on one forward run outside the timer) and forward+backward,
   the input gradients cleared before every call (on GPU outside the timed region, as do_bench's
   ``grad_to_none``). CPU: ``torch.utils.benchmark.Timer`` on all of torch's
   threads with ``blocked_autorange`` (or ``adaptive_autorange``); GPU: ``triton.testing.do_bench``'s
   method (CUDA events around every call, L2 flushed before it), written out so that a long call still
   gets ``min_samples`` calls (``cuda_time_fn``). Median and interquartile range of the per-call times,
   over at least ``min_samples`` samples (blocks of calls) unless that would pass ``max_run_time``.
5. Noise: ``noise`` says why a point's timings cannot be trusted, and which pass's (spread, too few samples,
   others' load, forward slower than forward+backward); the run flags or re-measures it (``on_noise``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

# The profiler behind harness.memory.cpu_peak_bytes makes kineto print two "USDT ... profiler_start/stop"
# lines to stderr per call; level 6 (above ERROR and USDT) silences them. Read when the first profile
# starts, so setting it here, before any measurement, is enough; an explicit setting is kept.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import logging  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

if TYPE_CHECKING:
    import variants


class _NoCudaRuntimeNote(logging.Filter):
    """torch.utils.benchmark imports cpp_extension, which warns on stderr where a CUDA build of torch finds
    a CUDA toolkit but no GPU (a cluster's login node): a note about building C++ extensions, which the
    harness never does, that would make every run's output and one-line errors two lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeNote())
from torch.utils import benchmark  # noqa: E402

from .config import PASSES, MeasureOptions  # noqa: E402
from .memory import peak_memory  # noqa: E402

@dataclass(frozen=True)
class Timing:
    median_ms: float
    iqr_ms: float | None  # None when fewer than two samples were taken (no spread to report)
    samples: int | None  # timed samples (blocks of calls); None where the timer does not say


L2_FLUSH_BYTES = 256 * 2**20  # written before every timed GPU call, as do_bench does: more than any GPU's L2
GPU_WARMUP_MS = 25.0  # do_bench's default warm-up


def timer_name(device: torch.device, opts: MeasureOptions) -> str:
    if device.type == "cuda":
        return "cuda.Event (do_bench's method)"
    return f"torch.utils.benchmark.{opts.timer}_autorange"


def _stats(times_ms: list[float]) -> Timing:
    q25, q50, q75 = np.quantile(np.asarray(times_ms, dtype=float), [0.25, 0.5, 0.75])
    return Timing(float(q50), float(q75 - q25) if len(times_ms) > 1 else None, len(times_ms))


def gpu_repeats(estimate_ms: float, opts: MeasureOptions, spent_ms: float = 0.0) -> int:
    """Timed calls of a GPU pass: do_bench's ``rep / estimate`` (rep = min_run_time), but at least
    ``min_samples``, and no more than fit in what ``max_run_time`` leaves after the ``spent_ms`` the pass
    already took (its untimed calls: every call counts, as on CPU; at least one). do_bench itself times a
    call longer than rep / min_samples fewer times, one longer than rep once: no spread to judge."""
    fit = max(1, int((opts.max_run_time * 1e3 - spent_ms) / max(estimate_ms, 1e-6)))
    return min(max(int(opts.min_run_time * 1e3 / max(estimate_ms, 1e-6)), opts.min_samples), fit)


def cuda_time_fn(fn: Callable[[], object], device: torch.device, opts: MeasureOptions,
                 before: Callable[[], object] | None = None) -> Timing:
    """``triton.testing.do_bench``'s method with the harness's sample rule (``gpu_repeats``): one untimed
    call; the estimate of one call (over five when they are short, as do_bench); warm-up calls for 25 ms
    (none past that: the untimed call and the estimate were warm-up enough); then every call between two
    CUDA events, with a 256 MiB buffer written before it so no input is served from L2. ``before`` runs
    ahead of every call, outside the events, as do_bench's ``grad_to_none`` clears the gradients: the
    timed call is the one a raw do_bench of ``fn`` times. The untimed calls count against ``max_run_time``
    (``gpu_repeats``). Per-call ms."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    before = before or (lambda: None)
    began = time.perf_counter()

    def events(n: int) -> list[torch.cuda.Event]:
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def mean_ms(n: int) -> float:
        start, end = events(2)
        start.record()
        for _ in range(n):
            before()
            flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / n

    before()
    fn()
    torch.cuda.synchronize(device)
    estimate = mean_ms(1)
    if 5 * estimate < opts.min_run_time * 1e3:
        estimate = mean_ms(5)
    warmup = int(GPU_WARMUP_MS / max(estimate, 1e-6))
    for _ in range(warmup):
        before()
        fn()
    spent_ms = (time.perf_counter() - began) * 1e3 + warmup * estimate  # synchronised after the estimate
    starts, ends = events(n := gpu_repeats(estimate, opts, spent_ms)), events(n)
    for start, end in zip(starts, ends):
        before()
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return _stats([s.elapsed_time(e) for s, e in zip(starts, ends)])


def time_fn(fn: Callable[[], object], device: torch.device, opts: MeasureOptions,
            before: Callable[[], object] | None = None) -> Timing:
    """Median and IQR of one call of ``fn`` in milliseconds, over at least ``opts.min_samples`` samples
    unless taking them would pass ``opts.max_run_time`` (then fewer, and the point says so as noisy).
    ``before`` (clearing the input gradients) runs ahead of every call: untimed on CUDA (``cuda_time_fn``),
    inside the timed block on CPU, where a sample is a block of calls (microseconds against a call's
    milliseconds).

    CPU: torch.utils.benchmark's ``blocked_autorange`` (its blocks of calls are the samples), topped up
    with blocks of the same size, timed here as Timer times a block, until ``min_samples``. Every call
    counts against ``max_run_time``, the autorange's own estimate included (Timer.timeit would add two
    untimed warm-up calls per block: a 10 s call would take three times its budget)."""
    if device.type == "cuda":
        return cuda_time_fn(fn, device, opts, before)
    fn = with_before(fn, before)
    began = time.perf_counter()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    if opts.timer == "adaptive":
        m = timer.adaptive_autorange(min_run_time=opts.min_run_time,
                                     max_run_time=min(10 * opts.min_run_time, opts.max_run_time))
    else:
        m = timer.blocked_autorange(min_run_time=opts.min_run_time)
    per_call = list(m.times)  # seconds per call, one sample per block of m.number_per_run calls
    block = sum(m.raw_times) / len(m.raw_times)
    while len(per_call) < opts.min_samples and time.perf_counter() - began + block <= opts.max_run_time:
        start = time.perf_counter()
        for _ in range(m.number_per_run):  # one more block of the same size
            fn()
        per_call.append((time.perf_counter() - start) / m.number_per_run)
    return _stats([t * 1e3 for t in per_call])


def with_before(fn: Callable[[], object], before: Callable[[], object] | None) -> Callable[[], object]:
    """``fn`` preceded by ``before`` in one call (a timer that cannot leave ``before`` out of its samples)."""
    if before is None:
        return fn

    def call() -> object:
        before()
        return fn()
    return call


def spare_cores(device: torch.device | str, launchers: int = 1) -> int:
    """Cores other processes may keep busy without slowing a timed measurement on ``device``. Zero on CPU:
    the kernels run on every thread torch has, and cores left idle still share the memory bandwidth and
    the last-level cache that attention is bound by. On CUDA the GPU does the work and the host only
    launches it, from ``launchers`` threads (one per process of the point on this machine): another
    process slows that only once it leaves no core for them. On the H100's 16-core host, 1.03 and 0.45
    cores of other load flagged two FlexAttention points whose spread was 1-2% noisy, and a target's
    fit lost them. The host's cores, not this process's affinity: others' load (harness.env.OtherLoad)
    is the host's, and in a cpuset of a few cores (a SLURM job's on a GPU node) the other jobs' load on
    the rest of the host flagged every CUDA point."""
    if torch.device(device).type != "cuda":
        return 0
    return max(0, (os.cpu_count() or 1) - launchers)


FEW_SAMPLES = "< measure.min_samples="  # in the reason of a pass with too few samples: a slow call


def retry_helps(reasons: list[str]) -> bool:
    """Whether measuring again can make a noisy point quiet: not when its only reasons are passes with
    too few samples (one call takes so long that max_run_time holds fewer than min_samples: so it will
    again, and each try costs up to max_run_time per pass)."""
    return any(FEW_SAMPLES not in r for r in reasons)


def noise(record: dict, opts: MeasureOptions, spare: float = 0) -> list[tuple[str | None, str]]:
    """Why the point's timings cannot be trusted as they are, each reason with the pass it concerns (None:
    every pass): a pass's too few samples for a spread, or its spread over ``max_rel_iqr`` of the median;
    other processes' load over ``max_other_cores`` beyond the ``spare`` cores the measurement leaves them
    (``spare_cores``), a forward slower than forward+backward (only possible when the machine changed
    under the measurement). The reasons' words are what harness.results.noisy_passes reads on rows
    written before noisy_passes was recorded: a pass's own begin with its name and a colon."""
    reasons: list[tuple[str | None, str]] = []
    for name in opts.passes:
        median, iqr, n = record.get(f"{name}_ms"), record.get(f"{name}_iqr_ms"), record.get(f"{name}_samples")
        if median is None:
            continue
        if n is not None and n < opts.min_samples:
            reasons.append((name, f"{name}: {n} sample{'s' if n != 1 else ''} {FEW_SAMPLES}{opts.min_samples} "
                                  f"(one call {median / 1e3:.3g} s; measure.max_run_time={opts.max_run_time:g} s)"))
        elif iqr is not None and median > 0 and iqr / median > opts.max_rel_iqr:
            reasons.append((name, f"{name}: IQR {iqr / median:.0%} of the median > measure.max_rel_iqr="
                                  f"{opts.max_rel_iqr:g}"))
    fwd, fwd_bwd = record.get("fwd_ms"), record.get("fwd_bwd_ms")
    if fwd is not None and fwd_bwd is not None and fwd > fwd_bwd:
        reasons.append((None, f"forward {fwd:.4g} ms slower than forward+backward {fwd_bwd:.4g} ms"))
    others = record.get("other_cpu_cores")
    timed = any(record.get(f"{name}_ms") is not None for name in opts.passes)  # memory alone: load-proof
    if timed and others is not None and others - spare > opts.max_other_cores:
        beyond = f", {others - spare:.2f} beyond the {spare:g} a CUDA measurement leaves them," if spare else ""
        reasons.append((None, f"other processes kept {others:.2f} cores busy{beyond} > measure.max_other_cores="
                              f"{opts.max_other_cores:g}"))
    return reasons


def noise_fields(found: list[tuple[str | None, str]], record: dict, opts: MeasureOptions) -> dict:
    """The row's verdict on its timings from ``noise``'s reasons ``found``: noisy, noise_reasons (joined by
    "; ") and noisy_passes, the timed passes a reason concerns (a reason of the whole point: every one)."""
    timed = [p for p in opts.passes if record.get(f"{p}_ms") is not None]
    untrusted = {p for which, _ in found for p in ([which] if which else timed)}
    return {"noisy": bool(found), "noise_reasons": "; ".join(r for _, r in found) or None,
            "noisy_passes": [p for p in timed if p in untrusted]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_point(attn: "variants.Attention", *, batch_size: int, num_heads: int, seq_len: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device, causal: bool, seed: int, opts: MeasureOptions,
                  record: dict, on_phase: Callable[[str], None] = lambda phase: None,
                  shard: Callable[[torch.Tensor], torch.Tensor] | None = None, timer_fn=time_fn) -> None:
    """Measures one point into ``record`` (fields of harness.results.Result), filled as each measurement
    finishes so that what was measured before a failure (an OOM in the backward) is kept. The output and
    the input gradients of the last warm-up call are checked once: NaN or Inf makes the point
    ``nonfinite`` (with the tensors named) and nothing is timed. Sequence-parallel ranks (harness.distributed)
    pass ``shard`` (this rank's rows of each whole input) and ``timer_fn`` (every rank timed in step)."""
    shape = (batch_size, num_heads, seq_len, head_dim)  # (B, H, N, D)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=dtype, device=device) for _ in range(4))
    if shard is not None:
        q, k, v, dout = (shard(t) for t in (q, k, v, dout))
    for t in (q, k, v):
        t.requires_grad_()
    leaves = (q, k, v, *(p for p in attn.parameters() if p.requires_grad))

    def reset_grads() -> None:
        for t in leaves:
            t.grad = None

    def forward() -> torch.Tensor:
        return attn(q, k, v, causal=causal)

    def fwd_bwd() -> torch.Tensor:  # after reset_grads: the backward writes the gradients, never adds
        out = forward()
        out.backward(dout)
        return out

    on_phase("warm-up")
    start = time.perf_counter()  # what a call at N needs built first (FlexAttention's BlockMask): apart
    attn.prepare(seq_len, causal, device)
    synchronize(device)
    record["setup_s"] = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(max(1, opts.warmup_iters)):  # a quality-only point still makes one checked call
        reset_grads()
        out = fwd_bwd()
    synchronize(device)
    record["warmup_s"] = time.perf_counter() - start
    bad = [name for name, t in (("output", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))
           if t is not None and not bool(torch.isfinite(t).all())]
    del out
    if bad:
        record.update(status="nonfinite", reason=f"non-finite values (NaN or Inf) in {', '.join(bad)} in "
                                                 f"{str(dtype).removeprefix('torch.')}")
        reset_grads()
        return
    if not opts.passes and not opts.memory:
        reset_grads()
        return  # a quality-only point: nothing to time or measure

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
            timing = timer_fn(forward, device, opts)
        elif name == "bwd":
            out = forward()  # once, outside the timer; the graph is kept for every timed backward

            def backward() -> None:
                out.backward(dout, retain_graph=True)

            timing = timer_fn(backward, device, opts, before=reset_grads)
            del out, backward
        else:
            timing = timer_fn(fwd_bwd, device, opts, before=reset_grads)
        record.update({f"{name}_ms": timing.median_ms, f"{name}_iqr_ms": timing.iqr_ms,
                       f"{name}_samples": timing.samples})
    reset_grads()
