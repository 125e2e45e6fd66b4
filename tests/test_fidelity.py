"""harness/quality/fidelity.py: exact variants score at rounding level, errors are caught, mass_kept is right."""

from __future__ import annotations

import pytest
import torch

import variants
from harness.quality.fidelity import INPUT_KINDS, fidelity, make_inputs, mass_kept, upstream_gradient
from variants.full import Full


def inputs(kind: str, N: int, D: int = 16, B: int = 1, H: int = 2, seed: int = 0, dtype=torch.float32):
    return make_inputs(kind, B, H, N, D, dtype, "cpu", torch.Generator().manual_seed(seed))


EXACT = [("full", {"backend": "math"}), ("full", {"backend": "sdpa"}), ("blockwise", {"block_size": 16}),
         ("blockwise", {"block_size": 37})]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("name,options", EXACT)
def test_exact_variants_at_rounding_level(name, options, kind, causal):
    q, k, v = inputs(kind, N=100)  # 100: not a multiple of any block size used
    r = fidelity(variants.build(name, **options), q, k, v, causal, block_size=32)
    assert r["out_rel_err"] < 1e-5
    assert r["grad_rel_err"] < 1e-4
    assert r["out_cos"] > 1 - 1e-9
    assert r["out_max_abs_err"] < 1e-4
    assert r["mass_kept"] == 1.0


class NoisyFull(Full):
    """Full attention plus a small output perturbation: must not pass as exact."""

    def _attend(self, q, k, v, causal, backend):
        out = super()._attend(q, k, v, causal, backend)
        return out + 1e-3 * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.001


class WrongGradFull(Full):
    """Exact forward, gradient of q off by 0.1%: only grad_rel_err can see it."""

    def _attend(self, q, k, v, causal, backend):
        return super()._attend(_ScaleGrad.apply(q), k, v, causal, backend)


def test_a_perturbed_output_fails_the_exact_bounds():
    q, k, v = inputs("gaussian", N=64)
    r = fidelity(NoisyFull(), q, k, v, causal=False, block_size=16)
    assert r["out_rel_err"] > 1e-3  # the output bound of the exact test (1e-5) would fail


def test_a_wrong_gradient_fails_the_exact_bounds():
    q, k, v = inputs("gaussian", N=64)
    r = fidelity(WrongGradFull(), q, k, v, causal=True, block_size=16)
    assert r["out_rel_err"] < 1e-5
    assert r["grad_rel_err"] > 5e-4  # the gradient bound of the exact test (1e-4) would fail


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["local", "gaussian"])
def test_mass_kept_rises_strictly_with_the_window(kind, causal):
    N = 256
    q, k, _ = inputs(kind, N=N, D=32)
    kept = [mass_kept(variants.build("sliding_window", window=w), q, k, causal, block_size=64) for w in (4, 16, 64)]
    assert 0 < kept[0] < kept[1] < kept[2] < 1
    for w in (N - 1, N, 2 * N):  # window >= N - 1 allows every pair
        assert mass_kept(variants.build("sliding_window", window=w), q, k, causal, block_size=64) == 1.0


MASKED = [("sliding_window", {"window": 5}), ("sliding_window", {"window": 3, "dilation": 2, "global_tokens": 3}),
          ("sparse", {"pattern": "fixed", "block_size": 8, "local_blocks": 2}),
          ("sparse", {"pattern": "strided", "block_size": 8, "stride": 3}),
          ("sparse", {"pattern": "bigbird", "block_size": 8, "random_blocks": 1}),
          ("blockwise", {"mode": "local", "block_size": 16})]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,options", MASKED)
def test_mass_kept_equals_a_dense_computation(name, options, causal):
    N = 70  # ragged against the chunk (16) and every block size
    q, k, _ = inputs("local", N=N, B=2, D=16, dtype=torch.float64)
    attn = variants.build(name, **options)
    scores = (q @ k.transpose(-2, -1)) * attn.scale(q.shape[-1])  # (B, H, N, N), independent of mass_kept
    if causal:
        scores = scores.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
    dense = float((scores.softmax(-1) * attn.mask(N, causal)).sum(-1).mean())
    assert mass_kept(attn, q, k, causal, block_size=16) == pytest.approx(dense, abs=1e-12)
    assert dense < 1.0  # every pattern here drops something, so the comparison is not trivially 1 == 1


@pytest.mark.parametrize("window", [4, 16, 32])
def test_sliding_window_error_is_positive_and_smaller_on_local_inputs(window):
    # Gaussian inputs spread attention over all N keys: the exact output is an average of many values
    # (norm ~ 1/√N) that a window of 2w+1 keys cannot reproduce, so the relative error is large (> 1).
    # Local inputs put most mass within a few dozen positions (≥ 99% within 32), so the windowed
    # output approaches the exact one as the window covers that range.
    attn = variants.build("sliding_window", window=window)
    errs = {}
    for kind in ("local", "gaussian"):
        q, k, v = inputs(kind, N=256, D=32)
        errs[kind] = fidelity(attn, q, k, v, causal=False, block_size=64)
    local, gaussian = errs["local"], errs["gaussian"]
    assert local["out_rel_err"] > 0 and local["grad_rel_err"] > 0
    assert local["out_rel_err"] < 0.5 * gaussian["out_rel_err"]
    assert local["grad_rel_err"] < gaussian["grad_rel_err"]
    assert local["mass_kept"] > gaussian["mass_kept"]
    if window == 32:
        assert local["mass_kept"] > 0.99 and local["out_rel_err"] < 0.05
        assert gaussian["out_rel_err"] > 1.0


