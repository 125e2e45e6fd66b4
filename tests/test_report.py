"""The reporting tools: harness.report (sweep -> CSV, PNGs, report.html), harness.report.compare (A vs B),
harness.report.collect (loading). Synthetic result rows with known shapes stand in for a real sweep."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.report import collect, sweep as report
from harness.report.collect import load_rows, point_key, series_key, series_labels

ROOT = Path(__file__).resolve().parents[1]
NS = [256, 512, 1024, 2048, 4096, 8192]


def row(variant, backend, n, status="ok", fwd=None, mem=None, device="cpu", **extra):
    """One results row as the harness writes it; times from ``fwd`` (bwd = 2 fwd), null when not ok."""
    ok = status == "ok" and fwd is not None
    r = dict(variant=variant, backend=backend, seq_len=n, batch_size=1, num_heads=2, head_dim=32,
             dtype="float32", device=device, causal=False, status=status,
             reason=None if status == "ok" else f"{status} at N={n}",
             fwd_ms=fwd if ok else None, bwd_ms=2 * fwd if ok else None, fwd_bwd_ms=3 * fwd if ok else None,
             fwd_iqr_ms=0.01 if ok else None, bwd_iqr_ms=None, fwd_bwd_iqr_ms=None,
             peak_mem_bytes=mem if ok else None, peak_mem_abs_bytes=None, flops_fwd=4 * n * n * 32,
             flops_fwd_useful=4 * n * n * 32, tflops_fwd=0.5, density=1.0, analytic_mem_bytes=mem,
             # what harness.results adds besides: measurement details and the environment
             seed=0, fwd_samples=10, tflops_bwd=0.2, block_density=None, timer="blocked_autorange",
             device_name="Synthetic CPU", torch_version="2.13.0+cpu", cuda_version=None, hostname="testhost",
             date=f"2026-01-01T00:{n % 60:02d}:00+00:00")
    r.update(extra)
    return r


def sweep_rows() -> list[list[dict]]:
    """Jobs of a sweep. full/math ∝ N² exactly and OOMs from 8192; sliding windows ∝ N."""
    full_math = [row("full", "math", n, fwd=1e-6 * n * n, mem=4 * n * n) if n <= 4096 else
                 row("full", "math", n, "oom") for n in NS]
    full_sdpa = [row("full", "sdpa", n, fwd=0.5e-6 * n * n, mem=64 * n) for n in NS]
    windows = [[row("sliding_window", "blocksparse", n, fwd=w * 1e-5 * n, mem=w * n, opt_window=w, opt_dilation=1,
                    out_rel_err=0.01 * n / w, mass_kept=0.9) for n in NS] for w in (64, 128)]
    lin = [row("linear", "math", n, fwd=0.2 + 1e-4 * n, mem=100 * n, opt_proj_dim=64, task_accuracy=0.5)
           if n <= 4096 else row("linear", "math", n, "skipped", opt_proj_dim=64) for n in NS]
    # A later job measured one point again: two runs of it, drawn from the median run (the lower of two:
    # the first job's, on the line).
    rerun = [row("full", "math", 256, fwd=0.07, mem=4 * 256 * 256)]
    return [full_math, full_sdpa, *windows, lin, rerun]


def write_sweep(root: Path, jobs: list[list[dict]]) -> Path:
    for i, rows in enumerate(jobs):  # Hydra multirun layout: SWEEP/<job>/results.jsonl
        (root / str(i)).mkdir(parents=True)
        (root / str(i) / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "WANDB_MODE": "disabled"})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    sweep = write_sweep(tmp_path_factory.mktemp("sweep"), sweep_rows())
    assert report.main([str(sweep)]) == 0
    return sweep, sweep / "report"


# ----- report ----------------------------------------------------------------------------------------

def test_report_writes_every_file(made):
    _, out = made
    pngs = ["fwd_ms", "bwd_ms", "fwd_bwd_ms", "peak_mem_bytes", "speedup_fwd_ms", "speedup_fwd_bwd_ms",
            "mem_ratio", "out_rel_err", "mass_kept", "task_accuracy"]
    for name in pngs:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (out / "grad_rel_err.png").exists()  # no row has it: no empty plot
    html = (out / "report.html").read_text()
    assert html.count("src='data:image/png;base64,") == len(pngs)  # self-contained: every image inline
    assert "src='http" not in html and "src='/" not in html


def test_report_html_names_every_variant_and_series(made):
    sweep, out = made
    html = (out / "report.html").read_text()
    rows = load_rows(sweep)
    for variant in {r["variant"] for r in rows}:
        assert variant in html
    for label in series_labels(series_key(r) for r in rows).values():
        assert label in html
    env = html[html.index("<h2>Environment"):html.index("<h2>Series")]
    assert "Synthetic CPU" in env and "testhost" in env and "torch_version" in env
    assert "tflops_bwd" not in env and "seed" not in env  # measurement fields are not the environment
    assert "sliding_window[window=64]/blocksparse" in html and "full/math" in html


def test_report_csv_equals_input_rows(made):
    _, out = made
    expected = {}
    for job in sweep_rows():  # one row per point; full/math at 256 has two runs: the faster is the median
        for r in job:
            expected.setdefault(point_key(r), r)
    got = load_rows(out / "results.csv")
    assert len(got) == len(expected)
    for r in got:
        want = expected[point_key(r)]
        for k in set(want) | set(r):
            assert r.get(k) == want.get(k), (point_key(r), k)
    assert expected[point_key(row("full", "math", 256))]["fwd_ms"] == 1e-6 * 256 * 256


def test_fitted_exponent_recovers_known_slope(made):
    ns = [256.0, 512.0, 1024.0, 4096.0]
    assert report.fit_exponent(ns, [3e-6 * n ** 2 for n in ns]) == pytest.approx(2.0, abs=1e-12)
    assert report.fit_exponent(ns, [5.0 * n ** 1.5 for n in ns]) == pytest.approx(1.5, abs=1e-12)
    assert report.fit_exponent([1024.0], [1.0]) is None
    # On the sweep: OOM rows of full/math are left out of the fit.
    groups = collect.group_series(load_rows(made[0]))
    by_label = {lab: groups[s] for s, lab in series_labels(groups).items()}
    assert report.series_exponent(by_label["full/math"], "fwd_ms") == pytest.approx(2.0, abs=1e-9)
    assert report.series_exponent(by_label["sliding_window[window=64]/blocksparse"], "peak_mem_bytes") \
        == pytest.approx(1.0, abs=1e-9)


def test_exponents_fitted_from_a_length_on(tmp_path, capsys):
    """--fit-from N: the exponents over N and longer only, as a GPU's launch-bound short lengths would
    flatten a fit over every length; said in the series table's title and the plots' titles. A length past
    every series' last but one fits nothing: said in one line (every exponent was left empty, unsaid)."""
    ns = [256, 512, 1024, 2048, 4096, 8192]
    # 1 ms of launches, then ∝ N² from 2048 on (the fit over every length would be far below 2)
    sweep = write_sweep(tmp_path / "sweep", [[row("full", "sdpa", n, fwd=max(1.0, (n / 2048) ** 2), mem=64 * n)
                                              for n in ns]])
    rows = load_rows(sweep)
    assert report.series_exponent(rows, "fwd_ms", 2048) == pytest.approx(2.0, abs=1e-9)
    assert report.series_exponent(rows, "fwd_ms") < 1.5
    assert report.main([str(sweep), "--fit-from", "2048"]) == 0
    html = (sweep / "report" / "report.html").read_text()
    assert "over ok points at N ≥ 2048" in html
    series = html[html.index("<h2>Series"):].split("</table>")[0]
    assert "<td>2.00</td><td>2.00</td><td>1.00</td>" in series, series
    assert "warning" not in capsys.readouterr().err
    assert report.main([str(sweep), "--fit-from", "8192", "--out", str(tmp_path / "r2")]) == 0
    assert capsys.readouterr().err == ("warning: --fit-from 8192: no series has two lengths at N >= 8192 (the longest "
                                       "measured: 8192), so no exponent was fitted\n")


