"""The `gpu-plumbing` check: does the container really see the GPUs its playbook assigns? Pure decision logic.

Facts come from two places, each gathered in an exec that an operation makes anyway (docs/gpu-containers.md):
the host (HOST_PLUMBING_SH: `pct config VMID`, /proc/devices, the /dev/nvidia* nodes, the kernel module's
version and nvidia-smi's header) and the container (the agent's `plumbing` facts: agent/container/plumbing.py).
`findings()` compares them and names each problem with what was expected, what was found, where, and the fix.
Everything that came from the container or the host is text to show, never to run: values are bounded and
stripped of controls here, and fix commands quote what they carry (shell_word). Facts follow
../shared/domain/lxc-gpu-plumbing.md (docs/domain/proxmox-lxc.md).
"""

from __future__ import annotations

import re
import shlex

from orchestrator.agent.container.plumbing import SIM_NODE
from orchestrator.agent.container.protocol import SMI_MEMORY_ARGS
from orchestrator.core.errors import DeployError
from orchestrator.core.remote import shell_word

CHECK = "gpu-plumbing"
GIB = 1024

# the host side, in one `sh -c` over the operation's own SSH connection: sections marked by "@@ NAME" lines.
# Simulated device nodes of the test bed are regular files whose first bytes say "vpd-testbed-node c MAJ:MIN"
# (agent/container/plumbing.py SIM_NODE, the one pattern: read here from the 48 bytes this script prints).
HOST_PLUMBING_SH = r"""
V="$1"
echo "@@ config"; { pct config "$V" 2>&1; echo "@@ rc $?"; } | head -c 65536; echo
echo "@@ devices"; sed -n '/^Character devices:/,/^$/p' /proc/devices 2>/dev/null | grep -i nvidia
echo "@@ nodes"
for f in /dev/nvidia*; do
  [ -e "$f" ] || continue
  [ -d "$f" ] && continue
  s=$(stat -c '%n|%F|%t|%T|%s' "$f" 2>/dev/null) || continue
  case "$s" in *"|regular"*) s="$s|$(head -c 48 "$f" 2>/dev/null | tr -d '\n\r|')";; esac
  echo "$s"
done
echo "@@ version"; head -c 400 /proc/driver/nvidia/version 2>/dev/null
echo "@@ smi"
T=""; command -v timeout >/dev/null 2>&1 && T="timeout -k 2 ${2:-10}"
F=$(mktemp 2>/dev/null) && { { $T @SMI_MEMORY@ > "$F" 2>/dev/null; echo "@@ smi_rc $?" >> "$F"; } & }
H=$(mktemp 2>/dev/null) || H=/dev/null
$T nvidia-smi > "$H" 2>&1; R=$?
head -c 4000 "$H" | grep -E 'Driver Version|CUDA Version|NVML|Failed' | head -n 4
[ "$H" = /dev/null ] || rm -f "$H"
echo "@@ smi_rc $R"
wait
echo "@@ gpumem"; if [ -n "$F" ]; then head -n 65 "$F" | head -c 4100; rm -f "$F"; fi
exit 0
"""
HOST_PLUMBING_SH = HOST_PLUMBING_SH.replace("@SMI_MEMORY@", shlex.join(["nvidia-smi", *SMI_MEMORY_ARGS]))  # one spelling

MAX_LINE = 300
MAX_LINES = 400
MODULE_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")
SMI_DRIVER_RE = re.compile(r"Driver Version:\s*(\d+\.\d+(?:\.\d+)?)")
SMI_CUDA_RE = re.compile(r"CUDA Version:\s*(\d+\.\d+)")
VERSION_RE = re.compile(r"^\d{2,4}\.\d{1,4}(?:\.\d{1,4})?$")
CUDA_RE = re.compile(r"^\d{1,2}\.\d{1,2}$")

# the first driver of each CUDA release (NVIDIA's CUDA toolkit release notes, table 3, Linux x86_64): the
# driver's maximum CUDA is the last row whose driver it reaches. nvidia-smi's header says it too, when it runs.
CUDA_MIN_DRIVER = [("11.8", "520.61.05"), ("12.0", "525.60.13"), ("12.1", "530.30.02"), ("12.2", "535.54.03"),
                   ("12.3", "545.23.06"), ("12.4", "550.54.14"), ("12.5", "555.42.02"), ("12.6", "560.28.03"),
                   ("12.8", "570.26"), ("12.9", "575.51.03"), ("13.0", "580.65.06")]


