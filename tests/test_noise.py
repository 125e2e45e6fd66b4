"""A measurement that can be trusted, or says it cannot: samples, the noisy flag and its reasons, retry,
and what the console, fits, report and compare do with noisy points. Timings are never asserted: the
flags are (a CPU-burning process beside a real point must be seen)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from harness.report import sweep as report
from harness.report.collect import compare_key
from harness.report.compare import compare, judge
from harness.config import MeasureOptions
from harness.console import Display
from harness.measure import gpu_repeats, noise, spare_cores, time_fn
from harness.results import Result, fit_exponents, read_jsonl
from harness.run import run

from .test_harness import compose_cfg
from .test_report import row, write_sweep

TINY = ["variant=full", "num_heads=1", "head_dim=8", "seq_lens=[48]", "measure.min_run_time=0.05",
        "fidelity.enabled=false", "logger=none"]


def test_every_timing_has_enough_samples_for_a_spread(tmp_path):
    (r,) = run(compose_cfg(*TINY, "measure.min_samples=7", "measure.min_run_time=0.001"), output_dir=tmp_path).rows
    for p in ("fwd", "bwd", "fwd_bwd"):
        assert getattr(r, f"{p}_samples") >= 7 and getattr(r, f"{p}_iqr_ms") is not None, p
    assert r.tries == 1 and isinstance(r.noisy, bool)


def test_too_few_samples_is_noisy_and_says_why(tmp_path):
    # max_run_time below one block: the point cannot take its samples and says so
    (r,) = run(compose_cfg(*TINY, "measure.min_samples=1000", "measure.max_run_time=0.01",
                           "measure.passes=[fwd,fwd_bwd]"), output_dir=tmp_path).rows
    assert r.noisy and "< measure.min_samples=1000" in r.noise_reasons and "max_run_time=0.01" in r.noise_reasons
    assert r.noisy_passes == ["fwd", "fwd_bwd"]  # the passes timed, each without its samples
    assert read_jsonl(tmp_path / "results.jsonl")[-1]["noisy_passes"] == ["fwd", "fwd_bwd"]


def test_a_point_noisy_only_for_too_few_samples_is_not_retried(tmp_path):
    """A slow call stays slow: retrying it would spend max_run_time per pass again for nothing. A point
    noisy for another reason is still retried (the quietest kept). The slow point times forward+backward
    alone: under load a forward timed slower than forward+backward is noisy too (and retried: it failed so)."""
    (r,) = run(compose_cfg(*TINY, "measure.min_samples=1000", "measure.max_run_time=0.01", "measure.on_noise=retry",
                           "measure.max_other_cores=1000", "measure.passes=[fwd_bwd]"),
               output_dir=tmp_path / "slow").rows
    assert r.noisy and r.tries == 1 and "< measure.min_samples=1000" in r.noise_reasons
    (r,) = run(compose_cfg(*TINY, "measure.max_rel_iqr=1e-9", "measure.on_noise=retry", "measure.max_tries=2"),
               output_dir=tmp_path / "spread").rows
    assert r.noisy and r.tries == 2 and "IQR" in r.noise_reasons


def test_cpu_timing_of_long_calls_keeps_within_max_run_time():
    """Every call counts against max_run_time: the autorange's estimate and each block topped up (Timer's
    timeit would add two untimed calls per block: 11 calls of 0.2 s where 1 s allows 5)."""
    import time

    calls = []

    def slow() -> None:
        calls.append(1)
        time.sleep(0.2)

    t = time_fn(slow, torch.device("cpu"), MeasureOptions(min_run_time=0.1, min_samples=5, max_run_time=1.0))
    assert len(calls) <= 5 and 2 <= t.samples < 5  # fewer samples than asked, within the limit
    assert t.median_ms == pytest.approx(200, rel=0.5)


def test_before_runs_ahead_of_every_timed_call_on_cpu():
    """``before`` (the harness clears the input gradients with it) runs once before each call of ``fn``,
    never after it nor twice: a backward timed without it would add into the last call's gradients."""
    import time

    order = []
    t = time_fn(lambda: order.append("fn"), torch.device("cpu"), MeasureOptions(min_run_time=0.01, min_samples=3),
                before=lambda: (order.append("before"), time.sleep(1e-3)))
    assert order[::2] == ["before"] * (len(order) // 2) and order[1::2] == ["fn"] * (len(order) // 2)
    assert t.median_ms >= 1.0  # on CPU a sample is a block of calls: before is inside it


@pytest.mark.gpu
def test_cuda_timer_leaves_before_out_of_the_timed_region():
    """As do_bench's ``grad_to_none``: host work before a call (here a 30 ms sleep, with the GPU idle)
    is not in its CUDA events; a timer that recorded it would give at least 30 ms a call."""
    import time

    x = torch.randn(1024, 1024, device="cuda")
    calls = {"before": 0, "fn": 0}

    def before() -> None:
        calls["before"] += 1
        time.sleep(0.03)

    def fn() -> None:
        calls["fn"] += 1
        x @ x
    t = time_fn(fn, torch.device("cuda"), MeasureOptions(min_run_time=0.01, min_samples=5), before=before)
    assert calls["before"] == calls["fn"] and t.samples >= 5
    assert t.median_ms < 10, t  # a 1024³ float32 matmul: well under a millisecond on any recent GPU


def test_gpu_repeats_give_every_call_a_spread_within_max_run_time():
    """do_bench's rep / estimate calls, but at least min_samples (do_bench would time a 300 ms call once)
    and no more than max_run_time allows."""
    opts = MeasureOptions(min_run_time=0.1, min_samples=5, max_run_time=60)
    assert gpu_repeats(0.01, opts) == 10_000  # short calls: do_bench's count
    assert gpu_repeats(10.0, opts) == 10
    assert gpu_repeats(300.0, opts) == 5  # do_bench: 1
    assert gpu_repeats(20_000.0, opts) == 3  # 5 would take 100 s > 60 s: fewer, and the point says so
    assert gpu_repeats(90_000.0, opts) == 1


@pytest.fixture
def host_clock_events(monkeypatch):
    """cuda_time_fn on any machine: its CUDA events and synchronisation stood in for by the host clock
    (harness.measure's: a test that stands in for that clock moves the events with it)."""
    from harness import measure

    class Event:
        def __init__(self, enable_timing: bool = True) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = measure.time.perf_counter()

        def elapsed_time(self, end: Event) -> float:
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(measure, "L2_FLUSH_BYTES", 16)


def test_cuda_timing_of_long_calls_keeps_within_max_run_time(host_clock_events):
    """The GPU pass's untimed calls (the first, the estimate) count against max_run_time, as the CPU
    autorange's estimate does: 0.2 s calls with 1 s allow 5 calls, not 2 untimed + 5 timed. The CUDA
    events and synchronisation are stood in for by the host clock (the calls are host sleeps)."""
    import time

    from harness import measure

    calls = []

    def slow() -> None:
        calls.append(1)
        time.sleep(0.2)

    t = measure.cuda_time_fn(slow, torch.device("cpu"), MeasureOptions(min_run_time=0.1, min_samples=5,
                                                                       max_run_time=1.0))
    assert len(calls) <= 5 and 1 <= t.samples < 5, (len(calls), t)
    assert t.median_ms == pytest.approx(200, rel=0.5)


def test_the_cuda_timer_leaves_before_out_of_its_events_with_the_host_clock_standing_in(host_clock_events):
    """cuda_time_fn on any machine, its CUDA events stood in for by the host clock (as above): ``before``
    (a 30 ms host sleep) runs ahead of every timed call and outside its events, so a 1 ms call times about
    1 ms, not 31. The GPU test above checks the real events; this one runs without a GPU."""
    import time

    from harness import measure

    order = []
    t = measure.cuda_time_fn(lambda: (order.append("fn"), time.sleep(1e-3)), torch.device("cpu"),
                             MeasureOptions(min_run_time=0.01, min_samples=5),
                             before=lambda: (order.append("before"), time.sleep(0.03)))
    assert order[::2] == ["before"] * (len(order) // 2) and order[1::2] == ["fn"] * (len(order) // 2)
    assert t.samples >= 5 and t.median_ms < 15, t


@pytest.mark.gpu
def test_cuda_timer_is_do_bench_with_a_spread_for_long_calls():
    """The same method as do_bench (other test processes may share the GPU, slowing any call several
    times: loose bounds here; the benchmark's d/overhead.json holds the harness against raw do_bench
    within 3%), and at least min_samples calls where do_bench would time a call once or twice."""
    import time

    import torch
    from triton.testing import do_bench

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    opts = MeasureOptions(min_run_time=0.1, min_samples=5)
    short = time_fn(lambda: x @ x, torch.device("cuda"), opts)
    ref = do_bench(lambda: x @ x, rep=100, return_mode="median")
    assert short.samples >= 50 and 0.5 < short.median_ms / ref < 2, (short, ref)  # ~0.3 ms a call alone
    reps = 1

    def long_call():
        for _ in range(reps):
            x @ x
    while True:  # a call past 150 ms, measured here: past 25 ms even if the GPU was shared 6 ways then,
        torch.cuda.synchronize()  # so do_bench's rep=100 times it at most four times
        start = time.perf_counter()
        long_call()
        torch.cuda.synchronize()
        if time.perf_counter() - start > 0.15:
            break
        reps *= 2
    assert len(do_bench(long_call, rep=100, return_mode="all")) < 5
    timing = time_fn(long_call, torch.device("cuda"), opts)
    assert timing.samples == 5 and timing.iqr_ms is not None and timing.median_ms > 20, timing


def test_noise_names_the_pass_each_reason_concerns():
    opts = MeasureOptions(passes=("fwd", "fwd_bwd"))
    quiet = dict(fwd_ms=1.0, fwd_iqr_ms=0.05, fwd_samples=9, fwd_bwd_ms=3.0, fwd_bwd_iqr_ms=0.1, fwd_bwd_samples=9,
                 other_cpu_cores=0.02)
    assert noise(quiet, opts) == []
    assert noise({**quiet, "fwd_iqr_ms": 0.5}, opts) == [
        ("fwd", "fwd: IQR 50% of the median > measure.max_rel_iqr=0.15")]
    assert noise({**quiet, "fwd_bwd_samples": 2}, opts) == [
        ("fwd_bwd", "fwd_bwd: 2 samples < measure.min_samples=5 (one call 0.003 s; measure.max_run_time=60 s)")]
    assert noise({**quiet, "fwd_ms": 111.9}, opts)[-1] == \
        (None, "forward 111.9 ms slower than forward+backward 3 ms")
    assert noise({**quiet, "other_cpu_cores": 1.2}, opts) == [
        (None, "other processes kept 1.20 cores busy > measure.max_other_cores=0.25")]


def test_on_cuda_only_load_beyond_the_spare_cores_is_noise():
    """A CUDA measurement needs one core to launch from: others' load on the rest does not slow it. A CPU
    one shares memory bandwidth and cache with every core: any load counts."""
    import os

    cores = os.cpu_count()
    assert spare_cores("cpu") == 0 and spare_cores(torch.device("cpu")) == 0
    assert spare_cores("cuda") == cores - 1 and spare_cores("cuda:0", launchers=3) == max(0, cores - 3)
    assert spare_cores("cuda", launchers=cores + 5) == 0
    # The host's cores, as others' load is the host's: in a cpuset of one core (a SLURM job's on a GPU
    # node) the other jobs' load on the rest of the host flagged every CUDA point
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})
    try:
        assert spare_cores("cuda") == cores - 1
    finally:
        os.sched_setaffinity(0, mine)
    opts = MeasureOptions(passes=("fwd_bwd",))
    timed = {"fwd_bwd_ms": 10.0, "fwd_bwd_iqr_ms": 0.1, "fwd_bwd_samples": 9, "other_cpu_cores": 1.03}
    assert noise(timed, opts, spare=15) == []
    assert noise({**timed, "other_cpu_cores": 15.2}, opts, spare=15) == []
    assert noise({**timed, "other_cpu_cores": 15.5}, opts, spare=15) == [
        (None, "other processes kept 15.50 cores busy, 0.50 beyond the 15 a CUDA measurement leaves them, "
               "> measure.max_other_cores=0.25")]
    assert noise(timed, opts) == [(None, "other processes kept 1.03 cores busy > measure.max_other_cores=0.25")]


