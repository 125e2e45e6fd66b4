"""scripts/bench_peers.py end to end at a tiny N: outputs checked equal, both sides measured, ratios written.
The SDPA pairs need nothing beyond the project and always run; the others need the `peers` extra."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, load_script

SCRIPT = ROOT / "scripts" / "bench_peers.py"


def run(tmp_path, pairs, seq_lens=("256",), rounds=1):
    cmd = [sys.executable, str(SCRIPT), "--seq-lens", *seq_lens, "--min-run-time", "0.01", "--rounds", str(rounds),
           "--out", str(tmp_path), "--only", *pairs]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp_path / "results.json").read_text()), done


def test_ctrl_c_is_one_line_and_keeps_the_pairs_measured(tmp_path):
    """It was a KeyboardInterrupt's traceback. results.json is written after every pair: the first stays,
    and so it does through the rerun of the pair interrupted (each run rewrote both files with its own
    rows only)."""
    cmd = [sys.executable, str(SCRIPT), "--seq-lens", "256", "--min-run-time", "0.3", "--rounds", "1",
           "--out", str(tmp_path), "--only", "sparse_fixed", "blockwise_exact"]
    # SIGINT as a terminal's foreground process has it: a suite started in the background (`cmd &` in a
    # script) ignores SIGINT, and a Python started ignoring it keeps ignoring it (no KeyboardInterrupt)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "results.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "it ended before Ctrl-C: " + proc.communicate()[1][-2000:]
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "bench_peers.py: interrupted (Ctrl-C); results.json and table.md hold "
                                           "the pairs measured before it, and the earlier runs' rows\n"), err[-2000:]
    assert [r["pair"] for r in json.loads((tmp_path / "results.json").read_text())["rows"]] == ["sparse_fixed"]
    res, done = run(tmp_path, ["blockwise_exact"])
    assert "keeping 1 earlier row(s)" in done.stdout
    check(res["rows"], ["blockwise_exact", "sparse_fixed"])  # PAIRS' order
    assert "sparse_fixed / SDPA + mask (time)" in (tmp_path / "table.md").read_text()
    # another machine's directory is refused, not mixed into one table
    other = json.loads((tmp_path / "results.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps({**other, "env": {**other["env"], "device_name": "Another CPU"}}))
    cmd = [sys.executable, str(SCRIPT), "--seq-lens", "256", "--out", str(tmp_path), "--only", "sparse_fixed"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-2000:]
    assert "holds measurements of another machine (Another CPU" in refused.stderr


def check(rows, pairs):
    assert [r["pair"] for r in rows] == pairs
    for r in rows:
        assert r["max_rel_err"] <= 1e-4
        for side in (r["ours_side"], r["peer_side"]):
            assert side["fwd_bwd_ms"] > 0 and side["peak_mem_bytes"] > 0
        assert r["time_ratio"] == pytest.approx(r["ours_side"]["fwd_bwd_ms"] / r["peer_side"]["fwd_bwd_ms"])
        ratios = r["round_time_ratios"]
        assert len(ratios) == r["rounds"] and r["time_ratio"] == sorted(ratios)[(len(ratios) - 1) // 2]
        assert r["noisy"] == bool(r["noise_reasons"])


def test_sdpa_pairs(tmp_path):
    pairs = ["blockwise_exact", "sparse_fixed", "sparse_bigbird"]
    res, _ = run(tmp_path, pairs, rounds=3)
    check(res["rows"], pairs)
    assert "sparse_fixed / SDPA + mask (time)" in (tmp_path / "table.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("local_attention") is None or importlib.util.find_spec("linformer") is None,
                    reason='peers not installed: pip install -e ".[peers]"')
def test_package_peers(tmp_path):
    pairs = ["sliding_window", "linear"]
    res, _ = run(tmp_path, pairs)
    check(res["rows"], pairs)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason='peers not installed: pip install -e ".[peers]"')
def test_longformer_peer(tmp_path):
    """Hugging Face's Longformer layer, given our q, k, v, computes sliding_window w=256 (N: a multiple
    of its two-sided window, 512)."""
    res, _ = run(tmp_path, ["longformer"], seq_lens=["512"])
    check(res["rows"], ["longformer"])


def without_local_attention(out, *pairs: str) -> subprocess.CompletedProcess:
    """The script measuring ``pairs`` at N=256 into ``out`` as where local-attention is not installed."""
    code = ("import importlib.util, runpy, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'local_attention' else real(n, *a); "
            f"sys.argv = {[str(SCRIPT), '--seq-lens', '256', '--min-run-time', '0.01', '--rounds', '1', '--out', str(out), '--only', *pairs]!r}; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}  # no re-exec
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_missing_peer_is_one_line(tmp_path):
    """Without a peer the script says how to install it and measures the rest."""
    done = without_local_attention(tmp_path, "sliding_window", "blockwise_exact")
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'skipping sliding_window: peers not installed (pip install -e ".[peers]")' in done.stderr
    assert [r["pair"] for r in json.loads((tmp_path / "results.json").read_text())["rows"]] == ["blockwise_exact"]


def test_every_chosen_peer_missing_is_one_line_and_writes_nothing(tmp_path):
    """It said it skipped them, then raised FileNotFoundError reading a table.md it never wrote."""
    done = without_local_attention(tmp_path / "out", "sliding_window")
    assert (done.returncode, done.stdout) == (1, ""), done.stderr[-2000:]
    assert done.stderr == 'bench_peers: nothing to measure: sliding_window: peers not installed (pip install -e ".[peers]")\n'
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--seq-lens", "-5"], "argument --seq-lens: must be an integer > 0; got '-5'"),
    (["--seq-lens", "0"], "argument --seq-lens: must be an integer > 0; got '0'"),
    (["--min-run-time", "nan"], "argument --min-run-time: must be a finite number > 0; got 'nan'"),  # looped forever
    (["--min-run-time", "-1"], "argument --min-run-time: must be a finite number > 0; got '-1'"),
    (["--rounds", "0"], "argument --rounds: must be an integer > 0; got '0'"),
    (["--only", "longformer", "--seq-lens", "512", "768"], "--only longformer needs every --seq-lens a multiple of 512; got 768"),
    (["--out", "FILE"], "argument --out: cannot write results to FILE: FILE is a file, not a directory")])
def test_bad_input_is_one_line_before_anything_is_made(tmp_path, args, message, monkeypatch, capsys):
    """-5 and 0 were a traceback from torch or the variant, after the output directory was made. In this
    process (a process each costs torch's import; the script's one line as a process: the refusal of
    another machine's directory above)."""
    file = tmp_path / "file"
    file.write_text("kept")
    args = [str(file) if a == "FILE" else a for a in args]
    monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--only", "blockwise_exact", "--out", str(tmp_path / "out"), *args])
    with pytest.raises(SystemExit) as exit_:
        load_script("bench_peers").main()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, ""), err[-2000:]
    assert err == f"bench_peers.py: error: {message.replace('FILE', str(file))}; see --help\n"
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and file.read_text() == "kept"


