"""Nothing measured is lost, duplicated or misrepresented: the faults of the README's reliability table.

Each test makes the fault for real (a second process, SIGINT/SIGTERM/SIGKILL, damaged files, a file in
the way, a read-only or full filesystem mounted for the test) and checks the outcome: exit code, one
line, status.json, and every point exactly once.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import variants
from harness.results import DirectoryLock, JobStatus, ResultStore, job_state, parse_jsonl, read_jsonl
from harness.run import run

from .conftest import ROOT, refusal
from .test_harness import compose_cfg

# Points as small and quick as a real measurement gets: these tests are about files, not numbers.
TINY = ["variant=full", "num_heads=1", "head_dim=8", "measure.passes=[fwd]", "measure.memory=false",
        "measure.min_run_time=0.01", "measure.min_samples=2", "fidelity.enabled=false", "logger=none"]


def harness(*args: str, wandb: bool = False) -> list[str]:
    return [sys.executable, "-m", "harness", *TINY, *args, *(["logger=wandb"] if wandb else [])]


def cli(*args: str, wandb: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run(harness(*args, wandb=wandb), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def start(*args: str, wandb: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.Popen(harness(*args, wandb=wandb), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"ended before {what}: " + proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def seq_lens_of(out: Path) -> list[int]:
    return sorted(r["seq_len"] for r in read_jsonl(out / "results.jsonl"))


# ----- 1 and 5: extending a run with wandb on; one wandb run per directory ---------------------------

def wandb_records(run_dir: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_extending_a_run_with_wandb_on_logs_each_point_once_in_one_run(tmp_path):
    """Rows the wandb run has not logged (added with wandb off; also one written as the disk filled: kept, not
    measured again, so no later run logged them) are logged first, in file order: the run's points are the
    file's rows, one for one. A new wandb run on a directory with rows logs them all first (it logged only
    what it measured, then took its count of points for a position in the file: the next run logged a
    point twice and never the first one)."""
    out = tmp_path / "D"

    def harness(lens: str, wandb: bool) -> str:
        proc = cli(f"seq_lens=[{lens}]", f"hydra.run.dir={out}", wandb=wandb)
        assert proc.returncode == 0, proc.stderr[-3000:]  # was: TypeError on TorchVersion, status failed
        return proc.stderr
    harness("32", wandb=False)
    said = harness("32,40", wandb=True)
    assert ("warning: wandb: 1 point(s) of results.jsonl its wandb run had not logged (N=32; written with wandb "
            "off, or as a disk filled): logged now") in said, said[-3000:]
    harness("48", wandb=False)
    said = harness("32,40,48,56", wandb=True)
    assert "its wandb run had not logged (N=48;" in said, said[-3000:]
    assert "had not logged" not in harness("32,40,48,56", wandb=True)  # every row logged
    assert json.loads((out / "status.json").read_text())["state"] == "completed"
    assert seq_lens_of(out) == [32, 40, 48, 56]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 3
    state = json.loads((out / "wandb" / "harness-run.json").read_text())
    assert all(state["id"] in run_dir.name for run_dir in runs), (state, runs)  # one wandb run, resumed
    points, steps = [], []
    for run_dir in runs:  # in start order
        for rec in wandb_records(run_dir):
            item = rec.get("history", {}).get("item")
            if item:
                steps.append(item["_step"])
                if "fwd_ms" in item:
                    points.append(item["seq_len"])
    assert points == [32, 40, 48, 56], points  # each point logged once across the runs, in the file's order
    assert steps == sorted(steps) and len(set(steps)) == len(steps), steps  # one increasing history


def test_resume_false_with_wandb_on_starts_a_new_wandb_run(tmp_path):
    """resume=false replaces the directory's results: its wandb run is replaced too (a new run, its state
    moved aside with results.jsonl), so the superseded measurement is never charted beside the new one."""
    out = tmp_path / "D"
    for extra in ((), ("resume=false",)):
        proc = cli("seq_lens=[32]", *extra, "logger.mode=offline", f"hydra.run.dir={out}", wandb=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    summaries = []
    for run_dir in runs:
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json",
                               str(run_dir)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        summaries.append(json.loads(proc.stdout))
    ids = [s["run_id"] for s in summaries]
    assert ids[0] != ids[1], f"resume=false logged into the replaced run {ids[0]}"
    (old,) = out.glob("results.jsonl.replaced-*")
    (old_state,) = (out / "wandb").glob(f"harness-run.json.{old.name.split('.')[-1]}")  # moved with the rows
    assert [json.loads(p.read_text())["id"] for p in (old_state, out / "wandb" / "harness-run.json")] == ids
    for summary, rows in zip(summaries, (read_jsonl(old), read_jsonl(out / "results.jsonl"))):
        (point,) = rows  # each run charts its own measurement only, from step 0
        assert summary["state"] == "finished" and summary["summary"]["fwd_ms"] == point["fwd_ms"]
        assert summary["summary"]["points"]["nrows"] == 1 and summary["step"] == 1, summary["summary"]
    for run_dir in runs:  # one point in each run's history
        items = [r["history"]["item"] for r in wandb_records(run_dir) if r.get("history", {}).get("item")]
        assert [i["seq_len"] for i in items if "fwd_ms" in i] == [32], items


# ----- 2: two writers on one directory ---------------------------------------------------------------

def test_a_wandb_run_that_logged_points_whose_rows_are_lost_is_not_resumed(tmp_path):
    """A results.jsonl deleted or damaged under a directory whose wandb run had logged its points: the points
    measured again were logged a second time into the one resumed run. Its state is moved aside (a new
    wandb run, as resume=false), and only then."""
    from harness.logger import RUN_STATE, RunState

    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)
    (out / RUN_STATE).parent.mkdir()
    (out / RUN_STATE).write_text(json.dumps({"id": "abc123", "next_step": 2, "points": 2}))
    said = []
    ResultStore(out, warn=said.append).close()  # both rows there: the same run goes on
    assert said == [] and RunState(out).run_id == "abc123"
    lines = lines_of(out / "results.jsonl")
    (out / "results.jsonl").write_text(lines[1] + "\n")  # the first row lost
    ResultStore(out, warn=said.append).close()
    aside = next(out.glob("wandb/harness-run.json.replaced-*")).name
    assert said[1:] == [f"wandb run abc123 logged 2 point(s) and results.jsonl holds 1 row(s): the directory's points, "
                        f"and those measured again, go to a new wandb run ({RUN_STATE} moved to {aside})"]
    assert RunState(out).run_id is None


def test_a_second_run_on_a_busy_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "D"
    assert cli("seq_lens=[32]", f"hydra.run.dir={out}").returncode == 0
    record = {name: (out / ".hydra" / name).read_text() for name in ("config.yaml", "overrides.yaml")}
    holder = ResultStore(out)  # a live holder: this test process
    try:
        proc = cli("seq_lens=[32,40]", "seed=7", f"hydra.run.dir={out}")
    finally:
        holder.close()
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert "in use by another run" in line and f"pid {os.getpid()}" in line and "started" in line, line
    assert seq_lens_of(out) == [32] and json.loads((out / "status.json").read_text())["state"] == "completed"
    # Refused before Hydra wrote its record of the refused command over the holder's
    assert {name: (out / ".hydra" / name).read_text() for name in record} == record


def test_the_same_command_started_twice_at_once_measures_every_point_once(tmp_path):
    out = tmp_path / "D"
    args = ("seq_lens=[32,40,48,56]", "measure.min_run_time=0.5", f"hydra.run.dir={out}")
    procs = [start(*args), start(*args)]  # they race for the directory: one runs, one is refused
    results = [(p.communicate(timeout=300)[1], p.returncode)[::-1] for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    (refused,) = [err for code, err in results if code == 2]
    assert "in use by another run" in error_line(refused)
    assert seq_lens_of(out) == [32, 40, 48, 56]
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 4  # the csv agrees with the jsonl


def test_a_job_of_the_same_sweep_waits_for_the_lock_any_other_run_is_refused(tmp_path):
    import threading

    from harness.results import LockedError

    held = DirectoryLock(tmp_path, sweep="/s").acquire()
    with pytest.raises(LockedError, match="is in use by another run"):
        DirectoryLock(tmp_path, sweep="/other").acquire()
    with pytest.raises(LockedError, match="is in use by another run"):
        DirectoryLock(tmp_path).acquire()
    said, got = [], []
    waiter = threading.Thread(target=lambda: got.append(DirectoryLock(tmp_path, sweep="/s").acquire(said.append)))
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive() and not got and "waiting for another job of this sweep" in said[0], said
    held.release()
    waiter.join(timeout=10)
    assert got and got[0].taken_over is None  # released cleanly: nothing to take over
    got[0].release()


@pytest.mark.parametrize("left", ["", json.dumps({"pid": 999999, "host": "gone", "started": "earlier"}) + "\n"],
                         ids=["released", "dead-holder"])
def test_a_probe_of_the_lock_at_the_moment_a_run_starts_does_not_refuse_it(tmp_path, left):
    """in_use (status, the sweep's summary, a job's check) takes a shared lock for a moment: a run whose
    exclusive try lands in that moment is not refused as "in use", whether the file is empty (released
    cleanly) or holds a dead run's line."""
    import fcntl
    import threading

    (tmp_path / DirectoryLock.NAME).write_text(left)
    with open(tmp_path / DirectoryLock.NAME) as probe:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the probe's moment, made to last 5 ms
        unlock = threading.Timer(0.005, fcntl.flock, (probe, fcntl.LOCK_UN))
        unlock.start()
        try:
            lock = DirectoryLock(tmp_path).acquire()
        finally:
            unlock.join()
    assert lock.taken_over == (json.loads(left) if left else None)
    lock.release()


