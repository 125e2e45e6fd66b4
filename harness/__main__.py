"""``python -m harness [variant=NAME] [key=value ...]``: a thin ``@hydra.main`` over ``harness.run.run``.

Every key is documented in conf/config.yaml (``python -m harness --help`` prints it). The command line
is checked first (harness/command_line.py): bad input is one line on stderr naming the problem and the
allowed values, exit code 2, and nothing written. Ctrl-C and SIGTERM end a run as interrupted (exit 130,
143), resumable by the same command, and so does stdout's reader going away (`| head`: exit 141).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

# What the signal handlers use, imported before they are installed: a handler imports nothing (it may run
# inside torch's import, which harness.run's would re-enter), and this module imports no torch.
from harness.signals import (PENDING_INTERRUPTS, GuardedStdout, Terminated, TimeLimit, deferred,
                             raise_pending_interrupt)


# The output directories of the runs this command started: an interrupt outside a run says what they kept.
RUNS_STARTED: list[str] = []


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from variants import VariantError

    from harness.config import ConfigError, one_line
    from harness.hydra_hooks import REFUSED_INPUT, record_refused
    from harness.results import JobStatus
    from harness.run import DirectoryInUse, RunFailed, RunInterrupted, run

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    RUNS_STARTED.append(hc.runtime.output_dir)
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # A SLURM job (hydra/launcher=slurm): scancel's SIGTERM and the time limit's warning (SIGUSR2)
        # end the run as on the command line (status interrupted, resumable), neither ignored until the
        # SIGKILL nor raised by submitit inside the point being measured (harness.signals.TimeLimit).
        import signal

        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGUSR2, terminate)
    try:
        run(cfg)  # into Hydra's output directory (HydraConfig.get().runtime.output_dir)
    except RunInterrupted as e:  # the directory's status says interrupted; a sweep stops here too
        print(f"error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (ConfigError, VariantError, RunFailed) as e:
        if not multirun:
            fail(one_line(e), 1 if isinstance(e, RunFailed) else 2)
        # One job of a sweep that cannot run (linear in a causal sweep) or could not finish: said in one
        # line and in the job's status.json (the sweep's refused-jobs.jsonl when another command's run holds
        # its directory, or another job of the sweep wrote there: jobs differing in seq_lens share one);
        # the others go on, and the multirun exits 1 (harness/hydra_hooks.py).
        out = Path(hc.runtime.output_dir)
        try:
            if isinstance(e, DirectoryInUse):  # its status.json is the holder's to write
                record_refused(hc.sweep.dir, hc.job.num, hc.job.override_dirname, one_line(e))
            elif isinstance(e, RunFailed):
                pass  # its status.json says failed (harness.run)
            elif holds_another_job(out, hc.job.num):
                record_refused(hc.sweep.dir, hc.job.num, hc.job.override_dirname, REFUSED_INPUT + one_line(e))
            else:
                # job: whose refusal it is (a rerun's refusal replaces its own only)
                JobStatus(out, None, job=hc.job.num).finish("refused", one_line(e))
        except OSError:
            pass
        print(f"error: job {hc.job.num} ({hc.job.override_dirname}): {one_line(e)}", file=sys.stderr)
    except Exception as e:  # a failure of the harness itself (a bug, wandb refusing to start)
        if not multirun:
            raise
        # Its status.json says failed (harness.run); the sweep's other jobs go on and its summary is
        # printed (raised, it would end the multirun in Hydra's traceback before the summary).
        print(f"error: job {hc.job.num} ({hc.job.override_dirname}) failed: {one_line(f'{type(e).__name__}: {e}')}",
              file=sys.stderr)


def holds_another_job(job_dir: Path, num: int) -> bool:
    """Whether a job directory holds what another job wrote: results, a live run, or a status.json other
    than this job's own earlier refusal (a rerun's refusal replaces that one)."""
    from harness.results import DirectoryLock, job_state

    info = job_state(job_dir)
    return ((job_dir / "results.jsonl").exists() or DirectoryLock.is_held(job_dir) or
            (info["state"] != "no status" and (info["state"], info.get("job")) != ("refused", num)))


def terminate(signum, frame) -> None:
    """SIGTERM (a scheduler's cancel, ``kill``) or, in a SLURM job, SIGUSR2 (the time limit is near): end
    the run as Ctrl-C does, with its own exit code."""
    import signal

    kind = TimeLimit if signum == signal.SIGUSR2 else Terminated
    # A SIGTERM while the run already ends for one is the same request, not raised again: it comes twice
    # where a process group and its parent both pass it on (timeout signals its group, harness.job its
    # sweep), and the second, landing while the run recorded the first, left status.json "running".
    ending = any(issubclass(k, Terminated) for k in PENDING_INTERRUPTS)
    PENDING_INTERRUPTS.append(kind)  # raised again at the run's next phase, should this one be lost
    if not ending and not deferred(kind):
        raise kind()


def interrupt(signum, frame) -> None:
    """SIGINT (Ctrl-C): Python's own KeyboardInterrupt, remembered as SIGTERM's is."""
    PENDING_INTERRUPTS.append(KeyboardInterrupt)
    if not deferred(KeyboardInterrupt):
        raise KeyboardInterrupt()


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, interrupt)
    sys.stdout = GuardedStdout(sys.stdout)  # before Hydra's log handlers take it: `| head` ends the run in order
    try:
        from harness.command_line import check
        from harness.config import ConfigError, one_line

        try:
            check(sys.argv[1:])
        except ConfigError as e:
            fail(one_line(e))
        raise_pending_interrupt()  # one a library swallowed while the check imported it: before Hydra writes
        hydra_main()
        from harness.hydra_hooks import NOT_COMPLETE

        if NOT_COMPLETE:  # a multirun whose every job ran, but not every one completed
            fail(NOT_COMPLETE[0], 1)
    except KeyboardInterrupt as e:  # before, between or after runs (startup, composing, a sweep's end)
        name, code = (e.NAME, e.EXIT_CODE) if isinstance(e, Terminated) else ("Ctrl-C", 130)
        # Loaded by Hydra when a multirun started; not imported here (the signal may have cut its import short).
        hooks = sys.modules.get("harness.hydra_hooks")
        MULTIRUN, here = getattr(hooks, "MULTIRUN", None) or [], getattr(hooks, "JOBS_HERE", None) or [False]
        print(f"error: {interrupted_outside_a_run(name, RUNS_STARTED, MULTIRUN[-1] if MULTIRUN else None, here[-1])}",
              file=sys.stderr)
        if not RUNS_STARTED and not MULTIRUN:  # at startup: nothing opened that an exit handler would close
            # A Ctrl-C that interrupted code run by an extension's import (torch's: PyRun_String) leaves
            # CPython's "unhandled KeyboardInterrupt" flag set, and its exit would kill the process with
            # SIGINT (-2) whatever the exit code given here.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        sys.exit(code)


def interrupted_outside_a_run(name: str, started: list[str], sweep: str | None = None, jobs_here: bool = False) -> str:
    """The line for an interrupt (``name``: Ctrl-C, SIGTERM, ...) that came while no run of this process
    was measuring (a run's own says its points). ``sweep``: the directory of a multirun this process
    launched, whose jobs may be running elsewhere (joblib's workers, a cluster), or, ``jobs_here`` (the
    basic launcher), in this process one after another."""
    if not started and sweep is not None and jobs_here:
        return f"interrupted ({name}) before the multirun's first job started; nothing was measured"
    if not started and sweep is not None:
        return (f"interrupted ({name}) while the multirun's jobs ran in other processes: each job's "
                f"status.json under {sweep} says how far it got (jobs already submitted to a cluster keep "
                f"running: scancel them); rerun the same command to resume")
    if not started:
        return f"interrupted ({name}) before a run started; nothing was measured"
    return (f"interrupted ({name}) outside a run, after {len(started)} run(s) started (the last in "
            f"{started[-1]}); their results are kept and their status.json says how each ended")


if __name__ == "__main__":
    main()
