"""PID 1 of a simulated container (run by `unshare --pid --mount --net --uts --fork --mount-proc`).

Builds the container's view of the file system from CTDIR/ct.json, then prints "ready" on stdout and
reaps orphans until it gets SIGTERM/SIGINT (or is killed from outside; then the kernel kills the whole
PID namespace and the mount namespace disappears with its last process).

Stdlib only; run with `python3 -SE`.
"""
import json
import os
import signal
import socket
import subprocess
import sys


def sh(*argv, fds=()):
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=fds)
    if r.returncode:
        raise SystemExit("ctinit: %s failed: %s" % (" ".join(argv), r.stdout.decode(errors="replace")))


def touch(path):
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()


def bind(src, dst, ro=False, rec=False):
    sh("mount", "--rbind" if rec else "--bind", src, dst)
    if ro:
        sh("mount", "-o", "remount,bind,ro", dst)


def setup(ct):
    d = ct["ctdir"]
    hostdir = ct["hostdir"]
    # mount points (pct set --mpN, ct["mounts"]): their host directories opened now, while this machine's /root
    # and /tmp are still in view (the binds below hide them), and mounted last, so that /root and /tmp get them too
    mps = []
    for src, dst, ro in ct.get("mounts", []):
        try:
            mps.append((os.open(src, os.O_PATH | os.O_DIRECTORY), dst, ro))
        except OSError as e:
            raise SystemExit("ctinit: mount point %s: directory '%s': %s" % (dst, src, e.strerror))
    # /usr/bin: nvidia-smi (read-only overlay on top of the real /usr/bin)
    lower = ct["cbin"]
    if ct.get("hide_usr_bin"):  # a container without Python: whiteouts (0/0 char devices) hide these names
        wd = os.path.join(d, "usr-bin-hide")
        os.makedirs(wd, exist_ok=True)
        for n in ct["hide_usr_bin"]:
            if not os.path.lexists(os.path.join(wd, n)):
                os.mknod(os.path.join(wd, n), 0o600 | 0o020000, os.makedev(0, 0))
        lower += ":" + wd
    sh("mount", "-t", "overlay", "overlay", "-o", "lowerdir=%s:/usr/bin" % lower, "/usr/bin")
    # /etc and /var/lib: writable per-container overlays
    for target, name in (("/etc", "etc"), ("/var/lib", "varlib")):
        up, wk = os.path.join(d, name + "-upper"), os.path.join(d, name + "-work")
        os.makedirs(up, exist_ok=True)
        os.makedirs(wk, exist_ok=True)
        sh("mount", "-t", "overlay", "overlay", "-o",
           "lowerdir=%s,upperdir=%s,workdir=%s" % (target, up, wk), target)
    os.makedirs("/etc/vpd-testbed", exist_ok=True)
    bind(os.path.join(d, "faults"), "/etc/vpd-testbed", ro=True)
    with open("/etc/hostname", "w") as f:
        f.write(ct["name"] + "\n")
    # /dev and /run: directories prepared by the test bed on the state file system. /dev/nvidia<i> are hard
    # links of the host's GPU files (same inode in every container of the host, and not mount points, so
    # fuser output looks like the real thing); /run holds the GPU simulator's socket for this container.
    bind(os.path.join(d, "dev"), "/dev")
    sh("mount", "-t", "tmpfs", "-o", "mode=1777,size=%dm" % ct.get("shm_mib", 8192), "vpd-shm", "/dev/shm")
    # the NVIDIA user space (core.write_user_space): CTDIR/nvlib at Debian's place for it, over an empty
    # mount point that a read-only overlay adds to the machine's library directory
    # (gpus=real: the machine's own /proc/driver, the real kernel module's version)
    if os.path.isdir("/proc/driver") and os.path.isdir(os.path.join(hostdir, "procdriver")) and \
            not ct.get("gpus_real"):
        bind(os.path.join(hostdir, "procdriver"), "/proc/driver", ro=True)  # the module's version file
    lib = "/usr/lib/x86_64-linux-gnu"
    if os.path.isdir(os.path.join(d, "nvlib")) and os.path.isdir(lib):
        stub = os.path.join(d, "nvlib-stub")
        os.makedirs(os.path.join(stub, "nvidia", "current"), exist_ok=True)
        sh("mount", "-t", "overlay", "overlay", "-o", "lowerdir=%s:%s" % (stub, lib), lib)
        bind(os.path.join(d, "nvlib"), lib + "/nvidia/current")
    bind(os.path.join(d, "run"), "/run")
    # gpus=real (realgpu.py): the machine's real /dev/nvidia* nodes, bound over placeholders the test bed made
    for src, dst in ct.get("dev_binds", []):
        bind(src, dst, rec=os.path.isdir(src))
    # /root: the per-container home; paths the Python needs that live under /root or /tmp are bound
    # into the new trees first (their sources get hidden by the /root and /tmp mounts below)
    for src, dst in ct["binds"]:
        os.makedirs(dst, exist_ok=True)
        bind(src, dst, ro=True)
    bind(os.path.join(d, "root"), "/root", rec=True)
    bind(os.path.join(d, "tmp"), "/tmp", rec=True)  # the state dir (under /tmp) disappears here
    for fd, dst, ro in mps:
        try:
            os.makedirs(dst, exist_ok=True)
        except OSError as e:
            raise SystemExit("ctinit: mount point %s: %s" % (dst, e.strerror))
        # the directory by its descriptor (its path may be hidden now); -c: mount must not resolve it to that path
        sh("mount", "--no-canonicalize", "--bind", "/proc/self/fd/%d" % fd, dst, fds=(fd,))
        os.close(fd)
        if ro:
            sh("mount", "-o", "remount,bind,ro", dst)
    sh("ip", "link", "set", "lo", "up")
    try:
        socket.sethostname(ct["name"])
    except (AttributeError, OSError):
        pass


def main():
    ct = json.load(open(sys.argv[1]))
    os.chdir("/")
    setup(ct)
    os.chdir("/root")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT})
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    try:
        os.setsid()
    except OSError:
        pass
    while True:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        info = signal.sigtimedwait({signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}, 5.0)
        if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
            return 0


if __name__ == "__main__":
    sys.exit(main())
