"""reformer (shared-QK LSH attention) against its definition, and against a second, slow oracle: one
query, one round at a time, written here from the paper's algorithm given the variant's rotations."""

from __future__ import annotations

import math

import pytest
import torch

import variants
from harness.quality.fidelity import fidelity
from variants import VariantError
from variants.base import dense_attention
from variants.reformer import Reformer

from .conftest import qkv
from .test_memory_scaling import fwd_bwd_peak


# ----- the slow oracle ------------------------------------------------------------------------------
def loop_buckets(q, R):
    """bucket_t(i) = argmax([q_i R ; −q_i R]), the first index among equal maxima, one row at a time.
    q: (N, D) float64; R: (D, n/2) → list of ints."""
    out = []
    for row in q:
        x = [float(v) for v in row @ R.double()]
        scores = x + [-v for v in x]
        best = max(scores)
        out.append(scores.index(best))  # list.index: the first occurrence
    return out


def loop_sets(q, R, c, causal):
    """For one (batch, head): per query i, {j: number of rounds whose set has j} (before causal and
    the self rule), as the paper's algorithm states them."""
    N = q.shape[0]
    n_c = math.ceil(N / c)
    found = [dict() for _ in range(N)]
    for t in range(R.shape[0]):
        b = loop_buckets(q, R[t])
        order = sorted(range(N), key=lambda i: (b[i], i))  # sort by (bucket, position)
        chunk = {pos: rank // c for rank, pos in enumerate(order)}
        for i in range(N):
            for j in range(N):
                if chunk[j] == chunk[i] or chunk[j] == (chunk[i] - 1) % n_c:
                    found[i][j] = found[i].get(j, 0) + 1
    return found


def loop_attention(attn, q, v, causal, multiset=False):
    """Row i: softmax over P(i) of q_i·k̂_j/√D, times v. ``multiset``: each key weighted by the number of
    rounds that found it (what the union must NOT compute; used to show a case discriminates)."""
    B, H, N, D = q.shape
    q, v = q.double(), v.double()
    R = attn.rotations(H, D, attn.num_buckets(N))  # (r, H, D, n/2): the variant's own rotations
    rows = []
    for b in range(B):
        for h in range(H):
            khat = q[b, h] / q[b, h].norm(dim=-1, keepdim=True).clamp(min=1e-12)  # a zero q: a zero key
            sets = loop_sets(q[b, h].detach(), R[:, h], attn.options.bucket_size, causal)
            for i in range(N):
                keys = {j: n for j, n in sets[i].items() if (j <= i or not causal) and j != i}
                if not keys:
                    keys = {i: 1}  # itself, only when nothing else is allowed
                js = sorted(keys)
                s = torch.stack([q[b, h, i] @ khat[j] for j in js]) / math.sqrt(D)
                if multiset:
                    s = s + torch.tensor([math.log(keys[j]) for j in js], dtype=s.dtype)
                p = torch.softmax(s, dim=0)
                rows.append(sum(p[t] * v[b, h, j] for t, j in enumerate(js)))
    return torch.stack(rows).view(B, H, N, D)


def grads(out, q, v, upstream):
    return torch.autograd.grad(out, (q, v), upstream.to(out.dtype))


def assert_close(got, want, tol):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


# ----- the definition, two ways ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["lsh", "dense"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("N,options", [
    (50, {"bucket_size": 8, "n_hashes": 1}),
    (50, {"bucket_size": 8, "n_hashes": 3}),
    (37, {"bucket_size": 8, "n_hashes": 3, "n_buckets": 2}),  # two buckets: many keys in several rounds
    (13, {"bucket_size": 8, "n_hashes": 2}),  # two chunks: the look-back wraps onto the other
    (6, {"bucket_size": 8, "n_hashes": 2}),  # one chunk, shorter than bucket_size
], ids=str)
def test_matches_the_loop_oracle(N, options, causal, backend):
    attn = variants.build("reformer", backend=backend, **options)
    q, k, v = qkv(1, 2, N, 8, dtype=torch.float32, seed=N)
    out = attn(q, k, v, causal=causal)
    q64, v64 = (t.detach().double().requires_grad_() for t in (q, v))
    want = loop_attention(attn, q64, v64, causal)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert_close(out, want, 2e-5)
    for g, w in zip(grads(out, q, v, up), grads(want, q64, v64, up)):
        assert_close(g, w, 2e-5)


