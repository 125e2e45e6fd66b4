"""Report of a sweep: one table, plots against sequence length, and a self-contained report.html.

    python -m harness.report SWEEP_DIR [--out DIR] [--fit-from N] [--wandb]

Collects every results.jsonl under SWEEP_DIR (a point measured again: its last row; a point in several
files, i.e. several runs: its median run, harness.results.load_rows; a report's own output is never read
as input) and writes to ``--out`` (default SWEEP_DIR/report): results.csv, one
PNG per plot, report.html (PNGs embedded, so it opens anywhere). With ``--wandb`` the plots and tables
also go to a wandb run in group = the sweep dir's name (mode: WANDB_MODE, else online with credentials,
offline without).

Comparisons with full: within one (causal, dtype, device, shape) group, each non-full series against
the *best* full backend at each N (fastest for time, smallest for memory), so a variant is credited
only for beating the strongest exact baseline measured.

Noisy timings (harness.measure.noise: a pass's spread or samples make that pass's timing untrusted, others'
load every pass's) are drawn hollow, left out of the fitted exponents and of the crossover, and their points
listed in their own table; the point's other passes count as measured. ``--fit-from N`` fits the
exponents over N and longer only: on a GPU the short lengths are bound by kernel launches, not by the
algorithm, and flatten a fit over every length. Time plots carry
error bars of the interquartile range (median ± IQR/2). A measured 0 (a peak within the inputs), which a log
axis cannot show, is marked at the plot's bottom and listed in its own table. Each series keeps one colour
in every figure.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, check_output_dir, one_line_errors
from ..results import (REPORT_DIR, SLOW, atomic_write, from_timings, loglog_slope, noisy_passes, untrusted,
                       write_csv)
from .collect import (FULL, STATUSES, InputError, Series, columns, environment_fields, group_series, load_rows,
                      ok_value, series_labels)

Rows = list[dict[str, Any]]
MIB = 2.0 ** 20
# (metric, title, y label, y scale): absolute plots, fitted exponent in the legend.
SCALING_PLOTS = (
    ("fwd_ms", "Forward time", "ms", 1.0),
    ("bwd_ms", "Backward time", "ms", 1.0),
    ("fwd_bwd_ms", "Forward + backward time", "ms", 1.0),
    ("peak_mem_bytes", "Peak memory, forward + backward (extra over inputs)", "MiB", MIB),
)
SPEEDUP_METRICS = (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward + backward"))
FIDELITY_PLOTS = (  # drawn only when some row has the field; log y where errors span decades
    ("out_rel_err", "Output relative error vs exact", True),
    ("grad_rel_err", "Gradient relative error vs exact", True),
    ("mass_kept", "Softmax mass kept by the mask", False),
    ("task_accuracy", "MQAR task accuracy", False),
)
LOG_METRICS = [m for m, *_ in SCALING_PLOTS] + [m for m, _, logy in FIDELITY_PLOTS if logy]  # a 0 has no place


# ----- analysis (pure functions, tested directly) --------------------------------------------------

def fit_exponent(ns: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log N over the positive points: y ∝ N^slope.
    None with fewer than 2 distinct N."""
    pts = [(n, y) for n, y in zip(ns, ys) if n > 0 and y is not None and y > 0]
    if len({n for n, _ in pts}) < 2:
        return None
    return loglog_slope([n for n, _ in pts], [y for _, y in pts])


def trusted(row: dict[str, Any], metric: str) -> float | None:
    """The row's ok value of ``metric``, or None where it is missing or a timing whose pass is noisy (or the
    throughput computed from one)."""
    if untrusted(row, metric):
        return None
    return ok_value(row, metric)


def series_exponent(rows: Rows, metric: str, fit_from: int = 0) -> float | None:
    """The fitted exponent over the trusted points (noisy timings left out) at N >= ``fit_from``."""
    ok = [(r["seq_len"], trusted(r, metric)) for r in rows
          if r["seq_len"] >= fit_from and trusted(r, metric) is not None]
    return fit_exponent([n for n, _ in ok], [y for _, y in ok])


