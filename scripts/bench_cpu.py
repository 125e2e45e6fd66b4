"""CPU benchmark: every variant at N = 1024 … 16384 through harness.run.run, one output dir per variant.

    python scripts/bench_cpu.py [--out results/cpu] [--seq-lens 1024 2048 4096 8192 16384]
                                [--min-run-time 0.3] [--memory-budget-gb GB] [--only full_math linear]
                                [--rounds 3] [--resume]

Workload: B=1, H=4, D=64, float32, non-causal, each variant at its defaults (full both on the math path
and on SDPA) but adaptive_span's max_span: 256 (its default is 1024), sliding_window's reach. Each point
is measured in --rounds rounds (separate processes, minutes apart) and the median round kept
(harness.results.median_run: among the rounds whose forward+backward is not noisy).
Writes <out>/<name>/results.{jsonl,csv}, env.json, fit.json per variant (its later rounds in
<out>/<name>/round-<r>/), and the combined <out>/results.csv (the kept rows), <out>/fit.json and
<out>/SUMMARY.md (tables, fitted exponents, targets, the rounds' spread). The combined files hold every
variant <out> has rows of from this machine at every length it has, those --only or --seq-lens left out
included; SUMMARY.md names those measured on another machine. A row another command measured into
<out>/<name> (another window, another batch) is no round of it, and is left out; a forward+backward time
noisy in every round is marked so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.signals import exit_at_startup_interrupts  # noqa: E402

exit_at_startup_interrupts("bench_cpu.py")

# No torch here (harness.env imports it): the command line is checked, and the process re-executed with
# ALLOCATOR_ENV, before torch's import (seconds) is paid, and paid once.
from harness.config import (BENCH_CPU, ConfigError, check_results_dir, ctrl_c_is_one_line, one_line_errors,  # noqa: E402
                            output_dir_arg, positive_arg, wait_through_ctrl_c)
from harness.report.markdown import table as markdown_table  # noqa: E402
from harness.results import (Result, fit_exponents, latest, machine, median_run, read_jsonl, untrusted,  # noqa: E402
                             write_csv, write_json)

CONFIGS = {  # name -> overrides of conf/config.yaml
    "full_math": ["variant=full", "variant.backend=math"],
    "full_sdpa": ["variant=full", "variant.backend=sdpa"],
    "blockwise": ["variant=blockwise", "variant.mode=exact", "variant.block_size=128"],
    "sliding_window": ["variant=sliding_window", "variant.window=256"],
    "sparse": ["variant=sparse", "variant.pattern=fixed"],
    "linear": ["variant=linear", "variant.proj_dim=256"],
    "reformer": ["variant=reformer", "variant.bucket_size=64", "variant.n_hashes=2"],
    # spans at init (S = 256): the reach of sliding_window's w=256 plus the ramp
    "adaptive_span": ["variant=adaptive_span", "variant.max_span=256", "variant.ramp=32"],
}
WORKLOAD = ["batch_size=1", "num_heads=4", "head_dim=64", "dtype=float32", "device=cpu", "causal=false"]
SEQ_LENS = [1024, 2048, 4096, 8192, 16384]
MiB = 2**20
ROUNDS_DISAGREE = 1.10  # a point whose slowest round took more than 1.1x its fastest is starred
# glibc serves every allocation above its mmap threshold (dynamic, at most 32 MiB) with fresh pages that
# are page-faulted and zeroed on every call and returned on free; how often that happens depends on the
# process's allocation history. Variants whose temporaries cross 32 MiB between two N then show a step
# in time that is not in the algorithm (sliding_window: 2.3x at N=4096). A threshold above any tensor
# here and no trimming keep freed memory for reuse, as a caching allocator would.
# The threshold stays at 1 GiB and the trim threshold at 1 GiB: a higher one kept so much freed memory
# that full math at N=16384 (three 4 GiB matrices) was killed for lack of memory.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def main() -> None:
    ap = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--out", type=output_dir_arg, default=ROOT / "results" / "cpu")
    ap.add_argument("--seq-lens", type=positive_arg(int), nargs="+", default=SEQ_LENS)
    ap.add_argument("--min-run-time", type=positive_arg(float), default=0.3, help="seconds of timed calls per pass")
    ap.add_argument("--memory-budget-gb", type=positive_arg(float), default=None,
                    help="skip points above this analytic memory (default: 0.8 x MemAvailable: full math at "
                         "N=16384 needs three 4 GiB N×N matrices)")
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--max-other-cores", type=positive_arg(float), default=0.25,  # > 0, as the harness's
                    help="other processes' load (cores) that makes a round's timings noisy (the harness's "
                         "measure.max_other_cores) and that a run waits to fall below before it starts; a round "
                         "whose forward+backward is noisy is kept only where no round of the point is not")
    ap.add_argument("--rounds", type=positive_arg(int), default=3,
                    help="measurements of each point (in separate processes, minutes apart); the median is kept")
    ap.add_argument("--round-max-s", type=positive_arg(float), default=60.0,
                    help="measure a point again only when that takes at most this long (estimated)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse a round's earlier results in --out when they cover its lengths (results taken on "
                         "another machine are not reused: the harness measures those points again)")
    ap.add_argument("--wait-s", type=positive_arg(float, zero=True), default=60.0,
                    help="longest wait for a quiet machine before a run")
    ap.add_argument("--glibc-default", action="store_true",
                    help=f"keep glibc's default allocator settings (otherwise re-run with {ALLOCATOR_ENV})")
    args = ap.parse_args()
    try:  # a run's directory (its results.csv, fit.json), bench_gpu's (its SUMMARY.md): not written over
        check_results_dir(args.out, BENCH_CPU, ("results.csv", "fit.json", "SUMMARY.md"))
    except ConfigError as e:
        ap.error(f"argument --out: {e}")
    args.seq_lens = list(dict.fromkeys(args.seq_lens))  # a length given twice is one point (it was two columns)
    if not args.glibc_default and any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})

    from harness.env import mem_available_bytes

    budget = args.memory_budget_gb
    if budget is None:
        budget = 0.8 * (mem_available_bytes() or 16e9) / 1e9
    common = [*WORKLOAD, f"seq_lens=[{','.join(map(str, args.seq_lens))}]",
              f"measure.min_run_time={args.min_run_time}", f"measure.max_other_cores={args.max_other_cores}",
              f"memory_budget_gb={budget:.6g}"]  # a small budget stays > 0
    rows, spreads, fits = {}, {}, {}
    started = time.perf_counter()
    # This machine is shared, and some of its slow periods are invisible from inside (other_cpu_cores stays
    # near 0 while some variants run 30-45% slower for minutes): each point is measured in
    # --rounds separate processes, the rounds minutes apart and in alternating variant order, and the
    # median kept. Points that take long (full math at large N) are measured once.
    for r in range(1, args.rounds + 1):
        for name in (args.only if r % 2 else args.only[::-1]):
            vdir = args.out / name
            rdir, ns = (vdir, args.seq_lens) if r == 1 else (vdir / f"round-{r}", again(vdir, args))
            if ns and not (args.resume and set(ns) <= set(candidates(rdir, rounds=False))):
                wait_for_quiet(args.max_other_cores, args.wait_s)
                run_harness([*CONFIGS[name], *common, f"seq_lens=[{','.join(map(str, ns))}]"], rdir)
    # The combined table: this invocation's variants and every other one --out holds from this machine
    # (an earlier --only), never dropped; one measured on another machine is named, not mixed in.
    names = [n for n in CONFIGS if n in args.only or candidates(args.out / n)]
    # ... and every length they have here, those this invocation's --seq-lens left out included
    args.seq_lens = sorted({*args.seq_lens, *(n for name in names for n in candidates(args.out / name))})
    elsewhere = {n: sorted({f"{r['device_name']}, {r['num_threads']} threads" for r in rs})
                 for n in CONFIGS if n not in names and (rs := stored(args.out / n))}
    for name in names:
        vdir = args.out / name
        found = candidates(vdir)
        rows[name] = [Result.from_record(median_run([r.record() for r in found[n]])) for n in args.seq_lens
                      if n in found]
        spreads[name] = {n: spread(found[n]) for n in args.seq_lens if n in found}
        fits[name] = {"all": fit_exponents(rows[name]), "2k_16k": fit_exponents(rows[name], 2048, 16384),
                      "seq_lens": args.seq_lens}
    env = machine_env(args.out, args.only)  # this invocation's machine and code
    elapsed = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "results.csv", [r for name in names for r in rows[name]])
    write_json(args.out / "fit.json", fits)
    summary = summarize(rows, spreads, fits, env, args, run_budgets(args.out, names, budget), elapsed, elsewhere)
    (args.out / "SUMMARY.md").write_text(summary)
    print(summary)


ALLOCATOR_NOTE = (
    "Allocator: glibc with MALLOC_MMAP_THRESHOLD_=2^30 and MALLOC_TRIM_THRESHOLD_=2^30 (set by this script) "
    "unless the line above says otherwise. With glibc's defaults every temporary over 32 MiB is mmapped, "
    "page-faulted and zeroed on each call, depending on the process's allocation history, and a variant "
    "whose temporaries cross 32 MiB between two N shows a step in time that is not in its algorithm. "
    "`--glibc-default` keeps the defaults.")


# How to read the tables: what follows from the method and the algorithms, true of any run. What one run
# showed (and why) belongs in the results directory's own notes, with the numbers of that run.
NOTES = """\
- Theory is the slope of the analytic FLOPs and memory between the same N: a measured time exponent
  above it is the machine (memory traffic, page faults of N×N temporaries, per-op overhead at small N),
  not the algorithm; the memory exponent is the check of the algorithm.
