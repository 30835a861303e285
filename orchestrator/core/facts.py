"""Parsers for remote command output, each testable on a string (formats in docs/domain/proxmox-lxc.md)."""

from __future__ import annotations

import re

# `pct list` prints printf "%-10s %-10s %-12s %-20s": parse by offsets, the Lock column is usually blank.
_PCT_LIST_COLS = ((0, 11), (11, 22), (22, 35), (35, None))


def parse_pct_list(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []  # pct list prints nothing at all when there are no containers
    if not lines[0].startswith("VMID"):
        raise ValueError(f"unexpected pct list header: {lines[0]!r}")
    out = []
    for ln in lines[1:]:
        vmid, status, lock, name = (ln[a:b].strip() if b else ln[a:].strip() for a, b in _PCT_LIST_COLS)
        out.append({"vmid": int(vmid), "status": status, "lock": lock or None, "name": name})
    return out


def parse_pct_status(text: str) -> str:
    m = re.fullmatch(r"status: (\w+)", text.strip())
    if not m:
        raise ValueError(f"unexpected pct status output: {text.strip()!r}")
    return m.group(1)


def parse_pct_config_gpus(text: str) -> list[int]:
    """GPU indices passed into a container: `devN: /dev/nvidiaK` lines and `lxc.mount.entry: /dev/nvidiaK ...`
    of the current config (a `[snapshot]` section ends it, as in discover.parse_pct_config)."""
    gpus = set()
    for ln in text.splitlines():
        if ln.strip().startswith("["):  # a snapshot section: its lines are not the running config
            break
        m = re.match(r"(dev\d+|lxc\.mount\.entry):\s*/dev/nvidia(\d+)\b", ln.strip())
        if m:
            gpus.add(int(m.group(2)))
    return sorted(gpus)


# nvidia-smi (NVML) when the user-space driver and the kernel module differ (docs/domain/proxmox-lxc.md)
NVML_MISMATCH = "Driver/library version mismatch"


def nvml_mismatch_fix(text: str | None, host: str, vmid: int | str | None = None) -> str | None:
    """The fix for `Failed to initialize NVML: Driver/library version mismatch` in nvidia-smi's output TEXT, or
    None when TEXT is something else. Not a wedged driver: two versions that differ, usually the container's
    user-space libraries against the host's kernel module; a reboot only helps when the host itself was upgraded."""
    if not text or NVML_MISMATCH.lower() not in text.lower():
        return None
    ct = f"container {vmid}" if vmid is not None else "the container"
    return (f"the user-space NVIDIA driver in {ct} (libnvidia-ml) and the kernel module on {host} have different "
            f"versions: compare `cat /proc/driver/nvidia/version` on {host} with "
            f"`ls /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*` in {ct} (a newer nvidia-smi also prints "
            f"`NVML library version: VER`), then install in {ct} exactly the host's driver version, user space only "
            f"(e.g. `./NVIDIA-Linux-x86_64-VER.run --no-kernel-module`); reboot {host} only if the host itself was "
            f"just upgraded (nvidia-smi on {host} shows the same mismatch)")


HOST_HOLDERS_SH = r"""
T=""; command -v timeout >/dev/null 2>&1 && T="timeout -k 2 10"
apps=$($T nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits 2>/dev/null)
$T nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>/dev/null | sed 's/^/gpu /'
printf '%s\n' "$apps" | sed '/^$/d; s/^/app /'
echo "hostns $(readlink /proc/self/ns/pid)"  # this SSH session runs in the host's own namespaces
for p in $(printf '%s\n' "$apps" | cut -d, -f1); do
  cg=$(grep -o 'lxc/[0-9]*' /proc/$p/cgroup 2>/dev/null | head -n 1)
  echo "proc $p $(readlink /proc/$p/ns/pid) cg=${cg:--} $(cat /proc/$p/comm 2>/dev/null)"
done
exit 0
"""


def parse_host_holders(text: str) -> dict:
    """The host's GPU processes (HOST_HOLDERS_SH output) -> {host_pid_ns, holders: [{pid, gpu, mib, pid_ns,
    vmid, comm}]}. Host PIDs: a holder is in this container when its PID namespace is the container's."""
    uuid, apps, procs, host_ns = {}, [], {}, None
    for ln in text.splitlines():
        kind, _, rest = ln.partition(" ")
        if kind == "gpu":
            i, _, u = rest.partition(",")
            if i.strip().isdigit():
                uuid[u.strip()] = int(i)
        elif kind == "app":
            f = [x.strip() for x in rest.split(",")]
            if len(f) >= 3 and f[0].isdigit():
                apps.append((int(f[0]), int(float(f[1])) if f[1].replace(".", "").isdigit() else 0, f[2]))
        elif kind == "hostns":
            host_ns = rest.strip() or None
        elif kind == "proc":
            f = rest.split(" ", 3)
            if len(f) >= 3 and f[0].isdigit():
                cg = f[2][3:] if f[2].startswith("cg=") else "-"
                procs[int(f[0])] = {"pid_ns": f[1] or None, "vmid": int(cg[4:]) if cg.startswith("lxc/") else None,
                                    "comm": f[3].strip() if len(f) > 3 else None}
    holders = [{"pid": pid, "gpu": uuid.get(u), "mib": mib, **procs.get(pid, {"pid_ns": None, "vmid": None,
                                                                             "comm": None})}
               for pid, mib, u in apps if u in uuid]
    return {"host_pid_ns": host_ns, "holders": holders}
