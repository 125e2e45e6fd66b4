"""GPU benchmark (issue 6): every variant and backend measured by the harness itself, then the targets.

    python scripts/bench_gpu.py [--out DIR] [--parts a,b,c,d] [--budget-s S] [--smoke] [--device cpu]
    python scripts/bench_gpu.py --summary-only --out DIR     # rewrite SUMMARY.md, summary.json, plots

Every point is measured by ``harness.run.run`` on a config composed from ``conf/`` (the same code, timer
and memory measurement as ``python -m harness``), one point per call into one directory per series
(``<part>/<variant label>__<backend>/results.jsonl``, the harness's own files), with logger=none and
fidelity off (the GPU tests check correctness).

Parts (default output ``results/gpu/<UTC date>-<device>/``):
  a  FA-1 shape: B=16, H=8, D=64, fp16, N = 128…65536, forward+backward, every variant × every backend
     available on the device (blockwise exact and local, sparse fixed/strided/bigbird at their
     defaults). OOM is a result; after an oom (or a memory skip) the longer N of that series are
     recorded as skipped, as are points whose projected time exceeds --point-cap-s.
  b  full `math` peak memory against FA-1 Table 21's naive formula 4·B·H·N²·2 + 10·B·H·N·D·2 bytes, per N
     (from part a's full__math rows; measured memory-only into b/ where they are missing).
  c  FA-2/FA-3 shape: 16K tokens per batch (B = 16384/N), hidden 2048 (H = 2048/D), D = 64 and 128,
     bf16, causal and not, N = 512…16384: TFLOP/s of every full backend; the matmul roof (8192³ bf16
     and fp16 torch.matmul timed with triton.testing.do_bench).
  d  the targets' own measurements, in one process: each efficient variant's backends (through the
     harness) against the best public kernel for its pattern (raw xformers, raw FlexAttention with the
     canonical mask_mod, SDPA flash on blocks), and the harness's timing against raw do_bench of the
     same callable.
After the parts, SUMMARY.md, summary.json and plots (a_time.png, a_memory.png, c_tflops.png) are
(re)written from every result in the output directory, so a part measured by an earlier invocation
counts too. Targets: met | missed (with the gap) | skipped (needs CUDA) | not measured.

Time: --budget-s bounds this invocation (checked between points); points not reached are measured by
the next invocation into the same --out (done points are never measured again). state.json says what
is complete; --pending prints the parts still incomplete.

--smoke: the same code at tiny sizes (N = 128, 256; B=1, H=2, D=16; part c D = 16, 32 with 256 tokens,
hidden 64), float32 on CPU; what needs CUDA (the roof, raw do_bench, xformers, FlexAttention's
backward) is recorded as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

MiB = 2**20
PARTS = ("a", "b", "c", "d")
NEEDS_CUDA = "skipped: needs CUDA"

# ----- what is measured --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    smoke: bool
    # a: FA-1 shape
    a_seq_lens: tuple[int, ...]
    a_batch: int
    a_heads: int
    a_dim: int
    a_dtype: str
    # c: FA-2/FA-3 shape
    c_tokens: int
    c_hidden: int
    c_dims: tuple[int, ...]
    c_seq_lens: tuple[int, ...]
    c_dtype: str
    # d and targets
    compare_seq_lens: tuple[int, ...]
    overhead_seq_len: int
    exponent_range: tuple[int, int]
    roof_size: int
    roof_target_seq_len: int
    roof_target_dim: int
    min_run_time: dict[str, float]  # per part: seconds of timed calls per pass (do_bench's rep)
    budgets_s: dict[str, float]  # per part, when --budget-s does not say otherwise


def pow2(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(2**e for e in range(int(math.log2(lo)), int(math.log2(hi)) + 1))


FULL_PLAN = Plan(
    smoke=False,
    a_seq_lens=pow2(128, 65536), a_batch=16, a_heads=8, a_dim=64, a_dtype="float16",
    c_tokens=16384, c_hidden=2048, c_dims=(128, 64), c_seq_lens=pow2(512, 16384), c_dtype="bfloat16",
    compare_seq_lens=(16384,), overhead_seq_len=4096, exponent_range=(4096, 65536),
    roof_size=8192, roof_target_seq_len=16384, roof_target_dim=128,
    min_run_time={"a": 0.05, "b": 0.05, "c": 0.1, "d": 0.1},
    budgets_s={"a": 480.0, "b": 120.0, "c": 300.0, "d": 300.0},
)
SMOKE_PLAN = Plan(
    smoke=True,
    a_seq_lens=(128, 256), a_batch=1, a_heads=2, a_dim=16, a_dtype="float16",
    c_tokens=256, c_hidden=64, c_dims=(32, 16), c_seq_lens=(128, 256), c_dtype="bfloat16",
    compare_seq_lens=(256,), overhead_seq_len=256, exponent_range=(128, 256),
    roof_size=1024, roof_target_seq_len=256, roof_target_dim=32,
    min_run_time={"a": 0.01, "b": 0.01, "c": 0.01, "d": 0.01},
    budgets_s={"a": 600.0, "b": 600.0, "c": 600.0, "d": 600.0},
)

# Part a: (label, variant, options over conf/variant/<variant>.yaml), in the order they are measured
# (what the targets need first; every `dense` backend, the N×N mask path, goes last).
A_VARIANTS = [
    ("full", "full", {}),
    ("sliding_window", "sliding_window", {}),
    ("linear", "linear", {}),  # max_seq_len is set to the longest N
    ("blockwise-local", "blockwise", {"mode": "local"}),
    ("sparse-fixed", "sparse", {"pattern": "fixed"}),
    ("sparse-strided", "sparse", {"pattern": "strided"}),
    ("sparse-bigbird", "sparse", {"pattern": "bigbird"}),
    ("blockwise-exact", "blockwise", {"mode": "exact"}),
]
FULL_ORDER = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "xformers", "auto", "sdpa", "math", "sdpa_math")
# Labels whose time grows as N² (theory), for projecting a series' next point.
QUADRATIC = {"full", "sparse-fixed", "sparse-strided", "blockwise-exact"}
N2_BACKENDS = {"math", "sdpa_math", "dense"}
CALLS_PER_POINT = 16  # forward+backward equivalents of one point when a call is longer than do_bench's rep
# The efficient variants whose best backend is held against the best public kernel for its pattern.
COMPARE = [("sliding_window", True), ("blockwise-local", True), ("sparse-fixed", True),
           ("sparse-strided", True), ("sparse-bigbird", True), ("blockwise-exact", False)]  # False: for information
EXPONENT_TARGETS = ("sliding_window", "linear")
OVERHEAD_CASES = [("full", "full", {}, "sdpa_flash"), ("sliding_window", "sliding_window", {}, "xformers"),
                  ("linear", "linear", {}, "sdpa")]


@dataclass(frozen=True)
class Series:
    part: str
    label: str
    variant: str
    options: tuple[tuple[str, Any], ...]
    backend: str
    causal: bool = False
    dim: int | None = None  # part c: the head dim of the series

    @property
    def key(self) -> str:
        if self.part == "c":
            return f"D{self.dim}-{'causal' if self.causal else 'bidir'}__{self.backend}"
        return f"{self.label}__{self.backend}"

    def overrides(self) -> list[str]:
        return [f"variant={self.variant}", f"variant.backend={self.backend}",
                *[f"variant.{k}={v}" for k, v in self.options]]


def variant_options(variant: str, options: dict[str, Any], plan: Plan) -> dict[str, Any]:
    if variant == "linear":
        return {**options, "max_seq_len": max(plan.a_seq_lens + plan.compare_seq_lens + (plan.overhead_seq_len,))}
    return dict(options)


def available(variant: str, options: dict[str, Any], device: torch.device) -> list[str]:
    import variants

    return variants.build(variant, **options).available_backends(device)


def series_a(plan: Plan, device: torch.device) -> list[Series]:
    out, dense = [], []
    for label, variant, options in A_VARIANTS:
        opts = variant_options(variant, options, plan)
        backends = available(variant, opts, device)
        if variant == "full":
            backends = sorted(backends, key=lambda b: FULL_ORDER.index(b) if b in FULL_ORDER else len(FULL_ORDER))
        for b in backends:
            s = Series("a", label, variant, tuple(opts.items()), b)
            (dense if b == "dense" else out).append(s)
    return out + dense


def series_c(plan: Plan, device: torch.device) -> list[Series]:
    backends = sorted(available("full", {}, device),
                      key=lambda b: FULL_ORDER.index(b) if b in FULL_ORDER else len(FULL_ORDER))
    return [Series("c", "full", "full", (), b, causal, dim)
            for causal in (False, True) for dim in plan.c_dims for b in backends]


# ----- running points through the harness --------------------------------------------------------


class Budget:
    def __init__(self, total_s: float | None) -> None:
        self.start = time.monotonic()
        self.total_s = total_s

    def left(self) -> float:
        return math.inf if self.total_s is None else self.total_s - (time.monotonic() - self.start)


class Context:
    """The composed-config factory, the device, where results go and the log."""

    def __init__(self, plan: Plan, out: Path, device: torch.device, point_cap_s: float,
                 min_run_time: float | None, only: str | None = None) -> None:
        from hydra import initialize_config_dir

        self.plan, self.out, self.device, self.point_cap_s, self.only = plan, out, device, point_cap_s, only
        self.min_run_time_override = min_run_time
        self._hydra = contextlib.ExitStack()
        self._hydra.enter_context(initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"))
        self._env: dict | None = None
        cuda = device.type == "cuda"
        total = torch.cuda.get_device_properties(device).total_memory if cuda else None
        # GPU: skip only what clearly cannot fit (the analytic figure is about 3/4 of full math's real
        # peak); the rest runs and an out-of-memory is caught by the harness (status oom).
        self.memory_budget_gb = None if total is None else round(1.25 * total / 1e9, 1)

    def close(self) -> None:
        self._hydra.close()

    def selected(self, s: Series) -> bool:
        import fnmatch

        return self.only is None or fnmatch.fnmatchcase(s.key, self.only)

    def min_run_time(self, part: str) -> float:
        return self.min_run_time_override or self.plan.min_run_time[part]

    def compose(self, overrides: list[str]):
        from hydra import compose

        return compose(config_name="config", overrides=overrides)

    def environment(self) -> dict:
        if self._env is None:
            from harness import env as envmod

            self._env = envmod.collect(self.device).as_dict()
        return self._env

    def workload(self, *, batch: int, heads: int, dim: int, dtype: str, causal: bool, seq_len: int,
                 part: str, passes: Iterable[str] | None = None, memory: bool = True) -> list[str]:
        o = [f"batch_size={batch}", f"num_heads={heads}", f"head_dim={dim}", f"dtype={dtype}",
             f"device={self.device.type}", f"causal={str(causal).lower()}", f"seq_lens=[{seq_len}]",
             f"measure.min_run_time={self.min_run_time(part)}", "measure.warmup_iters=1",
             "fidelity.enabled=false", "logger=none", "resume=true"]
        if passes is not None:
            o.append(f"measure.passes=[{','.join(passes)}]")
        if not memory:
            o.append("measure.memory=false")
        if self.memory_budget_gb is not None:
            o.append(f"memory_budget_gb={self.memory_budget_gb}")
        if self.plan.smoke:  # a dry run of the orchestration at tiny sizes: its timings are not judged as noise
            o += ["measure.max_rel_iqr=1000", "measure.max_other_cores=1000", "measure.min_samples=2"]
        return o

    def dtype(self, name: str) -> str:
        """float32 on CPU (half-precision matmuls there are slow emulations), the plan's dtype on GPU."""
        return name if self.device.type == "cuda" else "float32"


