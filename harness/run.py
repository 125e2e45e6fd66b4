"""``run(cfg)``: validate a composed config, then measure one variant at each sequence length.

Everything is validated before any file is written: the workload, the measurement options, the device,
the variant (built, so that its own checks run) and causal support. Bad input raises ``ConfigError`` or
``variants.VariantError``, both ValueErrors with a one-line message naming the problem and the allowed
values. After that, a failure at one point is a result (``oom``, ``skipped``, ``error``), never a crash.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

import variants
from variants import VariantError
from variants.blocksparse import MaskedAttention

from . import env as envmod
from .console import Display
from .logger import sweep_group_name, wandb_run
from .config import DEFAULT_BUDGET_SHARE, ConfigError, Settings, one_line, settings_from_config
from .measure import measure_point, timer_name
from .results import (BACKWARD_FLOPS_FACTOR, FIELDS, Result, ResultWriter, fit_exponents, tflops,
                      write_json)

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(frozen=True)
class Sweep:
    rows: list[Result]
    fits: dict[str, Any]
    output_dir: Path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available on this machine; allowed here: auto, cpu")
    return torch.device(name)


def build_variant(variant_cfg: Mapping[str, Any]) -> variants.Attention:
    """Instantiates the variant's ``_target_`` with its options; the variant's own VariantError (unknown
    option, bad value) is re-raised as it is, not wrapped in Hydra's multi-line InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        attn = instantiate(dict(variant_cfg))
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, VariantError):
            raise VariantError(str(cause)) from None
        raise ConfigError(one_line(f"cannot build variant {variant_cfg.get('_target_')!r}: {cause or e}")) from None
    if not isinstance(attn, variants.Attention):
        raise ConfigError(f"variant _target_ {variant_cfg.get('_target_')!r} is not an attention variant; "
                          f"allowed: {', '.join(f'variants.{c.__name__}' for c in variants.REGISTRY.values())}")
    return attn


def validate(cfg: DictConfig | Mapping[str, Any]) -> tuple[Settings, variants.Attention, torch.device]:
    """All the checks of bad input, before any file is written. Raises ConfigError or VariantError."""
    settings = settings_from_config(cfg)
    device = resolve_device(settings.device)
    attn = build_variant(settings.variant)
    if settings.causal and not attn.supports_causal:
        raise VariantError(attn.causal_error())
    available = attn.available_backends(device)
    if attn.backend not in available:
        raise ConfigError(f"{attn.name}: backend {attn.backend!r} needs CUDA; available on {device.type}: "
                          f"{', '.join(available)}")
    if settings.fidelity.enabled and settings.inputs == "local" and settings.head_dim % 2:
        raise ConfigError(f"inputs=local needs an even head_dim (cos/sin pairs); got head_dim={settings.head_dim}; "
                          f"allowed inputs here: gaussian, peaked")
    if settings.task is not None:
        task_config(settings, settings.seq_lens[0])  # the task's own checks, before anything is written
    return settings, attn, device


def task_config(settings: Settings, seq_len: int):
    """The MQAR config for a point of length ``seq_len`` (task.seq_len null: the point's N)."""
    from .task import MQARConfig

    values = dict(settings.task)
    if values.get("seq_len") is None:
        values["seq_len"] = seq_len
    try:
        return MQARConfig.from_dict(values)
    except ValueError as e:
        raise ConfigError(f"task=mqar at N={seq_len}: {one_line(e).removeprefix('mqar config: ')}") from None


# ----- the sweep -----------------------------------------------------------------------------------