def test_a_job_refused_for_another_commands_run_counts_in_the_sweeps_outcome(tmp_path, capsys):
    from omegaconf import OmegaConf

    from harness import hydra_hooks as multirun

    from harness.results import MULTIRUN_ENV

    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    (tmp_path / multirun.REFUSED).write_text("stale\n")  # not a line a job wrote whole
    multirun.Hooks().on_multirun_start(config)
    ours = os.environ[MULTIRUN_ENV]
    try:
        (tmp_path / "job").mkdir()
        JobStatus(tmp_path / "job", 1).finish("completed")
        multirun.record_refused(tmp_path, 1, "variant=full", "... is in use by another run ...")
        # Another sweep in the same directory at the same time: its refusal is its own. Each multirun emptied
        # the file when it started, and counted every line when it ended: the one that started second
        # hid the first's refusal (exit 0), and counted it as its own (exit 1).
        os.environ[MULTIRUN_ENV] = "other-host:1:1"
        multirun.record_refused(tmp_path, 0, "variant=linear", "... is in use by another run ...")
        os.environ[MULTIRUN_ENV] = ours
        multirun.Hooks().on_multirun_end(config)
        assert "jobs: 2 (completed 1, refused (directory in use) 1)" in capsys.readouterr().out
        assert multirun.NOT_COMPLETE and "not every job of the sweep completed" in multirun.NOT_COMPLETE[0]
        assert len((tmp_path / multirun.REFUSED).read_text().splitlines()) == 3  # never emptied under another
    finally:
        multirun.NOT_COMPLETE.clear()
        os.environ.pop(MULTIRUN_ENV, None)


