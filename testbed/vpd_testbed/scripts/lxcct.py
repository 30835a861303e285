"""Real LXC containers with systemd as init, for the test bed (stdlib only; used by ctl.py, pct.py and core.py).

A container whose ct.json has "lxc": {...} is not a namespace container made by ctinit.py: it is an LXC
container (Debian's `lxc` package) whose PID 1 is systemd, booted from the test bed's cached Debian root file
system (debootstrap, built once: core.py `lxc_rootfs`) as the lower layer of a per-container overlay. The
simulated `pct` drives it the way Proxmox's does: `lxc-start`, `lxc-stop`, `lxc-attach`, `lxc-info`, with the
GPUs passed in Proxmox's way (`lxc.mount.entry` of the host's GPU files). See docs/testbed.md, "LXC containers".
"""
import json
import os
import subprocess
import time

BOOT_TIMEOUT_S = 60.0


def info(ct):
    return ct.get("lxc") or None


def _base(lx):
    return ["-P", lx["lxcpath"], "-n", lx["name"]]


def _run(argv, timeout=30):
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, b"", ("%s: no answer within %ss" % (argv[0], timeout)).encode())


def init_pid(lx):
    """PID (root namespace) of the container's init (systemd), or None when it is stopped."""
    r = _run(["lxc-info"] + _base(lx) + ["-p", "-H"], timeout=15)
    out = r.stdout.decode().strip()
    return int(out) if r.returncode == 0 and out.isdigit() else None


def attach_argv(lx, argv, env=None, keep_env=False):
    """`pct exec` is lxc-attach underneath. keep_env: the caller's environment goes in (pct's default); else it
    is cleared and only `env` is set (pct exec --keep-env 0)."""
    pre = ["lxc-attach"] + _base(lx)
    if keep_env:
        pre.append("--keep-env")
    else:
        pre.append("--clear-env")
        for k, v in sorted((env or {}).items()):
            pre += ["--set-var", "%s=%s" % (k, v)]
    return pre + ["--"] + list(argv)


def system_state(lx):
    r = _run(attach_argv(lx, ["systemctl", "is-system-running"], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}),
             timeout=15)
    return r.stdout.decode(errors="replace").strip()


def start(lx, timeout=BOOT_TIMEOUT_S):
    """lxc-start, then wait (bounded) until systemd says the boot is over (running, or degraded: some unit
    failed). Returns the init PID."""
    r = _run(["lxc-start"] + _base(lx) + ["-l", "INFO", "-o", lx["log"]], timeout=timeout)
    if r.returncode:
        raise RuntimeError("lxc-start -n %s failed (exit %d): %s%s" % (
            lx["name"], r.returncode, r.stderr.decode(errors="replace").strip()[-1500:], _log_tail(lx)))
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = system_state(lx)
        if state in ("running", "degraded"):
            pid = init_pid(lx)
            if pid:
                return pid
        time.sleep(0.1)
    raise RuntimeError("container %s: systemd did not finish booting within %.0f s (systemctl is-system-running: "
                       "%r)%s" % (lx["name"], timeout, state, _log_tail(lx)))


def stop(lx, clean=False, timeout=30.0):
    """lxc-stop -k (pct stop: a hard stop), or a clean shutdown with -t (pct shutdown / reboot). -> was it running"""
    if not init_pid(lx):
        return False
    argv = ["lxc-stop"] + _base(lx) + (["-t", str(int(timeout))] if clean else ["-k"])
    r = _run(argv, timeout=timeout + 15)
    if r.returncode and init_pid(lx):
        raise RuntimeError("lxc-stop -n %s failed (exit %d): %s" % (lx["name"], r.returncode,
                                                                     r.stderr.decode(errors="replace").strip()))
    return True


def _log_tail(lx, n=12):
    try:
        with open(lx["log"], errors="replace") as f:
            lines = [ln.rstrip() for ln in f if " ERROR " in ln or " WARN " in ln]
    except OSError:
        return ""
    return ("\n  %s (errors and warnings):\n    " % lx["log"] + "\n    ".join(lines[-n:])) if lines else ""


def load_ct(ctdir):
    try:
        with open(os.path.join(ctdir, "ct.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
