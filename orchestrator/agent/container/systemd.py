"""systemd, where it supervises vLLM in the container (/run/systemd/system exists exactly when systemd is init):
`launch` installs vllm-PLAYBOOK.service (launch.py), which systemd restarts on a crash (Restart=on-failure, bounded
by the start limit), starts at boot (WantedBy=multi-user.target) and stops as a whole (KillMode=control-group).
Here: systemctl and journalctl with deadlines, the unit text and its quoting, stop + disable, the unit's cgroup,
and what systemd says about a state file's unit (supervision). See docs/domain/systemd-in-containers.md."""

import os
import time

from .core import ANSI, clean, loads
from .files import last_lines
from .procs import _boot_time, init_starttime, pids, proc_starttime


UNIT_DIR = "/etc/systemd/system"
EXIT_MESSAGE_ID = "98e322203f7a4ed290d09fe03c09fe15"  # systemd: "UNIT: Main process exited, code=..., status=..."
UNIT_PROPS = ("MainPID", "NRestarts", "ActiveState", "SubState", "Result", "ExecMainStatus", "ExecMainCode",
              "ExecMainExitTimestampMonotonic", "ActiveEnterTimestamp", "UnitFileState", "InvocationID", "LoadState",
              "Id")


def systemd_running():
    return os.path.isdir("/run/systemd/system")


def systemctl(args, timeout=60):
    """-> (returncode, stdout+stderr) of `systemctl ARGS`, bounded by a deadline."""
    import subprocess  # here: a status exec in a container without systemd never runs it

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
    import subprocess

    try:
        p = subprocess.run(["journalctl", "--no-pager", "-q"] + list(args), stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return []
    return [ANSI.sub("", ln) for ln in p.stdout[-limit:].decode("utf-8", "replace").splitlines()]


SUCCESS_MESSAGE_ID = "7ad2d189f7e94e70a38c781354912448"  # systemd: "UNIT: Deactivated successfully."
FAILURE_MESSAGE_ID = "d9b373ed55a64feb8242e02dbe79a49c"  # systemd: "UNIT: Failed with result 'RESULT'."
_CLD = {"1": "exited", "2": "killed", "3": "dumped"}  # ExecMainCode (siginfo CLD_*)


def _exit_status(code, status):
    if code in ("killed", "dumped") and status and str(status).isdigit():
        import signal

        try:
            return signal.Signals(int(status)).name
        except ValueError:
            return status
    return int(status) if status is not None and str(status).isdigit() else status


def pick_last_exit(entries, unit_state=None, since=None):
    """The last main-process exit of THIS launch (issue 26): systemd's own journal entries about the unit since
    the launch (oldest first, dicts of journalctl -o json), and `systemctl show`'s ExecMain* (which describe the
    current main process: an exit there is newer than any journal line). systemd logs no "Main process exited"
    for an exit it counts as clean (status 0: how vLLM exits when its engine dies), only "Deactivated
    successfully"; a plain failure is "Main process exited" followed by "Failed with result". -> {"code", "status",
    "at", "message"} or None (no exit since the launch)."""
    u = unit_state or {}
    mono = u.get("ExecMainExitTimestampMonotonic") or "0"
    if mono.isdigit() and int(mono) > 0 and _CLD.get(u.get("ExecMainCode") or ""):
        at = time.time() - (time.monotonic() - int(mono) / 1e6)
        if since is None or at >= since - 1:
            code = _CLD[u["ExecMainCode"]]
            return {"code": code, "status": _exit_status(code, u.get("ExecMainStatus")), "at": round(at, 3),
                    "message": "systemctl show %s: ExecMainCode=%s ExecMainStatus=%s"
                               % (u.get("Id") or "UNIT", code, u.get("ExecMainStatus"))}
    for d in reversed(entries):
        mid, msg = d.get("MESSAGE_ID"), d.get("MESSAGE")
        msg = clean(msg) if isinstance(msg, str) else ""
        try:
            at = int(d.get("__REALTIME_TIMESTAMP")) / 1e6
        except (TypeError, ValueError):
            at = None
        if mid == EXIT_MESSAGE_ID:
            code = d.get("EXIT_CODE")
            return {"code": code, "status": _exit_status(code, d.get("EXIT_STATUS")), "at": at, "message": msg}
        if mid == SUCCESS_MESSAGE_ID or msg.endswith("Deactivated successfully."):
            return {"code": "exited", "status": 0, "at": at, "message": msg}
        if mid == FAILURE_MESSAGE_ID or "Failed with result" in msg:
            continue  # its "Main process exited" comes just before it; a result with none is not an exit
    return None


def _journal_json(args, since):
    """journalctl -o json ARGS, since `since` (epoch seconds) when given -> its entries (a line not JSON left out)."""
    out = []
    for ln in journal(args + (["--since", "@%d" % int(since)] if since else [])):
        try:
            out.append(loads(ln))
        except ValueError:
            continue
    return out


def last_exit(unit, unit_state=None, since=None):
    """The unit's last main-process exit since `since` (the launch, epoch seconds): see pick_last_exit."""
    entries = _journal_json(["-o", "json", "-n", "200", "UNIT=" + unit, "_PID=1"], since)
    return pick_last_exit(entries, unit_state, since)


def unit_error_entries(unit, since):
    """The server's own lines (not systemd's about it) since the launch -> [(invocation id, line)]."""
    entries = _journal_json(["_SYSTEMD_UNIT=" + unit, "-o", "json", "-n", "400",
                             "--output-fields=MESSAGE,_SYSTEMD_INVOCATION_ID"], since)
    return [(d.get("_SYSTEMD_INVOCATION_ID"), clean(d["MESSAGE"])) for d in entries
            if isinstance(d.get("MESSAGE"), str)]


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
           "last_exit": last_exit(st["unit"], u, st.get("started_at")), "main_pid": int(u.get("MainPID") or 0) or None,
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
    out["serving_passed_gate"] = None if not out["main_pid"] else \
        out["main_pid"] == launched.get("pid") and stt == launched.get("starttime")
    return out


def unit_log_tail(unit, n, grep=None, exclude=None):
    if n <= 0:
        return []
    return last_lines(journal(["-u", unit, "-o", "cat", "-n", str(n * (20 if grep or exclude else 1))], timeout=30), n,
                      grep, exclude)
