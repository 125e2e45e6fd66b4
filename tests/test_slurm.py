"""Sweeps through a real SLURM cluster: scripts/slurm_cluster.sh starts one on this machine (slurmctld,
slurmd, slurmdbd, munged; installed with apt-get where missing), and scripts/sweep.sh submits to it with
hydra/launcher=slurm, through the real sbatch, sacct and scancel. Skipped, with the reason, only where
the packages cannot be installed (not root, no apt-get, no network). About 1.5 minutes on 2 cores, plus
the installation the first time.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.results import job_state, parse_jsonl, point_key, result_files

from .conftest import patch_on_import

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "scripts" / "slurm_cluster.sh"
SWEEP_SH = ROOT / "scripts" / "sweep.sh"
TINY = ["num_heads=1", "head_dim=8", "measure.warmup_iters=1", "fidelity.enabled=false", "logger=none"]
# The test cluster's node has no GPU and little to spare: one core and 1 GB per job, a short time limit.
ON_TEST_CLUSTER = ["hydra/launcher=slurm", "hydra.launcher.partition=debug", "hydra.launcher.gpus_per_node=null",
                   "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]
WANDB_ENV = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC", "WANDB_ENTITY",
             "WANDB_PROJECT")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment that points Slurm's commands at a fresh cluster; the cluster is stopped (its
    jobs cancelled, its daemons ended) afterwards, whatever happened."""
    cluster_dir = tmp_path_factory.mktemp("slurm")
    env = {k: v for k, v in os.environ.items() if k not in WANDB_ENV}
    env.update(CLUSTER_DIR=str(cluster_dir), WANDB_MODE="disabled", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    try:
        p = subprocess.run(["bash", str(CLUSTER_SH), "start"], env=env, capture_output=True, text=True, timeout=600)
        if p.returncode == 3:  # the packages are missing and cannot be installed here
            pytest.skip(p.stderr.strip().splitlines()[-1])
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.strip() == f"export SLURM_CONF={cluster_dir}/etc/slurm.conf"
        env["SLURM_CONF"] = str(cluster_dir / "etc" / "slurm.conf")
        # Starting it again is harmless: it says so and changes nothing.
        again = subprocess.run(["bash", str(CLUSTER_SH), "start"], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already up" in again.stderr, again.stderr
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "stop"], env=env, capture_output=True, timeout=120)
        assert not cluster_dir.exists()


def sweep(env, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SWEEP_SH), "cpu_small", *TINY, *ON_TEST_CLUSTER, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 150) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the sweep did not end within {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    return p.returncode, out, err


def slurm(env, *cmd: str) -> str:
    return subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=30).stdout


def rows_by_job(sweep_dir: Path) -> dict[str, list[dict]]:
    """variant -> the valid rows of its job's results.jsonl, in file order (every row, superseded or not)."""
    return {variant: parse_jsonl((d / "results.jsonl").read_text()).rows if (d / "results.jsonl").exists() else []
            for variant, d in job_dirs(sweep_dir).items()}


def job_dirs(sweep_dir: Path) -> dict[str, Path]:
    return {dict(kv.split("=", 1) for kv in d.name.split(","))["variant"]: d
            for d in sweep_dir.iterdir() if d.is_dir() and "variant=" in d.name}


def each_point_once(sweep_dir: Path, variants: list[str], seq_lens: list[int]) -> None:
    rows = [r for f in result_files(sweep_dir) for r in parse_jsonl(f.read_text()).rows]
    counts = collections.Counter(point_key(r) for r in rows)
    assert set(counts.values()) == {1}, counts
    assert sorted((r["variant"], r["seq_len"]) for r in rows) == sorted((v, n) for v in variants for n in seq_lens)
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]


