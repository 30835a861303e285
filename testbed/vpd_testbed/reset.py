"""Testbed's faults and reset (a mixin of core.Testbed): switching faults on and off (faults.py does the work) and
reset(), back to the state right after up() between tests."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from . import faults as _faults
from .common import kill as _kill, pids_alive as _pids_alive, read_pid as _read_pid, write_user_space
from .layout import BACKUPS, LXC_RESET, TEMPLATE, _read_json_file, write_template
from .scripts import ctl
from .scripts.gpusim import DRIVER


class ResetMixin:
    """Faults and reset() between tests."""

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

    # ---- reset -------------------------------------------------------------------------------------
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
                drv = DRIVER
                if self.options.get(h, {}).get(v, {}).get("gpus") == "real":  # the real driver's version
                    from . import realgpu
                    drv = realgpu.driver_version() or DRIVER
                if not self.lxc_of(h, v) and sorted(os.listdir(self.ctdir(h, v) / "nvlib")) != \
                        ["libcuda.so." + drv, "libnvidia-ml.so." + drv]:
                    write_user_space(self.ctdir(h, v), drv)
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