def test_buckets_are_the_loop_argmax():
    attn = variants.build("reformer", bucket_size=4, n_hashes=3, n_buckets=6)
    q = qkv(2, 2, 40, 8, dtype=torch.float64)[0].detach()
    got = attn.buckets(q)  # (B, H, r, N)
    R = attn.rotations(2, 8, 6)
    for b in range(2):
        for h in range(2):
            for t in range(3):
                assert got[b, h, t].tolist() == loop_buckets(q[b, h], R[t, h])
    assert got.min() >= 0 and got.max() < 6 and len(got.unique()) > 3


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_a_key_found_in_two_rounds_counts_once(causal):
    """With two buckets and three rounds most keys are found by one, two or three rounds. The output is
    the softmax over the set (each key once); weighting by the rounds that found a key (skipping the
    paper's log N_ij correction) gives another function, and the case is strong enough to tell."""
    N, c = 37, 8
    attn = variants.build("reformer", bucket_size=c, n_hashes=3, n_buckets=2)
    q, k, v = qkv(1, 2, N, 8, dtype=torch.float64, seed=5)
    R = attn.rotations(2, 8, 2)
    counts = [n for h in range(2) for row in loop_sets(q[0, h].detach(), R[:, h], c, causal) for n in row.values()]
    assert {1, 2, 3} <= set(counts), "keys found by one, two and three rounds"
    out = attn(q, k, v, causal=causal)
    assert_close(out, attn.reference(q, k, v, causal), 1e-10)
    assert_close(out, loop_attention(attn, q, v, causal), 1e-10)
    wrong = loop_attention(attn, q, v, causal, multiset=True)
    assert (out - wrong).abs().max() > 1e-3, "counting duplicates twice must change the output"


def test_identical_rounds_equal_one_round():
    """Every pair found by both rounds: the union is one round's set."""
    one = variants.build("reformer", bucket_size=8, n_hashes=1)
    two = variants.build("reformer", bucket_size=8, n_hashes=2)
    q, k, v = qkv(1, 2, 45, 8, dtype=torch.float64, seed=3)
    nb = two.num_buckets(45)
    R = one.rotations(2, 8, nb)
    two.set_rotations(torch.cat([R, R]))  # round 2 = round 1
    for causal in (False, True):
        assert_close(two(q, k, v, causal=causal), one(q, k, v, causal=causal), 1e-12)


# ----- the self rule, ties, shared QK ------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["lsh", "dense"])
def test_self_only_when_nothing_else(backend):
    attn = variants.build("reformer", bucket_size=8, n_hashes=2, backend=backend)
    N = 40
    q, k, v = (t.detach() for t in qkv(1, 2, N, 8, dtype=torch.float64, seed=1))
    # Causal position 0 may see only itself: its output is v_0, whatever q is.
    out = attn(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=0, atol=1e-15)
    # Elsewhere a query never sees itself (N ≥ 2, bidirectional: its chunk or the one before has others):
    # changing v_i leaves row i as it was, and changes other rows that find i.
    i = 17
    v2 = v.clone()
    v2[:, :, i] += 100.0
    out, out2 = attn(q, k, v), attn(q, k, v2)
    torch.testing.assert_close(out2[:, :, i], out[:, :, i], rtol=0, atol=1e-12)
    assert (out2 - out).abs().amax() > 1.0
    # Causal rows whose set holds no earlier key fall back on themselves, as the reference says.
    alone = ~(attn.allowed_set(q, causal=True) & ~torch.eye(N, dtype=torch.bool)).any(-1)  # (B, H, N)
    assert alone[:, :, 0].all() and int(alone.sum()) >= 2
    out = attn(q, k, v, causal=True)
    torch.testing.assert_close(out[alone], v[alone], rtol=0, atol=1e-12)


def test_ties_in_the_argmax_take_the_first_bucket():
    attn = variants.build("reformer", bucket_size=4, n_hashes=2, n_buckets=8)
    N, D = 30, 8
    q, k, v = qkv(1, 2, N, D, dtype=torch.float64, seed=4)
    q = q.detach().clone()
    q[:, :, [3, 11, 12, 20]] = 0.0  # every entry of [qR ; −qR] is 0: a tie everywhere, bucket 0
    q[:, :, 25] = 2.0 * q[:, :, 7]  # the same bucket as position 7: sorted by position
    b = attn.buckets(q)
    assert (b[:, :, :, [3, 11, 12, 20]] == 0).all()
    assert torch.equal(b[:, :, :, 25], b[:, :, :, 7])
    # Rotations whose first two columns are equal: q·R_0 = q·R_1 exactly, so bucket 1 never wins.
    R = attn.rotations(2, D, 8).clone()
    R[..., 1] = R[..., 0]
    attn.set_rotations(R)
    b = attn.buckets(q)
    assert not (b == 1).any() and not (b == 5).any() and (b == 0).any()
    for h in range(2):
        for t in range(2):
            assert b[0, h, t].tolist() == loop_buckets(q[0, h], R[t, h])
    q.requires_grad_()
    for causal in (False, True):
        out = attn(q, k, v, causal=causal)
        assert torch.isfinite(out).all()
        assert_close(out, loop_attention(attn, q, v, causal), 1e-10)
        assert_close(out, attn.reference(q, k, v, causal), 1e-10)


