"""A killed sweep loses nothing: rerunning into the same directory measures only what is missing.

The kill is a real SIGKILL of a real Hydra multirun (basic launcher) in the middle of its first job; the
rerun must end with every point exactly once, every line whole, the points measured before the kill
unchanged, and each job's status.json saying completed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from harness.results import ResultStore, point_key, read_csv, read_jsonl, write_csv
from harness.run import lacking, run, validate, wanted_points

from .conftest import ROOT
from .test_harness import compose_cfg

SEQ_LENS = [32, 48, 64, 80, 96, 112]
SWEEP = ["-m", "variant=full,linear", f"seq_lens=[{','.join(map(str, SEQ_LENS))}]", "num_heads=1",
         "head_dim=8", "measure.passes=[fwd]", "measure.memory=false", "measure.warmup_iters=1",
         "fidelity.enabled=false", "logger=none"]


def sweep(sweep_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", *SWEEP, "measure.min_run_time=0.2",
                             f"hydra.sweep.dir={sweep_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def job_dir(sweep_dir, variant: str):
    """A job's directory is named by its overrides (hydra.job.override_dirname): stable across reruns."""
    (path,) = [p for p in sweep_dir.iterdir() if f"variant={variant}" in p.name.split(",")]
    return path


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_a_sweep_killed_half_way_and_rerun_has_every_point_once(tmp_path):
    proc = sweep(tmp_path)
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob("*variant=full*/results.jsonl")) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    first_job = job_dir(tmp_path, "full") / "results.jsonl"
    while len(lines(first_job)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be killed: " + proc.communicate()[1][-2000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, as a scheduler's kill would
    proc.wait()
    before = [json.loads(line) for line in lines(first_job)]
    assert 2 <= len(before) < len(SEQ_LENS)
    assert json.loads((first_job.parent / "status.json").read_text())["state"] == "running"
    with open(first_job, "a") as f:  # a kill mid-write leaves a cut line: it must be dropped, not kept
        f.write('{"variant": "full", "seq_len": 9')

    proc = sweep(tmp_path)  # the same command into the same directory
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert len(list(tmp_path.iterdir())) == 3  # two job directories and Hydra's multirun.yaml
    for variant in ("full", "linear"):
        job = job_dir(tmp_path, variant)
        rows = [json.loads(line) for line in lines(job / "results.jsonl")]  # every line whole
        assert sorted(r["seq_len"] for r in rows) == SEQ_LENS, job
        assert all(r["status"] == "ok" for r in rows)
        status = json.loads((job / "status.json").read_text())
        assert status["state"] == "completed" and status["points_done"] == len(SEQ_LENS), status
    after = read_jsonl(first_job)
    assert after[:len(before)] == before, "points measured before the kill are kept as they were"


def test_rerunning_a_finished_run_measures_nothing_and_resume_false_keeps_the_old_file(tmp_path):
    args = ("variant=blockwise", "seq_lens=[40,56]", "num_heads=1", "head_dim=8", "measure.min_run_time=0.01",
            "logger=none")
    first = run(compose_cfg(*args), output_dir=tmp_path)
    again = run(compose_cfg(*args, "seq_lens=[40,56,72]"), output_dir=tmp_path)
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [r["seq_len"] for r in rows] == [40, 56, 72]
    assert rows[:2] == [r.record() for r in first.rows] and len(again.rows) == 3
    # A different workload in the same directory is a different point: measured, not skipped.
    run(compose_cfg(*args, "seq_lens=[40]", "head_dim=16"), output_dir=tmp_path)
    assert [(r["seq_len"], r["head_dim"]) for r in read_jsonl(tmp_path / "results.jsonl")][-1] == (40, 16)

    assert (tmp_path / "fit.json").exists()
    run(compose_cfg(*args, "seq_lens=[40]", "resume=false"), output_dir=tmp_path)
    assert len(read_jsonl(tmp_path / "results.jsonl")) == 1
    (old,) = tmp_path.glob("results.jsonl.replaced-*")
    assert len(read_jsonl(old)) == 4, "resume=false moves the old results aside, it never deletes them"
    # Their fit goes with them (one length fits nothing), and the view shows only what the file holds
    assert not (tmp_path / "fit.json").exists() and len(list(tmp_path.glob("fit.json.replaced-*"))) == 1
    assert [r["seq_len"] for r in read_csv(tmp_path / "results.csv")] == [40]


def test_resume_false_runs_within_one_second_keep_every_replaced_row(tmp_path, monkeypatch):
    """Runs into one directory with resume=false, each moving the last one's results aside, often within the
    same second (a script's loop; jobs of one multirun keep each other's rows): the aside names must never
    collide (one was renamed over the other: its rows were lost). Each replaced results.jsonl keeps its own
    fit.json beside it, under the same suffix."""
    from harness import results
    from harness.results import Result

    monkeypatch.setattr(results, "_stamp", lambda: "20260101T000000")  # every move in the same second
    (tmp_path / "results.jsonl.replaced-20260101T000000-3").write_text("someone else's file\n")
    for n in (32, 40, 48, 56, 64):
        with ResultStore(tmp_path, resume=False) as store:
            store.add(Result.from_record(dict(variant="full", backend="sdpa", seq_len=n, batch_size=1, num_heads=1,
                                              head_dim=8, dtype="float32", device="cpu", causal=False, seed=0,
                                              status="ok")))
            (tmp_path / "fit.json").write_text(f"{n}\n")
    assert [r["seq_len"] for r in read_jsonl(tmp_path / "results.jsonl")] == [64]
    stem = "results.jsonl.replaced-20260101T000000"
    assert (tmp_path / f"{stem}-3").read_text() == "someone else's file\n", "a file there is never replaced"
    asides = {p.name[len(stem):]: [r["seq_len"] for r in read_jsonl(p)] for p in tmp_path.glob(f"{stem}*")}
    assert asides == {"": [32], "-2": [40], "-3": [], "-4": [48], "-5": [56]}, asides
    fits = {p.name[len("fit.json.replaced-20260101T000000"):]: p.read_text() for p in tmp_path.glob("fit.json.*")}
    assert fits == {"": "32\n", "-2": "40\n", "-4": "48\n", "-5": "56\n"}, fits


def test_results_csv_left_short_by_an_interrupt_is_made_whole_when_the_store_opens(tmp_path):
    """A run stopped between its results.jsonl line and the results.csv rewrite: the next run's store
    shows every stored point in the CSV before it measures anything."""
    args = ("variant=full", "seq_lens=[32,40]", "num_heads=1", "head_dim=8", "measure.min_run_time=0.01",
            "logger=none")
    run(compose_cfg(*args), output_dir=tmp_path)
    rows = read_jsonl(tmp_path / "results.jsonl")
    write_csv(tmp_path / "results.csv", rows[:1])
    ResultStore(tmp_path).close()
    assert [r["seq_len"] for r in read_csv(tmp_path / "results.csv")] == [32, 40]


def test_an_interrupted_run_says_interrupted_in_its_status(tmp_path, monkeypatch):
    from harness import run as runmod

    calls = []

    def interrupted(*a, **kw):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **kw)

    real = runmod.run_point
    monkeypatch.setattr(runmod, "run_point", interrupted)
    with pytest.raises(runmod.RunInterrupted) as err:
        run(compose_cfg("variant=full", "seq_lens=[16,24]", "num_heads=1", "head_dim=8",
                        "measure.min_run_time=0.01", "logger=none"), output_dir=tmp_path)
    assert err.value.exit_code == 130
    assert err.value.message == "interrupted (Ctrl-C) after 1 of 2 points; rerun the same command to resume"
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "interrupted" and status["error"] == err.value.message
    assert status["points_done"] == 1 and len(read_jsonl(tmp_path / "results.jsonl")) == 1


