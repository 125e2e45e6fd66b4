"""Peak memory of a callable, measured, not estimated.

GPU: the CUDA caching allocator's peak (``max_memory_allocated``) after a reset, minus what was
allocated before the call. CPU: PyTorch keeps no CPU allocator statistics, so we replay the profiler's
allocation events (``profile_memory=True``): a running sum of every allocation and free in time order,
whose maximum is the peak. Checked in docs/measurement.md against theory (exact) and against
peak RSS in a fresh process (within 2%); unlike RSS it is not hidden by memory the C allocator keeps.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

# Kineto prints a line per profiler session (USDT probes) unless told to be quiet; the CPU peak
# measurement opens one session per measured call, so silence it before torch loads it.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
# The autograd profiler, which torch.profiler.profile wraps: the wrapper's start asks hasattr(torch,
# "_inductor"), which imports inductor and dynamo (about 1.2 s a process) to read a CUDA-graphs setting
# a CPU memory trace has no use for.
from torch.autograd.profiler import profile  # noqa: E402


@dataclass(frozen=True)
class PeakMemory:
    extra_bytes: int  # peak over what was allocated before the call (the inputs)
    abs_bytes: int | None  # allocator peak including inputs (GPU only)
    reserved_bytes: int | None  # allocator's reserved peak (GPU only)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated by ``fn`` on the CPU (over what existed before), from profiler events."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # profiler's "no kineto activity" chatter
        with profile(use_cpu=True, profile_memory=True) as prof:
            fn()
    events = [e for e in prof.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def cuda_peak(fn: Callable[[], object], device: torch.device) -> PeakMemory:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return PeakMemory(peak - before, peak, torch.cuda.max_memory_reserved(device))


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> PeakMemory:
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_peak(fn, device)
    return PeakMemory(cpu_peak_bytes(fn), None, None)


# ----- after a failure -----------------------------------------------------------------------------

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def is_out_of_memory(e: BaseException) -> bool:
    """An OutOfMemoryError, or one wrapped by another (Inductor raises its autotuning's OOM as a compile
    error): the point ran out of memory, whatever carried the news."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OutOfMemoryError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def release_memory(device: torch.device) -> None:
    """Collect what a point left (a failed point's tensors, held by the exception's frames until now) and
    return the device's cached blocks. Never raises: after a sticky CUDA error every CUDA call fails, and
    ``device_lost`` says so."""
    import gc

    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass


def device_lost(device: torch.device) -> bool:
    """Whether this process can no longer use ``device``: after a sticky CUDA error (an illegal memory
    access, a device-side assert) the context is corrupt and every later kernel fails, so every later
    point would be recorded as an error that is not its own. Probed by running a kernel."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        return (torch.ones(1, device=device) + 1).item() != 2.0
    except Exception:
        return True


def tensor_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers (one built on the meta device: nothing allocated)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def check_fits(what: str, nbytes: int, allowed: str) -> None:
    """Refuses a module whose tensors this machine cannot hold, before it is built: a parameter of 10¹³
    bytes is not an out-of-memory the harness can record but the kernel's OOM killer ending the process
    (no row, no line), and a model of 10¹¹ layers takes hours to build first. Counted on the meta device
    (``tensor_bytes``) against MemAvailable, where the modules are built (on the host, then moved)."""
    from .config import ConfigError
    from .env import mem_available_bytes

    available = mem_available_bytes()
    if available is not None and nbytes > available:
        raise ConfigError(f"{what} take {nbytes / 1e9:.3g} GB, more than this machine's available memory "
                          f"({available / 1e9:.3g} GB, MemAvailable); allowed: {allowed}")
