"""What a harness sweep cannot measure, for scripts/bench_gpu.py (each a step run in a process of its own,
``ctx`` its Context): the matmul roof (roof.json), the public kernels of part d's patterns beside our flex
backend called bare (d/compare.jsonl) and the harness's timing against raw do_bench of the same callable
(d/overhead.json). On CPU (the dry run) what needs CUDA is recorded skipped, with the reason.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import torch

from bench_gpu_summary import COMPARED, OURS_BARE, OVERHEAD_CASES, case_disturbed, d_done, job_file, side_rows
from harness.config import one_line
from harness.env import now
from harness.job import BUDGET_SPENT
from harness.report.markdown import cell
from harness.results import write_json

if TYPE_CHECKING:
    from bench_gpu import Context

NEEDS_CUDA = "skipped: needs CUDA"
OVERHEAD_RUNS = 3  # harness runs per case, each between two raw timings: the median is judged


def part_roof(ctx: Context) -> int:
    """The device's matmul rate: an n×n×n torch.matmul of fresh randn, median of do_bench; a roof.json
    measured before is kept."""
    if ctx.skips_cuda:
        write_json(ctx.out / "roof.json", {"status": NEEDS_CUDA})
        return 0
    if (job_file(ctx.out / "roof.json") or {}).get("status") == "ok":
        # measured: kept, not replaced (the step runs again where state.json lost its outcome)
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


# ----- d: the harness's overhead and the public kernels ----------------------------------------

class Unavailable(Exception):
    """A public kernel that cannot run here (reason: one line)."""


class Call(NamedTuple):
    """A kernel's forward+backward (``run``), what clears its input gradients before each (``before``: timed
    as the harness times a point, harness.measure.time_fn, the clearing outside the CUDA events) and the
    seconds its set-up took (a BlockMask, our backend's prepare), reported apart from the kernel's time."""
    run: Callable[[], None]
    before: Callable[[], None]
    setup_s: float | None = None


def qkv_dout(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (each requiring its gradient) and dout: fresh randn of ``shape``."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def fwd_bwd_call(f: Callable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 setup_s: float | None = None) -> Call:
    """A forward+backward call of ``f`` on fresh randn inputs already in the kernel's own layout."""
    q, k, v, dout = qkv_dout(shape, dtype, device, seed=1)

    def before() -> None:
        q.grad = k.grad = v.grad = None
    return Call(lambda: f(q, k, v).backward(dout), before, setup_s)


def public_specs(label: str, attn, B: int, N: int, device: torch.device) -> dict[str, tuple[str, Any]]:
    """The best public kernels for a variant's pattern, as what defines the pairs each one computes: name ->
    ("xformers", attn_bias module -> bias over (N, N), None: no mask), ("xformers_flat", ... -> bias over the
    batch's B·N rows flattened), ("flex", factory of a mask_mod), ("sdpa", the SDPBackend it is pinned to on
    CUDA: no mask) or ("sdpa_blocks", block size). tests/test_bench_gpu.py
    materializes each on CPU against the variant's mask: a ratio between two different functions would
    mean nothing."""
    if label == "sliding_window":
        w = attn.options.window
        return {f"xformers LocalAttentionFromBottomRightMask({w}, {w})":
                ("xformers", lambda ab: ab.LocalAttentionFromBottomRightMask(window_left=w, window_right=w)),
                f"FlexAttention mask_mod |q-kv| <= {w}": ("flex", lambda: (lambda b, h, q, kv: (q - kv).abs() <= w))}
    if label == "blockwise-exact":  # full attention's function: torch's fused kernels, each pinned, and the others
        from torch.nn.attention.flex_attention import noop_mask

        from variants.full import SDPA_KERNELS

        specs = ({f"SDPA {name.removeprefix('sdpa_')} (no mask)": ("sdpa", kernel) for name, kernel in SDPA_KERNELS.items()
                  if name != "sdpa_math"} if device.type == "cuda" else {"SDPA (no mask)": ("sdpa", None)})
        return {**specs, "xformers memory_efficient_attention (no bias)": ("xformers", lambda ab: None),
                "FlexAttention, no mask_mod": ("flex", lambda: noop_mask)}
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
                   device: torch.device) -> dict[str, tuple[str, Callable[[], Call]]]:
    """public_specs as builders of a forward+backward call, each on inputs in the kernel's own layout:
    name -> (kind, build)."""
    from torch.nn.attention import SDPBackend

    cuda, scale = device.type == "cuda", D ** -0.5
    no_flex_backward = f"{NEEDS_CUDA} (FlexAttention has no backward on CPU)"

    def xformers(bias_fn, flat: bool = False) -> Call:
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

    def flex(mask_mod) -> Call:
        if not cuda:
            raise Unavailable(no_flex_backward)
        from torch.nn.attention.flex_attention import create_block_mask

        from variants.flex import compiled_flex_attention

        start = time.perf_counter()
        bm = create_block_mask(mask_mod(), None, None, N, N, device=device, BLOCK_SIZE=128)
        torch.cuda.synchronize()
        setup_s = time.perf_counter() - start
        fn = compiled_flex_attention()
        return fwd_bwd_call(lambda q, k, v: fn(q, k, v, block_mask=bm, scale=scale), (B, H, N, D), dtype, device,
                            setup_s)

    def sdpa(kernel, b: int | None = None) -> Call:
        """SDPA pinned to ``kernel`` on CUDA (torch's own choice on CPU), over the whole sequence or, with
        ``b``, over (B·N/b, H, b, D) blocks."""
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        def f(q, k, v):
            with sdpa_kernel([kernel]) if cuda else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
        return fwd_bwd_call(f, (B, H, N, D) if b is None else (B * N // b, H, b, D), dtype, device)

    def ours_bare() -> Call:
        if not cuda:
            raise Unavailable(no_flex_backward)
        import variants

        mine = variants.build(attn.name, **{**asdict(attn.options), "backend": "flex"})
        start = time.perf_counter()
        mine.prepare(N, False, device)
        torch.cuda.synchronize()
        return fwd_bwd_call(mine, (B, H, N, D), dtype, device, time.perf_counter() - start)

    builders = {"xformers": xformers, "xformers_flat": partial(xformers, flat=True), "flex": flex, "sdpa": sdpa,
                "sdpa_blocks": partial(sdpa, SDPBackend.FLASH_ATTENTION)}
    kernels = {name: (kind, partial(builders[kind], what))
               for name, (kind, what) in public_specs(label, attn, B, N, device).items()}
    if "flex" in attn.backend_names():  # not a public kernel: it tells where a gap to FlexAttention lies
        kernels[OURS_BARE] = ("flex", ours_bare)
    return kernels


def timed(ctx: Context, build: Callable[[], Call]) -> dict[str, Any]:
    """Builds a call, times its first call apart (compilation, plans) and then its median with the
    harness's own timer (do_bench on GPU)."""
    from harness.config import MeasureOptions
    from harness.measure import synchronize, time_fn
    from harness.memory import device_lost, release_memory

    row: dict[str, Any] = {"status": "ok", "reason": None}
    try:
        call = build()
        start = time.perf_counter()
        call.before()
        call.run()
        synchronize(ctx.device)
        row.update(first_call_s=time.perf_counter() - start, block_mask_s=call.setup_s)
        t = time_fn(call.run, ctx.device, MeasureOptions(min_run_time=0.01 if ctx.plan.smoke else 0.1, min_samples=2),
                    before=call.before)
        row.update(fwd_bwd_ms=t.median_ms, fwd_bwd_iqr_ms=t.iqr_ms)
        if not ctx.skips_cuda:  # the state the kernel ran in: a throttled clock is a slower kernel
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


def public_list(ctx: Context) -> list[tuple[str, str, bool, Callable[[], Call]]]:
    """(label, name, compiled, build) of every kernel d:public times (the public ones, and ours bare), in the
    order it times them: those compiled per call shape (FlexAttention) after every one that is not, so that
    a call cut short by its budget has not spent it compiling."""
    (B, H, D), N, dtype = ctx.plan.shape, ctx.plan.compare_seq_len, getattr(torch, ctx.dtype)
    kernels = [(label, name, kind == "flex", build) for label in COMPARED if label in ctx.labels
               for name, (kind, build) in public_kernels(label, ctx.build(label), B, H, N, D, dtype, ctx.device).items()]
    return sorted(kernels, key=lambda k: k[2])  # stable: COMPARED's order otherwise


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
        ctx.log(f"[d:public] {label} N={row['seq_len']} {name}: {row['status']} {cell(row.get('fwd_bwd_ms'))} ms"
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

    from harness.measure import with_before

    def cpu(fn: Callable[[], Any], rep: int, grads: list[torch.Tensor]) -> float:
        call = with_before(fn, lambda: [setattr(t, "grad", None) for t in grads])
        timer = benchmark.Timer("call()", globals={"call": call}, num_threads=torch.get_num_threads())  # its default: 1
        return timer.blocked_autorange(min_run_time=rep / 1e3).median * 1e3
    return cpu


def last_judged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A case's passes as overhead.json keeps them: the last round judged, the ones before it beside."""
    return {**rounds[-1], **({"earlier_rounds": rounds[:-1]} if len(rounds) > 1 else {})}


def part_overhead(ctx: Context) -> int:
    """The harness's fwd and fwd_bwd medians against raw do_bench of the same callable and shape,
    interleaved: raw, harness, raw, ... (OVERHEAD_RUNS harness runs, each between two raw timings). The
    overhead is the median harness run over the median raw timing: one run disturbed (the +13.6% the
    H100 showed once, the other five cases within 0.83%) neither passes nor fails the target alone. A
    round whose raw timings are disturbed (bench_gpu_summary.disturbed) is measured again, up to
    plan.overhead_rounds rounds, the earlier ones kept (earlier_rounds); a case judged in an earlier call
    is kept as it is. On CPU the cases whose backend runs there, against torch.utils.benchmark: the dry
    run's check of the path, no target."""
    import variants

    from harness.memory import release_memory
    from harness.run import RunInterrupted, run
    from harness.signals import Terminated

    (ctx.out / "d").mkdir(parents=True, exist_ok=True)
    (B, H, D), N, rep = ctx.plan.shape, ctx.plan.overhead_seq_len, 100
    dtype, raw_ms = ctx.dtype, raw_timer(ctx.device)
    earlier_file = job_file(ctx.out / "d" / "overhead.json") or {}
    before = {(c["variant"], c["backend"]): c for c in earlier_file.get("cases", [])}
    # A case measured when OVERHEAD_CASES listed it, and no longer: kept apart, in no target
    retired = earlier_file.get("retired_cases", []) + [c for key, c in before.items() if key not in OVERHEAD_CASES]
    cases: list[dict[str, Any]] = []
    timer = "blocked_autorange" if ctx.skips_cuda else "do_bench"

    def save() -> None:
        """overhead.json: the cases this call has reached, then the earlier ones it has not (yet)."""
        reached = {(c["variant"], c["backend"]) for c in cases}
        rest = [before[key] for key in OVERHEAD_CASES if key in before and key not in reached]
        write_json(ctx.out / "d" / "overhead.json", {"status": "ok", "timer": f"{timer}(median, rep={rep} ms)",
                                                     "cases": cases + rest, "date": now(),
                                                     **({"retired_cases": retired} if retired else {})})
    for variant, backend in OVERHEAD_CASES:
        earlier = before.get((variant, backend), {})
        if earlier.get("status") == "ok" and not case_disturbed(earlier):
            cases.append(earlier)  # judged: never measured twice
            continue
        case: dict[str, Any] = {"variant": variant, "backend": backend, "seq_len": N, "status": "ok"}
        # the rounds measured so far, the judged one last: an earlier call's (a case that ended in an error
        # kept the rounds it had measured), then this call's
        rounds = [*earlier.get("earlier_rounds", []),
                  *([{p: earlier[p] for p in ("fwd", "fwd_bwd")}] if earlier.get("status") == "ok" else [])]
        kept = len(rounds)
        try:
            # The same work as the harness's: no gradients for the variant's own parameters (linear's E, F;
            # measure.param_grads is off), input gradients cleared before every call.
            attn = variants.build(variant, backend=backend).requires_grad_(False)
            if (reason := attn.unavailable(backend, ctx.device)) is not None:
                raise Unavailable(NEEDS_CUDA if ctx.skips_cuda else f"skipped: {reason}")
            attn = attn.to(ctx.device)
            q, k, v, dout = qkv_dout((B, H, N, D), getattr(torch, dtype), ctx.device, seed=0)
            calls = {"fwd": lambda: attn(q, k, v), "fwd_bwd": lambda: attn(q, k, v).backward(dout)}
            calls["fwd_bwd"]()

            def raw_times() -> dict[str, float]:
                return {p: raw_ms(c, rep, [q, k, v]) for p, c in calls.items()}
            cfg = {"variant": {"_target_": type(attn).__module__.split(".")[0] + "." + type(attn).__name__,
                               "backend": backend},
                   "seq_lens": [N], "batch_size": B, "num_heads": H, "head_dim": D, "dtype": dtype,
                   "device": ctx.device.type, "fidelity": {"enabled": False}, "logger": {"name": "none"},
                   "measure": {"passes": ["fwd", "fwd_bwd"], "memory": False, "min_run_time": rep / 1e3},
                   # measured now, between the raw timings: a row an interrupted earlier call stored (maybe
                   # on another machine) would be compared with this call's raw numbers
                   "resume": False}
            for left in range(ctx.plan.overhead_rounds - 1, -1, -1):
                # round 0's runs in run-<i>, as before rounds; a later round's in round-<r>/run-<i>
                where = ctx.out / "d" / "overhead" / variant / (f"round-{len(rounds)}" if rounds else "")
                raw, runs = [raw_times()], []
                for i in range(OVERHEAD_RUNS):
                    runs.append(run(cfg, output_dir=where / f"run-{i}").rows[-1].record())
                    raw.append(raw_times())
                measured = {}
                for p in calls:
                    harness = [r[f"{p}_ms"] for r in runs]
                    mid = None if None in harness else float(np.median(harness))
                    measured[p] = {"harness_ms": mid, "harness_runs_ms": harness,
                                   "harness_iqr_ms": [r[f"{p}_iqr_ms"] for r in runs], "raw_ms": [r[p] for r in raw],
                                   "overhead": None if mid is None else mid / float(np.median([r[p] for r in raw])) - 1}
                rounds.append(measured)
                if not case_disturbed({"status": "ok", **measured}) or not left:
                    break
                raws = ", ".join(f"{p} {measured[p]['raw_ms']}" for p in calls)
                ctx.log(f"[d:overhead] {variant}/{backend}: raw timings disturbed ({raws} ms): measuring again")
            case.update(last_judged(rounds))
        except Unavailable as e:
            case.update(status="skipped", reason=str(e))
        except Exception as e:
            case.update(status="error", reason=one_line(f"{type(e).__name__}: {e}")[:300],
                        **({"earlier_rounds": rounds} if rounds else {}))
        except (KeyboardInterrupt, RunInterrupted) as e:
            # A spent budget's SIGTERM or a Ctrl-C (inside a harness run, its RunInterrupted): the rounds
            # this call measured are kept as a call ending there keeps them (the last one judged; still
            # disturbed, it is measured again), with every case reached and the earlier ones not; the
            # process then ends as interrupted, in its one line
            if len(rounds) > kept:
                cases.append({**case, **last_judged(rounds)})
            save()
            if isinstance(e, RunInterrupted):
                raise (Terminated() if e.exit_code == Terminated.EXIT_CODE else KeyboardInterrupt()) from None
            raise
        release_memory(ctx.device)
        cases.append(case)
        ctx.log(f"[d:overhead] {variant}/{backend}: {case}")
        save()  # each case as it ends: a crash later in this process (a lost CUDA context) loses none of it
    return 0
