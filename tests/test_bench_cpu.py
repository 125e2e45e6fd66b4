"""scripts/bench_cpu.py end to end at tiny N: each variant through the harness's command line, the combined
rows, fits and SUMMARY written from them (and only from them)."""

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

from harness.env import code_version

from .conftest import ROOT, load_script, results_dirs

SCRIPT = ROOT / "scripts" / "bench_cpu.py"


def test_two_variants_at_two_lengths(tmp_path):
    names, seq_lens = ["sliding_window", "linear"], ["128", "256"]  # the combined table in CONFIGS order
    cmd = [sys.executable, str(SCRIPT), "--only", *names, "--seq-lens", *seq_lens, "--min-run-time", "0.01",
           "--out", str(tmp_path), "--wait-s", "0", "--rounds", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seq_len"], r["status"]) for r in rows] == [
        (name, n, "ok") for name in names for n in seq_lens]
    assert {r["code_version"] for r in rows} == {code_version() or ""}
    fits = json.loads((tmp_path / "fit.json").read_text())
    assert set(fits) == set(names) and fits["linear"]["all"]["memory"]["fitted"] > 0  # time: unless noisy
    summary = (tmp_path / "SUMMARY.md").read_text()
    by = {(r["variant"], r["seq_len"]): r for r in rows}
    for name in names:  # one line per variant in the time, memory, fit, rounds and disturbance tables
        assert summary.count(f"| {name} |") == 5, name
        # The second round of every point, in its own process and directory; the kept row is one of the two
        again = {r["seq_len"]: r for r in csv.DictReader(open(tmp_path / name / "round-2" / "results.csv"))}
        assert sorted(again) == seq_lens
        first = {r["seq_len"]: r for r in csv.DictReader(open(tmp_path / name / "results.csv"))}
        for n in seq_lens:  # the median of two rounds: the faster, unless only one's forward+backward is not noisy
            rounds = [first[n], again[n]]
            assert by[name, n]["fwd_bwd_ms"] in {r["fwd_bwd_ms"] for r in rounds}
            # (noisy: its spread as well as others' load; the load alone left a spread-noisy faster round in)
            if all("fwd_bwd" not in json.loads(r["noisy_passes"] or "[]") for r in rounds):
                assert by[name, n]["fwd_bwd_ms"] == min((r["fwd_bwd_ms"] for r in rounds), key=float)
    ms = float(by["linear", "256"]["fwd_bwd_ms"])
    assert f"{ms:.4g}" in summary  # the tables are this run's numbers
    assert "not measured" in summary  # blockwise and full_math did not run: their target is not judged

    # One variant at one length again (--only, --seq-lens, nothing left to measure): the other variant and
    # the other length stay in the combined files (a run with fewer lengths wrote them with its own alone),
    # and a variant measured on another machine is named there, not mixed in
    (tmp_path / "full_sdpa").mkdir()
    (tmp_path / "full_sdpa" / "results.jsonl").write_text("".join(
        json.dumps({**json.loads(line), "variant": "full", "backend": "sdpa", "device_name": "Another CPU"}) + "\n"
        for line in (tmp_path / "linear" / "results.jsonl").read_text().splitlines()))
    cmd = [c for c in cmd if c not in ("sliding_window", "256")] + ["--resume"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "results.csv") as f:
        assert list(csv.DictReader(f)) == rows
    assert json.loads((tmp_path / "fit.json").read_text())["linear"]["seq_lens"] == [128, 256]
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "This invocation measured linear; the rows of sliding_window are earlier invocations' on this machine" in summary
    assert "measured on another machine (compare within one machine): full_sdpa (Another CPU, " in summary
    assert all(summary.count(f"| {name} |") == 5 for name in names) and "| full_sdpa |" not in summary


