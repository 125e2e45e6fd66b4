"""adaptive_span: every backend against the float64 reference, outputs and the gradients of q, k, v and
the spans z; z's gradient against finite differences; the soft mask, counts and memory; the task's span
penalty and the spans logged to wandb."""

from __future__ import annotations

import math

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.func import functional_call

import variants
from harness.memory import cpu_peak_bytes
from harness.quality.task import MQARConfig, build_model, layer_metrics, span_penalty, train_mqar
from variants import VariantError, flex
from variants.adaptive_span import AdaptiveSpan

from .conftest import qkv
from .test_gpu_backends import assert_fa_rule

S, R = 40, 8  # max_span, ramp: the band (reach ⌈z⌉ + R − 1 ≤ 47) is narrower than N below
LENGTHS = (1, 97, 200)  # 97: one chunk holds the band; 200: 4 chunks of 64 (the last ragged)
SPANS = {  # one z per head (3 heads): the clamp ends, inside the ramp's reach, between, out of range
    "zero": [0.0, 0.0, 0.0],
    "mixed": [0.0, 3.5, 17.25],
    "max": [S, S, S],
    "clamped": [-5.0, S + 10.0, 12.0],
}


def build(spans, **options) -> AdaptiveSpan:
    attn = variants.build("adaptive_span", **{"max_span": S, "ramp": R, "num_heads": len(spans), **options})
    with torch.no_grad():
        attn.z.copy_(torch.tensor(spans))
    return attn


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, g.to(device=out.device, dtype=out.dtype))  # drawn on CPU: same on any device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("spans", list(SPANS), ids=str)
@pytest.mark.parametrize("backend", ["band", "dense"])
def test_matches_float64_reference_with_span_gradients(backend, spans, causal, dtype):
    attn = build(SPANS[spans], backend=backend)
    for N in LENGTHS:
        q, k, v = qkv(1, 3, N, 16, dtype=dtype, seed=N)
        out = attn(q, k, v, causal=causal)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = attn.reference(q64, k64, v64, causal=causal)
        got = (out, *grads(out, (q, k, v, attn.z)))
        want = (ref, *grads(ref, (q64, k64, v64, attn.z)))
        eps = 1e-10 if dtype == torch.float64 else 2e-5
        for name, g, w in zip(("out", "dq", "dk", "dv", "dz"), got, want):
            w = w.double()
            torch.testing.assert_close(g.double(), w, rtol=eps * 10, atol=eps * max(1.0, w.abs().max().item()),
                                       msg=lambda m: f"N={N} {name}: {m}")
        dz = want[-1]
        if spans == "clamped":  # outside [0, S] the clamp stops the gradient
            assert dz[0] == 0 and dz[1] == 0
        if spans == "mixed" and N > S + R:  # spans whose ramp covers keys learn
            assert (dz[1:] != 0).all()


