#!/usr/bin/env bash
# The real-GPU check (issues 40, 55; docs/testbed.md, "The real-GPU check"): the tool's GPU lifecycle on a real
# NVIDIA driver, through the test bed (gpus=real: the fake vLLM's torch engine holds real CUDA contexts). Nothing is
# installed from a registry: what the GPU machine lacks travels in gpu-carry/ (bench/gpu/carry.py).
#
#   scripts/gpu-check.sh --build-carry        # here, once: build gpu-carry/ (git-ignored; prints its size)
#   scripts/gpu-check.sh --dry-run            # anywhere: every step, and what it carries (`carries 29.7 MiB`)
#   scripts/gpu-check.sh [--out DIR] ...      # on the GPU machine, as root: the run (bench/gpu/gpu_check.py --help)
#
# On the device machine: run(command="bash scripts/gpu-check.sh", carry=["gpu-carry"]); the report lands in $OUT.
# Never part of CI: without a GPU it refuses at once (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry
args=()
build=0
while [ $# -gt 0 ]; do
    case "$1" in
        --build-carry) build=1; shift ;;
        --carry) CARRY=$2; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ "$build" = 1 ]; then
    exec "${VPD_GPU_CARRY_PYTHON:-.venv/bin/python}" bench/gpu/carry.py build "$CARRY"
fi
# the project's dependencies the machine lacks (fabric, paramiko, tenacity, ...): the carried --target folder
if [ -d "$CARRY/site" ]; then
    export PYTHONPATH="$(cd "$CARRY/site" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${VPD_GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c 'import click, yaml, fabric' 2>/dev/null; then PY=.venv/bin/python
    else PY=python3; fi
fi
export VPD_GPU_CHECK_PYTHON="$PY" PYTHONUNBUFFERED=1
exec "$PY" bench/gpu/gpu_check.py ${args[@]+"${args[@]}"}
