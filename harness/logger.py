"""wandb logging: one harness run is one wandb run, inside Hydra's output directory.

The mode is ``logger.mode`` when given, else ``WANDB_MODE``, else online with credentials and offline
without. Online never hangs the harness: a short init timeout, and on failure one warning line and an
offline run instead (the local results are written as always). The run is a context manager, so a job
that raises is closed as failed and the next job in the same process gets a run of its own. One
output directory is one wandb run: a rerun into it resumes the same run (its id is kept in
``wandb/harness-run.json``) and logs the points it measures, first the directory's rows the run has
not logged (added with wandb off, or as a disk filled; a new run: every row there); synced, each point is
uploaded once.
A rerun with ``resume=false`` replaces the directory's results and starts a new wandb run (the store
moves ``harness-run.json`` aside with results.jsonl), so the replaced points are not charted beside
the new ones.
"""

from __future__ import annotations

import json
import netrc
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

MODES = ("online", "offline", "disabled")
WANDB_ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # what wandb's settings take
# Per-point metrics plotted against seq_len; task curves have their own step.
POINT_METRICS = ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "peak_mem_bytes", "peak_mem_abs_bytes", "tflops_fwd",
                 "out_rel_err", "out_cos", "out_max_abs_err", "grad_rel_err", "mass_kept",
                 "task_accuracy", "task_loss")


@dataclass(frozen=True)
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    mode: str | None = None  # online | offline | disabled; null: WANDB_MODE, else by credentials
    project: str = "attention-harness"
    entity: str | None = None
    group: str | None = None  # None: the sweep directory under a Hydra multirun, else no group
    init_timeout_s: float = 20.0  # online only: then fall back to offline

    def __post_init__(self) -> None:
        if self.name not in ("wandb", "none"):
            raise ValueError(f"logger: unknown logger {self.name!r}; allowed: wandb, none")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"logger: unknown mode {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.name == "wandb":
            check_wandb_mode_env()


def check_wandb_mode_env() -> None:
    """wandb reads WANDB_MODE itself, whatever mode it is given, and refused another value with a traceback
    after the run had begun (the report's --wandb: after its files were written): refused first, in one line."""
    env = os.environ.get("WANDB_MODE")
    if env is not None and env not in WANDB_ENV_MODES:
        raise ValueError(f"environment variable WANDB_MODE={env!r} is not a wandb mode; allowed: "
                         f"{', '.join(WANDB_ENV_MODES)}, or unset")


def sweep_group_name(sweep_dir: str | Path) -> str:
    """The wandb group of a sweep: the last two parts of its directory (multirun/cpu_small/2026-11-22T07-24-36Z
    -> cpu_small/2026-11-22T07-24-36Z; Hydra's default multirun/DATE/TIME -> DATE/TIME). The harness's
    jobs, the report and the dashboard script all name a sweep's group with this one function."""
    path = Path(sweep_dir).resolve()
    return "/".join(path.parts[-2:])


def jobs_logger(sweep_dir: Path) -> dict[str, str]:
    """Where the sweep's wandb jobs logged: the ``logger.group``, ``.project`` and ``.entity`` they set
    (read from their .hydra/config.yaml), each key left out where no job set it (the group is then
    ``sweep_group_name(sweep_dir)``). The report's wandb run and the dashboard go there too. ValueError
    (one line) where the jobs set two of one: either place would leave the other's runs out, unsaid.
    Also ``mode`` where the jobs set one, online or offline (the report's run went online beside offline
    runs where credentials existed); none where they set none, disabled, or both."""
    from omegaconf import OmegaConf

    found: dict[str, set[str]] = {}
    for config in sorted(Path(sweep_dir).glob("*/.hydra/config.yaml")):
        logger = OmegaConf.to_container(OmegaConf.load(config)).get("logger") or {}
        if logger.get("name", "wandb") == "wandb":
            for key in ("group", "project", "entity", "mode"):
                if logger.get(key):
                    found.setdefault(key, set()).add(str(logger[key]))
    modes = found.pop("mode", set())
    if len(modes) == 1 and modes <= {"online", "offline"}:
        found["mode"] = modes
    for key, values in found.items():
        if len(values) > 1:
            raise ValueError(f"the sweep's jobs logged to several wandb {key}s ({', '.join(sorted(values))}); "
                             f"allowed: one logger.{key} for a sweep's jobs (report and chart each part apart)")
    return {key: values.pop() for key, values in found.items()}