def test_a_series_measured_by_two_code_versions_is_said(tmp_path):
    """A resumed run keeps its earlier points: a series whose points come from two commits is one notice,
    naming them; one code version is no notice."""
    write_sweep(tmp_path, [[row("full", "sdpa", 64, fwd=1.0, code_version="aaaaaaaaaaaa"),
                            row("full", "sdpa", 128, fwd=2.0, code_version="bbbbbbbbbbbb+dirty"),
                            row("full", "math", 64, fwd=1.0, code_version="aaaaaaaaaaaa"),
                            row("full", "math", 128, fwd=2.0, code_version="aaaaaaaaaaaa")]])
    said = []
    assert len(load_rows(tmp_path, warn=said.append)) == 4
    assert said == [f"{tmp_path}: 1 series mix code versions (aaaaaaaaaaaa, bbbbbbbbbbbb+dirty): a resumed run "
                    f"keeps the points measured before; resume=false (or a new directory) measures a series "
                    f"with one"], said


def test_a_point_in_several_files_is_its_median_run_and_said_apart_from_one_measured_again(tmp_path):
    """Job directories with the same point (a sweep run again, bench_cpu's rounds, jobs differing only in
    measure.timer) are runs of it, not re-measurements: drawn from the median run by forward+backward time
    among those whose forward+backward is not noisy, a whole row; the notice names the files. Runs of two
    machines do not stand for each other: the last row, and a notice saying so."""
    noisy = dict(noisy=True, noise_reasons="fwd_bwd: IQR 50% of the median > measure.max_rel_iqr=0.15")
    runs = [[row("full", "sdpa", 64, fwd=9.0), row("full", "sdpa", 64, fwd=1.0)],  # measured again: 1.0 is its run
            [row("full", "sdpa", 64, fwd=2.0, fwd_iqr_ms=0.02)], [row("full", "sdpa", 64, fwd=3.0)],
            [row("full", "sdpa", 64, fwd=1.5, **noisy)]]  # the median of four, but its forward+backward is noisy
    said = []
    (point,) = load_rows(write_sweep(tmp_path / "one", runs), warn=said.append)
    assert (point["fwd_ms"], point["fwd_iqr_ms"]) == (2.0, 0.02)  # the median of 1, 2, 3: one run's row
    assert len(said) == 2, said
    assert "1 point(s) are in more than one results file" in said[0] and "median run" in said[0]
    assert f"{tmp_path / 'one' / '0'} and {tmp_path / 'one' / '1'}" in said[0]
    assert "1 row(s) are earlier measurements of a point measured again" in said[1]
    # every run noisy: the median of them all
    (point,) = load_rows(write_sweep(tmp_path / "all", [[{**r, **noisy} for r in job] for job in runs]), warn=[].append)
    assert point["fwd_ms"] == 1.5
    # two machines
    write_sweep(tmp_path / "two", [[row("full", "sdpa", 64, fwd=1.0), row("full", "sdpa", 64, fwd=2.0)],
                                   [row("full", "sdpa", 64, fwd=3.0, device_name="Other CPU")]])
    said = []
    (point,) = load_rows(tmp_path / "two", warn=said.append)
    assert point["fwd_ms"] == 3.0  # the file read last
    assert len(said) == 2, said
    assert "1 point(s) were timed on more than one machine (Other CPU, Synthetic CPU)" in said[0]
    assert "1 row(s) are earlier measurements of a point measured again" in said[1]
    # a row measured again on the other machine is no run: every run is one machine's, the median stands
    write_sweep(tmp_path / "again", [[row("full", "sdpa", 64, fwd=1.0, device_name="Other CPU"),
                                      row("full", "sdpa", 64, fwd=9.0)],
                                     [row("full", "sdpa", 64, fwd=3.0)], [row("full", "sdpa", 64, fwd=2.0)]])
    said = []
    (point,) = load_rows(tmp_path / "again", warn=said.append)
    assert point["fwd_ms"] == 3.0 and not [s for s in said if "more than one machine" in s], said


def write_csv_sweep(root: Path, rows: list[dict]) -> Path:
    """A directory with only a results.csv, as the harness writes it (results.write_csv)."""
    from harness.results import write_csv

    root.mkdir(parents=True, exist_ok=True)
    write_csv(root / "results.csv", rows)
    return root


def test_csv_text_fields_stay_text_and_a_row_left_out_is_said(tmp_path):
    """CSV cells are read by their field's type: a hostname, reason or code_version that looks like a number
    stays text (it was made a number, failed the schema and its row vanished without a word). A row that is
    not valid is left out with one line naming the file, how many and why."""
    rows = [row("full", "sdpa", 64, fwd=1.0, hostname="1234", code_version="123456789012"),
            row("full", "sdpa", 128, "error", reason="nan", hostname="1234", code_version="123456789012"),
            row("full", "sdpa", 256, fwd=2.0, seq_len="abc"),
            row("full", "sdpa", 512, fwd=2.0, batch_size="1.5")]
    write_csv_sweep(tmp_path, rows)
    said = []
    got = load_rows(tmp_path, warn=said.append)
    assert [r["seq_len"] for r in got] == [64, 128]
    assert [(r["hostname"], r["code_version"]) for r in got] == [("1234", "123456789012")] * 2
    assert got[1]["reason"] == "nan" and got[0]["fwd_ms"] == 1.0 and got[0]["causal"] is False
    assert {k: v for k, v in got[0].items() if v is not None} == {k: v for k, v in rows[0].items() if v is not None}
    assert len(said) == 1, said
    assert str(tmp_path / "results.csv") in said[0] and "2 line(s) left out" in said[0]
    assert "4 (seq_len='abc' is not int)" in said[0] and "5 (batch_size=1.5 is not int)" in said[0], said


def test_an_integral_float_in_an_int_field_of_a_jsonl_is_an_int_as_in_a_csv(tmp_path):
    """pandas writes an int column that holds a null as floats ("seq_len": 4096.0): such a row was a damaged
    line in a results.jsonl, while the same cell in a results.csv read as 4096. A fraction stays damage."""
    write_sweep(tmp_path, [[row("full", "sdpa", 64, fwd=1.0), row("full", "sdpa", 128, fwd=4.0),
                            row("full", "sdpa", 256, fwd=9.0)]])
    path = tmp_path / "0" / "results.jsonl"
    first, second, third = (json.loads(line) for line in path.read_text().splitlines())
    second.update(seq_len=128.0, batch_size=1.0)
    third.update(batch_size=1.5)
    # and at the end of a line cut mid-write, where a reader recovers whole rows
    path.write_text("\n".join([json.dumps(first), json.dumps(second), json.dumps(third),
                               '{"variant": "fu' + json.dumps({**second, "seq_len": 512.0}), ""]))
    said = []
    got = load_rows(tmp_path, warn=said.append)
    assert [(r["seq_len"], r["batch_size"]) for r in got] == [(64, 1), (128, 1), (512, 1)]
    assert all(type(r["seq_len"]) is int and type(r["batch_size"]) is int for r in got)
    assert type(got[1]["fwd_ms"]) is float  # a float field keeps its floats
    assert len(said) == 1 and "3 (batch_size=1.5 is not int)" in said[0] and "a whole row inside line(s) 4 kept" in said[0], said


def test_a_csv_row_with_cells_missing_or_past_the_header_is_a_damaged_line(tmp_path):
    """A row cut after its status cell read as a valid row (the reader fills the cells it lacks with null)
    and showed as a series of its own; a row joined to the next lost the cells past the header."""
    write_csv_sweep(tmp_path, [row("full", "sdpa", n, fwd=1.0) for n in (64, 128, 256)])
    header, r64, r128, r256, _ = (tmp_path / "results.csv").read_bytes().decode().split("\r\n")
    cut = r128[:r128.index(",ok,") + 3]  # every field a row needs is before the cut
    (tmp_path / "results.csv").write_text("\r\n".join([header, r64, cut, r256 + "," + r64, ""]))
    said = []
    assert [r["seq_len"] for r in load_rows(tmp_path, warn=said.append)] == [64]
    cells = len(header.split(","))
    assert said == [f"{tmp_path / 'results.csv'}: damaged line(s) 3 ({cut.count(',') + 1} cells, the header has "
                    f"{cells}), 4 ({2 * cells} cells, the header has {cells}): 2 line(s) left out"]