def test_a_lock_left_by_a_killed_run_is_taken_over_and_said(tmp_path):
    out = tmp_path / "D"
    proc = start("seq_lens=[32,40,48,56,64]", "measure.min_run_time=0.3", f"hydra.run.dir={out}")
    wait_for(lambda: len(lines_of(out / "results.jsonl")) >= 1, proc, "a first point")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    info = json.loads((out / "status.json").read_text())
    assert info["state"] == "running"  # a SIGKILL leaves no chance to say more...
    assert job_state(out)["state"] == "gone"  # ...but nobody holds the lock: the job is known to be gone
    assert not DirectoryLock.is_held(out)
    rerun = cli("seq_lens=[32,40,48,56,64]", f"hydra.run.dir={out}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"left by a run that is gone (pid {info['pid']}" in rerun.stderr
    assert seq_lens_of(out) == [32, 40, 48, 56, 64]
    assert job_state(out)["state"] == "completed"


# ----- 3: damaged lines ----------------------------------------------------------------------------

def test_damaged_lines_are_moved_aside_said_and_their_points_measured_again(tmp_path, capsys):
    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32,40,48,56]"), output_dir=out)
    r32, r40, r48, r56 = (json.loads(line) for line in lines_of(out / "results.jsonl"))
    no_status = {k: v for k, v in r48.items() if k != "status"}
    text_len = {**r56, "seq_len": "56"}
    cut = json.dumps(r40)[:70]
    damaged = [
        cut,  # 2: a line cut in the middle
        json.dumps(r32)[:50] + json.dumps(r32),  # 3: a cut line joined to the next row: that row is kept
        "garbage %%% not json",  # 4
        json.dumps(no_status),  # 5: a row without status must not count as done
        json.dumps(text_len),  # 6: a string seq_len must not make its point measured twice
        "[1, 2, 3]",  # 7: valid JSON, not an object
        json.dumps({**r56, "opt_extra": float("nan")}),  # 8: NaN (not JSON) in a field outside the schema
        # 9, 10: NaN inside a list field, a lone surrogate in a field's name: rewriting the file and results.csv
        # failed on them (a traceback on every rerun, the damaged lines never moved out)
        json.dumps({**r56, "peak_mem_per_rank_bytes": [float("nan")]}),
        json.dumps({**r56, "extra_\udcff": 1}),
        json.dumps(r40) + json.dumps(r48),  # 11: two whole rows, their newline lost: both kept
    ]
    (out / "results.jsonl").write_text("\n".join(["", *damaged]) + "\n")  # line 1 empty
    capsys.readouterr()
    run(compose_cfg(*TINY, "seq_lens=[32,40,48,56]"), output_dir=out)  # in this process: its stderr, as a process's
    stderr = capsys.readouterr().err
    warning = [line for line in stderr.splitlines() if "damaged line(s)" in line]
    assert len(warning) == 1, stderr
    for n in (2, 3, 4, 5, 6, 7, 8, 9):  # the first eight named, the rest counted
        assert f" {n} (" in warning[0], (n, warning[0])
    assert " and 2 more; 3 whole rows inside line(s) 3, 11 kept" in warning[0]
    problems = {d.lineno: d.problem for d in parse_jsonl("\n".join(["", *damaged])).damaged}
    assert sorted(problems) == list(range(2, 12))
    assert problems[9] == "peak_mem_per_rank_bytes is not finite"
    assert problems[10] == "a field's name 'extra_\\udcff' holds a lone surrogate (not UTF-8 text)"
    (aside,) = out.glob("results.jsonl.damaged-*")
    assert lines_of(aside) == damaged  # moved verbatim, never deleted
    rows = read_jsonl(out / "results.jsonl")
    assert sorted(r["seq_len"] for r in rows) == [32, 40, 48, 56]  # each point once
    assert rows[:3] == [r32, r40, r48]  # the rows found inside joined lines are kept, not measured again
    assert parse_jsonl((out / "results.jsonl").read_text()).damaged == []
    status = json.loads((out / "status.json").read_text())
    assert status["points_done"] == 4 and status["state"] == "completed"


def test_a_row_nested_inside_another_object_is_no_row_but_a_row_ending_a_cut_line_is_kept():
    """What a damaged line keeps is the rows it starts with and the row it ends with (a cut line joined
    to the next row), never an object nested in something else: a wrapped copy of a row (another tool's
    record appended to the file) would otherwise count as a measurement of its point."""
    from .test_report import row

    whole = json.dumps(row("full", "sdpa", 64, fwd=1.0))
    joined = parse_jsonl('{"variant": "fu' + whole)
    assert ([r["seq_len"] for r in joined.rows], joined.recovered) == ([64], [1])
    # the next two rows joined to the cut (the first's newline lost too): both kept, not the last alone
    two = parse_jsonl('{"variant": "fu' + whole + json.dumps(row("full", "sdpa", 128, fwd=2.0)))
    assert ([r["seq_len"] for r in two.rows], two.recovered) == ([64, 128], [1, 1])
    wrapped = parse_jsonl('{"note": "not a row", "row": ' + whole + "}")
    assert (wrapped.rows, wrapped.recovered, [d.lineno for d in wrapped.damaged]) == ([], [], [1])


def test_status_json_counts_points_by_status_and_noise_the_kept_ones_included(tmp_path):
    """status.json's statuses and noisy are counts of points, the points an earlier run measured (kept on
    resume) included: a sweep's summary and a reader of the job's state take "3 ok, 1 oom, 1 noisy" from
    them, so each point counts once under its own status, and as noisy only where it is."""
    from harness.results import Result

    from .test_report import row

    def point(n, status="ok", **extra):
        return Result.from_record(row("full", "sdpa", n, status, fwd=1.0, tries=1, **extra))

    status = JobStatus(tmp_path, 4, done=[point(64), point(128)])
    status.add(point(256, "oom"))
    status.add(point(512, noisy=True, noisy_passes=["fwd"], noise_reasons="fwd: IQR 90% of the median"))
    info = json.loads((tmp_path / "status.json").read_text())
    assert (info["points_total"], info["points_done"], info["statuses"], info["noisy"]) == \
        (4, 4, {"ok": 3, "oom": 1}, 1)


def test_results_csv_keeps_the_options_of_every_row_not_only_the_first(tmp_path):
    """A results.csv of several variants (bench_cpu's combined table) has a column for each option any row
    has: the columns of the first row alone would drop a later variant's window, and with it the identity
    of its points (every window one series)."""
    from harness.results import read_csv, write_csv

    from .test_report import row

    rows = [row("full", "sdpa", 64, fwd=1.0), row("sliding_window", "blocksparse", 64, fwd=0.5, opt_window=16),
            row("sliding_window", "blocksparse", 64, fwd=0.7, opt_window=32, task_opt_steps=10)]
    write_csv(tmp_path / "results.csv", rows)
    got = read_csv(tmp_path / "results.csv")
    assert [(r["variant"], r.get("opt_window"), r.get("task_opt_steps")) for r in got] == [
        ("full", None, None), ("sliding_window", 16, None), ("sliding_window", 32, 10)]


def test_a_last_line_without_its_newline_is_ended_before_the_next_row_is_appended(tmp_path):
    """A run killed after a row's closing brace and before its newline left a whole last row: the next
    run ends that line first, so its own row starts a line of its own. Appended to it, the two rows were
    one damaged line, moved aside with a warning on the next read."""
    from harness.results import Result

    from .test_report import row

    first, second = row("full", "sdpa", 64, fwd=1.0), row("full", "sdpa", 128, fwd=2.0)
    (tmp_path / "results.jsonl").write_text(json.dumps(first))  # no newline
    said = []
    with ResultStore(tmp_path, warn=said.append) as store:
        store.add(Result.from_record(second))
    contents = parse_jsonl((tmp_path / "results.jsonl").read_text())
    assert (contents.damaged, [r["seq_len"] for r in contents.rows], said) == ([], [64, 128], [])


def test_a_file_written_whole_keeps_what_it_held_when_the_write_fails(tmp_path, monkeypatch):
    """status.json, results.csv, env.json and fit.json are written to a temporary file that is renamed over
    the old one: a write that fails (a full disk at the flush) leaves the old file whole, and no temporary
    file behind."""
    import errno

    from harness import results

    path = tmp_path / "status.json"
    results.write_json(path, {"state": "running", "points_done": 3})

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(results.os, "fsync", full_disk)
    with pytest.raises(OSError):
        results.write_json(path, {"state": "completed", "points_done": 4})
    assert json.loads(path.read_text()) == {"state": "running", "points_done": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_line_that_is_not_utf8_is_moved_aside_byte_for_byte(tmp_path):
    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)
    good = (out / "results.jsonl").read_bytes()
    bad = b'{"variant": "full\xff\xfe", "seq_len": 40}\n'
    (out / "results.jsonl").write_bytes(good + bad)
    said = []
    ResultStore(out, warn=said.append).close()
    assert "line(s) 2 (not UTF-8)" in said[0], said
    (aside,) = out.glob("results.jsonl.damaged-*")
    assert aside.read_bytes() == bad and (out / "results.jsonl").read_bytes() == good


def test_a_results_csv_that_is_not_the_jsonls_view_is_moved_aside_not_rewritten(tmp_path, capsys):
    """A combined table (bench_cpu's results/cpu/results.csv has no results.jsonl beside it) or a csv whose
    jsonl was deleted: a run into its directory moves it aside with its fit.json and says so, where it
    used to rewrite it from the jsonl's rows, losing every row. A csv that is the jsonl's view, even a
    short one (a run killed between its line and the rewrite), is rewritten; resume=false moves the view
    aside with its jsonl."""
    from harness.results import csv_text, read_csv

    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)
    (out / "fit.json").write_text('{"fits": "the table\'s own"}\n')
    table, fit = (out / "results.csv").read_text(), (out / "fit.json").read_text()
    (out / "results.jsonl").unlink()
    capsys.readouterr()
    run(compose_cfg(*TINY, "seq_lens=[48]"), output_dir=out)
    stderr = capsys.readouterr().err
    assert len([line for line in stderr.splitlines() if "holds rows that results.jsonl does not" in line]) == 1, stderr
    (csv_aside,), (fit_aside,) = out.glob("results.csv.replaced-*"), out.glob("fit.json.replaced-*")
    assert csv_aside.read_text() == table and fit_aside.read_text() == fit
    assert [r["seq_len"] for r in read_csv(out / "results.csv")] == [48]

    view = tmp_path / "V"
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=view)
    (view / "results.csv").write_text(csv_text(read_jsonl(view / "results.jsonl")[:1]))
    said = []
    ResultStore(view, warn=said.append).close()
    assert not said and not list(view.glob("*.replaced-*"))
    assert [r["seq_len"] for r in read_csv(view / "results.csv")] == [32, 40]
    table = (view / "results.csv").read_text()
    ResultStore(view, resume=False, warn=said.append).close()
    (csv_aside,) = view.glob("results.csv.replaced-*")
    assert csv_aside.read_text() == table and list(view.glob("results.jsonl.replaced-*"))
    assert len(said) == 1 and said[0].startswith("resume=false: the directory's earlier results moved aside"), said


