"""`stop`: end what the state file says deploy launched, and only that. Under systemd: systemctl stop + disable of
the unit. Without: SIGTERM to each proven process, a grace period, SIGKILL to what is left (proven again); then
wait until the group has left. Foreign vLLM processes are reported, never signalled."""

import os
import signal

from .core import emit, now, wait_while
from .files import UnsafeDirectory, open_dir, remove_owned
from .gpus import fuser_kill, gpu_holders, read_gpu_memory
from .procs import proc_cmdline, proc_name, vllm_processes
from .state import _group_members, proven_members, read_state, signal_proven
from .systemd import systemd_running, unit_cgroup_members, unit_stop


def act_stop(a):
    """Stop what the state file says we launched, and only that: SIGTERM each proven process, grace, SIGKILL
    what is left of them (proven again), then report leftovers. fuser -k only with clean_gpus, only on the
    playbook's own /dev/nvidiaN."""
    state_dir = a["state_dir"]
    grace = float(a.get("grace_s", 30))
    st = read_state(state_dir)
    report = {"state": None, "terminated": [], "killed": [], "leftovers": [], "fuser": None, "seconds": 0}
    t0 = now()
    mem = read_gpu_memory(float(a.get("nvidia_smi_timeout_s", 5)))
    report["gpu_before"] = {str(g): v for g, v in mem.get("gpus", {}).items()} if "gpus" in mem else None
    if st and not st.get("corrupt") and a.get("only_playbook") and st.get("playbook") != a["only_playbook"]:
        return {"refused": ("this container runs %s (pid %s), not %s" if st.get("alive") else
                            "this container's state file names %s (pid %s, not running), not %s")
                           % (st.get("playbook"), st.get("pid"), a["only_playbook"]),
                "running": st.get("playbook")}
    if st and not st.get("corrupt") and st.get("unit"):
        # systemd's unit: `systemctl stop` ends every process of its cgroup (SIGTERM, TimeoutStopSec = the grace,
        # then SIGKILL), `disable` keeps it from starting at the next boot
        report["state"] = {k: st.get(k) for k in ("pid", "pgid", "playbook", "started_at", "alive", "unit")}
        members = unit_cgroup_members(st["unit"])
        report["terminated"] = [{"pid": p, "comm": proc_name(p)} for p in members]
        if systemd_running():
            emit(event="stop", message="systemctl stop %s (%d process(es) in its cgroup), then disable"
                                       % (st["unit"], len(members)))
            report["unit"] = unit_stop(st["unit"], grace + 30)
            if st.get("env_file"):  # the secrets are not kept once nothing uses them
                report["unit"]["env_file_removed"] = remove_owned(os.path.dirname(st["env_file"]),
                                                                  os.path.basename(st["env_file"]))
            if report["unit"]["stop"]["rc"]:
                report["unit_problem"] = "systemctl stop %s failed: %s" % (st["unit"], report["unit"]["stop"]["output"])
            report["cgroup_left"] = [{"pid": p, "comm": proc_name(p)} for p in unit_cgroup_members(st["unit"])]
        else:
            report["unit_problem"] = ("the state file names unit %s but systemd is not running in this container "
                                      "now; nothing was stopped through it" % st["unit"])
    elif st and not st.get("corrupt"):
        report["state"] = {k: st.get(k) for k in ("pid", "pgid", "playbook", "started_at", "alive")}
        members = proven_members(st)
        if not members and st.get("pgid") and _group_members(st["pgid"]):
            report["not_ours"] = ("the state file names process group %s (leader pid %s), but the processes now in "
                                  "that group are not the ones deploy started (start time or launch id differ: a "
                                  "reboot or a reused pid); nothing was signalled" % (st["pgid"], st.get("pid")))
            emit(event="stop", message=report["not_ours"])
        elif members:
            report["terminated"] = [{"pid": p, "comm": proc_name(p)} for p in members]
            sent = report["sigterm"] = signal_proven(st, signal.SIGTERM)
            gone = len(members) - len(sent)  # issue 26: one count, the same in the event and the summary
            emit(event="stop", message="SIGTERM sent to process group %d: %d of the %d process(es) deploy started "
                                       "there%s" % (st["pgid"], len(sent), len(members),
                                                    " (the other %d were already exiting)" % gone if gone else ""))
            wait_while(lambda: proven_members(st), grace, 0.1)
            left = proven_members(st)
            if left:
                report["killed"] = [{"pid": p, "comm": proc_name(p), "cmdline": proc_cmdline(p)[:200]} for p in left]
                emit(event="stop", message="%d process(es) ignored SIGTERM for %gs; SIGKILL" % (len(left), grace))
                signal_proven(st, signal.SIGKILL)
                wait_while(lambda: proven_members(st), 10)
            # A process on its way out can no longer be proven (its environ and cmdline are gone) but still holds
            # its /dev/nvidia* fds for a moment: wait, without signalling anything, until the group has left.
            wait_while(lambda: _group_members(st["pgid"]), min(max(grace, 1.0), 10.0))
    elif st and st.get("corrupt"):
        report["state_error"] = st["corrupt"]
    # vLLM processes outside our recorded group were not started by deploy: never signalled here. They are
    # reported; if they hold the GPUs, gpus-free names them and --clean-gpus (an explicit opt-in) frees the devices.
    report["leftovers"] = gpu_holders()
    if a.get("clean_gpus") and report["leftovers"]:
        report["fuser"] = fuser_kill(a.get("gpus"), float(a.get("fuser_grace_s", 5)))
        report["leftovers"] = gpu_holders()
    # after fuser: what it killed is not "left alone" (issue 26)
    killed = set((report["fuser"] or {}).get("term") or []) | set((report["fuser"] or {}).get("kill") or [])
    report["foreign"] = [p for p in vllm_processes() if p["pid"] != os.getpid() and p["pid"] not in killed]
    if st is not None and not st.get("unsafe"):
        try:
            dfd = open_dir(state_dir)
            try:
                os.rename("state.json", "state.stopped.json", src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        except (OSError, UnsafeDirectory):
            pass
    report["seconds"] = round(now() - t0, 3)
    return report
