"""The harness's Hydra launchers: each waits for every job and says how each one ended, where the stock
launcher raises through Hydra at the first job that produced no result (a traceback, no summary, the other
jobs stopped or left running unwatched, their ``status.json`` left at ``running``).

- ``hydra/launcher=slurm``: Hydra's submitit SLURM launcher, ``SlurmLauncher`` here. The plugin's waits
  for the jobs in order and raises at the first that produced no result, while the later ones still
  run. Here every job is waited for; a job that ended without finishing its run (cancelled, killed, out
  of time or memory, a failing ``setup`` line: whatever SLURM's accounting says) is one line on stderr.
- ``hydra/launcher=submitit_local``: the same, on this machine (``LocalLauncher``: submitit's local
  executor, one process per job; the plugin's config, registered again below with this target). A job killed by a signal (the kernel's OOM killer, ``kill -9``)
  leaves no result; submitit's launcher raised ``UncompletedJobError``.
- ``hydra/launcher=local_parallel``: joblib's loky workers (``JoblibLauncher``). A worker killed by a
  signal breaks the whole pool: loky stops the other workers too, and joblib raised
  ``TerminatedWorkerError``. The jobs that completed stay so; the others are said here.

A job whose run could not say so itself becomes ``failed`` in its ``status.json``, with the reason
(``ended_unfinished``). The sweep goes on to its summary (``scripts/sweep.sh``: "jobs: 2 (completed 1,
failed 1)", exit 1), and the same command resumes it.

It lives in the ``hydra_plugins`` namespace because Hydra instantiates launchers only from there; it
imports nothing of the harness until a job has ended (Hydra imports every plugin at start-up).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus as HydraJobStatus, filter_overrides
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher as StockJoblibLauncher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def cannot_submit(executor: str, e: Exception) -> None:
    """Nothing was submitted: one line and exit 1 (Hydra would print the submission's traceback)."""
    from harness.config import one_line

    launcher = "slurm" if executor == "slurm" else f"submitit_{executor}"
    print(f"error: hydra/launcher={launcher} submitted nothing: {one_line(e)[:400]}", file=sys.stderr)
    sys.exit(1)


def ended_unfinished(hydra_context, config: DictConfig, overrides: list[str], num: int, reason: str,
                     said: bool = True) -> JobReturn:
    """A job that ended without finishing its run: ``failed`` with ``reason`` in its status.json where
    its run could not say so itself (killed: the status says running and nobody holds the directory; or
    it never started), and one line on stderr. The job counts in the sweep's summary, and a rerun resumes
    it. ``said=False``: the line only for such a job (one whose run ended as its status.json says, a
    completed one say, is said by the summary)."""
    from harness.results import MULTIRUN_ENV, JobStatus, earlier_jobs, job_state, write_json

    sweep_cfg = hydra_context.config_loader.load_sweep_config(config, overrides)
    job_dir = Path(str(sweep_cfg.hydra.sweep.dir)) / str(sweep_cfg.hydra.sweep.subdir)
    info = job_state(job_dir)
    # Killed before its run wrote there: the directory's status.json is another job's of this multirun (a
    # job waits for the one holding the directory they share), which names it nowhere. Every job has
    # ended by now, so this job's status may be written, the others' states kept in it (JobStatus).
    unnamed = (info.get("multirun") is not None and info.get("multirun") == os.environ.get(MULTIRUN_ENV)
               and info.get("job") != num and str(num) not in earlier_jobs(info))
    # Or its status, said running, was kept as "gone" in the status of a job the launcher said first
    kept_gone = earlier_jobs(info).get(str(num)) == "gone" and info.get("job") != num
    unsaid = info.get("state") in ("gone", "no status") or unnamed or kept_gone  # the run could not say so
    if kept_gone:  # as written (job_state's info says "gone" for a status said running, killed too)
        written = json.loads((job_dir / "status.json").read_text())
        write_json(job_dir / "status.json", {**written, "jobs": {**written["jobs"], str(num): "failed"}})
    elif unsaid:
        status = JobStatus(job_dir, info.get("points_total"), job=num)
        if not unnamed:  # its counts kept (the others' states are in its own "jobs", made by JobStatus)
            status.info.update({k: v for k, v in info.items() if k in status.info and k not in ("error", "job", "jobs")})
        status.finish("failed", reason)
    if unsaid or said:
        print(f"error: job {num} ({sweep_cfg.hydra.job.override_dirname}): {reason}", file=sys.stderr)
    return JobReturn(overrides=overrides, status=HydraJobStatus.COMPLETED, _return_value=None)


# SLURM's states of a job ended from outside; INTERRUPTED: submitit's local job ended by a signal
KILLED_STATES = ("CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL",
                 "INTERRUPTED")


def killed(job) -> bool:
    """Whether the job's process was ended from outside: SLURM cancelled it, its time or memory ran out, its
    node was lost, or a signal killed it (a signal in sacct's ``exit:signal`` codes of the job or its steps:
    a run SIGKILLed shows FAILED, ExitCode 9:0, its step 0:9). Such a job writes no result file; one that
    failed by raising does (submitit pickles the error, exit code 1), so it is waited for. Unknown (sacct
    does not answer): not killed."""
    if (job.state or "").split(" ")[0] in KILLED_STATES:
        return True
    if not (job.state or "").startswith("FAILED"):
        return False
    try:
        out = subprocess.run(["sacct", "-j", str(job.job_id), "-n", "-P", "-o", "State,ExitCode,DerivedExitCode"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    fields = [f for line in out.splitlines() for f in line.split("|")]
    return any(f.split(" ")[0] in KILLED_STATES or (":" in f and f.partition(":")[2] not in ("", "0")) for f in fields)


def results_appear(jobs) -> None:
    """Waits once for every ended job's result file. On a shared filesystem the file can show up a moment
    after SLURM records the job's end, so submitit waits up to ``_results_timeout_s`` (15 s) for it, job by
    job: a sweep whose jobs were cancelled or ran out of time (they leave no result) would wait that long
    for each of them. One wait of that length here serves them all, and none for a job that was killed
    (``killed``: no result will come); submitit then reads what is there."""
    expected = [job for job in jobs if not killed(job)]
    deadline = time.monotonic() + min((job._results_timeout_s for job in expected), default=0)
    while True:
        missing = [job for job in expected if not job.paths.result_pickle.exists()]
        if not missing or time.monotonic() > deadline:
            break
        for job in missing:  # as submitit does: refreshes a network filesystem's cached view of the folder
            try:
                job.paths.folder.chmod(job.paths.folder.stat().st_mode)
            except OSError:
                pass
        time.sleep(1)
    for job in jobs:
        job._results_timeout_s = 0  # waited for above


class SlurmLauncher(SubmititSlurmLauncher):
    """``hydra/launcher=slurm``; ``LocalLauncher`` below is the same on submitit's local executor."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and self.hydra_context is not None
        # The executor and its parameters as the plugin builds them (SubmititLauncher.launch).
        params = dict(self.params)
        try:
            timeouts = {f"{self._EXECUTOR}_max_num_timeout": params.pop("max_num_timeout")} \
                if "max_num_timeout" in params else {}
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop("submitit_folder"), **timeouts)
            base = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        except Exception as e:  # no SLURM here (no srun/sbatch), a parameter submitit refuses
            cannot_submit(self._EXECUTOR, e)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        nums = range(initial_job_idx, initial_job_idx + len(job_overrides))
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        try:
            jobs = executor.map_array(self, [list(o) for o in job_overrides], ["hydra.sweep.dir"] * len(nums),
                                      list(nums), [f"job_id_for_{n}" for n in nums],
                                      [Singleton.get_state()] * len(nums))
        except Exception as e:  # sbatch refused the array (no controller, a bad partition or account)
            cannot_submit(self._EXECUTOR, e)
        for job in jobs:  # every job ends before any is judged: none is left running unwatched
            job.wait()
        self._results_appear(jobs)
        return [self._outcome(job, list(overrides), num) for job, overrides, num in zip(jobs, job_overrides, nums)]

    def _results_appear(self, jobs) -> None:
        results_appear(jobs)

    def _ended(self, job) -> str:
        return job.get_info().get("State") or "UNKNOWN"

    def _outcome(self, job, overrides: list[str], num: int) -> JobReturn:
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            return job.results()[0]
        except FailedJobError as e:  # the run raised: it marked its status.json failed itself
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["?"]
            reason = f"{self._EXECUTOR} job {job.job_id} raised {last[0].strip()} (log: {job.paths.stderr})"
        except UncompletedJobError:  # no result: SLURM's accounting says why
            reason = (f"{self._EXECUTOR} job {job.job_id} ended {self._ended(job)} before its run finished (log: "
                      f"{job.paths.stderr}); rerun the same command to resume")
        return ended_unfinished(self.hydra_context, self.config, overrides, num, reason)


class LocalLauncher(SlurmLauncher):
    """``hydra/launcher=submitit_local``: one process per job on this machine, every job waited for, as
    ``SlurmLauncher`` does on a cluster."""

    _EXECUTOR = "local"

    def _results_appear(self, jobs) -> None:
        """A local job's result file is written before its process ends: none is waited for (submitit
        would wait 15 s for that of a job whose run was killed, as on a network filesystem)."""
        for job in jobs:
            job._results_timeout_s = 0

    def _ended(self, job) -> str:
        return "without a result"  # no accounting here: a process killed (or ended) outside its run


class SubmititLocalConfig(SearchPathPlugin):
    """Makes ``hydra/launcher=submitit_local`` the plugin's own config (every key of it, validated) with
    ``LocalLauncher`` as its target. Not at this module's import: Hydra's plugin scan executes every
    plugin module again, the plugin's config module too, which stores its entry again, after this one
    when the scan comes to it later. Hydra calls the search path plugins once the scan is done, and
    passes the ConfigStore to each job. The search path itself is left as it is. (A
    conf/hydra/launcher/submitit_local.yaml would shadow the entry too, but Hydra then warns, at every
    start of every job, that matching a YAML to a schema of the same name is deprecated.)"""

    def manipulate_search_path(self, search_path) -> None:
        ConfigStore.instance().store(group="hydra/launcher", name="submitit_local", provider="attention-harness",
                                     node=LocalQueueConf(_target_=f"{__name__}.LocalLauncher"))


class JoblibLauncher(StockJoblibLauncher):
    """``hydra/launcher=local_parallel``: joblib's launcher, until a worker is killed. Then the jobs that
    completed are kept and the others (the killed one's, those loky stopped with it, those not started)
    are said, each in its status.json and one line."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        try:
            return super().launch(job_overrides, initial_job_idx)
        except TerminatedWorkerError as e:
            codes = str(e).partition("The exit codes of the workers are ")[2].splitlines()[:1] or ["?"]
            reason = (f"a joblib worker process was killed (exit codes {codes[0]}), and loky stopped the others: "
                      f"this job did not finish; rerun the same command to resume")
            assert self.hydra_context is not None and self.config is not None
            return [ended_unfinished(self.hydra_context, self.config, list(overrides), initial_job_idx + i, reason,
                                     said=False) for i, overrides in enumerate(job_overrides)]