def test_reference_is_the_papers_formula_row_by_row():
    """The oracle against the definition written out: a_ij = m(x)·e^{s_ij} / Σ m(x)·e^{s_ij'}."""
    attn = build([1.5, 6.0], max_span=10, ramp=3)
    q, k, v = (t.detach() for t in qkv(1, 2, 13, 4, seed=5))
    for causal in (False, True):
        out = attn.reference(q, k, v, causal)
        for h, z in enumerate((1.5, 6.0)):
            for i in range(13):
                js = [j for j in range(13) if not causal or j <= i]
                m = torch.tensor([min(max((3 + z - (i - j if causal else abs(i - j))) / 3, 0.0), 1.0) for j in js],
                                 dtype=torch.float64)
                e = m * torch.exp(torch.stack([q[0, h, i] @ k[0, h, j] / 2 for j in js]))
                row = sum(w * v[0, h, j] for w, j in zip(e / e.sum(), js))
                torch.testing.assert_close(out[0, h, i], row, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("backend", ["band", "dense"])
def test_span_gradient_against_finite_differences(backend, causal, monkeypatch):
    """torch.autograd.gradcheck in float64: z's gradient entry by entry, and q, k, v with z along random
    directions (fast mode). z stays off the ramp's kinks (x − z never 0 or R for integer x)."""
    monkeypatch.setattr(variants.adaptive_span, "CHUNK", 4)  # N = 23: 6 band chunks, the last ragged
    attn = build([0.0, 0.0, 0.0], max_span=5, ramp=2, backend=backend)
    q, k, v = (t.detach() for t in qkv(1, 3, 23, 4, seed=2))
    z = torch.tensor([0.4, 1.3, 3.7], dtype=torch.float64, requires_grad=True)
    if backend == "band":
        with torch.no_grad():
            attn.z.copy_(z)
        assert attn.band_shape(23, causal) == (6, 4, 4 + 5 * (1 if causal else 2))

    def f(q, k, v, z):
        return functional_call(attn, {"z": z}, (q, k, v), {"causal": causal})

    assert torch.autograd.gradcheck(lambda z: f(q, k, v, z), (z,), eps=1e-6, atol=1e-7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(f, (q, k, v, z), eps=1e-6, atol=1e-7, fast_mode=True)


def test_spans_at_max_equal_full_attention_when_they_cover_every_key():
    N = 30
    q, k, v = qkv(1, 2, N, 8, seed=4)
    full = variants.build("full", backend="math")
    for causal in (False, True):
        for backend in ("band", "dense"):
            attn = build([N - 1, 50.0], max_span=60, ramp=4, backend=backend)  # m = 1 for every x ≤ N − 1
            torch.testing.assert_close(attn(q, k, v, causal), full(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_span_zero_keeps_the_ramp_only():
    """z = 0: weights m(x) = (R − x)/R on x < R; R = 1 leaves only the query's own key (out = v)."""
    q, k, v = qkv(1, 1, 50, 8, seed=6)
    attn = build([0.0], ramp=1)
    for causal in (False, True):
        torch.testing.assert_close(attn(q, k, v, causal), v, rtol=0, atol=1e-12)


def test_shared_span_broadcasts_over_heads():
    attn = variants.build("adaptive_span", max_span=S, ramp=R, init_span=10.0)  # num_heads null: one z
    assert attn.z.shape == (1,) and attn.spans(4).tolist() == [10.0] * 4
    q, k, v = qkv(1, 4, 97, 8)
    out = attn(q, k, v, causal=True)
    torch.testing.assert_close(out, attn.reference(q, k, v, True), rtol=1e-10, atol=1e-10)
    with pytest.raises(VariantError, match=r"built for num_heads=3 \(one span per head\); got H=4"):
        build([1.0, 2.0, 3.0])(q, k, v)


def test_mask_counts_and_density_follow_the_spans():
    attn = build(SPANS["mixed"])
    for N in (97, 200):
        for causal in (False, True):
            i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
            x = (i - j) if causal else (i - j).abs()
            want = torch.stack([((R + z - x) / R > 0) & (j <= i if causal else True) for z in SPANS["mixed"]])
            assert torch.equal(attn.mask(N, causal), want)  # the support m_h(x) > 0
            assert attn.allowed_pairs(N, causal) == int(want.sum()) // 3
            assert attn.density(N, causal) == pytest.approx(int(want.sum()) // 3 / N**2)
            f = attn.flops(2, 3, N, 16, causal)
            assert f.executed >= f.useful == 4 * 2 * 3 * 16 * attn.allowed_pairs(N, causal)


def test_band_is_linear_in_n_and_builds_no_dense_mask(monkeypatch):
    """The band path never calls the O(N²) mask, and its measured peak memory doubles with N (its tiles,
    a constant, shrunk as in tests/test_memory_scaling.py so that what doubles is the O(N·D) part)."""
    def forbidden(*a, **k):
        raise AssertionError("dense mask built on the fast path")

    monkeypatch.setattr(variants.adaptive_span, "dense_mask", forbidden)
    monkeypatch.setattr(variants.blocksparse, "TILE_ELEMENTS", 1 << 14)
    attn = build([20.0, 48.0], max_span=48, ramp=16)
    peaks = []
    for N in (1024, 2048):
        q, k, v = qkv(1, 2, N, 32, dtype=torch.float32)
        dout = torch.randn(1, 2, N, 32)
        step = lambda: attn(q, k, v).backward(dout)  # noqa: E731
        step()
        peaks.append(cpu_peak_bytes(step))
        assert peaks[-1] <= attn.memory_bytes(1, 2, N, 32), "the analytic budget bounds the measurement"
    assert 1.6 <= peaks[1] / peaks[0] <= 2.4, peaks
    assert peaks[1] < 3 * 2 * 2048 * 2048 * 4 / 4  # a fraction of full math's three N×N matrices


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_band_keeps_no_score_per_pair(causal):
    """FlashAttention-2's way (BandAttention): the forward keeps each row's output and log-sum-exp, the
    backward computes the scores again, so the peak is O(N·D) plus one group's tiles, not the N·L scores,
    probabilities and their gradient that autograd would keep (nor the keys copied per chunk)."""
    attn = build([1000.0], max_span=1000, ramp=32)
    N, D = 16384, 16
    q, k, v = qkv(1, 1, N, D, dtype=torch.float32)
    dout = torch.randn(1, 1, N, D)
    step = lambda: attn(q, k, v, causal).backward(dout)  # noqa: E731
    step()
    peak = cpu_peak_bytes(step)
    nc, c, L = attn.band_shape(N, causal)
    assert peak < nc * c * L * 4 / 3, (peak, nc * c * L * 4)  # a third of one float32 score per computed pair
    assert peak <= attn.memory_bytes(1, 1, N, D, 4, causal)


def test_executed_band_is_the_reach_of_the_largest_span():
    attn = build([3.2, 10.0])
    assert attn.reach() == 10 + R - 1
    nc, c, L = attn.band_shape(200, causal=False)
    assert (nc, c, L) == (4, 64, 64 + 2 * 17)
    assert attn.band_shape(200, causal=True)[2] == 64 + 17
    assert attn.executed_pairs(200) == 4 * 64 * 98
    with torch.no_grad():
        attn.z.fill_(1000.0)  # clamped to S; a reach past N is cut at N − 1
    assert attn.reach() == S + R - 1
    assert attn.band_shape(30, False) == (1, 30, 30)  # the band covers the sequence: one chunk of N ≤ 64 rows against the N keys


def test_reach_is_read_from_z_once_until_z_changes(monkeypatch):
    """reach() reads z on the host (a device sync on GPU): once per value of z, renewed by an optimiser
    step and by a copy to another device or dtype. (Kept on CUDA only; here on the CPU for the test.)"""
    monkeypatch.setattr(AdaptiveSpan, "reach_kept_on", ("cpu", "cuda"))
    attn = build([3.2, 10.0])
    q, k, v = qkv(1, 2, 100, 16, dtype=torch.float32)
    attn(q, k, v).sum().backward()
    kept = attn._reach
    attn(q, k, v)
    assert attn._reach is kept and attn.reach() == 10 + R - 1
    torch.optim.SGD([attn.z], lr=50.0).step()
    want = math.ceil(float(attn.z.detach().clamp(0, S).max())) + R - 1
    assert attn.reach() == want != 10 + R - 1 and attn._reach is not kept
    attn.double()  # a new z: read again
    assert attn.reach() == want and attn._reach[0] == (attn.z.data_ptr(), attn.z.device, attn.z._version)


def test_reach_follows_a_fused_optimiser_step():
    """A fused AdamW step changes z without bumping its version: on the CPU z is read at every call, and
    after_step (which the harness's training calls after each step) forgets a kept value anywhere."""
    attn = build([3.0])
    q, k, v = qkv(1, 1, 100, 8)
    attn(q, k, v)
    opt = torch.optim.AdamW([attn.z], lr=5.0, fused=True)
    attn.z.grad = torch.tensor([-1.0])
    opt.step()
    assert attn.reach() == math.ceil(float(attn.z.detach().max())) + R - 1 > 3 + R - 1
    torch.testing.assert_close(attn(q, k, v), attn.reference(q, k, v))
    attn.reach_kept_on = ("cpu",)
    attn.reach()
    opt.step()
    attn.after_step()
    assert attn.reach() == math.ceil(float(attn.z.detach().max())) + R - 1


@pytest.mark.parametrize("options,expect", [
    ({"max_span": -1}, "max_span must be an integer >= 0; got -1"),
    ({"ramp": 0}, "ramp must be an integer >= 1; got 0"),
    ({"max_span": 8, "init_span": 9}, r"init_span must be a number in \[0, max_span=8\] or null; got 9"),
    ({"num_heads": 0}, "num_heads must be an integer > 0 or null"),
    ({"span": 3}, "unknown option 'span'; allowed: max_span, ramp, init_span, num_heads, backend"),
    ({"backend": "blocksparse"}, "unknown backend 'blocksparse'; allowed: band, dense, flex"),
])
def test_bad_options(options, expect):
    with pytest.raises(VariantError, match=expect) as err:
        variants.build("adaptive_span", **options)
    assert "\n" not in str(err.value)


def test_init_span_defaults_to_max_span():
    assert variants.build("adaptive_span", num_heads=2).spans().tolist() == [1024.0, 1024.0]
    assert variants.build("adaptive_span", max_span=64, init_span=5).spans().tolist() == [5.0]


# ----- flex (FlexAttention: CUDA; its score_mod and band checked on CPU, forward only) ---------------
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_flex_score_mod_and_band_match_reference_cpu(causal):
    attn = build(SPANS["mixed"], backend="flex")
    assert "flex" not in attn.available_backends("cpu")
    q, k, v = (t.detach().float() for t in qkv(1, 3, 200, 16, seed=3))
    out = attn.flex_forward(q, k, v, causal, compiled=False)  # eager: the same score_mod and block mask
    torch.testing.assert_close(out.double(), attn.reference(q, k, v, causal), rtol=1e-4, atol=1e-4)
    if causal:  # and once compiled, as the backend runs it (CPU: forward only, no grad)
        with torch.no_grad():
            torch.testing.assert_close(attn.flex_forward(q, k, v, causal).double(), attn.reference(q, k, v, causal),
                                       rtol=1e-4, atol=1e-4)
        shared = variants.build("adaptive_span", max_span=S, ramp=R, init_span=5.5, backend="flex")  # one z, expanded
        with torch.no_grad():  # (compiled, an expanded z failed: the score_mod's buffers must be contiguous)
            torch.testing.assert_close(shared.flex_forward(q, k, v, causal).double(),
                                       shared.reference(q, k, v, causal), rtol=1e-4, atol=1e-4)
    stats = flex.block_mask_stats(attn, 200, causal)
    # N = 200 is 2 × 2 tiles: the band (reach 24) touches all of them, causal skips the future one
    assert stats["tile_density"] == (0.75 if causal else 1.0)
    long = flex.block_mask_stats(attn, 2048, causal)
    assert long["tile_density"] < 0.25  # 16 tiles a side, the band only near the diagonal


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spans", ["mixed", "max"])
@pytest.mark.parametrize("backend,device", [("band", "cpu"), pytest.param("band", "cuda", marks=pytest.mark.gpu),
                                            pytest.param("flex", "cuda", marks=pytest.mark.gpu)])
def test_half_precision_matches_reference(backend, device, spans, dtype, causal):
    """The GPU benchmark's inputs (half precision; band on CPU too): output and gradients (z included)
    against the float64 reference, under flash-attention's rule: at most twice the error of the dense
    path in the same dtype, plus the rounding floor.
    Should flex's gradients be NaN here: PyTorch issue 153799 (open in 2.7) reports NaN in FlexAttention's
    backward when a score_mod and a block mask meet N not a multiple of 128 — this backend's case."""
    N, D = 1000, 64  # not a multiple of 128
    attn = build([300.0, 7.5, 120.0] if spans == "mixed" else [S, S, S], max_span=300 if spans == "mixed" else S,
                 backend=backend).to(device)
    dense = build(attn.spans().tolist(), max_span=attn.options.max_span, backend="dense").to(device)
    q, k, v = qkv(2, 3, N, D, dtype=dtype, seed=N, device=device)
    out = attn(q, k, v, causal)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attn.reference(q64, k64, v64, causal)
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = dense(qn, kn, vn, causal)
    got = (out, *grads(out, (q, k, v, attn.z)))
    want = (ref, *grads(ref, (q64, k64, v64, attn.z)))
    base = (naive, *grads(naive, (qn, kn, vn, dense.z)))
    assert_fa_rule(zip(("out", "dq", "dk", "dv", "dz"), got, want, base), dtype, "dense")


# ----- the task: span penalty in the loss, spans logged ----------------------------------------------
TINY = dict(seq_len=48, vocab_size=40, num_kv_pairs=8, num_queries=6, batch_size=8, eval_size=32)


def test_span_penalty_is_the_papers_term_and_zero_for_other_variants():
    cfg = MQARConfig(**TINY, span_penalty=1e-3)
    model = build_model("adaptive_span", {"max_span": 64, "num_heads": 2}, cfg)
    layers = [m for m in model.modules() if isinstance(m, AdaptiveSpan)]
    with torch.no_grad():
        layers[0].z.copy_(torch.tensor([10.0, 30.0]))
        layers[1].z.copy_(torch.tensor([80.0, 2.0]))  # 80 counts as 64 (clamped)
    assert float(span_penalty(model, cfg).detach()) == pytest.approx(1e-3 * ((10 + 30) / 2 + (64 + 2) / 2))
    for name, options in (("sliding_window", {"window": 8}), ("full", {})):
        assert float(span_penalty(build_model(name, options, cfg), cfg)) == 0.0
    # Inside ulysses: the same term, and each span named by its model layer (the wrapper and its inner
    # variant were counted as two layers: span_l1_h0, span_l3_h0)
    wrapped = build_model("ulysses", {"world_size": 1, "inner": "adaptive_span",
                                      "inner_options": {"max_span": 64, "num_heads": 2}}, cfg)
    assert sorted(layer_metrics(wrapped)) == sorted(layer_metrics(model)) == [
        "span_l0_h0", "span_l0_h1", "span_l1_h0", "span_l1_h1"]
    assert float(span_penalty(wrapped, cfg).detach()) == pytest.approx(1e-3 * 2 * 64)  # z starts at max_span


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_span_penalty_is_in_the_training_loss(device):
    """Spans of 64 at N = 48 cover every key: the task loss gives them no gradient, so they move only
    if the penalty is in the loss (down, by about lr·max_span per step), and stay put without it."""
    def final_spans(penalty):
        logs = []
        cfg = MQARConfig(**TINY, steps=6, eval_every=3, lr=0.03, warmup_steps=0, span_penalty=penalty)
        out = train_mqar("adaptive_span", {"max_span": 64, "num_heads": 2}, cfg, log=lambda s, m: logs.append(m),
                         device=device)
        assert [h["step"] for h in out["history"]] == [3, 6]
        spans = {k: v for k, v in logs[-1].items() if k.startswith("span_l")}
        assert sorted(spans) == ["span_l0_h0", "span_l0_h1", "span_l1_h0", "span_l1_h1"]
        assert logs[-1]["span_penalty"] == pytest.approx(penalty * sum(spans.values()) / 2, rel=1e-6)
        return spans

    assert set(final_spans(0.0).values()) == {64.0}
    assert all(z < 63 for z in final_spans(1e-3).values())
    logs = []
    train_mqar("sliding_window", {"window": 8}, MQARConfig(**TINY, steps=3, eval_every=3), log=lambda s, m: logs.append(m))
    assert not any(k.startswith("span") for k in logs[-1])


def test_spans_are_logged_to_wandb_against_the_step(tmp_path):
    """The command line with task=mqar: each head's span is a curve task/N<N>/span_l<layer>_h<head>
    against task/step in the offline wandb run, read back with ``wandb leet inspect``."""
    from .test_quality_logging import leet

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "variant=adaptive_span", "variant.max_span=64", "seq_lens=[48]",
         "num_heads=2", "head_dim=16", "measure.passes=[]", "measure.memory=false", "task=mqar", "task.steps=4",
         "task.eval_every=2", "task.eval_size=16", "task.batch_size=4", "task.span_penalty=0.01",
         f"hydra.run.dir={out}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run_dir, = (out / "wandb").glob("offline-run-*")
    records = [json.loads(line) for line in leet(run_dir).splitlines() if line.strip()]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    for layer in (0, 1):
        for h in (0, 1):
            key = f"task/N48/span_l{layer}_h{h}"
            curve = [(row["task/step"], row[key]) for row in history if key in row]
            assert [s for s, _ in curve] == [2, 4], key
            assert 0 <= curve[1][1] < curve[0][1] < 64, curve  # the penalty shrinks spans that see every key
    assert any("task/N48/span_penalty" in row for row in history)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_a_band_as_wide_as_the_sequence_is_tiled_too(causal):
    """A band that covers the sequence (N ≤ c + reach on each side, e.g. the default max_span=1024 at N=2048)
    is still computed a group of query chunks at a time: its peak is O(N·D) plus one tile, as at a longer N,
    never the B·H·N×N scores, probabilities and log-mask of one N-row chunk. Before, N=2048 measured 9x
    the peak of N=4096 (B=1, H=2, D=32), so a memory budget that skipped N=2048 also skipped (stop_on_oom)
    every longer N that fit."""
    # causal: max_span=2048, so that the band (64 + reach keys, no key ahead) covers N=2048 too
    attn = variants.build("adaptive_span", max_span=2048 if causal else 1024, ramp=32, num_heads=2)
    B, H, D = 1, 2, 32
    short, long = 2048, 4096  # the band covers the shorter
    peaks = {}
    for N in (short, long):
        q, k, v = qkv(B, H, N, D, dtype=torch.float32, seed=N)
        dout = torch.randn(B, H, N, D)
        step = lambda: attn(q, k, v, causal).backward(dout)  # noqa: E731
        step()
        q.grad = k.grad = v.grad = None
        peaks[N] = cpu_peak_bytes(step)
        assert peaks[N] <= attn.memory_bytes(B, H, N, D, 4, causal), (N, peaks[N])
    assert peaks[short] < B * H * short * short * 4, peaks  # less than one float32 N×N score matrix
    assert peaks[short] <= peaks[long], peaks  # the longer sequence needs at least as much
    assert attn.band(short, causal).whole and not attn.band(long, causal).whole


def test_a_band_as_wide_as_the_sequence_matches_the_reference():
    """The whole-key chunks (the band covers the sequence) against the float64 reference, N not a multiple
    of the chunk (padded query rows), a head (z = 0) whose ramp leaves a padded row no key with m > 0."""
    attn, N = build([60.0, 5.0, 0.0], max_span=64), 130  # reach 67: 64 + 67 ≥ N, each side or causal
    for causal in (False, True):
        assert attn.band(N, causal).whole and attn.band_shape(N, causal) == (3, 64, N)
        q, k, v = qkv(1, 3, N, 16, dtype=torch.float64, seed=N)
        out = attn(q, k, v, causal=causal)
        ref = attn.reference(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for g, r in zip(grads(out, (q, k, v, attn.z)), grads(ref, (q, k, v, attn.z))):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-8)
