#!/usr/bin/env bash
# The GPU benchmark as one command, on a CUDA machine, from the repository root:
#
#   bash scripts/gpu_job.sh
#
# 1. On an offline GPU node (no package index), bring wheels: run scripts/fetch_wheels.sh where PyPI
#    is reachable and copy wheels/ with the repository; they are installed here with --no-index into
#    /tmp/site (put on PYTHONPATH; the node's own torch, CUDA and triton are used as they are).
# 2. Prints nvidia-smi and the versions of torch, CUDA, triton, xformers, hydra and wandb.
# 3. Runs the GPU tests (`pytest -m gpu`: every GPU backend against the float64 reference; -n 8 --dist load where
#    pytest-xdist is installed) within what the call has left but 200 s (at most 300 s). Each outcome goes
#    to <results>/tests-gpu.jsonl as it is known, with the code it tested; the next call runs only the
#    tests it lacks, or every one again where they tested other code (the earlier outcomes kept beside).
# 4. Runs scripts/bench_gpu.py --out <results> within what is left of JOB_BUDGET_S (default 480 s): the
#    targets' measurements first; the sweeps stop at the budget and resume on the next call; measured
#    points are never measured again.
# 5. Copies a few files into OUT (default /tmp/gpu_job_out) to take home, after the tests, every PACK_EVERY_S
#    (default 60) seconds of the benchmark and on any exit (the end, a failure, a signal; a call killed
#    outright leaves the last copy): results.tar.gz (the results directory, with repository-relative
#    paths: `tar -xzf results.tar.gz` at the repository root), SUMMARY.md, tests-gpu.log, job.log.
# Run the same command again (with the extracted results in place) until its last line says
# "complete". On an H100 the GPU tests and the first steps (roof, c-targets, a-targets) took about ten
# minutes; the whole benchmark takes several calls of ten minutes.
#
# Environment: BENCH_DIR (default: the latest results/gpu/<UTC date>-<device> without a COMPLETE or CLOSED
# file, else a new one; one that an earlier call measured on another device is refused), JOB_BUDGET_S
# (keep it 100 s under any hard limit on the call), OUT, PYTHON, PACK_EVERY_S, RERUN_TESTS=1 (once every
# GPU test has run: all of them again), TEST_WORKERS (8, at most one per core), SKIP_TESTS=1,
# SKIP_WHEELS=1, BENCH_ARGS (more bench_gpu.py arguments), HARNESS_CODE_VERSION (the commit every row
# records as code_version, over any copied .git, which may be older than the tree: `git rev-parse
# --short=12 HEAD` where it was copied from).
# A dry run on a CPU machine (tiny sizes; what needs CUDA is recorded skipped):
#   OUT=/tmp/o BENCH_DIR=/tmp/b SKIP_WHEELS=1 SKIP_TESTS=1 BENCH_ARGS=--smoke bash scripts/gpu_job.sh
# Arguments: none (settings go in the environment); -h or --help prints this and exits.
set -uo pipefail
for arg in "$@"; do
    case "$arg" in
        -h|--help) sed -n '2,/^set -uo pipefail/{/^set -uo pipefail/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "gpu_job.sh: unknown argument '$arg'; allowed: -h, --help (settings go in the environment:" \
                "JOB_BUDGET_S, OUT, BENCH_DIR, ...; see --help)" >&2
           exit 2 ;;
    esac
done
# The numbers the job computes with, checked before anything is written: bash's arithmetic takes "abc"
# as 0 and stops at "2)" with errors of its own, and the job went on (and said it ended well).
for setting in JOB_BUDGET_S PACK_EVERY_S TEST_WORKERS; do
    value=${!setting:-}  # unset or empty: the default
    [ -z "$value" ] || [[ $value =~ ^[1-9][0-9]{0,8}$ ]] && continue
    allowed="a whole number of seconds from 1 to 999999999"
    if [ "$setting" = TEST_WORKERS ]; then
        [[ $value = auto || $value = logical ]] && continue  # pytest-xdist's own choices
        allowed="a number of test processes from 1 to 999999999, auto or logical"
    fi
    echo "gpu_job.sh: $setting must be $allowed; got '$value'; see --help" >&2
    exit 2
done
cd "$(dirname "$0")/.."