def resolve_output_dir(explicit: str | Path | None, settings: Settings) -> Path:
    if explicit is not None:
        return Path(explicit)
    if settings.output_dir is not None:
        return Path(settings.output_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise ConfigError("no output directory: outside Hydra pass run(cfg, output_dir=...) or set output_dir=PATH")


def memory_budget_bytes(settings: Settings, device: torch.device) -> int | None:
    """CPU: the kernel's OOM killer cannot be caught, so points whose analytic memory exceeds this are
    skipped. GPU: OOM is caught, so only an explicit budget applies."""
    if settings.memory_budget_gb is not None:
        return int(settings.memory_budget_gb * 1e9)
    if device.type == "cpu":
        available = envmod.mem_available_bytes()
        return None if available is None else int(DEFAULT_BUDGET_SHARE * available)
    return None


def run(cfg: DictConfig | Mapping[str, Any], output_dir: str | Path | None = None,
        display: Display | None = None) -> Sweep:
    """Measures the configured variant at every sequence length; writes results.jsonl, results.csv,
    env.json, status.json and (with two or more lengths) fit.json into ``output_dir`` (default:
    ``cfg.output_dir``, else Hydra's output directory), and logs the run to wandb (``cfg.logger``).

    With ``resume`` (the default) points already in the directory's results.jsonl are kept, not measured
    again; status.json says running / completed / failed with the point counts (Hydra leaves no
    failure marker in a job's directory)."""
    settings, attn, device = validate(cfg)
    out_dir = resolve_output_dir(output_dir, settings)
    environment = envmod.collect(device)
    attn.to(device)
    attn.requires_grad_(settings.measure.param_grads)
    budget = memory_budget_bytes(settings, device)
    options = tuple(dataclasses.asdict(attn.options).items())
    shown = ", ".join(f"{k}={v}" for k, v in options if k != "backend")
    title = (f"{attn.name} ({shown + '; ' if shown else ''}backend {attn.backend}) on {device.type} "
             f"({environment.device_name}), {settings.dtype}, "
             f"B={settings.batch_size} H={settings.num_heads} D={settings.head_dim}"
             f"{' causal' if settings.causal else ''} -> {out_dir}")
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    display = display or Display(title, len(settings.seq_lens))
    status = JobStatus(out_dir, len(settings.seq_lens))
    task_cache: dict[int, dict[str, Any]] = {}  # task.seq_len fixed: trained once, reused at every point
    try:
        with ResultWriter(out_dir, resume=settings.resume) as writer, \
                wandb_run(settings.logger, out_dir, {**config, "env": environment.as_dict()},
                          name=f"{attn.name}/{attn.backend}", group=sweep_group(settings),
                          tags=[attn.name, attn.backend, device.type]) as logger, display:
            write_json(out_dir / "env.json", {**environment.as_dict(), "date": envmod.now(), "config": config})
            wanted = {resume_key(point_identity(attn, settings, device, n), options): n for n in settings.seq_lens}
            done = [r for r in writer.rows if resume_key(r.record(), r.options) in wanted]
            for row in done:  # measured by an earlier run into this directory: shown and logged, not redone
                display.add(row)
                logger.log_point(row.record())
            measured = {resume_key(r.record(), r.options) for r in done}
            status.update(done)
            for key, seq_len in wanted.items():
                if key in measured:
                    continue
                row = run_point(attn, settings, seq_len, device, environment, budget, options,
                                on_phase=lambda phase, n=seq_len: display.phase(n, phase),
                                task_log=lambda step, m, n=seq_len: logger.log_task_step(n, step, m),
                                task_cache=task_cache)
                writer.add(row)
                done.append(row)
                logger.log_point(row.record())
                display.add(row)
                status.update(done)
            fits = fit_exponents(done)
            if fits:
                write_json(out_dir / "fit.json", {"variant": attn.name, "backend": attn.backend,
                                                  "options": dict(options), "fits": fits})
                display.fits(fits, sorted({n for f in fits.values() for n in f["seq_lens"]}))
            logger.log_points_table([r.record() for r in done])
            logger.summary({f"fit/{name}": f["fitted"] for name, f in fits.items()})
    except BaseException as e:  # KeyboardInterrupt too: the directory says the job did not finish
        status.finish("failed", one_line(f"{type(e).__name__}: {e}")[:500])
        raise
    status.finish("completed")
    return Sweep(done, fits, out_dir)


def point_identity(attn: variants.Attention, s: Settings, device: torch.device, seq_len: int) -> dict[str, Any]:
    """The fields that say which measurement a point is (with the variant's options): the start of its
    record, and, for resuming, what makes two points the same."""
    return dict(variant=attn.name, backend=attn.backend, seq_len=seq_len, batch_size=s.batch_size,
                num_heads=s.num_heads, head_dim=s.head_dim, dtype=s.dtype, device=device.type, causal=s.causal,
                seed=s.seed, inputs=s.inputs if s.fidelity.enabled else None,
                task="mqar" if s.task is not None else None)


def resume_key(identity: Mapping[str, Any], options: tuple) -> tuple:
    """A point's identity (``point_identity``'s fields, read from a new point or a stored row) and options."""
    fields = ("variant", "backend", "seq_len", "batch_size", "num_heads", "head_dim", "dtype", "device",
              "causal", "seed", "inputs", "task")
    return (*(identity[f] for f in fields), json.dumps(dict(options), sort_keys=True, default=str))


def sweep_group(s: Settings) -> str | None:
    """The wandb group: ``logger.group``, else the sweep's (``sweep_group_name``) under a Hydra multirun."""
    if s.logger.group is not None:
        return s.logger.group
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return sweep_group_name(HydraConfig.get().sweep.dir)
    return None


class JobStatus:
    """``status.json``: state (running | completed | failed | refused), point counts by status, pid, host,
    times."""

    def __init__(self, out_dir: Path, total: int | None) -> None:
        self.path = Path(out_dir) / "status.json"
        self.info: dict[str, Any] = {"state": "running", "points_total": total, "points_done": 0,
                                     "statuses": {}, "pid": os.getpid(), "hostname": socket.gethostname(),
                                     "started": envmod.now(), "updated": envmod.now(), "error": None}

    def update(self, done: list[Result]) -> None:
        statuses: dict[str, int] = {}
        for r in done:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        self.info.update(points_done=len(done), statuses=statuses, updated=envmod.now())
        self._write()

    def finish(self, state: str, error: str | None = None) -> None:
        self.info.update(state=state, error=error, updated=envmod.now())
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, self.info)


