"""MQAR data, the small Transformer with every variant, and a short training run (all tiny and fast)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import variants
from harness.quality.model import TinyTransformer
from harness.quality.mqar import IGNORE_INDEX, PAD, key_range, mqar_batch, no_recall_accuracy, validate, value_range
from harness.quality import task
from harness.quality.task import GPU_PRESET, PRESETS, MQARConfig, evaluate, lr_at, train_mqar

SIZES = dict(seq_len=48, vocab_size=40, num_kv_pairs=8, num_queries=6)


def batch(seed: int = 0, B: int = 64, **overrides):
    sizes = {**SIZES, **overrides}
    return mqar_batch(B, sizes["seq_len"], sizes["vocab_size"], sizes["num_kv_pairs"], sizes["num_queries"],
                      torch.Generator().manual_seed(seed))


def test_batches_are_deterministic_for_a_seed():
    x1, y1 = batch(seed=7)
    x2, y2 = batch(seed=7)
    x3, _ = batch(seed=8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert x1.shape == y1.shape == (64, SIZES["seq_len"]) and x1.dtype == y1.dtype == torch.long


@pytest.mark.parametrize("overrides", [{}, {"num_queries": 8, "seq_len": 24}, {"num_kv_pairs": 1, "num_queries": 1}])
def test_batches_satisfy_the_mqar_invariants(overrides):
    sizes = {**SIZES, **overrides}
    P, Q, N, V = sizes["num_kv_pairs"], sizes["num_queries"], sizes["seq_len"], sizes["vocab_size"]
    x, y = batch(seed=1, **overrides)
    k_lo, k_hi = key_range(V)
    v_lo, v_hi = value_range(V)
    for seq, tgt in zip(x.tolist(), y.tolist()):
        keys, vals = seq[0:2 * P:2], seq[1:2 * P:2]
        assert len(set(keys)) == P, "keys distinct within a sequence"
        assert all(k_lo <= t < k_hi for t in keys) and all(v_lo <= t < v_hi for t in vals)
        pairs = dict(zip(keys, vals))
        assert all(t == IGNORE_INDEX for t in tgt[:2 * P]), "no targets inside the key-value pairs"
        asked = [t for t in range(2 * P, N) if tgt[t] != IGNORE_INDEX]
        assert len(asked) == Q
        assert len({seq[t] for t in asked}) == Q, "each query asks a distinct key"
        for t in range(2 * P, N):
            if tgt[t] == IGNORE_INDEX:
                assert seq[t] == PAD, "the query region holds only queries and padding"
            else:
                assert seq[t] in pairs, "a query holds one of the sequence's keys"
                assert tgt[t] == pairs[seq[t]], "its target is the value paired with that key"
                assert tgt[t] not in seq[t:], "the answer never appears at or after its query"
        assert not any(v_lo <= t < v_hi for t in seq[2 * P:]), "no value token after the pairs"


def test_no_recall_accuracy_answers_each_query_with_its_sequences_most_frequent_value():
    # P = 4 pairs: values (40, 40, 41, 42) -> one mode, 40; (50, 51, 51, 50) -> two modes, half credit each
    x = torch.tensor([[1, 40, 2, 40, 3, 41, 4, 42, 1, 2, 3],
                      [1, 50, 2, 51, 3, 51, 4, 50, 1, 2, 0]])
    y = torch.full_like(x, IGNORE_INDEX)
    y[0, 8:11] = torch.tensor([40, 40, 41])  # 2 of 3 answered right by "40"
    y[1, 8:10] = torch.tensor([50, 51])  # each right with probability 1/2
    assert no_recall_accuracy(x, y, 4) == pytest.approx((1 + 1 + 0 + 0.5 + 0.5) / 5)
    # On generated data: above 1/P (values repeat), and exactly what counting by hand gives.
    x, y = mqar_batch(64, 64, 64, 8, 8, torch.Generator().manual_seed(0))
    by_hand = []
    for b in range(64):
        values = x[b, 1:16:2].tolist()
        top = max(values.count(v) for v in values)
        modes = {v for v in values if values.count(v) == top}
        by_hand += [(t in modes) / len(modes) for t in y[b][y[b] != IGNORE_INDEX].tolist()]
    assert no_recall_accuracy(x, y, 8) == pytest.approx(sum(by_hand) / len(by_hand)) and sum(by_hand) / len(by_hand) > 1 / 8


def test_validation_names_the_numbers():
    with pytest.raises(ValueError, match=r"seq_len=20 is too short .* need seq_len >= 22"):
        validate(seq_len=20, vocab_size=64, num_kv_pairs=8, num_queries=6)
    with pytest.raises(ValueError, match="num_queries=9 must be <= num_kv_pairs=8"):
        validate(seq_len=64, vocab_size=64, num_kv_pairs=8, num_queries=9)
    with pytest.raises(ValueError, match="num_kv_pairs=8 distinct keys need vocab_size >= 18; got vocab_size=16"):
        validate(seq_len=64, vocab_size=16, num_kv_pairs=8, num_queries=4)
    with pytest.raises(ValueError, match="num_queries must be an integer >= 1; got 0"):
        validate(seq_len=64, vocab_size=64, num_kv_pairs=8, num_queries=0)
    with pytest.raises(ValueError, match="batch_size"):
        mqar_batch(0, 64, 64, 8, 8, torch.Generator())


def test_the_smallest_vocabulary_the_message_asks_for_is_accepted():
    """The key check's bound: vocab_size = 2·(P+1) gives exactly P key tokens, which must be enough (a >= slip
    refused it, contradicting its own "need vocab_size >= 18"); one less is refused."""
    validate(seq_len=64, vocab_size=18, num_kv_pairs=8, num_queries=4)
    x, _ = mqar_batch(4, 64, 18, 8, 4, torch.Generator().manual_seed(0))
    assert all(len(set(row[0:16:2])) == 8 for row in x.tolist())
    with pytest.raises(ValueError, match="need vocab_size >= 18; got vocab_size=17"):
        validate(seq_len=64, vocab_size=17, num_kv_pairs=8, num_queries=4)


@pytest.mark.parametrize("bad,match", [
    ({"seq_len": 10}, "seq_len=10 is too short"),
    ({"d_model": 30, "n_heads": 4}, "d_model=30 must be divisible by n_heads=4"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"positions": "alibi"}, "unknown positions 'alibi'"),
    ({"positions": "rope", "d_model": 6, "n_heads": 2}, "positions=rope needs an even head dimension"),  # ran, q != v
    ({"short_conv": -1}, "short_conv must be an integer >= 0"),
])
def test_bad_configs_fail_with_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        dataclasses.replace(MQARConfig(), **bad)
    assert "\n" not in str(info.value)


def test_config_from_dict_rejects_unknown_keys_and_presets_are_valid():
    assert MQARConfig.from_dict({"steps": 3}).steps == 3
    with pytest.raises(ValueError, match="unknown option 'stpes'"):
        MQARConfig.from_dict({"stpes": 3})
    assert PRESETS["gpu"] is GPU_PRESET and GPU_PRESET.seq_len > MQARConfig().seq_len


N_TINY = 28  # not a multiple of the block sizes (8) or the window
ALL_VARIANTS = [
    ("full", {"backend": "math"}), ("full", {"backend": "sdpa"}),
    ("sparse", {"block_size": 8}), ("sparse", {"pattern": "bigbird", "block_size": 8}),
    ("blockwise", {"block_size": 8}), ("blockwise", {"mode": "local", "block_size": 8}),
    ("sliding_window", {"window": 4}),
    ("linear", {"proj_dim": 8, "max_seq_len": 32}),
]


def tiny_model(name, options, **kwargs):
    torch.manual_seed(0)
    return TinyTransformer(vocab_size=16, max_seq_len=N_TINY, attention=lambda: variants.build(name, **options),
                           d_model=16, n_layers=2, n_heads=2, **kwargs)


@pytest.mark.parametrize("name,options", ALL_VARIANTS)
def test_model_runs_forward_and_backward_with_every_variant(name, options):
    model = tiny_model(name, options, short_conv=3)
    tokens = torch.randint(0, 16, (2, N_TINY), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, N_TINY, 16)
    logits.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    if name == "linear":  # parameters per layer, not shared
        assert model.blocks[0].attn.attn is not model.blocks[1].attn.attn
    assert model.causal == variants.build(name, **options).supports_causal


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope"])
@pytest.mark.parametrize("name,options", ALL_VARIANTS)
def test_model_is_causal_where_the_variant_supports_it(name, options, positions):
    model = tiny_model(name, options, positions=positions, short_conv=3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 16, (2, N_TINY), generator=gen)
    t = 13
    changed = tokens.clone()
    changed[:, t + 1:] = torch.randint(0, 16, (2, N_TINY - t - 1), generator=gen)
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    prefix_same = torch.allclose(a[:, :t + 1], b[:, :t + 1], atol=1e-6, rtol=0)
    if model.causal:
        assert prefix_same
    else:  # bidirectional: the check above would see the change, so it can fail
        assert name == "linear" and not prefix_same


def test_a_shared_instance_is_used_by_every_layer():
    attn = variants.build("full")
    model = TinyTransformer(vocab_size=16, max_seq_len=8, attention=attn, d_model=16, n_layers=3, n_heads=2)
    assert all(block.attn.attn is attn for block in model.blocks)


TINY = MQARConfig(seq_len=32, vocab_size=16, num_kv_pairs=4, num_queries=4, d_model=32, n_layers=2, n_heads=2,
                  batch_size=16, steps=40, lr=3e-3, warmup_steps=5, eval_every=10, eval_size=64, seed=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_short_training_run_lowers_the_loss(device):
    logged = []
    r = train_mqar("full", {}, TINY, log=lambda step, m: logged.append((step, m)), device=device)
    assert [s for s, _ in logged] == [10, 20, 30, 40]
    assert all(set(m) == {"train_loss", "eval_accuracy", "eval_loss"} for _, m in logged)
    first, last = r["history"][0], r["history"][-1]
    assert last["train_loss"] < first["train_loss"] - 0.2
    assert last["eval_loss"] < first["eval_loss"]
    assert r["task_accuracy"] == last["eval_accuracy"] and r["task_loss"] == last["eval_loss"]
    assert r["causal"] is True


def test_training_is_deterministic_for_a_seed():
    cfg = dataclasses.replace(TINY, steps=6, eval_every=3)
    a = train_mqar("sliding_window", {"window": 4}, cfg)
    b = train_mqar("sliding_window", {"window": 4}, cfg)
    assert a["history"] == b["history"]


def test_linear_trains_bidirectionally():
    cfg = dataclasses.replace(TINY, steps=4, eval_every=2)
    r = train_mqar("linear", {"proj_dim": 8, "max_seq_len": cfg.seq_len}, cfg)
    assert r["causal"] is False and len(r["history"]) == 2


def test_a_bad_variant_option_fails_before_training():
    with pytest.raises(variants.VariantError, match="unknown option 'windw'"):
        train_mqar("sliding_window", {"windw": 4}, TINY)


def test_the_eval_set_shares_no_sequence_with_the_training_batches(monkeypatch):
    """The eval set and the training data come from differently seeded generators: with the same seed (a slip in
    make_eval_set or in train_mqar) the eval set would be the first training batch, and eval accuracy a train one."""
    drawn = []  # (generator, inputs) of every batch train_mqar draws

    def recording(batch_size, *sizes_and_generator):
        inputs, targets = mqar_batch(batch_size, *sizes_and_generator)
        drawn.append((sizes_and_generator[-1], inputs))
        return inputs, targets

    monkeypatch.setattr(task, "mqar_batch", recording)
    cfg = dataclasses.replace(TINY, steps=3, eval_every=3, eval_size=TINY.batch_size)  # equal sizes: a full overlap
    train_mqar("full", {}, cfg)
    by_generator = {}
    for gen, inputs in drawn:
        by_generator.setdefault(id(gen), []).append(inputs)
    (eval_set,), train = sorted(by_generator.values(), key=len)  # one eval draw, then a batch per step
    assert len(train) == cfg.steps
    seen = {tuple(row) for batch in train for row in batch.tolist()}
    assert not seen & {tuple(row) for row in eval_set.tolist()}


class Recaller(torch.nn.Module):
    """A perfect MQAR solver without learning: at every position, logits for the value paired with the token there
    (if it is one of the sequence's keys), made wrong on purpose where the key is odd."""

    def __init__(self, vocab_size: int, num_kv_pairs: int):
        super().__init__()
        self.V, self.P = vocab_size, num_kv_pairs
        self.unused = torch.nn.Parameter(torch.zeros(()))  # evaluate reads the device from a parameter

    def forward(self, x):
        keys, vals = x[:, 0:2 * self.P:2], x[:, 1:2 * self.P:2]
        answer = ((x[:, :, None] == keys[:, None, :]) * vals[:, None, :]).sum(-1)  # (b, N); 0 off the keys
        answer = torch.where(x % 2 == 1, (answer + 1) % self.V, answer)  # odd keys: a wrong token
        return 10.0 * torch.nn.functional.one_hot(answer, self.V).float()


def test_eval_accuracy_counts_the_query_positions_only():
    """evaluate's accuracy is the share of query positions (target != IGNORE_INDEX) answered right, whatever the
    batching: counting other positions (the keys or the values of the pairs, PAD) would dilute it."""
    x, y = batch(seed=2, B=20)
    asked = y != IGNORE_INDEX
    even = int((x[asked] % 2 == 0).sum())  # the queries the Recaller answers right
    assert 0 < even < int(asked.sum())
    r = evaluate(Recaller(SIZES["vocab_size"], SIZES["num_kv_pairs"]), x, y, batch_size=7)  # 7: a ragged last batch
    assert r["eval_accuracy"] == pytest.approx(even / int(asked.sum()))
    V = SIZES["vocab_size"]  # logits: 10 on the answer, 0 on the V - 1 others
    right, wrong = math.log(1 + (V - 1) * math.exp(-10)), math.log(math.exp(10) + V - 1)
    n = int(asked.sum())
    assert r["eval_loss"] == pytest.approx((even * right + (n - even) * wrong) / n, rel=1e-5)


def test_the_learning_rate_warms_up_from_the_first_step_and_decays_to_a_tenth():
    """lr_at(0) is lr/warmup_steps, not 0 (an off-by-one makes the first step a no-op), reaches lr at the end of
    the warm-up, and the cosine ends at lr/10 at the last step."""
    cfg = dataclasses.replace(TINY, lr=1e-3, warmup_steps=4, steps=24)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(4, cfg) == pytest.approx(1e-3) and lr_at(14, cfg) == pytest.approx(0.55e-3)
    assert lr_at(24, cfg) == pytest.approx(1e-4) and lr_at(100, cfg) == pytest.approx(1e-4)


def test_the_train_loss_of_each_eval_is_the_mean_since_the_previous_one(monkeypatch):
    """history's train_loss is the mean of the training steps' losses since the previous eval (the docstring's
    "averaged since the previous eval"), not the mean since the first step, which lags the curve."""
    losses = []  # every training step's loss, in order

    def recording(logits, targets):
        loss = task_query_loss(logits, targets)
        if torch.is_grad_enabled():  # a training step; evaluate runs without gradients
            losses.append(float(loss.detach()))
        return loss

    task_query_loss = task.query_loss
    monkeypatch.setattr(task, "query_loss", recording)
    r = train_mqar("full", {}, dataclasses.replace(TINY, steps=6, eval_every=3))
    assert len(losses) == 6
    assert [h["train_loss"] for h in r["history"]] == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:]) / 3])


def test_the_task_accuracy_is_the_final_evals_not_the_best(monkeypatch):
    """task_accuracy and task_loss are those of the last eval: picking the best eval along the way would select
    on the eval set and report an accuracy the final model does not have."""
    scripted = iter([{"eval_accuracy": 0.2, "eval_loss": 2.0}, {"eval_accuracy": 0.9, "eval_loss": 0.5},
                     {"eval_accuracy": 0.4, "eval_loss": 1.0}])
    monkeypatch.setattr(task, "evaluate", lambda *args: next(scripted))
    r = train_mqar("full", {}, dataclasses.replace(TINY, steps=3, eval_every=1))
    assert [h["eval_accuracy"] for h in r["history"]] == [0.2, 0.9, 0.4]
    assert (r["task_accuracy"], r["task_loss"]) == (0.4, 1.0)
