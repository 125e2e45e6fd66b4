#!/usr/bin/env bash
# The GPU session's one command (issue 6): run on the device machine from the repository root.
#
# Here, once:   scripts/fetch_wheels.sh          # wheels/ (about 27 MiB, gitignored)
# Then the device tool's run, the same call until the output's last line says "all parts complete":
#   run(command="bash scripts/gpu_job.sh", carry=["wheels"], timeout_s=600)
# and after each call, here:
#   tar -xzf <files_at>/results.tar.gz -C /work/main     # results/gpu/<date>-<device>/ ; it travels
#                                                        # with the next call, which resumes it
# Finally commit results/gpu/<date>-<device>/ (SUMMARY.md, summary.json, plots, rows).
#
# One call is at most 10 minutes, so the job does what is left within JOB_BUDGET_S (default 520 s)
# and stops: the GPU tests first (once), then the benchmark parts c, d, a, b (scripts/bench_gpu.py,
# resumable: measured points are never measured again). Expect 3 calls on an H100 (about 25 minutes).
#
# What it does:
# 1. installs the carried wheels (--no-index, --no-deps) into /tmp/site and puts it on PYTHONPATH. Not a
#    venv: the machine's python3 is itself a venv (/opt/torch/.venv), and `python -m venv
#    --system-site-packages` from it would see the base interpreter's packages, not its torch;
# 2. prints nvidia-smi and the versions of torch, CUDA, triton, xformers, hydra, wandb;
# 3. `python -m pytest -q -m gpu` (xdist -n 4 where installed) -> <results>/junit-gpu.xml, tests-gpu.log;
# 4. `python scripts/bench_gpu.py --out <results> --parts c,d,a,b --budget-s <what is left>`;
# 5. copies into $OUT: results.tar.gz (the whole results directory, repo-relative paths), SUMMARY.md,
#    summary.json, junit-gpu.xml, tests-gpu.log, job.log (6 files; the tool brings back at most 8).
#
# Environment: BENCH_DIR (default: the newest incomplete results/gpu/*-<device>, else a new one),
# JOB_BUDGET_S, PARTS (default c,d,a,b), RERUN_TESTS=1 (run the GPU tests again), SKIP_TESTS=1,
# SKIP_WHEELS=1 and BENCH_ARGS (extra bench_gpu.py arguments): for a dry run on a CPU machine,
#   OUT=/tmp/o BENCH_DIR=/tmp/b SKIP_WHEELS=1 BENCH_ARGS="--smoke --device cpu" bash scripts/gpu_job.sh
set -uo pipefail
cd "$(dirname "$0")/.."

JOB_BUDGET_S=${JOB_BUDGET_S:-520}
PARTS=${PARTS:-c,d,a,b}
START=$(date +%s)
left() { echo $((JOB_BUDGET_S - ($(date +%s) - START))); }
OUTDIR=${OUT:-/tmp/gpu_job_out}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/job.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== gpu_job $(date -u +%FT%TZ) on $(hostname); budget ${JOB_BUDGET_S} s"

# 1. wheels
SITE=/tmp/site
if [ "${SKIP_WHEELS:-0}" = 1 ]; then
    echo "gpu_job: SKIP_WHEELS=1: using the installed packages"