def test_text_that_is_not_utf8_inside_a_row_neither_crashes_a_run_nor_splits_a_line(tmp_path):
    """An error's reason naming a path that is not UTF-8 holds a lone surrogate (surrogateescape): stored
    escaped, so results.csv and the console take it (it raised UnicodeEncodeError after the jsonl line,
    and again at every later run into the directory). A stored row holding one (JSON's "\\udcff") is a
    damaged line. A raw U+2028 inside a JSON string is no line end: one row, kept."""
    from harness.results import Result, read_csv

    rec = {"variant": "full", "backend": "sdpa", "seq_len": 32, "batch_size": 1, "num_heads": 1, "head_dim": 8,
           "dtype": "float32", "device": "cpu", "causal": False, "seed": 0, "status": "error"}
    with ResultStore(tmp_path / "A") as store:
        store.add(Result.from_record({**rec, "reason": "OSError: '/scratch/caf\udcff/kernel.so'"}))
    (row,) = read_csv(tmp_path / "A" / "results.csv")
    stored = read_jsonl(tmp_path / "A" / "results.jsonl")[0]["reason"]
    assert row["reason"] == stored == "OSError: '/scratch/caf\\udcff/kernel.so'"

    out = tmp_path / "B"
    out.mkdir()
    bad = json.dumps({**rec, "reason": "caf\udcff"})  # as an earlier version wrote it
    good = json.dumps({**rec, "seq_len": 40, "reason": "one\u2028two"}, ensure_ascii=False)
    (out / "results.jsonl").write_text(bad + "\n" + good + "\n", encoding="utf-8")
    said = []
    with ResultStore(out, warn=said.append) as store:
        assert [r["seq_len"] for r in store.rows] == [40] and store.rows[0]["reason"] == "one\u2028two"
    assert len(said) == 1 and "line(s) 1 (reason holds a lone surrogate" in said[0], said
    (aside,) = out.glob("results.jsonl.damaged-*")
    assert aside.read_text() == bad + "\n"
    assert [r["seq_len"] for r in read_csv(out / "results.csv")] == [40]


