"""What the command line's signal handlers need, and nothing else: no torch import (nor of anything that
imports it). A handler runs wherever the signal lands, torch's own import included; one that imported
harness.run there would re-enter that half-done import and end in an ImportError and a traceback
instead of the one line and exit code of an interrupt. harness.run takes these names from here.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """Raised by the command line's SIGTERM handler, so that a cancelled job ends like Ctrl-C."""

    NAME, EXIT_CODE = "SIGTERM", 143


class TimeLimit(Terminated):
    """SLURM's warning that a job nears its time limit (SIGUSR2, ``signal_delay_s`` before it, as the
    SLURM launcher asks): the run ends as interrupted, resumable, before the kill. (submitit's own handler
    would raise inside the point being measured, which then stood as an error that no rerun retried.)"""

    NAME, EXIT_CODE = "SIGUSR2: the SLURM time limit is near", 140


# The interrupts the command line's handlers saw (``Terminated`` or ``KeyboardInterrupt`` classes). Python
# drops an exception raised inside a finalizer (it prints "Exception ignored in ..."), and a library may
# swallow one raised inside its import: a signal landing there would be lost, so the run raises it again
# at its next phase (``raise_pending_interrupt``), and the command line before Hydra starts.
PENDING_INTERRUPTS: list[type[KeyboardInterrupt]] = []


def raise_pending_interrupt() -> None:
    if PENDING_INTERRUPTS:
        raise PENDING_INTERRUPTS[-1]()


# For each open ``interrupts_deferred`` block, innermost last, how many interrupts landed inside it.
_DEFERRED: list[int] = []


def deferred(kind: type[KeyboardInterrupt]) -> bool:
    """Called by a handler: whether the interrupt ``kind`` waits for the end of the open
    ``interrupts_deferred`` block (the first one does; a second one ends the run at once, as a stuck block
    would otherwise hold it)."""
    if not _DEFERRED or _DEFERRED[-1]:
        return False
    _DEFERRED[-1] += 1
    return True


@contextmanager
def interrupts_deferred():
    """An interrupt landing inside the block is raised at its end: a measured row is written, logged,
    shown and counted, or (interrupted before the block) none of that."""
    _DEFERRED.append(0)
    try:
        yield
    finally:
        _DEFERRED.pop()
    raise_pending_interrupt()


def exit_at_startup_interrupts(name: str) -> None:
    """A script's first call, before its imports (torch's take seconds): a Ctrl-C or SIGTERM landing
    there ends it at once in one line, exit 130 or 143, nothing having been measured or written (a
    KeyboardInterrupt raised inside torch's import is a traceback). harness.config.ctrl_c_is_one_line,
    around the script's main, then puts back the handlers that end a measurement in order."""
    def handler(signum, frame) -> None:
        kind = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        print(f"{name}: interrupted ({kind}) while starting; nothing was written", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


class OutputClosed(Terminated):
    """stdout's reader went away (``python -m harness ... | head``): as SIGPIPE ends a Unix tool, the run
    ends as interrupted, resumable, and says so on stderr (``GuardedStdout``)."""

    NAME, EXIT_CODE = "stdout closed by its reader", 141


class GuardedStdout:
    """The command line's sys.stdout. Python ignores SIGPIPE, so a write to a pipe whose reader has gone
    raises BrokenPipeError wherever it happens: in Hydra's log lines it was a "Logging error" traceback,
    in rich's print a SystemExit(1) that left a row stored but not counted and status.json "failed".
    Here the rest of the output goes to /dev/null and the run ends as interrupted (``OutputClosed``), at
    once or, inside an ``interrupts_deferred`` block, at its end, as a Ctrl-C does."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)  # fileno, isatty, encoding, ...

    def _closed(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())  # the buffer's rest, and all after
        PENDING_INTERRUPTS.append(OutputClosed)
        if not deferred(OutputClosed):
            raise OutputClosed()
