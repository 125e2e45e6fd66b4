"""harness.job on its own: a job of sweeps within a time budget, resumed (the GPU benchmark's use of it,
compiling ahead and a budget spent mid-sweep, is tested in test_bench_gpu.py)."""

from __future__ import annotations

import json

import pytest

from harness.job import Job, Step, job_file, pending_points
from harness.results import latest, load_rows

from .test_report import row

# Tiny CPU points, timings not judged as noise: the job's bookkeeping is the subject, not the numbers
TINY = ("device=cpu", "dtype=float32", "batch_size=1", "num_heads=2", "head_dim=16", "fidelity.enabled=false",
        "measure.min_run_time=0.01", "measure.min_samples=2", "measure.max_rel_iqr=1000",
        "measure.max_other_cores=1000", "measure.on_noise=flag")


def linear(lens: str = "[32,48]") -> Step:
    return Step("a", "a:linear", "seq_len_scaling", ("variant=linear", "variant.backend=sdpa", f"seq_lens={lens}"),
                "a/linear")


def test_a_step_runs_once_and_is_done_again_only_where_a_point_is_missing(tmp_path):
    """The first call measures the step's points and records it complete; the next finds every point's row
    and starts nothing; a length added to the step (or a row lost) reopens it, and the rerun measures only
    that point."""
    said: list[str] = []
    Job(tmp_path, budget_s=600, log=said.append, common=TINY).run([linear()])
    rows = latest(load_rows(tmp_path / "a"))
    assert sorted((r["seq_len"], r["status"]) for r in rows) == [(32, "ok"), (48, "ok")]
    assert json.loads((tmp_path / "state.json").read_text()) == {"a:linear": "complete"}
    said.clear()
    job = Job(tmp_path, log=said.append, common=TINY)
    assert job.complete(linear()) and said == []
    job.run([linear()])
    assert said == []  # nothing started
    longer = linear("[32,48,64]")
    assert not job.complete(longer) and pending_points(job, longer) == [("linear", "sdpa", 64)]
    job.run([longer])
    assert sorted(r["seq_len"] for r in latest(load_rows(tmp_path / "a"))) == [32, 48, 64]
    assert len(load_rows(tmp_path / "a")) == 3  # nothing measured twice
    assert job.complete(longer)


def test_a_spent_budget_starts_nothing_and_leaves_the_state_alone(tmp_path):
    said: list[str] = []
    Job(tmp_path, budget_s=5, log=said.append, common=TINY).run([linear()])
    assert said == ["[a:linear] not started: the budget is spent (run again to continue)"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "state.json").exists()


def test_a_sweeps_command_and_a_step_of_a_subclasss_own(tmp_path):
    """A sweep's process: the preset, the step's overrides, the job's common ones, no wandb logger, into
    the step's directory (or another's: compiling ahead's scratch). A step without a preset is a
    subclass's, which says how to run it."""
    job = Job(tmp_path, common=("device=cpu",))
    assert job.command(linear()) == ["-m", "harness", "--multirun", "sweep=seq_len_scaling", "variant=linear",
                                     "variant.backend=sdpa", "seq_lens=[32,48]", "device=cpu", "logger=none",
                                     f"hydra.sweep.dir={tmp_path / 'a' / 'linear'}"]
    assert job.command(linear(), ("variant=full",), tmp_path / "x")[4:] == [
        "variant=full", "device=cpu", "logger=none", f"hydra.sweep.dir={tmp_path / 'x'}"]
    with pytest.raises(NotImplementedError):
        job.command(Step("roof", "roof"))


@pytest.mark.parametrize("text, problem", [("[]", "an array, not an object"), ("{\"a\": \"compl", "not JSON"),
                                           ('{"a": 1}', "a step whose state is not a string")])
def test_a_damaged_state_is_set_aside_in_one_line_and_read_as_empty(tmp_path, capsys, text, problem):
    (tmp_path / "state.json").write_text(text)
    assert Job(tmp_path).state == {}
    (aside,) = tmp_path.glob("state.json.damaged-*")
    assert aside.read_text() == text and not (tmp_path / "state.json").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"harness: {tmp_path / 'state.json'} is damaged ({problem}"), err
    assert job_file(tmp_path / "state.json") is None  # gone: absent, not damaged again


