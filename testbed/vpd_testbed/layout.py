"""The test bed's constants and what it writes (see core.py): the container spec and option checks, the pct config
of a container, the host's pveversion and driver installer stand-ins, its hostinit.sh lines for /etc/pve and
/dev/nvidia*, the container template, and the drafter's safetensors header."""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

from .common import TestbedError
from .scripts import ctl

PKG = Path(__file__).resolve().parent
SCRIPTS = PKG / "scripts"
DATA = PKG / "data"
FAKE_VLLM = PKG / "fake_vllm"
LAG_PORT_BASE = 2300
LAN_FIRST, LAN_LAST, LAN_WS = 10, 253, 254  # containers' host numbers in the test bed's /24; the workstation's
SUB_ADDR = "127.77.0."
STATE = "testbed.json"

TARGET = "Qwen3.6-27B"
STALE_CONFIG = DATA / "qwen36-27b-dflash.stale-guess.config.json"
SITE_DIR = "/root/.vpd-testbed-site"  # in every container: this machine's site-packages (see site_pth)
TARGET_CONFIG = DATA / "qwen36-27b-target.config.json"  # the published config, whole (sizing reads it)


# back to a fresh container without rebooting it: deploy's units stopped and removed, its state gone
LXC_RESET = ("for u in $(systemctl list-units --all --plain --no-legend 'vllm-*.service' | awk '{print $1}') "
             "$(cd /etc/systemd/system && ls vllm-*.service 2>/dev/null); do systemctl stop \"$u\"; "
             "systemctl disable --quiet \"$u\" 2>/dev/null; systemctl reset-failed \"$u\" 2>/dev/null; done; "
             "rm -f /etc/systemd/system/vllm-*.service; systemctl daemon-reload; "
             "umount /root/models 2>/dev/null; rm -rf /var/lib/vllm-pve-deploy; true")


def default_root() -> str:
    return os.environ.get("VPD_TESTBED_DIR") or "/tmp/vpd-testbed"


def lean_python() -> str:
    """A Python for the test bed's own small scripts (pct, nvidia-smi, init, simulator): stdlib only."""
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _container_name(vmid: int) -> str:
    return "vllm-qwen" if vmid == 129 else "vllm-%d" % vmid


def _normalize_containers(hosts: int, containers, gpus: int) -> dict:
    """-> {host_name: {vmid: [gpu indices]}}"""
    names = ["pve%d" % i for i in range(1, hosts + 1)]
    allg = list(range(gpus))
    if containers is None:
        containers = [129]
    if isinstance(containers, (list, tuple)):
        spec = {n: {int(v): list(allg) for v in containers} for n in names}
    elif isinstance(containers, dict):
        if all(isinstance(k, str) and not str(k).isdigit() for k in containers):
            spec = {}
            for n in names:
                c = containers.get(n, {})
                if isinstance(c, (list, tuple)):
                    c = {int(v): list(allg) for v in c}
                spec[n] = {int(v): list(g if g is not None else allg) for v, g in c.items()}
            unknown = set(containers) - set(names)
            if unknown:
                raise TestbedError("containers given for unknown hosts %s (hosts are %s)"
                                   % (sorted(unknown), names))
        else:
            spec = {n: {int(v): list(g if g is not None else allg) for v, g in containers.items()} for n in names}
    else:
        raise TestbedError("containers must be a list of VMIDs or a dict")
    for n, cts in spec.items():
        for v, gl in cts.items():
            if not 100 <= v <= 999999999:
                raise TestbedError("VMID %d out of range 100..999999999" % v)
            bad = [g for g in gl if not 0 <= int(g) < gpus]
            if bad:
                raise TestbedError("%s/%d: GPU index %s out of range (host has %d GPUs)" % (n, v, bad, gpus))
    return spec


