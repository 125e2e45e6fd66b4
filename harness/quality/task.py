"""Train and evaluate a small Transformer with a given attention variant on MQAR.

``train_mqar("sliding_window", {"window": 8}, MQARConfig())`` trains with AdamW on freshly generated
batches (one seeded generator), evaluates accuracy on query positions of a fixed seeded eval set every
``eval_every`` steps, and returns the final accuracy and loss with the history. Everything is seeded
from ``cfg.seed`` (data, eval set, initialisation) without touching the global RNG, so the same config
and variant give the same run on the same device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

import variants
from harness.quality.model import POSITIONS, TinyTransformer, query_loss
from harness.quality.mqar import IGNORE_INDEX, mqar_batch, no_recall_accuracy, validate

Log = Callable[[int, dict[str, float]], None]


@dataclass(frozen=True)
class MQARConfig:
    """Task, model and training sizes. Defaults: a CPU run at seq_len 128 in under a minute in which full
    attention solves the task. Measured (seed 0, 500 steps, one thread on a shared 2-core machine;
    final eval accuracy, training seconds): full (sdpa or math) 1.000, 42–50 s, solved by step 200
    (seeds 1, 2: 1.000, 0.998); blockwise exact 1.000 (the same curve as full); sparse fixed b=16
    0.52; linear k=32 (bidirectional) 0.21; sliding_window w=32 0.085, w=8 0.032; blockwise local
    b=32 0.044. Without recall: 1/32 guessing any value, 0.21 answering the sequence's most frequent
    value (``no_recall_accuracy``: values repeat, so more than 1/8).

    ``short_conv`` follows Zoology, whose attention baselines are hybrids of a short convolution and
    attention: without it, full attention stayed at ~0.2 accuracy (the in-context-value plateau) for
    2000 steps at these sizes, whatever the lr, positions or heads; with it the recall circuit forms
    in ~200 steps. The kernel (3) is local, so it cannot carry a key to a distant query: long-range
    recall still has to go through the attention variant."""

    # task (harness/quality/mqar.py)
    seq_len: int = 128  # total length: 2·num_kv_pairs pair tokens, then the query region
    vocab_size: int = 64  # PAD + 31 key tokens + 32 value tokens
    num_kv_pairs: int = 8
    num_queries: int = 8  # each asks a distinct key of its sequence
    # model (harness/quality/model.py)
    d_model: int = 64
    n_layers: int = 2  # two layers: recall needs a previous-token step and a lookup step
    n_heads: int = 2
    d_mlp: int | None = None  # None: 4·d_model
    positions: str = "learned"  # learned | sinusoidal | rope
    short_conv: int = 3  # causal depthwise conv kernel before attention (Zoology's hybrid); 0: none
    # training
    batch_size: int = 32
    steps: int = 500
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20  # linear warm-up, then cosine decay to lr/10
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 100
    eval_size: int = 256  # sequences in the fixed eval set
    seed: int = 0
    # adaptive_span only: λ of the paper's span penalty λ/M·Σ_h z_h per layer (M heads), added to the
    # loss; 2e-6 is the authors' coefficient for their small models (5e-7 for the large ones)
    span_penalty: float = 2e-6

    def __post_init__(self) -> None:
        for name in ("seq_len", "vocab_size", "num_kv_pairs", "num_queries", "d_model", "n_layers", "n_heads",
                     "batch_size", "steps", "eval_every", "eval_size"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "seed", "short_conv"):
            _check_int(name, getattr(self, name), 0)
        if self.d_mlp is not None:
            _check_int("d_mlp", self.d_mlp, 1)
        for name in ("lr", "weight_decay", "grad_clip", "span_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"mqar config: {name} must be a finite number {'> 0' if name == 'lr' else '>= 0'}; "
                                 f"got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"mqar config: d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.positions not in POSITIONS:
            raise ValueError(f"mqar config: unknown positions {self.positions!r}; allowed: {', '.join(POSITIONS)}")
        head_dim = self.d_model // self.n_heads
        if self.positions == "rope" and head_dim % 2:  # RoPE rotates pairs of a head's dimensions
            raise ValueError(f"mqar config: positions=rope needs an even head dimension d_model/n_heads; got "
                             f"{self.d_model}/{self.n_heads} = {head_dim}; allowed: an even d_model/n_heads, or "
                             f"positions {', '.join(p for p in POSITIONS if p != 'rope')}")
        validate(self.seq_len, self.vocab_size, self.num_kv_pairs, self.num_queries)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "MQARConfig":
        """From a plain mapping (e.g. a Hydra node as a dict); an unknown key fails, naming the allowed."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"mqar config: unknown option {', '.join(map(repr, unknown))}; allowed: {', '.join(fields)}")
        return cls(**values)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"mqar config: {name} must be an integer >= {minimum}; got {value!r}")


