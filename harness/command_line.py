"""The command line checked before Hydra starts (Hydra creates the output directory first, and its own
refusals are several lines and a hint): composed as Hydra will compose it and validated once by the
harness's own checks (harness.config, the variant's Options, harness.run.validate). Every refusal is a
ConfigError of one line naming the problem and the allowed values: an unknown config group choice with
the choices there are, and a key not in the config in the words of what owns the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from weakref import WeakKeyDictionary

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
    from omegaconf.errors import OmegaConfBaseException

    from harness.config import HARNESS, ConfigError, check_output_dir, check_results_dir, launched, one_line

    launched()  # torchrun's or SLURM's variables, read by Hydra's callbacks and the run: integers
    args = hydra_args(argv)
    commands = [flag for flag, given in (("--run", args.run), ("--multirun", args.multirun),
                                         ("--cfg", args.cfg is not None), ("--info", args.info is not None),
                                         ("--shell-completion", args.shell_completion)) if given]
    if len(commands) > 1:  # Hydra raises a ValueError: a traceback
        raise ConfigError(f"{' and '.join(commands)} cannot be given together; allowed: one of --run, --multirun "
                          f"(-m), --cfg (-c), --info (-i), --shell-completion (-sc) (one job's config: --cfg job, no -m)")
    if args.resolve and args.cfg is None and not args.help:
        raise ConfigError("--resolve goes with --cfg or --help")
    if args.config_path is not None and "://" not in args.config_path:  # Hydra's: relative to harness/
        config_path = Path(__file__).resolve().parent / args.config_path
        if not config_path.is_dir():
            raise ConfigError(f"--config-path {config_path} is not a directory")
    if args.experimental_rerun is not None and not Path(args.experimental_rerun).is_file():
        raise ConfigError(f"--experimental-rerun {args.experimental_rerun} is not a file (a job's "
                          f".hydra/config.pickle)")
    # --cfg and --info print one job's config: composed and checked here as a run's (else Hydra's lines:
    # "Ambiguous value ...", a parse error's, a missing choice's search path)
    prints = next((f for f, given in (("--cfg", args.cfg), ("--info", args.info)) if given is not None), None)
    if args.help or args.hydra_help or commands not in ([], ["--run"], ["--multirun"], ["--cfg"], ["--info"]) \
            or args.config_path or args.experimental_rerun:
        return  # Hydra's own output (help, --shell-completion), or a config Hydra finds elsewhere
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
            if prints:  # Hydra prints it, for one job
                if swept := sweeping(overrides):
                    raise ConfigError(f"{prints} prints one job's config, and {' '.join(swept)} sweeps over several; "
                                      f"allowed: one value per key with {prints} (e.g. variant=full)")
                return
            multirun = args.multirun or OmegaConf.select(base, "hydra.mode") == RunMode.MULTIRUN
            # Hydra creates the output directory before any of our code runs, with a traceback if it cannot;
            # an empty one (hydra.run.dir=$OUT, OUT unset) would be the current directory.
            key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
            run_dir = OmegaConf.select(base, key)
            if not str(run_dir or "").strip():
                raise ConfigError(f"{key} is empty (an unset variable?); allowed: a directory path "
                                  f"(Hydra would write into the current directory)")
            check_output_dir(run_dir)
            subdir = OmegaConf.select(base, "hydra.output_subdir")  # Hydra writes the job's config there first
            if subdir is not None and str(subdir).strip():
                try:
                    check_output_dir(Path(run_dir) / ("JOB" if multirun else "") / str(subdir))
                except ConfigError as e:
                    raise ConfigError(f"hydra.output_subdir={subdir}: {e}") from None
            output_dir = OmegaConf.select(base, "output_dir")  # results go there instead (harness.config refuses '')
            if isinstance(output_dir, str) and output_dir.strip():
                check_output_dir(output_dir)
            if not multirun:  # a run's env.json and status.json would replace another command's (bench_gpu's)
                check_results_dir(output_dir if isinstance(output_dir, str) and output_dir.strip() else run_dir,
                                  HARNESS, ("env.json", "status.json"))
            if multirun:
                check_launcher(OmegaConf.select(base, "hydra.launcher") or {})
                params = OmegaConf.select(base, "hydra.sweeper.params") or {}
                if not (groups := sweep_groups(params, overrides)):  # Hydra launches 0 jobs and exits 0
                    raise ConfigError(no_job(params, overrides))
                distinct = {}  # the variants and tasks of the sweep's jobs: each built and checked once
                for group in groups:
                    cfg = compose_job(name, group[0], [group[0]])
                    for job in group:  # the values of every job: a bad one is refused before any job runs
                        s = check_values(job_config(cfg, group[0], job) or compose_job(name, job, [job]))
                        distinct.setdefault(repr((s.variant, s.task, s.seq_lens if s.task else ())), s)
                for s in distinct.values():  # torch only once every job's values passed
                    variant_and_task_checks(s)
                return
            # One job's config is the base unless a value sweeps (a sweep without -m: Hydra's "ambiguous
            # value" in RUN mode); composing again would cost a quarter of a second for the same config.
            cfg = compose_job(name, overrides, [overrides]) if sweeping(overrides) else base
        # An override that does not parse, a sweep Hydra's sweeper cannot expand; an interpolation of Hydra's
        # own settings that does not resolve (hydra.run.dir=${oc.env:UNSET}), read here before Hydra does
        except (HydraException, OmegaConfBaseException) as e:
            raise ConfigError(one_line(e)) from None
    with open_dict(cfg):
        del cfg["hydra"]
    harness_checks(cfg, whole=True)


# The launchers' numbers (joblib's, submitit's and the SLURM launcher's) that a bad value turned into a
# traceback once the jobs were launched, after the sweep directory was written: key -> (integer, least, what).
LAUNCHER_NUMBERS = {"timeout_min": (False, 0, "a number of minutes > 0"), "mem_gb": (False, 0, "a number of GB > 0"),
                    "signal_delay_s": (True, 0, "an integer of seconds >= 0"), "gpus_per_node": (True, 0, "an integer >= 0"),
                    **{k: (True, 1, "an integer >= 1") for k in ("nodes", "tasks_per_node", "cpus_per_task",
                                                                  "array_parallelism")}}


def check_launcher(launcher) -> None:
    """hydra.launcher's numbers, before the sweep's directory is written: joblib's n_jobs (0 raised in
    joblib's Parallel), submitit's and SLURM's sizes and time limit (timeout_min=-1 failed every job)."""
    import math

    from harness.config import ConfigError, _is_int, _is_number

    n_jobs = launcher.get("n_jobs")
    if n_jobs is not None and (not _is_int(n_jobs) or n_jobs == 0):
        raise ConfigError(f"hydra.launcher.n_jobs must be an integer other than 0 (worker processes; -1: one "
                          f"per core); got {n_jobs!r}")
    for key, (integer, least, allowed) in LAUNCHER_NUMBERS.items():
        value = launcher.get(key)
        if value is None:
            continue
        ok = (_is_int(value) and value >= least) if integer else \
            (_is_number(value) and math.isfinite(value) and value > least)
        if not ok:
            raise ConfigError(f"hydra.launcher.{key} must be {allowed}, or null; got {value!r}")