@pytest.fixture
def burners():
    """Two processes spinning on the CPU (this machine's cores, or two of a larger one)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def test_a_point_beside_a_cpu_burner_is_flagged_or_retried(tmp_path, burners):
    (r,) = run(compose_cfg(*TINY), output_dir=tmp_path / "flag").rows
    assert r.noisy and "other processes kept" in r.noise_reasons and r.tries == 1
    rec = read_jsonl(tmp_path / "flag" / "results.jsonl")[0]
    assert rec["noisy"] is True and rec["noise_reasons"] == r.noise_reasons
    (r,) = run(compose_cfg(*TINY, "measure.on_noise=retry", "measure.max_tries=2"), output_dir=tmp_path / "retry").rows
    assert r.tries == 2 and r.noisy  # measured again, still disturbed: kept the quieter, still flagged
    status = json.loads((tmp_path / "retry" / "status.json").read_text())
    assert status["noisy"] == 1


@pytest.mark.gpu
def test_a_cuda_point_beside_cpu_burners_is_not_noise_while_cores_are_spare(tmp_path, burners):
    """The run passes the device's spare cores to the judgment: two spinning processes on a host with
    cores to spare leave a GPU point's timing as it is (on a 2-core host they would not). Judged on the
    load measured, as other tests' processes (compiling, in parallel) may add to the burners'."""
    import os

    if len(os.sched_getaffinity(0)) < 4:
        pytest.skip("needs 4 cores: two burners and a launching thread with one to spare")
    # The run's own allowance: the host's cores but the launching one (spare_cores), not this process's
    # affinity, as others' load is the host's (in a cpuset smaller than the host the two differ)
    spare = spare_cores("cuda")
    (r,) = run(compose_cfg(*TINY, "device=cuda", "dtype=float16", "variant.backend=sdpa"), output_dir=tmp_path).rows
    assert r.status == "ok" and r.other_cpu_cores > 1.5, r
    flagged = "other processes" in (r.noise_reasons or "")
    assert flagged == (r.other_cpu_cores - spare > 0.25), (r.other_cpu_cores, spare, r.noise_reasons)


def point(n: int, noisy: bool = False, **extra) -> dict:
    return row("full", "sdpa", n, fwd=1e-3 * n, mem=64 * n, noisy=noisy,
               noise_reasons="fwd: IQR 90% of the median > measure.max_rel_iqr=0.15" if noisy else None, **extra)


def test_fits_leave_noisy_points_out_and_say_so():
    rows = [point(256), point(512), point(1024, noisy=True), point(2048)]
    for r in rows:
        r["fwd_ms"] = 1e-3 * r["seq_len"] if not r["noisy"] else 99.0
    fit = fit_exponents(rows)["fwd_ms"]
    assert fit["seq_lens"] == [256, 512, 2048] and fit["left_out_noisy"] == [1024]
    assert fit["fitted"] == pytest.approx(1.0)
    assert fit_exponents(rows)["memory"]["seq_lens"] == [256, 512, 1024, 2048]  # memory is not timing


SPREAD = "IQR 90% of the median > measure.max_rel_iqr=0.15"
FEW = "2 samples < measure.min_samples=5 (one call 3 s; measure.max_run_time=60 s)"  # "; " inside one reason
LOAD = "other processes kept 1.20 cores busy > measure.max_other_cores=0.25"


@pytest.mark.parametrize("reasons, passes", [
    (f"fwd: {SPREAD}", ("fwd",)),
    (f"bwd: {SPREAD}; fwd: {FEW}", ("fwd", "bwd")),
    (f"fwd_bwd: {FEW}", ("fwd_bwd",)),
    (f"fwd: {SPREAD}; try 2 ended oom: CUDA out of memory; fwd_bwd: x", ("fwd",)),  # a retry's failure, said after
    (f"fwd: {SPREAD}; {LOAD}", ("fwd", "bwd", "fwd_bwd")),  # others' load: every pass
    ("forward 9 ms slower than forward+backward 3 ms", ("fwd", "bwd", "fwd_bwd")),
    ("a reason this harness never wrote", ("fwd", "bwd", "fwd_bwd")),
    (None, ("fwd", "bwd", "fwd_bwd")),
])
def test_a_row_from_before_noisy_passes_reads_them_from_its_reasons(reasons, passes):
    """Rows measured before noisy_passes was recorded: a pass's own reason makes that pass untrusted, any
    other (or one not recognised) every pass."""
    from harness.results import noisy_passes

    old = {**point(1024), "noisy": True, "noise_reasons": reasons}
    assert noisy_passes(old) == passes
    assert noisy_passes({**old, "noisy_passes": ["bwd"]}) == ("bwd",)  # recorded: as recorded
    assert noisy_passes({**old, "noisy": False}) == ()


def test_every_reason_noise_writes_reads_back_as_the_passes_it_recorded():
    """The reading of old rows is held to the words harness.measure writes now: each kind of reason, alone
    and together, read from its text gives the noisy_passes recorded beside it."""
    from harness.measure import noise, noise_fields
    from harness.results import noisy_passes

    opts = MeasureOptions(max_run_time=60.0)
    quiet = {f"{p}_{k}": v for p in ("fwd", "bwd", "fwd_bwd")
             for k, v in (("ms", 3.0), ("iqr_ms", 0.01), ("samples", 9))}
    quiet.update(fwd_ms=1.0, other_cpu_cores=0.0)
    cases = [{"fwd_iqr_ms": 0.9}, {"bwd_samples": 2}, {"fwd_bwd_samples": 1, "fwd_iqr_ms": 0.9}, {"fwd_ms": 9.0},
             {"other_cpu_cores": 1.2, "bwd_iqr_ms": 2.0}]
    for case in cases:
        rec = {**quiet, **case}
        fields = noise_fields(noise(rec, opts), rec, opts)
        assert fields["noisy"] and fields["noisy_passes"], case
        assert noisy_passes({**fields, "noisy_passes": None}) == tuple(fields["noisy_passes"]), (case, fields)
    rec = {**quiet, "fwd_iqr_ms": 0.9}
    assert noise_fields(noise(rec, opts), rec, opts)["noisy_passes"] == ["fwd"]


def test_a_noisy_pass_leaves_the_points_other_timings_trusted():
    """A forward's spread makes its forward untrusted, not its forward+backward: the fits, the report's
    crossover and compare use the passes that are not noisy. Others' load makes every pass untrusted."""
    from harness.report.compare import pooled
    from harness.results import untrusted

    rows = [point(256), point(512), point(1024, noisy=True), point(2048)]  # N=1024: the forward's spread
    rows[2]["fwd_ms"] = 99.0
    assert [untrusted(rows[2], m) for m in ("fwd_ms", "tflops_fwd", "bwd_ms", "fwd_bwd_ms", "tflops_fwd_bwd_useful",
                                            "peak_mem_bytes")] == [True, True, False, False, False, False]
    fits = fit_exponents(rows)
    assert fits["fwd_ms"]["left_out_noisy"] == [1024] and fits["fwd_ms"]["seq_lens"] == [256, 512, 2048]
    assert fits["fwd_bwd_ms"]["left_out_noisy"] == [] and fits["fwd_bwd_ms"]["seq_lens"] == [256, 512, 1024, 2048]
    assert report.trusted(rows[2], "fwd_ms") is None and report.trusted(rows[2], "fwd_bwd_ms") == rows[2]["fwd_bwd_ms"]
    loaded = {**rows[2], "noise_reasons": LOAD}
    assert report.trusted(loaded, "fwd_bwd_ms") is None and fit_exponents([*rows[:2], loaded, rows[3]])[
        "fwd_bwd_ms"]["left_out_noisy"] == [1024]
    # compare: the forward+backward judged, the forward not
    a = point(1024, fwd_bwd_ms=10.0, fwd_bwd_iqr_ms=0.1)
    b = point(1024, noisy=True, fwd_bwd_ms=20.0, fwd_bwd_iqr_ms=0.1)
    assert judge("fwd_bwd_ms", a, b, 0.1)[1] == "REGRESSION" and judge("fwd_ms", a, b, 0.1)[1] == "noisy"
    result = compare({compare_key(a): [a]}, {compare_key(b): [b]}, ["fwd_ms", "fwd_bwd_ms"], 0.1)
    assert result["regressions"] == 1 and result["noisy"] == [f"full/sdpa N=1024: fwd_ms noisy in B (fwd: {SPREAD})"]
    assert compare({compare_key(a): [a]}, {compare_key(b): [b]}, ["fwd_bwd_ms"], 0.1)["noisy"] == []
    # pooled runs: a pass is noisy where every run's is; its value is the median of the runs where it is not
    quiet_fwd = {**point(1024, fwd_ms=2.0), "noisy": True, "noisy_passes": ["bwd"], "noise_reasons": f"bwd: {SPREAD}"}
    both = pooled([{**b, "fwd_ms": 5.0}, quiet_fwd], ["fwd_ms", "bwd_ms"])
    assert both["fwd_ms"] == 2.0 and both["noisy_passes"] == [] and not both["noisy"]
    assert pooled([b, {**b, "noisy_passes": ["fwd", "bwd"]}], ["fwd_ms"])["noisy_passes"] == ["fwd"]


