"""Fault switches of the test bed (contracts.md section 4): validation and the side effects of the active ones.

Passive faults are only stored (the fake vllm / nvidia-smi / pct read the JSON on every use). Active ones start
or stop something right away: a helper process, a mount, sshd, a lagproxy.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from .common import SSH_PORT, DRAFTER, pids_alive, port_open, read_pid, wait_until, write_user_space
from .scripts import ctl

CONTAINER = {
    "oom_at_startup": "one of free_memory, cuda_oom, no_kv_cache, max_len",
    "oom_exit_code": "0 or 1",
    "crash_after_s": "seconds (float)",
    "load_s": "seconds (float, default 1.0)",
    "vllm_version": 'version string, e.g. "0.21.0" (default "0.34.0")',
    "vllm_build": "release or pr40898",
    "missing_extension": 'file name, e.g. "_C_stable_libtorch.abi3.so"',
    "no_fix_markers": "bool",
    "sigterm_ignoring_holder_mib": "MiB (int): a process ignoring SIGTERM holds GPU 0 (first GPU of the CT)",
    "config_revert_s": "seconds (float): the drafter config is reverted to the stale guess that long after it changes",
    "readonly_models": "bool: /root/models mounted read-only",
    "port_in_use": "TCP port (int): something listens there",
    "shm_mib": "MiB (int): /dev/shm of the container is remounted that small (default 8192)",
    "missing_dev_line": 'device path, e.g. "/dev/nvidia1": pct config no longer prints the line passing it in',
    "spec_overhead": "factor (float, default 1.0): every speculative decode step of the fake vLLM costs this many "
                     "times its modelled time (4: speculation never pays)",
    "torch_cuda": 'CUDA version, e.g. "12.8": the venv gets a torch/version.py saying so (no torch: not importable)',
}
HOST = {
    "release_delay_s": "seconds (float, default 0.3): GPU memory lingers that long after a holder exits",
    "nvidia_smi_hang": "bool: nvidia-smi never answers",
    "nvidia_smi_mismatch": "containers or everywhere: nvidia-smi fails with NVML's Driver/library version mismatch "
                           "(in the containers only: their user-space driver differs; everywhere: the host's driver "
                           "was upgraded without a reboot)",
    "foreign_holder": 'JSON {"gpu": 0, "mib": 30000}: a host process outside every container holds the GPU',
    "unreachable": "bool: sshd stopped, port closed",
    "ssh_drop_after_s": "seconds (float): every SSH connection to the host is cut that long after it opened",
    "latency_ms": "ms (int): added round-trip time, through a lagproxy in front of sshd (inventory port changes)",
    "keep_env_supported": "bool (default true): false makes pct reject --keep-env like pve-container < 5.0.9",
    "pve_version": 'version, e.g. "8.0.4" (default "8.2.4"): what pveversion prints; below 8.1 pve-container has no '
                   "devN: keys (pct set refuses them)",
    "uvm_missing": "bool: /dev/nvidia-uvm and /dev/nvidia-uvm-tools are gone from the host (a reboot with no CUDA "
                   "use on the host); the containers keep theirs",
    "gpu_total_mib": "MiB (int, default 81559): every GPU of the host reports this total memory (a smaller card: "
                     "nvidia-smi everywhere, and the fake vLLM sizes itself from it)",
}

FAKE_VLLM_LAYOUT = {"vllm_version", "vllm_build", "missing_extension", "no_fix_markers"}
_FLOAT = {"crash_after_s", "load_s", "spec_overhead", "config_revert_s", "release_delay_s", "ssh_drop_after_s"}
_INT = {"sigterm_ignoring_holder_mib", "port_in_use", "latency_ms", "oom_exit_code", "shm_mib", "gpu_total_mib"}
_BOOL = {"no_fix_markers", "readonly_models", "nvidia_smi_hang", "unreachable", "keep_env_supported", "uvm_missing"}

M_HOLDER = "vpd-testbed-sigterm-holder"
M_REVERT = "vpd-testbed-config-revert"
M_PORT = "vpd-testbed-port-listener"

HOLDER_CODE = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd = os.open(sys.argv[2], os.O_RDWR)
os.lseek(fd, int(sys.argv[3]) << 20, 0)
while True:
    time.sleep(3600)
"""

