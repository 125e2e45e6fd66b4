"""The project's variants against the implementations a user would otherwise pick, on the same function.

    python scripts/bench_peers.py [--seq-lens 1024 2048 4096 8192 16384] [--only PAIR ...]
                                  [--min-run-time 0.3] [--out results/cpu/peers]

Each pair computes one function two ways; per N, both sides run back to back (one interleaved run), their
outputs are checked equal (float32, 1e-4 of the output's scale) before anything is timed, then each
side's forward+backward peak memory (harness.memory) and time (harness.measure.time_fn: median and IQR)
are measured, with the cores other processes kept busy meanwhile, in --rounds rounds whose order
alternates (ours first, then the peer first). The row is the round with the median time ratio; a point
is starred (noisy) when its rounds' ratios differ by more than 10%, others kept more than
--max-other-cores busy, or an IQR exceeds 15% of its median. Workload: B=1, H=4, D=64, float32,
non-causal.

Pairs (ours / peer):
  sliding_window  sliding_window w=256 / lucidrains local-attention (window 256, one block back and
                  forward, exact window)
  longformer      sliding_window w=256 / Hugging Face LongformerSelfAttention (attention_window 512,
                  no global tokens), its q/k/v projections replaced by the given q, k, v; N a multiple
                  of 512, as the layer requires
  blockwise_exact blockwise exact b=128 / torch SDPA (no mask)
  sparse_fixed    sparse fixed (b=64, L=4, c=1) / torch SDPA with the same boolean mask
  sparse_bigbird  sparse bigbird (b=64, w=3, g=1, r=2) / torch SDPA with the same boolean mask
  linear          linear k=256 (share=headwise) / lucidrains linformer with its E, F and identity
                  projections (linformer takes one key/value input: both sides get v = k)

The SDPA pairs need nothing beyond the project; the others need the peers: pip install -e ".[peers]".
Writes <out>/results.json (every measurement) and <out>/table.md (ratios, machine facts), after each pair:
a pair and N measured again replaces its earlier row, the others are kept (an --only run adds its pairs
to the table; a run interrupted, then rerun, loses nothing it had measured). A point that fails (an
error, outputs that differ) is recorded as failed, with its one-line reason, and the run goes on to the
next; a row an earlier run measured at that point is kept. The run then ends with exit code 1 and one
line naming the failed points. A directory of another machine's rows, or one another run is writing, is
refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the project, and bench_cpu beside this script
from harness.signals import exit_at_startup_interrupts  # noqa: E402

exit_at_startup_interrupts("bench_peers.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import variants  # noqa: E402
from bench_cpu import ALLOCATOR_ENV  # noqa: E402
from harness.config import MeasureOptions, ctrl_c_is_one_line, one_line, one_line_errors, output_dir_arg, positive_arg  # noqa: E402
from harness.env import OtherLoad, collect, now  # noqa: E402
from harness.measure import time_fn  # noqa: E402
from harness.report.markdown import table as markdown_table  # noqa: E402
from harness.memory import peak_memory  # noqa: E402
from harness.results import DirectoryLock, LockedError, atomic_write, machine, write_json  # noqa: E402

B, H, D = 1, 4, 64
MAX_SPREAD = 0.10  # rounds whose time ratios differ by more than this: the point is starred
SEQ_LENS = [1024, 2048, 4096, 8192, 16384]
INSTALL = 'pip install -e ".[peers]"'
Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Layout(NamedTuple):
    """How a peer takes q, k, v and gives its output, against ours, (B, H, N, D): its inputs and dout are
    made in its own layout once, outside the timed calls (a copy inside them is time and memory ours does
    not spend: linformer's measured 0.93x memory was that copy), and its output is brought back to ours
    only to check it."""
    inputs: Callable[[torch.Tensor], torch.Tensor]  # (B, H, N, D) -> the peer's q, k, v
    output: Callable[[torch.Tensor], torch.Tensor]  # (B, H, N, D) -> the peer's output (dout)
    back: Callable[[torch.Tensor], torch.Tensor]  # the peer's output -> (B, H, N, D)


def same(t: torch.Tensor) -> torch.Tensor:
    return t


OURS = Layout(same, same, same)
MERGED = Layout(*[lambda t: t.transpose(1, 2).flatten(2)] * 2,  # (B, N, H·D)
                lambda t: t.unflatten(2, (H, D)).transpose(1, 2))


def sliding_window(N: int) -> tuple[Fn, Fn, Layout]:
    from local_attention import LocalAttention

    peer = LocalAttention(window_size=256, causal=False, look_backward=1, look_forward=1, exact_windowsize=True,
                          autopad=True)
    # autopad pads k and v with zeros it does not mask: without a key mask the last window's queries
    # attend to them where N is not a multiple of 256 (another function). Built once, as the SDPA masks.
    keys = torch.ones(B, N, dtype=torch.bool) if N % 256 else None
    return variants.build("sliding_window", window=256), lambda q, k, v: peer(q, k, v, mask=keys), OURS


class Given(torch.nn.Module):
    """Stands in for one of a layer's projections: returns the tensor it was handed (the attention alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.value


def longformer(N: int) -> tuple[Fn, Fn, Layout]:
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    # attention_window 512 is Longformer's two-sided window: 256 keys each side, our window=256.
    config = LongformerConfig(hidden_size=H * D, num_attention_heads=H, attention_window=[512],
                              attention_probs_dropout_prob=0.0, num_hidden_layers=1)
    peer = LongformerSelfAttention(config, layer_id=0).eval()
    peer.query, peer.key, peer.value = Given(), Given(), Given()  # q, k, v given, not projected
    local = torch.zeros(B, N)  # Longformer's mask: 0 = local attention for every position, no global
    hidden = torch.empty(B, N, H * D)  # read by nothing but its shape: the projections are given

    def peer_fn(q, k, v):  # the layer's (N, B, H·D) -> its (B, N, H·D)
        # It divides its query in place: a tensor of its own, as its query projection would give it (the
        # one copy in its timed calls; k and v are given as they are)
        peer.query.value, peer.key.value, peer.value.value = q.clone(), k, v
        return peer(hidden, attention_mask=local, is_index_masked=local < 0, is_index_global_attn=local > 0,
                    is_global_attn=False)[0]

    layout = Layout(lambda t: t.permute(2, 0, 1, 3).flatten(2), MERGED.output, MERGED.back)
    return variants.build("sliding_window", window=256), peer_fn, layout


def sdpa_masked(name: str, **options) -> Callable[[int], tuple[Fn, Fn, Layout]]:
    def make(N: int) -> tuple[Fn, Fn, Layout]:
        ours = variants.build(name, **options)
        mask = ours.mask(N)  # (N, N) bool, built once outside the timed calls, as a user would
        return ours, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), OURS
    return make


