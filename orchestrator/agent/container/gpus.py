"""GPUs: nvidia-smi with a deadline, the processes holding /dev/nvidia*, `gpus_free` (poll until the playbook's
GPUs are under the threshold), and fuser -k on the playbook's own /dev/nvidiaN (only with clean_gpus, only inside
a container, never on a Proxmox host)."""

import os
import time

from . import core
from .core import emit, in_container, now, wait_while
from .procs import pids, proc_cmdline, proc_comm
from .protocol import SMI_MEMORY_ARGS
from .state import proven_members, read_state
from .systemd import systemd_running, unit_cgroup_members


def nvidia_smi(args, timeout):
    """Run nvidia-smi with a timeout; returns (rc, stdout, stderr, timed_out). A run of the same arguments that the
    exec's preamble started already (core.EARLY, `deploy status`) is adopted, once, as if started here."""
    early = core.EARLY.pop("nvidia-smi", None)
    try:
        if early is not None and list(early[0]) == list(args):
            if isinstance(early[1], OSError):
                raise early[1]
            return _wait_spawned(*early[1], timeout=timeout)
        import subprocess  # here: a status exec adopts the preamble's run and never loads it

        p = subprocess.Popen(["nvidia-smi"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL)
        with p:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()  # as subprocess.run does: kill, then reap
                p.wait()
                return None, "", "", True
        return p.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), False
    except OSError as e:
        return 127, "", str(e), False


def _wait_spawned(pid, out_fd, err_fd, timeout):
    """The preamble's nvidia-smi (os.posix_spawnp, call.py EARLY_SMI): both pipes read until they close and the
    process reaped, within `timeout`; past it, killed and reaped as subprocess.run does. -> nvidia_smi's tuple."""
    import select

    bufs = {out_fd: [], err_fd: []}
    poll = select.poll()
    for fd in bufs:
        poll.register(fd, select.POLLIN)
    deadline = now() + timeout
    status, done = None, 0
    try:
        open_fds = set(bufs)
        while open_fds:
            events = poll.poll(max(0.0, deadline - now()) * 1000)
            if not events and now() >= deadline:
                break
            for fd, _ in events:
                chunk = os.read(fd, 65536)
                if chunk:
                    bufs[fd].append(chunk)
                else:
                    poll.unregister(fd)
                    open_fds.discard(fd)
        while not open_fds:  # output complete: reap it (it may linger a moment after closing its pipes)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done or now() >= deadline:
                break
            time.sleep(0.005)
        if status is None or not done:
            os.kill(pid, 9)  # SIGKILL (the signal module would cost an import), then reap
            os.waitpid(pid, 0)
            return None, "", "", True
    finally:
        os.close(out_fd)
        os.close(err_fd)
    return (os.waitstatus_to_exitcode(status), b"".join(bufs[out_fd]).decode("utf-8", "replace"),
            b"".join(bufs[err_fd]).decode("utf-8", "replace"), False)


def read_gpu_memory(timeout, wait=None):
    """{index: {"used": MiB, "total": MiB}} or {"error": ...}. wait: how long to wait now, when part of `timeout`
    has passed already (status adopts the preamble's run at its end)."""
    rc, out, err, timed_out = nvidia_smi(list(SMI_MEMORY_ARGS), timeout if wait is None else wait)
    if timed_out:
        return {"error": "timeout", "message": "nvidia-smi did not answer within %gs" % timeout}
    if rc != 0:
        return {"error": "failed", "message": (err or out).strip()[:500] or "exit %s" % rc}
    gpus = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            gpus[int(parts[0])] = {"used": int(float(parts[1])), "total": int(float(parts[2]))}
        except ValueError:
            return {"error": "parse", "message": "unexpected nvidia-smi line: %r" % line}
    return {"gpus": gpus}


def gpu_holders():
    """Every process in this container holding /dev/nvidia*: [{pid, comm, cmdline, devices}]."""
    me = os.getpid()
    out = []
    for pid in pids():
        if pid == me:
            continue
        devs = set()
        try:
            for fd in os.listdir("/proc/%d/fd" % pid):
                try:
                    target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
                except OSError:
                    continue
                if target.startswith("/dev/nvidia"):
                    devs.add(target)
        except OSError:
            continue
        if devs:
            out.append({"pid": pid, "comm": proc_comm(pid), "cmdline": proc_cmdline(pid)[:4000],  # whole: named
                        "devices": sorted(devs)})
    return out


def act_gpu_read(a):
    holders = gpu_holders()
    st = read_state(a["state_dir"]) if a.get("state_dir") else None
    if st and not st.get("corrupt"):  # deploy's own processes (the stop step ends them) are not foreign holders
        own = set(unit_cgroup_members(st["unit"])) if st.get("unit") and systemd_running() else \
            set(proven_members(st))
        for h in holders:
            h["ours"] = h["pid"] in own
    return {"memory": read_gpu_memory(a.get("nvidia_smi_timeout_s", 10)), "holders": holders,
            "in_container": in_container()}


def gpu_devices(gpus):
    """The playbook's own GPU device files (/dev/nvidiaN for N in target.gpus). Never nvidiactl or nvidia-uvm:
    every CUDA process holds those, so their holders include users of other GPUs."""
    return ["/dev/nvidia%d" % int(g) for g in (gpus or []) if os.path.exists("/dev/nvidia%d" % int(g))]