def array_jobs(sweep_dir: Path) -> list[str]:
    """The SLURM array tasks the sweep submitted (submitit's folders are named by them), e.g. 12_0, 12_1."""
    return sorted((d.name for d in (sweep_dir / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", d.name)),
                  key=lambda name: int(name.split("_")[1]))


def sacct_states(env, jobs: list[str]) -> dict[str, str]:
    """SLURM's accounting of the jobs, once each has ended (a job's result is on disk a moment before
    SLURM records its end)."""
    deadline = time.monotonic() + 30
    while True:
        out = slurm(env, "sacct", "-n", "-P", "-o", "JobID,State", *(f"-j{j}" for j in jobs))
        states = {j: s for j, s in (line.split("|") for line in out.splitlines()) if j in jobs}
        if all(states.get(j, "RUNNING") not in ("PENDING", "RUNNING", "COMPLETING") for j in jobs):
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.5)


def test_sweep_through_sbatch_every_point_once_and_the_report(cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    rc, out, err = finish(sweep(cluster, "variant=full,linear", "seq_lens=[32,64]", "measure.min_run_time=0.01",
                                f"hydra.sweep.dir={sweep_dir}"))
    assert rc == 0, out[-2000:] + err[-3000:]
    assert "jobs: 2 (completed 2)" in out
    jobs = array_jobs(sweep_dir)
    assert len(jobs) == 2
    assert set(sacct_states(cluster, jobs).values()) == {"COMPLETED"}  # they did run as SLURM jobs
    each_point_once(sweep_dir, ["full", "linear"], [32, 64])
    for job in job_dirs(sweep_dir).values():
        assert job_state(job)["state"] == "completed"
    report = subprocess.run([sys.executable, "-m", "harness.report", str(sweep_dir)], cwd=ROOT, env=cluster,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert (sweep_dir / "report" / "report.html").stat().st_size > 0
    assert len((sweep_dir / "report" / "results.csv").read_text().splitlines()) == 1 + 4


def test_cancelled_and_failed_jobs_are_said_and_the_same_command_resumes(cluster, tmp_path):
    """Half way, one job is cancelled (scancel: SIGTERM) and the other killed (SIGKILL, as the OOM killer
    or a lost node would): the sweep says so, job by job, and exits 1; the same command then measures
    only what is missing: every point exactly once, the earlier rows untouched."""
    sweep_dir = tmp_path / "sweep"
    seq_lens = [32, 64, 128, 256]
    args = ["variant=full,linear", f"seq_lens=[{','.join(map(str, seq_lens))}]", "measure.min_run_time=0.3",
            f"hydra.sweep.dir={sweep_dir}"]
    # submitit's wait for a late result file made 600 s instead of its 15: a launcher that waited for the
    # killed jobs' results (they write none) would not end within finish's limit
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        patch_on_import("submitit.core.core", "module.Job._results_timeout_s = 600"))
    p = sweep({**cluster, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"),
                                                                      cluster.get("PYTHONPATH")]))}, *args)
    signalled: set[str] = set()
    deadline = time.monotonic() + 120
    while len(signalled) < 2:  # each job, as soon as it has measured its first point
        for variant, rows in (rows_by_job(sweep_dir) if sweep_dir.is_dir() else {}).items():
            if rows and variant not in signalled:
                full_job, linear_job = array_jobs(sweep_dir)  # the sweep's order: job 0 full, job 1 linear
                if variant == "full":
                    slurm(cluster, "scancel", full_job)
                else:  # SIGKILL to the run itself (scancel --signal=KILL is a plain cancel: SIGTERM first)
                    os.kill(json.loads((job_dirs(sweep_dir)["linear"] / "status.json").read_text())["pid"],
                            signal.SIGKILL)
                signalled.add(variant)
        assert p.poll() is None and time.monotonic() < deadline, (p.poll(), signalled)
        time.sleep(0.1)
    rc, out, err = finish(p)  # neither killed job writes a result: the launcher does not wait for one
    assert rc == 1, out[-2000:] + err[-3000:]
    assert "jobs: 2 (failed 1, interrupted 1)" in out, out[-2000:]
    assert "rerun the same command to resume" in err
    states = sacct_states(cluster, [full_job, linear_job])
    assert states[full_job].startswith("CANCELLED") and states[linear_job] == "FAILED", states
    jobs = job_dirs(sweep_dir)
    assert job_state(jobs["full"])["state"] == "interrupted"  # the run said so itself (SIGTERM)
    failed = job_state(jobs["linear"])
    assert failed["state"] == "failed" and f"slurm job {linear_job} ended FAILED" in failed["error"], failed
    assert f"error: job 1 ({jobs['linear'].name}): slurm job {linear_job} ended FAILED" in err
    before = rows_by_job(sweep_dir)
    assert all(0 < len(r) < len(seq_lens) for r in before.values()), {v: len(r) for v, r in before.items()}

    rc, out, err = finish(sweep(cluster, *args))
    assert rc == 0, out[-2000:] + err[-3000:]
    assert "jobs: 2 (completed 2)" in out
    each_point_once(sweep_dir, ["full", "linear"], seq_lens)
    after = rows_by_job(sweep_dir)
    for variant, rows in before.items():
        assert after[variant][:len(rows)] == rows, variant  # what was measured stays, unchanged


def test_ranks_srun_starts_share_the_cores_of_their_node(cluster, tmp_path):
    """Ulysses over two ranks srun started on the one node (2 cores): each rank runs on one thread. Only
    torchrun's LOCAL_WORLD_SIZE was read, so each took both cores (threads unset, torch's default)."""
    from harness.distributed import free_port

    env = {k: v for k, v in cluster.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run(["srun", "--ntasks=2", "--time=5", sys.executable, "-m", "harness", "logger=none",
                           "variant=ulysses", "variant.inner=sliding_window", "variant.inner_options={window:8}",
                           "num_heads=2", "head_dim=8", "seq_len=50", "measure.min_run_time=0.01",
                           "measure.min_samples=2", f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert (row["status"], row["world_size"], row["num_threads"]) == ("ok", 2, 1), row["reason"]