def run_point(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device,
              environment: envmod.Environment, budget: int | None, options: tuple,
              on_phase=lambda phase: None, task_log=None, task_cache: dict | None = None) -> Result:
    B, H, N, D = s.batch_size, s.num_heads, seq_len, s.head_dim
    element_size = torch.empty((), dtype=s.torch_dtype).element_size()
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(**point_identity(attn, s, device, N), status="ok", timer=timer_name(device, s.measure),
               **{k: v for k, v in environment.as_dict().items() if k in FIELDS})
    oom = False
    load = envmod.OtherLoad()
    try:
        flops = attn.flops(B, H, N, D, s.causal)
        rec.update(flops_fwd=flops.executed, flops_fwd_useful=flops.useful, density=attn.density(N, s.causal),
                   block_density=attn.block_density(N, s.causal) if isinstance(attn, MaskedAttention) else None,
                   analytic_mem_bytes=attn.memory_bytes(B, H, N, D, element_size, s.causal))
        # q, k, v and the output gradient are allocated too; the analytic figure counts only the extra.
        needed = rec["analytic_mem_bytes"] + 4 * B * H * N * D * element_size
        if budget is not None and needed > budget:
            rec.update(status="skipped",
                       reason=f"analytic memory {needed / 1e9:.3g} GB (inputs included) exceeds the memory "
                              f"budget {budget / 1e9:.3g} GB (memory_budget_gb)")
        else:
            load.start()
            measure_point(attn, batch_size=B, num_heads=H, seq_len=N, head_dim=D, dtype=s.torch_dtype,
                          device=device, causal=s.causal, seed=s.seed, opts=s.measure, record=rec,
                          on_phase=on_phase)
            rec["backend_ran"] = getattr(attn, "last_backend", None) or attn.backend
            if attn.backend == "flex":  # what the kernel computed: whole tiles of its BlockMask (cached
                from variants.flex import block_mask_stats  # on the device by the warm-up)

                rec["flops_fwd"] = 4 * B * H * D * block_mask_stats(attn, N, s.causal, device)["executed_pairs"]
    except OutOfMemoryError as e:
        oom = True
        rec.update(status="oom", reason=one_line(e)[:500])
    except Exception as e:  # recorded; the next point still runs
        message = str(e) if isinstance(e, VariantError) else f"{type(e).__name__}: {e}"
        rec.update(status="error", reason=one_line(message)[:500])
    if oom or device.type == "cuda":
        gc.collect()  # the exception's frames held the point's tensors until here
        if device.type == "cuda":
            torch.cuda.empty_cache()
    f, fu = rec["flops_fwd"], rec["flops_fwd_useful"]
    if f is not None:
        k = BACKWARD_FLOPS_FACTOR
        rec.update(tflops_fwd=tflops(f, rec["fwd_ms"]), tflops_fwd_useful=tflops(fu, rec["fwd_ms"]),
                   tflops_bwd=tflops(int(k * f), rec["bwd_ms"]), tflops_bwd_useful=tflops(int(k * fu), rec["bwd_ms"]),
                   tflops_fwd_bwd=tflops(int((1 + k) * f), rec["fwd_bwd_ms"]),
                   tflops_fwd_bwd_useful=tflops(int((1 + k) * fu), rec["fwd_bwd_ms"]))
    if rec["status"] == "ok":
        quality(attn, s, seq_len, device, rec, on_phase, task_log, task_cache if task_cache is not None else {})
    rec["other_cpu_cores"] = load.stop()
    rec["date"] = envmod.now()
    return Result(**rec, options=options)


