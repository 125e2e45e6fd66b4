"""A job of sweeps: harness sweeps (``python -m harness --multirun sweep=<preset> ...``) run one after
another, each in a process of its own, within a time budget, and resumed by the next invocation where a
budget or a failure stopped them. What an allocation of a few minutes on a CUDA machine needs: the GPU
benchmark (scripts/bench_gpu.py) is such a job.

    job = Job(Path("results/my-job"), budget_s=600)
    job.run([Step("a", "a:linear", "seq_len_scaling", ("variant=linear",), "a/linear"), ...])

- **Resume.** Each step is a sweep into ``<out>/<directory>``: the harness skips the points stored there.
  state.json records each step's outcome; a step is complete while state.json says so and every point of
  its sweep has its row (pending_points), so a point lost since, or a length added, reopens it.
- **Budget.** A sweep still running when the budget is spent gets SIGTERM (its job records interrupted),
  30 s to end, then a kill. A step left with under 20 s is not started.
- **Isolation.** A crash (a segfault, a lost CUDA context) ends its step, not the job; a failed step is run
  once more at once, in a new process that skips what is stored. An invocation holds the job's directory
  (``hold``): a second one into it at once is refused.
- **Compiling ahead.** Backends that compile per N (COMPILED: FlexAttention) compile each point's kernels
  on its warm-up, one after another in their sweep. Where a run of such sweeps begins (steps with
  ``compiled``), their pending points are first run as warm-up calls only, several processes at once:
  torch's compile caches keep what they compile, and the sweeps then load it.
A step that is not a sweep (``preset`` None) is a subclass's own: its ``command``, which keeps to the
budget itself (exit BUDGET_SPENT when it is spent) and whose ``complete`` the subclass decides.
A script runs a job inside harness.config.ctrl_c_is_one_line, which turns a SIGTERM into the exception
that run_step and precompile pass on to the processes they started; once its sweeps have ended,
``repository_relative`` writes the repository's path in their Hydra records as ``.``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from harness.results import DirectoryLock, atomic_write, latest, move_aside, read_jsonl, write_json
from harness.signals import Terminated

ROOT = Path(__file__).resolve().parents[1]
BUDGET_SPENT = 3  # the exit status of a step that its budget stopped (not a failure)
COMPILED = ("flex",)  # backends that compile per N (seconds to tens of seconds each)
# Compiling ahead: at most this many processes at once, within this share of the budget left (a process
# past it is killed). On an H100's 16-core host a flex point took 4-8 s to compile (adaptive_span's
# 12-16 s) one after another in its sweep; one compiled by an earlier process warmed up in 0.3-1.7 s.
PRECOMPILE_PROCESSES = 6  # each holds one point's tensors: 6 at N=64K, B=16, H=8, D=64 are about 60 GB
PRECOMPILE_SHARE = 1 / 3
STOP_GRACE_S = 30  # for a process sent SIGTERM (a budget spent, a cancel) or SIGINT to record where it stopped
# A point as warm-up only: the variant's prepare and one checked forward+backward, nothing timed
WARM_UP_ONLY = {"measure.passes": "[]", "measure.memory": "false", "fidelity.enabled": "false"}
# A sweep's keys (the preset's sweeper params and the step's overrides) that each row names, and the row's field
GRID = {"variant": "variant", "variant.backend": "backend", "head_dim": "head_dim", "causal": "causal"}


@dataclass(frozen=True)
class Step:
    """One resumable piece of a job: a harness sweep of conf/sweep/<preset>.yaml with ``overrides`` into
    <out>/<directory>, or (no preset) a step of the subclass's own."""
    group: str  # the steps run together (a subclass's --steps)
    name: str  # its entry in state.json: "complete" once done
    preset: str | None = None
    overrides: tuple[str, ...] = ()
    directory: str = ""
    compiled: bool = False  # its backends compile per N: compiled ahead


def job_file(path: Path, expected: type = dict, check: Callable[[Any], str | None] | None = None,
             prog: str = "harness") -> Any:
    """One of a job's own JSON files (state.json, and a subclass's), None where there is none. Each is
    written whole (write_json), so one that does not read as its kind (``expected``, then ``check``'s
    problem; cut, emptied or edited by hand) was not written by the job: it is moved aside to
    ``<name>.damaged-<time>``, with one line saying so, and read as absent: what it recorded is done again."""
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_bytes())
    except ValueError as e:  # json's errors, and bytes that are not UTF-8
        problem = f"not JSON ({e})"
    else:
        kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        if not isinstance(obj, expected):
            problem = f"{kinds.get(type(obj), 'a number')}, not {kinds[expected]}"
        elif expected is list and not all(isinstance(e, dict) for e in obj):
            problem = "an entry that is not an object"
        elif (problem := check and check(obj)) is None:
            return obj
    aside, = move_aside([path], "damaged")
    print(f"{prog}: {path} is damaged ({problem}): moved to {aside.name} and read as absent", file=sys.stderr)
    return None


