#!/usr/bin/env bash
# Run a command in a clean clone of this repo's HEAD as on a freshly booted Debian machine, without changing
# this one (needs root):
#   - a private mount namespace; /usr, /etc, /var and /root are copy-on-write overlays, dropped at exit, in which
#     openssh-server, psmisc and python3-venv are purged first and pip's cache is empty, so setup.sh must install
#     them; PATH is Debian's own (no pyenv or other Python put in front by hand), so python3 is Debian's;
#   - /run is an empty tmpfs, as after a boot (no /run/sshd);
#   - lxc and debootstrap are purged too, and the test bed's LXC root file system cache is a new empty directory
#     (VPD_LXC_CACHE), so the tests build it with debootstrap as on a new machine.
# usage: bash scripts/fresh-machine.sh [COMMAND...]
#   default COMMAND: the README's two quick-start commands (demo, then the tests), as CI runs them, then the
#   load variant (scripts/test-under-load.sh: the tests marked deadline beside a CPU hog, issue 37).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "fresh-machine: needs root" >&2; exit 2; }
scratch=$(mktemp -d /tmp/vpd-fresh-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
git clone -q . "$scratch/clone"
echo "fresh-machine: a clean clone of $(git rev-parse --short HEAD) in $scratch/clone" >&2
[ $# -gt 0 ] || set -- bash -c 'bash scripts/demo.sh && .venv/bin/deploy testbed down && bash scripts/test.sh && bash scripts/test-under-load.sh'
cd "$scratch/clone"
unshare --mount --propagation private -- bash -euo pipefail -s "$scratch" "$@" <<'INNER'
scratch=$1; shift
for d in usr etc var root; do
  mkdir -p "$scratch/$d.upper" "$scratch/$d.work"
  mount -t overlay "fresh-$d" -o "lowerdir=/$d,upperdir=$scratch/$d.upper,workdir=$scratch/$d.work" "/$d"
done
mkdir -p /root/.cache && mount -t tmpfs tmpfs /root/.cache
export DEBIAN_FRONTEND=noninteractive
apt-get purge -y -qq openssh-server psmisc python3-venv 'python3.*-venv' lxc debootstrap >/dev/null 2>&1 || true
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t tmpfs -o mode=0755 tmpfs /run
# the test bed's cached Debian root file system for its LXC containers is built anew (debootstrap), not reused
export VPD_LXC_CACHE=$scratch/lxc-cache
have=$( { [ -x /usr/sbin/sshd ] && echo sshd; command -v fuser; command -v lxc-start; command -v debootstrap; python3 -c 'import ensurepip' 2>/dev/null && echo venv
          ls -A /run; ls -A /root/.cache; } | tr '\n' ' ')
echo "fresh-machine: $(command -v python3) ($(python3 -V 2>&1)), empty /run, no sshd, fuser, python3-venv, lxc or debootstrap, empty" \
     "pip cache${have:+ (NOT fresh: $have)}" >&2
"$@" </dev/null
INNER
