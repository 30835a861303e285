"""`logs`: the tail of vLLM's log (the file, or the unit's journal), filtered, and with `follow` new lines as
events until follow_s passes."""

import os
import re
import subprocess
import time

from .core import ANSI, emit, now
from .files import _read_json, _tail_lines, tail_file
from .systemd import systemd_running, unit_log_tail


def _unit_of(state_dir):
    """The unit named by the state file (running or stopped) when systemd runs here, else None."""
    if not state_dir or not systemd_running():
        return None
    for name in ("state.json", "state.stopped.json"):
        st = _read_json(os.path.join(state_dir, name))
        if st:
            return st.get("unit")
    return None


def act_logs(a):
    path, n, grep, exclude = a["log_path"], int(a.get("n", 50)), a.get("grep"), a.get("exclude")
    unit = _unit_of(a.get("state_dir"))
    lines = unit_log_tail(unit, n, grep, exclude) if unit else tail_file(path, n, grep, exclude)
    if not a.get("follow"):
        if unit:
            return {"lines": lines, "exists": True, "unit": unit, "source": "journalctl -u %s -o cat" % unit}
        return {"lines": lines, "exists": os.path.exists(path)}
    for ln in lines:
        emit(event="line", line=ln)
    rx = re.compile(grep) if grep else None
    ex = re.compile(exclude) if exclude else None
    deadline = now() + float(a.get("follow_s", 3600))

    def show(ln):
        if (rx is None or rx.search(ln)) and (ex is None or not ex.search(ln)):
            emit(event="line", line=ln)
    if unit:
        args = ["-u", unit, "-o", "cat", "-f", "-n", "0"]
        p = subprocess.Popen(["journalctl", "--no-pager", "-q"] + args, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            import selectors
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            while now() < deadline:
                if not sel.select(timeout=min(1.0, max(0.0, deadline - now()))):
                    continue
                raw = p.stdout.readline()
                if not raw:
                    break
                show(ANSI.sub("", raw.decode("utf-8", "replace").rstrip("\n")))
        finally:
            p.kill()
            p.wait()
        return {"followed_s": a.get("follow_s"), "unit": unit}
    pos = os.path.getsize(path) if os.path.exists(path) else 0
    while now() < deadline:
        pos, new = _tail_lines(path, pos)
        for ln in new:
            show(ln)
        time.sleep(0.25)
    return {"followed_s": a.get("follow_s")}