def _state_problem(state: dict) -> str | None:
    return None if all(isinstance(v, str) for v in state.values()) else "a step whose state is not a string"


class Job:
    """One invocation of a job into ``out``: its state.json, the budget left, how it logs (default: each
    line with the seconds since the job began, so that a log shows where a budget went). ``common``:
    overrides of every sweep; ``device``: where a CUDA device's memory bounds the points tried."""

    prog = "harness"  # names the job in its one-line messages

    def __init__(self, out: Path, budget_s: float | None = None, log: Callable[[str], None] | None = None,
                 common: tuple[str, ...] | list[str] = (), device: Any = None) -> None:
        self.out, self.common, self.device = out, tuple(common), device
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        began = time.monotonic()
        self.log = log or (lambda message: print(f"[{time.monotonic() - began:4.0f} s] {message}", flush=True))
        self.state = self.read_state()

    def read_state(self) -> dict[str, str]:
        """state.json: each step's outcome (none where there is none, or it was damaged and set aside)."""
        return job_file(self.out / "state.json", check=_state_problem, prog=self.prog) or {}

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def hold(self) -> DirectoryLock:
        """The job's directory, for this invocation alone (release() the lock it returns once done): two
        invocations into one directory at once each rewrote state.json from their own copy, and one's
        outcomes were lost. Another live invocation holding it: harness.results.LockedError (one line).
        Each sweep locks its own job directories as well."""
        self.out.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(self.out).acquire()
        self.state = self.read_state()  # as it is now
        return lock

    def finish(self, name: str, outcome: str) -> None:
        self.state[name] = outcome
        write_json(self.out / "state.json", self.state)

    def complete(self, step: Step) -> bool:
        """Whether a sweep has nothing left to measure: state.json says so and each of its points has its
        row. A subclass decides for its own steps."""
        return self.state.get(step.name) == "complete" and not pending_points(self, step)

    def command(self, step: Step, overrides: tuple[str, ...] | None = None, sweep_dir: Path | None = None
                ) -> list[str]:
        """The step's process (after the interpreter): its sweep, with ``overrides`` instead of the step's
        own, into ``sweep_dir`` instead of its directory (compiling ahead's)."""
        if step.preset is None:
            raise NotImplementedError(f"{step.name}: a step that is not a sweep is the subclass's")
        cmd = ["-m", "harness", "--multirun", f"sweep={step.preset}",
               *(step.overrides if overrides is None else overrides), *self.common, "logger=none",
               f"hydra.sweep.dir={sweep_dir or self.out / step.directory}"]
        if getattr(self.device, "type", None) == "cuda":  # skip what clearly cannot fit; an oom is recorded
            import torch

            total = torch.cuda.get_device_properties(self.device).total_memory
            cmd.append(f"memory_budget_gb={1.25 * total / 1e9:.1f}")
        return cmd

    def run(self, steps: list[Step]) -> None:
        """Runs the steps not complete, in order; where a run of compiled ones begins, compiles it ahead."""
        todo = [step for step in steps if not self.complete(step)]
        for i, step in enumerate(todo):
            if step.compiled and (i == 0 or not todo[i - 1].compiled):  # the first of a run of them
                self.precompile(list(itertools.takewhile(lambda s: s.compiled, todo[i:])))
            self.run_step(step)

    def run_step(self, step: Step) -> None:
        """Runs a step in a process of its own: this process holds none of its memory, and a crash ends
        that step, not the job. A sweep still running when the budget is spent gets SIGTERM (its job
        records interrupted; a rerun resumes it); a step that is not a sweep keeps to the budget itself."""
        env = harness_env()
        for attempt in (1, 2):
            if self.left() < 20:
                return self.log(f"[{step.name}] not started: the budget is spent (run again to continue)")
            cmd = [sys.executable, *self.command(step)]
            self.log(f"[{step.name}] {' '.join(cmd[1:])}")
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
            grace = 60 if step.preset is None else 0
            try:
                rc = proc.wait(timeout=None if self.left() == float("inf") else max(1.0, self.left() + grace))
                spent = rc == BUDGET_SPENT and step.preset is None
            except subprocess.TimeoutExpired:
                rc, spent = stop([proc])[0], True
            except KeyboardInterrupt as e:  # Ctrl-C reached the step too (one process group); SIGTERM is passed on
                stop([proc], signal.SIGTERM if isinstance(e, Terminated) else None)
                raise
            self.finish(step.name, "complete" if rc == 0 else "interrupted by the budget" if spent else f"exit {rc}")
            if spent:
                return self.log(f"[{step.name}] interrupted by the budget: run again to continue")
            # A job that failed (one that lost the process's CUDA context stops its sweep's later jobs too):
            # once more at once, in a new process that skips what is stored
            if rc == 0 or attempt == 2 or self.left() < 60:
                return
            self.log(f"[{step.name}] exit {rc}: once more, resuming")

    def precompile(self, steps: list[Step]) -> None:
        """Compiles the pending points of ``steps`` (sweeps of a compiled backend, about to run one after
        another) several at once, before they are timed one at a time. Each process is a step's own sweep
        narrowed to some of its lengths, each point a warm-up call only (WARM_UP_ONLY: the harness's
        prepare and one checked forward+backward, which compile what its timed passes call), into a scratch
        directory removed after. torch's compile caches on this machine's disk (inductor's FX graphs and
        AOT autograd, triton's kernels) keep what they compiled, so each sweep's warm-up then loads its
        kernels: its rows' warmup_s are a warm cache's. At most PRECOMPILE_PROCESSES at once, within
        PRECOMPILE_SHARE of the budget left: a process still compiling then is killed, and what it had not
        compiled compiles in its sweep. What fails here (an out-of-memory beside the others, a kernel that
        does not compile) is said in the log and fails again, recorded, in the sweep."""
        chunks = precompile_chunks(self, steps)
        points = sum(len(lens) for _, lens in chunks)
        limit = min(self.left(), 3600) * PRECOMPILE_SHARE
        if points < 2 or limit < 30:  # one point gains nothing from going first
            return
        began, deadline = time.monotonic(), time.monotonic() + limit
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        width = min(PRECOMPILE_PROCESSES, len(chunks))
        env = harness_env(TORCHINDUCTOR_COMPILE_THREADS=str(max(1, cores // width)))  # not in the caches' keys
        self.log(f"[precompile] {points} points of {', '.join(s.name for s in steps)} in {len(chunks)} processes, "
                 f"{width} at once, warm-up calls only, within {limit:.0f} s")
        scratch = Path(tempfile.mkdtemp(prefix="precompile-"))
        started: list[subprocess.Popen] = []  # under ``lock``: an interrupt stops these, and no new one starts
        lock, stopping = threading.Lock(), threading.Event()

        def warm(i: int, step: Step, lens: list[int]) -> str | None:
            """None once compiled, else what happened."""
            overrides = [o for o in with_seq_lens(step.preset, list(step.overrides), lambda n: n in lens)
                         if o.split("=", 1)[0] not in WARM_UP_ONLY] + [f"{k}={v}" for k, v in WARM_UP_ONLY.items()]
            with lock:
                if stopping.is_set():
                    return "not started: interrupted"
                proc = subprocess.Popen([sys.executable, *self.command(step, tuple(overrides), scratch / str(i))],
                                        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                started.append(proc)
            try:
                output, _ = proc.communicate(timeout=max(0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                return "stopped at the limit"
            last = output.strip().splitlines()[-1:]
            return None if proc.returncode == 0 else f"exit {proc.returncode}: {''.join(last)}"

        pool = ThreadPoolExecutor(width)
        try:
            outcomes = list(pool.map(lambda c: warm(c[0], *c[1]), enumerate(chunks)))
        except KeyboardInterrupt as e:
            # The processes compiling end as run_step's do: SIGTERM passed on (a Ctrl-C reached them too:
            # one process group), 30 s to end, then a kill; the pool's threads then return.
            with lock:
                stopping.set()
            stop(started, signal.SIGTERM if isinstance(e, Terminated) else None)
            raise
        finally:
            pool.shutdown(cancel_futures=True)
            shutil.rmtree(scratch, ignore_errors=True)
        for (step, lens), outcome in zip(chunks, outcomes):
            if outcome:  # said, not fatal: the sweep compiles those points itself
                self.log(f"[precompile] {step.name} N={','.join(map(str, lens))}: {outcome}")
        self.log(f"[precompile] {outcomes.count(None)} of {len(chunks)} processes compiled theirs in "
                 f"{time.monotonic() - began:.0f} s")


def harness_env(**extra: str) -> dict[str, str]:
    """The environment of a step's process: this one's, the project first on PYTHONPATH, and ``extra``."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}


def stop(procs: list[subprocess.Popen], sig: int | None = signal.SIGTERM) -> list[int]:
    """Ends processes as a budget or an interrupt does: ``sig`` to each still running, STOP_GRACE_S for
    them to record where they stopped, then a kill. ``sig`` None: a Ctrl-C, which a terminal sends them
    too (one process group); one still running after STOP_GRACE_S is sent the SIGINT it missed (the
    Ctrl-C was this process's alone, ``kill -INT``) and given STOP_GRACE_S more, as
    harness.config.wait_through_ctrl_c does, not killed halfway through a point with its status.json
    left ``running``. Their exit codes."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running if sig is not None else []:
        proc.send_signal(sig)
    for missed in ((signal.SIGINT,) if sig is None else ()) + (None,):
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        running = [proc for proc in running if proc.poll() is None]
        for proc in running:
            proc.send_signal(missed) if missed is not None else proc.kill()
    return [proc.wait() for proc in procs]


def preset_config(name: str) -> dict:
    """conf/sweep/<name>.yaml."""
    return yaml.safe_load((ROOT / "conf" / "sweep" / f"{name}.yaml").read_text())


def seq_lens(preset: str, overrides: list[str] | tuple[str, ...]) -> list[int]:
    """The lengths a sweep of ``preset`` with ``overrides`` runs: the overrides' own seq_lens, else the preset's."""
    own = [o for o in overrides if o.startswith("seq_lens=")]
    return yaml.safe_load(own[-1].split("=", 1)[1]) if own else preset_config(preset)["seq_lens"]


def with_seq_lens(preset: str, overrides: list[str], keep: Callable[[int], bool]) -> list[str]:
    """``overrides`` with seq_lens narrowed to the lengths ``keep`` admits (of ``seq_lens``)."""
    kept = ",".join(str(n) for n in seq_lens(preset, overrides) if keep(n))
    return [o for o in overrides if not o.startswith("seq_lens=")] + [f"seq_lens=[{kept}]"]


def pending_points(job: Job, step: Step) -> list[tuple]:
    """The points of ``step``'s sweep that its directory holds no row of yet, as (its GRID values, N):
    its jobs are the product of the GRID keys' values (the step's overrides, else the preset's sweeper
    params; a key given in neither is not checked), each with the sweep's lengths. Every point of a
    finished sweep has its row, an oom's or a skipped one's too."""
    params = preset_config(step.preset)["hydra"]["sweeper"]["params"]
    given = {**{k: str(v) for k, v in params.items()}, **dict(o.split("=", 1) for o in step.overrides if "=" in o)}
    grid = {k: [yaml.safe_load(v) for v in given[k].split(",")] for k in GRID if k in given}
    held = {(*[r.get(GRID[k]) for k in grid], r["seq_len"])
            for path in (job.out / step.directory).rglob("results.jsonl") for r in latest(read_jsonl(path))}
    return [point for point in itertools.product(*grid.values(), seq_lens(step.preset, step.overrides))
            if point not in held]


def precompile_chunks(job: Job, steps: list[Step]) -> list[tuple[Step, list[int]]]:
    """The pending lengths of ``steps`` in about PRECOMPILE_PROCESSES processes: each step's lengths split
    over a share of them as large as its share of the lengths (every other length: alike in cost), so
    that a step of five lengths alone compiles them at once, and five steps of ten take a process each
    (a process starts in seconds, about what compiling one point costs)."""
    pending = [(step, sorted({point[-1] for point in pending_points(job, step)})) for step in steps]
    total = sum(len(lens) for _, lens in pending)
    chunks = []
    for step, lens in pending:
        m = max(1, min(len(lens), round(PRECOMPILE_PROCESSES * len(lens) / max(total, 1))))
        chunks += [(step, lens[i::m]) for i in range(m) if lens[i::m]]
    return chunks


def repository_relative(out: Path, root: Path = ROOT) -> None:
    """Hydra's records (.hydra/hydra.yaml, multirun.yaml: its cwd, config path, sweep and output
    directories) and the reports' source line hold the repository's absolute path on the machine that ran
    them: written as ``.`` instead, so that the results say nothing of that machine and read the same
    wherever they are checked out. The path whole, not a directory beside it whose name begins with it
    (``<root>_results/...`` became ``._results/...``). Run once the sweeps have ended (no file is being
    written)."""
    whole = re.compile(re.escape(str(root)) + r"(?=[/\s\"'<>,:;\]}]|$)", re.M)
    for path in [*out.rglob("*.yaml"), *out.rglob("report.html")]:
        text = path.read_text()
        if whole.search(text):
            atomic_write(path, whole.sub(".", text))