def test_a_line_that_is_not_utf8_is_left_out_and_the_rest_reported(tmp_path):
    """One line of bytes that are not UTF-8 (a disk error, a bad copy) costs that line, said, not the sweep."""
    write_sweep(tmp_path, [[row("full", "sdpa", 64, fwd=1.0), row("full", "sdpa", 128, fwd=4.0)]])
    good = (tmp_path / "0" / "results.jsonl").read_bytes()
    (tmp_path / "0" / "results.jsonl").write_bytes(good + b'{"variant": "full\xff\xfe", "seq_len": 40}\n')
    said = []
    assert [r["seq_len"] for r in load_rows(tmp_path, warn=said.append)] == [64, 128]
    assert said == [f"{tmp_path / '0' / 'results.jsonl'}: damaged line(s) 3 (not UTF-8): 1 line(s) left out"]
    res = cli("harness.report", tmp_path)
    assert res.returncode == 0 and "2 points" in res.stdout, res.stderr
    assert "not UTF-8" in res.stderr and "Traceback" not in res.stderr


def test_the_report_never_reads_its_own_output(tmp_path, capsys):
    """In a directory with only a results.csv, the report's own report/results.csv is not a second input:
    a second report reads the same points, with no word of a point in two results files."""
    write_csv_sweep(tmp_path, [row("full", "sdpa", n, fwd=1e-6 * n * n, mem=n) for n in (64, 128)])
    other = tmp_path / "elsewhere"  # --out anywhere else inside the directory: a report.html says what it is
    for _ in range(2):
        assert report.main([str(tmp_path)]) == 0
        assert report.main([str(tmp_path), "--out", str(other)]) == 0
    err = capsys.readouterr().err
    assert "more than one results file" not in err and "earlier measurements" not in err, err
    assert len(load_rows(tmp_path)) == 2
    assert len(load_rows(tmp_path / "report")) == 2  # a report's folder given itself is read


def test_a_run_in_a_folder_named_report_is_read(tmp_path):
    """Only a report's results.csv is its output: a run's results.jsonl in a folder named report was left
    out without a word."""
    for name, variant in (("report", "full"), ("other", "linear")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text(json.dumps(row(variant, "math", 64, fwd=1.0, mem=1)) + "\n")
    assert sorted(r["variant"] for r in load_rows(tmp_path)) == ["full", "linear"]


def test_a_results_csv_left_unread_beside_results_jsonl_files_is_said(tmp_path):
    """A directory tree with results.jsonl files is read through them: a results.csv without a jsonl beside
    it (a combined table, an old run's only file) is not read, and that was not said."""
    write_sweep(tmp_path, [[row("full", "sdpa", 64, fwd=1.0)]])
    write_csv_sweep(tmp_path / "old", [row("linear", "math", 64, fwd=1.0)])
    said = []
    assert [r["variant"] for r in load_rows(tmp_path, warn=said.append)] == ["full"]
    assert len(said) == 1 and "1 results.csv without a results.jsonl beside it not read" in said[0], said
    assert str(tmp_path / "old" / "results.csv") in said[0]


def test_every_series_has_a_colour_of_its_own_past_twenty():
    """tab20's colours repeated from the 21st series (results/quality has 55): two series drawn alike."""
    labels = {i: f"s{i:02d}" for i in range(55)}
    assert len(set(report.series_colours(labels).values())) == 55


def test_a_peak_of_zero_has_no_ratio_and_the_report_is_whole(tmp_path):
    """A peak within the inputs is 0 bytes (the schema allows it): the memory ratio against it raised
    ZeroDivisionError and left the report half-written (plots, no report.html)."""
    write_sweep(tmp_path, [[row("full", "sdpa", 32, fwd=1.0, mem=0), row("full", "sdpa", 64, fwd=2.0, mem=100)],
                           [row("blockwise", "blocksparse", n, fwd=1.0, mem=50) for n in (32, 64)]])
    assert report.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "report.html").is_file()


def test_a_peak_of_zero_is_marked_on_the_log_plot_and_listed(tmp_path, capsys, monkeypatch):
    """A measured peak of 0 has no place on the log-log memory plot: it vanished there, unsaid (the line
    dove off the axis at its N). It is marked at the plot's bottom, named in a table of report.html and in
    the printed output, and the every-point table keeps its 0."""
    write_sweep(tmp_path, [[row("full", "sdpa", n, fwd=1.0, mem=0 if n == 64 else 100 * n) for n in (32, 64, 128)],
                           [row("blockwise", "blocksparse", n, fwd=1.0, mem=50 * n, out_rel_err=0.0 if n == 64 else 1e-3)
                            for n in (32, 64, 128)]])
    drawn, save = {}, report._save

    def spy(fig, path):  # the memory plot's marks and title, read before it is closed
        ax = fig.axes[0]
        drawn[path.stem] = ([(t.get_text(), t.xy[0]) for t in ax.texts], ax.get_title())
        return save(fig, path)

    monkeypatch.setattr(report, "_save", spy)
    assert report.main([str(tmp_path)]) == 0
    texts, title = drawn["peak_mem_bytes"]
    assert ("0", 64) in texts and "a value of 0" in title
    assert "a value of 0" not in drawn["fwd_ms"][1]  # said only where there is one
    html = (tmp_path / "report" / "report.html").read_text()
    assert "<tr><td>full/sdpa</td><td>64</td><td>peak_mem_bytes</td></tr>" in html
    # an error of exactly 0 on the log error plot, alike
    texts, title = drawn["out_rel_err"]
    assert ("0", 64) in texts and "a value of 0" in title
    assert "<tr><td>blockwise/blocksparse</td><td>64</td><td>out_rel_err</td></tr>" in html
    # the every-point table keeps the 0 (peak MiB: the 6th cell after the status)
    assert re.search(r"<tr><td>full/sdpa</td><td>64</td><td>ok</td>(<td>[^<]*</td>){6}<td>0</td>", html)
    assert re.search(r"full/sdpa\s+64\s+peak_mem_bytes", capsys.readouterr().out)


def test_a_crossover_cell_says_whether_nothing_ran_at_a_common_n_or_it_was_noisy():
    """A series compared at no N: none the two both ran, or every such point's timing noisy (flagged on a
    busy machine): the cell says which, not "timed by neither" for points that were timed."""
    full = [row("full", "sdpa", n, fwd=1.0) for n in (256, 512)]
    noisy = [{**row("sparse", "blocksparse", n, fwd=2.0), "noisy": True} for n in (256, 512)]
    elsewhere = [row("linear", "math", 1024, fwd=0.5)]
    faster = [row("blockwise", "online", n, fwd=0.5) for n in (256, 512)]
    groups = report.group_series([*full, *noisy, *elsewhere, *faster])
    _, body = report.crossover_table(groups, report.series_labels(groups))
    assert {r[0]: r[1:] for r in body} == {"sparse/blocksparse": ["noisy at every N both ran"] * 2,
                                           "linear/math": ["no N timed by both"] * 2,
                                           "blockwise/online": ["256 (faster at every N)"] * 2}
    # measure.passes=[fwd_bwd]: the forward was never timed, which is not noise
    untimed = [{**row(v, b, n, fwd=f), "fwd_ms": None, "fwd_iqr_ms": None, "tflops_fwd": None}
               for v, b, f in (("full", "sdpa", 1.0), ("sparse", "blocksparse", 0.5)) for n in (256, 512)]
    groups = report.group_series(untimed)
    _, body = report.crossover_table(groups, report.series_labels(groups))
    assert [r[1:] for r in body] == [["no N timed by both", "256 (faster at every N)"]], body