def test_linear_has_no_mass_and_is_not_exact():
    q, k, v = inputs("gaussian", N=48)
    attn = variants.build("linear", proj_dim=8, max_seq_len=64)
    r = fidelity(attn, q, k, v, causal=False, block_size=16)
    assert r["mass_kept"] is None
    assert r["out_rel_err"] > 1e-2
    with pytest.raises(variants.VariantError, match="causal"):
        fidelity(attn, q, k, v, causal=True)


def test_local_inputs_concentrate_near_the_diagonal():
    q, k, _ = inputs("local", N=512, D=64, H=1)
    within_32 = mass_kept(variants.build("sliding_window", window=32), q, k, False, block_size=128)
    within_2 = mass_kept(variants.build("sliding_window", window=2), q, k, False, block_size=128)
    assert within_32 > 0.99
    assert within_2 < 0.6  # concentrated over a few dozen positions, not on the diagonal alone


def test_peaked_inputs_are_sharper_than_gaussian():
    def top_prob(kind):
        q, k, _ = inputs(kind, N=128, D=16, dtype=torch.float64)
        return float((q @ k.transpose(-2, -1) / 4).softmax(-1).amax(-1).mean())

    assert top_prob("peaked") > 3 * top_prob("gaussian")


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_make_inputs_is_deterministic_for_a_seed(kind):
    a = inputs(kind, N=32, seed=3)
    b = inputs(kind, N=32, seed=3)
    c = inputs(kind, N=32, seed=4)
    for x, y, z in zip(a, b, c):
        assert x.shape == (1, 2, 32, 16) and x.dtype == torch.float32
        assert torch.equal(x, y)
        assert not torch.equal(x, z)
    half = make_inputs(kind, 1, 2, 32, 16, torch.bfloat16, "cpu", torch.Generator().manual_seed(3))
    assert half[0].dtype == torch.bfloat16
    assert torch.equal(half[0], a[0].to(torch.bfloat16))


def test_make_inputs_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown input kind 'uniform'; allowed: gaussian, local, peaked"):
        make_inputs("uniform", 1, 1, 8, 8, torch.float32, "cpu", torch.Generator())
    with pytest.raises(ValueError, match="even head dim"):
        make_inputs("local", 1, 1, 8, 7, torch.float32, "cpu", torch.Generator())
    with pytest.raises(ValueError, match="N must be"):
        make_inputs("gaussian", 1, 1, 0, 8, torch.float32, "cpu", torch.Generator())


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_the_upstream_gradient_is_independent_of_inputs_drawn_with_the_same_seed(kind):
    """The harness draws q, k, v with the run's seed and passes that seed to fidelity as grad_seed: the
    upstream gradient must not repeat their draws (it once equalled q, and so inflated reformer's
    grad_rel_err by half)."""
    for seed in (0, 1, 7):
        q, k, v = make_inputs(kind, 2, 2, 256, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        up = upstream_gradient(q.shape, seed)
        assert up.shape == q.shape and torch.equal(up, upstream_gradient(q.shape, seed))  # fixed for a seed
        for t in (q, k, v):
            corr = torch.corrcoef(torch.stack([up.flatten(), t.flatten()]))[0, 1].abs().item()
            assert corr < 0.05, (kind, seed, corr)


def test_the_output_max_error_and_cosine_are_those_of_the_variants_output_against_the_exact_one():
    """out_max_abs_err is the largest |o - o_ref| (not a mean) and out_cos the cosine of o against o_ref (not of o
    with itself, which is 1 for any output): each checked against a direct computation on a perturbed output."""
    q, k, v = inputs("gaussian", N=64)
    attn = NoisyFull()
    r = fidelity(attn, q, k, v, causal=False, block_size=16)
    o = attn(q, k, v, causal=False).double()
    ref = variants.build("full", backend="math")(q.double(), k.double(), v.double(), causal=False)
    err = o - ref
    assert err.abs().max() > 2 * err.abs().mean()  # max and mean far apart, so either slip shows
    assert r["out_max_abs_err"] == pytest.approx(float(err.abs().max()), rel=1e-6)
    cos = float(torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0))
    assert cos < 1 - 1e-7  # the perturbation is visible in the cosine
    assert r["out_cos"] == pytest.approx(cos, abs=1e-12)


class HalvedFull(Full):
    """Full attention times 0.5: its output and every gradient half the exact ones."""

    def _attend(self, q, k, v, causal, backend):
        return 0.5 * super()._attend(q, k, v, causal, backend)


@pytest.mark.parametrize("causal", [False, True])
def test_the_relative_errors_are_over_the_exact_norms(causal):
    """out_rel_err is ‖o − o_ref‖ / ‖o_ref‖ and grad_rel_err the same of dq, dk, dv: over the exact norm. A
    variant at half the exact output (and so half each gradient) is 0.5 off in both; over its own norm it
    would read 1.0, and a variant shrinking its output would flatter itself. Exact in float64."""
    q, k, v = inputs("gaussian", N=50, dtype=torch.float64)
    r = fidelity(HalvedFull(backend="math"), q, k, v, causal=causal, block_size=16)
    assert r["out_rel_err"] == pytest.approx(0.5, rel=1e-9)
    assert r["grad_rel_err"] == pytest.approx(0.5, rel=1e-9)
