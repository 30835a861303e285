"""The test bed's real LXC containers (systemd as init): the cached Debian root file system and each container's
LXC config. The life cycle (start, stop, attach) is in scripts/lxcct.py, shared with the simulated `pct`.

The root file system is built ONCE per machine from Debian's packages (`debootstrap --variant=minbase`, about 45 s
and 300 MB) into a cache directory, then shared read-only as the lower layer of every container's overlay. Its
Python is Debian bookworm's python3.11; the fake vLLM and transformers are not installed in it: the container's
/root/ml-env venv uses that python3.11 with the test environment's own site-packages bind-mounted read-only (the
same way the namespace containers get them), which is why the test environment's Python must be 3.11 too.
See docs/testbed.md, "LXC containers with systemd".
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"
PACKAGES = "systemd,systemd-sysv,dbus,python3,psmisc,procps"
ROOTFS_VERSION = "v1"  # bump when PACKAGES or the preparation below change: a new cache directory is built
PYTHON_VER = "3.11"  # bookworm's python3


from .common import TestbedError


class LxcUnavailable(TestbedError):
    """LXC containers cannot run here; the message says why and what to install."""


def cache_dir() -> Path:
    return Path(os.environ.get("VPD_LXC_CACHE") or "/var/cache/vpd-testbed")


def rootfs_path() -> Path:
    return cache_dir() / f"rootfs-{SUITE}-{ROOTFS_VERSION}"


def check_prereqs(python_ver: str) -> None:
    """Why LXC containers cannot run here (LxcUnavailable), or nothing."""
    if os.geteuid() != 0:
        raise LxcUnavailable("LXC containers need root")
    missing = [t for t in ("lxc-start", "lxc-stop", "lxc-attach", "lxc-info", "debootstrap") if not shutil.which(t)]
    if missing:
        raise LxcUnavailable("missing %s: apt-get install lxc debootstrap (scripts/setup.sh does)" % ", ".join(missing))
    if python_ver != PYTHON_VER:
        raise LxcUnavailable("the container's Debian %s has Python %s, the test environment runs Python %s: its "
                             "site-packages (transformers) cannot be shared with it" % (SUITE, PYTHON_VER, python_ver))


def _say(msg: str) -> None:
    import sys

    print("testbed: " + msg, file=sys.stderr, flush=True)


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip()[:120] if lines else ""
    except OSError:
        return ""


def ensure_rootfs(log=None, say=_say, every_s: float = 10.0) -> Path:
    """The cached root file system, built on first use (under a lock: concurrent test sessions build it once).
    The build says what it does and, every `every_s` seconds, how long it has run and debootstrap's last line."""
    dest = rootfs_path()
    if (dest / ".vpd-complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".build.lock", "w") as lk:
        try:
            fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another test bed is building the LXC root file system in %s; waiting for it" % dest.parent)
            fcntl.flock(lk, fcntl.LOCK_EX)
        if (dest / ".vpd-complete").exists():
            return dest
        tmp = dest.parent / (dest.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        logf = Path(log or (dest.parent / (dest.name + ".log")))
        say("building the LXC root file system once (debootstrap %s minbase from Debian's mirror, about 45-90 s; "
            "log: %s); later test beds reuse it" % (SUITE, logf))
        with open(logf, "wb") as lf:
            p = subprocess.Popen(["debootstrap", "--variant=minbase", "--include=" + PACKAGES, SUITE, str(tmp)],
                                 stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 900
            while True:
                try:
                    p.wait(timeout=max(0.1, min(every_s, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        p.kill()
                        p.wait()
                        raise LxcUnavailable("debootstrap %s into %s did not finish within 900 s (see %s): is "
                                             "Debian's mirror reachable?" % (SUITE, tmp, logf)) from None
                    say("still building the root file system (%.0f s): %s" % (time.monotonic() - t0, _last_line(logf)))
            r = p
        if r.returncode:
            tail = "\n    ".join(logf.read_text(errors="replace").splitlines()[-12:])
            raise LxcUnavailable("debootstrap %s into %s failed (exit %d); last lines of %s:\n    %s"
                                 % (SUITE, tmp, r.returncode, logf, tail))
        _prepare(tmp)
        (tmp / ".vpd-complete").write_text("built in %.0f s by the vllm-pve-deploy test bed\n" % (time.monotonic() - t0))
        os.rename(tmp, dest)
        say("root file system built in %.0f s: %s" % (time.monotonic() - t0, dest))
        return dest


def _prepare(root: Path) -> None:
    """Quiet and fast boots: no getty on consoles that do not exist, a journal in memory only."""
    wants = root / "etc/systemd/system"
    for unit in ("getty.target", "console-getty.service", "systemd-networkd-wait-online.service"):
        p = wants / unit
        if not p.exists():
            p.symlink_to("/dev/null")
    jd = root / "etc/systemd/journald.conf.d"
    jd.mkdir(parents=True, exist_ok=True)
    (jd / "vpd-testbed.conf").write_text("[Journal]\nStorage=volatile\n")


def write_config(ct_dir: Path, name: str, lxcpath: Path, rootfs: Path, hostdir: Path, gpus, binds) -> dict:
    """The container's LXC config (as Proxmox generates from its pct config, reduced to what matters here) and
    the description ct.json keeps ("lxc")."""
    upper, work = ct_dir / "rootfs-upper", ct_dir / "rootfs-work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    cdir = lxcpath / name
    cdir.mkdir(parents=True, exist_ok=True)
    gd = hostdir / "gpus"
    lines = [
        "# vllm-pve-deploy test bed: container %s (systemd as init)" % name,
        "lxc.uts.name = %s" % name,
        "lxc.rootfs.path = overlay:%s:%s" % (rootfs, upper),
        "lxc.init.cmd = /lib/systemd/systemd",
        "lxc.mount.auto = proc:mixed sys:mixed cgroup:mixed",
        "lxc.apparmor.profile = unconfined",
        "lxc.net.0.type = empty",  # its own network namespace (eth0 plugged in after start): every container can use :8000
        "lxc.tty.max = 0",
        "lxc.autodev = 1",
        # the GPUs, the Proxmox way (a plain file stands in for each device: same inode as the host's)
    ] + ["lxc.mount.entry = %s dev/nvidia%d none bind,optional,create=file" % (gd / ("nvidia%d" % i), i)
         for i in gpus] + [
        "lxc.mount.entry = %s dev/%s none bind,optional,create=file" % (gd / n, n)
        for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")] + [
        # the test bed's plumbing: nvidia-smi's socket, fault switches, /root with the venv and models
        "lxc.mount.entry = %s opt/vpd-testbed-run none bind,create=dir" % (ct_dir / "run"),
        "lxc.mount.entry = %s usr/bin/nvidia-smi none bind,ro,create=file" % (ct_dir / "nvidia-smi"),
        "lxc.mount.entry = %s etc/vpd-testbed none bind,ro,create=dir" % (ct_dir / "faults"),
        "lxc.mount.entry = %s root none bind,create=dir" % (ct_dir / "root"),
        "lxc.mount.entry = %s usr/lib/x86_64-linux-gnu/nvidia/current none bind,ro,create=dir" % (ct_dir / "nvlib"),
        "lxc.mount.entry = %s proc/driver none bind,ro,optional 0 0" % (hostdir / "procdriver"),
    ] + ["lxc.mount.entry = %s %s none bind,ro,create=dir" % (src, dst.lstrip("/")) for src, dst in binds] + [""]
    (cdir / "config").write_text("\n".join(lines))
    return {"lxcpath": str(lxcpath), "name": name, "log": str(ct_dir / "lxc.log"), "rootfs": str(rootfs)}
