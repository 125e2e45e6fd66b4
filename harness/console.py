"""Live console view of a sweep: a table of the finished points above a progress bar across points.

On a terminal the view is redrawn only between measurements (no refresh thread competing with the
timed code for the GIL and the two cores); elsewhere (a pipe, a log file, pytest) each point is printed
as one line as it finishes and the table once at the end.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .results import Result

MiB = 2**20


def make_console() -> Console:
    terminal = sys.stdout.isatty()
    return Console(highlight=False, width=None if terminal else 200)


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _ms(median: float | None, iqr: float | None) -> str:
    if median is None:
        return "-"
    return f"{median:.4g}" + ("" if iqr is None else f" ±{iqr:.2g}")


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


class Display:
    COLUMNS = ("N", "status", "fwd ms", "bwd ms", "fwd+bwd ms", "peak MiB", "analytic MiB", "TFLOP/s fwd+bwd",
               "density", "out rel err", "mass kept", "task acc", "warm-up s", "others' cores", "reason")

    def __init__(self, title: str, total: int, console: Console | None = None) -> None:
        self.console = console or make_console()
        self.table = Table(title=title, title_justify="left")
        for c in self.COLUMNS:
            self.table.add_column(c, justify="left" if c in ("status", "reason") else "right",
                                  overflow="fold")
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
        self.task = self.progress.add_task("starting", total=total)
        self.live: Live | None = None
        self.fit_table: Table | None = None

    def __enter__(self) -> "Display":
        if self.console.is_terminal:
            self.live = Live(Group(self.table, self.progress), console=self.console, auto_refresh=False)
            self.live.start(refresh=True)
        else:
            self.console.print(self.table.title)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.stop()  # the last frame stays on the screen
        else:
            self.console.print(self.table)
        if self.fit_table is not None:
            self.console.print(self.fit_table)

    def phase(self, seq_len: int, phase: str) -> None:
        self.progress.update(self.task, description=f"N={seq_len}: {phase}")
        if self.live is not None:
            self.live.refresh()

    def add(self, r: Result) -> None:
        self.table.add_row(str(r.seq_len), r.status, _ms(r.fwd_ms, r.fwd_iqr_ms), _ms(r.bwd_ms, r.bwd_iqr_ms),
                           _ms(r.fwd_bwd_ms, r.fwd_bwd_iqr_ms), _mib(r.peak_mem_bytes),
                           _mib(r.analytic_mem_bytes), _num(r.tflops_fwd_bwd), _num(r.density),
                           _num(r.out_rel_err), _num(r.mass_kept), _num(r.task_accuracy),
                           _num(r.warmup_s), _num(r.other_cpu_cores, 2), "; ".join(x for x in (r.reason, r.quality_reason) if x))
        self.progress.advance(self.task)
        if self.live is not None:
            self.live.refresh()
        else:
            self.console.print(f"N={r.seq_len} {r.status}: fwd {_ms(r.fwd_ms, r.fwd_iqr_ms)} ms, "
                               f"bwd {_ms(r.bwd_ms, r.bwd_iqr_ms)} ms, "
                               f"fwd+bwd {_ms(r.fwd_bwd_ms, r.fwd_bwd_iqr_ms)} ms, "
                               f"peak {_mib(r.peak_mem_bytes)} MiB (analytic {_mib(r.analytic_mem_bytes)}), "
                               f"out_rel_err {_num(r.out_rel_err)}, mass_kept {_num(r.mass_kept)}, "
                               f"task_accuracy {_num(r.task_accuracy)}, "
                               f"others' cores {_num(r.other_cpu_cores, 2)}"
                               + (f" - {r.reason}" if r.reason else "")
                               + (f" - {r.quality_reason}" if r.quality_reason else ""))

    def fits(self, fits: dict[str, Any], seq_lens: Sequence[int]) -> None:
        """Shown below the table when the sweep ends."""
        table = Table(title=f"log-log exponents against N over {', '.join(map(str, seq_lens))} (ok points)",
                      title_justify="left")
        for c in ("quantity", "fitted", "theory"):
            table.add_column(c, justify="left" if c == "quantity" else "right")
        for key, fit in fits.items():
            label = "peak memory" if key == "memory" else f"time ({key})"
            table.add_row(label, f"{fit['fitted']:.2f}", f"{fit['theory']:.2f}")
        self.fit_table = table
