from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
VARIANT_YAMLS = sorted((CONF / "variant").glob("*.yaml"))


def pytest_addoption(parser):
    parser.addoption("--outcomes", metavar="FILE", default=None,
                     help="append each test's outcome to FILE (JSON lines) as it ends, and leave out the tests "
                          "FILE already has: a run cut short by a time limit (the GPU tests) goes on where it stopped")


def pytest_configure(config):
    """The CPU suite runs on the CPU, on a CUDA machine too: unless the run selects the GPU tests
    (``-m gpu``), CUDA is hidden from this process and from the harness processes its tests start, so
    ``device=auto`` means the CPU the tests were written for (rows on "cpu", the CPU timer, gloo ranks).
    Set here, before anything initialises CUDA (importing torch does not)."""
    if not re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker: the workers share the cores, not each all of them. The harness processes
        # its tests start take the same count (OMP_NUM_THREADS), so that their rows and the ones a test
        # writes itself are of one machine (resume measures again a point another machine measured).
        threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    path = config.getoption("outcomes")
    if path and not hasattr(config, "workerinput"):  # written by one process: pytest-xdist's controller
        config.pluginmanager.register(Outcomes(Path(path)), "outcomes")


class Outcomes:
    """``--outcomes FILE``: one JSON line per test as its outcome is known, so that a run killed at a time
    limit keeps what it ran; and ``reported(FILE)``, the tests a later run leaves out. Each line names the
    code it tested (harness.env.code_version, as the rows of a measurement do): gpu_job.sh runs every test
    again where the outcomes are another code's."""

    def __init__(self, path: Path) -> None:
        from harness.env import code_version

        self.path, self.code = path, code_version()
        if path.exists() and not path.read_bytes().endswith(b"\n") and path.stat().st_size:
            with path.open("a") as f:  # a line cut by a kill stays on a line of its own, never joined to ours
                f.write("\n")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or not report.passed:  # setup's skips and errors, teardown's errors too
            outcome = "error" if report.when != "call" and report.failed else report.outcome
            if isinstance(report.longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
                message = report.longrepr[2]
            else:
                message = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
            line = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3),
                    "message": next(iter((message or "").strip().splitlines()), "")[:300] or None,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "code_version": self.code}
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")


def reported(path: Path) -> set[str]:
    """The tests ``path`` (an ``--outcomes`` file) has an outcome for; a line cut by a kill is left out."""
    from harness.results import read_jsonl

    if not path.exists():
        return set()
    return {r["test"] for r in read_jsonl(path, check=lambda r: None if isinstance(r, dict) and "test" in r
                                          else "not a test outcome")}


# pytest-xdist hands out whole modules (pyproject.toml: --dist loadfile, --no-loadscope-reorder) in the
# collection's order, each worker taking the next as it frees: the longest modules (their tests start
# processes) go first, so that the two workers end together instead of one running a long module alone
# at the end. The rest keep their order after them.
LONGEST_FIRST = ("test_bench_gpu.py", "test_sweep.py", "test_reliability.py", "test_harness.py",
                 "test_sequence_parallel.py", "test_bench_cpu.py", "test_slurm.py", "test_adaptive_span.py",
                 "test_bench_peers.py", "test_job.py", "test_resume.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # stable: a module's tests keep their order
    path = config.getoption("outcomes")
    if path:
        done = reported(Path(path))
        left_out = [item for item in items if item.nodeid in done]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.nodeid not in done]
    if torch.cuda.is_available():
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    skip = pytest.mark.skip(reason="a GPU test: on a CUDA machine run python -m pytest -m gpu" if hidden
                            else "needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def patch_on_import(module: str, patch: str) -> str:
    """The source of a sitecustomize.py (its folder put first on PYTHONPATH) that runs ``patch`` right
    after ``module`` is first imported, in every Python process that inherits the environment: a test's
    hook into the processes a command starts. In ``patch``, ``module`` is the module just executed."""
    import textwrap

    return f"""
import importlib.abc, importlib.util, sys


class After(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != {module!r}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
{textwrap.indent(textwrap.dedent(patch).strip(), " " * 12)}
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, After())
"""


def load_script(name: str):
    """scripts/NAME.py as a module of this process (registered in sys.modules: its dataclasses need it), for
    a test that calls its functions or its main in-process: a process of its own costs torch's import. The
    signal handlers a script installs while it imports (exit_at_startup_interrupts: os._exit on Ctrl-C) are
    put back, so they never end the test process."""
    import importlib.util
    import signal

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return module


def refusal(argv: list[str], where: Path) -> str:
    """The line ``python -m harness ARGV`` run in ``where`` refuses with, in this process: the check the command
    line runs before Hydra starts (harness.command_line.check; harness/__main__.py prints its ConfigError as
    "error: ..." and exits 2). A process of its own each would cost torch's import: the process's side (one
    line, exit 2, no traceback, nothing written) is test_harness.py's command-line tests'. Asserts the check
    wrote nothing in ``where`` (Hydra's default output directories are relative to it)."""
    from harness.command_line import check
    from harness.config import ConfigError, one_line

    cwd = os.getcwd()
    os.chdir(where)
    try:
        check(list(argv))
    except ConfigError as e:
        return f"error: {one_line(e)}"
    else:
        raise AssertionError(f"not refused: {argv}")
    finally:
        os.chdir(cwd)
        assert list(where.iterdir()) == [], argv


# What tells each command's results directory apart (harness.config.results_of), with files another command
# would write over: a run's (results.jsonl), bench_cpu's and bench_gpu's (their SUMMARY.md; bench_gpu's
# env.json, an array of its invocations)
RESULTS_DIRS = {
    "run": {"results.jsonl": "{}\n", "env.json": '{"device_name": "AMD EPYC"}\n', "results.csv": "variant\n",
            "fit.json": "{}\n"},
    "cpu": {"SUMMARY.md": "# CPU benchmark: time and peak memory against sequence length\n", "results.csv": "variant\n"},
    "gpu": {"SUMMARY.md": "# GPU benchmark\n", "env.json": '[{"device": "cuda"}]\n'},
}


def results_dirs(root: Path) -> dict[str, Path]:
    """RESULTS_DIRS made under ``root``: kind -> its directory."""
    for kind, files in RESULTS_DIRS.items():
        (root / kind).mkdir()
        for name, text in files.items():
            (root / kind / name).write_text(text)
    return {kind: root / kind for kind in RESULTS_DIRS}


def qkv(B, H, N, D, dtype=torch.float64, seed=0, device="cpu"):
    """Fresh random inputs that require grad (never zeros: zeros hide wrong indexing)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
                 .requires_grad_() for _ in range(3))