def test_a_cut_last_line_is_moved_aside_not_appended_to(tmp_path):
    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)
    with open(out / "results.jsonl", "a") as f:
        f.write('{"variant": "full", "seq_len": 4')  # a kill mid-write
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)
    assert seq_lens_of(out) == [32, 40]
    assert all(json.loads(line) for line in lines_of(out / "results.jsonl"))
    (aside,) = out.glob("results.jsonl.damaged-*")
    assert lines_of(aside) == ['{"variant": "full", "seq_len": 4']


# ----- 4: interrupts and broken output directories ----------------------------------------------------

@pytest.mark.parametrize("sig,code,name,wandb", [(signal.SIGINT, 130, "Ctrl-C", False),
                                                (signal.SIGTERM, 143, "SIGTERM", False),
                                                (signal.SIGINT, 130, "Ctrl-C", True),  # wandb's run ends too
                                                # a SLURM job's warning before its time limit
                                                (signal.SIGUSR2, 140, "SIGUSR2: the SLURM time limit is near",
                                                 False)],
                         ids=["Ctrl-C", "SIGTERM", "Ctrl-C-wandb", "SLURM-time-limit"])
def test_an_interrupt_is_one_line_status_interrupted_and_resumable(tmp_path, sig, code, name, wandb):
    out = tmp_path / "D"
    slurm = {"SUBMITIT_EXECUTOR": "slurm"} if sig == signal.SIGUSR2 else None  # as a SLURM job runs it
    proc = start("seq_lens=[32,40,48,56]", "measure.min_run_time=0.3", f"hydra.run.dir={out}", wandb=wandb,
                 env=slurm)
    wait_for(lambda: len(lines_of(out / "results.jsonl")) >= 1, proc, "a first point")
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    line = error_line(err)
    assert line.startswith(f"error: interrupted ({name}) after ") and "of 4 points; rerun the same command to " \
                                                                         "resume" in line, line
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and status["error"] == line.removeprefix("error: ")
    assert all(json.loads(x)["status"] == "ok" for x in lines_of(out / "results.jsonl"))  # none cut to an error
    assert cli("seq_lens=[32,40,48,56]", f"hydra.run.dir={out}").returncode == 0
    assert seq_lens_of(out) == [32, 40, 48, 56]



def test_a_closed_stdout_ends_the_run_as_interrupted_with_every_row_counted(tmp_path):
    """``python -m harness ... | head -1``: once the reader has gone, the next line written ends the run as
    interrupted (exit 141, one line on stderr), after the row being handed on reached every sink. rich's
    own answer was SystemExit(1) inside the print: a row stored but not counted, status.json "failed"
    with points_done 0, and nothing said. In a multirun, Hydra's first log line finds the pipe closed:
    one line too, not logging's "Logging error" traceback."""
    out = tmp_path / "D"
    proc = start("seq_lens=[32,40,48,56]", f"hydra.run.dir={out}")
    assert "-> " in proc.stdout.readline()  # the run's title, then the reader goes
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    line = error_line(err)
    status = json.loads((out / "status.json").read_text())
    rows = lines_of(out / "results.jsonl")
    assert line == (f"error: interrupted (stdout closed by its reader) after {len(rows)} of 4 points; rerun the "
                    "same command to resume"), line
    assert status["state"] == "interrupted" and status["points_done"] == len(rows) >= 1, status
    assert cli("seq_lens=[32,40,48,56]", f"hydra.run.dir={out}").returncode == 0
    assert seq_lens_of(out) == [32, 40, 48, 56]

    proc = start("sweep=cpu_small", "variant=full,linear", "seq_lens=[32]", f"hydra.sweep.dir={tmp_path / 'S'}")
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert error_line(err) == ("error: interrupted (stdout closed by its reader) before the multirun's first job "
                               "started; nothing was measured")
    # The scripts and report commands too (harness.config.ctrl_c_is_one_line), not a BrokenPipeError's traceback
    proc = subprocess.Popen([sys.executable, "-m", "harness.report.compare", str(out), str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert error_line(err) == "compare: interrupted (stdout closed by its reader); nothing was written"

def interrupted_run(tmp_path, *overrides: str):
    """run() in this process, which must end interrupted; the interrupts its handlers remembered are
    cleared after. Its RunInterrupted."""
    from harness import run as runmod

    try:
        with pytest.raises(runmod.RunInterrupted) as e:
            runmod.run(compose_cfg(*TINY, *overrides), output_dir=tmp_path)
    finally:
        runmod.PENDING_INTERRUPTS.clear()
    return e.value


def test_an_interrupt_lost_in_a_finalizer_still_ends_the_run(tmp_path):
    """Python drops a KeyboardInterrupt raised inside a finalizer ("Exception ignored in ..."): the
    command line's handler remembers every signal, and the run raises it again at its next phase."""
    from harness import run as runmod

    runmod.PENDING_INTERRUPTS.append(runmod.Terminated)  # as the SIGTERM handler does, its raise lost
    e = interrupted_run(tmp_path, "seq_lens=[32,40]")
    assert e.exit_code == 143 and e.message.startswith("interrupted (SIGTERM) after 0 of 2 points")
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "interrupted"
    assert lines_of(tmp_path / "results.jsonl") == []


def test_an_interrupt_while_a_row_is_handed_on_waits_until_every_sink_has_it(tmp_path, monkeypatch):
    """Ctrl-C landing after the row is written but before it is counted (status.json) waits for the count:
    the run says 1 of 2 points, as results.jsonl has (it said 0). A second Ctrl-C there ends it at once."""
    from harness import run as runmod
    from harness.__main__ import interrupt
    from harness.signals import interrupts_deferred

    add = JobStatus.add

    def add_after_ctrl_c(self, row):
        interrupt(signal.SIGINT, None)  # as the command line's handler runs when the signal lands here
        add(self, row)
    monkeypatch.setattr(JobStatus, "add", add_after_ctrl_c)
    try:
        with pytest.raises(runmod.RunInterrupted) as e:
            runmod.run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=tmp_path)
        assert e.value.message.startswith("interrupted (Ctrl-C) after 1 of 2 points"), e.value.message
        status = json.loads((tmp_path / "status.json").read_text())
        assert (status["state"], status["points_done"]) == ("interrupted", 1)
        assert len(lines_of(tmp_path / "results.jsonl")) == 1
        runmod.PENDING_INTERRUPTS.clear()
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():
            interrupt(signal.SIGINT, None)  # deferred
            with pytest.raises(KeyboardInterrupt):
                interrupt(signal.SIGINT, None)  # the second: at once
    finally:
        runmod.PENDING_INTERRUPTS.clear()


def test_a_second_sigterm_while_the_run_records_the_first_is_not_raised_again(tmp_path, monkeypatch):
    """A sweep's harness gets a SIGTERM twice where a process group and its parent both pass it on
    (gpu_job.sh's timeout signals its group, and harness.job passes it on to its sweep): the second landed
    while the run wrote "interrupted", escaped it, and status.json stayed "running" (seen in CI). A SIGTERM
    while the run already ends for one is the same request: the run records the first and ends, exit 143."""
    from harness.__main__ import terminate

    add, finish = JobStatus.add, JobStatus.finish

    def add_then_sigterm(self, row):
        add(self, row)
        terminate(signal.SIGTERM, None)  # inside the row's deferred block: raised at its end

    def finish_after_a_second_sigterm(self, state, error=None):
        terminate(signal.SIGTERM, None)  # the second, as the run records the first
        finish(self, state, error)
    monkeypatch.setattr(JobStatus, "add", add_then_sigterm)
    monkeypatch.setattr(JobStatus, "finish", finish_after_a_second_sigterm)
    e = interrupted_run(tmp_path, "seq_lens=[32,40]")
    assert e.exit_code == 143 and e.message.startswith("interrupted (SIGTERM) after 1 of 2 points")
    status = json.loads((tmp_path / "status.json").read_text())
    assert (status["state"], status["points_done"]) == ("interrupted", 1)


def test_an_interrupt_between_runs_does_not_say_nothing_was_measured():
    """A sweep's Ctrl-C between two jobs (no run measuring) keeps what the finished jobs measured."""
    from harness.__main__ import interrupted_outside_a_run

    assert interrupted_outside_a_run("Ctrl-C", []) == "interrupted (Ctrl-C) before a run started; nothing was measured"
    line = interrupted_outside_a_run("SIGTERM", ["sweep/0", "sweep/1"])
    assert line.startswith("interrupted (SIGTERM) outside a run, after 2 run(s) started (the last in sweep/1)")
    assert "nothing was measured" not in line
    # A multirun whose jobs run in other processes (joblib, SLURM): this process started none itself.
    line = interrupted_outside_a_run("Ctrl-C", [], "multirun/x")
    assert "jobs ran in other processes" in line and "under multirun/x" in line and "nothing was" not in line
    # The basic launcher's jobs run in this process: none had started (it said they ran elsewhere)
    line = interrupted_outside_a_run("Ctrl-C", [], "multirun/x", jobs_here=True)
    assert line == "interrupted (Ctrl-C) before the multirun's first job started; nothing was measured"


def test_an_impossible_output_directory_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for target, words in ((blocker / "out", "is a file"), (Path("/proc/harness-results/out"), "not writable")):
        proc = cli("seq_lens=[32]", f"hydra.run.dir={target}")
        assert proc.returncode == 2
        line = error_line(proc.stderr)
        assert "cannot write results to" in line and words in line, line


def test_a_results_file_that_cannot_be_written_is_named_in_the_one_line(tmp_path):
    """A writable directory whose results.jsonl cannot be opened (here a directory of that name; a
    read-only file for a user who is not root): the line names the file, not the directory alone."""
    from harness.config import ConfigError

    (tmp_path / "D" / "results.jsonl").mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=tmp_path / "D")
    assert str(err.value) == f"cannot write to the output directory {tmp_path / 'D'} (results.jsonl): Is a directory"
    assert sorted(p.name for p in (tmp_path / "D").iterdir()) == ["harness.lock", "results.jsonl"]