def clean(value, n: int = MAX_LINE) -> str:
    """A value read remotely, as one printable line of at most n characters (never a control character)."""
    s = "".join(ch if ch.isprintable() else " " for ch in str(value if value is not None else ""))
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def vkey(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v or ""))


def driver_max_cuda(driver: str | None) -> str | None:
    """The highest CUDA version a driver supports, from the table above; None for an unknown or older driver."""
    if not driver or not VERSION_RE.fullmatch(driver):
        return None
    return next((cuda for cuda, first in reversed(CUDA_MIN_DRIVER) if vkey(driver) >= vkey(first)), None)


def driver_for_cuda(cuda: str) -> str | None:
    """The first driver that supports CUDA `cuda` (at least the major.minor asked), or None when beyond the table."""
    return next((first for c, first in CUDA_MIN_DRIVER if vkey(c) >= vkey(cuda)), None)


# ------------------------------------------------------------------ parsing the host side


def parse_host(text: str) -> dict:
    """HOST_PLUMBING_SH output -> {config: [lines], config_rc, proc_devices: {name: major}, nodes: {path: node},
    module_version, smi_driver, smi_cuda, smi_error, gpu_mem: {index: {used, total}}}. A node: {kind: "char"|"file"|
    "other", major, minor}."""
    out = {"config": [], "config_rc": None, "proc_devices": {}, "nodes": {}, "module_version": None,
           "smi_driver": None, "smi_cuda": None, "smi_error": None, "gpu_mem": {}, "smi_timeout": []}
    sec = None
    for raw in (text or "").splitlines()[: MAX_LINES * 4]:
        ln = raw[:1000]
        if ln.startswith("@@ "):
            word = ln[3:].strip()
            if word.startswith("rc "):
                out["config_rc"] = int(word[3:]) if word[3:].strip().isdigit() else None
            elif word.startswith("smi_rc "):  # 124/137: `timeout` ended an nvidia-smi that did not answer
                if word[7:].strip() in ("124", "137"):
                    out["smi_timeout"] = [*out.get("smi_timeout", []),
                                          "nvidia-smi" if sec == "smi" else shlex.join(["nvidia-smi", *SMI_MEMORY_ARGS])]
            else:
                sec = word
            continue
        if sec == "config":
            if ln.strip().startswith("["):  # a snapshot section: not the running config
                sec = "config-snapshot"
            elif ln.strip() and len(out["config"]) < MAX_LINES:
                out["config"].append(clean(ln, 500))
        elif sec == "devices":
            m = re.match(r"\s*(\d+)\s+(\S+)", ln)
            if m:
                out["proc_devices"][m.group(2)[:40]] = int(m.group(1))
        elif sec == "nodes":
            node = parse_node_line(ln)
            if node and len(out["nodes"]) < 64:
                out["nodes"][node.pop("path")] = node
        elif sec == "version":
            m = MODULE_RE.search(ln)
            if m and not out["module_version"]:
                out["module_version"] = m.group(1)
        elif sec == "gpumem":  # the host's nvidia-smi: index, used MiB, total MiB (the sizing check's GPUs)
            m = re.fullmatch(r"\s*(\d{1,3}),\s*(\d{1,9}),\s*(\d{1,9})\s*", ln)
            if m and len(out["gpu_mem"]) < 64:
                out["gpu_mem"][int(m.group(1))] = {"used": int(m.group(2)), "total": int(m.group(3))}
        elif sec == "smi":
            if (m := SMI_DRIVER_RE.search(ln)):
                out["smi_driver"] = m.group(1)
            if (m := SMI_CUDA_RE.search(ln)):
                out["smi_cuda"] = m.group(1)
            if "mismatch" in ln.lower() or "failed" in ln.lower():
                out["smi_error"] = clean(ln, 200)
    return out


