"""systemd, where it supervises vLLM in the container (/run/systemd/system exists exactly when systemd is init):
`launch` installs vllm-PLAYBOOK.service (launch.py), which systemd restarts on a crash (Restart=on-failure, bounded
by the start limit), starts at boot (WantedBy=multi-user.target) and stops as a whole (KillMode=control-group).
Here: systemctl and journalctl with deadlines, the unit text and its quoting, stop + disable, the unit's cgroup,
and what systemd says about a state file's unit (supervision). See docs/domain/systemd-in-containers.md."""

import json
import os
import re
import signal
import subprocess

from .core import ANSI, clean
from .procs import _boot_time, init_starttime, pids, proc_starttime


UNIT_DIR = "/etc/systemd/system"


EXIT_MESSAGE_ID = "98e322203f7a4ed290d09fe03c09fe15"  # systemd: "UNIT: Main process exited, code=..., status=..."


UNIT_PROPS = ("MainPID", "NRestarts", "ActiveState", "SubState", "Result", "ExecMainStatus", "ExecMainCode",
              "ActiveEnterTimestamp", "UnitFileState", "InvocationID", "LoadState")


def systemd_running():
    return os.path.isdir("/run/systemd/system")


def systemctl(args, timeout=60):
    """-> (returncode, stdout+stderr) of `systemctl ARGS`, bounded by a deadline."""
    try:
        p = subprocess.run(["systemctl"] + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "systemctl %s: no answer within %gs" % (" ".join(args), timeout)
    except OSError as e:
        return 127, "cannot run systemctl: %s" % e.strerror
    return p.returncode, clean(p.stdout.decode("utf-8", "replace")).strip()


def unit_show(unit):
    """systemctl show UNIT's properties that deploy reads -> dict (empty where systemd does not answer)."""
    rc, out = systemctl(["show", unit, "--no-pager"] + ["-p" + p for p in UNIT_PROPS], timeout=20)
    if rc:
        return {}
    return dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)