def test_k_is_not_used():
    attn = variants.build("reformer", bucket_size=8)
    q, k, v = qkv(1, 2, 33, 8, dtype=torch.float64)
    out = attn(q, k, v, causal=True)
    torch.testing.assert_close(attn(q, torch.randn_like(k), v, causal=True), out, rtol=0, atol=0)
    out.sum().backward()
    assert k.grad is None and q.grad is not None and v.grad is not None


# ----- degenerate: one or two chunks see every key --------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("N", [1, 20, 32])  # bucket_size 16: n_c = 1, 2, 2
def test_one_or_two_chunks_equal_the_exact_counterpart(N, causal):
    attn = variants.build("reformer", bucket_size=16, n_hashes=2)
    q, k, v = qkv(2, 2, N, 8, dtype=torch.float64, seed=N)
    assert_close(attn(q, k, v, causal=causal), attn.exact_counterpart(8)(q, k, v, causal=causal), 1e-12)
    if N == 1:
        return  # dq is 0 in both: no relative error to take
    r = fidelity(attn, q.float(), k.float(), v.float(), causal, block_size=8)
    assert r["out_rel_err"] < 1e-5 and r["grad_rel_err"] < 1e-4 and r["mass_kept"] is None


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_a_bucket_far_past_n_costs_n_not_the_bucket(causal):
    """bucket_size ≥ N is one chunk of N positions (every key): tiles of N × N, not of c × c (c = 10^5 at
    N = 37 was planned as a 961 GB point and skipped), and the same function as a chunk of exactly N."""
    N = 37
    attn = variants.build("reformer", bucket_size=100_000, n_hashes=2)
    assert attn.executed_pairs(N) == 2 * N * N and attn.memory_bytes(1, 2, N, 8, 8, causal) < 2**20
    q, k, v = qkv(1, 2, N, 8, dtype=torch.float64, seed=3)
    want = variants.build("reformer", bucket_size=N, n_hashes=2)(q, k, v, causal=causal)
    assert_close(attn(q, k, v, causal=causal), want, 1e-12)
    assert_close(attn(q, k, v, causal=causal), attn.reference(q, k, v, causal=causal), 1e-12)


def test_analytic_memory_counts_the_rotations():
    """A large fixed n_buckets makes the rotations (n_hashes, H, D, n_buckets/2) the point's memory: the CPU
    budget's skip rule reads memory_bytes, which counted none of them (1.8 MB for 1 GiB at N=64)."""
    rotations = 4 * 2 * 4 * 64 * 2**19
    for backend in ("lsh", "dense"):
        attn = variants.build("reformer", n_buckets=2**20, backend=backend)
        assert attn.memory_bytes(1, 4, 64, 64) > rotations


def test_fidelity_is_against_the_counterpart():
    """At N > 2c the variant drops keys: its error is positive, and measured against full attention on
    k̂ with the self rule (a dense computation here), not against attention on the unused k."""
    attn = variants.build("reformer", bucket_size=8, n_hashes=2)
    q, k, v = (t.detach() for t in qkv(1, 2, 64, 8, dtype=torch.float64, seed=6))
    khat = q / q.norm(dim=-1, keepdim=True)
    allowed = ~torch.eye(64, dtype=torch.bool)
    exact = variants.dense_attention(q, khat, v, allowed, 1 / math.sqrt(8))
    r = fidelity(attn, q, k, v, False, block_size=16)
    out = attn(q, k, v)
    assert r["out_rel_err"] == pytest.approx(float((out - exact).norm() / exact.norm()), rel=1e-9)
    assert 0.05 < r["out_rel_err"] < 2