def test_full_is_its_fastest_backend_and_an_n_where_one_is_noisy_is_left_out():
    """Where full's fastest backend is noisy at N, full's time there is unknown: not the next backend's, which
    would credit a variant slower than the fastest one's median with beating full."""
    noisy = dict(noisy=True, noisy_passes=["fwd", "bwd", "fwd_bwd"], noise_reasons="IQR over the bound")
    sdpa = [row("full", "sdpa", 256, fwd=1.0), row("full", "sdpa", 512, fwd=4.4, **noisy)]
    math = [row("full", "math", n, fwd=f) for n, f in ((256, 5.0), (512, 20.0))]
    window = [row("sliding_window", "dense", n, fwd=f) for n, f in ((256, 3.0), (512, 4.5))]
    assert report.reference([sdpa, math], "fwd_ms") == {256: 1.0}
    groups = report.group_series([*sdpa, *math, *window])
    _, body = report.crossover_table(groups, report.series_labels(groups))
    assert [r[1:] for r in body] == [["none in range"] * 2], body


def test_crossover_and_max_fitting_on_constructed_case():
    def rows_of(times, status=None):
        status = status or {}
        return [row("x", "b", n, status.get(n, "ok"), fwd=t) for n, t in times.items()]

    # Two full backends: the reference is the faster at each N; both fail at 4096.
    math_ = rows_of({256: 1.0, 512: 4.0, 1024: 16.0, 2048: 64.0, 4096: None}, {4096: "oom"})
    sdpa = rows_of({256: 0.5, 512: 5.0, 1024: 12.0, 2048: 50.0, 4096: None}, {4096: "oom"})
    ref = report.reference([math_, sdpa], "fwd_ms")
    assert ref == {256: 0.5, 512: 4.0, 1024: 12.0, 2048: 50.0, 4096: None}
    # Faster at 512, slower at 1024, faster from 2048 on (full OOMs at 4096: still faster).
    v = rows_of({256: 1.0, 512: 3.0, 1024: 13.0, 2048: 20.0, 4096: 40.0})
    assert report.crossover(v, ref, "fwd_ms") == (2048, False)
    assert report.crossover(rows_of({256: 0.1, 512: 1.0, 1024: 2.0}), ref, "fwd_ms") == (256, True)
    # Slower at the largest common N, or out of memory there: no crossover in range.
    assert report.crossover(rows_of({256: 0.1, 2048: 60.0}), ref, "fwd_ms") == (None, False)
    assert report.crossover(rows_of({1024: 1.0, 2048: None}, {2048: "oom"}), ref, "fwd_ms") == (None, False)
    # A skipped point says nothing about speed; nor does running out of memory where full failed too.
    assert report.crossover(rows_of({1024: 1.0, 2048: None}, {2048: "skipped"}), ref, "fwd_ms") == (1024, True)
    assert report.crossover(rows_of({1024: 1.0, 4096: None}, {4096: "oom"}), ref, "fwd_ms") == (1024, True)
    # No N timed by both is not "slower": nothing is compared.
    assert report.crossover(rows_of({8192: 1.0}), ref, "fwd_ms") is None
    assert report.crossover(rows_of({4096: None}, {4096: "oom"}), ref, "fwd_ms") is None
    # One full backend ran at 4096 (noisy: its time unknown), another ran out of memory: full did not fail
    # there, so a variant twice as slow everywhere does not become "faster" at 4096
    noisy_sdpa = [*sdpa[:4], {**row("x", "b", 4096, fwd=100.0), "noisy": True}]
    ref = report.reference([math_, noisy_sdpa], "fwd_ms")
    assert 4096 not in ref
    slow = rows_of({n: 2 * (ref.get(n) or 100.0) for n in (256, 512, 1024, 2048, 4096)})
    assert report.crossover(slow, ref, "fwd_ms") == (None, False)

    fit = rows_of({256: 1.0, 512: 1.0, 1024: 1.0, 2048: None, 4096: None}, {2048: "oom", 4096: "skipped"})
    assert report.max_fitting(fit) == (1024, 2048, "oom")
    assert report.max_fitting(rows_of({256: 1.0})) == (256, None, None)
    assert report.max_fitting(rows_of({256: None}, {256: "skipped"})) == (None, 256, "skipped")


def test_report_tables_on_the_sweep(made):
    html = (made[1] / "report.html").read_text()
    # full/math: ok up to 4096, first oom at 8192; linear: skipped from 8192.
    assert "<tr><td>full/math</td><td>4096</td><td>8192</td><td>oom</td>" in html
    assert "<tr><td>linear/math</td><td>4096</td><td>8192</td><td>skipped</td>" in html
    # window=64 fwd 6.4e-4·N ms vs sdpa 5e-7·N² ms: faster from N > 1280, i.e. 2048.
    assert "<tr><td>sliding_window[window=64]/blocksparse</td><td>2048</td>" in html


def test_series_labels_show_only_distinguishing_fields():
    rows = [row("full", "sdpa", 8), row("full", "sdpa", 8, causal=True),
            row("sparse", "blocksparse", 8, opt_pattern="fixed", opt_block_size=64, opt_local_blocks=4),
            row("sparse", "blocksparse", 8, opt_pattern="bigbird", opt_block_size=64, opt_random_blocks=2)]
    labels = series_labels(series_key(r) for r in rows)
    assert [labels[series_key(r)] for r in rows] == [
        "full/sdpa non-causal", "full/sdpa causal",
        "sparse[pattern=fixed]/blocksparse non-causal", "sparse[pattern=bigbird]/blocksparse non-causal"]
    # An option set by one pattern only is not a difference; one set to two values is, where it is set.
    rows = [row("sparse", "blocksparse", 8, opt_pattern="bigbird", opt_random_blocks=r) for r in (2, 3)]
    rows += [row("sparse", "blocksparse", 8, opt_pattern="fixed", opt_local_blocks=4)]
    labels = series_labels(series_key(r) for r in rows)
    assert [labels[series_key(r)] for r in rows] == ["sparse[pattern=bigbird,random_blocks=2]/blocksparse",
                                                     "sparse[pattern=bigbird,random_blocks=3]/blocksparse",
                                                     "sparse[pattern=fixed]/blocksparse"]
    # Task settings: those that differ within a variant; rows from before they were recorded say so.
    task = dict(task="mqar", task_opt_steps=500, task_opt_lr=0.003)
    rows = [row("full", "sdpa", 8, **task), row("full", "sdpa", 8, **{**task, "task_opt_steps": 100}),
            row("full", "sdpa", 8, task="mqar"), row("linear", "math", 8, **task)]
    labels = series_labels(series_key(r) for r in rows)
    assert [labels[series_key(r)] for r in rows] == [
        "full/sdpa task.steps=500", "full/sdpa task.steps=100", "full/sdpa task settings unrecorded", "linear/math"]


