"""Test bed start-up hook (a .pth in the real-vLLM venv): make a CPU vLLM hold the simulated GPUs.

vLLM on CPU opens no /dev/nvidia*, so the test bed's GPU simulator (which counts open device files and their
offsets) would see a running server as holding nothing. In `vllm serve` and in the processes it spawns
(multiprocessing children: EngineCore, workers), when CUDA_VISIBLE_DEVICES names GPUs, this opens
/dev/nvidia<i> for each (plus nvidiactl and nvidia-uvm), as the CUDA driver would. The API server seeks each
device fd to VPD_REAL_VLLM_GPU_MIB (default 2048) MiB: that is the memory the simulator reports; spawned children
hold theirs at offset 0 (fuser lists them; they add no memory). A forked child closes the inherited fds (sharing
the parent's offsets would count twice) and opens its own at offset 0. Stdlib only; never raises.
"""
import os
import sys

_fds = []


def _gpus():
    out = []
    for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","):
        part = part.strip()
        if not part.isdigit():
            break
        out.append(int(part))
    return out


def _open(mib):
    for g in _gpus():
        try:
            fd = os.open("/dev/nvidia%d" % g, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        if mib:
            os.lseek(fd, mib << 20, os.SEEK_SET)
        _fds.append(fd)
    if _fds:
        for name in ("nvidiactl", "nvidia-uvm"):
            try:
                _fds.append(os.open("/dev/" + name, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                pass


def _after_fork():
    while _fds:
        try:
            os.close(_fds.pop())
        except OSError:
            pass
    _open(0)


def _main():
    argv = list(getattr(sys, "orig_argv", None) or [])
    if not _gpus() or not argv:
        return
    text = " ".join(argv)
    server = any(os.path.basename(a) == "vllm" for a in argv[:3]) and "serve" in argv
    child = "multiprocessing" in text and "resource_tracker" not in text and "spawn_main" in text
    if not (server or child):
        return
    try:
        mib = int(os.environ.get("VPD_REAL_VLLM_GPU_MIB", "2048")) if server else 0
    except ValueError:
        mib = 2048 if server else 0
    _open(mib)
    os.register_at_fork(after_in_child=_after_fork)


try:
    _main()
except Exception:  # noqa: BLE001 - a start-up hook must never break the interpreter
    pass
