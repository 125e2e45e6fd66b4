"""The typed, validated configuration of a sweep, checked before anything is measured or written.

No torch import here: the command line refuses a misspelt key, a bad length or dtype in a fraction of
a second. Every message is one line naming the problem and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from omegaconf import DictConfig, OmegaConf

PASSES = ("fwd", "bwd", "fwd_bwd")
TIMERS = ("blocked", "adaptive")
ON_NOISE = ("flag", "retry")
RETRYABLE = ("error", "oom", "skipped", "nonfinite", "noisy")  # what retry=[...] may name


@dataclass(frozen=True)
class MeasureOptions:
    passes: tuple[str, ...] = PASSES  # which of fwd, bwd, fwd_bwd to time
    warmup_iters: int = 1  # forward+backward calls before anything is measured (>= 1)
    min_run_time: float = 0.5  # seconds of measured calls per pass (GPU: do_bench's rep, in s here)
    min_samples: int = 5  # timed samples per pass at least, for a spread (unless max_run_time passes)
    max_run_time: float = 60.0  # seconds per pass that taking min_samples may use; fewer samples: noisy
    timer: str = "blocked"  # CPU: blocked (blocked_autorange) | adaptive (adaptive_autorange)
    memory: bool = True  # measure the forward+backward peak memory
    param_grads: bool = False  # also compute gradients of the variant's own parameters (linear's E, F)
    max_rel_iqr: float = 0.15  # a pass whose IQR / median exceeds this is noisy
    max_other_cores: float = 0.25  # others' load (cores; on CUDA beyond the spare ones) above this while timing: noisy
    on_noise: str = "flag"  # flag: record noisy with its reasons | retry: measure again, keep the quietest
    max_tries: int = 3  # on_noise=retry: measurements of a noisy point at most
    max_call_s: float | None = None  # skip a length whose forward+backward call is predicted slower (None: no cap)


@dataclass(frozen=True)
class FidelityOptions:
    enabled: bool = True  # errors against exact attention at every ok point (harness/quality/fidelity.py)
    batch_size: int = 1  # q, k, v of (batch_size, num_heads, N, head_dim)
    max_seq_len: int | None = 4096  # longer points record none (the float64 reference is the cost)
    block_size: int = 256  # key block of the float64 online-softmax reference


INPUT_KINDS = ("gaussian", "local", "peaked")  # harness.quality.fidelity.INPUT_KINDS (no torch import here)
TASKS = ("none", "mqar")
DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_BUDGET_SHARE = 0.5  # of MemAvailable: the CPU memory budget when memory_budget_gb is null
INT64_MAX = 2**63 - 1  # a count past it (N, B, H, D, ...) is no tensor size
SEED_MAX = INT64_MAX  # a seed is an int64: the results' seed column; torch's generators take up to 2**64 - 1
MIN_FREE_BYTES = 2**20  # an output directory's filesystem: less free space is refused before anything runs
MAX_SECONDS = 7 * 24 * 3600  # a time option: a week is past any job; 1e14 s overflows a transfer's timedelta


class ConfigError(ValueError):
    """Bad configuration. The message is one line naming the problem and the allowed values."""


@dataclass(frozen=True)
class Settings:
    variant: Mapping[str, Any]  # the variant's config: _target_ and options (num_heads filled in)
    seq_lens: tuple[int, ...]
    batch_size: int
    num_heads: int
    head_dim: int
    dtype: str
    device: str
    causal: bool
    seed: int
    memory_budget_gb: float | None
    output_dir: str | None
    measure: MeasureOptions
    inputs: str = "gaussian"
    fidelity: FidelityOptions = FidelityOptions()
    task: Mapping[str, Any] | None = None  # MQARConfig fields (seq_len None: each point's N); None: no task
    logger: Any = None  # harness.logger.LoggerConfig
    resume: bool = True
    retry: tuple[str, ...] = ()  # stored points with these statuses (or noisy) are measured again
    stop_on_oom: bool = True  # after an oom/skipped point, the longer N are recorded skipped, not run
    tokens_per_batch: int | None = None  # set: B = tokens_per_batch // N at each point (FA-2's shape)

    def batch_at(self, seq_len: int) -> int:
        """B at a point: batch_size, or tokens_per_batch // N when that is set."""
        return self.batch_size if self.tokens_per_batch is None else self.tokens_per_batch // seq_len
    dist_timeout_s: float = 120.0  # sequence-parallel points: a rank's transfers give up after this

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


