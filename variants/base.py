"""The one interface every attention variant implements.

A variant is an ``nn.Module`` called as ``attn(q, k, v, causal=False)`` on ``(B, H, N, D)`` tensors. It
holds only the attention maths; projections (Wq, Wk, Wv, Wo) live in the shared wrapper of the model
that uses it. Each variant declares a closed, typed ``Options`` dataclass (a misspelt option fails,
naming it) and the facts the harness and tests read instead of guessing: causal support, exactness,
backends, analytic FLOPs and memory, density, and what a call ran. Each fact has a default here that a
variant overrides where it differs, so the harness never asks which class it holds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from .masks import Predicate, causal_allowed


class VariantError(ValueError):
    """Bad configuration or input. The message is one line naming the problem and the allowed values."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise VariantError(message)


SEED_MAX = 2**63 - 1  # a seed is an int64, as the harness's own (harness.config, which imports no torch)


def whole(value: Any, minimum: int) -> bool:
    """Whether an option is an integer from ``minimum`` to 2**63-1: a bool is none (true passed for 1, and
    a window of true ran), and one past int64 could not be stored in its point's row."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= SEED_MAX


def seed_error(name: str, value: Any) -> str | None:
    """The one line refusing ``value`` as the seed ``name``, or None where it is one (0 … 2**63-1)."""
    if whole(value, 0):
        return None
    return f"{name} must be an integer from 0 to 2**63-1 ({SEED_MAX}); got {value!r}"


def require_seed(name: str, value: Any) -> None:
    error = seed_error(name, value)
    require(error is None, error or "")


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs of one call. ``executed`` counts what the backend computes (whole blocks, padding,
    masked entries); ``useful`` counts only allowed (query, key) pairs. Backward is 2.5x forward
    (flash-attention's convention)."""

    executed: int
    useful: int


def score_tensors(device: torch.device | str | None) -> int:
    """Score-sized tensors a dense path holds at its softmax backward: P, dP, dS; on CUDA also dP ∘ P
    (Attention.memory_bytes says why)."""
    return 4 if device is not None and torch.device(device).type == "cuda" else 3


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q kᵀ·scale, masked to -inf where ``mask`` is False) v, materialising the N×N scores.

    The readable path and, called on float64 copies, the test oracle. ``mask``: (N, N) or (H, N, N) bool.
    """
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
    if mask is not None:
        scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, H, N, D)


def resolved(device: torch.device | str) -> torch.device:
    """``device`` as a tensor on it reports it ("cuda" is "cuda:<current>"): the key of what is kept per
    device, so that what ``prepare`` built for "cuda" is what a call on "cuda:0" finds."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> Tensor:
    i = torch.arange(seq_len, device=device)
    return causal_allowed(i[:, None], i[None, :])  # (N, N): j ≤ i


