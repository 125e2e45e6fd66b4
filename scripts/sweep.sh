#!/usr/bin/env bash
# scripts/sweep.sh PRESET [hydra overrides ...]
#
# Runs the preset grid conf/sweep/PRESET.yaml as a Hydra multirun (`python -m harness --multirun
# sweep=PRESET ...`), one job per grid point in SWEEP_DIR/<the job's overrides>/.
#   SWEEP_DIR: hydra.sweep.dir=DIR when given (rerunning into the same DIR with the same overrides
#              resumes: measured points are skipped), else multirun/PRESET/<UTC time>/ under the repo.
# Without this script, `python -m harness sweep=PRESET ...` runs the same sweep (no -m needed: the preset
# sets multirun mode) into Hydra's default multirun/DATE/TIME/ under the current directory.
# The exit status is the harness's: 1 when it ran but some job did not complete (refused or failed,
# e.g. linear in a causal sweep; the others still ran and their results stand). Prints the sweep dir before and after, and the report command.
#
# Examples:
#   scripts/sweep.sh cpu_small
#   scripts/sweep.sh cpu_small variant=full,linear 'seq_lens=[256,512]'
#   scripts/sweep.sh seq_len_scaling hydra/launcher=slurm hydra.launcher.partition=gpu
#   scripts/sweep.sh cpu_small hydra.sweep.dir=multirun/cpu_small/2026-11-22T07-20-00Z   # resume
#   scripts/sweep.sh cpu_small variant=full --cfg job   # the config a job starts from: nothing runs
#
# Hydra's flags may come anywhere: the script puts them before the overrides, as Hydra wants. One that
# prints (--cfg, --info, --hydra-help, ...) runs no sweep and makes no directory.
#
# Launchers: basic (default; jobs one after another: timings must not share the machine),
# hydra/launcher=local_parallel (joblib; quality-only sweeps), hydra/launcher=slurm,
# hydra/launcher=submitit_local (parallel local processes). PYTHON=... picks the interpreter.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"

