"""Result rows, the files they go to, and the log-log fit of time and memory against N.

One frozen ``Result`` per (variant, N) point, units in the field names, flat (the variant's options as
``opt_<name>`` columns), so the same record feeds the console table, ``results.jsonl`` (appended and
flushed as each point finishes), ``results.csv`` (rewritten from all rows after each point) and plots.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

STATUSES = ("ok", "oom", "skipped", "error")


@dataclass(frozen=True)
class Result:
    # The point
    variant: str
    backend: str
    backend_ran: str | None  # the kernel that actually ran, where the backend chooses (full's auto)
    seq_len: int
    batch_size: int
    num_heads: int
    head_dim: int
    dtype: str
    device: str
    causal: bool
    seed: int
    status: str  # ok | oom | skipped | error
    reason: str | None  # why a point is not ok (one line)
    # Time: medians and interquartile ranges of one call, and how many samples they come from
    fwd_ms: float | None
    fwd_iqr_ms: float | None
    fwd_samples: int | None
    bwd_ms: float | None
    bwd_iqr_ms: float | None
    bwd_samples: int | None
    fwd_bwd_ms: float | None
    fwd_bwd_iqr_ms: float | None
    fwd_bwd_samples: int | None
    warmup_s: float | None
    timer: str
    # Memory of forward+backward: measured (extra over the inputs; GPU also absolute and reserved) and
    # the variant's analytic estimate of the same extra
    peak_mem_bytes: int | None
    peak_mem_abs_bytes: int | None
    peak_mem_reserved_bytes: int | None
    analytic_mem_bytes: int | None
    # Work: forward FLOPs executed (whole blocks, masked entries) and useful (allowed pairs); backward is
    # counted as 2.5x forward, forward+backward as 3.5x
    flops_fwd: int | None
    flops_fwd_useful: int | None
    tflops_fwd: float | None
    tflops_fwd_useful: float | None
    tflops_bwd: float | None
    tflops_bwd_useful: float | None
    tflops_fwd_bwd: float | None
    tflops_fwd_bwd_useful: float | None
    density: float | None  # used score entries / N²
    block_density: float | None  # computed key blocks / all blocks (mask-defined variants only)
    # Fidelity against exact attention, float64 reference on the same q, k, v (harness/fidelity.py)
    inputs: str | None  # gaussian | local | peaked: the distribution of q, k, v for fidelity
    out_rel_err: float | None  # ‖o − o_ref‖ / ‖o_ref‖
    out_cos: float | None  # cosine similarity of o and o_ref
    out_max_abs_err: float | None  # max |o − o_ref|
    grad_rel_err: float | None  # the largest relative L2 error among dq, dk, dv
    mass_kept: float | None  # share of exact softmax mass on allowed pairs (mask-defined variants)
    # Task quality: a small Transformer trained with the variant on MQAR (harness/task.py)
    task: str | None  # mqar, or None when no task ran
    task_seq_len: int | None  # the length it was trained at
    task_accuracy: float | None  # final eval accuracy on query positions
    task_loss: float | None  # final eval cross-entropy on query positions
    task_chance_accuracy: float | None  # 1 / num_kv_pairs: guessing a value of the sequence
    task_train_s: float | None
    quality_reason: str | None  # why fidelity or task numbers are missing at an ok point (one line)
    # Environment
    device_name: str
    num_threads: int
    torch_version: str
    cuda_version: str | None
    cudnn_version: int | None
    triton_version: str | None
    xformers_version: str | None
    hostname: str
    other_cpu_cores: float | None  # cores busy with other processes while this point ran (shared machines)
    date: str  # UTC, ISO 8601, when the point finished
    # The variant's options as built (defaults included): ((name, value), ...), written as opt_<name>
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Result":
        """The inverse of ``record``: a row read back from results.jsonl (missing fields become None)."""
        options = tuple((k[len("opt_"):], v) for k, v in rec.items() if k.startswith("opt_"))
        return cls(**{name: rec.get(name) for name in FIELDS}, options=options)

    def record(self) -> dict[str, Any]:
        """The flat form written to JSONL and CSV."""
        row = {f.name: _finite(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "options"}
        row.update({f"opt_{name}": value for name, value in self.options})
        return row


def _finite(x: Any) -> Any:
    """NaN and infinities are not JSON: a non-finite number is written as null (never a crash)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