- sparse (fixed) is quadratic by design: every L-th key block is a summary block seen by every later
  query, so its theory exponent is below 2 but rises towards it with N.
- Peak memory is the profiler's replay of the allocations (extra over the inputs); the analytic figures
  are upper bounds of the same quantity.
- reformer's default n_buckets = 2N/c makes hashing quadratic (its theory exponent is above 1);
  adaptive_span runs at its initial spans (every key within max_span + ramp).
- The machine may be shared: see "Disturbance". Compare timings within one run, as ratios.
"""


def run_harness(overrides: list[str], output_dir: Path) -> None:
    """One sweep through the command line (python -m harness, i.e. run(cfg)), each in a fresh process:
    no variant inherits another's heap (the allocator's history changes CPU timings, see above)."""
    cmd = [sys.executable, "-m", "harness", *overrides, f"hydra.run.dir={output_dir}", "hydra.output_subdir=null",
           "hydra/job_logging=disabled"]
    rc = wait_through_ctrl_c(subprocess.Popen(cmd, cwd=ROOT))
    # A harness that refused (a length or budget it will not take: exit 2) or failed said why in its one
    # line, and nothing is combined from a variant it did not measure: its exit code is this one's.
    if rc < 0:  # killed by a signal: it said nothing
        print(f"bench_cpu.py: the harness was killed by {signal.Signals(-rc).name} while measuring into "
              f"{output_dir}", file=sys.stderr)
        sys.exit(128 - rc)
    if rc:
        sys.exit(rc)


def machine_env(out: Path, names: list[str]) -> dict:
    """The machine and code the summary names: the first measured variant's env.json (the harness writes
    one with each run), else, where none is there (a --resume that ran nothing, its env.json removed by
    hand: a traceback after the combined files were written), this process's, dated now."""
    import torch

    from harness import env as envmod

    for name in names:
        if (path := out / name / "env.json").exists():
            return json.loads(path.read_text())
    return {**envmod.collect(torch.device("cpu")).as_dict(), "date": envmod.now()}


