"""FlexAttention backend (``flex``) for every mask-defined variant: one compiled kernel, any mask.

The variant's element predicate ``allowed(i, j)`` (docs/variants.md; causality excluded)
becomes FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) = allowed(q_idx, kv_idx) [& kv_idx <= q_idx]``
(the causal rule, ``masks.causal_allowed``), on the positions in the variant's ``engine_order`` where it
has one (sliding_window with dilation: a w-wide band, not every d-th key of a w·d one),
and, through it, a ``BlockMask`` of 128×128 tiles: empty tiles are skipped, full tiles run without the
mask_mod, partial tiles (band edges, the ragged last block when N is not a multiple of 128) apply it
element by element. Layout-defined variants (sparse, blockwise local) look the block layout up in a
tensor on the inputs' device; blockwise exact has no element restriction (only the causal one).

Costs kept apart so the harness can log them outside its timed region:
- ``block_mask(attn, N, causal, device)`` builds the BlockMask once per (N, causal, device) and keeps
  it in the variant's ``block_masks`` (a ``BlockMasks``, declared by each variant with a flex backend).
  The variant's ``prepare`` calls it, and the harness times that apart as ``setup_s``.
  ``create_block_mask`` evaluates the mask on the whole N×N grid (with int64 temporaries); above
  ``CHUNK_ELEMENTS`` grid points it is evaluated in strips of query rows instead, so memory stays
  O(strip·N) and the BlockMask is the same.
- ``flex_attention`` is wrapped by ``torch.compile`` with ``dynamic=False`` once per process, when the
  first variant with the flex backend is built (importing torch's compiler takes seconds: in no timed
  set-up). One specialisation per (B, H, N, D, dtype, grad mode, mask_mod code and constants).
  ``prepare(...)`` here builds the BlockMask and runs one call (forward, and backward when asked) to
  trigger compilation, returning the seconds spent on each (the harness's warm-up does the same:
  ``setup_s``, then ``warmup_s``).

On CPU (torch 2.13) FlexAttention runs forward (compiled here) but has no backward: the ``flex``
backend is registered as needing CUDA, and ``flex_forward`` is the helper the CPU tests call on
inputs that do not require grad.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import Attention, VariantError, resolved
from .masks import causal_allowed, reordered

BLOCK_SIZE = 128  # FlexAttention's sparse block (tile) size, both query and key
CHUNK_ELEMENTS = 1 << 24  # above this many grid points (N > 4096), evaluate the mask in row strips

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_compiled: Any = None


def compiled_flex_attention():
    """``torch.compile(flex_attention, dynamic=False)``, built on first use and shared by every variant.

    Each (shape, dtype, mask_mod) combination is a recompilation of the same code object; torch's
    default limit (8) would silently drop later combinations to eager FlexAttention, which
    materialises the N×N scores and would make every later timing and memory figure meaningless.
    The limits are raised once here (a process-wide setting, fine in a benchmark process).
    Donated buffers are turned off too: a compiled backward that frees its saved intermediates (flex's
    logsumexp) refuses ``backward(retain_graph=True)``, which is how the harness times the backward alone.
    """
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo_config
        import torch._functorch.config as functorch_config
        from torch.nn.attention.flex_attention import flex_attention

        functorch_config.donated_buffer = False

        for names, floor in ((("recompile_limit", "cache_size_limit"), 1024),
                             (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 8192)):
            name = next(n for n in names if hasattr(dynamo_config, n))  # newer name first (older torch)
            if getattr(dynamo_config, name) < floor:
                setattr(dynamo_config, name, floor)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


# ----- mask_mod and BlockMask ------------------------------------------------------------------------
def mask_mod(attn: Attention, seq_len: int, causal: bool, device: torch.device | str) -> MaskMod:
    """FlexAttention mask_mod of a mask-defined variant: allowed(q_idx, kv_idx), and kv_idx <= q_idx
    under causal. Every tensor it reads lives on ``device`` (it runs inside the compiled kernel)."""
    pred, order = attn.predicate(seq_len, causal), attn.engine_order(seq_len)
    if pred is None:
        # Layout-defined (sparse, blockwise): the layout's arithmetic rule where it has one (blockwise
        # local), else a lookup in the block layout, moved to the device once.
        layout = attn.layout(seq_len, causal) if order is None else attn.engine_layout(seq_len, causal)
        if not bool(layout.all()):  # all-true (blockwise exact): no element restriction
            pred = (attn.layout_rule(seq_len) if order is None else None) or \
                _layout_lookup(layout, attn.engine_block_size(seq_len), seq_len, device)
    elif order is not None:  # the kernel runs the positions in engine_order (flex_forward reorders q, k, v)
        pred = reordered(pred, order.to(device))

    # Only the terms this call needs: the kernel evaluates the mask_mod on every element of a partial tile,
    # so a term that allows everything still costs arithmetic there. Causal and not are two compilations.
    if pred is None:
        if not causal:
            from torch.nn.attention.flex_attention import noop_mask
            return noop_mask

        def causal_only(b_idx, h_idx, q_idx, kv_idx):
            return causal_allowed(q_idx, kv_idx)
        return causal_only
    if not causal:
        def allowed(b_idx, h_idx, q_idx, kv_idx):
            return pred(q_idx, kv_idx)
        return allowed

    def allowed_causal(b_idx, h_idx, q_idx, kv_idx):
        return pred(q_idx, kv_idx) & causal_allowed(q_idx, kv_idx)
    return allowed_causal


def _layout_lookup(layout: Tensor, b: int, seq_len: int, device: torch.device | str):
    """allowed(i, j) = layout[i // b, j // b], with the layout padded by False blocks so that indices in
    the kernel's padded last tile (up to the next multiple of BLOCK_SIZE) never read out of bounds."""
    nb = layout.shape[0]
    covered = math.ceil(seq_len / BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE  # a spare tile, for safety
    n = max(nb, math.ceil(covered / b))
    lay = torch.zeros(n, n, dtype=torch.bool)
    lay[:nb, :nb] = layout
    lay = lay.to(device)

    def allowed(i: Tensor, j: Tensor) -> Tensor:
        return lay[i // b, j // b]

    return allowed


def _create_block_mask_in_strips(mod: MaskMod, seq_len: int, device: torch.device, rows: int):
    """Same BlockMask as ``create_block_mask(mod, None, None, N, N, device, BLOCK_SIZE)``, evaluating
    the mask ``rows`` query rows at a time (``rows`` a multiple of BLOCK_SIZE)."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    N, bs = seq_len, BLOCK_SIZE
    nb = -(-N // bs)
    partial, full = [], []
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)

        def shifted(b_idx, h_idx, q_idx, kv_idx, r0=r0):
            return mod(b_idx, h_idx, q_idx + r0, kv_idx)

        m = create_mask(shifted, 1, 1, r1 - r0, N, device)[0, 0]  # (r1 - r0, N) bool
        # Pad with False to whole tiles (as create_block_mask does: a ragged tile is never full).
        m = torch.nn.functional.pad(m, (0, nb * bs - N, 0, -(r1 - r0) % bs))
        counts = m.view(-1, bs, nb, bs).sum(dim=(1, 3))  # (tiles in strip, nb)
        full.append(counts == bs * bs)
        partial.append((counts > 0) & (counts < bs * bs))
        del m

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
        dense = dense.to(torch.int32)[None, None]  # (1, 1, nb, nb)
        num = dense.sum(dim=-1).to(torch.int32)
        idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return num.contiguous(), idx.contiguous()

    kv_num, kv_idx = ordered(torch.cat(partial))
    full_num, full_idx = ordered(torch.cat(full))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=mod,
                                    seq_lengths=(N, N))


def build_block_mask(attn: Attention, seq_len: int, causal: bool, device: torch.device | str,
                     chunk_elements: int = CHUNK_ELEMENTS):
    """A fresh BlockMask (uncached). ``create_block_mask`` up to ``chunk_elements`` grid points,
    row strips above."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(device)
    mod = mask_mod(attn, seq_len, causal, device)
    if seq_len * seq_len <= chunk_elements:
        return create_block_mask(mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device,
                                 BLOCK_SIZE=BLOCK_SIZE)
    rows = max(BLOCK_SIZE, chunk_elements // seq_len // BLOCK_SIZE * BLOCK_SIZE)
    return _create_block_mask_in_strips(mod, seq_len, device, rows)


class BlockMasks(dict):
    """A variant's BlockMasks, (N, causal, device) -> BlockMask, filled by ``block_mask``: building one
    evaluates the mask on the whole grid, far more work than a call, so each is built once. A mask that
    changes as the variant trains (adaptive_span's reach) is ``renew``ed: the masks of another value go."""

    built_for: Any = None  # what else the masks depend on (adaptive_span: the reach); None: nothing

    def renew(self, built_for: Any) -> None:
        if built_for != self.built_for:
            self.clear()
            self.built_for = built_for


def block_mask(attn: Attention, seq_len: int, causal: bool, device: torch.device | str):
    """The BlockMask for (N, causal, device), built once and kept in ``attn.block_masks``."""
    device = resolved(device)
    key = (seq_len, causal, str(device))
    if key not in attn.block_masks:
        attn.block_masks[key] = build_block_mask(attn, seq_len, causal, device)
    return attn.block_masks[key]


def block_mask_stats(attn: Attention, seq_len: int, causal: bool, device: torch.device | str = "cpu") -> dict:
    """Tiles FlexAttention computes: partial (mask_mod applied), full, of nb² in all; executed pairs
    counts every computed tile as BLOCK_SIZE² (what the kernel does: the flex backend's
    ``executed_pairs`` on a device)."""
    bm = block_mask(attn, seq_len, causal, device)
    partial = int(bm.kv_num_blocks.sum())
    full = int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0
    nb = -(-seq_len // BLOCK_SIZE)
    return {"partial_tiles": partial, "full_tiles": full, "tiles": nb * nb,
            "tile_density": (partial + full) / (nb * nb), "executed_pairs": (partial + full) * BLOCK_SIZE**2}


# ----- calls -----------------------------------------------------------------------------------------
def flex_forward(attn: Attention, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                 compiled: bool = True) -> Tensor:
    """FlexAttention on (B, H, N, D) inputs with the variant's mask, on any device.

    This is the ``flex`` backend's body. On CPU it runs forward only (FlexAttention has no CPU
    backward): pass inputs that do not require grad. ``compiled=False`` runs eager FlexAttention,
    which materialises the scores (for debugging only).
    """
    if causal and not attn.supports_causal:
        raise VariantError(attn.causal_error())
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled_flex_attention() if compiled else flex_attention
    bm = block_mask(attn, q.shape[-2], causal, q.device)
    return attn.in_engine_order(lambda q, k, v: fn(q, k, v, block_mask=bm, scale=attn.scale(q.shape[-1])), q, k, v)


@dataclass(frozen=True)
class PrepareTimes:
    block_mask_s: float  # building the BlockMask (0 when it was cached)
    compile_s: float  # first call: compilation (when this specialisation is new) plus one run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare(attn: Attention, shape: tuple[int, int, int, int], dtype: torch.dtype,
            device: torch.device | str, causal: bool = False, backward: bool = True) -> PrepareTimes:
    """Warm-up for the ``flex`` backend: builds (and caches) the BlockMask, then runs one call on random
    inputs of ``shape`` (B, H, N, D) and ``dtype`` so that compilation happens here, outside any timed
    region. ``backward=True`` also compiles the backward (GPU only; CPU has none). Compilation is
    specialised on shape, dtype and grad mode: prepare with what will be measured."""
    device = torch.device(device)
    N = shape[2]
    t0 = time.perf_counter()
    block_mask(attn, N, causal, device)
    _sync(device)
    t1 = time.perf_counter()
    grad = backward and device.type != "cpu"
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
    with torch.set_grad_enabled(grad):
        out = flex_forward(attn, q, k, v, causal)
        if grad:
            out.backward(torch.randn_like(out))
    _sync(device)
    return PrepareTimes(block_mask_s=t1 - t0, compile_s=time.perf_counter() - t1)