def has_credentials() -> bool:
    """What wandb itself accepts, checked without importing it or touching the network: an API key or
    identity token in the environment, or a ~/.netrc entry for the wandb host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    if os.environ.get("NETRC"):
        paths = [Path(os.environ["NETRC"]).expanduser()]
    else:
        paths = [Path.home() / ".netrc", Path.home() / "_netrc"]
    for path in paths:
        try:
            if netrc.netrc(str(path)).authenticators(host) is not None:
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def resolve_mode(cfg: LoggerConfig) -> str:
    if cfg.name == "none":
        return "disabled"
    if cfg.mode is not None:
        return cfg.mode
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in MODES:
        return env
    if env == "dryrun":
        return "offline"
    return "online" if has_credentials() else "offline"


class RunLogger:
    """What the harness logs; a no-op when wandb is disabled. Every log call names its step explicitly,
    counted on from the steps the directory's earlier runs logged (``RunState``), so a resumed run
    continues the same history instead of restarting at step 0 (offline runs cannot ask the server)."""

    def __init__(self, run: Any | None, state: "RunState | None" = None) -> None:
        self.run, self.state = run, state
        if run is not None:
            run.define_metric("seq_len")
            for name in POINT_METRICS:
                run.define_metric(name, step_metric="seq_len")
            run.define_metric("task/step")
            run.define_metric("task/*", step_metric="task/step")

    @property
    def directory(self) -> Path | None:
        return None if self.run is None else Path(self.run.dir).parent

    def log(self, values: dict[str, Any]) -> None:
        """One step of the directory's run, after every step it logged before (its state in
        harness-run.json): a resumed run's history never goes back to a step it already has."""
        if self.run is not None:
            self.run.log(values, step=self.state.next_step())

    def add(self, row) -> None:
        """One measured point (a results.Result): every number of its row (seq_len is the x-axis), counted
        in the run's state (ResultStore compares the count with the rows the directory still holds)."""
        if self.run is not None:
            self._point(row.record())

    def _point(self, record: dict[str, Any]) -> None:
        self.state.points += 1  # saved with the step, before the log call
        self.log({k: v for k, v in record.items() if _is_number(v)})

    def add_unlogged(self, rows: list[dict[str, Any]]) -> list[int]:
        """The directory's rows (results.jsonl's, in file order) past the points its wandb run logged,
        logged now, before this run measures: rows a run with wandb off added, or one written as the disk
        filled (in results.jsonl, the run ended before its log call); a new wandb run, every row there.
        They are kept, not measured again, so no later run would log them. The run's points are then the
        file's rows, one for one, and the next rows it adds are logged as they come. Their lengths."""
        if self.run is None or self.state.points >= len(rows):
            return []
        unlogged = rows[self.state.points:]
        for record in unlogged:
            self._point(record)
        return [r["seq_len"] for r in unlogged]

    def log_task_step(self, seq_len: int, step: int, metrics: dict[str, float]) -> None:
        """One eval of the task trained at ``seq_len``: keys task/N<seq_len>/<metric>, so each length's
        training curve is a line of its own against task/step."""
        if self.run is not None:
            self.log({"task/step": step, **{f"task/N{seq_len}/{k}": v for k, v in metrics.items()}})

    def complete(self, sweep) -> None:
        """The run is done: a table of every point of its directory, and the fitted exponents."""
        if self.run is None:
            return
        from .results import latest, read_jsonl

        self.log_points_table(latest(read_jsonl(sweep.output_dir / "results.jsonl")))
        self.summary({f"fit/{name}": f["fitted"] for name, f in sweep.fits.items()})

    def log_points_table(self, rows: list[dict[str, Any]]) -> None:
        """A wandb.Table of all the directory's points and line plots of time and memory against seq_len."""
        if self.run is None or not rows:
            return
        import wandb

        columns = list(dict.fromkeys(c for r in rows for c in r))
        table = wandb.Table(columns=columns, data=[[table_cell(r.get(c)) for c in columns] for r in rows])
        ok = [r for r in rows if r.get("status") == "ok"]
        plots = {}
        for metric, title in (("fwd_bwd_ms", "forward+backward time (ms)"),
                              ("peak_mem_bytes", "peak memory, forward+backward (bytes)")):
            pts = [[r["seq_len"], r[metric]] for r in ok if r.get(metric) is not None]
            if pts:
                t = wandb.Table(columns=["seq_len", metric], data=pts)
                plots[f"plot/{metric}"] = wandb.plot.line(t, "seq_len", metric, title=f"{title} vs seq_len")
        self.log({"points": table, **plots})

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = v


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def table_cell(v: Any) -> Any:
    """A table cell: a list (noisy_passes, each rank's peak) as JSON text, as results.csv writes it."""
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v if v is None or isinstance(v, (int, float, str, bool)) else str(v)