def reference(full_series: list[Rows], metric: str) -> dict[int, float | None]:
    """N -> the best (smallest) trusted value of ``metric`` over the full backends; None where full
    failed at N (no backend ok: oom/skipped/error/nonfinite). An N where full ran but no backend measured
    this metric (a pass left out), or where one measured it noisy, is absent: nothing is known there (the
    noisy one may be the fastest: the best of the others is not full's best)."""
    ref: dict[int, float | None] = {}
    ran: set[int] = set()  # N where some full backend was ok, trusted here or not
    noisy: set[int] = set()  # N where some full backend's value of the metric is untrusted
    for rows in full_series:
        for r in rows:
            v, n = trusted(r, metric), r["seq_len"]
            if r.get("status") == "ok":
                ran.add(n)
                if v is None and ok_value(r, metric) is not None:
                    noisy.add(n)
            if v is not None:
                if ref.get(n) is None or v < ref[n]:
                    ref[n] = v
            elif r.get("status") != "ok":
                ref.setdefault(n, None)
    # full failed at N only where no backend ran: one ran, its time unknown (noisy, a pass left out), and
    # another's oom says nothing there
    return {n: v for n, v in ref.items() if n not in noisy and (v is not None or n not in ran)}


def crossover(rows: Rows, ref: dict[int, float | None], metric: str) -> tuple[int | None, bool] | None:
    """First N from which the series stays faster than full, over the N both measured.

    Faster at N: the series is ok and full is slower or failed there. A series point that ran out of
    memory where full ran counts as not faster; one out of memory where full failed too, skipped, in error
    or noisy is left out (it says nothing about speed). Returns (N, faster at every compared N), (None,
    False) when not faster at the largest compared N, or None when no N can be compared.
    """
    def compared(r: dict[str, Any]) -> bool:
        n = r["seq_len"]
        if n not in ref:
            return False
        if r.get("status") == "oom":
            return ref[n] is not None
        return trusted(r, metric) is not None

    faster = [(r["seq_len"], trusted(r, metric) is not None
               and (ref[r["seq_len"]] is None or trusted(r, metric) < ref[r["seq_len"]]))
              for r in rows if compared(r)]
    if not faster:
        return None
    first = None
    for n, f in faster:
        first = (first if first is not None else n) if f else None
    return first, first == faster[0][0]


def max_fitting(rows: Rows) -> tuple[int | None, int | None, str | None]:
    """(largest ok N, first N that ran out of memory or was skipped, that status: "skipped (time)" where
    it was skipped as predicted too slow (measure.max_call_s), not for memory)."""
    ok = [r["seq_len"] for r in rows if r.get("status") == "ok"]
    failed = [(r["seq_len"], "skipped (time)" if SLOW in (r.get("reason") or "") else r["status"])
              for r in rows if r.get("status") in ("oom", "skipped")]
    first = min(failed) if failed else (None, None)
    return (max(ok) if ok else None), first[0], first[1]


def reference_groups(groups: dict[Series, Rows]) -> dict[tuple, list[Series]]:
    """(causal, dtype, device, shape) -> the full series in it: what each other series is compared with."""
    refs: dict[tuple, list[Series]] = defaultdict(list)
    for s in groups:
        if s.variant == FULL:
            refs[_ref_key(s)].append(s)
    return refs


def _ref_key(s: Series) -> tuple:
    return (s.causal, s.dtype, s.device, s.shape)


# ----- plots ---------------------------------------------------------------------------------------

def series_colours(labels: dict[Series, str]) -> dict[Series, Any]:
    """One colour per series, the same in every figure (assigned in label order): tab10 or tab20, and past
    20 series as many colours spread over a continuous colour map (tab20's would repeat)."""
    import matplotlib

    n = len(labels)
    palette = (matplotlib.colormaps["tab10" if n <= 10 else "tab20"].colors if n <= 20 else
               [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)])
    return {s: palette[i % len(palette)] for i, s in enumerate(sorted(labels, key=labels.get))}


def _axes(title: str, ylabel: str, ns: list[int]):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    if 0 < len(ns) <= 14:  # label the measured N themselves rather than powers of 2
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
    return fig, ax


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.axes[0].legend(fontsize=7, loc="best")
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.1, top=0.88)  # fixed: tight_layout doubles the time
    fig.savefig(path)
    plt.close(fig)
    return path


