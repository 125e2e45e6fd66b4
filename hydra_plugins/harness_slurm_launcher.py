"""``hydra/launcher=slurm``: Hydra's submitit SLURM launcher, made to wait for every job and to say how
each one ended.

The plugin's own launcher waits for the jobs in order and raises at the first that produced no result,
while the later ones still run, unwatched. Here every job is waited for; a job that ended without
finishing its run (cancelled, killed, out of time or memory, a failing ``setup`` line: whatever SLURM's
accounting says) is one line on stderr and, where its run could not say so itself, ``failed`` in its
``status.json`` with SLURM's state as the reason. The sweep goes on to its summary
(``scripts/sweep.sh``: "jobs: 2 (completed 1, failed 1)", exit 1), and the same command resumes it.

It lives in the ``hydra_plugins`` namespace because Hydra instantiates launchers only from there; it
imports nothing of the harness until a job has ended (Hydra imports every plugin at start-up).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus as HydraJobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


def cannot_submit(e: Exception) -> None:
    """Nothing was submitted: one line and exit 1 (Hydra would print the submission's traceback)."""
    from harness.config import one_line

    print(f"error: hydra/launcher=slurm submitted nothing: {one_line(e)[:400]}", file=sys.stderr)
    sys.exit(1)


KILLED_STATES = ("CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL")


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
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None and self.hydra_context is not None
        # The executor and its parameters as the plugin builds them (SubmititLauncher.launch).
        params = dict(self.params)
        try:
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop("submitit_folder"),
                                             slurm_max_num_timeout=params.pop("max_num_timeout"))
            base = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        except Exception as e:  # no SLURM here (no srun/sbatch), a parameter submitit refuses
            cannot_submit(e)
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
            cannot_submit(e)
        for job in jobs:  # every job ends before any is judged: none is left running unwatched
            job.wait()
        results_appear(jobs)
        return [self._outcome(job, list(overrides), num) for job, overrides, num in zip(jobs, job_overrides, nums)]

    def _outcome(self, job, overrides: list[str], num: int) -> JobReturn:
        from submitit.core.utils import FailedJobError, UncompletedJobError

        from harness.results import JobStatus, job_state

        try:
            return job.results()[0]
        except FailedJobError as e:  # the run raised: it marked its status.json failed itself
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["?"]
            reason = f"slurm job {job.job_id} raised {last[0].strip()} (log: {job.paths.stderr})"
        except UncompletedJobError:  # no result: SLURM's accounting says why
            state = job.get_info().get("State") or "UNKNOWN"
            reason = (f"slurm job {job.job_id} ended {state} before its run finished (log: {job.paths.stderr}); "
                      f"rerun the same command to resume")
        sweep_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        job_dir = Path(str(sweep_cfg.hydra.sweep.dir)) / str(sweep_cfg.hydra.sweep.subdir)
        info = job_state(job_dir)
        if info.get("state") in ("gone", "no status"):  # the run could not say so itself
            status = JobStatus(job_dir, info.get("points_total"))
            status.info.update({k: v for k, v in info.items() if k in status.info and k != "error"})
            status.finish("failed", reason)
        print(f"error: job {num} ({sweep_cfg.hydra.job.override_dirname}): {reason}", file=sys.stderr)
        return JobReturn(overrides=overrides, status=HydraJobStatus.COMPLETED, _return_value=None)
