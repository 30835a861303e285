#!/usr/bin/env bash
# The load variant of the test command (issue 37; .ci/run runs it after scripts/test.sh): the tests that assert a
# bound on time (pytest -m deadline, tests/slack.py) beside a CPU hog, one busy process per core, so that a
# timing-dependent test cannot land again. Extra arguments go to scripts/test.sh (e.g. a different -m to run the
# whole suite under the hog: bash scripts/test-under-load.sh -m "not nothing").
# VPD_HOGS=N sets the number of busy processes (default: one per core). Every hog ends by itself after 30 min.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${VPD_HOGS:-$(nproc)}
pids=()
for _ in $(seq 1 "$n"); do
  timeout 1800 python3 -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
echo "test-under-load: $n CPU hog(s) beside the tests (pids ${pids[*]})" >&2
t0=$(date +%s)
rc=0
if [ $# -gt 0 ]; then
  VPD_SKIP_REAL_VLLM=${VPD_SKIP_REAL_VLLM:-1} bash scripts/test.sh "$@" || rc=$?
else
  VPD_SKIP_REAL_VLLM=${VPD_SKIP_REAL_VLLM:-1} bash scripts/test.sh -m deadline || rc=$?
fi
echo "test-under-load: exit $rc after $(( $(date +%s) - t0 )) s with $n hog(s)" >&2
exit $rc