def _headroom(ax) -> None:
    """Raise the (log) y top by 20% of the range so the markers at the top do not sit on the data."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * (hi / lo) ** 0.2)


def _mark_edge(ax, marks: list[tuple[int, str]], y: float, marker: str, color, index: int) -> None:
    """Points the y axis cannot show, as ``marker`` at height ``y`` (axes fraction) at their N, each
    labelled with its text; ``index`` staggers the labels of series marked at one N."""
    at = ax.get_xaxis_transform()  # x in data, y in axes fraction
    dy = -4 - 7 * index if y > 0.5 else 4 + 7 * index  # labels inward from the edge
    for n, text in marks:
        ax.plot([n], [y], marker, color=color, transform=at, markersize=8, mew=2)
        ax.annotate(text, (n, y), xycoords=at, textcoords="offset points", xytext=(4, dy), fontsize=6, color=color)


def _mark_failures(ax, rows: Rows, color, index: int) -> None:
    """Not-ok points as an 'x' at the top of the axis at their N, labelled with the status."""
    _mark_edge(ax, [(r["seq_len"], str(r.get("status"))) for r in rows if r.get("status") != "ok"], 0.97, "x",
               color, index)


def _mark_zeros(ax, rows: Rows, metric: str, color, index: int) -> None:
    """Measured zeros (a peak within the inputs) as a 'v' at the bottom of the axis at their N: a log axis
    has no place for 0, and a point it cannot draw vanished unsaid."""
    _mark_edge(ax, [(r["seq_len"], "0") for r in rows if ok_value(r, metric) == 0], 0.03, "v", color, index)


def _line(ax, pts: list[tuple[int, float, bool]], color, label: str, errs: list[float] | None = None) -> None:
    """A series: a line through its points, filled markers where trusted, hollow where noisy, and IQR
    error bars (``errs``: half the IQR per point) where given."""
    xs, ys = [n for n, _, _ in pts], [v for _, v, _ in pts]
    ax.plot(xs, ys, "-", color=color, label=label, lw=1.2)
    if errs is not None:
        ax.errorbar(xs, ys, yerr=errs, fmt="none", ecolor=color, elinewidth=0.8, capsize=2)
    for filled in (True, False):
        sel = [(n, v) for n, v, noisy in pts if noisy != filled]
        if sel:
            ax.plot([n for n, _ in sel], [v for _, v in sel], "o", markersize=4, color=color,
                    markerfacecolor=color if filled else "white", markeredgewidth=1.2)


def scaling_plot(groups: dict[Series, Rows], labels: dict[Series, str], colours: dict[Series, Any], metric: str,
                 title: str, unit: str, scale: float, path: Path, fit_from: int = 0) -> Path:
    ns = sorted({r["seq_len"] for rows in groups.values() for r in rows})
    timing = from_timings(metric)
    zeros = any(ok_value(r, metric) == 0 for rows in groups.values() for r in rows)
    fig, ax = _axes(f"{title} vs N (log-log; x at top: not ok at that N"
                    + ("; hollow: noisy; bars: median ± IQR/2" if timing else "")
                    + (f"; exponents over N ≥ {fit_from})" if fit_from else ")")
                    + ("\n(v at bottom: a value of 0, which a log axis cannot show)" if zeros else ""), unit, ns)
    any_ok = False
    for i, (s, rows) in enumerate(sorted(groups.items(), key=lambda kv: labels[kv[0]])):
        ok = [r for r in rows if (ok_value(r, metric) or 0) > 0]  # zeros: marked below, the line would dive
        slope = series_exponent(rows, metric, fit_from)
        label = labels[s] + (f"  ($\\propto N^{{{slope:.2f}}}$)" if slope is not None else "")
        pts = [(r["seq_len"], ok_value(r, metric) / scale, untrusted(r, metric)) for r in ok]
        iqr = metric.removesuffix("_ms") + "_iqr_ms"
        errs = [(r.get(iqr) or 0.0) / 2 / scale for r in ok] if timing else None
        _line(ax, pts, colours[s], label, errs)
        any_ok |= bool(ok)
        _mark_failures(ax, rows, colours[s], i)
        _mark_zeros(ax, rows, metric, colours[s], i)
    if any_ok:
        ax.set_yscale("log")
        _headroom(ax)
    return _save(fig, path)


def ratio_plot(groups: dict[Series, Rows], labels: dict[Series, str], colours: dict[Series, Any], metric: str,
               speedup: bool, title: str, path: Path) -> Path:
    """speedup: full/series time (> 1: the variant is faster); else series/full memory (< 1: smaller).
    Noisy times on either side leave the ratio out."""
    refs = reference_groups(groups)
    ns = sorted({r["seq_len"] for rows in groups.values() for r in rows})
    backends = sorted({str(s.backend) for ss in refs.values() for s in ss})
    best = "smallest" if not speedup else "fastest"
    vs = f"full/{backends[0]}" if len(backends) == 1 else f"the {best} full backend at each N ({', '.join(backends)})"
    fig, ax = _axes(f"{title} vs {vs}\n(^ at top: full failed there, the variant ran)",
                    "speed-up (full time / variant time)" if speedup else "memory ratio (variant / full)", ns)
    ax.axhline(1.0, color="black", lw=0.8)
    top = ax.get_xaxis_transform()
    for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]]):
        if s.variant == FULL or _ref_key(s) not in refs:
            continue
        ref = reference([groups[f] for f in refs[_ref_key(s)]], metric)
        pts, full_failed = [], []
        for r in rows:
            v, n = trusted(r, metric), r["seq_len"]
            if v is not None and n in ref:
                if ref[n] is None:
                    full_failed.append(n)
                elif v > 0 and ref[n] > 0:  # a zero (a peak within the inputs) has no ratio
                    pts.append((n, ref[n] / v if speedup else v / ref[n], False))
        _line(ax, pts, colours[s], labels[s])
        if full_failed:
            ax.plot(full_failed, [0.97] * len(full_failed), "^", color=colours[s], transform=top)
    ax.set_yscale("log")
    _headroom(ax)
    return _save(fig, path)


def value_plot(groups: dict[Series, Rows], labels: dict[Series, str], colours: dict[Series, Any], metric: str,
               title: str, logy: bool, path: Path) -> Path:
    ns = sorted({r["seq_len"] for rows in groups.values() for r in rows})
    values = [ok_value(r, metric) for rows in groups.values() for r in rows]
    logy = logy and any((v or 0) > 0 for v in values)
    zeros = logy and 0 in values  # an error of exactly 0 (an exact path): marked, as scaling_plot's zeros
    fig, ax = _axes(f"{title} vs N" + ("\n(v at bottom: a value of 0, which a log axis cannot show)" if zeros else ""),
                    metric, ns)
    for i, (s, rows) in enumerate(sorted(groups.items(), key=lambda kv: labels[kv[0]])):
        pts = [(r["seq_len"], v, False) for r in rows
               if (v := ok_value(r, metric)) is not None and (v > 0 or not logy)]
        if pts:
            _line(ax, pts, colours[s], labels[s])
        if zeros:
            _mark_zeros(ax, rows, metric, colours[s], i)
    if logy:
        ax.set_yscale("log")
    return _save(fig, path)


# ----- tables ------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def series_table(groups: dict[Series, Rows], labels: dict[Series, str],
                 fit_from: int = 0) -> tuple[list[str], list[list[Any]]]:
    head = ["series", "variant", "backend", "options", "causal", "dtype", "device", "B,H,D",
            *STATUSES, "noisy", "exp. fwd", "exp. bwd", "exp. mem"]
    body = []
    for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]]):
        counts = [sum(r.get("status") == st for r in rows) for st in STATUSES]
        exps = [series_exponent(rows, m, fit_from) for m in ("fwd_ms", "bwd_ms", "peak_mem_bytes")]
        body.append([labels[s], s.variant, s.backend, ", ".join(f"{k}={v}" for k, v in s.opts), s.causal,
                     s.dtype, s.device, ",".join(map(str, s.shape)), *counts, sum(bool(r.get("noisy")) for r in rows),
                     *[None if e is None else f"{e:.2f}" for e in exps]])
    return head, body


def noisy_table(groups: dict[Series, Rows], labels: dict[Series, str]) -> tuple[list[str], list[list[Any]]]:
    body = [[labels[s], r["seq_len"], passes_named(r), r.get("tries"), r.get("other_cpu_cores"), r.get("noise_reasons")]
            for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]]) for r in rows if r.get("noisy")]
    return ["series", "N", "passes not trusted", "tries", "others' cores", "why"], body


def zeros_table(groups: dict[Series, Rows], labels: dict[Series, str]) -> tuple[list[str], list[list[Any]]]:
    """The measured zeros of the log plots' metrics: marked at the plot's bottom, not drawn, so named here (an
    error plot is linear, its zeros drawn, where no value is above 0)."""
    scaling = [m for m, *_ in SCALING_PLOTS]
    logged = [m for m in LOG_METRICS if m in scaling or any((ok_value(r, m) or 0) > 0 for rs in groups.values() for r in rs)]
    body = [[labels[s], r["seq_len"], metric] for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]])
            for r in rows for metric in logged if ok_value(r, metric) == 0]
    return ["series", "N", "metric"], body


def passes_named(row: dict[str, Any]) -> str | None:
    """The row's noisy passes ("fwd, bwd"); None where none."""
    return ", ".join(noisy_passes(row)) or None


