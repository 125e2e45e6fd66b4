"""GPU benchmark: the harness's own sweeps at the FlashAttention papers' shapes, then what a sweep cannot
measure (the matmul roof, public kernels, the harness's overhead) and the targets.

    python scripts/bench_gpu.py [--out DIR] [--budget-s S] [--steps roof,c-targets,d,a-targets,c,a] [--smoke]
    python scripts/bench_gpu.py --summary-only --out DIR   # SUMMARY.md, summary.json, reports again (on any
                                                           # machine: judged as on the one that measured)

Steps, what the targets need first (a job spread over short calls has them early). Each is made of
harness sweeps of the presets in conf/sweep/, except roof, d's overhead and public kernels, which this
script runs in a process of its own:
  roof       n×n×n torch.matmul in bf16 and fp16, triton.testing.do_bench median -> roof.json
  c-targets  fa2_full at the roof target's point (N=16K, D=128, non-causal), every full backend -> c/
  d          the harness's timing against raw do_bench of the same callable -> d/overhead.json;
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
N×N backends last. A rerun into the same --out (default results/gpu/<UTC date>-<device>/) resumes: a
sweep skips the points it has, a finished sweep is not run again (state.json). --budget-s bounds the
invocation: a sweep still running when it is spent gets SIGTERM (its job records status interrupted and
resumes on the next invocation). Then SUMMARY.md and summary.json (targets: met | missed, with the gap |
not measured | skipped on CPU), and harness.report's plots and tables (a/report/, c/report/).
--smoke: the same code at tiny sizes, float32 on CPU; what needs CUDA (roof, xformers, FlexAttention's
backward, the kernels SDPA pins) is recorded skipped, and the overhead cases that run on CPU are timed
against torch.utils.benchmark instead of do_bench.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from harness.config import ctrl_c_is_one_line, one_line, one_line_errors, output_dir_arg, positive_arg  # noqa: E402
from harness.env import now  # noqa: E402
from harness.results import InputError, atomic_write, fit_exponents, latest, load_rows, read_jsonl, write_json  # noqa: E402

MiB = 2**20
STEPS = ("roof", "c-targets", "d", "a-targets", "c", "a")
NEEDS_CUDA = "skipped: needs CUDA"
BUDGET_SPENT = 3  # the exit status of a step of this script's own that the budget stopped (not a failure)
CHILDREN = ("roof", "d:overhead", "d:public")  # the steps this script runs itself (in a process of their own)
# (label, variant, options): part a's series and the comparisons' variants.
VARIANTS = [("full", "full", {}), ("sliding_window", "sliding_window", {}), ("linear", "linear", {}),
            ("blockwise-local", "blockwise", {"mode": "local"}), ("sparse-fixed", "sparse", {"pattern": "fixed"}),
            ("sparse-strided", "sparse", {"pattern": "strided"}), ("sparse-bigbird", "sparse", {"pattern": "bigbird"}),
            ("blockwise-exact", "blockwise", {"mode": "exact"}), ("reformer", "reformer", {}),
            ("adaptive_span", "adaptive_span", {})]
N2_BACKENDS = {"dense", "math", "sdpa_math"}  # full's math and sdpa_math, any variant's dense: N×N in memory
TABLE21 = ("full", "math")  # the path FA-1 Table 21's target reads: the only N×N series a target needs
COMPARED = ("sliding_window", "blockwise-local", "sparse-fixed", "sparse-strided", "sparse-bigbird")
EXPONENT_TARGETS = ("sliding_window", "linear", "reformer", "adaptive_span")
# Three kinds of kernel: a pinned SDPA one, a compiled one (FlexAttention: on any CUDA machine with triton;
# xformers' wheels did not run on the H100's CUDA 13) and a composition of torch ops
OVERHEAD_CASES = [("full", "sdpa_flash"), ("sliding_window", "flex"), ("linear", "sdpa")]
COMPILED = ("flex",)  # backends that compile per N (tens of seconds each): sweeps of their own, later
# Our flex backend called bare, in the public kernels' process, beside them (kind "ours-bare", in no target):
# against the public FlexAttention it measures our mask_mod; against our harness row, the harness run.
OURS_BARE = "ours flex, called bare"
PUBLISHED = ("FA-3 on H100: up to 740 TFLOP/s fp16 forward, at its best head dimension (75% of the 989 TFLOP/s "
             "datasheet peak); FA-2 on H100 about 335-370 TFLOP/s forward (both papers' 16K-token, hidden-2048 "
             "benchmark)")


def n2(variant: str, backend: str) -> bool:
    """Whether a backend holds N×N tensors (linear's math is O(N·k): not one of them)."""
    return backend == "dense" or (variant == "full" and backend in N2_BACKENDS)


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


GPU_PLAN = Plan(smoke=False, a=[], c=[], shape=(16, 8, 64), dtype="float16", compare_seq_len=16384,
                overhead_seq_len=4096, exponent_range=(4096, 65536), roof_size=8192, roof_target=(16384, 128))
# Tiny sizes on CPU, timings not judged as noise: proves the orchestration, measures nothing.
QUIET = ["measure.min_run_time=0.01", "measure.min_samples=2", "measure.max_rel_iqr=1000",
         "measure.max_other_cores=1000", "measure.on_noise=flag", "device=cpu", "dtype=float32"]
SMOKE_PLAN = Plan(smoke=True, a=["seq_lens=[128,256]", "batch_size=1", "num_heads=2", "head_dim=16",
                                 "fidelity.enabled=false"],
                  c=["seq_lens=[128,256]", "tokens_per_batch=256", "model_dim=64", "head_dim=16,32"],
                  shape=(1, 2, 16), dtype="float32", compare_seq_len=256, overhead_seq_len=256,
                  exponent_range=(128, 256), roof_size=256, roof_target=(256, 32), common=QUIET)


@dataclass(frozen=True)
class Step:
    """One resumable piece of the job: a harness sweep of conf/sweep/<preset>.yaml into <out>/<directory>,
    or (no preset) a step of this script run in a process of its own (roof, d:overhead, d:public)."""
    group: str  # what --steps names (STEPS)
    name: str  # its entry in state.json: "complete" once done
    preset: str | None = None
    overrides: tuple[str, ...] = ()
    directory: str = ""


class Context:
    def __init__(self, plan: Plan, out: Path, device: torch.device, budget_s: float | None, log,
                 labels: list[str]) -> None:
        self.plan, self.out, self.device, self.log, self.labels = plan, out, device, log, labels
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.state = json.loads((out / "state.json").read_text()) if (out / "state.json").exists() else {}
        self.lost = False  # this process lost its CUDA context (d:public): its kernels stop
        self._steps: list[Step] | None = None

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def steps(self, group: str | None = None) -> list[Step]:
        if self._steps is None:
            self._steps = plan_steps(self)
        return [s for s in self._steps if group in (None, s.group)]

    def done(self, group: str) -> bool:
        return all(self.state.get(s.name) == "complete" for s in self.steps(group))

    @property
    def skips_cuda(self) -> bool:
        """What needs CUDA is skipped: this is not a CUDA run."""
        return self.device.type != "cuda"

    def finish(self, name: str, outcome: str) -> None:
        self.state[name] = outcome
        write_json(self.out / "state.json", self.state)


def backends(variant: str, options: dict[str, Any], device: torch.device) -> list[str]:
    import variants

    return variants.build(variant, **options).available_backends(device)


# ----- the steps -----------------------------------------------------------------------------------

def plan_steps(ctx: Context) -> list[Step]:
    """Every step of the job, group by group in STEPS' order, each group's in the order they run."""
    n, d = ctx.plan.roof_target
    full = [f"variant.backend={','.join(backends('full', {}, ctx.device))}", *ctx.plan.c]
    roof_point = [o for o in with_seq_lens("fa2_full", full, lambda x: x == n)
                  if not o.startswith(("head_dim=", "causal="))] + [f"head_dim={d}", "causal=false"]
    steps = [Step("roof", "roof"), Step("c-targets", "c-targets", "fa2_full", tuple(roof_point), "c"), *d_steps(ctx),
             *a_series(ctx, targets=True), Step("c", "c", "fa2_full", tuple(full), "c"), *a_series(ctx)]
    return sorted(steps, key=lambda s: STEPS.index(s.group))  # stable


def a_series(ctx: Context, targets: bool = False) -> list[Step]:
    """Part a's sweeps in the order they run: what a target needs first (tier 0: full's math, Table 21;
    tiers 1 and 2: the exponent series, the kernels that compile per N after every one that does not),
    then the other efficient variants and full's kernels (3, compiled ones 4), the other N×N backends last
    (5: full's sdpa_math among them). A variant's compiled backends are a sweep of their own (step
    <label>:compiled, the same job directories), so a call cut short by its budget has not spent it
    compiling one variant's kernels while another's series waits. ``targets``: tiers 0 to 2 only, for
    a-targets. There tiers 1 and 2 are narrowed to the exponent fit's lengths, sweeps of their own
    (a-targets:<label>...); tier 0 is part a's own sweep (a:full:table21), not run twice."""
    import variants

    series = []
    for label, variant, options in VARIANTS:
        if variant not in variants.REGISTRY or label not in ctx.labels:
            continue
        kinds = {b: ":table21" if (variant, b) == TABLE21 else ":n2" if n2(variant, b) else
                 ":compiled" if b in COMPILED else "" for b in backends(variant, options, ctx.device)}
        target = label in EXPONENT_TARGETS
        for kind, tier in (("", 1 if target else 3), (":compiled", 2 if target else 4), (":table21", 0),
                           (":n2", 5)):
            chosen = [b for b, k in kinds.items() if k == kind]
            if not chosen or (targets and tier > 2):
                continue
            narrowed = targets and tier in (1, 2)  # the exponent series from the fit's first length
            overrides = [f"variant={variant}", f"variant.backend={','.join(chosen)}",
                         *[f"variant.{k}={v}" for k, v in options.items()], *ctx.plan.a]
            if narrowed:
                overrides = with_seq_lens("seq_len_scaling", overrides, lambda n: n >= ctx.plan.exponent_range[0])
            name = f"{'a-targets' if narrowed else 'a'}:{label}{kind}"
            series.append((tier, Step("a-targets" if targets else "a", name, "seq_len_scaling", tuple(overrides),
                                      f"a/{label}")))
    return [step for _, step in sorted(series, key=lambda s: s[0])]  # stable: VARIANTS' order in a tier


def d_steps(ctx: Context) -> list[Step]:
    """Part d: the overhead (seconds, a target), each compared variant with its backends at the
    comparison's point (pattern_compare; one process per pattern, the compiled backends last), then the
    public kernels (d:public)."""
    (B, H, D), N = ctx.plan.shape, ctx.plan.compare_seq_len
    point = [f"seq_lens=[{N}]", f"batch_size={B}", f"num_heads={H}", f"head_dim={D}"]
    steps = [Step("d", f"d:{label}", "pattern_compare", (
        f"variant={variant}", f"variant.backend={','.join(compared_backends(ctx, variant, options))}",
        *[f"variant.{k}={v}" for k, v in options.items()], *point), f"d/{label}")
        for label, variant, options in VARIANTS if label in COMPARED and label in ctx.labels]
    return [Step("d", "d:overhead"), *steps, Step("d", "d:public")]


def compared_backends(ctx: Context, variant: str, options: dict[str, Any]) -> list[str]:
    """The backends part d times for a pattern: every one the device has but the N×N one, compiled last."""
    chosen = [b for b in backends(variant, options, ctx.device) if not n2(variant, b)]
    return sorted(chosen, key=lambda b: b in COMPILED)


def with_seq_lens(preset: str, overrides: list[str], keep: Callable[[int], bool]) -> list[str]:
    """``overrides`` with seq_lens narrowed to the lengths ``keep`` admits, of the overrides' own seq_lens
    or else the preset's."""
    own = [o for o in overrides if o.startswith("seq_lens=")]
    lens = (yaml.safe_load(own[-1].split("=", 1)[1]) if own else
            yaml.safe_load((ROOT / "conf" / "sweep" / f"{preset}.yaml").read_text())["seq_lens"])
    return [o for o in overrides if o not in own] + [f"seq_lens=[{','.join(str(n) for n in lens if keep(n))}]"]


def command(ctx: Context, step: Step) -> list[str]:
    if step.preset is None:  # this script again, for one step of its own
        cmd = [str(Path(__file__).resolve()), "--child", step.name, "--out", str(ctx.out),
               "--variants", ",".join(ctx.labels), *(["--smoke"] if ctx.plan.smoke else [])]
        return cmd + ([] if ctx.left() == float("inf") else ["--budget-s", f"{ctx.left():.0f}"])
    cmd = ["-m", "harness", "--multirun", f"sweep={step.preset}", *step.overrides, *ctx.plan.common,
           "logger=none", f"hydra.sweep.dir={ctx.out / step.directory}"]
    if ctx.device.type == "cuda":  # skip what clearly cannot fit; the rest runs and an oom is recorded
        cmd.append(f"memory_budget_gb={1.25 * torch.cuda.get_device_properties(ctx.device).total_memory / 1e9:.1f}")
    return cmd


def run_step(ctx: Context, step: Step) -> None:
    """Runs a step in a process of its own: the orchestrating process holds none of the step's memory
    (only the CUDA context of its xformers probe), and a crash (a segfault, a lost CUDA context) ends
    that step, not the job. A sweep still running when the budget is spent gets SIGTERM (its job records
    interrupted; a rerun resumes it); one of this script's steps keeps to the budget itself."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for attempt in (1, 2):
        if ctx.left() < 20:
            return ctx.log(f"[{step.name}] not started: the budget is spent (run again to continue)")
        cmd = [sys.executable, *command(ctx, step)]
        ctx.log(f"[{step.name}] {' '.join(cmd[1:])}")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        grace = 60 if step.preset is None else 0
        try:
            rc = proc.wait(timeout=None if ctx.left() == float("inf") else max(1.0, ctx.left() + grace))
            spent = rc == BUDGET_SPENT and step.preset is None
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            spent = True
        ctx.finish(step.name, "complete" if rc == 0 else "interrupted by the budget" if spent else f"exit {rc}")
        if spent:
            return ctx.log(f"[{step.name}] interrupted by the budget: run again to continue")
        # A job that failed (one that lost the process's CUDA context stops its sweep's later jobs too):
        # once more at once, in a new process that skips what is stored
        if rc == 0 or attempt == 2 or ctx.left() < 60:
            return
        ctx.log(f"[{step.name}] exit {rc}: once more, resuming")


def part_roof(ctx: Context) -> int:
    """The device's matmul rate: an n×n×n torch.matmul of fresh randn, median of do_bench."""
    if ctx.device.type != "cuda":
        write_json(ctx.out / "roof.json", {"status": NEEDS_CUDA})
        return 0
    from triton.testing import do_bench

    n = ctx.plan.roof_size
    out: dict[str, Any] = {"status": "ok", "size": n, "timer": "triton.testing.do_bench(median, rep=500 ms)",
                           "tflops": {}, "date": now()}
    for dtype in ("bfloat16", "float16"):
        g = torch.Generator(device=ctx.device).manual_seed(0)
        x, y = (torch.randn(n, n, device=ctx.device, dtype=getattr(torch, dtype), generator=g) for _ in range(2))
        ms = do_bench(lambda x=x, y=y: torch.matmul(x, y), warmup=100, rep=500, return_mode="median")
        out["tflops"][dtype] = 2 * n**3 / (ms * 1e-3) / 1e12
        ctx.log(f"[roof] {dtype} {n}^3: {ms:.3f} ms = {out['tflops'][dtype]:.1f} TFLOP/s")
        del x, y
    write_json(ctx.out / "roof.json", out)
    return 0


# ----- d: the harness's overhead and the public kernels (steps of this script's own) ----------------

class Unavailable(Exception):
    """A public kernel that cannot run here (reason: one line)."""


def fwd_bwd_call(f: Callable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """A forward+backward call of ``f`` on fresh randn inputs already in the kernel's own layout."""
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v, dout = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()

    def call() -> None:
        q.grad = k.grad = v.grad = None
        f(q, k, v).backward(dout)
    return call


def public_specs(label: str, attn, B: int, N: int, device: torch.device) -> dict[str, tuple[str, Any]]:
    """The best public kernels for a variant's pattern, as what defines the pairs each one computes: name ->
    ("xformers", attn_bias module -> bias over (N, N)), ("xformers_flat", ... -> bias over the batch's
    B·N rows flattened), ("flex", factory of a mask_mod) or ("sdpa_blocks", block size). tests/test_bench_gpu.py
    materializes each on CPU against the variant's mask: a ratio between two different functions would
    mean nothing."""
    if label == "sliding_window":
        w = attn.options.window
        return {f"xformers LocalAttentionFromBottomRightMask({w}, {w})":
                ("xformers", lambda ab: ab.LocalAttentionFromBottomRightMask(window_left=w, window_right=w)),
                f"FlexAttention mask_mod |q-kv| <= {w}": ("flex", lambda: (lambda b, h, q, kv: (q - kv).abs() <= w))}
    if label == "blockwise-local":
        b = attn.options.block_size
        per_seq = [b] * (N // b) + ([N % b] if N % b else [])  # the last block shorter, as the variant's
        specs = {f"xformers BlockDiagonalMask (blocks of {b})":
                 ("xformers_flat", lambda ab: ab.BlockDiagonalMask.from_seqlens(per_seq * B, device=device)),
                 f"FlexAttention mask_mod q//{b} == kv//{b}": ("flex", lambda: (lambda bb, h, q, kv: q // b == kv // b))}
        if N % b == 0:
            specs[f"SDPA{' flash' if device.type == 'cuda' else ''} on (B·N/{b}, H, {b}, D) blocks"] = ("sdpa_blocks", b)
        return specs
    bs = attn.engine_block_size(N)  # sparse: the variant's own block layout, as a mask_mod

    def layout_mod():
        from variants.flex import _layout_lookup  # padded: the kernel's last tile may reach past N

        allowed = _layout_lookup(attn.layout(N, False), bs, N, device)
        return lambda b, h, q, kv: allowed(q, kv)
    return {f"FlexAttention mask_mod layout[q//{bs}, kv//{bs}]": ("flex", layout_mod)}


def public_kernels(label: str, attn, B: int, H: int, N: int, D: int, dtype: torch.dtype,
                   device: torch.device) -> dict[str, tuple[str, Callable[[], Callable[[], None]]]]:
    """public_specs as builders of a forward+backward call, each on inputs in the kernel's own layout:
    name -> (kind, build)."""
    cuda, scale = device.type == "cuda", D ** -0.5

    def xformers(bias_fn, flat: bool):
        def build():
            if not cuda:
                raise Unavailable(f"{NEEDS_CUDA} (xformers runs no attention on CPU)")
            from variants.xformers_backend import unavailable_reason, xformers_ops

            if (reason := unavailable_reason(device)) is not None:  # said, not replaced
                raise Unavailable(reason)
            xops = xformers_ops()
            bias = bias_fn(xops.fmha.attn_bias)
            shape = (1, B * N, H, D) if flat else (B, N, H, D)  # xformers' own layout
            return fwd_bwd_call(lambda q, k, v: xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale),
                                shape, dtype, device)
        return build

    def flex(mask_mod):
        def build():
            if not cuda:
                raise Unavailable(f"{NEEDS_CUDA} (FlexAttention has no backward on CPU)")
            from torch.nn.attention.flex_attention import create_block_mask

            from variants.flex import compiled_flex_attention

            start = time.perf_counter()
            bm = create_block_mask(mask_mod(), None, None, N, N, device=device, BLOCK_SIZE=128)
            torch.cuda.synchronize()
            build.block_mask_s = time.perf_counter() - start  # reported apart from the kernel's time
            fn = compiled_flex_attention()
            return fwd_bwd_call(lambda q, k, v: fn(q, k, v, block_mask=bm, scale=scale), (B, H, N, D), dtype, device)
        return build

    def sdpa_blocks(b):
        def build():
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def f(q, k, v):
                if not cuda:
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
            return fwd_bwd_call(f, (B * N // b, H, b, D), dtype, device)
        return build

    def ours_bare():
        def build():
            if not cuda:
                raise Unavailable(f"{NEEDS_CUDA} (FlexAttention has no backward on CPU)")
            import variants

            mine = variants.build(attn.name, **{**asdict(attn.options), "backend": "flex"})
            start = time.perf_counter()
            mine.prepare(N, False, device)
            torch.cuda.synchronize()
            build.block_mask_s = time.perf_counter() - start
            return fwd_bwd_call(lambda q, k, v: mine(q, k, v), (B, H, N, D), dtype, device)
        return build

    builders = {"xformers": lambda x: xformers(x, False), "xformers_flat": lambda x: xformers(x, True),
                "flex": flex, "sdpa_blocks": sdpa_blocks}
    specs = public_specs(label, attn, B, N, device)
    kernels = {name: (kind, builders[kind](what)) for name, (kind, what) in specs.items()}
    if "flex" in attn.backend_names():  # not a public kernel: it tells where a gap to FlexAttention lies
        kernels[OURS_BARE] = ("flex", ours_bare())
    return kernels


def timed(ctx: Context, build: Callable[[], Callable[[], None]]) -> dict[str, Any]:
    """Builds a call, times its first call apart (compilation, plans) and then its median with the
    harness's own timer (do_bench on GPU)."""
    from harness.config import MeasureOptions
    from harness.measure import synchronize, time_fn
    from harness.memory import device_lost, release_memory

    row: dict[str, Any] = {"status": "ok", "reason": None}
    try:
        fn = build()
        start = time.perf_counter()
        fn()
        synchronize(ctx.device)
        row["first_call_s"] = time.perf_counter() - start
        row["block_mask_s"] = getattr(build, "block_mask_s", None)
        t = time_fn(fn, ctx.device, MeasureOptions(min_run_time=0.01 if ctx.plan.smoke else 0.1, min_samples=2))
        row.update(fwd_bwd_ms=t.median_ms, fwd_bwd_iqr_ms=t.iqr_ms)
        if ctx.device.type == "cuda":  # the state the kernel ran in: a throttled clock is a slower kernel
            from harness.env import nvidia_smi

            row["gpu_after"] = nvidia_smi("clocks.sm,temperature.gpu,power.draw")
    except Unavailable as e:
        row.update(status="skipped" if NEEDS_CUDA in str(e) else "unavailable", reason=str(e))
    except Exception as e:  # an oom or a kernel that refuses the shape: recorded, the next one runs
        row.update(status="error", reason=one_line(f"{type(e).__name__}: {e}")[:300])
    release_memory(ctx.device)
    if row["status"] == "error" and device_lost(ctx.device):  # every later kernel of this process would fail
        row["reason"] += " (the CUDA context is lost: part d stops; a new invocation goes on)"
        ctx.lost = True
    return row


def public_list(ctx: Context) -> list[tuple[str, str, bool, Callable[[], Callable[[], None]]]]:
    """(label, name, compiled, build) of every kernel d:public times (the public ones, and ours bare), in the
    order it times them:
    those compiled per call shape (FlexAttention) after every one that is not, so that a call cut short
    by its budget has not spent it compiling."""
    import variants

    (B, H, D), N = ctx.plan.shape, ctx.plan.compare_seq_len
    dtype = getattr(torch, ctx.plan.dtype if ctx.device.type == "cuda" else "float32")
    kernels = [(label, name, kind == "flex", build) for label, variant, options in VARIANTS
               if label in COMPARED and label in ctx.labels
               for name, (kind, build) in public_kernels(label, variants.build(variant, **options), B, H, N, D, dtype,
                                                         ctx.device).items()]
    return sorted(kernels, key=lambda k: k[2])  # stable: VARIANTS' order otherwise


def d_done(rows: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """The (label, name) of the kernels d:public has done with: measured, or skipped/unavailable for a
    reason; an error is tried once more on a later call (a transient failure should not stand), then
    kept too."""
    tries: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        tries.setdefault((r["label"], r["name"]), []).append(r["status"])
    return {key for key, st in tries.items() if st[-1] != "error" or len(st) >= 2}


def part_public(ctx: Context) -> int:
    """Each public kernel not yet done; 0 once all are."""
    path = ctx.out / "d" / "compare.jsonl"
    have = d_done(side_rows(path))
    for label, name, _, build in public_list(ctx):
        if (label, name) in have:
            continue
        if ctx.left() < 20:
            ctx.log("[d:public] the budget is spent: run again to continue")
            return BUDGET_SPENT
        row = {"label": label, "seq_len": ctx.plan.compare_seq_len, "kind": "ours-bare" if name == OURS_BARE else "public",
               "name": name, **timed(ctx, build), "date": now()}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        ctx.log(f"[d:public] {label} N={row['seq_len']} {name}: {row['status']} {fmt(row.get('fwd_bwd_ms'))} ms"
                + (f" ({row['reason']})" if row["reason"] else ""))
        if ctx.lost:
            return 1  # a new process goes on (run_step's second attempt, or the next call)
    return 0


def raw_timer(device: torch.device) -> Callable[[Callable[[], Any], int, list[torch.Tensor]], float]:
    """(fn, rep_ms, grads) -> median ms of a bare call: triton's do_bench on CUDA; on CPU (the dry run)
    torch.utils.benchmark's blocked_autorange, gradients cleared before each call as do_bench does."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn, rep, grads: do_bench(fn, rep=rep, grad_to_none=grads, return_mode="median")
    from torch.utils import benchmark

    def cpu(fn: Callable[[], Any], rep: int, grads: list[torch.Tensor]) -> float:
        def call() -> None:
            for t in grads:
                t.grad = None
            fn()
        timer = benchmark.Timer("call()", globals={"call": call}, num_threads=torch.get_num_threads())  # its default: 1
        return timer.blocked_autorange(min_run_time=rep / 1e3).median * 1e3
    return cpu


def part_overhead(ctx: Context) -> int:
    """The harness's fwd and fwd_bwd medians against raw do_bench of the same callable and shape (raw
    before and after the harness; their mean is the reference). On CPU the same code runs the cases
    whose backend runs there, against torch.utils.benchmark: the dry run's check of the path, no target."""
    import variants

    from harness.memory import release_memory
    from harness.run import run

    (ctx.out / "d").mkdir(parents=True, exist_ok=True)

    (B, H, D), N, rep = ctx.plan.shape, ctx.plan.overhead_seq_len, 100
    dtype, raw_ms = ctx.plan.dtype if ctx.device.type == "cuda" else "float32", raw_timer(ctx.device)
    cases = []
    for variant, backend in OVERHEAD_CASES:
        case: dict[str, Any] = {"variant": variant, "backend": backend, "seq_len": N, "status": "ok"}
        try:
            # The same work as the harness's: no gradients for the variant's own parameters (linear's E, F;
            # measure.param_grads is off), input gradients cleared before every call.
            attn = variants.build(variant, backend=backend).requires_grad_(False)
            if (reason := attn.unavailable(backend, ctx.device)) is not None:
                raise Unavailable(NEEDS_CUDA if ctx.device.type != "cuda" else f"skipped: {reason}")
            attn = attn.to(ctx.device)
            g = torch.Generator(device=ctx.device).manual_seed(0)
            q, k, v, dout = (torch.randn((B, H, N, D), generator=g, device=ctx.device, dtype=getattr(torch, dtype))
                             for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            calls = {"fwd": lambda: attn(q, k, v), "fwd_bwd": lambda: attn(q, k, v).backward(dout)}
            calls["fwd_bwd"]()

            def raw_times() -> dict[str, float]:
                return {p: raw_ms(c, rep, [q, k, v]) for p, c in calls.items()}
            raw = [raw_times()]
            cfg = {"variant": {"_target_": type(attn).__module__.split(".")[0] + "." + type(attn).__name__,
                               "backend": backend},
                   "seq_lens": [N], "batch_size": B, "num_heads": H, "head_dim": D, "dtype": dtype,
                   "device": ctx.device.type, "fidelity": {"enabled": False}, "logger": {"name": "none"},
                   "measure": {"passes": ["fwd", "fwd_bwd"], "memory": False, "min_run_time": rep / 1e3},
                   # measured now, between the raw timings: a row an interrupted earlier call stored (maybe
                   # on another machine) would be compared with this call's raw numbers
                   "resume": False}
            rec = run(cfg, output_dir=ctx.out / "d" / "overhead" / variant).rows[-1].record()
            raw.append(raw_times())
            for p in calls:
                ref = (raw[0][p] + raw[1][p]) / 2
                case[p] = {"harness_ms": rec[f"{p}_ms"], "harness_iqr_ms": rec[f"{p}_iqr_ms"],
                           "raw_ms": [raw[0][p], raw[1][p]],
                           "overhead": None if rec[f"{p}_ms"] is None else rec[f"{p}_ms"] / ref - 1}
        except Unavailable as e:
            case.update(status="skipped", reason=str(e))
        except Exception as e:
            case.update(status="error", reason=one_line(f"{type(e).__name__}: {e}")[:300])
        release_memory(ctx.device)
        cases.append(case)
        ctx.log(f"[d:overhead] {variant}/{backend}: {case}")
    write_json(ctx.out / "d" / "overhead.json", {"status": "ok", "timer": f"{'do_bench' if ctx.device.type == 'cuda' else 'blocked_autorange'}"
                      f"(median, rep={rep} ms)", "cases": cases, "date": now()})
    return 0


# ----- summary -------------------------------------------------------------------------------------

def rows_of(path: Path) -> list[dict[str, Any]]:
    try:
        return latest(load_rows(path)) if path.exists() else []
    except InputError:  # nothing measured there yet
        return []


def side_rows(path: Path) -> list[dict[str, Any]]:
    """The whole rows of one of this script's own .jsonl files (a line cut by a kill is left out)."""
    return read_jsonl(path, check=lambda r: None if isinstance(r, dict) else "not a JSON object") if path.exists() else []


def fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def table(head: list[str], body: list[list[Any]]) -> list[str]:
    """A Markdown table; a | inside a cell (a test's failure message) is escaped, not a column."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(fmt(c).replace("|", "\\|") for c in row) + " |" for row in body]


def target(name: str, text: str, value: float | None, ok: Callable[[float], bool], detail: str,
           skip: bool, gap: Callable[[float], str]) -> dict[str, Any]:
    """A target judged from ``value``: met | missed (with the gap) | not measured | skipped (``skip``:
    it needs CUDA and this is not a CUDA run)."""
    if skip:
        status = "skipped (needs CUDA)"
    else:
        status = "not measured" if value is None else "met" if ok(value) else "missed"
    return {"target": name, "text": text, "status": status, "value": value, "detail": detail,
            "gap": gap(value) if status == "missed" else None}


def not_yet(wanted: list[str], have: set[str]) -> str:
    """"not yet measured: ..." for what a target waits for (``wanted`` not in ``have``), else ""."""
    missing = [w for w in wanted if w not in have]
    return f"not yet measured: {', '.join(missing)}" if missing else ""


def analyse(ctx: Context) -> dict[str, Any]:
    """Every number SUMMARY.md states, from the files in ``out``, and the targets judged on them."""
    a, c = rows_of(ctx.out / "a"), rows_of(ctx.out / "c")
    roof = json.loads((ctx.out / "roof.json").read_text()) if (ctx.out / "roof.json").exists() else {}
    res: dict[str, Any] = {"roof": roof, "targets": [], "a_rows": len(a), "c_rows": len(c), "tests": gpu_tests(ctx.out)}
    memory_targets(ctx, a, res)
    roof_target(ctx, c, res)
    compare_targets(ctx, res)
    exponent_targets(ctx, a, res)
    overhead_target(ctx, res)
    return res


def memory_targets(ctx: Context, a: list[dict[str, Any]], res: dict[str, Any]) -> None:
    """Full math's peak with its inputs (the measured peak over q, k, v, dout, plus those four) against
    FA-1 Table 21's formula (four fp16 N×N tensors and ten N×D per (b, h): what FA-1's PyTorch baseline
    held) and against this path's own count (three N×N at the softmax backward, P, dP, dS, and on CUDA
    the temporary dP∘P of torch's softmax backward; two N×D: the variant's memory_bytes on the row's
    device, plus the four inputs): the second checks the measurement, the first compares the programs."""
    import variants

    math_path, table = variants.build("full", backend="math"), []
    for r in sorted((r for r in a if r["variant"] == "full" and r["backend"] == "math" and r["peak_mem_bytes"]),
                    key=lambda r: r["seq_len"]):
        B, H, N, D = r["batch_size"], r["num_heads"], r["seq_len"], r["head_dim"]
        elt = torch.empty((), dtype=getattr(torch, r["dtype"])).element_size()
        inputs = 4 * B * H * N * D * elt
        measured = r["peak_mem_bytes"] + inputs
        formula = (4 * N * N + 10 * N * D) * B * H * 2
        own = math_path.memory_bytes(B, H, N, D, elt, r["causal"], r["device"]) + inputs
        table.append({"seq_len": N, "measured_mib": measured / MiB, "formula_mib": formula / MiB,
                      "ratio": measured / formula, "own_mib": own / MiB, "own_ratio": measured / own,
                      "elements_per_head": measured / (B * H * elt), "head_dim": D})
    res["table21"] = table
    # What the measurements say the peak holds: a·N² + c·N·D elements per (b, h), least squares over every N
    fit = res["table21_fit"] = table21_fit(res["table21"])
    held = fit and f"measured = {fit['n2']:.2f}·N² + {fit['nd']:.2f}·N·D elements per (b, h) (fitted over every N)"
    within = [m["seq_len"] for m in res["table21"] if abs(m["ratio"] - 1) <= 0.02]
    worst21 = max(res["table21"], key=lambda m: abs(m["ratio"] - 1), default=None)
    res["targets"].append(target(
        "table21", "full math peak memory = FA-1 Table 21's 4·B·H·N²·2 + 10·B·H·N·D·2 bytes within 2%",
        worst21 and worst21["ratio"], lambda v: abs(v - 1) <= 0.02,
        ", ".join(f"N={m['seq_len']}: {m['ratio']:.4f}" for m in res["table21"]), ctx.skips_cuda,
        lambda v: f"worst N={worst21['seq_len']}: {(v - 1) * 100:+.1f}%; {held}, the formula 4·N² + 10·N·D: "
                  f"{'within 2% at N=' + ', '.join(map(str, within)) if within else 'within 2% at no N'}"))
    worst_own = max(res["table21"], key=lambda m: abs(m["own_ratio"] - 1), default=None)
    res["targets"].append(target(
        "math_exact", "full math peak memory = its own count, (s·N² + 6·N·D)·B·H elements with the inputs "
                      "(s = 3 on CPU, 4 on CUDA), within 2%",
        worst_own and worst_own["own_ratio"], lambda v: abs(v - 1) <= 0.02,
        ", ".join(f"N={m['seq_len']}: {m['own_ratio']:.4f}" for m in res["table21"]), ctx.skips_cuda,
        lambda v: f"worst N={worst_own['seq_len']}: {(v - 1) * 100:+.1f}%; {held}"))


def roof_target(ctx: Context, c: list[dict[str, Any]], res: dict[str, Any]) -> None:
    """Full's best forward TFLOP/s at the roof target's point against the bf16 matmul roof, and every full
    backend's TFLOP/s at the FA-2/FA-3 shape's longest N."""
    n, d = ctx.plan.roof_target
    fwd = [(r["backend"], r["tflops_fwd"]) for r in c if r["seq_len"] == n and r["head_dim"] == d
           and not r["causal"] and r["tflops_fwd"] and r["status"] == "ok" and not r.get("noisy")]
    best = max(fwd, key=lambda x: x[1], default=None)
    rate = (res["roof"].get("tflops") or {}).get("bfloat16")
    share = best[1] / rate if best and rate else None
    # Judged once every full backend has its row there (measured or not): not on the first ones timed
    waiting = not_yet(backends("full", {}, ctx.device),
                      {r["backend"] for r in c if (r["seq_len"], r["head_dim"], r["causal"]) == (n, d, False)})
    res["targets"].append(target(
        "full_roof", f"full's best backend >= 60% of the bf16 matmul roof, forward, N={n}, D={d}, non-causal",
        None if waiting else share, lambda v: v >= 0.6,
        "; ".join(filter(None, [best and f"{best[0]} {best[1]:.1f} TFLOP/s vs roof {fmt(rate)}", waiting])),
        ctx.skips_cuda,
        lambda v: f"{(0.6 - v) * rate:.1f} TFLOP/s short of 60% ({v:.1%} of the roof)"))
    # Useful TFLOP/s (FA-2's convention: causal counts half the pairs; the math paths compute all of them)
    res["fa2"] = [{"backend": r["backend"], "head_dim": r["head_dim"], "causal": r["causal"], "status": r["status"],
                   "noisy": r.get("noisy"), **{p: r.get(f"tflops_{p}_useful") for p in ("fwd", "bwd", "fwd_bwd")},
                   "fwd_share": r["tflops_fwd_useful"] / rate if rate and r.get("tflops_fwd_useful") else None}
                  for r in sorted((r for r in c if r["seq_len"] == n),
                                  key=lambda r: (r["head_dim"], r["causal"], -(r.get("tflops_fwd_useful") or 0)))]


def compare_targets(ctx: Context, res: dict[str, Any]) -> None:
    """Part d: our backends' rows (harness sweeps, d/<label>/) against the public kernels' (compare.jsonl;
    the first layout of part d timed ours there too, as rows of kind "ours")."""
    res["compare"], res["compare_rows"] = [], []
    compare, public = side_rows(ctx.out / "d" / "compare.jsonl"), public_list(ctx)
    done = {n for _, n in d_done(compare)}
    for label, variant, options in VARIANTS:
        if label not in COMPARED or label not in ctx.labels:
            continue
        rows = [{"label": label, "kind": "ours", "name": f"ours {r['backend']}", "status": r["status"],
                 "fwd_bwd_ms": r["fwd_bwd_ms"], "first_call_s": r["warmup_s"], "block_mask_s": r.get("setup_s"),
                 "reason": r["reason"] or r.get("noise_reasons")} for r in rows_of(ctx.out / "d" / label)]
        rows += [r for r in compare if r["label"] == label]
        res["compare_rows"] += rows
        # Judged once each of the pattern's backends has its row (ok or not) and each public kernel is done,
        # not on the first ones timed
        waiting = not_yet([f"ours {b}" for b in compared_backends(ctx, variant, options)] +
                          [name for lb, name, *_ in public if lb == label], done | {r["name"] for r in rows})
        ok = [r for r in rows if r["status"] == "ok" and r["fwd_bwd_ms"]]
        ours = min((r for r in ok if r["kind"] == "ours"), key=lambda r: r["fwd_bwd_ms"], default=None)
        pub = min((r for r in ok if r["kind"] == "public"), key=lambda r: r["fwd_bwd_ms"], default=None)
        ratio = pub["fwd_bwd_ms"] / ours["fwd_bwd_ms"] if ours and pub else None
        # The target is the issue's: our best backend. Our xformers and flex backends call the public
        # kernels themselves (same mask; ours built from the variant's predicate), so where one of them is
        # best the ratio measures our wrapper and mask_mod; the engine's ratio (variants/blocksparse.py,
        # our own kernel) is stated beside it.
        own = min((r for r in ok if r["kind"] == "ours" and r["name"] not in ("ours xformers", "ours flex")),
                  key=lambda r: r["fwd_bwd_ms"], default=None)
        own_ratio = pub["fwd_bwd_ms"] / own["fwd_bwd_ms"] if own and pub else None
        res["compare"].append({"label": label, "ours": ours and ours["name"], "ours_ms": ours and ours["fwd_bwd_ms"],
                               "public": pub and pub["name"], "public_ms": pub and pub["fwd_bwd_ms"], "ratio": ratio,
                               "own": own and own["name"], "own_ms": own and own["fwd_bwd_ms"], "own_ratio": own_ratio})
        res["targets"].append(target(
            f"compare_{label}", f"{label}: best backend >= 0.9x the speed of the best public kernel (one run)",
            None if waiting else ratio, lambda v: v >= 0.9,
            f"{fmt(ours and ours['name'])} vs {fmt(pub and pub['name'])}: {fmt(ratio)}; our own kernel "
            f"({fmt(own and own['name'])}): {fmt(own_ratio)}" + (f"; {waiting}" if waiting else ""),
            ctx.skips_cuda and ratio is None and not waiting,
            lambda v: f"ours takes {1 / v:.2f}x the public kernel's time"))


def exponent_targets(ctx: Context, a: list[dict[str, Any]], res: dict[str, Any]) -> None:
    """Each exponent target's variant: its backends' fitted time exponents over the range, judged on the
    backend fastest at the range's last length."""
    import variants

    lo, hi = ctx.plan.exponent_range
    res["exponents"] = {}
    for label in (t for t in EXPONENT_TARGETS if t in variants.REGISTRY and t in ctx.labels):
        # A backend is fitted only with every length of the range measured, ok and not noisy (a fit over
        # what is left of it could pass on two points); the target is judged on the backend fastest at hi.
        mine = [r for r in a if r["variant"] == label and lo <= r["seq_len"] <= hi and not n2(label, r["backend"])]
        lengths = sorted({r["seq_len"] for r in mine})
        fits, short = {}, {}
        for backend in sorted({r["backend"] for r in mine}):
            rows = [r for r in mine if r["backend"] == backend]
            good = {r["seq_len"] for r in rows if r["status"] == "ok" and not r.get("noisy") and r.get("fwd_bwd_ms")}
            missing = [n for n in lengths if n not in good] + ([] if hi in lengths else [hi])
            if missing or len(lengths) < 2:
                short[backend] = missing
            else:
                fits[backend] = {**fit_exponents(rows, lo, hi)["fwd_bwd_ms"],
                                 "ms_at_hi": next(r["fwd_bwd_ms"] for r in rows if r["seq_len"] == hi)}
        res["exponents"][label] = {"seq_lens": lengths, "fits": fits, "incomplete": short}
        fastest = min(fits.items(), key=lambda kv: kv[1]["ms_at_hi"], default=None)
        detail = "; ".join([f"{b}: {f['fitted']:.3f} (theory {f['theory']:.3f}, {f['ms_at_hi']:.4g} ms at {hi})"
                            for b, f in fits.items()] +
                           [f"{b}: not fitted (N={', '.join(map(str, ns))} missing, failed or noisy)"
                            for b, ns in short.items()])
        # Judged once each backend's series has reached hi (a series runs its lengths in order, and one
        # stopped by an oom records the longer ones as skipped): not while one is still to come
        waiting = not_yet([b for b in backends(label, {}, ctx.device) if not n2(label, b)],
                          {r["backend"] for r in mine if r["seq_len"] == hi})
        # At most 1.1; where the contract's FLOPs themselves grow faster than N^1.1, at most 0.1 above their
        # exponent: reformer's hashing, N·D·n_buckets with n_buckets = 2⌈N/c⌉, is O(N²·D/c).
        theory = fastest[1]["theory"] if fastest else 1.0
        limit = 1.1 if theory <= 1.1 else theory + 0.1
        res["targets"].append(target(
            f"exponent_{label}", f"{label} forward+backward time exponent <= 1.1 (FLOPs growing faster: their "
            f"exponent + 0.1) over N={lo}..{hi} (the backend fastest at {hi}, every length ok)",
            None if waiting else fastest and fastest[1]["fitted"], lambda v: v <= limit,
            "; ".join(filter(None, [fastest and f"{fastest[0]} (limit {limit:.3f})", detail, waiting])), False,
            lambda v: f"{v - limit:+.3f} above {limit:.3f}"))


def overhead_target(ctx: Context, res: dict[str, Any]) -> None:
    """The harness's timing against raw do_bench of the same callable (d/overhead.json)."""
    ov = json.loads((ctx.out / "d" / "overhead.json").read_text()) if (ctx.out / "d" / "overhead.json").exists() else {}
    vals = [(f"{cs['variant']}/{cs['backend']} {p}", cs[p]["overhead"]) for cs in ov.get("cases", [])
            if cs["status"] == "ok" for p in ("fwd", "fwd_bwd") if cs[p]["overhead"] is not None]
    worst = max(vals, key=lambda x: abs(x[1]), default=None)  # faster than raw would be a discrepancy too

    def spread(key: str) -> str:
        """The worst case's spread, to judge it by: the harness's IQR (from its row where an older
        overhead.json lacks it) and the two raw timings around it."""
        (cs, p), = [(cs, p) for cs in ov["cases"] for p in ("fwd", "fwd_bwd")
                    if f"{cs['variant']}/{cs['backend']} {p}" == key]
        iqr = cs[p].get("harness_iqr_ms")
        if iqr is None:
            iqr = next((r.get(f"{p}_iqr_ms") for r in rows_of(ctx.out / "d" / "overhead" / cs["variant"])), None)
        raw = " and ".join(f"{x:.4g}" for x in cs[p]["raw_ms"])
        share = f"{iqr / cs[p]['harness_ms']:.1%}" if iqr is not None else "-"
        return f"harness {cs[p]['harness_ms']:.4g} ms, IQR {share} of it; raw before and after {raw} ms"
    res["overhead"] = ov
    res["targets"].append(target(
        "overhead", "the harness's timing within 3% of raw do_bench of the same callable", worst and worst[1],
        lambda v: abs(v) <= 0.03, ", ".join(f"{k}: {v:+.2%}" for k, v in vals), ctx.skips_cuda,
        lambda v: f"{worst[0]}: {v:+.2%} ({spread(worst[0])})"))


def table21_fit(points: list[dict[str, Any]]) -> dict[str, float] | None:
    """The measured peak per (b, h) as a·N² + c·N·D elements, least squares over the points (two at least):
    what the path holds, to set beside FA-1's 4·N² + 10·N·D and the path's own count."""
    if len({m["seq_len"] for m in points}) < 2:
        return None
    A = np.array([[m["seq_len"] ** 2, m["seq_len"] * m["head_dim"]] for m in points], dtype=float)
    y = np.array([m["elements_per_head"] for m in points])
    (n2, nd), *_ = np.linalg.lstsq(A, y, rcond=None)
    return {"n2": float(n2), "nd": float(nd)}


def gpu_tests(out: Path) -> dict[str, Any]:
    """The GPU tests' outcomes, the last one per test, from tests-gpu.jsonl (gpu_job.sh's pytest run);
    tests-gpu.rc is there once every test has one."""
    last = {r["test"]: r for r in side_rows(out / "tests-gpu.jsonl")}
    return {"all_run": (out / "tests-gpu.rc").exists(), "counts": dict(Counter(r["outcome"] for r in last.values())),
            "failed": [r for r in last.values() if r["outcome"] in ("failed", "error")],
            "skipped": dict(Counter(r["message"] for r in last.values() if r["outcome"] == "skipped"))}


def summary_md(ctx: Context, res: dict[str, Any], reports: dict[str, Path]) -> str:
    envs = invocations(ctx.out)
    e = envs[-1] if envs else {}
    lines = [f"# GPU benchmark{' (SMOKE: tiny sizes on CPU, not results)' if ctx.plan.smoke else ''}", "",
             f"Device {e.get('device_name')}; torch {e.get('torch_version')}, CUDA {e.get('cuda_version')}, "
             f"cuDNN {e.get('cudnn_version')}, triton {e.get('triton_version')}, xformers {e.get('xformers_version')}; "
             f"code {', '.join(dict.fromkeys(str(x.get('code_version')) for x in envs)) or None}; driver and clocks "
             f"below. Invocations: " + "; ".join(f"{x['date']} ({x['steps']}; code {x.get('code_version')})" for x in envs)
             + ".",
             *(x for r in e.get("unavailable_backends", {}).values()
               for x in ("", f"Unavailable on this machine, so not measured and not replaced by another kernel: {r}.")),
             "", "```", e.get("nvidia_smi") or "nvidia-smi: not available", "```", "",
             "Steps: " + ", ".join(f"{k}: {v}" for k, v in sorted(ctx.state.items())) + ".", ""]
    tests = res["tests"]
    lines += ["## GPU tests (`pytest -m gpu`: every GPU backend against the float64 reference)", "",
              (", ".join(f"{n} {k}" for k, n in sorted(tests["counts"].items())) or "none run") + "; " +
              ("every test has run." if tests["all_run"] else "not every test has run yet (the next call goes on)."), ""]
    if tests["failed"]:
        lines += table(["failed test", "outcome", "message"], [[r["test"], r["outcome"], r["message"]] for r in tests["failed"]])
        lines += [""]
    if tests["skipped"]:
        lines += table(["skipped, because", "tests"], [[m, n] for m, n in tests["skipped"].items()]) + [""]
    lines += ["## Targets", ""]
    lines += table(["target", "status", "measured", "gap"],
                   [[t["text"], f"**{t['status']}**", t["detail"] or "-", t["gap"] or "-"] for t in res["targets"]])
    roof = res["roof"]
    lines += ["", "## Matmul roof and exact attention at the FA-2/FA-3 shape (c/)", "",
              f"Roof: {', '.join(f'{k} {v:.1f} TFLOP/s' for k, v in roof.get('tflops', {}).items()) or roof.get('status', 'not measured')}"
              f" ({roof.get('size', '-')}³ torch.matmul). Published: {PUBLISHED}.", "",
              f"Every full backend at N={ctx.plan.roof_target[0]} (B·N = 16K tokens, H·D = 2048), TFLOP/s of "
              "the useful FLOPs (4·B·H·N²·D forward, causal half of it; backward 2.5× forward):", ""]
    lines += table(["D", "causal", "backend", "status", "fwd", "bwd", "fwd+bwd", "fwd / roof"],
                   [[r["head_dim"], r["causal"], r["backend"], r["status"] + (" (noisy)" if r["noisy"] else ""),
                     r["fwd"], r["bwd"], r["fwd_bwd"], "-" if r["fwd_share"] is None else f"{r['fwd_share']:.1%}"]
                    for r in res["fa2"]])
    lines += ["", "## FA-1 Table 21: full math peak memory (a/full)", "",
              "With the inputs (q, k, v, dout). FA-1's formula, 4·N²·2 + 10·N·D·2 bytes per (b, h), is four fp16 "
              "N×N tensors at the peak of its PyTorch baseline. This path's own count: at the softmax backward "
              "P, dP and dS, and on CUDA the product dP∘P that torch's CUDA softmax backward forms first (three "
              "N×N on CPU, as tests/test_harness.py measures, four on CUDA), and six N×D."
              + (f" Here the measurements fit {res['table21_fit']['n2']:.2f}·N² + {res['table21_fit']['nd']:.2f}·N·D "
                 "elements per (b, h)." if res.get("table21_fit") else ""), ""]
    lines += table(["N", "measured MiB", "FA-1 formula MiB", "ratio", "own count MiB", "ratio"],
                   [[m["seq_len"], f"{m['measured_mib']:.1f}", f"{m['formula_mib']:.1f}", f"{m['ratio']:.4f}",
                     f"{m['own_mib']:.1f}", f"{m['own_ratio']:.4f}"] for m in res["table21"]])
    lines += ["", f"## Against public kernels (d/, N={ctx.plan.compare_seq_len}, forward+backward, one job)", ""]
    lines += table(["pattern", "best public kernel", "ms", "our best backend", "ms", "speed ratio (target)",
                    "our own kernel", "ms", "speed ratio"],
                   [[r["label"], r["public"], r["public_ms"], r["ours"], r["ours_ms"], r["ratio"], r["own"],
                     r["own_ms"], r["own_ratio"]] for r in res["compare"]])
    lines += ["", "Speed ratio: the public kernel's time over ours (>= 1: ours is as fast). Our `xformers` and `flex` "
              "backends call the public kernels themselves with the same mask (flex's built from the variant's "
              "predicate), so where one is our best the ratio measures our wrapper and mask_mod; the last three "
              "columns are our own kernel, the block-sparse engine, against the same public kernel."]
    lines += ["", "Every kernel timed (first call: compilation and plans, for ours the harness's warm-up; set-up: "
              "building the BlockMask, for ours the row's setup_s, the backend's prepare: flex's BlockMask, the "
              f"engine's plan on the device). `{OURS_BARE}` is our flex backend timed as the public kernels are, "
              "in their process: against the public FlexAttention it measures our mask_mod, against `ours flex` "
              "the harness run; it is in no target. The SM clock, temperature and power are nvidia-smi's, read "
              "right after the kernel's timed calls.", ""]
    lines += table(["pattern", "kernel", "status", "ms", "first call s", "set-up s", "SM clock, °C, W after", "note"],
                   [[r["label"], r["name"], r["status"], r.get("fwd_bwd_ms"), r.get("first_call_s"),
                     r.get("block_mask_s"), r.get("gpu_after") or "-", (r["reason"] or "-")[:120]]
                    for r in res["compare_rows"]])
    lines += ["", "## Reports", ""] + [f"- {k}: `{p.relative_to(ctx.out)}` (plots, OOM frontier, every point)"
                                        for k, p in reports.items()]
    return "\n".join(lines) + "\n"


def summarize(ctx: Context) -> dict[str, Any]:
    from harness.report.sweep import make_report

    reports = {}
    # Part a's exponents over the exponent targets' range (4K and up): shorter lengths are launch-bound
    for part, title, fit_from in (("a", "FA-1 shape, every variant and backend", ctx.plan.exponent_range[0]),
                                  ("c", "FA-2/FA-3 shape, full", 0)):
        if rows_of(ctx.out / part):
            make_report(ctx.out / part, ctx.out / part / "report", fit_from)
            reports[title] = ctx.out / part / "report" / "report.html"
    res = analyse(ctx)
    (ctx.out / "SUMMARY.md").write_text(summary_md(ctx, res, reports))
    write_json(ctx.out / "summary.json", {"smoke": ctx.plan.smoke, "state": ctx.state, **res})
    repository_relative(ctx.out)
    return res


def repository_relative(out: Path) -> None:
    """Hydra's records (.hydra/hydra.yaml, multirun.yaml: its cwd, config path, sweep and output
    directories) and the reports' source line hold the repository's absolute path on the machine that ran
    them: written as ``.`` instead, so that the results say nothing of that machine and read the same
    wherever they are checked out. Run once the sweeps have ended (no file is being written)."""
    root = str(ROOT)
    for path in [*out.rglob("*.yaml"), *out.rglob("report.html")]:
        text = path.read_text()
        if root in text:
            atomic_write(path, text.replace(root, "."))


# ----- command line --------------------------------------------------------------------------------

def record_invocation(ctx: Context, steps: list[str]) -> None:
    """env.json: one entry per invocation (machine, versions, clocks, date, steps)."""
    from harness import env as envmod
    from variants.xformers_backend import unavailable_reason

    entries = invocations(ctx.out)
    unavailable = {"xformers": unavailable_reason(ctx.device)} if ctx.device.type == "cuda" else {}
    entries.append({"date": now(), "steps": ",".join(steps), "device": ctx.device.type, "python": platform.python_version(),
                    "unavailable_backends": {b: r for b, r in unavailable.items() if r is not None},
                    **envmod.collect(ctx.device).as_dict(),
                    "nvidia_smi": envmod.nvidia_smi("name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                                                    "clocks.max.mem,power.limit,temperature.gpu,memory.total",
                                                    header=True)})
    write_json(ctx.out / "env.json", entries)


def invocations(out: Path) -> list[dict[str, Any]]:
    """env.json's entries: one per invocation into ``out``."""
    path = out / "env.json"
    return json.loads(path.read_text()) if path.exists() else []


def measured_on(out: Path, default: torch.device) -> torch.device:
    """The device type the last invocation into ``out`` measured on (env.json), else ``default``."""
    envs = invocations(out)
    return torch.device(envs[-1]["device"]) if envs and "device" in envs[-1] else default


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
    steps = [s for s in args.steps.split(",") if s]
    chosen = [v for v in args.variants.split(",") if v]
    if set(chosen) - set(labels):
        print(f"bench_gpu.py: unknown variant label(s) {', '.join(sorted(set(chosen) - set(labels)))}; allowed: "
              f"{', '.join(labels)}", file=sys.stderr)
        return 2
    if set(steps) - set(STEPS):
        print(f"bench_gpu.py: unknown step(s) {', '.join(sorted(set(steps) - set(STEPS)))}; allowed: "
              f"{', '.join(STEPS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-") if device.type == "cuda" else "cpu"
    out = (args.out or ROOT / ("outputs/bench_gpu_smoke" if args.smoke else
                               f"results/gpu/{datetime.date.today().isoformat()}-{slug}")).resolve()
    reader = "--summary-only" if args.summary_only else "--pending" if args.pending else None
    if reader and not out.is_dir():  # made here, it would hold a summary of nothing
        ap.error(f"{reader} reads the results directory of an earlier run (--out DIR); {out} does not exist")
    out.mkdir(parents=True, exist_ok=True)
    if args.summary_only:  # judged as on the machine that measured: a GPU's results stay a GPU's elsewhere
        device = measured_on(out, device)
    start = time.monotonic()  # every line says when, so a job's log shows where a budget went

    def log(message: str) -> None:
        print(f"[{time.monotonic() - start:4.0f} s] {message}", flush=True)
    ctx = Context(SMOKE_PLAN if args.smoke else GPU_PLAN, out, device, args.budget_s, log, chosen)
    if args.pending:
        print(" ".join(s for s in steps if not ctx.done(s)))
        return 0
    if args.child:
        return {"roof": part_roof, "d:overhead": part_overhead, "d:public": part_public}[args.child](ctx)
    if not args.summary_only:
        record_invocation(ctx, steps)
        ctx.log(f"bench_gpu: steps {','.join(steps)} on {device} -> {out}")
        for group in steps:
            for step in ctx.steps(group):
                if ctx.state.get(step.name) != "complete":
                    run_step(ctx, step)
            ctx.log(f"step {group}: {'complete' if ctx.done(group) else 'not complete'}")
    res = summarize(ctx)
    for t in res["targets"]:
        ctx.log(f"target {t['target']}: {t['status']}" + (f" ({t['gap']})" if t["gap"] else ""))
    ctx.log(f"wrote {out / 'SUMMARY.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(ctrl_c_is_one_line(main, "bench_gpu.py", "rerun the same command to resume (a sweep that was running said so itself)"))