def run_budgets(out: Path, names: list[str], default: float) -> list[float]:
    """The memory budgets (GB) the kept rows' runs had, from each run's env.json: the summary states
    theirs, not this invocation's (a --resume that measured nothing stated the memory free now);
    ``default`` where no run's is there."""
    found = set()
    for name in names:
        for path in [out / name / "env.json", *(out / name).glob("round-*/env.json")]:
            try:
                value = json.loads(path.read_text()).get("config", {}).get("memory_budget_gb")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found.add(float(value))
    return sorted(found) or [default]


def wait_for_quiet(max_other_cores: float, timeout_s: float = 120.0) -> None:
    """Waits (up to timeout_s) until other processes use at most max_other_cores over one second."""
    from harness.env import OtherLoad

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = OtherLoad()
        load.start()
        time.sleep(1.0)
        if (load.stop() or 0.0) <= max_other_cores:
            return


def again(vdir: Path, args) -> list[int]:
    """The lengths measured again in a later round: ok in the first, and quick enough."""
    first = {r.seq_len: r for rs in candidates(vdir, rounds=False).values() for r in rs}
    return [n for n in args.seq_lens if n in first and first[n].status == "ok"
            and 6.5 * (first[n].fwd_bwd_ms or 0) / 1e3 <= args.round_max_s]  # warm-up, memory, 3 passes