def blockwise_exact(N: int) -> tuple[Fn, Fn, Layout]:
    return variants.build("blockwise", mode="exact", block_size=128), F.scaled_dot_product_attention, OURS


def linear(N: int) -> tuple[Fn, Fn, Layout]:
    from linformer import LinformerSelfAttention

    ours = variants.build("linear", proj_dim=256, max_seq_len=N)
    peer = LinformerSelfAttention(dim=H * D, seq_len=N, k=256, heads=H)
    peer.to_q = peer.to_k = peer.to_v = peer.to_out = torch.nn.Identity()  # the attention alone
    with torch.no_grad():
        peer.proj_k.copy_(ours.E.T)  # linformer projects with (n, k); ours with E (k, n)
        peer.proj_v.copy_(ours.F.T)
    for p in (*ours.parameters(), *peer.parameters()):
        p.requires_grad_(False)  # fixed projections on both sides: the attention's own cost

    def peer_fn(x, ctx, _):  # linformer's (B, N, H·D), values = keys
        return peer(x, context=ctx)

    return (lambda q, k, v: ours(q, k, k)), peer_fn, MERGED


PAIRS: dict[str, tuple[Callable[[int], tuple[Fn, Fn, Layout]], str | None, str]] = {
    # name: (builder, module the peer needs or None, peer label)
    "sliding_window": (sliding_window, "local_attention", "local-attention"),
    "longformer": (longformer, "transformers", "HF Longformer"),
    "blockwise_exact": (blockwise_exact, None, "SDPA"),
    "sparse_fixed": (sdpa_masked("sparse", pattern="fixed"), None, "SDPA + mask"),
    "sparse_bigbird": (sdpa_masked("sparse", pattern="bigbird"), None, "SDPA + mask"),
    "linear": (linear, "linformer", "linformer"),
}


