"""The state file (state.json: what `launch` started) and the proof that a process is ours: the leader by its
start time, the group's other members by the random launch id in their environment, each proven again through a
pidfd right before a signal. Also the server's recorded exit code and last_failure.json (note_failure)."""

import os
import time

from .core import LAUNCH_ID_VAR, loads, now
from .files import UnsafeDirectory, read_state_file, remove_owned, write_json_atomic
from .procs import alive, descends_from, pids, proc_env_has, proc_pgid, proc_starttime
from .systemd import systemd_running, unit_show


def read_json_state(path):
    """A state file deploy wrote, as a JSON object, read by files.read_state_file's rules (its directory root's and
    private, the file regular, root-owned, no symlinks): -> (the object, None); (None, None) when there is none;
    (None, the exception) when it may not be used (unsafe, unreadable, not JSON, not an object)."""
    try:
        st = loads(read_state_file(path).decode("utf-8", "replace"))
    except FileNotFoundError:
        return None, None
    except (UnsafeDirectory, OSError, ValueError) as e:
        return None, e
    return (st, None) if isinstance(st, dict) else (None, ValueError("not a JSON object"))


def read_state(state_dir):
    path = os.path.join(state_dir, "state.json")
    st, err = read_json_state(path)
    if err is not None:
        return {"corrupt": str(err), "path": path, **({"unsafe": True} if isinstance(err, UnsafeDirectory) else {})}
    if st is None:
        return None
    if st.get("unit") and systemd_running():
        # systemd may have restarted the server (or the container booted): the unit's MainPID is the process now
        u = st["unit_state"] = unit_show(st["unit"])
        main = int(u.get("MainPID") or 0)
        st["pid"] = st["pgid"] = main or None
        st["starttime"] = proc_starttime(main) if main else None
    pid = st.get("pid")
    st["ours"] = ours(st)
    st["alive"] = bool(pid) and alive(pid) and st["ours"]
    return st


def ours(st):
    """Is the process the state file names still the one we launched? Its leader's start time must match: after
    a reboot, or once the pid is reused, a group with that id belongs to someone else."""
    pid = st.get("pid")
    if not pid or st.get("starttime") is None:
        return False
    return proc_starttime(pid) == st.get("starttime")


def proven(st, p):
    """Is process p one that deploy launched for this state file? The leader by its start time; the others by
    their group and the launch id in their environment (or, for state files from before launch ids, by the leader
    being proven: while one member of a group lives, its id cannot be handed to a new group)."""
    if not st.get("pgid") or proc_pgid(p) != st["pgid"] or not alive(p):
        return False
    if p == st.get("pid") or not st.get("launch_id"):
        return ours(st)
    if proc_env_has(p, LAUNCH_ID_VAR, st["launch_id"]):
        return True
    # vLLM titles its processes with setproctitle ("VLLM::EngineCore", "VLLM::Worker"), which overwrites the block
    # /proc/PID/environ shows unless SPT_NOENV is set (launch sets it; a server started by an older deploy, or
    # whose env dropped it, has no readable launch id): a descendant of the proven leader, by the kernel's own
    # process tree, is ours all the same (its parent is alive, so its pid cannot have been reused)
    return descends_from(p, st.get("pid")) and ours(st)


def proven_members(st):
    return [p for p in pids() if proven(st, p)] if st.get("pgid") else []


def signal_proven(st, sig):
    """Signal each proven process through a pidfd opened, then proven again, so the signal reaches exactly the
    process that was checked even if it exits and its pid is reused in between (os.kill where pidfds are missing).
    -> the pids signalled."""
    import signal  # here: status, which imports this module, signals nothing

    done = []
    for p in proven_members(st):
        fd = None
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            try:
                fd = os.pidfd_open(p)
            except OSError:
                fd = None
        try:
            if not proven(st, p):  # proven again, now that the pidfd pins the process
                continue
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(p, sig)
            done.append(p)
        except (ProcessLookupError, PermissionError):
            pass
        finally:
            if fd is not None:
                os.close(fd)
    return done


def _group_members(pgid):
    return [p for p in pids() if proc_pgid(p) == pgid and alive(p)]


def read_exit_code(state_dir, wait_s=1.0):
    if not state_dir:
        return None
    deadline = now() + wait_s
    while True:
        try:
            with open(os.path.join(state_dir, "exit_code")) as fh:
                return int(fh.read().strip())
        except (OSError, ValueError):
            if now() >= deadline:
                return None
            time.sleep(0.05)


def act_note_failure(a):
    """Record that an up/restart failed after changing something, for `deploy status` to report; with no
    failure (after a successful down), forget the last one."""
    if not a.get("failure"):
        for name in ("last_failure.json", "rejected.json"):  # a deliberate down ends both stories
            remove_owned(a["state_dir"], name)
        return {"ok": True}
    write_json_atomic(os.path.join(a["state_dir"], "last_failure.json"), dict(a["failure"], at=now()))
    return {"ok": True}
