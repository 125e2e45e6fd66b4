"""Quality in the harness: fidelity and MQAR numbers per point, and the wandb run read back from disk.

One real offline wandb run made by the real command line (``python -m harness ... task=mqar``) and read
back with ``wandb leet inspect``: its config, summary, history and points table must equal what the
harness wrote to results.jsonl, .hydra/config.yaml and env.json.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
from omegaconf import OmegaConf

from harness.logger import POINT_METRICS
from harness.results import read_jsonl

from .conftest import refusal
from .test_harness import compose_cfg

SEQ_LENS = (48, 80)  # not multiples of the window or the engine's block
STEPS, EVAL_EVERY = 20, 10


def leet(run_dir, *flags: str):
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", *flags, "--json", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """The issue's done-when command at tiny sizes: sliding_window at two lengths with task=mqar."""
    out = tmp_path_factory.mktemp("quality") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "variant=sliding_window", "variant.window=8",
         f"seq_lens=[{','.join(map(str, SEQ_LENS))}]", "num_heads=2", "head_dim=16",
         "measure.min_run_time=0.01", "task=mqar", f"task.steps={STEPS}", f"task.eval_every={EVAL_EVERY}",
         "task.eval_size=32", "task.batch_size=8", f"hydra.run.dir={out}"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one harness run is one wandb run"
    summary = json.loads(leet(runs[0], "--summary"))
    records = [json.loads(line) for line in leet(runs[0]).splitlines() if line.strip()]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    return out, runs[0], read_jsonl(out / "results.jsonl"), summary, history


def test_results_carry_fidelity_and_task_numbers(offline_run):
    _, _, rows, _, _ = offline_run
    assert [r["seq_len"] for r in rows] == list(SEQ_LENS)
    for r in rows:
        assert r["status"] == "ok" and r["quality_reason"] is None
        assert r["inputs"] == "gaussian" and r["task"] == "mqar" and r["task_seq_len"] == r["seq_len"]
        # window 8 of N >= 48 on iid inputs: far from exact, and only part of the softmax mass kept
        assert 0.05 < r["out_rel_err"] < 2 and 0 < r["out_cos"] < 1 and r["grad_rel_err"] > 0.05
        assert 0 < r["mass_kept"] < 0.9
        assert 0 <= r["task_accuracy"] <= 1 and r["task_loss"] > 0
        assert 1 / 8 < r["task_no_recall_accuracy"] < 0.3  # values repeat: above 1/P


def test_wandb_run_finished_with_the_resolved_config_and_environment(offline_run):
    out, _, rows, summary, _ = offline_run
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    config = {k: v for k, v in summary["config"].items() if k != "_wandb"}
    environment = config.pop("env")
    # The variant by name and by its options: what runs are grouped and filtered by.
    assert config.pop("variant_name") == "sliding_window"
    assert config.pop("variant_label") == "sliding_window[dilation=1,global_tokens=0,window=8]/blocksparse"
    assert config == OmegaConf.to_container(OmegaConf.load(out / ".hydra" / "config.yaml"), resolve=True)
    env_json = json.loads((out / "env.json").read_text())
    assert environment == {k: v for k, v in env_json.items() if k not in ("date", "config")}
    assert set(summary["tags"]) == {"sliding_window", rows[0]["backend"], "cpu"}


def test_wandb_summary_and_history_equal_the_results_file(offline_run):
    _, _, rows, summary, history = offline_run
    points = [h for h in history if "seq_len" in h]
    assert [h["seq_len"] for h in points] == list(SEQ_LENS)
    for row, logged in zip(rows, points):
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert {k: logged[k] for k in numbers} == pytest.approx(numbers, rel=1e-12)
    last = rows[-1]
    for metric in POINT_METRICS:
        if last.get(metric) is not None:
            assert summary["summary"][metric] == pytest.approx(last[metric], rel=1e-12), metric
    assert {"task_accuracy", "task_loss", "out_rel_err", "mass_kept"} <= set(summary["summary"])


