"""scripts/sweep.sh, the launcher configs and scripts/wandb_dashboard.py, end to end at tiny sizes.

Sweeps run as subprocesses (bash scripts/sweep.sh ...) with logger=none and WANDB_MODE=disabled: no
wandb, no network. The whole file takes about 20 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import variants

ROOT = Path(__file__).resolve().parents[1]
SWEEP_SH = ROOT / "scripts" / "sweep.sh"
DASHBOARD = ROOT / "scripts" / "wandb_dashboard.py"
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml"))
# cpu_small's grid: every single-process variant (ring and ulysses have their own preset, sequence_parallel)
VARIANTS = sorted(p.stem for p in (ROOT / "conf" / "variant").glob("*.yaml") if "world_size" not in p.read_text())
SEQ_LENS = [32, 64]
TINY = [f"seq_lens=[{','.join(map(str, SEQ_LENS))}]", "num_heads=1", "head_dim=8", "measure.min_run_time=0.01",
        "measure.warmup_iters=1", "fidelity.enabled=false", "logger=none"]
WANDB_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC", "WANDB_ENTITY",
             "WANDB_PROJECT")


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in WANDB_ENV}
    e.update(WANDB_MODE="disabled", PYTHON=sys.executable, PYTHONUNBUFFERED="1", **extra)
    return e


def sweep(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SWEEP_SH), *args], check=False, cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def lines(p: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]


def jobs(sweep_dir: Path) -> dict[str, Path]:
    """variant name -> job dir, for every job dir that wrote results."""
    found = {}
    for results in sweep_dir.glob("*/results.jsonl"):
        overrides = dict(kv.split("=", 1) for kv in results.parent.name.split(",") if "=" in kv)
        found[overrides["variant"]] = results.parent
    return found


def check_jobs(sweep_dir: Path, variants: list[str]) -> None:
    found = jobs(sweep_dir)
    assert sorted(found) == sorted(variants), sorted(found)
    for variant, job in found.items():
        rows = [json.loads(line) for line in (job / "results.jsonl").read_text().splitlines() if line.strip()]
        assert sorted(r["seq_len"] for r in rows) == SEQ_LENS, (variant, rows)
        assert all(r["status"] == "ok" and r["variant"] == variant for r in rows), (variant, rows)
        for name in ("results.csv", "env.json", "fit.json"):
            assert (job / name).is_file(), (variant, name)
        if (job / "status.json").is_file():
            assert json.loads((job / "status.json").read_text())["state"] == "completed", variant


def test_cpu_small_basic_launcher_end_to_end_and_resume(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # From another directory, with a relative sweep dir: sweep.sh finds the repo and makes the path absolute.
    p = sweep("cpu_small", *TINY, "hydra.sweep.dir=sweep", cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    check_jobs(sweep_dir, VARIANTS)
    assert p.stdout.count(str(sweep_dir)) >= 2, p.stdout[-2000:]  # before and after
    assert f"-m harness.report {sweep_dir}" in p.stdout

    # Rerunning one job of it into the same dir measures nothing again.
    job = jobs(sweep_dir)["full"]
    before = (job / "results.jsonl").read_text()
    p = sweep("cpu_small", *TINY, "variant=full", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (job / "results.jsonl").read_text() == before
    assert sorted(jobs(sweep_dir)) == VARIANTS  # same job dir, no new one


def test_cpu_small_submitit_local_launcher(tmp_path):
    sweep_dir = tmp_path / "sweep"
    p = sweep("cpu_small", *TINY, "variant=full,linear", "hydra/launcher=submitit_local",
              f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    check_jobs(sweep_dir, ["full", "linear"])
    assert (sweep_dir / ".submitit").is_dir()  # it did go through submitit


def sweep_with_a_job_killed(args: list[str], cwd: Path, victim) -> tuple[str, str]:
    """scripts/sweep.sh ARGS, one of whose jobs is SIGKILLed (as the OOM killer would) once ``victim()``,
    polled, names its process; the sweep must then end within 120 s, exit 1, without a traceback. Its
    output (stdout, stderr)."""
    p = subprocess.Popen(["bash", str(SWEEP_SH), *args], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (pid := victim(p)) is None:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 1 and "Traceback" not in out + err, (out + err)[-3000:]
    return out, err


@pytest.mark.parametrize("launcher", ["local_parallel", "submitit_local"])
def test_a_job_killed_under_a_local_launcher_ends_the_sweep_with_its_summary_and_resumes(tmp_path, launcher):
    """A job's process SIGKILLed half way (as the OOM killer would) under joblib's workers or submitit's local
    processes: the stock launchers raised through Hydra (a traceback, no summary, status.json left running;
    loky stops the other worker too). Now the sweep says each unfinished job in one line and its
    status.json, ends with its summary, exit 1; the same command measures only what is missing: every
    point exactly once (resumed after joblib's only: submitit's resume is the basic launcher's, tested
    above, and each sweep here costs some ten processes)."""
    sweep_dir = tmp_path / "sweep"
    seq_lens = [32, 64, 128, 256]
    args = ["cpu_small", *TINY, "variant=full,linear", f"seq_lens=[{','.join(map(str, seq_lens))}]",
            "measure.min_run_time=0.1", f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep_dir}"]

    def full(p) -> int | None:  # job 0 (full), once it has measured its first point
        status = (jobs(sweep_dir) if sweep_dir.is_dir() else {}).get("full", tmp_path) / "status.json"
        return info["pid"] if status.is_file() and (info := json.loads(status.read_text())).get("points_done") else None
    out, err = sweep_with_a_job_killed(args, tmp_path, full)
    summary = [line for line in out.splitlines() if line.startswith("jobs: 2 (")]
    assert len(summary) == 1 and "failed" in summary[0], (out + err)[-3000:]
    killed = json.loads((jobs(sweep_dir)["full"] / "status.json").read_text())
    assert killed["state"] == "failed" and "rerun the same command to resume" in killed["error"], killed
    assert re.search(r"^error: job 0 \(.*variant=full\): ", err, re.M), err[-3000:]
    if launcher != "local_parallel":
        return
    again = sweep(*args, cwd=tmp_path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    for variant, job in jobs(sweep_dir).items():
        rows = [json.loads(line) for line in (job / "results.jsonl").read_text().splitlines() if line.strip()]
        assert sorted(r["seq_len"] for r in rows) == seq_lens, (variant, rows)
        assert json.loads((job / "status.json").read_text())["state"] == "completed", variant


@pytest.mark.parametrize("preset", ["no_such_preset", "../sweep/cpu_small"])
def test_unknown_preset_is_one_line_and_no_sweep_dir(tmp_path, preset):
    before = set((ROOT / "multirun").glob("*")) if (ROOT / "multirun").is_dir() else set()
    p = sweep(preset, *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert p.returncode != 0
    out = lines(p)
    assert len(out) == 1, out
    assert preset in out[0] and all(name in out[0] for name in PRESETS), out[0]
    assert not (tmp_path / "sweep").exists()
    p = sweep(preset, cwd=tmp_path)  # the default sweep dir is not made either
    assert p.returncode != 0 and len(lines(p)) == 1
    after = set((ROOT / "multirun").glob("*")) if (ROOT / "multirun").is_dir() else set()
    assert after == before


def test_flags_after_overrides_reach_hydra_and_a_printing_flag_runs_no_sweep(tmp_path):
    """`sweep.sh PRESET variant=full --cfg job` put the flag after the script's own sweep=PRESET, and the
    harness refused it (Hydra reads no override after a flag that follows one); --cfg with the script's
    --multirun could not work either. The script puts flags first; one that prints runs no job."""
    sweep_dir = tmp_path / "sweep"
    p = sweep("cpu_small", "variant=full", "--cfg", "job", "seq_lens=[64]", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "_target_: variants.Full" in p.stdout and "- 64" in p.stdout, p.stdout  # the overrides either side
    p = sweep("cpu_small", "--info", "variant=full", cwd=tmp_path)  # --info's optional value is not the override
    assert p.returncode == 0 and "Defaults List" in p.stdout, p.stdout + p.stderr
    p = sweep("cpu_small", "variant=full,linear", "-c", "job", cwd=tmp_path)  # Hydra's 5 lines, exit 1
    assert (p.returncode, lines(p)) == (2, ["error: --cfg prints one job's config, and variant=full,linear sweeps "
                                            "over several; allowed: one value per key with --cfg (e.g. variant=full)"])
    p = sweep("cpu_small", "variant=full", "--cfg", cwd=tmp_path)  # else Hydra's: "invalid choice: 'sweep=cpu_small'"
    assert (p.returncode, lines(p)) == (2, ["sweep.sh: --cfg needs a value; see python -m harness --hydra-help"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, args, first", [
    ("sweep.sh", [], f"sweep.sh: missing PRESET (conf/sweep/PRESET.yaml); allowed: {', '.join(PRESETS)}"),
    ("slurm_cluster.sh", [], "slurm_cluster: missing command; allowed: start, stop, env, status"),
    ("slurm_cluster.sh", ["nope"], "slurm_cluster: unknown command 'nope'; allowed: start, stop, env, status")])
def test_a_missing_or_unknown_command_is_one_line_and_help_the_usage(tmp_path, script, args, first):
    """Both printed their whole usage (some 20 lines) for a missing or unknown argument; --help still does."""
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "scripts" / script), *argv], cwd=tmp_path,
                              env=env(CLUSTER_DIR=str(tmp_path / "cluster")), capture_output=True, text=True, timeout=60)

    p = run(*args)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", f"{first}; see --help\n"), p.stdout + p.stderr
    usage = run("--help")
    assert usage.returncode == 0 and usage.stderr.startswith(f"scripts/{script} ") and len(lines(usage)) > 10
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_to_the_script_ends_the_sweep_it_runs_as_interrupted(tmp_path):
    """kill (or a scheduler's cancel) reaches sweep.sh alone: it passes it on, and the harness records its
    job interrupted and ends before the script, which says where the sweep is (the harness went on
    measuring unattended, holding its directory, and the script ended with bash's "Terminated")."""
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(["bash", str(SWEEP_SH), "cpu_small", "variant=full", "seq_lens=[32,64,128,256,512,1024]",
                             "num_heads=1", "head_dim=8", "measure.min_run_time=0.3", "fidelity.enabled=false",
                             "logger=none", f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not any(p.read_text().strip() for p in sweep_dir.glob("*/results.jsonl")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        time.sleep(0.05)  # the first point measured
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].splitlines()
    assert proc.returncode == 143, out[-10:]
    assert out[-3].startswith("error: interrupted (SIGTERM) after ") and out[-2:] == [
        f"sweep cpu_small -> {sweep_dir} (exit 143)", f"report: {sys.executable} -m harness.report {sweep_dir}"], out[-10:]
    (status,) = sweep_dir.glob("*/status.json")
    assert json.loads(status.read_text())["state"] == "interrupted"


def test_harness_exit_code_propagates(tmp_path):
    p = sweep("cpu_small", "no_such_key=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no_such_key" in p.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_refused_job_makes_the_sweep_exit_1_and_the_others_complete(tmp_path):
    sweep_dir = tmp_path / "sweep"
    p = sweep("cpu_small", *TINY, "variant=full,linear", "causal=true", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "jobs: 2 (completed 1, refused 1)" in p.stdout and "not every job of the sweep completed" in p.stderr
    check_jobs(sweep_dir, ["full"])  # linear cannot be causal: refused, its job dir holds status.json only


def test_a_multirun_with_a_refused_job_exits_1_without_the_script(tmp_path):
    """The harness itself says how a multirun ended (harness/hydra_hooks.py), so `python -m harness -m` with a
    value every job refuses is not exit 0."""
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, "variant=linear", "causal=true",
                        f"hydra.sweep.dir={tmp_path}"],
                       check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "jobs: 1 (refused 1)" in p.stdout
    error = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert "causal" in error[0] and "not every job of the sweep completed" in error[-1], p.stderr


def test_a_job_failing_in_the_harness_itself_still_ends_with_the_summary(tmp_path):
    """A job that fails outside any point (here wandb refuses the run id stored in its directory) is said
    in one line, status failed; the other job completes and the multirun prints its summary, exit 1
    (raised, the failure ended the multirun in Hydra's traceback before the summary)."""
    first = tmp_path / "0" / "wandb"  # job 0: variant=full
    first.mkdir(parents=True)
    (first / "harness-run.json").write_text(json.dumps({"id": "bad/id", "next_step": 0}))
    tiny = [a for a in TINY if a != "logger=none"]
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *tiny, "variant=full,linear", "logger=wandb",
                        "logger.mode=offline", f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${hydra.job.num}"],
                       check=False, cwd=ROOT, env=env(WANDB_SILENT="true"), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "jobs: 2 (completed 1, failed 1)" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    failed = [line for line in p.stderr.splitlines() if line.startswith("error: job 0")]
    assert len(failed) == 1 and "failed:" in failed[0], p.stderr[-2000:]
    assert json.loads((tmp_path / "0" / "status.json").read_text())["state"] == "failed"


class Unmovable(variants.Full):
    """A variant that fails before its run writes a status (moved to the device: a sequence-parallel job's
    group failing to start is another such failure)."""

    def _apply(self, *args, **kwargs):
        raise RuntimeError("cannot be moved")


def test_a_job_failing_before_its_run_wrote_a_status_is_counted(tmp_path):
    """It left no status.json: the summary counted the other jobs only ("jobs: 1 (failed 1)" for two)."""
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, f"variant._target_={__name__}.Unmovable",
                        "causal=false,true", f"hydra.sweep.dir={tmp_path}"],
                       check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1 and "jobs: 2 (failed 2)" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    states = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("*/status.json"))]
    assert [(s["state"], s["error"]) for s in states] == [("failed", "RuntimeError: cannot be moved")] * 2


class UnmovableInJob0(variants.Full):
    """Fails before its first point in the multirun's job 0 only (its status.json: failed)."""

    def _apply(self, *args, **kwargs):
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.get().job.num == 0:
            raise RuntimeError("cannot be moved")
        return super()._apply(*args, **kwargs)


def test_jobs_sharing_a_directory_each_count_in_the_summary(tmp_path):
    """seq_lens is not in a job directory's name: the three jobs of seq_lens=[32],[48],[64] write one
    status.json. The summary counted the directory once, in its last writer's state: "jobs: 1 (completed 1)",
    exit 0, for a sweep whose job 0 failed. Each job counts, in its own state."""
    tiny = [a for a in TINY if not a.startswith("seq_lens=")]
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *tiny, f"variant._target_={__name__}.UnmovableInJob0",
                        "seq_lens=[32],[48],[64]", f"hydra.sweep.dir={tmp_path}"],
                       check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1 and "jobs: 3 (completed 2, failed 1)" in p.stdout, p.stdout + p.stderr
    assert p.stderr.splitlines()[-1].endswith("; rerun the same command to resume"), p.stderr[-2000:]
    (status,) = [json.loads(f.read_text()) for f in tmp_path.glob("*/status.json")]
    assert (status["state"], status["job"], status["jobs"]) == ("completed", 2, {"0": "failed", "1": "completed"})


def test_a_job_of_the_multirun_killed_while_it_said_running_is_gone_in_the_next_jobs_status(tmp_path, monkeypatch):
    """Jobs sharing a directory keep each other's final states in status.json (``jobs``). An earlier job
    killed without a word left "running"; the job writing now holds the directory, so the lock cannot tell
    that the earlier one is gone: its state is kept as "gone", never "running" (the summary would count a
    killed job as still running)."""
    from harness.results import MULTIRUN_ENV, DirectoryLock, JobStatus

    monkeypatch.setenv(MULTIRUN_ENV, "host:1:1")
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "multirun": "host:1:1", "job": 0,
                                                     "jobs": {"2": "completed"}}))
    lock = DirectoryLock(tmp_path).acquire()  # this job's run holds the directory
    try:
        assert JobStatus(tmp_path, 2, job=1).info["jobs"] == {"0": "gone", "2": "completed"}
    finally:
        lock.release()