POINT_COLUMNS = (("N", "seq_len"), ("status", "status"), ("fwd ms", "fwd_ms"), ("fwd IQR", "fwd_iqr_ms"),
                 ("bwd ms", "bwd_ms"), ("bwd IQR", "bwd_iqr_ms"), ("fwd+bwd ms", "fwd_bwd_ms"),
                 ("fwd+bwd IQR", "fwd_bwd_iqr_ms"), ("peak MiB", "peak_mem_bytes"), ("TFLOP/s fwd", "tflops_fwd"),
                 ("out rel err", "out_rel_err"), ("mass kept", "mass_kept"), ("task acc", "task_accuracy"),
                 ("others' cores", "other_cpu_cores"), ("noisy passes", "noisy_passes"))


def points_table(groups: dict[Series, Rows], labels: dict[Series, str]) -> tuple[list[str], list[list[Any]]]:
    """Every point's numbers, series by series (the report's CSV has every field)."""
    def value(r: dict[str, Any], field: str) -> Any:
        if field == "noisy_passes":  # a row from before the field: as its reasons say
            return passes_named(r)
        v = r.get(field)
        return v / MIB if field == "peak_mem_bytes" and v is not None else v

    body = [[labels[s], *(value(r, f) for _, f in POINT_COLUMNS)]
            for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]]) for r in rows]
    return ["series", *(h for h, _ in POINT_COLUMNS)], body