def available(pair: str) -> bool:
    module = PAIRS[pair][1]
    return module is None or importlib.util.find_spec(module) is not None


def measure(fn: Fn, q, k, v, dout, opts: MeasureOptions) -> dict:
    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(dout)
        return out

    fwd_bwd()  # warm-up (plans, caches)
    for t in (q, k, v):
        t.grad = None
    peak = peak_memory(fwd_bwd, "cpu").extra_bytes
    load = OtherLoad()
    load.start()
    timing = time_fn(fwd_bwd, torch.device("cpu"), opts)
    return {"fwd_bwd_ms": timing.median_ms, "iqr_ms": timing.iqr_ms, "samples": timing.samples,
            "peak_mem_bytes": peak, "other_cpu_cores": load.stop()}


class Differ(Exception):
    """The two sides' outputs differ: the point is recorded as failed and nothing of it is timed."""


def check_equal(ours: Fn, peer: Fn, layout: Layout, q, k, v, peer_inputs) -> float:
    """Largest |ours − peer| over the output's largest magnitude; raises Differ when above 1e-4."""
    with torch.no_grad():
        a, b = ours(q, k, v), layout.back(peer(*peer_inputs))
    err = float((a - b).abs().max() / b.abs().max())
    if not err <= 1e-4:
        raise Differ(f"outputs differ ({err:.2e} of the output's scale); nothing timed")
    return err


