"""Processes, read from /proc: command lines, names, stat fields (group, start time), liveness, environments, and
the vLLM processes of this container (zombies excluded)."""

import os

from .core import LazyRe, clean


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            raw = fh.read()
        return clean(raw.replace(b"\0", b" ").decode("utf-8", "replace")).strip()
    except OSError:
        return ""


def proc_comm(pid):
    try:
        with open("/proc/%d/comm" % pid, encoding="utf-8", errors="replace") as fh:
            return clean(fh.read()).strip()
    except OSError:
        return ""


def proc_name(pid):
    """comm is cut at 15 characters (VLLM::EngineCor); the rewritten argv[0] is not."""
    comm, cmd = proc_comm(pid), proc_cmdline(pid)
    first = cmd.split(" ", 1)[0] if cmd else ""
    return first if first.startswith(comm) and len(comm) >= 15 else comm


def proc_stat(pid):
    """The fields of /proc/PID/stat after the command name (state first), or None if it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            stat = fh.read()
        return stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def proc_ppid(pid):
    f = proc_stat(pid)
    try:
        return int(f[1]) if f else None
    except (IndexError, ValueError):
        return None


def descends_from(pid, ancestor, depth=16):
    """Is ancestor on pid's parent chain (the kernel's process tree, at most `depth` levels up)?"""
    for _ in range(depth):
        pid = proc_ppid(pid)
        if not pid or pid <= 1:
            return False
        if pid == ancestor:
            return True
    return False


def proc_pgid(pid):
    f = proc_stat(pid)
    return int(f[2]) if f and len(f) > 2 else None


def proc_starttime(pid):
    f = proc_stat(pid)
    return int(f[19]) if f and len(f) > 19 else None


def alive(pid):
    f = proc_stat(pid) if pid else None
    return bool(f) and f[0] != "Z"


def pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


VLLM_SERVE = LazyRe(r"(^|/)vllm serve")


def vllm_processes():
    """Live vLLM processes; zombies (exited, not yet reaped: a stopped group's workers) are not processes to report."""
    out = []
    for pid in pids():
        if not alive(pid):
            continue
        comm = proc_comm(pid)
        cmd = proc_cmdline(pid)
        if comm.startswith("VLLM::") or cmd.startswith("VLLM::") or VLLM_SERVE.search(cmd):
            out.append({"pid": pid, "comm": comm, "cmdline": cmd[:300]})
    return out


def proc_env_has(pid, name, value):
    """Does /proc/PID/environ hold name=value? Readable only by the process's owner and root, so an unprivileged
    user can neither read our launch id nor forge it."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return ("%s=%s" % (name, value)).encode() in env


def init_starttime():
    return proc_starttime(1)


def _argv(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [x.decode("utf-8", "replace") for x in fh.read().split(b"\0") if x]
    except OSError:
        return []


def _environ(pid, names):
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            env = dict(e.decode("utf-8", "replace").split("=", 1) for e in fh.read().split(b"\0") if b"=" in e)
    except OSError:
        return {}
    return {k: env[k] for k in names if k in env}


def _boot_time():
    try:
        with open("/proc/stat") as fh:
            for ln in fh:
                if ln.startswith("btime "):
                    return int(ln.split()[1])
    except OSError:
        pass
    return None