def parse_node_line(ln: str) -> dict | None:
    """`stat -c '%n|%F|%t|%T|%s'` (+ a simulated node's first bytes) -> {path, kind, major, minor}."""
    f = ln.split("|")
    if len(f) < 5 or not re.fullmatch(r"/dev/nvidia[A-Za-z0-9_-]{0,40}", f[0]):
        return None
    kind = "char" if "character" in f[1] else "file" if "regular" in f[1] else "other"
    try:
        major, minor = int(f[2], 16), int(f[3], 16)
    except ValueError:
        major = minor = None
    if kind == "file":
        m = re.search(SIM_NODE, f[5].encode() if len(f) > 5 else b"")
        if m:  # the test bed's simulated node: a device as far as this check is concerned
            kind, major, minor = "char", int(m.group(1)), int(m.group(2))
        else:
            major = minor = None
    return {"path": f[0], "kind": kind, "major": major if kind == "char" else None,
            "minor": minor if kind == "char" else None}


def parse_config(lines: list[str]) -> dict:
    """The GPU-related lines of `pct config`: {dev: {path: line}, mounts: {dst_path: {line, src, optional}},
    allow: [{line, type, major, minor}]}. dst_path is the container path with its leading slash."""
    dev, mounts, allow = {}, {}, []
    for ln in lines:
        key, _, val = ln.partition(":")
        key, val = key.strip(), val.strip()
        if re.fullmatch(r"dev\d+", key):
            path = val.split(",")[0].strip()
            if path.startswith("/dev/nvidia"):
                dev[path] = ln
        elif key == "lxc.mount.entry":
            f = val.split()
            if len(f) >= 4 and f[0].startswith("/dev/nvidia"):
                dst = "/" + f[1].lstrip("/")
                mounts[dst] = {"line": ln, "src": f[0], "optional": "optional" in f[3].split(",")}
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            m = re.fullmatch(r"([abc])\s+(\d+|\*):(\d+|\*)\s*\S*", val)
            if m:
                allow.append({"line": ln, "type": m.group(1), "major": m.group(2), "minor": m.group(3)})
    return {"dev": dev, "mounts": mounts, "allow": allow}


def allowed(cfg: dict, major: int | None, minor: int | None) -> bool:
    return any(a["type"] in ("c", "a") and a["major"] in ("*", str(major)) and a["minor"] in ("*", str(minor))
               for a in cfg["allow"])


# ------------------------------------------------------------------ the container side's facts


def sane_container(ct: dict | None) -> dict:
    """The agent's `plumbing` facts, validated: anything of the wrong type or shape is dropped (the container's
    word, bounded). -> {nodes: {path: node}, libs: {name: [versions]}, module_version, shm_mib, torch_cuda}."""
    ct = ct if isinstance(ct, dict) else {}
    nodes = {}
    for p, n in list((ct.get("nodes") or {}).items())[:64] if isinstance(ct.get("nodes"), dict) else []:
        if isinstance(p, str) and re.fullmatch(r"/dev/nvidia[A-Za-z0-9_-]{0,40}", p) and isinstance(n, dict):
            kind = n.get("kind") if n.get("kind") in ("char", "file", "other") else "other"
            mj, mn = n.get("major"), n.get("minor")
            nodes[p] = {"kind": kind, "major": mj if isinstance(mj, int) else None,
                        "minor": mn if isinstance(mn, int) else None,
                        "size": n.get("size") if isinstance(n.get("size"), int) else None}
    libs = {}
    raw = ct.get("libs") if isinstance(ct.get("libs"), dict) else {}
    for name in ("libnvidia-ml", "libcuda"):
        vs = raw.get(name) if isinstance(raw.get(name), list) else []
        libs[name] = sorted({v for v in vs[:16] if isinstance(v, str) and VERSION_RE.fullmatch(v)}, key=vkey)
    mv = ct.get("module_version")
    shm = ct.get("shm_mib")
    tc = ct.get("torch_cuda")
    return {"nodes": nodes, "libs": libs,
            "module_version": mv if isinstance(mv, str) and VERSION_RE.fullmatch(mv) else None,
            "shm_mib": shm if isinstance(shm, int) and shm >= 0 else None,
            "torch_cuda": tc if isinstance(tc, str) and CUDA_RE.fullmatch(tc) else None,
            "error": clean(ct.get("error"), 200) if ct.get("error") else None}


