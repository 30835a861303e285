#!/usr/bin/env bash
# The demo: set up, start the built-in test bed (a simulated Proxmox host with 4 fake GPUs, needs root),
# bring qwen36-dflash up verified end to end, and show `deploy status`. Leaves the test bed running to explore.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export DEPLOY_INVENTORY="${VPD_TESTBED_DIR:-/tmp/vpd-testbed}/hosts.yaml"
deploy testbed status >/dev/null 2>&1 || deploy testbed up
echo; echo '$ deploy plan qwen36-dflash   (first lines)'; deploy plan qwen36-dflash | sed -n 1,12p
echo; echo '$ deploy up qwen36-dflash'; deploy up qwen36-dflash
echo; echo '$ deploy status'; deploy status
cat <<MSG

The test bed is still running. Try:
  export PATH=$PWD/.venv/bin:\$PATH DEPLOY_INVENTORY=$DEPLOY_INVENTORY
  deploy verify qwen36-dflash
  deploy testbed fault pve1/129 oom_at_startup=free_memory && deploy restart qwen36-dflash   # fails, as it should
  deploy testbed fault pve1/129 --clear && deploy restart qwen36-dflash                     # the fault off: up again
  deploy testbed down          # removes every process, mount and file it made
MSG