def test_task_curves_are_logged_per_length(offline_run):
    _, _, rows, _, history = offline_run
    for row in rows:
        key = f"task/N{row['seq_len']}/eval_accuracy"
        curve = [(h["task/step"], h[key]) for h in history if key in h]
        assert [s for s, _ in curve] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
        assert curve[-1][1] == pytest.approx(row["task_accuracy"])


def test_points_table_equals_the_results_file(offline_run):
    _, run_dir, rows, summary, _ = offline_run
    table = json.loads((run_dir / "files" / summary["summary"]["points"]["path"]).read_text())
    logged = [dict(zip(table["columns"], values)) for values in table["data"]]
    assert len(logged) == len(rows)
    for row, got in zip(rows, logged):
        for k, v in row.items():
            if isinstance(v, float):
                assert got[k] == pytest.approx(v, rel=1e-12), k
            elif isinstance(v, list):  # as results.csv has it: JSON
                assert json.loads(got[k]) == v, k
            else:
                assert got[k] == v, k


def test_fidelity_beyond_its_max_length_is_missing_with_a_reason(tmp_path):
    from harness.run import run

    sweep = run(compose_cfg("variant=blockwise", "seq_lens=[40,72]", "num_heads=1", "head_dim=8",
                            "fidelity.max_seq_len=64", "measure.passes=[]", "measure.memory=false",
                            "logger=none"), output_dir=tmp_path)
    short, long_ = (r.record() for r in sweep.rows)
    # blockwise exact: rounding level in float32; nothing was timed (a quality-only point)
    assert short["out_rel_err"] < 1e-5 and short["mass_kept"] == 1.0 and short["fwd_ms"] is None
    assert long_["out_rel_err"] is None and "fidelity.max_seq_len=64" in long_["quality_reason"]


def test_fidelity_at_exactly_its_max_length_is_measured(tmp_path):
    """fidelity.max_seq_len is the longest N measured, itself included: at the default 4096, a sweep's N=4096
    point would otherwise lose its errors."""
    from harness.run import run

    sweep = run(compose_cfg("variant=blockwise", "seq_lens=[64]", "num_heads=1", "head_dim=8",
                            "fidelity.max_seq_len=64", "measure.passes=[]", "measure.memory=false",
                            "logger=none"), output_dir=tmp_path)
    (point,) = (r.record() for r in sweep.rows)
    assert point["quality_reason"] is None and point["out_rel_err"] < 1e-5 and point["mass_kept"] == 1.0


def test_inputs_choose_the_distribution_and_local_inputs_keep_more_mass(tmp_path):
    from harness.run import run

    kept = {}
    for kind in ("gaussian", "local"):
        sweep = run(compose_cfg("variant=sliding_window", "variant.window=16", "seq_len=200", "num_heads=1",
                                "head_dim=16", f"inputs={kind}", "measure.passes=[]", "measure.memory=false",
                                "logger=none"), output_dir=tmp_path / kind)
        (row,) = sweep.rows
        assert row.inputs == kind
        kept[kind] = row.mass_kept
    assert kept["gaussian"] < 0.3 < 0.9 < kept["local"]


def test_a_bad_task_or_logger_option_is_one_line_before_anything_is_written(tmp_path):
    """Refused by the command line's check, in this process (conftest.refusal; the process's own line and
    exit code: test_harness.py)."""
    for args, needle in ((["task=mqar", "task.d_model=65"], "divisible"),
                         (["task=mqar", "task.num_kv_pairs=0"], "num_kv_pairs"),
                         (["task=mqar", "task.positions=rope", "task.d_model=6"], "even head dimension"),
                         (["logger.mode=sometimes"], "allowed: online, offline, disabled"),
                         (["inputs=uniform"], "allowed: gaussian, local, peaked"),
                         (["task=nope"], "allowed: mqar, mqar_gpu, none")):
        out = tmp_path / "_".join(args).replace("=", "-")
        line = refusal(["seq_len=64", *args, f"hydra.run.dir={out}"], tmp_path)
        assert needle in line, (args, line)
        assert not out.exists()