def hydra_args(argv: list[str]):
    """The command line as hydra.main reads it (Hydra's own parser: its flags are not listed again here);
    a misused flag is one line."""
    from hydra._internal.utils import get_args_parser

    from harness.config import ConfigError

    def error(message: str) -> None:
        raise ConfigError(f"{message}; see python -m harness --hydra-help")

    parser = get_args_parser()
    parser.error = error
    args, extra = parser.parse_known_args(argv)
    if extra and not any(e.startswith("-") for e in extra):  # argparse's "unrecognized arguments: seq_len=32"
        raise ConfigError(f"overrides after a flag that follows other overrides: {' '.join(extra)}; allowed: Hydra's "
                          f"flags (-m, --cfg, ...) before every override, e.g. python -m harness -m seq_len=32 "
                          f"variant=full,linear")
    if extra:
        error(f"unrecognized arguments: {' '.join(extra)}")
    return args


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
        if str(e).startswith("Cannot find primary config"):  # --config-name nope: which there are
            names = [n for n in GlobalHydra.instance().config_loader().get_group_options("") if not n.startswith("_")]
            one_of("--config-name", name, tuple(names))
        raise ConfigError(one_line(str(e).split("\n\n")[0])) from None  # not the search path it lists
    except HydraException as e:
        for job in jobs:
            judge_keys(name, job)
        # e.g. an option of the variant not in its YAML (use +); a value of Hydra's own typed settings
        # ("Error merging override hydra.launcher.n_jobs=abc"), said with its cause's first line: why
        cause = str(e.__cause__ or "").strip().split("\n")[0]
        why = cause and str(e).startswith("Error merging override")
        raise ConfigError(one_line(f"{e}: {cause}" if why else e)) from None
    except ValueError as e:  # a config group's choice that is no name (variant=5: Hydra's parser made it an int)
        loader = GlobalHydra.instance().config_loader()
        for job in jobs:
            for key, _, value in (o.partition("=") for o in job):
                name_like = re.fullmatch(r"[A-Za-z_][\w.-]*", value) and value.lower() not in ("true", "false", "null")
                if is_group(key) and not name_like:
                    one_of(key, value, tuple(loader.get_group_options(key)))
        raise ConfigError(one_line(e)) from None
    except (AssertionError, AttributeError):  # OmegaConf updating a null node: tracebacks
        # hydra.sweeper.params is null unless a sweep preset sets it: a key of it set from the command line
        # (hydra.sweeper.params.variant=full,linear) failed inside Hydra's composition
        touched = [o for o in overrides if key_of(o).lstrip("+~").startswith("hydra.sweeper.params")]
        if not touched:
            raise
        presets = ", ".join(sorted(GlobalHydra.instance().config_loader().get_group_options("sweep")))
        raise ConfigError(f"{touched[0]}: hydra.sweeper.params is null without a sweep preset, so it has no key "
                          f"to set; allowed: the values to sweep given as overrides (-m variant=full,linear), or a "
                          f"preset first (sweep=NAME: {presets})") from None