def test_the_console_marks_noisy_points_and_fits_at_100_columns():
    buf = io.StringIO()
    console = Console(file=buf, width=100, color_system=None)  # the frame as a 100-column terminal shows it
    display = Display("sliding_window[window=256]/blocksparse on cpu (AMD EPYC), float32, B=1 H=4 D=64 -> /d",
                      2, console=console)
    for n in (256, 65536):
        display.add(Result.from_record(point(n, noisy=n == 256, fwd_iqr_ms=1e-5 * n, bwd_iqr_ms=2e-5 * n)))
    display.add(Result.from_record(point(2**20, fwd_ms=22690.4, fwd_iqr_ms=1234.5, bwd_ms=45380.2, bwd_iqr_ms=99.9,
                                         fwd_bwd_ms=68071.0, fwd_bwd_iqr_ms=0.5, peak_mem_bytes=12320 * 2**20,
                                         tflops_fwd_bwd=0.123, out_rel_err=1.2e-7, other_cpu_cores=0.01)))
    buf.seek(0)
    buf.truncate()
    console.print(display.view())
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100, text
    body = [line.split() for line in text.splitlines() if line.strip().startswith(("256 ", "65536 "))]
    assert [b[:2] for b in body] == [["256", "ok*"], ["65536", "ok"]], text  # N never wraps; noisy marked
    assert body[1][2] == "65.54±0.66", text  # a number and its spread stay whole
    widest = [line.split() for line in text.splitlines() if line.strip().startswith("1048576 ")]
    assert widest == [["1048576", "ok", "22690±1234", "45380±100", "68071±0.5", "12320.0", "0.123", "1.2e-07",
                       "0.01"]], text
    assert "N=256 ok*: noisy: fwd: IQR 90%" in text
    display.fits({"fwd_ms": {"fitted": 1.0, "theory": 1.0, "seq_lens": [65536], "left_out_noisy": [256]}})
    assert "noisy N=256 left out" in display.fit_lines[0]


