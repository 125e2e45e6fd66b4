"""The command line checked before Hydra starts (Hydra creates the output directory first, and its own
refusals are several lines and a hint): composed as Hydra will compose it and validated once by the
harness's own checks (harness.config, the variant's Options, harness.run.validate). Every refusal is a
ConfigError of one line naming the problem and the allowed values: an unknown config group choice with
the choices there are, and a key not in the config in the words of what owns the key.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def check(argv: list[str]) -> None:
    """Raises ConfigError (one line) when the command line cannot run. A run: its config composed and
    validated as run() will (harness.run.validate). A sweep: its directory, and every job composed as
    Hydra's sweeper will compose it, one per combination of config group choices (jobs differing only in
    values compose alike); what one job cannot run (linear in a causal sweep) is that job's "refused"."""
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    from harness.config import ConfigError, check_output_dir, one_line

    args = hydra_args(argv)
    commands = [flag for flag, given in (("--run", args.run), ("--multirun", args.multirun),
                                         ("--cfg", args.cfg is not None), ("--info", args.info is not None),
                                         ("--shell-completion", args.shell_completion)) if given]
    if len(commands) > 1:  # Hydra raises a ValueError: a traceback
        raise ConfigError(f"{' and '.join(commands)} cannot be given together; allowed: one of --run, --multirun "
                          f"(-m), --cfg (-c), --info (-i), --shell-completion (-sc) (one job's config: --cfg job, no -m)")
    if args.resolve and args.cfg is None and not args.help:
        raise ConfigError("--resolve goes with --cfg or --help")
    if args.help or args.hydra_help or commands not in ([], ["--run"], ["--multirun"]) or args.config_path \
            or args.experimental_rerun:
        return  # Hydra's own output (help, --cfg, --info), or a config Hydra finds elsewhere
    overrides = list(args.overrides)
    if args.config_dir is not None:  # Hydra adds it to the config search path, after conf/
        config_dir = Path(args.config_dir).absolute()
        if not config_dir.is_dir():
            raise ConfigError(f"--config-dir {config_dir} is not a directory")
        quoted = str(config_dir).replace("\\", "\\\\").replace("'", "\\'")
        overrides.append(f"hydra.searchpath=['file://{quoted}']")
    name = args.config_name or "config"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="harness"):
        try:
            # The config without its sweeps, as Hydra composes it to find the mode (a sweep preset sets it).
            base = compose_job(name, overrides, sweep_jobs({}, overrides), RunMode.MULTIRUN)
            multirun = args.multirun or OmegaConf.select(base, "hydra.mode") == RunMode.MULTIRUN
            # Hydra creates the output directory before any of our code runs, with a traceback if it cannot.
            check_output_dir(base.hydra.sweep.dir if multirun else base.hydra.run.dir)
            if multirun:
                for job in sweep_jobs(OmegaConf.select(base, "hydra.sweeper.params") or {}, overrides):
                    compose_job(name, job, [job])
                return
            cfg = compose_job(name, overrides, [overrides])  # a sweep without -m: Hydra's "ambiguous value"
        except HydraException as e:  # an override that does not parse, a sweep Hydra's sweeper cannot expand
            raise ConfigError(one_line(e)) from None
    with open_dict(cfg):
        del cfg["hydra"]
    harness_checks(cfg, whole=True)


def hydra_args(argv: list[str]):
    """The command line as hydra.main reads it (Hydra's own parser: its flags are not listed again here);
    a misused flag is one line."""
    from hydra._internal.utils import get_args_parser

    from harness.config import ConfigError

    def error(message: str) -> None:
        raise ConfigError(f"{message}; see python -m harness --hydra-help")

    parser = get_args_parser()
    parser.error = error
    return parser.parse_args(argv)


def compose_job(name: str, overrides: list[str], jobs: list[list[str]], mode=None) -> DictConfig:
    """The config Hydra composes from ``overrides`` (``mode`` MULTIRUN: a sweep's, its sweeps left out),
    or its refusal in one line. ``jobs``: the override lists of the jobs this config stands for; when
    Hydra refuses a key, theirs are judged (judge_keys)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from hydra.types import RunMode

    from harness.config import ConfigError, one_line, one_of

    try:
        return GlobalHydra.instance().hydra.compose_config(name, overrides, run_mode=mode or RunMode.RUN)
    except MissingConfigException as e:
        if e.options is not None and e.missing_cfg_file:  # a config group choice: variant=nope
            group, _, choice = e.missing_cfg_file.rpartition("/")
            one_of(group, choice, tuple(e.options))
        raise ConfigError(one_line(str(e).split("\n\n")[0])) from None  # not the search path it lists
    except HydraException as e:
        for job in jobs:
            judge_keys(name, job)
        raise ConfigError(one_line(e)) from None  # e.g. an option of the variant not in its YAML: use +


def judge_keys(name: str, job: list[str]) -> None:
    """Hydra refuses a key not in the config (given without "+") as a struct error and a hint. The job is
    composed again with such keys force-added (``++key=value``) so that what owns them judges them:
    harness.config for the config's keys, the variant's Options for ``variant.*``. Returns when they
    find nothing wrong (Hydra's own message then stands)."""
    from hydra import compose
    from hydra.errors import HydraException

    def plain(override: str) -> bool:  # key=value: not a group choice, an add or delete, or Hydra's own
        key = key_of(override)
        return not (key[:1] in "+~" or "@" in key or is_group(key) or key.startswith("hydra."))

    try:
        cfg = compose(config_name=name, overrides=[f"++{o}" if plain(o) else o for o in job])
    except HydraException:
        return
    harness_checks(cfg, whole=False)


def harness_checks(cfg: DictConfig, whole: bool) -> None:
    """harness.config's checks (no torch import: a misspelt key is refused in a fraction of a second), then
    the variant built with its options; ``whole``: all of run()'s validation (device, causal support,
    backend, task, memory budget). A VariantError becomes a ConfigError: one kind of bad input here."""
    from harness.config import ConfigError, settings_from_config

    settings = settings_from_config(cfg)
    from variants import VariantError

    from harness.run import build_variant, validate

    try:
        validate(cfg) if whole else build_variant(settings.variant)
    except VariantError as e:
        raise ConfigError(str(e)) from None


def sweep_jobs(params, overrides: list[str]) -> list[list[str]]:
    """The override lists of a sweep's jobs as Hydra's basic sweeper makes them (``params``: a preset's
    hydra.sweeper.params, which the command line's overrides replace), one per combination of config
    group choices."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(
        [f"{k}={v}" for k, v in params.items()] + overrides)
    jobs: dict[tuple[str, ...], list[str]] = {}
    for job in BasicSweeper.split_arguments(parsed, None)[0]:
        jobs.setdefault(tuple(o if is_group(key_of(o)) else key_of(o) for o in job), job)
    return list(jobs.values())


def key_of(override: str) -> str:
    return override.split("=", 1)[0].strip()


def is_group(key: str) -> bool:
    """``key`` names a config group (variant, hydra/launcher), whose value is a choice of config file."""
    from hydra.core.global_hydra import GlobalHydra

    return "/" in key or key in GlobalHydra.instance().config_loader().list_groups("")
