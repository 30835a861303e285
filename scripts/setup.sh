#!/usr/bin/env bash
# Set up vllm-pve-deploy on a fresh Debian machine: system packages the test bed needs, and a venv in .venv.
# Idempotent; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
need=()
"$PY" -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v fuser >/dev/null 2>&1 || need+=(psmisc)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v ps >/dev/null 2>&1 || need+=(procps)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# the test bed's LXC containers with systemd as init (docs/testbed.md): Debian's lxc, and debootstrap for their
# root file system (built once, into /var/cache/vpd-testbed)
command -v lxc-start >/dev/null 2>&1 || need+=(lxc)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
# `deploy monitor export`'s tests: the real promtool (check config/rules, test rules) and a real Prometheus that
# scrapes the test bed (Debian's prometheus; its service is not used: the tests run their own on a free port)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# `deploy monitor metrics`'s test: Debian's node_exporter, run by the test with only its textfile collector on a
# free 127.x port (the service the package starts where systemd runs is disabled again below)
command -v prometheus-node-exporter >/dev/null 2>&1 || need+=(prometheus-node-exporter)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    echo "setup: apt-get update (reading the package lists; about 10-30 s)" >&2
    apt-get update -qq >/dev/null
    echo "setup: apt-get install ${need[*]} (about 10-60 s)" >&2
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # node_exporter's Debian package starts and enables its service where systemd runs: the tests run their own
    # (only the textfile collector, a free port), so the one this script installed is stopped and disabled again
    if [[ " ${need[*]} " == *" prometheus-node-exporter "* ]] && [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus-node-exporter.service >/dev/null 2>&1 || true
    fi
  else
    echo "setup: please install: ${need[*]} (the test bed needs them)" >&2
  fi
fi
[ -x .venv/bin/python ] || { echo "setup: creating the virtual environment .venv" >&2; "$PY" -m venv .venv; }
echo "setup: pip: installing the tool, the test bed and the test tools into .venv (about 20-60 s; log:" \
  ".venv/pip-install.log)" >&2
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e ./testbed -e '.[test]' > .venv/pip-install.log 2>&1 || { cat .venv/pip-install.log >&2; exit 1; }
# the real vLLM Router (issue 29) for the test bed's containers, which have no route to PyPI: its wheels, once
# per machine, into /var/cache/vpd-testbed/wheels (about 30 MB); the router tests skip without them
.venv/bin/python -m vpd_testbed.router_wheels >/dev/null || echo "setup: vllm-router wheels not downloaded (the router tests will skip)" >&2
echo "setup: done ($(.venv/bin/deploy --version))" >&2