def test_off_a_terminal_each_point_is_one_plain_line(tmp_path):
    out = tmp_path / "measure.passes=[fwd]"  # as a sweep names its job directories: shown as it is
    proc = subprocess.run([sys.executable, "-m", "harness", *TINY, "seq_lens=[32,48]", f"hydra.run.dir='{out}'"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(f"-> {out}"), lines[0]
    assert [line.split(":")[0] for line in lines[1:3]] == ["N=32 ok", "N=48 ok"] or \
        [line.split(":")[0].rstrip("*") for line in lines[1:3]] == ["N=32 ok", "N=48 ok"], proc.stdout
    assert not any("│" in line or "━" in line for line in lines), proc.stdout  # no table drawn


# ----- compare ---------------------------------------------------------------------------------------

def test_a_regression_needs_the_threshold_and_separate_iqr_intervals():
    a = point(1024, fwd_bwd_ms=10.0, fwd_bwd_iqr_ms=0.4)
    slower_clear = {**a, "fwd_bwd_ms": 12.0, "fwd_bwd_iqr_ms": 0.4}
    slower_within = {**a, "fwd_bwd_ms": 12.0, "fwd_bwd_iqr_ms": 4.0}
    assert judge("fwd_bwd_ms", a, slower_clear, 0.1)[1] == "REGRESSION"
    assert judge("fwd_bwd_ms", a, slower_within, 0.1)[1] == "within noise"
    assert judge("fwd_bwd_ms", a, {**slower_clear, "noisy": True}, 0.1)[1] == "noisy"
    b = {**slower_clear, "noisy": True, "noise_reasons": "others"}
    result = compare({compare_key(a): [a]}, {compare_key(b): [b]}, ["fwd_bwd_ms"], 0.1)  # one run a side
    assert result["regressions"] == 0 and result["noisy"] == ["full/sdpa N=1024: fwd_bwd_ms noisy in B (others)"]
    # memory has no spread: the threshold alone decides
    assert judge("peak_mem_bytes", a, {**a, "peak_mem_bytes": 2 * a["peak_mem_bytes"]}, 0.1)[1] == "REGRESSION"
    # each run's interval is its median ± half its IQR: [9, 11] and [12, 14] are apart (± a whole IQR,
    # [8, 12] and [11, 15], would overlap)
    assert judge("fwd_bwd_ms", {**a, "fwd_bwd_iqr_ms": 2.0}, {**a, "fwd_bwd_ms": 13.0, "fwd_bwd_iqr_ms": 2.0},
                 0.1)[1] == "REGRESSION"


def test_every_throughput_is_higher_is_better_and_not_judged_from_noisy_timings():
    a = point(1024, fwd_bwd_ms=10.0, tflops_fwd=1.0, tflops_fwd_bwd=1.0, tflops_fwd_useful=1.0, out_rel_err=0.0)
    faster = {**a, "fwd_ms": a["fwd_ms"] / 2, "fwd_bwd_ms": 5.0, "tflops_fwd": 2.0, "tflops_fwd_bwd": 2.0,
              "tflops_fwd_useful": 2.0}  # twice the throughput: half the time it is computed from
    for metric in ("tflops_fwd", "tflops_fwd_bwd", "tflops_fwd_useful"):
        assert judge(metric, a, faster, 0.1)[1] == "better", metric
        assert judge(metric, faster, a, 0.1)[1] == "REGRESSION", metric
        assert judge(metric, a, {**faster, "noisy": True}, 0.1)[1] == "noisy", metric
    # From exactly zero there is no ratio, but an error that appears is still a regression
    assert judge("out_rel_err", a, {**a, "out_rel_err": 0.5}, 0.1) == (None, "REGRESSION (from 0)")


def test_two_runs_of_the_same_code_compare_without_regression(tmp_path):
    """End to end on real runs, on what repeats exactly: peak memory (the allocation replay). Times of
    two runs seconds apart on a shared machine can differ by more than any threshold with separate IQRs
    (a slow period), so judging them here would be a timed test; judge() is tested on given numbers."""
    args = ("variant=sliding_window", "variant.window=16", "num_heads=1", "head_dim=16", "seq_lens=[64,128,256]",
            "fidelity.enabled=false", "logger=none", "measure.min_run_time=0.01")
    run(compose_cfg(*args), output_dir=tmp_path / "a")
    run(compose_cfg(*args), output_dir=tmp_path / "b")
    proc = subprocess.run([sys.executable, "-m", "harness.report.compare", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--fail-on-regression", "--metric", "peak_mem_bytes", "--threshold", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "REGRESSION" not in proc.stdout, proc.stdout + proc.stderr
    assert "0 of 3 matched points regressed" in proc.stdout and proc.stdout.count(" 1.000") == 3, proc.stdout


# ----- report ----------------------------------------------------------------------------------------

@pytest.fixture
def drawn(monkeypatch):
    """The figures the report draws, kept (not closed) for inspection."""
    figures = {}

    def keep(fig, path):
        figures[path.stem] = fig
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(report, "_save", keep)
    return figures


def test_report_draws_noisy_points_hollow_iqr_bars_and_one_colour_per_series(tmp_path, drawn):
    import matplotlib.colors as mcolors

    rows = [point(n, noisy=n == 1024, fwd_iqr_ms=0.1) for n in (256, 512, 1024)]
    rows += [row("sliding_window", "blocksparse", n, fwd=1e-4 * n, mem=8 * n, opt_window=64, out_rel_err=0.1)
             for n in (256, 512, 1024)]
    sweep = write_sweep(tmp_path / "s", [rows])
    report.make_report(sweep, tmp_path / "out")
    ax = drawn["fwd_ms"].axes[0]
    markers = [line for line in ax.get_lines() if line.get_marker() == "o"]
    hollow = [line for line in markers if mcolors.same_color(line.get_markerfacecolor(), "white")]
    assert [list(line.get_xdata()) for line in hollow] == [[1024]]
    assert ax.containers, "IQR error bars"
    colour = {line.get_label(): line.get_color() for line in ax.get_lines() if not line.get_label().startswith("_")}
    other = {line.get_label(): line.get_color() for line in drawn["out_rel_err"].axes[0].get_lines()
             if not line.get_label().startswith("_")}
    window = [k for k in colour if k.startswith("sliding_window")][0]
    assert mcolors.same_color(colour[window], other["sliding_window/blocksparse"])
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Noisy points" in html and "Every point" in html


def test_a_pass_not_measured_is_not_full_failing_and_seeds_are_separate_series():
    full = [row("full", "sdpa", n, fwd=1.0, mem=1, fwd_ms=None) for n in (256, 512)]  # fwd not measured
    assert report.reference([full], "fwd_ms") == {}
    assert report.reference([[row("full", "sdpa", 256, "oom")]], "fwd_ms") == {256: None}
    from harness.report.collect import group_series, series_labels

    seeds = [row("full", "sdpa", 256, fwd=1.0, mem=1, seed=s) for s in (0, 1)]
    groups = group_series(seeds)
    assert len(groups) == 2
    assert sorted(series_labels(groups).values()) == ["full/sdpa seed=0", "full/sdpa seed=1"]


def test_others_load_makes_only_timings_noisy():
    """A point that timed nothing (quality or memory only) is not noisy for others' load: the profiler's
    memory replay and the task do not depend on it."""
    busy = {"other_cpu_cores": 1.5}
    assert noise(busy, MeasureOptions(passes=())) == []
    timed = {**busy, "fwd_bwd_ms": 10.0, "fwd_bwd_iqr_ms": 0.1, "fwd_bwd_samples": 9}
    assert noise(timed, MeasureOptions(passes=("fwd_bwd",))) == [
        (None, "other processes kept 1.50 cores busy > measure.max_other_cores=0.25")]


def test_a_timing_is_the_median_of_its_samples_and_its_spread_the_interquartile_range():
    """A pass's time is the median of its samples and its spread the 75th minus the 25th percentile (numpy's
    linear quantiles), never another pair; one sample has no spread to report. Kills a median read from
    another quantile, IQR bounds swapped for wider ones, and a zero IQR reported for a single sample."""
    from harness.measure import Timing, _stats

    t = _stats([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0])
    assert (t.median_ms, t.iqr_ms, t.samples) == (5.0, 4.0, 9)
    assert _stats([2.5]) == Timing(2.5, None, 1)


def test_the_spread_is_judged_relative_to_the_median_and_min_samples_samples_are_enough():
    """max_rel_iqr bounds IQR / median: a 10 ms spread of a 100 ms call is quiet, a 0.1 ms spread of a
    0.5 ms call is not. A pass with exactly min_samples samples has enough."""
    opts = MeasureOptions(passes=("fwd_bwd",))
    rec = dict(fwd_bwd_ms=100.0, fwd_bwd_iqr_ms=10.0, fwd_bwd_samples=opts.min_samples, other_cpu_cores=0.0)
    assert noise(rec, opts) == []
    assert noise({**rec, "fwd_bwd_ms": 0.5, "fwd_bwd_iqr_ms": 0.1}, opts) == [
        ("fwd_bwd", f"fwd_bwd: IQR 20% of the median > measure.max_rel_iqr={opts.max_rel_iqr:g}")]
    assert [p for p, _ in noise({**rec, "fwd_bwd_samples": opts.min_samples - 1}, opts)] == ["fwd_bwd"]


def test_a_point_noisy_for_too_few_samples_and_for_another_reason_is_retried():
    """retry_helps: only a point whose every reason is a pass with too few samples is not measured again
    (its call is slow and stays slow); one with a spread or others' load besides is (the other reason may
    go away), as is one with a spread alone."""
    from harness.measure import retry_helps

    few = f"fwd_bwd: {FEW}"
    assert retry_helps([few]) is False and retry_helps([few, few]) is False
    assert retry_helps([few, f"fwd: {SPREAD}"]) is True and retry_helps([LOAD, few]) is True
    assert retry_helps([f"fwd: {SPREAD}"]) is True


def test_a_spread_of_exactly_max_rel_iqr_of_the_median_is_not_noise():
    """max_rel_iqr is the largest relative spread a quiet pass may have, as the reason's words say ("IQR ...
    > measure.max_rel_iqr"): an IQR of exactly max_rel_iqr times the median (2 ms of 8 ms at 0.25, exact
    in binary) is quiet, as exactly min_samples samples are enough; a hair more is noisy."""
    opts = MeasureOptions(passes=("fwd_bwd",), max_rel_iqr=0.25)
    rec = {"fwd_bwd_ms": 8.0, "fwd_bwd_iqr_ms": 2.0, "fwd_bwd_samples": 9, "other_cpu_cores": 0.0}
    assert noise(rec, opts) == []
    assert [p for p, _ in noise({**rec, "fwd_bwd_iqr_ms": 2.001}, opts)] == ["fwd_bwd"]


class FakeClock:
    """A host clock that moves only when a stood-in call says it took so long: timings exact to the bit."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_cpu_top_up_samples_are_per_call_times_and_stay_within_max_run_time(monkeypatch):
    """When blocked_autorange returns fewer than min_samples blocks, blocks of the same size are timed here
    until min_samples: each a per-call time (the block over its calls, as the autorange's), never a
    whole block's; and one is begun only if a block's time still fits in max_run_time. The autorange and
    the clock are stood in for: 1 ms a call, blocks of 10 calls, two blocks from the autorange."""
    import types

    from harness import measure

    clock, calls = FakeClock(), []

    def fn() -> None:
        calls.append(1)
        clock.now += 1e-3

    class Timer:
        def __init__(self, stmt, globals, num_threads):
            self.fn = globals["fn"]

        def blocked_autorange(self, min_run_time):
            raw = []
            for _ in range(2):
                start = clock.now
                for _ in range(10):
                    self.fn()
                raw.append(clock.now - start)
            return types.SimpleNamespace(times=[t / 10 for t in raw], raw_times=raw, number_per_run=10)

    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(measure.benchmark, "Timer", Timer)
    t = time_fn(fn, torch.device("cpu"), MeasureOptions(min_samples=5))
    assert (t.median_ms, t.iqr_ms, t.samples) == (pytest.approx(1.0), pytest.approx(0.0), 5) and len(calls) == 50
    # 45 ms allows the autorange's 20 calls and two blocks more (40 ms), not a third (50 ms)
    calls.clear()
    t = time_fn(fn, torch.device("cpu"), MeasureOptions(min_samples=5, max_run_time=0.045))
    assert t.samples == 4 and len(calls) == 40, (t, len(calls))


def test_a_cuda_device_is_timed_with_cuda_events_and_a_cpu_one_with_the_cpu_timer(monkeypatch):
    """time_fn's choice of timer by the device: CUDA events (cuda_time_fn: do_bench's method, L2 flushed,
    ``before`` outside the events) for a CUDA device, never the CPU's wall-clock Timer, which would put
    ``before`` and the launch overhead into every sample; the CPU timer for the CPU. Checked without a
    GPU: cuda_time_fn is stood in for."""
    from harness import measure
    from harness.measure import Timing

    chosen = []

    def events(fn, device, opts, before=None):
        chosen.append(device)
        return Timing(1.0, 0.0, 5)

    monkeypatch.setattr(measure, "cuda_time_fn", events)
    assert time_fn(lambda: None, torch.device("cuda"), MeasureOptions(min_run_time=0.01)) == Timing(1.0, 0.0, 5)
    assert chosen == [torch.device("cuda")]
    time_fn(lambda: None, torch.device("cpu"), MeasureOptions(min_run_time=0.01, min_samples=2))
    assert chosen == [torch.device("cuda")]


def test_the_cuda_timers_untimed_calls_are_not_among_its_samples(host_clock_events, monkeypatch):
    """cuda_time_fn's first call and its estimate (where compilation and autotuning happen: 50 ms here,
    against 1 ms a call after) are warm-up: the samples are the timed calls alone, gpu_repeats of them.
    The CUDA events read a clock that moves by each call's stated time."""
    import types

    from harness import measure
    from harness.measure import Timing

    clock, calls = FakeClock(), []

    def fn() -> None:
        calls.append(1)
        clock.now += 0.05 if len(calls) <= 2 else 1e-3

    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    opts = MeasureOptions(min_run_time=0.01, min_samples=5)
    t = measure.cuda_time_fn(fn, torch.device("cpu"), opts)
    # the estimate of 50 ms a call: no warm-up calls past it (25 ms), gpu_repeats(50 ms) = min_samples timed
    assert gpu_repeats(50.0, opts, 100.0) == 5 and len(calls) == 2 + 5
    assert t == Timing(pytest.approx(1.0), pytest.approx(0.0), 5), t