# ----- validation ----------------------------------------------------------------------------------

TOP_KEYS = ("variant", "seq_len", "seq_lens", "batch_size", "num_heads", "head_dim", "dtype", "device",
            "causal", "seed", "memory_budget_gb", "output_dir", "measure", "inputs", "fidelity", "task",
            "logger", "resume", "retry", "stop_on_oom", "tokens_per_batch", "model_dim", "distributed")
MEASURE_KEYS = tuple(f.name for f in dataclasses.fields(MeasureOptions))
FIDELITY_KEYS = tuple(f.name for f in dataclasses.fields(FidelityOptions))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive_int(name: str, x: Any) -> int:
    if not _is_int(x) or x <= 0:
        raise ConfigError(f"{name} must be an integer > 0; got {x!r}")
    if x > INT64_MAX:  # its FLOPs and bytes would pass float's range, and a tensor's size int64's
        raise ConfigError(f"{name} must be an integer > 0 and at most 2**63-1; got a {len(str(x))}-digit integer")
    return x


def _options(name: str, x: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A group of options (``measure``, ``fidelity``, ...) as a dict, or the one line saying that
    ``name=VALUE`` is not how it is set."""
    if x is not None and not isinstance(x, Mapping):
        raise ConfigError(f"{name} is a group of options, set one by one ({name}.KEY=VALUE; keys: "
                          f"{', '.join(allowed)}); got {name}={x!r}")
    cfg = dict(x or {})
    _unknown_keys(f"{name} option", cfg, allowed)
    return cfg


def _finite(x: Any) -> bool:
    """A number that is neither inf nor nan (nor an integer past float's range)."""
    try:
        return _is_number(x) and math.isfinite(x)
    except OverflowError:
        return False


def _positive_number(name: str, x: Any, what: str = "number", most: float | None = None, also: str = "") -> float:
    """``x`` as a float when it is a finite number > 0 (and at most ``most``); else the one line naming it and
    the range (``what``: "number of seconds", ...; ``also``: what else is allowed, e.g. ", or null ...")."""
    if not _finite(x) or x <= 0 or (most is not None and x > most):
        upper = "" if most is None else f", at most {most:g}"
        raise ConfigError(f"{name} must be a {what} > 0 (finite{upper}){also}; got {x!r}")
    return float(x)


def _seed(name: str, x: Any) -> int:
    if not _is_int(x) or not 0 <= x <= SEED_MAX:
        raise ConfigError(f"{name} must be an integer from 0 to 2**63-1 ({SEED_MAX}); got {x!r}")
    return x


def _bool(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise ConfigError(f"{name} must be true or false; got {x!r}")
    return x


def _unknown_keys(where: str, given: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown {where} {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")


def _seq_lens(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    def as_list(name: str, x: Any) -> list[int]:
        values = list(x) if isinstance(x, (list, tuple)) else [x]
        if not values:
            raise ConfigError(f"{name} must name at least one sequence length (integers > 0); got []")
        return [_positive_int(name, v) for v in values]

    seq_len, seq_lens = cfg.get("seq_len"), cfg.get("seq_lens")
    if seq_len is None and seq_lens is None:
        raise ConfigError("set seq_len (an integer > 0) or seq_lens (a list of them)")
    single = as_list("seq_len", seq_len) if seq_len is not None else []
    many = as_list("seq_lens", seq_lens) if seq_lens is not None else single  # seq_lens, when set, wins
    return tuple(dict.fromkeys(many))  # in the given order, repeats dropped


def _measure(cfg: Mapping[str, Any] | None) -> MeasureOptions:
    cfg = _options("measure", cfg, MEASURE_KEYS)
    m = dataclasses.replace(MeasureOptions(), **cfg)
    passes = _names("measure.passes", m.passes, PASSES)  # [] times nothing: a quality-only sweep
    if not _is_int(m.warmup_iters) or m.warmup_iters < 1:
        raise ConfigError(f"measure.warmup_iters must be an integer >= 1 (compilation and autotuning must stay "
                          f"out of the memory measurement); got {m.warmup_iters!r}")
    floats = {name: _positive_number(f"measure.{name}", getattr(m, name), what, most)
              for name, what, most in (("min_run_time", "number of seconds", MAX_SECONDS),
                                        ("max_run_time", "number of seconds", MAX_SECONDS),
                                        ("max_rel_iqr", "number", None), ("max_other_cores", "number of cores", None))}
    if m.max_call_s is not None:
        floats["max_call_s"] = _positive_number("measure.max_call_s", m.max_call_s, "number of seconds", MAX_SECONDS,
                                                ", or null (no cap)")
    if not _is_int(m.min_samples) or m.min_samples < 2:
        raise ConfigError(f"measure.min_samples must be an integer >= 2 (a spread needs two); got {m.min_samples!r}")
    if not _is_int(m.max_tries) or m.max_tries < 1:
        raise ConfigError(f"measure.max_tries must be an integer >= 1; got {m.max_tries!r}")
    if m.timer not in TIMERS:
        raise ConfigError(f"unknown measure.timer {m.timer!r}; allowed: {', '.join(TIMERS)}")
    if m.on_noise not in ON_NOISE:
        raise ConfigError(f"unknown measure.on_noise {m.on_noise!r}; allowed: {', '.join(ON_NOISE)}")
    _bool("measure.memory", m.memory)
    _bool("measure.param_grads", m.param_grads)
    return dataclasses.replace(m, passes=tuple(p for p in PASSES if p in passes), **floats)


def _fidelity(cfg: Mapping[str, Any] | None) -> FidelityOptions:
    cfg = _options("fidelity", cfg, FIDELITY_KEYS)
    f = dataclasses.replace(FidelityOptions(), **cfg)
    _bool("fidelity.enabled", f.enabled)
    _positive_int("fidelity.batch_size", f.batch_size)
    _positive_int("fidelity.block_size", f.block_size)
    if f.max_seq_len is not None:
        _positive_int("fidelity.max_seq_len (or null: no limit)", f.max_seq_len)
    return f


def _task(cfg: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The task's options without its name, or None for task=none. Its values are checked by
    harness.quality.task.MQARConfig in run.validate (that module needs torch)."""
    cfg = dict(cfg or {"name": "none"})
    name = cfg.pop("name", None)
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; allowed: {', '.join(TASKS)} (conf/task/*.yaml)")
    if name == "none":
        if cfg:  # options of a task that is not chosen
            raise ConfigError(f"task=none takes no options; got task.{', task.'.join(sorted(cfg))} (choose a task "
                              f"first: task={'|'.join(t for t in TASKS if t != 'none')})")
        return None
    if "seed" in cfg:  # its other values: MQARConfig's
        _seed("task.seed", cfg["seed"])
    return cfg


def _logger(cfg: Mapping[str, Any] | None):
    from .logger import LoggerConfig

    cfg = dict(cfg or {"name": "none"})
    _unknown_keys("logger option", cfg, tuple(f.name for f in dataclasses.fields(LoggerConfig)))
    try:
        logger = LoggerConfig(**cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _positive_number("logger.init_timeout_s", logger.init_timeout_s, "number of seconds", MAX_SECONDS)
    return logger


def settings_from_config(cfg: DictConfig | Mapping[str, Any]) -> Settings:
    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception as e:  # an interpolation that does not resolve
            raise ConfigError(one_line(f"config does not resolve: {e}")) from None
    cfg = dict(cfg)
    _unknown_keys("config key", cfg, TOP_KEYS)
    variant = cfg.get("variant")
    if not isinstance(variant, Mapping) or "_target_" not in variant:
        names = ", ".join(variant_names())
        raise ConfigError(f"no variant chosen (a conf/variant/*.yaml with _target_); allowed: {names}")
    dtype = cfg.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    device = cfg.get("device", "auto")
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; allowed: {', '.join(DEVICES)}")
    budget = cfg.get("memory_budget_gb")
    if budget is not None:
        budget = _positive_number("memory_budget_gb", budget, "number of GB", also=f", or null for "
                                  f"{DEFAULT_BUDGET_SHARE} of the available memory")
    seed = _seed("seed", cfg.get("seed", 0))
    output_dir = cfg.get("output_dir")
    if output_dir is not None and (not isinstance(output_dir, str) or not output_dir.strip()):
        raise ConfigError(f"output_dir must be a path or null (Hydra's output directory); got {output_dir!r}")
    num_heads = _heads(cfg)
    seq_lens = _seq_lens(cfg)
    tokens = cfg.get("tokens_per_batch")
    if tokens is not None:
        _positive_int("tokens_per_batch (or null: batch_size)", tokens)
        if max(seq_lens) > tokens:
            raise ConfigError(f"tokens_per_batch={tokens} holds no sequence of N={max(seq_lens)} (B = "
                              f"tokens_per_batch // N would be 0); allowed: seq_lens up to {tokens}")
    variant = dict(variant)
    if "num_heads" in variant and variant["num_heads"] is None:
        variant["num_heads"] = num_heads  # linear share=none: one E_h, F_h per head of the workload
    return Settings(
        variant=variant,
        seq_lens=seq_lens,
        batch_size=1 if tokens is not None and cfg.get("batch_size") is None else
        _positive_int("batch_size", cfg.get("batch_size")),
        num_heads=num_heads,
        head_dim=_positive_int("head_dim", cfg.get("head_dim")),
        dtype=dtype,
        device=device,
        causal=_bool("causal", cfg.get("causal", False)),
        seed=seed,
        memory_budget_gb=budget,
        output_dir=output_dir,
        measure=_measure(cfg.get("measure")),
        inputs=one_of("inputs", cfg.get("inputs", "gaussian"), INPUT_KINDS),
        fidelity=_fidelity(cfg.get("fidelity")),
        task=_task(cfg.get("task")),
        logger=_logger(cfg.get("logger")),
        resume=_bool("resume", cfg.get("resume", True)),
        retry=_retry(cfg.get("retry")),
        stop_on_oom=_bool("stop_on_oom", cfg.get("stop_on_oom", True)),
        tokens_per_batch=tokens,
        dist_timeout_s=_distributed(cfg.get("distributed")),
    )


def _heads(cfg: Mapping[str, Any]) -> int:
    """num_heads, or model_dim // head_dim when model_dim (the hidden size) is set."""
    model_dim = cfg.get("model_dim")
    if model_dim is None:
        return _positive_int("num_heads", cfg.get("num_heads"))
    head_dim = _positive_int("head_dim", cfg.get("head_dim"))
    _positive_int("model_dim (or null: num_heads)", model_dim)
    if model_dim % head_dim:
        raise ConfigError(f"model_dim={model_dim} is not a multiple of head_dim={head_dim} (H = model_dim / "
                          f"head_dim); allowed: head_dim dividing {model_dim}")
    return model_dim // head_dim


def _distributed(cfg: Mapping[str, Any] | None) -> float:
    cfg = _options("distributed", cfg, ("timeout_s",))
    return _positive_number("distributed.timeout_s", cfg.get("timeout_s", 120), "number of seconds", MAX_SECONDS)


def _names(name: str, x: Any, allowed: tuple[str, ...]) -> list[str]:
    """A list of some of ``allowed`` (one alone may be given bare; null: none), or the one line saying what
    is allowed: a number or a flag is no list (5 was a traceback, 0 and false an empty list)."""
    values = [] if x is None else [x] if isinstance(x, str) else list(x) if isinstance(x, (list, tuple)) else None
    if values is None or any(v not in allowed for v in values):
        raise ConfigError(f"{name} must be a list of {', '.join(allowed)} (or []); got {x!r}")
    return values


def _retry(x: Any) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_names("retry", x, RETRYABLE)))


def one_of(name: str, x: Any, allowed: tuple[str, ...]) -> str:
    """``x`` when it is one of ``allowed``; else the one line naming it and them (a config group's choice
    too: ``unknown variant 'nope'; allowed: ...``)."""
    if x not in allowed:
        raise ConfigError(f"unknown {name} {x!r}; allowed: {', '.join(allowed)}")
    return x


def launched() -> dict[str, Any] | None:
    """The group torchrun or SLURM launched this process into (rank, world_size, address, port, local_rank),
    or None. Their variables are integers; one that is not (RANK= left empty) is refused in one line, where
    it was a traceback, or a warning that skipped the check of a directory in use."""
    import os

    env = os.environ

    def number(name: str, default: str | None = None) -> int:
        text = env.get(name, default)
        if text is None or not (text.strip().isascii() and text.strip().isdigit()):
            raise ConfigError(f"environment variable {name}={text!r} is not an integer >= 0; allowed: what torchrun "
                              f"or srun sets (unset it for one process)")
        return int(text)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size, local = number("RANK"), number("WORLD_SIZE"), number("LOCAL_RANK", env["RANK"])
    elif "SLURM_PROCID" in env and number("SLURM_NTASKS", "1") > 1:
        rank, size, local = number("SLURM_PROCID"), number("SLURM_NTASKS"), number("SLURM_LOCALID", "0")
    else:
        return None
    address = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    return dict(rank=rank, world_size=size, address=address, port=number("MASTER_PORT", "29500"), local_rank=local)


def ranks_here() -> int:
    """How many ranks of the launched group share the cores this process may use: torchrun's
    LOCAL_WORLD_SIZE (the ranks on this machine); under srun, this node's count in
    SLURM_STEP_TASKS_PER_NODE ("2(x3),1": three nodes of two tasks, then one of one) at SLURM_NODEID, or
    1 where srun bound each task to cores of its own (SLURM_CPU_BIND_LIST); 1 where neither says (or says
    it in a form not theirs: the count only sets threads)."""
    import os
    import re

    env = os.environ
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(env["LOCAL_WORLD_SIZE"]))
    if env.get("SLURM_CPU_BIND_LIST"):
        return 1
    counts = []
    for entry in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", entry.strip())
        if found is None:
            return 1
        counts += [int(found[1])] * int(found[2] or 1)
    node = env.get("SLURM_NODEID", "0")
    return max(1, counts[int(node)]) if node.isdigit() and int(node) < len(counts) else 1


def check_output_dir(path: str | Path) -> None:
    """Refuses an output directory results could not be written to (Hydra would create it with a
    traceback). Tried for real: a file is created and removed in the nearest existing ancestor, since
    permissions alone do not tell (root ignores them; a read-only filesystem refuses everyone)."""
    import os
    import shutil
    import tempfile

    path = Path(path).absolute()
    # Names and paths past the filesystem's limits: Hydra's mkdir fails with a traceback
    for name, size, most in [*((f"a name ({p[:24]}...)", len(os.fsencode(p)), NAME_MAX) for p in path.parts),
                             (f"a path ({str(path)[:24]}...)", len(os.fsencode(str(path))), PATH_MAX - 1)]:
        if size > most:
            raise ConfigError(f"cannot write results under {name} of {size} bytes; allowed: at most {most}")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"cannot write results to {path}: {ancestor} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".harness-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"cannot write results to {path}: {ancestor} is not writable ({e.strerror or e})") from None
    # The probe takes no space: a full filesystem passes it, and Hydra's first write (.hydra/config.yaml,
    # before any of the harness's code runs) would fail with its own traceback.
    free = shutil.disk_usage(ancestor).free
    if free < MIN_FREE_BYTES:
        raise ConfigError(f"cannot write results to {path}: no space left on its filesystem ({free} bytes free); "
                          f"allowed: at least {MIN_FREE_BYTES // 2**20} MiB free (a run's configuration, status "
                          f"and first results)")


HARNESS, BENCH_CPU, BENCH_GPU = "python -m harness", "scripts/bench_cpu.py", "scripts/bench_gpu.py"


def results_of(path: str | Path) -> dict[str, str]:
    """The commands whose results ``path`` holds at its top, each with the file that tells (a file only that
    command writes there): a run's results.jsonl or status.json, bench_cpu's and bench_gpu's SUMMARY.md,
    bench_gpu's state.json or env.json (an array of its invocations; a run's is an object)."""
    path = Path(path)
    found: dict[str, str] = {}

    def head(name: str) -> str:
        try:
            with open(path / name, "rb") as f:
                return f.read(64).decode("utf-8", "replace")
        except OSError:  # absent, a directory, unreadable
            return ""
    for name in ("results.jsonl", "status.json"):
        if (path / name).is_file():
            found.setdefault(HARNESS, name)
    summary = head("SUMMARY.md")
    if summary.startswith("# CPU benchmark"):
        found[BENCH_CPU] = "SUMMARY.md"
    if summary.startswith("# GPU benchmark"):
        found[BENCH_GPU] = "SUMMARY.md"
    elif (path / "state.json").is_file():
        found[BENCH_GPU] = "state.json"
    elif head("env.json").lstrip().startswith("["):
        found[BENCH_GPU] = "env.json"
    return found


def check_results_dir(path: str | Path, command: str, writes: tuple[str, ...]) -> None:
    """Refuses ``path`` where it holds another command's results and ``command`` would write over one of its
    files there (``writes``: the files ``command`` writes at the directory's top). Each wrote over the
    others' once: bench_cpu's results.csv and fit.json replaced a run's, bench_gpu's SUMMARY.md bench_cpu's
    (and a run's env.json, read as a damaged one of bench_gpu's, was moved aside), a run's env.json
    bench_gpu's record of its invocations."""
    path = Path(path)
    replaced = [name for name in writes if (path / name).exists()]
    others = {c: f for c, f in results_of(path).items() if c != command}
    if replaced and others:
        other, sign = next(iter(others.items()))
        raise ConfigError(f"cannot write results to {path}: it holds the results of {other} ({sign}), whose "
                          f"{', '.join(replaced)} {command} would write over; allowed: a directory of {command}'s "
                          f"own, or a new one")


NAME_MAX = 255  # bytes in a file name (ext4, xfs, NFS): a longer job directory fails in Hydra's mkdir
PATH_MAX = 4096  # bytes in a path, its terminating null included (Linux)


def job_dirname(overrides: str) -> str:
    """A sweep job's directory (``hydra.sweep.subdir``): its overrides as Hydra joins them (sorted
    ``key=value`` items), or, where that passes a file name's limit, a hash of them all and as many of the
    last items as fit (``variant``, ``variant.backend`` sort last): the same overrides, the same directory,
    so a sweep resumes; .hydra/overrides.yaml keeps them all."""
    if len(overrides.encode()) <= NAME_MAX:
        return overrides
    import hashlib

    head = f"sha1-{hashlib.sha1(overrides.encode()).hexdigest()[:12]}"
    tail: list[str] = []
    for item in reversed(overrides.split(",")):
        if len(",".join([head, item, *tail]).encode()) > NAME_MAX:
            break
        tail.insert(0, item)
    return ",".join([head, *tail])


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)  # conf/config.yaml's sweep.subdir


def variant_names() -> list[str]:
    return sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "variant").glob("*.yaml"))


