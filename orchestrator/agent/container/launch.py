"""`launch`: start vLLM detached and record it in state.json. Under systemd as vllm-PLAYBOOK.service (secrets and
the launch id in a 0600 EnvironmentFile); without, with setsid, every stream redirected to a new 0600 log, and a
one-line sh wrapper that records the exit code."""

import base64
import os
import subprocess

from .core import LAUNCH_ID_VAR, now
from .files import UnsafeDirectory, open_dir, write_json_atomic, write_owned
from .procs import init_starttime, proc_starttime
from .systemd import UNIT_DIR, env_file_line, systemctl, systemd_running, unit_show, unit_text
from . import core


LAUNCH_WRAPPER = '"$@" </dev/null; echo $? >&0'


def act_launch(a):
    """Start vLLM detached (setsid, every stream redirected) and record it in the state file."""
    state_dir, log_path = a["state_dir"], a["log_path"]
    try:
        dfd = open_dir(state_dir, 0o700)
    except UnsafeDirectory as e:
        return {"ok": False, "message": "refusing to use the state directory: %s" % e}
    launch_id = base64.b32encode(os.urandom(15)).decode().lower()
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", **(a.get("env") or {}), **(core.SECRETS.get("env") or {}), LAUNCH_ID_VAR: launch_id}
    if a.get("unit") and systemd_running():
        os.close(dfd)  # the state directory is checked: write_owned writes in it by name, checking it again
        r = _launch_unit(a, env, launch_id)
        if r.get("ok"):
            _record(a, r["pid"], env, launch_id, log_path=None, supervisor="systemd", unit=r["unit"],
                    unit_path=r["unit_path"], env_file=r["env_file"], unit_sha256=r["unit_sha256"],
                    invocation=r.get("invocation"))
            r.update(pgid=r["pid"], log_path="journal: journalctl -u %s" % r["unit"])
        return r
    try:
        if os.path.dirname(log_path) != state_dir.rstrip("/"):
            return {"ok": False, "message": "the log %s must be in the state directory %s" % (log_path, state_dir)}
        logname = os.path.basename(log_path)
        try:
            os.rename(logname, logname + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            pass
        for old in ("exit_code", logname):
            try:
                os.unlink(old, dir_fd=dfd)
            except FileNotFoundError:
                pass
        # The log and the exit file are created here, new (O_EXCL, O_NOFOLLOW, 0600), and handed to the wrapper as
        # open fds: nothing is opened by name after this agent is gone.
        logfd = os.open(logname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, 0o600,
                        dir_fd=dfd)
        exitfd = os.open("exit_code", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        os.fchmod(logfd, 0o600)
        os.fchmod(exitfd, 0o600)
    except OSError as e:
        os.close(dfd)
        return {"ok": False, "message": "cannot prepare %s: %s" % (state_dir, e.strerror)}
    # A one-line sh wrapper leads the new session and records the server's exit status on its stdin, the exit file
    # opened for writing (the server itself reads /dev/null): an exit, even with code 0, is a failure the tool must
    # be able to report after this agent is gone. An empty exit_code file means "not exited yet". The script is a
    # constant: nothing is formatted into shell text (tests/unit/test_no_shell_text.py).
    wrapped = ["/bin/sh", "-c", LAUNCH_WRAPPER, "vllm-pve-deploy"] + list(a["argv"])
    try:
        proc = subprocess.Popen(wrapped, stdin=exitfd, stdout=logfd, stderr=subprocess.STDOUT, env=env,
                                cwd="/", start_new_session=True, close_fds=True)
    except OSError as e:
        return {"ok": False, "message": "cannot start %s: %s" % (a["argv"][0], e.strerror)}
    finally:
        for fd in (logfd, exitfd, dfd):
            os.close(fd)
    _record(a, proc.pid, env, launch_id, log_path=log_path, supervisor="none")
    return {"ok": True, "pid": proc.pid, "pgid": proc.pid, "log_path": log_path, "supervisor": "none",
            "systemd": systemd_running()}


def _record(a, pid, env, launch_id, log_path, supervisor, **unit):
    """state.json for the launch: the playbook's record, the process (its start time), how it was launched."""
    st = dict(a.get("record") or {})
    st.update(pid=pid, pgid=pid, argv=a["argv"], env_keys=sorted(env), log_path=log_path, started_at=now(),
              starttime=proc_starttime(pid), launch_id=launch_id, supervisor=supervisor, **unit)
    st.update(init_starttime=init_starttime(), launched={"pid": pid, "starttime": proc_starttime(pid)},
              argv0_real=os.path.realpath(a["argv"][0]))  # which venv it runs from (install-vllm switches links)
    write_json_atomic(os.path.join(a["state_dir"], "state.json"), st)


def _launch_unit(a, env, launch_id):
    """Install, enable and start vllm-PLAYBOOK.service. The caller's env minus the secrets goes into the unit
    (what `deploy plan` shows), the secrets and the launch id into a 0600 EnvironmentFile in the state dir."""
    state_dir = a["state_dir"]
    unit = a["unit"]
    secrets = {**(core.SECRETS.get("env") or {}), LAUNCH_ID_VAR: launch_id}
    plain = {k: v for k, v in env.items() if k not in secrets}
    env_name = unit.rsplit(".", 1)[0] + ".env"
    env_file = os.path.join(state_dir, env_name)
    res = {"supervisor": "systemd", "unit": unit, "unit_path": os.path.join(UNIT_DIR, unit), "env_file": env_file}
    try:
        write_owned(state_dir, env_name, "".join(env_file_line(k, v) for k, v in sorted(secrets.items())).encode(),
                    0o600)
        changed, sha = write_owned(UNIT_DIR, unit, unit_text(a, plain, env_file), 0o644)
    except (OSError, UnsafeDirectory, ValueError) as e:
        res.update(ok=False, message="cannot write the unit: %s" % e)
        return res
    res.update(unit_changed=changed, unit_sha256=sha)
    steps = ([["daemon-reload"]] if changed else []) + [["reset-failed", unit], ["enable", "--quiet", unit],
                                                          ["start", unit]]
    for cmd in steps:
        rc, out = systemctl(cmd)
        if rc and cmd[0] != "reset-failed":
            res.update(ok=False, message="systemctl %s failed (exit %d): %s" % (" ".join(cmd), rc, out[-2000:]))
            return res
    u = unit_show(unit)
    pid = int(u.get("MainPID") or 0)
    if not pid:
        res.update(ok=False, message="systemctl start %s: no main process (ActiveState=%s, Result=%s)"
                                     % (unit, u.get("ActiveState"), u.get("Result")), unit_state=u)
        return res
    res.update(ok=True, pid=pid, invocation=u.get("InvocationID"))
    return res
