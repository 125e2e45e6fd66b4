"""ring: exact attention over a sequence split across the P ranks of a process group (Ring Attention,
Liu, Zaharia & Abbeel 2023).

Rank p holds its shard of q, k, v, (B, H, n_p, D) (layout ``contiguous`` or ``zigzag``, uneven shards:
see variants/seqpar.py, which also says how the forward takes the local shard). Forward: in P steps the
key/value shards travel around the ring (rank p sends to p+1 and receives from p-1, the next step's
transfer posted before this step's compute, so they overlap where the backend allows); each rank merges
the partial results of its queries against every shard by the online softmax (running max m and sum l;
the saved log-sum-exp is m + log l). Backward: the same ring again; each shard's dK, dV accumulator
travels with it, collecting every rank's contribution, and takes one more hop home. The probabilities
are recomputed from the saved log-sum-exp (FlashAttention-2's backward), so no rank ever holds more than
two K/V shards (the current one and the one arriving), plus their gradient accumulators: memory per
rank O(N/P·D) plus one tile of scores, forward and backward.

``inner`` names the single-device exact function each step computes, checked exact: ``full`` (one
(n_q × n_k) score tile per pair of runs) or ``blockwise`` with mode=exact (key blocks of its
``block_size``: tiles of n_q × b, memory O(N/P·b)). The step kernel is ring's own, because merging needs
the log-sum-exp that a variant's output alone does not give. Causal: a key tile wholly in the future of
a query run is skipped, one wholly in its past needs no mask; ``zigzag`` gives every rank the same number
of computed tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .base import require
from .masks import causal_allowed
from .seqpar import LAYOUTS, SequenceParallel, local_runs, shard_runs


@dataclass(frozen=True)
class RingOptions:
    layout: str = "zigzag"  # contiguous: rank p holds chunk p of P | zigzag: chunks p and 2P-1-p of 2P
    world_size: int = 2  # processes the harness starts (the process group, when there is one, decides)
    inner: str = "full"  # the exact function each step computes: full | blockwise (mode=exact)
    inner_options: dict | None = None  # options of inner, e.g. {block_size: 128} for blockwise
    backend: str | None = None  # online (ring's own online-softmax step kernel)

    def __post_init__(self) -> None:
        require(self.layout in LAYOUTS, f"ring: unknown layout {self.layout!r}; allowed: {', '.join(LAYOUTS)}")


class Ring(SequenceParallel):
    name = "ring"
    Options = RingOptions
    backends = {"online": False}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        inner = self.wrapped
        require(inner.is_exact, f"ring: inner must be an exact variant (full, or blockwise with mode=exact); "
                                f"got {inner.name} with {inner.extra_repr() or 'its defaults'}")
        self.block_size = getattr(inner.options, "block_size", None)  # None: a whole shard per tile

    @property
    def layout_name(self) -> str:
        return self.options.layout

    @property
    def is_exact(self) -> bool:
        return True

    # The function is the exact inner variant's (full's): its mask and pair count.
    def mask(self, seq_len: int, causal: bool = False) -> Tensor:
        return self.wrapped.mask(seq_len, causal)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return self.wrapped.allowed_pairs(seq_len, causal)

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        """Whole tiles computed by all ranks together (a partly masked tile counts whole)."""
        P = self.options.world_size
        if seq_len < P * (2 if self.options.layout == "zigzag" else 1):
            return self.allowed_pairs(seq_len, causal)
        runs = [local_runs(r) for r in shard_runs(seq_len, P, self.options.layout)]
        return sum((qe - qs) * (ke - ks) for q_runs in runs for k_runs in runs
                   for (qs, qe, _), (ks, ke, _), _ in tiles(q_runs, k_runs, causal, self.block_size))

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        """Per rank: scores, probabilities and their gradients of one tile (accumulated in float32 for half
        inputs), about 16 shard-sized buffers (q, k, v in flight and their gradients and accumulators, o,
        dO) and two float32 row statistics (the saved log-sum-exp, the backward's rowsum(dO ∘ O))."""
        n = -(-N // self.options.world_size)
        run = -(-n // 2) if self.options.layout == "zigzag" else n
        tile = run * min(self.block_size or run, run)
        acc = max(element_size, 4)
        return B * H * (acc * 4 * tile + element_size * 16 * n * D + 4 * 2 * n)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        group, rank, size = self.process_group()
        lengths = self.shard_lengths(q.shape[-2], q.device, group, size)
        runs = [local_runs(r) for r in shard_runs(sum(lengths), size, self.options.layout)]
        return RingAttention.apply(q, k, v, self, group, rank, runs, causal, self.scale(q.shape[-1]))


def tiles(q_runs, k_runs, causal: bool, block: int | None) -> Iterator[tuple[tuple, tuple, bool]]:
    """The score tiles of one (query shard, key shard) pair: ((q local start, end, global start),
    (k local start, end, global start), needs the causal mask). Keys in blocks of ``block`` (None: a
    whole run); under causal (the rule j ≤ i applied to a tile's corners) a tile wholly in the future is
    skipped and one wholly in the past is not masked."""
    for qs, qe, qg in q_runs:
        for ks, ke, kg in k_runs:
            step = block or (ke - ks)
            for b in range(ks, ke, step):
                be = min(b + step, ke)
                first_key, last_key = kg + b - ks, kg + be - ks - 1
                if causal and not causal_allowed(qg + qe - qs - 1, first_key):
                    continue  # every key after every query
                yield (qs, qe, qg), (b, be, first_key), causal and not causal_allowed(qg, last_key)


def tile_scores(q: Tensor, k: Tensor, qt: tuple, kt: tuple, masked: bool, scale: float, acc) -> Tensor:
    (qs, qe, qg), (ks, ke, kg) = qt, kt
    s = (q[:, :, qs:qe].to(acc) @ k[:, :, ks:ke].to(acc).transpose(-2, -1)) * scale  # (B, H, nq, nk)
    if masked:
        i = torch.arange(qg, qg + qe - qs, device=q.device)[:, None]
        j = torch.arange(kg, kg + ke - ks, device=q.device)[None, :]
        s = s.masked_fill(~causal_allowed(i, j), float("-inf"))
    return s


def exchange(send: Tensor, recv_shape: torch.Size, rank: int, size: int, group, attn: Ring):
    """Post the ring transfer: ``send`` to rank+1, a fresh buffer of ``recv_shape`` from rank-1.
    Returns (buffer, requests); wait on the requests before reading the buffer."""
    buf = send.new_empty(recv_shape)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group),
           dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, (rank - 1) % size), group)]
    attn.count_sent(send)
    return buf, dist.batch_isend_irecv(ops)


