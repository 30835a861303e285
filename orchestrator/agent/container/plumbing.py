"""The container's side of the gpu-plumbing check (orchestrator/plumbing.py decides): its /dev/nvidia* nodes with
their majors/minors, the versions of libnvidia-ml.so.* / libcuda.so.*, the kernel module's version as the
container sees it, the size of /dev/shm, and the runtime's torch.version.cuda read from torch/version.py
(not imported: cheap). Read-only, bounded, no subprocess; part of the status and doctor results and the
`plumbing` action."""

import importlib.util
import os
import re
import stat
import sys

LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu/nvidia/current", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64",
            "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/aarch64-linux-gnu")
LIB_RE = re.compile(r"^(libnvidia-ml|libcuda)\.so\.(\d{2,4}\.\d{1,4}(?:\.\d{1,4})?)$")
MODULE_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
# The test bed's simulated device nodes are regular files whose first bytes say "vpd-testbed-node c MAJ:MIN": read as
# that character device here and by orchestrator/plumbing.py (the host side), from this one pattern. Why the test
# bed cannot give real character devices instead: docs/testbed.md, "Why the GPU nodes are files".
SIM_NODE = re.compile(rb"vpd-testbed-node c (\d+):(\d+)")
MAX_ENTRIES = 4000


def read_nodes():
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
                    m = SIM_NODE.search(f.read(48))
                if m:
                    node.update(kind="char", major=int(m.group(1)), minor=int(m.group(2)), size=None)
            except OSError:
                pass
        out[p] = node
    return out


def read_libs():
    libs = {"libnvidia-ml": set(), "libcuda": set()}
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
                    m = LIB_RE.match(e.name)
                    if m:
                        libs[m.group(1)].add(m.group(2))
        except OSError:
            continue
    return {k: sorted(v)[:16] for k, v in libs.items()}


def read_module_version():
    try:
        with open("/proc/driver/nvidia/version", "rb") as f:
            text = f.read(400).decode("ascii", "replace")
    except OSError:
        return None
    m = MODULE_RE.search(text)
    return m.group(1) if m else None


def read_shm_mib():
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return int(st.f_blocks * st.f_frsize // (1 << 20))


def read_torch_cuda():
    """torch.version.cuda of this Python, from torch/version.py's text (importing torch takes seconds). The
    venv's own site-packages first, by path: `deploy status` runs with -I -S, where nothing of the venv loads."""
    dirs = [os.path.join(sys.prefix, "lib", "python%d.%d" % sys.version_info[:2], "site-packages", "torch")]
    try:
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


def act_plumbing(a):
    return {"plumbing": facts()}