def shm_required_mib(tp: int) -> int:
    """What /dev/shm must hold: 1 GiB per GPU with tensor parallelism (vLLM's workers exchange through /dev/shm
    and NCCL's shared-memory transport keeps its buffers there; NVIDIA's own containers ask for --shm-size=1g per
    run), 256 MiB for a single GPU (vLLM's engine and API server still share a message queue there)."""
    return GIB * tp if tp > 1 else 256


# ------------------------------------------------------------------ the decision


def _f(findings, problem, where, expected, found, fix, cause):
    findings.append({"check": CHECK, "class": CHECK, "problem": problem, "where": clean(where),
                     "expected": clean(expected), "found": clean(found), "cause": clean(cause, 600),
                     "fix": clean(fix, 900)})


def findings(host: dict | None, ct: dict | None, *, host_name: str, vmid: int, gpus: list[int],
             tp: int = 1) -> list[dict]:
    """-> [{check, class, problem, where, expected, found, cause, fix}] for one container; [] when all is well.
    `host`: parse_host() or None (status reads the container only); `ct`: the agent's facts (sane_container
    validates them here)."""
    out: list[dict] = []
    if not isinstance(ct, dict) or "nodes" not in ct:
        ct = None  # no facts from the container (an older agent): compare what the host says alone
    c = sane_container(ct)
    hw = shell_word(host_name)
    v = int(vmid)
    conf = f"/etc/pve/lxc/{v}.conf"
    wanted = [f"/dev/nvidia{int(g)}" for g in gpus] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    cfg = parse_config(host["config"]) if host else None
    hn = (host or {}).get("nodes") or {}
    uvm_major = (host or {}).get("proc_devices", {}).get("nvidia-uvm")
    next_dev = 0
    if host:
        idx = [int(re.match(r"dev(\d+)", ln).group(1)) for ln in host["config"] if re.match(r"dev\d+:", ln)]
        next_dev = max(idx) + 1 if idx else 0
    raw_style = bool(cfg and not cfg["dev"] and (cfg["mounts"] or cfg["allow"]))

    # 0. a probe that did not answer: nothing it would have said is known (never an ok without having looked)
    for cmd in (host or {}).get("smi_timeout") or []:
        _f(out, "nvidia-smi-timeout", f"{host_name}: `{cmd}`",
           f"an answer within {(host or {}).get('smi_timeout_s') or SMI_TIMEOUT_S:g}s",
           "no answer: the driver version, CUDA version and GPU memory were not read",
           f"the NVIDIA driver may be wedged: run nvidia-smi on {hw} itself (a hung one needs the driver reloaded "
           "or the host rebooted)",
           "a hung nvidia-smi usually means a wedged driver or a GPU that fell off the bus (dmesg shows Xid errors)")

    # 1. the host's nodes: each one the container needs must exist there first (nvidia-uvm-tools: only a note)
    # (a plain file there is no device either)
    host_missing = {p for p in wanted if p not in hn or hn[p]["kind"] != "char"} if host else set()
    if host:
        if "/dev/nvidia-uvm" in host_missing:
            _f(out, "uvm-missing-on-host", f"{host_name}: /dev/nvidia-uvm",
               "/dev/nvidia-uvm on the host",
               "missing" + (f" (nvidia-uvm is loaded: major {uvm_major} in /proc/devices)" if uvm_major
                            else " (nvidia_uvm not in /proc/devices: the module is not loaded)"),
               f"on {hw}: nvidia-modprobe -u -c=0 (loads nvidia_uvm and creates the nodes), then pct reboot {v}; to "
               "survive a reboot: echo nvidia-uvm > /etc/modules-load.d/nvidia-uvm.conf and a udev rule or "
               "systemd unit that runs nvidia-modprobe -u -c=0 at boot (e.g. ExecStart=/usr/bin/nvidia-modprobe "
               "-u -c=0 in a oneshot unit before pve-guests.service)",
               "the node only exists after something loaded nvidia_uvm and created it (a CUDA program on the "
               "host, or nvidia-modprobe); containers started without it fail CUDA while nvidia-smi still works")
        for p in sorted(host_missing - {"/dev/nvidia-uvm"}):
            _f(out, "host-node-missing", f"{host_name}: {p}", f"{p} on the host", "missing",
               f"on {hw}: check the driver (nvidia-smi; a GPU that fell off the bus shows in dmesg) and "
               f"`ls -l /dev/nvidia*`; nvidia-modprobe -c=0 (or -m) recreates nodes of a loaded driver",
               "a devN: line whose host path does not exist stops the container from starting; an optional "
               "bind skips it silently")

    # 2. the config: each needed node passed in, by devN: or by a bind mount plus a cgroup rule for its major
    if cfg is not None:
        for p in wanted:
            in_dev, mnt = p in cfg["dev"], cfg["mounts"].get(p)
            node = hn.get(p) or {}
            if not in_dev and not mnt:
                if raw_style:
                    mj = node.get("major")
                    add = f"lxc.mount.entry: {p} {p[1:]} none bind,optional,create=file"
                    if mj is not None and not allowed(cfg, mj, node.get("minor")):
                        add += f" and lxc.cgroup2.devices.allow: c {mj}:* rwm"
                    fix = f"add to {conf} on {hw}: {add}; then pct reboot {v}"
                else:
                    add = f"dev{next_dev}: {p}"
                    fix = f"on {hw}: pct set {v} -dev{next_dev} {shell_word(p)} (adds `{add}` to {conf}), " \
                          f"then pct reboot {v}"
                    next_dev += 1
                _f(out, "config-line-missing", f"{host_name}/{v} {conf}", f"a line passing {p} into the container",
                   "no devN: or lxc.mount.entry line for it", fix,
                   "pct config does not pass this node in, so the container cannot see it" +
                   (" (a GPU the playbook assigns)" if re.fullmatch(r"/dev/nvidia\d+", p) else ""))
            elif mnt and not in_dev and node.get("kind") == "char" and not allowed(cfg, node["major"], node["minor"]):
                stale = sorted({a["major"] for a in cfg["allow"] if a["major"] != "*"} - {str(node["major"])})
                _f(out, "cgroup-stale-major", f"{host_name}/{v} {conf}: {p}",
                   f"lxc.cgroup2.devices.allow: c {node['major']}:* rwm (the host's major of {p})",
                   f"no rule for major {node['major']}" + (f"; rules for major(s) {', '.join(stale)}" if stale else ""),
                   f"in {conf} on {hw}: replace the rule for the old major with lxc.cgroup2.devices.allow: "
                   f"c {node['major']}:* rwm, then pct reboot {v}; or use devN: lines (pct set {v} -devN {p}) "
                   "which follow the majors by themselves",
                   "nvidia-uvm and nvidia-caps have dynamic majors: a driver update can move them, and the old "
                   "rule then denies access (Operation not permitted)")
            elif mnt and mnt["optional"] and p in host_missing:
                _f(out, "optional-bind-skipped", f"{host_name}/{v} {conf}: {mnt['line']}",
                   f"{p} bound into the container", "the host node is missing, so the optional bind was skipped "
                   "silently at the container's start", f"create the node on {hw} (see the host-node or uvm fix), "
                   f"then pct reboot {v}", "`optional` in lxc.mount.entry skips a missing source without an error")

    # 3. the container's own nodes: present, a device, and the host's major/minor
    cn = c["nodes"]
    if ct is not None and not c.get("error"):
        for p in wanted:
            node, hnode = cn.get(p), hn.get(p)
            if node is None:
                if cfg is None or p in cfg["dev"] or p in cfg["mounts"]:  # else: the config finding says it
                    _f(out, "container-node-missing", f"{host_name}/{v}: {p}", f"{p} in the container",
                       "missing", f"pct reboot {v} on {hw} (the nodes are created at start: a node the host "
                       "gained later is not there yet); if it stays missing, see the host side",
                       "a container started before the host had the node, or a bind was skipped" +
                       (" (CUDA then fails: cudaErrorUnknown / no CUDA-capable device)" if "uvm" in p else ""))
            elif node["kind"] != "char":
                _f(out, "not-a-device", f"{host_name}/{v}: {p}", f"{p} a character device",
                   f"a {'regular file' if node['kind'] == 'file' else 'non-device'}"
                   + (f" of {node['size']} bytes" if node.get("size") is not None else ""),
                   f"create the node on {hw}, then pct reboot {v}",
                   "an empty regular file is what create=file leaves when an optional bind had no source")
            elif hnode and hnode.get("kind") == "char" and (node["major"], node["minor"]) != \
                    (hnode["major"], hnode["minor"]):
                _f(out, "node-number-mismatch", f"{host_name}/{v}: {p}",
                   f"{hnode['major']}:{hnode['minor']} (the host's {p})", f"{node['major']}:{node['minor']}",
                   f"pct reboot {v} on {hw} (recreates the nodes); a hand-written mknod in the container is wrong",
                   "the container's node points at another device than the host's (a driver update moved "
                   "the dynamic major)")

    # 4. versions: user space == kernel module; the driver's CUDA >= the runtime's
    module = (host or {}).get("module_version") or (host or {}).get("smi_driver") or c["module_version"]
    libs = sorted(set(c["libs"].get("libnvidia-ml", [])) | set(c["libs"].get("libcuda", [])), key=vkey)
    if ct is not None and not c.get("error") and module:
        other = [x for x in libs if x != module]
        if not libs:
            _f(out, "user-space-missing", f"{host_name}/{v}: libnvidia-ml.so.* / libcuda.so.*",
               f"the NVIDIA user-space driver {module} (the host's kernel module)", "none found",
               f"install in container {v} exactly {module}, user space only: "
               f"./NVIDIA-Linux-x86_64-{module}.run --no-kernel-module --silent (the .run the host was installed "
               "with), or the distribution's packages of that version",
               "the container cannot load kernel modules; it needs the host's driver version in user space")
        elif other:
            _f(out, "driver-version-mismatch", f"{host_name}/{v}: libnvidia-ml/libcuda {', '.join(libs)}",
               f"{module} (the kernel module on {host_name})", f"{', '.join(libs)} (user space in container {v})",
               f"install in container {v} exactly {module}, user space only: "
               f"./NVIDIA-Linux-x86_64-{module}.run --no-kernel-module --silent (or the distribution's packages "
               f"of {module}), removing {', '.join(other)}; reboot {hw} only if the host itself was just upgraded "
               "(then nvidia-smi on the host shows the mismatch too)",
               "nvidia-smi fails with `Failed to initialize NVML: Driver/library version mismatch` and CUDA "
               "with cudaErrorSystemDriverMismatch (803); typical after a host driver upgrade")
    maxc = (host or {}).get("smi_cuda") or driver_max_cuda(module)
    tc = c["torch_cuda"]
    if tc and maxc and vkey(tc) > vkey(maxc):
        need = driver_for_cuda(tc)
        _f(out, "cuda-above-driver", f"{host_name}/{v}: the runtime's torch (CUDA {tc})",
           f"a driver supporting CUDA {tc}" + (f" ({need} or newer)" if need else ""),
           f"driver {module or '?'} supports CUDA {maxc} at most",
           f"upgrade the driver on {hw} to {need or 'one that supports CUDA ' + tc} or newer (then the same "
           f"version in user space in container {v}), or install a vLLM whose torch is built for CUDA {maxc} or "
           f"older (pip's --extra-index-url https://download.pytorch.org/whl/cu{maxc.replace('.', '')} for the "
           "matching torch)",
           "torch then fails with `The NVIDIA driver on your system is too old` at its first CUDA use")

    # 5. /dev/shm for tensor parallelism
    need = shm_required_mib(tp)
    if ct is not None and c["shm_mib"] is not None and c["shm_mib"] < need:
        _f(out, "shm-too-small", f"{host_name}/{v}: /dev/shm", f"at least {need} MiB for tensor_parallel_size "
           f"{tp}" + (" (1 GiB per GPU)" if tp > 1 else ""), f"{c['shm_mib']} MiB",
           f"in container {v}: mount -o remount,size={max(need // GIB, 1)}G /dev/shm (now), and to keep it: "
           f"a line `tmpfs /dev/shm tmpfs defaults,size={max(need // GIB, 1)}G 0 0` in the container's "
           f"/etc/fstab (or lxc.mount.entry: tmpfs dev/shm tmpfs size={max(need // GIB, 1)}G,nosuid,nodev,"
           f"create=dir 0 0 in {conf} on {hw}); the container's memory: must cover it",
           "vLLM's workers exchange through /dev/shm and NCCL's shared-memory transport keeps its buffers there; "
           "too small fails with NCCL `Error while creating shared memory segment` or bus errors, minutes into "
           "loading")
    return out


