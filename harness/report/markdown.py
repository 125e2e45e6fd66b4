"""Markdown tables, for the benchmark scripts' summaries (scripts/bench_cpu.py, bench_peers.py and
bench_gpu_summary.py's SUMMARY.md)."""

from __future__ import annotations

from typing import Any


def cell(x: Any, digits: int = 4) -> str:
    """A value as a cell: None is "-", a float has ``digits`` significant digits."""
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def table(head: list[str], body: list[list[Any]], right_from: int | None = None) -> list[str]:
    """A Markdown table's lines, each cell as ``cell`` writes it; a | inside a cell (a kernel's name, a
    test's failure message) is escaped, not a column. The columns from ``right_from`` on are right-aligned
    (numbers)."""
    rule = "".join("---:|" if right_from is not None and i >= right_from else "---|" for i in range(len(head)))
    return ["| " + " | ".join(head) + " |", "|" + rule] + [
        "| " + " | ".join(cell(c).replace("|", "\\|") for c in row) + " |" for row in body]