def test_a_training_curve_is_logged_under_the_length_trained_at(tmp_path, monkeypatch):
    """task.seq_len=32 trains once at N=32 for every point: its curve was logged as task/N48/... (the first
    point's N), a curve of a length never trained at."""
    from harness.logger import RunLogger
    from harness.run import run

    logged = []
    monkeypatch.setattr(RunLogger, "log_task_step", lambda self, n, step, metrics: logged.append((n, step)))
    run(compose_cfg("variant=full", "seq_lens=[48,64]", "num_heads=1", "head_dim=8", "measure.passes=[]",
                    "measure.memory=false", "fidelity.enabled=false", "logger=none", "task=mqar", "task.seq_len=32",
                    "task.steps=2", "task.eval_every=1", "task.eval_size=8", "task.batch_size=4"), output_dir=tmp_path)
    assert logged and {n for n, _ in logged} == {32}, logged
    assert {r["task_seq_len"] for r in read_jsonl(tmp_path / "results.jsonl")} == {32}


def test_a_task_whose_training_diverges_records_no_accuracy_and_says_why(tmp_path):
    """NaN logits' argmax is token 0, never a target: a diverged model read as accuracy 0.0, a number the
    report and compare then trusted, with no quality_reason."""
    from harness.run import run

    (row,) = run(compose_cfg("variant=full", "seq_len=32", "num_heads=1", "head_dim=8", "measure.passes=[]",
                             "measure.memory=false", "fidelity.enabled=false", "logger=none", "task=mqar",
                             "task.steps=2", "task.eval_every=1", "task.eval_size=8", "task.batch_size=4",
                             "task.warmup_steps=1", "task.lr=1e30"), output_dir=tmp_path).rows
    rec = row.record()
    assert (rec["status"], rec["task_accuracy"], rec["task_loss"]) == ("ok", None, None), rec
    assert rec["quality_reason"].startswith("task: FloatingPointError: the training diverged: its final eval loss is "
                                            "nan (task.lr=1e+30)"), rec


def test_non_finite_numbers_are_written_as_null_not_a_crash():
    from harness.results import Result, FIELDS

    rec = dict.fromkeys(FIELDS)
    rec.update(variant="full", backend="math", seq_len=8, status="ok", out_rel_err=math.nan, out_cos=math.inf)
    row = Result(**rec).record()
    assert row["out_rel_err"] is None and row["out_cos"] is None
    json.dumps(row, allow_nan=False)


def test_credentials_for_a_self_hosted_wandb_server_make_runs_online(tmp_path, monkeypatch):
    """`wandb login --host` writes a ~/.netrc entry for that host and WANDB_BASE_URL names it: the
    harness logs online there, as wandb itself would, not offline without a word."""
    from harness.logger import LoggerConfig, has_credentials, resolve_mode

    rc = tmp_path / "netrc"
    rc.write_text("machine wandb.example.org login user password secret\n")
    rc.chmod(0o600)
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(rc))
    assert not has_credentials()  # an entry for another host than api.wandb.ai
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert has_credentials()
    assert resolve_mode(LoggerConfig(name="wandb")) == "online"


# ----- the logger alone, with a stand-in wandb: what each call hands to the run ----------------------

class FakeRun:
    """A wandb run that keeps what it is given (log calls with their step, summary, config, finish)."""

    def __init__(self, run_id: str = "run1", **init) -> None:
        self.id, self.init, self.logged, self.summary, self.finished = run_id, init, [], {}, None
        self.config = types.SimpleNamespace(update=lambda *a, **k: None)

    def define_metric(self, *args, **kwargs) -> None:
        pass

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self, exit_code):
        self.finished = exit_code