def test_seeds_table_pools_seeds_of_otherwise_equal_series(tmp_path):
    """Series that differ only in seed or task.seed are one line of the seeds table per N; another task
    setting (steps) is another line; a single seed makes no table."""
    def acc(seed, task_seed, value, n=512, steps=500, variant="full"):
        return row(variant, "sdpa", n, fwd=1.0, seed=seed, task="mqar", task_opt_seed=task_seed,
                   task_opt_steps=steps, task_accuracy=value)

    rows = [acc(0, 0, 1.0), acc(0, 1, 0.5), acc(1, 2, 0.75), acc(0, 0, 0.25, steps=100),
            acc(0, 0, 0.2, variant="linear"), acc(0, 1, 0.3, variant="linear"), acc(0, 1, 0.4, n=256, variant="linear")]
    head, body = report.seeds_table(collect.group_series(rows))
    assert head == ["series", "N", "seeds", "mean", "range", "accuracies"]
    assert body == [["full/sdpa task.steps=100", 512, 1, "0.250", "0.250–0.250", "0.250"],
                    ["full/sdpa task.steps=500", 512, 3, "0.750", "0.500–1.000", "0.500, 0.750, 1.000"],
                    ["linear/sdpa", 256, 1, "0.400", "0.400–0.400", "0.400"],
                    ["linear/sdpa", 512, 2, "0.250", "0.200–0.300", "0.200, 0.300"]]
    assert report.seeds_table(collect.group_series(rows[3:4])) == (head, [])
    # The harness's seed alone (fidelity's inputs) does not make another training run: one seed, no table
    copies = [acc(seed, 1, 0.057) for seed in (0, 1, 2)]
    assert report.seeds_table(collect.group_series(copies)) == (head, [])
    write_sweep(tmp_path / "sweep", [rows])
    done = cli("harness.report", tmp_path / "sweep", "--out", tmp_path / "out")
    assert done.returncode == 0 and "MQAR task accuracy over seeds" in done.stdout
    assert "MQAR task accuracy over seeds" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.slow  # wandb starts its service process: a few seconds
def test_report_wandb_logs_plots_and_tables_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    jobs = sweep_rows()[:1]
    jobs[0][0].update(noisy=True, noisy_passes=["fwd", "bwd"])
    sweep = write_sweep(tmp_path / "mysweep", jobs)
    (sweep / "0" / ".hydra").mkdir()  # the job logged to a project of its own: the report's run goes there too
    (sweep / "0" / ".hydra" / "config.yaml").write_text('logger: {name: wandb, project: myproj}\n')
    assert report.main([str(sweep), "--wandb"]) == 0
    (run,) = (sweep / "report" / "wandb").glob("offline-run-*")
    media = {p.name.split("_0_")[0] for p in (run / "files" / "media").rglob("*") if p.is_file()}
    assert {"fwd_ms", "bwd_ms", "peak_mem_bytes", "results", "max_fit"} <= media
    # a list cell as results.csv has it (JSON text), not Python's repr "['fwd', 'bwd']"
    (table,) = (run / "files" / "media" / "table").glob("table/results_*.table.json")
    results = json.loads(table.read_text())
    assert results["data"][0][results["columns"].index("noisy_passes")] == '["fwd", "bwd"]'
    # The group. wandb's service process may still be writing the run's log when finish() returns (seen
    # on a loaded machine: only the 7-byte header there): give it time, never accept it missing.
    deadline = time.monotonic() + 60
    while b"mysweep" not in next(run.glob("*.wandb")).read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"mysweep" in next(run.glob("*.wandb")).read_bytes() and b"myproj" in next(run.glob("*.wandb")).read_bytes()
    # A second report into the same run logs after the first's step: a synced run keeps both
    state = sweep / "report" / "wandb" / "harness-run.json"
    assert json.loads(state.read_text())["next_step"] == 1
    assert report.main([str(sweep), "--wandb"]) == 0
    assert json.loads(state.read_text())["next_step"] == 2


# ----- compare ---------------------------------------------------------------------------------------

@pytest.fixture
def ab(tmp_path):
    base = [row("full", "sdpa", n, fwd=1e-6 * n * n, mem=64 * n) for n in NS[:4]]
    base += [row("sliding_window", "blocksparse", n, fwd=1e-3 * n, mem=32 * n, opt_window=64) for n in NS[:4]]
    a = write_sweep(tmp_path / "a", [base])

    def candidate(name, changes, device="cuda"):
        rows = [dict(r, device=device) for r in base]  # another device: still matched
        for i, factor in changes.items():
            rows[i]["fwd_bwd_ms"] *= factor
        return write_sweep(tmp_path / name, [rows + [row("linear", "math", 256, fwd=1.0, mem=1, device=device)]])

    return a, candidate("regressed", {1: 1.30, 5: 1.05}), candidate("within", {1: 1.05, 2: 0.8})


def test_compare_flags_injected_regression(ab):
    a, regressed, _ = ab
    res = cli("harness.report.compare", a, regressed, "--fail-on-regression")
    assert res.returncode == 1, res.stdout + res.stderr
    flagged = [line for line in res.stdout.splitlines() if "REGRESSION" in line]
    assert len(flagged) == 1 and "full/sdpa" in flagged[0] and " 512 " in flagged[0]
    assert "cpu" in res.stdout and "cuda" in res.stdout  # the devices are printed
    assert "only in B" in res.stdout and "linear/math N=256" in res.stdout
    assert cli("harness.report.compare", a, regressed).returncode == 0  # reported, but no failure asked for


def test_compare_passes_within_threshold_change(ab):
    a, regressed, within = ab
    res = cli("harness.report.compare", a, within, "--fail-on-regression")
    assert res.returncode == 0 and "REGRESSION" not in res.stdout, res.stdout
    assert "better" in res.stdout
    # A looser threshold lets the 30% slowdown through; single files work as inputs too.
    res = cli("harness.report.compare", a / "0" / "results.jsonl", regressed / "0" / "results.jsonl",
              "--threshold", "0.5", "--fail-on-regression")
    assert res.returncode == 0, res.stdout
    assert "threshold 0.5%" in cli("harness.report.compare", a, within, "--threshold", "0.005").stdout  # was 0%


def test_compare_status_change_is_a_regression(tmp_path):
    a = write_sweep(tmp_path / "a", [[row("full", "math", 4096, fwd=16.0, mem=10)]])
    b = write_sweep(tmp_path / "b", [[row("full", "math", 4096, "oom")]])
    res = cli("harness.report.compare", a, b, "--fail-on-regression")
    assert res.returncode == 1 and "ok -> oom" in res.stdout


def test_a_point_ok_in_a_that_b_lacks_is_a_regression(tmp_path):
    """A candidate that lost a point (its run crashed before it, a length dropped from its sweep) passed
    --fail-on-regression: only in A was listed, and the count said 0 regressed. A point A has that was
    not ok there is no loss; points only in B are listed, not judged."""
    a = write_sweep(tmp_path / "a", [[row("full", "sdpa", n, fwd=1.0, mem=1) for n in (64, 128)]
                                     + [row("full", "math", 256, "oom")]])
    b = write_sweep(tmp_path / "b", [[row("full", "sdpa", n, fwd=1.0, mem=1) for n in (64, 512)]])
    res = cli("harness.report.compare", a, b, "--fail-on-regression")
    assert res.returncode == 1, res.stdout
    assert "only in A:\n  full/math N=256\n  full/sdpa N=128" in res.stdout, res.stdout
    assert ("0 of 1 matched points regressed; 1 point(s) ok in A not in B (regressions too: see 'only in A')"
            in res.stdout), res.stdout
    assert cli("harness.report.compare", b, a, "--fail-on-regression").returncode == 1  # 512: ok in b, not in a
    c = write_sweep(tmp_path / "c", [[row("full", "sdpa", n, fwd=1.0, mem=1) for n in (64, 128)]])
    assert cli("harness.report.compare", a, c, "--fail-on-regression").returncode == 0  # lost only an oom


def test_a_point_ok_in_one_run_of_a_side_and_oom_in_another_is_judged_the_same_whatever_their_order(tmp_path, capsys):
    """A side's runs of a point are pooled as the report draws them (its median run: the ok one), not as
    their directories happen to sort (the last run's status made the verdict)."""
    from harness.report.compare import main as compare

    a = write_sweep(tmp_path / "a", [[row("full", "sdpa", 64, fwd=1.0, mem=1)]])
    verdicts = []
    for first, second in (("ok", "oom"), ("oom", "ok")):
        side = tmp_path / f"b-{first}-first"
        for name, status in (("run1", first), ("run2", second)):
            write_sweep(side / name, [[row("full", "sdpa", 64, status, fwd=1.0, mem=1)]])
        assert compare([str(a), str(side), "--metric", "fwd_bwd_ms", "--fail-on-regression"]) == 0
        verdicts.append(next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("full/sdpa")))
    assert verdicts[0] == verdicts[1] and "REGRESSION" not in verdicts[0], verdicts


