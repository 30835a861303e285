#!/usr/bin/env bash
# The real-GPU check (issue 40; docs/testbed.md, "The real-GPU check"): deploy against a CUDA vLLM on this
# machine's real NVIDIA GPU, through the test bed (gpus=real). Never part of CI: without a GPU it refuses at once.
#
#   scripts/gpu-check.sh [--dry-run] [--out DIR] [--cache DIR] [--wheels DIR] [--vllm-version V]
#                        [--extra-site DIR] [--site DIR] [--debs DIR]     (bench/gpu/gpu_check.py --help)
#
# --site DIR: a folder of the project's own dependencies (pip install --target DIR click PyYAML ...) for a machine
#   whose Python lacks them; --debs DIR: .deb files (openssh-server, psmisc, ...) unpacked into / first
#   (disposable machines only, like the device machine of docs/testbed.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VPD_GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if .venv/bin/python -c 'import click, yaml' 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --debs) for f in "$2"/*.deb; do dpkg -x "$f" /; done; shift 2 ;;
        --site) export PYTHONPATH="$(cd "$2" && pwd)${PYTHONPATH:+:$PYTHONPATH}"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
export VPD_GPU_CHECK_PYTHON="$PY" PYTHONUNBUFFERED=1
exec "$PY" bench/gpu/gpu_check.py ${args[@]+"${args[@]}"}
