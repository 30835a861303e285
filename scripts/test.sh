#!/usr/bin/env bash
# The test command (README and CI run exactly this): set up, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Three workers (pytest-xdist), a test file per worker at a time: most of the suite waits on simulated hosts and
# servers, so 3 workers on 2 cores take ~3 min where one takes ~8 (bench/README.md). VPD_TEST_WORKERS=0: serial.
WORKERS=${VPD_TEST_WORKERS:-3}
if [ "$WORKERS" = 0 ]; then
  exec .venv/bin/python -m pytest -q -rs "$@"
fi
exec .venv/bin/python -m pytest -q -rs -n "$WORKERS" --dist loadfile "$@"
