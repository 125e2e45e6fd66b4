"""Series of measured points, for the report and compare tools.

Rows come from ``harness.results`` (``load_rows``: every results.jsonl under a directory, checked, one
row per point). A *point* is one measurement configuration (``results.point_key``); a *series* is one
line in a plot: the point without ``seq_len`` (``results.series_key``). Labels name a series by what
distinguishes it, e.g. ``sliding_window[window=256]/blocksparse``, ``full/sdpa seed=1``,
``full/sdpa task.seed=1``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from harness.results import (OPT_PREFIX, STATUSES, TASK_OPT_PREFIX, InputError, Series, load_rows,  # noqa: F401
                             point_key, series_key, write_csv)

FULL = "full"  # the variant every other one is compared with
CORE_FIELDS = (
    "variant", "backend", "seq_len", "batch_size", "num_heads", "head_dim", "dtype", "device", "causal",
    "seed", "inputs", "fidelity_batch_size", "task", "param_grads", "status", "reason", "noisy", "noise_reasons",
    "noisy_passes",
    "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_iqr_ms", "bwd_iqr_ms", "fwd_bwd_iqr_ms", "peak_mem_bytes",
    "peak_mem_abs_bytes", "flops_fwd", "flops_fwd_useful", "tflops_fwd", "density", "analytic_mem_bytes",
)
QUALITY_FIELDS = ("out_rel_err", "out_cos", "out_max_abs_err", "grad_rel_err", "mass_kept",
                  "task_accuracy", "task_loss")
# What harness.env records beside each point (plus the timer used); shown once in the report.
ENV_FIELDS = ("device", "device_name", "num_threads", "torch_version", "cuda_version", "cudnn_version",
              "triton_version", "xformers_version", "hostname", "gpu_clocks", "timer", "date")


def compare_key(row: dict[str, Any]) -> tuple:
    """point_key without the device, so a CPU run can be matched with a GPU run."""
    s = series_key(row)
    return (*s._replace(device=None), row.get("seq_len"))


def series_labels(keys: Iterable[Series]) -> dict[Series, str]:
    """Readable, unique labels: variant[options that differ within the variant]/backend, then the
    causal/dtype/device/shape/seed suffixes only where those differ between the series shown, and the task
    settings that differ within the variant (``task.seed=1``)."""
    keys = list(dict.fromkeys(keys))
    by_variant: dict[str, list[Series]] = defaultdict(list)
    for k in keys:
        by_variant[k.variant].append(k)
    differs = {f: len({getattr(k, f) for k in keys}) > 1
               for f in ("causal", "dtype", "device", "shape", "seed", "inputs", "fidelity_batch_size", "task",
                         "param_grads")}
    labels = {}
    for variant, ks in by_variant.items():
        # What takes two values within the variant, shown where a series sets it: sparse[pattern=fixed]
        # and sparse[pattern=bigbird], not every option of the other pattern as None. Task settings among
        # the series that recorded them (rows from before have none: said so, not 17 settings as None).
        opt_dicts, task_dicts = [dict(k.opts) for k in ks], [dict(k.task_opts) for k in ks]
        shown, task_shown = ([n for n in sorted({n for d in dicts for n in d})
                              if len({d[n] for d in dicts if n in d}) > 1] for dicts in (opt_dicts, task_dicts))
        for k, d, t in zip(ks, opt_dicts, task_dicts):
            label = variant
            if any(n in d for n in shown):
                label += "[" + ",".join(f"{n}={d[n]}" for n in shown if n in d) + "]"
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
            for f in ("seed", "inputs", "fidelity_batch_size", "task", "param_grads"):
                if differs[f]:
                    label += f" {f}={getattr(k, f)}"
            if k.task is not None and not t and any(task_dicts):
                label += " task settings unrecorded"
            label += "".join(f" task.{n}={t[n]}" for n in task_shown if n in t)
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
    task_opts = [k for k in seen if k.startswith(TASK_OPT_PREFIX)]
    known = set(CORE_FIELDS) | set(QUALITY_FIELDS) | set(opts) | set(task_opts)
    return ([k for k in CORE_FIELDS if k in seen] + opts + [k for k in QUALITY_FIELDS if k in seen] + task_opts
            + [k for k in seen if k not in known])


def environment_fields(rows: list[dict[str, Any]]) -> list[str]:
    """The fields that describe the machine and software (device name, versions...), where present."""
    cols = columns(rows)
    return [c for c in cols if c in ENV_FIELDS or c.endswith("_version")]