RUN_STATE = Path("wandb", "harness-run.json")  # in the output directory


class RunState:
    """``<output dir>/wandb/harness-run.json``: the directory's wandb run id, the next step and the points
    logged, so every run into the directory resumes one wandb run (a sync uploads each point once). A run
    with ``resume=false`` starts a new wandb run: its ResultStore moves this file aside with the rows, and
    so it does where the run logged points whose rows the directory no longer holds (measured again, they
    would be charted twice in one history)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / RUN_STATE
        self.damaged: str | None = None  # what is wrong with a file that is not as save() writes it
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            saved = {}
        except (OSError, ValueError) as e:
            saved, self.damaged = {}, f"does not read as JSON ({type(e).__name__})"
        if not isinstance(saved, dict):
            saved, self.damaged = {}, "is not a JSON object"
        kinds = {"id": str, "next_step": int, "points": int}  # bool is an int: not one of these
        wrong = [k for k, kind in kinds.items() if k in saved and not (
            isinstance(saved[k], kind) and not isinstance(saved[k], bool) and (kind is str or saved[k] >= 0))]
        if wrong:
            saved, self.damaged = {}, f"holds {', '.join(f'{k}={saved[k]!r}'[:80] for k in wrong)}"
        self.run_id: str | None = saved.get("id")
        self.step: int = saved.get("next_step", 0)
        self.points: int = saved.get("points", 0)  # rows logged (a state of older code: 0, unknown)

    def save(self, run_id: str) -> None:
        from .results import write_json

        self.run_id = run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"id": run_id, "next_step": self.step, "points": self.points})

    def next_step(self) -> int:
        step, self.step = self.step, self.step + 1
        self.save(self.run_id)  # before the log call: a crash leaves a gap, never a repeated step
        return step


@contextmanager
def wandb_run(cfg: LoggerConfig, directory: Path, config: dict[str, Any], *, name: str | None = None,
              group: str | None = None, tags: list[str] | None = None) -> Iterator[RunLogger]:
    mode = resolve_mode(cfg)
    if mode == "disabled":
        yield RunLogger(None)
        return
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    state = RunState(directory)
    kwargs = dict(dir=str(directory), project=cfg.project, entity=cfg.entity, name=name, group=group, tags=tags,
                  reinit="create_new", id=state.run_id, resume="allow" if state.run_id else None)
    try:
        run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=cfg.init_timeout_s, silent=True),
                         **kwargs)
    except Exception as err:  # online init failed (no network, bad key): never lose the local results
        if mode != "online":
            raise
        print(f"warning: wandb online init failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
              f"logging offline instead (sync later with `wandb sync {directory}/wandb/offline-run-*`)",
              file=sys.stderr)
        run = wandb.init(mode="offline", settings=wandb.Settings(silent=True), **kwargs)
    # Not `with run:` — its __exit__ prints the traceback of whatever ended the run (an interrupt, a full
    # disk), where the harness says one line.
    exit_code = 1
    try:
        state.save(run.id)
        # A resumed run's config is replaced, not merged with a conflict: the rerun may add lengths.
        run.config.update(config, allow_val_change=True)
        yield RunLogger(run, state)
        exit_code = 0
    finally:
        run.finish(exit_code=exit_code)