def stored(vdir: Path, rounds: bool = True) -> list[dict]:
    """The rows of a variant's directory (``<out>/<name>``), the first round's and the later rounds', each
    the point's latest row in its directory (a point measured again supersedes its earlier row there; both
    stay in the file), of this script's configuration ``name`` only: a row another command measured into
    the directory (another window, another batch) is no round of it."""
    paths = [vdir / "results.jsonl", *(sorted(vdir.glob("round-*/results.jsonl")) if rounds else [])]
    name = vdir.parent.name if vdir.name.startswith("round-") else vdir.name  # a later round's own directory
    return [rec for path in paths if path.exists() for rec in latest(read_jsonl(path)) if ours(rec, name)]


def ours(rec: dict, name: str) -> bool:
    """Whether a row has what CONFIGS[name] and WORKLOAD set: its variant, backend, options, shape, dtype."""
    import yaml

    for override in (*CONFIGS[name], *WORKLOAD):
        key, value = override.split("=", 1)
        field = {"variant.backend": "backend"}.get(key, "opt_" + key.removeprefix("variant.") if
                                                    key.startswith("variant.") else key)
        if rec.get(field) != yaml.safe_load(value):
            return False
    return True


def candidates(vdir: Path, rounds: bool = True) -> dict[int, list[Result]]:
    """Every measurement of each N in a variant's directory taken on this machine (CPU model and threads)."""
    import torch

    from harness.env import cpu_name

    here = (cpu_name(), torch.get_num_threads())
    found: dict[int, list[Result]] = {}
    for rec in stored(vdir, rounds):
        if machine(rec) == here:
            found.setdefault(rec["seq_len"], []).append(Result.from_record(rec))
    return found


def spread(rs: list[Result]) -> tuple[int, float | None]:
    """(rounds, slowest / fastest forward+backward time among the ok ones)."""
    ms = [r.fwd_bwd_ms for r in rs if r.status == "ok" and r.fwd_bwd_ms]
    return len(rs), (max(ms) / min(ms) if ms else None)


def by_n(rs):
    return {r.seq_len: r for r in rs}


def cell_ms(r) -> str:
    if r is None:
        return "-"
    if r.status != "ok":
        return r.status
    iqr = "" if r.fwd_bwd_iqr_ms is None else f" ±{r.fwd_bwd_iqr_ms:.2g}"
    return f"{r.fwd_bwd_ms:.4g}{iqr}" + (" noisy" if untrusted(r.record(), "fwd_bwd_ms") else "")


def cell_mib(r) -> str:
    if r is None:
        return "-"
    if r.status != "ok" or r.peak_mem_bytes is None:
        return r.status
    return f"{r.peak_mem_bytes / MiB:.1f}"


def disagree(sp: tuple[int, float | None] | None) -> str:
    return "*" if sp and sp[1] and sp[1] > ROUNDS_DISAGREE else ""