def fake_wandb(monkeypatch, runs: list):
    """A wandb module whose init makes a FakeRun (its kwargs kept) and whose Table and plot.line keep their data."""
    def init(**kwargs):
        runs.append(FakeRun(kwargs.get("id") or f"new{len(runs)}", **kwargs))
        return runs[-1]
    module = types.SimpleNamespace(
        init=init, Settings=lambda **k: k,
        Table=lambda columns, data: {"columns": columns, "data": data},
        plot=types.SimpleNamespace(line=lambda table, x, y, title: {"x": x, "y": y, "data": table["data"]}))
    monkeypatch.setitem(sys.modules, "wandb", module)
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)


def test_a_point_logs_every_number_of_its_row_and_no_flag_or_text(tmp_path):
    """The per-point history is the row's numbers, unchanged (seq_len is the x-axis): a flag (causal, noisy)
    is no metric to chart against seq_len, and text is not a number."""
    from harness.logger import RunLogger, RunState

    run = FakeRun()
    logger = RunLogger(run, RunState(tmp_path))
    row = {"seq_len": 64, "fwd_ms": 1.5, "fwd_bwd_ms": 4.0, "peak_mem_bytes": 2**20, "causal": False, "noisy": True,
           "status": "ok", "noisy_passes": ["fwd"], "out_cos": None}
    assert logger.add_unlogged([row]) == [64]
    assert run.logged == [(0, {"seq_len": 64, "fwd_ms": 1.5, "fwd_bwd_ms": 4.0, "peak_mem_bytes": 2**20})]


def test_the_run_state_on_disk_is_past_each_step_before_it_is_logged(tmp_path):
    """harness-run.json is saved with the next step before the log call: a crash in that call leaves a gap in
    the history, never a step the resumed run logs a second time (saved before the increment, it would)."""
    from harness.logger import RunLogger, RunState

    logger = RunLogger(FakeRun(), RunState(tmp_path))
    logger.state.run_id = "run1"
    logger.run.log = lambda values, step: (_ for _ in ()).throw(OSError("disk full"))
    with pytest.raises(OSError):
        logger.add_unlogged([{"seq_len": 32, "fwd_ms": 1.0}])
    again = RunState(tmp_path)
    assert (again.run_id, again.step, again.points) == ("run1", 1, 1)


