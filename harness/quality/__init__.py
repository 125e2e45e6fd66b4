"""What a variant loses, measured at each ok point: errors against exact attention on the same inputs
(fidelity.py, float64 reference) and the accuracy of a small Transformer trained with it on MQAR
(task.py trains model.py on mqar.py's data); the run loop's one entry is ``quality``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

import variants
from variants import VariantError

from ..config import ConfigError, Settings, one_line
from ..memory import check_fits, release_memory, tensor_bytes


def task_config(settings: Settings, seq_len: int):
    """The MQAR config for a point of length ``seq_len`` (task.seq_len null: the point's N)."""
    from .task import MQARConfig

    values = dict(settings.task)
    if values.get("seq_len") is None:
        values["seq_len"] = seq_len
    try:
        return MQARConfig.from_dict(values)
    except ValueError as e:
        raise ConfigError(f"task=mqar at N={seq_len}: {one_line(e).removeprefix('mqar config: ')}") from None


def task_options(settings: Settings, attn: variants.Attention, seq_len: int) -> tuple[tuple[str, Any], ...]:
    """The task's settings as part of a point's identity: every MQARConfig field that can change its
    numbers (defaults filled in), ``seq_len`` as configured (null: each point's N). Not ``eval_every``
    (how often training is logged: the final eval is the same) nor, for a variant without a regulariser,
    ``span_penalty`` (it adds nothing to its loss). () without a task."""
    if settings.task is None:
        return ()
    values = dataclasses.asdict(task_config(settings, seq_len))
    values["seq_len"] = settings.task.get("seq_len")
    del values["eval_every"]
    if all(a.regulariser() is None for a in attn.modules() if isinstance(a, variants.Attention)):  # ulysses: its inner
        del values["span_penalty"]
    return tuple(sorted(values.items()))


def quality(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device, rec: dict[str, Any],
            on_phase, task_log, task_cache: dict[int, dict[str, Any]], budget: int | None = None) -> None:
    """Fidelity and task numbers into ``rec``. A failure here (out of memory in the float64 reference,
    a task that diverges) leaves the timing intact: the numbers stay None and ``quality_reason`` says why.
    ``budget``: bytes (the CPU's memory_budget_gb), which fidelity's analytic memory must not pass."""
    reasons = []
    if s.fidelity.enabled:
        if s.fidelity.max_seq_len is not None and seq_len > s.fidelity.max_seq_len:
            reasons.append(f"fidelity: N > fidelity.max_seq_len={s.fidelity.max_seq_len}")
        elif budget is not None and (needed := fidelity_memory_bytes(attn, s, seq_len, device)) > budget:
            reasons.append(f"fidelity: analytic memory {needed / 1e9:.3g} GB (fidelity.batch_size="
                           f"{s.fidelity.batch_size}, float64 reference) exceeds the memory budget "
                           f"{budget / 1e9:.3g} GB (memory_budget_gb)")
        else:
            on_phase("fidelity")
            reasons.append(guarded("fidelity", device, lambda: rec.update(point_fidelity(attn, s, seq_len, device))))
    elif attn.world_size > 1:  # harness.distributed.Team turns it off
        reasons.append(f"fidelity: not measured over world_size={attn.world_size} ranks (its float64 reference "
                       f"needs the whole sequence in one process; the tests check {attn.name} against it)")
    if s.task is not None:
        on_phase("task")
        cfg = task_config(s, seq_len)

        def train() -> None:
            if cfg.seq_len not in task_cache:
                task_cache[cfg.seq_len] = train_task(attn, s, cfg, device, task_log)
            rec.update(task_cache[cfg.seq_len])

        reasons.append(guarded("task", device, train))
    reasons = [r for r in reasons if r]
    rec["quality_reason"] = "; ".join(reasons) or None


def fidelity_memory_bytes(attn: variants.Attention, s: Settings, seq_len: int,
                          device: torch.device | None = None) -> int:
    """Analytic peak of fidelity at ``fidelity.batch_size``: the larger of the variant's forward+backward
    (in the run's dtype) and its float64 exact counterpart's, beside the inputs, output and gradients of
    both (the variant's kept while the reference runs)."""
    B, H, N, D = s.fidelity.batch_size, s.num_heads, seq_len, s.head_dim
    e = torch.empty((), dtype=s.torch_dtype).element_size()
    reference = attn.exact_counterpart(s.fidelity.block_size)
    return (max(attn.memory_bytes(B, H, N, D, e, s.causal, device), reference.memory_bytes(B, H, N, D, 8, s.causal, device))
            + B * H * N * D * (8 * e + 8 * 8))


def guarded(what: str, device: torch.device, fn) -> str | None:
    try:
        fn()
    except Exception as e:  # OutOfMemoryError included: recorded, the point and the sweep go on
        message = str(e) if isinstance(e, (VariantError, ConfigError)) else f"{type(e).__name__}: {e}"
        release_memory(device)
        return one_line(f"{what}: {message}")[:300]
    return None


def point_fidelity(attn: variants.Attention, s: Settings, seq_len: int, device: torch.device) -> dict[str, Any]:
    from .fidelity import fidelity, make_inputs

    gen = torch.Generator().manual_seed(s.seed)
    q, k, v = make_inputs(s.inputs, s.fidelity.batch_size, s.num_heads, seq_len, s.head_dim,
                          dtype=s.torch_dtype, device=device, generator=gen)  # (B, H, N, D)
    result = fidelity(attn, q, k, v, causal=s.causal, block_size=s.fidelity.block_size, grad_seed=s.seed)
    bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"non-finite {', '.join(bad)} (the variant's output or gradients overflow "
                                 f"in {s.dtype})")
    return result