CT_OPTIONS = {"passthrough": ("dev", "mount", "cgroup-all"), "ip": None, "python": ("venv", "system", "none"),
              "init": ("namespaces", "systemd"), "onboot": ("0", "1"), "vllm": ("fake", "real"),
              "gpus": ("fake", "real"), "vllm_venv": None}


def _normalize_options(spec: dict, options) -> dict:
    """-> {host: {vmid: {option: value}}}: per-container variations of the pct config and the container's
    contents (default: `devN:` passthrough, ip=dhcp, the /root/ml-env venv). See docs/testbed.md."""
    out = {h: {} for h in spec}
    for h, cts in (options or {}).items():
        if h not in spec:
            raise TestbedError("options given for unknown host %r (hosts are %s)" % (h, list(spec)))
        for v, o in cts.items():
            v = int(v)
            if v not in spec[h]:
                raise TestbedError("options given for unknown container %s/%d" % (h, v))
            for k, val in o.items():
                if k == "onboot":
                    val = o[k] = str(val)
                if k not in CT_OPTIONS:
                    raise TestbedError("unknown container option %r (known: %s)" % (k, ", ".join(CT_OPTIONS)))
                if CT_OPTIONS[k] and val not in CT_OPTIONS[k]:
                    raise TestbedError("container option %s=%r: one of %s" % (k, val, ", ".join(CT_OPTIONS[k])))
            if o.get("vllm") == "real" and (o.get("python", "venv") != "venv" or o.get("init") == "systemd"):
                raise TestbedError("container option vllm=real needs python=venv and init=namespaces (%s/%d)"
                                   % (h, v))
            out[h][v] = dict(o)
    from . import realgpu
    realgpu.validate_options(spec, out)
    return out


def _mac(host_no: int, v: int) -> str:
    """The container's eth0 MAC (its pct config's hwaddr): the same rule as the host's pct create (ctl.mac)."""
    return ctl.mac(host_no, v)


SIM_NODE_TEXT = "vpd-testbed-node c %d:%d\n"
BACKUPS = "vllm-pve-deploy-backups"  # what deploy prepare keeps in the host's /root (orchestrator/hosts/prepare.py)

# the host's pveversion (pve_version, a host fault, changes what it says)
PVEVERSION = r"""#!/bin/sh
V=$(sed -n 's/.*"pve_version": *"\([0-9.]*\)".*/\1/p' %(hd)s/faults.json 2>/dev/null)
V=${V:-8.2.4}
case "$1" in
  -v|--verbose) echo "proxmox-ve: $V (running kernel: 6.8.8-2-pve)"
                echo "pve-manager: $V (running version: $V/faa83925c9641325)"
                echo "pve-container: $( [ "${V%%%%.*}" -ge 8 ] && echo 5.1.12 || echo 4.4-6)";;
  *) echo "pve-manager/$V/faa83925c9641325 (running kernel: 6.8.8-2-pve)";;
esac
"""

# a stand-in for NVIDIA's driver installer (a makeself archive users run with sh): user space only, into the
# container's nvlib (core.write_user_space's place); without --no-kernel-module it fails as in a container
DRIVER_RUN = r"""#!/bin/sh
# vllm-pve-deploy test bed: stand-in for NVIDIA-Linux-x86_64-%(v)s.run
V=%(v)s
kmod=1
for a; do
  case "$a" in
    --no-kernel-module) kmod=0;;
    --version|-v) echo "NVIDIA-Linux-x86_64-$V"; exit 0;;
  esac
done
if [ $kmod = 1 ]; then
  echo "ERROR: Unable to load the kernel module 'nvidia.ko'. (in a container: pass --no-kernel-module)" >&2
  exit 1
fi
D=/usr/lib/x86_64-linux-gnu/nvidia/current
[ -d "$D" ] || { echo "ERROR: no $D to install into" >&2; exit 1; }
rm -f "$D"/libnvidia-ml.so.* "$D"/libcuda.so.*
: > "$D/libnvidia-ml.so.$V" && : > "$D/libcuda.so.$V" || exit 1
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: $V) is now complete."
"""