@pytest.mark.skipif(importlib.util.find_spec("local_attention") is None, reason='peers not installed: pip install -e ".[peers]"')
def test_sliding_window_peer_at_an_n_not_a_multiple_of_its_window(tmp_path):
    """local-attention's autopad pads the keys with zeros it does not mask: at N=1000 its queries near the
    end attended to them, and the run stopped with 'outputs differ' (4e-2)."""
    res, _ = run(tmp_path, ["sliding_window"], seq_lens=["1000"])
    check(res["rows"], ["sliding_window"])


def test_a_length_or_pair_given_twice_is_one_row(tmp_path):
    """It was measured twice and written as two rows of one pair and N."""
    res, _ = run(tmp_path, ["blockwise_exact", "blockwise_exact"], seq_lens=["256", "256"])
    check(res["rows"], ["blockwise_exact"])


@pytest.mark.skipif(importlib.util.find_spec("linformer") is None, reason='peers not installed: pip install -e ".[peers]"')
def test_a_peers_layout_is_made_outside_its_timed_calls(tmp_path):
    """linformer takes (B, N, H·D): its q and k were copied into that layout inside its timed calls, a
    copy ours does not make, and its 0.93x peak memory against ours was that copy. Made once outside,
    the two sides, the same computation, hold the same memory."""
    res, _ = run(tmp_path, ["linear"], seq_lens=["1024"])
    (row,) = res["rows"]
    assert row["mem_ratio"] == 1.0, (row["ours_side"]["peak_mem_bytes"], row["peer_side"]["peak_mem_bytes"])


