"""xformers backend (``xformers``): ``xformers.ops.memory_efficient_attention`` with structured biases.

GPU only: on a CPU torch, xformers imports (warning that its extension did not load) and every
``memory_efficient_attention`` call raises NotImplementedError. xformers is imported lazily, so the
variants import and run without it.

The mappings onto the contract (docs/variants.md), for square N×N attention; each is checked
on CPU by ``bias.materialize((N, N))`` against the variant's own mask (tests/test_gpu_backends.py):
- full: no bias; causal = ``LowerTriangularMask()`` (j ≤ i).
- sliding_window, window w (one-sided, |i − j| ≤ w), dilation 1, no global tokens:
  non-causal = ``LocalAttentionFromBottomRightMask(window_left=w, window_right=w)``
  (allowed iff i − w ≤ j ≤ i + w; with N×N the bottom-right shift is 0);
  causal = ``LowerTriangularFromBottomRightLocalAttentionMask(w + 1)`` (i − w ≤ j ≤ i: xformers'
  window_size counts the diagonal, so w + 1, not w; the flash kernel gets window_left = w).
- blockwise local, block b: ``BlockDiagonalMask.from_seqlens`` over the batch flattened into the
  sequence, (B, N, H, D) → (1, B·N, H, D), with seqlens [b, …, b, N mod b] per batch element;
  causal = ``.make_causal()`` (j ≤ i inside each block, blocks start at multiples of b).
Windows are clamped to N − 1 (the same mask) to keep kernel arguments small. Layout: xformers takes
(B, N, H, D); scale = 1/√D is passed explicitly.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from .base import VariantError

_xops: Any = None
_failure: str | None = None  # why xformers did not import, once tried: a second attempt may fail otherwise


def xformers_ops():
    """``xformers.ops``, imported on first use; a one-line VariantError, saying why, where it does not
    import (not installed, or built for another torch or CUDA: any error of its import, not only
    ImportError)."""
    global _xops, _failure
    if _xops is None:
        if _failure is not None:
            raise VariantError(_failure)
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "xFormers can't load C++/CUDA extensions" on CPU torch
                import xformers.ops as xops
        except Exception as err:
            first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            _failure = f"backend 'xformers' needs the xformers package, which does not import: " \
                       f"{type(err).__name__}: {first}"
            raise VariantError(_failure) from err
        _xops = xops
    return _xops


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """None where xformers imports and, on a CUDA ``device``, runs; else why not, one line starting
    "backend 'xformers'". An xformers built for another torch or CUDA imports, warns that its extension
    did not load, and then has no kernel for any input: a one-call probe per device finds that out, and
    the backend is reported unavailable with xformers' own reason, never replaced by another kernel."""
    try:
        xops = xformers_ops()
    except VariantError as err:
        return str(err)
    if device is None or torch.device(device).type != "cuda":
        return None
    key = str(torch.device(device))
    if key not in _probed:
        try:
            _probe(xops, torch.device(device))
            _probed[key] = None
        except Exception as err:  # NotImplementedError ("no operator found"), or a CUDA error of the kernel
            _probed[key] = f"backend 'xformers' runs no kernel on {key}: {_why(err)}"
    return _probed[key]


_probed: dict[str, str | None] = {}  # device -> unavailable_reason, probed once per process


def _probe(xops, device: torch.device) -> None:
    """One forward call on a (1, 1, 1, 64) fp16 input, xformers' (B, N, H, D): every kernel it has takes it."""
    q = torch.zeros(1, 1, 1, 64, device=device, dtype=torch.float16)
    xops.memory_efficient_attention(q, q, q)


