"""The measurement harness: every variant through run(), the command line, peak memory, failures as results."""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import subprocess
import sys
import types

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import env as envmod
from harness import run as runmod
from harness.env import code_version
from harness.memory import cpu_peak_bytes
from harness.results import FIELDS, fit_exponents, latest, read_jsonl, series_key
from harness.config import ConfigError, settings_from_config, variant_names
from harness.run import run, validate
import variants
from variants import VariantError

from .conftest import CONF, ROOT, VARIANT_YAMLS, refusal, results_dirs

MiB = 2**20
# Tiny sizes and short measurement: the whole file stays far below a minute on two cores.
TINY = ["batch_size=1", "num_heads=2", "head_dim=16", "seq_len=96", "measure.min_run_time=0.01",
        "measure.warmup_iters=1", "logger=none"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def rows_of(path):
    return read_jsonl(path / "results.jsonl") if (path / "results.jsonl").exists() else []


@pytest.mark.parametrize("yaml", VARIANT_YAMLS, ids=lambda p: p.stem)
def test_every_variant_config_runs_and_records_every_field(yaml, tmp_path):
    cfg = compose_cfg(f"variant={yaml.stem}", *TINY)
    sweep = run(cfg, output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert len(rows) == 1 and rows == [r.record() for r in sweep.rows]
    row = rows[0]
    assert row["status"] == "ok", row["reason"]
    assert set(FIELDS) <= set(row)
    options = {k for k in row if k.startswith("opt_")}
    assert options == {f"opt_{k}" for k, _ in sweep.rows[0].options}
    assert (row["variant"], row["seq_len"], row["head_dim"], row["device"]) == (yaml.stem, 96, 16, "cpu")
    for name in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "peak_mem_bytes", "analytic_mem_bytes", "flops_fwd",
                 "flops_fwd_useful", "tflops_fwd", "tflops_fwd_bwd", "density", "setup_s", "warmup_s"):
        assert row[name] > 0, name
    assert row["peak_mem_abs_bytes"] is None and row["reason"] is None
    ranks = row["world_size"] or 1  # sequence-parallel ranks on one machine share its cores
    threads = torch.get_num_threads() if ranks == 1 else max(1, len(os.sched_getaffinity(0)) // ranks)
    assert row["torch_version"] == torch.__version__ and row["num_threads"] == threads
    assert row["code_version"] == code_version()  # the checkout's commit, in every row
    with open(tmp_path / "results.csv") as f:
        header = next(csv.reader(f))
    assert header[:len(FIELDS)] == list(FIELDS) and set(header) == set(row)
    assert (tmp_path / "env.json").exists() and not (tmp_path / "fit.json").exists()  # one length: no fit
    env_json = json.loads((tmp_path / "env.json").read_text())
    assert env_json["python_version"] == platform.python_version() and env_json["numpy_version"]
    assert env_json["float32_matmul_precision"] == torch.get_float32_matmul_precision() and "matmul=" in env_json["tf32"]


def test_setup_is_timed_apart_once_before_the_warm_up(tmp_path, monkeypatch):
    """The variant's prepare (FlexAttention's BlockMask, the engine's plan on the device) runs once per
    point, before any call, and its time is setup_s, not part of warmup_s."""
    import time

    from variants.blocksparse import MaskedAttention

    calls, prepare, attend = [], MaskedAttention.prepare, MaskedAttention._attend

    def slow_prepare(self, *args):
        calls.append("prepare")
        time.sleep(1.0)
        return prepare(self, *args)

    def counted_attend(self, *args):
        calls.append("call")
        return attend(self, *args)
    monkeypatch.setattr(MaskedAttention, "prepare", slow_prepare)
    monkeypatch.setattr(MaskedAttention, "_attend", counted_attend)
    (r,) = run(compose_cfg("variant=sliding_window", *TINY), output_dir=tmp_path).rows
    assert r.status == "ok" and calls[0] == "prepare" and calls.count("prepare") == 1 and "call" in calls
    assert r.setup_s >= 1.0 and r.warmup_s < 1.0, (r.setup_s, r.warmup_s)


def test_code_version_is_the_commit_and_dirty_only_for_code(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    for path in ("harness/a.py", "results/r.csv"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    monkeypatch.setattr(envmod, "ROOT", tmp_path)
    monkeypatch.delenv(envmod.CODE_VERSION_VAR, raising=False)
    assert code_version() == head
    (tmp_path / "results/r.csv").write_text("2\n")  # results written into the checkout: not code
    (tmp_path / "results/new.csv").write_text("3\n")
    assert code_version() == head
    (tmp_path / "variants").mkdir()
    (tmp_path / "variants/new.py").write_text("x = 1\n")  # a new variant file not yet committed is code
    assert code_version() == head + "+dirty"
    (tmp_path / "variants/new.py").unlink()
    (tmp_path / "harness/a.py").write_text("2\n")
    assert code_version() == head + "+dirty"
    # Not a checkout of the project (a copied tree, an installed package): the variable, else unknown
    monkeypatch.setattr(envmod, "ROOT", tmp_path / "harness")
    assert code_version() is None
    monkeypatch.setenv(envmod.CODE_VERSION_VAR, "0123abcd")
    assert code_version() == "0123abcd"
    # Set, it is what the copier says even over git's metadata: a copied .git can be older than the tree
    monkeypatch.setattr(envmod, "ROOT", tmp_path)
    assert code_version() == "0123abcd"


def test_memory_facts_are_the_kernels_kib_in_bytes():
    """/proc/meminfo's "kB" are KiB: MemTotal in bytes is the physical pages times the page size, exactly (a
    factor of 1000 would understate every memory budget and MemTotal check by 2.4%)."""
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo")
    assert envmod.mem_total_bytes() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < envmod.mem_available_bytes() <= envmod.mem_total_bytes()


def test_other_load_counts_the_machines_busy_cores_less_this_process(monkeypatch):
    """OtherLoad is the cores others kept busy: the machine's busy time (/proc/stat) less this process's own CPU
    time, over the wall time; without the subtraction the timed code itself would read as others' load."""
    tick = os.sysconf("SC_CLK_TCK")
    samples = iter([(100.0, 10 * tick, 5.0), (102.0, 13 * tick, 6.0)])  # (monotonic, busy ticks, own CPU s)
    now = {}

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/stat"
        t, busy, own = next(samples)
        now.update(t=t, own=own)
        return io.StringIO(f"cpu  {busy} 0 0 999999 0 0 0 0 0 0\n")

    monkeypatch.setattr(envmod, "open", fake_open, raising=False)
    with monkeypatch.context() as m:
        m.setattr(envmod.time, "monotonic", lambda: now["t"])
        m.setattr(envmod.os, "times", lambda: types.SimpleNamespace(user=now["own"], system=0.0))
        load = envmod.OtherLoad()
        load.start()
        others = load.stop()
    assert others == pytest.approx((3.0 - 1.0) / 2.0)  # 3 busy core-seconds, 1 of them ours, over 2 s


# ----- the command line ------------------------------------------------------------------------------

def harness_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness", "logger=none", *args]


def test_command_line_runs_and_writes_results(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(harness_cmd("variant=blockwise", "seq_len=256", "head_dim=16", "num_heads=2",
                                      "measure.min_run_time=0.01", f"hydra.run.dir={out}"),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    rows = rows_of(out)
    assert [(r["variant"], r["seq_len"], r["status"]) for r in rows] == [("blockwise", 256, "ok")]
    assert (out / "results.csv").exists()


# The list of bad input, each through the real command line.
BAD_INPUTS = [
    (["variant=foo"], ["'foo'", "allowed", "blockwise", "sliding_window"]),
    (["seq_len=0"], ["seq_len", "> 0"]),
    (["seq_len=abc"], ["seq_len", "integer"]),
    (["dtype=float64"], ["dtype", "allowed: float32, float16, bfloat16"]),
    (["variant=linear", "causal=true"], ["linear", "causal"]),
    (["variant=sliding_window", "+variant.windw=3"], ["windw", "allowed", "window"]),
    (["variant=sliding_window", "variant.windw=3"], ["windw", "allowed", "window"]),
    (["seq_lenz=128"], ["seq_lenz", "allowed", "seq_len"]),
]
if not torch.cuda.is_available():
    BAD_INPUTS.append((["device=cuda"], ["cuda", "not available", "cpu"]))


def test_bad_input_is_one_line_no_traceback_no_results(tmp_path):
    """Each refused by the command line's check (in this process: conftest.refusal); two as processes, a
    group's choice and a variant's own refusal, all at once (each spends most of its time importing torch)."""
    for i, (args, words) in enumerate(BAD_INPUTS):
        (tmp_path / f"check{i}").mkdir()
        line = refusal([*args, "logger=none"], tmp_path / f"check{i}")
        assert all(word in line for word in words), (args, line)
    procs, in_processes = [], [BAD_INPUTS[0], BAD_INPUTS[4]]  # variant=foo; variant=linear causal=true
    for i, (args, _) in enumerate(in_processes):
        out = tmp_path / f"bad{i}"
        procs.append((out, subprocess.Popen(harness_cmd(*args, "measure.min_run_time=0.01", f"hydra.run.dir={out}"),
                                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)))
    for (args, words), (out, proc) in zip(in_processes, procs):
        output, _ = proc.communicate(timeout=120)
        lines = [line for line in output.splitlines() if line.strip()]
        assert proc.returncode == 2, (args, output)
        assert len(lines) == 1, (args, output)
        assert "Traceback" not in output
        for word in words:
            assert word in lines[0], (args, word, lines[0])
        assert not out.exists(), args


def test_torchs_cuda_home_note_does_not_reach_the_output():
    """A CUDA build of torch on a machine with a CUDA toolkit and no GPU (a cluster's login node) logs "No
    CUDA runtime is found, using CUDA_HOME=..." when the CPU timer's import reaches cpp_extension; the
    harness drops that one note (through torch's own log handler here), and only it."""
    code = ("import logging, harness.measure\n"
            "log = logging.getLogger('torch.utils.cpp_extension')\n"
            "log.warning(\"No CUDA runtime is found, using CUDA_HOME='/usr/local'\")\n"
            "log.warning('another note')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "another note" in proc.stderr, proc.stderr
    assert "No CUDA runtime" not in proc.stderr, proc.stderr


# What Hydra itself refuses (several lines and a hint, or a traceback), said in one line by what owns the
# problem: the group's choices, harness.config's keys, the variant's Options. Exact lines: each names the
# problem and lists what is allowed.
HYDRA_REFUSALS = [
    (["variant=nope"], f"unknown variant 'nope'; allowed: {', '.join(variant_names())}"),
    (["-m", "variant=full,nope"], f"unknown variant 'nope'; allowed: {', '.join(variant_names())}"),  # no job ran
    (["-m", "sweep=cpu_small", "task=mqar,nope"], "unknown task 'nope'; allowed: mqar, mqar_gpu, none"),
    (["hydra/launcher=nope"], "unknown hydra/launcher 'nope'; allowed: basic, joblib, local_parallel, slurm, "
                              "submitit_local, submitit_slurm"),
    (["measure.repeat=3"], "unknown measure option 'repeat'; allowed: passes, warmup_iters, min_run_time, "
                           "min_samples, max_run_time, timer, memory, param_grads, max_rel_iqr, max_other_cores, "
                           "on_noise, max_tries, max_call_s"),
    (["variant=sliding_window", "variant.windw=3"],
     "sliding_window: unknown option 'windw'; allowed: window, dilation, global_tokens, backend"),
    (["-m", "variant=sliding_window,full", "variant.window=3"], "full: unknown option 'window'; allowed: backend"),
    # An option the variant has but its YAML does not: Hydra's own hint, in one line.
    (["variant._target_=variants.SlidingWindow", "variant.backend=dense", "variant.window=3"],
     "Could not override 'variant.window'. To append to your config use +variant.window=3"),
    (["-m", "variant=full", "--cfg", "job"], "--multirun and --cfg cannot be given together; allowed: one of --run, "
                                             "--multirun (-m), --cfg (-c), --info (-i), --shell-completion (-sc) "
                                             "(one job's config: --cfg job, no -m)"),
    # --cfg or --info with a sweep: Hydra's "Ambiguous value for argument ..." in five lines, exit 1; its
    # parse error too; a choice that does not exist: Hydra's search path listed
    (["--cfg", "job", "variant=full,linear"], "--cfg prints one job's config, and variant=full,linear sweeps over "
                                              "several; allowed: one value per key with --cfg (e.g. variant=full)"),
    (["--cfg", "job", "variant=nope"], f"unknown variant 'nope'; allowed: {', '.join(variant_names())}"),  # composed
    (["--info", "defaults", "variant=nope"], f"unknown variant 'nope'; allowed: {', '.join(variant_names())}"),
    (["--info", "all", "task=mqar,none"], "--info prints one job's config, and task=mqar,none sweeps over several; "
                                          "allowed: one value per key with --info (e.g. variant=full)"),
    (["--cfg", "job", "seq_lens=["], "no viable alternative at input '[' See "
                                      "https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details"),
    # a flag between overrides: argparse's "unrecognized arguments: variant=full,linear", overrides that are valid
    (["seq_len=32", "-m", "variant=full,linear"], "overrides after a flag that follows other overrides: "
     "variant=full,linear; allowed: Hydra's flags (-m, --cfg, ...) before every override, e.g. python -m harness -m "
     "seq_len=32 variant=full,linear"),
    # a value of Hydra's own typed settings: "Error merging override ..." and no why
    (["-m", "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=abc"], "Error merging override "
     "hydra.launcher.n_jobs=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    (["hydra.mode=RUNS"], "Error merging override hydra.mode=RUNS: Invalid value 'RUNS', expected one of [RUN, MULTIRUN]"),
    # null for a group (as sweep: null reads in config.yaml): "Config group override must be a string or a list"
    (["task=null"], "unknown task 'null'; allowed: mqar, mqar_gpu, none"),
]


def test_hydra_refusals_are_one_line_exit_2_nothing_written(tmp_path):
    """Exactly this line from the command line's check (in this process: conftest.refusal); two refusals, one
    of a group's choice and one of a sweep's job (LATE_REFUSALS), as processes (each costs torch's import):
    the line, exit 2, nothing where it ran."""
    for i, (args, want) in enumerate(HYDRA_REFUSALS):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        assert refusal(args, cwd) == f"error: {want}", args
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    procs = []
    sweep_job = (["-m", "seq_lens=[32]", "task=mqar", "task.steps=1,-1"],
                 "task=mqar at N=32: steps must be an integer >= 1; got -1")  # in LATE_REFUSALS: builds a model
    for i, (args, want) in enumerate([HYDRA_REFUSALS[1], sweep_job]):
        cwd = tmp_path / f"process-{i}"
        cwd.mkdir()
        procs.append((args, want, cwd, subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=cwd, env=env,
                                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for args, want, cwd, proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert (proc.returncode, output.splitlines()) == (2, [f"error: {want}"]), args
        assert list(cwd.iterdir()) == [], args


def test_bad_input_in_process_raises_before_writing(tmp_path):
    cases = [
        (["seq_len=-4"], ConfigError),
        (["seq_len=1.5"], ConfigError),
        (["seq_len=true"], ConfigError),
        (["seq_lens=[256,0]"], ConfigError),
        (["seq_lens=[]"], ConfigError),
        (["dtype=float8"], ConfigError),
        (["device=tpu"], ConfigError),
        (["causal=maybe"], ConfigError),
        (["variant=linear", "causal=true"], VariantError),
        (["variant=sliding_window", "+variant.windw=3"], VariantError),
        (["variant=sparse", "variant.pattern=dense"], VariantError),
        (["variant=full", "variant.backend=flash"], VariantError),
        (["measure.passes=[fwd,back]"], ConfigError),
        (["measure.timer=wall"], ConfigError),
        (["measure.min_run_time=0"], ConfigError),
        (["+measure.repeat=3"], ConfigError),
        (["+seq_lenz=3"], ConfigError),
        (["memory_budget_gb=-1"], ConfigError),
    ]
    for overrides, error in cases:
        with pytest.raises(error) as e:
            run(compose_cfg(*overrides), output_dir=tmp_path)
        assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


# ----- peak memory -------------------------------------------------------------------------------------

def test_cpu_peak_of_one_scores_matrix_is_256_mib():
    # One (1, 4, 4096, 4096) float32 scores matrix is 4·4096²·4 bytes = 256 MiB. D = 8 keeps the matmul
    # cheap; the output's size does not depend on D.
    q, k = torch.randn(1, 4, 4096, 8), torch.randn(1, 4, 4096, 8)
    peak = cpu_peak_bytes(lambda: q @ k.transpose(-2, -1))
    assert abs(peak / (256 * MiB) - 1) < 0.05, peak / MiB


def test_full_math_memory_reproduces_the_n_squared_term(tmp_path):
    """The math path's forward+backward peak holds three N×N matrices: in the backward, when softmax's
    gradient dS = P ∘ (dP − rowsum(dP ∘ P)) is formed, the probabilities P (saved for softmax and for P·V),
    dP = dO·Vᵀ and dS are alive; the scores S = q·kᵀ·scale were freed after the forward's softmax (its
    backward needs only P) and q·kᵀ right after scaling. Beside them only N×D tensors (the output and dV).
    Measured: 3.00 N² matrices + 2 N·D. So the peak's growth between two lengths is 3·B·H·(N₂² − N₁²)·4
    bytes plus a small N·D part, which head_dim=8 keeps below 1%."""
    B, H, D = 1, 4, 8
    n1, n2 = 256, 512
    cfg = compose_cfg("variant=full", "variant.backend=math", f"seq_lens=[{n1},{n2}]", f"batch_size={B}",
                      f"num_heads={H}", f"head_dim={D}", "measure.passes=[fwd]", "measure.min_run_time=0.01")
    run(cfg, output_dir=tmp_path)
    rows = {r["seq_len"]: r for r in rows_of(tmp_path)}
    assert all(r["status"] == "ok" for r in rows.values())
    matrix = lambda n: B * H * n * n * 4  # noqa: E731  one N×N float32 matrix per (batch, head)
    measured = rows[n2]["peak_mem_bytes"] - rows[n1]["peak_mem_bytes"]
    assert abs(measured / (3 * (matrix(n2) - matrix(n1))) - 1) < 0.15
    for n in (n1, n2):  # and the count itself at each length: three matrices
        assert abs(rows[n]["peak_mem_bytes"] / matrix(n) - 3) < 0.15
    # The variant's analytic figure has the same N² term, and is the peak over the inputs itself.
    analytic = rows[n2]["analytic_mem_bytes"] - rows[n1]["analytic_mem_bytes"]
    assert abs(measured / analytic - 1) < 0.15
    for n in (n1, n2):
        assert abs(rows[n]["peak_mem_bytes"] / rows[n]["analytic_mem_bytes"] - 1) < 0.01, n
    fit = json.loads((tmp_path / "fit.json").read_text())["fits"]["memory"]
    assert abs(fit["fitted"] - fit["theory"]) < 0.1 and fit["seq_lens"] == [n1, n2]


# ----- failures are results ------------------------------------------------------------------------

def test_fidelity_over_the_memory_budget_is_skipped_with_its_reason(tmp_path):
    """Fidelity runs the variant at fidelity.batch_size and a float64 reference: on the CPU, where the
    kernel's OOM killer cannot be caught, a fidelity that would pass the budget is not run (the point's
    timing stays; quality_reason says why)."""
    # full math at N=512, B=1, H=2: about 6.4 MB timed; fidelity at batch 64: the variant alone ~400 MB.
    cfg = compose_cfg("variant=full", "variant.backend=math", "seq_lens=[512]", "num_heads=2", "head_dim=16",
                      "memory_budget_gb=0.2", "fidelity.batch_size=64", "measure.min_run_time=0.01", "logger=none")
    run(cfg, output_dir=tmp_path)
    (row,) = rows_of(tmp_path)
    assert row["status"] == "ok" and row["fwd_ms"] > 0 and row["out_rel_err"] is None
    assert row["quality_reason"].startswith("fidelity: analytic memory") and "memory_budget_gb" in row["quality_reason"]


@pytest.mark.parametrize("yaml", VARIANT_YAMLS, ids=lambda p: p.stem)
def test_fidelity_memory_is_estimated_for_every_variant(yaml):
    """Every variant's fidelity estimate exists (its exact counterpart says its memory: reformer's is not
    an Attention) and bounds the measured peak of the float64 reference."""
    from harness.config import settings_from_config
    from harness.quality import fidelity_memory_bytes

    s = settings_from_config(compose_cfg(f"variant={yaml.stem}", *TINY))
    attn = variants.build(yaml.stem, **({"max_seq_len": 512} if yaml.stem == "linear" else {}))
    assert fidelity_memory_bytes(attn, s, 512) > 0
    reference = attn.exact_counterpart(s.fidelity.block_size)
    q, k, v = (t.double().detach().requires_grad_() for t in torch.randn(3, 1, 2, 512, 16))
    grad = torch.randn(1, 2, 512, 16, dtype=torch.float64)

    def step():
        reference(q, k, v).backward(grad)

    assert cpu_peak_bytes(step) <= reference.memory_bytes(1, 2, 512, 16, 8)


def test_point_over_memory_budget_is_skipped_and_the_next_runs(tmp_path):
    # full math at N=1024 needs about 3·2·1024²·4 bytes = 25 MB; N=64 about 0.1 MB. Budget: 1 MB.
    cfg = compose_cfg("variant=full", "variant.backend=math", "seq_lens=[1024,64]", "num_heads=2", "head_dim=16",
                      "memory_budget_gb=0.001", "measure.min_run_time=0.01", "stop_on_oom=false")
    sweep = run(cfg, output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert [(r["seq_len"], r["status"]) for r in rows] == [(1024, "skipped"), (64, "ok")]
    assert "memory_budget_gb" in rows[0]["reason"] and rows[0]["fwd_ms"] is None
    assert rows[0]["analytic_mem_bytes"] > 1e6 and rows[1]["fwd_bwd_ms"] > 0
    assert sweep.fits == {}  # one ok point: nothing to fit


def test_error_at_one_point_is_recorded_and_others_run(tmp_path):
    cfg = compose_cfg("variant=linear", "variant.max_seq_len=100", "variant.proj_dim=16", "seq_lens=[128,64]",
                      "num_heads=2", "head_dim=16", "measure.min_run_time=0.01")
    run(cfg, output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert [(r["seq_len"], r["status"]) for r in rows] == [(64, "ok"), (128, "error")]  # shortest first
    assert "128" in rows[1]["reason"] and "100" in rows[1]["reason"]


def test_out_of_memory_is_recorded_as_oom(tmp_path, monkeypatch):
    real = runmod.measure_point

    def oom_at_128(attn, **kw):
        if kw["seq_len"] == 128:
            kw["record"]["warmup_s"] = 0.5  # measured before the failure: kept
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", oom_at_128)
    cfg = compose_cfg("variant=full", "seq_lens=[128,64]", "num_heads=2", "head_dim=16", "measure.min_run_time=0.01",
                      "stop_on_oom=false")
    run(cfg, output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert [(r["seq_len"], r["status"]) for r in rows] == [(128, "oom"), (64, "ok")]
    assert "out of memory" in rows[0]["reason"] and rows[0]["warmup_s"] == 0.5


def test_an_out_of_memory_error_wrapped_by_another_is_oom(tmp_path, monkeypatch):
    """Inductor raises an OOM met while autotuning as its own compile error: still the point's oom."""
    real = runmod.measure_point

    def wrapped_oom_at_128(attn, **kw):
        if kw["seq_len"] == 128:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except torch.OutOfMemoryError as e:
                raise RuntimeError("backend='inductor' raised: OutOfMemoryError") from e
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", wrapped_oom_at_128)
    run(compose_cfg("variant=full", "seq_lens=[64,128,256]", "num_heads=2", "head_dim=16", "logger=none",
                    "measure.min_run_time=0.01"), output_dir=tmp_path)
    assert [(r["seq_len"], r["status"]) for r in rows_of(tmp_path)] == [(64, "ok"), (128, "oom"), (256, "skipped")]


def test_a_retry_that_runs_out_of_memory_keeps_the_measurement_before_it(tmp_path, monkeypatch):
    """on_noise=retry: a noisy first try, then an oom on the second (the first try's memory still cached
    on a GPU): the point keeps the first try's measurement, flagged noisy, and the longer N still run
    (it was once recorded oom, and stop_on_oom skipped every longer N)."""
    real, calls = runmod.measure_point, []

    def oom_on_second_try(attn, **kw):
        calls.append(kw["seq_len"])
        if calls.count(kw["seq_len"]) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", oom_on_second_try)
    run(compose_cfg("variant=full", "seq_lens=[64,128]", "num_heads=2", "head_dim=16", "logger=none",
                    "measure.min_run_time=0.01", "measure.on_noise=retry", "measure.max_tries=3",
                    "measure.max_rel_iqr=1e-9"),  # every timing with a spread is noisy: retried
        output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert [(r["seq_len"], r["status"], r["noisy"], r["tries"]) for r in rows] == [(64, "ok", True, 2),
                                                                                  (128, "ok", True, 2)]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    assert all(r["noise_reasons"].endswith("; try 2 ended oom: CUDA out of memory. Tried to allocate 2.00 GiB")
               for r in rows), rows[0]["noise_reasons"]


def test_a_lost_device_stops_the_run_after_recording_its_point_and_later_runs_measure_nothing(tmp_path,
                                                                                              monkeypatch):
    """After a sticky CUDA error every later kernel in the process fails: the point that raised it is an
    error, the run stops (status failed), and a sweep's next job in the same process measures nothing
    rather than recording errors that are not its own. (The probe itself runs on a GPU in
    test_gpu_backends.py; here it answers as it would after such an error.)"""
    real, lost = runmod.measure_point, []

    def illegal_access_at_128(attn, **kw):
        if kw["seq_len"] == 128:
            lost.append(True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", illegal_access_at_128)
    monkeypatch.setattr(runmod, "device_lost", lambda device: bool(lost))
    monkeypatch.setattr(runmod, "LOST", [])
    common = ("variant=full", "num_heads=2", "head_dim=16", "measure.min_run_time=0.01", "logger=none")
    with pytest.raises(runmod.RunFailed, match="the CUDA context was lost at N=128 .* after 2 of 3 points"):
        run(compose_cfg(*common, "seq_lens=[64,128,256]"), output_dir=tmp_path / "a")
    rows = rows_of(tmp_path / "a")
    assert [(r["seq_len"], r["status"]) for r in rows] == [(64, "ok"), (128, "error")]
    assert rows[1]["reason"].endswith("(the CUDA context is lost: the run stops here)")
    status = json.loads((tmp_path / "a" / "status.json").read_text())
    assert status["state"] == "failed" and "lost at N=128" in status["error"]
    with pytest.raises(runmod.RunFailed, match="lost at N=128"):  # the next job of the sweep
        run(compose_cfg(*common, "seq_lens=[64]", "variant.backend=math"), output_dir=tmp_path / "b")
    assert rows_of(tmp_path / "b") == []
    assert json.loads((tmp_path / "b" / "status.json").read_text())["state"] == "failed"
    # A new process (here: the probe's answer and the record cleared) resumes after the recorded point.
    monkeypatch.setattr(runmod, "LOST", [])
    lost.clear()
    monkeypatch.setattr(runmod, "measure_point", real)
    run(compose_cfg(*common, "seq_lens=[64,128,256]"), output_dir=tmp_path / "a")
    assert [(r["seq_len"], r["status"]) for r in rows_of(tmp_path / "a")] == [(64, "ok"), (128, "error"), (256, "ok")]


def test_stop_on_oom_records_the_longer_lengths_skipped_without_running_them(tmp_path, monkeypatch):
    real, ran = runmod.measure_point, []

    def oom_from_128(attn, **kw):
        ran.append(kw["seq_len"])
        if kw["seq_len"] >= 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", oom_from_128)
    common = ("variant=full", "num_heads=2", "head_dim=16", "measure.min_run_time=0.01", "logger=none")
    run(compose_cfg(*common, "seq_lens=[256,64,128,512]"), output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert ran == [64, 128]  # shortest first; nothing tried after the first oom
    assert [(r["seq_len"], r["status"]) for r in rows] == [(64, "ok"), (128, "oom"), (256, "skipped"), (512, "skipped")]
    assert all(r["reason"].startswith("not run: N=128 was oom (stop_on_oom") for r in rows[2:])
    # A rerun with a longer length: the stored oom still stops it (the directory's own rows count).
    run(compose_cfg(*common, "seq_lens=[1024]"), output_dir=tmp_path)
    assert ran == [64, 128] and rows_of(tmp_path)[-1]["reason"].startswith("not run: N=128 was oom")
    # A budget skip stops a series too; stop_on_oom=false tries every length.
    out = tmp_path / "budget"
    run(compose_cfg("variant=full", "variant.backend=math", "seq_lens=[2048,64,1024]", "num_heads=2",
                    "head_dim=16", "memory_budget_gb=0.001", "measure.min_run_time=0.01", "logger=none"), output_dir=out)
    assert [(r["seq_len"], r["status"]) for r in rows_of(out)] == [(64, "ok"), (1024, "skipped"), (2048, "skipped")]
    assert "memory_budget_gb" in rows_of(out)[1]["reason"] and "N=1024 was skipped" in rows_of(out)[2]["reason"]
    ran.clear()
    run(compose_cfg(*common, "seq_lens=[256,64,128]", "stop_on_oom=false"), output_dir=tmp_path / "all")
    assert ran == [256, 64, 128]
    # As the skip's reason says: rerun with stop_on_oom=false into the same directory, and the points it
    # skipped are run (the oom stays: retry=[oom] measures it again); their new rows supersede the skips.
    ran.clear()
    run(compose_cfg(*common, "seq_lens=[256,64,128,512]", "stop_on_oom=false"), output_dir=tmp_path)
    assert ran == [256, 512]
    assert {r["seq_len"]: r["status"] for r in latest(rows_of(tmp_path))} == {64: "ok", 128: "oom", 256: "oom",
                                                                              512: "oom", 1024: "skipped"}


def test_lengths_stop_on_oom_skipped_are_measured_once_what_stopped_them_is_measured_again(tmp_path, monkeypatch):
    """retry=[oom] measures the oom again: where it still does not fit, the longer lengths it had stopped
    are skipped anew for it; where it fits now, they are measured too, as is a new longer length. Before,
    they stayed skipped, "not run: N=128 was oom", with N=128 ok in the same run, and N=512 was skipped
    for N=256's stale skip. A rerun retrying nothing keeps the skips: their cause stands."""
    real, ran, fits = runmod.measure_point, [], []

    def oom_at_128(attn, **kw):
        ran.append(kw["seq_len"])
        if kw["seq_len"] == 128 and not fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", oom_at_128)
    common = ("variant=full", "num_heads=1", "head_dim=8", "measure.min_run_time=0.01", "logger=none",
              "fidelity.enabled=false", "measure.passes=[fwd]", "measure.memory=false")

    def now() -> dict[int, tuple[str, str | None]]:
        return {r["seq_len"]: (r["status"], (r["reason"] or "")[:22] or None) for r in latest(rows_of(tmp_path))}

    run(compose_cfg(*common, "seq_lens=[64,128,256]"), output_dir=tmp_path)
    skipped = ("skipped", "not run: N=128 was oom")
    assert ran == [64, 128] and now()[256] == skipped
    for retry, measured in (("[oom]", [128]), ("[]", [])):  # still oom, then nothing retried
        ran.clear()
        run(compose_cfg(*common, "seq_lens=[64,128,256]", f"retry={retry}"), output_dir=tmp_path)
        assert ran == measured and now()[128][0] == "oom" and now()[256] == skipped, (retry, ran, now())
    fits.append(True)
    ran.clear()
    run(compose_cfg(*common, "seq_lens=[64,128,256,512]", "retry=[oom]"), output_dir=tmp_path)
    assert ran == [128, 256, 512]
    assert now() == {n: ("ok", None) for n in (64, 128, 256, 512)}
    assert len(rows_of(tmp_path)) == 8  # three rows of the first run, N=128 and 256 again, then these three


def test_max_call_s_skips_a_length_predicted_too_slow_and_a_higher_cap_runs_it(tmp_path, monkeypatch):
    """measure.max_call_s: from the longest shorter timed point, times the executed FLOPs' ratio, a length
    predicted slower is recorded skipped with the prediction, not run; it does not stop the series as an oom
    would (each length is predicted on its own). A rerun with no cap (or a higher one) measures it."""
    real, ran = runmod.measure_point, []

    def counted(attn, **kw):
        ran.append(kw["seq_len"])
        return real(attn, **kw)

    monkeypatch.setattr(runmod, "measure_point", counted)
    common = ("variant=full", "variant.backend=math", "num_heads=2", "head_dim=16", "measure.min_run_time=0.01",
              "logger=none", "fidelity.enabled=false")
    run(compose_cfg(*common, "seq_lens=[64]"), output_dir=tmp_path)
    t64 = runmod.call_ms(rows_of(tmp_path)[0])
    # A cap above N=64's call, below its predictions at 96 and 128: (96/64)² and 4 times it (full's FLOPs)
    ran.clear()
    run(compose_cfg(*common, "seq_lens=[64,96,128]", f"measure.max_call_s={t64 * 1.5 / 1e3}"), output_dir=tmp_path)
    rows = {r["seq_len"]: r for r in rows_of(tmp_path)}
    assert ran == [] and [rows[n]["status"] for n in (64, 96, 128)] == ["ok", "skipped", "skipped"], rows
    reason = rows[96]["reason"]
    assert reason.startswith("not run: a forward+backward call predicted") and "measure.max_call_s=" in reason
    assert "stop_on_oom" not in rows[128]["reason"] and "N=64 took" in rows[128]["reason"]
    from harness.report.sweep import max_fitting

    assert max_fitting(list(rows.values())) == (64, 96, "skipped (time)")  # the report: not a memory frontier
    ran.clear()
    run(compose_cfg(*common, "seq_lens=[64,96,128]"), output_dir=tmp_path)  # no cap: measured now
    assert ran == [96, 128]
    assert {r["seq_len"]: r["status"] for r in latest(rows_of(tmp_path))} == {64: "ok", 96: "ok", 128: "ok"}


def test_tokens_per_batch_and_model_dim_set_b_and_h_per_point(tmp_path):
    cfg = compose_cfg("variant=full", "seq_lens=[32,64,128]", "tokens_per_batch=256", "model_dim=64", "head_dim=16",
                      "measure.min_run_time=0.01", "logger=none")
    settings, _, _ = validate(cfg)
    assert settings.num_heads == 4 and [settings.batch_at(n) for n in (32, 64, 128)] == [8, 4, 2]
    sweep = run(cfg, output_dir=tmp_path)
    rows = rows_of(tmp_path)
    assert [(r["batch_size"], r["num_heads"], r["tokens_per_batch"]) for r in rows] == [(8, 4, 256), (4, 4, 256), (2, 4, 256)]
    assert rows[0]["flops_fwd"] == 4 * 8 * 4 * 32 * 32 * 16  # the FLOPs of the point's own B
    # One series, fitted over every N (memory: timings may be left out as noisy on a loaded machine)
    assert len({series_key(r) for r in rows}) == 1 and sweep.fits["memory"]["seq_lens"] == [32, 64, 128]
    for bad, words in ((["tokens_per_batch=100"], ["tokens_per_batch=100", "N=128", "up to 100"]),
                       (["model_dim=60"], ["model_dim=60", "head_dim=16"])):
        with pytest.raises(ConfigError) as e:
            validate(compose_cfg("variant=full", "seq_lens=[32,64,128]", "tokens_per_batch=256", "model_dim=64",
                                 "head_dim=16", *bad))
        assert all(w in str(e.value) for w in words), str(e.value)


# ----- configuration and fits ----------------------------------------------------------------------

def test_config_yaml_documents_every_key_run_accepts():
    from omegaconf import OmegaConf

    from harness.config import FIDELITY_KEYS, MEASURE_KEYS, TOP_KEYS

    config = OmegaConf.load(CONF / "config.yaml")
    groups = {"variant", "task", "logger"}  # config groups: conf/<group>/*.yaml
    assert groups | {k for k in config if k not in ("defaults", "hydra")} == set(TOP_KEYS)
    assert list(config.measure) == list(MEASURE_KEYS)
    assert list(config.fidelity) == list(FIDELITY_KEYS)


def test_the_largest_seed_is_accepted_as_the_message_says():
    """A seed is allowed "from 0 to 2**63-1": both ends pass, for the sweep's seed and the task's (a < slip at the
    top, or at 0, refused a value the refusal's own message allows)."""
    top = 2**63 - 1
    for seed in (0, top):
        settings = settings_from_config(compose_cfg(f"seed={seed}", "task=mqar", f"task.seed={seed}"))
        assert settings.seed == seed and settings.task["seed"] == seed


def test_each_bound_refuses_the_value_past_it_and_accepts_the_value_at_it():
    """Every bound is stated in the refusal's line ("integer >= 1", "at most 604800", "<= tokens_per_batch"):
    the value at the bound passes and the one past it is refused, for the checks no other test reaches the
    edge of (max_tries=0 ran no measurement at all; fidelity.block_size=0 failed in range() at the first
    point; a week, or N == tokens_per_batch (B = 1), refused by a slip to >=)."""
    edges = [  # (at the bound: accepted, past it: refused, words of the refusal)
        ("measure.max_tries=1", "measure.max_tries=0", ["measure.max_tries", ">= 1", "got 0"]),
        ("fidelity.block_size=1", "fidelity.block_size=0", ["fidelity.block_size", "> 0", "got 0"]),
        ("fidelity.max_seq_len=1", "fidelity.max_seq_len=0", ["fidelity.max_seq_len", "> 0", "got 0"]),
        ("measure.max_run_time=604800", "measure.max_run_time=604801", ["measure.max_run_time", "at most 604800"]),
        ("measure.max_call_s=604800", "measure.max_call_s=604801", ["measure.max_call_s", "at most 604800"]),
        ("distributed.timeout_s=604800", "distributed.timeout_s=604801", ["distributed.timeout_s", "at most 604800"]),
        ("tokens_per_batch=128", "tokens_per_batch=127", ["tokens_per_batch=127", "N=128", "up to 127"]),
    ]
    for ok, bad, words in edges:
        settings = settings_from_config(compose_cfg("seq_lens=[32,128]", ok))
        assert settings.seq_lens == (32, 128), ok
        with pytest.raises(ConfigError) as e:
            settings_from_config(compose_cfg("seq_lens=[32,128]", bad))
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), (bad, str(e.value))
    assert settings_from_config(compose_cfg("seq_lens=[32,128]", "tokens_per_batch=128")).batch_at(128) == 1


def test_a_flag_of_the_measurement_is_true_or_false_not_any_string():
    """measure.memory and measure.param_grads are booleans: a string ("maybe", "no") is truthy and would
    measure what the user turned off; refused in one line like causal=maybe."""
    for key in ("measure.memory", "measure.param_grads", "fidelity.enabled", "resume", "stop_on_oom"):
        with pytest.raises(ConfigError) as e:
            settings_from_config(compose_cfg("seq_len=32", f"{key}=maybe"))
        assert str(e.value) == f"{key} must be true or false; got 'maybe'", str(e.value)


def test_the_cpu_memory_budget_is_checked_against_memtotal_in_gb_not_gib(monkeypatch):
    """memory_budget_gb is in GB (1e9 bytes), as its refusal prints MemTotal: on a 16 GB machine 15.9 passes
    and 16.1 is refused (read as GiB, 15.9 would be 17.07e9 bytes and refused; 16 GB machines are common);
    on a GPU the budget is not bound by the host's memory."""
    monkeypatch.setattr(runmod.envmod, "mem_total_bytes", lambda: 16_000_000_000)
    cpu = torch.device("cpu")
    runmod.check_memory_budget(settings_from_config(compose_cfg("seq_len=32", "memory_budget_gb=15.9")), cpu)
    runmod.check_memory_budget(settings_from_config(compose_cfg("seq_len=32", "memory_budget_gb=16")), cpu)
    with pytest.raises(ConfigError) as e:
        runmod.check_memory_budget(settings_from_config(compose_cfg("seq_len=32", "memory_budget_gb=16.1")), cpu)
    assert str(e.value).startswith("memory_budget_gb=16.1 exceeds this machine's physical memory (MemTotal 16 GB)")
    runmod.check_memory_budget(settings_from_config(compose_cfg("seq_len=32", "memory_budget_gb=100")),
                               torch.device("cuda"))


def test_linear_share_none_gets_num_heads_from_the_workload():
    settings, attn, _ = validate(compose_cfg("variant=linear", "variant.share=none", "num_heads=3"))
    assert settings.variant["num_heads"] == 3 and attn.options.num_heads == 3


def test_seq_lens_replace_seq_len_and_passes_are_validated():
    settings, _, _ = validate(compose_cfg("seq_len=64", "seq_lens=[256,128,256]", "measure.passes=[fwd_bwd,fwd]"))
    assert settings.seq_lens == (256, 128) and settings.measure.passes == ("fwd", "fwd_bwd")


def test_fit_exponents_against_theory():
    rows = [{"status": "ok", "seq_len": n, "fwd_ms": 1e-6 * n**2, "bwd_ms": None, "fwd_bwd_ms": 3e-6 * n**2,
             "flops_fwd": n**2, "peak_mem_bytes": 10 * n, "analytic_mem_bytes": 12 * n + 0} for n in (256, 512, 1024)]
    rows.append({**rows[0], "seq_len": 2048, "status": "skipped", "fwd_ms": None})
    fits = fit_exponents(rows)
    assert fits["fwd_ms"]["fitted"] == pytest.approx(2) and fits["fwd_ms"]["theory"] == pytest.approx(2)
    assert fits["memory"]["fitted"] == pytest.approx(1) and fits["memory"]["seq_lens"] == [256, 512, 1024]
    assert "bwd_ms" not in fits


def test_the_theory_beside_a_fitted_exponent_is_the_analytic_slope_not_the_measured_one():
    """fit.json sets each measured exponent beside the theory: the slope of the forward FLOPs (time) or of
    the analytic memory (memory) over the same N. A theory read from the measured column would always
    agree with the fit, hiding a variant that does not scale as its analysis says."""
    rows = [{"status": "ok", "seq_len": n, "fwd_ms": 1e-6 * n**1.5, "bwd_ms": None, "fwd_bwd_ms": None,
             "flops_fwd": n**2, "peak_mem_bytes": 10 * n, "analytic_mem_bytes": n**2} for n in (256, 1024, 4096)]
    fits = fit_exponents(rows)
    assert (fits["fwd_ms"]["fitted"], fits["fwd_ms"]["theory"]) == (pytest.approx(1.5), pytest.approx(2.0))
    assert (fits["memory"]["fitted"], fits["memory"]["theory"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert (fits["memory"]["measured"], fits["memory"]["analytic"]) == ("peak_mem_bytes", "analytic_mem_bytes")


def test_fit_exponents_needs_two_distinct_lengths_and_its_bounds_are_inclusive():
    """A slope needs two lengths: two rows at one N (two seeds of it) are no fit, whatever their count (a
    log-log fit through one x is no exponent). min_seq_len and max_seq_len bound the fit with both ends
    included, as --fit-from does in the report."""
    rows = [{"status": "ok", "seq_len": n, "seed": seed, "fwd_ms": 1e-6 * n**2, "bwd_ms": None, "fwd_bwd_ms": None,
             "flops_fwd": n**2, "peak_mem_bytes": None, "analytic_mem_bytes": None}
            for n in (256, 512, 1024) for seed in (0, 1)]
    assert fit_exponents([r for r in rows if r["seq_len"] == 256]) == {}
    assert fit_exponents(rows, min_seq_len=512)["fwd_ms"]["seq_lens"] == [512, 1024]
    assert fit_exponents(rows, max_seq_len=512)["fwd_ms"]["seq_lens"] == [256, 512]


@pytest.mark.gpu
def test_gpu_point_records_allocator_peaks(tmp_path):
    cfg = compose_cfg("variant=full", "device=cuda", "seq_lens=[256,512]", "measure.min_run_time=0.01")
    run(cfg, output_dir=tmp_path)
    for r in rows_of(tmp_path):
        assert r["status"] == "ok" and r["device"] == "cuda"
        assert r["peak_mem_abs_bytes"] >= r["peak_mem_bytes"] > 0 and r["peak_mem_reserved_bytes"] > 0


@pytest.mark.gpu
def test_a_real_cuda_oom_is_a_row_and_the_process_measures_on_unchanged(tmp_path):
    """The OOM frontier on a GPU: a length whose N×N scores cannot be allocated (FA-1's shape, math at
    N=32K: 275 GB of fp16 scores; the allocation fails at once, whatever the GPU) is an oom row, the
    longer lengths are skipped, and what the failed point left is released: the same point measured
    again in this process takes the same peak memory as before."""
    common = ("variant=full", "variant.backend=math", "device=cuda", "dtype=float16", "batch_size=16",
              "num_heads=8", "head_dim=64", "fidelity.enabled=false", "measure.min_run_time=0.01", "logger=none")
    run(compose_cfg(*common, "seq_lens=[256,32768,65536]"), output_dir=tmp_path / "series")
    rows = {r["seq_len"]: r for r in rows_of(tmp_path / "series")}
    assert [rows[n]["status"] for n in (256, 32768, 65536)] == ["ok", "oom", "skipped"], rows
    assert "out of memory" in rows[32768]["reason"].lower()
    assert rows[65536]["reason"].startswith("not run: N=32768 was oom")
    run(compose_cfg(*common, "seq_lens=[256]"), output_dir=tmp_path / "after")
    (again,) = rows_of(tmp_path / "after")
    assert again["status"] == "ok" and again["peak_mem_bytes"] == pytest.approx(rows[256]["peak_mem_bytes"], rel=0.01)
    assert torch.cuda.memory_allocated() < 2**30  # nothing of the failed point is still held


def test_only_the_chosen_passes_and_memory_are_measured(tmp_path):
    run(compose_cfg("seq_len=32", "num_heads=1", "head_dim=8", "measure.passes=[fwd]", "measure.memory=false",
                    "measure.min_run_time=0.01"), output_dir=tmp_path)
    (row,) = rows_of(tmp_path)
    assert row["status"] == "ok" and row["fwd_ms"] > 0
    assert row["bwd_ms"] is row["fwd_bwd_ms"] is row["peak_mem_bytes"] is row["tflops_bwd"] is None


def test_the_backend_that_ran_is_recorded(tmp_path):
    sweep = run(compose_cfg("variant=full", "variant.backend=math", *TINY, "measure.passes=[fwd]"),
                output_dir=tmp_path)
    assert sweep.rows[0].backend == sweep.rows[0].backend_ran == "math"


# ----- bad input found after Hydra or the run started (review) ----------------------------------------

# Each refused before Hydra starts: exactly this line, exit 2, nothing written where the command ran.
ALLOWED_TASK_KEYS = ("seq_len, vocab_size, num_kv_pairs, num_queries, d_model, n_layers, n_heads, d_mlp, positions, "
                     "short_conv, batch_size, steps, lr, weight_decay, warmup_steps, grad_clip, eval_every, "
                     "eval_size, seed, span_penalty")
LATE_REFUSALS = [
    # non-finite numbers, which crashed later with a traceback
    (["measure.min_run_time=inf"], "measure.min_run_time must be a number of seconds > 0 (finite, at most 604800); "
                                   "got inf"),
    (["measure.max_run_time=inf"], "measure.max_run_time must be a number of seconds > 0 (finite, at most 604800); "
                                   "got inf"),
    (["measure.max_rel_iqr=nan"], "measure.max_rel_iqr must be a number > 0 (finite); got nan"),
    (["measure.max_other_cores=inf"], "measure.max_other_cores must be a number of cores > 0 (finite); got inf"),
    (["distributed.timeout_s=nan"], "distributed.timeout_s must be a number of seconds > 0 (finite, at most 604800); "
                                    "got nan"),
    (["distributed.timeout_s=1e300"], "distributed.timeout_s must be a number of seconds > 0 (finite, at most "
                                      "604800); got 1e+300"),
    (["memory_budget_gb=nan"], "memory_budget_gb must be a number of GB > 0 (finite), or null for 0.5 of the "
                               "available memory; got nan"),
    (["logger=wandb", "logger.init_timeout_s=nan"],
     "logger.init_timeout_s must be a number of seconds > 0 (finite, at most 604800); got nan"),
    # seeds past an int64, which became error rows
    (["seed=99999999999999999999"], "seed must be an integer from 0 to 2**63-1 (9223372036854775807); "
                                    "got 99999999999999999999"),
    (["task=mqar", "task.steps=1", "seq_len=32", "task.seed=9223372036854775808"],
     "task.seed must be an integer from 0 to 2**63-1 (9223372036854775807); got 9223372036854775808"),
    # a task key not in the config names the allowed ones, as +task.nope=1 does
    (["task=mqar", "seq_len=64", "task.nope=1"], f"task=mqar at N=64: unknown option 'nope'; allowed: "
                                                 f"{ALLOWED_TASK_KEYS}"),
    (["task=mqar", "seq_len=64", "+task.nope=1"], f"task=mqar at N=64: unknown option 'nope'; allowed: "
                                                  f"{ALLOWED_TASK_KEYS}"),
    # output paths: Hydra's own directory was left behind, or the current directory written into
    (["output_dir=/proc/xx"], "cannot write results to /proc/xx: /proc is not writable (No such file or directory)"),
    (["output_dir="], "output_dir must be a path or null (Hydra's output directory); got ''"),
    (["hydra.run.dir="], "hydra.run.dir is empty (an unset variable?); allowed: a directory path (Hydra would write "
                         "into the current directory)"),
    (["-m", "hydra.sweep.dir="], "hydra.sweep.dir is empty (an unset variable?); allowed: a directory path (Hydra "
                                 "would write into the current directory)"),
    # an interpolation of Hydra's own settings that does not resolve, a name past the filesystem's limit:
    # tracebacks (the second after Hydra had made the directories above it)
    (["hydra.run.dir=out/${oc.env:HARNESS_TEST_UNSET}"], "KeyError raised while resolving interpolation: "
     "\"Environment variable 'HARNESS_TEST_UNSET' not found\" full_key: hydra.run.dir object_type=dict"),
    ([f"hydra.run.dir=out/{'a' * 256}"], f"cannot write results under a name ({'a' * 24}...) of 256 bytes; allowed: "
                                         f"at most 255"),
    # every job's values of a sweep, not one job per combination of config group choices
    (["-m", "batch_size=1,abc"], "batch_size must be an integer > 0; got 'abc'"),
    (["-m", "seq_lens=[32],[0]"], "seq_lens must be an integer > 0; got 0"),
    (["-m", "variant=full,blockwise", "seq_lens=[32],[64]", "measure.min_run_time=0.01,nan"],
     "measure.min_run_time must be a number of seconds > 0 (finite, at most 604800); got nan"),
    # ... and the variant's and the task's options of every job, not only of the first of its group
    (["-m", "seq_lens=[32]", "variant=sparse", "variant.pattern=fixed,nope"],
     "sparse: unknown pattern 'nope'; allowed: fixed, strided, bigbird"),
    (["-m", "seq_lens=[32]", "task=mqar", "task.steps=1,-1"], "task=mqar at N=32: steps must be an integer >= 1; got -1"),
    # a sweep whose values select nothing: Hydra launched no job and exited 0
    (["-m", "variant=glob(nope*)"], "the sweep has no job: variant=glob(nope*) selects no value; allowed for variant: "
                                    "adaptive_span, blockwise, full, linear, reformer, ring, sliding_window, sparse, ulysses"),
    (["-m", "seq_len=range(5,1)"], "the sweep has no job: seq_len=range(5,1) selects no value; allowed for seq_len: "
                                   "at least one value"),
    # a group of options given a value, a group's choice that is no name: tracebacks
    (["seq_len=32", "measure=5"], "measure is a group of options, set one by one (measure.KEY=VALUE; keys: passes, "
                                  "warmup_iters, min_run_time, min_samples, max_run_time, timer, memory, param_grads, "
                                  "max_rel_iqr, max_other_cores, on_noise, max_tries, max_call_s); got measure=5"),
    (["seq_len=32", "distributed=true"], "distributed is a group of options, set one by one (distributed.KEY=VALUE; "
                                         "keys: timeout_s); got distributed=True"),
    (["seq_len=32", "variant=5"], "unknown variant '5'; allowed: adaptive_span, blockwise, full, linear, reformer, ring, "
                                  "sliding_window, sparse, ulysses"),
    # an integer past int64: its FLOPs overflowed a float after the first points were measured
    ([f"seq_lens=[32,1{'0' * 30}]"], "seq_lens must be an integer > 0 and at most 2**63-1; got a 31-digit integer"),
    # a task option without a task ("allowed: " and nothing)
    (["seq_len=32", "task.steps=5"], "task=none takes no options; got task.steps (choose a task first: task=mqar)"),
    (["--config-path=/nonexistent"], "--config-path /nonexistent is not a directory"),
    (["--config-name=nope"], "unknown --config-name 'nope'; allowed: config"),  # Hydra's line named none
    # a launcher's number that joblib or submitit refused with a traceback once the jobs were launched (n_jobs=0),
    # or that failed every job (timeout_min=-1), after the sweep directory was written
    (["-m", "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=0"],
     "hydra.launcher.n_jobs must be an integer other than 0 (worker processes; -1: one per core); got 0"),
    (["-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=-1"],
     "hydra.launcher.timeout_min must be a number of minutes > 0, or null; got -1"),
    (["-m", "hydra/launcher=slurm", "hydra.launcher.mem_gb=-5"], "hydra.launcher.mem_gb must be a number of GB > 0, "
                                                                  "or null; got -5"),
    (["-m", "hydra/launcher=slurm", "hydra.launcher.nodes=0"], "hydra.launcher.nodes must be an integer >= 1, or null; "
                                                               "got 0"),
    # a key of the sweeper's grid without a preset (null then): OmegaConf's AssertionError, a traceback
    (["-m", "hydra.sweeper.params.variant=full"], "hydra.sweeper.params.variant=full: hydra.sweeper.params is null "
     "without a sweep preset, so it has no key to set; allowed: the values to sweep given as overrides (-m "
     "variant=full,linear), or a preset first (sweep=NAME: cpu_small, fa2_full, pattern_compare, seq_len_scaling, "
     "sequence_parallel)"),
    (["-m", "hydra.sweeper.params.variant=full,linear"], "Sweeping over Hydra's configuration is not supported : "
                                                         "'hydra.sweeper.params.variant=full,linear'"),
    # Hydra's own output folder where none can be made: its traceback after the run's directory was made
    (["seq_len=32", "hydra.output_subdir=/proc/xx"], "hydra.output_subdir=/proc/xx: cannot write results to /proc/xx: "
                                                    "/proc is not writable (No such file or directory)"),
]


def test_late_refusals_are_one_line_exit_2_before_hydra_writes(tmp_path):
    """In this process (conftest.refusal); as a process: test_hydra_refusals_are_one_line_exit_2_nothing_written."""
    for i, (args, want) in enumerate(LATE_REFUSALS):
        cwd = tmp_path / str(i)  # Hydra's default output and sweep directories are relative to it
        cwd.mkdir()
        flags = [a for a in args if a.startswith("-")]  # Hydra's flags before the overrides
        overrides = [a for a in args if not a.startswith("-")]
        assert refusal([*flags, "logger=none", "num_heads=1", "head_dim=8", "measure.min_run_time=0.01", *overrides],
                       cwd) == f"error: {want}", args


def test_a_directory_of_another_commands_results_is_refused_and_left_as_it_was(tmp_path):
    """bench_gpu's results directory: a run into it (hydra.run.dir or output_dir) wrote its env.json over
    bench_gpu's record of its invocations (the device its results were measured on), exit 0. Refused by the
    command line's check (in this process: conftest.refusal). bench_cpu's combined table is no such
    directory: a run moves its results.csv aside (test_reliability.py), and nothing of it is written over."""
    from harness.command_line import check

    dirs = results_dirs(tmp_path)
    gpu, cpu = dirs["gpu"], dirs["cpu"]
    kept = {p.name: p.read_bytes() for p in gpu.iterdir()}
    want = (f"error: cannot write results to {gpu}: it holds the results of scripts/bench_gpu.py (SUMMARY.md), whose "
            f"env.json python -m harness would write over; allowed: a directory of python -m harness's own, or a new one")
    for i, where in enumerate([f"hydra.run.dir={gpu}", f"output_dir={gpu}"]):
        (tmp_path / str(i)).mkdir()
        assert refusal([where, "seq_len=32", "logger=none"], tmp_path / str(i)) == want, where
    assert {p.name: p.read_bytes() for p in gpu.iterdir()} == kept
    check([f"hydra.run.dir={cpu}", "seq_len=32", "logger=none"])  # not refused


def test_a_module_the_machine_cannot_hold_is_refused_before_it_is_built(tmp_path):
    """linear's E and F, each 0.6 of the memory available (each passing the kernel's overcommit check, so
    allocated and filled), got the process ended by the OOM killer: no line, no row; a model of 10¹¹ layers
    was built until killed. Each is counted on the meta device first: one line, exit 2, nothing written;
    a run and every job of a sweep alike. Processes, not this one (conftest.refusal): were the count to
    regress, the OOM killer or the endless build ends them, not the test process."""
    from harness.env import mem_available_bytes

    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    n = int(1.2 * mem_available_bytes() / (2 * 64 * 4)) + 1  # E, F: proj_dim=64 × n float32 each
    cases = [(["variant=linear", "variant.proj_dim=64", f"variant.max_seq_len={n}"], f"variant linear's parameters and buffers take "
              f"{2 * 64 * 4 * n / 1e9:.3g} GB"),
             (["-m", "task=mqar", "task.n_layers=2,100000000000"], "task=mqar's model (n_layers=100000000000, d_model=64, "
              "vocab_size=64, seq_len=32), its gradients and Adam's moments take 8.02e+07 GB")]
    procs = [subprocess.Popen([sys.executable, "-m", "harness", *args, "logger=none", "seq_lens=[32]"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for args, _ in cases]
    for (args, want), proc in zip(cases, procs):
        (line,) = proc.communicate(timeout=120)[0].splitlines()
        assert proc.returncode == 2 and line.startswith(f"error: {want}, more than this machine's available memory ("), line
        assert line.endswith("allowed: task sizes whose model fits" if "-m" in args else
                             "allowed: options whose tensors fit (linear: E and F hold proj_dim × max_seq_len numbers each)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum,code,name", [(2, 130, "Ctrl-C"), (15, 143, "SIGTERM")])
def test_a_signal_while_a_script_imports_is_one_line(tmp_path, signum, code, name):
    """The scripts (bench_cpu, bench_peers, bench_gpu, harness.report) import torch or matplotlib for
    seconds before their main: a Ctrl-C there was a KeyboardInterrupt's traceback, a SIGTERM a silent end."""
    script = f"""
import os, sys
from harness.signals import exit_at_startup_interrupts
exit_at_startup_interrupts("some_script.py")
os.kill(os.getpid(), {signum})
import time
time.sleep(30)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (proc.returncode, proc.stdout + proc.stderr) == (
        code, f"some_script.py: interrupted ({name}) while starting; nothing was written\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum,code,name", [(2, 130, "Ctrl-C"), (15, 143, "SIGTERM")])
@pytest.mark.parametrize("swallowed", [False, True])
def test_a_signal_while_torch_is_imported_at_startup_is_one_line(tmp_path, signum, code, name, swallowed):
    """Ctrl-C or SIGTERM landing inside torch's import (the command line's check imports it): the handler
    imports nothing that imports torch (it re-entered torch's half-done import: an ImportError and a
    traceback). Raised there, it ends the command as interrupted; swallowed there (a library's except),
    it is raised again before Hydra writes anything."""
    out = tmp_path / "run"
    catch = "except KeyboardInterrupt:\n            pass" if swallowed else "finally:\n            pass"
    script = f"""
import importlib.abc, os, sys

class SignalInTorchsImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("torch."):
            return None
        sys.meta_path.remove(self)
        try:
            os.kill(os.getpid(), {signum})
            for _ in range(1000):  # the handler runs here
                pass
        {catch}
        return None

sys.meta_path.insert(0, SignalInTorchsImport())
sys.argv = ["harness", "variant=full", "seq_lens=[64]", "num_heads=1", "head_dim=8", "logger=none",
            "hydra.run.dir={out}"]
from harness.__main__ import main
main()
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"})
    assert (proc.returncode, proc.stdout + proc.stderr) == (
        code, f"error: interrupted ({name}) before a run started; nothing was measured\n")
    assert list(tmp_path.iterdir()) == []


def test_compare_refuses_a_threshold_that_can_never_flag(tmp_path, capsys):
    from harness.report.compare import main as compare

    for threshold in ("nan", "inf"):
        assert compare([str(tmp_path), str(tmp_path), "--threshold", threshold]) == 2
        assert capsys.readouterr().err == (f"compare: error: --threshold must be a finite number >= 0 (a relative "
                                           f"change: 0.10 is 10%); got {threshold}\n")
    with pytest.raises(SystemExit) as e:  # argparse's own refusal: one line too
        compare([str(tmp_path), str(tmp_path), "--threshold", "abc"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "compare: error: argument --threshold: invalid float value: 'abc'; see --help\n"


def test_throughputs_are_the_flops_over_each_pass_time_the_backward_counted_as_2_5_forwards(tmp_path, monkeypatch):
    """tflops_<pass> = FLOPs / time in s / 1e12: the forward's FLOPs for the forward, 2.5 times them for the
    backward and 3.5 times for forward+backward (FlashAttention's convention), executed and useful alike;
    causal full attention's useful FLOPs count N(N+1)/2 pairs. The times are stood in for (2, 4 and 8 ms),
    so the figures are exact."""
    def timed(attn, **kw):
        kw["record"].update(setup_s=0.0, warmup_s=0.0, **{f"{p}_{k}": v for p, ms in (("fwd", 2.0), ("bwd", 4.0),
                                                                                       ("fwd_bwd", 8.0))
                                                           for k, v in (("ms", ms), ("iqr_ms", 0.0), ("samples", 5))})

    monkeypatch.setattr(runmod, "measure_point", timed)
    (r,) = run(compose_cfg("variant=full", "causal=true", "seq_lens=[64]", "batch_size=1", "num_heads=2",
                           "head_dim=16", "fidelity.enabled=false", "logger=none"), output_dir=tmp_path).rows
    useful = 4 * 1 * 2 * 16 * (64 * 65 // 2)
    assert r.flops_fwd_useful == useful and r.flops_fwd >= useful
    assert r.tflops_fwd == pytest.approx(r.flops_fwd / 2e-3 / 1e12)
    assert r.tflops_fwd_useful == pytest.approx(useful / 2e-3 / 1e12)
    assert r.tflops_bwd == pytest.approx(2.5 * r.flops_fwd / 4e-3 / 1e12)
    assert r.tflops_bwd_useful == pytest.approx(2.5 * useful / 4e-3 / 1e12)
    assert r.tflops_fwd_bwd == pytest.approx(3.5 * r.flops_fwd / 8e-3 / 1e12)
    assert r.tflops_fwd_bwd_useful == pytest.approx(3.5 * useful / 8e-3 / 1e12)


def test_the_memory_budget_counts_the_inputs_beside_the_analytic_extra(tmp_path):
    """A point is skipped where its analytic extra memory plus q, k, v and the output gradient (4·B·H·N·D
    elements) pass memory_budget_gb: a budget above the extra alone but below it with the inputs skips it."""
    cfg = compose_cfg("variant=full", "variant.backend=math", "seq_lens=[64]", "batch_size=1", "num_heads=1",
                      "head_dim=256", "fidelity.enabled=false", "logger=none")
    _, attn, device = validate(cfg)
    extra, inputs = attn.memory_bytes(1, 1, 64, 256, 4, False, device), 4 * 64 * 256 * 4
    cfg.memory_budget_gb = (extra + inputs / 2) / 1e9
    (r,) = run(cfg, output_dir=tmp_path).rows
    assert r.status == "skipped" and "(inputs included)" in r.reason and r.fwd_ms is None, r.reason


def test_on_noise_retry_keeps_the_quietest_try_not_the_first_or_the_last(tmp_path, monkeypatch):
    """measure.on_noise=retry with three noisy tries (forward+backward IQR 50%, 20% and 40% of the median,
    all over max_rel_iqr): the point keeps the try with the smallest relative spread, the second, and
    says it took three."""
    spreads = iter([5.0, 2.0, 4.0])

    def timed(attn, **kw):
        kw["record"].update(setup_s=0.0, warmup_s=0.0, fwd_bwd_ms=10.0, fwd_bwd_iqr_ms=next(spreads),
                            fwd_bwd_samples=9)

    monkeypatch.setattr(runmod, "measure_point", timed)
    (r,) = run(compose_cfg("variant=full", "seq_lens=[64]", "num_heads=1", "head_dim=8", "measure.passes=[fwd_bwd]",
                           "measure.on_noise=retry", "measure.max_tries=3", "fidelity.enabled=false", "logger=none"),
               output_dir=tmp_path).rows
    assert (r.fwd_bwd_iqr_ms, r.tries, r.noisy) == (2.0, 3, True)
    assert r.noise_reasons == "fwd_bwd: IQR 20% of the median > measure.max_rel_iqr=0.15"


def test_each_pass_times_only_its_own_calls_after_the_warm_up_iterations(monkeypatch):
    """measure_point with a timer that calls each timed function three times instead of timing it: the
    warm-up makes measure.warmup_iters forward+backward calls, the forward pass times forwards alone (a
    forward timed with its backward would report the forward+backward time as the forward's), the backward
    pass backwards alone (its one forward outside the timer) and forward+backward both; every timed
    backward starts from cleared input gradients (one that added into the last call's would time an extra
    add per gradient). No time is asserted: the calls are."""
    from harness.config import MeasureOptions
    from harness.measure import Timing, measure_point

    attn = variants.build("full", backend="math")
    phase, calls, cleared, inputs = ["?"], [], [], {}
    real_forward = attn.forward

    def forward(q, k, v, causal=False):
        inputs.update(q=q, k=k, v=v)
        calls.append((phase[0], "forward"))
        out = real_forward(q, k, v, causal=causal)
        out.register_hook(lambda grad: calls.append((phase[0], "backward")))
        return out

    monkeypatch.setattr(attn, "forward", forward)

    def timer(fn, device, opts, before=None):
        for _ in range(3):
            if before is not None:
                before()
            cleared.append((phase[0], all(t.grad is None for t in inputs.values())))
            fn()
        return Timing(1.0, 0.1, 3)

    record = {}
    measure_point(attn, batch_size=1, num_heads=1, seq_len=16, head_dim=8, dtype=torch.float32,
                  device=torch.device("cpu"), causal=False, seed=0, opts=MeasureOptions(warmup_iters=4),
                  record=record, on_phase=lambda p: phase.__setitem__(0, p), timer_fn=timer)

    def of(p: str) -> list[str]:
        return [c for q, c in calls if q == p]

    assert of("warm-up") == ["forward", "backward"] * 4
    assert of("memory") == ["forward", "backward"]
    assert of("fwd") == ["forward"] * 3
    assert of("bwd") == ["forward"] + ["backward"] * 3
    assert of("fwd_bwd") == ["forward", "backward"] * 3
    assert [ok for p, ok in cleared if p in ("bwd", "fwd_bwd")] == [True] * 6
    assert (record["fwd_ms"], record["bwd_ms"], record["fwd_bwd_ms"]) == (1.0, 1.0, 1.0)


def test_on_noise_retry_ranks_tries_by_their_number_of_reasons_then_their_worst_pass(tmp_path, monkeypatch):
    """The quietest try has the fewest noise reasons; among tries with as many, the smallest relative spread
    of its noisiest pass. Three noisy tries (forward / forward+backward IQR of the median): 20% / 20% (two
    reasons), 50% / 1% and 30% / 10% (one each): the third is kept. Ranked by spread alone the first would
    be (its worst pass 20%), by its quietest pass the second (1%)."""
    tries = iter([(1.0, 2.0), (2.5, 0.1), (1.5, 1.0)])  # (fwd_iqr_ms, fwd_bwd_iqr_ms): fwd 5 ms, fwd_bwd 10 ms

    def timed(attn, **kw):
        fwd_iqr, fwd_bwd_iqr = next(tries)
        kw["record"].update(setup_s=0.0, warmup_s=0.0, fwd_ms=5.0, fwd_iqr_ms=fwd_iqr, fwd_samples=9,
                            fwd_bwd_ms=10.0, fwd_bwd_iqr_ms=fwd_bwd_iqr, fwd_bwd_samples=9)

    monkeypatch.setattr(runmod, "measure_point", timed)
    (r,) = run(compose_cfg("variant=full", "seq_lens=[64]", "num_heads=1", "head_dim=8",
                           "measure.passes=[fwd,fwd_bwd]", "measure.on_noise=retry", "measure.max_tries=3",
                           "measure.max_other_cores=1000", "fidelity.enabled=false", "logger=none"),
               output_dir=tmp_path).rows
    assert (r.fwd_iqr_ms, r.fwd_bwd_iqr_ms, r.tries, r.noisy) == (1.5, 1.0, 3, True)
    assert r.noise_reasons == "fwd: IQR 30% of the median > measure.max_rel_iqr=0.15"


def test_a_retried_point_keeps_the_first_trys_set_up_and_warm_up_times(tmp_path, monkeypatch):
    """A retry's set-up and warm-up find the kernels compiled and the plans built: the point's cost of
    getting ready is the first try's, whichever try's timings are kept (here the second, the quieter)."""
    tries = iter([(7.0, 3.0, 5.0), (0.01, 0.02, 2.0)])  # (setup_s, warmup_s, fwd_bwd_iqr_ms of 10 ms)

    def timed(attn, **kw):
        setup_s, warmup_s, iqr = next(tries)
        kw["record"].update(setup_s=setup_s, warmup_s=warmup_s, fwd_bwd_ms=10.0, fwd_bwd_iqr_ms=iqr,
                            fwd_bwd_samples=9)

    monkeypatch.setattr(runmod, "measure_point", timed)
    (r,) = run(compose_cfg("variant=full", "seq_lens=[64]", "num_heads=1", "head_dim=8", "measure.passes=[fwd_bwd]",
                           "measure.on_noise=retry", "measure.max_tries=2", "measure.max_other_cores=1000",
                           "fidelity.enabled=false", "logger=none"), output_dir=tmp_path).rows
    assert (r.fwd_bwd_iqr_ms, r.tries) == (2.0, 2)
    assert (r.setup_s, r.warmup_s) == (7.0, 3.0)


def test_a_skipped_lengths_reason_names_the_shortest_length_that_did_not_fit():
    """stop_on_oom's reason names the series' memory frontier: the shortest shorter length that ran out of
    memory, whatever order the rows come in and whatever longer ones failed too (rows of earlier runs into
    the directory: here N=256's oom, measured alone before N=128's)."""
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB"
    rows = [{"seq_len": 256, "status": "oom", "reason": oom}, {"seq_len": 64, "status": "ok", "reason": None},
            {"seq_len": 128, "status": "oom", "reason": oom}]
    said = "(stop_on_oom: a longer sequence needs more memory; stop_on_oom=false runs it anyway)"
    assert runmod.stopped_by(rows, 512) == f"not run: N=128 was oom {said}"
    assert runmod.stopped_by(rows, 256) == f"not run: N=128 was oom {said}"
    assert runmod.stopped_by(rows, 128) is None


def test_an_out_of_memory_error_raised_while_another_error_is_handled_is_oom():
    """An OOM the next error was raised while handling (implicitly chained: its __context__, not its
    __cause__, as code that catches the OOM and raises its own error without ``from`` leaves it) still
    makes the point oom; the same error without an OOM behind it is an error."""
    def raised(make):
        try:
            make()
        except RuntimeError as e:
            return e

    def wrapped():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            raise RuntimeError("autotuning failed")

    def alone():
        raise RuntimeError("autotuning failed")

    assert runmod.failure(raised(wrapped)) == {"status": "oom", "reason": "autotuning failed"}
    assert runmod.failure(raised(alone)) == {"status": "error", "reason": "RuntimeError: autotuning failed"}