# ----- efficiency: no N×N on the lsh path, memory linear in N ----------------------------------------
def test_lsh_path_builds_no_dense_set(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("dense set built on the lsh path")

    monkeypatch.setattr(Reformer, "allowed_set", forbidden)
    q, k, v = qkv(1, 2, 200, 8, dtype=torch.float32)
    attn = variants.build("reformer", bucket_size=16, n_hashes=3)
    attn(q, k, v, causal=True).sum().backward()
    attn.flops(1, 2, 200, 8, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_slices_of_chunks_equal_the_whole_layout(monkeypatch, causal):
    """The lsh path attends a slice of chunks (every round) at a time, the backward recomputing each
    slice's tiles: one chunk per slice gives the output and the gradients of one slice for the whole
    layout, both equal to the float64 reference, N not a multiple of bucket_size; without gradients the
    same output."""
    import variants.reformer as reformer

    attn = variants.build("reformer", bucket_size=8, n_hashes=3)
    q, k, v = qkv(2, 2, 203, 8, dtype=torch.float64, seed=3)
    up = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    slices = []
    probabilities = reformer.probabilities
    monkeypatch.setattr(reformer, "probabilities", lambda *a: slices.append(a[0].shape[3]) or probabilities(*a))

    def run():
        out = attn(q, k, v, causal=causal)
        return (out, *grads(out, q, v, up))
    whole = run()
    assert slices == [26, 26]  # ⌈203 / 8⌉ chunks in one slice, forward and the backward's recomputation
    monkeypatch.setattr(reformer, "slice_elements", lambda device: 1)
    slices.clear()
    sliced = run()
    assert slices == [1] * 52
    q64, v64 = (t.detach().requires_grad_() for t in (q, v))
    want = attn.reference(q64, k, v64, causal)
    for got_whole, got_sliced, w in zip(whole, sliced, (want, *grads(want, q64, v64, up))):
        assert_close(got_sliced, got_whole, 1e-12)
        assert_close(got_sliced, w, 1e-10)
    with torch.no_grad():
        assert_close(attn(q, k, v, causal=causal), whole[0], 1e-12)


def test_backward_fills_each_input_gradient_once_whatever_the_slices(monkeypatch):
    """Many slices (one chunk each): the backward still zero-fills one (B, H, N + 1, D) gradient per
    padded input, not one per slice (autograd through each slice's gather would: O(N) per slice, O(N²)
    in all)."""
    import variants.reformer as reformer
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(reformer, "slice_elements", lambda device: 1)
    attn = variants.build("reformer", bucket_size=8, n_hashes=3)
    q, k, v = qkv(2, 2, 203, 8, seed=3)
    out = attn(q, k, v)
    assert attn.num_chunks(203) == 26
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward(torch.ones_like(out))
    full = [e for e in prof.events() if e.name == "aten::zero_" and e.input_shapes == [[2, 2, 204, 8]]]
    assert len(full) == 3, len(full)  # qs, k̂, vs (a gather's backward per slice: 3 · 26)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_lsh_in_half_precision_matches_the_reference(monkeypatch, device, dtype, causal):
    """The GPU benchmark's inputs (half precision; on CUDA there), in several slices: outputs and the
    gradients of q and v within twice the error of the dense path in that precision (plus the rounding
    floor) against the float64 reference, N not a multiple of bucket_size. Every call hashes in float64,
    so all see the same buckets: in another precision a near tie in q·R may fall the other way, which
    changes the set the definition picks, not the error of computing it."""
    import variants.reformer as reformer

    from .test_gpu_backends import assert_fa_rule

    hash_of = Reformer.buckets
    monkeypatch.setattr(Reformer, "buckets", lambda self, q: hash_of(self, q.detach().double()))
    monkeypatch.setattr(reformer, "slice_elements", lambda device: 2 * 4 * 2 * 32 * 64 * 5)  # 5 chunks a slice
    attn = variants.build("reformer", bucket_size=32, n_hashes=2)
    q, k, v = qkv(2, 4, 300, 64, dtype=dtype, seed=5, device=device)
    out = attn(q, k, v, causal=causal)
    q64, v64 = (t.detach().double().requires_grad_() for t in (q, v))
    ref = attn.reference(q64, k, v64, causal)
    qn, vn = (t.detach().clone().requires_grad_() for t in (q, v))
    naive = dense_attention(qn, reformer.normalise(qn), vn, attn.allowed_set(q64.detach(), causal), attn.scale(64))
    assert out.dtype == dtype and out.device.type == device
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    got, want, naive_g = grads(out, q, v, up), grads(ref, q64, v64, up), grads(naive, qn, vn, up)
    assert_fa_rule([("out", out, ref, naive)] + list(zip(("dq", "dv"), got, want, naive_g)), dtype, "dense")


@pytest.mark.parametrize("options", [{"bucket_size": 32}, {"bucket_size": 32, "n_hashes": 4, "n_buckets": 16}], ids=str)
def test_peak_memory_is_linear(options):
    """Measured (profiler allocation replay, as the harness does): forward+backward at N and 2N. The
    default n_buckets grows with N, so the hashing's temporaries are kept O(N) too."""
    attn = variants.build("reformer", **options)
    small, large = fwd_bwd_peak(attn, 512), fwd_bwd_peak(attn, 1024)
    assert 1.6 <= large / small <= 2.4, (small, large)
    analytic = attn.memory_bytes(1, 2, 512, 32)
    assert 0.5 < small / analytic < 2, (small, analytic)


# ----- facts, options --------------------------------------------------------------------------------
def test_facts():
    attn = variants.build("reformer", bucket_size=8, n_hashes=3)
    assert not attn.is_exact and attn.supports_causal and attn.mask(64) is None
    assert attn.backend == "lsh" and attn.available_backends("cpu") == ["lsh", "dense"]
    assert attn.num_buckets(100) == 2 * 13 and variants.build("reformer", n_buckets=6).num_buckets(100) == 6
    q = qkv(2, 2, 100, 8, dtype=torch.float64)[0].detach()
    for causal in (False, True):
        used = attn.allowed_set(q, causal).sum(dim=(-2, -1))  # (B, H) pairs per head
        assert (used <= attn.allowed_pairs(100, causal)).all(), "allowed_pairs is an upper bound"
        assert attn.executed_pairs(100, causal) == 3 * 13 * 8 * 16  # r · n_c · c · 2c, padding included
    f = attn.flops(1, 1, 100, 8)
    assert f.executed == 4 * 8 * 3 * 13 * 8 * 16 + 3 * 100 * 8 * 26 and f.useful == 4 * 8 * 100 * 48


def test_rotations_are_seeded_on_cpu():
    a, b, c = (variants.build("reformer", seed=s).rotations(4, 16, 10) for s in (0, 0, 1))
    assert a.shape == (2, 4, 16, 5) and a.device.type == "cpu" and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    expect = torch.randn(2, 4, 16, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, expect)


@pytest.mark.parametrize("options,expect", [
    ({"n_buckets": 5}, "n_buckets must be an even integer >= 2"),
    ({"n_buckets": 0}, "n_buckets must be an even integer >= 2"),
    ({"bucket_size": 0}, "bucket_size must be an integer > 0"),
    ({"n_hashes": 0}, "n_hashes must be an integer > 0"),
    ({"backend": "flex"}, "unknown backend 'flex'; allowed: lsh, dense"),
    ({"buckets": 4}, "unknown option 'buckets'; allowed: bucket_size, n_hashes, n_buckets, seed, backend"),
])
def test_bad_options(options, expect):
    with pytest.raises(VariantError, match=expect) as err:
        variants.build("reformer", **options)
    assert "\n" not in str(err.value)


# ----- inside the task's model ---------------------------------------------------------------------
def test_trains_inside_the_model_and_leaves_wk_unused():
    """The task's model projects k, but reformer never reads it: W_k gets no gradient, every other
    parameter does. With N ≤ 2c every key is in a query's chunk or the one before, so the model is
    strictly causal; beyond that the chunk boundaries depend on later positions (docs/variants.md)."""
    from harness.quality.model import TinyTransformer

    N = 28
    torch.manual_seed(0)
    model = TinyTransformer(vocab_size=16, max_seq_len=N, attention=lambda: variants.build("reformer", bucket_size=16),
                            d_model=16, n_layers=2, n_heads=2, short_conv=3)
    assert model.causal
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 16, (2, N), generator=gen)
    model(tokens).square().mean().backward()
    for name, p in model.named_parameters():
        if ".wk." in name:
            assert p.grad is None, name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    changed = tokens.clone()
    changed[:, 14:] = torch.randint(0, 16, (2, N - 14), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :14], model(tokens)[:, :14], rtol=0, atol=1e-6)


def test_rotations_are_copied_to_the_calls_device_and_dtype_once():
    """A call takes R where it runs from a copy kept per (device, dtype): a host-to-device copy per call
    would wait for the GPU's queue inside every timed call. set_rotations drops the copies (tested above)."""
    attn = variants.build("reformer", bucket_size=4, n_hashes=2)
    q = qkv(1, 2, 30, 8, dtype=torch.float64, seed=1)[0].detach()
    attn.buckets(q)
    kept = {key: id(R) for key, R in attn._rotations_on.items()}
    attn.buckets(q)
    assert len(kept) == 1 and {key: id(R) for key, R in attn._rotations_on.items()} == kept
    (R,) = attn._rotations_on.values()
    assert R.dtype == torch.float64 and torch.equal(R, attn.rotations(2, 8, attn.num_buckets(30)).double())