allowed_presets() {
    local names=() f
    for f in "$ROOT"/conf/sweep/*.yaml; do
        [ -e "$f" ] && names+=("$(basename "$f" .yaml)")
    done
    local IFS=,
    echo "${names[*]}" | sed 's/,/, /g'
}

if [ $# -lt 1 ]; then
    echo "sweep.sh: missing PRESET (conf/sweep/PRESET.yaml); allowed: $(allowed_presets); see --help" >&2
    exit 2
fi
if [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 0
fi

PRESET="$1"
shift
if ! [[ "$PRESET" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]] || [ ! -f "$ROOT/conf/sweep/$PRESET.yaml" ]; then
    echo "sweep.sh: unknown preset '$PRESET'; allowed: $(allowed_presets)" >&2
    exit 2
fi

# The sweep dir: the user's hydra.sweep.dir=... (made absolute against the current directory, as
# Hydra would; its last two parts are the jobs' wandb group), else a fresh one under the repo.
# Hydra's flags (--cfg job, -cn NAME, --info ...) go before every override (Hydra reads no override
# after a flag that follows one), with their values: where the user put them does not matter.
SWEEP_DIR=""
USER_SWEEP_DIR=()
PRINTS=""  # a flag that prints (--cfg, --info, ...): the harness runs once to print it, no sweep
args=()
flags=()
while [ $# -gt 0 ]; do
    a="$1"
    shift
    case "$a" in
        -c | --cfg | -p | --package | -cp | --config-path | -cn | --config-name | -cd | --config-dir | --experimental-rerun)
            [ $# -gt 0 ] || { echo "sweep.sh: $a needs a value; see python -m harness --hydra-help" >&2; exit 2; }
            flags+=("$a" "$1")
            shift
            case "$a" in -c | --cfg) PRINTS=1 ;; esac
            ;;
        -i | --info)
            PRINTS=1
            case "${1:-}" in
                all | config | defaults | defaults-tree | plugins | searchpath) flags+=("$a" "$1"); shift ;;
                *) flags+=("$a" all) ;;  # Hydra's default, given: else its parser takes the next override for the value
            esac
            ;;
        -c=* | --cfg=* | -i=* | --info=* | -sc | --shell-completion | -h | --help | --hydra-help | --version)
            PRINTS=1
            flags+=("$a")
            ;;
        -*) flags+=("$a") ;;
        hydra.sweep.dir=* | +hydra.sweep.dir=* | ++hydra.sweep.dir=*)
            USER_SWEEP_DIR=("$a")
            SWEEP_DIR="${a#*hydra.sweep.dir=}"
            [ -n "$SWEEP_DIR" ] || { echo "sweep.sh: empty hydra.sweep.dir=" >&2; exit 2; }
            case "$SWEEP_DIR" in
                /* | '${'*) ;;
                *) SWEEP_DIR="$PWD/$SWEEP_DIR" ;;
            esac
            ;;
        *) args+=("$a") ;;
    esac
done
if [ -z "$SWEEP_DIR" ]; then
    SWEEP_DIR="$ROOT/multirun/$PRESET/$(date -u +%Y-%m-%dT%H-%M-%SZ)"
fi
SWEEP_DIR="${SWEEP_DIR%/}"
if [ -n "$PRINTS" ]; then  # what the sweep's jobs would be given: no job runs, no directory is made
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m harness ${flags[@]+"${flags[@]}"} "sweep=$PRESET" \
        ${args[@]+"${args[@]}"} ${USER_SWEEP_DIR[@]+"${USER_SWEEP_DIR[@]}"}
fi
# Hydra parses the value: a path with spaces or other special characters goes in quotes.
SWEEP_ARG="$SWEEP_DIR"
if [[ "$SWEEP_ARG" != *'${'* && "$SWEEP_ARG" =~ [^A-Za-z0-9_./@%+:-] ]]; then
    SWEEP_ARG="'$(printf '%s' "$SWEEP_ARG" | sed "s/'/\\\\'/g")'"
fi

echo "sweep $PRESET -> $SWEEP_DIR"
rc=0
# The repo on PYTHONPATH: works without `pip install -e .` too. --multirun: every preset sets
# hydra.mode=MULTIRUN itself, so a comma sweep (variant=full,linear) runs with or without the flag;
# it is given so that the run is a multirun whatever the preset says. (Without a preset, a comma sweep
# needs -m: `python -m harness variant=full,linear` alone fails with Hydra's "Ambiguous value".)
# In the background, waited for: a SIGTERM to this script (kill, a scheduler's cancel) is passed on, and
# the harness records its jobs interrupted and ends before this script does, not left running on its
# own; a Ctrl-C at a terminal reaches both (one process group), and the harness is waited for.
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" -m harness --multirun ${flags[@]+"${flags[@]}"} "sweep=$PRESET" ${args[@]+"${args[@]}"} \
    "hydra.sweep.dir=$SWEEP_ARG" &
harness=$!
trap 'kill -TERM "$harness" 2>/dev/null || true' TERM
trap ':' INT
while :; do
    wait "$harness" && rc=0 || rc=$?
    kill -0 "$harness" 2>/dev/null || break  # a signal ended the wait, not the harness: wait again
done
trap - TERM INT

if [[ "$SWEEP_DIR" == *'${'* ]]; then  # an interpolation (${now:...}): Hydra's log above names the dir
    echo "sweep $PRESET -> $SWEEP_DIR, as Hydra resolved it (exit $rc)"
    echo "report: $PYTHON -m harness.report SWEEP_DIR"
elif [ -d "$SWEEP_DIR" ]; then
    # The harness printed "jobs: 5 (completed 4, refused 1)" and exited 1 where a job did not complete
    # (harness/hydra_hooks.py), whatever the launcher.
    echo "sweep $PRESET -> $SWEEP_DIR (exit $rc)"
    echo "report: $PYTHON -m harness.report $(printf "%q" "$SWEEP_DIR")"
else
    echo "sweep $PRESET: no sweep dir was created (exit $rc)"
fi
exit "$rc"