def cell_spread(sp: tuple[int, float | None] | None) -> str:
    if sp is None:
        return "-"
    return f"{fmt(sp[1])}{disagree(sp)} ({sp[0]})" if sp[0] > 1 else f"- ({sp[0]})"


def fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def summarize(rows, spreads, fits, env, args, budgets, elapsed, elsewhere) -> str:
    ns = args.seq_lens
    codes = {name: sorted({r.code_version or "unknown" for r in rs}) for name, rs in rows.items()}
    earlier = [name for name in rows if name not in args.only]
    by = {name: by_n(rs) for name, rs in rows.items()}

    def per_n(cell: Callable[[str, int], str]) -> list[str]:
        """A table of a row per variant, a column per N."""
        return markdown_table(["variant", *(f"N={n}" for n in ns)], [[name, *(cell(name, n) for n in ns)] for name in rows],
                              right_from=1)
    out = ["# CPU benchmark: time and peak memory against sequence length", "",
           f"Workload: B=1, H=4, D=64, float32, non-causal, forward+backward. Machine: {env['device_name']}, "
           f"{env['num_threads']} threads, torch {env['torch_version']}, code {env.get('code_version')}, "
           f"allocator {env['allocator']}, {env['hostname']}, {env['date']} "
           f"(load average {fmt(env.get('load_avg_1m'))} at the start of the first variant). "
           f"Timer: torch.utils.benchmark blocked_autorange, min run time {args.min_run_time} s per pass, "
           f"1 warm-up call; memory: profiler allocation replay (extra over the inputs); "
           f"memory budget {budgets[0]:.3g}"
           f"{'' if len(budgets) == 1 else f' to {budgets[-1]:.3g} (runs differ)'} GB. Produced by `python scripts/bench_cpu.py`; rows in results.csv, "
           f"fits in fit.json.", "", ALLOCATOR_NOTE, "",
           *([f"This invocation measured {', '.join(args.only)}; the rows of {', '.join(earlier)} are earlier "
              "invocations' on this machine (dates below).", ""] if earlier else []),
           *([f"Code versions differ between rows: {'; '.join(n + ': ' + ', '.join(c) for n, c in codes.items())}.",
              ""] if len({c for cs in codes.values() for c in cs}) > 1 else []),
           *(["Not in these tables, measured on another machine (compare within one machine): "
              f"{'; '.join(n + ' (' + ', '.join(m) + ')' for n, m in elsewhere.items())}.", ""] if elsewhere else []),
           "## Forward+backward time, ms (median ± IQR)", "",
           f"The median of each point's rounds (see Rounds); * where its rounds differ by more than "
           f"{ROUNDS_DISAGREE - 1:.0%}; noisy where every round's forward+backward was (its spread or other "
           "processes' load: see Disturbance), a timing not to be quoted.", "",
           *per_n(lambda name, n: cell_ms(by[name].get(n)) + disagree(spreads[name].get(n)))]
    out += ["", "## Peak memory of forward+backward, MiB (extra over the inputs)", "",
            *per_n(lambda name, n: cell_mib(by[name].get(n)))]
    out += ["", "## Fitted log-log exponents (least squares over ok points) beside theory",
            "", "Theory: the slope of the variant's analytic forward FLOPs (time) and analytic memory "
            "(memory) between the same N.", ""]
    out += markdown_table(
        ["variant", "time, all N", "theory", "time, 2K→16K", "theory", "memory, all N", "theory"],
        [[name, *(fmt(fits[name][fit].get(key, {}).get(part)) for fit, key in
                  (("all", "fwd_bwd_ms"), ("2k_16k", "fwd_bwd_ms"), ("all", "memory")) for part in ("fitted", "theory"))]
         for name in rows], right_from=1)
    out += ["", "## Targets", ""] + targets(rows, fits)
    most = max((sp[0] for sps in spreads.values() for sp in sps.values()), default=args.rounds)  # earlier ones too
    out += ["", "## Rounds", "",
            f"Each point was measured in up to {most} rounds, each in its own process, minutes apart "
            f"(rounds in alternating variant order; a point whose first round took over {args.round_max_s:.0f} s "
            "was measured once). The cell: the slowest round's forward+backward time over the fastest's "
            "(the number of rounds); the tables above hold the median round.", "",
            *per_n(lambda name, n: cell_spread(spreads[name].get(n)))]
    out += ["", "## Disturbance", "",
            "Cores kept busy by other processes (or stolen by the hypervisor) while each kept point ran. The "
            "kept round is the median among those whose forward+backward is not flagged noisy (its spread, "
            f"or other processes above {args.max_other_cores} cores), among all where every round is "
            "(harness.results.median_run, as the report's).",
            "", *per_n(lambda name, n: fmt(by[name][n].other_cpu_cores) if n in by[name] else "-")]
    # The start: the first variant's env.json, or a row's date where that is earlier (a rerun that measured
    # nothing writes env.json again: "from 12:07 to 12:05")
    dates = [r.date for name in rows for rs in candidates(args.out / name).values() for r in rs if r.date]
    first = min(dates + [json.loads(env.read_text())["date"] for name in rows
                         if (env := args.out / name / "env.json").exists()])
    last = max(dates)
    span = datetime.datetime.fromisoformat(last) - datetime.datetime.fromisoformat(first)
    out += ["", f"Measured from {first} to {last} ({span.total_seconds() / 60:.1f} min on this machine, "
            f"every round included); this invocation of the script took {elapsed / 60:.1f} min"
            + (" (earlier results reused with --resume)." if args.resume else ".")]
    out += ["", "## Notes", "", NOTES]
    problems = [r for rs in rows.values() for r in rs if r.status != "ok"]
    if problems:
        out += ["", "## Points not measured", ""]
        out += [f"- {r.variant} ({r.backend}) N={r.seq_len}: {r.status}: {r.reason}" for r in problems]
    return "\n".join(out) + "\n"