def crossover_table(groups: dict[Series, Rows], labels: dict[Series, str]) -> tuple[list[str], list[list[Any]]]:
    head = ["series", *[f"faster than full from N ({name})" for _, name in SPEEDUP_METRICS]]
    refs = reference_groups(groups)
    body = []
    for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]]):
        if s.variant == FULL:
            continue
        if _ref_key(s) not in refs:
            body.append([labels[s], *["no full series to compare"] * len(SPEEDUP_METRICS)])
            continue
        cells = []
        full = [groups[f] for f in refs[_ref_key(s)]]
        for metric, _ in SPEEDUP_METRICS:
            # N at which both timed this pass: where nothing is compared there, a timing there was noisy
            both = ({r["seq_len"] for r in rows if ok_value(r, metric) is not None} &
                    {r["seq_len"] for f in full for r in f if ok_value(r, metric) is not None})
            found = crossover(rows, reference(full, metric), metric)
            n, always = found or (None, False)
            cells.append(("no N timed by both" if not both else "noisy at every N both ran") if found is None
                         else "none in range" if n is None else f"{n} (faster at every N)" if always else n)
        body.append([labels[s], *cells])
    return head, body


def fitting_table(groups: dict[Series, Rows], labels: dict[Series, str]) -> tuple[list[str], list[list[Any]]]:
    head = ["series", "largest N that fits (ok)", "first N oom/skipped", "status there", "largest N tried"]
    body = [[labels[s], *max_fitting(rows), max(r["seq_len"] for r in rows)]
            for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]])]
    return head, body


