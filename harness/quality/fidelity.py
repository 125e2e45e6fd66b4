"""Fidelity of an attention variant: how far its output and gradients are from exact full attention.

The reference is exact (full, or full causal) softmax attention on the same q, k, v in float64,
computed by ``variants.Blockwise(mode="exact")`` — online softmax with a recomputing backward — so
outputs and gradients cost O(N·block_size) memory per head and the check runs at N = 16K and beyond.
The variant runs in the inputs' dtype. ``mass_kept`` (the share of exact softmax probability on pairs
the variant's mask allows) is computed in chunks of query rows with the variant's element predicate:
no N×N tensor is ever built.

Input distributions (``make_inputs``), because a variant's error depends on where attention looks:

- ``gaussian``: q, k, v iid N(0, 1). Logits q·k/√D ~ N(0, 1): attention spreads over the whole sequence,
  the hardest case for any variant that drops keys.
- ``local``: q and k share a positional component whose dot product decays with |i − j|, so exact
  attention concentrates near the diagonal, as in trained language models. Built from random Fourier
  features (Rahimi & Recht 2007): D/2 frequencies ω_f ~ N(0, 1/ℓ²), ℓ = ``LOCAL_LENGTH``, and
  p_i = √2 [cos(ω_f i), sin(ω_f i)]_f, so p_i·p_j = 2 Σ_f cos(ω_f (i − j)) ≈ D·exp(−(i − j)²/2ℓ²)
  depends only on i − j. q_i = a·p_i + z_i, k_j = a·p_j + z'_j with iid N(0, 1) content z, z' and
  a² = ``LOCAL_STRENGTH``/√D, so the positional part of the logit is ``LOCAL_STRENGTH`` at i = j,
  falls as ``LOCAL_STRENGTH``·exp(−(i − j)²/2ℓ²) and is ~0 a few ℓ away; the content adds
  N(0, 1 + 2a²) noise. Measured (share of exact softmax mass, worst of 3 seeds, D = 32, 64, 128,
  N = 256 … 32K): 34–50% within |i − j| ≤ 4, 91–99% within ≤ 16, ≥ 99.8% within ≤ 32.
  Far from the diagonal the D/2 random cosines partly realign (their sum has std ~ 1/√D), so with
  D < 32 some mass leaks to far keys at long N (D = 16, N = 16K–32K: 92–99% within 32).
- ``peaked``: as ``gaussian`` with q scaled by ``PEAKED_SCALE`` = 4: logits ~ N(0, 16), sharp
  attention on a few content-chosen keys anywhere in the sequence.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

import variants
from variants.base import Attention
from variants.masks import causal_allowed

INPUT_KINDS = ("gaussian", "local", "peaked")
LOCAL_LENGTH = 32.0  # ℓ: length scale (positions) of the positional kernel of ``local``
LOCAL_STRENGTH = 32.0  # positional logit at i = j for ``local``: e^32 outweighs 32K far keys
PEAKED_SCALE = 4.0  # q multiplier of ``peaked``: logit std 4 instead of 1
UPSTREAM_STREAM = 1  # the upstream gradient's stream, beside the inputs' (SeedSequence([seed, 1]))


def make_inputs(kind: str, B: int, H: int, N: int, D: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu",
                generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of shape (B, H, N, D) from one of ``INPUT_KINDS`` (see the module docstring).

    Drawn in float64 on the generator's device (CPU when None), then cast to ``dtype`` and moved to
    ``device``: the same seeded generator gives the same values (up to the cast) on every device.
    """
    if kind not in INPUT_KINDS:
        raise ValueError(f"unknown input kind {kind!r}; allowed: {', '.join(INPUT_KINDS)}")
    for name, value in (("B", B), ("H", H), ("N", N), ("D", D)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"make_inputs: {name} must be an integer >= 1; got {value!r}")
    if kind == "local" and D % 2:
        raise ValueError(f"make_inputs: kind 'local' needs an even head dim D (cos/sin pairs); got D={D}")
    gen_device = generator.device if generator is not None else torch.device("cpu")

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64, device=gen_device)

    q, k, v = randn(B, H, N, D), randn(B, H, N, D), randn(B, H, N, D)
    if kind == "peaked":
        q = q * PEAKED_SCALE
    elif kind == "local":
        omega = randn(D // 2) / LOCAL_LENGTH  # (D/2,) frequencies of the RBF kernel's random features
        phase = torch.arange(N, dtype=torch.float64, device=gen_device)[:, None] * omega  # (N, D/2)
        pos = torch.cat([phase.cos(), phase.sin()], dim=-1) * math.sqrt(2.0)  # (N, D): p_i·p_j ≈ D·rbf
        a = math.sqrt(LOCAL_STRENGTH / math.sqrt(D))
        q = q + a * pos  # (B, H, N, D), the same positional component in every batch and head
        k = k + a * pos
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _rel(err: Tensor, ref: Tensor) -> float:
    return float(torch.linalg.vector_norm(err) / torch.linalg.vector_norm(ref))


def _with_grads(attn: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                upstream: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """attn's output and (dq, dk, dv) for the upstream gradient, on detached leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attn(*leaves, causal=causal)
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)  # None: unused (reformer's k)
    return out.detach(), grads


@torch.no_grad()  # a number: no graph (adaptive_span's predicate reads its trainable spans)
def mass_kept(attn: Attention, q: Tensor, k: Tensor, causal: bool, block_size: int = 256) -> float | None:
    """Share of the exact softmax probability (causal softmax when ``causal``) on pairs the variant
    allows, averaged over every query row of every batch and head; None for variants without a mask.

    Computed as 1 − (probability on disallowed pairs), in float64, ``block_size`` query rows at a time
    against all N keys: O(N·block_size) memory per head. Exact variants return 1.0 without computing.
    """
    if attn.is_exact:
        return 1.0
    B, H, N, D = q.shape
    allowed = attn.element_predicate(N, causal)
    if allowed is None:
        return None  # e.g. linear: no (query, key) mask, every query sees mixtures of all keys
    scale = attn.scale(D)
    kd = k.double()
    j = torch.arange(N, device=q.device)[None, :]  # (1, N)
    lost = torch.zeros((), dtype=torch.float64, device=q.device)
    for r0 in range(0, N, block_size):
        r1 = min(r0 + block_size, N)
        i = torch.arange(r0, r1, device=q.device)[:, None]  # (R, 1)
        s = (q[:, :, r0:r1].double() @ kd.transpose(-2, -1)) * scale  # (B, H, R, N)
        if causal:
            s = s.masked_fill(~causal_allowed(i, j), float("-inf"))
        p = s.softmax(dim=-1)  # (B, H, R, N): exact probabilities of these rows
        lost = lost + p.masked_fill(allowed(i, j), 0.0).sum()  # mass on disallowed pairs
    return float(1.0 - lost / (B * H * N))


def upstream_gradient(shape: torch.Size | tuple[int, ...], grad_seed: int) -> Tensor:
    """The fixed random upstream gradient (float64, CPU) of ``fidelity``: from a stream of its own,
    derived from ``grad_seed`` (numpy's SeedSequence), independent of the inputs drawn with that same
    seed. (A generator seeded with ``grad_seed`` itself would repeat q's draws: upstream = q.)"""
    seed = int(np.random.SeedSequence([grad_seed, UPSTREAM_STREAM]).generate_state(1, dtype=np.uint64)[0])
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


def fidelity(attn: Attention, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
             block_size: int = 256, *, grad_seed: int = 0) -> dict[str, float | None]:
    """Errors of ``attn`` against exact full attention (float64) on the same q, k, v (B, H, N, D).

    Returns:
        out_rel_err: ‖o − o_ref‖ / ‖o_ref‖ (L2 over every element).
        out_cos: cosine similarity of the flattened o and o_ref.
        out_max_abs_err: max |o − o_ref|.
        grad_rel_err: for one fixed random upstream gradient (seeded by ``grad_seed``), the largest of
            the relative L2 errors of dq, dk, dv against the float64 exact gradients (an input the
            reference does not read, reformer's k, is left out).
        mass_kept: see ``mass_kept``; 1.0 for exact variants, None for variants without a mask.

    The variant runs in q's dtype; the reference is the variant's ``exact_counterpart(block_size)`` on
    float64 copies, O(N·block_size) memory forward and backward: ``variants.Blockwise(mode="exact",
    block_size=block_size)``, or for reformer full attention on its shared-QK keys with its self rule.
    """
    if causal and not attn.supports_causal:
        raise variants.VariantError(attn.causal_error())
    # Exact attention, or the variant's own exact counterpart (reformer: full attention on its keys).
    reference = attn.exact_counterpart(block_size)
    upstream = upstream_gradient(q.shape, grad_seed).to(q.device)  # (B, H, N, D)

    out, grads = _with_grads(attn, q, k, v, causal, upstream)
    ref_out, ref_grads = _with_grads(reference, q.double(), k.double(), v.double(), causal, upstream)

    o = out.double()
    err = o - ref_out
    cos = torch.nn.functional.cosine_similarity(o.flatten(), ref_out.flatten(), dim=0)
    grad_rel_err = max(_rel(g.double() - r, r) for g, r in zip(grads, ref_grads) if r is not None)
    return {
        "out_rel_err": _rel(err, ref_out),
        "out_cos": float(cos),
        "out_max_abs_err": float(err.abs().max()),
        "grad_rel_err": grad_rel_err,
        "mass_kept": mass_kept(attn, q, k, causal, block_size),
    }


__all__ = ["INPUT_KINDS", "LOCAL_LENGTH", "LOCAL_STRENGTH", "PEAKED_SCALE", "make_inputs", "mass_kept",
           "upstream_gradient", "fidelity"]
