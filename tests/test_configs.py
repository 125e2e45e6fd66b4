"""Every config group choice composes and validates: task/, logger/, sweep/ and hydra/launcher/, as
conf/variant/ is in test_variants.py. A preset's own grid (its sweeper params) is composed job by job."""

from __future__ import annotations

import itertools

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_class

from harness.config import settings_from_config
from harness.run import validate

from .conftest import CONF


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


@pytest.mark.parametrize("group", ["task", "logger"])
def test_every_task_and_logger_choice_validates(hydra_conf, group):
    for choice in choices(group):
        settings = settings_from_config(compose(config_name="config", overrides=[f"{group}={choice}"]))
        assert (settings.task is None) == (choice == "none") if group == "task" else settings.logger is not None


@pytest.mark.parametrize("preset", choices("sweep"))
def test_every_sweep_preset_job_validates(hydra_conf, preset):
    """Each job of the preset's grid (sweeper params) composes and passes the harness's checks (the
    variant built with its options); the
    device is set to cpu so that a GPU preset validates here too."""
    cfg = compose(config_name="config", overrides=[f"sweep={preset}"], return_hydra_config=True)
    params = {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}
    assert params, preset
    for values in itertools.product(*params.values()):
        overrides = [f"sweep={preset}", *(f"{k}={v}" for k, v in zip(params, values)), "device=cpu"]
        settings, attn, _ = validate(compose(config_name="config", overrides=overrides))  # builds the variant too
        assert settings.seq_lens and attn.name, overrides


@pytest.mark.parametrize("launcher", choices("hydra/launcher"))
def test_every_launcher_choice_composes_to_a_launcher_class(hydra_conf, launcher):
    cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    cls = get_class(cfg.hydra.launcher._target_)
    assert cls.__name__.endswith("Launcher"), cls