def one_line(text: Any) -> str:
    return " ".join(line.strip() for line in utf8(str(text)).splitlines() if line.strip())


def utf8(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\udcff``): an exception naming a path
    that is not UTF-8 carries one (Python's surrogateescape), which no UTF-8 file, console or wandb
    table can take (UnicodeEncodeError)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line_errors(parser: argparse.ArgumentParser, name: str | None = None) -> argparse.ArgumentParser:
    """``parser`` refusing bad arguments as every command of the project does: one line, ``NAME: error:
    ...; see --help``, exit 2 (argparse's own prints its usage first, several lines; --help has it)."""
    def error(message: str) -> NoReturn:
        print(f"{name or parser.prog}: error: {message}; see --help", file=sys.stderr)
        sys.exit(2)

    parser.error = error  # type: ignore[method-assign]
    return parser


def positive_arg(kind: type, zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type for the scripts' counts and durations: a ``kind`` (int or float) > 0, or >= 0 with
    ``zero``, finite; anything else is refused before anything runs or is written, in argparse's one line
    naming the argument, what it takes and the value given."""
    allowed = f"{'an integer' if kind is int else 'a finite number'} {'>=' if zero else '>'} 0"

    def parse(text: str) -> int | float:
        try:
            x = kind(text)
        except ValueError:
            x = math.nan
        if not ((kind is int or math.isfinite(x)) and (x >= 0 if zero else x > 0)):
            raise argparse.ArgumentTypeError(f"must be {allowed}; got {text!r}")
        return x
    return parse


def output_dir_arg(text: str) -> Path:
    """An argparse type for the scripts' --out: a directory results can be written to (made when missing);
    a file, a path under one or in a read-only place is refused in one line before anything runs, not by
    mkdir's traceback once the measurements are done. Absolute: a script's harness runs in the repository,
    and its results go where the caller named them; an empty name (an unset variable) is refused, not the
    current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a directory path; got {text!r}")
    try:
        check_output_dir(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return Path(text).absolute()


def ctrl_c_is_one_line(main: Callable[[], int | None], name: str, after: str) -> int | None:
    """``main()`` of a script, a Ctrl-C or SIGTERM ending it in one line (``NAME: interrupted (Ctrl-C);
    AFTER``) and exit 130 or 143 (the shell's codes) instead of a KeyboardInterrupt's traceback, or a
    SIGTERM's silent end; and so does stdout's reader going away (``| head``: exit 141, not a
    BrokenPipeError's traceback). (Before, while its imports ran: harness.signals.exit_at_startup_interrupts.)"""
    import signal

    from .signals import GuardedStdout, Terminated

    def terminate(signum, frame) -> None:
        raise Terminated()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, terminate)
    if not isinstance(sys.stdout, GuardedStdout):
        sys.stdout = GuardedStdout(sys.stdout)
    try:
        return main()
    except KeyboardInterrupt as e:
        kind, code = (e.NAME, e.EXIT_CODE) if isinstance(e, Terminated) else ("Ctrl-C", 130)
        print(f"{name}: interrupted ({kind}); {after}", file=sys.stderr)
        return code


def wait_through_ctrl_c(proc, grace_s: float = 30.0) -> int:
    """The exit code of a harness the script started. A Ctrl-C at a terminal reaches the harness too, which
    records its run as interrupted and ends with its own line: it is waited for (``grace_s``, then sent the
    SIGINT it missed: the Ctrl-C was the script's alone, ``kill -INT``), never killed halfway through
    writing that; the caller exits with its code. A SIGTERM (``kill``, a scheduler's cancel) reaches the
    script alone: it is passed on, and the harness, as with Ctrl-C, waited for (not left measuring on
    its own, holding its directory)."""
    import signal
    import subprocess

    from .signals import Terminated

    timeout = None
    while True:
        try:
            return proc.wait(timeout=timeout)
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated):
                proc.send_signal(signal.SIGTERM)
            timeout = grace_s
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            timeout = None