def seeds_table(groups: dict[Series, Rows]) -> tuple[list[str], list[list[Any]]]:
    """Task accuracy over the seeds of otherwise equal series (``seed`` and ``task.seed`` pooled): per N,
    every seed's value, their mean and range. A training run counts once: the task reads ``task.seed``
    only, so series that differ in the harness's ``seed`` alone hold copies of one run (the harness's
    seed stands in for rows that recorded no task settings). Only where some point has two seeds or
    more: one seed says nothing of the spread."""
    pooled: dict[Series, dict[int, dict[Any, float]]] = defaultdict(lambda: defaultdict(dict))
    for s, rows in groups.items():
        task_seed = dict(s.task_opts).get("seed", ("seed", s.seed))  # which training run
        unseeded = s._replace(seed=None, task_opts=tuple(kv for kv in s.task_opts if kv[0] != "seed"))
        for r in rows:
            if (acc := ok_value(r, "task_accuracy")) is not None:
                pooled[unseeded][r["seq_len"]][task_seed] = acc
    labels = series_labels(pooled)
    body = [[labels[s], n, len(accs), f"{sum(accs) / len(accs):.3f}", f"{min(accs):.3f}–{max(accs):.3f}",
             ", ".join(f"{a:.3f}" for a in sorted(accs))]
            for s in sorted(pooled, key=labels.get) for n, by_seed in sorted(pooled[s].items())
            for accs in [list(by_seed.values())]]
    if not any(row[2] >= 2 for row in body):
        body = []
    return ["series", "N", "seeds", "mean", "range", "accuracies"], body


def failures_table(groups: dict[Series, Rows], labels: dict[Series, str]) -> tuple[list[str], list[list[Any]]]:
    body = [[labels[s], r["seq_len"], r.get("status"), r.get("reason")]
            for s, rows in sorted(groups.items(), key=lambda kv: labels[kv[0]])
            for r in rows if r.get("status") != "ok"]
    return ["series", "N", "status", "reason"], body


def environment_table(rows: Rows) -> tuple[list[str], list[list[Any]]]:
    body = []
    for field in environment_fields(rows):
        values = sorted({str(r[field]) for r in rows if r.get(field) is not None})
        if field == "date" and values:  # one per point: the span is what matters
            shown = f"{values[0]} … {values[-1]}"
        else:
            shown = ", ".join(values[:5]) + (f" … ({len(values)} distinct)" if len(values) > 5 else "")
        body.append([field, shown or None])
    return ["field", "values"], body


# ----- output ------------------------------------------------------------------------------------

