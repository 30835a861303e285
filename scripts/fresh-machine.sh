#!/usr/bin/env bash
# Run a command as on a fresh Debian machine, without changing this one (needs root):
#   - a private mount namespace where /run is an empty tmpfs, as after a boot (no /run/sshd);
#   - /usr, /etc, /var and /root are copy-on-write overlays, dropped at exit, in which openssh-server and psmisc
#     are purged first and pip's cache is empty, so setup.sh has to install what the quick start needs.
# usage: bash scripts/fresh-machine.sh [COMMAND...]   (default: the README's two quick-start commands)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "fresh-machine: needs root" >&2; exit 2; }
scratch=$(mktemp -d /tmp/vpd-fresh-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
[ $# -gt 0 ] || set -- bash -c 'bash scripts/demo.sh && .venv/bin/deploy testbed down && bash scripts/test.sh'
rm -rf .venv   # the venv is made by setup.sh, as on a fresh clone
unshare --mount --propagation private -- bash -euo pipefail -s "$scratch" "$@" <<'INNER'
scratch=$1; shift
for d in usr etc var root; do
  mkdir -p "$scratch/$d.upper" "$scratch/$d.work"
  mount -t overlay "fresh-$d" -o "lowerdir=/$d,upperdir=$scratch/$d.upper,workdir=$scratch/$d.work" "/$d"
done
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /root/.cache && mount -t tmpfs tmpfs /root/.cache
export DEBIAN_FRONTEND=noninteractive
apt-get purge -y -qq openssh-server psmisc >/dev/null 2>&1 || true
missing=$( { [ -x /usr/sbin/sshd ] && echo sshd; command -v fuser >/dev/null && echo fuser; ls -A /run; } | wc -l)
echo "fresh-machine: /run empty, sshd and fuser absent, pip cache empty (leftovers: $missing)" >&2
"$@"
INNER
