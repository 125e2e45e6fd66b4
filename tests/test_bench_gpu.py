"""scripts/bench_gpu.py end to end on CPU (--smoke), and the GPU job's shell scripts.

The smoke run is the GPU benchmark's own code path at tiny sizes in float32: every variant × every CPU
backend through harness.run.run, the Table 21 memory check, the FA-2 shape TFLOP/s, the comparisons
and the targets. What needs CUDA (the matmul roof, raw do_bench, xformers, FlexAttention's backward)
must be recorded as skipped, never as met or missed, and every number SUMMARY.md shows must be the one
in the results files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import variants
from harness.results import FIELDS, read_jsonl

from .conftest import ROOT

SCRIPT = ROOT / "scripts" / "bench_gpu.py"
MiB = 2**20
SMOKE_N = (128, 256)
# Every variant of conf/variant/ at its defaults (sparse: every pattern; blockwise: both modes).
A_LABELS = {"full": ("full", {}), "sliding_window": ("sliding_window", {}), "linear": ("linear", {}),
            "blockwise-local": ("blockwise", {"mode": "local"}), "blockwise-exact": ("blockwise", {"mode": "exact"}),
            "sparse-fixed": ("sparse", {"pattern": "fixed"}), "sparse-strided": ("sparse", {"pattern": "strided"}),
            "sparse-bigbird": ("sparse", {"pattern": "bigbird"})}
CUDA_TARGETS = {"full_roof", "math_memory", "overhead", "compare_sliding_window", "compare_sparse-fixed",
                "compare_sparse-strided", "compare_sparse-bigbird"}


def bench(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    proc = bench("--smoke", "--out", str(out), "--threads", "1")
    return out, proc.stdout


def expected_series() -> set[str]:
    return {f"{label}__{b}" for label, (name, o) in A_LABELS.items()
            for b in variants.build(name, **o).available_backends("cpu")}


def md_rows(md: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table after ``heading`` (header row dropped)."""
    lines = md.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def md_table(md: str, heading: str) -> dict[str, list[str]]:
    """First cell -> the other cells."""
    return {r[0]: r[1:] for r in md_rows(md, heading)}