REVERT_CODE = r"""
import os, sys, time
path, stale_path, delay = sys.argv[2], sys.argv[3], float(sys.argv[4])
stale = open(stale_path, 'rb').read()
def read():
    try:
        with open(path, 'rb') as f:
            return f.read()
    except OSError:
        return None
last, changed = stale, None
while True:
    time.sleep(0.05)
    cur = read()
    if cur != last:
        last, changed = cur, time.monotonic()
    if changed is not None and cur is not None and cur != stale and time.monotonic() - changed >= delay:
        tmp = path + '.vpd-revert.tmp'
        try:
            with open(tmp, 'wb') as f:
                f.write(stale)
            os.replace(tmp, path)
        except OSError:
            pass
        last, changed = read(), None
"""

PORT_CODE = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', int(sys.argv[2])))
s.listen(16)
while True:
    c, _ = s.accept()
    try:
        c.settimeout(1.0)
        try:
            c.recv(4096)
        except OSError:
            pass
        c.sendall(b'HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\nServer: something-else\r\n\r\n')
    except OSError:
        pass
    c.close()
"""

FOREIGN_CODE = r"""
import os, sys, time
fd = os.open(sys.argv[2], os.O_RDWR)
os.lseek(fd, int(sys.argv[3]) << 20, 0)
while True:
    time.sleep(3600)