# ----- quality: fidelity against exact attention, and the task ------------------------------------

def quality(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device, rec: dict[str, Any],
            on_phase, task_log, task_cache: dict[int, dict[str, Any]]) -> None:
    """Fidelity and task numbers into ``rec``. A failure here (out of memory in the float64 reference,
    a task that diverges) leaves the timing intact: the numbers stay None and ``quality_reason`` says why."""
    reasons = []
    if s.fidelity.enabled:
        if s.fidelity.max_seq_len is not None and seq_len > s.fidelity.max_seq_len:
            reasons.append(f"fidelity: N > fidelity.max_seq_len={s.fidelity.max_seq_len}")
        else:
            on_phase("fidelity")
            reasons.append(guarded("fidelity", device, lambda: rec.update(point_fidelity(attn, s, seq_len, device))))
    if s.task is not None:
        on_phase("task")
        cfg = task_config(s, seq_len)

        def train() -> None:
            if cfg.seq_len not in task_cache:
                task_cache[cfg.seq_len] = train_task(attn, s, cfg, device, task_log)
            rec.update(task_cache[cfg.seq_len])

        reasons.append(guarded("task", device, train))
    reasons = [r for r in reasons if r]
    rec["quality_reason"] = "; ".join(reasons) or None


def guarded(what: str, device: torch.device, fn) -> str | None:
    try:
        fn()
    except Exception as e:  # OutOfMemoryError included: recorded, the point and the sweep go on
        message = str(e) if isinstance(e, (VariantError, ConfigError)) else f"{type(e).__name__}: {e}"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return one_line(f"{what}: {message}")[:300]
    return None


def point_fidelity(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device) -> dict[str, Any]:
    from .fidelity import fidelity, make_inputs

    gen = torch.Generator().manual_seed(s.seed)
    q, k, v = make_inputs(s.inputs, s.fidelity.batch_size, s.num_heads, seq_len, s.head_dim,
                          dtype=s.torch_dtype, device=device, generator=gen)  # (B, H, N, D)
    result = fidelity(attn, q, k, v, causal=s.causal, block_size=s.fidelity.block_size, grad_seed=s.seed)
    bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"non-finite {', '.join(bad)} (the variant's output or gradients overflow "
                                 f"in {s.dtype})")
    return result


def train_task(attn: variants.Attention, s: Settings, cfg, device: torch.device, task_log) -> dict[str, Any]:
    from .task import train_mqar

    options = dataclasses.asdict(attn.options)
    if options.get("num_heads") is not None:
        options["num_heads"] = cfg.n_heads  # linear share=none: one E_h, F_h per head of the task's model
    out = train_mqar(attn.name, options, cfg, log=task_log, device=device)
    return {"task_seq_len": cfg.seq_len, "task_accuracy": out["task_accuracy"], "task_loss": out["task_loss"],
            "task_chance_accuracy": out["chance_accuracy"], "task_train_s": out["train_seconds"]}
