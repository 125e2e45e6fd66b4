"""Loading measured points back from disk, for the report and compare tools.

A harness run writes ``results.jsonl`` (and ``results.csv``) in its output directory; a Hydra multirun
puts each job in its own numbered subdirectory. ``load_rows`` accepts a directory (every
``results.jsonl`` below it; ``results.csv`` only where no jsonl exists, e.g. a report's output
directory) or one ``.jsonl``/``.csv`` file. Rows are dicts with the harness's fixed fields plus
``opt_*`` option fields and optional quality and environment fields; missing fields read as None.

A *point* is one measurement configuration; a *series* is one line in a plot: the point without
``seq_len``. Labels name a series by what distinguishes it, e.g. ``sliding_window[window=256]/blocksparse``.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, NamedTuple

FULL = "full"  # the variant every other one is compared with
STATUSES = ("ok", "oom", "skipped", "error")
CORE_FIELDS = (
    "variant", "backend", "seq_len", "batch_size", "num_heads", "head_dim", "dtype", "device", "causal",
    "status", "reason", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_iqr_ms", "bwd_iqr_ms", "fwd_bwd_iqr_ms",
    "peak_mem_bytes", "peak_mem_abs_bytes", "flops_fwd", "flops_fwd_useful", "tflops_fwd", "density",
    "analytic_mem_bytes",
)
QUALITY_FIELDS = ("out_rel_err", "out_cos", "out_max_abs_err", "grad_rel_err", "mass_kept",
                  "task_accuracy", "task_loss")
# What harness.env records beside each point (plus the timer used); shown once in the report.
ENV_FIELDS = ("device", "device_name", "num_threads", "torch_version", "cuda_version", "cudnn_version",
              "triton_version", "xformers_version", "hostname", "gpu_clocks", "timer", "date")
OPT_PREFIX = "opt_"


class InputError(Exception):
    """Bad input (missing path, no results, unreadable file): the CLIs print it as one line, exit 2."""


# ----- loading -------------------------------------------------------------------------------------

def _natural(path: Path) -> list[Any]:
    """Sort key that puts sweep job 10 after job 9 (and timestamped sweep dirs in time order)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def result_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix not in (".jsonl", ".csv"):
            raise InputError(f"{path}: expected a results .jsonl or .csv file or a directory")
        return [path]
    files = sorted(path.rglob("results.jsonl"), key=_natural)
    if not files:
        files = sorted(path.rglob("results.csv"), key=_natural)
    if not files:
        raise InputError(f"{path}: no results.jsonl or results.csv found under it")
    return files


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object per line")
            rows.append(row)
    return rows


def _parse_cell(text: str) -> Any:
    """CSV cells are strings: give back None, bools and numbers as the jsonl would have them."""
    if text in ("", "None", "null"):
        return None
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text[:1] in "[{":  # lists/dicts written as JSON
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="") as f:
        return [{k: _parse_cell(v) for k, v in row.items() if k is not None} for row in csv.DictReader(f)]


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row under ``path``, deduplicated (the last copy of a point wins). Raises InputError."""
    rows: list[dict[str, Any]] = []
    for file in result_files(path):
        try:
            rows += _read_jsonl(file) if file.suffix == ".jsonl" else _read_csv(file)
        except (OSError, UnicodeDecodeError, csv.Error) as err:
            raise InputError(f"{file}: cannot read ({type(err).__name__}: {err})") from None
    rows = [r for r in rows if r.get("variant") is not None and isinstance(r.get("seq_len"), int)]
    if not rows:
        raise InputError(f"{path}: no result rows (with variant and seq_len) found")
    return dedupe(rows)


def dedupe(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    last: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = point_key(row)
        last.pop(key, None)  # re-insert so the order is that of the last copies
        last[key] = row
    return list(last.values())


# ----- keys and labels -----------------------------------------------------------------------------

def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def options(row: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The row's variant options, without the prefix; None-valued ones dropped (absent == null)."""
    return tuple(sorted((k[len(OPT_PREFIX):], _hashable(v)) for k, v in row.items()
                        if k.startswith(OPT_PREFIX) and k != "opt_backend" and v is not None))


