"""``run(cfg)``: validate a composed config, then measure one variant at each sequence length.

Everything is validated before any file is written: the workload, the measurement options, the device,
the variant (built, so that its own checks run) and causal support. Bad input raises ``ConfigError`` or
``variants.VariantError``, both ValueErrors with a one-line message naming the problem and the allowed
values. After that, a failure at one point is a result (``oom``, ``skipped``, ``error``), never a crash.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

import variants
from variants import VariantError

from . import distributed
from . import env as envmod
from .config import DEFAULT_BUDGET_SHARE, INT64_MAX, ConfigError, Settings, one_line, settings_from_config
from .console import Display
from .logger import sweep_group_name, wandb_run
from .measure import measure_point, noise, noise_fields, retry_helps, spare_cores, timer_name
from .memory import check_fits, device_lost, is_out_of_memory, release_memory, tensor_bytes
from .quality import check_task, quality, task_config, task_options
from .results import (BACKWARD_FLOPS_FACTOR, FIELDS, OPT_PREFIX, SLOW, TASK_OPT_PREFIX, JobStatus, LockedError,
                      Result, ResultStore, Sink, Sweep, fit_exponents, machine, point_key, series_key, tflops,
                      write_json)
from .signals import PENDING_INTERRUPTS, Terminated, TimeLimit, interrupts_deferred, raise_pending_interrupt  # noqa: F401


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available on this machine; allowed here: auto, cpu")
    return torch.device(name)


def build_variant(variant_cfg: Mapping[str, Any]) -> variants.Attention:
    """Instantiates the variant's ``_target_`` with its options; the variant's own VariantError (unknown
    option, bad value) is re-raised as it is, not wrapped in Hydra's multi-line InstantiationException.
    Built on the meta device first: tensors this machine cannot hold are refused (``check_fits``)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:  # its tensors counted first, nothing allocated
        with torch.device("meta"):
            sized = instantiate(dict(variant_cfg))
    except Exception:  # a bad option, or an __init__ that reads tensors' values (not on meta): said below
        sized = None
    if isinstance(sized, variants.Attention):
        check_fits(f"variant {sized.name}'s parameters and buffers", tensor_bytes(sized),
                   "options whose tensors fit (linear: E and F hold proj_dim × max_seq_len numbers each)")
    try:
        attn = instantiate(dict(variant_cfg))
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, VariantError):
            raise VariantError(str(cause)) from None
        raise ConfigError(one_line(f"cannot build variant {variant_cfg.get('_target_')!r}: {cause or e}")) from None
    if not isinstance(attn, variants.Attention):
        raise ConfigError(f"variant _target_ {variant_cfg.get('_target_')!r} is not an attention variant (a "
                          f"subclass of variants.Attention); the project's: "
                          f"{', '.join(f'variants.{c.__name__}' for c in variants.REGISTRY.values())}")
    return attn


def validate(cfg: DictConfig | Mapping[str, Any]) -> tuple[Settings, variants.Attention, torch.device]:
    """All the checks of bad input, before any file is written. Raises ConfigError or VariantError."""
    settings = settings_from_config(cfg)
    device = resolve_device(settings.device)
    attn = build_variant(settings.variant)
    if settings.causal and not attn.supports_causal:
        raise VariantError(attn.causal_error())
    if (error := attn.unavailable_error(attn.backend, device)) is not None:
        raise ConfigError(error)
    if settings.fidelity.enabled and settings.inputs == "local" and settings.head_dim % 2:
        raise ConfigError(f"inputs=local needs an even head_dim (cos/sin pairs); got head_dim={settings.head_dim}; "
                          f"allowed inputs here: gaussian, peaked")
    if settings.task is not None:
        check_task(attn, settings)
    check_memory_budget(settings, device)
    distributed.check(settings, attn, device)
    return settings, attn, device


