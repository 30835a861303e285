"""Process titles (prctl PR_SET_NAME + /proc/self/comm + argv area rewrite, like setproctitle) and GPU holds."""

import ctypes
import os
import re

PR_SET_NAME = 15


def set_title(title: str) -> None:
    raw = title.encode()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw[:15]), 0, 0, 0)
    except Exception:
        pass
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(raw[:15])
    except OSError:
        pass
    # argv rewrite: overwrite [arg_start, arg_end) of our own memory, so /proc/PID/cmdline (ps, pgrep -f)
    # shows the title. Like py-setproctitle (which vLLM uses), unless SPT_NOENV is set the environment block
    # [env_start, env_end) is taken for the title too and cleared: /proc/PID/environ then reads as zeros, while
    # the process keeps its own copy (os.environ was copied at start-up, as setproctitle copies environ).
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        fields = stat[stat.rindex(")") + 2:].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])
        env_start, env_end = int(fields[47]), int(fields[48])
        size = arg_end - arg_start
        if size > 1:
            data = raw[: size - 1]
            buf = data + b"\0" * (size - len(data))
            ctypes.memmove(arg_start, buf, size)
        if not os.environ.get("SPT_NOENV") and env_end > env_start:
            ctypes.memset(env_start, 0, env_end - env_start)
    except Exception:
        pass


def dev_dir() -> str:
    return os.environ.get("VPD_FAKE_DEV", "/dev")


def visible_gpus() -> list:
    """Host GPU indices visible to this process (CUDA_VISIBLE_DEVICES, else every /dev/nvidia<N>)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        out = []
        for part in cvd.split(","):
            part = part.strip()
            if part.isdigit():
                out.append(int(part))
            elif part:
                break  # like CUDA: parsing stops at an invalid entry
        return out
    try:
        names = os.listdir(dev_dir())
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names for m in [re.fullmatch(r"nvidia(\d+)", n)] if m)


def device_path(idx: int) -> str:
    return os.path.join(dev_dir(), f"nvidia{idx}")


class GpuHold:
    """Open fds on /dev/nvidia<i> (+ nvidiactl, nvidia-uvm when present); memory used = file offset in MiB."""

    def __init__(self, gpus):
        self.fds = {}
        self.extra = []
        for name in ("nvidiactl", "nvidia-uvm"):
            p = os.path.join(dev_dir(), name)
            if os.path.exists(p):
                try:
                    self.extra.append(os.open(p, os.O_RDONLY | os.O_CLOEXEC))
                except OSError:
                    pass
        for g in gpus:
            self.fds[g] = os.open(device_path(g), os.O_RDONLY | os.O_CLOEXEC)

    def use(self, gpu: int, mib: int) -> None:
        fd = self.fds.get(gpu)
        if fd is not None:
            os.lseek(fd, max(0, int(mib)) * 2**20, os.SEEK_SET)

    def close(self):
        for fd in list(self.fds.values()) + self.extra:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        self.extra = []
