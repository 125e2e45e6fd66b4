#!/usr/bin/env python
"""A wandb report for one sweep: time, memory and fidelity against seq_len, one line per variant.

    python scripts/wandb_dashboard.py SWEEP_GROUP [--project P] [--entity E] [--title T]
                                      [--group-by KEY ...] [--dry-run]

SWEEP_GROUP is the wandb group of the sweep's runs: ``logger.group`` when it was set, else the last two
parts of the sweep directory (harness.logger.sweep_group_name: multirun/cpu_small/2026-11-22T07-24-36Z ->
cpu_small/2026-11-22T07-24-36Z). Passing the sweep directory itself works too: the group is read from
its jobs' .hydra/ files.

The report has three panel grids over the group's runs, each a line plot against ``seq_len`` (the
x-axis the harness declares with define_metric), log x:
  time      fwd_ms, bwd_ms, fwd_bwd_ms (log y)
  memory    peak_mem_bytes (log y)
  fidelity  out_rel_err (log y), mass_kept, task_accuracy
One line per ``config.variant_label`` (the variant as configured: name, every option, backend, e.g.
``sliding_window[dilation=1,global_tokens=0,window=128]/blocksparse``): the mean over its runs (several
seeds or shapes of one configuration), with a min-max band. ``--group-by config.variant_name`` draws one
line per variant instead, averaging its options together.
It prints the report's URL. --dry-run builds the report and prints an outline of it (JSON: grids, run
filter, grouping, panels) without credentials or network.

Needs wandb credentials (WANDB_API_KEY, or `wandb login`, which writes ~/.netrc) and the
wandb-workspaces package (`pip install wandb-workspaces`). Without either it says so in one line and
exits 1. The offline dashboard is report.html from `python -m harness.report SWEEP_DIR`.
Project and entity default to $WANDB_PROJECT / $WANDB_ENTITY, else conf/logger/wandb.yaml's, else
attention-harness and your default entity.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROG = "wandb_dashboard"
INSTALL = "pip install 'wandb-workspaces>=0.4.13'"
NO_CREDENTIALS = (f"{PROG}: no wandb credentials (WANDB_API_KEY or `wandb login`); report.html from "
                  "`python -m harness.report DIR` is the offline dashboard")
DEFAULT_PROJECT = "attention-harness"
DEFAULT_GROUP_BY = "config.variant_label"

# (section, [(metric, title, log_x, log_y)])
SECTIONS = (
    ("Time", [("fwd_ms", "forward (ms)", True, True),
              ("bwd_ms", "backward (ms)", True, True),
              ("fwd_bwd_ms", "forward+backward (ms)", True, True)]),
    ("Memory", [("peak_mem_bytes", "peak memory, forward+backward (bytes)", True, True)]),
    ("Fidelity", [("out_rel_err", "output relative error vs exact", True, True),
                  ("mass_kept", "attention mass kept", True, False),
                  ("task_accuracy", "task accuracy (MQAR)", True, False)]),
)


class Failure(Exception):
    """A problem said in one line; exit 1."""


def logger_defaults() -> dict[str, Any]:
    """project and entity from conf/logger/wandb.yaml (what the harness logs to), when readable."""
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(ROOT / "conf" / "logger" / "wandb.yaml")
        return {k: cfg.get(k) for k in ("project", "entity")}
    except Exception:  # noqa: BLE001  (defaults only)
        return {}


def jobs_from_dir(sweep_dir: Path) -> dict[str, str]:
    """Where the jobs under sweep_dir logged: their group (logger.group when set, else the sweep's group
    name, harness.logger.sweep_group_name, as harness.run gives it) and the project and entity they set."""
    from omegaconf import OmegaConf

    from harness.logger import jobs_logger, sweep_group_name

    configs = sorted(sweep_dir.glob("*/.hydra/config.yaml"))
    if not configs:
        raise Failure(f"{sweep_dir}: no sweep jobs (*/.hydra/config.yaml) here; pass the wandb group name")
    if all((OmegaConf.load(c).get("logger") or {}).get("name", "wandb") != "wandb" for c in configs):
        raise Failure(f"{sweep_dir}: its jobs ran without wandb (logger=none); nothing to chart")
    try:
        jobs = jobs_logger(sweep_dir)
    except ValueError as e:
        raise Failure(f"{sweep_dir}: {e}") from None
    return {**jobs, "group": jobs.get("group") or sweep_group_name(sweep_dir)}


def literal(text: str) -> str:
    """A Python string literal for a wandb-workspaces filter expression. The library rewrites '=' to '=='
    and '<' to '<=' throughout the expression text before parsing it, string values included (0.4.13),
    and its FilterExpr objects do not escape quotes; escapes inside the literal survive both."""
    return repr(text).replace("=", "\\x3d").replace("<", "\\x3c").replace(">", "\\x3e")


def build_report(wr: Any, expr: Any, *, group: str, entity: str, project: str, title: str,
                 group_by: list[str]) -> Any:
    def runset() -> Any:
        return wr.Runset(entity=entity, project=project, name="sweep", filters=f"Group == {literal(group)}",
                         groupby=list(group_by))

    panel_group = group_by[0] if len(group_by) == 1 else None
    blocks: list[Any] = [
        wr.P(f"Runs of wandb group {group} in {entity}/{project}, one line per "
             f"{' / '.join(group_by)} (mean over its runs, band min-max), against seq_len. "
             "Points that did not run (oom, skipped, error) are absent; the offline report with the "
             "reasons is report.html from python -m harness.report SWEEP_DIR."),
    ]
    for section, panels in SECTIONS:
        plots = []
        for i, (metric, name, log_x, log_y) in enumerate(panels):
            plots.append(wr.LinePlot(
                title=f"{name} vs seq_len", x="seq_len", y=[metric], log_x=log_x, log_y=log_y,
                title_x="seq_len", title_y=name, groupby=panel_group, groupby_aggfunc="mean",
                groupby_rangefunc="minmax", legend_position="south",
                layout=wr.Layout(x=8 * (i % 3), y=6 * (i // 3), w=8, h=6)))
        blocks += [wr.H2(section), wr.PanelGrid(runsets=[runset()], panels=plots)]
    return wr.Report(entity=entity, project=project, title=title[:128], width="fluid",
                     description=f"attention-harness sweep {group}: time, memory and fidelity against "
                                 "seq_len by variant",
                     blocks=blocks)


def outline(report: Any, expr: Any) -> dict[str, Any]:
    """What the report holds, built offline (saving it resolves the project over the network): blocks,
    each grid's run filter and grouping (also as the backend keys wandb stores), each panel's axes."""
    blocks = []
    for b in report.blocks:
        if type(b).__name__ != "PanelGrid":
            blocks.append({"block": type(b).__name__, "text": str(getattr(b, "text", ""))[:200]})
            continue
        runsets = [{"filters": str(r.filters), "groupby": list(r.groupby),
                    "groupby_keys": [expr.groupby_str_to_key(g).name for g in r.groupby]} for r in b.runsets]
        panels = [{"panel": type(p).__name__, "title": p.title, "x": p.x, "y": list(p.y), "log_x": p.log_x,
                   "log_y": p.log_y, "groupby": p.groupby, "groupby_aggfunc": p.groupby_aggfunc,
                   "groupby_rangefunc": p.groupby_rangefunc} for p in b.panels]
        blocks.append({"block": "PanelGrid", "runsets": runsets, "panels": panels})
    return {"title": report.title, "entity": report.entity, "project": report.project,
            "description": report.description, "blocks": blocks}


def parse_args(argv: list[str]) -> argparse.Namespace:
    from harness.config import one_line_errors

    p = one_line_errors(argparse.ArgumentParser(prog="scripts/wandb_dashboard.py", description=__doc__.split("\n\n")[0],
                                                formatter_class=argparse.RawDescriptionHelpFormatter), PROG)
    p.add_argument("group", metavar="SWEEP_GROUP",
                   help="the sweep's wandb group (or its sweep directory, to read the group from)")
    p.add_argument("--project", help="wandb project (default: the jobs' logger.project where SWEEP_GROUP is their "
                                     "directory, else $WANDB_PROJECT, conf/logger/wandb.yaml)")
    p.add_argument("--entity", help="wandb entity (default: the jobs' logger.entity where SWEEP_GROUP is their "
                                    "directory, else $WANDB_ENTITY, conf/logger/wandb.yaml, your default entity)")
    p.add_argument("--title", help="report title (default: 'attention sweep <group's last part>')")
    p.add_argument("--group-by", action="append", metavar="KEY",
                   help=f"run key to draw one line per value of, repeatable (default {DEFAULT_GROUP_BY}; "
                        "e.g. config.variant_name: one line per variant, options averaged)")
    p.add_argument("--dry-run", action="store_true",
                   help="print an outline of the report (JSON) instead of saving it; no credentials "
                        "or network needed")
    args = p.parse_args(argv)
    if not args.group.strip():  # "" is a directory (the current one), and no group's name
        p.error("SWEEP_GROUP is empty; allowed: the sweep's wandb group or its sweep directory")
    if any(not key.strip() for key in args.group_by or []):
        p.error("--group-by is empty; allowed: a run key, e.g. variant_label or config.variant_name")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from harness.logger import has_credentials

    if not args.dry_run and not has_credentials():
        print(NO_CREDENTIALS, file=sys.stderr)
        return 1
    try:
        import wandb_workspaces.reports.v2 as wr
        from wandb_workspaces import expr
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "wandb_workspaces":
            raise Failure(f"cannot import wandb-workspaces: {e}") from None
        raise Failure(f"needs the wandb-workspaces package: {INSTALL}") from None

    group, jobs = args.group, {}
    if Path(group).is_dir():  # the jobs' own project and entity come before the defaults
        jobs = jobs_from_dir(Path(group))
        group = jobs["group"]
    defaults = logger_defaults()
    project = (args.project or jobs.get("project") or os.environ.get("WANDB_PROJECT") or defaults.get("project")
               or DEFAULT_PROJECT)
    entity = args.entity or jobs.get("entity") or os.environ.get("WANDB_ENTITY") or defaults.get("entity")
    title = args.title or f"attention sweep {Path(group.rstrip('/')).name or group}"
    group_by = args.group_by or [DEFAULT_GROUP_BY]

    if args.dry_run:
        report = build_report(wr, expr, group=group, entity=entity or "ENTITY", project=project,
                              title=title, group_by=group_by)
        print(json.dumps(outline(report, expr), indent=1))
        return 0

    import wandb

    api = wandb.Api()
    entity = entity or api.default_entity
    if not entity:
        raise Failure("no wandb entity: pass --entity E or set WANDB_ENTITY")
    try:
        n_runs = len(api.runs(f"{entity}/{project}", filters={"group": group}))
    except Exception:  # noqa: BLE001  (a project that does not exist yet: no runs)
        n_runs = 0
    if n_runs == 0:
        print(f"{PROG}: warning: no runs in group {group!r} of {entity}/{project} yet; the report "
              "shows them as they arrive", file=sys.stderr)
    report = build_report(wr, expr, group=group, entity=entity, project=project, title=title,
                          group_by=group_by)
    report.save()
    print(f"{PROG}: report for group {group!r} ({n_runs} runs): {report.url}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001  (network, permissions, API: one line, no traceback)
        message = " ".join(str(e).split())[:300]
        print(f"{PROG}: error: {type(e).__name__}: {message}", file=sys.stderr)
        sys.exit(1)