def test_a_sigterm_to_the_script_reaches_the_sweep_running_and_the_next_call_resumes(tmp_path):
    """A script running a job inside ctrl_c_is_one_line, sent SIGTERM alone (``kill``, a scheduler's
    cancel) mid-sweep: the sweep gets it too, records interrupted and ends; the script ends in its one
    line, exit 143; the step is not complete; the next call measures only the points left."""
    import signal
    import subprocess
    import sys
    import time

    from .conftest import ROOT

    lens = "[32,40,48,56,64]"
    script = f"""
import sys
from pathlib import Path
from harness.config import ctrl_c_is_one_line
from harness.job import Job, Step
step = Step("a", "a:linear", "seq_len_scaling", ("variant=linear", "variant.backend=sdpa", "seq_lens={lens}"), "a/linear")
job = Job(Path({str(tmp_path)!r}), common={(*TINY, "measure.min_run_time=0.3")!r})
sys.exit(ctrl_c_is_one_line(lambda: job.run([step]), "my_job", "rerun to resume"))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # a signal to the script alone, as kill sends it
    try:
        deadline = time.monotonic() + 120
        while (not any(p.stat().st_size for p in tmp_path.rglob("results.jsonl")) and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.2)  # the sweep has measured its first point
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "my_job: interrupted (SIGTERM); rerun to resume", err
    (status,) = tmp_path.rglob("status.json")
    assert json.loads(status.read_text())["state"] == "interrupted"
    before = sorted(r["seq_len"] for r in load_rows(tmp_path / "a"))
    assert 1 <= len(before) < 5 and Job(tmp_path).state.get("a:linear") != "complete"
    Job(tmp_path, log=lambda _: None, common=TINY).run([linear(lens)])
    assert sorted(r["seq_len"] for r in load_rows(tmp_path / "a")) == [32, 40, 48, 56, 64]  # each once


def test_a_ctrl_c_that_the_steps_process_missed_is_passed_on_not_a_kill(tmp_path, monkeypatch):
    """A Ctrl-C (KeyboardInterrupt, not SIGTERM) was taken to have reached the step's process too (one
    process group), and stop() gave it 30 s, then SIGKILL: with ``kill -INT`` to the job alone the sweep
    measured on for 30 s and was killed mid-point, its status.json left ``running``. It is sent the
    SIGINT it missed after the grace, and records where it stopped, as wait_through_ctrl_c's harness does."""
    import subprocess
    import sys
    import time

    from harness import job as harness_job

    monkeypatch.setattr(harness_job, "STOP_GRACE_S", 1, raising=False)
    ready, recorded = tmp_path / "ready", tmp_path / "interrupted"
    child = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "try:\n    time.sleep(120)\n"
        f"except KeyboardInterrupt:\n    pathlib.Path({str(recorded)!r}).touch()\n    raise SystemExit(130)\n")])
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    began = time.monotonic()
    assert harness_job.stop([child], None) == [130] and recorded.exists()
    assert time.monotonic() - began < 20


