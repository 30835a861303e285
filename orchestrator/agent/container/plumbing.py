"""The container's side of the gpu-plumbing check (orchestrator/steps/plumbing_check.py decides): its /dev/nvidia* nodes with
their majors/minors, the versions of libnvidia-ml.so.* / libcuda.so.*, the kernel module's version as the
container sees it, the size of /dev/shm, and the runtime's torch.version.cuda read from torch/version.py
(not imported: cheap). Read-only, bounded, no subprocess; part of the status and doctor results and the
`plumbing` action.

Status reads them from a record (STATE_DIR/plumbing.json, facts_recorded) while the record's key still holds: these
facts change only when the container restarts, the host's driver is reloaded, or the files themselves change, and
the key proves none of that happened (record_key). verify, up and doctor always read them fresh (facts)."""

import os
import stat
import sys
import time

LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu/nvidia/current", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64",
            "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/aarch64-linux-gnu")
# patterns, compiled where used (status reads the record and compiles none of them)
LIB_RE = r"^(libnvidia-ml|libcuda)\.so\.(\d{2,4}\.\d{1,4}(?:\.\d{1,4})?)$"
MODULE_RE = r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)"
# The test bed's simulated device nodes are regular files whose first bytes say "vpd-testbed-node c MAJ:MIN": read as
# that character device here and by orchestrator/steps/plumbing_check.py (the host side), from this one pattern. Why the test
# bed cannot give real character devices instead: docs/testbed.md, "Why the GPU nodes are files".
SIM_NODE = rb"vpd-testbed-node c (\d+):(\d+)"
MAX_ENTRIES = 4000


def read_nodes():
    import re  # here: only when the facts are read again (their record's key moved)

    out = {}
    try:
        names = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))[:64]
    except OSError:
        return out
    for n in names:
        p = "/dev/" + n
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        node = {"kind": "other", "major": None, "minor": None, "size": None}
        if stat.S_ISCHR(st.st_mode):
            node.update(kind="char", major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))
        elif stat.S_ISREG(st.st_mode):
            node.update(kind="file", size=st.st_size)
            try:
                with open(p, "rb") as f:
                    m = re.search(SIM_NODE, f.read(48))
                if m:
                    node.update(kind="char", major=int(m.group(1)), minor=int(m.group(2)), size=None)
            except OSError:
                pass
        out[p] = node
    return out


def read_libs():
    import re  # here: only when the facts are read again (their record's key moved)

    libs = {"libnvidia-ml": set(), "libcuda": set()}
    lib_re = re.compile(LIB_RE)
    seen = set()
    for d in LIB_DIRS:
        try:
            real = os.path.realpath(d)
            if real in seen:
                continue
            seen.add(real)
            with os.scandir(d) as it:
                for i, e in enumerate(it):
                    if i > MAX_ENTRIES:
                        break
                    m = lib_re.match(e.name)
                    if m:
                        libs[m.group(1)].add(m.group(2))
        except OSError:
            continue
    return {k: sorted(v)[:16] for k, v in libs.items()}


def read_module_version():
    import re  # here: only when the facts are read again (their record's key moved)

    try:
        with open("/proc/driver/nvidia/version", "rb") as f:
            text = f.read(400).decode("ascii", "replace")
    except OSError:
        return None
    m = re.search(MODULE_RE, text)
    return m.group(1) if m else None


