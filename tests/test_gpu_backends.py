"""GPU backends: FlexAttention (``flex``), xformers, pinned SDPA kernels and ``auto``.

On CPU (unmarked): FlexAttention forward, compiled, for every mask-defined variant against the float64
reference (CPU FlexAttention has no backward); the exact mapping of each xformers bias onto the
contract's mask, via ``bias.materialize`` (the off-by-one in window sizes is the classic bug); the
FlexAttention BlockMask built in strips equals ``create_block_mask``; asking for a GPU-only backend on
CPU is one clear line.

On GPU (``@pytest.mark.gpu``): every GPU backend of every variant, and the block-sparse engine (the
fallback of the mask-defined variants there), output and gradients, in bf16 and
fp16, causal and not, at N not a multiple of 128, under flash-attention's rule (its tests/test_flash_attn.py):
the backend's max abs error against the float64 reference is at most twice that of the naive
implementation in the same dtype, plus a floor of twice the error of rounding the reference, shifted
by 0.3, to that dtype (FA's ``fwd_atol = 2 * (out_ref + 0.3 - 0.3 - out_ref).abs().max()``): the
unavoidable error of storing a correct result in that dtype, about one ulp at magnitude 0.3 or the
largest one. The floor matters where the naive path is exact by accident (window 0: every row is one
value vector, and dq = dk = 0 exactly, where a fused backward leaves rounding residue).
"""

from __future__ import annotations

import pytest
import torch

import variants
from variants import VariantError, dense_attention, flex
from variants import xformers_backend as xf

from .conftest import qkv

# ----- CPU: FlexAttention forward ------------------------------------------------------------------
# One N for every compiled call: each new N, dtype, causal flag or mask_mod constant recompiles
# (about 5 s each on CPU, 8–16 s cold). 200 is not a multiple of FlexAttention's 128 (ragged last tile),
# nor of the 16-blocks of the sparse layouts.
FLEX_N = 200
FLEX_CASES = [
    ("sliding_window", {"window": 5}),
    ("sliding_window", {"window": 6, "dilation": 2, "global_tokens": 20}),  # global rows span two tiles' edge
    ("sparse", {"pattern": "fixed", "block_size": 16}),
    ("sparse", {"pattern": "strided", "block_size": 16, "stride": 3}),
    ("sparse", {"pattern": "bigbird", "block_size": 16}),
    ("blockwise", {"mode": "local", "block_size": 16}),
    ("blockwise", {"mode": "exact", "block_size": 16}),
]


def _id(name, o):
    return f"{name}-" + "-".join(f"{k}={v}" for k, v in o.items())


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name,options", FLEX_CASES, ids=[_id(*c) for c in FLEX_CASES])
def test_flex_forward_matches_reference_cpu(name, options, causal):
    attn = variants.build(name, **options)
    assert "flex" in attn.backend_names() and "flex" not in attn.available_backends("cpu")
    q, k, v = (t.detach().float() for t in qkv(1, 2, FLEX_N, 16, seed=3))
    out = flex.flex_forward(attn, q, k, v, causal)
    ref = attn.reference(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name,options", FLEX_CASES + [
    ("sliding_window", {"window": 0}),
    ("sliding_window", {"window": 300}),
    ("sliding_window", {"window": 20, "dilation": 3, "global_tokens": 130}),
    ("sparse", {"pattern": "bigbird", "block_size": 48, "window_blocks": 1, "global_blocks": 2, "random_blocks": 3}),
    ("blockwise", {"mode": "local", "block_size": 100}),
], ids=lambda x: str(x))
def test_flex_mask_mod_is_the_mask(name, options, causal):
    """The mask_mod on the whole grid (as create_block_mask evaluates it) equals the variant's mask, on the
    positions in the variant's engine_order (dilation) where it has one."""
    from torch.nn.attention.flex_attention import create_mask

    attn = variants.build(name, **options)
    for N in (97, 259):
        got = create_mask(flex.mask_mod(attn, N, causal, "cpu"), 1, 1, N, N, "cpu")[0, 0]
        order = attn.engine_order(N)
        want = attn.mask(N, causal) if order is None else attn.mask(N, causal)[order][:, order]
        assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("name,options", [("sparse", {"pattern": "fixed", "block_size": 16}),
                                          ("sparse", {"pattern": "bigbird", "block_size": 16}),
                                          ("sparse", {"pattern": "strided", "block_size": 48, "stride": 3})],
                         ids=lambda x: str(x))