elif ls wheels/*.whl >/dev/null 2>&1; then
    if ! cmp -s <(ls wheels) "$SITE/.installed" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" wheels/*.whl \
            || { echo "gpu_job: installing the carried wheels failed"; exit 1; }
        ls wheels > "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_job: no wheels/ carried (run scripts/fetch_wheels.sh here and carry [\"wheels\"]); hydra is needed"
fi

# 2. environment
nvidia-smi || echo "nvidia-smi failed"
"$PY" - <<'EOF'
import importlib, importlib.metadata as md, platform, warnings
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, cuda available {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
for name in ("triton", "xformers", "hydra-core", "omegaconf", "wandb", "matplotlib", "rich", "numpy", "pytest-xdist"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name}: not installed")
for mod in ("hydra", "omegaconf", "wandb", "xformers.ops"):
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            importlib.import_module(mod)
        print(f"  import {mod}: ok" + (f" ({len(w)} warnings: {str(w[0].message).splitlines()[0][:150]})" if w else ""))
    except Exception as e:
        print(f"  import {mod}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
EOF

BENCH_DIR=${BENCH_DIR:-$("$PY" scripts/bench_gpu.py --print-out-dir)}
mkdir -p "$BENCH_DIR"
echo "== results directory: $BENCH_DIR"

# 3. the GPU tests, once
T=$(($(left) - 140))
[ "$T" -gt 360 ] && T=360
if [ "${SKIP_TESTS:-0}" != 1 ] && { [ ! -f "$BENCH_DIR/tests-gpu.rc" ] || [ "${RERUN_TESTS:-0}" = 1 ]; } \
        && [ "$T" -lt 60 ]; then
    echo "== GPU tests: too little time left in this call (${T} s); the next call runs them"
elif [ "${SKIP_TESTS:-0}" != 1 ] && { [ ! -f "$BENCH_DIR/tests-gpu.rc" ] || [ "${RERUN_TESTS:-0}" = 1 ]; }; then
    if "$PY" -c "import wandb" 2>/dev/null; then export WANDB_MODE=offline; else export WANDB_MODE=disabled; fi
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
    echo "== python -m pytest -q -m gpu ${XDIST[*]} (limit ${T} s, WANDB_MODE=$WANDB_MODE)"
    timeout -k 15 "$T" "$PY" -m pytest -q -m gpu "${XDIST[@]}" -rfEs -p no:cacheprovider \
        --junitxml="$BENCH_DIR/junit-gpu.xml" 2>&1 | tee "$BENCH_DIR/tests-gpu.log"
    rc=${PIPESTATUS[0]}
    echo "$rc" > "$BENCH_DIR/tests-gpu.rc"
    echo "== GPU tests exit code $rc$([ "$rc" = 124 ] && echo ' (timed out: RERUN_TESTS=1 to run them again)')"
fi

# 4. the benchmark, resumable
B=$(($(left) - 25))
if [ "$B" -gt 30 ]; then
    echo "== python scripts/bench_gpu.py --out $BENCH_DIR --parts $PARTS --budget-s $B"
    timeout -k 10 $((B + 60)) "$PY" scripts/bench_gpu.py --out "$BENCH_DIR" --parts "$PARTS" --budget-s "$B" ${BENCH_ARGS:-}
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "== bench_gpu.py exit code $rc; rewriting the summary from what was measured"
        "$PY" scripts/bench_gpu.py --out "$BENCH_DIR" --summary-only ${BENCH_ARGS:-}
    fi
else
    echo "== no time left for the benchmark in this call"
fi

# 5. results back
PENDING=$("$PY" scripts/bench_gpu.py --out "$BENCH_DIR" --parts "$PARTS" --pending)
REL=$(realpath --relative-to="$PWD" "$BENCH_DIR")
case "$REL" in
    ../*) tar -czf "$OUTDIR/results.tar.gz" -C "$(dirname "$BENCH_DIR")" "$(basename "$BENCH_DIR")" ;;
    *) tar -czf "$OUTDIR/results.tar.gz" "$REL" ;;
esac
for f in SUMMARY.md summary.json junit-gpu.xml tests-gpu.log; do
    [ -f "$BENCH_DIR/$f" ] && cp "$BENCH_DIR/$f" "$OUTDIR/"
done
ls -l "$OUTDIR"
case "$REL" in
    ../*) echo "== results.tar.gz holds $(basename "$BENCH_DIR")/ (BENCH_DIR is outside the repository)" ;;
    *) echo "== extract here: tar -xzf <files_at>/results.tar.gz -C <repo root>   (-> $REL)" ;;
esac
if [ -z "$PENDING" ] && [ -f "$BENCH_DIR/tests-gpu.rc" ]; then
    echo "gpu_job: all parts complete (GPU tests exit code $(cat "$BENCH_DIR/tests-gpu.rc")); commit $REL"
else
    echo "gpu_job: incomplete (parts pending: ${PENDING:-none}); extract the results and run the same command again"
fi