def test_a_point_that_fails_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """An exception in one pair (a peer's error, an allocation refused) ended the whole run in a traceback,
    and outputs that differ in a SystemExit: the points after it were never measured. Now each is recorded
    as failed with its one-line reason, the run goes on, and it ends with exit code 1 and one line. A
    failure replaces no row measured before; a point measured later has no failure left. In this process:
    the failures are made by wrapping the pairs' builders."""
    peers = load_script("bench_peers")
    for name, value in peers.ALLOCATOR_ENV.items():  # else main() execs itself with them
        monkeypatch.setenv(name, value)
    make, _, label = peers.PAIRS["blockwise_exact"]

    def fails_at(n):
        def build(N):
            if N == n:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory:\n  you tried to allocate 1 byte")
            return make(N)
        return build

    def differs(N):
        ours, peer, layout = make(N)
        return ours, lambda q, k, v: 2 * peer(q, k, v), layout

    def main(*args):
        monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--min-run-time", "0.01", "--rounds", "1",
                                          "--out", str(tmp_path), *args])
        try:
            code = peers.main() or 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        res = json.loads((tmp_path / "results.json").read_text())
        return code, err, res, [(r["pair"], r["seq_len"]) for r in res["rows"]], \
            {(f["pair"], f["seq_len"]): f for f in res["failed"]}

    monkeypatch.setitem(peers.PAIRS, "blockwise_exact", (fails_at(256), None, label))
    monkeypatch.setitem(peers.PAIRS, "sparse_bigbird", (differs, None, label))
    code, err, res, rows, failed = main("--seq-lens", "128", "256", "--only", "blockwise_exact", "sparse_bigbird",
                                        "sparse_fixed")
    assert code == 1 and err.count("\n") == 1, err[-2000:]
    assert err.startswith("bench_peers: 3 point(s) failed, recorded in results.json and table.md: ")
    assert "blockwise_exact N=256: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried" in err
    assert rows == [("blockwise_exact", 128), ("sparse_fixed", 128), ("sparse_fixed", 256)]
    assert set(failed) == {("blockwise_exact", 256), ("sparse_bigbird", 128), ("sparse_bigbird", 256)}
    assert failed[("sparse_bigbird", 128)]["error"].startswith("outputs differ (")
    text = (tmp_path / "table.md").read_text()
    assert "| sparse_bigbird / SDPA (time) | failed | failed |" in text
    assert "- blockwise_exact N=256 (" in text

    # blockwise_exact mended, and now failing at the N it measured before: that row is kept, its failure
    # recorded; the N it failed at before is measured, its failure gone; sparse_bigbird's 256 failed again,
    # its 128 was not tried (kept).
    monkeypatch.setitem(peers.PAIRS, "blockwise_exact", (fails_at(128), None, label))
    before = rows
    code, err, res, rows, failed = main("--seq-lens", "128", "256", "--only", "blockwise_exact")
    assert code == 1 and "1 point(s) failed" in err
    assert rows == [("blockwise_exact", 128), ("blockwise_exact", 256), *before[1:]]
    assert set(failed) == {("blockwise_exact", 128), ("sparse_bigbird", 128), ("sparse_bigbird", 256)}
    monkeypatch.setitem(peers.PAIRS, "sparse_bigbird", peers.PAIRS["sparse_fixed"])
    code, err, res, rows, failed = main("--seq-lens", "256", "--only", "sparse_bigbird")
    assert code == 0 and set(failed) == {("blockwise_exact", 128), ("sparse_bigbird", 128)}
    assert ("sparse_bigbird", 256) in rows and len(rows) == 5
