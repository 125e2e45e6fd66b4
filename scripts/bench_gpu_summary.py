"""The GPU benchmark's targets and SUMMARY.md, judged from the files of its results directory alone (rows
read through harness.results): scripts/bench_gpu.py writes them after every invocation, and
`bench_gpu.py --summary-only --out DIR` again on any machine. ``ctx`` is bench_gpu.py's Context: the
directory, the plan's sizes, the labels chosen and what the measuring device has (its backends, the public
kernels part d times).

A target is met | missed (with the gap) | not measured (its measurements are not all there yet, or disturbed: judged on
complete ones only, never on the first ones timed) | skipped (needs CUDA, on the CPU dry run).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from harness.job import job_file as read_job_file
from harness.job import repository_relative
from harness.report.markdown import cell as fmt
from harness.report.markdown import table
from harness.results import (InputError, fit_exponents, latest, load_rows, noisy_passes, read_jsonl,
                             untrusted, write_json)

if TYPE_CHECKING:
    from bench_gpu import Context

MiB = 2**20
N2_BACKENDS = {"dense", "math", "sdpa_math"}  # full's math and sdpa_math, any variant's dense: N×N in memory
TABLE21 = ("full", "math")  # the path FA-1 Table 21's target reads: the only N×N series a target needs
# Part d's patterns (bench_gpu.VARIANTS' labels): the efficient variants a public kernel computes exactly
# (blockwise exact computes full attention's function, as FlashAttention's and cuDNN's kernels do)
COMPARED = ("sliding_window", "blockwise-local", "sparse-fixed", "sparse-strided", "sparse-bigbird", "blockwise-exact")
NOT_COMPARED = ("linear, reformer and adaptive_span are not compared: no public GPU kernel computes their function. "
                "Linformer's public code projects K and V, then attends in eager torch (our `sdpa` backend runs the "
                "projections, then SDPA's fused kernel); the Reformer's and adaptive span's public code is eager torch "
                "(adaptive_span's `flex` backend is FlexAttention with the span as its score_mod).")
EXPONENT_TARGETS = ("sliding_window", "linear", "reformer", "adaptive_span")
# Our flex backend called bare, in the public kernels' process, beside them (kind "ours-bare", in no target):
# against the public FlexAttention it measures our mask_mod; against our harness row, the harness run.
OURS_BARE = "ours flex, called bare"
PUBLISHED = ("FA-3 on H100: up to 740 TFLOP/s fp16 forward, at its best head dimension (75% of the 989 TFLOP/s "
             "datasheet peak); FA-2 on H100 about 335-370 TFLOP/s forward (both papers' 16K-token, hidden-2048 "
             "benchmark)")


def n2(variant: str, backend: str) -> bool:
    """Whether a backend holds N×N tensors (linear's math is O(N·k): not one of them)."""
    return backend == "dense" or (variant == "full" and backend in N2_BACKENDS)


def rows_of(path: Path) -> list[dict[str, Any]]:
    try:
        return latest(load_rows(path)) if path.exists() else []
    except InputError:  # nothing measured there yet
        return []


def side_rows(path: Path) -> list[dict[str, Any]]:
    """The whole rows of one of the benchmark's own .jsonl files (compare.jsonl: a kernel's row, each with
    label, name and status; tests-gpu.jsonl: a test's outcome); a line cut by a kill is left out, and so is
    an object without those keys (one nested in a cut row)."""
    keys = ("test", "outcome") if path.name.startswith("tests-gpu") else ("label", "name", "status")

    def check(r: Any) -> str | None:
        return None if isinstance(r, dict) and all(k in r for k in keys) else f"not a row with {', '.join(keys)}"
    return read_jsonl(path, check=check) if path.exists() else []


def d_done(rows: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """The (label, name) of the kernels d:public has done with: measured, or skipped/unavailable for a
    reason; an error is tried once more on a later call (a transient failure should not stand), then
    kept too."""
    tries: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        tries.setdefault((r["label"], r["name"]), []).append(r["status"])
    return {key for key, st in tries.items() if st[-1] != "error" or len(st) >= 2}


def target(name: str, text: str, value: float | None, ok: Callable[[float], bool], detail: str,
           skip: bool, gap: Callable[[float], str]) -> dict[str, Any]:
    """A target judged from ``value``: met | missed (with the gap) | not measured | skipped (``skip``:
    it needs CUDA and this is not a CUDA run)."""
    status = "skipped (needs CUDA)" if skip else "not measured" if value is None else "met" if ok(value) else "missed"
    return {"target": name, "text": text, "status": status, "value": value, "detail": detail,
            "gap": gap(value) if status == "missed" else None}


def not_yet(wanted: list[str], have: set[str]) -> str:
    """"not yet measured: ..." for what a target waits for (``wanted`` not in ``have``), else ""."""
    missing = [w for w in wanted if w not in have]
    return f"not yet measured: {', '.join(missing)}" if missing else ""


def analyse(ctx: Context) -> dict[str, Any]:
    """Every number SUMMARY.md states, from the files in ``out``, and the targets judged on them."""
    a, c = rows_of(ctx.out / "a"), rows_of(ctx.out / "c")
    roof = job_file(ctx.out / "roof.json") or {}
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

    math_path, points = variants.build("full", backend="math"), []
    for r in sorted((r for r in a if r["variant"] == "full" and r["backend"] == "math" and r["peak_mem_bytes"]),
                    key=lambda r: r["seq_len"]):
        B, H, N, D = r["batch_size"], r["num_heads"], r["seq_len"], r["head_dim"]
        elt = torch.empty((), dtype=getattr(torch, r["dtype"])).element_size()
        inputs = 4 * B * H * N * D * elt
        measured = r["peak_mem_bytes"] + inputs
        formula = (4 * N * N + 10 * N * D) * B * H * 2
        own = math_path.memory_bytes(B, H, N, D, elt, r["causal"], r["device"]) + inputs
        points.append({"seq_len": N, "measured_mib": measured / MiB, "formula_mib": formula / MiB,
                       "ratio": measured / formula, "own_mib": own / MiB, "own_ratio": measured / own,
                       "elements_per_head": measured / (B * H * elt), "head_dim": D})
    res["table21"] = points
    # What the measurements say the peak holds: a·N² + c·N·D elements per (b, h), least squares over every N
    fit = res["table21_fit"] = table21_fit(points)
    held = (f"measured = {fit['n2']:.2f}·N² + {fit['nd']:.2f}·N·D elements per (b, h) (fitted over every N)" if fit
            else "no fit (one length measured)")
    within = [m["seq_len"] for m in points if abs(m["ratio"] - 1) <= 0.02]
    formula_gap = f", the formula 4·N² + 10·N·D: {'within 2% at N=' + ', '.join(map(str, within)) if within else 'within 2% at no N'}"
    for name, key, text, more in (
            ("table21", "ratio", "full math peak memory = FA-1 Table 21's 4·B·H·N²·2 + 10·B·H·N·D·2 bytes within 2%",
             formula_gap),
            ("math_exact", "own_ratio", "full math peak memory = its own count, (s·N² + 6·N·D)·B·H elements with the "
                                        "inputs (s = 3 on CPU, 4 on CUDA), within 2%", "")):
        worst = max(points, key=lambda m: abs(m[key] - 1), default=None)
        res["targets"].append(target(
            name, text, worst and worst[key], lambda v: abs(v - 1) <= 0.02,
            ", ".join(f"N={m['seq_len']}: {m[key]:.4f}" for m in points), ctx.skips_cuda,
            lambda v: f"worst N={worst['seq_len']}: {(v - 1) * 100:+.1f}%; {held}{more}"))


def roof_target(ctx: Context, c: list[dict[str, Any]], res: dict[str, Any]) -> None:
    """Full's best forward TFLOP/s at the roof target's point against the bf16 matmul roof, and every full
    backend's TFLOP/s at the FA-2/FA-3 shape's longest N."""
    n, d = ctx.plan.roof_target
    fwd = [(r["backend"], r["tflops_fwd"]) for r in c if r["seq_len"] == n and r["head_dim"] == d
           and not r["causal"] and r["tflops_fwd"] and r["status"] == "ok" and not untrusted(r, "tflops_fwd")]
    best = max(fwd, key=lambda x: x[1], default=None)
    rate = (res["roof"].get("tflops") or {}).get("bfloat16")
    share = best[1] / rate if best and rate else None
    # Judged once every full backend has its row there (measured or not): not on the first ones timed
    waiting = not_yet(ctx.backends("full"),
                      {r["backend"] for r in c if (r["seq_len"], r["head_dim"], r["causal"]) == (n, d, False)})
    res["targets"].append(target(
        "full_roof", f"full's best backend >= 60% of the bf16 matmul roof, forward, N={n}, D={d}, non-causal",
        None if waiting else share, lambda v: v >= 0.6,
        "; ".join(filter(None, [best and f"{best[0]} {best[1]:.1f} TFLOP/s vs roof {fmt(rate)}", waiting])),
        ctx.skips_cuda,
        lambda v: f"{(0.6 - v) * rate:.1f} TFLOP/s short of 60% ({v:.1%} of the roof)"))
    # Useful TFLOP/s (FA-2's convention: causal counts half the pairs; the math paths compute all of them)
    res["fa2"] = [{"backend": r["backend"], "head_dim": r["head_dim"], "causal": r["causal"], "status": r["status"],
                   "noisy": noisy_passes(r), **{p: r.get(f"tflops_{p}_useful") for p in ("fwd", "bwd", "fwd_bwd")},
                   "fwd_share": r["tflops_fwd_useful"] / rate if rate and r.get("tflops_fwd_useful") else None}
                  for r in sorted((r for r in c if r["seq_len"] == n),
                                  key=lambda r: (r["head_dim"], r["causal"], -(r.get("tflops_fwd_useful") or 0)))]


def compare_targets(ctx: Context, res: dict[str, Any]) -> None:
    """Part d: our backends' rows (harness sweeps, d/<label>/) against the public kernels' (compare.jsonl;
    the first layout of part d timed ours there too, as rows of kind "ours")."""
    res["compare"], res["compare_rows"] = [], []
    compare = side_rows(ctx.out / "d" / "compare.jsonl")
    done = {n for _, n in d_done(compare)}
    for label in (label for label in COMPARED if label in ctx.labels):
        rows = [{"label": label, "kind": "ours", "name": f"ours {r['backend']}", "status": r["status"],
                 "fwd_bwd_ms": r["fwd_bwd_ms"], "first_call_s": r["warmup_s"], "block_mask_s": r.get("setup_s"),
                 "reason": r["reason"] or r.get("noise_reasons"), "noisy": untrusted(r, "fwd_bwd_ms")}
                for r in rows_of(ctx.out / "d" / label)]
        rows += [r for r in compare if r["label"] == label]
        res["compare_rows"] += rows
        # Judged once each of the pattern's backends has its row (ok or not) and each public kernel is done,
        # not on the first ones timed; a row of ours whose forward+backward is noisy is not judged (the
        # one rule of harness.results: fits and compare leave it out too)
        waiting = not_yet([f"ours {b}" for b in ctx.compared_backends(label)] + ctx.public_names(label),
                          done | {r["name"] for r in rows})
        noisy = [r["name"] for r in rows if r["status"] == "ok" and r.get("noisy")]
        ok = [r for r in rows if r["status"] == "ok" and r["fwd_bwd_ms"] and not r.get("noisy")]

        def best(kind: str, but: tuple[str, ...] = ()) -> dict[str, Any] | None:
            return min((r for r in ok if r["kind"] == kind and r["name"] not in but), key=lambda r: r["fwd_bwd_ms"],
                       default=None)
        # The target is the issue's: our best backend. Our xformers and flex backends call the public
        # kernels themselves (same mask; ours built from the variant's predicate), so where one of them is
        # best the ratio measures our wrapper and mask_mod; the engine's ratio (variants/blocksparse.py,
        # our own kernel) is stated beside it.
        ours, pub, own = best("ours"), best("public"), best("ours", but=("ours xformers", "ours flex"))
        ratio = pub["fwd_bwd_ms"] / ours["fwd_bwd_ms"] if ours and pub else None
        own_ratio = pub["fwd_bwd_ms"] / own["fwd_bwd_ms"] if own and pub else None
        res["compare"].append({"label": label, "ours": ours and ours["name"], "ours_ms": ours and ours["fwd_bwd_ms"],
                               "public": pub and pub["name"], "public_ms": pub and pub["fwd_bwd_ms"], "ratio": ratio,
                               "own": own and own["name"], "own_ms": own and own["fwd_bwd_ms"], "own_ratio": own_ratio})
        res["targets"].append(target(
            f"compare_{label}", f"{label}: best backend >= 0.9x the speed of the best public kernel (one run)",
            None if waiting else ratio, lambda v: v >= 0.9,
            f"{fmt(ours and ours['name'])} vs {fmt(pub and pub['name'])}: {fmt(ratio)}; our own kernel "
            f"({fmt(own and own['name'])}): {fmt(own_ratio)}" + (f"; {waiting}" if waiting else "")
            + (f"; left out, forward+backward noisy: {', '.join(noisy)}" if noisy else ""),
            ctx.skips_cuda and ratio is None and not waiting and not noisy,
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
            good = {r["seq_len"] for r in rows if r["status"] == "ok" and not untrusted(r, "fwd_bwd_ms")
                    and r.get("fwd_bwd_ms")}
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
        waiting = not_yet([b for b in ctx.backends(label) if not n2(label, b)],
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


OVERHEAD_TOLERANCE = 0.03  # the overhead target: the harness's timing within 3% of raw do_bench
# The overhead's cases, three kinds of kernel: a pinned SDPA one, a compiled one (FlexAttention: on any CUDA
# machine with triton; xformers' wheels did not run on the H100's CUDA 13) and a composition of torch ops
OVERHEAD_CASES = [("full", "sdpa_flash"), ("sliding_window", "flex"), ("linear", "sdpa")]


def disturbed(raw_ms: list[float]) -> float | None:
    """How far apart the two raw timings are that make their median, where that is more than the target's
    tolerance (None where they agree): the reference itself moved by more than the 3% the target is to
    resolve, so no overhead can be judged against it. On the H200, linear `sdpa` forward's raw timings
    read 0.3555, 0.4761, 0.3567 and 0.4837 ms (the harness's runs beside them flagged noisy too): 33%
    between the middle two. One raw timing off alone leaves the middle two together."""
    ordered = sorted(raw_ms)
    lo, hi = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
    return hi / lo - 1 if hi / lo - 1 > OVERHEAD_TOLERANCE else None


def case_disturbed(case: dict[str, Any]) -> bool:
    """Whether an overhead case's judged round is disturbed in either pass (d/overhead.json)."""
    return case["status"] == "ok" and any(case[p]["overhead"] is not None and disturbed(case[p]["raw_ms"])
                                          for p in ("fwd", "fwd_bwd"))


def overhead_target(ctx: Context, res: dict[str, Any]) -> None:
    """The harness's timing against raw do_bench of the same callable (d/overhead.json). A case whose raw
    timings disagree by more than the tolerance is disturbed: judged neither way, and measured again
    (part_overhead); the target is met only when every case was judged. Judged once every case has its
    entry (part_overhead writes the file after each case: an interrupted call leaves some out)."""
    ov = job_file(ctx.out / "d" / "overhead.json") or {}
    waiting = not_yet([f"{v}/{b}" for v, b in OVERHEAD_CASES],
                      {f"{cs['variant']}/{cs['backend']}" for cs in ov.get("cases", [])})
    cases = [(f"{cs['variant']}/{cs['backend']} {p}", cs[p], 1 + len(cs.get("earlier_rounds", [])))
             for cs in ov.get("cases", []) if cs["status"] == "ok" for p in ("fwd", "fwd_bwd")
             if cs[p]["overhead"] is not None]
    vals = [(k, c["overhead"]) for k, c, _ in cases if not disturbed(c["raw_ms"])]
    shaken = [(k, c, rounds) for k, c, rounds in cases if disturbed(c["raw_ms"])]
    worst = max(vals, key=lambda x: abs(x[1]), default=None)  # faster than raw would be a discrepancy too
    # judged: a judged case missed, or every case judged (then the worst one decides)
    value = worst[1] if worst is not None and not waiting and (abs(worst[1]) > OVERHEAD_TOLERANCE or not shaken) else None

    def spread(key: str) -> str:
        """The worst case's spread, to judge it by: each harness run with its IQR, and the raw timings
        around them. An older overhead.json has one harness run (its IQR, or none: then its row's)."""
        (cs, p), = [(cs, p) for cs in ov["cases"] for p in ("fwd", "fwd_bwd")
                    if f"{cs['variant']}/{cs['backend']} {p}" == key]
        runs, iqrs = cs[p].get("harness_runs_ms", [cs[p]["harness_ms"]]), cs[p].get("harness_iqr_ms")
        if iqrs is None:
            iqrs = next((r.get(f"{p}_iqr_ms") for r in rows_of(ctx.out / "d" / "overhead" / cs["variant"])), None)
        iqrs = iqrs if isinstance(iqrs, list) else [iqrs]
        harness = ", ".join(f"{ms:.4g} ms (IQR {'-' if iqr is None else f'{iqr / ms:.1%}'})"
                            for ms, iqr in zip(runs, iqrs))
        raw = ", ".join(f"{x:.4g}" for x in cs[p]["raw_ms"])
        return f"harness run{'s' if len(runs) > 1 else ''} {harness}; raw, before and after each, {raw} ms"
    detail = [f"{k}: {v:+.2%}" for k, v in vals] + [
        f"{k}: disturbed, not judged (raw timings {disturbed(c['raw_ms']):.0%} apart at their median, in "
        f"{'each of its' if rounds > 1 else 'its'} {rounds} round{'s' if rounds > 1 else ''}; the last: {spread(k)})"
        for k, c, rounds in shaken]
    res["overhead"] = ov
    res["targets"].append(target(
        "overhead", "the harness's timing within 3% of raw do_bench of the same callable", value,
        lambda v: abs(v) <= OVERHEAD_TOLERANCE, "; ".join(filter(None, [", ".join(detail), waiting])), ctx.skips_cuda,
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
    tests-gpu.rc is there once every test has one. ``earlier``: the counts of each run of every test
    before it (RERUN_TESTS=1 kept them beside, as tests-gpu.<time>.jsonl), whose failures would otherwise
    go unseen."""
    def outcomes(path: Path) -> dict[str, dict[str, Any]]:
        return {r["test"]: r for r in side_rows(path)}

    last = outcomes(out / "tests-gpu.jsonl")
    return {"all_run": (out / "tests-gpu.rc").exists(), "code": tests_code(out / "tests-gpu.jsonl"),
            "counts": dict(Counter(r["outcome"] for r in last.values())),
            "failed": [r for r in last.values() if r["outcome"] in ("failed", "error")],
            "skipped": dict(Counter(r["message"] for r in last.values() if r["outcome"] == "skipped")),
            "earlier": {p.name: dict(Counter(r["outcome"] for r in outcomes(p).values()))
                        for p in sorted(out.glob("tests-gpu.*.jsonl"))}}


def tests_code(path: Path) -> list[str]:
    """The code versions the outcomes of ``path`` (tests-gpu.jsonl) tested, "not recorded" for an outcome
    from before each said (tests/conftest.py's Outcomes)."""
    return sorted({str(r.get("code_version") or "not recorded") for r in side_rows(path)})


def tests_of_other_code(out: Path, code: str | None) -> str | None:
    """Why the GPU tests' outcomes in ``out`` do not verify the code ``code`` (harness.env.code_version of
    the code about to measure): some tested other code, or did not say which (gpu_job.sh then runs every
    test again, the earlier outcomes kept beside). None: every outcome is of ``code``, or there is none."""
    other = [c for c in tests_code(out / "tests-gpu.jsonl") if c != str(code or "not recorded")]
    return f"outcomes of code {', '.join(other)} in tests-gpu.jsonl, and this is code {code}" if other else None


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
              (", ".join(f"{n} {k}" for k, n in sorted(tests["counts"].items())) or "none run")
              + (f" at code {', '.join(tests['code'])}" if tests["code"] else "") + "; " +
              ("every test has run." if tests["all_run"] else "not every test has run yet (the next call goes on)."), ""]
    if tests["failed"]:
        lines += table(["failed test", "outcome", "message"], [[r["test"], r["outcome"], r["message"]] for r in tests["failed"]])
        lines += [""]
    if tests["skipped"]:
        lines += table(["skipped, because", "tests"], [[m, n] for m, n in tests["skipped"].items()]) + [""]
    lines += [f"An earlier run of every test, kept beside: `{name}`, "
              + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no outcome")
              + f" at code {', '.join(tests_code(ctx.out / name)) or '-'}." for name, counts in
              tests["earlier"].items()] + ([""] if tests["earlier"] else [])
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
                   [[r["head_dim"], r["causal"], r["backend"],
                     r["status"] + (f" (noisy: {', '.join(r['noisy'])})" if r["noisy"] else ""),
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
              "columns are our own kernel, the block-sparse engine, against the same public kernel. " + NOT_COMPARED]
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


# ----- command line --------------------------------------------------------------------------------

def job_file(path: Path) -> Any:
    """One of the benchmark's own JSON files (env.json, roof.json, d/overhead.json; state.json is the Job's),
    None where there is none: read as harness.job reads a job's files (one that does not read as its kind is moved aside,
    said in one line, and read as absent: the step it records is done again)."""
    def check(obj: Any) -> str | None:
        if path.name in ("roof.json", "overhead.json") and not isinstance(obj.get("status"), str):
            return "no status"
        if path.name == "env.json":  # what --summary-only, --pending and other_device read of each entry
            for e in obj:
                if e.get("device", "cpu") not in ("cpu", "cuda") or not isinstance(e.get("device_name", ""), str):
                    return f"an entry whose device is {e.get('device')!r} ({e.get('device_name')!r})"
                backends = e.get("backends", {})
                if not (isinstance(backends, dict) and all(isinstance(v, list) and all(isinstance(b, str) for b in v)
                                                           for v in backends.values())):
                    return "an entry whose backends are not lists of names"
        return None
    return read_job_file(path, list if path.name == "env.json" else dict, check, "bench_gpu.py")


def invocations(out: Path) -> list[dict[str, Any]]:
    """env.json's entries: one per invocation into ``out``."""
    return job_file(out / "env.json") or []


def other_device(out: Path, name: str) -> str | None:
    """Why ``out`` takes no measurement on the device called ``name`` (harness.env.device_name): an earlier
    invocation measured there on another. A directory's steps, targets and ratios read its rows together
    (a complete step is not run again), so they must be one device's. None: no other device."""
    others = sorted({e["device_name"] for e in invocations(out) if e.get("device_name", name) != name})
    if not others:
        return None
    return (f"{out} holds results measured on {' and '.join(others)}, and this is {name}: a results directory "
            "holds one device's (give another; the default is a new results/gpu/<date>-<device>)")