def test_a_job_that_raises_says_failed_in_its_status(tmp_path, monkeypatch):
    from harness import run as runmod

    def broken(*a, **kw):
        raise RuntimeError("a bug in the harness")

    monkeypatch.setattr(runmod, "run_point", broken)
    with pytest.raises(RuntimeError):
        run(compose_cfg("variant=full", "seq_lens=[16]", "num_heads=1", "head_dim=8", "logger=none"),
            output_dir=tmp_path)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and "RuntimeError: a bug in the harness" in status["error"]


def test_a_job_that_cannot_run_is_refused_in_one_line_and_the_sweep_goes_on(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "-m", "variant=linear,full", "causal=true",
                           "seq_lens=[32]", "num_heads=1", "head_dim=8", "measure.min_run_time=0.01",
                           "fidelity.enabled=false", "logger=none", f"hydra.sweep.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the sweep ran, but not every job completed
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "causal" in errors[0] and "Traceback" not in proc.stderr
    assert "not every job of the sweep completed (jobs: 2 (completed 1, refused 1)" in errors[1]
    linear, full = job_dir(tmp_path, "linear"), job_dir(tmp_path, "full")
    refused = json.loads((linear / "status.json").read_text())
    assert refused["state"] == "refused" and not (linear / "results.jsonl").exists()
    assert json.loads((full / "status.json").read_text())["state"] == "completed"


# ----- what a stored point answers for --------------------------------------------------------------

TINY_TASK = ("task=mqar", "task.seq_len=32", "task.vocab_size=16", "task.num_kv_pairs=4", "task.num_queries=4",
             "task.d_model=16", "task.steps=4", "task.eval_every=2", "task.eval_size=8", "task.batch_size=4")
QUICK = ("seq_lens=[32]", "num_heads=2", "head_dim=8", "measure.passes=[fwd]", "measure.memory=false",
         "measure.min_run_time=0.01", "measure.min_samples=2", "fidelity.enabled=false", "logger=none")


def test_a_different_task_setting_is_another_point_never_the_stored_one(tmp_path):
    """Every task setting that changes the accuracy is part of the point: resuming with task.seed=1 must
    train again (a stored seed-0 row returned for it would be a wrong number, silently)."""
    run(compose_cfg("variant=full", *QUICK, *TINY_TASK), output_dir=tmp_path)
    run(compose_cfg("variant=full", *QUICK, *TINY_TASK, "task.seed=1"), output_dir=tmp_path)
    run(compose_cfg("variant=full", *QUICK, *TINY_TASK, "task.steps=6"), output_dir=tmp_path)
    run(compose_cfg("variant=full", *QUICK, *TINY_TASK, "task.seed=1"), output_dir=tmp_path)  # stored: kept
    run(compose_cfg("variant=full", *QUICK, *TINY_TASK, "task.eval_every=1"), output_dir=tmp_path)  # logging only
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [(r["task_opt_seed"], r["task_opt_steps"]) for r in rows] == [(0, 4), (1, 4), (0, 6)]
    assert all(r["task_accuracy"] is not None for r in rows)
    # Every setting is written, defaults included; seq_len as configured; span_penalty only where it applies.
    assert rows[0]["task_opt_lr"] == 3e-3 and rows[0]["task_opt_seq_len"] == 32
    assert "task_opt_span_penalty" not in rows[0] and "task_opt_eval_every" not in rows[0]
    from harness.report.collect import series_key, series_labels

    assert sorted(series_labels(series_key(r) for r in rows).values()) == [
        "full/sdpa task.seed=0 task.steps=4", "full/sdpa task.seed=0 task.steps=6", "full/sdpa task.seed=1 task.steps=4"]
    run(compose_cfg("variant=adaptive_span", *QUICK, *TINY_TASK), output_dir=tmp_path / "span")
    (span,) = read_jsonl(tmp_path / "span" / "results.jsonl")
    assert span["task_opt_span_penalty"] == 2e-6


def test_param_grads_is_part_of_the_point_only_where_the_variant_has_parameters(tmp_path):
    for name in ("linear", "full"):
        run(compose_cfg(f"variant={name}", *QUICK), output_dir=tmp_path / name)
        run(compose_cfg(f"variant={name}", *QUICK, "measure.param_grads=true"), output_dir=tmp_path / name)
    assert [r["param_grads"] for r in read_jsonl(tmp_path / "linear" / "results.jsonl")] == [False, True]
    assert [r["param_grads"] for r in read_jsonl(tmp_path / "full" / "results.jsonl")] == [None]


def test_fidelity_batch_size_is_part_of_the_point(tmp_path):
    """Fidelity over B=2 is another sample than over B=1: a rerun measures it, never returns the B=1 row.
    Rows from before the field carry none and are the default's (1); without fidelity it changes nothing."""
    fid = ("fidelity.enabled=true",)
    for b in (1, 2, 2):
        run(compose_cfg("variant=full", *QUICK, *fid, f"fidelity.batch_size={b}"), output_dir=tmp_path)
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert [r["fidelity_batch_size"] for r in rows] == [1, 2]
    assert rows[0]["out_rel_err"] is not None and rows[1]["out_rel_err"] is not None
    old = {k: v for k, v in rows[0].items() if k != "fidelity_batch_size"}
    assert point_key(old) == point_key({**old, "fidelity_batch_size": None}) == point_key(rows[0])
    assert point_key(rows[0]) != point_key(rows[1])
    # A results file from before the field: its points are kept, not measured again, and counted once
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n")
    run(compose_cfg("variant=full", *QUICK, *fid, "seq_lens=[32,48]"), output_dir=tmp_path)
    assert [r["seq_len"] for r in read_jsonl(tmp_path / "results.jsonl")] == [32, 48]
    status = json.loads((tmp_path / "status.json").read_text())
    assert (status["points_total"], status["points_done"]) == (2, 2), status
    run(compose_cfg("variant=full", *QUICK, "fidelity.enabled=false"), output_dir=tmp_path / "off")
    run(compose_cfg("variant=full", *QUICK, "fidelity.enabled=false", "fidelity.batch_size=2"), output_dir=tmp_path / "off")
    assert [r["fidelity_batch_size"] for r in read_jsonl(tmp_path / "off" / "results.jsonl")] == [None]


def test_a_stored_point_without_what_this_run_measures_is_measured_again(tmp_path, capsys):
    """A quality-only run (no passes, no memory) resumed with timings must time the point, not return the
    stored row without them; the stored row stays in the file, the new one supersedes it."""
    quality_only = ("measure.passes=[]", "fidelity.max_seq_len=16")
    run(compose_cfg("variant=full", *QUICK, "fidelity.enabled=true", *quality_only), output_dir=tmp_path)
    (first,) = read_jsonl(tmp_path / "results.jsonl")
    assert first["fwd_ms"] is None and first["out_rel_err"] is None and "fidelity.max_seq_len" in first["quality_reason"]
    capsys.readouterr()
    run(compose_cfg("variant=full", *QUICK, "fidelity.enabled=true", "measure.memory=true"), output_dir=tmp_path)
    assert "N=32: measured again, its stored row has no fwd time, peak memory, fidelity" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert len(rows) == 2 and rows[0] == first
    assert rows[1]["fwd_ms"] > 0 and rows[1]["peak_mem_bytes"] is not None and rows[1]["out_rel_err"] < 1e-5
    # Complete now: the same command, or one asking for less, measures nothing.
    for args in (("fidelity.enabled=true", "measure.memory=true"), ("fidelity.enabled=true",)):
        run(compose_cfg("variant=full", *QUICK, *args), output_dir=tmp_path)
        assert "kept from earlier runs into this directory, not measured again (resume): N=32" in capsys.readouterr().out
    assert len(read_jsonl(tmp_path / "results.jsonl")) == 2


def test_the_committed_quality_runs_resume_with_their_own_commands():
    """Each results/quality/ folder's command (its .hydra/overrides.yaml) rerun into it would measure
    nothing: every point it asks for is stored, under today's identity, with everything it measures."""
    folders = sorted(p for p in (ROOT / "results" / "quality").iterdir() if p.is_dir())
    assert len(folders) >= 8
    for folder in folders:
        overrides = folder / ".hydra" / "overrides.yaml"
        # sliding_window_mqar predates the saved overrides: its command is in its SUMMARY.md
        args = (yaml.safe_load(overrides.read_text()) if overrides.exists()
                else ["variant=sliding_window", "seq_lens=[256,512,1024]", "task=mqar"])
        settings, attn, device = validate(compose_cfg(*args, "device=cpu"))
        stored = {point_key(r): r for r in read_jsonl(folder / "results.jsonl")}
        for key, n in wanted_points(attn, settings, device).items():
            assert key in stored, (folder.name, n)
            assert lacking(stored[key], settings) == [], (folder.name, n)


def test_a_point_measured_on_another_machine_is_timed_again_here(tmp_path, capsys):
    """Times and memory belong to the machine (CPU model and threads, or GPU) that took them: resuming a
    directory on another machine measures the points again rather than mixing machines in one series.
    A quality-only run does not depend on the machine: its points are kept."""
    def moved_to_another_machine(path):
        rows = read_jsonl(path / "results.jsonl")
        path.joinpath("results.jsonl").write_text("".join(json.dumps({**r, "device_name": "Another CPU"}) + "\n"
                                                          for r in rows))

    timed, quality_only = tmp_path / "timed", tmp_path / "quality"
    run(compose_cfg("variant=full", *QUICK), output_dir=timed)
    run(compose_cfg("variant=full", *QUICK, "measure.passes=[]", "fidelity.enabled=true"), output_dir=quality_only)
    for path in (timed, quality_only):
        moved_to_another_machine(path)
    capsys.readouterr()
    run(compose_cfg("variant=full", *QUICK), output_dir=timed)
    out = capsys.readouterr().out
    assert "N=32: measured again, its stored row has no measurement on this machine (it was measured on " \
           "Another CPU, " in out
    rows = read_jsonl(timed / "results.jsonl")
    assert [r["device_name"] == "Another CPU" for r in rows] == [True, False]
    run(compose_cfg("variant=full", *QUICK, "measure.passes=[]", "fidelity.enabled=true"), output_dir=quality_only)
    assert "kept from earlier runs" in capsys.readouterr().out
    assert len(read_jsonl(quality_only / "results.jsonl")) == 1
    # Another machine's oom does not stop this machine's series (stop_on_oom).
    rows = read_jsonl(timed / "results.jsonl")
    with open(timed / "results.jsonl", "a") as f:
        f.write(json.dumps({**rows[0], "seq_len": 40, "status": "oom", "reason": "out of memory"}) + "\n")
    run(compose_cfg("variant=full", *QUICK, "seq_lens=[48]"), output_dir=timed)
    assert read_jsonl(timed / "results.jsonl")[-1]["status"] == "ok"


def test_a_task_length_too_short_anywhere_is_refused_before_anything_is_written(tmp_path):
    from harness.config import ConfigError

    with pytest.raises(ConfigError, match="task=mqar at N=8: .*need seq_len >= "):
        run(compose_cfg("variant=full", *QUICK, *TINY_TASK, "task.seq_len=null", "seq_lens=[64,8]"),
            output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