def same_point(rec: dict, want: dict) -> bool:
    return all(rec.get(k) == v for k, v in want.items())


def existing(series_dir: Path, want: dict) -> dict | None:
    from harness.results import read_jsonl

    path = series_dir / "results.jsonl"
    if not path.exists():
        return None
    for rec in read_jsonl(path):
        if same_point(rec, want):
            return rec
    return None


def measure(ctx: Context, series_dir: Path, overrides: list[str]) -> tuple[dict, float]:
    """One point through harness.run.run (quiet console); returns its record and wall seconds."""
    from rich.console import Console

    from harness.console import Display
    from harness.run import run as harness_run

    cfg = ctx.compose(overrides)
    start = time.perf_counter()
    sweep = harness_run(cfg, output_dir=series_dir, display=Display("", 1, console=Console(file=io.StringIO())))
    return sweep.rows[-1].record(), time.perf_counter() - start


def write_skip(ctx: Context, series_dir: Path, overrides: list[str], reason: str) -> dict:
    """A point not run (status skipped, with the reason) in the harness's own results file, so that a
    rerun into the same directory does not try it again."""
    from harness.measure import timer_name
    from harness.results import FIELDS, Result, ResultStore
    from harness.run import validate
    from harness import env as envmod

    cfg = ctx.compose(overrides)
    s, attn, device = validate(cfg)
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(variant=attn.name, backend=attn.backend, seq_len=s.seq_lens[0], batch_size=s.batch_size,
               num_heads=s.num_heads, head_dim=s.head_dim, dtype=s.dtype, device=device.type, causal=s.causal,
               seed=s.seed, status="skipped", reason=reason, timer=timer_name(device, s.measure),
               inputs=None, task=None, date=envmod.now(),
               **{k: v for k, v in ctx.environment().items() if k in FIELDS})
    row = Result(**rec, options=tuple(dataclasses.asdict(attn.options).items()))
    with ResultStore(series_dir, resume=True) as w:
        w.add(row)
    return row.record()


def project_s(series: Series, last_ok: dict | None, seq_len: int) -> float | None:
    """Projected seconds of the point at ``seq_len`` from the series' last ok point."""
    if last_ok is None or not last_ok.get("fwd_bwd_ms"):
        return None
    quadratic = series.label in QUADRATIC or series.backend in N2_BACKENDS
    ratio = (seq_len / last_ok["seq_len"]) ** (2 if quadratic else 1)
    return CALLS_PER_POINT * last_ok["fwd_bwd_ms"] / 1e3 * ratio


def run_series(ctx: Context, series: Series, points: list[tuple[int, list[str], dict]], budget: Budget,
               log: Callable[[str], None], part: str) -> int:
    """Measures a series' points in order of N. Returns how many were not reached (budget)."""
    series_dir = ctx.out / part / series.key
    last_ok, blocked = None, None
    for i, (seq_len, overrides, want) in enumerate(points):
        rec = existing(series_dir, want)
        if rec is None:
            if budget.left() <= 0:
                return len(points) - i
            projected = project_s(series, last_ok, seq_len)
            if blocked is None and projected is not None and projected > ctx.point_cap_s:
                blocked = (f"projected {projected:.0f} s for this point (from N={last_ok['seq_len']}: "
                           f"{last_ok['fwd_bwd_ms']:.4g} ms per forward+backward) exceeds --point-cap-s "
                           f"{ctx.point_cap_s:.0f}")
            if blocked is not None:
                rec = write_skip(ctx, series_dir, overrides, blocked)
                wall = 0.0
            else:
                rec, wall = measure(ctx, series_dir, overrides)
            log(f"[{part}] {series.key} N={seq_len} B={want['batch_size']}: {rec['status']}"
                + (f" fwd {fmt_ms(rec['fwd_ms'])} ms, fwd+bwd {fmt_ms(rec['fwd_bwd_ms'])} ms, "
                   f"peak {fmt_mib(rec['peak_mem_bytes'])} MiB" if rec["status"] == "ok" else f" ({rec['reason']})")
                + f" [{wall:.1f} s]")
        if rec["status"] == "ok":
            last_ok = rec
        elif blocked is None and (rec["status"] == "oom" or (rec["status"] == "skipped" and "memory" in (rec["reason"] or ""))):
            blocked = f"not run: N={seq_len} did not fit ({rec['status']}); longer sequences need more memory"
        elif blocked is None and rec["status"] == "skipped" and "point-cap" in (rec["reason"] or ""):
            blocked = rec["reason"]
    return 0