def test_the_summary_counts_this_multiruns_jobs_not_an_earlier_sweeps(tmp_path):
    """A job an earlier sweep left interrupted in the same sweep directory (another sub-grid) is not one of
    this multirun's: it neither shows in the summary nor makes the multirun exit 1. Its status.json names
    its multirun; one of older code, which names none, counts where it changed after this one started
    (less a clock slack: the earlier sweep's job interrupted a minute before was counted)."""
    old, recent = tmp_path / "old", tmp_path / "recent"
    for job, multirun in ((old, None), (recent, "host:1:1")):
        job.mkdir()
        (job / "status.json").write_text(json.dumps({"state": "interrupted", "error": "interrupted (Ctrl-C)",
                                                     **({"multirun": multirun} if multirun else {})}))
    hour_ago = time.time() - 3600
    os.utime(old / "status.json", (hour_ago, hour_ago))
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, "variant=full", f"hydra.sweep.dir={tmp_path}",
                        "hydra.sweep.subdir=new"], check=False, cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "jobs: 1 (completed 1)" in p.stdout, p.stdout
    assert json.loads((tmp_path / "new" / "status.json").read_text())["multirun"].count(":") == 2


def test_parallel_jobs_sharing_a_directory_wait_for_each_other(tmp_path):
    """seq_lens is not part of a job's directory name: a sweep over it has two jobs in one directory,
    which the parallel launcher runs at once. The second waits for the first, then both are measured."""
    sweep_dir = tmp_path / "sweep"
    p = sweep("cpu_small", *TINY, "variant=full", "seq_lens=[32],[64]", "hydra/launcher=local_parallel",
              f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "jobs: 2 (completed 2)" in p.stdout, p.stdout  # each job, not the directory ("jobs: 1")
    (job,) = jobs(sweep_dir).values()
    rows = [json.loads(line) for line in (job / "results.jsonl").read_text().splitlines()]
    assert sorted(r["seq_len"] for r in rows) == [32, 64] and all(r["status"] == "ok" for r in rows), rows


def test_a_job_killed_while_it_waits_for_its_shared_directory_counts_as_failed(tmp_path):
    """Under joblib, a job of a seq_lens sweep waits for the job holding their one directory; SIGKILLed
    while it waits, it has written nothing there: status.json was the other job's, so the launcher said it
    in a line but the summary left it out ("jobs: 1 (completed 1)"). Now its own status says failed, the
    other job's state kept beside it."""
    from harness.results import job_state

    sweep_dir = tmp_path / "sweep"
    args = ["cpu_small", *TINY, "variant=full", "seq_lens=[32,64,128,256],[48,96,192,384]", "measure.min_run_time=0.2",
            "hydra/launcher=local_parallel", f"hydra.sweep.dir={sweep_dir}"]
    holder: dict = {}

    def waiting(p) -> int | None:  # the first job holds the directory and has measured a point; the other waits
        status = next(iter(jobs(sweep_dir).values()), tmp_path) / "status.json" if sweep_dir.is_dir() else tmp_path
        holder.update(json.loads(status.read_text()) if status.is_file() else {})
        others = [int(pid) for pid in subprocess.run(["pgrep", "-f", "popen_loky"], capture_output=True,
                                                     text=True).stdout.split()
                  if int(pid) != holder.get("pid") and os.getsid(int(pid)) == p.pid]
        # A holder naming another job (its "jobs") came second: the other has ended, its worker is idle
        first = holder.get("multirun") is not None and not holder.get("jobs")
        return others[0] if holder.get("points_done") and first and len(others) == 1 else None
    out, err = sweep_with_a_job_killed(args, tmp_path, waiting)
    # loky may stop the holder too, or let it finish first; stopped, it is failed whichever job the launcher
    # says first (it was "gone", kept so in the killed job's status, where the killed job was said first)
    summary = [line for line in out.splitlines() if line.startswith("jobs: ")]
    assert len(summary) == 1 and re.fullmatch(r"jobs: 2 \((completed 1, )?failed [12]\)", summary[0]), \
        (out + err)[-3000:]
    (job,) = jobs(sweep_dir).values()
    state = job_state(job)
    # The last status.json written is the killed job's, or the holder's where loky stopped it and the
    # launcher said its end after the killed one's: either way both jobs are there, the killed one failed.
    recorded = {str(state["job"]): state["state"], **state["jobs"]}
    killed = ({"0", "1"} - {str(holder["job"])}).pop()
    assert recorded.keys() == {"0", "1"} and recorded[killed] == "failed" and state["state"] == "failed", state


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["waiting-job-said-first", "holder-said-first"])
def test_both_jobs_killed_in_a_shared_directory_are_failed_whichever_the_launcher_says_first(tmp_path, monkeypatch,
                                                                                           order, capsys):
    """The launcher's end of two killed jobs sharing one directory, in either order, without the race of
    the test above: job 1 held the directory and was killed in its run (status.json says running, no lock
    held), job 0 was killed waiting for it (it wrote nothing). Said first, job 0 kept job 1 as "gone" in
    its status; job 1, said second, stayed "gone" there ("failed 1, gone 1" in the summary) until
    ended_unfinished rewrote it."""
    from types import SimpleNamespace

    from harness.results import MULTIRUN_ENV, JobStatus, job_state
    from hydra_plugins.harness_launchers import ended_unfinished

    monkeypatch.setenv(MULTIRUN_ENV, "multirun-1")
    JobStatus(tmp_path, 4, job=1).save()  # job 1's run, SIGKILLed after it began: "running"
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path.parent), "subdir": tmp_path.name},
                                      "job": {"override_dirname": "seq_lens=..."}}})
    context = SimpleNamespace(config_loader=SimpleNamespace(load_sweep_config=lambda config, overrides: cfg))
    for num in order:
        ended_unfinished(context, cfg, [], num, "killed")
    state = job_state(tmp_path)
    assert {str(state["job"]): state["state"], **state["jobs"]} == {"0": "failed", "1": "failed"}, state
    assert capsys.readouterr().err.count("error: job ") == 2  # each said in one line