def test_smoke_writes_every_file_and_completes(smoke):
    out, _ = smoke
    for name in ("SUMMARY.md", "summary.json", "state.json", "env.json", "a_time.png", "a_memory.png", "c_tflops.png",
                 "c/roof.json", "d/compare.jsonl", "d/overhead.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    state = json.loads((out / "state.json").read_text())
    assert all(state["parts"][p]["complete"] for p in "abcd"), state
    roof = json.loads((out / "c" / "roof.json").read_text())
    assert roof["status"] == "skipped: needs CUDA"


def test_every_variant_and_backend_is_measured_by_the_harness(smoke):
    out, _ = smoke
    want = expected_series()
    assert {p.name for p in (out / "a").iterdir()} == want
    for key in want:
        rows = read_jsonl(out / "a" / key / "results.jsonl")
        assert sorted(r["seq_len"] for r in rows) == list(SMOKE_N), key
        for r in rows:
            assert set(FIELDS) <= set(r)  # the harness's own rows
            assert r["status"] == "ok", (key, r["reason"])
            assert (r["batch_size"], r["num_heads"], r["head_dim"], r["dtype"]) == (1, 2, 16, "float32")
            assert r["timer"] == "torch.utils.benchmark.blocked_autorange"
            assert (r["variant"], r["backend"]) == (A_LABELS[key.split("__")[0]][0], key.split("__")[1])
        assert (out / "a" / key / "env.json").exists()  # written by harness.run.run
    # Part c: every full backend, D = 32 and 16, causal and not; B = 256 tokens / N, H = 64 / D.
    full = variants.build("full").available_backends("cpu")
    c_keys = {p.name for p in (out / "c").iterdir() if p.is_dir()}
    assert c_keys == {f"D{d}-{c}__{b}" for d in (32, 16) for c in ("bidir", "causal") for b in full}
    for key in c_keys:
        d = int(key[1:].split("-")[0])
        for r in read_jsonl(out / "c" / key / "results.jsonl"):
            assert (r["batch_size"], r["num_heads"], r["causal"]) == (256 // r["seq_len"], 64 // d, "causal" in key)


def test_summary_tables_hold_every_series_and_the_numbers_of_the_results(smoke):
    out, _ = smoke
    md = (out / "SUMMARY.md").read_text()
    times = md_table(md, "### Forward+backward time, ms (median)")
    memory = md_table(md, "### Peak memory of forward+backward, MiB")
    frontier = md_table(md, "### OOM frontier")
    assert set(times) == set(memory) == set(frontier) == expected_series()
    for key in times:
        rows = {r["seq_len"]: r for r in read_jsonl(out / "a" / key / "results.jsonl")}
        assert times[key] == [f"{rows[n]['fwd_bwd_ms']:.4g}" for n in SMOKE_N], key
        assert memory[key] == [f"{rows[n]['peak_mem_bytes'] / MiB:.1f}" for n in SMOKE_N], key
        assert frontier[key][0] == "256"
    tflops = md_table(md, "### TFLOP/s, forward (")
    assert set(tflops) == {p.name for p in (out / "c").iterdir() if p.is_dir()}
    for key, cells in tflops.items():
        rows = {r["seq_len"]: r for r in read_jsonl(out / "c" / key / "results.jsonl")}
        assert cells == [f"{rows[n]['tflops_fwd']:.4g}" for n in SMOKE_N], key
    mem = md_table(md, "## B. full math peak memory")
    math_rows = {r["seq_len"]: r for r in read_jsonl(out / "a" / "full__math" / "results.jsonl")}
    for n in SMOKE_N:
        r = math_rows[n]
        measured = r["peak_mem_bytes"] + 4 * 1 * 2 * n * 16 * 4  # + q, k, v, dout in float32
        formula = 4 * 1 * 2 * n * n * 2 + 10 * 1 * 2 * n * 16 * 2
        assert mem[str(n)] == ["ok", f"{measured / MiB:.1f}", f"{formula / MiB:.1f}", f"{measured / formula:.3f}"]
    # Comparisons: every timed kernel's line carries the number of d/compare.jsonl.
    timed = [tuple(r[:6]) for r in md_rows(md, "Every kernel timed:")]
    compare = [json.loads(line) for line in (out / "d" / "compare.jsonl").read_text().splitlines()]
    assert compare and len(timed) == len(compare)
    for r in compare:
        ms = "-" if r["fwd_bwd_ms"] is None else f"{r['fwd_bwd_ms']:.4g}"
        assert (r["label"], str(r["seq_len"]), r["kind"], r["name"], r["status"], ms) in timed, r
    # summary.json says what SUMMARY.md says.
    summary = json.loads((out / "summary.json").read_text())
    for key, pts in summary["a"].items():
        rows = {r["seq_len"]: r for r in read_jsonl(out / "a" / key / "results.jsonl")}
        assert {int(n): p["fwd_bwd_ms"] for n, p in pts.items()} == {n: r["fwd_bwd_ms"] for n, r in rows.items()}


def test_targets_needing_cuda_are_skipped_not_judged(smoke):
    out, stdout = smoke
    summary = json.loads((out / "summary.json").read_text())
    targets = {t["id"]: t for t in summary["targets"]}
    assert set(targets) == CUDA_TARGETS | {"compare_blockwise-local", "exponent_sliding_window", "exponent_linear"}
    for tid in CUDA_TARGETS:
        assert targets[tid]["status"] == "skipped" and "needs CUDA" in targets[tid]["detail"], targets[tid]
    # What runs on CPU is judged: blockwise local against SDPA on its blocks, and the exponents.
    for tid in ("compare_blockwise-local", "exponent_sliding_window", "exponent_linear"):
        assert targets[tid]["status"] in ("met", "missed") and targets[tid]["value"] is not None, targets[tid]
    md = (out / "SUMMARY.md").read_text()
    table = md_table(md, "## Targets")
    assert len(table) == len(targets)
    for t in summary["targets"]:
        assert table[t["target"]][0] == f"**{t['status']}**"
        assert f"target {t['id']}: {t['status']}" in stdout
    lin = targets["exponent_linear"]
    best = lin["detail"].split(":")[0]
    rows = read_jsonl(out / "a" / best / "results.jsonl")
    from harness.results import fit_exponents

    assert lin["value"] == pytest.approx(fit_exponents(rows, 128, 256)["fwd_bwd_ms"]["fitted"])
    assert f"{lin['value']:.3f}" in table[lin["target"]][1]


def test_resume_point_cap_and_pending(tmp_path):
    out = tmp_path / "b"
    # The longer N of a series whose projected time exceeds --point-cap-s is recorded as skipped ...
    bench("--smoke", "--threads", "1", "--out", str(out), "--parts", "a", "--only", "full__math", "--point-cap-s", "1e-9")
    rows = read_jsonl(out / "a" / "full__math" / "results.jsonl")
    assert [(r["seq_len"], r["status"]) for r in rows] == [(128, "ok"), (256, "skipped")]
    assert "--point-cap-s" in rows[1]["reason"] and set(FIELDS) <= set(rows[1])
    assert [p.name for p in (out / "a").iterdir()] == ["full__math"]
    # ... a subset leaves the part incomplete, and a rerun measures nothing again.
    assert bench("--smoke", "--out", str(out), "--pending").stdout.split() == ["a", "b", "c", "d"]
    proc = bench("--smoke", "--threads", "1", "--out", str(out), "--parts", "a", "--only", "full__math")
    assert "[a] full__math" not in proc.stdout
    assert read_jsonl(out / "a" / "full__math" / "results.jsonl") == rows


@pytest.mark.parametrize("script", ["gpu_job.sh", "fetch_wheels.sh"])
def test_shell_scripts_parse(script):
    path = ROOT / "scripts" / script
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    if script == "gpu_job.sh":  # the documented call: carried wheels, one command, within the tool's limits
        call = re.search(r'run\(command="([^"]+)", carry=\["wheels"\], timeout_s=600\)', text)
        assert call and len(call.group(1)) <= 2000
        assert "--no-index" in text and "-m gpu" in text and "bench_gpu.py" in text
