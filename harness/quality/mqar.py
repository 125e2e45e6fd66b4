"""MQAR: multi-query associative recall (Zoology, Arora et al. 2023), the task-quality probe.

A sequence opens with ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 …`` and then holds
``num_queries`` queries: a query position carries one of the sequence's keys and its target is the value
paired with that key. The model must recall, at the query, which token followed that key earlier.

Layout of one sequence of length ``seq_len`` (our choice where Zoology leaves room):

    positions [0, 2P)          k1 v1 … kP vP        P = num_kv_pairs
    positions [2P, seq_len)    the query region: Q = num_queries distinct keys of the sequence
                               (a random subset, in random order) at random distinct positions;
                               every other position holds PAD

- Vocabulary: token 0 is PAD; keys come from [1, V/2), values from [V/2, V) (V = vocab_size, V/2
  rounded down), so key and value tokens never coincide. Keys are distinct within a sequence, values
  are drawn independently (they may repeat).
- Targets: (B, seq_len) with the value at each query position and ``IGNORE_INDEX`` (-100) elsewhere.
- No answer in the input: a query position holds the key, never its value (Zoology's next-token form
  puts the value right after the query, which a bidirectional model could read from the future). The
  query region holds only keys and PAD, so a variant that cannot be causal (linear) is trained
  bidirectionally without seeing any answer.
- Queries sit uniformly anywhere in the query region, so the distance between a key and its query
  grows with ``seq_len``: at long lengths recall needs long-range attention, not only a window.
- Without recall: a model that knows only that the answer is a value scores 1/(V − V/2); one that
  knows the sequence's values but not which key each follows does best by answering the most frequent
  of them (``no_recall_accuracy``). Values repeat, so that is more than 1/P: 0.21 at P = 8 and 32 value
  tokens, the defaults, against 1/8. (Zoology draws a sequence's values without replacement, where
  1/P is that baseline; this generator's is measured on the eval set and recorded with every result.)
"""

from __future__ import annotations

import torch
from torch import Tensor

PAD = 0
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def key_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi) of key tokens: after PAD, the lower half of the vocabulary."""
    return 1, vocab_size // 2


def value_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi) of value tokens: the upper half of the vocabulary."""
    return vocab_size // 2, vocab_size


def validate(seq_len: int, vocab_size: int, num_kv_pairs: int, num_queries: int) -> None:
    """Raises ValueError (one line naming the numbers) unless the four sizes make an MQAR sequence."""
    for name, value in (("seq_len", seq_len), ("vocab_size", vocab_size), ("num_kv_pairs", num_kv_pairs),
                        ("num_queries", num_queries)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mqar: {name} must be an integer >= 1; got {value!r}")
    lo, hi = key_range(vocab_size)
    if num_kv_pairs > hi - lo:
        raise ValueError(f"mqar: num_kv_pairs={num_kv_pairs} distinct keys need vocab_size >= "
                         f"{2 * (num_kv_pairs + 1)}; got vocab_size={vocab_size} ({hi - lo} key tokens)")
    if num_queries > num_kv_pairs:
        raise ValueError(f"mqar: num_queries={num_queries} must be <= num_kv_pairs={num_kv_pairs} "
                         f"(each query asks a distinct key)")
    if seq_len < 2 * num_kv_pairs + num_queries:
        raise ValueError(f"mqar: seq_len={seq_len} is too short for {num_kv_pairs} key-value pairs "
                         f"(2*{num_kv_pairs} positions) and {num_queries} queries: need seq_len >= "
                         f"{2 * num_kv_pairs + num_queries}")


def mqar_batch(batch_size: int, seq_len: int, vocab_size: int, num_kv_pairs: int, num_queries: int,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One batch: ``inputs`` (B, seq_len) int64 tokens and ``targets`` (B, seq_len) int64 (value at query
    positions, IGNORE_INDEX elsewhere), on the CPU, fully determined by the generator's state."""
    validate(seq_len, vocab_size, num_kv_pairs, num_queries)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"mqar: batch_size must be an integer >= 1; got {batch_size!r}")
    B, P, Q, N = batch_size, num_kv_pairs, num_queries, seq_len
    k_lo, k_hi = key_range(vocab_size)
    v_lo, v_hi = value_range(vocab_size)

    # Distinct keys per sequence: the first P of a random permutation of the key tokens.
    keys = torch.rand(B, k_hi - k_lo, generator=generator).argsort(dim=1)[:, :P] + k_lo  # (B, P)
    values = torch.randint(v_lo, v_hi, (B, P), generator=generator)  # (B, P)
    asked = torch.rand(B, P, generator=generator).argsort(dim=1)[:, :Q]  # (B, Q) which pairs are queried
    slots = torch.rand(B, N - 2 * P, generator=generator).argsort(dim=1)[:, :Q] + 2 * P  # (B, Q) positions

    inputs = torch.full((B, N), PAD, dtype=torch.long)
    inputs[:, 0:2 * P:2] = keys
    inputs[:, 1:2 * P:2] = values
    inputs.scatter_(1, slots, keys.gather(1, asked))
    targets = torch.full((B, N), IGNORE_INDEX, dtype=torch.long)
    targets.scatter_(1, slots, values.gather(1, asked))
    return inputs, targets


def no_recall_accuracy(inputs: Tensor, targets: Tensor, num_kv_pairs: int) -> float:
    """The best accuracy without recall on a set of sequences (``mqar_batch``'s): each query answered
    with the most frequent value of its sequence, a tie split evenly among the tied values (expected
    accuracy). It is what a model reaches by counting values without binding any to its key."""
    values = inputs[:, 1:2 * num_kv_pairs:2]  # (B, P)
    counts = (values[:, :, None] == values[:, None, :]).sum(-1)  # (B, P): each pair's value's count
    top = counts.max(dim=1, keepdim=True).values  # (B, 1)
    modes = (counts == top).sum(1) // top.squeeze(1)  # (B,) distinct values with the top count
    asked = targets != IGNORE_INDEX  # (B, N)
    # P(correct) at a query = [its value has the top count] / (number of such values)
    target_count = ((targets[:, :, None] == values[:, None, :]).sum(-1))  # (B, N)
    hit = (target_count == top) & asked  # (B, N)
    return float((hit.sum(1).double() / modes.double()).sum() / asked.sum())


__all__ = ["PAD", "IGNORE_INDEX", "key_range", "value_range", "validate", "mqar_batch", "no_recall_accuracy"]