def test_flex_layout_lookup_stays_in_its_table_over_the_padded_last_tile(name, options, causal):
    """A CUDA kernel evaluates the mask_mod on its last tile whole, indices up to the next multiple of
    BLOCK_SIZE past N (the kernel drops those scores itself); the layout lookup must read inside its
    table there (a read past it is out of bounds on the device). On CPU: the same mask_mod on that padded
    grid. A table of just the nb layout blocks passed every CPU test (create_mask stops at N)."""
    N = 200
    attn = variants.build(name, **options)
    padded = -(-N // flex.BLOCK_SIZE) * flex.BLOCK_SIZE
    i, j = torch.arange(padded)[:, None], torch.arange(padded)[None, :]
    got = flex.mask_mod(attn, N, causal, "cpu")(0, 0, i, j)  # IndexError if it reads past its table
    assert got.shape == (padded, padded) and torch.equal(got[:N, :N], attn.mask(N, causal))


def _captured_tensors(fn) -> list:
    """The tensors a function reads through its closure, followed into the functions it holds."""
    found, todo, seen = [], [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in f.__closure__ or ():
            x = cell.cell_contents
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif callable(x) and getattr(x, "__closure__", None) is not None:
                todo.append(x)
    return found


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_flex_blockwise_local_mask_mod_is_arithmetic_where_sparse_looks_up(causal):
    """Blockwise local's layout has a closed form, i // b == j // b: its mask_mod reads no tensor in the
    kernel (a table lookup there cost 13% at N=16K on an H100, docs/gpu.md). A layout without one (sparse)
    is looked up in the layout tensor."""
    local = variants.build("blockwise", mode="local", block_size=16)
    assert _captured_tensors(flex.mask_mod(local, 259, causal, "cpu")) == []
    sparse = variants.build("sparse", pattern="fixed", block_size=16)
    lookup = _captured_tensors(flex.mask_mod(sparse, 259, causal, "cpu"))
    assert [t.dtype for t in lookup] == [torch.bool]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_flex_dilated_window_computes_the_window_not_window_times_dilation(causal):
    """flex runs a dilated window in the engine's order too: its BlockMask's tiles are about those of the
    same window without dilation (they were ~d× as many: every d-th key of a w·d band)."""
    N, w = 4096, 64
    plain = flex.block_mask_stats(variants.build("sliding_window", window=w, global_tokens=8), N, causal)
    for d in (2, 8):
        dilated = flex.block_mask_stats(variants.build("sliding_window", window=w, dilation=d, global_tokens=8),
                                        N, causal)
        assert dilated["executed_pairs"] < 1.3 * plain["executed_pairs"], (d, dilated, plain)


@pytest.mark.parametrize("name,options,N,causal", [
    ("sliding_window", {"window": 40, "global_tokens": 3}, 700, False),
    ("sliding_window", {"window": 40, "dilation": 2}, 700, True),
    ("sparse", {"pattern": "bigbird", "block_size": 64}, 650, True),
    ("blockwise", {"mode": "exact"}, 300, True),
    ("blockwise", {"mode": "exact"}, 300, False),
], ids=lambda x: str(x))
def test_block_mask_in_strips_equals_create_block_mask(name, options, N, causal):
    attn = variants.build(name, **options)
    whole = flex.build_block_mask(attn, N, causal, "cpu")
    for chunk in (128 * N, 300 * N):  # strips of 128 and of 256 rows (the last one ragged)
        strips = flex.build_block_mask(attn, N, causal, "cpu", chunk_elements=chunk)
        assert strips.shape == whole.shape and strips.BLOCK_SIZE == whole.BLOCK_SIZE
        assert torch.equal(strips.to_dense(), whole.to_dense())
        for a, b in [(strips.kv_num_blocks, whole.kv_num_blocks), (strips.full_kv_num_blocks, whole.full_kv_num_blocks),
                     (strips.q_num_blocks, whole.q_num_blocks), (strips.full_q_num_blocks, whole.full_q_num_blocks)]:
            assert torch.equal(a, b)
    stats = flex.block_mask_stats(attn, N, causal)
    assert stats["partial_tiles"] + stats["full_tiles"] == int(whole.to_dense().sum())


def test_building_a_flex_variant_loads_the_compiler_outside_the_timed_set_up():
    """Importing torch._dynamo, which FlexAttention's create_mask needs, takes seconds once per process: it
    happens when a variant with the flex backend is built, not inside the first BlockMask's ``setup_s``
    (on an H100 it was 1.8–2.1 s of each flex row's, against 0.01–0.13 s for the same BlockMask built in
    a process that had it loaded)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, variants\n"
            "variants.build('sliding_window', window=4)\nprint('torch._dynamo' in sys.modules)\n"
            "variants.build('sliding_window', window=4, backend='flex')\nprint('torch._dynamo' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr[-2000:]


def test_flex_prepare_caches_block_mask_and_compiles_cpu():
    attn = variants.build(FLEX_CASES[2][0], **FLEX_CASES[2][1])  # the same mask_mod code as test_flex_forward: no new compile
    times = flex.prepare(attn, (1, 2, FLEX_N, 16), torch.float32, "cpu", causal=False)
    assert times.block_mask_s > 0 and times.compile_s > 0
    bm = flex.block_mask(attn, FLEX_N, False, "cpu")
    assert flex.block_mask(attn, FLEX_N, False, "cpu") is bm
    assert flex.prepare(attn, (1, 2, FLEX_N, 16), torch.float32, "cpu").block_mask_s < 0.05  # cached


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_flex_executed_pairs_on_a_device_are_its_block_mask_tiles(causal):
    """What the harness records once flex has run on a device: the BlockMask's tiles there; without a
    device (before measuring), the allowed pairs. adaptive_span's mask follows its reach."""
    N = 300  # 3 × 3 tiles of 128, the last one ragged
    for attn in (variants.build("sliding_window", window=5, backend="flex"),
                 variants.build("adaptive_span", max_span=300, init_span=10, backend="flex")):
        tiles = flex.block_mask_stats(attn, N, causal, "cpu")["executed_pairs"]
        assert tiles == (5 if causal else 7) * 128 * 128  # the diagonal band, causal: no tile above it
        assert attn.executed_pairs(N, causal, "cpu") == tiles
        assert attn.executed_pairs(N, causal) == attn.allowed_pairs(N, causal) < tiles
        assert attn.flops(2, 3, N, 16, causal, "cpu").executed == 4 * 2 * 3 * 16 * tiles
    with torch.no_grad():
        attn.z.fill_(300.0)  # reach past N: every tile (causal: those on and below the diagonal)
    assert attn.executed_pairs(N, causal, "cpu") == (6 if causal else 9) * 128 * 128


def test_compiled_backward_can_be_timed_on_a_retained_graph():
    """The harness times the backward alone as out.backward(grad, retain_graph=True) after a full
    forward+backward; torch's compiled backward refuses that while it donates its saved buffers, which
    compiled_flex_attention turns off (the mechanism, on CPU: flex has no backward here)."""
    import torch._functorch.config as functorch_config

    flex.compiled_flex_attention()
    assert functorch_config.donated_buffer is False
    f = torch.compile(lambda x, w: (x @ w).tanh() @ w, dynamic=False)  # saves the tanh: a donated buffer
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
    f(x, w).sum().backward()
    out = f(x, w)
    for _ in range(2):
        out.backward(torch.ones_like(out), retain_graph=True)


def test_flex_on_cpu_has_no_backward():
    attn = variants.build("sparse", pattern="fixed", block_size=16)
    q, k, v = (t.float() for t in qkv(1, 2, FLEX_N, 16, seed=3))  # requires grad
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex.flex_forward(attn, q, k, v)


# ----- CPU: xformers biases against the contract ------------------------------------------------------
def _allowed(bias, shape):
    return bias.materialize(shape, dtype=torch.float32, device="cpu") == 0  # 0 allowed, -inf not


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("window", [0, 1, 2, 5, 63, 64, 199, 200, 1000])
def test_xformers_sliding_window_bias_is_the_contract(window, causal):
    attn = variants.build("sliding_window", window=window)
    for N in (1, 97, 200):
        bias = xf.sliding_window_bias(window, N, causal)
        assert torch.equal(_allowed(bias, (N, N)), attn.mask(N, causal)), (window, N, causal)
        keys = attn.mask(N, causal).sum(1)
        assert int(keys.max()) == min(N, window + 1 if causal else 2 * window + 1)  # one-sided w


def test_xformers_sliding_window_bias_classes():
    """Which biases: the causal one is xformers' window_size = w + 1 (it counts the diagonal)."""
    ab = xf.xformers_ops().fmha.attn_bias
    b = xf.sliding_window_bias(7, 100, causal=True)
    assert type(b) is ab.LowerTriangularFromBottomRightLocalAttentionMask and b._window_size == 8
    b = xf.sliding_window_bias(7, 100, causal=False)
    assert type(b) is ab.LocalAttentionFromBottomRightMask and (b.window_left, b.window_right) == (7, 7)
    assert type(xf.causal_bias(True)) is ab.LowerTriangularMask and xf.causal_bias(False) is None


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("block_size", [1, 16, 64, 100, 200, 512])
@pytest.mark.parametrize("batch", [1, 3])
def test_xformers_block_local_bias_is_the_contract(block_size, batch, causal):
    """Batch flattened into the sequence, (1, B·N): block-diagonal per batch element, none across."""
    attn = variants.build("blockwise", mode="local", block_size=block_size)
    for N in (97, 200):
        bias = xf.block_local_bias(batch, N, block_size, causal, "cpu")
        want = torch.block_diag(*[attn.mask(N, causal)] * batch)
        assert torch.equal(_allowed(bias, (batch * N, batch * N)), want), (block_size, batch, N, causal)


def test_xformers_full_causal_bias_is_j_le_i():
    full = variants.build("full")
    assert torch.equal(_allowed(xf.causal_bias(True), (97, 97)), full.mask(97, causal=True))


def test_xformers_call_on_cpu_raises():
    """The documented fact this backend's needs_cuda rests on."""
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(NotImplementedError):
        xf.attention(q, q, q, None, 8 ** -0.5)


def test_xformers_that_does_not_import_is_unavailable_with_its_reason(monkeypatch):
    """An xformers whose import fails in any way (here: its extension raising as a wheel built for another
    CUDA can) is one line with the reason, and stays unavailable: a second import is not attempted."""
    import builtins
    import sys

    real_import, attempts = builtins.__import__, []

    def failing(name, *args, **kw):
        if name.startswith("xformers"):
            attempts.append(name)
            raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version\nsecond line")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(xf, "_xops", None)
    monkeypatch.setattr(xf, "_failure", None)
    monkeypatch.delitem(sys.modules, "xformers.ops", raising=False)
    monkeypatch.setattr(builtins, "__import__", failing)
    assert xf.unavailable_reason() == ("backend 'xformers' needs the xformers package, which does not import: "
                                       "RuntimeError: CUDA driver version is insufficient for CUDA runtime version")
    with pytest.raises(VariantError, match="does not import: RuntimeError"):
        xf.causal_bias(True)
    assert attempts == ["xformers.ops"]


NO_OPERATOR = """No operator found for `memory_efficient_attention_forward` with inputs:
     query       : shape=(1, 1, 1, 64) (torch.float16)
     attn_bias   : <class 'NoneType'>
`fa3F@0.0.0` is not supported because:
    xFormers wasn't build with CUDA support
    operator wasn't built - see `python -m xformers.info` for more info
`cutlassF-pt` is not supported because:
    xFormers wasn't build with CUDA support"""


@pytest.mark.parametrize("load_failure", [True, False], ids=["extension-not-loaded", "dispatcher-reasons"])
def test_xformers_that_runs_no_kernel_on_cuda_is_unavailable_with_its_reason(monkeypatch, load_failure):
    """Seen on an H100 with torch 2.11+cu130: the xformers wheel (built for torch 2.10+cu128) imports, and
    every call raises "no operator found". One probe call per device finds it; the backend is then
    unavailable there with xformers' reason (the versions its extension was built for, else its
    dispatcher's reasons), for every variant that offers it, and refused in one line."""
    import sys

    calls = []

    def probe(xops, device):
        calls.append(str(device))
        raise NotImplementedError(NO_OPERATOR)

    class LoadFailure(Exception):
        def __str__(self):
            return ("xFormers can't load C++/CUDA extensions. xFormers was built for:\n    PyTorch 2.10.0+cu128 with "
                    "CUDA 1208 (you have 2.11.0+cu130)\n    Python  3.10.19 (you have 3.12.3)\n  Please reinstall "
                    "xformers (see https://github.com/facebookresearch/xformers#installing-xformers)\n")

    xf.xformers_ops()  # imports here (CPU torch: its extension does not load, as there)
    monkeypatch.setattr(sys.modules["xformers._cpp_lib"], "_cpp_library_load_exception",
                        LoadFailure() if load_failure else None)
    monkeypatch.setattr(xf, "_probe", probe)
    monkeypatch.setattr(xf, "_probed", {})
    why = ("xFormers can't load C++/CUDA extensions. xFormers was built for: PyTorch 2.10.0+cu128 with CUDA 1208 "
           "(you have 2.11.0+cu130) Python 3.10.19 (you have 3.12.3)" if load_failure else
           "xFormers wasn't build with CUDA support; operator wasn't built - see `python -m xformers.info` for more info")
    reason = f"backend 'xformers' runs no kernel on cuda: memory_efficient_attention raised NotImplementedError: {why}"
    assert xf.unavailable_reason("cuda") == reason
    assert xf.unavailable_reason() is None  # imports: on CPU it is the "needs CUDA" of every GPU backend
    for name, options in [("full", {}), ("sliding_window", {"window": 4}), ("blockwise", {"mode": "local"})]:
        attn = variants.build(name, **options, backend="xformers")
        assert attn.available_backends("cuda") == [b for b in attn.backend_names() if b != "xformers"]
        assert attn.unavailable("xformers", "cuda") == reason
        error = attn.unavailable_error("xformers", "cuda")
        assert error.startswith(f"{name}: {reason}; available on cuda: ") and "\n" not in error
    assert variants.build("full").unavailable("xformers", "cpu") == "backend 'xformers' needs CUDA"
    assert calls == ["cuda"], "probed once per device and process"


# ----- CPU: asking for a GPU-only backend --------------------------------------------------------------
GPU_ONLY = [(name, o, b) for name, o in [("full", {}), ("blockwise", {"mode": "exact"}), ("blockwise", {"mode": "local"}),
                                          ("sliding_window", {"window": 4}), ("sparse", {}), ("adaptive_span", {})]
            for b, needs_cuda in variants.build(name, **o).backends.items()
            if needs_cuda and b in variants.build(name, **o).backend_names()]


@pytest.mark.parametrize("name,options,backend", GPU_ONLY, ids=lambda x: str(x))
def test_gpu_only_backend_on_cpu_is_one_clear_line(name, options, backend):
    attn = variants.build(name, **options, backend=backend)
    q, k, v = (t.detach() for t in qkv(1, 2, 16, 8, dtype=torch.float32))
    with pytest.raises(VariantError, match=f"{name}: backend '{backend}' needs CUDA; available on cpu: ") as err:
        attn(q, k, v)
    assert "\n" not in str(err.value)


def test_backend_sets():
    assert {b for _, _, b in GPU_ONLY} == {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "xformers", "auto", "flex"}
    full = variants.build("full")
    assert full.backend == "sdpa" and "sdpa_math" in full.available_backends("cpu")
    assert variants.build("blockwise").backend == "online"
    assert variants.build("sliding_window").backend == "blocksparse"
    assert variants.build("sparse").backend == "blocksparse"
    # xformers only where its bias is the pattern: a plain band, or block-diagonal.
    assert "xformers" not in variants.build("sliding_window", dilation=2).backend_names()
    assert "xformers" not in variants.build("sliding_window", global_tokens=1).backend_names()
    assert "xformers" not in variants.build("blockwise", mode="exact").backend_names()
    assert "xformers" not in variants.build("sparse").backend_names()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_xformers_sliding_window_refuses_a_dtype_its_kernels_lack(dtype):
    with pytest.raises(VariantError, match=f"backend 'xformers' runs the window only in float16 or bfloat16; "
                                           f"got {str(dtype).removeprefix('torch.')}") as err:
        xf.check_window_dtype(dtype)
    assert "\n" not in str(err.value)
    xf.check_window_dtype(torch.float16)
    xf.check_window_dtype(torch.bfloat16)


@pytest.mark.parametrize("options,named", [
    ({"dilation": 2}, "dilation=2"),
    ({"global_tokens": 3}, "global_tokens=3"),
    ({"dilation": 3, "global_tokens": 1}, "dilation=3, global_tokens=1"),
])
def test_xformers_sliding_window_refuses_dilation_and_global_tokens(options, named):
    with pytest.raises(VariantError, match=f"backend 'xformers' supports only dilation=1 and global_tokens=0; "
                                           f"got {named}") as err:
        variants.build("sliding_window", window=8, backend="xformers", **options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_sdpa_math_on_cpu_matches_reference(dtype, causal):
    from .test_variants import assert_matches_reference

    attn = variants.build("full", backend="sdpa_math")
    assert_matches_reference(attn, 97, causal, dtype)
    assert attn.last_backend == "sdpa_math"


def _sdpa_kernel_seen(attn, q, k, v, causal):
    """backend_ran after a forward+backward of unpinned sdpa, and the kernel ops the profiler saw run."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    ran = {}
    for only in (None, SDPBackend.MATH):
        with torch.profiler.profile() as prof, sdpa_kernel([only]) if only else nullcontext():
            attn(q, k, v, causal=causal).sum().backward()
        if q.is_cuda:
            torch.cuda.synchronize()
        ops = {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_") or
               e.name.startswith("aten::_efficient_attention") or e.name.startswith("aten::_flash_attention")}
        ran[only] = attn.backend_ran, ops
    return ran


OPS_OF = {"sdpa_flash": "flash", "sdpa_efficient": "efficient", "sdpa_cudnn": "cudnn", "sdpa_math": "math"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unpinned_sdpa_records_the_kernel_that_ran(device):
    """full's default backend lets SDPA choose: backend_ran names the kernel it chose, as the profiler
    saw it run (the CPU flash kernel here; on an H100 in fp16 a fused one), under any sdpa_kernel
    context (MATH only: sdpa_math)."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    attn = variants.build("full")
    for causal in (False, True):
        q, k, v = qkv(2, 4, 300, 64, dtype=dtype, device=device, seed=int(causal))
        ran = _sdpa_kernel_seen(attn, q, k, v, causal)
        for only, (backend_ran, ops) in ran.items():
            assert backend_ran in OPS_OF and any(OPS_OF[backend_ran] in op for op in ops), (only, backend_ran, ops)
            others = [op for op in ops if any(w in op for b, w in OPS_OF.items() if b != backend_ran)]
            assert not others, (only, backend_ran, ops)
        assert ran[torch.nn.attention.SDPBackend.MATH][0] == "sdpa_math"
        if device == "cuda":
            assert ran[None][0] != "sdpa_math", ran  # a fused kernel on an H100 in fp16


# ----- GPU: every GPU backend against the float64 reference -----------------------------------------
GPU_CASES = [
    ("full", {}),
    ("blockwise", {"mode": "exact", "block_size": 128}),
    ("blockwise", {"mode": "local", "block_size": 128}),
    ("blockwise", {"mode": "local", "block_size": 100}),  # blocks cross FlexAttention's 128-tiles
    ("sliding_window", {"window": 64}),
    ("sliding_window", {"window": 0}),
    ("sliding_window", {"window": 32, "dilation": 2, "global_tokens": 40}),
    ("sparse", {"pattern": "fixed", "block_size": 64}),
    ("sparse", {"pattern": "strided", "block_size": 64}),
    ("sparse", {"pattern": "bigbird", "block_size": 64}),
]
GPU_LENGTHS = (1000, 1537)  # not multiples of 128 (nor of 64 or 100)
ERROR_FACTOR = 2.0
ENGINE = ("blocksparse", "online")  # variants/blocksparse.py: mask-defined variants, blockwise exact


def gpu_params():
    for name, o in GPU_CASES:
        attn = variants.build(name, **o)
        for backend in attn.backend_names():
            if not attn.backends[backend] and backend not in ("sdpa", "sdpa_math", *ENGINE):
                continue  # CPU backends: tested on CPU; unpinned SDPA picks another kernel on CUDA, and the engine is the GPU fallback too
            # FlexAttention compiles per (N, dtype, causal, mask): the second N only where it adds most.
            lengths = GPU_LENGTHS if backend != "flex" or (name, o) == ("sliding_window", {"window": 64}) else (1000,)
            for N in lengths:
                yield pytest.param(name, o, backend, N, id=f"{_id(name, o)}-{backend}-N{N}")


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


def _floor(ref, dtype):
    """Twice the rounding error of storing the reference in ``dtype``, taken at magnitude 0.3 and up
    (FA's ``+ 0.3 - 0.3``): where the exact result is 0 (window 0: dq = dk = 0) rounding it is exact, but
    a correct fused backward still leaves rounding residue (dS = P∘(dO·Vᵀ − rowsum(dO∘O)))."""
    shifted = ref + 0.3
    return 2 * (shifted.to(dtype).double() - shifted).abs().max().item()


def assert_fa_rule(checks, dtype, naive="naive") -> None:
    """Flash-attention's rule for each (what, got, float64 reference, naive path in ``dtype``) of
    ``checks``: the max error against the reference at most ERROR_FACTOR times the naive path's, plus
    the rounding floor."""
    for what, g, w, n in checks:
        err, err_naive, floor = _err(g, w), _err(n, w), _floor(w.double(), dtype)
        assert err <= ERROR_FACTOR * err_naive + floor, (
            f"{what}: max error {err:.3e} > {ERROR_FACTOR} x {naive} {err_naive:.3e} + floor {floor:.3e}")


def assert_half_within_fa_rule(attn, masked, q, k, v, out, causal, label: str = "") -> None:
    """``out = attn(q, k, v, causal=causal)`` in half precision, and its dq, dk, dv, within flash-attention's
    rule against ``attn.reference`` in float64; the naive path is dense attention in the same dtype over
    the mask and scale of ``masked`` (the variant itself, or the one a wrapper runs)."""
    dtype, N, D = q.dtype, q.shape[-2], q.shape[-1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attn.reference(q64, k64, v64, causal=causal)
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = dense_attention(qn, kn, vn, masked.mask(N, causal).to(q.device), masked.scale(D))
    assert out.shape == ref.shape and out.dtype == dtype and out.device == q.device, label
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(q.device)
    got = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), dout)
    naive_g = torch.autograd.grad(naive, (qn, kn, vn), dout.to(dtype))
    assert_fa_rule([(f"{label}out", out, ref, naive)]
                   + [(f"{label}{w}", g, r, b) for w, g, r, b in zip(("dq", "dk", "dv"), got, want, naive_g)], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,options,backend,N", list(gpu_params()))
def test_gpu_backend_matches_reference(name, options, backend, N, dtype, causal):
    attn = variants.build(name, **options, backend=backend)
    if (reason := attn.unavailable(backend, "cuda")) is not None:
        pytest.skip(reason)  # reported unavailable (xformers built for another torch or CUDA), with the reason
    B, H, D = 2, 4, 64
    q, k, v = qkv(B, H, N, D, dtype=dtype, seed=N, device="cuda")
    try:
        out = attn(q, k, v, causal=causal)
    except VariantError as err:
        if "has no kernel" in str(err):
            pytest.skip(str(err))  # a capability fact (e.g. cudnn on this shape), not a wrong result
        raise
    assert_half_within_fa_rule(attn, attn, q, k, v, out, causal)
    if name == "full":  # what ran: auto's choice, unpinned SDPA's kernel (by torch's rule), else the one pinned
        ran = {"auto": (*variants.full.AUTO_CANDIDATES, variants.full.AUTO_FALLBACK), "sdpa": (*variants.full.SDPA_KERNELS, "sdpa")}
        assert attn.last_backend in ran.get(backend, (backend,))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_sdpa_in_half_precision_matches_reference(device, dtype):
    """linear's sdpa (on CUDA a fused kernel over the k projected keys) against the float64 reference,
    under the rule above: the naive implementation in the same dtype is linear's math path (the same
    projections, softmax written out). Non-causal only: linear refuses causal."""
    attn = variants.build("linear", proj_dim=96, max_seq_len=2048, backend="sdpa").to(device)
    naive = variants.build("linear", proj_dim=96, max_seq_len=2048, backend="math").to(device)
    q, k, v = qkv(2, 4, 1000, 64, dtype=dtype, seed=3, device=device)
    out = attn(q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attn.reference(q64, k64, v64)
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    base = naive(qn, kn, vn)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    # and the projections' gradients (E, F: trained), float32 parameters behind the cast to ``dtype``
    got = torch.autograd.grad(out, (q, k, v, attn.E, attn.F), dout.to(dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64, attn.E, attn.F), dout)
    base_g = torch.autograd.grad(base, (qn, kn, vn, naive.E, naive.F), dout.to(dtype))
    assert out.dtype == dtype and attn.backend_ran == "sdpa"
    assert torch.equal(attn.E, naive.E) and torch.equal(attn.F, naive.F)
    assert_fa_rule([("out", out, ref, base)] + list(zip(("dq", "dk", "dv", "dE", "dF"), got, want, base_g)), dtype, "math")


@pytest.mark.gpu
def test_auto_picks_once_and_records():
    attn = variants.build("full", backend="auto")
    q, k, v = qkv(2, 4, 1000, 64, dtype=torch.bfloat16, device="cuda")
    attn(q, k, v, causal=True).sum().backward()
    (key, choice), = attn.auto_choices.items()
    assert attn.last_backend == choice and choice in variants.full.AUTO_CANDIDATES
    assert key == ((2, 4, 1000, 64), torch.bfloat16, True, "cuda:0", True)
    assert isinstance(attn.auto_timings[key][choice], float)
    assert attn.auto_timings[key][choice] == min(t for t in attn.auto_timings[key].values() if isinstance(t, float))
    timings = dict(attn.auto_timings)
    attn(q, k, v, causal=True)  # same signature: no new timing
    assert attn.auto_timings == timings and attn.last_backend == choice
    with torch.no_grad():
        attn(q, k, v, causal=True)  # forward only: timed on its own
    assert len(attn.auto_choices) == 2


@pytest.mark.gpu
def test_flex_prepare_then_no_recompile():
    from torch._dynamo.utils import counters

    attn = variants.build("sliding_window", window=64, backend="flex")
    shape = (2, 4, 1000, 64)
    times = flex.prepare(attn, shape, torch.bfloat16, "cuda", causal=True)
    assert times.block_mask_s > 0 and times.compile_s > 0
    graphs = counters["stats"]["unique_graphs"]
    q, k, v = qkv(*shape, dtype=torch.bfloat16, device="cuda")
    attn(q, k, v, causal=True).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs, "prepare must have compiled what the call runs"
    stats = flex.block_mask_stats(attn, 1000, True, "cuda")
    assert 0 < stats["tile_density"] < 1


@pytest.mark.gpu
def test_device_lost_is_false_until_a_sticky_error_then_true():
    """harness.memory.device_lost, which stops a run after a sticky CUDA error (an out-of-bounds index is
    a device-side assert): probed in its own process, whose CUDA context the error ruins."""
    import subprocess
    import sys

    code = ("import torch\nfrom harness.memory import device_lost\nd = torch.device('cuda')\nprint(device_lost(d))\n"
            "try:\n    torch.zeros(4, device=d)[torch.tensor([10], device=d)].sum().item()\n"
            "except Exception as e:\n    print(type(e).__name__)\nprint(device_lost(d))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0] == "False" and out[-1] == "True", out