def test_a_rerun_with_more_lengths_extends_the_same_jobs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    assert sweep("cpu_small", *TINY, "variant=full", "seq_lens=[32]", f"hydra.sweep.dir={sweep_dir}",
                 cwd=tmp_path).returncode == 0
    first = (jobs(sweep_dir)["full"] / "results.jsonl").read_text().splitlines()
    assert len(first) == 1
    assert sweep("cpu_small", *TINY, "variant=full", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path).returncode == 0
    check_jobs(sweep_dir, ["full"])
    assert (jobs(sweep_dir)["full"] / "results.jsonl").read_text().splitlines()[0] == first[0]


def hydra_launcher_cfg(launcher: str, *overrides: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "harness", "sweep=cpu_small", f"hydra/launcher={launcher}",
                        *overrides, "--cfg", "hydra", "-p", "hydra.launcher"],
                       check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return yaml.safe_load(p.stdout)


def test_slurm_launcher_composes_and_makes_the_sbatch_script(tmp_path, monkeypatch):
    cfg = hydra_launcher_cfg("slurm", "hydra.launcher.partition=gpu")
    # The plugin's launcher, waiting for every job (tests/test_slurm.py runs it on a real cluster).
    assert cfg["_target_"] == "hydra_plugins.harness_launchers.SlurmLauncher"
    from hydra_plugins.harness_launchers import SlurmLauncher
    # By name: Hydra's plugin scan may have loaded the plugin's module afresh in this process.
    assert "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in {
        f"{c.__module__}.{c.__qualname__}" for c in SlurmLauncher.__mro__}
    assert cfg["partition"] == "gpu"
    assert cfg["gpus_per_node"] == 1
    assert isinstance(cfg["timeout_min"], int) and cfg["timeout_min"] > 0
    # Every key is one of the plugin's (its structured config refuses others at composition) and one that
    # submitit turns into an sbatch line: the plugin's own mapping (SubmititLauncher.launch), on a
    # machine without SLURM.
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf
    from submitit.slurm import slurm

    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm",
                                     slurm_max_num_timeout=cfg["max_num_timeout"])
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    params = {k if k in base else f"slurm_{k}": v for k, v in cfg.items()
              if k not in ("_target_", "submitit_folder", "max_num_timeout")}
    params["name"] = "harness"  # ${hydra.job.name}
    executor.update_parameters(**params)
    script = executor._executor._make_submission_file_text("python -m harness", "0")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1", "#SBATCH --time=120",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --mem=64GB"):
        assert line in script, script
    assert "@120" in next(line for line in script.splitlines() if line.startswith("#SBATCH --signal="))