def wait(requests) -> None:
    for r in requests:
        r.wait()


def kv_shape(kv: Tensor, runs: list, src: int) -> torch.Size:
    """(2, B, H, n_src, D): the shape of rank ``src``'s stacked K, V (or their gradients)."""
    return torch.Size((2, *kv.shape[1:3], runs[src][-1][1], kv.shape[-1]))


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, attn: Ring, group, rank: int, runs: list, causal: bool,
                scale: float) -> Tensor:
        size, block = len(runs), attn.block_size
        B, H, n, D = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)  # accumulate half inputs in float32
        m = torch.full((B, H, n, 1), float("-inf"), dtype=acc, device=q.device)  # running max
        l = torch.zeros((B, H, n, 1), dtype=acc, device=q.device)  # running sum of exp(s - m)
        o = torch.zeros((B, H, n, D), dtype=acc, device=q.device)  # running unnormalised output
        kv = torch.stack((k, v))  # (2, B, H, n, D): one message per step
        for t in range(size):
            src = (rank - t) % size  # whose shard kv is
            if t < size - 1:
                incoming, requests = exchange(kv, kv_shape(kv, runs, (src - 1) % size), rank, size, group, attn)
            for qt, kt, masked in tiles(runs[rank], runs[src], causal, block):
                qs, qe, _ = qt
                s = tile_scores(q, kv[0], qt, kt, masked, scale, acc)
                m_old = m[:, :, qs:qe]
                m_new = torch.maximum(m_old, s.amax(dim=-1, keepdim=True))
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with no key yet: exp(-inf) = 0
                p = torch.exp(s - m_safe)  # (B, H, nq, nk)
                alpha = torch.exp(m_old - m_safe)  # rescales what was summed under the old max
                l[:, :, qs:qe] = l[:, :, qs:qe] * alpha + p.sum(dim=-1, keepdim=True)
                o[:, :, qs:qe] = o[:, :, qs:qe] * alpha + p @ kv[1, :, :, kt[0]:kt[1]].to(acc)
                m[:, :, qs:qe] = m_new
            if t < size - 1:
                wait(requests)
                kv = incoming
        out = (o / l).to(q.dtype)
        lse = m + torch.log(l)  # (B, H, n, 1): every query sees at least one key
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = attn, group, rank, runs, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        attn, group, rank, runs, causal, scale = ctx.args
        size, block, acc = len(runs), attn.block_size, lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1, keepdim=True)  # (B, H, n, 1) = rowsum(dO ∘ O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))  # (2, B, H, n, D)
        arriving = None  # (buffer, requests): the accumulator of the next shard, on its way from rank-1
        for t in range(size):
            src = (rank - t) % size
            if t < size - 1:
                incoming, requests = exchange(kv, kv_shape(kv, runs, (src - 1) % size), rank, size, group, attn)
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's share of d(K, V) of src
            for qt, kt, masked in tiles(runs[rank], runs[src], causal, block):
                (qs, qe, _), (ks, ke, _) = qt, kt
                qa, da = q[:, :, qs:qe].to(acc), dout[:, :, qs:qe].to(acc)
                p = torch.exp(tile_scores(q, kv[0], qt, kt, masked, scale, acc) - lse[:, :, qs:qe])  # recomputed
                dkv[1, :, :, ks:ke] += p.transpose(-2, -1) @ da
                dp = da @ kv[1, :, :, ks:ke].to(acc).transpose(-2, -1)  # (B, H, nq, nk)
                ds = p * (dp - delta[:, :, qs:qe]) * scale
                dq[:, :, qs:qe] += ds @ kv[0, :, :, ks:ke].to(acc)
                dkv[0, :, :, ks:ke] += ds.transpose(-2, -1) @ qa
            if arriving is not None:  # what ranks src+1 ... rank-1 contributed to src's accumulator
                wait(arriving[1])
                dkv += arriving[0]
            if size > 1:  # on to rank+1, whose next shard is src; the last hop brings each shard home
                arriving = exchange(dkv, kv_shape(dkv, runs, (src - 1) % size), rank, size, group, attn)
            if t < size - 1:
                wait(requests)
                kv = incoming
        if arriving is not None:
            wait(arriving[1])
            dkv = arriving[0]  # this rank's own shard, every rank's contribution summed
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None
