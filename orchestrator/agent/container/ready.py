"""`wait_ready`: follow vLLM's log (the file, or the unit's journal for this invocation only) while polling
/health; stop at once on a known fatal text or an exit; ready means a completion succeeded."""

import json
import re
import time

from .core import emit, now
from .files import _tail_lines, write_json_atomic
from .net import http, listener_check, serving_host
from .procs import alive
from .state import read_exit_code, read_state
from .systemd import journal, last_exit, unit_show
from . import core


def act_wait_ready(a):
    """Follow the log while polling /health; stop at once on a fatal text or an exit; ready = a completion."""
    st = state = read_state(a["state_dir"]) or {}
    pid, port, log_path = int(st.get("pid") or 0), int(a["port"]), a["log_path"]
    host = serving_host(st)
    if not pid:
        return {"ready": False, "reason": "no_state", "message": "no state file in %s" % a["state_dir"]}
    deadline = now() + float(a["timeout_s"])
    fatal = [(re.compile(p["regex"]), p) for p in a["fatal"]]
    phases = [(re.compile(p["regex"]), p["phase"]) for p in a["phases"]]
    aux_re = re.compile(a["aux_regex"])
    api_key = core.SECRETS.get("api_key")
    last_lines, aux, seen_phases, mem_lines = [], None, [], []
    log = LogReader(st, log_path)
    t0 = now()
    ready_http = False

    def scan(lines):
        """Progress phases, the taps line, and the first fatal text (its result), for new log lines."""
        nonlocal last_lines, aux
        for ln in lines:
            last_lines = (last_lines + [ln])[-40:]
            if len(mem_lines) < 12 and any(k in ln for k in MEMORY_MARKS):
                mem_lines.append(ln[-300:])
            for rx, ph in phases:
                m = rx.search(ln)
                if m and ph not in seen_phases:
                    seen_phases.append(ph)
                    emit(event="phase", phase=ph, line=ln[m.start():], elapsed=round(now() - t0, 1))
            m = aux_re.search(ln)
            if m:
                aux = [int(x) for x in re.findall(r"-?\d+", m.group(1))]
            for rx, info in fatal:
                if rx.search(ln):
                    return {"ready": False, "reason": "fatal", "cause": info["cause"], "fix": info["fix"],
                            "line": ln if len(ln) <= 4000 else
                            ln[:4000] + " ... (%d more characters: deploy logs)" % (len(ln) - 4000),
                            "log_tail": last_lines[-15:],
                            "seconds": round(now() - t0, 1), "alive": alive(pid), "phases": seen_phases}
        return None

    last_beat = now()
    while True:
        failed = scan(log.read())
        if failed:
            return failed
        if now() - last_beat >= float(a.get("heartbeat_s", 10)):  # a 27B model loads for minutes: show life
            last_beat = now()
            emit(event="waiting", elapsed=round(now() - t0, 1), line=(last_lines[-1] if last_lines else "")[-4000:])
        if not alive(pid):
            # read what is left of the log first: the fatal line may be the last thing it wrote (journald may
            # still be storing the last lines: read until nothing new came for a moment, at most 2 s)
            quiet_until, give_up = now() + (0.4 if log.unit else 0), now() + 2
            while True:
                lines = log.read()
                failed = scan(lines)
                if failed:
                    return failed
                if lines:
                    quiet_until = now() + (0.4 if log.unit else 0)
                if now() >= quiet_until or now() >= give_up:
                    break
                time.sleep(0.1)
            res = {"ready": False, "reason": "exited", "log_tail": last_lines[-15:],
                   "seconds": round(now() - t0, 1), "phases": seen_phases}
            if log.unit:
                ex = last_exit(log.unit, unit_show(log.unit), st.get("started_at"))
                res["last_exit"] = ex
                res["exit_code"] = (ex or {}).get("status") if (ex or {}).get("code") == "exited" else None
                res["unit"] = log.unit
            else:
                res["exit_code"] = read_exit_code(a.get("state_dir"))
            return res
        if not ready_http:
            st, body = http(port, "/health", timeout=2, host=host)
            if st == 200:
                ready_http = True
                emit(event="phase", phase="health", line="/health 200", elapsed=round(now() - t0, 1))
        if ready_http and api_key:
            ok, problem = listener_check(state, port)
            if not ok:
                return {"ready": False, "reason": "foreign_listener", "message": problem,
                        "seconds": round(now() - t0, 1), "alive": alive(pid)}
        if ready_http:
            st, body = http(port, "/v1/models", timeout=5, api_key=api_key, host=host)
            models = []
            if st == 200:
                try:
                    models = [m.get("id") for m in json.loads(body).get("data", [])]
                except (ValueError, AttributeError):
                    models = []
            if a["served_model_name"] in models:
                st, body = http(port, "/v1/completions", "POST",
                                {"model": a["served_model_name"], "prompt": "Hello", "max_tokens": 8},
                                timeout=60, api_key=api_key, host=host)
                if st == 200:
                    keep_memory_lines(a["state_dir"], state, mem_lines)
                    return {"ready": True, "seconds": round(now() - t0, 1), "models": models, "aux_layers": aux,
                            "phases": seen_phases}
                if st in (401, 403):
                    return {"ready": False, "reason": "auth", "status": st, "body": body[:300],
                            "seconds": round(now() - t0, 1)}
            elif st == 200:
                return {"ready": False, "reason": "model_missing", "models": models,
                        "seconds": round(now() - t0, 1)}
        if now() >= deadline:
            return {"ready": False, "reason": "timeout", "log_tail": last_lines[-15:], "phases": seen_phases,
                    "seconds": round(now() - t0, 1), "alive": alive(pid)}
        time.sleep(0.2)


# vLLM's memory lines (weights, KV cache), kept for `deploy status` once the launch serves (issue 35)
MEMORY_MARKS = ("Model loading took", "Available KV cache memory", "KV cache size:")


def keep_memory_lines(state_dir, st, lines):
    """STATE_DIR/memory.json: this launch's memory lines (its pid and start, so status shows only its own)."""
    try:
        write_json_atomic(state_dir.rstrip("/") + "/memory.json",
                          {"pid": st.get("pid"), "started_at": st.get("started_at"), "lines": lines})
    except (OSError, ValueError):
        pass  # a figure for status, never a reason to fail the launch


class LogReader:
    """New log lines of a launch: from the log file (setsid path) or the unit's journal (systemd path, this
    invocation only, so an earlier run's fatal line is never taken for this one's)."""

    def __init__(self, st, log_path):
        self.unit = (st or {}).get("unit")
        self.invocation = (st or {}).get("invocation")
        self.path = log_path
        self.pos = 0
        self.cursor = None

    def read(self):
        if not self.unit:
            self.pos, lines = _tail_lines(self.path, self.pos)
            return lines
        args = ["-o", "cat", "--show-cursor"]
        args += ["_SYSTEMD_INVOCATION_ID=" + self.invocation] if self.invocation else ["-u", self.unit]
        if self.cursor:
            args += ["--after-cursor", self.cursor]
        out = journal(args, timeout=10)
        if out and out[-1].startswith("-- cursor: "):
            self.cursor = out.pop()[len("-- cursor: "):].strip()
        return out