def our_gpu_holders(devs):
    return [h for h in gpu_holders() if set(h["devices"]) & set(devs)]


NAMED_CMDLINE_MAX = 200  # a signalled process named in the summary: its command line up to this long
NAMED_CMDLINE_TAIL = 60  # ... keeping its last characters: a long `python -c SCRIPT ARGS` is told apart by its ARGS


def named(pid, seen):
    """{pid, comm, cmdline} of a process fuser signalled: as read while it held the GPU (`seen`), else now (it may
    be gone: then empty). The cmdline is the container's: cleaned of terminal controls (proc_cmdline), capped to
    its head and tail (the arguments that tell one process from another are usually last)."""
    h = seen.get(pid) or {"comm": proc_comm(pid), "cmdline": proc_cmdline(pid)}
    cmd = " ".join((h.get("cmdline") or "").split())  # no newlines: one line per process in the summary
    if len(cmd) > NAMED_CMDLINE_MAX:
        head = NAMED_CMDLINE_MAX - NAMED_CMDLINE_TAIL
        cmd = cmd[:head] + " ... " + cmd[-NAMED_CMDLINE_TAIL:]
    return {"pid": pid, "comm": h.get("comm") or "", "cmdline": cmd}


def fuser_kill(gpus, grace):
    """fuser -k -TERM on the playbook's /dev/nvidiaN, then -KILL after a grace period. Refuses on a PVE host."""
    if not in_container():
        return {"refused": "not inside a container (no container= in /proc/1/environ): refusing to run "
                           "fuser -k here; it would kill every GPU user on the Proxmox host"}
    devs = gpu_devices(gpus)
    before = our_gpu_holders(devs)
    res = {"devices": devs, "holders_before": before, "term": [], "kill": [], "term_procs": [], "kill_procs": []}
    if not devs or not before:
        return res
    # who each signalled pid was, read before the signal (a killed process's cmdline is gone): issue 41
    seen = {h["pid"]: h for h in before}
    import re
    import subprocess

    left = before
    for sig, wait, step in (("TERM", grace, 0.1), ("KILL", 10, 0.05)):  # -KILL only for what -TERM left
        if not left:
            break
        seen.update((h["pid"], h) for h in left)
        p = subprocess.run(["fuser", "-k", "-" + sig] + devs, capture_output=True, timeout=30)
        done = res[sig.lower()] = sorted(set(int(x) for x in re.findall(r"\d+", p.stdout.decode())))
        res[sig.lower() + "_procs"] = [named(pid, seen) for pid in done]
        wait_while(lambda: our_gpu_holders(devs), wait, step)
        left = our_gpu_holders(devs)
    return res


def act_gpus_free(a):
    """Poll nvidia-smi until every GPU in `gpus` is under the threshold, or the deadline passes."""
    gpus = [int(g) for g in a["gpus"]]
    threshold = int(a.get("threshold_mib", 1024))
    timeout = float(a.get("timeout_s", 60))
    smi_timeout = float(a.get("nvidia_smi_timeout_s", 10))
    poll = float(a.get("poll_s", 0.25))
    outside_after = a.get("outside_after_s")  # busy with no holder in here this long: held outside, say so now
    t0 = now()
    first = last = None
    last_emit = 0
    outside_since, last_look = None, 0
    while True:
        mem = read_gpu_memory(smi_timeout)
        if "error" in mem:
            return {"verdict": "nvidia_smi_" + mem["error"], "message": mem["message"],
                    "command": " ".join(("nvidia-smi",) + SMI_MEMORY_ARGS),
                    "timeout_s": smi_timeout, "before": first, "seconds": round(now() - t0, 3)}
        readings = {str(g): mem["gpus"].get(g) for g in gpus}
        missing = [g for g in gpus if mem["gpus"].get(g) is None]
        if missing:
            return {"verdict": "gpu_missing", "missing": missing, "seen": sorted(mem["gpus"]),
                    "before": first, "seconds": round(now() - t0, 3)}
        if first is None:
            first = readings
        last = readings
        busy = [g for g in gpus if mem["gpus"][g]["used"] > threshold]
        if not busy:
            return {"verdict": "free", "before": first, "after": last, "seconds": round(now() - t0, 3),
                    "threshold_mib": threshold}
        if now() - t0 >= timeout:
            break
        if outside_after is not None and now() - last_look >= 1.0:
            last_look = now()
            if gpu_holders():
                outside_since = None
            elif outside_since is None:
                outside_since = now()
            elif now() - outside_since >= float(outside_after):
                break  # nothing in this container holds them: waiting the rest of the timeout would not help
        if now() - last_emit > 1.0:
            emit(event="gpu", readings=readings, busy=busy, elapsed=round(now() - t0, 1))
            last_emit = now()
        time.sleep(poll)
    holders = gpu_holders()
    return {"verdict": "held_inside" if holders else "held_outside", "holders": holders, "before": first,
            "after": last, "busy": busy, "seconds": round(now() - t0, 3), "threshold_mib": threshold}