def check_memory_budget(settings: Settings, device: torch.device) -> None:
    """On CPU a budget above the machine's physical memory would let the kernel's OOM killer end the run
    instead of a recorded skip: refused. (On GPU an out-of-memory is caught and recorded, so a budget
    there only spares the time of points that clearly cannot fit.)"""
    total = envmod.mem_total_bytes()
    if device.type != "cpu" or settings.memory_budget_gb is None or total is None:
        return
    if settings.memory_budget_gb * 1e9 > total:
        raise ConfigError(f"memory_budget_gb={settings.memory_budget_gb:g} exceeds this machine's physical memory "
                          f"(MemTotal {total / 1e9:.3g} GB); allowed: a number of GB up to {total / 1e9:.3g}, or "
                          f"null for {DEFAULT_BUDGET_SHARE} x MemAvailable")


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


class RunInterrupted(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM (a scheduler's cancel) during a run: the directory's status says
    interrupted; ``message`` is the one line to print, ``exit_code`` 130 or 143 (128 + the signal)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message, self.exit_code = message, exit_code


class DirectoryInUse(ConfigError):
    """Another live run holds the output directory (one line naming it): refused, exit 2, its files
    left untouched."""


class RunFailed(Exception):
    """The run could not go on (its output directory stopped taking writes, or the process lost its CUDA
    context): one line; status failed."""


# The points at which this process lost its device (harness.memory.device_lost): the point is recorded as
# an error, its run stops, and every later run in this process (a sweep's next jobs) fails at once, measuring
# nothing, instead of recording errors that are not their own; a new process (rerun) goes on.
LOST: list[str] = []


def team_lost_message(lost: str, done: int, wanted: int) -> str:
    return (f"{lost}, after {done} of {wanted} points; the point it broke in is recorded as an error, and "
            f"rerunning the same command goes on with a new group (retry=error measures that point again)")


def device_gone_message(done: int, wanted: int) -> str:
    return (f"the CUDA context was lost at {LOST[0]} (a sticky CUDA error: an illegal memory access or a "
            f"device-side assert), after {done} of {wanted} points; that point is recorded as an error, and "
            f"rerunning the same command goes on in a new process")


def run(cfg: DictConfig | Mapping[str, Any], output_dir: str | Path | None = None) -> Sweep:
    """Measures the configured variant at every sequence length; writes results.jsonl, results.csv,
    env.json, status.json and (with two or more lengths) fit.json into ``output_dir`` (default:
    ``cfg.output_dir``, else Hydra's output directory), and logs the run to wandb (``cfg.logger``).

    The directory is locked for the run (a second run refuses: ``LockedError``, a ConfigError). With
    ``resume`` (the default) points already in its results.jsonl are kept, not measured again (except
    those named by ``retry``); status.json says running / completed / failed / interrupted with the
    point counts. Raises ConfigError/VariantError on bad input (nothing written), RunInterrupted on
    Ctrl-C or SIGTERM, RunFailed when the directory stops taking writes."""
    settings, attn, device = validate(cfg)
    with distributed.team(cfg, settings, attn, device) as team:  # None: one process
        if team is not None and team.rank != 0:
            team.serve()  # measures the points rank 0 names; rank 0 writes them
            return None
        out_dir = resolve_output_dir(output_dir, settings)
        total = len(settings.seq_lens)
        try:
            def said(e: BaseException) -> None:  # an OSError is refused below (ConfigError, exit 2): none
                if not isinstance(e, OSError):
                    ended_unstarted(out_dir, total, e)
            store = ResultStore(out_dir, resume=settings.resume, sweep=sweep_dir(), on_failure=said)
        except KeyboardInterrupt as e:  # while the store opened: said in its status.json if it held the lock
            raise RunInterrupted(*interruption(e, 0, total)) from None
        except LockedError as e:
            raise DirectoryInUse(str(e)) from None
        except OSError as e:  # named down to the file (a read-only results.jsonl in a writable directory)
            file = f" ({Path(e.filename).name})" if e.filename and Path(e.filename) != Path(out_dir) else ""
            raise ConfigError(f"cannot write to the output directory {out_dir}{file}: {e.strerror or e}") from None
        with store:
            return _run(cfg, team.settings if team else settings, attn, device, store, team)


def _run(cfg, settings: Settings, attn: variants.Attention, device: torch.device, store: ResultStore,
         team: distributed.Team | None = None) -> Sweep:
    out_dir = store.output_dir
    try:  # before the run's own status (moving the variant, reading the directory): said in one all the same
        environment = envmod.collect(device)
        attn.to(device)
        attn.requires_grad_(settings.measure.param_grads)
        budget = memory_budget_bytes(settings, device)
        if team is not None and budget is not None:  # the ranks on this machine share it
            budget //= attn.world_size
        label = variant_label(attn)
        title = (f"{label} on {device.type} ({environment.device_name}), {settings.dtype}, "
                 f"B={settings.batch_size if settings.tokens_per_batch is None else f'{settings.tokens_per_batch}/N'} "
                 f"H={settings.num_heads} D={settings.head_dim}"
                 f"{' causal' if settings.causal else ''} -> {out_dir}")
        config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        wanted = wanted_points(attn, settings, device)
        stored = store.current()
        # Measured by an earlier run into this directory (and written and logged by it): shown and counted,
        # unless retried or lacking what this run measures (then measured again: the new row supersedes)
        resumed = {key: stored[key] for key in wanted if key in stored and not retried(stored[key], settings.retry)}
        here = machine({**environment.as_dict(), "device": device.type})
        # This series' points in the directory, the run's lengths or not (stop_on_oom looks at all of them),
        # those of this machine only: an oom or a skip for memory says nothing of another machine
        series = series_key(point_identity(attn, settings, device, settings.seq_lens[0]))
        series_rows = {key: row for key, row in stored.items() if series_key(row) == series and machine(row) == here}
        # What still stops a length under stop_on_oom: the series' rows but those this run measures again
        standing = [row for key, row in series_rows.items() if key not in wanted or key in resumed]
        again = {wanted[key]: lacks for key, row in resumed.items() if (lacks := lacking(row, settings, here, standing))}
        keep = [key for key in resumed if wanted[key] not in again]
        kept = [Result.from_record(resumed[key]) for key in keep]
        done: list[Result] = list(kept)
        display = Display(title, len(settings.seq_lens), task=settings.task is not None, kept=kept, again=again)
        status = JobStatus(out_dir, len(settings.seq_lens), done=kept, job=job_num())
        task_cache: dict[int, dict[str, Any]] = {}  # task.seq_len fixed: trained once, reused at every point
    except KeyboardInterrupt as e:  # a sweep counts its jobs by their status.json
        ended_unstarted(out_dir, len(settings.seq_lens), e)
        raise RunInterrupted(*interruption(e, 0, len(settings.seq_lens))) from None
    except Exception as e:
        ended_unstarted(out_dir, len(settings.seq_lens), e)
        raise
    try:
        status.save()  # "running", the kept points counted
        if LOST:
            raise RunFailed(device_gone_message(len(done), len(wanted)))
        write_json(out_dir / "env.json", {**environment.as_dict(), "date": envmod.now(), "config": config})
        with wandb_run(settings.logger, out_dir, {**config, "variant_name": attn.name, "variant_label": label,
                                                  "env": environment.as_dict()},
                       name=label, group=sweep_group(settings), tags=[attn.name, attn.backend, device.type]) as logger, \
                display:
            if unlogged := logger.add_unlogged(store.rows):
                store.warn(f"wandb: {len(unlogged)} point(s) of results.jsonl its wandb run had not logged (N="
                           f"{', '.join(map(str, unlogged))}; written with wandb off, or as a disk filled): logged now")
            sinks: list[Sink] = [store, logger, display, status]  # each new row: written, logged, shown, counted
            measured = set(keep)
            # stop_on_oom: shortest first, and once a length does not fit the longer ones are not tried
            order = sorted(wanted.items(), key=lambda item: item[1]) if settings.stop_on_oom else wanted.items()
            for key, seq_len in order:
                if key in measured:
                    continue
                raise_pending_interrupt()
                stop = stopped_by(series_rows.values(), seq_len) if settings.stop_on_oom else None
                if stop is None and settings.measure.max_call_s is not None:
                    stop = too_slow(attn, settings, series_rows.values(), seq_len)

                def on_phase(phase: str, n: int = seq_len) -> None:
                    raise_pending_interrupt()
                    display.phase(n, phase)

                # The curve's key is the length trained at: task.seq_len, where set, for every point
                trained_at = task_config(settings, seq_len).seq_len if settings.task is not None else seq_len

                def task_log(step: int, metrics: dict[str, float], n: int = trained_at) -> None:
                    raise_pending_interrupt()
                    logger.log_task_step(n, step, metrics)
                row = run_point(attn, settings, seq_len, device, environment, budget, stop=stop, on_phase=on_phase,
                                task_log=task_log, task_cache=task_cache,
                                measure=team.measure if team else measure_quietest)
                with interrupts_deferred():  # every sink has the row, and it counts as done, or none has it
                    for sink in sinks:
                        sink.add(row)
                    series_rows[key] = row.record()
                    done.append(row)
                if LOST:
                    raise RunFailed(device_gone_message(len(done), len(wanted)))
                if team is not None and team.lost:
                    raise RunFailed(team_lost_message(team.lost, len(done), len(wanted)))
            raise_pending_interrupt()
            sweep = Sweep(done, fit_exponents(done), out_dir)
            for sink in sinks:
                sink.complete(sweep)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through the command line's handler
        message, code = interruption(e, len(done), len(wanted))
        status.finish("interrupted", message)
        raise RunInterrupted(message, code) from None
    except OSError as e:  # the directory stopped taking writes (a full disk): what was written stands
        # counted from the file: a row appended before its results.csv could not be rewritten is there
        current = store.current()
        held = sum(key in current for key in wanted)
        message = one_line(f"cannot write results to {out_dir}: {e.strerror or e} ({held} of "
                           f"{len(wanted)} points are in results.jsonl; make room and rerun the same command "
                           f"to resume)")
        try:
            status.info.update(points_done=max(held, status.info["points_done"]))
            status.finish("failed", message)
        except OSError:
            pass
        raise RunFailed(message) from None
    except RunFailed as e:
        status.finish("failed", one_line(e)[:500])
        raise
    except BaseException as e:
        status.finish("failed", one_line(f"{type(e).__name__}: {e}")[:500])
        raise
    return sweep


def interruption(e: KeyboardInterrupt, done: int, wanted: int) -> tuple[str, int]:
    """Ctrl-C, or SIGTERM through the command line's handler: the run's one line and exit code."""
    signal_name, code = (e.NAME, e.EXIT_CODE) if isinstance(e, Terminated) else ("Ctrl-C", 130)
    return f"interrupted ({signal_name}) after {done} of {wanted} points; rerun the same command to resume", code


def ended_unstarted(out_dir: Path, total: int, e: BaseException) -> None:
    """status.json says how a run ended before its first point, while it held the directory: interrupted,
    or failed with the error (a file of the directory the store could not read, say). It said the last
    run's state before: "completed", and a sweep then counted the job as not run by it at all."""
    try:
        if isinstance(e, KeyboardInterrupt):
            JobStatus(out_dir, total, job=job_num()).finish("interrupted", interruption(e, 0, total)[0])
        else:
            JobStatus(out_dir, total, job=job_num()).finish("failed", one_line(f"{type(e).__name__}: {e}")[:500])
    except OSError:  # the directory takes no writes: the error said is the run's own
        pass


def stopped_by(rows: Iterable[Mapping[str, Any]], seq_len: int) -> str | None:
    """Why ``seq_len`` is not run under stop_on_oom: the shortest shorter point of the series that ran
    out of memory (oom) or was skipped for it, if any. A point stop_on_oom skipped is no cause of its own
    (its cause is a shorter point, or gone: measured again, and fitting now), nor one skipped for time."""
    first = min((r for r in rows if r["seq_len"] < seq_len and (r["status"] == "oom" or r["status"] == "skipped"
                 and not any(w in (r.get("reason") or "") for w in (STOPPED, SLOW)))),
                key=lambda r: r["seq_len"], default=None)
    if first is None:
        return None
    return (f"not run: N={first['seq_len']} was {first['status']} ({STOPPED}: a longer sequence needs more memory; "
            "stop_on_oom=false runs it anyway)")


def too_slow(attn: variants.Attention, s: Settings, rows: Iterable[Mapping[str, Any]], seq_len: int) -> str | None:
    """Why ``seq_len`` is not run under measure.max_call_s: its forward+backward call, predicted from the
    longest shorter point of the series that was timed, times the executed FLOPs' ratio, would take
    longer. Each try of such a point costs several calls per pass (min_samples), up to max_run_time each:
    minutes of a device's time for one point of an O(N²) series at 64K. None: not predicted slower."""
    timed = [r for r in rows if r["status"] == "ok" and r["seq_len"] < seq_len and call_ms(r) is not None]
    if not timed:
        return None
    base = max(timed, key=lambda r: r["seq_len"])
    flops = [attn.flops(s.batch_at(n), s.num_heads, n, s.head_dim, s.causal).executed
             for n in (base["seq_len"], seq_len)]
    ratio = flops[1] / flops[0] if flops[0] else float("inf")
    predicted = call_ms(base) * ratio / 1e3
    if predicted <= s.measure.max_call_s:
        return None
    return (f"not run: a forward+backward call predicted {predicted:.3g} s > {SLOW}={s.measure.max_call_s:g} "
            f"(N={base['seq_len']} took {call_ms(base):.4g} ms, times the executed FLOPs' ratio {ratio:.3g}; "
            f"{SLOW}=null runs it)")


def call_ms(row: Mapping[str, Any]) -> float | None:
    """A timed point's forward+backward call: its fwd_bwd pass, else its fwd and bwd passes summed."""
    if row.get("fwd_bwd_ms") is not None:
        return row["fwd_bwd_ms"]
    parts = [row.get(f"{p}_ms") for p in ("fwd", "bwd") if row.get(f"{p}_ms") is not None]
    return sum(parts) if parts else None


def variant_label(attn: variants.Attention) -> str:
    """``name[option=value,...]/backend``: the variant as configured, for titles, wandb names and grouping."""
    shown = ",".join(f"{k}={v}" for k, v in sorted(dataclasses.asdict(attn.options).items())
                     if k != "backend" and v is not None)
    return f"{attn.name}{f'[{shown}]' if shown else ''}/{attn.backend}"


def retried(row: Mapping[str, Any], retry: tuple[str, ...]) -> bool:
    """Whether a stored row is to be measured again (``retry``: statuses, or noisy)."""
    return row["status"] in retry or ("noisy" in retry and bool(row.get("noisy")))


STOPPED = "stop_on_oom"  # in the reason of a point skipped because a shorter one did not fit


def lacking(row: Mapping[str, Any], s: Settings, here: tuple[Any, Any] | None = None,
            standing: Iterable[Mapping[str, Any]] | None = None) -> list[str]:
    """What this run measures that a stored point lacks: a time or memory measured on this machine
    (``here``: its ``machine``; a stored oom or skip belongs to its machine too), or, at an ok point, a
    pass of ``measure.passes``, ``measure.memory``, fidelity past a lower ``fidelity.max_seq_len``. Such a
    point is measured again rather than returned without them. Quality-only runs ignore the machine. A
    point stop_on_oom skipped lacks a measurement once nothing of the series that this run keeps
    (``standing``) stops it: its cause is measured again (retry), or gone."""
    if here is not None and (s.measure.passes or s.measure.memory) and machine(row) != here:
        name, threads = machine(row)
        return [f"measurement on this machine (it was measured on {name}{f', {threads} threads' if threads else ''})"]
    if row["status"] == "skipped" and STOPPED in (row.get("reason") or ""):
        if not s.stop_on_oom:
            return ["a measurement (stop_on_oom had skipped it; stop_on_oom=false runs it)"]
        if standing is not None and stopped_by(standing, row["seq_len"]) is None:
            return ["a measurement (stop_on_oom had skipped it; no shorter point of the series kept from earlier "
                    "runs is oom or skipped for its memory)"]
    if row["status"] != "ok":
        cap = re.search(rf"{re.escape(SLOW)}=([0-9.e+-]+) ", row.get("reason") or "")  # a skip for time
        if cap and (s.measure.max_call_s is None or s.measure.max_call_s > float(cap.group(1))):
            return [f"a measurement ({SLOW}={cap.group(1)} had skipped it; now {s.measure.max_call_s})"]
        return []
    lacks = [f"{name} time" for name in s.measure.passes if row.get(f"{name}_ms") is None]
    if s.measure.memory and row.get("peak_mem_bytes") is None:
        lacks.append("peak memory")
    f = s.fidelity
    if (f.enabled and (f.max_seq_len is None or row["seq_len"] <= f.max_seq_len) and row.get("out_rel_err") is None
            and "fidelity.max_seq_len" in (row.get("quality_reason") or "")):
        lacks.append("fidelity")
    return lacks


def wanted_points(attn: variants.Attention, s: Settings, device: torch.device) -> dict[tuple, int]:
    """point_key -> N of every point the run asks for."""
    return {point_key(point_identity(attn, s, device, n)): n for n in s.seq_lens}


def point_identity(attn: variants.Attention, s: Settings, device: torch.device, seq_len: int) -> dict[str, Any]:
    """The fields that say which measurement a point is (``results.point_key`` compares them): the start
    of its record, the variant's options (opt_*) and the task's settings (task_opt_*) included."""
    has_parameters = any(True for _ in attn.parameters())
    return dict(variant=attn.name, backend=attn.backend, seq_len=seq_len, batch_size=s.batch_at(seq_len),
                tokens_per_batch=s.tokens_per_batch, num_heads=s.num_heads, head_dim=s.head_dim, dtype=s.dtype,
                device=device.type, causal=s.causal,
                seed=s.seed, inputs=s.inputs if s.fidelity.enabled else None,
                fidelity_batch_size=s.fidelity.batch_size if s.fidelity.enabled else None,
                task="mqar" if s.task is not None else None,
                param_grads=s.measure.param_grads if has_parameters else None,
                **{f"{OPT_PREFIX}{k}": v for k, v in dataclasses.asdict(attn.options).items()},
                **{f"{TASK_OPT_PREFIX}{k}": v for k, v in task_options(s, attn, seq_len)})


def sweep_dir() -> str | None:
    """The sweep directory (absolute) of the Hydra multirun this run is a job of; None outside one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return str(Path(HydraConfig.get().sweep.dir).resolve())
    return None


def job_num() -> int | None:
    """The Hydra job number of the multirun job this run is (status.json says it: jobs may share a
    directory); None outside a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return int(HydraConfig.get().job.num)
    return None


def sweep_group(s: Settings) -> str | None:
    """The wandb group: ``logger.group``, else the sweep's (``sweep_group_name``) under a Hydra multirun."""
    if s.logger.group is not None:
        return s.logger.group
    sweep = sweep_dir()
    return None if sweep is None else sweep_group_name(sweep)


def run_point(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device,
              environment: envmod.Environment, budget: int | None,
              on_phase=lambda phase: None, task_log=None, task_cache: dict | None = None,
              stop: str | None = None, measure=None) -> Result:
    """One point measured (by ``measure``, default measure_quietest; or, with ``stop``, recorded skipped
    with that reason): never raises for a failure of the point itself."""
    B, H, N, D = s.batch_at(seq_len), s.num_heads, seq_len, s.head_dim
    element_size = torch.empty((), dtype=s.torch_dtype).element_size()
    identity = point_identity(attn, s, device, N)
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update({k: v for k, v in identity.items() if k in FIELDS}, status="ok", timer=timer_name(device, s.measure),
               **{k: v for k, v in environment.as_dict().items() if k in FIELDS})
    try:
        flops = attn.flops(B, H, N, D, s.causal)
        rec.update(flops_fwd=flops.executed, flops_fwd_useful=flops.useful, density=attn.density(N, s.causal),
                   block_density=attn.block_density(N, s.causal),
                   # with measure.param_grads the backward also allocates each parameter's gradient (linear's
                   # E and F: proj_dim × max_seq_len each, whatever N)
                   analytic_mem_bytes=attn.memory_bytes(B, H, N, D, element_size, s.causal, device)
                   + sum(p.numel() * p.element_size() for p in attn.parameters() if p.requires_grad))
        # q, k, v and the output gradient are allocated too; the analytic figure counts only the extra.
        needed = rec["analytic_mem_bytes"] + 4 * B * H * N * D * element_size
        # Sizes each within int64 whose product is not (a row could not hold it): no machine runs them
        huge = {k: rec[k] for k in ("flops_fwd", "flops_fwd_useful", "analytic_mem_bytes") if (rec[k] or 0) > INT64_MAX}
        if huge:
            rec.update(dict.fromkeys(huge), status="skipped", reason=", ".join(f"{k} {v:.3g}" for k, v in huge.items())
                       + " past a 64-bit integer: no machine runs this point")
        elif stop is not None:
            rec.update(status="skipped", reason=stop)
        elif budget is not None and needed > budget:
            rec.update(status="skipped",
                       reason=f"analytic memory {needed / 1e9:.3g} GB (inputs included) exceeds the memory "
                              f"budget {budget / 1e9:.3g} GB (memory_budget_gb)")
        else:
            rec = (measure or measure_quietest)(attn, s, N, device, rec, on_phase)
            # What ran: the kernel the backend chose (full's auto), and the FLOPs it executed counted on the
            # device, where some backends know them only (flex: its BlockMask's tiles, built by prepare).
            rec.update(backend_ran=attn.backend_ran, flops_fwd=attn.flops(B, H, N, D, s.causal, device).executed)
    except RunFailed:  # not the point's: the run cannot go on (a sequence-parallel group lost a rank)
        raise
    except Exception as e:  # recorded; the next point still runs
        rec.update(failure(e))
    if rec["status"] in ("oom", "error") or device.type == "cuda":
        release_memory(device)  # the exception's frames held the point's tensors until here
    f, fu = rec["flops_fwd"], rec["flops_fwd_useful"]
    if f is not None:
        k = BACKWARD_FLOPS_FACTOR
        rec.update(tflops_fwd=tflops(f, rec["fwd_ms"]), tflops_fwd_useful=tflops(fu, rec["fwd_ms"]),
                   tflops_bwd=tflops(int(k * f), rec["bwd_ms"]), tflops_bwd_useful=tflops(int(k * fu), rec["bwd_ms"]),
                   tflops_fwd_bwd=tflops(int((1 + k) * f), rec["fwd_bwd_ms"]),
                   tflops_fwd_bwd_useful=tflops(int((1 + k) * fu), rec["fwd_bwd_ms"]))
    if rec["status"] == "ok":
        quality(attn, s, seq_len, device, rec, on_phase, task_log, task_cache if task_cache is not None else {},
                budget=budget)
    failed = "reason" if rec["status"] == "error" else "quality_reason" if rec.get("quality_reason") else None
    if failed and device_lost(device):
        LOST.append(f"N={seq_len}")
        rec[failed] = one_line(f"{rec[failed]} (the CUDA context is lost: the run stops here)")[:500]
    rec["date"] = envmod.now()
    return Result.from_record({**identity, **rec})


def failure(e: Exception) -> dict[str, str]:
    """The status and reason a point records for the exception that ended it."""
    if is_out_of_memory(e):
        return {"status": "oom", "reason": one_line(e)[:500]}
    message = str(e) if isinstance(e, VariantError) else f"{type(e).__name__}: {e}"
    return {"status": "error", "reason": one_line(message)[:500]}


def measure_quietest(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device,
                     rec: dict[str, Any], on_phase) -> dict[str, Any]:
    """``rec`` measured (harness.measure) with others' load recorded over the measurement and the noise
    judged; with ``on_noise=retry`` a noisy point is measured again, up to ``max_tries`` times, and the
    quietest measurement is kept (fewest noise reasons, then the smallest relative spread). A retry
    that fails (an oom with the first try's memory still cached, a non-finite result) ends the retries
    and the quietest measurement before it is kept; the first try's failure is the point's."""
    best, fresh, failed = None, dict(rec), None
    for tries in range(1, s.measure.max_tries + 1):
        attempt = rec if tries == 1 else dict(fresh)  # the first fills rec: what it measured before a
        # failure (an OOM in the backward) is kept by the caller
        # Others' load from the end of the warm-up: the warm-up's compilation runs in worker processes
        # of our own (Inductor compiles Triton kernels in a pool), which /proc/stat counts as others.
        load = envmod.OtherLoad()

        def phase(p: str, t: int = tries) -> None:
            if p != "warm-up" and not load.started:
                load.start()
            on_phase(p if t == 1 else f"{p} (try {t})")
        try:
            measure_point(attn, batch_size=s.batch_at(seq_len), num_heads=s.num_heads, seq_len=seq_len,
                          head_dim=s.head_dim, dtype=s.torch_dtype, device=device, causal=s.causal, seed=s.seed,
                          opts=s.measure, record=attempt, on_phase=phase)
        except Exception as e:
            if best is None:
                raise
            release_memory(device)
            failed = f"try {tries} ended {failure(e)['status']}: {failure(e)['reason']}"
            break
        attempt["other_cpu_cores"] = load.stop()
        if attempt["status"] != "ok":  # nonfinite: nothing timed
            if best is None:
                return {**attempt, "tries": tries}
            failed = f"try {tries} ended {attempt['status']}: {attempt['reason']}"
            break
        found = noise(attempt, s.measure, spare_cores(device))
        attempt.update(noise_fields(found, attempt, s.measure))
        reasons = [reason for _, reason in found]
        if tries > 1:  # the warm-up that compiled was the first try's: the point's cost of getting ready
            attempt.update(setup_s=rec["setup_s"], warmup_s=rec["warmup_s"])
        if best is None or _noise_score(attempt, reasons) < _noise_score(*best):
            best = (attempt, reasons)
        if not reasons or s.measure.on_noise != "retry" or not retry_helps(reasons):
            break
        release_memory(device)  # the try's cached blocks, before the next one allocates afresh
    if failed is not None:  # said beside the kept try's noise (it is noisy: that is why it was retried)
        best[0]["noise_reasons"] = one_line(f"{best[0]['noise_reasons']}; {failed}")[:1000]
    return {**best[0], "tries": tries}


def _noise_score(rec: dict[str, Any], reasons: list[str]) -> tuple[int, float]:
    spreads = [rec[f"{p}_iqr_ms"] / rec[f"{p}_ms"] for p in ("fwd", "bwd", "fwd_bwd")
               if rec.get(f"{p}_iqr_ms") is not None and rec.get(f"{p}_ms")]
    return len(reasons), max(spreads, default=0.0)