def run_pair(pair: str, N: int, opts: MeasureOptions, rounds: int, max_other: float) -> dict:
    """``rounds`` rounds of both sides back to back, the order alternating (ours first, then the peer
    first) so that a drift of the machine's speed weighs on both; the row is the round with the median
    ratio, and every round's ratio is kept. A host's other guests are invisible from inside it: only
    the rounds' agreement shows that the machine did not change speed under a measurement."""
    make, _, label = PAIRS[pair]
    ours, peer, layout = make(N)
    gen = torch.Generator().manual_seed(N)
    q, k, v, dout = (torch.randn(B, H, N, D, generator=gen) for _ in range(4))
    # the same values in the peer's own layout, made here: no copy in its timed calls that ours does not make
    peer_inputs = [layout.inputs(t).contiguous() for t in (q, k, v)]
    peer_dout = layout.output(dout).contiguous()
    for t in (q, k, v, *peer_inputs):
        t.requires_grad_()
    err = check_equal(ours, peer, layout, q, k, v, peer_inputs)
    measured = []
    for r in range(rounds):
        if r % 2 == 0:
            o = measure(ours, q, k, v, dout, opts)
            p = measure(peer, *peer_inputs, peer_dout, opts)
        else:
            p = measure(peer, *peer_inputs, peer_dout, opts)
            o = measure(ours, q, k, v, dout, opts)
        measured.append((o["fwd_bwd_ms"] / p["fwd_bwd_ms"], o, p))
    ratios = [m[0] for m in measured]
    ratio, o, p = sorted(measured, key=lambda m: m[0])[(rounds - 1) // 2]
    sides = [side for m in measured for side in m[1:]]
    reasons = ([f"rounds' time ratios {min(ratios):.2f}-{max(ratios):.2f} differ by more than {MAX_SPREAD:.0%}"]
               if max(ratios) > (1 + MAX_SPREAD) * min(ratios) else [])
    reasons += [f"other processes kept {s['other_cpu_cores']:.2f} cores busy" for s in sides
                if (s["other_cpu_cores"] or 0) > max_other][:1]
    reasons += [f"IQR {s['iqr_ms'] / s['fwd_bwd_ms']:.0%} of a median" for s in sides
                if (s["iqr_ms"] or 0) > 0.15 * s["fwd_bwd_ms"]][:1]
    return {"pair": pair, "peer": label, "seq_len": N, "max_rel_err": err, "rounds": rounds,
            "round_time_ratios": ratios, "ours_side": o, "peer_side": p, "time_ratio": ratio,
            "mem_ratio": o["peak_mem_bytes"] / max(1, p["peak_mem_bytes"]), "noisy": bool(reasons),
            "noise_reasons": reasons}


def point(r: dict) -> tuple[int, int]:
    """A row's or a failure's place in the files (its sort key, not its identity): PAIRS' order (a pair no
    longer there last), then N."""
    return list(PAIRS).index(r["pair"]) if r["pair"] in PAIRS else len(PAIRS), r["seq_len"]


def table(rows: list[dict], failed: list[dict], env: dict, args) -> str:
    ns = sorted({r["seq_len"] for r in rows + failed})
    pairs = list(dict.fromkeys(r["pair"] for r in sorted(rows + failed, key=point)))
    at = {(r["pair"], r["seq_len"]): r for r in rows}
    failed_at = {(f["pair"], f["seq_len"]) for f in failed}
    def ratio(p: str, n: int, metric: str) -> str:
        r = at.get((p, n))
        if r is None:
            return "failed" if (p, n) in failed_at else ""
        return f"{r[metric]:.2f}" + ("*" if r["noisy"] and metric == "time_ratio" else "")
    lines = ["Ratios ours / peer on the same function (below 1: ours is cheaper); `*` measured while others "
             "kept cores busy, with a wide spread, or whose rounds disagree by more than 10%.", "",
             *markdown_table(["ours / peer", *(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in ns)],
                             [[f"{p} / {PAIRS[p][2] if p in PAIRS else 'peer'} ({what})", *(ratio(p, n, metric) for n in ns)]
                              for metric, what in (("time_ratio", "time"), ("mem_ratio", "peak memory")) for p in pairs], 1),
             "", "Absolute, the median round: forward+backward ms (median ± IQR) and peak MiB, ours | peer; "
                 "every round's time ratio:", ""]
    lines += markdown_table(
        ["pair", "N", "ours ms", "peer ms", "ours MiB", "peer MiB", "other cores (ours, peer)", "rounds' ratios",
         "max rel err"],
        [[r["pair"], r["seq_len"], *(f"{s['fwd_bwd_ms']:.1f} ±{s['iqr_ms'] or 0:.1f}" for s in sides),
          *(f"{s['peak_mem_bytes'] / 2**20:.1f}" for s in sides), ", ".join(f"{s['other_cpu_cores'] or 0:.2f}" for s in sides),
          " ".join(f"{x:.2f}" for x in r["round_time_ratios"]), f"{r['max_rel_err']:.1e}"]
         for r in rows for sides in [(r["ours_side"], r["peer_side"])]], 1)
    if failed:
        lines += ["", "Failed points, the latest attempt of each (where a ratio is shown, it is an earlier run's row):", ""]
        lines += [f"- {f['pair']} N={f['seq_len']} ({f['at']}): {f['error']}" for f in failed]
    lines += ["", f"Machine: {env['device_name']}, {env['num_threads']} threads, torch {env['torch_version']}, "
                  f"code {env['code_version']}, allocator {env['allocator']}, load average {env['load_avg_1m']:.2f} at the start; "
                  f"timer torch.utils.benchmark blocked_autorange, {args.min_run_time} s per side; "
                  f"B={B}, H={H}, D={D}, float32, non-causal."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--seq-lens", type=positive_arg(int), nargs="+", default=SEQ_LENS)
    ap.add_argument("--only", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    ap.add_argument("--min-run-time", type=positive_arg(float), default=0.3, help="seconds of timed calls per side")
    ap.add_argument("--rounds", type=positive_arg(int), default=3,
                    help="rounds per pair and N (order alternating); the median is kept")
    ap.add_argument("--max-other-cores", type=positive_arg(float, zero=True), default=0.25)
    ap.add_argument("--out", type=output_dir_arg, default=ROOT / "results" / "cpu" / "peers")
    args = ap.parse_args()
    # a length or pair given twice is one point (it was measured twice and written as two rows)
    args.seq_lens, args.only = list(dict.fromkeys(args.seq_lens)), list(dict.fromkeys(args.only))
    odd = [n for n in args.seq_lens if n % 512]
    if "longformer" in args.only and odd:  # the layer takes no other N: refused mid-run
        ap.error(f"--only longformer needs every --seq-lens a multiple of 512; got {' '.join(map(str, odd))}")
    if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):  # as scripts/bench_cpu.py: see there
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
    missing = [p for p in args.only if not available(p)]
    pairs = [p for p in args.only if p not in missing]
    if missing:
        why = f"{', '.join(missing)}: peers not installed ({INSTALL})"
        if not pairs:  # nothing would be measured: no results.json or table.md of nothing
            print(f"bench_peers: nothing to measure: {why}", file=sys.stderr)
            sys.exit(1)
        print(f"bench_peers: skipping {why}", file=sys.stderr)
    opts = MeasureOptions(min_run_time=args.min_run_time, passes=("fwd_bwd",))
    env = collect(torch.device("cpu")).as_dict()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        lock = DirectoryLock(args.out).acquire()
    except LockedError as e:
        ap.error(f"--out {e}")
    earlier, earlier_failed = earlier_results(args.out / "results.json", env, ap)
    started, rows, failed = now(), [], []
    for N in args.seq_lens:  # interleaved: every pair at one N before the next N
        for pair in pairs:
            try:
                row = run_pair(pair, N, opts, args.rounds, args.max_other_cores)
            except Exception as e:  # an allocation refused, a peer's error, outputs that differ: this point's result
                reason = str(e) if isinstance(e, Differ) else one_line(f"{type(e).__name__}: {e}")
                failed.append({"pair": pair, "seq_len": N, "error": reason, "at": now()})
                print(f"{pair:16s} N={N:6d} failed: {reason}", flush=True)
            else:
                rows.append(row)
                print(f"{pair:16s} N={N:6d} time {row['time_ratio']:.2f}x  memory {row['mem_ratio']:.2f}x"
                      f"{'  (noisy)' if row['noisy'] else ''}", flush=True)
            # Written after every point, so an interrupted run keeps what it measured, and the earlier rows
            # it has not measured again. A failure replaces no row (an earlier run's measurement is kept);
            # a point measured now has no failure left, and one failed now only its latest.
            done = {(r["pair"], r["seq_len"]) for r in rows}
            tried = done | {(f["pair"], f["seq_len"]) for f in failed}
            kept = sorted([r for r in earlier if (r["pair"], r["seq_len"]) not in done] + rows, key=point)
            failures = sorted([f for f in earlier_failed if (f["pair"], f["seq_len"]) not in tried] + failed, key=point)
            write_json(args.out / "results.json", {"started": started, "finished": now(), "env": env,
                                                   "workload": {"B": B, "H": H, "D": D, "dtype": "float32"},
                                                   "min_run_time": args.min_run_time, "rows": kept, "failed": failures})
            atomic_write(args.out / "table.md", table(kept, failures, env, args))
    lock.release()
    print((args.out / "table.md").read_text())
    if failed:
        print(f"bench_peers: {len(failed)} point(s) failed, recorded in results.json and table.md: "
              + "; ".join(f"{f['pair']} N={f['seq_len']}: {f['error']}" for f in failed), file=sys.stderr)
        sys.exit(1)


def earlier_results(path: Path, env: dict, ap: argparse.ArgumentParser) -> tuple[list[dict], list[dict]]:
    """The rows and the failed points an earlier run wrote to ``path`` (none where there is no file), kept
    beside this run's; a file this script did not write, or of another machine (its table states one), is
    refused."""
    if not path.exists():
        return [], []
    try:
        old = json.loads(path.read_bytes())
        rows, failed, where = old["rows"], old.get("failed", []), machine({**old["env"], "device": "cpu"})
        if not all(isinstance(x, list) and all(isinstance(r, dict) and {"pair", "seq_len"} <= set(r) for r in x)
                   for x in (rows, failed)):
            raise ValueError("no rows")
    except (ValueError, KeyError, TypeError):
        ap.error(f"--out {path} is not a results.json this script wrote (give another --out, or move it away)")
    if where != machine({**env, "device": "cpu"}):
        ap.error(f"--out {path.parent} holds measurements of another machine ({where[0]}, {where[1]} threads) and "
                 f"this is {env['device_name']} ({env['num_threads']} threads): give another --out")
    if rows or failed:
        print(f"bench_peers: keeping {len(rows)} earlier row(s)" + (f" and {len(failed)} failed point(s)" if failed else "")
              + f" of {path} (a pair and N measured again replaces its row)")
    return rows, failed


if __name__ == "__main__":
    sys.exit(ctrl_c_is_one_line(main, "bench_peers.py", "results.json and table.md hold the pairs measured before "
                                "it, and the earlier runs' rows"))
