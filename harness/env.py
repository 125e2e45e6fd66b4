"""The environment a sweep ran in, recorded with every point: numbers are only comparable within one.

Versions of optional packages are read from their metadata, never by importing them: importing xformers
on a CPU-only torch prints warnings about its missing extension, and triton is not needed to know it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Environment:
    device_name: str
    num_threads: int
    torch_version: str
    cuda_version: str | None  # torch.version.cuda (None on a CPU build)
    cudnn_version: int | None
    triton_version: str | None
    xformers_version: str | None
    hostname: str
    gpu_clocks: str | None  # nvidia-smi's current SM/memory clocks, where it answers
    load_avg_1m: float | None  # the machine's load when the sweep started: others' work skews timings
    allocator: str  # CPU memory allocator (LD_PRELOAD): glibc page-faults every temporary over 32 MiB
    code_version: str | None  # the harness's git commit, "+dirty" with local changes (see code_version)
    # In env.json only (not in each row): what else decides a number
    python_version: str = ""
    numpy_version: str | None = None
    gpu_driver: str | None = None  # nvidia-smi's driver version, where it answers
    # float32 matmuls: torch.get_float32_matmul_precision() ("highest": no TF32) and the TF32 switches of
    # CUDA matmuls and cuDNN convolutions; a float32 timing on a GPU depends on them
    float32_matmul_precision: str = ""
    tf32: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_smi(query: str, header: bool = False) -> str | None:
    """``nvidia-smi --query-gpu=QUERY`` as CSV, or None where it does not answer."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv" + ("" if header else ",noheader")],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def gpu_clocks() -> str | None:
    return nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm")


def device_name(device: torch.device) -> str:
    """What a results directory calls the device: the GPU's model (NVIDIA H100 80GB HBM3) or the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def collect(device: torch.device) -> Environment:
    cuda = device.type == "cuda"
    return Environment(
        device_name=device_name(device),
        num_threads=torch.get_num_threads(),
        torch_version=str(torch.__version__),  # a TorchVersion is not a plain str
        cuda_version=torch.version.cuda,
        cudnn_version=torch.backends.cudnn.version() if cuda else None,
        triton_version=package_version("triton"),
        xformers_version=package_version("xformers"),
        hostname=socket.gethostname(),
        gpu_clocks=gpu_clocks() if cuda else None,
        load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        allocator=allocator(),
        code_version=code_version(),
        python_version=platform.python_version(),
        numpy_version=package_version("numpy"),
        gpu_driver=nvidia_smi("driver_version") if cuda else None,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        tf32=f"matmul={torch.backends.cuda.matmul.allow_tf32}, cudnn={torch.backends.cudnn.allow_tf32}",
    )


ROOT = Path(__file__).resolve().parent.parent
# What decides a number: results written into the checkout (results/) do not make the code dirty.
CODE_PATHS = ("harness", "variants", "conf", "hydra_plugins", "scripts", "pyproject.toml")
CODE_VERSION_VAR = "HARNESS_CODE_VERSION"


def code_version() -> str | None:
    """Which code measured: $HARNESS_CODE_VERSION where it is set (a tree copied to an offline node,
    without git's metadata or with a copy of it older than the tree: what was copied is said by whoever
    copied it); else the commit of the checkout the harness runs from (12 hex digits), with "+dirty" when
    its code differs from that commit (changed or new files under CODE_PATHS); None when neither tells,
    e.g. an installed wheel."""
    if os.environ.get(CODE_VERSION_VAR):
        return os.environ[CODE_VERSION_VAR]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != ROOT:  # not a checkout of this project
        return None
    head, changes = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "--", *CODE_PATHS)
    if head is None or changes is None:
        return None
    return head + ("+dirty" if changes else "")


GLIBC_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def allocator() -> str:
    """The CPU allocator and its settings. It matters: glibc serves every allocation above its mmap
    threshold (at most 32 MiB unless set) with fresh pages, page-faulted and zeroed on each call."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in preload:
            conf = os.environ.get("MALLOC_CONF", "")
            return name + (f" ({conf})" if conf else "")
    tuning = [f"{k}={os.environ[k]}" for k in GLIBC_TUNING if k in os.environ]
    return "glibc" + (f" ({', '.join(tuning)})" if tuning else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo in bytes (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024  # the kernel's "kB" is KiB
    except OSError:
        pass
    return None


def mem_available_bytes() -> int | None:
    """MemAvailable: what can be allocated without swapping."""
    return meminfo_bytes("MemAvailable")


def mem_total_bytes() -> int | None:
    """MemTotal: the machine's physical memory."""
    return meminfo_bytes("MemTotal")


class OtherLoad:
    """Average number of cores used by other processes (and stolen by the hypervisor) between start()
    and stop(): a shared machine's other work slows the timed code, so every point records it."""

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        return time.monotonic(), busy, t.user + t.system

    @property
    def started(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[0] - self._start[0] < 0.05:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._start, end
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))
