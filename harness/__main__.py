"""``python -m harness [variant=NAME] [key=value ...]``: a thin ``@hydra.main`` over ``harness.run.run``.

Every key is documented in conf/config.yaml (``python -m harness --help`` prints it). Bad input is one
line on stderr naming the problem and the allowed values, exit code 2, and no results file: the
overrides are composed and validated here (``precheck``) before Hydra starts, because Hydra's own
errors (an unknown config group choice, a key not in the config) are several lines and a hint.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# Flags that take a value as the next argument, and flags after which the config is not ours to check.
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
NO_PRECHECK = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
MULTIRUN = {"--multirun", "-m"}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def split_args(argv: list[str]) -> tuple[list[str], set[str]]:
    overrides, flags = [], set()
    it = iter(argv)
    for arg in it:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            flags.add(flag)
            if flag in VALUE_FLAGS and "=" not in arg:
                next(it, None)
        else:
            overrides.append(arg)
    return overrides, flags


def precheck(argv: list[str]) -> str | None:
    """The one-line problem with the command line, or None. Composes the config as Hydra will and runs
    all of run()'s validation on it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from harness.config import ConfigError, one_line, settings_from_config

    overrides, flags = split_args(argv)
    if flags & NO_PRECHECK:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        return one_line(f"cannot parse the overrides: {e}")
    # What needs only the YAML files comes first: no torch import (2 s) to refuse a misspelt name.
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml"))
              for d in sorted(CONF_DIR.iterdir()) if d.is_dir() and d.name != "hydra"}
    config = OmegaConf.load(CONF_DIR / "config.yaml")
    top_keys = [*groups, *(k for k in config if k not in ("defaults", "hydra"))]
    chosen = next(d["variant"] for d in config.defaults if isinstance(d, Mapping) and "variant" in d)
    for o in parsed:
        if o.key_or_group in groups and o.package is None and not o.is_delete():
            group = o.key_or_group
            values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
            for v in values:
                if v not in groups[group]:
                    return f"unknown {group} {v!r}; allowed: {', '.join(groups[group])}"
            if group == "variant":
                chosen = values[0] if len(values) == 1 else chosen
    # A key that is not in the config, given without "+": Hydra refuses it in several lines and a hint.
    # Say which keys are allowed instead; for a variant option, in the variant's own words.
    variant_yaml = OmegaConf.load(CONF_DIR / "variant" / f"{chosen}.yaml")
    for o in parsed:
        if o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None:
            continue
        head, _, rest = o.key_or_group.partition(".")
        if head.split("/")[0] == "hydra":
            continue  # Hydra's own settings: Hydra checks them
        if head not in top_keys:
            return f"unknown config key {head!r}; allowed: {', '.join(top_keys)}"
        if head == "measure" and rest and rest not in config.measure:
            return f"unknown measure option {rest!r}; allowed: {', '.join(config.measure)}"
        if head == "variant" and rest and rest not in variant_yaml:
            cls = hydra.utils.get_class(variant_yaml._target_)
            fields = list(cls.Options.__dataclass_fields__)
            if rest in fields:
                return (f"{cls.name}: option {rest!r} is not in conf/variant/{chosen}.yaml; "
                        f"set it with +variant.{rest}=VALUE")
            return f"{cls.name}: unknown option {rest!r}; allowed: {', '.join(fields)}"
    if flags & MULTIRUN:
        return None  # sweeps are validated per job, in run()

    job_overrides = [a for a in overrides if not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="harness"):
            cfg = compose(config_name="config", overrides=job_overrides)
        settings_from_config(cfg)  # the workload and measurement options: still no torch import
    except ConfigError as e:
        return str(e)
    except Exception as e:  # Hydra's own composition errors
        return one_line(e)
    # The device, the variant built with its options, causal support: these need torch.
    from variants import VariantError

    from harness.run import validate

    try:
        validate(cfg)
    except (ConfigError, VariantError) as e:
        return one_line(e)
    return None


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from variants import VariantError

    from harness.config import ConfigError, one_line
    from harness.run import run

    try:
        run(cfg)  # into Hydra's output directory (HydraConfig.get().runtime.output_dir)
    except (ConfigError, VariantError) as e:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            fail(one_line(e))
        # One job of a sweep that cannot run (linear in a causal sweep): said in one line and in the
        # job's status.json; the other jobs go on.
        from harness.run import JobStatus

        JobStatus(Path(hc.runtime.output_dir), None).finish("refused", one_line(e))
        print(f"error: job {hc.job.num} ({hc.job.override_dirname}): {one_line(e)}", file=sys.stderr)


def main() -> None:
    problem = precheck(sys.argv[1:])
    if problem is not None:
        fail(problem)
    hydra_main()


if __name__ == "__main__":
    main()