JOB_BUDGET_S=${JOB_BUDGET_S:-480}
START=$(date +%s)
left() { echo $((JOB_BUDGET_S - ($(date +%s) - START))); }
OUTDIR=${OUT:-/tmp/gpu_job_out}
mkdir -p "$OUTDIR"
# The log's tee outlives a Ctrl-C or SIGTERM to the job (it ends with the job's output): killed with
# the job's process group, it took every later line with it, and the benchmark's writes broke off
# ("exit 1" for the step being measured, the job's closing lines lost, exit 141).
exec > >(trap '' INT TERM; exec tee -a "$OUTDIR/job.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
echo "== gpu_job $(date -u +%FT%TZ) on $(hostname); budget ${JOB_BUDGET_S} s"

# 1. wheels
SITE=/tmp/site
if [ "${SKIP_WHEELS:-0}" = 1 ]; then
    echo "gpu_job: SKIP_WHEELS=1: using the installed packages"
elif ls wheels/*.whl >/dev/null 2>&1; then
    if ! cmp -s <(ls wheels) "$SITE/.installed" 2>/dev/null; then
        PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
        if ! "${PIP[@]}" wheels/*.whl; then
            # One wheel that does not fit this Python or platform fails them all: install them one by one
            # (what fails is said here, and by the import checks below: the tests and sweeps need hydra
            # and omegaconf; wandb and xformers are optional).
            echo "gpu_job: installing wheels/ at once failed; one by one:"
            for w in wheels/*.whl; do "${PIP[@]}" "$w" || echo "gpu_job: NOT INSTALLED: $w"; done
        fi
        ls wheels > "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_job: no wheels/ here; using the installed packages (an offline node needs scripts/fetch_wheels.sh)"
fi

# 2. environment, said on stderr (the log); stdout: the device's name for the results directory, from
# the same process (each python that starts torch and CUDA costs seconds of the call)
nvidia-smi || echo "nvidia-smi failed"
DEVICE=$("$PY" - <<'PYEOF'
import importlib, importlib.metadata as md, platform, re, sys
import torch
say = sys.stderr.write
say(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
    f"cuDNN {torch.backends.cudnn.version()}, cuda available {torch.cuda.is_available()}\n")
for name in ("triton", "xformers", "hydra-core", "omegaconf", "wandb", "matplotlib", "numpy"):
    try:
        say(f"  {name} {md.version(name)}\n")
    except md.PackageNotFoundError:
        say(f"  {name}: not installed\n")
for mod in ("hydra", "wandb", "xformers.ops"):
    try:
        importlib.import_module(mod)
        say(f"  import {mod}: ok\n")
    except Exception as e:
        say(f"  import {mod}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}\n")
cuda = torch.cuda.is_available()
print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-") if cuda else "cpu")
# A BENCH_DIR begun on another device is refused here, before the GPU tests write their outcomes into it
# (bench_gpu.py refuses it too). The device is the one bench_gpu.py measures on: the CPU for --smoke.
import os
bench_dir = os.environ.get("BENCH_DIR")
if bench_dir and os.path.isdir(bench_dir):
    sys.path[:0] = ["scripts", "."]
    from pathlib import Path
    try:  # the harness's packages (the wheels) missing: said, and the job goes on to say what fails
        from bench_gpu_summary import other_device
        from harness.env import device_name
    except Exception as e:
        say(f"gpu_job.sh: BENCH_DIR's device not checked: {type(e).__name__}: {e}\n")
    else:
        smoke = "--smoke" in os.environ.get("BENCH_ARGS", "").split()
        why = other_device(Path(bench_dir), device_name(torch.device("cuda" if cuda and not smoke else "cpu")))
        if why:
            say(f"gpu_job.sh: BENCH_DIR: {why}\n")
            sys.exit(3)
PYEOF
)
[ $? = 3 ] && exit 2  # said above, nothing written
DEVICE=${DEVICE##*$'\n'}  # its last line: an import may print on stdout too

# 5. results to take home: packed into OUT after each step, every PACK_EVERY_S seconds while the benchmark
# runs, and on any exit (the end, a failure, a signal), so that what was measured leaves even when the call
# is killed (SIGKILL runs no trap): the last pack is what comes back.
pack() {
    local tmp="$OUTDIR/.results.tar.gz.tmp"  # whole or not at all: renamed into place
    case "$BENCH_DIR" in
        /*) tar -czf "$tmp" -C "$(dirname "$BENCH_DIR")" "$(basename "$BENCH_DIR")" ;;
        *) tar -czf "$tmp" "$BENCH_DIR" ;;
    esac && mv -f "$tmp" "$OUTDIR/results.tar.gz"
    for f in SUMMARY.md tests-gpu.log; do
        [ -f "$BENCH_DIR/$f" ] && cp "$BENCH_DIR/$f" "$OUTDIR/"
    done
    return 0
}

take_home() {
    trap - EXIT
    [ -n "${PACKER:-}" ] && kill "$PACKER" 2>/dev/null
    PENDING=$(timeout 60 "$PY" scripts/bench_gpu.py --out "$BENCH_DIR" --pending ${BENCH_ARGS:-}) \
        || PENDING="unknown (bench_gpu.py --pending failed: see above)"
    if [ ! -f "$BENCH_DIR/tests-gpu.rc" ] && [ "${SKIP_TESTS:-0}" != 1 ]; then
        PENDING="GPU tests${PENDING:+ }$PENDING"
    fi
    COMPLETE=0
    if [ -z "$PENDING" ]; then
        COMPLETE=1
        date -u +%FT%TZ > "$BENCH_DIR/COMPLETE"  # the next job starts a new directory
    fi
    pack
    ls -l "$OUTDIR"
    if [ "$COMPLETE" = 1 ]; then
        echo "gpu_job: complete; commit $BENCH_DIR"
    else
        echo "gpu_job: incomplete (steps pending: ${PENDING:-none}); run the same command again"
    fi
}

[ -n "$DEVICE" ] || DEVICE=unknown-device  # python or torch does not run: said above
if [ -z "${BENCH_DIR:-}" ]; then
    # This device's latest results directory unless it is complete or closed (CLOSED: a file saying why no
    # more runs go into it, e.g. code that changes its numbers): a benchmark that takes several calls
    # (over several days, on several machines) goes on where it stopped. A new one is named by the date, or by
    # the date and time where a directory of that date exists (they sort in the order they were made).
    latest=$(ls -d results/gpu/*-"$DEVICE" 2>/dev/null | sort | tail -n 1)
    if [ -n "$latest" ] && [ ! -f "$latest/COMPLETE" ] && [ ! -f "$latest/CLOSED" ]; then
        BENCH_DIR=$latest
    else
        BENCH_DIR=results/gpu/$(date -u +%F)-$DEVICE
        [ -e "$BENCH_DIR" ] && BENCH_DIR=results/gpu/$(date -u +%FT%H%M%SZ)-$DEVICE
    fi
fi
mkdir -p "$BENCH_DIR"
echo "== results directory: $BENCH_DIR"
trap take_home EXIT
# A SIGTERM to this script (kill, a scheduler's cancel) or a Ctrl-C: the GPU tests or the benchmark, run in
# the background (CHILD) and waited for, are sent CHILD_SIGNAL (the tests SIGINT, as at their limit; the
# benchmark SIGTERM: it records where it stopped) and waited for, then the results are packed. (A trap
# waits for a command in the foreground to end: the signal was held until the tests' limit or the
# benchmark's whole budget was spent, and timeout's process group never saw a Ctrl-C.)
CHILD=
stopped() {
    trap '' TERM INT
    echo "gpu_job: stopped by a signal"
    if [ -n "$CHILD" ]; then
        # To the command that timeout runs, once: timeout passes a signal it gets to the command and
        # again to its whole process group, so pytest was interrupted twice (a traceback from its
        # report of the first) and the harness under bench_gpu.py, which passes it on, thrice.
        pkill -"$CHILD_SIGNAL" -P "$CHILD" 2>/dev/null || kill -"$CHILD_SIGNAL" "$CHILD" 2>/dev/null
        wait "$CHILD"
    fi
    exit 143
}
trap stopped TERM INT

# 3. the GPU tests, resumed over calls until every one has an outcome. Each outcome is appended to
# tests-gpu.jsonl as it is known (tests/conftest.py's --outcomes), and a later call leaves out the tests
# that file has: a call whose time runs out during the tests loses none of what they ran.
# The outcomes verify the code they tested: where some are another code's (each names its own), every
# test runs again, as with RERUN_TESTS=1.
OUTCOMES="$BENCH_DIR/tests-gpu.jsonl"
STALE=
if [ "${SKIP_TESTS:-0}" != 1 ] && [ -f "$OUTCOMES" ]; then
    STALE=$("$PY" - "$BENCH_DIR" <<'PYEOF'
import sys
from pathlib import Path
sys.path[:0] = ["scripts", "."]
try:
    from bench_gpu_summary import tests_of_other_code
    from harness.env import code_version
except Exception as e:  # the wheels missing: said, and the outcomes are taken as they are
    sys.stderr.write(f"gpu_job.sh: the GPU tests' code not checked: {type(e).__name__}: {e}\n")
else:
    print(tests_of_other_code(Path(sys.argv[1]), code_version()) or "")
PYEOF
)
    STALE=${STALE##*$'\n'}  # its last line: an import may print on stdout too
fi
if { [ "${RERUN_TESTS:-0}" = 1 ] && [ -f "$BENCH_DIR/tests-gpu.rc" ]; } || [ -n "$STALE" ]; then
    # Every test again: the earlier outcomes are kept beside, not overwritten
    [ -n "$STALE" ] && echo "== GPU tests: $STALE: every test runs again"
    mv "$OUTCOMES" "$BENCH_DIR/tests-gpu.$(date -u +%Y%m%dT%H%M%SZ).jsonl" 2>/dev/null
    rm -f "$BENCH_DIR/tests-gpu.rc"
fi
if [ "${SKIP_TESTS:-0}" != 1 ] && [ ! -f "$BENCH_DIR/tests-gpu.rc" ]; then
    # The tests get what the call has left but 200 s, at most 300 s: the benchmark's first steps (the roof,
    # the FA-2 shape at its target length) get the rest of a short call, and the tests resume on the next.
    T=$(($(left) - 200)); [ "$T" -gt 300 ] && T=300
    if [ "$T" -lt 60 ]; then
        echo "== GPU tests: too little time left in this call (${T} s); the next call runs them"
    else
        if "$PY" -c "import wandb" 2>/dev/null; then export WANDB_MODE=offline; else export WANDB_MODE=disabled; fi
        # Eight test processes where pytest-xdist is installed: most of the time is FlexAttention's
        # compilation (one per N, dtype and mask), which one process does one at a time; with two compile
        # workers each they keep to about 16 cores. At most one per core: on fewer cores (a 2-core dry run)
        # more processes only add their imports. At the limit pytest gets SIGINT.
        # Test by test (--dist load), not the CPU suite's module by module: the GPU tests are mostly one
        # module's. Without pytest-xdist, one process and the project's -n option taken out of addopts.
        CORES=$(nproc 2>/dev/null || echo 8)
        XDIST=(-o "addopts=-ra"); "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_WORKERS:-$((CORES < 8 ? CORES : 8))}" --dist load)
        echo "== python -m pytest -q -m gpu ${XDIST[*]} (limit ${T} s; $([ -f "$OUTCOMES" ] && wc -l < "$OUTCOMES" || echo 0) outcomes from earlier calls)"
        echo "== gpu_job $(date -u +%FT%TZ): pytest -m gpu ${XDIST[*]}, limit ${T} s" >> "$BENCH_DIR/tests-gpu.log"
        TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2} timeout -s INT -k 30 "$T" \
            "$PY" -m pytest -q -m gpu "${XDIST[@]}" -rfEs --durations=15 -p no:cacheprovider --outcomes "$OUTCOMES" \
            > >(trap '' INT TERM; exec tee -a "$BENCH_DIR/tests-gpu.log") 2>&1 &
        CHILD=$! CHILD_SIGNAL=INT
        wait "$CHILD" && rc=0 || rc=$?
        CHILD=
        # Every test left ran (0: passed or skipped, 1: some failed, 5: none was left): done. Stopped at the
        # limit (124) or anything else (a collection error): the next call goes on.
        case "$rc" in 0|1|5) echo "$rc" > "$BENCH_DIR/tests-gpu.rc" ;; esac
        echo "== GPU tests exit code $rc$([ "$rc" = 124 ] && echo ' (stopped at the limit: the next call runs the rest)')"
        pack
    fi
fi

# 4. the benchmark, resumable
# Its budget leaves 60 s for a sweep to stop on SIGTERM (30 s) and the summary; the timeout's 60 s more
# and a summary again keep the whole call within about JOB_BUDGET_S + 35 s (at worst, every step at its
# limit, + 100 s: keep JOB_BUDGET_S 100 s under a hard limit on the call).
B=$(($(left) - 60))
if [ "$B" -gt 30 ]; then
    echo "== python scripts/bench_gpu.py --out $BENCH_DIR --budget-s $B ${BENCH_ARGS:-}"
    # A rows file caught mid-line by a pack is read back without its torn last line (harness.results).
    # The sleep holds no copy of the job's output: one left behind when the packer is killed would keep
    # whatever reads that output (a caller waiting for its end) waiting until it wakes.
    ( while sleep "${PACK_EVERY_S:-60}" </dev/null >/dev/null 2>&1; do pack; done ) &
    PACKER=$!
    timeout -k 10 $((B + 60)) "$PY" scripts/bench_gpu.py --out "$BENCH_DIR" --budget-s "$B" ${BENCH_ARGS:-} &
    CHILD=$! CHILD_SIGNAL=TERM
    wait "$CHILD" && rc=0 || rc=$?
    CHILD=
    [ "$rc" = 0 ] || timeout -k 5 60 "$PY" scripts/bench_gpu.py --out "$BENCH_DIR" --summary-only ${BENCH_ARGS:-}
    kill "$PACKER" 2>/dev/null
else
    echo "== no time left for the benchmark in this call"
fi