# Long-length preset for a GPU (numbers only; not run on CPU). Zoology's MQAR sizes (vocab 8192,
# 64 pairs, d_model 128) at 4K tokens: queries sit up to ~4K positions from their keys.
GPU_PRESET = MQARConfig(
    seq_len=4096, vocab_size=8192, num_kv_pairs=64, num_queries=64,
    d_model=128, n_layers=2, n_heads=2, positions="learned",
    batch_size=64, steps=8000, lr=1e-3, weight_decay=0.1, warmup_steps=400,
    eval_every=500, eval_size=1024, seed=0,
)
PRESETS: dict[str, MQARConfig] = {"cpu": MQARConfig(), "gpu": GPU_PRESET}


def lr_at(step: int, cfg: MQARConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to lr/10 at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def build_model(variant: str | type[variants.Attention], variant_options: Mapping[str, Any],
                cfg: MQARConfig) -> TinyTransformer:
    """The model with one attention per layer: ``variants.build(variant, **variant_options)`` for a name,
    ``variant(**variant_options)`` for a class (a variant defined outside the package)."""
    def make() -> variants.Attention:
        return variant(**variant_options) if isinstance(variant, type) else variants.build(variant, **variant_options)

    make()  # fail on a bad option before anything else
    return TinyTransformer(cfg.vocab_size, cfg.seq_len, make,
                           d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_mlp=cfg.d_mlp,
                           positions=cfg.positions, short_conv=cfg.short_conv)


def attention_layers(model: torch.nn.Module) -> list[variants.Attention]:
    """The model's attention variants, one per layer: what the training loop asks for their own terms."""
    return [m for m in model.modules() if isinstance(m, variants.Attention)]


def span_penalty(model: torch.nn.Module, cfg: MQARConfig) -> Tensor:
    """The regularisers of the model's attention layers times the task's coefficient: adaptive_span's
    span loss, λ · Σ over layers of the mean span of the layer's heads (λ/M · Σ_h z_h); 0 for variants
    without one."""
    terms = [t for t in (a.regulariser() for a in attention_layers(model)) if t is not None]
    return cfg.span_penalty * sum(terms, torch.zeros(()))


def layer_metrics(model: torch.nn.Module) -> dict[str, float]:
    """The layers' per-head numbers, ``<name>_l<layer>_h<head>`` (adaptive_span: span_l0_h0, in tokens).
    A layer is the model's: a variant inside another (ulysses' inner) counts as its wrapper's layer."""
    found = attention_layers(model)
    nested = {id(m) for a in found for m in a.modules() if m is not a}
    return {f"{name}_l{layer}_h{h}": value
            for layer, top in enumerate(a for a in found if id(a) not in nested)
            for a in top.modules() if isinstance(a, variants.Attention)
            for name, values in a.training_metrics().items() for h, value in enumerate(values)}


def make_eval_set(cfg: MQARConfig) -> tuple[Tensor, Tensor]:
    """The fixed eval set: ``eval_size`` sequences from a generator seeded apart from the training data."""
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    return mqar_batch(cfg.eval_size, cfg.seq_len, cfg.vocab_size, cfg.num_kv_pairs, cfg.num_queries, gen)


@torch.no_grad()
def evaluate(model: TinyTransformer, inputs: Tensor, targets: Tensor, batch_size: int) -> dict[str, float]:
    """Accuracy (argmax == target) and mean cross-entropy over query positions only."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    loss_sum = 0.0
    for s in range(0, inputs.shape[0], batch_size):
        x, y = inputs[s:s + batch_size].to(device), targets[s:s + batch_size].to(device)
        logits = model(x)  # (b, N, V)
        asked = y != IGNORE_INDEX  # (b, N)
        n = int(asked.sum())
        loss_sum += float(query_loss(logits, y)) * n
        correct += int((logits.argmax(dim=-1)[asked] == y[asked]).sum())
        total += n
    model.train(was_training)
    return {"eval_accuracy": correct / total, "eval_loss": loss_sum / total}


def train_mqar(variant: str | type[variants.Attention], variant_options: Mapping[str, Any] | None = None,
               cfg: MQARConfig | None = None, log: Log | None = None,
               device: torch.device | str = "cpu") -> dict[str, Any]:
    """Trains on MQAR with the variant (a name, or an Attention class); returns ``task_accuracy`` and ``task_loss`` (final eval),
    ``history`` (one dict per eval: step, train_loss averaged since the previous eval, eval_accuracy,
    eval_loss), ``no_recall_accuracy`` (the eval set's best without recall: mqar.no_recall_accuracy),
    ``num_params``, ``causal`` and ``train_seconds``.

    ``log(step, {"train_loss", "eval_accuracy", "eval_loss"})`` is called at every eval. Each attention
    layer trains its own way through the variant's training hooks (variants/base.py): with adaptive_span
    the loss adds the span penalty (``span_penalty``), the metrics add it and every head's span
    (``span_l<layer>_h<head>``), and the spans are kept in [0, max_span] after each step and stepped at
    lr·max_span, as the paper trains them.
    """
    cfg = cfg or MQARConfig()
    variant_options = dict(variant_options or {})
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's RNG
        torch.manual_seed(cfg.seed)
        model = build_model(variant, variant_options, cfg).to(device)
    layers = attention_layers(model)
    own = [g for a in layers for g in a.param_groups()]  # the variants' own parameters, trained their way
    apart = {id(p) for g in own for p in g["params"]}
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n and id(p) not in apart]
    no_decay = [p for n, p in model.named_parameters()
                if not (p.dim() >= 2 and "emb" not in n) and id(p) not in apart]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}, *own]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))
    eval_inputs, eval_targets = make_eval_set(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)

    history: list[dict[str, float]] = []
    loss_sum, loss_count = 0.0, 0
    start = time.perf_counter()
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, cfg) * group.get("lr_scale", 1.0)
        x, y = mqar_batch(cfg.batch_size, cfg.seq_len, cfg.vocab_size, cfg.num_kv_pairs, cfg.num_queries, gen)
        loss = query_loss(model(x.to(device)), y.to(device))
        penalty = span_penalty(model, cfg).to(loss.device)
        opt.zero_grad(set_to_none=True)
        (loss + penalty).backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        for a in layers:
            a.after_step()
        loss_sum += float(loss.detach())
        loss_count += 1
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics = {"train_loss": loss_sum / loss_count,
                       **evaluate(model, eval_inputs, eval_targets, cfg.batch_size)}
            extra = layer_metrics(model)
            if extra:
                metrics.update(span_penalty=float(span_penalty(model, cfg).detach()), **extra)
            history.append({"step": step, **metrics})
            if log is not None:
                log(step, metrics)
            loss_sum, loss_count = 0.0, 0
    final = history[-1]
    return {
        "task_accuracy": final["eval_accuracy"],
        "task_loss": final["eval_loss"],
        "history": history,
        "no_recall_accuracy": no_recall_accuracy(eval_inputs, eval_targets, cfg.num_kv_pairs),
        "num_params": sum(p.numel() for p in model.parameters()),
        "causal": model.causal,
        "train_seconds": time.perf_counter() - start,
    }


__all__ = ["MQARConfig", "GPU_PRESET", "PRESETS", "lr_at", "build_model", "attention_layers", "span_penalty",
           "layer_metrics", "make_eval_set", "evaluate", "train_mqar"]