def model_options(attn: variants.Attention, cfg) -> dict[str, Any]:
    """The options of each attention layer of the task's model: the variant's, with the model's heads."""
    options = dataclasses.asdict(attn.options)
    if options.get("num_heads") is not None:
        options["num_heads"] = cfg.n_heads  # linear share=none: one E_h, F_h per head of the task's model
    return options


def check_task(attn: variants.Attention, s: Settings) -> None:
    """The task's options at every length (task_config), before anything is written; and its model at
    the longest must fit in memory with its gradients and Adam's two moments (four copies of its
    parameters): counted on the meta device at 1 and 2 layers, the others by the difference, so that
    ``task.n_layers=1e11`` is refused at once, not built for hours."""
    from .task import build_model

    cfg = max((task_config(s, n) for n in s.seq_lens), key=lambda c: c.seq_len)

    def size(n_layers: int) -> int:
        with torch.device("meta"):
            return tensor_bytes(build_model(type(attn), model_options(attn, cfg), dataclasses.replace(cfg, n_layers=n_layers)))
    try:
        one, two = size(1), size(2)
    except Exception:  # a variant whose __init__ reads tensors' values (not on meta): not counted
        return
    check_fits(f"task=mqar's model (n_layers={cfg.n_layers}, d_model={cfg.d_model}, vocab_size={cfg.vocab_size}, "
               f"seq_len={cfg.seq_len}), its gradients and Adam's moments", 4 * (one + (cfg.n_layers - 1) * (two - one)),
               "task sizes whose model fits")


def train_task(attn: variants.Attention, s: Settings, cfg, device: torch.device, task_log) -> dict[str, Any]:
    from .task import train_mqar

    options = model_options(attn, cfg)
    out = train_mqar(type(attn), options, cfg, log=task_log, device=device)  # the class: any _target_ trains
    if out["task_loss"] is None or not math.isfinite(out["task_loss"]):  # NaN logits' argmax: an accuracy of 0
        raise FloatingPointError(f"the training diverged: its final eval loss is {out['task_loss']} "
                                 f"(task.lr={cfg.lr}); no accuracy is recorded")
    return {"task_seq_len": cfg.seq_len, "task_accuracy": out["task_accuracy"], "task_loss": out["task_loss"],
            "task_no_recall_accuracy": out["no_recall_accuracy"], "task_train_s": out["train_seconds"]}