def test_the_local_launchers_compose_to_the_harness_launchers():
    """local_parallel is joblib's config with the harness's JoblibLauncher; submitit_local the plugin's
    own config (its keys, validated) with the harness's LocalLauncher."""
    from hydra_plugins.harness_launchers import JoblibLauncher, LocalLauncher
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher as StockJoblibLauncher

    cfg = hydra_launcher_cfg("local_parallel")
    assert cfg["_target_"] == "hydra_plugins.harness_launchers.JoblibLauncher"
    assert cfg["n_jobs"] == 2 and issubclass(JoblibLauncher, StockJoblibLauncher)
    cfg = hydra_launcher_cfg("submitit_local")
    assert cfg["_target_"] == "hydra_plugins.harness_launchers.LocalLauncher" and LocalLauncher._EXECUTOR == "local"
    assert {"timeout_min", "cpus_per_task", "mem_gb", "submitit_folder"} <= set(cfg), cfg


def dashboard(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DASHBOARD), *args], check=False, cwd=home, env=env(HOME=str(home)),
                          capture_output=True, text=True, timeout=60)


def test_wandb_dashboard_without_credentials_is_one_line(tmp_path):
    p = dashboard("some/sweep/group", home=tmp_path)
    assert p.returncode == 1
    out = lines(p)
    assert len(out) == 1, out
    assert "no wandb credentials" in out[0] and "harness.report" in out[0]
    assert "Traceback" not in p.stderr
    missing = dashboard(home=tmp_path)  # no SWEEP_GROUP: argparse's refusal, one line too
    assert missing.returncode == 2 and lines(missing) == [
        "wandb_dashboard: error: the following arguments are required: SWEEP_GROUP; see --help"], missing.stderr
    for args, what in ((["", "--dry-run"], "SWEEP_GROUP is empty"), (["g", "--group-by", " ", "--dry-run"],
                                                                    "--group-by is empty")):
        p = dashboard(*args, home=tmp_path)  # "" was read as the current directory; "" as a run key
        assert p.returncode == 2 and len(lines(p)) == 1 and what in lines(p)[0], p.stderr