def journal(args, timeout=20, limit=8 << 20):
    """journalctl ARGS --no-pager -> its stdout lines (control sequences stripped), [] where it fails."""
    try:
        p = subprocess.run(["journalctl", "--no-pager", "-q"] + list(args), stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return []
    return [ANSI.sub("", ln) for ln in p.stdout[-limit:].decode("utf-8", "replace").splitlines()]


def last_exit(unit):
    """The unit's last main-process exit from the journal: {"code": exited|killed|dumped, "status": N or signal
    name, "at": epoch seconds, "message": ...} or None. (systemctl show forgets it once systemd restarted it.)"""
    for ln in reversed(journal(["-o", "json", "-n", "1", "MESSAGE_ID=" + EXIT_MESSAGE_ID, "UNIT=" + unit])):
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        status = d.get("EXIT_STATUS")
        code = d.get("EXIT_CODE")
        if code in ("killed", "dumped") and status and status.isdigit():
            try:
                status = signal.Signals(int(status)).name
            except ValueError:
                pass
        elif status and status.isdigit():
            status = int(status)
        try:
            at = int(d.get("__REALTIME_TIMESTAMP")) / 1e6
        except (TypeError, ValueError):
            at = None
        return {"code": code, "status": status, "at": at, "message": clean(str(d.get("MESSAGE", "")))}
    return None


def unit_quote(arg):
    """One argument of ExecStart= / Environment=, double-quoted: systemd's C-style escapes for \\ and ", and %%
    and $$ so that neither specifiers nor variables are expanded (the argv is exactly the plan's)."""
    if "\n" in arg or "\0" in arg:
        raise ValueError("an argument with a newline or NUL cannot go into a unit file: %r" % arg[:80])
    return '"%s"' % arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")


def env_file_line(name, value):
    """NAME='value' for an EnvironmentFile: single quotes, so systemd expands nothing in it."""
    if "'" in value or "\n" in value or "\0" in value:
        raise ValueError("the value of %s has a quote or a newline: not supported in an environment file" % name)
    return "%s='%s'\n" % (name, value)


def unit_text(a, env, env_file):
    s = a["supervise"]
    lines = ["# Written by vllm-pve-deploy (`deploy up %s`): deploy rewrites it; edit the playbook, not this file."
             % a["playbook"],
             "[Unit]",
             "Description=vLLM for playbook %s (vllm-pve-deploy)" % a["playbook"],
             "After=network.target",
             "StartLimitBurst=%d" % int(s["start_limit_burst"]),
             "StartLimitIntervalSec=%gs" % float(s["start_limit_interval_s"]),
             "",
             "[Service]",
             "Type=simple",
             "ExecStart=" + " ".join(unit_quote(x) for x in a["argv"]),
             "WorkingDirectory=/"]
    lines += ["Environment=" + unit_quote("%s=%s" % (k, v)) for k, v in sorted(env.items())]
    lines += ["# secrets (API key, tokens): only in this 0600 file, never in the unit, the argv or the state file",
              "EnvironmentFile=" + env_file,
              "StandardOutput=journal",
              "StandardError=inherit",
              "SyslogIdentifier=vllm-%s" % a["playbook"],
              "KillMode=control-group",
              "TimeoutStopSec=%gs" % max(1.0, float(a.get("stop_grace_s", 30))),
              "Restart=on-failure",
              "# vLLM exits 0 when its engine dies: that is a crash here, not a clean stop",
              "RestartForceExitStatus=0",
              "RestartSec=%gs" % float(s["restart_sec"]),
              "",
              "[Install]",
              "WantedBy=multi-user.target",
              ""]
    return "\n".join(lines).encode()


def unit_stop(unit, timeout):
    """systemctl stop + disable (+ reset-failed): every process of the unit's cgroup ends (TimeoutStopSec, then
    SIGKILL); the unit no longer starts at boot. -> report dict."""
    rep = {"unit": unit}
    rc, out = systemctl(["stop", unit], timeout=timeout)
    rep["stop"] = {"rc": rc, "output": out[-1000:]}
    rc, out = systemctl(["disable", "--quiet", unit], timeout=30)
    rep["disable"] = {"rc": rc, "output": out[-1000:]}
    systemctl(["reset-failed", unit], timeout=30)
    u = unit_show(unit)
    rep.update(active=u.get("ActiveState"), enabled=u.get("UnitFileState"))
    return rep


def unit_cgroup_members(unit):
    """PIDs whose cgroup is the unit's (system.slice/UNIT): the processes systemd stops with it."""
    out = []
    needle = "/system.slice/%s" % unit
    for p in pids():
        try:
            with open("/proc/%d/cgroup" % p) as fh:
                if any(ln.rstrip("\n").endswith(needle) or (needle + "/") in ln for ln in fh):
                    out.append(p)
        except OSError:
            pass
    return out


def supervision(st):
    """What systemd says about a state file's unit: restarts, last exit, whether the serving process is the one
    that passed the gate, whether the container rebooted since `up`. None for the setsid path."""
    if not st or not st.get("unit"):
        return {"supervisor": "none", "systemd_running": systemd_running()}
    u = st.get("unit_state") or {}
    out = {"supervisor": "systemd", "unit": st["unit"], "active": u.get("ActiveState"), "sub": u.get("SubState"),
           "result": u.get("Result"), "enabled": u.get("UnitFileState"),
           "restarts": int(u["NRestarts"]) if (u.get("NRestarts") or "").isdigit() else None,
           "last_exit": last_exit(st["unit"]), "main_pid": int(u.get("MainPID") or 0) or None,
           "container_restarted": (st.get("init_starttime") is not None
                                   and init_starttime() != st.get("init_starttime")),
           "systemd_running": systemd_running()}
    # systemd 252 keeps Result=exit-code when the limit stops an automatic restart; it says so in the journal
    out["start_limit_hit"] = u.get("Result") == "start-limit-hit" or (
        u.get("ActiveState") == "failed" and any("repeated too quickly" in ln for ln in journal(
            ["UNIT=" + st["unit"], "_PID=1", "-o", "cat", "-n", "3"])))
    bt, stt = _boot_time(), proc_starttime(out["main_pid"]) if out["main_pid"] else None
    out["main_started_at"] = bt + stt / os.sysconf("SC_CLK_TCK") if bt and stt is not None else None
    launched = st.get("launched") or {}
    if out["main_pid"]:
        out["serving_passed_gate"] = (out["main_pid"] == launched.get("pid")
                                      and proc_starttime(out["main_pid"]) == launched.get("starttime"))
    else:
        out["serving_passed_gate"] = None
    return out


def unit_log_tail(unit, n, grep=None, exclude=None):
    if n <= 0:
        return []
    lines = journal(["-u", unit, "-o", "cat", "-n", str(n * (20 if grep or exclude else 1))], timeout=30)
    if grep:
        rx = re.compile(grep)
        lines = [ln for ln in lines if rx.search(ln)]
    if exclude:
        ex = re.compile(exclude)
        lines = [ln for ln in lines if not ex.search(ln)]
    return lines[-n:]