@pytest.mark.parametrize("name, code", [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_an_interrupt_ends_the_harness_it_runs_as_interrupted_in_its_one_line(tmp_path, name, code):
    """Ctrl-C reaches the script and the harness it runs: the harness records its run interrupted and says
    so in one line, and the script waits for it and exits with its code (it printed a KeyboardInterrupt
    traceback, and its wait could kill the harness while that wrote its status). A SIGTERM reaches the
    script alone: it is passed on, and ends alike (the script ended at once, the harness measuring on
    unattended). The memory budget of a few megabytes reaches the harness as given (it was rounded to
    0.00 GB, which the harness refuses): the points, 1.6 and 3.5 MB of analytic memory, are within it.
    A relative --out is the caller's (the harness, run in the repository, wrote there, and the script
    then failed to find its rows)."""
    cmd = [sys.executable, str(SCRIPT), "--only", "sliding_window", "--seq-lens", "128", "256", "--min-run-time",
           "0.3", "--out", "out", "--wait-s", "0", "--rounds", "1", "--memory-budget-gb", "0.0049"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"})
    rows = tmp_path / "out" / "sliding_window" / "results.jsonl"
    deadline = time.monotonic() + 120
    while not (rows.exists() and rows.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the first point measured: the harness is measuring the next
    assert proc.poll() is None, "it ended before the interrupt: " + proc.communicate()[1][-2000:]
    if name == "Ctrl-C":
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground process group
    else:
        proc.send_signal(signal.SIGTERM)  # kill, a scheduler's cancel: the script alone
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1].startswith(f"error: interrupted ({name}) after 1 of 2 points; rerun"), err[-2000:]
    assert json.loads((tmp_path / "out" / "sliding_window" / "status.json").read_text())["state"] == "interrupted"
    assert [json.loads(line)["status"] for line in rows.read_text().splitlines()] == ["ok"]
    assert not running(f"hydra.run.dir={tmp_path}")  # the harness ended before the script


def running(text: str) -> list[str]:
    """The processes whose command line holds ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(proc.name)
        except OSError:  # ended meanwhile
            pass
    return found


def refusal(tmp_path, *args: str) -> str:
    """bench_cpu's stderr for ``args``, asserting that it refused them in one line, exit 2, nothing made."""
    (tmp_path / "file").write_text("kept")
    cmd = [sys.executable, str(SCRIPT), "--only", "full_sdpa", "--wait-s", "0", "--rounds", "1",
           "--out", str(tmp_path / "out"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "WANDB_MODE": "disabled"})
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (2, "", 1), done.stdout + done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "kept"
    return done.stderr


@pytest.mark.parametrize("option, value, allowed", [
    ("--seq-lens", "-5", "an integer > 0"), ("--min-run-time", "nan", "a finite number > 0"),
    ("--memory-budget-gb", "-1", "a finite number > 0"), ("--rounds", "0", "an integer > 0"),
    ("--wait-s", "-1", "a finite number >= 0"), ("--max-other-cores", "0", "a finite number > 0")])
def test_a_bad_number_is_one_line_before_anything_runs(tmp_path, option, value, allowed):
    """These were passed to the harness, whose one-line refusal came with bench_cpu's traceback."""
    assert refusal(tmp_path, option, value) == \
        f"bench_cpu.py: error: argument {option}: must be {allowed}; got {value!r}; see --help\n"


def test_an_out_that_is_a_file_is_one_line(tmp_path):
    assert refusal(tmp_path, "--out", str(tmp_path / "file")) == (
        f"bench_cpu.py: error: argument --out: cannot write results to {tmp_path / 'file'}: {tmp_path / 'file'} "
        "is a file, not a directory; see --help\n")


def test_an_empty_out_is_one_line(tmp_path):
    """It was the current directory: the harness, run in the repository, wrote its rows there."""
    assert refusal(tmp_path, "--out", "") == "bench_cpu.py: error: argument --out: must be a directory path; got ''; see --help\n"


def test_what_the_harness_refuses_is_its_one_line_and_exit_code(tmp_path):
    """A value only the harness can judge (a memory budget above this machine's memory): its refusal, not
    a CalledProcessError's traceback after it."""
    assert refusal(tmp_path, "--memory-budget-gb", "1e9").startswith("error: memory_budget_gb=1e+09 exceeds")


def test_an_out_holding_another_commands_results_is_one_line_and_left_as_it_was(tmp_path, monkeypatch, capsys):
    """A run's directory: bench_cpu wrote its combined results.csv and fit.json over the run's, exit 0;
    bench_gpu's: its SUMMARY.md over the GPU benchmark's. In this process (refused before anything runs)."""
    dirs = results_dirs(tmp_path)
    run_dir, gpu = dirs["run"], dirs["gpu"]
    bench = load_script("bench_cpu")
    for folder, sign, replaced in ((run_dir, "python -m harness (results.jsonl)", "results.csv, fit.json"),
                                   (gpu, "scripts/bench_gpu.py (SUMMARY.md)", "SUMMARY.md")):
        kept = {p.name: p.read_bytes() for p in folder.iterdir()}
        monkeypatch.setattr(sys, "argv", ["bench_cpu.py", "--only", "full_sdpa", "--seq-lens", "32", "--rounds", "1",
                                          "--min-run-time", "0.01", "--wait-s", "0", "--glibc-default", "--out", str(folder)])
        with pytest.raises(SystemExit) as exit_:
            bench.main()
        out, err = capsys.readouterr()
        assert (exit_.value.code, out) == (2, ""), err[-2000:]
        assert err == (f"bench_cpu.py: error: argument --out: cannot write results to {folder}: it holds the results of "
                       f"{sign}, whose {replaced} scripts/bench_cpu.py would write over; allowed: a directory of "
                       f"scripts/bench_cpu.py's own, or a new one; see --help\n")
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == kept


def test_the_rounds_are_this_machines_latest_rows(tmp_path):
    """A point measured again counts once (its latest row), and rows another machine took are not rounds
    of this one's benchmark (a resumed benchmark measures them again)."""
    import torch

    from harness.env import cpu_name

    bench = load_script("bench_cpu")
    here = {"device_name": cpu_name(), "num_threads": torch.get_num_threads()}
    point = {"variant": "full", "backend": "sdpa", "batch_size": 1, "num_heads": 4, "head_dim": 64,
             "dtype": "float32", "device": "cpu", "causal": False, "seed": 0}
    rows = [{**point, **here, "seq_len": 128, "status": "ok", "fwd_bwd_ms": 2.0},
            {**point, **here, "seq_len": 128, "status": "ok", "fwd_bwd_ms": 1.0},  # measured again: supersedes
            {**point, "device_name": "Another CPU", "num_threads": 2, "seq_len": 256, "status": "ok", "fwd_bwd_ms": 3.0},
            # another command's row in the directory (another batch): no round of full_sdpa's, which it was
            {**point, **here, "batch_size": 2, "seq_len": 512, "status": "ok", "fwd_bwd_ms": 4.0}]
    vdir = tmp_path / "full_sdpa"
    (vdir / "round-2").mkdir(parents=True)
    for path in (vdir / "results.jsonl", vdir / "round-2" / "results.jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = bench.candidates(vdir)
    assert list(found) == [128] and [r.fwd_bwd_ms for r in found[128]] == [1.0, 1.0]


def test_a_noisy_timing_is_marked_in_the_summarys_table():
    """A kept round whose forward+backward is noisy (every round was) showed as a plain number."""
    from harness.results import Result

    bench = load_script("bench_cpu")
    quiet = Result.from_record({"variant": "full", "backend": "sdpa", "seq_len": 128, "batch_size": 1, "num_heads": 4,
                                "head_dim": 64, "dtype": "float32", "device": "cpu", "causal": False, "seed": 0,
                                "status": "ok", "fwd_bwd_ms": 4.865, "fwd_bwd_iqr_ms": 0.5})
    noisy = Result.from_record({**quiet.record(), "noisy": True, "noisy_passes": ["fwd_bwd"]})
    assert (bench.cell_ms(quiet), bench.cell_ms(noisy)) == ("4.865 ±0.5", "4.865 ±0.5 noisy")


def test_the_summarys_machine_is_a_variants_env_json_or_this_process(tmp_path):
    """A --resume that ran nothing, a variant's env.json removed by hand: a traceback after the combined
    files were written (SUMMARY.md left an earlier one). The summary names this process's machine then."""
    bench = load_script("bench_cpu")
    env = bench.machine_env(tmp_path, ["linear"])
    assert {"device_name", "num_threads", "torch_version", "allocator", "hostname", "date"} <= set(env)
    (tmp_path / "sparse").mkdir()
    (tmp_path / "sparse" / "env.json").write_text(json.dumps({"device_name": "measured here"}))
    assert bench.machine_env(tmp_path, ["linear", "sparse"]) == {"device_name": "measured here"}


def test_the_summary_states_the_memory_budget_its_runs_had(tmp_path):
    """A --resume that measured nothing wrote the memory free at that moment as the budget (19.7 GB in a
    summary whose rows ran under 19.65): the budgets are the runs' own, from their env.json."""
    bench = load_script("bench_cpu")
    assert bench.run_budgets(tmp_path, ["linear"], 7.5) == [7.5]  # no run there: this invocation's
    for where, budget in (("linear", 19.65), ("linear/round-2", 19.65), ("sparse", 18.0)):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "env.json").write_text(json.dumps({"config": {"memory_budget_gb": budget}}))
    assert bench.run_budgets(tmp_path, ["linear"], 7.5) == [19.65]
    assert bench.run_budgets(tmp_path, ["linear", "sparse"], 7.5) == [18.0, 19.65]
