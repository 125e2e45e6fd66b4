"""Compare two sets of results point by point: baseline A, candidate B.

    python -m harness.report.compare A B [--threshold 0.10] [--fail-on-regression] [--metric fwd_bwd_ms,peak_mem_bytes]

A and B are run/sweep directories or results .jsonl/.csv files. Points match on their identity (variant,
backend, options, seq_len, shape, dtype, causal, seed, inputs, fidelity batch, task), not on the device,
so a CPU run can be set against a GPU run (the devices are printed; a side whose points are of two
devices, or were timed on two machines, is refused). For each matched point and metric: A, B and B/A. A
regression is B/A > 1 + threshold for lower-is-better metrics (times, memory, errors), B/A < 1 - threshold
for higher-is-better ones (throughput, accuracy, mass kept), or a point ok in A that is not ok in B, or
not in B at all (a candidate that lost a point has not kept it; B's points that A lacks are listed). For a
time (and a throughput, by the time it is computed from), the change must also clear the noise: the
interquartile intervals of A and B (median ± IQR/2) must not overlap, else it is "within noise". A point
noisy in A or B (its timings cannot be trusted) is not judged on the times of its noisy passes (a
forward's spread leaves its forward+backward judged): it is listed apart. Exit status: 1 on a regression
with --fail-on-regression, else 0; 2 on bad input.

One run a side measures the noise within a run only; on a shared machine runs of the same code differ by
more. A side may hold several runs of its points (the same sweep run again into other directories under
it: a point in several results files): they are pooled, the median of their medians set against the
other side, and a time change must clear every run's interval, so the spread between runs counts too.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any

from ..config import PASSES, one_line_errors
from ..results import (SCHEMA, TIME_METRICS, from_timings, latest, machine_name, median_run, noisy_passes,
                       read_files, untrusted, warn_mixed_code)
from .collect import InputError, compare_key, environment_fields, number, series_key, series_labels


def higher_is_better(metric: str) -> bool:
    """Throughput (every tflops_* field), cosine, mass kept, accuracy; lower is better for the rest."""
    return metric.startswith("tflops_") or metric in ("out_cos", "mass_kept", "task_accuracy")



def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "—"
    if metric.endswith("_bytes"):
        return f"{v / 2 ** 20:.1f}MiB"
    return f"{v:.4g}"


def _interval(runs: list[dict], metric: str) -> tuple[float, float] | None:
    """The interval a point's time is judged by: (median − IQR/2, median + IQR/2) of one run; for several,
    the span of every ok run's such interval, a noisy run's too (its median is left out of the value, not
    its evidence of how far runs of this point spread). For a throughput (tflops_<pass>[_useful]), that of
    the time it is computed from (the same measurement, the same noise). None for metrics without a
    spread."""
    if metric.startswith("tflops_"):
        metric = metric.removeprefix("tflops_").removesuffix("_useful") + "_ms"
    if not metric.endswith("_ms"):
        return None
    ends = [(number(r[metric]), number(r.get(metric.removesuffix("_ms") + "_iqr_ms")) or 0.0)
            for r in runs if r.get("status") == "ok" and number(r.get(metric)) is not None]
    if not ends:
        return None
    return min(m - iqr / 2 for m, iqr in ends), max(m + iqr / 2 for m, iqr in ends)


def pooled(runs: list[dict], metrics: list[str]) -> dict:
    """One row for a point's runs (the same point in several results files of one side): the row of the
    run the report draws (``median_run``: an ok one where any is, whichever order the files are read in),
    each metric the median over the ok runs (a timing: over those whose pass is not noisy; the pass noisy
    only where it is in every ok run). One run: its row as it is."""
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if r.get("status") == "ok"]
    row = dict(median_run(ok) if ok else runs[-1])
    for m in metrics:
        timed = [r for r in ok if not untrusted(r, m)]
        values = [number(r.get(m)) for r in (timed or ok)]
        values = [v for v in values if v is not None]
        row[m] = statistics.median(values) if values else None
    row["noisy_passes"] = [p for p in PASSES if ok and all(p in noisy_passes(r) for r in ok)]
    row["noisy"] = bool(row["noisy_passes"])
    if row["noisy"]:
        row["noise_reasons"] = next(r.get("noise_reasons") for r in reversed(ok) if r.get("noisy"))
    return row


def runs_by_point(path: str) -> dict[tuple, list[dict]]:
    """compare_key -> the point's runs under ``path``: its row in each results file holding it (the file's
    last), in the order read. A point in several files is several runs of it (the same sweep run again into
    another directory under ``path``)."""
    runs: dict[tuple, list[dict]] = {}
    for _, rows in read_files(path):
        for r in latest(rows):
            runs.setdefault(compare_key(r), []).append(r)
    warn_mixed_code(path, [r for rs in runs.values() for r in rs])
    return runs


def numeric(metric: str) -> bool:
    """Whether the schema makes ``metric`` a field of numbers (not text, not a flag)."""
    types = SCHEMA.get(metric, ((), False))[0]
    return bool(types) and set(types) <= {int, float}


def judge(metric: str, ra: dict, rb: dict, threshold: float, runs_a: list[dict] | None = None,
          runs_b: list[dict] | None = None) -> tuple[float | None, str]:
    """(B/A, flag) for one metric of one matched point: ``ra`` and ``rb`` its rows (``pooled``), ``runs_a``
    and ``runs_b`` the runs they pool (by default the rows themselves), whose intervals a change of time
    must clear."""
    va = number(ra.get(metric)) if ra.get("status") == "ok" else None
    vb = number(rb.get(metric)) if rb.get("status") == "ok" else None
    ratio = vb / va if va and vb is not None else None
    if ra.get("status") == "ok" and rb.get("status") != "ok":
        return ratio, f"REGRESSION (ok -> {rb.get('status')})"
    if va == 0 and vb:  # from exactly zero (an exact variant's error, say): no ratio, but a change
        return None, "REGRESSION (from 0)" if (vb < 0) == higher_is_better(metric) else "better (from 0)"
    if ratio is None:
        return ratio, "" if ra.get("status") == rb.get("status") else f"{ra.get('status')} -> {rb.get('status')}"
    if untrusted(ra, metric) or untrusted(rb, metric):
        return ratio, "noisy"
    worse = ratio < 1 - threshold if higher_is_better(metric) else ratio > 1 + threshold
    better = ratio > 1 + threshold if higher_is_better(metric) else ratio < 1 - threshold
    if not (worse or better):
        return ratio, ""
    ia, ib = _interval(runs_a or [ra], metric), _interval(runs_b or [rb], metric)
    if ia is not None and ib is not None and ia[0] <= ib[1] and ib[0] <= ia[1]:
        return ratio, "within noise"  # the intervals overlap: not a change we can claim
    return ratio, "REGRESSION" if worse else "better"


def compare(runs_a: dict[tuple, list[dict]], runs_b: dict[tuple, list[dict]], metrics: list[str],
            threshold: float) -> dict[str, Any]:
    """{'table': [[series, N, per metric: A, B, B/A, flag]...], 'regressions': points regressed,
    'noisy': points noisy in A or B, 'only_a' / 'only_b': unmatched points, 'missing': points ok in A
    that B lacks (regressions too: a candidate that lost a point has not kept it), 'time_changes_from_one_run':
    points whose time changed on one run of a side}. ``runs_a``, ``runs_b``:
    ``runs_by_point`` of each side (one machine per side: main refuses more)."""
    a = {k: pooled(runs, metrics) for k, runs in runs_a.items()}
    b = {k: pooled(runs, metrics) for k, runs in runs_b.items()}
    # Label series without the device, so a point of A and its match in B share a label.
    labels = series_labels(series_key(r)._replace(device=None) for r in [*a.values(), *b.values()])

    def label(r: dict) -> str:
        return labels[series_key(r)._replace(device=None)]

    table, regressions, noisy, one_run = [], 0, [], 0
    for key in sorted(a.keys() & b.keys(), key=lambda k: (label(a[k]), a[k]["seq_len"])):
        ra, rb = a[key], b[key]
        row: list[str] = [label(ra), str(ra["seq_len"])]
        timed_change = False  # a change of time claimed on this point
        for m in metrics:
            ratio, flag = judge(m, ra, rb, threshold, runs_a[key], runs_b[key])
            va = number(ra.get(m)) if ra.get("status") == "ok" else None
            vb = number(rb.get(m)) if rb.get("status") == "ok" else None
            row += [_fmt(m, va), _fmt(m, vb), "—" if ratio is None else f"{ratio:.3f}", flag]
            timed_change |= flag in ("REGRESSION", "better") and from_timings(m)
        regressions += any(c.startswith("REGRESSION") for c in row)  # points, not point x metric
        one_run += timed_change and min(len(runs_a[key]), len(runs_b[key])) == 1
        unjudged = [m for m in metrics if untrusted(ra, m) or untrusted(rb, m)]  # a pass noisy in A or B
        if unjudged:
            sides = [(side, r) for side, r in (("A", ra), ("B", rb)) if any(untrusted(r, m) for m in unjudged)]
            noisy.append(f"{label(ra)} N={ra['seq_len']}: {', '.join(unjudged)} noisy in "
                         f"{' and '.join(side for side, _ in sides)} ({sides[0][1].get('noise_reasons')})")
        table.append(row)

    def unmatched(mine: dict, other: dict) -> list[str]:
        """'series N=n1,n2,...' for the points of ``mine`` with no match in ``other``."""
        by_series: dict[str, list[int]] = {}
        for k, r in mine.items():
            if k not in other:
                by_series.setdefault(label(r), []).append(r["seq_len"])
        return [f"{s} N={','.join(map(str, sorted(ns)))}" for s, ns in sorted(by_series.items())]

    missing = sum(k not in b and r.get("status") == "ok" for k, r in a.items())
    return {"table": table, "regressions": regressions + missing, "missing": missing, "noisy": noisy,
            "only_a": unmatched(a, b), "only_b": unmatched(b, a), "time_changes_from_one_run": one_run}


def _runs(runs: dict[tuple, list[dict]]) -> str:
    """', k runs of each' (or 'j to k runs a point') where a side pools several runs; '' for one."""
    counts = sorted({len(rs) for rs in runs.values()})
    if counts == [1]:
        return ""
    return f", {counts[0]} runs of each" if len(counts) == 1 else f", {counts[0]} to {counts[-1]} runs a point"


def _devices(rows: list[dict]) -> str:
    """device, and any environment field naming the hardware (device name, GPU model)."""
    fields = ["device"] + [f for f in environment_fields(rows) if f != "device" and ("device" in f or "gpu" in f)]
    return "; ".join(f"{f} " + ", ".join(sorted({str(r.get(f)) for r in rows})) for f in fields)


def _print_table(head: list[str], body: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    for row in [head, *body]:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.report.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="baseline: a results directory or results .jsonl/.csv file")
    p.add_argument("b", help="candidate: a results directory or results .jsonl/.csv file")
    p.add_argument("--threshold", type=float, default=0.10, help="relative change that counts (default 0.10)")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 when any point regressed")
    p.add_argument("--metric", default="fwd_bwd_ms,peak_mem_bytes", help="comma-separated metrics")

    one_line_errors(p, "compare")
    args = p.parse_args(argv)
    metrics = list(dict.fromkeys(m.strip() for m in args.metric.split(",") if m.strip()))  # one column each
    try:
        examples = "e.g. fwd_ms, bwd_ms, fwd_bwd_ms, peak_mem_bytes, tflops_fwd, out_rel_err, task_accuracy"
        if not metrics:
            raise InputError(f"--metric: no metric given; allowed: a numeric field of the results, {examples}")
        if not math.isfinite(args.threshold) or args.threshold < 0:  # nan and inf would never flag a regression
            raise InputError(f"--threshold must be a finite number >= 0 (a relative change: 0.10 is 10%); "
                             f"got {args.threshold}")
        runs_a, runs_b = runs_by_point(args.a), runs_by_point(args.b)
        rows_a, rows_b = ([r for runs in side.values() for r in runs] for side in (runs_a, runs_b))
        for side, rows in (("A", rows_a), ("B", rows_b)):  # points match across devices: one per side
            # Which row of a point to match, or which runs to pool, is not knowable; and a side whose points
            # were timed on two machines (a resumed run measures again only the points it runs) is no
            # baseline or candidate: its times would compare machines, not code
            timed = [r for r in rows if any(number(r.get(m)) is not None for m in (*TIME_METRICS, "peak_mem_bytes"))]
            for what, of, among in (("devices", lambda r: str(r.get("device")), rows),
                                    ("machines", machine_name, timed)):
                several = sorted({of(r) for r in among})
                if len(several) > 1:
                    raise InputError(f"{side} holds points of several {what} ({', '.join(several)}); allowed: one "
                                     f"{what[:-1]} per side (runs of one {what[:-1]})")
        unknown = [m for m in metrics if not any(m in r for r in [*rows_a, *rows_b])]
        if unknown:
            raise InputError(f"--metric: {', '.join(unknown)} in neither A nor B; allowed: a numeric field of the "
                             f"results, {examples}")
        # A metric is a number: a field of numbers (by the schema) or a column holding one
        text = [m for m in metrics if not numeric(m) and all(number(r.get(m)) is None for r in [*rows_a, *rows_b])]
        if text:
            raise InputError(f"--metric: {', '.join(text)} is no measured number; allowed: a numeric field of "
                             f"the results, {examples}")
    except InputError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2

    result = compare(runs_a, runs_b, metrics, args.threshold)
    print(f"A (baseline):  {args.a}  [{len(runs_a)} points{_runs(runs_a)}; {_devices(rows_a)}]")
    print(f"B (candidate): {args.b}  [{len(runs_b)} points{_runs(runs_b)}; {_devices(rows_b)}]")
    print(f"threshold {args.threshold * 100:g}%; ratio = B/A\n")  # 0.005: 0.5%, not 0%
    head = ["series", "N"] + [f"{m} {c}" if c else "" for m in metrics for c in ("A", "B", "B/A", "")]
    if result["table"]:
        _print_table(head, result["table"])
    else:
        print("  no matching points")
    for side, name in (("only_a", "A"), ("only_b", "B")):
        if result[side]:
            print(f"\nonly in {name}:\n  " + "\n  ".join(result[side]))
    if result["noisy"]:
        print("\nnoisy points, the times named not judged (rerun them: retry=[noisy]):\n  "
              + "\n  ".join(result["noisy"]))
    n = result["regressions"]
    print(f"\n{n - result['missing']} of {len(result['table'])} matched points regressed"
          + (f"; {result['missing']} point(s) ok in A not in B (regressions too: see 'only in A')"
             if result["missing"] else "")
          + (f"; {len(result['noisy'])} noisy, not judged on time" if result["noisy"] else ""))
    if result["time_changes_from_one_run"]:
        print(f"{result['time_changes_from_one_run']} change(s) of time judged on one run of A or B: runs of the "
              f"same code can differ by more than one run's spread. Repeat the runs (the same sweep into more "
              f"directories under A and B): compare pools them and judges against their spread")
    return 1 if n and args.fail_on_regression else 0


if __name__ == "__main__":
    from harness.config import ctrl_c_is_one_line

    sys.exit(ctrl_c_is_one_line(main, "compare", "nothing was written"))