def judge_keys(name: str, job: list[str]) -> None:
    """Hydra refuses a key not in the config (given without "+") as a struct error and a hint. The job is
    composed again with such keys force-added (``++key=value``) so that what owns them judges them:
    harness.config for the config's keys, the variant's Options for ``variant.*``. Returns when they
    find nothing wrong (Hydra's own message then stands). The task's keys (``task.*``) are judged by its
    MQARConfig, which names the allowed ones."""
    from hydra import compose
    from hydra.errors import HydraException

    def plain(override: str) -> bool:  # key=value: not a group choice, an add or delete, or Hydra's own
        key = key_of(override)
        return not (key[:1] in "+~" or "@" in key or is_group(key) or key.startswith("hydra."))

    try:
        cfg = compose(config_name=name, overrides=[f"++{o}" if plain(o) else o for o in job])
    except (HydraException, AssertionError, AttributeError):  # the last two: a key of a null hydra.sweeper.params
        return
    harness_checks(cfg, whole=False)


def harness_checks(cfg: DictConfig, whole: bool) -> None:
    """harness.config's checks (no torch import: a misspelt key is refused in a fraction of a second), then
    the variant built with its options and the task's options checked at each length; ``whole``: all of
    run()'s validation (device, causal support, backend, task, memory budget). A VariantError becomes a
    ConfigError: one kind of bad input here."""
    from harness.config import ConfigError, settings_from_config

    settings = settings_from_config(cfg)
    if not whole:
        return variant_and_task_checks(settings)
    from variants import VariantError

    from harness.run import validate

    try:
        validate(cfg)
    except VariantError as e:
        raise ConfigError(str(e)) from None


