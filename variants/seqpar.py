"""What ring and Ulysses share: the process group, the sequence layout of the shards, the wrapped
single-device variant and the count of bytes sent.

Design. A sequence-parallel variant is an ordinary ``Attention``: ``attn(q, k, v, causal)``. When a
``torch.distributed`` process group is initialised, q, k, v are this rank's shard of the sequence,
``(B, H, n_p, D)`` (the rows ``shard`` picks for rank p), and the result is this rank's shard of the
output; gradients flow back to the local shards. Without a process group (or in a group of one) the same
code runs on the whole sequence in one process, so the single-device tests, the float64 reference and
the harness's single-process path apply unchanged. ``world_size`` is not read by the forward (the group
decides); it tells the harness how many processes to start, and a group of another size is refused.
The group is the default one unless ``attn.group`` names another (the harness gives each point a fresh
one). Nothing depends on the backend: gloo (CPU) and NCCL (CUDA) run the same calls.

Uneven shards, no padding: N is cut into P (``contiguous``) or 2P (``zigzag``) chunks whose lengths
differ by at most one, so N need not be divisible by P. Each call all-gathers the P shard lengths (one
tiny collective) and checks they are the layout's, so every rank knows every shard's positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Attention, require, whole

LAYOUTS = ("contiguous", "zigzag")


def shard_runs(seq_len: int, world_size: int, layout: str) -> list[list[tuple[int, int]]]:
    """Per rank, the runs [start, end) of global positions it holds, in order. ``contiguous``: rank p
    holds chunk p of P; ``zigzag``: chunks p and 2P-1-p of 2P (equal causal work on every rank).
    The first N mod chunks chunks are one longer."""
    chunks = world_size * (2 if layout == "zigzag" else 1)
    require(seq_len >= chunks, f"N={seq_len} is shorter than the {chunks} chunks of layout {layout} over "
                               f"{world_size} ranks; allowed: N >= {chunks}")
    base, extra = divmod(seq_len, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + base + (c < extra))
    if layout == "contiguous":
        return [[(bounds[p], bounds[p + 1])] for p in range(world_size)]
    last = 2 * world_size - 1
    return [[(bounds[p], bounds[p + 1]), (bounds[last - p], bounds[last - p + 1])] for p in range(world_size)]


def shard(x: Tensor, rank: int, world_size: int, layout: str) -> Tensor:
    """Rank ``rank``'s rows of a whole-sequence tensor: (..., N, D) -> (..., n_rank, D)."""
    runs = shard_runs(x.shape[-2], world_size, layout)[rank]
    return torch.cat([x[..., s:e, :] for s, e in runs], dim=-2)


def unshard(shards: list[Tensor], layout: str) -> Tensor:
    """The inverse of ``shard``: every rank's shard, in rank order -> (..., N, D)."""
    N = sum(s.shape[-2] for s in shards)
    out = shards[0].new_empty((*shards[0].shape[:-2], N, shards[0].shape[-1]))
    for piece, runs in zip(shards, shard_runs(N, len(shards), layout)):
        offset = 0
        for s, e in runs:
            out[..., s:e, :] = piece[..., offset:offset + e - s, :]
            offset += e - s
    return out


def local_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """A rank's runs as (local start, local end, global start): where each run sits in its shard."""
    out, offset = [], 0
    for s, e in runs:
        out.append((offset, offset + e - s, s))
        offset += e - s
    return out


class SequenceParallel(Attention):
    """Base of ring and ulysses: options ``world_size``, ``inner``, ``inner_options`` (see module doc)."""

    layout_name = "contiguous"

    def __init__(self, **options: Any) -> None:
        inner_options = options.get("inner_options")
        if isinstance(inner_options, Mapping):  # a plain dict (Hydra passes a DictConfig): recorded as JSON
            options["inner_options"] = {str(k): v for k, v in inner_options.items()}
        super().__init__(**options)
        o = self.options
        require(whole(o.world_size, 1),
                f"{self.name}: world_size must be an integer >= 1; got {o.world_size!r}")
        self.wrapped  # built now, so that its own checks run at construction
        self.group = None  # a process group to run on; None: the default group, if initialised
        self.bytes_sent = 0  # bytes this rank has sent to other ranks (the harness resets and reads it)

    # ----- the wrapped single-device variant -------------------------------------------------------
    @property
    def wrapped(self) -> Attention:
        """The inner variant, built once from ``inner`` and ``inner_options`` (lazily: the base class
        asks for backend names before our __init__ body runs)."""
        if "inner" not in self._modules:
            from . import REGISTRY, build  # here: the registry imports this module

            o = self.options
            single = [n for n, c in REGISTRY.items() if not issubclass(c, SequenceParallel)]
            require(o.inner in single, f"{self.name}: inner must be a single-device variant; got {o.inner!r}; "
                                       f"allowed: {', '.join(single)}")
            require(isinstance(o.inner_options, Mapping) or o.inner_options is None,
                    f"{self.name}: inner_options must be a mapping of the inner variant's options; "
                    f"got {o.inner_options!r}")
            self.inner = build(o.inner, **self.inner_build_options(dict(o.inner_options or {})))
        return self.inner

    def inner_build_options(self, inner_options: dict[str, Any]) -> dict[str, Any]:
        return inner_options

    @property
    def world_size(self) -> int:
        return self.options.world_size

    # ----- the process group -----------------------------------------------------------------------
    def process_group(self) -> tuple[Any, int, int]:
        """(group, rank, size) of the group this call runs on; (None, 0, 1) without one."""
        if not dist.is_available() or not dist.is_initialized():
            return None, 0, 1
        group = self.group or dist.group.WORLD
        size = dist.get_world_size(group)
        require(size in (1, self.options.world_size),
                f"{self.name}: world_size={self.options.world_size} but the process group has {size} ranks")
        return group, dist.get_rank(group), size

    def shard_lengths(self, n_local: int, device: torch.device, group: Any, size: int) -> list[int]:
        """Every rank's shard length, checked against the layout (an uneven split is the layout's)."""
        if size == 1:
            return [n_local]
        mine = torch.tensor([n_local], dtype=torch.int64, device=device)
        got = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(got, mine, group=group)
        lengths = [int(t) for t in got]
        want = [sum(e - s for s, e in runs) for runs in shard_runs(sum(lengths), size, self.layout_name)]
        require(lengths == want, f"{self.name}: shard lengths {lengths} are not layout {self.layout_name}'s "
                                 f"split of N={sum(lengths)} over {size} ranks ({want}); use "
                                 f"variants.seqpar.shard")
        return lengths

    def count_sent(self, t: Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.options).items() if k != "inner_options")