UVM_TOOLS = "/dev/nvidia-uvm-tools"
UVM_TOOLS_WHY = ("only profilers and UVM tools (Nsight, cuda-gdb) use it; CUDA and vLLM need /dev/nvidiactl, "
                 "/dev/nvidia-uvm and the GPUs' own /dev/nvidiaN")


def notes(host: dict | None, *, host_name: str, vmid: int) -> list[str]:
    """What the check saw that does not stop serving: /dev/nvidia-uvm-tools missing on the host or not passed in
    (docs/gpu-containers.md, "Which nodes a container needs")."""
    if not host:
        return []
    node = (host.get("nodes") or {}).get(UVM_TOOLS) or {}
    if node.get("kind") != "char":
        return [f"note: {UVM_TOOLS} is not on {clean(host_name)} ({UVM_TOOLS_WHY}); not required"]
    cfg = parse_config(host.get("config") or [])
    if UVM_TOOLS not in cfg["dev"] and UVM_TOOLS not in cfg["mounts"]:
        return [f"note: container {int(vmid)} is not given {UVM_TOOLS} ({UVM_TOOLS_WHY}); not required"]
    return []


def summary(found: list[dict]) -> str | None:
    """The short `GPU plumbing` line of deploy status: None when nothing is wrong."""
    if not found:
        return None
    first = found[0]
    more = f" (+{len(found) - 1} more: deploy doctor)" if len(found) > 1 else ""
    return clean(f"{first['problem']}: {first['where']}: expected {first['expected']}, found {first['found']}",
                 200) + more