def variant_and_task_checks(settings) -> None:
    """The variant built with its options, and the task's options checked at each length (imports torch)."""
    from variants import VariantError

    from harness.config import ConfigError
    from harness.quality import check_task
    from harness.run import build_variant

    try:
        attn = build_variant(settings.variant)
        if settings.task is not None:
            check_task(attn, settings)
    except VariantError as e:
        raise ConfigError(str(e)) from None


def sweep_jobs(params, overrides: list[str]) -> list[list[str]]:
    """The override lists of a sweep's jobs as Hydra's basic sweeper makes them (``params``: a preset's
    hydra.sweeper.params, which the command line's overrides replace), one per combination of config
    group choices."""
    return [group[0] for group in sweep_groups(params, overrides)]


def sweep_groups(params, overrides: list[str]) -> list[list[list[str]]]:
    """Every job's override list (as sweep_jobs), grouped by combination of config group choices: the
    jobs of a group differ only in values."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(
        [f"{k}={v}" for k, v in params.items()] + overrides)
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for job in BasicSweeper.split_arguments(parsed, None)[0]:
        groups.setdefault(tuple(o if is_group(key_of(o)) else key_of(o) for o in job), []).append(job)
    return list(groups.values())


def no_job(params, overrides: list[str]) -> str:
    """Why a sweep has no job: the overrides whose values are none (glob(nope*), range(0)), each with
    what it could select."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    empty = [o for o in [f"{k}={v}" for k, v in params.items()] + overrides if not sweep_groups({}, [o])]
    allowed = "; ".join(f"allowed for {key_of(o)}: {', '.join(sorted(loader.get_group_options(key_of(o))))}"
                        if is_group(key_of(o)) else f"allowed for {key_of(o)}: at least one value" for o in empty)
    return f"the sweep has no job: {', '.join(empty)} {'selects' if len(empty) == 1 else 'select'} no value; {allowed}"


def sweeping(overrides: list[str]) -> list[str]:
    """The overrides that sweep (a,b or a sweep function: one value per job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]


def job_config(cfg: DictConfig, composed_from: list[str], job: list[str]) -> DictConfig | None:
    """The config of ``job``, a job of the same group combination as ``composed_from`` (whose composed
    config ``cfg`` is): the overrides in which they differ (values: a sweep's) applied to a copy as Hydra
    applies them (composing each job anew would take ~0.1 s a job). One Hydra cannot apply is refused as
    Hydra would refuse it. None where they differ in a mapping or a deletion (merged or deleted on top of
    ``composed_from``'s, not the same): compose that job."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    changed = [o for o, c in zip(job, composed_from) if o != c]
    parsed = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader()).parse_overrides(changed)
    if any(o.is_delete() or isinstance(o.value(), dict) for o in parsed):
        return None
    for o in parsed:
        if o.type == OverrideType.ADD:  # +key=a,b: the key is there already, added by composed_from's value
            o.type = OverrideType.FORCE_ADD
    cfg = cfg.copy()
    ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
    return cfg


def check_values(cfg: DictConfig):
    """harness.config's checks of one job's config (no torch: cheap for every job of a sweep); its
    Settings."""
    from omegaconf import open_dict

    from harness.config import settings_from_config

    with open_dict(cfg):
        del cfg["hydra"]
    return settings_from_config(cfg)


def key_of(override: str) -> str:
    return override.split("=", 1)[0].strip()


_GROUPS: WeakKeyDictionary = WeakKeyDictionary()  # each config loader's top-level groups


def is_group(key: str) -> bool:
    """``key`` names a config group (variant, hydra/launcher), whose value is a choice of config file."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    if loader not in _GROUPS:  # listing them reads the config search path: once per Hydra, not per override
        _GROUPS[loader] = frozenset(loader.list_groups(""))
    return "/" in key or key in _GROUPS[loader]
