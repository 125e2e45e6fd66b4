"""The results store: result rows, their one schema and identity, and every read and write of them.

One frozen ``Result`` per point (one variant configuration at one N), units in the field names, flat
(the variant's options as ``opt_<name>`` columns, the task's settings as ``task_opt_<name>``), so the
same record feeds the console, wandb, ``results.jsonl``, ``results.csv`` and the plots. This module is
the only place that reads or writes result files, and the only definition of what makes two rows the
same point (``point_key``).

What the store guarantees (docs/reliability.md lists the faults tried):
- ``results.jsonl`` is append-only: a finished point is appended and flushed to disk before the next
  one starts; rows are never rewritten or deleted. A point measured again (``retry``) appends a new row
  that supersedes the earlier one; both stay in the file, the point counts once (the last row).
- Every line is validated against one schema when read (``row_problem``). A line that fails (cut by a
  kill, joined with the next, garbage, a row without ``status`` or with a string ``seq_len``) is moved
  verbatim to ``results.jsonl.damaged-<time>`` with one warning naming its line numbers, and its point
  is measured again; every whole row found inside a damaged line (a cut line joined to the next, two
  rows whose newline was lost) is kept.
- ``resume=false`` moves results.jsonl aside (``results.jsonl.replaced-<time>``, with ``-2``, ``-3``...
  where a move in the same second took that name), never deleting it and never renaming over a file.
- One writer per output directory: an exclusive lock (``harness.lock``) held for the whole run; a second
  run refuses in one line naming the holder; a lock left by a process that is gone is taken over.
- Every other file (``results.csv``, ``status.json``, ``env.json``, ``fit.json``) is written whole or not
  at all: a temporary file in the same directory, fsynced, renamed over the old one.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import fcntl
import io
import json
import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Protocol, Sequence

import numpy as np

from .config import INT64_MAX, PASSES, utf8
from .logger import RUN_STATE, RunState
from .signals import interrupts_deferred

STATUSES = ("ok", "oom", "skipped", "error", "nonfinite")
# The multirun a job belongs to: set by the multirun (harness.hydra_hooks), inherited by its jobs' processes
# (joblib's, submitit's, SLURM's), kept in each job's status.json
MULTIRUN_ENV = "HARNESS_MULTIRUN"
SLOW = "measure.max_call_s"  # in the reason of a point skipped because its call was predicted too slow
OPT_PREFIX = "opt_"
TASK_OPT_PREFIX = "task_opt_"


@dataclass(frozen=True)
class Result:
    # The point
    variant: str
    backend: str
    backend_ran: str | None  # the kernel that actually ran, where the backend chooses (full's sdpa and auto)
    seq_len: int
    batch_size: int
    tokens_per_batch: int | None  # set when B was tokens_per_batch // N (FA-2's shape: fixed tokens per batch)
    num_heads: int
    head_dim: int
    dtype: str
    device: str
    causal: bool
    seed: int
    # measure.param_grads where the variant has parameters (linear's E, F; adaptive_span's z): whether the
    # timed passes also took their gradients. None: it has none (the setting changes nothing)
    param_grads: bool | None
    status: str  # ok | oom | skipped | error | nonfinite
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
    setup_s: float | None  # the variant's prepare before the warm-up: BlockMask, dense mask, engine plan on the device
    warmup_s: float | None  # the warm-up calls: compilation, autotuning, first calls
    timer: str | None
    # Whether the timings can be trusted: noisy with its reasons (spread, others' load, forward slower
    # than forward+backward, too few samples), and how many times the point was measured (on_noise=retry)
    noisy: bool | None
    noise_reasons: str | None
    # The passes (fwd, bwd, fwd_bwd) whose timings those reasons make untrusted: a pass's own spread or
    # samples name it alone; others' load, or a forward slower than forward+backward, every timed pass.
    # [] where none; absent on rows from before 2026-11-27 (``noisy_passes`` reads their reasons)
    noisy_passes: list | None
    tries: int | None
    # Memory of forward+backward: measured (extra over the inputs; GPU also absolute and reserved) and
    # the variant's analytic estimate of the same extra
    peak_mem_bytes: int | None
    peak_mem_abs_bytes: int | None
    peak_mem_reserved_bytes: int | None
    analytic_mem_bytes: int | None
    # Sequence parallelism (ring, ulysses; None in one process): the ranks, the backend of their group,
    # each rank's peak (peak_mem_bytes is the largest) and the bytes each rank sent in one forward+backward.
    # The times are the slowest rank's (harness/distributed.py)
    world_size: int | None
    dist_backend: str | None  # gloo | nccl
    peak_mem_per_rank_bytes: list | None
    bytes_sent_per_rank: list | None
    # Work: forward FLOPs executed (whole blocks, masked entries) and useful (allowed pairs); backward is
    # counted as 2.5x forward, forward+backward as 3.5x, for every backend (FlashAttention's convention:
    # a backward that recomputes the scores; one that keeps them executes 2x: docs/measurement.md)
    flops_fwd: int | None
    flops_fwd_useful: int | None
    tflops_fwd: float | None
    tflops_fwd_useful: float | None
    tflops_bwd: float | None
    tflops_bwd_useful: float | None
    tflops_fwd_bwd: float | None
    tflops_fwd_bwd_useful: float | None
    density: float | None  # used score entries / N²
    block_density: float | None  # the layout's allowed key blocks / nb² (mask-defined variants only)
    # Fidelity against exact attention, float64 reference on the same q, k, v (harness/quality/fidelity.py)
    inputs: str | None  # gaussian | local | peaked: the distribution of q, k, v for fidelity
    fidelity_batch_size: int | None  # B of those q, k, v (fidelity.batch_size); None where fidelity is off
    out_rel_err: float | None  # ‖o − o_ref‖ / ‖o_ref‖
    out_cos: float | None  # cosine similarity of o and o_ref
    out_max_abs_err: float | None  # max |o − o_ref|
    grad_rel_err: float | None  # the largest relative L2 error among dq, dk, dv
    mass_kept: float | None  # share of exact softmax mass on allowed pairs (mask-defined variants)
    # Task quality: a small Transformer trained with the variant on MQAR (harness/quality/task.py)
    task: str | None  # mqar, or None when no task ran
    task_seq_len: int | None  # the length it was trained at
    task_accuracy: float | None  # final eval accuracy on query positions
    task_loss: float | None  # final eval cross-entropy on query positions
    task_no_recall_accuracy: float | None  # the eval set's best without recall (each query answered with its
    # sequence's most frequent value); rows from before 2026-11-25 have task_chance_accuracy (1/P) instead
    task_train_s: float | None
    quality_reason: str | None  # why fidelity or task numbers are missing at an ok point (one line)
    # Environment
    device_name: str | None
    num_threads: int | None
    torch_version: str | None
    cuda_version: str | None
    cudnn_version: int | None
    triton_version: str | None
    xformers_version: str | None
    hostname: str | None
    code_version: str | None  # the harness's git commit, "+dirty" with local changes (harness/env.py)
    other_cpu_cores: float | None  # cores busy with other processes while this point was timed
    date: str | None  # UTC, ISO 8601, when the point finished
    # The variant's options as built (defaults included): ((name, value), ...), written as opt_<name>
    options: tuple[tuple[str, Any], ...] = ()
    # The task's settings (harness.quality.task_options: every MQARConfig field that can change its
    # numbers, seq_len as configured), written as task_opt_<name>; () when no task ran
    task_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Result":
        """The inverse of ``record``: a row read back from results.jsonl (missing fields become None)."""
        def prefixed(prefix: str) -> tuple[tuple[str, Any], ...]:
            return tuple((k[len(prefix):], v) for k, v in rec.items() if k.startswith(prefix))

        return cls(**{name: rec.get(name) for name in FIELDS}, options=prefixed(OPT_PREFIX),
                   task_options=prefixed(TASK_OPT_PREFIX))

    def record(self) -> dict[str, Any]:
        """The flat form written to JSONL and CSV: plain JSON values only."""
        row = {name: _plain(getattr(self, name)) for name in FIELDS}
        for prefix, pairs in ((OPT_PREFIX, self.options), (TASK_OPT_PREFIX, self.task_options)):
            row.update({f"{prefix}{name}": _plain(value) for name, value in pairs})
        return row


def _plain(x: Any) -> Any:
    """A plain JSON value: NaN and infinities become null (not JSON), subclasses of str/int/float
    (torch's TorchVersion is a str) their base type, so a row read back equals the row written and
    wandb's tables see one type per column, and text UTF-8 (``utf8``)."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, str):
        return utf8(str(x))
    if isinstance(x, int):
        return int(x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


FIELDS = tuple(f.name for f in dataclasses.fields(Result) if f.name not in ("options", "task_options"))
BACKWARD_FLOPS_FACTOR = 2.5  # flash-attention's convention


def tflops(flops: int | None, ms: float | None) -> float | None:
    if flops is None or not ms:
        return None
    return flops / (ms * 1e-3) / 1e12


# ----- the one schema and the one identity ---------------------------------------------------------

# What says which measurement a row is: these fields, the variant's options (opt_*), the task's settings
# (task_opt_*), param_grads and fidelity_batch_size. Two rows with equal keys are the same point: a rerun
# skips it, the report draws them as one point. Whatever changes the numbers is part of it (seeds, inputs,
# the task's training settings), so a sweep over any of them is several series, never one whose last value
# wins or, on resume, a stored point returned for a different setting.
IDENTITY_FIELDS = ("variant", "backend", "seq_len", "batch_size", "num_heads", "head_dim", "dtype", "device",
                   "causal", "seed", "inputs", "task")
REQUIRED = tuple(f for f in IDENTITY_FIELDS if f not in ("inputs", "task")) + ("status",)
_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "list": (list,)}


def _schema() -> dict[str, tuple[tuple[type, ...], bool]]:
    """field -> (accepted types, may be null), read from Result's annotations: one definition."""
    schema = {}
    for f in dataclasses.fields(Result):
        if f.name in ("options", "task_options"):
            continue
        names = [t.strip() for t in str(f.type).split("|")]
        schema[f.name] = (tuple(t for n in names if n != "None" for t in _TYPES[n]), "None" in names)
    return schema


SCHEMA = _schema()
# A time, a spread, a count or a size below zero is no measurement (a negative spread broke the report's
# error bars), and a time of zero none either (it would pass for the fastest)
NON_NEGATIVE = tuple(k for k in SCHEMA if k.endswith(("_ms", "_samples")) or "bytes" in k or "flops" in k or k == "tries")
POSITIVE = tuple(k for k in NON_NEGATIVE if k.endswith("_ms") and not k.endswith("_iqr_ms"))


SURROGATE = re.compile("[\ud800-\udfff]")


def row_problem(row: Any) -> str | None:
    """Why ``row`` is not a result row (one short phrase), or None when it is one."""
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    missing = [f for f in REQUIRED if row.get(f) is None]
    if missing:
        return f"no {', '.join(missing)}"
    for name, (types, nullable) in SCHEMA.items():
        v = row.get(name)
        if v is None:
            if not nullable and name in row:
                return f"{name} is null"
            continue
        if isinstance(v, bool) and bool not in types or not isinstance(v, types):
            return f"{name}={v!r} is not {' or '.join(t.__name__ for t in types)}"
    for k, v in row.items():  # every field, and what a list or an object in it holds: NaN, infinities...
        if problem := _unwritable(k):
            return f"a field's name {ascii(k)} {problem}"  # ascii: the message itself must be writable
        if problem := _unwritable(v):
            return f"{k} {problem}"
    for name in NON_NEGATIVE:  # the types are checked above; a list's items are numbers or null
        values = row.get(name) if isinstance(row.get(name), list) else [row.get(name)]
        low = [x for x in values if isinstance(x, (int, float)) and (x <= 0 if name in POSITIVE else x < 0)]
        if low:
            return f"{name}={low[0]!r} is {'not > 0' if name in POSITIVE else 'negative'}"
    if row["status"] not in STATUSES:
        return f"status {row['status']!r} is not one of {', '.join(STATUSES)}"
    if row["seq_len"] <= 0:
        return f"seq_len={row['seq_len']} is not > 0"
    return None


def _unwritable(v: Any) -> str | None:
    """Why a value (a field's name, or its value, searched through lists and objects) cannot be kept, or
    None. A row is written again as JSON when damaged lines are moved aside and as results.csv after
    every point: NaN and infinities are not JSON; a lone surrogate (JSON's "\\udcff" escape) is no text,
    which neither the csv nor the console can take; an integer past int64 (JSON has no limit) overflows
    a float, numpy and wandb, and no measurement is one."""
    if isinstance(v, float) and not math.isfinite(v):
        return "is not finite"
    if isinstance(v, str) and SURROGATE.search(v):
        return "holds a lone surrogate (not UTF-8 text)"
    if isinstance(v, int) and not isinstance(v, bool) and not -INT64_MAX - 1 <= v <= INT64_MAX:
        return "is past a 64-bit integer"
    inner = [*v.keys(), *v.values()] if isinstance(v, dict) else v if isinstance(v, list) else []
    return next((p for p in map(_unwritable, inner) if p), None)


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def options_of(row: dict[str, Any], prefix: str = OPT_PREFIX) -> tuple[tuple[str, Any], ...]:
    """The row's variant options (or, with TASK_OPT_PREFIX, its task's settings) without the prefix,
    sorted; null ones dropped (absent == null), and the variant's backend, which is its own field."""
    return tuple(sorted((k[len(prefix):], _hashable(v)) for k, v in row.items()
                        if k.startswith(prefix) and k != f"{OPT_PREFIX}backend" and v is not None))


class Series(NamedTuple):
    """One line in a plot: a point without its N."""

    variant: str
    backend: str | None
    opts: tuple[tuple[str, Any], ...]
    causal: Any
    dtype: Any
    device: Any
    shape: tuple[Any, Any, Any]  # (B, num_heads, head_dim): a sweep may vary them too; B is batch_size,
    # or "<tokens>/N" for a fixed number of tokens per batch (one series whose B falls as N grows)
    seed: Any = 0
    inputs: Any = None
    task: Any = None
    task_opts: tuple[tuple[str, Any], ...] = ()
    param_grads: bool = False  # absent (rows from before the field, variants without parameters): False
    fidelity_batch_size: Any = None  # None where inputs is set (rows from before the field): 1, the default


def series_key(row: dict[str, Any]) -> Series:
    # A row from before fidelity_batch_size has none, read back absent or as null (from_record, CSV): its
    # fidelity ran at the default, 1. A null is otherwise only where fidelity is off, and inputs null too.
    fidelity_batch = row.get("fidelity_batch_size")
    if fidelity_batch is None and row.get("inputs") is not None:
        fidelity_batch = 1
    return Series(row.get("variant"), row.get("backend"), options_of(row), row.get("causal"), row.get("dtype"),
                  row.get("device"), (batch_label(row), row.get("num_heads"), row.get("head_dim")),
                  row.get("seed"), row.get("inputs"), row.get("task"), options_of(row, TASK_OPT_PREFIX),
                  bool(row.get("param_grads")), fidelity_batch)


def batch_label(row: dict[str, Any]) -> Any:
    tokens = row.get("tokens_per_batch")
    return row.get("batch_size") if tokens is None else f"{tokens}/N"


def point_key(row: dict[str, Any]) -> tuple:
    """The identity of a point (IDENTITY_FIELDS, the options, the task's settings, param_grads and
    fidelity_batch_size): the one definition, used to resume, to count and to draw."""
    return (*series_key(row), row.get("seq_len"))


def machine(row: dict[str, Any]) -> tuple[Any, Any]:
    """The machine a row's time and memory peak belong to: (device_name, num_threads) on CPU, (GPU name,
    None) on a GPU. A resumed run measures again what another machine measured (harness.run.lacking)."""
    return row.get("device_name"), row.get("num_threads") if row.get("device") == "cpu" else None


def machine_name(row: dict[str, Any]) -> str:
    """``machine(row)`` in words: "Intel(R) Xeon(R) Processor (2 threads)", "NVIDIA H100 80GB HBM3"."""
    name, threads = machine(row)
    return f"{name}{f' ({threads} threads)' if threads else ''}"


def latest(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point: the last one (a re-measured point supersedes its earlier rows), in the order
    of those last rows."""
    last: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = point_key(row)
        last.pop(key, None)
        last[key] = row
    return list(last.values())


# ----- reading -------------------------------------------------------------------------------------

class InputError(Exception):
    """Bad input to the reading tools (missing path, no results): the CLIs print it as one line, exit 2."""


@dataclass
class Damaged:
    lineno: int
    text: str  # the line verbatim, without its newline
    problem: str


@dataclass
class Contents:
    """A results.jsonl read and checked: its valid rows in file order, the damaged lines, and the rows
    recovered from inside damaged lines (a cut line joined to the next one)."""

    rows: list[dict[str, Any]]
    damaged: list[Damaged]
    recovered: list[int]  # the line number of each whole row found inside a damaged line, kept in ``rows``

    def warning(self, path: Path) -> str | None:
        if not self.damaged:
            return None
        lines = ", ".join(f"{d.lineno} ({d.problem})" for d in self.damaged[:8])
        more = f" and {len(self.damaged) - 8} more" if len(self.damaged) > 8 else ""
        n, where = len(self.recovered), ", ".join(map(str, dict.fromkeys(self.recovered)))
        kept = f"; {'a whole row' if n == 1 else f'{n} whole rows'} inside line(s) {where} kept" if n else ""
        return f"{path}: damaged line(s) {lines}{more}{kept}"


UNDECODABLE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of bytes that are not UTF-8


def integral_ints(row: Any) -> Any:
    """A result row with each integral float in an int field as an int, as a CSV cell is read: pandas
    writes an int column that holds a null as floats ("seq_len": 4096.0), which is no damage."""
    if not isinstance(row, dict):
        return row
    return {k: int(v) if isinstance(v, float) and v.is_integer() and SCHEMA.get(k, ((),))[0] == (int,) else v
            for k, v in row.items()}


def parse_jsonl(text: str, check: Callable[[Any], str | None] | None = None) -> Contents:
    """``check``: why a parsed line is not a row (default ``row_problem``: a result row, its integral floats
    in int fields read as ints)."""
    read = integral_ints if check is None else lambda row: row
    check = check or row_problem
    rows, damaged, recovered = [], [], []
    # Lines end at "\n" only: str.splitlines would also split at U+2028, U+0085 or \x1c inside a JSON
    # string (valid there), making one good row two damaged lines
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = read(json.loads(line))
            problem = "not UTF-8" if UNDECODABLE.search(line) else check(row)  # read with surrogateescape
        except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            row, problem = None, f"not JSON ({getattr(err, 'msg', type(err).__name__)})"
        if problem is None:
            rows.append(row)
            continue
        damaged.append(Damaged(lineno, line, problem))
        inner = _rows_inside(line, check, read)
        rows += inner
        recovered += [lineno] * len(inner)
    return Contents(rows, damaged, recovered)


def _rows_inside(line: str, check: Callable[[Any], str | None], read: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """The whole valid rows inside a damaged line, in order: the rows it starts with, one after another
    (rows whose newline was lost), and the rows it ends with (a line cut mid-write, then joined with the
    next rows: the next append started without a newline). Never an object nested in a row."""
    decoder = json.JSONDecoder()

    def whole(start: int) -> tuple[Any, int] | None:
        try:
            row, stop = decoder.raw_decode(line, start)
        except (ValueError, RecursionError):
            return None
        row = read(row)
        return None if UNDECODABLE.search(line, start, stop) or check(row) is not None else (row, stop)

    def run_of_rows(start: int) -> tuple[list[Any], int]:
        """The rows one after another from ``start``, and where they stop."""
        rows, at = [], start
        while at < len(line) and (found := whole(at)) is not None:
            rows.append(found[0])
            at = found[1]
        return rows, at
    rows, end = run_of_rows(0)
    for start in (m.start() for m in re.finditer(r"\{", line) if m.start() > end):
        tail, stop = run_of_rows(start)
        if tail and stop == len(line):  # rows that end the line: appended after the cut, not nested in it
            return rows + tail
    return rows


def read_text(path: str | Path) -> str:
    """A results file's text; bytes that are not UTF-8 kept as they are (errors="surrogateescape"), so one
    bad line is flagged by its reader (``UNDECODABLE``: "not UTF-8") instead of refusing the whole file."""
    return Path(path).read_text(errors="surrogateescape")


def read_jsonl(path: str | Path, check: Callable[[Any], str | None] | None = None) -> list[dict[str, Any]]:
    """The valid rows of a results.jsonl in file order (damaged lines left out: ``parse_jsonl`` says which);
    ``check`` for another kind of row (default: a result row)."""
    return parse_jsonl(read_text(path), check).rows


_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")  # a JSON number: never "nan", "1_0"


def _parse_cell(name: str, text: str | None) -> Any:
    """A CSV cell (a string) as the jsonl would have it, by its field's type in the Result schema: a text
    field stays text (a hostname "1234", a reason "nan", a code_version of twelve digits); a number, bool or
    list field is parsed as one (an integral float such as "1024.0" in an int field: an int). A cell that
    does not parse as its field's type stays text, so ``row_problem`` names it. Fields outside the schema
    (options, task settings, gpu_clocks): JSON numbers, bools and lists as such, anything else text.
    An empty cell is null."""
    if text is None or text == "":
        return None
    types = SCHEMA[name][0] if name in SCHEMA else None
    if types == (str,):
        return text
    if text in ("None", "null"):
        return None
    if text in ("True", "true", "False", "false"):
        return text in ("True", "true") if types is None or bool in types else text
    if types is None:  # what the field holds is not known: JSON's own literals only
        if _NUMBER.fullmatch(text):
            return json.loads(text)
    elif float in types or int in types:
        for cast in (int, float):
            try:
                value = cast(text)
            except ValueError:
                continue
            integral = isinstance(value, float) and float not in types and value.is_integer()
            return int(value) if integral else value
    if text[:1] in "[{" and (types is None or list in types):  # lists/dicts written as JSON
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def parse_csv(text: str) -> Contents:
    """A results.csv checked as ``parse_jsonl`` checks a results.jsonl: each row's cells by their field's
    type (``_parse_cell``); a row that is not a result row (``row_problem``) or holds bytes that are not
    UTF-8 is a damaged line, left out and named. A file csv cannot read (a cell past its field size limit,
    128 KiB: no row the harness writes) is damaged whole."""
    rows, damaged = [], []
    lines = text.split("\n")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    end = 1  # the header
    try:
        for raw in reader:
            start, end = end + 1, reader.line_num
            row = {k: _parse_cell(k, v) for k, v in raw.items() if k is not None}
            verbatim = "\n".join(lines[start - 1:end]).rstrip("\r")
            # DictReader fills the cells a row lacks with None, and gathers the cells past the header under
            # the key None: a row cut short would read as one with empty cells, a row joined to the next as
            # the first
            cells = sum(v is not None for k, v in raw.items() if k is not None) + len(raw.get(None, []))
            problem = ("not UTF-8" if UNDECODABLE.search(verbatim) else
                       f"{cells} cells, the header has {len(reader.fieldnames or ())}"
                       if None in raw or None in raw.values() else row_problem(row))
            if problem is None:
                rows.append(row)
            else:
                damaged.append(Damaged(end, verbatim, problem))
    except csv.Error as e:
        return Contents([], [Damaged(reader.line_num, "", f"not a CSV the harness writes ({e})")], [])
    return Contents(rows, damaged, [])


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The valid rows of a results.csv (damaged ones left out: ``parse_csv`` says which)."""
    return parse_csv(read_text(path)).rows


def _natural(path: Path) -> list[Any]:
    """Sort key that puts sweep job 10 after job 9 (and timestamped sweep dirs in time order)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


REPORT_DIR = "report"  # harness.report's output folder, by default, inside the directory it reads


def report_output(file: Path, root: Path) -> bool:
    """Whether ``file``, found under ``root``, is harness.report's own output, never its input: a
    results.csv (the one results file it writes) inside a folder named ``report`` below ``root`` (its
    default ``--out``) or beside a report.html (another ``--out``). A report folder given as ``root`` itself
    is read; a run's results.jsonl is read wherever it is, a folder named ``report`` too."""
    parent = Path(file).parent
    return Path(file).name == "results.csv" and parent != Path(root) and (
        REPORT_DIR in parent.relative_to(root).parts or (parent / "report.html").exists())


def result_files(path: str | Path) -> list[Path]:
    """A results file, or every results.jsonl under a directory (results.csv where there is none), the
    report's own output left out (``report_output``)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix not in (".jsonl", ".csv"):
            raise InputError(f"{path}: expected a results .jsonl or .csv file or a directory")
        return [path]
    for name in ("results.jsonl", "results.csv"):
        files = sorted((f for f in path.rglob(name) if not report_output(f, path)), key=_natural)
        if files:
            return files
    raise InputError(f"{path}: no results.jsonl or results.csv found under it")


def read_files(path: str | Path, warn=None) -> list[tuple[Path, list[dict[str, Any]]]]:
    """Each results file under ``path`` (``result_files``) with its valid rows in file order. Damaged lines
    (or CSV rows) are left out with one notice per file naming them and why; nothing is modified. Raises
    InputError, also where no file holds a row."""
    warn = warn or _stderr
    notices: list[str] = []
    read = []
    files = result_files(path)
    for file in files:
        try:
            contents = (parse_jsonl if file.suffix == ".jsonl" else parse_csv)(read_text(file))
        except (OSError, csv.Error) as err:
            raise InputError(f"{file}: cannot read ({type(err).__name__}: {err})") from None
        if contents.damaged:
            notices.append(f"{contents.warning(file)}: {len(contents.damaged)} line(s) left out")
        read.append((file, contents.rows))
    if not any(rows for _, rows in read):
        raise InputError(f"{path}: no result rows found" + (f" ({notices[0]})" if notices else ""))
    if Path(path).is_dir() and all(f.name == "results.jsonl" for f in files):
        # the jsonl files are read, so a results.csv with no jsonl beside it is not: a table combined from
        # others (bench_cpu's), or the only file of a run
        unread = sorted(f for f in Path(path).rglob("results.csv")
                        if not (f.parent / "results.jsonl").exists() and not report_output(f, path))
        if unread:
            notices.append(f"{path}: {len(unread)} results.csv without a results.jsonl beside it not read (e.g. "
                           f"{unread[0]}): the results.jsonl files here are; give the report such a "
                           f"directory on its own to read its results.csv")
    for notice in notices:
        warn(notice)
    return read


def load_rows(path: str | Path, warn=None) -> list[dict[str, Any]]:
    """One row per point under ``path``, for the report and compare tools: a point measured again within a
    results file is its last row there; a point in several results files (runs: a sweep repeated into
    other directories, bench_cpu's rounds) is its median run (``median_run``), or its last row where the
    runs are of several machines. Each case is said in one notice. Damaged lines are left out
    (``read_files``). Raises InputError."""
    warn = warn or _stderr
    rows: list[dict[str, Any]] = []
    runs_of: dict[tuple, list[dict[str, Any]]] = {}  # point -> its last row in each file holding it
    files_of: dict[tuple, list[Path]] = {}  # point -> those files
    # point -> the machines its runs' timed rows were measured on (a row measured again in its file is no
    # run: a point timed on A, then again on B, is B's)
    machines_of: dict[tuple, set[str]] = {}
    for file, found in read_files(path, warn):
        for row in latest(found):
            key = point_key(row)
            runs_of.setdefault(key, []).append(row)
            files_of.setdefault(key, []).append(file)
            if any(row.get(m) is not None for m in (*TIME_METRICS, "peak_mem_bytes")):
                machines_of.setdefault(key, set()).add(machine_name(row))
        rows += found
    # A point in two files is two runs of it (jobs that differ only in a setting outside the identity,
    # e.g. measure.timer; a sweep run again; or two machines): not a re-measurement, and not to be hidden
    # as one. Runs of one machine stand for each other; two machines' do not.
    mixed = {key for key, ms in machines_of.items() if len(ms) > 1}
    points = [median_run(runs_of[key]) if key not in mixed else runs_of[key][-1]
              for key in map(point_key, latest(rows))]
    if mixed:  # the point's time and memory belong to the machine of its last row only
        names = ", ".join(sorted({m for key in mixed for m in machines_of[key]}))
        warn(f"{path}: {len(mixed)} point(s) were timed on more than one machine ({names}); each is drawn from "
             f"its last row, so a series can mix machines. Give the report one machine's results")
    warn_mixed_code(path, points, warn)
    shared = [files for key, files in files_of.items() if len(files) > 1 and key not in mixed]
    if shared:
        warn(f"{path}: {len(shared)} point(s) are in more than one results file (e.g. "
             f"{' and '.join(str(f.parent) for f in shared[0][:2])}: repeated runs, or runs that differ only in "
             f"a setting that is not part of a point); each is drawn from its median run by forward+backward "
             f"time (harness.report.compare pools them)")
    again = len(rows) - sum(len(runs) for runs in runs_of.values())
    if again > 0:
        warn(f"{path}: {again} row(s) are earlier measurements of a point measured again; the last measurement "
             f"of each point is used")
    return points


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run that stands for a point measured in several (its rows in several results files, or
    bench_cpu's rounds): the ok run with the median forward+backward time (the lower of the middle two)
    among those whose forward+backward is not noisy, among every ok one where each is; the last run
    where none is ok with that time. A whole row, so that its times, spreads, memory and environment are
    one measurement's."""
    ok = [r for r in runs if r.get("status") == "ok" and r.get("fwd_bwd_ms") is not None]
    if not ok:
        return runs[-1]
    calm = [r for r in ok if not untrusted(r, "fwd_bwd_ms")] or ok
    return sorted(calm, key=lambda r: r["fwd_bwd_ms"])[(len(calm) - 1) // 2]


def warn_mixed_code(path: str | Path, rows: list[dict[str, Any]], warn=None) -> None:
    """One notice where a series' rows under ``path`` were measured by more than one code version."""
    versions_of: dict[Series, set[str]] = {}  # series -> the code versions of its points' rows
    for r in rows:
        versions_of.setdefault(series_key(r), set()).add(str(r.get("code_version")))
    mixed_code = [v for v in versions_of.values() if len(v) > 1]
    if mixed_code:  # a resumed run keeps the points measured before a change of code
        (warn or _stderr)(f"{path}: {len(mixed_code)} series mix code versions "
                          f"({', '.join(sorted(set().union(*mixed_code)))}): a resumed run keeps the points measured "
                          f"before; resume=false (or a new directory) measures a series with one")


def _stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# ----- writing -------------------------------------------------------------------------------------

def atomic_write(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or keeps what it held: a temporary file in the same directory,
    flushed to disk, renamed over it. The temporary file never outlives a failure (a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def csv_text(records: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows as CSV: ``columns`` (default: every Result field), then any other key in first-seen order;
    null as an empty cell, lists as JSON."""
    columns = list(FIELDS if columns is None else columns)
    for rec in records:
        columns += [c for c in rec if c not in columns]

    def cell(v: Any) -> Any:
        return "" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else v

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(columns)
    writer.writerows([cell(r.get(c)) for c in columns] for r in records)
    return buf.getvalue()


def write_csv(path: Path, rows: Sequence[Result | dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    atomic_write(path, csv_text([r.record() if isinstance(r, Result) else r for r in rows], columns))


class LockedError(Exception):
    """Another live process holds the output directory (one line naming it)."""


class DirectoryLock:
    """An exclusive lock on an output directory for the whole run: ``flock`` on ``harness.lock``, which
    also holds the holder's pid, host, start time and sweep. The kernel drops the lock when its process
    dies, however it dies; the holder's line left in the file then says a run ended without releasing
    it, and the next run takes it over and says so.

    ``sweep``: the sweep directory of a multirun's job. Jobs of one sweep that differ only in a key left
    out of their directory's name (seq_lens, logger, ...) share a directory; a parallel launcher runs them
    at once, and then one waits for the other (``on_wait`` says so) instead of being refused: both
    measure their points, one after the other."""

    NAME = "harness.lock"

    def __init__(self, directory: Path, sweep: str | None = None) -> None:
        self.path = Path(directory) / self.NAME
        self.sweep = sweep
        self._file = None
        self.taken_over: dict[str, Any] | None = None  # the dead holder's line, when one was left

    def acquire(self, on_wait: Callable[[str], None] | None = None) -> "DirectoryLock":
        f = open(self.path, "a+")
        locked = _try_exclusive(f)
        # Blocked for a moment, not by a run: by in_use's probe (a shared lock taken and dropped at once;
        # a dead holder's line may still be in the file), or by a holder between its flock and its line.
        # Tried again a few times, and for up to a second while no holder line is there.
        for wait in [0.02] * 5 + [0.05] * 20:
            if locked or (wait == 0.05 and _holder(f)):
                break
            time.sleep(wait)
            locked = _try_exclusive(f)
        if not locked:
            holder = _holder(f)
            if self.sweep is None or holder.get("sweep") != self.sweep:
                f.close()
                raise LockedError(in_use_message(self.path.parent, holder)) from None
            if on_wait is not None:
                on_wait(f"waiting for another job of this sweep, which holds {self.path.parent} "
                        f"({describe_holder(holder)})")
            fcntl.flock(f, fcntl.LOCK_EX)
        # An interrupt (Ctrl-C, SIGTERM) landing once this run's line is written is raised with the lock
        # held (``held``): its store then says in status.json how the run ended
        with interrupts_deferred():
            previous = _holder(f)
            self.taken_over = previous or None
            f.seek(0)
            f.truncate()
            line = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
                    **({"sweep": self.sweep} if self.sweep is not None else {})}
            f.write(json.dumps(line) + "\n")
            f.flush()
            self._file = f
            os.fsync(f.fileno())
        return self

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is not None:
            try:
                self._file.seek(0)
                self._file.truncate()  # released cleanly: nobody to take over from
            except OSError:
                pass
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    @staticmethod
    def in_use(directory: Path) -> str | None:
        """Why ``directory`` cannot be run into now (a live process holds its lock; one line), or None
        (tried without waiting, released at once)."""
        path = Path(directory) / DirectoryLock.NAME
        try:
            f = open(path)
        except OSError:  # none, or none a process can hold (a directory of that name): the store says so
            return None
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return in_use_message(Path(directory), _holder(f))
            fcntl.flock(f, fcntl.LOCK_UN)
        return None

    @staticmethod
    def is_held(directory: Path) -> bool:
        """Whether a live process holds ``directory``'s lock."""
        return DirectoryLock.in_use(directory) is not None


def _try_exclusive(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def in_use_message(directory: Path, holder: dict[str, Any]) -> str:
    return (f"{directory} is in use by another run ({describe_holder(holder)}); wait for it to finish or use "
            f"another output directory")


def _holder(f) -> dict[str, Any]:
    f.seek(0)
    try:
        holder = json.loads(f.read() or "{}")
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
            if holder else "holder unknown")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime())


def move_aside(paths: Iterable[Path], kind: str) -> list[Path]:
    """Moves each of ``paths`` that exists to ``<name>.<kind>-<time>`` beside it, never over a file: where
    one of those names is taken (a move in the same second: jobs of a multirun into one directory), the
    first free ``<name>.<kind>-<time>-2``, ``-3``, ... instead, one suffix for all of them (fit.json keeps
    its results.jsonl's). Each new name is created exclusively (O_EXCL) before the file is renamed onto it,
    so a file already there is never replaced. Returns the new paths."""
    paths = [Path(p) for p in paths if Path(p).exists()]
    stamp, n = _stamp(), 1
    while paths:
        targets = [p.with_name(f"{p.name}.{kind}-{stamp}{f'-{n}' if n > 1 else ''}") for p in paths]
        made: list[Path] = []
        try:
            for target in targets:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
                made.append(target)
            for path, target in zip(paths, targets):
                os.replace(path, target)
                made.remove(target)
            return targets
        except FileExistsError:
            n += 1
        finally:
            for target in made:  # a name taken for nothing (taken by another, or a rename that failed)
                target.unlink(missing_ok=True)
    return []


@dataclass(frozen=True)
class Sweep:
    """What a run measured: its points (kept from earlier runs and new), the fitted exponents, where."""

    rows: list[Result]
    fits: dict[str, Any]
    output_dir: Path


class Sink(Protocol):
    """Where a run's rows go (the results file, wandb, the console, status.json): each new row is
    handed once to ``add``, and ``complete`` is told when every point is done."""

    def add(self, row: Result) -> None: ...

    def complete(self, sweep: Sweep) -> None: ...


class ResultStore:
    """The results of one output directory, for one run: locked, read and checked, appended.

    ``resume=True`` keeps the valid rows of ``results.jsonl`` (``rows``, in file order) and appends;
    damaged lines are moved verbatim to ``results.jsonl.damaged-<time>`` first (one warning). ``resume=
    False`` moves an existing file aside (``results.jsonl.replaced-<time>``, ``-<time>-2``... where that
    name is taken: ``move_aside``), and with it its ``results.csv``, ``fit.json`` and the directory's wandb
    run state (``wandb/harness-run.json``), so the new rows go to a new wandb run, not beside the ones they
    replace. Nothing is ever deleted or overwritten.
    ``results.csv`` is the view: one row per point (the latest), rewritten whole when the store opens
    (a run interrupted between its jsonl line and the rewrite left it short) and after each point. A
    results.csv that is not a view of the jsonl (rows the jsonl lacks) is moved aside first, with its
    fit.json.
    Raises LockedError when another run holds the directory (another job of the same ``sweep`` is waited
    for: DirectoryLock), OSError when it cannot be written; ``on_failure`` is called with what ended the
    opening (an error, Ctrl-C) while the lock is still held."""

    def __init__(self, output_dir: Path, resume: bool = True, warn=None, sweep: str | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.warn = warn or _stderr
        self.jsonl = self.output_dir / "results.jsonl"
        self.csv = self.output_dir / "results.csv"
        self.rows: list[dict[str, Any]] = []
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.lock = DirectoryLock(self.output_dir, sweep)
        try:
            self.lock.acquire(on_wait=self.warn)
            if self.lock.taken_over:
                self.warn(f"took over {self.lock.path}, left by a run that is gone "
                          f"({describe_holder(self.lock.taken_over)})")
            # resume=false moves an earlier command's rows aside, not those of this multirun's other jobs
            if resume or self._this_multiruns():
                if self.jsonl.exists():
                    self._load()
                self._keep_a_foreign_csv()
                self._new_wandb_run_if_rows_were_lost()
            else:  # the rows, their views, the fit of them and the wandb run they were logged to: a new run
                aside = move_aside([self.jsonl, self.csv, self.output_dir / "fit.json", self.output_dir / RUN_STATE],
                                   "replaced")
                if aside:
                    self.warn(f"resume=false: the directory's earlier results moved aside, not read again: "
                              f"{', '.join(a.name for a in aside)}")
            open(self.jsonl, "a").close()  # writable, or OSError now, before anything is measured
            if self.rows or self.csv.exists():
                write_csv(self.csv, latest(self.rows))
        except BaseException as e:
            try:
                if on_failure is not None and self.lock.held:  # told while the directory is still this run's
                    on_failure(e)
            finally:
                self.lock.release()
            raise

    def _this_multiruns(self) -> bool:
        """Whether the directory's rows are this multirun's own: jobs of one sweep over ``seq_lens`` share a
        directory, and with resume=false each job moved the one before it aside (only the last job's
        lengths were left to read, and said nowhere). They are read as resume=true reads them."""
        multirun = os.environ.get(MULTIRUN_ENV)
        return multirun is not None and job_state(self.output_dir).get("multirun") == multirun

    def _keep_a_foreign_csv(self) -> None:
        """A results.csv that is not a view of results.jsonl (a point the jsonl lacks, a damaged line; say,
        bench_cpu's combined table, or a csv whose jsonl was deleted) is moved aside with the fit.json
        beside it, not rewritten from the jsonl: its rows would be lost."""
        if not self.csv.exists():
            return
        contents = parse_csv(read_text(self.csv))
        have = {point_key(r) for r in self.rows}
        if contents.damaged or any(point_key(r) not in have for r in contents.rows):
            aside = move_aside([self.csv, self.output_dir / "fit.json"], "replaced")
            self.warn(f"{self.csv} holds rows that {self.jsonl.name} does not: moved to {aside[0].name}"
                      + (f" (with fit.json: {aside[1].name})" if len(aside) > 1 else ""))

    def _new_wandb_run_if_rows_were_lost(self) -> None:
        """The directory's wandb run logged more points than its results.jsonl holds rows (the file deleted,
        lines damaged): the points measured again would be charted beside their lost measurements in one
        history. Its state is moved aside, as resume=false does, and the run goes to a new wandb run."""
        state = RunState(self.output_dir)
        if state.damaged is not None:  # not as the logger writes it (edited, cut): read as no run
            aside = move_aside([self.output_dir / RUN_STATE], "damaged")
            self.warn(f"{RUN_STATE} {state.damaged}: moved to {aside[0].name}; the points go to a new wandb run")
            return
        if state.run_id is not None and state.points > len(self.rows):
            aside = move_aside([self.output_dir / RUN_STATE], "replaced")
            self.warn(f"wandb run {state.run_id} logged {state.points} point(s) and {self.jsonl.name} holds "
                      f"{len(self.rows)} row(s): the directory's points, and those measured again, go to a new "
                      f"wandb run ({RUN_STATE} moved to {aside[0].name})")

    def _load(self) -> None:
        text = read_text(self.jsonl)  # bytes not UTF-8 kept as they are
        contents = parse_jsonl(text)
        self.rows = contents.rows
        if contents.damaged:
            aside = self.jsonl.with_name(f"{self.jsonl.name}.damaged-{_stamp()}")
            with open(aside, "a", errors="surrogateescape") as f:  # verbatim, before results.jsonl loses them
                f.writelines(d.text + "\n" for d in contents.damaged)
                f.flush()
                os.fsync(f.fileno())
            atomic_write(self.jsonl, "".join(json.dumps(r, allow_nan=False) + "\n" for r in contents.rows))
            self.warn(f"{contents.warning(self.jsonl)}: moved to {aside.name}; a point that no row kept holds "
                      f"is measured again")
        elif text and not text.endswith("\n"):  # a last line ended by its closing brace, then killed
            with open(self.jsonl, "a") as f:
                f.write("\n")

    def current(self) -> dict[tuple, dict[str, Any]]:
        """point_key -> the point's latest row."""
        return {point_key(r): r for r in latest(self.rows)}

    def add(self, row: Result) -> None:
        rec = row.record()
        problem = row_problem(rec)
        if problem is not None:  # never write what would not read back
            raise ValueError(f"result row for N={rec.get('seq_len')} is not valid: {problem}")
        # Opened for each row, not held for the run: a results.jsonl replaced while the run goes on (a git
        # checkout or stash of a committed results directory, an editor's save) still gets the row; a held
        # handle would append it to the replaced file, which nothing reads (seen: a row lost so).
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(rec)
        write_csv(self.csv, latest(self.rows))

    def complete(self, sweep: "Sweep") -> None:
        """``fit.json``: the run's log-log exponents (two or more lengths), with the series they fit."""
        if sweep.fits:
            first = sweep.rows[0]
            write_json(self.output_dir / "fit.json", {"variant": first.variant, "backend": first.backend,
                                                      "options": dict(first.options), "fits": sweep.fits})

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----- the state of a job --------------------------------------------------------------------------

class JobStatus:
    """``status.json``: state (running | completed | failed | refused | interrupted), point counts by
    status, pid, host, times. A run that dies without a word (SIGKILL) leaves "running": ``job_state``
    tells that apart from a live run by its lock. As a sink of the run, it counts each row handed to it
    (``done``: the points an earlier run measured, counted from the start). In a multirun, ``job`` is the
    Hydra job number, and ``jobs`` the final states of the multirun's other jobs that wrote the directory
    before (``earlier_jobs``): jobs differing only in seq_lens share one, and each counts in its summary."""

    def __init__(self, out_dir: Path, total: int | None, done: Sequence[Result] = (),
                 job: int | None = None) -> None:
        self.path = Path(out_dir) / "status.json"
        multirun = os.environ.get(MULTIRUN_ENV)
        self.info: dict[str, Any] = {"state": "running", "points_total": total, "points_done": 0,
                                     "statuses": {}, "noisy": 0, "pid": os.getpid(),
                                     "hostname": socket.gethostname(), "started": _now(), "updated": _now(),
                                     "error": None, "multirun": multirun, "job": job,
                                     "jobs": self._other_jobs(multirun, job)}
        for row in done:
            self._count(row)

    def _other_jobs(self, multirun: str | None, job: int | None) -> dict[str, str]:
        """The states of this multirun's other jobs that wrote the directory (overwriting status.json
        would lose them). Its last writer is no longer running where this job writes (it holds the lock,
        or it is the launcher saying a killed job's end): one said running was killed."""
        if multirun is None or job is None:
            return {}
        info = job_state(self.path.parent)
        if info.get("multirun") != multirun:
            return {}
        jobs = earlier_jobs(info)
        if isinstance(info.get("job"), int):
            state = str(info.get("state"))
            jobs[str(info["job"])] = "gone" if state == "running" else state
        jobs.pop(str(job), None)  # its own earlier try (a requeued SLURM job): this one's state replaces it
        return jobs

    def _count(self, row: Result) -> None:
        statuses = self.info["statuses"]
        statuses[row.status] = statuses.get(row.status, 0) + 1
        self.info.update(points_done=self.info["points_done"] + 1, noisy=self.info["noisy"] + bool(row.noisy),
                         updated=_now())

    def add(self, row: Result) -> None:
        self._count(row)
        self.save()

    def complete(self, sweep: "Sweep") -> None:
        self.finish("completed")

    def finish(self, state: str, error: str | None = None) -> None:
        self.info.update(state=state, error=error, updated=_now())
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_json(self.path, self.info)
        except OSError as err:
            if err.errno != errno.ENOSPC or not self.path.exists():
                raise
            # A full disk: a temporary file needs new blocks; overwriting the small file in place reuses
            # its own, so the state is still told ("failed: no space left").
            text = json.dumps(self.info, indent=2) + "\n"
            with open(self.path, "r+") as f:
                f.truncate()
                f.write(text)


def job_state(job_dir: Path) -> dict[str, Any]:
    """A job directory's status.json, with ``state`` "gone" where it says running but no live process
    holds the directory (killed without a chance to say so); "no status" where there is none."""
    try:
        info = json.loads((Path(job_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {"state": "no status"}
    if not isinstance(info, dict):
        return {"state": "no status"}
    if info.get("state") == "running" and not DirectoryLock.is_held(job_dir):
        info = {**info, "state": "gone", "error": f"the run (pid {info.get('pid')} on {info.get('hostname')}) "
                                                  f"ended without finishing; rerun to resume"}
    return info


def earlier_jobs(info: dict[str, Any]) -> dict[str, str]:
    """A status.json's ``jobs``: Hydra job number -> state of the other jobs of its multirun that wrote the
    directory before its own (none in one of older code, or where it is not as written)."""
    jobs = info.get("jobs")
    if not isinstance(jobs, dict):
        return {}
    return {str(num): state for num, state in jobs.items() if isinstance(state, str)}


# ----- log-log fits --------------------------------------------------------------------------------

TIME_METRICS = ("fwd_ms", "bwd_ms", "fwd_bwd_ms")


def timing_pass(metric: str) -> str | None:
    """The timed pass a metric comes from (fwd_ms: fwd; tflops_fwd_bwd_useful: fwd_bwd), None for one
    that is not a time or a throughput computed from one."""
    if metric.startswith("tflops_"):
        name = metric.removeprefix("tflops_").removesuffix("_useful")
    else:
        name = metric.removesuffix("_ms") if metric in TIME_METRICS else None
    return name if name in PASSES else None


def from_timings(metric: str) -> bool:
    """A time, or a throughput computed from one (tflops_*): not to be trusted where its pass is noisy."""
    return timing_pass(metric) is not None


# A row's noise_reasons: reasons joined by "; ", which one reason may hold too ("(one call 12 s;
# measure.max_run_time=60 s)"): split only where a reason harness.measure writes begins
_NEXT_REASON = re.compile(r"; (?=(?:fwd_bwd|fwd|bwd): |forward |other processes |try \d+ ended )")
_PASS_REASON = re.compile(r"(fwd_bwd|fwd|bwd): ")
_TRY_FAILED = re.compile(r"try \d+ ended ")  # harness.run: a retry's failure, said after the kept try's reasons


def noisy_passes(row: dict[str, Any]) -> tuple[str, ...]:
    """The passes whose timings cannot be trusted, in PASSES' order: none where the row is not noisy, else
    its noisy_passes. A row from before that field: the passes its noise_reasons name (``fwd: IQR 18%
    ...``), every pass where one reason concerns the whole point (others' load, a forward slower than
    forward+backward) or is not one harness.measure writes. A retry's failure said after the reasons
    (``try 2 ended oom: ...``, the last) concerns a measurement that was not kept."""
    if not row.get("noisy"):
        return ()
    if row.get("noisy_passes") is not None:
        return tuple(p for p in PASSES if p in row["noisy_passes"])
    named = set()
    for reason in _NEXT_REASON.split(row.get("noise_reasons") or ""):
        found = _PASS_REASON.match(reason)
        if found:
            named.add(found.group(1))
        elif _TRY_FAILED.match(reason):  # the rest is that try's failure
            break
        else:
            return PASSES
    return tuple(p for p in PASSES if p in named) if named else PASSES


def untrusted(row: dict[str, Any], metric: str) -> bool:
    """Whether ``metric`` of ``row`` is a timing (or a throughput computed from one) whose pass is noisy:
    left out of fits, crossovers and comparisons. The other passes' timings of the point still count."""
    return timing_pass(metric) in noisy_passes(row)


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x: y ∝ x^slope."""
    return float(np.polyfit(np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(ys, dtype=float)), 1)[0])


def fit_exponents(rows: Iterable[Result | dict], min_seq_len: int = 0,
                  max_seq_len: int | None = None) -> dict[str, Any]:
    """Fitted exponents of time and peak memory against N over the ok points (at least two distinct N),
    each beside the theory: the log-log slope of the analytic forward FLOPs (time) or of the analytic
    memory (memory) over the same N. A point whose pass is noisy is left out of that pass's time fit
    (``left_out_noisy``): its timing cannot be trusted; memory is measured once and is not subject to timing
    noise."""
    recs = [r.record() if isinstance(r, Result) else r for r in rows]
    recs = [r for r in recs if r["status"] == "ok" and r["seq_len"] >= min_seq_len
            and (max_seq_len is None or r["seq_len"] <= max_seq_len)]
    fits: dict[str, Any] = {}
    pairs = [(m, m, "flops_fwd") for m in TIME_METRICS] + [("memory", "peak_mem_bytes", "analytic_mem_bytes")]
    for key, measured, analytic in pairs:
        usable = [r for r in recs if _positive(r.get(measured)) and _positive(r.get(analytic))]
        noisy = sorted({r["seq_len"] for r in usable if untrusted(r, measured)})
        pts = [r for r in usable if not untrusted(r, measured)]
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
            "left_out_noisy": noisy,
        }
    return fits


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
