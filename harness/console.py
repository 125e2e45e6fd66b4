"""Live console view of a run: the finished points above a progress bar, or plain lines.

On a terminal the table is redrawn only between measurements (no refresh thread competing with the
timed code for the GIL and the cores) and fits in 100 columns: numbers never wrap; why a point is not
ok, or is noisy, is a note below the table. Elsewhere (a pipe, ``| tee``, a CI log, pytest) each point
is one plain line as it finishes, and nothing is redrawn.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .results import Result

MiB = 2**20


def make_console() -> Console:
    # markup=False: a title, path or label is shown as it is (`[window=256]`, `measure.passes=[fwd]`), never
    # read as a style tag
    return Console(highlight=False, markup=False, soft_wrap=not sys.stdout.isatty())


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _short(x: float, digits: int) -> str:
    """``digits`` significant digits, never in e-notation (22690 ms, not 2.269e+04)."""
    return f"{x:.0f}" if abs(x) >= 10 ** (digits - 1) else f"{x:.{digits}g}"


def _ms(median: float | None, iqr: float | None) -> str:
    if median is None:
        return "-"
    return _short(median, 4) + ("" if iqr is None else f"±{_short(iqr, 2)}")


def _cores(x: float | None) -> str:
    """Others' load in cores, two decimals (1.6e-12 is 0.00: /proc/stat's rounding, not load)."""
    return "-" if x is None else f"{x:.2f}"


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def status_text(r: Result) -> str:
    return f"{r.status}*" if r.noisy else r.status


def note(r: Result) -> str:
    parts = [r.reason, f"noisy: {r.noise_reasons}" if r.noisy else None, r.quality_reason]
    if r.tries and r.tries > 1:
        parts.append(f"{r.tries} tries")
    return "; ".join(p for p in parts if p)


class Display:
    """A sink of result rows (``add``, ``complete``) with a progress line; the run calls ``phase`` as it
    measures. ``kept``: points an earlier run measured into the directory, shown first and said so;
    ``again``: N -> what the stored row of a point measured again lacks."""

    def __init__(self, title: str, total: int, console: Console | None = None, task: bool = False,
                 kept: Sequence[Result] = (), again: dict[int, list[str]] | None = None) -> None:
        self.kept = list(kept)
        self.resume_lines = (["kept from earlier runs into this directory, not measured again (resume): N="
                              + ",".join(str(r.seq_len) for r in self.kept)] if self.kept else []) + [
            f"N={n}: measured again, its stored row has no {', '.join(lacks)}" for n, lacks in (again or {}).items()]
        self.console = console or make_console()
        self.title = title
        self.task = task
        self.table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        numeric = ["fwd ms", "bwd ms", "fwd+bwd ms", "peak MiB", "TFLOP/s", "rel err"]
        for c in ["N", "status", *numeric, *(["task acc"] if task else []), "others"]:
            self.table.add_column(c, justify="left" if c == "status" else "right", no_wrap=True)
        self.notes = Text()  # below the table: why a point is not ok, or noisy (* in its status)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.bar = self.progress.add_task("starting", total=total)
        self.live: Live | None = None
        self.fit_lines: list[str] = []

    def __enter__(self) -> "Display":
        if self.console.is_terminal:
            self.live = Live(self.view(), console=self.console, auto_refresh=False)
            self.live.start(refresh=True)
        else:
            self.console.print(self.title)
        if self.live is None:
            for text in self.resume_lines:
                self.console.print(text, soft_wrap=True)
        for row in self.kept:
            self.add(row)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()  # the last frame stays on the screen
        for line in self.fit_lines:
            self.console.print(line)

    def view(self) -> Group:
        return Group(self.table, Text("".join(t + "\n" for t in self.resume_lines), style="dim"), self.notes,
                     self.progress)

    def phase(self, seq_len: int, phase: str) -> None:
        self.progress.update(self.bar, description=f"N={seq_len}: {phase}")
        if self.live is not None:
            self.live.refresh()

    def add(self, r: Result) -> None:
        self.table.add_row(str(r.seq_len), status_text(r), _ms(r.fwd_ms, r.fwd_iqr_ms), _ms(r.bwd_ms, r.bwd_iqr_ms),
                           _ms(r.fwd_bwd_ms, r.fwd_bwd_iqr_ms), _mib(r.peak_mem_bytes), _num(r.tflops_fwd_bwd),
                           _num(r.out_rel_err, 2), *([_num(r.task_accuracy)] if self.task else []),
                           _cores(r.other_cpu_cores))
        if note(r):
            if not self.notes:
                self.notes.append("* noisy: its timings cannot be trusted as they are\n", style="dim")
            self.notes.append(f"N={r.seq_len} {status_text(r)}: {note(r)}\n")
        self.progress.advance(self.bar)
        if self.live is not None:
            self.live.refresh()
        else:
            self.console.print(line(r), soft_wrap=True)

    def complete(self, sweep) -> None:
        self.fits(sweep.fits)

    def fits(self, fits: dict[str, Any]) -> None:
        """Shown below the table when the run ends."""
        for key, fit in fits.items():
            what = "peak memory" if key == "memory" else f"time ({key})"
            left = fit.get("left_out_noisy") or []
            self.fit_lines.append(
                f"log-log exponent of {what}: {fit['fitted']:.2f} (theory {fit['theory']:.2f}) over "
                f"N={','.join(map(str, fit['seq_lens']))}"
                + (f"; noisy N={','.join(map(str, left))} left out" if left else ""))


def line(r: Result) -> str:
    """One point as one plain line (logs, pipes)."""
    text = (f"N={r.seq_len} {status_text(r)}: fwd {_ms(r.fwd_ms, r.fwd_iqr_ms)} ms, "
            f"bwd {_ms(r.bwd_ms, r.bwd_iqr_ms)} ms, fwd+bwd {_ms(r.fwd_bwd_ms, r.fwd_bwd_iqr_ms)} ms, "
            f"peak {_mib(r.peak_mem_bytes)} MiB (analytic {_mib(r.analytic_mem_bytes)}), "
            f"out_rel_err {_num(r.out_rel_err)}, mass_kept {_num(r.mass_kept)}")
    if r.task_accuracy is not None:
        text += f", task_accuracy {_num(r.task_accuracy)}"
    text += f", others' cores {_cores(r.other_cpu_cores)}"
    return text + (f" - {note(r)}" if note(r) else "")