# ----- parts ---------------------------------------------------------------------------------------


def part_a(ctx: Context, budget: Budget, log) -> dict:
    p = ctx.plan
    dtype = ctx.dtype(p.a_dtype)
    not_reached = 0
    for s in series_a(p, ctx.device):
        if not ctx.selected(s):
            continue
        points = []
        for n in p.a_seq_lens:
            o = s.overrides() + ctx.workload(batch=p.a_batch, heads=p.a_heads, dim=p.a_dim, dtype=dtype,
                                             causal=False, seq_len=n, part="a")
            points.append((n, o, a_want(p, dtype, ctx.device, n)))
        not_reached += run_series(ctx, s, points, budget, log, "a")
    return {"complete": not_reached == 0 and ctx.only is None, "not_reached": not_reached}


def a_want(p: Plan, dtype: str, device: torch.device, n: int) -> dict:
    return {"seq_len": n, "batch_size": p.a_batch, "num_heads": p.a_heads, "head_dim": p.a_dim, "dtype": dtype,
            "causal": False, "device": device.type}


def part_b(ctx: Context, budget: Budget, log) -> dict:
    """Part a's full__math rows where they exist; the others measured memory-only into b/."""
    p = ctx.plan
    dtype = ctx.dtype(p.a_dtype)
    have = {n for n in p.a_seq_lens if existing(ctx.out / "a" / "full__math", a_want(p, dtype, ctx.device, n))}
    missing = [n for n in p.a_seq_lens if n not in have]
    if not missing:
        return {"complete": True, "not_reached": 0}
    s = Series("b", "full", "full", (), "math")
    points = [(n, s.overrides() + ctx.workload(batch=p.a_batch, heads=p.a_heads, dim=p.a_dim, dtype=dtype,
                                               causal=False, seq_len=n, part="b", passes=[]),
               a_want(p, dtype, ctx.device, n)) for n in p.a_seq_lens]
    left = run_series(ctx, s, points, budget, log, "b")
    return {"complete": left == 0, "not_reached": left}


def part_c(ctx: Context, budget: Budget, log) -> dict:
    p = ctx.plan
    dtype = ctx.dtype(p.c_dtype)
    roof_path = ctx.out / "c" / "roof.json"
    if not roof_path.exists():
        roof = measure_roofs(ctx, log)
        roof_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(roof_path, roof)
    not_reached = 0
    for s in series_c(p, ctx.device):
        if not ctx.selected(s):
            continue
        heads = p.c_hidden // s.dim
        points = []
        for n in p.c_seq_lens:
            batch = p.c_tokens // n
            if batch < 1:
                continue
            o = s.overrides() + ctx.workload(batch=batch, heads=heads, dim=s.dim, dtype=dtype, causal=s.causal,
                                             seq_len=n, part="c")
            points.append((n, o, {"seq_len": n, "batch_size": batch, "num_heads": heads, "head_dim": s.dim,
                                  "dtype": dtype, "causal": s.causal, "device": ctx.device.type}))
        not_reached += run_series(ctx, s, points, budget, log, "c")
    return {"complete": not_reached == 0 and ctx.only is None, "not_reached": not_reached}


def measure_roofs(ctx: Context, log) -> dict:
    """The device's matmul rate: an n×n×n torch.matmul of fresh randn, median of do_bench."""
    if ctx.device.type != "cuda":
        return {"status": NEEDS_CUDA, "reason": "the roof is timed with triton.testing.do_bench on a CUDA device"}
    from triton.testing import do_bench

    n = ctx.plan.roof_size
    out = {"status": "ok", "size": n, "timer": "triton.testing.do_bench(median, rep=500 ms)", "tflops": {},
           "ms": {}, "date": now(), "hostname": platform.node(), "device_name": torch.cuda.get_device_name(ctx.device)}
    def timed(dtype: str) -> float:  # the operands are freed on return
        g = torch.Generator(device=ctx.device).manual_seed(0)
        x, y = (torch.randn(n, n, device=ctx.device, dtype=getattr(torch, dtype), generator=g) for _ in range(2))
        return do_bench(lambda: torch.matmul(x, y), warmup=100, rep=500, return_mode="median")

    for dtype in ("bfloat16", "float16"):
        ms = timed(dtype)
        out["ms"][dtype] = ms
        out["tflops"][dtype] = 2 * n**3 / (ms * 1e-3) / 1e12
        log(f"[c] matmul roof {dtype} {n}^3: {ms:.3f} ms = {out['tflops'][dtype]:.1f} TFLOP/s")
    torch.cuda.empty_cache()
    return out


# ----- part d: public kernels and the harness's overhead ------------------------------------------


class Unavailable(Exception):
    """A public kernel that cannot run here (reason: one line)."""


def compare_variant(label: str) -> tuple[str, dict[str, Any]]:
    for lab, variant, options in A_VARIANTS:
        if lab == label:
            return variant, options
    raise KeyError(label)