TEMPLATE = "debian-12-standard_12.7-1_amd64.tar.gz"  # the `local` storage's one template (pct create)


def write_template(path, extra=None):
    """A container template as `pct create` takes it: a tar archive of a root file system. The test bed uses its
    ./root/ (the rest of a container's file system is this machine's); extra: {relative path under root/: bytes}."""
    import io
    import tarfile
    files = {".profile": ('# vllm-pve-deploy test bed container (from the template)\n'
                          'if [ -n "$BASH_VERSION" ] && [ -f "$HOME/.bashrc" ]; then . "$HOME/.bashrc"; fi\n'
                          'export PATH="/root/ml-env/bin:$PATH"\n').encode(),
             ".bashrc": b"# vllm-pve-deploy test bed container (from the template)\n", **(extra or {})}
    tmp = str(path) + ".tmp"
    with tarfile.open(tmp, "w:gz") as t:
        for d in ("./etc", "./root"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o700 if d == "./root" else 0o755
            t.addfile(ti)
        ti = tarfile.TarInfo("./etc/os-release")
        data = b'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
        for rel, data in sorted(files.items()):
            ti = tarfile.TarInfo("./root/" + rel)
            ti.size, ti.mode = len(data), 0o755 if rel.endswith(".sh") else 0o644
            t.addfile(ti, io.BytesIO(data))
    os.replace(tmp, path)


def etc_pve_sh(hd) -> str:
    """hostinit.sh lines: /etc/pve of the simulated host (its pve/ directory, /etc/pve/lxc -> nodes/HOST/lxc as on
    Proxmox). A read-only overlay adds the mount point to the machine's /etc, its submounts bound back."""
    return ("mkdir -p %(hd)s/run/realetc\n"
            "mount --rbind /etc %(hd)s/run/realetc\n"
            "esubs=$(awk '$5 ~ \"^/etc/\" {print $5}' /proc/self/mountinfo)\n"
            "mount -t overlay overlay -o lowerdir=%(hd)s/etcstub:/etc /etc\n"
            "for m in $esubs; do [ -e \"$m\" ] && mount --rbind \"%(hd)s/run/realetc${m#/etc}\" \"$m\"; done\n"
            "mount --bind %(hd)s/pve /etc/pve\n") % {"hd": hd}


MODULE_VERSION_TEXT = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  %s  Tue Mar  5 22:23:56 UTC 2024\n"
                       "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
UVM_MAJOR = 508  # the pct config's lxc.cgroup2.devices.allow for it says the same


def sim_nodes(ngpus: int) -> dict:
    """The simulated device nodes of a host: {name: (major, minor)}, as a real driver numbers them."""
    out = {"nvidia%d" % i: (195, i) for i in range(ngpus)}
    out.update({"nvidiactl": (195, 255), "nvidia-uvm": (UVM_MAJOR, 0), "nvidia-uvm-tools": (UVM_MAJOR, 1)})
    return out


def host_dev_sh(hd, nodes) -> str:
    """hostinit.sh lines: /dev/nvidia* of the simulated host. A read-only overlay puts empty mount points over
    the machine's /dev (its submounts bound back), then each GPU file is bound on its name; nvidia-uvm only
    without the host fault uvm_missing (run/uvm_missing), as after a reboot with no CUDA use on the host."""
    return ("mkdir -p %(hd)s/run/realdev\n"
            "mount --rbind /dev %(hd)s/run/realdev\n"
            "subs=$(awk '$5 ~ \"^/dev/[^/]+$\" {print $5}' /proc/self/mountinfo)\n"
            "mount -t overlay overlay -o lowerdir=%(hd)s/devstub:/dev /dev\n"
            "for m in $subs; do [ -d \"$m\" ] && mount --rbind \"%(hd)s/run/realdev${m#/dev}\" \"$m\"; done\n"
            "[ -d /proc/driver ] && mount --bind %(hd)s/procdriver /proc/driver\n"
            "for n in %(names)s; do\n"
            "  case $n in nvidia-uvm*) [ -e %(hd)s/run/uvm_missing ] && continue;; esac\n"
            "  mount --bind %(hd)s/gpus/$n /dev/$n\n"
            "done\n") % {"hd": hd, "names": " ".join(sorted(nodes))}


def _pct_conf(v: int, gpus, opt: dict, host_no: int = 1) -> str:
    """The container's /etc/pve/nodes/<host>/lxc/<vmid>.conf, as `pct config` prints it.

    passthrough "dev" (default, PVE >= 8.1): `devN: /dev/nvidiaK` entries; "mount": `lxc.mount.entry` bind
    mounts of each device; "cgroup-all": only `lxc.cgroup2.devices.allow: c 195:* rwm` plus the control devices
    (the GPU nodes come from a hook, as with an autodev script): every GPU of the host is allowed."""
    style = opt.get("passthrough", "mount" if opt.get("init") == "systemd" else "dev")
    ctl_devs = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    lines = ["arch: amd64", "cores: 32"]
    if style == "dev":
        devs = ["/dev/nvidia%d" % i for i in gpus] + ctl_devs
        lines += ["dev%d: %s" % (n, d) for n, d in enumerate(devs)]
    lines += ["features: nesting=1", "hostname: %s" % _container_name(v), "memory: 262144",
              "net0: name=eth0,bridge=vmbr0,hwaddr=%s,ip=%s,type=veth" % (_mac(host_no, v), opt.get("ip") or "dhcp"),
              *(["onboot: 1"] if opt.get("onboot") == "1" else []),
              "ostype: debian", "rootfs: local-lvm:vm-%d-disk-0,size=200G" % v, "swap: 0",
              "lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 508:* rwm"]
    if style == "mount":
        lines += ["lxc.mount.entry: %s %s none bind,optional,create=file" % (d, d[1:])
                  for d in ["/dev/nvidia%d" % i for i in gpus] + ctl_devs]
    elif style == "cgroup-all":
        lines += ["lxc.mount.entry: %s %s none bind,optional,create=file" % (d, d[1:]) for d in ctl_devs]
        lines += ["lxc.hook.autodev: /var/lib/lxc/%d/nvidia-autodev.sh" % v]
    return "\n".join(lines) + "\n"


def safetensors_header(hidden=5120, inter=17408, heads=32, kv=8, head_dim=128, layers=5, taps=5) -> bytes:
    tensors = {}
    off = 0

    def add(name, shape):
        nonlocal off
        n = 2
        for s in shape:
            n *= s
        tensors[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n

    add("fc.weight", [hidden, hidden * taps])
    add("hidden_norm.weight", [hidden])
    for i in range(layers):
        p = "layers.%d." % i
        add(p + "input_layernorm.weight", [hidden])
        add(p + "post_attention_layernorm.weight", [hidden])
        add(p + "self_attn.q_proj.weight", [heads * head_dim, hidden])
        add(p + "self_attn.k_proj.weight", [kv * head_dim, hidden])
        add(p + "self_attn.v_proj.weight", [kv * head_dim, hidden])
        add(p + "self_attn.o_proj.weight", [hidden, heads * head_dim])
        add(p + "self_attn.q_norm.weight", [head_dim])
        add(p + "self_attn.k_norm.weight", [head_dim])
        add(p + "mlp.gate_proj.weight", [inter, hidden])
        add(p + "mlp.up_proj.weight", [inter, hidden])
        add(p + "mlp.down_proj.weight", [hidden, inter])
    add("norm.weight", [hidden])
    header = {"__metadata__": {"format": "pt"}}
    header.update(tensors)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _read_json_file(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