FIELDS = tuple(f.name for f in dataclasses.fields(Result) if f.name != "options")
BACKWARD_FLOPS_FACTOR = 2.5  # flash-attention's convention


def tflops(flops: int | None, ms: float | None) -> float | None:
    if flops is None or not ms:
        return None
    return flops / (ms * 1e-3) / 1e12


class ResultWriter:
    """Writes ``results.jsonl`` (one object per point, flushed at once) and ``results.csv``.

    ``resume=True`` keeps the rows already in ``results.jsonl`` (``rows`` starts with them) and appends:
    a line cut short by a kill mid-write is dropped first, so the file stays one whole object per line.
    ``resume=False`` moves an existing file aside (``results.jsonl.replaced-<time>``): never deleted."""

    def __init__(self, output_dir: Path, resume: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.output_dir / "results.jsonl"
        self.csv = self.output_dir / "results.csv"
        self.rows: list[Result] = []
        if self.jsonl.exists():
            if resume:
                self.rows = [Result.from_record(r) for r in drop_cut_lines(self.jsonl)]
            else:
                stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
                self.jsonl.rename(self.jsonl.with_name(f"{self.jsonl.name}.replaced-{stamp}"))
        self._file = open(self.jsonl, "a")
        if self.rows:
            write_csv(self.csv, self.rows)

    def add(self, row: Result) -> None:
        self.rows.append(row)
        self._file.write(json.dumps(row.record(), allow_nan=False) + "\n")
        self._file.flush()
        write_csv(self.csv, self.rows)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_csv(path: Path, rows: Sequence[Result]) -> None:
    records = [r.record() for r in rows]
    columns = list(FIELDS)
    for rec in records:  # option columns: the union over rows, in first-seen order
        columns += [c for c in rec if c not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for rec in records:
            writer.writerow({c: "" if rec.get(c) is None else rec[c] for c in columns})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a results.jsonl, whole lines only: a line that does not parse (a SIGKILL can cut
    the last one mid-write) is skipped."""
    return _whole_lines(path)[0]


def drop_cut_lines(path: Path) -> list[dict[str, Any]]:
    """``read_jsonl``, and the file rewritten without a cut line (atomically: a temporary file renamed
    over it), so that appending after it starts on a fresh line."""
    records, dropped = _whole_lines(path)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)
        os.replace(tmp, path)
    return records


def _whole_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    records, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                dropped += 1
    return records, dropped


# ----- log-log fits --------------------------------------------------------------------------------

TIME_METRICS = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x: y ∝ x^slope."""
    return float(np.polyfit(np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(ys, dtype=float)), 1)[0])


def fit_exponents(rows: Iterable[Result | dict], min_seq_len: int = 0,
                  max_seq_len: int | None = None) -> dict[str, Any]:
    """Fitted exponents of time and peak memory against N over the ok points (at least two distinct N),
    each beside the theory: the log-log slope of the analytic forward FLOPs (time) or of the analytic
    memory (memory) over the same N."""
    recs = [r.record() if isinstance(r, Result) else r for r in rows]
    recs = [r for r in recs if r["status"] == "ok" and r["seq_len"] >= min_seq_len
            and (max_seq_len is None or r["seq_len"] <= max_seq_len)]
    fits: dict[str, Any] = {}
    pairs = [(m, m, "flops_fwd") for m in TIME_METRICS] + [("memory", "peak_mem_bytes", "analytic_mem_bytes")]
    for key, measured, analytic in pairs:
        pts = [r for r in recs if _positive(r.get(measured)) and _positive(r.get(analytic))]
        seq_lens = sorted({r["seq_len"] for r in pts})
        if len(seq_lens) < 2:
            continue
        ns = [r["seq_len"] for r in pts]
        fits[key] = {
            "fitted": loglog_slope(ns, [r[measured] for r in pts]),
            "theory": loglog_slope(ns, [r[analytic] for r in pts]),
            "measured": measured,
            "analytic": analytic,
            "seq_lens": seq_lens,
        }
    return fits


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def write_json(path: Path, obj: Any) -> None:
    """Written whole or not at all (a temporary file renamed over ``path``)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
