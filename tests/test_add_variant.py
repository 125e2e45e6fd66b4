"""A variant defined outside this package, added the way docs/adding-a-variant.md says: a module on the
user's PYTHONPATH, named by ``_target_``. Checked against the float64 reference (outputs and gradients,
causal and not, N not a multiple of its block), measured by ``python -m harness`` and reported by
``python -m harness.report``, with nothing registered in ``variants``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from .conftest import ROOT
from .test_variants import assert_matches_reference

# A user's own module: a band of keys around each query, `behind` positions back and `ahead` forward,
#   allowed(i, j) = -ahead ≤ i − j ≤ behind
# (ahead=0 is a causal local window even with causal=False). Mask-defined, so it inherits the
# block-sparse engine, the dense mask path and the pair counts from MaskedAttention.
MODULE = '''
from dataclasses import dataclass

import torch

from variants.base import require, whole
from variants.blocksparse import MaskedAttention
from variants.masks import num_blocks

BLOCK = 16


@dataclass(frozen=True)
class BandOptions:
    behind: int = 8  # keys i - behind ... i
    ahead: int = 0   # and i + 1 ... i + ahead
    backend: str | None = None  # blocksparse | dense | flex (CUDA)

    def __post_init__(self):
        for name in ("behind", "ahead"):
            value = getattr(self, name)
            require(whole(value, 0), f"band: {name} must be an integer >= 0; got {value!r}")


class Band(MaskedAttention):
    name = "band"
    Options = BandOptions

    def engine_block_size(self, seq_len):
        return BLOCK

    def layout(self, seq_len, causal):
        # Key block J holds an allowed key of query block I when the two position ranges overlap.
        o, b = self.options, BLOCK
        I = torch.arange(num_blocks(seq_len, b))[:, None]
        J = torch.arange(num_blocks(seq_len, b))[None, :]
        return (J * b <= I * b + b - 1 + o.ahead) & (J * b + b - 1 >= I * b - o.behind)  # (nb, nb)

    def predicate(self, seq_len, causal):
        o = self.options

        def allowed(i, j):
            return (i - j <= o.behind) & (j - i <= o.ahead)

        return allowed
'''

CASES = [dict(behind=5, ahead=2), dict(behind=0, ahead=0), dict(behind=40, ahead=17), dict(behind=300, ahead=300)]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A directory holding the user's module, importable here and by subprocesses (PYTHONPATH)."""
    root = tmp_path_factory.mktemp("user_pkg")
    (root / "bandattn.py").write_text(textwrap.dedent(MODULE))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("bandattn", None)


def build(user_dir, **options):
    from hydra.utils import instantiate

    return instantiate({"_target_": "bandattn.Band", **options})  # as the harness builds it


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("N,dtype", [(97, torch.float32), (200, torch.float32), (97, torch.float64)],
                         ids=["97-f32", "200-f32", "97-f64"])  # N not a multiple of its block (16)
@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_outside_variant_matches_reference(user_dir, options, N, causal, dtype):
    for backend in ("blocksparse", "dense"):
        assert_matches_reference(build(user_dir, **options, backend=backend), N, causal, dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("options", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_outside_variant_mask_is_the_formula(user_dir, options, causal):
    """mask() (the reference's oracle) against the band written here, and the engine's pair counts."""
    N = 97
    attn = build(user_dir, **options)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    want = (i - j <= options["behind"]) & (j - i <= options["ahead"]) & ((j <= i) | (not causal))
    assert torch.equal(attn.mask(N, causal), want)
    assert attn.allowed_pairs(N, causal) == int(want.sum())
    padded = -(-N // 16) * 16  # the engine computes whole blocks
    assert attn.allowed_pairs(N, causal) <= attn.executed_pairs(N, causal) <= padded**2
    if options["behind"] + options["ahead"] < 40:  # a narrow band: the engine computes O(N) pairs, not N²
        assert attn.executed_pairs(1000, causal) < 1000 * 64


def test_outside_variant_through_the_harness_and_report(user_dir, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_dir), str(ROOT)]), "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "harness", "variant._target_=bandattn.Band", "~variant.backend",
           "+variant.behind=5", "+variant.ahead=2", "seq_lens=[97,200]", "causal=true", "num_heads=2",
           "head_dim=16", "measure.passes=[fwd_bwd]", "measure.min_run_time=0.01", "measure.min_samples=2",
           "task=mqar", "task.seq_len=32", "task.steps=2", "task.eval_every=2", "task.eval_size=8",
           "task.batch_size=4", "task.d_model=16", "logger=none", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["backend"], r["seq_len"], r["status"]) for r in rows] == [
        ("band", "blocksparse", 97, "ok"), ("band", "blocksparse", 200, "ok")]
    for r in rows:
        assert r["causal"] and r["opt_behind"] == 5 and r["opt_ahead"] == 2
        assert r["fwd_bwd_ms"] > 0 and r["peak_mem_bytes"] > 0 and r["flops_fwd"] > 0 and r["density"] < 0.1
        assert r["out_rel_err"] is not None  # fidelity against exact attention ran on the user's variant
        assert r["task_accuracy"] is not None and r["quality_reason"] is None  # and the task trained it

    # The other way in: the user's own config group (a directory holding variant/band.yaml) through
    # --config-dir. A misspelt option is one line naming it and the allowed ones, exit 2, no files.
    (user_dir / "conf" / "variant").mkdir(parents=True, exist_ok=True)
    (user_dir / "conf" / "variant" / "band.yaml").write_text("_target_: bandattn.Band\nbehind: 8\nahead: 0\n")
    bad = subprocess.run([sys.executable, "-m", "harness", "--config-dir", str(user_dir / "conf"), "variant=band",
                          "+variant.behnd=5", "logger=none", f"hydra.run.dir={tmp_path / 'bad'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "behnd" in bad.stderr and "behind" in bad.stderr and not (tmp_path / "bad" / "results.jsonl").exists()

    rep = subprocess.run([sys.executable, "-m", "harness.report", str(out), "--out", str(tmp_path / "report")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert "band" in (tmp_path / "report" / "report.html").read_text()