def test_the_points_table_plots_ok_points_time_and_memory_of_the_forward_backward(tmp_path, monkeypatch):
    """plot/fwd_bwd_ms and plot/peak_mem_bytes chart the ok points' forward+backward time and peak: not the
    forward's time, and not what a failed point kept of its measurement (an oom in the backward keeps its
    forward); the table holds every row, lists as JSON."""
    from harness.logger import RunLogger, RunState

    fake_wandb(monkeypatch, [])
    run = FakeRun()
    rows = [{"seq_len": 32, "status": "ok", "fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "peak_mem_bytes": 100, "noisy_passes": []},
            {"seq_len": 64, "status": "ok", "fwd_ms": 4.0, "fwd_bwd_ms": 12.0, "peak_mem_bytes": 400,
             "noisy_passes": ["fwd"]},
            {"seq_len": 128, "status": "oom", "fwd_ms": 16.0, "fwd_bwd_ms": 48.0, "peak_mem_bytes": 1600,
             "noisy_passes": None}]
    RunLogger(run, RunState(tmp_path)).log_points_table(rows)
    ((_, logged),) = run.logged
    assert logged["plot/fwd_bwd_ms"]["data"] == [[32, 3.0], [64, 12.0]]
    assert logged["plot/peak_mem_bytes"]["data"] == [[32, 100], [64, 400]]
    assert set(logged) == {"points", "plot/fwd_bwd_ms", "plot/peak_mem_bytes"}
    assert logged["points"]["data"][1] == [64, "ok", 4.0, 12.0, 400, '["fwd"]']


def test_the_summary_holds_the_fitted_exponents_not_the_theorys(tmp_path, monkeypatch):
    """fit/<name> in the run's summary is the exponent fitted to the measurements (fit.json's "fitted"): the
    theory's would always read as the variant scaling as its analysis says."""
    from harness.logger import RunLogger, RunState

    fake_wandb(monkeypatch, [])
    (tmp_path / "results.jsonl").write_text("")
    run = FakeRun()
    sweep = types.SimpleNamespace(output_dir=tmp_path, fits={"fwd_ms": {"fitted": 1.52, "theory": 2.0},
                                                              "memory": {"fitted": 1.01, "theory": 1.0}})
    RunLogger(run, RunState(tmp_path)).complete(sweep)
    assert run.summary == {"fit/fwd_ms": 1.52, "fit/memory": 1.01}


def test_a_rerun_into_a_directory_resumes_its_wandb_run_by_id(tmp_path, monkeypatch):
    """The first run of a directory starts a wandb run (no id, no resume); the next resumes it: the same id,
    resume="allow" (without it, an online wandb refuses an id it has seen, or a sync overwrites the first
    run's history), its steps and points counted on from the first's."""
    from harness.logger import LoggerConfig, wandb_run

    runs = []
    fake_wandb(monkeypatch, runs)
    cfg = LoggerConfig(mode="offline")
    with wandb_run(cfg, tmp_path, {}) as logger:
        logger.add_unlogged([{"seq_len": 32, "fwd_ms": 1.0}])
    with wandb_run(cfg, tmp_path, {}) as logger:
        assert logger.add_unlogged([{"seq_len": 32, "fwd_ms": 1.0}, {"seq_len": 64, "fwd_ms": 2.0}]) == [64]
    assert [(r.init["id"], r.init["resume"], r.init["mode"]) for r in runs] == [(None, None, "offline"),
                                                                                ("new0", "allow", "offline")]
    assert [r.logged for r in runs] == [[(0, {"seq_len": 32, "fwd_ms": 1.0})], [(1, {"seq_len": 64, "fwd_ms": 2.0})]]
    assert [r.finished for r in runs] == [0, 0]


def test_the_state_of_a_wandb_run_that_logged_nothing_yet_is_resumed_not_damaged(tmp_path):
    """The state saved as a run starts ({"next_step": 0, "points": 0}: interrupted before its first point) is
    as save() writes it: the rerun resumes that wandb run, with no warning and no second, empty run; a
    negative count is what is damaged."""
    from harness.logger import RUN_STATE, RunState

    (tmp_path / RUN_STATE).parent.mkdir()
    (tmp_path / RUN_STATE).write_text(json.dumps({"id": "abc", "next_step": 0, "points": 0}))
    state = RunState(tmp_path)
    assert (state.damaged, state.run_id, state.step, state.points) == (None, "abc", 0, 0)
    (tmp_path / RUN_STATE).write_text(json.dumps({"id": "abc", "next_step": 0, "points": -1}))
    assert RunState(tmp_path).damaged == "holds points=-1"


def test_the_mode_is_logger_mode_then_wandb_mode_then_credentials(monkeypatch):
    """logger.mode wins; else WANDB_MODE, its old name dryrun read as offline (never online: a dry run
    uploads nothing); else online only with credentials; logger=none is disabled whatever is set."""
    from harness.logger import LoggerConfig, resolve_mode

    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", os.devnull)
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert resolve_mode(LoggerConfig()) == "offline"
    assert resolve_mode(LoggerConfig(mode="disabled")) == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode(LoggerConfig()) == "offline"
    monkeypatch.setenv("WANDB_MODE", "shared")  # wandb's, not a mode of the harness: by credentials
    assert resolve_mode(LoggerConfig()) == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    assert resolve_mode(LoggerConfig()) == "offline"
    assert resolve_mode(LoggerConfig(name="none", mode="online")) == "disabled"