class Attention(nn.Module):
    """Base class. Subclasses set ``name``, ``Options``, ``backends`` and implement ``_attend``."""

    name: ClassVar[str]
    Options: ClassVar[type]
    # backend name -> needs CUDA. The first one is the default when ``backend`` is not given.
    backends: ClassVar[dict[str, bool]]
    supports_causal: ClassVar[bool] = True

    def __init__(self, **options: Any) -> None:
        super().__init__()
        fields = [f.name for f in dataclasses.fields(self.Options)]
        unknown = sorted(set(options) - set(fields))
        require(not unknown, f"{self.name}: unknown option {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(fields)}")
        self.options = self.Options(**options)
        allowed = self.backend_names()
        backend = self.options.backend
        require(backend is None or backend in allowed,
                f"{self.name}: unknown backend {backend!r}; allowed: {', '.join(allowed)}")
        self._backend = allowed[0] if backend is None else backend
        if self._backend == "flex":
            # torch.compile's machinery (torch._dynamo, which create_mask needs too: seconds to import) loaded
            # now, not inside the first BlockMask's timed set-up
            from .flex import compiled_flex_attention

            compiled_flex_attention()
        self.last_backend: str | None = None  # set by a backend that chooses a kernel per call (full's auto)
        # (first, total): the calls get heads [first, first + H) of ``total``. Set by ulysses while it runs
        # the variant on a head shard; None: a call gets every head. See heads().
        self.head_shard: tuple[int, int] | None = None
        # (N, device) -> engine_order and its inverse there, or None (as given): asked once per N and device
        self._orders_on: dict[tuple[int, str], tuple[Tensor, Tensor] | None] = {}

    # ----- facts -----------------------------------------------------------------------------------
    def backend_names(self) -> list[str]:
        return list(self.backends)

    @property
    def backend(self) -> str:
        """The backend this instance runs (the option, or the first of ``backend_names()``)."""
        return self._backend

    @property
    def backend_ran(self) -> str:
        """The backend the last call ran: ``backend``, or the kernel it chose (``last_backend``)."""
        return self.last_backend or self.backend

    @property
    def world_size(self) -> int:
        """Processes one call runs on (the sequence-parallel variants: their ``world_size`` option)."""
        return 1

    def check_workload(self, num_heads: int) -> None:
        """Raises VariantError (one line naming the allowed values) when the variant, as configured,
        cannot run ``num_heads`` heads: one whose ``num_heads`` option sizes its per-head parameters
        (linear share=none's E_h, F_h; adaptive_span's z_h) needs the workload's (else every point failed
        as an error); ulysses a multiple of its world size."""
        own = getattr(self.options, "num_heads", None)
        require(own is None or own == num_heads, f"{self.name}: num_heads={own} (its per-head parameters) but the "
                                                 f"workload has {num_heads} heads; allowed: {num_heads}, or null")

    @property
    def is_exact(self) -> bool:
        """True when the variant computes the same function as ``full``."""
        return False

    def heads(self, num_heads: int) -> tuple[slice, int]:
        """Which of the variant's heads a call's ``num_heads`` heads are, and how many there are in all:
        (slice, total). A variant whose function differs per head (reformer's R_h, adaptive_span's z_h,
        linear share=none's E_h, F_h) takes that slice of its per-head parts, so a head shard (ulysses)
        computes exactly what those heads compute in a call on every head."""
        first, total = (0, num_heads) if self.head_shard is None else self.head_shard
        require(first + num_heads <= total, f"{self.name}: heads [{first}, {first + num_heads}) of a call on "
                                            f"heads [0, {total}): allowed: at most {total - first} heads")
        return slice(first, first + num_heads), total

    def engine_order(self, seq_len: int) -> Tensor | None:
        """(N,) the order in which the variant's kernels (the block-sparse engine, flex) run the positions:
        their position p is position order[p]. None: as given. The variant's layout and predicate are then
        stated in that order (``engine_layout``, ``masks.reordered``); the order must keep every allowed
        pair's j ≤ i, so that causality carries over. sliding_window with dilation has one."""
        return None

    def in_engine_order(self, body: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor,
                        v: Tensor) -> Tensor:
        """``body(q, k, v)`` on (B, H, N, D) inputs taken in ``engine_order``, its output put back in the
        positions' order: two O(N·D) copies in, one out (and their gradients)."""
        key = (q.shape[-2], str(q.device))
        if key not in self._orders_on:  # copied to the device once: a copy per call from pageable host
            order = self.engine_order(key[0])  # memory would wait for the device's queue
            self._orders_on[key] = None if order is None else (order.to(q.device), torch.argsort(order).to(q.device))
        if self._orders_on[key] is None:
            return body(q, k, v)
        order, back = self._orders_on[key]
        out = body(*(t.index_select(2, order) for t in (q, k, v)))  # (B, H, N, D) in the engine's order
        return out.index_select(2, back)

    def available_backends(self, device: torch.device | str) -> list[str]:
        return [b for b in self.backend_names() if self.unavailable(b, device) is None]

    def unavailable(self, backend: str, device: torch.device | str) -> str | None:
        """Why ``backend`` cannot run on ``device``, one line starting "backend '<name>'"; None where it
        can. A GPU backend needs CUDA; xformers also needs kernels that run on this torch and CUDA."""
        if self.backends[backend] and torch.device(device).type != "cuda":
            return f"backend {backend!r} needs CUDA"
        if backend == "xformers":
            from .xformers_backend import unavailable_reason

            return unavailable_reason(device)
        return None

    def unavailable_error(self, backend: str, device: torch.device | str) -> str | None:
        """The one-line refusal of a backend that cannot run on ``device``, naming the ones that can."""
        reason = self.unavailable(backend, device)
        return None if reason is None else (f"{self.name}: {reason}; available on {torch.device(device).type}: "
                                            f"{', '.join(self.available_backends(device))}")

    def mask(self, seq_len: int, causal: bool = False) -> Tensor | None:
        """Dense bool (N, N) mask of allowed (query, key) pairs: the test oracle, never the fast path."""
        raise NotImplementedError

    def element_predicate(self, seq_len: int, causal: bool) -> Predicate | None:
        """The rule ``allowed(i, j)`` of the variant's mask on broadcast index tensors, causality
        excluded (variants/masks.py), for checks that go a few query rows at a time; None when no
        such rule exists (linear mixes every key; reformer's set depends on q)."""
        return None

    def exact_counterpart(self, block_size: int = 256) -> nn.Module:
        """The exact function this variant approximates, in O(N·block_size) memory forward and backward,
        for fidelity: exact attention (blockwise exact), unless the variant changes the keys themselves
        (reformer: full attention on its shared-QK keys)."""
        from .blockwise import Blockwise  # here: blockwise builds on this module

        return Blockwise(mode="exact", block_size=block_size)

    def allowed_pairs(self, seq_len: int, causal: bool = False) -> int:
        """Number of (query, key) pairs whose scores the variant's function uses, per (batch, head)."""
        m = self.mask(seq_len, causal)
        return int(m.sum()) // (m.shape[0] if m.dim() == 3 else 1)

    def density(self, seq_len: int, causal: bool = False) -> float:
        """Used score entries over N²: 1 for full, about 1/2 for full causal."""
        return self.allowed_pairs(seq_len, causal) / seq_len**2

    def block_density(self, seq_len: int, causal: bool = False) -> float | None:
        """The layout's allowed key blocks over all nb² blocks (what the engine computes is counted by the
        executed FLOPs); None for a variant without a block layout."""
        return None

    def flops(self, B: int, H: int, N: int, D: int, causal: bool = False,
              device: torch.device | str | None = None) -> Flops:
        """``device``: see ``executed_pairs``."""
        useful = 4 * B * H * D * self.allowed_pairs(N, causal)
        return Flops(executed=4 * B * H * D * self.executed_pairs(N, causal, device), useful=useful)

    def executed_pairs(self, seq_len: int, causal: bool = False, device: torch.device | str | None = None) -> int:
        """(query, key) pairs the backend computes per (batch, head). ``device``: where it runs, for a
        backend whose count is known only there (flex: the tiles of its BlockMask, built on that device
        and kept); without it such a count is the allowed pairs, the fused kernels' convention."""
        return self.allowed_pairs(seq_len, causal)

    def memory_bytes(self, B: int, H: int, N: int, D: int, element_size: int = 4, causal: bool = False,
                     device: torch.device | str | None = None) -> int:
        """Analytic estimate of the extra peak memory of forward+backward (q, k, v and the output
        gradient, the inputs, excluded): an upper bound of the measured CPU peak, within 1.3× of it
        (tests/test_memory_scaling.py::test_analytic_memory_bounds_the_measured_peak). ``device``: where it
        runs (None: CPU), for a backend that sizes its work per device (the block-sparse engine's tiles) or
        whose kernels differ there (the softmax backward below)."""
        # Dense attention's peak is the softmax backward: the saved probabilities P, dP and dS (three
        # score-sized tensors) beside the output and dV (two N×D); dq and dk come after it. Measured
        # exactly so on CPU (tests/test_harness.py). On CUDA PyTorch's softmax backward first forms
        # dP ∘ P as a tensor of its own (softmax_backward_cuda_out's ``tmp = grad * output``): four,
        # measured so on an H100 (4.00·N², results/gpu/). Plus the bool mask the dense path saves
        # (masked_fill keeps its negation). Variants with their own structure override this.
        return (element_size * B * H * (score_tensors(device) * self.executed_pairs(N, causal) + 2 * N * D)
                + self.mask_bytes(B, H, N, causal))

    def mask_bytes(self, B: int, H: int, N: int, causal: bool) -> int:
        """Bytes of the bool mask a dense path holds through the backward: one (N, N)."""
        return N * N

    # ----- training: what a model that trains the variant asks of each layer (harness/quality/task.py) -
    def regulariser(self) -> Tensor | None:
        """A term of the training loss, before the task's coefficient (adaptive_span: the mean span of
        its heads, the paper's span loss); None: the variant adds nothing."""
        return None

    def param_groups(self) -> list[dict[str, Any]]:
        """The variant's own parameters that train apart from the model's, as optimiser groups
        (``lr_scale`` multiplies the task's learning rate); the model's groups leave them out."""
        return []

    def after_step(self) -> None:
        """Called after each optimiser step (adaptive_span keeps its spans in range)."""

    def training_metrics(self) -> dict[str, list[float]]:
        """Numbers to log while training, one per head (adaptive_span: ``span``)."""
        return {}

    # ----- call ------------------------------------------------------------------------------------
    def scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        check_qkv(q, k, v)
        require(not causal or self.supports_causal, self.causal_error())
        error = self.unavailable_error(self.backend, q.device)
        require(error is None, error)
        return self._attend(q, k, v, causal, self.backend)

    def prepare(self, seq_len: int, causal: bool, device: torch.device | str) -> None:
        """Builds and keeps what a call at ``seq_len`` needs on ``device`` before its first call: the
        flex backends' BlockMask, the dense path's mask, the block-sparse engine's plan there. The harness
        times it apart (``setup_s``), before the warm-up, as FlexAttention's paper reports mask creation
        apart from the kernel. Nothing by default: the first call builds what it needs."""

    def causal_error(self) -> str:
        return f"{self.name} does not support causal=True"

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, backend: str) -> Tensor:
        raise NotImplementedError

    def reference(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        """The contract's function in float64 on the dense mask (differentiable)."""
        require(not causal or self.supports_causal, self.causal_error())
        q, k, v = (t.double() for t in (q, k, v))
        return dense_attention(q, k, v, self.mask(q.shape[-2], causal), self.scale(q.shape[-1]))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.options).items())


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        require(t.dim() == 4, f"{name} must have 4 dims (B, H, N, D); got shape {tuple(t.shape)}")
    require(q.shape == k.shape == v.shape,
            f"q, k, v must have the same shape (B, H, N, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}")
    require(q.dtype == k.dtype == v.dtype,
            f"q, k, v must have the same dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    require(q.device == k.device == v.device,
            f"q, k, v must be on the same device; got {q.device}, {k.device}, {v.device}")
    require(q.is_floating_point(), f"q, k, v must be floating point; got {q.dtype}")
    require(q.shape[-2] > 0, "sequence length N must be > 0")
