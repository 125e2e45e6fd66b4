"""ulysses: any single-device variant over a sequence split across P ranks (DeepSpeed-Ulysses, Jacobs
et al. 2023).

Rank p holds the contiguous shard p of q, k, v, (B, H, n_p, D) (uneven shards: variants/seqpar.py, which
also says how the forward takes the local shard). One all-to-all turns sequence shards into head
shards: rank p gets heads [p·H/P, (p+1)·H/P) of the whole sequence, (B, H/P, N, D); the wrapped
variant (``inner``, with ``inner_options``) runs on them, told which heads they are (``head_shard``), so
that a variant whose function differs per head takes those heads' parts (reformer's rotations R_h,
adaptive_span's spans z_h, linear share=none's E_h, F_h) and the whole computes exactly the inner
variant's function; a second all-to-all turns its output back into sequence shards. The backward is the
same two all-to-alls reversed; a per-head parameter's gradient lands on the rank holding that head (their
sum over the ranks is the whole gradient). Needs H % P == 0. Memory per rank: the inner variant's at
(B, H/P, N, D) beside q, k, v, o in head layout, or the last all-to-all's buffers (``memory_bytes``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .base import Flops, require, whole
from .masks import Predicate
from .seqpar import SequenceParallel


@dataclass(frozen=True)
class UlyssesOptions:
    world_size: int = 2  # processes the harness starts (the process group, when there is one, decides)
    inner: str = "full"  # the single-device variant run on each head shard
    inner_options: dict | None = None  # its options, e.g. {window: 64} for sliding_window
    backend: str | None = None  # the inner variant's backend (its own names); null: its default
    # The workload's heads, for an inner variant with one parameter per head (adaptive_span's z_h, linear
    # share=none's E_h, F_h) whose inner_options give no num_heads: the harness fills a null one, as it
    # does a plain variant's, so the inner variant computes what it computes alone (not one shared span).
    num_heads: int | None = None


class Ulysses(SequenceParallel):
    name = "ulysses"
    Options = UlyssesOptions

    def inner_build_options(self, inner_options: dict[str, Any]) -> dict[str, Any]:
        from . import REGISTRY  # here: the registry imports this module

        o = self.options
        require("backend" not in inner_options,
                "ulysses: give the inner variant's backend as variant.backend, not in inner_options")
        require(o.num_heads is None or whole(o.num_heads, 1),
                f"ulysses: num_heads must be an integer >= 1 or null; got {o.num_heads!r}")
        per_head = "num_heads" in {f.name for f in fields(REGISTRY[o.inner].Options)}
        if per_head and inner_options.get("num_heads") is None:
            inner_options = {**inner_options, "num_heads": o.num_heads}
        return {**inner_options, "backend": o.backend}

    # The inner variant's facts: the same function, backends, support, work and fidelity reference. Not its
    # training hooks (regulariser, param_groups, ...): a model's layers are found by model.modules(),
    # which reaches the inner variant itself.
    def backend_names(self) -> list[str]:
        return self.wrapped.backend_names()

    def unavailable(self, backend: str, device: torch.device | str) -> str | None:
        return self.wrapped.unavailable(backend, device)

    @property
    def backends(self) -> dict[str, bool]:
        return self.wrapped.backends

    @property
    def supports_causal(self) -> bool:
        return self.wrapped.supports_causal

    def causal_error(self) -> str:
        return f"ulysses: inner {self.wrapped.causal_error()}"

    @property
    def is_exact(self) -> bool:
        return self.wrapped.is_exact

    def mask(self, seq_len: int, causal: bool = False) -> Tensor | None:
        return self.wrapped.mask(seq_len, causal)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        return self.wrapped.allowed_pairs(seq_len, causal)

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        return self.wrapped.executed_pairs(seq_len, causal, device)

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False,
              device: torch.device | str | None = None) -> Flops:
        return self.wrapped.flops(B, H, N, D, causal, device)  # linear's projections, reformer's hashing

    def block_density(self, seq_len: int, causal: bool = False) -> float | None:
        return self.wrapped.block_density(seq_len, causal)

    def element_predicate(self, seq_len: int, causal: bool) -> Predicate | None:
        return self.wrapped.element_predicate(seq_len, causal)  # fidelity's mass_kept

    def exact_counterpart(self, block_size: int = 256) -> nn.Module:
        return self.wrapped.exact_counterpart(block_size)  # reformer's: full attention on its k̂

    def check_workload(self, num_heads: int) -> None:
        self.wrapped.check_workload(num_heads)  # the inner's heads are the whole call's, sharded over ranks
        P = self.options.world_size
        require(num_heads % P == 0, f"ulysses: num_heads={num_heads} is not divisible by world_size={P}; "
                                    f"allowed: num_heads a multiple of {P}")

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        """Per rank (rank 0's shard, the longest: n = ⌈N/P⌉), the larger of the two moments that can hold the
        peak: the inner variant's own peak on its head shard, and the last all-to-all (q, k, v's gradients
        back to sequence shards). Measured on gloo: tests/test_sequence_parallel.py."""
        P = self.options.world_size
        heads = max(1, H // P)
        inner = self.wrapped.memory_bytes(B, heads, N, D, element_size, causal, device)
        if P == 1:
            return inner  # no group: the inner variant on every head, nothing exchanged
        shard = element_size * B * H * -(-N // P) * D  # one (B, H, n, D): our output, or dq, dk or dv
        head = element_size * B * heads * N * D  # one (B, H/P, N, D): a head shard of q, k, v, o or dO
        # The inner's peak (its figure counts its own output), beside its inputs q, k, v (one (3, B, H/P, N, D)
        # buffer), its backward's input dO in head layout (out of its figure) and our output, which the
        # caller holds through the backward. Exact where the inner keeps its output and dO to the end of its
        # backward (SDPA, the block-sparse engine); a dense inner frees both before its softmax backward,
        # two head shards under this.
        during = inner + 3 * head + head + shard
        # The last all-to-all, heads_to_seq of q, k, v's gradient (3, B, H/P, N, D): that gradient and the
        # buffer sent (its pieces per rank end to end: a copy, a split along N being no view); the
        # (3, B, H, n, D) received and its reordering into dq, dk, dv (a copy: the stacked layout is no view of
        # it); our output.
        last = 2 * 3 * head + 2 * 3 * shard + shard
        # The shard lengths' all-gather, P + 1 int64 (seqpar.shard_lengths): gloo's thread may be the one to
        # free them, unseen by the profiler.
        return max(during, last) + 8 * (P + 1)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        return self.wrapped.reference(q, k, v, causal)

    def prepare(self, seq_len: int, causal: bool, device: torch.device | str) -> None:
        self.wrapped.prepare(seq_len, causal, device)  # the inner runs on every position (of a head shard)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        group, rank, size = self.process_group()
        if size == 1:
            return self.wrapped(q, k, v, causal=causal)
        H = q.shape[1]
        require(H % size == 0, f"ulysses: num_heads H={H} is not divisible by the {size} ranks; allowed: "
                               f"H a multiple of world_size")
        lengths = self.shard_lengths(q.shape[-2], q.device, group, size)
        qkv = AllToAll.apply(torch.stack((q, k, v)), seq_to_heads, heads_to_seq, self, group, rank,
                             lengths)  # (3, B, H/P, N, D)
        self.wrapped.head_shard = (rank * (H // size), H)
        try:
            out = self.wrapped(qkv[0], qkv[1], qkv[2], causal=causal)  # (B, H/P, N, D)
        finally:
            self.wrapped.head_shard = None  # the reference and facts see every head
        self.last_backend = self.wrapped.last_backend
        return AllToAll.apply(out, heads_to_seq, seq_to_heads, self, group, rank, lengths)  # (B, H, n_rank, D)


def seq_to_heads(x: Tensor, attn: Ulysses, group, rank: int, lengths: list[int]) -> Tensor:
    """(..., H, n_rank, D) -> (..., H/P, N, D): head group p goes to rank p; the sequence shards that
    arrive are laid end to end in rank order (contiguous layout)."""
    P = len(lengths)
    lead, (H, n, D) = x.shape[:-3], x.shape[-3:]
    send = x.unflatten(-3, (P, H // P)).movedim(-4, 0).contiguous()  # (P, ..., H/P, n, D)
    per_piece = send[0].numel() // n
    recv = x.new_empty(per_piece * sum(lengths))
    all_to_all(recv, send, [per_piece * m for m in lengths], [send[0].numel()] * P, group)
    attn.bytes_sent += (send.numel() - send[rank].numel()) * send.element_size()
    pieces = recv.split([per_piece * m for m in lengths])
    return torch.cat([p.view(*lead, H // P, m, D) for p, m in zip(pieces, lengths)], dim=-2)


def heads_to_seq(x: Tensor, attn: Ulysses, group, rank: int, lengths: list[int]) -> Tensor:
    """The inverse of ``seq_to_heads``: (..., H/P, N, D) -> (..., H, n_rank, D)."""
    P = len(lengths)
    lead, (h, _, D) = x.shape[:-3], x.shape[-3:]
    # Rank p's positions, (..., h, n_p, D) each, laid end to end: copied once, straight into the buffer sent
    sizes = [x.numel() // x.shape[-2] * m for m in lengths]
    send = x.new_empty(sum(sizes))
    for piece, out in zip(x.split(lengths, dim=-2), send.split(sizes)):
        out.view(piece.shape).copy_(piece)
    recv = x.new_empty(P * sizes[rank])
    all_to_all(recv, send, [sizes[rank]] * P, sizes, group)
    attn.bytes_sent += (send.numel() - sizes[rank]) * send.element_size()
    return recv.view(P, *lead, h, lengths[rank], D).movedim(0, -4).flatten(-4, -3)  # (..., H, n_rank, D)


def all_to_all(recv: Tensor, send: Tensor, recv_splits: list[int], send_splits: list[int], group) -> None:
    """``dist.all_to_all_single`` of two contiguous buffers, which on the CPU returns once gloo has let go of
    them. gloo's worker thread holds a finished operation's tensors until it next runs, and a buffer whose
    last reference it drops is freed there, unseen by the profiler that measures the CPU peak: the peak then
    counted it held to the end of the call (about one call in five on 2 cores; 6.5 to 10 MiB at P=4,
    N=2048, docs/sequence-parallel.md). So gloo gets views of its own, and this waits (a few yields) until
    the storage is ours alone again: each buffer is freed where this code drops it, and the peak repeats."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: where a torch lacks it, no wait
    wait = recv.device.type == "cpu" and use_count is not None

    def refs() -> list[int]:  # tensors holding each buffer's storage, views included
        return [use_count(t.untyped_storage()._cdata) for t in (recv, send)]
    ours = refs() if wait else None
    dist.all_to_all_single(recv.view(-1), send.view(-1), recv_splits, send_splits, group=group)
    # Bounded: gloo lets go within microseconds (at most 1 ms measured on 2 busy cores); should it ever
    # keep them longer, the call goes on after WAIT_S, and only the measured peak is affected.
    deadline = time.monotonic() + WAIT_S
    while wait and refs() != ours and time.monotonic() < deadline:
        os.sched_yield()


WAIT_S = 0.1


class AllToAll(torch.autograd.Function):
    """``there`` (seq_to_heads or heads_to_seq) forward; the other one, its inverse, backward."""

    @staticmethod
    def forward(ctx, x, there, back, attn, group, rank, lengths):
        ctx.back, ctx.args = back, (attn, group, rank, lengths)
        return there(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), *ctx.args), None, None, None, None, None, None
