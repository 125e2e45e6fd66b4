"""GPU benchmark: the harness's own sweeps at the FlashAttention papers' shapes, then what a sweep cannot
measure (the matmul roof, public kernels, the harness's overhead: bench_gpu_kernels.py) and the targets
(bench_gpu_summary.py). This file plans the job: which sweeps, in which order; harness.job runs them
within a budget, resumably.

    python scripts/bench_gpu.py [--out DIR] [--budget-s S] [--steps roof,c-targets,d,a-targets,c,a] [--smoke]
    python scripts/bench_gpu.py --summary-only --out DIR   # SUMMARY.md, summary.json, reports again (on any
                                                           # machine: judged as on the one that measured)

Steps, what the targets need first (a job spread over short calls has them early). Each is made of
harness sweeps of the presets in conf/sweep/, except roof, d's overhead and public kernels, which this
script runs in a process of its own:
  roof       n×n×n torch.matmul in bf16 and fp16, triton.testing.do_bench median -> roof.json
  c-targets  fa2_full at the roof target's point (N=16K, D=128, non-causal), every full backend -> c/
  d          the harness's timing against raw do_bench of the same callable, three harness runs each
             between two raw timings -> d/overhead.json;
             pattern_compare: each efficient variant whose pattern a public kernel computes, every backend
             -> d/<variant>/; at the same point the public kernels (raw xformers, raw FlexAttention with the
             pattern's mask_mod, SDPA on blocks; first call and BlockMask timed apart), and our flex backend
             called bare beside them -> d/compare.jsonl
  a-targets  seq_len_scaling for full's math (Table 21), and for the exponent targets' variants from the
             fit's first length (4K) -> a/<variant>/
  c          fa2_full at every N, D and causal (c-targets' points are not measured again)
  a          seq_len_scaling (FA-1 shape: B=16, H=8, D=64, fp16, N=128…65536), every variant with every
             backend the device has: a series stops at its first oom (the OOM frontier) -> a/<variant>/
In a step, the backends that compile per N (flex) run in sweeps of their own after the others, and the
N×N backends last; where a run of such sweeps begins, their points are compiled first, several processes
at once, by warm-up calls only (precompile: the sweeps then load the kernels from torch's caches). A
rerun into the same --out (default results/gpu/<UTC date>-<device>/) resumes: a sweep skips the points
it has, a finished step is not run again while what it measured is there (state.json, and its rows or
file; a job file that does not read is set aside); a directory that an earlier invocation measured on
another device is refused. --budget-s bounds the invocation: a sweep still running when it is spent
gets SIGTERM (its job records status interrupted and resumes on the next invocation). Then SUMMARY.md
and summary.json (targets: met | missed, with the gap | not measured | skipped on CPU), and
harness.report's plots and tables (a/report/, c/report/).
--smoke: the same code at tiny sizes, float32 on CPU; what needs CUDA (roof, xformers, FlexAttention's
backward, the kernels SDPA pins) is recorded skipped, and the overhead cases that run on CPU are timed
against torch.utils.benchmark instead of do_bench.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]  # the harness, and this script's two modules
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
from harness.signals import exit_at_startup_interrupts  # noqa: E402

exit_at_startup_interrupts("bench_gpu.py")

import torch  # noqa: E402

from bench_gpu_kernels import part_overhead, part_public, part_roof, public_list  # noqa: E402
from bench_gpu_summary import (COMPARED, EXPONENT_TARGETS, TABLE21, case_disturbed, d_done, invocations,  # noqa: E402
                               job_file, n2, other_device, side_rows, summarize)
from harness.config import (BENCH_GPU, ConfigError, check_results_dir, ctrl_c_is_one_line, one_line_errors,  # noqa: E402
                            output_dir_arg, positive_arg)
from harness.env import device_name, now  # noqa: E402
from harness.job import COMPILED, Job, Step, with_seq_lens  # noqa: E402
from harness.results import LockedError, write_json  # noqa: E402

STEPS = ("roof", "c-targets", "d", "a-targets", "c", "a")
CHILDREN = {"roof": part_roof, "d:overhead": part_overhead, "d:public": part_public}  # steps of this script's own
CHILD_FILES = {"roof": "roof.json", "d:overhead": "d/overhead.json"}  # what they write, whole (d:overhead after each case)
# (label, variant, options): part a's series and the comparisons' variants.
VARIANTS = [("full", "full", {}), ("sliding_window", "sliding_window", {}), ("linear", "linear", {}),
            ("blockwise-local", "blockwise", {"mode": "local"}), ("sparse-fixed", "sparse", {"pattern": "fixed"}),
            ("sparse-strided", "sparse", {"pattern": "strided"}), ("sparse-bigbird", "sparse", {"pattern": "bigbird"}),
            ("blockwise-exact", "blockwise", {"mode": "exact"}), ("reformer", "reformer", {}),
            ("adaptive_span", "adaptive_span", {})]


@dataclass(frozen=True)
class Plan:
    smoke: bool
    a: list[str]  # overrides on top of conf/sweep/seq_len_scaling.yaml
    c: list[str]  # ... and of conf/sweep/fa2_full.yaml
    shape: tuple[int, int, int]  # (B, H, D) of the comparisons (pattern_compare's) and the overhead (FA-1's)
    dtype: str
    compare_seq_len: int
    overhead_seq_len: int
    exponent_range: tuple[int, int]
    roof_size: int
    roof_target: tuple[int, int]  # (N, D) of the roof target
    common: list[str] = field(default_factory=list)
    overhead_rounds: int = 3  # rounds per call at most for an overhead case whose raw timings disagree


GPU_PLAN = Plan(smoke=False, a=[], c=[], shape=(16, 8, 64), dtype="float16", compare_seq_len=16384,
                overhead_seq_len=4096, exponent_range=(4096, 65536), roof_size=8192, roof_target=(16384, 128))
# Tiny sizes on CPU, timings not judged as noise: proves the orchestration, measures nothing.
QUIET = ["measure.min_run_time=0.01", "measure.min_samples=2", "measure.max_rel_iqr=1000",
         "measure.max_other_cores=1000", "measure.on_noise=flag", "device=cpu", "dtype=float32"]
SMOKE_PLAN = Plan(smoke=True, a=["seq_lens=[128,256]", "batch_size=1", "num_heads=2", "head_dim=16",
                                 "fidelity.enabled=false"],
                  c=["seq_lens=[128,256]", "tokens_per_batch=256", "model_dim=64", "head_dim=16,32"],
                  shape=(1, 2, 16), dtype="float32", compare_seq_len=256, overhead_seq_len=256,
                  exponent_range=(128, 256), roof_size=256, roof_target=(256, 32), common=QUIET,
                  overhead_rounds=1)  # CPU timings, no target: one round, whatever they say


class Context(Job):
    """One invocation, a harness.job.Job (the results directory and its state.json, the budget left, the
    sweeps' runs) with the plan, the device and the labels chosen; and what each label is on the device,
    for bench_gpu_kernels and bench_gpu_summary too (they read no other module's definitions of the job)."""

    prog = "bench_gpu.py"

    def __init__(self, plan: Plan, out: Path, device: torch.device, budget_s: float | None, log,
                 labels: list[str], recorded: dict[str, list[str]] | None = None) -> None:
        super().__init__(out, budget_s, log, plan.common, device)
        self.plan, self.labels = plan, labels
        self.skips_cuda = device.type != "cuda"  # what needs CUDA is skipped
        self.dtype = "float32" if self.skips_cuda else plan.dtype  # of the kernels this script times
        self.lost = False  # this process lost its CUDA context (d:public): its kernels stop
        self._steps: list[Step] | None = None
        # Reading an earlier run's results (--summary-only, --pending): each label's backends as the
        # measuring machine had them (measured_on), not as this one's installation has them
        self.recorded = recorded or {}

    def steps(self, group: str | None = None) -> list[Step]:
        if self._steps is None:
            self._steps = plan_steps(self)
        return [s for s in self._steps if group in (None, s.group)]

    def done(self, group: str) -> bool:
        return all(self.complete(s) for s in self.steps(group))

    def complete(self, step: Step) -> bool:
        """Whether ``step`` has nothing left to measure: state.json says so, and what it measured is there:
        a sweep's row for each of its points, d:public's for each public kernel (a length, pattern or
        kernel added since the step ran, or a file lost since, reopens it), roof's and d:overhead's file."""
        if step.preset is not None or self.state.get(step.name) != "complete":
            return super().complete(step)
        if step.name == "d:public":
            have = d_done(side_rows(self.out / "d" / "compare.jsonl"))
            return all((label, name) in have for label, name, *_ in public_list(self))
        done = job_file(self.out / CHILD_FILES[step.name])
        if step.name == "d:overhead" and done is not None and not self.skips_cuda:
            # a case still disturbed is measured again, by two calls' rounds at most (then said so for good)
            return not any(case_disturbed(c) and 1 + len(c.get("earlier_rounds", [])) < 2 * self.plan.overhead_rounds
                           for c in done.get("cases", []))
        return done is not None

    def command(self, step: Step, overrides: tuple[str, ...] | None = None, sweep_dir: Path | None = None
                ) -> list[str]:
        """A sweep's process (Job's), or this script again for one step of its own."""
        if step.preset is not None:
            return super().command(step, overrides, sweep_dir)
        cmd = [str(Path(__file__).resolve()), "--child", step.name, "--out", str(self.out),
               "--variants", ",".join(self.labels), *(["--smoke"] if self.plan.smoke else [])]
        return cmd + ([] if self.left() == float("inf") else ["--budget-s", f"{self.left():.0f}"])

    # What a label is on this device
    def build(self, label: str):
        import variants

        (variant, options), = [(v, o) for lb, v, o in VARIANTS if lb == label]
        return variants.build(variant, **options)

    def backends(self, label: str) -> list[str]:
        if label in self.recorded:
            return list(self.recorded[label])
        return self.build(label).available_backends(self.device)

    def compared_backends(self, label: str) -> list[str]:
        """The backends part d times for a pattern: every one the device has but the N×N one, compiled last."""
        name = self.build(label).name
        return sorted((b for b in self.backends(label) if not n2(name, b)), key=lambda b: b in COMPILED)

    def public_names(self, label: str) -> list[str]:
        """The kernels d:public times for a pattern (the public ones, and ours bare)."""
        return [name for lb, name, *_ in public_list(self) if lb == label]


# ----- the steps -----------------------------------------------------------------------------------

def plan_steps(ctx: Context) -> list[Step]:
    """Every step of the job, group by group in STEPS' order, each group's in the order they run."""
    n, d = ctx.plan.roof_target
    full = [f"variant.backend={','.join(ctx.backends('full'))}", *ctx.plan.c]
    roof_point = [o for o in with_seq_lens("fa2_full", full, lambda x: x == n)
                  if not o.startswith(("head_dim=", "causal="))] + [f"head_dim={d}", "causal=false"]
    steps = [Step("roof", "roof"), Step("c-targets", "c-targets", "fa2_full", tuple(roof_point), "c"), *d_steps(ctx),
             *a_series(ctx, targets=True), Step("c", "c", "fa2_full", tuple(full), "c"), *a_series(ctx)]
    return sorted(steps, key=lambda s: STEPS.index(s.group))  # stable


def a_series(ctx: Context, targets: bool = False) -> list[Step]:
    """Part a's sweeps in the order they run: what a target needs first (tier 0: full's math, Table 21;
    tiers 1 and 2: the exponent series, compiled backends after the others), then the other efficient
    variants and full's kernels (3, compiled ones 4), the other N×N backends last (5: full's sdpa_math among
    them). A variant's compiled backends are a sweep of their own (<label>:compiled, the same job
    directories), so a call cut short has not spent its budget compiling one variant's kernels while
    another's series waits. ``targets``: tiers 0 to 2 only, 1 and 2 narrowed to the exponent fit's lengths
    (a-targets:<label>...); tier 0 is part a's own sweep (a:full:table21), not run twice."""
    import variants

    series = []
    for label, variant, options in VARIANTS:
        if variant not in variants.REGISTRY or label not in ctx.labels:
            continue
        kinds = {b: ":table21" if (variant, b) == TABLE21 else ":n2" if n2(variant, b) else
                 ":compiled" if b in COMPILED else "" for b in ctx.backends(label)}
        target = label in EXPONENT_TARGETS
        for kind, tier in (("", 1 if target else 3), (":compiled", 2 if target else 4), (":table21", 0),
                           (":n2", 5)):
            chosen = [b for b, k in kinds.items() if k == kind]
            if not chosen or (targets and tier > 2):
                continue
            narrowed = targets and tier in (1, 2)  # the exponent series from the fit's first length
            overrides = variant_overrides(variant, chosen, options) + ctx.plan.a
            if narrowed:
                overrides = with_seq_lens("seq_len_scaling", overrides, lambda n: n >= ctx.plan.exponent_range[0])
            name = f"{'a-targets' if narrowed else 'a'}:{label}{kind}"
            series.append((tier, Step("a-targets" if targets else "a", name, "seq_len_scaling", tuple(overrides),
                                      f"a/{label}", compiled=kind == ":compiled")))
    return [step for _, step in sorted(series, key=lambda s: s[0])]  # stable: VARIANTS' order in a tier


def d_steps(ctx: Context) -> list[Step]:
    """Part d: the overhead (seconds, a target), each compared variant with its backends at the
    comparison's point (pattern_compare; one process per pattern, the compiled backends last), then the
    public kernels (d:public)."""
    (B, H, D), N = ctx.plan.shape, ctx.plan.compare_seq_len
    point = [f"seq_lens=[{N}]", f"batch_size={B}", f"num_heads={H}", f"head_dim={D}"]
    steps = [Step("d", f"d:{label}", "pattern_compare",
                  (*variant_overrides(variant, ctx.compared_backends(label), options), *point), f"d/{label}")
             for label, variant, options in VARIANTS if label in COMPARED and label in ctx.labels]
    return [Step("d", "d:overhead"), *steps, Step("d", "d:public")]


def variant_overrides(variant: str, backends: list[str], options: dict[str, Any]) -> list[str]:
    return [f"variant={variant}", f"variant.backend={','.join(backends)}", *[f"variant.{k}={v}" for k, v in options.items()]]


def record_invocation(ctx: Context, steps: list[str]) -> None:
    """env.json: one entry per invocation (machine, versions, clocks, date, steps)."""
    import variants
    from harness import env as envmod
    from variants.xformers_backend import unavailable_reason

    entries = invocations(ctx.out)
    unavailable = {"xformers": unavailable_reason(ctx.device)} if ctx.device.type == "cuda" else {}
    entries.append({"date": now(), "steps": ",".join(steps), "device": ctx.device.type, "smoke": ctx.plan.smoke,
                    "python": platform.python_version(),
                    "unavailable_backends": {b: r for b, r in unavailable.items() if r is not None},
                    "backends": {label: ctx.backends(label) for label, variant, _ in VARIANTS if variant in variants.REGISTRY},
                    **envmod.collect(ctx.device).as_dict(),
                    "nvidia_smi": envmod.nvidia_smi("name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                                                    "clocks.max.mem,power.limit,temperature.gpu,memory.total",
                                                    header=True)})
    write_json(ctx.out / "env.json", entries)


def measured_on(out: Path, default: torch.device) -> tuple[torch.device, dict[str, list[str]], bool]:
    """The device type the last invocation into ``out`` measured on, else ``default``, each label's
    backends there (env.json; none in an entry older than the field), and whether it was --smoke."""
    last = (invocations(out) or [{}])[-1]
    return (torch.device(last["device"]) if "device" in last else default, last.get("backends", {}),
            last.get("smoke") is True)


def main(argv: list[str] | None = None) -> int:
    ap = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--out", type=output_dir_arg, default=None,
                    help="output directory (default results/gpu/<date>-<device>)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, in order (default {','.join(STEPS)})")
    labels = [label for label, _, _ in VARIANTS]
    ap.add_argument("--variants", default=",".join(labels), help=f"part a and d's series (default: all of {', '.join(labels)})")
    ap.add_argument("--budget-s", type=positive_arg(float), default=None,
                    help="seconds for this invocation (default: no limit)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, float32 on CPU: the orchestration end to end")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite SUMMARY.md, summary.json and reports")
    ap.add_argument("--pending", action="store_true", help="print the steps not complete in --out and exit")
    ap.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)  # run_step's process
    args = ap.parse_args(argv)
    # a step or label given twice is one (--pending printed it twice)
    steps = list(dict.fromkeys(s for s in args.steps.split(",") if s))
    chosen = list(dict.fromkeys(v for v in args.variants.split(",") if v))
    for flag, given, allowed in (("--variants", chosen, labels), ("--steps", steps, STEPS)):
        unknown = sorted(set(given) - set(allowed))
        if unknown or not given:  # none given ran nothing and wrote a summary of it, exit 0
            ap.error(f"argument {flag}: {'unknown ' + ', '.join(unknown) if unknown else 'none given'}; "
                     f"allowed: {', '.join(allowed)}")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-") if device.type == "cuda" else "cpu"
    out = (args.out or ROOT / ("outputs/bench_gpu_smoke" if args.smoke else
                               f"results/gpu/{datetime.date.today().isoformat()}-{slug}")).resolve()
    reader = "--summary-only" if args.summary_only else "--pending" if args.pending else None
    if reader and not out.is_dir():  # made here, it would hold a summary of nothing
        ap.error(f"{reader} reads the results directory of an earlier run (--out DIR); {out} does not exist")
    if not args.child:  # a run's directory (its env.json), bench_cpu's (its SUMMARY.md): not written over
        try:
            check_results_dir(out, BENCH_GPU, ("env.json", "state.json", "SUMMARY.md", "summary.json", "roof.json"))
        except ConfigError as e:
            ap.error(f"argument --out: {e}")
    out.mkdir(parents=True, exist_ok=True)
    recorded = None
    if reader:  # judged as on the machine that measured: a GPU's results stay a GPU's elsewhere
        device, recorded, smoke = measured_on(out, device)  # a smoke run's sizes too, with or without --smoke
        args.smoke = args.smoke or smoke
    elif not args.child and (why := other_device(out, device_name(device))):
        ap.error(why)
    ctx = Context(SMOKE_PLAN if args.smoke else GPU_PLAN, out, device, args.budget_s, None, chosen, recorded)
    if args.pending:
        print(" ".join(s for s in steps if not ctx.done(s)))
        return 0
    if args.child:
        return CHILDREN[args.child](ctx)
    lock = None
    try:
        if not args.summary_only:
            try:
                lock = ctx.hold()  # state.json and env.json are this invocation's to rewrite
            except LockedError as e:
                ap.error(str(e))
            record_invocation(ctx, steps)
            ctx.log(f"bench_gpu: steps {','.join(steps)} on {device} -> {out}")
            for group in steps:
                ctx.run(ctx.steps(group))
                ctx.log(f"step {group}: {'complete' if ctx.done(group) else 'not complete'}")
        res = summarize(ctx)
    finally:
        if lock is not None:
            lock.release()
    for t in res["targets"]:
        ctx.log(f"target {t['target']}: {t['status']}" + (f" ({t['gap']})" if t["gap"] else ""))
    ctx.log(f"wrote {out / 'SUMMARY.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(ctrl_c_is_one_line(main, "bench_gpu.py", "rerun the same command to resume (a sweep that was running said so itself)"))