"""What the harness does around Hydra's runs (conf/config.yaml, ``hydra.callbacks``), in the process that
runs the command.

Before a single run: Hydra writes the run's ``.hydra/`` (config, overrides) into its directory before the
harness can take the directory's lock, so a second run into a directory another run holds would have
replaced the first one's record before being refused. It is refused here first, in one line, exit 2.

How a multirun (``python -m harness -m ...``, scripts/sweep.sh) ends, whatever launched its jobs (basic
launcher: in this process; joblib, submitit, SLURM: elsewhere): one line with the state of every job it
ran (not of jobs an earlier sweep left in the directory), and exit status 1 when one did not complete. A job's state is its directory's status.json
(``harness.results.job_state``): what the job said itself (completed, refused, failed, interrupted), or
what the SLURM launcher wrote for a job that could not. Jobs sharing a directory (differing only in
seq_lens) each count: its status.json keeps the states of the multirun's jobs that wrote there before.
A job refused because another command's run holds its directory cannot write there: it adds a line to
the sweep's ``refused-jobs.jsonl`` instead, naming its multirun; a multirun counts its own lines only
(two sweeps may share the directory at once, so neither empties the file).
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

REFUSED = "refused-jobs.jsonl"
# How a line of REFUSED starts for a job refused for its input in a directory another job of the sweep wrote
# (jobs differing only in seq_lens share one), not because another command's run holds it.
REFUSED_INPUT = "refused for its input (its directory holds another job's results): "
# What the multirun that just ended says when one of its jobs did not complete (harness.__main__ exits 1).
NOT_COMPLETE: list[str] = []
# The sweep directory of a multirun started in this process (its jobs may run in others: joblib, SLURM).
MULTIRUN: list[str] = []
STARTED: list[float] = []  # when it started (time.time())
JOBS_HERE: list[bool] = []  # whether its launcher runs the jobs in this process, one after another (basic)
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


# Where a job's status.json names no multirun (written by older code): a job of this multirun wrote it after
# the multirun started; clocks of a cluster's nodes and its file server may disagree by this much.
CLOCK_SLACK_S = 120.0


def job_states(root: Path, since: float | None = None,
               multirun: str | None = None) -> dict[tuple[Path, str | None], str]:
    """Every job under a sweep directory (a directory with results.jsonl or status.json; a report's folders
    excluded), as (its directory, its Hydra job number) -> its state: the one that wrote status.json last,
    and those of its multirun it names as having written there before (``jobs``: jobs differing only in
    seq_lens share a directory). With ``multirun`` (its id, MULTIRUN_ENV), only the jobs whose status.json
    names it, and with ``since`` (a time.time()) those whose files changed after it, where status.json names
    none: the jobs of the multirun, not those an earlier sweep or another command left in the directory."""
    from harness.results import earlier_jobs, job_state, report_output  # "gone": said running, no live holder

    files = [p for name in ("results.jsonl", "status.json") for p in root.rglob(name) if not report_output(p, root)]
    changed = {p.parent for p in files if since is None or p.stat().st_mtime >= since - CLOCK_SLACK_S}
    states = {}
    for job in sorted({p.parent for p in files}):
        state = job_state(job)
        named = state.get("multirun")
        if (named == multirun) if multirun is not None and named is not None else job in changed:
            states.update({(job, num): other for num, other in earlier_jobs(state).items()})
            last = state.get("job")
            states[(job, None if last is None else str(last))] = str(state.get("state", "?"))
    return states


def record_refused(sweep_dir: str | Path, num: int, overrides: str, message: str) -> None:
    """A job that could not say so in its own directory (another run holds it), under its multirun's id."""
    from harness.results import MULTIRUN_ENV

    line = {"job": num, "overrides": overrides, "error": message, "multirun": os.environ.get(MULTIRUN_ENV)}
    with open(Path(sweep_dir) / REFUSED, "a") as f:
        f.write(json.dumps(line) + "\n")


class Hooks(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from harness.distributed import from_environment
        from harness.results import DirectoryLock

        launched = from_environment()  # torchrun/srun ranks share one directory: only rank 0 writes results
        if config.get("output_dir") is None and (launched is None or launched.rank == 0):
            busy = DirectoryLock.in_use(Path(str(config.hydra.run.dir)))
            if busy is not None:
                print(f"error: {busy}", file=sys.stderr)
                sys.exit(2)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from harness.results import MULTIRUN_ENV

        NOT_COMPLETE.clear()
        MULTIRUN.append(str(config.hydra.sweep.dir))
        STARTED.append(time.time())
        JOBS_HERE.append(OmegaConf.select(config, "hydra.launcher._target_") == BASIC_LAUNCHER)
        # Inherited by the jobs, whatever the launcher: each job's status.json names its multirun
        os.environ[MULTIRUN_ENV] = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        root = Path(str(config.hydra.sweep.dir))
        if not root.is_dir():
            return
        from harness.results import MULTIRUN_ENV

        states = collections.Counter(job_states(root, STARTED[-1] if STARTED else None,
                                                os.environ.get(MULTIRUN_ENV)).values())
        refused = root / REFUSED
        if refused.exists():  # this multirun's jobs that could not say so in their own directory
            for line in refused.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # not a line a job wrote whole
                if not isinstance(record, dict) or record.get("multirun") != os.environ.get(MULTIRUN_ENV):
                    continue  # another multirun's, earlier or running beside this one
                error = str(record.get("error", ""))
                states["refused" if error.startswith(REFUSED_INPUT) else "refused (directory in use)"] += 1
        if not states:
            return
        summary = f"jobs: {sum(states.values())} ({', '.join(f'{s} {n}' for s, n in sorted(states.items()))})"
        print(summary, flush=True)
        if set(states) - {"completed"}:
            NOT_COMPLETE.append(not_complete_line(summary, states))


def not_complete_line(summary: str, states: collections.Counter) -> str:
    """The last line of a multirun not every job of which completed. A job refused for its input
    ("refused") is refused again by the same command; the others (interrupted, failed, gone, refused
    because another command's run held the directory) resume."""
    head = f"not every job of the sweep completed ({summary}; see each job's status.json and the lines above)"
    resumable = sum(n for state, n in states.items() if state not in ("completed", "refused"))
    if not states["refused"]:
        return f"{head}; rerun the same command to resume"
    if not resumable:
        return f"{head}; a job refused for its input is refused again by the same command: change that input first"
    return (f"{head}; rerun the same command to resume the jobs that did not finish (a job refused for its input "
            f"is refused again until that input changes)")