def render(found: list[dict]) -> str:
    """The findings for a person: one block each (the output layer makes it terminal-safe on the way out)."""
    lines = []
    for f in found:
        lines.append(f"GPU PLUMBING {f['problem']}: {f['where']}")
        lines.append(f"  expected: {f['expected']}")
        lines.append(f"  found:    {f['found']}")
        lines.append(f"  why:      {f['cause']}")
        lines.append(f"  fix:      {f['fix']}")
    return "\n".join(lines)


SMI_TIMEOUT_S = 10


def host_argv(vmid: int, smi_timeout_s: float | None = None) -> list[str]:
    """The gpu-plumbing check's one host exec (HOST_PLUMBING_SH), read-only; nvidia-smi bounded by smi_timeout_s
    (the playbook's gpu.nvidia_smi_timeout_s; 10 s without one)."""
    t = smi_timeout_s if smi_timeout_s else SMI_TIMEOUT_S
    return ["sh", "-c", HOST_PLUMBING_SH, "sh", str(int(vmid)), f"{float(t):g}"]


HOST_TIMEOUT_S = 25
HOST_OUTPUT_MAX = 256 << 10


def read_host(session, vmid: int, label: str = "gpu-plumbing", need_config: bool = True,
              smi_timeout_s: float | None = None) -> dict:
    """The host's side (HOST_PLUMBING_SH): parsed, or {"error": ...} when it could not be read. need_config=False:
    a container that does not exist yet (deploy prepare --create) is no error: its config is empty."""
    t = smi_timeout_s if smi_timeout_s else SMI_TIMEOUT_S
    try:
        r = session.run(host_argv(vmid, t), timeout=max(HOST_TIMEOUT_S, t + 15),
                        vmid=vmid, label=label, max_output=HOST_OUTPUT_MAX)
    except DeployError as e:
        return {"error": e.message}
    if not r.ok:
        return {"error": clean((r.err or r.out).strip()[:300]) or f"exit {r.exited}"}
    h = parse_host(r.out)
    h["smi_timeout_s"] = t
    if not need_config:
        h["config"], h["config_rc"] = [], 0
    elif h["config_rc"] not in (0, None) or not h["config"]:
        return {"error": f"`pct config {vmid}` failed: " + clean(" ".join(h["config"])[:300])}
    return h