def test_a_throughput_change_within_its_times_noise_is_within_noise(tmp_path):
    """tflops_fwd is flops / fwd_ms: a change the time's interquartile intervals do not clear is within
    noise for both (the throughput was flagged a regression while its own time was within noise)."""
    a = write_sweep(tmp_path / "a", [[row("full", "sdpa", 256, fwd=10.0, mem=1, fwd_iqr_ms=4.0, tflops_fwd=1.2)]])
    b = write_sweep(tmp_path / "b", [[row("full", "sdpa", 256, fwd=12.0, mem=1, fwd_iqr_ms=2.0, tflops_fwd=1.0)]])
    res = cli("harness.report.compare", a, b, "--metric", "fwd_ms,tflops_fwd", "--fail-on-regression")
    assert res.returncode == 0 and res.stdout.count("within noise") == 2, res.stdout


def test_compare_refuses_a_side_with_a_point_on_two_devices(tmp_path):
    """Points match across devices (a CPU run against a GPU run): A's cpu row of a point was dropped without
    a word for its cuda row, and B's cpu row judged against that."""
    a = write_sweep(tmp_path / "a", [[row("full", "sdpa", 256, fwd=10.0, mem=1)],
                                     [row("full", "sdpa", 256, fwd=0.5, mem=1, device="cuda")]])
    b = write_sweep(tmp_path / "b", [[row("full", "sdpa", 256, fwd=10.2, mem=1)]])
    res = cli("harness.report.compare", a, b)
    _one_line_error(res, "A holds points of several devices (cpu, cuda)", "allowed: one device per side")