def public_kernels(label: str, attn, B: int, H: int, N: int, D: int, dtype: torch.dtype,
                   device: torch.device) -> dict[str, Callable[[], Callable[[], None]]]:
    """The best public kernels for a variant's pattern, each a builder returning a forward+backward
    callable on fresh randn inputs already in the kernel's own layout (layout changes stay untimed)."""
    cuda = device.type == "cuda"
    scale = D ** -0.5

    def inputs(shape):
        g = torch.Generator(device=device).manual_seed(1)
        ts = [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4)]
        for t in ts[:3]:
            t.requires_grad_()
        return ts[:3], ts[3]

    def fwd_bwd(f, shape):
        (q, k, v), dout = inputs(shape)

        def call():
            q.grad = k.grad = v.grad = None
            f(q, k, v).backward(dout)
        return call

    def xformers(bias_fn, flat=False):
        def build():
            if not cuda:
                raise Unavailable(f"{NEEDS_CUDA} (xformers runs no attention on CPU)")
            from variants.xformers_backend import xformers_ops

            try:
                xops = xformers_ops()
            except Exception as e:  # VariantError: xformers does not import
                raise Unavailable(str(e)) from None
            bias = bias_fn(xops.fmha.attn_bias)
            shape = (1, B * N, H, D) if flat else (B, N, H, D)  # xformers' own layout
            return fwd_bwd(lambda q, k, v: xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale), shape)
        return build

    def flex(mod_fn):
        def build():
            if not cuda:
                raise Unavailable(f"{NEEDS_CUDA} (FlexAttention has no backward on CPU)")
            from torch.nn.attention.flex_attention import create_block_mask

            from variants.flex import compiled_flex_attention

            mod = mod_fn()
            bm = create_block_mask(mod, None, None, N, N, device=device, BLOCK_SIZE=128)
            fn = compiled_flex_attention()
            return fwd_bwd(lambda q, k, v: fn(q, k, v, block_mask=bm, scale=scale), (B, H, N, D))
        return build

    def sdpa_flash(shape):
        def build():
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def f(q, k, v):
                if not cuda:
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
            return fwd_bwd(f, shape)
        return build

    name = "SDPA flash" if cuda else "SDPA"
    if label == "sliding_window":
        w = attn.options.window
        return {f"xformers LocalAttentionFromBottomRightMask({w}, {w}) (flash, window)":
                    xformers(lambda ab: ab.LocalAttentionFromBottomRightMask(window_left=w, window_right=w)),
                f"FlexAttention mask_mod abs(q-kv) <= {w}":
                    flex(lambda: (lambda b, h, q, kv: (q - kv).abs() <= w))}
    if label == "blockwise-local":
        b = attn.options.block_size
        kernels = {f"xformers BlockDiagonalMask (blocks of {b})":
                       xformers(lambda ab: ab.BlockDiagonalMask.from_seqlens([b] * (B * N // b), device=device), flat=True),
                   f"FlexAttention mask_mod q//{b} == kv//{b}":
                       flex(lambda: (lambda bb, h, q, kv: q // b == kv // b))}
        if N % b == 0:
            kernels[f"{name} on (B·N/{b}, H, {b}, D) blocks"] = sdpa_flash((B * N // b, H, b, D))
        return kernels
    if label.startswith("sparse-"):
        bs = attn.engine_block_size(N)

        def layout_mod():
            lay = attn.layout(N, False).to(device)
            return lambda b, h, q, kv: lay[q // bs, kv // bs]
        return {f"FlexAttention mask_mod layout[q//{bs}, kv//{bs}]": flex(layout_mod)}
    if label == "blockwise-exact":
        return {name: sdpa_flash((B, H, N, D)),
                "xformers memory_efficient_attention": xformers(lambda ab: None)}
    return {}


def time_callable(ctx: Context, fn: Callable[[], None], part: str) -> float:
    """Median ms of ``fn`` with the harness's own timer (do_bench on GPU), for kernels the harness
    does not wrap."""
    from harness.config import MeasureOptions
    from harness.measure import synchronize, time_fn

    fn()  # warm-up (compilation, plans)
    synchronize(ctx.device)
    return time_fn(fn, ctx.device, MeasureOptions(min_run_time=ctx.min_run_time(part))).median_ms


def part_d(ctx: Context, budget: Budget, log) -> dict:
    import variants

    p = ctx.plan
    dtype_name = ctx.dtype(p.a_dtype)
    dtype = getattr(torch, dtype_name)
    d_dir = ctx.out / "d"
    d_dir.mkdir(parents=True, exist_ok=True)
    cmp_path = d_dir / "compare.jsonl"
    done = {(r["label"], r["seq_len"], r["kind"], r["name"]) for r in read_jsonl_safe(cmp_path)}
    not_reached = 0
    for label, _is_target in COMPARE:
        variant, options = compare_variant(label)
        opts = variant_options(variant, options, p)
        for n in p.compare_seq_lens:
            # Ours: every backend of the variant but `dense` (the N×N mask path), through the harness.
            for b in available(variant, opts, ctx.device):
                if b == "dense" or (label, n, "ours", b) in done:
                    continue
                if budget.left() <= 0:
                    not_reached += 1
                    continue
                s = Series("d", label, variant, tuple(opts.items()), b)
                o = s.overrides() + ctx.workload(batch=p.a_batch, heads=p.a_heads, dim=p.a_dim, dtype=dtype_name,
                                                 causal=False, seq_len=n, part="d", passes=["fwd_bwd"], memory=False)
                rec, wall = measure(ctx, d_dir / "ours" / s.key, o)
                row = {"label": label, "seq_len": n, "kind": "ours", "name": b, "status": rec["status"],
                       "fwd_bwd_ms": rec["fwd_bwd_ms"], "reason": rec["reason"], "date": now()}
                append_jsonl(cmp_path, row)
                log(f"[d] {label} N={n} ours {b}: {rec['status']} {fmt_ms(rec['fwd_bwd_ms'])} ms [{wall:.1f} s]")
            attn = variants.build(variant, **opts)
            for name, build in public_kernels(label, attn, p.a_batch, p.a_heads, n, p.a_dim, dtype, ctx.device).items():
                if (label, n, "public", name) in done:
                    continue
                if budget.left() <= 0:
                    not_reached += 1
                    continue
                row = {"label": label, "seq_len": n, "kind": "public", "name": name, "status": "ok",
                       "fwd_bwd_ms": None, "reason": None, "date": now()}
                try:
                    row["fwd_bwd_ms"] = time_callable(ctx, build(), "d")
                except Unavailable as e:
                    row.update(status="skipped" if NEEDS_CUDA in str(e) else "unavailable", reason=str(e))
                except Exception as e:  # OOM or a kernel that refuses the shape: recorded, the next runs
                    row.update(status="error", reason=one_line(f"{type(e).__name__}: {e}")[:300])
                finally:
                    if ctx.device.type == "cuda":
                        torch.cuda.empty_cache()
                append_jsonl(cmp_path, row)
                log(f"[d] {label} N={n} public {name}: {row['status']} {fmt_ms(row['fwd_bwd_ms'])} ms"
                    + (f" ({row['reason']})" if row["reason"] else ""))
    ov_path = d_dir / "overhead.json"
    if not ov_path.exists():
        if budget.left() <= 0:
            not_reached += 1
        else:
            write_json(ov_path, measure_overhead(ctx, log))
    return {"complete": not_reached == 0, "not_reached": not_reached}


def measure_overhead(ctx: Context, log) -> dict:
    """The harness's fwd and fwd_bwd medians against raw do_bench of the same callable on the same
    shape (raw before and after the harness; their mean is the reference)."""
    if ctx.device.type != "cuda":
        return {"status": NEEDS_CUDA, "reason": "raw triton.testing.do_bench needs a CUDA device", "cases": []}
    rep = ctx.min_run_time("d") * 1e3
    cases = []
    for label, variant, options, backend in OVERHEAD_CASES:
        opts = variant_options(variant, options, ctx.plan)
        case = {"label": label, "backend": backend, "seq_len": ctx.plan.overhead_seq_len, "status": "ok"}
        if backend not in available(variant, opts, ctx.device):
            case["status"] = "unavailable"
        else:
            try:
                overhead_case(ctx, case, variant, opts, rep, log)
            except Exception as e:
                case.update(status="error", reason=one_line(f"{type(e).__name__}: {e}")[:300])
            torch.cuda.empty_cache()
        cases.append(case)
    return {"status": "ok", "timer": f"triton.testing.do_bench(median, rep={rep:g} ms)", "cases": cases, "date": now()}


def overhead_case(ctx: Context, case: dict, variant: str, opts: dict, rep: float, log) -> None:
    import variants
    from triton.testing import do_bench

    p, label, backend, n = ctx.plan, case["label"], case["backend"], case["seq_len"]
    dtype_name = ctx.dtype(p.a_dtype)
    attn = variants.build(variant, **opts, backend=backend).to(ctx.device)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    shape = (p.a_batch, p.a_heads, n, p.a_dim)
    q, k, v, dout = (torch.randn(shape, generator=g, device=ctx.device, dtype=getattr(torch, dtype_name))
                     for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()

    def fwd():
        return attn(q, k, v, causal=False)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        attn(q, k, v, causal=False).backward(dout)

    def raw() -> dict[str, float]:
        return {"fwd": do_bench(fwd, rep=rep, return_mode="median"),
                "fwd_bwd": do_bench(fwd_bwd, rep=rep, return_mode="median")}

    fwd_bwd()  # warm-up
    before = raw()
    s = Series("d", label, variant, tuple(opts.items()), backend)
    o = s.overrides() + ctx.workload(batch=p.a_batch, heads=p.a_heads, dim=p.a_dim, dtype=dtype_name, causal=False,
                                     seq_len=n, part="d", passes=["fwd", "fwd_bwd"], memory=False)
    rec, _ = measure(ctx, ctx.out / "d" / "overhead" / s.key, o)
    after = raw()
    for pas in ("fwd", "fwd_bwd"):
        mean = (before[pas] + after[pas]) / 2
        case[pas] = {"harness_ms": rec[f"{pas}_ms"], "raw_ms_before": before[pas], "raw_ms_after": after[pas],
                     "overhead": None if rec[f"{pas}_ms"] is None else rec[f"{pas}_ms"] / mean - 1}
    log(f"[d] overhead {label} {backend}: " + ", ".join(
        f"{pas} harness {fmt_ms(case[pas]['harness_ms'])} ms vs raw {fmt_ms(case[pas]['raw_ms_before'])}/"
        f"{fmt_ms(case[pas]['raw_ms_after'])} ms" for pas in ("fwd", "fwd_bwd")))


# ----- reading results back ------------------------------------------------------------------------


def read_jsonl_safe(path: Path) -> list[dict]:
    """The whole lines of a .jsonl (a line cut by a kill is skipped); [] when there is none yet."""
    rows = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")


def load_part(out: Path, part: str) -> dict[str, list[dict]]:
    """series key -> rows (the last row of each point wins), for the part's series directories."""
    series = {}
    base = out / part
    if not base.exists():
        return series
    for path in sorted(base.glob("*/results.jsonl")):
        rows = {}
        for r in read_jsonl_safe(path):
            rows[(r["seq_len"], r["batch_size"], r["num_heads"], r["head_dim"], r["dtype"], r["causal"])] = r
        series[path.parent.name] = sorted(rows.values(), key=lambda r: r["seq_len"])
    return series


def series_order(keys: Iterable[str], part: str) -> list[str]:
    """Series keys in measurement order (labels as in A_VARIANTS, then backends)."""
    labels = [lab for lab, _, _ in A_VARIANTS]

    def rank(key: str):
        label, backend = key.split("__", 1)
        if part == "c":
            m = re.match(r"D(\d+)-(bidir|causal)", label)
            lab_rank = (m.group(2) == "causal", -int(m.group(1))) if m else (True, 0)
        else:
            lab_rank = (labels.index(label) if label in labels else len(labels),)
        return (backend == "dense", lab_rank, FULL_ORDER.index(backend) if backend in FULL_ORDER else len(FULL_ORDER), backend)
    return sorted(keys, key=rank)


# ----- targets, summary, plots ---------------------------------------------------------------------


def fmt_ms(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def fmt_mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def fmt_tf(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def fmt_ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def cell(r: dict | None, value: Callable[[dict], str]) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    return value(r)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def write_json(path: Path, obj: Any) -> None:
    from harness.results import write_json as w

    w(path, obj)


def table(head: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" if i < right_from else "---:" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def target(tid: str, text: str, status: str, *, value=None, threshold=None, detail: str = "", gap: str | None = None,
           needs_cuda: bool = False) -> dict:
    assert status in ("met", "missed", "skipped", "not measured"), status
    return {"id": tid, "target": text, "status": status, "value": value, "threshold": threshold, "detail": detail,
            "gap": gap, "needs_cuda": needs_cuda}


def analyse(out: Path, plan: Plan, device_type: str) -> dict:
    """Everything SUMMARY.md and summary.json say, computed from the files in ``out``."""
    from harness.results import fit_exponents

    cuda = device_type == "cuda"
    a = load_part(out, "a")
    c = load_part(out, "c")
    b_rows = load_part(out, "b").get("full__math", [])
    res: dict[str, Any] = {"a": {}, "frontier": {}, "math_memory": [], "c": {}, "roof": None, "compare": [],
                           "exponents": {}, "overhead": None, "targets": []}

    # a: time and memory per series and N; the OOM frontier.
    for key in series_order(a, "a"):
        rows = a[key]
        res["a"][key] = {str(r["seq_len"]): {k: r.get(k) for k in ("status", "reason", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
                                                                   "peak_mem_bytes", "peak_mem_abs_bytes",
                                                                   "tflops_fwd_bwd", "warmup_s")} for r in rows}
        ok = [r["seq_len"] for r in rows if r["status"] == "ok"]
        first_bad = next((r for r in rows if r["status"] != "ok" and (not ok or r["seq_len"] > max(ok))), None)
        res["frontier"][key] = {"largest_ok": max(ok) if ok else None,
                                "first_failing": None if first_bad is None else first_bad["seq_len"],
                                "status": None if first_bad is None else first_bad["status"],
                                "reason": None if first_bad is None else first_bad["reason"]}

    # b: full math against Table 21.
    math_rows = {r["seq_len"]: r for r in b_rows}
    math_rows.update({r["seq_len"]: r for r in a.get("full__math", [])})
    for n in sorted(math_rows):
        r = math_rows[n]
        B, H, D = r["batch_size"], r["num_heads"], r["head_dim"]
        elt = 2 if r["dtype"] in ("float16", "bfloat16") else 4
        formula = 4 * B * H * n * n * 2 + 10 * B * H * n * D * 2
        measured = None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] + 4 * B * H * n * D * elt
        res["math_memory"].append({"seq_len": n, "status": r["status"], "measured_bytes": measured,
                                   "peak_mem_bytes": r["peak_mem_bytes"], "peak_mem_abs_bytes": r["peak_mem_abs_bytes"],
                                   "formula_bytes": formula,
                                   "ratio": None if measured is None else measured / formula})

    # c: TFLOP/s and the roof.
    roof_path = out / "c" / "roof.json"
    res["roof"] = json.loads(roof_path.read_text()) if roof_path.exists() else None
    for key in series_order(c, "c"):
        res["c"][key] = {str(r["seq_len"]): {k: r.get(k) for k in ("status", "reason", "batch_size", "num_heads",
                                                                   "fwd_ms", "fwd_bwd_ms", "tflops_fwd", "tflops_bwd",
                                                                   "tflops_fwd_bwd")} for r in c[key]}

    # d: comparisons (the last measurement of each kernel and N wins).
    latest = {}
    for r in read_jsonl_safe(out / "d" / "compare.jsonl"):
        latest[(r["label"], r["seq_len"], r["kind"], r["name"])] = r
    res["compare_rows"] = list(latest.values())
    for label, is_target in COMPARE:
        for n in sorted({nn for (lab, nn, _, _) in latest if lab == label}):
            rows = [r for (lab, nn, _, _), r in latest.items() if lab == label and nn == n]
            if not rows:
                continue
            ours = [r for r in rows if r["kind"] == "ours" and r["status"] == "ok" and r["fwd_bwd_ms"]]
            pub = [r for r in rows if r["kind"] == "public" and r["status"] == "ok" and r["fwd_bwd_ms"]]
            best_o = min(ours, key=lambda r: r["fwd_bwd_ms"]) if ours else None
            best_p = min(pub, key=lambda r: r["fwd_bwd_ms"]) if pub else None
            res["compare"].append({
                "label": label, "seq_len": n, "is_target": is_target,
                "ours_backend": best_o and best_o["name"], "ours_ms": best_o and best_o["fwd_bwd_ms"],
                "public_name": best_p and best_p["name"], "public_ms": best_p and best_p["fwd_bwd_ms"],
                "speed_ratio": best_p["fwd_bwd_ms"] / best_o["fwd_bwd_ms"] if best_o and best_p else None,
                "public_not_run": [f"{r['name']}: {r['reason']}" for r in rows
                                   if r["kind"] == "public" and r["status"] != "ok"]})

    # Exponents over the plan's range, every series of the exponent targets (and the rest, for information).
    lo, hi = plan.exponent_range
    for key in series_order(a, "a"):
        fit = fit_exponents(a[key], lo, hi).get("fwd_bwd_ms")
        if fit:
            res["exponents"][key] = {"fitted": fit["fitted"], "theory": fit["theory"], "seq_lens": fit["seq_lens"]}

    ov_path = out / "d" / "overhead.json"
    res["overhead"] = json.loads(ov_path.read_text()) if ov_path.exists() else None
    res["targets"] = targets(res, plan, cuda)
    return res


def targets(res: dict, plan: Plan, cuda: bool) -> list[dict]:
    out = []
    # 1. full's best backend >= 60% of the roof, forward, N=16K, D=128, non-causal.
    n, d = plan.roof_target_seq_len, plan.roof_target_dim
    text = f"full's best backend >= 60% of the bf16 matmul roof, forward, N={n}, D={d}, non-causal"
    roof = res["roof"]
    cands = [(key.split("__")[1], row["tflops_fwd"]) for key, rows in res["c"].items()
             if key.startswith(f"D{d}-bidir__") and (row := rows.get(str(n))) and row["status"] == "ok"
             and row["tflops_fwd"]]
    if not cuda or (roof and roof.get("status") == NEEDS_CUDA):
        best = max(cands, key=lambda x: x[1]) if cands else None
        out.append(target("full_roof", text, "skipped", needs_cuda=True,
                          detail=f"{NEEDS_CUDA} (the roof is timed with triton.testing.do_bench)"
                                 + (f"; best backend here {best[0]} {fmt_tf(best[1])} TFLOP/s" if best else "")))
    elif not roof or not cands:
        out.append(target("full_roof", text, "not measured", needs_cuda=True,
                          detail="part c has no roof or no ok full point at this shape yet"))
    else:
        backend, tf = max(cands, key=lambda x: x[1])
        r = roof["tflops"]["bfloat16"]
        ratio = tf / r
        out.append(target("full_roof", text, "met" if ratio >= 0.6 else "missed", value=ratio, threshold=0.6,
                          needs_cuda=True,
                          detail=f"{backend} {fmt_tf(tf)} TFLOP/s vs roof {fmt_tf(r)} TFLOP/s: {fmt_ratio(ratio)}",
                          gap=None if ratio >= 0.6 else f"{(0.6 - ratio) * r:.1f} TFLOP/s short of 60% ({fmt_ratio(ratio)} of the roof)"))

    # 2. full math memory within 2% of FA-1 Table 21, every N that ran.
    text = "full math peak memory = FA-1 Table 21's 4·B·H·N²·2 + 10·B·H·N·D·2 bytes within 2% (every N that ran)"
    mm = [m for m in res["math_memory"] if m["ratio"] is not None]
    detail = ", ".join(f"N={m['seq_len']}: {fmt_ratio(m['ratio'])}" for m in mm)
    if not cuda:
        out.append(target("math_memory", text, "skipped", needs_cuda=True,
                          detail=f"{NEEDS_CUDA} (Table 21 is the CUDA allocator's peak in fp16); ratios here: {detail or '-'}"))
    elif not mm:
        out.append(target("math_memory", text, "not measured", needs_cuda=True, detail="no full math point ran"))
    else:
        worst = max(mm, key=lambda m: abs(m["ratio"] - 1))
        ok = abs(worst["ratio"] - 1) <= 0.02
        out.append(target("math_memory", text, "met" if ok else "missed", value=worst["ratio"], threshold="1 ± 0.02",
                          needs_cuda=True, detail=detail,
                          gap=None if ok else f"worst N={worst['seq_len']}: ratio {fmt_ratio(worst['ratio'])} "
                                              f"({(worst['ratio'] - 1) * 100:+.1f}%)"))

    # 3. each efficient variant's best backend within 0.9x of the best public kernel.
    for label, is_target in COMPARE:
        if not is_target:
            continue
        rows = [r for r in res["compare"] if r["label"] == label]
        text = f"{label}: best backend's forward+backward time within 0.9x of the best public kernel's (speed ratio >= 0.9)"
        measured = [r for r in rows if r["speed_ratio"] is not None]
        not_run = "; ".join(sorted({x for r in rows for x in r["public_not_run"]}))
        if not measured:
            cpu_only = any(NEEDS_CUDA in x for r in rows for x in r["public_not_run"]) or not cuda
            out.append(target(f"compare_{label}", text, "skipped" if cpu_only and not cuda else "not measured",
                              needs_cuda=True, detail=not_run or "no comparison measured"))
            continue
        worst = min(measured, key=lambda r: r["speed_ratio"])
        ok = worst["speed_ratio"] >= 0.9
        detail = "; ".join(f"N={r['seq_len']}: ours {r['ours_backend']} {fmt_ms(r['ours_ms'])} ms vs "
                           f"{r['public_name']} {fmt_ms(r['public_ms'])} ms = {fmt_ratio(r['speed_ratio'])}" for r in measured)
        out.append(target(f"compare_{label}", text, "met" if ok else "missed", value=worst["speed_ratio"], threshold=0.9,
                          needs_cuda=not measured, detail=detail + (f" (not run: {not_run})" if not_run else ""),
                          gap=None if ok else f"N={worst['seq_len']}: ours is {1 / worst['speed_ratio']:.2f}x the public "
                                              f"kernel's time"))

    # 4. sliding_window and linear time exponents <= 1.1 over the range (their best backend).
    lo, hi = plan.exponent_range
    for label in EXPONENT_TARGETS:
        text = f"{label} forward+backward time exponent <= 1.1 over N={lo}..{hi} (its best backend)"
        fits = {k: f for k, f in res["exponents"].items() if k.split("__")[0] == label and k.split("__")[1] != "dense"}
        full_range = {k: f for k, f in fits.items() if f["seq_lens"][0] == lo and f["seq_lens"][-1] == hi}
        if not full_range:
            out.append(target(f"exponent_{label}", text, "not measured",
                              detail="no backend has ok points at both ends of the range"
                                     + (" (partial: " + ", ".join(f"{k} {f['fitted']:.2f} over {f['seq_lens']}"
                                                                  for k, f in fits.items()) + ")" if fits else "")))
            continue
        at_hi = {k: res["a"][k][str(hi)]["fwd_bwd_ms"] for k in full_range}
        best = min(at_hi, key=at_hi.get)
        f = full_range[best]
        ok = f["fitted"] <= 1.1
        out.append(target(f"exponent_{label}", text, "met" if ok else "missed", value=f["fitted"], threshold=1.1,
                          detail=f"{best}: fitted {f['fitted']:.3f} (theory {f['theory']:.3f}) over N={f['seq_lens']}; "
                                 + ", ".join(f"{k.split('__')[1]} {v['fitted']:.3f}" for k, v in full_range.items()),
                          gap=None if ok else f"{f['fitted'] - 1.1:+.3f} above 1.1"))

    # 5. harness overhead <= 3% against raw do_bench.
    text = "harness timing within 3% of raw triton.testing.do_bench of the same callable (fwd and fwd+bwd)"
    ov = res["overhead"]
    if not cuda or (ov and ov.get("status") == NEEDS_CUDA):
        out.append(target("overhead", text, "skipped", needs_cuda=True, detail=f"{NEEDS_CUDA} (raw do_bench)"))
    elif not ov or not [c for c in ov["cases"] if c["status"] == "ok"]:
        out.append(target("overhead", text, "not measured", needs_cuda=True, detail="part d's overhead not measured"))
    else:
        vals = [(f"{c['label']} {c['backend']} {pas}", c[pas]["overhead"]) for c in ov["cases"] if c["status"] == "ok"
                for pas in ("fwd", "fwd_bwd") if c[pas]["overhead"] is not None]
        worst = max(vals, key=lambda x: x[1])
        ok = worst[1] <= 0.03
        out.append(target("overhead", text, "met" if ok else "missed", value=worst[1], threshold=0.03, needs_cuda=True,
                          detail=", ".join(f"{k}: {v * 100:+.2f}%" for k, v in vals),
                          gap=None if ok else f"{worst[0]}: {worst[1] * 100:+.2f}% (> 3%)"))
    return out


def env_block(out: Path) -> list[dict]:
    path = out / "env.json"
    return json.loads(path.read_text()) if path.exists() else []


def record_invocation(out: Path, device: torch.device, parts: list[str], smoke: bool) -> None:
    """env.json: one entry per invocation (machine, versions, clocks, date, parts)."""
    from harness import env as envmod

    e = envmod.collect(device).as_dict()
    entry = {"date": now(), "parts": parts, "smoke": smoke, "python": platform.python_version(),
             "device_type": device.type, **e, "nvidia_smi": nvidia_smi()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        entry.update(gpu_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                     capability=f"{props.major}.{props.minor}")
    entries = env_block(out) + [entry]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "env.json", entries)


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                            "clocks.max.mem,power.draw,power.limit,temperature.gpu,memory.total",
                            "--format=csv"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def summary_md(out: Path, plan: Plan, res: dict, state: dict) -> str:
    envs = env_block(out)
    e = envs[-1] if envs else {}
    ns = plan.a_seq_lens
    lines = [f"# GPU benchmark (issue 6){' - SMOKE (tiny sizes, not results)' if plan.smoke else ''}", ""]
    lines += [f"Device: {e.get('device_name', '?')}; torch {e.get('torch_version')}, CUDA {e.get('cuda_version')}, "
              f"cuDNN {e.get('cudnn_version')}, triton {e.get('triton_version')}, xformers {e.get('xformers_version')}, "
              f"Python {e.get('python')}; host {e.get('hostname')}.",
              "Invocations (date, parts, machine): " + "; ".join(
                  f"{x['date']} [{','.join(x['parts'])}] {x.get('device_name')} on {x.get('hostname')}" for x in envs) + ".",
              "", "Clocks (nvidia-smi at the start of the last invocation):", "",
              "```", (e.get("nvidia_smi") or "nvidia-smi not available"), "```", "",
              "Produced by `python scripts/bench_gpu.py` (through `scripts/gpu_job.sh` on the GPU machine): every point "
              "is `harness.run.run` on a config composed from `conf/` (timer: triton.testing.do_bench median on GPU, "
              "torch.utils.benchmark on CPU; memory: the caching allocator's peak over the inputs), logger none, fidelity "
              "off. Rows: `<part>/<series>/results.jsonl`; everything below: `summary.json`.", "",
              "Parts: " + ", ".join(f"{p}: {'complete' if s.get('complete') else 'incomplete (' + str(s.get('not_reached')) + ' points not reached)'}"
                                    for p, s in sorted(state.get("parts", {}).items())) + ".", ""]

    lines += ["## Targets", ""]
    lines += table(["target", "status", "measured", "gap / why"],
                   [[t["target"], f"**{t['status']}**", t["detail"] or "-", t["gap"] or "-"] for t in res["targets"]],
                   right_from=99)

    lines += ["", f"## A. FA-1 shape: B={plan.a_batch}, H={plan.a_heads}, D={plan.a_dim}, "
                  f"{'fp16' if not plan.smoke else plan.a_dtype + ' (float32 on CPU)'}, non-causal", "",
              "### Forward+backward time, ms (median)", ""]
    keys = list(res["a"])
    head = ["series"] + [f"N={n}" for n in ns]
    lines += table(head, [[k] + [cell(res["a"][k].get(str(n)) and {"seq_len": n, **res["a"][k][str(n)]},
                                      lambda r: fmt_ms(r["fwd_bwd_ms"])) for n in ns] for k in keys])
    lines += ["", "### Peak memory of forward+backward, MiB (extra over the inputs)", ""]
    lines += table(head, [[k] + [cell(res["a"][k].get(str(n)) and {"seq_len": n, **res["a"][k][str(n)]},
                                      lambda r: fmt_mib(r["peak_mem_bytes"])) for n in ns] for k in keys])
    lines += ["", "### OOM frontier: the largest N that ran, and what stopped the next", ""]
    lines += table(["series", "largest ok N", "next N", "status", "reason"],
                   [[k, str(f["largest_ok"] or "-"), str(f["first_failing"] or "-"), f["status"] or "-",
                     (f["reason"] or "-")[:160]] for k, f in res["frontier"].items()], right_from=99)

    lines += ["", "## B. full math peak memory against FA-1 Table 21", "",
              "Measured = the harness's peak over the inputs + the inputs (q, k, v, dout); formula = "
              "4·B·H·N²·2 + 10·B·H·N·D·2 bytes.", ""]
    lines += table(["N", "status", "measured MiB", "formula MiB", "ratio"],
                   [[str(m["seq_len"]), m["status"], fmt_mib(m["measured_bytes"]), fmt_mib(m["formula_bytes"]),
                     fmt_ratio(m["ratio"])] for m in res["math_memory"]])

    roof = res["roof"] or {}
    lines += ["", f"## C. FA-2/FA-3 shape: {plan.c_tokens} tokens per batch, hidden {plan.c_hidden}, "
                  f"{'bf16' if not plan.smoke else plan.c_dtype + ' (float32 on CPU)'}", ""]
    if roof.get("status") == "ok":
        lines += [f"Matmul roof ({roof['size']}³, {roof['timer']}): bf16 {fmt_tf(roof['tflops']['bfloat16'])} TFLOP/s, "
                  f"fp16 {fmt_tf(roof['tflops']['float16'])} TFLOP/s.", ""]
    else:
        lines += [f"Matmul roof: {roof.get('status', 'not measured')}.", ""]
    cns = plan.c_seq_lens
    for metric, title in (("tflops_fwd", "forward"), ("tflops_fwd_bwd", "forward+backward")):
        lines += [f"### TFLOP/s, {title} (FLOPs: 4·B·H·N²·D forward, causal counts allowed pairs; backward 2.5x)", ""]
        lines += table(["series"] + [f"N={n}" for n in cns],
                       [[k] + [cell(res["c"][k].get(str(n)), lambda r, m=metric: fmt_tf(r[m])) for n in cns]
                        for k in res["c"]])
        lines += [""]

    lines += ["## D. Against the best public kernels, exponents, overhead", "",
              "Forward+backward ms at the FA-1 shape, ours = the variant's best backend through the harness "
              "(every backend but `dense`), public = the best kernel that runs here for the same pattern; speed "
              "ratio = public ms / ours ms (>= 0.9 is the target).", ""]
    lines += table(["variant", "N", "ours (backend)", "ours ms", "best public", "public ms", "speed ratio"],
                   [[r["label"] + ("" if r["is_target"] else " (information)"), str(r["seq_len"]),
                     r["ours_backend"] or "-", fmt_ms(r["ours_ms"]), r["public_name"] or "-", fmt_ms(r["public_ms"]),
                     fmt_ratio(r["speed_ratio"])] for r in res["compare"]], right_from=99)
    lines += ["", "Every kernel timed:", ""]
    lines += table(["variant", "N", "kind", "kernel", "status", "ms", "note"],
                   [[r["label"], str(r["seq_len"]), r["kind"], r["name"], r["status"], fmt_ms(r["fwd_bwd_ms"]),
                     (r["reason"] or "-")[:160]] for r in res["compare_rows"]], right_from=99)
    lo, hi = plan.exponent_range
    lines += ["", f"### Forward+backward time exponents over N={lo}..{hi} (log-log least squares, ok points)", ""]
    lines += table(["series", "fitted", "theory", "N"],
                   [[k, f"{f['fitted']:.3f}", f"{f['theory']:.3f}", ",".join(map(str, f["seq_lens"]))]
                    for k, f in res["exponents"].items()])
    ov = res["overhead"]
    lines += ["", "### Harness overhead against raw do_bench", ""]
    if ov and ov.get("cases"):
        lines += table(["case", "pass", "harness ms", "raw ms (before/after)", "overhead"],
                       [[f"{c['label']} {c['backend']}", pas, fmt_ms(c[pas]["harness_ms"]),
                         f"{fmt_ms(c[pas]['raw_ms_before'])} / {fmt_ms(c[pas]['raw_ms_after'])}",
                         "-" if c[pas]["overhead"] is None else f"{c[pas]['overhead'] * 100:+.2f}%"]
                        for c in ov["cases"] if c["status"] == "ok" for pas in ("fwd", "fwd_bwd")])
    else:
        lines += [f"{(ov or {}).get('status', 'not measured')}"]

    bad = [(part, k, n, r) for part in ("a", "c") for k, rows in res[part].items() for n, r in rows.items()
           if r["status"] == "error"]
    if bad:
        lines += ["", "## Errors", ""]
        lines += [f"- {part} {k} N={n}: {r['reason']}" for part, k, n, r in bad]
    lines += ["", "Plots: `a_time.png`, `a_memory.png` (log-log against N, one panel per variant), `c_tflops.png`.", ""]
    return "\n".join(lines)


def plots(out: Path, res: dict, plan: Plan) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    labels = list(dict.fromkeys(k.split("__")[0] for k in res["a"]))
    for metric, fname, ylabel, scale in (("fwd_bwd_ms", "a_time.png", "forward+backward ms", 1.0),
                                         ("peak_mem_bytes", "a_memory.png", "peak memory MiB (over inputs)", 1 / MiB)):
        if not labels:
            break
        cols = min(4, len(labels))
        rows = -(-len(labels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
        for ax, label in zip(axes.flat, labels):
            for key, pts in res["a"].items():
                if key.split("__")[0] != label:
                    continue
                xy = [(int(n), r[metric] * scale) for n, r in pts.items() if r["status"] == "ok" and r[metric]]
                if xy:
                    ax.plot(*zip(*sorted(xy)), marker="o", ms=3, label=key.split("__")[1])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("N", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(labels):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=90)
        plt.close(fig)
        made.append(fname)
    groups = list(dict.fromkeys(k.split("__")[0] for k in res["c"]))
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False)
        roof = res["roof"] or {}
        for ax, g in zip(axes.flat, groups):
            for key, pts in res["c"].items():
                if key.split("__")[0] != g:
                    continue
                xy = [(int(n), r["tflops_fwd"]) for n, r in pts.items() if r["status"] == "ok" and r["tflops_fwd"]]
                if xy:
                    ax.plot(*zip(*sorted(xy)), marker="o", ms=3, label=key.split("__")[1])
            if roof.get("status") == "ok":
                ax.axhline(roof["tflops"]["bfloat16"], color="k", ls="--", lw=1, label="bf16 matmul roof")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{g}: forward TFLOP/s", fontsize=9)
            ax.set_xlabel("N", fontsize=8)
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "c_tflops.png", dpi=90)
        plt.close(fig)
        made.append("c_tflops.png")
    return made


def load_state(out: Path) -> dict:
    path = out / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"parts": {}}


def summarize(out: Path, plan: Plan, device_type: str) -> dict:
    res = analyse(out, plan, device_type)
    state = load_state(out)
    res["plots"] = plots(out, res, plan)
    (out / "SUMMARY.md").write_text(summary_md(out, plan, res, state))
    write_json(out / "summary.json", {"smoke": plan.smoke, "plan": dataclasses.asdict(plan), "state": state,
                                      "env": env_block(out), **res})
    return res


# ----- command line --------------------------------------------------------------------------------


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_out(device: torch.device, smoke: bool) -> Path:
    if smoke:
        return ROOT / "outputs" / "bench_gpu_smoke"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return ROOT / "results" / "gpu" / f"{date}-{device_slug(device)}"


def resume_out(device: torch.device) -> Path:
    """The newest results/gpu/*-<device> directory with an incomplete part, else a new default one."""
    slug = device_slug(device)
    for d in sorted((ROOT / "results" / "gpu").glob(f"*-{slug}"), reverse=True):
        st = load_state(d)
        if not all(st["parts"].get(p, {}).get("complete") for p in PARTS):
            return d
    return default_out(device, False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="output directory (default results/gpu/<UTC date>-<device>)")
    ap.add_argument("--parts", default="a,b,c,d",
                    help="comma-separated subset of a,b,c,d, measured in the order given (gpu_job.sh: c,d,a,b)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, float32 on CPU: proves the script end to end")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for this invocation (checked between points; default: each part's own budget)")
    ap.add_argument("--point-cap-s", type=float, default=60.0,
                    help="skip a point whose projected time exceeds this (and the longer N of its series)")
    ap.add_argument("--min-run-time", type=float, default=None, help="override the plan's seconds per timed pass")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 with --smoke on CPU, where tiny ops contend for a shared "
                         "machine's cores, else torch's default)")
    ap.add_argument("--only", default=None,
                    help="parts a and c: measure only the series whose key matches this glob (e.g. 'full__*')")
    ap.add_argument("--compare-seq-lens", type=int, nargs="+", default=None,
                    help="part d: the N of the comparisons with public kernels (default 16384; smoke 256)")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite SUMMARY.md, summary.json and plots")
    ap.add_argument("--print-out-dir", action="store_true",
                    help="print the directory a resumed job should use (newest incomplete for this device) and exit")
    ap.add_argument("--pending", action="store_true", help="print the parts of --parts not complete in --out and exit")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.print_out_dir:
        print(args.out or resume_out(device))
        return 0
    plan = SMOKE_PLAN if args.smoke else FULL_PLAN
    if args.compare_seq_lens:
        plan = dataclasses.replace(plan, compare_seq_lens=tuple(args.compare_seq_lens))
    out = (args.out or default_out(device, args.smoke)).resolve()
    parts = list(dict.fromkeys(p for p in args.parts.split(",") if p in PARTS))  # in the order given
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        print(f"bench_gpu.py: unknown part(s) {', '.join(sorted(unknown))}; allowed: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.pending:
        st = load_state(out)
        print(" ".join(p for p in parts if not st["parts"].get(p, {}).get("complete")))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if args.summary_only:
        envs = env_block(out)
        dev_type = envs[-1]["device_type"] if envs else device.type
        summarize(out, plan, dev_type)
        print(f"rewrote {out / 'SUMMARY.md'}")
        return 0

    threads = args.threads or (1 if args.smoke and device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    record_invocation(out, device, parts, args.smoke)

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"bench_gpu: parts {','.join(parts)} on {device} ({device_slug(device)}) -> {out}")
    ctx = Context(plan, out, device, args.point_cap_s, args.min_run_time, args.only)
    total = Budget(args.budget_s)
    state = load_state(out)
    funcs = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
    try:
        for p in parts:
            if state["parts"].get(p, {}).get("complete"):
                log(f"[{p}] complete in {out}: nothing to measure")
                continue
            cap = plan.budgets_s[p] if args.budget_s is None else min(plan.budgets_s[p], max(0.0, total.left()))
            started = time.monotonic()
            result = funcs[p](ctx, Budget(cap), log)
            result.update(updated=now(), seconds=round(time.monotonic() - started, 1))
            state["parts"][p] = result
            write_json(out / "state.json", state)
            log(f"[{p}] {'complete' if result['complete'] else 'incomplete'} in {result['seconds']} s"
                + ("" if result["complete"] else f" ({result['not_reached']} points not reached: run again to continue)"))
    finally:
        ctx.close()
    res = summarize(out, plan, device.type)
    log("")
    for t in res["targets"]:
        log(f"target {t['id']}: {t['status']} - {t['detail']}" + (f" - gap: {t['gap']}" if t["gap"] else ""))
    log(f"wrote {out / 'SUMMARY.md'}, summary.json, {', '.join(res['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
