"""Container life cycle, shared by the test bed API and the simulated `pct` (stdlib only, lean imports).

A host directory HOSTDIR holds host.json (name, containers, GPU simulator pid) and one ctVMID/ directory per
container with ct.json (what ctinit.py needs) and init.pid (the container's PID 1, as seen from the root PID
namespace) while it runs.
"""
import json
import os
import select
import signal
import subprocess
import time

NSENTER = "nsenter"
CT_PATH = "/root/ml-env/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def load_host(hostdir):
    with open(os.path.join(hostdir, "host.json")) as f:
        return json.load(f)


def ctdir(hostdir, vmid):
    return os.path.join(hostdir, "ct%d" % int(vmid))


def _cmdline(pid):
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _lxcct():
    if __package__:  # imported by the test bed's Python API
        from . import lxcct
    else:  # the state directory's copy, run by pct with python3 -SE
        import lxcct
    return lxcct


def lxc_of(hostdir, vmid):
    """The LXC description of a real LXC container (systemd as init), None for a namespace container."""
    lxcct = _lxcct()
    return lxcct.info(lxcct.load_ct(ctdir(hostdir, vmid)))


def host_node_missing(hostdir, path):
    """A device path missing on the simulated host: /dev/nvidia* are the host's GPU files (uvm_missing, a host
    fault, hides nvidia-uvm*); any other path is looked up as it is."""
    if not path.startswith("/dev/nvidia"):
        return not os.path.exists(path)
    name = path[len("/dev/"):]
    if "/" in name or not os.path.exists(os.path.join(hostdir, "gpus", name)):
        return True
    return name.startswith("nvidia-uvm") and os.path.exists(os.path.join(hostdir, "run", "uvm_missing"))


def conf_nvidia(hostdir, vmid):
    """The /dev/nvidia* nodes the container's pct config passes in: {name: "dev" | "bind" | "optional"}, or None
    when a hook makes the nodes (lxc.hook.autodev) or the container has the machine's real GPUs."""
    host = load_host(hostdir)
    path = os.path.join(hostdir, "pve", "nodes", host["name"], "lxc", "%d.conf" % int(vmid))
    out = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    for ln in lines:
        if ln.startswith("["):
            break
        k, _, v = ln.partition(":")
        k, v = k.strip(), v.strip()
        if k == "lxc.hook.autodev":
            return None
        if k.startswith("dev") and k[3:].isdigit():
            p = v.split(",")[0]
            p = p[len("path="):] if p.startswith("path=") else p
            if p.startswith("/dev/nvidia"):
                out[p[len("/dev/"):]] = "dev"
        elif k == "lxc.mount.entry":
            f = v.split()
            if len(f) >= 4 and f[0].startswith("/dev/nvidia"):
                out[f[0][len("/dev/"):]] = "optional" if "optional" in f[3].split(",") else "bind"
    return out


def conf_mounts(hostdir, vmid):
    """The bind mount points of the container's pct config (mpN: DIR,mp=PATH[,ro=1]...): [[DIR, PATH, ro]], parents
    before what is mounted below them (pve-container mounts them sorted by path)."""
    host = load_host(hostdir)
    path = os.path.join(hostdir, "pve", "nodes", host["name"], "lxc", "%d.conf" % int(vmid))
    out = []
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return out
    for ln in lines:
        if ln.startswith("["):
            break
        k, _, v = ln.partition(":")
        if k.strip().startswith("mp") and k.strip()[2:].isdigit():
            parts = v.strip().split(",")
            o = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
            src = parts[0][len("volume="):] if parts[0].startswith("volume=") else parts[0]
            if src.startswith("/") and o.get("mp"):
                out.append([src, os.path.normpath(o["mp"]), o.get("ro") == "1"])
    return sorted(out, key=lambda m: m[1])