class Series(NamedTuple):
    variant: str
    backend: str | None
    opts: tuple[tuple[str, Any], ...]
    causal: Any
    dtype: Any
    device: Any
    shape: tuple[Any, Any, Any]  # (batch_size, num_heads, head_dim): a sweep may vary them too


def series_key(row: dict[str, Any]) -> Series:
    return Series(row.get("variant"), row.get("backend"), options(row), row.get("causal"),
                  row.get("dtype"), row.get("device"),
                  (row.get("batch_size"), row.get("num_heads"), row.get("head_dim")))


def point_key(row: dict[str, Any]) -> tuple:
    return (*series_key(row), row.get("seq_len"))


def compare_key(row: dict[str, Any]) -> tuple:
    """point_key without the device, so a CPU run can be matched with a GPU run."""
    s = series_key(row)
    return (*s._replace(device=None), row.get("seq_len"))


def series_labels(keys: Iterable[Series]) -> dict[Series, str]:
    """Readable, unique labels: variant[options that differ within the variant]/backend, then the
    causal/dtype/device/shape suffixes only where those differ between the series shown."""
    keys = list(dict.fromkeys(keys))
    by_variant: dict[str, list[Series]] = defaultdict(list)
    for k in keys:
        by_variant[k.variant].append(k)
    differs = {f: len({getattr(k, f) for k in keys}) > 1 for f in ("causal", "dtype", "device", "shape")}
    labels = {}
    for variant, ks in by_variant.items():
        opt_dicts = [dict(k.opts) for k in ks]
        names = sorted({n for d in opt_dicts for n in d})
        shown = [n for n in names if len({d.get(n) for d in opt_dicts}) > 1]
        for k, d in zip(ks, opt_dicts):
            label = variant
            if shown:
                label += "[" + ",".join(f"{n}={d.get(n)}" for n in shown) + "]"
            if k.backend is not None:
                label += f"/{k.backend}"
            if differs["causal"]:
                label += " causal" if k.causal else " non-causal"
            if differs["dtype"]:
                label += f" {k.dtype}"
            if differs["device"]:
                label += f" @{k.device}"
            if differs["shape"]:
                label += " B={},H={},D={}".format(*k.shape)
            labels[k] = label
    seen: dict[str, int] = defaultdict(int)  # belt and braces: never two series with one label
    for k in keys:
        seen[labels[k]] += 1
        if seen[labels[k]] > 1:
            labels[k] += f" #{seen[labels[k]]}"
    return labels


def group_series(rows: Iterable[dict[str, Any]]) -> dict[Series, list[dict[str, Any]]]:
    """Series -> its rows sorted by seq_len."""
    groups: dict[Series, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[series_key(row)].append(row)
    return {k: sorted(v, key=lambda r: r["seq_len"]) for k, v in groups.items()}


# ----- values and tables ---------------------------------------------------------------------------

def number(v: Any) -> float | None:
    """A finite float, or None (null, missing, strings, bools, NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def ok_value(row: dict[str, Any], metric: str) -> float | None:
    return number(row.get(metric)) if row.get("status") == "ok" else None


def columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Core fields first, then options, quality, and whatever else the rows carry (environment)."""
    seen = list(dict.fromkeys(k for r in rows for k in r))
    opts = [k for k in seen if k.startswith(OPT_PREFIX)]
    known = set(CORE_FIELDS) | set(QUALITY_FIELDS) | set(opts)
    return ([k for k in CORE_FIELDS if k in seen] + opts + [k for k in QUALITY_FIELDS if k in seen]
            + [k for k in seen if k not in known])


def environment_fields(rows: list[dict[str, Any]]) -> list[str]:
    """The fields that describe the machine and software (device name, versions...), where present."""
    cols = columns(rows)
    return [c for c in cols if c in ENV_FIELDS or c.endswith("_version")]


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    cols = columns(rows)

    def cell(v: Any) -> Any:
        return "" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else v

    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows([cell(r.get(c)) for c in cols] for r in rows)
