#!/usr/bin/env bash
# The test command (README and CI run exactly this): set up, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -rs "$@"