def sync_mounts(hostdir, vmid):
    """At each start, like pve-container: the mount points of the container's config go into its ct.json ("mounts",
    what ctinit.py mounts); a host directory that is gone fails the start."""
    mounts = conf_mounts(hostdir, vmid)
    for src, _, _ in mounts:
        if not os.path.isdir(src):
            raise RuntimeError("directory '%s' does not exist" % src)
    path = os.path.join(ctdir(hostdir, vmid), "ct.json")
    with open(path) as f:
        ct = json.load(f)
    if ct.get("mounts", []) == mounts:
        return
    ct["mounts"] = mounts
    with open(path + ".tmp", "w") as f:
        json.dump(ct, f, indent=1)
    os.rename(path + ".tmp", path)


def mac(host_no, vmid):
    """A container's eth0 MAC (its pct config's hwaddr): stable across restarts, unique in the test bed."""
    return "BC:24:11:%02X:%02X:%02X" % (host_no % 256, vmid // 256 % 256, vmid % 256)


def make_basic_dev(dev):
    """A container's /dev without GPUs: the basic character nodes, the fd links, shm/ and pts/."""
    os.makedirs(os.path.join(dev, "shm"))
    os.makedirs(os.path.join(dev, "pts"))
    for name, (ma, mi) in {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
                           "urandom": (1, 9), "tty": (5, 0)}.items():
        os.mknod(os.path.join(dev, name), 0o666 | 0o020000, os.makedev(ma, mi))
        os.chmod(os.path.join(dev, name), 0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, os.path.join(dev, name))


def make_ct_dirs(d):
    """A new container's directory, as `pct create` leaves it: root/ tmp/ faults/ run/lock, a /dev with the basic
    nodes and no GPU (make_basic_dev, as the test bed's own containers have), an empty NVIDIA user space (nvlib/:
    no driver libraries until one is installed)."""
    for sub in ("root", "tmp", "faults", "nvlib", os.path.join("run", "lock")):
        os.makedirs(os.path.join(d, sub))
    os.chmod(os.path.join(d, "tmp"), 0o1777)
    os.chmod(os.path.join(d, "root"), 0o700)
    os.chmod(os.path.join(d, "run", "lock"), 0o1777)
    with open(os.path.join(d, "faults", "faults.json"), "w") as f:
        f.write("{}\n")
    make_basic_dev(os.path.join(d, "dev"))
    os.chmod(os.path.join(d, "dev"), 0o755)


def ensure_ct_socket(hostdir, vmid):
    """The container's nvidia-smi socket (served by the host's GPU simulator; asked for when pct create made the
    container after the simulator started)."""
    path = os.path.join(ctdir(hostdir, vmid), "run", "nvidia-sim.sock")
    if os.path.exists(path):
        return
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(os.path.join(hostdir, "gpu.sock"))
        s.sendall((json.dumps({"op": "serve_ct", "vmid": int(vmid)}) + "\n").encode())
        s.recv(4096)
    except OSError:
        pass
    finally:
        s.close()


def sync_devices(hostdir, vmid):
    """At each start, like pve-container and lxc-start: the container's /dev/nvidia* become what its config passes
    in. A devN: or non-optional bind of a node the host lacks fails the start; an optional bind of one leaves the
    empty file create=file makes. A node the config no longer passes in goes."""
    d = os.path.join(ctdir(hostdir, vmid), "dev")
    try:
        with open(os.path.join(ctdir(hostdir, vmid), "ct.json")) as f:
            if json.load(f).get("gpus_real"):
                return
    except (OSError, ValueError):
        pass
    want = conf_nvidia(hostdir, vmid)
    if want is None or not os.path.isdir(d):
        return
    for name, how in sorted(want.items()):
        if how != "optional" and host_node_missing(hostdir, "/dev/" + name):
            raise RuntimeError("Device /dev/%s does not exist" % name if how == "dev" else
                               "lxc-start: failed to mount /dev/%s onto dev/%s" % (name, name))
    for name in os.listdir(d):
        if name.startswith("nvidia") and name not in want:
            os.unlink(os.path.join(d, name))
    for name, how in want.items():
        src, dst = os.path.join(hostdir, "gpus", name), os.path.join(d, name)
        if host_node_missing(hostdir, "/dev/" + name):
            if os.path.lexists(dst):
                os.unlink(dst)
            open(dst, "w").close()  # create=file: an empty regular file where the node should be
            continue
        try:
            if os.path.samefile(src, dst):
                continue
            os.unlink(dst)
        except OSError:
            pass
        os.link(src, dst)


def init_pid(hostdir, vmid):
    """PID (root namespace) of the container's init, or None when the container is stopped."""
    d = ctdir(hostdir, vmid)
    lx = lxc_of(hostdir, vmid)
    if lx:
        return _lxcct().init_pid(lx)
    try:
        with open(os.path.join(d, "init.pid")) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    cmd = _cmdline(pid)
    if b"ctinit.py" in cmd and os.path.join(d, "ct.json").encode() in cmd:
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return None
        except OSError:
            return None
        return pid
    return None


# ---- the test bed's network (see docs/testbed.md, "Networking") ----------------------------------------------
# One network namespace per test bed (held by lan.py, its pid in $ROOT/lan.json) with a bridge br0: every
# container's eth0 is one end of a veth pair whose other end is a port of br0, and the workstation (the root
# network namespace, where the simulated hosts' sshd run too) has one more veth into it with the subnet's .254.
# Deleting the namespace (its holder killed) deletes every veth pair: nothing outlives the test bed's processes.

def _ip(argv, ns_pid=None, batch=None, check=True):
    cmd = ([NSENTER, "-t", str(ns_pid), "-n", "--"] if ns_pid else []) + ["ip"] + (["-batch", "-"] if batch else argv)
    r = subprocess.run(cmd, input=(batch or "").encode(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=10)
    if check and r.returncode:
        raise RuntimeError("%s failed (exit %d): %s%s" % (" ".join(cmd), r.returncode,
                                                          r.stdout.decode(errors="replace").strip(),
                                                          ("; input: " + batch.strip()) if batch else ""))
    return r


def lan_info(hostdir):
    """$ROOT/lan.json with the pid of a live holder, or None (no network, or its holder is gone)."""
    root = os.path.dirname(os.path.abspath(hostdir))
    try:
        with open(os.path.join(root, "lan.json")) as f:
            lan = json.load(f)
    except (OSError, ValueError):
        return None
    cmd = _cmdline(int(lan.get("pid") or 0))
    return lan if b"lan.py" in cmd and root.encode() in cmd else None


def net_attach(hostdir, vmid, pid):
    """Give the container (init `pid`) its eth0 on the test bed's bridge with its address (ct.json "net")."""
    with open(os.path.join(ctdir(hostdir, vmid), "ct.json")) as f:
        net = json.load(f).get("net")
    if not net:
        return None
    lan = lan_info(hostdir)
    if not lan:
        raise RuntimeError("container %d: the test bed's network namespace is gone (its lan.py holder is not "
                           "running); `deploy testbed down` and up again" % int(vmid))
    port = net["port"]
    _ip(["link", "del", "dev", port], ns_pid=lan["pid"], check=False)  # a stale port of a previous start
    _ip(None, ns_pid=lan["pid"], batch="link add name %s type veth peer name eth0 address %s netns %d\n"
                                         "link set %s master %s up\n" % (port, net["mac"], pid, port, lan["bridge"]))
    _ip(None, ns_pid=pid, batch="addr add %s dev eth0\nlink set eth0 up\n" % net["cidr"])
    return net["cidr"]


def start(hostdir, vmid, python, root_ns_pid=None, timeout=20.0):
    """Start a container, wait until its file system view is ready, plug it into the test bed's network.
    Returns the init PID."""
    pid = _start(hostdir, vmid, python, root_ns_pid, timeout)
    try:
        net_attach(hostdir, vmid, pid)
    except BaseException:
        try:
            stop(hostdir, vmid)
        except Exception:
            pass
        raise
    return pid


def _start(hostdir, vmid, python, root_ns_pid=None, timeout=20.0):
    d = ctdir(hostdir, vmid)
    if init_pid(hostdir, vmid):
        raise RuntimeError("CT %d already running" % int(vmid))
    lx = lxc_of(hostdir, vmid)
    if lx:
        return _lxcct().start(lx)
    sync_devices(hostdir, vmid)
    sync_mounts(hostdir, vmid)
    ctjson = os.path.join(d, "ct.json")
    here = os.path.join(os.path.dirname(os.path.abspath(hostdir)), "bin")  # the state dir's copy
    argv = ["unshare", "--pid", "--mount", "--net", "--uts", "--ipc", "--fork", "--mount-proc",
            "--propagation", "private", "--", python, "-SE", os.path.join(here, "ctinit.py"), ctjson]
    if root_ns_pid and os.path.exists("/proc/%d/ns/mnt" % root_ns_pid):
        # started from a simulated host's session: build the container from the root mount namespace,
        # not from the host's (which has the host's /usr/sbin overlay)
        argv = [NSENTER, "-t", str(root_ns_pid), "-m", "--"] + argv
    log = open(os.path.join(d, "init.log"), "ab")
    # like LXC, the container's init runs with container=lxc in its environment (tools detect containers by it)
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                         start_new_session=True, close_fds=True, env=dict(os.environ, container="lxc"))
    log.close()
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("container %d did not become ready within %.0f s (see %s/init.log)"
                                   % (int(vmid), timeout, d))
            r, _, _ = select.select([p.stdout], [], [], left)
            if r:
                chunk = os.read(p.stdout.fileno(), 64)
                if not chunk:
                    break
                buf += chunk
        if not buf.startswith(b"ready"):
            p.wait(timeout=5)
            try:
                err = open(os.path.join(d, "init.log"), errors="replace").read()[-2000:]
            except OSError:
                err = ""
            raise RuntimeError("container %d failed to start: %s" % (int(vmid), err.strip()))
    except BaseException:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        raise
    finally:
        p.stdout.close()
    # the init is unshare's only child
    pid = None
    while pid is None and time.monotonic() < deadline:
        for tid in os.listdir("/proc/%d/task" % p.pid):
            try:
                with open("/proc/%d/task/%s/children" % (p.pid, tid)) as f:
                    kids = f.read().split()
            except OSError:
                kids = []
            if kids:
                pid = int(kids[0])
    if pid is None:
        raise RuntimeError("container %d: cannot find its init process" % int(vmid))
    with open(os.path.join(d, "init.pid.tmp"), "w") as f:
        f.write("%d\n%d\n" % (pid, p.pid))
    os.rename(os.path.join(d, "init.pid.tmp"), os.path.join(d, "init.pid"))
    return pid


def _dead(pid):
    """A zombie (exited, not yet reaped by the container's init: under load that can take a while) or gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def ns_members(pid, live_only=False):
    """PIDs (root namespace) of every process in the PID namespace of `pid` (live_only: not the dead ones)."""
    try:
        ns = os.readlink("/proc/%d/ns/pid" % pid)
    except OSError:
        return []
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                if os.readlink("/proc/%s/ns/pid" % e) == ns and not (live_only and _dead(int(e))):
                    out.append(int(e))
            except OSError:
                pass
    return out


def wait_gone(pids, timeout=5.0):
    deadline = time.monotonic() + timeout
    pids = set(pids)
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            try:
                with open("/proc/%d/stat" % pid) as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        pids.discard(pid)
            except OSError:
                pids.discard(pid)
        if pids:
            time.sleep(0.005)
    return not pids


def stop(hostdir, vmid, timeout=5.0, clean=False):
    lx = lxc_of(hostdir, vmid)
    if lx:
        return _lxcct().stop(lx, clean=clean)
    pid = init_pid(hostdir, vmid)
    if not pid:
        return False
    members = ns_members(pid)
    try:
        os.kill(pid, signal.SIGKILL)  # the kernel then kills the whole PID namespace
    except OSError:
        pass
    wait_gone(members + [pid], timeout)
    try:
        os.unlink(os.path.join(ctdir(hostdir, vmid), "init.pid"))
    except OSError:
        pass
    return True


def enter_argv(pid, argv, wd="/root"):
    # nsenter --wd=DIR opens DIR *before* entering the mount namespace; bare --wd takes the init's cwd
    # (/root inside the container), anything else goes through env --chdir inside
    pre = [] if wd in (None, "/root") else ["env", "--chdir=" + wd]
    return [NSENTER, "-t", str(pid), "-m", "-p", "-n", "-u", "-i", "--wd", "--"] + pre + list(argv)