def test_a_second_invocation_into_a_job_held_is_refused_in_one_line(tmp_path, capsys):
    """Two invocations into one directory at once each rewrote state.json (and the GPU job's env.json) from
    their own copy: one's outcomes were lost. The second is refused in one line, exit 2, writing nothing."""
    from harness.results import LockedError

    from .conftest import load_script

    lock = Job(tmp_path).hold()
    try:
        with pytest.raises(LockedError, match=f"^{tmp_path} is in use by another run"):
            Job(tmp_path).hold()
        bench = load_script("bench_gpu")
        with pytest.raises(SystemExit) as e:
            bench.main(["--smoke", "--out", str(tmp_path), "--steps", "roof"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "is in use by another run" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["harness.lock"]
    finally:
        lock.release()
    Job(tmp_path).hold().release()  # free again


def counting(tries, code: int, sleep_s: float = 0) -> list[str]:
    """A step's process (after the interpreter) that adds an x to ``tries``, sleeps, and exits ``code``."""
    script = (f"import pathlib, sys, time; p = pathlib.Path({str(tries)!r}); "
              f"p.write_text(p.read_text() + 'x' if p.exists() else 'x'); time.sleep({sleep_s}); sys.exit({code})")
    return ["-c", script]


def test_a_failed_step_is_run_once_more_at_once_and_then_recorded_failed(tmp_path):
    """A step whose process fails (a crash, a lost CUDA context) is run again at once in a new process, once:
    two tries, then its exit recorded in state.json. Catches the retry dropped (or made endless)."""
    tries = tmp_path / "tries"

    class Failing(Job):
        def command(self, step, overrides=None, sweep_dir=None):
            return counting(tries, 1)

    said: list[str] = []
    job = Failing(tmp_path, budget_s=600, log=said.append)
    job.run([Step("own", "own")])
    assert tries.read_text() == "xx", said
    assert job.state == {"own": "exit 1"} and "[own] exit 1: once more, resuming" in said


def test_a_step_that_succeeds_is_run_once(tmp_path):
    """The retry is for a failed process only: a step that exits 0 is recorded complete and not started again
    (a sweep run twice costs a process start and its whole grid's skip checks, a subclass's step all of its
    work). Catches the retry's ``rc == 0`` left out."""
    tries = tmp_path / "tries"

    class Once(Job):
        def command(self, step, overrides=None, sweep_dir=None):
            return counting(tries, 0)

    said: list[str] = []
    job = Once(tmp_path, budget_s=600, log=said.append)
    job.run([Step("own", "own")])
    assert tries.read_text() == "x" and job.state == {"own": "complete"}, said


def test_a_step_that_stops_for_its_budget_is_interrupted_not_complete_and_not_run_again(tmp_path):
    """A subclass's step that keeps to the budget itself exits BUDGET_SPENT when it is spent: recorded
    "interrupted by the budget" (the next invocation runs it again), not complete and not failed, and not
    started again at once. Catches BUDGET_SPENT taken for success."""
    from harness.job import BUDGET_SPENT

    tries = tmp_path / "tries"

    class Spent(Job):
        def command(self, step, overrides=None, sweep_dir=None):
            return counting(tries, BUDGET_SPENT)

    said: list[str] = []
    job = Spent(tmp_path, budget_s=600, log=said.append)
    job.run([Step("own", "own")])
    assert tries.read_text() == "x" and job.state == {"own": "interrupted by the budget"}, said
    assert said[-1] == "[own] interrupted by the budget: run again to continue"


def test_a_sweep_still_running_when_the_budget_is_spent_is_stopped_at_once_and_recorded_interrupted(tmp_path):
    """A sweep gets no grace past the budget (a subclass's own step, which ends itself, gets 60 s): the
    budget spent, it is sent SIGTERM and the job goes on at once; state.json says "interrupted by the
    budget" (not a failure's exit code) and it is not started again. The budget here: 25 s when the step
    starts, 1 s from then on. Catches the wait without a timeout, the grace given to sweeps, and the stop
    recorded as a failure."""
    import time

    tries = tmp_path / "tries"

    class Slow(Job):
        calls = 0

        def left(self):
            self.calls += 1
            return 25.0 if self.calls == 1 else self.deadline - time.monotonic()

        def command(self, step, overrides=None, sweep_dir=None):
            return counting(tries, 0, sleep_s=40)

    said: list[str] = []
    job = Slow(tmp_path, budget_s=1, log=said.append)
    began = time.monotonic()
    job.run([Step("a", "a:slow", "seq_len_scaling", ("variant=linear",), "a/slow")])
    assert time.monotonic() - began < 20, said
    assert tries.read_text() == "x" and job.state == {"a:slow": "interrupted by the budget"}, said
    assert json.loads((tmp_path / "state.json").read_text()) == {"a:slow": "interrupted by the budget"}


def test_a_sweeps_points_are_told_apart_by_causal_and_complete_needs_its_state_too(tmp_path):
    """A sweep over causal=false,true has a point for each: the non-causal row of a length is not the causal
    one's, so a lost causal row reopens the step. And every row there is not enough: a step whose state.json
    entry is not "complete" (interrupted by the budget, a failure) is not complete. Catches causal left out
    of the grid's keys, and complete() read from the rows alone."""
    step = Step("c", "c:linear", "seq_len_scaling",
                ("variant=linear", "variant.backend=sdpa", "causal=false,true", "seq_lens=[32,48]"), "c/linear")
    store = tmp_path / "c" / "linear" / "0"
    store.mkdir(parents=True)
    rows = [row("linear", "sdpa", n, causal=c, head_dim=16)
            for n in (32, 48) for c in (False, True) if (n, c) != (48, True)]
    (store / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = Job(tmp_path)
    assert pending_points(job, step) == [("linear", "sdpa", True, 48)]
    job.finish("c:linear", "complete")
    assert not job.complete(step)
    with (store / "results.jsonl").open("a") as f:
        f.write(json.dumps(row("linear", "sdpa", 48, causal=True, head_dim=16)) + "\n")
    assert pending_points(job, step) == [] and job.complete(step)
    job.finish("c:linear", "interrupted by the budget")
    assert not job.complete(step)


def test_holding_the_job_reads_the_state_as_it_is_then(tmp_path):
    """A script builds its Job (reading state.json), then holds the directory: an invocation that held it
    in between and recorded a step has its outcome in the file. The holder reads it again, so the outcomes
    it writes keep that one: rewritten from the copy read before, it was lost (and the step run again)."""
    job = Job(tmp_path)
    other = Job(tmp_path)
    lock = other.hold()
    other.finish("a:linear", "complete")
    lock.release()
    lock = job.hold()
    try:
        job.finish("a:full", "interrupted by the budget")
    finally:
        lock.release()
    assert json.loads((tmp_path / "state.json").read_text()) == {"a:linear": "complete",
                                                                 "a:full": "interrupted by the budget"}


def test_a_sweeps_lengths_are_its_last_seq_lens_override(tmp_path):
    """Hydra takes the last of an override given twice (a step's own seq_lens, then one narrowed after it):
    the points a step waits for are that one's lengths. Catches the first one read."""
    step = Step("a", "a:linear", "seq_len_scaling", ("variant=linear", "variant.backend=sdpa", "seq_lens=[32]",
                                                     "seq_lens=[32,48]"), "a/linear")
    assert pending_points(Job(tmp_path), step) == [("linear", "sdpa", 32), ("linear", "sdpa", 48)]