def test_wandb_dashboard_report_outline(tmp_path):
    """Offline (--dry-run): with wandb-workspaces (a test extra), the report's grids, filter and panels;
    without it (an import that fails, as where it is not installed), one line saying how to install it."""
    group = "/runs/multirun/cpu_small/2026-11-22T07-00-00Z"
    (tmp_path / "missing" / "wandb_workspaces").mkdir(parents=True)
    (tmp_path / "missing" / "wandb_workspaces" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb_workspaces'\", name='wandb_workspaces')\n")
    p = subprocess.run([sys.executable, str(DASHBOARD), group, "--dry-run"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=env(HOME=str(tmp_path), PYTHONPATH=str(tmp_path / "missing")))
    out = lines(p)
    assert p.returncode == 1 and len(out) == 1 and "pip install 'wandb-workspaces" in out[0], out
    p = dashboard(group, "--dry-run", "--entity", "me", home=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert (report["entity"], report["project"]) == ("me", "attention-harness")
    grids = [b for b in report["blocks"] if b["block"] == "PanelGrid"]
    assert len(grids) == 3
    metrics = set()
    for grid in grids:
        (runset,) = grid["runsets"]
        assert group in runset["filters"] and "Group" in runset["filters"]
        assert runset["groupby_keys"] == ["variant_label.value"]  # the variant with its options
        for panel in grid["panels"]:
            assert panel["panel"] == "LinePlot" and panel["x"] == "seq_len"
            metrics.update(panel["y"])
    assert metrics == {"fwd_ms", "bwd_ms", "fwd_bwd_ms", "peak_mem_bytes", "out_rel_err", "mass_kept",
                       "task_accuracy"}


def test_the_group_of_a_sweeps_runs_is_logger_group_where_its_jobs_set_it(tmp_path):
    """The report's wandb run and the dashboard go to the group, project and entity the jobs logged to (the
    project and entity were the defaults whatever the jobs had set)."""
    from harness.logger import jobs_logger, sweep_group_name

    for job, logger in (("0", {"name": "none", "project": "elsewhere"}), ("1", {"name": "wandb", "group": None})):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "config.yaml").write_text(json.dumps({"logger": logger}))
    assert jobs_logger(tmp_path) == {}  # the jobs' group is the sweep's name then
    assert sweep_group_name(tmp_path) == "/".join(tmp_path.parts[-2:])
    (tmp_path / "1" / ".hydra" / "config.yaml").write_text(json.dumps(
        {"logger": {"name": "wandb", "group": "ab", "project": "myproj", "entity": "myteam"}}))
    assert jobs_logger(tmp_path) == {"group": "ab", "project": "myproj", "entity": "myteam"}
    # Their mode too, where they set one (online or offline): the report's run went online beside offline runs
    for modes, want in ((("offline",), {"mode": "offline"}), (("offline", "online"), {}), (("disabled",), {})):
        for job, mode in zip(("1", "0"), modes):
            (tmp_path / job / ".hydra" / "config.yaml").write_text(json.dumps(
                {"logger": {"name": "wandb", "group": "ab", "project": "myproj", "entity": "myteam", "mode": mode}}))
        assert jobs_logger(tmp_path) == {"group": "ab", "project": "myproj", "entity": "myteam", **want}, modes
    # Jobs that logged to two projects: the report and the dashboard charted the first one's, unsaid
    (tmp_path / "0" / ".hydra" / "config.yaml").write_text(json.dumps({"logger": {"name": "wandb", "project": "pB"}}))
    with pytest.raises(ValueError, match=r"^the sweep's jobs logged to several wandb projects \(myproj, pB\); "):
        jobs_logger(tmp_path)
    (tmp_path / "0" / "results.jsonl").write_text("")
    p = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path), "--wandb"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "several wandb projects (myproj, pB)" in p.stderr, p.stderr
    assert not (tmp_path / "report").exists()
    if importlib.util.find_spec("wandb_workspaces") is not None:  # an extra: checked where installed
        p = dashboard(str(tmp_path), "--dry-run", home=tmp_path)
        assert p.returncode == 1 and "several wandb projects (myproj, pB)" in p.stderr, p.stdout + p.stderr
    (tmp_path / "0" / ".hydra" / "config.yaml").write_text(json.dumps({"logger": {"name": "none"}}))
    p = dashboard(str(tmp_path), "--dry-run", home=tmp_path)
    if importlib.util.find_spec("wandb_workspaces") is not None:  # an extra: its outline where installed
        assert p.returncode == 0, p.stdout + p.stderr
        assert (json.loads(p.stdout)["entity"], json.loads(p.stdout)["project"]) == ("myteam", "myproj")


# MQAR at tiny sizes, from a config Hydra finds elsewhere (--config-path: not checked up front), so a job
# with N=16 (MQAR needs N >= 24 here) is refused at run time
MQAR_TINY = ["--config-path=../conf", "task=mqar", "task.steps=1", "task.eval_size=4", "task.batch_size=2",
             "task.warmup_steps=0", "num_heads=1", "head_dim=8", "measure.passes=[]", "measure.memory=false",
             "fidelity.enabled=false", "logger=none"]


def test_a_job_refused_in_a_directory_another_job_completed_leaves_its_status_and_is_counted(tmp_path):
    """seq_lens is not in a job directory's name: the jobs of seq_lens=[32],[16] share one. The second is
    refused at run time (MQAR needs N >= 24 here): the first's status.json still says completed, the
    refusal is in the sweep's refused-jobs.jsonl and counted, and the last line does not promise that
    rerunning resumes what the same command refuses again. (The command line's own check refuses that
    value before any job runs; a config Hydra finds elsewhere, --config-path, is not checked up front.)"""
    tiny = [*MQAR_TINY, "seq_lens=[32],[16]"]
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *tiny, f"hydra.sweep.dir={tmp_path}"], check=False,
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    (status,) = tmp_path.glob("*/status.json")
    assert json.loads(status.read_text())["state"] == "completed"
    assert "jobs: 2 (completed 1, refused 1)" in p.stdout, p.stdout
    (refused,) = [json.loads(x) for x in (tmp_path / "refused-jobs.jsonl").read_text().splitlines()]
    assert refused["job"] == 1 and "seq_len=16 is too short" in refused["error"], refused
    error = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 2 and "job 1" in error[0] and "seq_len=16 is too short" in error[0], p.stderr
    assert "rerun the same command to resume" not in error[1] and "refused again" in error[1], error[1]