def read_shm_mib():
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return int(st.f_blocks * st.f_frsize // (1 << 20))


def venv_torch_dir():
    return os.path.join(sys.prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages", "torch")


def read_torch_cuda():
    """torch.version.cuda of this Python, from torch/version.py's text (importing torch takes seconds). The
    venv's own site-packages first, by path: `deploy status` runs with -I -S, where nothing of the venv loads."""
    import re  # here: only when the facts are read again (their record's key moved)

    dirs = [venv_torch_dir()]
    try:
        import importlib.util  # here: only a fresh read pays for it

        spec = importlib.util.find_spec("torch")
        if spec and spec.submodule_search_locations:
            dirs += list(spec.submodule_search_locations)[:2]
    except (ImportError, ValueError):
        pass
    for d in dirs:
        try:
            with open(os.path.join(d, "version.py"), "rb") as f:
                text = f.read(4096).decode("utf-8", "replace")
        except OSError:
            continue
        m = re.search(r"^cuda(?:\s*:\s*[^=\n]+)?\s*=\s*['\"](\d{1,2}\.\d{1,2})['\"]", text, re.M)
        return m.group(1) if m else None
    return None


def facts():
    out = {}
    for key, fn in (("nodes", read_nodes), ("libs", read_libs), ("module_version", read_module_version),
                    ("shm_mib", read_shm_mib), ("torch_cuda", read_torch_cuda)):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - one unreadable fact is not the others' failure
            out[key] = None
            out.setdefault("errors", []).append("%s: %s" % (key, str(e)[:200]))
    return out


# ------------------------------------------------------------------ the record status reads (issue 54)

RECORD = "plumbing.json"
RECORD_VERSION = 1


def _stat_key(path):
    """What changes when a file or directory changes: device, inode, mtime (a directory's mtime moves when an
    entry is added, removed or renamed); the errno when it is absent."""
    try:
        s = os.stat(path)
    except OSError as e:
        return e.errno
    return [s.st_dev, s.st_ino, s.st_mtime_ns]


def _read_small(path, n=400):
    try:
        with open(path, "rb") as f:
            return f.read(n).decode("ascii", "replace")
    except OSError as e:
        return e.errno


def record_key():
    """What proves a record of the facts current, each read cheaply (a few stats and small reads, no scan):
    - the container's boot: init's start time (/proc/1/stat) and the host's boot id. `pct config` lines (devN:,
      lxc.mount.entry, cgroup rules) act only at a container start, so a changed config moves this too;
    - the host's driver load: the kernel module's version file (/proc/driver/nvidia/version, whole);
    - the device nodes: /dev itself (a node made or removed moves its mtime);
    - the user-space libraries: each library folder (a library installed or removed moves its mtime);
    - torch's CUDA: the venv's torch/version.py and its site-packages folder (an install moves them);
    - this Python (sys.prefix): another runtime has another torch."""
    from .procs import init_starttime

    sp = os.path.dirname(venv_torch_dir())
    return {"boot_id": _read_small("/proc/sys/kernel/random/boot_id", 64), "init_start": init_starttime(),
            "module": _read_small("/proc/driver/nvidia/version"), "dev": _stat_key("/dev"),
            "libs": [_stat_key(d) for d in LIB_DIRS], "prefix": sys.prefix,
            "torch": [_stat_key(os.path.join(sp, "torch", "version.py")), _stat_key(sp)]}


def facts_recorded(state_dir):
    """status: the facts from STATE_DIR/plumbing.json while its key (record_key) is the one they were read under,
    else read fresh and recorded. /dev/shm's size is always read now (a remount changes it at any time, and a
    statvfs costs nothing). out["record"]: {reused, at (when the facts were read), error (why no record could be
    kept; the facts are fresh then)}."""
    from .files import _read_json, write_json_atomic

    key = record_key()
    path = os.path.join(state_dir, RECORD)
    rec = _read_json(path) if os.path.isdir(state_dir) else None
    if isinstance(rec, dict) and rec.get("v") == RECORD_VERSION and rec.get("key") == key \
            and isinstance(rec.get("facts"), dict):
        return dict(rec["facts"], shm_mib=read_shm_mib(), record={"reused": True, "at": rec.get("at"), "error": None})
    out = facts()
    error = None
    if out.get("errors"):
        error = "not recorded: a fact could not be read (%s)" % "; ".join(out["errors"])[:300]
    elif os.path.isdir(state_dir):  # (without one, no deployment is here yet: no record, nothing wrong)
        try:
            write_json_atomic(path, {"v": RECORD_VERSION, "key": key, "at": time.time(), "facts": out})
        except Exception as e:  # noqa: BLE001 - a record is a saving, never status's failure: said, not raised
            error = "not recorded in %s: %s" % (path, str(e)[:300])
    out["record"] = {"reused": False, "at": time.time(), "error": error}
    return out


def act_plumbing(a):
    return {"plumbing": facts()}