def test_a_lock_that_is_a_directory_is_the_one_line_alone(tmp_path):
    """A directory named harness.lock: Hydra printed its callback's IsADirectoryError as a warning of two
    lines before the harness's one."""
    (tmp_path / "D" / "harness.lock").mkdir(parents=True)
    proc = cli("seq_lens=[32]", f"hydra.run.dir={tmp_path / 'D'}")
    assert (proc.returncode, proc.stderr) == (
        2, f"error: cannot write to the output directory {tmp_path / 'D'} (harness.lock): Is a directory\n")


@pytest.fixture
def small_fs(tmp_path):
    """A real filesystem of 2 MiB (tmpfs), unmounted afterwards; skipped where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_filesystem_is_one_line_exit_2(small_fs):
    assert subprocess.run(["mount", "-o", "remount,ro", str(small_fs)]).returncode == 0
    proc = cli("seq_lens=[32]", f"hydra.run.dir={small_fs / 'out'}")
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert "not writable" in line and "Read-only file system" in line, line


def fill(fs: Path, leave: int = 0) -> Path:
    """Fills the filesystem ``fs`` to its last byte but ``leave`` bytes, with one file (returned)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def test_a_full_disk_is_refused_in_one_line_before_hydra_writes(small_fs):
    """Hydra writes .hydra/config.yaml before any of the harness's code runs: on a full filesystem that was
    Hydra's traceback and its HYDRA_FULL_ERROR hint (the probe of a writable directory takes no space)."""
    fill(small_fs, leave=3 * 4096)
    proc = cli("seq_lens=[32]", f"hydra.run.dir={small_fs / 'D'}")
    assert (proc.returncode, proc.stderr.count("\n")) == (2, 1), proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert "no space left" in line and "allowed: at least 1 MiB free" in line, line
    assert not (small_fs / "D").exists()