def test_a_job_refused_before_another_job_completed_in_its_directory_is_counted(tmp_path):
    """The other order: job 0 (N=16) is refused in the empty directory and says so in its status.json;
    job 1 then completes there. The summary said "jobs: 1 (completed 1)", exit 0: the refusal was lost."""
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *MQAR_TINY, "seq_lens=[16],[32]",
                        f"hydra.sweep.dir={tmp_path}"], check=False, cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 1 and "jobs: 2 (completed 1, refused 1)" in p.stdout, p.stdout + p.stderr
    assert "refused again" in p.stderr.splitlines()[-1], p.stderr[-2000:]
    (status,) = [json.loads(f.read_text()) for f in tmp_path.glob("*/status.json")]
    assert (status["state"], status["job"], status["jobs"]) == ("completed", 1, {"0": "refused"})


def test_a_multirun_whose_job_is_refused_at_run_time_exits_1_and_says_a_rerun_refuses_it_again(tmp_path):
    """What test_a_multirun_with_a_refused_job_exits_1_without_the_script checks, with a job refused at run
    time (linear cannot be causal): a bad value (seq_len=-5) is now refused before any job runs, exit 2.
    A refusal is not resumed by rerunning the same command, and the last line does not say it is."""
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, "variant=linear", "causal=true",
                        f"hydra.sweep.dir={tmp_path}"], check=False, cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "jobs: 1 (refused 1)" in p.stdout
    error = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert "causal" in error[0] and "not every job of the sweep completed" in error[-1], p.stderr
    assert error[-1].endswith("a job refused for its input is refused again by the same command: change that input "
                              "first"), error[-1]
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, "seq_len=-5",
                        f"hydra.sweep.dir={tmp_path / 'x'}"], check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (2, "error: seq_len must be an integer > 0; got -5\n"), p.stdout + p.stderr
    assert not (tmp_path / "x").exists()


