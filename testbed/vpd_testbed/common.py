"""What the test bed's modules share (no imports of core or faults: no cycle)."""
from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

SSH_PORT = 2222
DRAFTER = "Qwen3.6-27B-DFlash"


class TestbedError(RuntimeError):
    """A test bed operation failed; the message says what to do."""

    __test__ = False  # not a pytest test class


def pids_alive(pids) -> list:
    out = []
    for p in pids:
        try:
            with open("/proc/%d/stat" % p) as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    out.append(p)
        except (OSError, ValueError, IndexError):
            pass
    return out


def port_open(addr, port, timeout=0.2) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_free(addr, port) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_net(first, stop):
    """A 127.77.N. prefix, N in range(first, stop), whose .1 port SSH_PORT is free (for a test bed of a test's own);
    None if there is none."""
    for n in range(first, stop):
        with socket.socket() as s:
            try:
                s.bind(("127.77.%d.1" % n, SSH_PORT))
                return "127.77.%d." % n
            except OSError:
                pass
    return None


def kill(pids, sig=signal.SIGKILL):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def log_tail(path, lines=8) -> str:
    """The last lines of a test bed process's log, for an error message ('' when it has none)."""
    try:
        text = Path(path).read_text(errors="replace").rstrip()
    except OSError:
        return ""
    tail = text.splitlines()[-lines:]
    return ("\n  last lines of %s:\n    " % path + "\n    ".join(tail)) if tail else ""


def wait_until(cond, timeout, what, interval=0.005, log=None):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise TestbedError("timed out after %.1f s waiting for %s%s"
                               % (timeout, what, log_tail(log) if log else ""))
        time.sleep(interval)


def read_pid(path):
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def write_user_space(ctdir, version: str) -> None:
    """The container's NVIDIA user-space libraries, as a driver .run installs them (empty stand-ins: nothing
    loads them), in CTDIR/nvlib, seen at /usr/lib/x86_64-linux-gnu/nvidia/current (Debian's place for them)."""
    d = Path(ctdir) / "nvlib"
    d.mkdir(exist_ok=True)
    for f in os.listdir(d):
        if f.startswith(("libnvidia-ml.so.", "libcuda.so.")):
            os.unlink(d / f)
    for lib in ("libnvidia-ml.so.", "libcuda.so."):
        (d / (lib + version)).write_text("")
