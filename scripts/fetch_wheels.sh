#!/usr/bin/env bash
# Download, where PyPI is reachable, the wheels an offline GPU node lacks, for scripts/gpu_job.sh to
# install there with --no-index.
#
#   scripts/fetch_wheels.sh [--dest wheels] [--python-version 3.12] [--torch 2.11] [--no-wandb] [--no-xformers]
#
# What an offline GPU node typically has: python3 with torch (CUDA build), triton, numpy, matplotlib,
# rich, PyYAML, packaging, requests, protobuf, click, xxhash, pytest, joblib, cloudpickle. It lacks what
# the harness imports (hydra-core, omegaconf, antlr4-python3-runtime), the GPU backend xformers, and
# wandb with part of its dependency tree. Only those are fetched: a second version of a package the node
# already has could shadow it. --python-version and --torch describe the node (defaults: 3.12, 2.11).
#
# Versions are the ones this project's CPU venv runs and tests (pyproject's ranges resolve to them):
#   hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3 (PyPI has only an sdist: it is
#   built here into a pure-python wheel), the hydra launcher plugins, wandb 0.31.0 and the part of its
#   tree not on the machine, xformers 0.0.35.
# xformers: 0.0.35 (the newest on PyPI) declares torch>=2.10; its extension (_C.so) was built for torch
#   2.10+cu128. On an H100 with torch 2.11+cu130 (2026-11-26) the extension did not load, and xformers
#   then refuses every CUDA kernel it has, its torch-backed ones too ("xFormers wasn't build with CUDA
#   support"): the harness reports the backend unavailable there, with that reason. It runs only where
#   torch is the build the wheel names (2.10 + CUDA 12.8). --torch only checks that the machine's torch
#   meets the wheel's requirement (>= 2.10); pick another version with XFORMERS_VERSION=...
# Sizes (measured 2026-11-22): 26 wheels, 27.1 MiB together (wandb 19.4 MiB, pydantic-core 2.2, xformers
#   3.1 MiB). The script prints the total and fails if it exceeds LIMIT_MIB (default 60).
#
# The folder is ignored by git (.gitignore: wheels/); copy it to the GPU node with the repository.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=wheels
PYVER=3.12
TORCH=2.11
WANDB=1
XFORMERS=1
LIMIT_MIB=${LIMIT_MIB:-60}
XFORMERS_VERSION=${XFORMERS_VERSION:-0.0.35}
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) DEST=$2; shift 2 ;;
        --python-version) PYVER=$2; shift 2 ;;
        --torch) TORCH=$2; shift 2 ;;
        --no-wandb) WANDB=0; shift ;;
        --no-xformers) XFORMERS=0; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "fetch_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

# xformers 0.0.35 needs torch >= 2.10.
if [ "$XFORMERS" = 1 ] && [ "$XFORMERS_VERSION" = 0.0.35 ]; then
    if ! python3 -c "import sys; t=tuple(int(x) for x in sys.argv[1].split('.')[:2]); sys.exit(t < (2, 10))" "$TORCH"; then
        echo "fetch_wheels.sh: xformers $XFORMERS_VERSION needs torch >= 2.10, the GPU node has $TORCH;" \
             "set XFORMERS_VERSION to one built for it, or pass --no-xformers" >&2
        exit 2
    fi
fi

CORE=(hydra-core==1.3.8 omegaconf==2.3.1 hydra-submitit-launcher==1.2.0 hydra-joblib-launcher==1.2.0
      submitit==1.5.4)
# wandb 0.31.0's requirements, less those an offline GPU node usually has (click, packaging, protobuf,
# pyyaml, requests, typing-extensions, xxhash, anyio, httpx, certifi, idna, urllib3, ...).
WANDB_TREE=(wandb==0.31.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
            typing-inspection==0.4.5 platformdirs==4.14.7 cwevals==0.0.1b1 distro==1.9.0 sniffio==1.3.1
            tzdata==2026.6 googleapis-common-protos==1.76.0
            opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
            opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
            opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2
            opentelemetry-exporter-otlp-common==0.66b2)
WANTED=("${CORE[@]}")
[ "$WANDB" = 1 ] && WANTED+=("${WANDB_TREE[@]}")
[ "$XFORMERS" = 1 ] && WANTED+=("xformers==$XFORMERS_VERSION")

mkdir -p "$DEST"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "${WANTED[@]}"
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) exists only as an sdist: build a pure wheel.
if ! ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
    python3 -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" antlr4-python3-runtime==4.9.3 \
        || python3 -m pip wheel --quiet --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
fi
[ "$WANDB" = 1 ] || rm -f "$DEST"/wandb-*.whl
[ "$XFORMERS" = 1 ] || rm -f "$DEST"/xformers-*.whl

# One version of each: two stop the whole install on the GPU node.
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
if [ -n "$dups" ]; then
    echo "fetch_wheels.sh: more than one wheel of: $dups (remove the older from $DEST)" >&2
    exit 1
fi
ls -l "$DEST"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$( (git ls-files; git ls-files --others --exclude-standard) | tr '\n' '\0' | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
printf 'wheels: %.2f MiB; the working tree beside them: %.2f MiB\n' \
    "$(echo "$total / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "fetch_wheels.sh: the wheels exceed ${LIMIT_MIB} MiB; drop one with --no-wandb or --no-xformers" >&2
    exit 1
fi
