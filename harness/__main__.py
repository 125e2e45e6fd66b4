"""``python -m harness [variant=NAME] [key=value ...]``: a thin ``@hydra.main`` over ``harness.run.run``.

Every key is documented in conf/config.yaml (``python -m harness --help`` prints it). Bad input is one
line on stderr naming the problem and the allowed values, exit code 2, and no results file: the
overrides are composed and validated here (``precheck``) before Hydra starts, because Hydra's own
errors (an unknown config group choice, a key not in the config) are several lines and a hint.
"""

from __future__ import annotations

import os
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


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def output_dir_problem(path: str | Path) -> str | None:
    """Why results could not be written under ``path`` (one line), or None. Tried for real: a file is
    created and removed in the nearest existing ancestor, since permissions alone do not tell (root
    ignores them; a read-only filesystem refuses everyone)."""
    import tempfile

    path = Path(path).absolute()
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot write results to {path}: {ancestor} is a file, not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".harness-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write results to {path}: {ancestor} is not writable ({e.strerror or e})"
    return None


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
    from omegaconf import OmegaConf, open_dict

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
                chosen = values[0]  # a sweep's variant options are checked against its first variant
            if group == "sweep":  # a preset that sweeps variants: options checked against its first one
                swept = OmegaConf.load(CONF_DIR / "sweep" / f"{values[0]}.yaml").get("hydra", {})
                preset_variants = str(swept.get("sweeper", {}).get("params", {}).get("variant", "") or "")
                if preset_variants and not any(q.key_or_group == "variant" for q in parsed):
                    chosen = preset_variants.split(",")[0].strip()
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
    multirun = bool(flags & MULTIRUN)
    # One job's config (a sweep's first values are not needed: its directory is all we check of it).
    # Hydra's groups stay: hydra.launcher.partition=... exists only with hydra/launcher=slurm.
    single = [a for a, o in zip(overrides, parsed) if not o.is_sweep_override()]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="harness"):
            cfg = compose(config_name="config", overrides=single, return_hydra_config=True)
        hydra_cfg = cfg.hydra
        multirun = multirun or "MULTIRUN" in str(hydra_cfg.get("mode"))  # a sweep preset sets the mode itself
        # Hydra creates the output directory before any of our code runs, with a traceback if it cannot.
        problem = output_dir_problem(hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir)
        if problem is not None:
            return problem
        if multirun:
            return None  # sweeps are validated per job, in run()
        with open_dict(cfg):
            del cfg["hydra"]
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
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from variants import VariantError

    from harness.config import ConfigError, one_line
    from harness.results import JobStatus
    from harness.run import DirectoryInUse, RunFailed, RunInterrupted, run

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # A SLURM job (hydra/launcher=slurm): scancel and the time limit's SIGTERM end the run as on the
        # command line (status interrupted, resumable), not ignored until the SIGKILL as submitit would.
        import signal

        signal.signal(signal.SIGTERM, terminate)
    try:
        run(cfg)  # into Hydra's output directory (HydraConfig.get().runtime.output_dir)
    except RunInterrupted as e:  # the directory's status says interrupted; a sweep stops here too
        print(f"error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except (ConfigError, VariantError, RunFailed) as e:
        if not multirun:
            fail(one_line(e), 1 if isinstance(e, RunFailed) else 2)
        # One job of a sweep that cannot run (linear in a causal sweep) or could not finish: said in one
        # line and in the job's status.json (unless another run holds its directory); the others go on.
        if not isinstance(e, (RunFailed, DirectoryInUse)):
            try:
                JobStatus(Path(hc.runtime.output_dir), None).finish("refused", one_line(e))
            except OSError:
                pass
        print(f"error: job {hc.job.num} ({hc.job.override_dirname}): {one_line(e)}", file=sys.stderr)


def terminate(signum, frame) -> None:
    """SIGTERM (a scheduler's cancel, ``kill``): end the run as Ctrl-C does, with its own exit code."""
    from harness.run import Terminated

    raise Terminated()


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, terminate)
    try:
        problem = precheck(sys.argv[1:])
        if problem is not None:
            fail(problem)
        hydra_main()
    except KeyboardInterrupt as e:  # before or between runs (startup, composing): nothing was measured
        from harness.run import Terminated

        print(f"error: interrupted ({'SIGTERM' if isinstance(e, Terminated) else 'Ctrl-C'}) before a run "
              f"started; nothing was measured", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)


if __name__ == "__main__":
    main()