def _html_table(head: list[str], body: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><tr>{th}</tr>{trs}</table>"


def write_html(path: Path, sweep: Path, rows: Rows, tables: dict[str, tuple], images: dict[str, Path]) -> None:
    statuses = ", ".join(f"{sum(r.get('status') == s for r in rows)} {s}" for s in STATUSES)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Attention benchmark report: {html.escape(sweep.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;"
        "font-size:13px;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}</style></head><body>",
        f"<h1>Attention benchmark report: {html.escape(sweep.name)}</h1>",
        f"<p>Source: <code>{html.escape(str(sweep))}</code>. {len(rows)} points ({statuses}). "
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. All points: <code>results.csv</code> "
        "next to this file. Speed-up and memory ratios compare each variant with the best full backend "
        "measured at each N with the same causal flag, dtype, device and shape.</p>",
    ]
    def table(key: str) -> None:
        title, head, body = tables[key]
        if body:
            parts.append(f"<h2>{html.escape(title)}</h2>{_html_table(head, body)}")

    for key in tables:
        if key != "points":
            table(key)
    for name, img in images.items():
        data = base64.b64encode(img.read_bytes()).decode()
        parts.append(f"<h2>{html.escape(name)}</h2><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>")
    if "points" in tables:  # the numbers behind every figure, last
        table("points")
    parts.append("</body></html>")
    atomic_write(path, "\n".join(parts))


def log_wandb(out: Path, sweep: Path, images: dict[str, Path], rows: Rows, tables: dict[str, tuple]) -> None:
    """The same plots (wandb.Image) and tables (wandb.Table) in one wandb run of the sweep's group."""
    import wandb

    from harness.logger import LoggerConfig, jobs_logger, sweep_group_name, table_cell, wandb_run

    cols = columns(rows)
    payload = {f"plot/{p.stem}": wandb.Image(str(p), caption=name) for name, p in images.items()}
    # a list (noisy_passes) as JSON text, as results.csv and the runs' points tables have it (was Python's repr)
    payload["table/results"] = wandb.Table(columns=cols, data=[[table_cell(r.get(c)) for c in cols]
                                                               for r in rows])
    for key, (_, head, body) in tables.items():
        payload[f"table/{key}"] = wandb.Table(columns=head, data=[[_fmt(c) for c in row] for row in body])
    # wandb_run: `with wandb.init(...) as run`, mode from WANDB_MODE / credentials, falls back offline.
    jobs = jobs_logger(sweep)  # where the jobs logged: their logger.group, project, entity and mode where set
    group = jobs.get("group") or sweep_group_name(sweep)
    where = LoggerConfig(**{k: v for k, v in jobs.items() if k in ("project", "entity", "mode")})
    with wandb_run(where, out, config={"sweep_dir": str(sweep.resolve())}, name=f"report-{group}",
                   group=group, tags=["report"]) as logger:
        logger.log(payload)  # after the steps of an earlier report into the same run


def staged(out: Path, make: Callable[[Path], tuple[Rows, dict[str, tuple], dict[str, Path]]]
           ) -> tuple[Rows, dict[str, tuple], dict[str, Path]]:
    """``make``'s report, drawn into a scratch directory beside ``out`` (drawing takes seconds a plot) and
    moved into ``out`` once whole: a report interrupted or failing half way leaves ``out`` as it was, not
    a few new plots beside an older report.html."""
    import os
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        rows, tables, images = make(stage)
        out.mkdir(exist_ok=True)
        for f in sorted(stage.iterdir(), key=lambda f: f.name == "results.csv"):  # results.csv last, as written
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return rows, tables, {title: out / path.name for title, path in images.items()}


def make_report(sweep: Path, out: Path, fit_from: int = 0) -> tuple[Rows, dict[str, tuple], dict[str, Path]]:
    """The report of every row under ``sweep`` into ``out``; exponents fitted over N >= ``fit_from``."""
    rows = load_rows(sweep)  # first: bad input fails before the slow imports
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    out.mkdir(parents=True, exist_ok=True)
    groups = group_series(rows)
    labels = series_labels(groups)
    colours = series_colours(labels)
    rows = [r for s in sorted(groups, key=labels.get) for r in groups[s]]  # readable order in the CSV

    def has(metric: str, variants: str = "any") -> bool:  # any ok value to draw (of a non-full series)?
        return any(ok_value(r, metric) is not None for r in rows if variants == "any" or r["variant"] != FULL)

    images: dict[str, Path] = {}  # title -> PNG
    for metric, title, unit, scale in SCALING_PLOTS:
        if has(metric):
            images[title] = scaling_plot(groups, labels, colours, metric, title, unit, scale, out / f"{metric}.png",
                                         fit_from)
    if reference_groups(groups):
        for metric, name in SPEEDUP_METRICS:
            if has(metric, "non-full"):
                images[f"Speed-up, {name}"] = ratio_plot(groups, labels, colours, metric, True, f"Speed-up ({name})",
                                                         out / f"speedup_{metric}.png")
        if has("peak_mem_bytes", "non-full"):
            images["Memory ratio"] = ratio_plot(groups, labels, colours, "peak_mem_bytes", False, "Peak memory ratio",
                                                out / "mem_ratio.png")
    for metric, title, logy in FIDELITY_PLOTS:
        if has(metric):
            images[title] = value_plot(groups, labels, colours, metric, title, logy, out / f"{metric}.png")

    tables = {  # key (wandb name) -> (title, header, rows)
        "environment": ("Environment", *environment_table(rows)),
        "series": ("Series (exp.: fitted log-log exponent, y ∝ N^exp over ok points"
                   + (f" at N ≥ {fit_from}" if fit_from else "") + "; noisy timings left out)",
                   *series_table(groups, labels, fit_from)),
        "crossover": ("Crossover: first N from which the variant stays faster than full",
                      *crossover_table(groups, labels)),
        "max_fit": ("Largest N that fits in memory", *fitting_table(groups, labels)),
        "seeds": ("MQAR task accuracy over seeds (series that differ only in seed or task.seed)",
                  *seeds_table(groups)),
        "not_ok": ("Points not ok", *failures_table(groups, labels)),
        "noisy": ("Noisy points (the timings of the passes named: drawn hollow, left out of fits and crossovers)",
                  *noisy_table(groups, labels)),
        "zeros": ("Zero values: no place on a log axis (marked v at the bottom of the plot; left out of the fitted "
                  "exponents and the ratios)", *zeros_table(groups, labels)),
        "points": ("Every point (median and IQR in ms; peak memory over the inputs, MiB)",
                   *points_table(groups, labels)),
    }
    write_html(out / "report.html", sweep, rows, tables, images)
    # Last: a report that failed on the way leaves no results.csv, which would make its --out refused
    write_csv(out / "results.csv", rows, columns(rows))
    return rows, tables, images


def _print_table(title: str, head: list[str], body: list[list[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in [head, *body]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    print(f"\n{title}")
    for row in cells:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", type=Path, help="a run or sweep directory (results.jsonl found recursively)")
    p.add_argument("--out", default=None, help="output directory (default: SWEEP_DIR/report)")
    p.add_argument("--fit-from", default="0", metavar="N",
                   help="fit the exponents over N and longer only (default: every length)")
    p.add_argument("--wandb", action="store_true", help="also log the plots and tables to wandb")

    one_line_errors(p, "report")
    args = p.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"report: error: {args.sweep_dir}: not a directory", file=sys.stderr)
        return 2
    if not args.fit_from.isascii() or not args.fit_from.isdigit():
        p.error(f"--fit-from must be a sequence length (a whole number >= 0), got {args.fit_from!r}")
    if args.out is not None and not args.out.strip():  # an unset variable: not the current directory
        p.error(f"--out must be a directory path; got {args.out!r}")
    out = Path(args.out) if args.out is not None else args.sweep_dir / REPORT_DIR
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file (it names the report's directory)")
    try:  # a name past the filesystem's limit, an unwritable place: said before any file is made
        check_output_dir(out)
    except ConfigError as err:
        p.error(f"--out: {err}")
    if args.wandb:
        from harness.logger import check_wandb_mode_env, jobs_logger

        try:
            check_wandb_mode_env()
            jobs_logger(args.sweep_dir)  # where it logs: one place, before the report is made
        except ValueError as err:
            p.error(str(err))
    if out.resolve() == args.sweep_dir.resolve():
        p.error(f"--out {out} is SWEEP_DIR itself, whose results.csv a later report would read as one more run "
                f"of each point; allowed: a directory inside it or elsewhere (default SWEEP_DIR/{REPORT_DIR})")
    if (out / "results.jsonl").exists() or ((out / "results.csv").exists() and not (out / "report.html").exists()):
        p.error(f"--out {out} holds results (a results.jsonl, or a results.csv no report wrote), which the "
                f"report's results.csv would replace; choose another directory")
    try:
        rows, tables, images = staged(out, lambda stage: make_report(args.sweep_dir, stage, int(args.fit_from)))
    except (InputError, OSError) as err:  # OSError: e.g. --out is a file or not writable
        print(f"report: error: {err}", file=sys.stderr)
        return 2
    fit_from = int(args.fit_from)
    if fit_from and not any(len({r["seq_len"] for r in s if r["seq_len"] >= fit_from}) >= 2
                            for s in group_series(rows).values()):  # every exponent column empty, unsaid
        print(f"warning: --fit-from {fit_from}: no series has two lengths at N >= {fit_from} (the longest measured: "
              f"{max(r['seq_len'] for r in rows)}), so no exponent was fitted", file=sys.stderr)
    for key in ("crossover", "max_fit", "seeds", "zeros"):
        if tables[key][2] or key not in ("seeds", "zeros"):  # seeds, zeros: only where some point has them
            _print_table(*tables[key])
    print(f"\n{len(rows)} points, {len(images)} plots -> {out / 'report.html'}")
    if args.wandb:
        log_wandb(out, args.sweep_dir, images, rows, tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
