"""The test bed: a local simulated Proxmox VE GPU fleet (see docs/testbed.md and docs/design/contracts.md).

Mode: each simulated host is a real OpenSSH sshd bound to its own loopback address 127.77.0.<i> and running
in its own mount namespace (where /usr/sbin/pct is ours); each container is a mount + PID + network + UTS +
IPC namespace made with unshare and entered with nsenter; the GPUs of a host are files watched by a per-host
GPU driver simulator (scripts/gpusim.py). Everything we start is a process; `down()` kills them all, which
also frees every namespace and mount, and then removes the state directory.

Testbed is this module's class with its life cycle, paths and status; the rest of its methods come from mixins:
build.py (the files up() writes), processes.py (what runs), reset.py (faults and reset); layout.py holds the
constants and the texts written.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .build import BuildMixin
from .common import (SSH_PORT, TestbedError, pids_alive as _pids_alive, port_free as _port_free,
                     port_open as _port_open, read_pid as _read_pid, wait_until as _wait)
from .layout import (DATA, LAG_PORT_BASE, LAN_FIRST, LAN_LAST, LAN_WS, STALE_CONFIG, STATE, SUB_ADDR, TARGET,
                     TARGET_CONFIG, _container_name, _normalize_containers, _normalize_options, default_root,
                     etc_pve_sh, host_dev_sh, lean_python, safetensors_header, sim_nodes, write_template)
from .processes import ProcessMixin
from .reset import ResetMixin
from .scripts import ctl

# what the tests and docs import from here (DATA, STALE_CONFIG, safetensors_header, write_template...)
__all__ = ["Testbed", "TestbedError", "DATA", "STALE_CONFIG", "TARGET", "TARGET_CONFIG", "safetensors_header",
           "write_template", "sim_nodes", "host_dev_sh", "etc_pve_sh"]


class Testbed(BuildMixin, ProcessMixin, ResetMixin):
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

    # ---- status / down -----------------------------------------------------------------------------
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