"""


class FaultError(ValueError):
    pass


def validate(name, value, container):
    table = CONTAINER if container else HOST
    if name not in table:
        other = HOST if container else CONTAINER
        where = "host-level (use HOST without /VMID)" if not container and False else None
        if name in other:
            where = "a host-level fault (give HOST, not HOST/VMID)" if container else \
                "a container-level fault (give HOST/VMID)"
            raise FaultError("%s is %s" % (name, where))
        raise FaultError("unknown fault %r; known %s faults: %s" % (name, "container" if container else "host",
                                                                    ", ".join(sorted(table))))
    if value is None or (value is False and name in _BOOL):
        return
    if name in _FLOAT and not isinstance(value, (int, float)):
        raise FaultError("%s needs a number of seconds" % name)
    if name in _INT and (not isinstance(value, int) or isinstance(value, bool)):
        raise FaultError("%s needs an integer" % name)
    if name in _BOOL and not isinstance(value, bool):
        raise FaultError("%s needs true/false" % name)
    if name == "oom_at_startup" and value not in ("free_memory", "cuda_oom", "no_kv_cache", "max_len"):
        raise FaultError("oom_at_startup must be free_memory, cuda_oom, no_kv_cache or max_len")
    if name == "nvidia_smi_mismatch" and value not in ("containers", "everywhere"):
        raise FaultError("nvidia_smi_mismatch must be containers or everywhere")
    if name == "missing_dev_line" and not (isinstance(value, str) and value.startswith("/dev/nvidia")):
        raise FaultError('missing_dev_line needs a device path such as "/dev/nvidia1"')
    if name == "torch_cuda" and not (isinstance(value, str) and __import__("re").fullmatch(r"\d{1,2}\.\d{1,2}", value)):
        raise FaultError('torch_cuda needs a CUDA version such as "12.8"')
    if name == "pve_version" and not (isinstance(value, str) and __import__("re").fullmatch(r"\d+\.\d+(\.\d+)?",
                                                                                            value)):
        raise FaultError('pve_version needs a version such as "8.0.4"')
    if name == "shm_mib" and value < 1:
        raise FaultError("shm_mib needs a positive number of MiB")
    if name == "vllm_build" and value not in ("release", "pr40898"):
        raise FaultError("vllm_build must be release or pr40898")
    if name == "foreign_holder":
        if not (isinstance(value, dict) and isinstance(value.get("gpu"), int) and isinstance(value.get("mib"), int)):
            raise FaultError('foreign_holder needs {"gpu": INT, "mib": INT}')


# faults whose value is text (a version, a path, a word): `torch_cuda=12.8` is the string "12.8", not the number
_STR = {"torch_cuda", "vllm_version", "pve_version", "vllm_build", "missing_extension", "missing_dev_line",
        "oom_at_startup", "nvidia_smi_mismatch"}


def parse_value(text: str, name: str | None = None):
    """CLI value: JSON if it parses (true, 0.5, 30000, {"gpu": 0}), else the plain string; for a fault whose value
    is text (_STR), the text as written unless it is a quoted JSON string (issue 53: 12.8 stays "12.8")."""
    import json
    if name in _STR and not text.startswith('"'):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- helpers in containers -----------------------------------------------------------------------
def _ct_helpers(tb, host, vmid, marker):
    out = []
    for p in tb.container_pids(host, vmid):
        if marker.encode() in ctl._cmdline(p):
            out.append(p)
    return out


def _kill_ct_helper(tb, host, vmid, marker):
    pids = _ct_helpers(tb, host, vmid, marker)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    ctl.wait_gone(pids, 5)


def _start_ct_helper(tb, host, vmid, marker, code, *args, ready=None):
    r = tb.container_exec(host, vmid, ["sh", "-c", 'exec setsid -f "$@" </dev/null >/dev/null 2>&1', "sh",
                                      tb.python, "-SE", "-c", code, marker] + [str(a) for a in args], timeout=10)
    if r.returncode:
        raise RuntimeError("starting %s in %s/%s failed: %s" % (marker, host, vmid, r.stderr.strip()))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = _ct_helpers(tb, host, vmid, marker)
        if pids and (ready is None or ready(pids[0])):
            return pids[0]
        time.sleep(0.005)
    raise RuntimeError("%s did not come up in %s/%s" % (marker, host, vmid))


def _holds_gpu(pid):
    try:
        for fd in os.listdir("/proc/%d/fd" % pid):
            if "nvidia" in os.readlink("/proc/%d/fd/%s" % (pid, fd)):
                with open("/proc/%d/fdinfo/%s" % (pid, fd)) as f:
                    if any(line.startswith("pos:") and int(line.split()[1]) > 0 for line in f):
                        return True
    except (OSError, ValueError):
        pass
    return False


def _listens(port):
    def check(pid):
        try:
            for fn in ("tcp", "tcp6"):
                with open("/proc/%d/net/%s" % (pid, fn)) as f:
                    for line in f.readlines()[1:]:
                        parts = line.split()
                        if parts[1].endswith(":%04X" % port) and parts[3] == "0A":
                            return True
        except OSError:
            pass
        return False
    return check


# ---- host-level helpers ----------------------------------------------------------------------------
def _pidfile(tb, host, name):
    return tb.hostdir(host) / "run" / (name + ".pid")


def _stop_pidfile(tb, host, name):
    f = _pidfile(tb, host, name)
    try:
        pid = int(f.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if str(tb.root).encode() in ctl._cmdline(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        ctl.wait_gone([pid], 5)
    try:
        f.unlink()
    except OSError:
        pass


def _spawn_pidfile(tb, host, name, argv):
    p = tb.spawn(argv, tb.hostdir(host) / "run" / (name + ".log"))
    _pidfile(tb, host, name).write_text("%d\n" % p.pid)
    return p


def _start_lagproxy(tb, host, ms):
    a = tb.address(host)
    port = tb.lag_port(host)
    p = _spawn_pidfile(tb, host, "lagproxy", [tb.python, "-E", str(tb.root / "bin" / "lagproxy.py"),
                                              "--listen", "%s:%d" % (a, port), "--to", "%s:%d" % (a, SSH_PORT),
                                              "--delay-ms", "%g" % (ms / 2.0)])
    wait_until(lambda: port_open(a, port) or p.poll() is not None, 10, "lagproxy of %s" % host)
    if p.poll() is not None:
        raise RuntimeError("lagproxy of %s failed to start (port %d in use?)" % (host, port))


def apply(tb, host, vmid, name, value, old):
    """Make the side effect of fault `name` match `value` (None = off)."""
    if vmid is not None:
        if name == "sigterm_ignoring_holder_mib":
            _kill_ct_helper(tb, host, vmid, M_HOLDER)
            if value:
                gpu = tb.spec[host][int(vmid)][0]
                _start_ct_helper(tb, host, vmid, M_HOLDER, HOLDER_CODE, "/dev/nvidia%d" % gpu, value,
                                 ready=_holds_gpu)
        elif name == "config_revert_s":
            _kill_ct_helper(tb, host, vmid, M_REVERT)
            if value is not None:
                _start_ct_helper(tb, host, vmid, M_REVERT, REVERT_CODE, "/root/models/%s/config.json" % DRAFTER,
                                 "/etc/vpd-testbed/stale-drafter-config.json", value)
        elif name == "port_in_use":
            _kill_ct_helper(tb, host, vmid, M_PORT)
            if value:
                _start_ct_helper(tb, host, vmid, M_PORT, PORT_CODE, value, ready=_listens(int(value)))
        elif name == "torch_cuda":
            import glob
            import shutil
            for sp in glob.glob(str(tb.ctdir(host, vmid) / "root" / "ml-env" / "lib" / "python*" / "site-packages")):
                d = os.path.join(sp, "torch")
                if value:
                    os.makedirs(d, exist_ok=True)
                    with open(os.path.join(d, "version.py"), "w") as f:  # as torch writes it; no __init__.py
                        f.write("__version__ = '2.8.0+cu%s'\ndebug = False\ncuda: Optional[str] = '%s'\n"
                                % (value.replace(".", ""), value))
                else:
                    shutil.rmtree(d, ignore_errors=True)
        elif name == "shm_mib":
            if tb.init_pid(host, vmid):
                r = tb.container_exec(host, vmid, ["mount", "-o", "remount,size=%dm" % (value or 8192), "/dev/shm"],
                                      timeout=10)
                if r.returncode:
                    raise RuntimeError("shm_mib: %s" % r.stderr.strip())
        elif name == "readonly_models":
            if tb.init_pid(host, vmid):
                script = "mountpoint -q /root/models && umount /root/models; true"
                if value:
                    script += "; mount --bind /root/models /root/models && mount -o remount,bind,ro /root/models"
                r = tb.container_exec(host, vmid, ["sh", "-c", script], timeout=10)
                if r.returncode:
                    raise RuntimeError("readonly_models: %s" % r.stderr.strip())
        return
    if name == "nvidia_smi_mismatch":
        # "containers": their user-space driver is another version than the host's module (the NVML library
        # version the fake nvidia-smi prints); "everywhere" is the host's own upgrade: the containers keep theirs
        from .scripts.gpusim import DRIVER, MISMATCH_VERSION
        for v in tb.spec[host]:
            write_user_space(tb.ctdir(host, v), MISMATCH_VERSION if value == "containers" else DRIVER)
    elif name == "uvm_missing":
        flag = tb.hostdir(host) / "run" / "uvm_missing"
        if value:
            flag.write_text("1\n")
        elif flag.exists():
            flag.unlink()
        pid = read_pid(tb.hostdir(host) / "sshd.pid")
        if pid and pids_alive([pid]):  # the host's mount namespace: its /dev/nvidia-uvm* (core.host_dev_sh)
            hd = tb.hostdir(host)
            script = "".join("umount /dev/%s 2>/dev/null; " % n if value else
                             "mountpoint -q /dev/%s || mount --bind %s/gpus/%s /dev/%s; " % (n, hd, n, n)
                             for n in ("nvidia-uvm", "nvidia-uvm-tools")) + "true"
            subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "sh", "-c", script], timeout=10, check=True)
    elif name == "foreign_holder":
        _stop_pidfile(tb, host, "foreign_holder")
        if value:
            p = _spawn_pidfile(tb, host, "foreign_holder", [tb.python, "-SE", "-c", FOREIGN_CODE, "vpd-foreign-holder",
                                                            tb.gpu_path(host, value["gpu"]), str(value["mib"])])
            deadline = time.monotonic() + 10
            while not _holds_gpu(p.pid) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
    elif name == "unreachable":
        lag = _pidfile(tb, host, "lagproxy").exists()
        if value:
            tb.stop_sshd(host)
            _stop_pidfile(tb, host, "lagproxy")
            if tb.host_faults(host).get("latency_ms"):
                (tb.hostdir(host) / "run" / "lagproxy.suspended").write_text("1\n")
        else:
            pid = read_pid(tb.hostdir(host) / "sshd.pid")
            if not (pid and pids_alive([pid])):
                tb.start_sshd(host)
            ms = tb.host_faults(host).get("latency_ms")
            if ms and not lag:
                _start_lagproxy(tb, host, ms)
            try:
                (tb.hostdir(host) / "run" / "lagproxy.suspended").unlink()
            except OSError:
                pass
    elif name == "ssh_drop_after_s":
        _stop_pidfile(tb, host, "ssh_drop")
        if value is not None:
            _spawn_pidfile(tb, host, "ssh_drop", [tb.python, "-SE", str(tb.root / "bin" / "helpers.py"), "ssh_drop",
                                                  str(tb.hostdir(host)), str(float(value))])
    elif name == "latency_ms":
        _stop_pidfile(tb, host, "lagproxy")
        if value and not tb.host_faults(host).get("unreachable"):
            _start_lagproxy(tb, host, value)
        tb.write_inventory()


def cleanup_helpers(tb, host=None):
    """Stop host-level helpers whose fault is off (after a crash or a hand-edited faults.json)."""
    for h in ([host] if host else tb.hosts):
        f = tb.host_faults(h)
        for name, key in (("foreign_holder", "foreign_holder"), ("ssh_drop", "ssh_drop_after_s"),
                          ("lagproxy", "latency_ms")):
            if not f.get(key):
                _stop_pidfile(tb, h, name)
        if not f.get("unreachable"):
            pid = read_pid(tb.hostdir(h) / "sshd.pid")
            if not (pid and pids_alive([pid])):
                tb.start_sshd(h)
    tb.write_inventory()
