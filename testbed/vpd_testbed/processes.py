"""Testbed's processes (a mixin of core.Testbed): the containers' network, the GPU simulators, each host's sshd,
the containers (start, stop, exec in them and in a host), the GPU simulator's answers, and killing everything."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import (SSH_PORT, TestbedError, kill as _kill, log_tail, pids_alive as _pids_alive,
                     port_free as _port_free, port_open as _port_open, read_pid as _read_pid, wait_until as _wait)
from .scripts import ctl


class ProcessMixin:
    """Starts, stops and enters the test bed's processes."""

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
                and (str(hd / "sshd_config")).encode() in ctl._cmdline(e) and b"-D" in ctl._cmdline(e)]
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
        if pid and b"sshd" in ctl._cmdline(pid):
            try:
                ns = os.readlink("/proc/%d/ns/mnt" % pid)
            except OSError:
                ns = None
            victims.append(pid)
            if ns:
                for e in os.listdir("/proc"):
                    if e.isdigit():
                        try:
                            if os.readlink("/proc/%s/ns/mnt" % e) == ns and b"sshd" in ctl._cmdline(e):
                                victims.append(int(e))
                        except OSError:
                            pass
        _kill(victims)
        ctl.wait_gone(victims, 5)
        a = self.address(h)
        _wait(lambda: _port_free(a, SSH_PORT), 5, "port %s:%d to close" % (a, SSH_PORT))

    def lxc_of(self, host: str, vmid: int):
        """The LXC description of a real LXC container (init=systemd), None for a namespace container."""
        return ctl.lxc_of(str(self.root / host), vmid)

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
                cmd = ctl._cmdline(pid)
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