def test_the_last_line_tells_a_refusal_from_what_a_rerun_resumes():
    """A job refused for its input is refused again by the same command; interrupted jobs, and jobs
    refused because another command's run held their directory, resume."""
    from collections import Counter

    from harness.hydra_hooks import not_complete_line

    head = "not every job of the sweep completed (S; see each job's status.json and the lines above)"
    resumable = Counter({"completed": 1, "interrupted": 1, "refused (directory in use)": 1})
    assert not_complete_line("S", resumable) == head + "; rerun the same command to resume"
    assert not_complete_line("S", resumable + Counter(refused=1)) == head + (
        "; rerun the same command to resume the jobs that did not finish (a job refused for its input is refused "
        "again until that input changes)")
    assert not_complete_line("S", Counter(completed=2, refused=1)) == head + (
        "; a job refused for its input is refused again by the same command: change that input first")


def test_slurm_launcher_without_slurm_is_one_line(tmp_path):
    """On a machine without SLURM (no srun, sbatch on PATH) hydra/launcher=slurm submits nothing: one
    line naming why, exit 1, not the submission's traceback."""
    p = subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, "variant=full", "hydra/launcher=slurm",
                        "hydra.launcher.gpus_per_node=null", f"hydra.sweep.dir={tmp_path}"],
                       check=False, cwd=ROOT, env=env(PATH=str(tmp_path / "no-slurm-here")), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: hydra/launcher=slurm submitted nothing: ") and "srun" in line, line


def test_a_job_directory_past_a_file_names_limit_is_hashed_and_keeps_its_last_overrides():
    """Hydra names a sweep's job directory by its overrides; past 255 bytes its mkdir failed in a traceback
    before the harness ran (the GPU job's dry run, once one more measure.* override was added)."""
    from harness.config import NAME_MAX, job_dirname

    short = "variant.backend=math,variant=full"
    assert job_dirname(short) == short
    items = [f"measure.option_{i:02d}={'x' * 20}" for i in range(12)] + ["variant.backend=dense", "variant=blockwise"]
    long = ",".join(items)
    name = job_dirname(long)
    assert len(long.encode()) > NAME_MAX >= len(name.encode()) and name == job_dirname(long)  # the same job, the same directory
    assert re.fullmatch(r"sha1-[0-9a-f]{12},.*,variant\.backend=dense,variant=blockwise", name), name
    assert job_dirname(long.replace("dense", "flex")) != name
    assert OmegaConf.create({"a": long, "b": "${job_dirname:${a}}"}).b == name  # the resolver conf/config.yaml names
