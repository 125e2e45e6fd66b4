"""reformer: shared-QK LSH attention (Reformer, Kitaev et al. 2020).

Shared-QK: the keys are the normalised queries, k̂_j = q_j / ‖q_j‖; the ``k`` argument is not used
(its gradient is None). For each hash round t and head h a rotation R_{t,h} ∈ ℝ^{D × n_buckets/2}
(entries N(0, 1), from a CPU generator seeded with ``seed``) hashes bucket_t(i) = argmax([q_i R ; −q_i R])
(the first index on ties). Round t orders the positions by (bucket, position); the rank ρ_t(i) gives
the chunk C_t(i) = ⌊ρ_t(i)/c⌋ of ``bucket_size`` c, and query i may see the keys of its chunk and of
the one before, (C − 1) mod n_c (the first chunk looks back at the last). P(i) is the union over rounds,
``∩ {j ≤ i}`` under causal (by original position); a key found in several rounds counts once; i itself
is in P(i) only when nothing else is. Row i is softmax_{j ∈ P(i)}(q_i·k̂_j/√D) v_j.

Causal masks the future keys, but which past keys a query sees depends on the hashes of every position
(the chunk boundaries), as in the paper.

Backends: ``lsh`` sorts, gathers each chunk and the one before (a slice of chunks of every round at a
time; the backward recomputes each slice's tiles and differentiates them by hand, adding each slice's
row gradients into one buffer per input: ``LSHSlices``), scores c × 2c tiles, subtracts
log(number of rounds that found the pair) so that duplicates count once (the paper's log N_ij
correction), merges the rounds with their running maxima and unsorts: O(N·r·c) time, O(N·r·D) memory
beside one slice's tiles, forward and backward. Hashing is done a few rows at a time so its
temporaries stay O(N) too; its time is O(N·D·n_buckets). ``dense`` materialises the set (B, H, N, N)
from the inputs: the readable path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from .base import Attention, Flops, dense_attention, require, require_seed, whole
from .blocksparse import CUDA_TILE_ELEMENTS
from .masks import causal_allowed


@dataclass(frozen=True)
class ReformerOptions:
    bucket_size: int = 64  # c: chunk length; a query sees its chunk and the one before
    n_hashes: int = 2  # r: hash rounds, the union of their sets (each key once)
    n_buckets: int | None = None  # even; None: 2·⌈N/c⌉ (the paper's choice: about c keys per bucket)
    seed: int = 0  # draws the rotations R_{t,h}, the same on every run and device
    backend: str | None = None  # lsh | dense

    def __post_init__(self) -> None:
        for name in ("bucket_size", "n_hashes"):
            value = getattr(self, name)
            require(whole(value, 1), f"reformer: {name} must be an integer > 0; got {value!r}")
        require(self.n_buckets is None or (whole(self.n_buckets, 2) and self.n_buckets % 2 == 0),
                f"reformer: n_buckets must be an even integer >= 2, or null for 2·⌈N/bucket_size⌉; "
                f"got {self.n_buckets!r}")
        require_seed("reformer: seed", self.seed)


def normalise(q: Tensor) -> Tensor:
    """k̂ = q / ‖q‖ (a zero query gives a zero key)."""
    return F.normalize(q, dim=-1)


def hash_buckets(q: Tensor, rotations: Tensor, row_chunk: int) -> Tensor:
    """bucket_t(i) = argmax([q_i R_t ; −q_i R_t]), first index on ties: (B, H, r, N) int64.

    q: (B, H, N, D); rotations: (r, H, D, n_buckets/2). ``row_chunk`` rows at a time, so the (rows,
    n_buckets) temporaries stay small whatever N is."""
    B, H, N, D = q.shape
    out = torch.empty(B, H, rotations.shape[0], N, dtype=torch.long, device=q.device)
    with torch.no_grad():
        R = rotations.to(device=q.device, dtype=q.dtype)
        for t in range(R.shape[0]):
            for r0 in range(0, N, row_chunk):
                x = q[:, :, r0:r0 + row_chunk] @ R[t]  # (B, H, rows, n_buckets/2)
                # argmax of [x ; −x] without building it: max and min both return the first index on
                # ties, and the x half comes first, so it wins a tie with the −x half.
                hi, lo = x.max(dim=-1), x.min(dim=-1)
                out[:, :, t, r0:r0 + row_chunk] = torch.where(hi.values >= -lo.values, hi.indices,
                                                              lo.indices + x.shape[-1])
    return out


def sort_rounds(buckets: Tensor) -> tuple[Tensor, Tensor]:
    """Order by (bucket, position): ``perm`` (position at each rank) and ``rank`` (ρ), (B, H, r, N)."""
    perm = torch.sort(buckets, dim=-1, stable=True).indices  # stable: equal buckets keep position order
    rank = torch.empty_like(perm)
    rank.scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm))
    return perm, rank


class Reformer(Attention):
    name = "reformer"
    Options = ReformerOptions
    backends = {"lsh": False, "dense": False}

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._rotations: dict[tuple[int, int, int], Tensor] = {}
        # The calls' slices of them, where the calls run: copied once (a copy per call from host memory
        # would wait for the device's queue inside every timed call). Key: (H, D, n_buckets, heads, device, dtype).
        self._rotations_on: dict[tuple, Tensor] = {}

    # ----- the hashing --------------------------------------------------------------------------------
    def num_buckets(self, seq_len: int) -> int:
        o = self.options
        return o.n_buckets if o.n_buckets is not None else 2 * math.ceil(seq_len / o.bucket_size)

    def rotations(self, num_heads: int, head_dim: int, n_buckets: int) -> Tensor:
        """R: (n_hashes, H, D, n_buckets/2) float32 on CPU, one draw from torch.Generator seeded with
        ``seed``: R[t, h] is round t's rotation for head h."""
        key = (num_heads, head_dim, n_buckets)
        if key not in self._rotations:
            gen = torch.Generator().manual_seed(self.options.seed)
            self._rotations[key] = torch.randn(self.options.n_hashes, num_heads, head_dim, n_buckets // 2,
                                               generator=gen)
        return self._rotations[key]

    def set_rotations(self, rotations: Tensor) -> None:
        """Use these rotations (n_hashes, H, D, n_buckets/2) for inputs of that H and D at every N whose
        bucket count is n_buckets (to compare with another implementation given the same rotations)."""
        r, H, D, half = rotations.shape
        require(r == self.options.n_hashes, f"reformer: rotations hold {r} rounds; n_hashes={self.options.n_hashes}")
        self._rotations[(H, D, 2 * half)] = rotations.detach().cpu()
        self._rotations_on.clear()

    def buckets(self, q: Tensor) -> Tensor:
        """(B, H, r, N) bucket of every position in every round, hashed in at least float32."""
        B, H, N, D = q.shape
        nb = self.num_buckets(N)
        heads, total = self.heads(H)  # R_{t,h} of these heads: the same draw on a head shard (ulysses)
        q = q.to(torch.promote_types(q.dtype, torch.float32))
        key = (total, D, nb, heads.start, heads.stop, str(q.device), q.dtype)
        if key not in self._rotations_on:
            self._rotations_on[key] = self.rotations(total, D, nb)[:, heads].to(device=q.device, dtype=q.dtype)
        return hash_buckets(q, self._rotations_on[key], self.hash_rows(N))

    def hash_rows(self, seq_len: int) -> int:
        """Positions hashed at a time: temporaries of about N·c elements (N at most: all at once)."""
        return min(seq_len, max(1, seq_len * self.chunk_length(seq_len) // self.num_buckets(seq_len)))

    def chunk_length(self, seq_len: int) -> int:
        """c as computed: ``bucket_size``, or N when it is longer. A chunk of c ≥ N positions holds the whole
        sequence either way (n_c = 1, the same set), so the tiles are N × N, not c × c (bucket_size=10^5 at
        N=64 was planned as 961 GB and skipped)."""
        return min(self.options.bucket_size, seq_len)

    def num_chunks(self, seq_len: int) -> int:
        return math.ceil(seq_len / self.chunk_length(seq_len))

    def allowed_set(self, q: Tensor, causal: bool = False) -> Tensor:
        """P(i) from the definition, materialised: (B, H, N, N) bool. O(N²): the dense path and the
        reference only."""
        N = q.shape[-2]
        c, n_c = self.chunk_length(N), self.num_chunks(N)
        _, rank = sort_rounds(self.buckets(q))
        chunk = rank // c  # (B, H, r, N): C_t(i)
        ci, cj = chunk[..., :, None], chunk[..., None, :]  # (B, H, r, N, 1), (B, H, r, 1, N)
        found = ((cj == ci) | (cj == (ci - 1) % n_c)).any(dim=2)  # (B, H, N, N): union over rounds
        i = torch.arange(N, device=q.device)
        if causal:
            found &= causal_allowed(i[:, None], i[None, :])
        others = found & (i[None, :] != i[:, None])
        alone = ~others.any(dim=-1, keepdim=True)  # (B, H, N, 1): nothing but i itself
        return others | (alone & torch.eye(N, dtype=torch.bool, device=q.device))

    def mask(self, seq_len: int, causal: bool = False) -> None:
        return None  # the set depends on q: see allowed_set(q, causal)

    # ----- facts --------------------------------------------------------------------------------------
    def window(self, seq_len: int) -> int:
        """Keys gathered per query and round: its chunk and the one before (one chunk when n_c = 1)."""
        c = self.chunk_length(seq_len)
        return c if self.num_chunks(seq_len) == 1 else 2 * c

    def chunks_per_slice(self, B: int, H: int, seq_len: int, device: torch.device | str | None) -> int:
        """Chunks per slice of the ``lsh`` path (each of every round): as many as keep the
        slice's c × window score tiles within slice_elements(device), one at least."""
        per_chunk = B * H * self.options.n_hashes * self.chunk_length(seq_len) * self.window(seq_len)
        return max(1, slice_elements(device) // per_chunk)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        """At most: per query min(r·window, keys it may see) (the set depends on q; duplicates shrink it)."""
        cap = self.options.n_hashes * self.window(seq_len)
        if not causal:
            return seq_len * min(cap, seq_len)
        k = min(cap, seq_len)  # queries i < k see at most i + 1 keys (the causal rule: j ≤ i)
        return k * (k + 1) // 2 + (seq_len - k) * cap

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        if self.backend == "dense":
            return seq_len * seq_len
        n_c = self.num_chunks(seq_len)
        return self.options.n_hashes * n_c * self.chunk_length(seq_len) * self.window(seq_len)

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False,
              device: torch.device | str | None = None) -> Flops:
        # Hashing (q·R for every round: 2·N·D·n_buckets/2) is executed work beside the attention.
        hashing = B * H * self.options.n_hashes * N * D * self.num_buckets(N)
        return Flops(executed=4 * B * H * D * self.executed_pairs(N, causal) + hashing,
                     useful=4 * B * H * D * self.allowed_pairs(N, causal))

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        if self.backend == "dense":  # plus k̂ = q/‖q‖, and ‖q‖ and its clamp kept for the division's backward
            return (super().memory_bytes(B, H, N, D, element_size, causal, device)
                    + element_size * B * H * N * (D + 2) + self.hashing_bytes(B, H, N, D, element_size))
        # Fitted as an upper bound (within 1.52x) to the peaks measured on CPU over bucket sizes 8-64, 1-4
        # rounds, D 8-64, N 1000-16384, float32 and bfloat16, causal and not: the rounds' outputs in sorted
        # and original order, their weighted product and its gradient (4·r·N·D, N padded to whole chunks);
        # the scaled, normalised and padded inputs, their gradients and the merged output (7·N·D); the
        # int64 layout (r·N); and one slice's tiles (bias, probabilities, their gradient: 3 of the slice's
        # score elements) with its gathered query, key and value rows. In float32 at least (half inputs'
        # tiles are float32).
        o, a = self.options, max(element_size, 4)
        n_c, w = self.num_chunks(N), self.window(N)
        padded = n_c * self.chunk_length(N)
        sliced = min(n_c, self.chunks_per_slice(B, H, N, device)) * B * H * o.n_hashes * self.chunk_length(N) * w
        return (a * B * H * (4 * o.n_hashes * padded * D + 7 * N * D) + 8 * B * H * o.n_hashes * padded
                + a * sliced * (3 * w + 3 * D) // w + self.hashing_bytes(B, H, N, D, element_size))

    def hashing_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4) -> int:
        """The rotations R (n_hashes, H, D, n_buckets/2), kept in float32 and, for wider inputs, copied to
        their dtype, and one hashing tile q·R of (B, H, rows, n_buckets/2) (``buckets``). Small at the
        default n_buckets ∝ N/c; a large fixed n_buckets makes them the point's memory (n_buckets=2^20 at
        N=64 held 1 GiB of rotations against 1.8 MB counted)."""
        a, half = max(element_size, 4), self.num_buckets(N) // 2
        copies = 4 + (a if a != 4 else 0)
        return copies * self.options.n_hashes * H * D * half + a * B * H * self.hash_rows(N) * half

    def mask_bytes(self, B: int, H: int, N: int, causal: bool) -> int:
        return B * H * N * N  # the dense path's set, (B, H, N, N): it depends on q

    # ----- call ---------------------------------------------------------------------------------------
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        if backend == "dense":
            return dense_attention(q, normalise(q), v, self.allowed_set(q, causal), self.scale(q.shape[-1]))
        return self._lsh(q, v, causal)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        """The definition in float64, the set built from the inputs (``k`` unused)."""
        q, v = q.double(), v.double()
        return dense_attention(q, normalise(q), v, self.allowed_set(q, causal), self.scale(q.shape[-1]))

    def exact_counterpart(self, block_size: int = 256) -> nn.Module:
        """What fidelity compares with: full attention on k̂ with the same self rule."""
        return SharedQKFull(block_size)

    def _lsh(self, q: Tensor, v: Tensor, causal: bool) -> Tensor:
        B, H, N, D = q.shape
        c, n_c = self.chunk_length(N), self.num_chunks(N)
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.no_grad():  # the layout: which positions meet, and how often
            perm, rank = sort_rounds(self.buckets(q))  # (B, H, r, N)
            # Sorted order padded to n_c·c slots with position N: a key never kept, a query dropped.
            pos_q = F.pad(perm, (0, n_c * c - N), value=N).unflatten(-1, (n_c, c))  # (B, H, r, n_c, c)
            pos_k = look_back(pos_q, n_c)  # (B, H, r, n_c, w): its chunk, then the one before
            step = self.chunks_per_slice(B, H, N, q.device)  # chunks of every round whose tiles hold one slice
            slices = [slice(s, s + step) for s in range(0, n_c, step)]
            # Itself only where no round offers anything else: (B, H, N + 1), the pad row False
            offers = torch.cat([others_of(pos_q[:, :, :, s], pos_k[:, :, :, s], N, causal).any(dim=-1)
                                for s in slices], dim=3)  # (B, H, r, n_c, c)
            alone = F.pad(~unsort(offers.flatten(-2), rank).any(dim=2), (0, 1))  # (B, H, N + 1)
            chunk = F.pad(rank // c, (0, 1), value=-2)  # (B, H, r, N + 1): C_t(j); padded keys match nothing

        # Padded once with the row of position N (zeros), which the slices gather from: (B, H, N + 1, D)
        qs, k_hat, vs = (F.pad(x, (0, 0, 0, 1)) for x in (q.to(acc) * self.scale(D), normalise(q.to(acc)), v.to(acc)))
        # Slice by slice, forward and backward (which recomputes each slice's tiles, as the paper's reversible
        # layers trade time for memory alike): one slice's tiles at a time beside the O(r·N·D) outputs, never
        # every round's c × w tiles.
        o, l, m = LSHSlices.apply(qs, k_hat, vs, self, pos_q, pos_k, chunk, alone, causal, slices)
        # (B, H, r, n_c, c[, D]), in sorted order
        # Back to original order, then merge the rounds under their common maximum.
        o, l, m = unsort(o.flatten(3, 4), rank), unsort(l.flatten(-2), rank), unsort(m.flatten(-2), rank)
        w = torch.exp(m - m.amax(dim=2, keepdim=True))  # (B, H, r, N): 0 for a round with nothing
        out = (w[..., None] * o).sum(dim=2) / (w * l).sum(dim=2)[..., None]  # (B, H, N, D)
        return out.to(q.dtype)

    def _bias(self, pos_q: Tensor, pos_k: Tensor, chunk: Tensor, alone: Tensor, causal: bool,
              dtype: torch.dtype) -> Tensor:
        """Added to the window scores: −inf where the pair is not in P(i), −log(rounds that found it)
        where it is (so that a key found by several rounds counts once). (B, H, r, s, c, w) for the chunks
        ``pos_q`` (B, H, r, s, c) with their windows ``pos_k`` (B, H, r, s, w); ``chunk`` (B, H, r, N + 1)
        is C_t(j) of every position (−2 for the pad), ``alone`` (B, H, N + 1) where i sees only itself."""
        N, r = alone.shape[-1] - 1, chunk.shape[2]
        n_c = self.num_chunks(N)
        own = torch.eye(pos_q.shape[-1], pos_k.shape[-1], dtype=torch.bool, device=pos_q.device)  # slot of i
        keep = others_of(pos_q, pos_k, N, causal) | (own & rows_at(alone[..., None], pos_q))
        if r == 1 or n_c == 1:  # each kept key found once, or by every round alike
            return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
        # found[t] = 1 (round t itself) + the other rounds t' whose chunks put j in P_t'(i):
        # C_t'(j) = C_t'(i) or C_t'(j) + 1 ≡ C_t'(i) (mod n_c).
        found = torch.ones(keep.shape, dtype=torch.uint8, device=keep.device)
        for t in range(r):
            for u in range(r):
                if u != t:
                    ci = chunk[:, :, u].gather(-1, pos_q[:, :, t].flatten(2)).view_as(pos_q[:, :, t])[..., None]
                    cj = chunk[:, :, u].gather(-1, pos_k[:, :, t].flatten(2)).view_as(pos_k[:, :, t])[..., None, :]
                    found[:, :, t] += (cj == ci) | ((cj + 1) % n_c == ci)
        return found.to(dtype).log_().neg_().masked_fill_(~keep, float("-inf"))


def probabilities(q_rows: Tensor, k_rows: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Chunks' queries (B, H, r, s, c, D) against their windows' keys (B, H, r, s, w, D): the unnormalised
    probabilities p = exp(q·k̂ᵀ + bias − m) (B, H, r, s, c, w), 0 where not kept, computed in place in one
    tile, and the row maxima m (B, H, r, s, c), −inf where a row has nothing. No autograd: LSHSlices'
    backward differentiates by hand."""
    p = torch.matmul(q_rows, k_rows.transpose(-2, -1)).add_(bias)
    m = p.amax(dim=-1)
    return p.sub_(torch.where(torch.isfinite(m), m, 0.0)[..., None]).exp_(), m


class LSHSlices(torch.autograd.Function):
    """Every round's chunk outputs, a slice of chunks at a time, from the padded inputs qs, k̂, vs
    (B, H, N + 1, D): unnormalised outputs o = p·v (B, H, r, n_c, c, D), their row sums l and row maxima
    m (B, H, r, n_c, c).

    The backward recomputes each slice's p (as the paper's reversible layers trade time for memory) and
    differentiates by hand, as FlashAttention's does: dv = pᵀ·do, ds = p ∘ (do·vᵀ + dl), dq = ds·k̂,
    dk̂ = dsᵀ·q (m only shifts the exponent: no gradient). Each slice's row gradients are added into one
    (B, H, N + 1, D) buffer per input. Autograd through a gather (or a checkpoint per slice) would hand
    each slice's gradient back as a zero-filled (B, H, N + 1, D) tensor and add them up: O(N·D) per slice,
    O(N²) in all. On CPU (B·H = 8, D = 64) filling those zeros took 17% of forward+backward at N=32K,
    3.5x more per doubling; this path took 0.74x the time of a checkpoint per slice there (0.84x at 4K),
    with 0.91x to 1.10x its peak memory (1.10x with two slices: the three buffers come first)."""

    @staticmethod
    def forward(ctx, qs: Tensor, k_hat: Tensor, vs: Tensor, attn: Reformer, pos_q: Tensor, pos_k: Tensor,
                chunk: Tensor, alone: Tensor, causal: bool, slices: list[slice]) -> tuple[Tensor, Tensor, Tensor]:
        ctx.attn, ctx.causal, ctx.slices = attn, causal, slices
        ctx.save_for_backward(qs, k_hat, vs, pos_q, pos_k, chunk, alone)
        parts = []
        for s in slices:
            pq, pk = pos_q[:, :, :, s], pos_k[:, :, :, s]
            bias = attn._bias(pq, pk, chunk, alone, causal, qs.dtype)  # (B, H, r, s, c, w)
            p, m = probabilities(rows_at(qs, pq), rows_at(k_hat, pk), bias)
            del bias
            parts.append((p @ rows_at(vs, pk), p.sum(-1), m))
            del p
        o, l, m = (torch.cat(x, dim=3) for x in zip(*parts))  # (B, H, r, n_c, c[, D])
        ctx.mark_non_differentiable(m)
        return o, l, m

    @staticmethod
    @once_differentiable
    def backward(ctx, do: Tensor, dl: Tensor, _dm: Tensor) -> tuple[Tensor | None, ...]:
        qs, k_hat, vs, pos_q, pos_k, chunk, alone = ctx.saved_tensors
        dqs, dk_hat, dvs = (torch.zeros_like(x) for x in (qs, k_hat, vs))  # (B, H, N + 1, D), filled once
        for s in ctx.slices:
            pq, pk = pos_q[:, :, :, s], pos_k[:, :, :, s]
            q_rows, k_rows = rows_at(qs, pq), rows_at(k_hat, pk)
            p, _ = probabilities(q_rows, k_rows, ctx.attn._bias(pq, pk, chunk, alone, ctx.causal, qs.dtype))
            do_s = do[:, :, :, s]  # (B, H, r, s, c, D)
            add_rows(dvs, pk, p.transpose(-2, -1) @ do_s)
            dp = torch.matmul(do_s, rows_at(vs, pk).transpose(-2, -1)).add_(dl[:, :, :, s, :, None])  # (…, c, w)
            ds = dp.mul_(p)
            del p, dp
            add_rows(dqs, pq, ds @ k_rows)
            add_rows(dk_hat, pk, ds.transpose(-2, -1) @ q_rows)
        return dqs, dk_hat, dvs, None, None, None, None, None, None, None


def slice_elements(device: torch.device | str | None) -> int:
    """The most score elements of one slice on ``device`` (None: CPU): the block-sparse engine's GPU tile on
    CUDA; on CPU 2^22, as many smaller slices cost more time than they save memory (2^19:
    1.45x the time)."""
    return CUDA_TILE_ELEMENTS if device is not None and torch.device(device).type == "cuda" else 1 << 22


def others_of(pos_q: Tensor, pos_k: Tensor, N: int, causal: bool) -> Tensor:
    """The pairs of P(i) but i itself, before the self rule: (…, c, w) bool for the queries ``pos_q``
    (…, c) and their windows ``pos_k`` (…, w); padded keys (position N) are never kept."""
    if causal:
        keep = causal_allowed(pos_q[..., :, None], pos_k[..., None, :])  # j ≤ i (padded keys hold N)
    else:
        keep = (pos_k < N)[..., None, :].expand(*pos_q.shape, pos_k.shape[-1])
    return keep & ~torch.eye(pos_q.shape[-1], pos_k.shape[-1], dtype=torch.bool, device=pos_q.device)


def look_back(x: Tensor, n_c: int, dim: int = -1) -> Tensor:
    """Each chunk followed by the chunk before it (the first by the last); the chunk alone when n_c = 1.

    x: (…, n_c, c[, D]); ``dim`` (negative) is the c axis, the chunk axis just before it."""
    if n_c == 1:
        return x
    return torch.cat([x, x.roll(1, dims=dim - 1)], dim=dim)  # roll: chunk C gets chunk C − 1


def rows_at(x: Tensor, pos: Tensor) -> Tensor:
    """x (B, H, M, D) at positions ``pos`` (B, H, …) < M: (B, H, …, D)."""
    B, H, _, D = x.shape
    return x.gather(2, pos.flatten(2)[..., None].expand(B, H, -1, D)).view(*pos.shape, D)


def add_rows(x: Tensor, pos: Tensor, rows: Tensor) -> None:
    """x (B, H, M, D) += rows (B, H, …, D) at positions ``pos`` (B, H, …), repeated positions summed."""
    B, H, _, D = x.shape
    x.scatter_add_(2, pos.flatten(2)[..., None].expand(B, H, -1, D), rows.flatten(2, -2))


def unsort(x: Tensor, rank: Tensor) -> Tensor:
    """Rows of each round's sorted order back to original positions: x (B, H, r, n_c·c[, D]) → (B, H, r, N[, D])."""
    if x.dim() == rank.dim():
        return x.gather(3, rank)
    return x.gather(3, rank[..., None].expand(*rank.shape, x.shape[-1]))


class SharedQKFull(nn.Module):
    """Full attention on the keys k̂ = q/‖q‖ with reformer's self rule (i sees itself only when it may
    see nothing else: causal position 0, or N = 1): reformer's exact counterpart, for fidelity.

    ``block_size`` query rows at a time, each block checkpointed (its backward recomputes the block's
    scores), so forward and backward hold O(N·block_size) per head, never N×N. ``k`` is unused."""

    def __init__(self, block_size: int = 256) -> None:
        super().__init__()
        self.block_size = block_size

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        """A block's scores, probabilities and their gradient, its (R, N) mask, k̂, the output and gradients."""
        R = min(self.block_size, N)
        return element_size * B * H * (3 * R * N + 6 * N * D) + 2 * R * N

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        khat = normalise(q)
        N, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        return torch.cat([checkpoint(_counterpart_rows, q[:, :, r0:r0 + self.block_size], khat, v, r0, causal, scale,
                                     use_reentrant=False)
                          for r0 in range(0, N, self.block_size)], dim=2)


def _counterpart_rows(q_rows: Tensor, khat: Tensor, v: Tensor, r0: int, causal: bool, scale: float) -> Tensor:
    N = khat.shape[-2]
    i = torch.arange(r0, r0 + q_rows.shape[-2], device=q_rows.device)[:, None]  # (R, 1)
    j = torch.arange(N, device=q_rows.device)[None, :]  # (1, N)
    others = (j != i) & causal_allowed(i, j) if causal else (j != i)  # (R, N)
    allowed = others | ((j == i) & ~others.any(dim=-1, keepdim=True))
    return dense_attention(q_rows, khat, v, allowed, scale)  # (B, H, R, D)