def targets(rows, fits) -> list[str]:
    lines = []

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("**met**" if ok else "**missed**")

    bw, fm = by_n(rows.get("blockwise", [])).get(8192), by_n(rows.get("full_math", [])).get(8192)
    if bw and fm and bw.peak_mem_bytes and fm.peak_mem_bytes:
        ratio = bw.peak_mem_bytes / fm.peak_mem_bytes
        lines.append(f"- blockwise exact peak memory at N=8192 <= 1/10 of full math: {verdict(ratio <= 0.1)} "
                     f"({bw.peak_mem_bytes / MiB:.1f} MiB vs {fm.peak_mem_bytes / MiB:.1f} MiB, ratio {ratio:.4f} "
                     f"= 1/{1 / ratio:.0f})")
    else:
        lines.append(f"- blockwise exact peak memory at N=8192 <= 1/10 of full math: {verdict(None)}")
    for name in ("sliding_window", "linear"):
        f = fits.get(name, {}).get("2k_16k", {}).get("fwd_bwd_ms")
        if f is None:
            lines.append(f"- {name} time exponent <= 1.2 over 2K→16K: {verdict(None)}")
        else:
            lines.append(f"- {name} time exponent <= 1.2 over 2K→16K: {verdict(f['fitted'] <= 1.2)} "
                         f"(fitted {f['fitted']:.2f}, theory {f['theory']:.2f}, over N={f['seq_lens']})")
    f = fits.get("full_math", {}).get("all", {}).get("memory")
    if f is None:
        lines.append(f"- full math memory exponent ≈ 2: {verdict(None)}")
    else:
        lines.append(f"- full math memory exponent ≈ 2 (within 0.1): {verdict(abs(f['fitted'] - 2) <= 0.1)} "
                     f"(fitted {f['fitted']:.3f}, theory {f['theory']:.3f}, over N={f['seq_lens']})")
    return lines


if __name__ == "__main__":
    sys.exit(ctrl_c_is_one_line(main, "bench_cpu.py", "rerun the same command to resume (what was measured is kept)"))