def test_a_full_disk_fails_in_one_line_keeps_what_was_written_and_resumes(small_fs):
    out = small_fs / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)
    csv_before = (out / "results.csv").read_text()
    assert csv_before.startswith("variant,")
    seq_lens = "seq_lens=[32,40,48,56,64,72,80,88]"
    proc = start(seq_lens, "measure.min_run_time=0.2", f"hydra.run.dir={out}")
    wait_for(lambda: len(lines_of(out / "results.jsonl")) >= 2, proc, "the run's first point")
    filler = fill(small_fs)  # the run is measuring: its next write finds no space
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    line = error_line(err)
    assert "cannot write" in line and "No space left on device" in line, line
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and "No space left" in status["error"]  # never left "running"
    assert not list(out.rglob("*.tmp")), list(out.rglob("*"))  # no half-written temporary files
    with open(out / "results.csv") as f:  # whole (the old one or a newer one), never emptied or cut
        rows = list(csv.reader(f))
    assert rows[0] == csv_before.splitlines()[0].split(",") and len(rows) >= 2
    assert all(len(r) == len(rows[0]) for r in rows)
    held = {r["seq_len"] for r in parse_jsonl((out / "results.jsonl").read_text()).rows}
    # what the file holds, counted: a row appended in the last free page before its results.csv found no
    # room was left out of the line and status.json ("1 of 8" where results.jsonl held two)
    assert f"({len(held)} of 8 points are in results.jsonl;" in line and status["points_done"] == len(held), \
        (line, status, held)
    filler.unlink()
    proc = cli(seq_lens, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert seq_lens_of(out) == [32, 40, 48, 56, 64, 72, 80, 88]


def test_a_results_file_replaced_during_a_run_still_gets_the_later_points(tmp_path):
    """git checkout / stash of a committed results directory (or an editor's save) replaces results.jsonl
    by a new file while a run appends to it: the points measured after that must land in the file at the
    path, not in the replaced one that nothing reads."""
    from harness.results import Result

    out = tmp_path / "D"
    sweep = run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=tmp_path / "source")
    first, second = sweep.rows
    with ResultStore(out) as store:
        store.add(first)
        replaced = out / "results.jsonl.new"
        replaced.write_text((out / "results.jsonl").read_text())
        os.replace(replaced, out / "results.jsonl")  # a new inode at the path, as git writes files
        store.add(second)
    assert [r["seq_len"] for r in read_jsonl(out / "results.jsonl")] == [32, 40]
    assert Result.from_record(read_jsonl(out / "results.jsonl")[1]) == second


# ----- retry and smaller things ------------------------------------------------------------------

def test_a_point_whose_flops_or_memory_pass_int64_is_skipped_not_a_crash(tmp_path):
    """Sizes each within int64 (the config's bound) whose FLOPs are not: the row could not be stored, and the
    run ended with a traceback, the points before it measured and the rest not."""
    sweep = run(compose_cfg(*TINY, "seq_lens=[2147483648,32]"), output_dir=tmp_path / "D")
    assert [(r.seq_len, r.status) for r in sweep.rows] == [(32, "ok"), (2147483648, "skipped")]
    flops = 4 * 2**31 * 2**31 * 8  # 4·B·H·N²·D
    assert sweep.rows[1].reason == (f"flops_fwd {flops:.3g}, flops_fwd_useful {flops:.3g} past a 64-bit integer: no "
                                    f"machine runs this point")
    assert [r["seq_len"] for r in read_jsonl(tmp_path / "D" / "results.jsonl")] == [32, 2147483648]


def test_retry_measures_stored_failures_again_and_the_new_row_supersedes(tmp_path):
    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]", "memory_budget_gb=0.000001"), output_dir=out)
    assert [r["status"] for r in read_jsonl(out / "results.jsonl")] == ["skipped"]
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)  # resume: kept as it is
    assert [r["status"] for r in read_jsonl(out / "results.jsonl")] == ["skipped"]
    run(compose_cfg(*TINY, "seq_lens=[32]", "retry=[skipped]"), output_dir=out)
    assert [r["status"] for r in read_jsonl(out / "results.jsonl")] == ["skipped", "ok"]  # both kept
    with open(out / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok"]  # the view: one row per point
    status = json.loads((out / "status.json").read_text())
    assert status["points_done"] == 1 and status["statuses"] == {"ok": 1}


def test_bad_measurement_and_budget_options_are_one_line_exit_2(tmp_path):
    from harness.env import mem_total_bytes

    cases = [(["measure.warmup_iters=0"], ["warmup_iters", ">= 1"]),
             (["memory_budget_gb=100000"], ["memory_budget_gb=100000", "MemTotal", f"{mem_total_bytes() / 1e9:.3g}"]),
             (["retry=[failed]"], ["retry", "error, oom, skipped, nonfinite, noisy"]),
             (["measure.on_noise=ignore"], ["on_noise", "flag, retry"]),
             (["measure.min_samples=1"], ["min_samples", ">= 2"]),
             (["measure.max_call_s=-1"], ["measure.max_call_s", "> 0", "or null"]),
             # a number or a flag where a list goes: a traceback (5), or read as no pass at all (0, false)
             (["measure.passes=5"], ["measure.passes must be a list of fwd, bwd, fwd_bwd", "got 5"]),
             (["retry=false"], ["retry must be a list of", "got False"])]
    for i, (args, words) in enumerate(cases):  # in this process (conftest.refusal): the command line's check
        line = refusal([*TINY, "seq_lens=[32]", *args, f"hydra.run.dir={tmp_path / str(i)}"], tmp_path)
        assert all(w in line for w in words), (args, line)


class ExplodesFrom48(variants.Full):
    """Exact attention whose output overflows from N=48 on (a test-only variant, built by _target_)."""

    name = "explodes"

    def _attend(self, q, k, v, causal, backend):
        out = super()._attend(q, k, v, causal, backend)
        return out * float("inf") if q.shape[-2] >= 48 else out


def test_non_finite_output_or_gradients_make_the_point_nonfinite(tmp_path):
    # Fidelity would also catch it, but only up to fidelity.max_seq_len: every point checks once.
    cfg = compose_cfg(*TINY, "seq_lens=[32,48]", "variant._target_=tests.test_reliability.ExplodesFrom48",
                      "fidelity.enabled=true", "fidelity.max_seq_len=16")
    rows = run(cfg, output_dir=tmp_path).rows
    assert [(r.seq_len, r.status) for r in rows] == [(32, "ok"), (48, "nonfinite")]
    assert rows[1].reason == "non-finite values (NaN or Inf) in output, dq, dk, dv in float32"
    assert rows[1].fwd_ms is None and rows[1].noisy is None  # nothing timed


# ----- files of the directory the store reads, damaged; an interrupt while it opens ----------------

@pytest.mark.parametrize("state", ['{"id": "abc", "next_step": 3, "points": 1e400}', '{"id": "abc", "next_step": null}',
                                   '{"id": 7}', "[1]", "{cut"])
def test_a_damaged_wandb_run_state_is_set_aside_and_the_run_goes_on(tmp_path, capsys, state):
    """wandb/harness-run.json not as the logger writes it: read with int() it was a traceback (OverflowError,
    TypeError) before the run's status was written, logger=none too, and a sweep then counted the job
    as not run by it (exit 0, its new lengths never measured). It is moved aside, said in one line, and
    the run measures its points."""
    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)
    (out / "wandb").mkdir()
    (out / "wandb" / "harness-run.json").write_text(state)
    capsys.readouterr()
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)
    said = [line for line in capsys.readouterr().err.splitlines() if "harness-run.json" in line]
    assert len(said) == 1 and "moved to harness-run.json.damaged-" in said[0], said
    (aside,) = (out / "wandb").glob("harness-run.json.damaged-*")
    assert aside.read_text() == state
    assert sorted(r["seq_len"] for r in read_jsonl(out / "results.jsonl")) == [32, 40]
    assert json.loads((out / "status.json").read_text())["state"] == "completed"