def test_compare_pools_repeated_runs_and_judges_a_time_against_their_spread(tmp_path, capsys):
    """Runs of the same code differ by more than one run's interquartile range on a busy machine (two runs
    of one sweep on a 2-core VM: 2 to 4 of 21 points "regressed" by 13-35%, each clear of its IQR). A side
    may hold several runs of its points (the same sweep into several directories under it): their median
    is compared, and a change must clear the span of every run's interval, a noisy run's included."""
    from harness.report.compare import main as compare

    def runs(side: str, times: list[float], noisy: tuple[int, ...] = (), **extra) -> Path:
        for i, ms in enumerate(times):  # fwd_bwd_ms = 3 · fwd
            write_sweep(tmp_path / side / f"run{i}", [[row("full", "sdpa", 512, fwd=ms / 3, mem=1, fwd_bwd_iqr_ms=0.2,
                                                           noisy=i in noisy, noise_reasons="x" if i in noisy else None,
                                                           **extra)]])
        return tmp_path / side

    def flag(a: Path, b: Path) -> tuple[str, str]:
        assert compare([str(a), str(b), "--metric", "fwd_bwd_ms"]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.strip().startswith("full/sdpa"))
        return line.split()[-1], out

    # A change clear of every run's interval is a regression, from three runs a side
    verdict, out = flag(runs("a", [10.0, 10.3, 9.9]), runs("b", [13.0, 13.2, 12.8]))
    assert verdict == "REGRESSION" and "13 " in out and "[1 points, 3 runs of each;" in out
    assert compare([str(tmp_path / "a"), str(tmp_path / "b"), "--metric", "fwd_bwd_ms,fwd_bwd_ms"]) == 0
    assert capsys.readouterr().out == out  # a metric given twice is one column
    assert "judged on one run" not in out
    # Medians 11.5 / 10.2 apart, but the runs of each side spread over the other's: within noise; each pair
    # of single runs claims a change, and says it rests on one run a side
    verdict, _ = flag(runs("c", [10.0, 10.2, 12.6]), runs("d", [11.5, 12.0, 9.9]))
    assert verdict == "noise"
    verdict, out = flag(tmp_path / "c" / "run0", tmp_path / "d" / "run0")
    assert verdict == "REGRESSION" and "1 change(s) of time judged on one run of A or B" in out
    # A noisy run is left out of the value, not out of the spread
    verdict, out = flag(runs("e", [10.0, 10.1, 14.0], noisy=(2,)), runs("f", [12.0, 12.1, 12.05]))
    assert verdict == "noise" and " 10.05 " in out
    # Every run of a point noisy: not judged on time
    verdict, out = flag(runs("g", [10.0, 10.1], noisy=(0, 1)), runs("h", [13.0, 13.1]))
    assert verdict == "noisy" and "noisy in A" in out
    # Runs of one point from two machines are not pooled: one line, exit 2
    runs("i", [10.0])
    write_sweep(tmp_path / "i" / "other", [[row("full", "sdpa", 512, fwd=3.0, mem=1, device_name="Another CPU")]])
    assert compare([str(tmp_path / "i"), str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == ("compare: error: A holds points of several machines (Another CPU, "
                                       "Synthetic CPU); allowed: one machine per side (runs of one machine)\n")
    # Nor is a side whose points come from two machines (a run resumed on another machine measures
    # again only the points it runs; its other rows stay the first machine's): the rows of its file that
    # the other machine's superseded do not count
    rows_k = [row("full", "sdpa", n, fwd=3.0, mem=1) for n in (512, 1024)]
    write_sweep(tmp_path / "k", [[*rows_k, {**rows_k[0], "device_name": "Another CPU"}]])
    assert compare([str(tmp_path / "b"), str(tmp_path / "k")]) == 2
    assert capsys.readouterr().err == ("compare: error: B holds points of several machines (Another CPU, Synthetic "
                                       "CPU); allowed: one machine per side (runs of one machine)\n")
    write_sweep(tmp_path / "l", [[{**rows_k[0], "device_name": "Another CPU"}, *rows_k]])
    assert compare([str(tmp_path / "b"), str(tmp_path / "l")]) == 0
    capsys.readouterr()
    # Runs of two code versions are pooled, and said
    for i, code in enumerate(("aaaaaaaaaaaa", "bbbbbbbbbbbb")):
        write_sweep(tmp_path / "j" / f"run{i}", [[row("full", "sdpa", 512, fwd=3.0, mem=1, code_version=code)]])
    assert compare([str(tmp_path / "j"), str(tmp_path / "b")]) == 0
    assert "1 series mix code versions (aaaaaaaaaaaa, bbbbbbbbbbbb)" in capsys.readouterr().err


# ----- bad input ---------------------------------------------------------------------------------------

def _one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for needle in needles:
        assert needle in lines[0]


def test_a_wandb_mode_that_wandb_refuses_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """wandb reads WANDB_MODE itself and refused another value with a traceback: the harness's run after it
    had begun, the report's --wandb after its files were written."""
    from harness.logger import LoggerConfig

    sweep = write_sweep(tmp_path / "s", [[row("full", "sdpa", 128, fwd=1.0, mem=1)]])
    monkeypatch.setenv("WANDB_MODE", "bogus")
    line = "environment variable WANDB_MODE='bogus' is not a wandb mode; allowed: online, offline, disabled, " \
           "dryrun, run, shared, or unset"
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        LoggerConfig(name="wandb")
    LoggerConfig(name="none")  # no wandb, no refusal
    with pytest.raises(SystemExit) as err:
        report.main([str(sweep), "--wandb"])
    assert err.value.code == 2 and capsys.readouterr().err.startswith(f"report: error: {line}")
    assert not (sweep / "report").exists()


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    _one_line_error(cli("harness.report", tmp_path / "missing"), "missing")
    (tmp_path / "empty" / "0").mkdir(parents=True)
    _one_line_error(cli("harness.report", tmp_path / "empty"), "no results")
    bad = tmp_path / "bad" / "0"
    bad.mkdir(parents=True)
    (bad / "results.jsonl").write_text('{"variant": "full", "seq_len": 256}\n{not json\n')
    # No valid row: an error naming every damaged line and why (with a valid row: a warning, see below).
    _one_line_error(cli("harness.report", tmp_path / "bad"), "no result rows", "damaged line(s) 1 (no backend",
                    "2 (not JSON")
    good = write_sweep(tmp_path / "good", [[row("full", "sdpa", 256, fwd=1.0, mem=1)]])
    _one_line_error(cli("harness.report.compare", tmp_path / "missing", good), "missing")
    _one_line_error(cli("harness.report.compare", good, tmp_path / "empty"), "no results")
    _one_line_error(cli("harness.report.compare", good, good, "--metric", "nonsense_ms"), "nonsense_ms",
                    "allowed: a numeric field of the results, e.g. fwd_ms")
    _one_line_error(cli("harness.report", good, "--fit-from", "4K"), "--fit-from", "'4K'")
    _one_line_error(cli("harness.report", good, "--no-such-option"), "--no-such-option")  # argparse's, in one line
    assert not (good / "report").exists()
    # compare's metrics are numbers: a text or flag field is refused, not a column of dashes
    _one_line_error(cli("harness.report.compare", good, good, "--metric", "status"), "status is no measured number")
    # --out: a file, or a directory holding results (a job's: its results.csv would be replaced)
    (tmp_path / "afile").write_text("")
    _one_line_error(cli("harness.report", good, "--out", tmp_path / "afile"), "is a file")
    job_rows = (good / "0" / "results.jsonl").read_text()
    _one_line_error(cli("harness.report", good, "--out", good / "0"), "holds results")
    assert not (good / "0" / "results.csv").exists() and (good / "0" / "results.jsonl").read_text() == job_rows
    _one_line_error(cli("harness.report", good, "--out", ""), "--out must be a directory path; got ''")  # was "."
    # --out the directory itself: its results.csv would be read back as one more run of each point
    only_csv = write_csv_sweep(tmp_path / "csv", [row("full", "sdpa", 64, fwd=1.0, mem=1)])
    _one_line_error(cli("harness.report", only_csv, "--out", only_csv), "is SWEEP_DIR itself")
    assert sorted(p.name for p in only_csv.rglob("*") if p.is_file()) == ["results.csv"]
    assert not (good / "report").exists() and not (ROOT / "report.html").exists()


def test_a_report_interrupted_half_way_leaves_its_out_as_it_was(tmp_path):
    """The report is drawn beside --out and moved there whole: an interrupt (or a failure) half way left a
    few new plots beside an older report.html, or a new --out with only some of them."""
    sweep = write_sweep(tmp_path / "s", [[row("full", "sdpa", 128, fwd=1.0, mem=1), row("full", "sdpa", 256, fwd=4.0, mem=1)]])
    out = tmp_path / "out"
    assert report.main([str(sweep), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(stage):
        (stage / "fwd_ms.png").write_bytes(b"half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        report.staged(out, interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.staged(tmp_path / "new", interrupted)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and sorted(os.listdir(tmp_path)) == ["out", "s"]


@pytest.mark.parametrize("field, value, problem", [
    ("fwd_iqr_ms", -0.1, "fwd_iqr_ms=-0.1 is negative"),  # the error bars' matplotlib refused it: a traceback
    ("fwd_ms", 0.0, "fwd_ms=0.0 is not > 0"),  # counted as the fastest in the crossover
    ("peak_mem_bytes", -1, "peak_mem_bytes=-1 is negative"),
    ("seq_len", 0, "seq_len=0 is not > 0")])  # no sequence: a log-log fit's log(0)
def test_a_negative_time_spread_or_size_is_a_damaged_line(tmp_path, capsys, field, value, problem):
    """No measurement gives one (a hand-edited or foreign row): left out and said, the rest reported."""
    sweep = write_sweep(tmp_path / "s", [[row("full", "sdpa", 128, fwd=1.0, mem=1),
                                          {**row("full", "sdpa", 256, fwd=4.0, mem=1), field: value}]])
    assert report.main([str(sweep)]) == 0
    assert f"damaged line(s) 2 ({problem})" in capsys.readouterr().err
    assert [r["seq_len"] for r in load_rows(sweep / "report" / "results.csv")] == [128]


def test_a_row_with_an_integer_past_int64_is_a_damaged_line_not_a_crash(tmp_path):
    """JSON has no integer limit; one past int64 overflowed a float in the report after it had written its
    results.csv (a hand-made or foreign line: the harness never writes one)."""
    big = row("full", "sdpa", 256, fwd=1.0, mem=1, fwd_bwd_ms=10**400)
    sweep = write_sweep(tmp_path / "s", [[row("full", "sdpa", 128, fwd=1.0, mem=1), big]])
    res = cli("harness.report", sweep)
    assert res.returncode == 0, res.stderr
    assert "damaged line(s) 2 (fwd_bwd_ms is past a 64-bit integer)" in res.stderr and "1 points" in res.stdout


def test_the_fit_from_length_itself_is_in_the_fit():
    """--fit-from N fits over N and longer, N included: here the point at N=512 is off the N² line, so a fit
    that left it out would find exactly 2."""
    from harness.results import loglog_slope

    times = {256: 1.0, 512: 4 * 512 ** 2 * 1e-6, 1024: 1024 ** 2 * 1e-6, 2048: 2048 ** 2 * 1e-6}
    rows = [row("full", "sdpa", n, fwd=t) for n, t in times.items()]
    fitted = report.series_exponent(rows, "fwd_ms", 512)
    assert fitted == pytest.approx(loglog_slope([512, 1024, 2048], [times[n] for n in (512, 1024, 2048)]))
    assert fitted < 1.9


def test_latest_keeps_each_points_last_row_in_the_order_of_those_last_rows():
    """A point measured again counts once, by its last row, placed where that row is (results.csv lists the
    points in the order they were last measured)."""
    from harness.results import latest

    first, other = row("full", "sdpa", 64, fwd=1.0), row("full", "sdpa", 128, fwd=2.0)
    again = row("full", "sdpa", 64, fwd=3.0)
    assert latest([first, other, again]) == [other, again]


# ----- from a mutation audit of report and compare -----------------------------------------------------

def test_a_drop_in_accuracy_mass_kept_or_cosine_is_a_regression_and_a_grown_error_too():
    """Task accuracy, mass kept and cosine are higher-is-better: a variant whose MQAR accuracy fell from 0.9 to
    0.5 regressed (judged as lower-is-better it would read "better"); an error that grew regressed too."""
    from harness.report.compare import judge

    a = row("full", "sdpa", 256, fwd=1.0, mem=1, task_accuracy=0.9, mass_kept=0.9, out_cos=0.99, out_rel_err=0.1)
    b = {**a, "task_accuracy": 0.5, "mass_kept": 0.5, "out_cos": 0.5, "out_rel_err": 0.5}
    for metric in ("task_accuracy", "mass_kept", "out_cos"):
        assert judge(metric, a, b, 0.1)[1] == "REGRESSION", metric
        assert judge(metric, b, a, 0.1)[1] == "better", metric
    assert judge("out_rel_err", a, b, 0.1)[1] == "REGRESSION"


def test_a_point_that_regressed_on_two_metrics_counts_once():
    """'n of m matched points regressed' counts points, not point x metric: a point slower and larger is one
    regressed point of two (counted per metric, 2 of 2 points would read as regressed)."""
    from harness.report.compare import compare

    a = [row("full", "sdpa", n, fwd=1.0, mem=100) for n in (256, 512)]
    b = [{**a[0], "fwd_bwd_ms": 6.0, "peak_mem_bytes": 200}, a[1]]
    result = compare({collect.compare_key(r): [r] for r in a}, {collect.compare_key(r): [r] for r in b},
                     ["fwd_bwd_ms", "peak_mem_bytes"], 0.1)
    assert [(r[5], r[9]) for r in result["table"]] == [("REGRESSION", "REGRESSION"), ("", "")]  # both metrics
    assert result["regressions"] == 1


def test_a_change_of_time_against_one_run_of_either_side_is_said_to_rest_on_one_run():
    """Three runs in A and one in B: the change still rests on B's single run (its spread between runs is
    unknown), so it is counted among the changes judged on one run of A or B."""
    from harness.report.compare import compare

    def runs(times):
        return [row("full", "sdpa", 512, fwd=ms / 3, mem=1, fwd_bwd_iqr_ms=0.2) for ms in times]

    a, b = runs([10.0, 10.1, 9.9]), runs([13.0])
    key = collect.compare_key(a[0])
    result = compare({key: a}, {key: b}, ["fwd_bwd_ms"], 0.1)
    assert result["table"][0][-1] == "REGRESSION"
    assert result["time_changes_from_one_run"] == 1
    assert compare({key: a}, {key: runs([13.0, 13.1, 12.9])}, ["fwd_bwd_ms"], 0.1)["time_changes_from_one_run"] == 0


def test_compare_shows_memory_in_mebibytes():
    """peak_mem_bytes is shown in MiB (2**20 bytes), as the report's tables: 64 MiB is 64.0MiB, not 67.1 (MB)."""
    from harness.report.compare import compare

    a = row("full", "sdpa", 256, fwd=1.0, mem=64 * 2 ** 20)
    b = {**a, "peak_mem_bytes": 32 * 2 ** 20}
    key = collect.compare_key(a)
    (line,) = compare({key: [a]}, {key: [b]}, ["peak_mem_bytes"], 0.1)["table"]
    assert line[2:5] == ["64.0MiB", "32.0MiB", "0.500"], line


def test_a_variant_as_fast_as_full_is_not_faster():
    """The crossover is where the variant is faster than full: an equal time is not faster (a series exactly
    as fast as full at 256 and twice as fast from 512 crosses at 512, not at every N)."""
    rows = [row("x", "b", n, fwd=t) for n, t in ((256, 2.0), (512, 4.0))]
    assert report.crossover(rows, {256: 2.0, 512: 8.0}, "fwd_ms") == (512, False)


def test_a_point_in_error_is_not_a_length_that_fits():
    """The largest N that fits is the largest ok N: a point that failed otherwise (error, nonfinite) is no
    evidence that N fits in memory."""
    rows = [row("x", "b", n, fwd=1.0) for n in (256, 512)]
    rows += [row("x", "b", 1024, "error"), row("x", "b", 2048, "nonfinite"), row("x", "b", 4096, "oom")]
    assert report.max_fitting(rows) == (512, 4096, "oom")


def test_the_ratio_plots_draw_full_over_variant_time_and_variant_over_full_memory(tmp_path, monkeypatch):
    """The speed-up is full's time / the variant's (a variant 4x faster is drawn at 4, not 0.25); the memory
    ratio is the variant's peak / full's (a quarter of full's memory is drawn at 0.25)."""
    window = [row("sliding_window", "blocksparse", n, fwd=1.0, mem=100, opt_window=64) for n in (256, 512)]
    write_sweep(tmp_path, [[row("full", "sdpa", n, fwd=4.0, mem=400) for n in (256, 512)], window])
    drawn, save = {}, report._save

    def spy(fig, path):  # each labelled line's points, read before the figure is closed
        drawn[path.stem] = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()
                            if not line.get_label().startswith("_")}
        return save(fig, path)

    monkeypatch.setattr(report, "_save", spy)
    report.make_report(tmp_path, tmp_path / "report")
    for plot in ("speedup_fwd_ms", "speedup_fwd_bwd_ms"):
        assert drawn[plot] == {"sliding_window/blocksparse": [4.0, 4.0]}, (plot, drawn[plot])
    assert drawn["mem_ratio"] == {"sliding_window/blocksparse": [0.25, 0.25]}, drawn["mem_ratio"]


def test_the_reports_exponent_leaves_a_noisy_timing_out():
    """The series table's fitted exponent is over the trusted points: a forward noisy at 1024 (99 ms, far off
    the N² line) is left out of the forward's fit, as the report's title says."""
    rows = [row("full", "sdpa", n, fwd=1e-6 * n * n) for n in (256, 512, 1024, 2048)]
    rows[2].update(fwd_ms=99.0, noisy=True, noisy_passes=["fwd"], noise_reasons="fwd: IQR 90% of the median")
    assert report.series_exponent(rows, "fwd_ms") == pytest.approx(2.0, abs=1e-9)


def test_the_series_table_fits_each_pass_in_its_own_column():
    """exp. fwd, exp. bwd and exp. mem are the exponents of fwd_ms, bwd_ms and peak_mem_bytes: a forward ∝ N²
    and a backward ∝ N read 2.00 and 1.00 (the forward+backward, a mix of both, is no column's)."""
    rows = [row("full", "sdpa", n, fwd=1e-6 * n * n, mem=16 * n, bwd_ms=1e-3 * n, fwd_bwd_ms=1e-6 * n * n + 1e-3 * n)
            for n in (256, 1024, 4096)]
    groups = collect.group_series(rows)
    head, (line,) = report.series_table(groups, series_labels(groups))
    assert [line[head.index(c)] for c in ("exp. fwd", "exp. bwd", "exp. mem")] == ["2.00", "1.00", "1.00"], line


def test_the_every_point_table_puts_each_field_in_its_column_and_memory_in_mebibytes():
    """Each column of the every-point table holds its own field (distinct values, so a swap shows), and the
    peak in MiB (2**20 bytes): 3 MiB reads 3, not 3.15 (MB)."""
    r = row("full", "sdpa", 256, fwd=1.0, mem=3 * 2 ** 20, fwd_iqr_ms=0.1, bwd_iqr_ms=0.2, fwd_bwd_iqr_ms=0.3,
            tflops_fwd=0.7, out_rel_err=0.01, mass_kept=0.9, task_accuracy=0.8, other_cpu_cores=0.05)
    groups = collect.group_series([r])
    head, (line,) = report.points_table(groups, series_labels(groups))
    assert dict(zip(head, line)) == {
        "series": "full/sdpa", "N": 256, "status": "ok", "fwd ms": 1.0, "fwd IQR": 0.1, "bwd ms": 2.0,
        "bwd IQR": 0.2, "fwd+bwd ms": 3.0, "fwd+bwd IQR": 0.3, "peak MiB": 3.0, "TFLOP/s fwd": 0.7,
        "out rel err": 0.01, "mass kept": 0.9, "task acc": 0.8, "others' cores": 0.05, "noisy passes": None}


def test_a_point_measured_again_last_takes_its_place_by_length_in_the_crossover(tmp_path):
    """A point measured again (a resumed run) is the last row of its file, so the rows come back out of length
    order; a series is its rows sorted by N, else the crossover (the first N from which the variant stays
    faster) would read them in file order: slower at 256 measured last would read as "none in range"."""
    full = [row("full", "sdpa", n, fwd=1.0) for n in (256, 512, 1024)]
    window = [row("sliding_window", "blocksparse", n, fwd=f) for n, f in ((256, 3.0), (512, 0.5), (1024, 0.5))]
    write_sweep(tmp_path, [[*full, *window, row("sliding_window", "blocksparse", 256, fwd=2.0)]])
    groups = collect.group_series(load_rows(tmp_path, warn=[].append))
    assert [[r["seq_len"] for r in rows] for rows in groups.values()] == [[256, 512, 1024]] * 2
    _, body = report.crossover_table(groups, series_labels(groups))
    assert body == [["sliding_window/blocksparse", 512, 512]], body


def test_a_forward_time_kept_by_a_point_that_ran_out_of_memory_is_no_measured_value():
    """A point whose backward ran out of memory keeps the forward time measured before it (harness.measure):
    the point is oom, so full failed there (the crossover's "full failed") and the series' fit and plots have
    no value at that N; the time is not full's best time there."""
    full = [row("full", "sdpa", 256, fwd=1.0), {**row("full", "sdpa", 512, "oom"), "fwd_ms": 1.5, "tflops_fwd": 0.5}]
    assert report.reference([full], "fwd_ms") == {256: 1.0, 512: None}
    assert collect.ok_value(full[1], "fwd_ms") is None and report.trusted(full[1], "tflops_fwd") is None