def _why(err: Exception) -> str:
    """xformers' reason in one line: its extension's load failure where it said one (the versions it was
    built for), else the distinct reasons its dispatcher gave for each kernel it refused."""
    import sys

    load = getattr(sys.modules.get("xformers._cpp_lib"), "_cpp_library_load_exception", None)
    if load is not None:  # "xFormers can't load C++/CUDA extensions. xFormers was built for: PyTorch ..."
        text = str(load).split("Please reinstall")[0]
    else:
        found = re.findall(r"is not supported because:\n((?:[ \t]{4,}\S.*(?:\n|$))+)", str(err))
        text = "; ".join(dict.fromkeys(line.strip() for block in found for line in block.splitlines() if line.strip()))
    text = " ".join(text.split()) or (str(err).strip().splitlines() or [""])[0]
    return f"memory_efficient_attention raised {type(err).__name__}: {text[:400]}"


# ----- biases ----------------------------------------------------------------------------------------
def causal_bias(causal: bool):
    return xformers_ops().fmha.attn_bias.LowerTriangularMask() if causal else None


def sliding_window_bias(window: int, seq_len: int, causal: bool):
    """|i − j| ≤ window (and j ≤ i under causal) on an N×N grid."""
    ab = xformers_ops().fmha.attn_bias
    w = min(window, max(seq_len - 1, 0))
    if causal:
        return ab.LowerTriangularFromBottomRightLocalAttentionMask(w + 1)
    return ab.LocalAttentionFromBottomRightMask(window_left=w, window_right=w)


def block_local_bias(batch: int, seq_len: int, block_size: int, causal: bool, device: torch.device | str):
    """Block-diagonal over the (1, B·N) flattened sequence: allowed = (i // b == j // b) inside each
    batch element, never across two. Cached: it holds small index tensors on ``device``."""
    return _block_local_bias(batch, seq_len, block_size, causal, str(torch.device(device)))


@lru_cache(maxsize=64)
def _block_local_bias(batch: int, seq_len: int, block_size: int, causal: bool, device: str):
    ab = xformers_ops().fmha.attn_bias
    b = min(block_size, seq_len)
    per_seq = [b] * (seq_len // b) + ([seq_len % b] if seq_len % b else [])
    bias = ab.BlockDiagonalMask.from_seqlens(per_seq * batch, device=torch.device(device))
    return bias.make_causal() if causal else bias


# ----- calls -----------------------------------------------------------------------------------------
def attention(q: Tensor, k: Tensor, v: Tensor, bias, scale: float) -> Tensor:
    """(B, H, N, D) in and out; xformers works on (B, N, H, D)."""
    out = xformers_ops().memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    attn_bias=bias, scale=scale)
    return out.transpose(1, 2)


def block_local_attention(q: Tensor, k: Tensor, v: Tensor, block_size: int, causal: bool, scale: float) -> Tensor:
    B, H, N, D = q.shape
    bias = block_local_bias(B, N, block_size, causal, q.device)
    flat = [t.transpose(1, 2).reshape(1, B * N, H, D) for t in (q, k, v)]  # (1, B·N, H, D)
    out = xformers_ops().memory_efficient_attention(*flat, attn_bias=bias, scale=scale)
    return out.reshape(B, N, H, D).transpose(1, 2)


def check_window_dtype(dtype: torch.dtype) -> None:
    """xformers' float32 kernel (cutlass) has no local-attention bias forward (non-causal) nor backward
    (causal; xformers/ops/fmha/cutlass.py), and its flash kernel takes only 16-bit floats: one line here
    instead of xformers' "no operator found" listing."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise VariantError(f"sliding_window: backend 'xformers' runs the window only in float16 or bfloat16; got "
                           f"{str(dtype).removeprefix('torch.')} (use dtype=float16|bfloat16, or backend flex, "
                           f"blocksparse or dense)")


def check_sliding_window(window: int, dilation: int, global_tokens: int) -> None:
    unsupported = [f"{n}={v}" for n, v, ok in (("dilation", dilation, dilation == 1),
                                                ("global_tokens", global_tokens, global_tokens == 0)) if not ok]
    if unsupported:
        raise VariantError(f"sliding_window: backend 'xformers' supports only dilation=1 and global_tokens=0; "
                           f"got {', '.join(unsupported)} (use backend flex, blocksparse or dense)")