def test_a_results_csv_csv_cannot_read_is_set_aside_and_the_run_goes_on(tmp_path, capsys):
    """A cell past csv's field size limit (128 KiB): csv.Error escaped the store, a traceback."""
    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)
    text = (out / "results.csv").read_text()
    (out / "results.csv").write_text(text + "x" * 200_000 + "\n")
    capsys.readouterr()
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)
    assert "results.csv holds rows that results.jsonl does not: moved to" in capsys.readouterr().err
    (aside,) = out.glob("results.csv.replaced-*")
    assert aside.read_text().startswith(text)
    assert sorted(r["seq_len"] for r in read_jsonl(out / "results.jsonl")) == [32, 40]


def test_a_failure_while_the_store_opens_is_the_runs_status(tmp_path, monkeypatch):
    """What ended a run before its first point, while it held the directory, is in its status.json:
    failed with the error, or interrupted (Ctrl-C, SIGTERM: exit 130 / 143). It said the last run's
    "completed" before, and the sweep counted the job as not its own. The error is a real one of the
    store: a results.jsonl whose bytes cannot be read (EIO-like: a directory in its place is an OSError
    the command line says; here the reading raises)."""
    from harness import results
    from harness.run import RunInterrupted

    out = tmp_path / "D"
    run(compose_cfg(*TINY, "seq_lens=[32]"), output_dir=out)
    for raised, state in ((ValueError("cannot read"), "failed"), (KeyboardInterrupt(), "interrupted")):
        def read(path, raised=raised):
            raise raised
        monkeypatch.setattr(results, "read_text", read)
        with pytest.raises((ValueError, RunInterrupted)):
            run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == state and status["pid"] == os.getpid(), status
        assert not DirectoryLock.is_held(out)
    monkeypatch.undo()
    run(compose_cfg(*TINY, "seq_lens=[32,40]"), output_dir=out)  # resumes
    assert sorted(r["seq_len"] for r in read_jsonl(out / "results.jsonl")) == [32, 40]


def test_sigterm_as_the_store_opens_is_one_line_status_interrupted(tmp_path):
    """SIGTERM as soon as the run holds the directory (its store reading a long results.jsonl): the
    status said "completed" (the last run's), while the command said its status.json tells how it ended.
    Now: one line, exit 143, status interrupted; the same command resumes."""
    out = tmp_path / "D"
    assert cli("seq_lens=[32]", f"hydra.run.dir={out}").returncode == 0
    row = (out / "results.jsonl").read_text()
    (out / "results.jsonl").write_text(row * 5000)  # the same point: read (a moment), kept once
    proc = start("seq_lens=[32,40]", f"hydra.run.dir={out}")
    wait_for(lambda: str(proc.pid) in (out / "harness.lock").read_text(errors="replace")
             if (out / "harness.lock").exists() else False, proc, "the lock", timeout=60)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    status = json.loads((out / "status.json").read_text())
    if status.get("points_done", 0) > 1:  # the store had opened and a point was measured: nothing tested
        pytest.skip("the run measured before the signal came")
    assert proc.returncode == 143, err
    assert error_line(err).startswith("error: interrupted (SIGTERM) after 0 of 2 points"), err
    assert status["state"] == "interrupted" and status["pid"] == proc.pid, status
    assert cli("seq_lens=[32,40]", f"hydra.run.dir={out}").returncode == 0
    assert sorted({r["seq_len"] for r in read_jsonl(out / "results.jsonl")}) == [32, 40]


def test_resume_false_in_a_sweep_over_seq_lens_keeps_each_jobs_rows(tmp_path):
    """resume=false with jobs sharing a directory (a sweep over seq_lens): each job moved the one before it
    aside, unsaid, and only the last job's lengths were left to read. Rows of this multirun's own are
    kept; an earlier command's are moved aside, said in one line."""
    sweep = tmp_path / "S"
    def multirun(lengths: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness", "-m", *TINY, f"seq_lens={lengths}", "resume=false",
                               f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    first = multirun("[32],[40]")
    assert first.returncode == 0, first.stderr[-2000:]
    (job,) = [d for d in sweep.iterdir() if (d / "results.jsonl").exists()]
    assert sorted(r["seq_len"] for r in read_jsonl(job / "results.jsonl")) == [32, 40]
    with open(job / "results.csv") as f:  # the view too: the second job read the first's rows
        assert sorted(int(r["seq_len"]) for r in csv.DictReader(f)) == [32, 40]
    assert not list(job.glob("results.jsonl.replaced-*"))
    again = multirun("[48]")
    assert again.returncode == 0, again.stderr[-2000:]
    (aside,) = job.glob("results.jsonl.replaced-*")
    assert sorted(r["seq_len"] for r in read_jsonl(aside)) == [32, 40]
    assert [r["seq_len"] for r in read_jsonl(job / "results.jsonl")] == [48]
    assert "resume=false: the directory's earlier results moved aside, not read again: results.jsonl.replaced-" \
        in again.stderr
