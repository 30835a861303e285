"""GPU driver simulator of one simulated host (stdlib only; runs in the root PID namespace).

GPU i of the host is the file HOSTDIR/gpus/nvidia<i>. A process uses M MiB of GPU i while it holds an open
fd on that file (any path: containers see it bind-mounted at /dev/nvidia<i>) whose offset is M MiB.
Memory used = live holders + holders that vanished less than release_delay_s ago (host fault, default 0.3).

Serves `nvidia-smi` over unix sockets: HOSTDIR/gpu.sock for the host itself, HOSTDIR/ctVMID/run/nvidia-sim.sock
for each container (its /run is HOSTDIR/ctVMID/run; the socket tells which container asks).
Protocol: one JSON line {"argv": [...]} -> one JSON line {"rc": int, "out": str, "err": str}.
Special requests: {"op": "reset"} forgets vanished holders; {"op": "state"} returns the memory table.
"""
import hashlib
import json
import os
import select
import socket
import sys
import threading
import time

MIB = 1 << 20
NAME = "NVIDIA H100 80GB HBM3"
MISMATCH_VERSION = "550.90"  # the containers' user-space driver under nvidia_smi_mismatch=containers
MISMATCH_TEXT = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: %s\n" \
    % MISMATCH_VERSION
NO_LIB_TEXT = ("NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA "
               "Display Driver is properly installed and present in your system.\nPlease also try adding directory "
               "that contains libnvidia-ml.so to your system PATH.\n")
TOTAL = 81559
DRIVER = "550.54.15"
CUDA = "12.4"


class Sim:
    def __init__(self, hostdir):
        self.hostdir = hostdir
        self.host = json.load(open(os.path.join(hostdir, "host.json")))
        self.ngpus = self.host["gpus"]
        self.ids = {}
        for i in range(self.ngpus):
            st = os.stat(os.path.join(hostdir, "gpus", "nvidia%d" % i))
            self.ids[(st.st_dev, st.st_ino)] = i
        self.lock = threading.RLock()
        self.live = {}  # (pid, fd) -> (gpu, mib, comm)
        self.gone = {}  # (pid, fd) -> (gpu, mib, last_seen)
        self.last_seen = {}

    def faults(self):
        try:
            with open(os.path.join(self.hostdir, "faults.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def total(self):
        """Each GPU's total MiB: the host fault gpu_total_mib, else an 80 GB card's figure."""
        v = self.faults().get("gpu_total_mib")
        return int(v) if isinstance(v, int) and v > 0 else TOTAL

    def uuid(self, i):
        h = hashlib.sha1(("%s/%d" % (self.host["name"], i)).encode()).hexdigest()
        return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:32])

    def scan(self):
        with self.lock:
            return self._scan()

    def _scan(self):
        now = time.monotonic()
        live = {}
        for e in os.listdir("/proc"):
            if not e.isdigit():
                continue
            base = "/proc/" + e + "/fd/"
            try:
                fds = os.listdir(base)
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(base + fd)
                except OSError:
                    continue
                if "nvidia" not in link:
                    continue
                try:
                    st = os.stat(base + fd)
                except OSError:
                    continue
                gpu = self.ids.get((st.st_dev, st.st_ino))
                if gpu is None:
                    continue
                pos = 0
                try:
                    with open("/proc/%s/fdinfo/%s" % (e, fd)) as f:
                        for line in f:
                            if line.startswith("pos:"):
                                pos = int(line.split()[1])
                                break
                except (OSError, ValueError):
                    continue
                live[(int(e), int(fd))] = (gpu, pos // MIB)
        delay = float(self.faults().get("release_delay_s", 0.3))
        with self.lock:
            for k, (gpu, mib) in self.live.items():
                if k not in live:
                    self.gone[k] = (gpu, mib, now)
            for k in live:
                self.gone.pop(k, None)
            for k, (gpu, mib, t) in list(self.gone.items()):
                if now - t >= delay:
                    del self.gone[k]
            self.live = live
            used = [0] * self.ngpus
            for gpu, mib in live.values():
                used[gpu] += mib
            for gpu, mib, _ in self.gone.values():
                used[gpu] += mib
            return used, dict(live)

    def background(self):
        while True:
            self.scan()
            with self.lock:
                busy = bool(self.live or self.gone)
            time.sleep(0.05 if busy else 0.25)

    # ---- nvidia-smi ------------------------------------------------------------------------------
    FIELDS = {
        "index": ("index", None), "count": ("count", None),
        "name": ("name", None), "gpu_name": ("name", None),
        "uuid": ("uuid", None), "gpu_uuid": ("uuid", None),
        "memory.used": ("memory.used [MiB]", "MiB"), "memory.total": ("memory.total [MiB]", "MiB"),
        "memory.free": ("memory.free [MiB]", "MiB"), "memory.reserved": ("memory.reserved [MiB]", "MiB"),
        "utilization.gpu": ("utilization.gpu [%]", "%"), "utilization.memory": ("utilization.memory [%]", "%"),
        "pci.bus_id": ("pci.bus_id", None), "gpu_bus_id": ("pci.bus_id", None),
        "driver_version": ("driver_version", None), "temperature.gpu": ("temperature.gpu", None),
        "power.draw": ("power.draw [W]", "W"), "persistence_mode": ("persistence_mode", None),
    }
    APP_FIELDS = {
        "pid": ("pid", None), "process_name": ("process_name", None), "name": ("process_name", None),
        "used_memory": ("used_gpu_memory [MiB]", "MiB"), "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB"),
        "gpu_uuid": ("gpu_uuid", None), "gpu_bus_id": ("gpu_bus_id", None), "gpu_name": ("gpu_name", None),
    }

    def bus(self, i):
        return "00000000:%02X:00.0" % (0x18 + 0x10 * i)

    def value(self, f, i, used):
        if f == "index":
            return str(i)
        if f == "count":
            return None
        if f in ("name", "gpu_name"):
            return NAME
        if f in ("uuid", "gpu_uuid"):
            return self.uuid(i)
        if f == "memory.used":
            return str(used[i])
        if f == "memory.total":
            return str(self.total())
        if f == "memory.free":
            return str(max(0, self.total() - used[i]))
        if f == "memory.reserved":
            return "0"
        if f == "utilization.gpu":
            return "0"
        if f == "utilization.memory":
            return "0"
        if f in ("pci.bus_id", "gpu_bus_id"):
            return self.bus(i)
        if f == "driver_version":
            return DRIVER
        if f == "temperature.gpu":
            return "32"
        if f == "power.draw":
            return "71.00"
        if f == "persistence_mode":
            return "Enabled"

    def smi(self, argv, gpus, in_container):
        query = apps = None
        fmt = None
        sel = None
        listing = False
        i = 0
        while i < len(argv):
            a = argv[i]
            if a.startswith("--query-gpu="):
                query = a.split("=", 1)[1]
            elif a == "--query-gpu" and i + 1 < len(argv):
                i += 1
                query = argv[i]
            elif a.startswith("--query-compute-apps="):
                apps = a.split("=", 1)[1]
            elif a.startswith("--format="):
                fmt = a.split("=", 1)[1]
            elif a == "--format" and i + 1 < len(argv):
                i += 1
                fmt = argv[i]
            elif a in ("-i", "--id") and i + 1 < len(argv):
                i += 1
                sel = argv[i]
            elif a.startswith("--id="):
                sel = a.split("=", 1)[1]
            elif a in ("-L", "--list-gpus"):
                listing = True
            elif a in ("-h", "--help"):
                return 0, "NVIDIA System Management Interface -- v%s\n\n(test bed simulator)\n" % DRIVER, ""
            else:
                return 2, "", ("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
                               if a.startswith("-") else "")
            i += 1
        if sel is not None:
            try:
                wanted = [int(x) for x in sel.split(",")]
            except ValueError:
                return 6, "No devices were found\n", ""
            if any(w not in gpus for w in wanted):
                return 6, "No devices were found\n", ""
            gpus = [g for g in gpus if g in wanted]
        used, live = self.scan()
        if not gpus:
            return 6, "No devices were found\n", ""
        if listing:
            return 0, "".join("GPU %d: %s (UUID: %s)\n" % (g, NAME, self.uuid(g)) for g in gpus), ""
        if query is not None or apps is not None:
            opts = (fmt or "").split(",")
            if "csv" not in opts:
                return 2, "", "Please specify the output format with --format=csv\n"
            header = "noheader" not in opts
            units = "nounits" not in opts
            table = self.FIELDS if query is not None else self.APP_FIELDS
            fields = [f.strip() for f in (query if query is not None else apps).split(",") if f.strip()]
            for f in fields:
                if f not in table:
                    return 2, 'Field "%s" is not a valid field to query.\n\n' % f, ""
            out = []
            if header:
                out.append(", ".join(table[f][0] for f in fields))
            if query is not None:
                for g in gpus:
                    vals = []
                    for f in fields:
                        v = str(len(gpus)) if f == "count" else self.value(f, g, used)
                        if units and table[f][1]:
                            v += " " + table[f][1]
                        vals.append(v)
                    out.append(", ".join(vals))
            elif not in_container:
                for (pid, _fd), (g, mib) in sorted(live.items()):
                    if g not in gpus or mib == 0:
                        continue
                    try:
                        comm = open("/proc/%d/comm" % pid).read().strip()
                    except OSError:
                        continue
                    vals = []
                    for f in fields:
                        v = {"pid": str(pid), "process_name": comm, "name": comm, "used_memory": str(mib),
                             "used_gpu_memory": str(mib), "gpu_uuid": self.uuid(g), "gpu_bus_id": self.bus(g),
                             "gpu_name": NAME}[f]
                        if units and table[f][1]:
                            v += " " + table[f][1]
                        vals.append(v)
                    out.append(", ".join(vals))
            return 0, "".join(x + "\n" for x in out), ""
        return 0, self.table(gpus, used, live, in_container), ""

    def table(self, gpus, used, live, in_container):
        w = 91
        sep = "+-----------------------------------------+------------------------+----------------------+"

        def row(*cells):
            return "|" + "|".join(cells) + "|"

        def full(text):
            return "|" + text.ljust(w - 2) + "|"

        o = [time.strftime("%a %b %d %H:%M:%S %Y") + "       ", "+" + "-" * (w - 2) + "+",
             full(" NVIDIA-SMI %-21s Driver Version: %-14s CUDA Version: %s" % (DRIVER, DRIVER, CUDA)),
             sep.replace("+", "|", 1)[:-1] + "+",
             row(" GPU  Name                 Persistence-M ", " Bus-Id          Disp.A ", " Volatile Uncorr. ECC "),
             row(" Fan  Temp   Perf          Pwr:Usage/Cap ", "           Memory-Usage ", " GPU-Util  Compute M. "),
             row(" " * 41, " " * 24, "               MIG M. "),
             "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|"]
        for n, g in enumerate(gpus):
            o.append(row(("   %d  %s" % (g, NAME)).ljust(37) + "On  ", "   %s Off " % self.bus(g), "0".rjust(21) + " "))
            mem = "%dMiB / %dMiB" % (used[g], self.total())
            o.append(row(" N/A   32C    P0             71W /  700W ", " " + mem.rjust(22) + " ",
                         "0%".rjust(8) + "      Default "))
            o.append(row(" " * 41, " " * 24, "             Disabled "))
            o.append(sep)
        o.append(" " * w)
        o.append("+" + "-" * (w - 2) + "+")
        o.append(full(" Processes:"))
        o.append(full("  GPU   GI   CI              PID   Type   Process name                        GPU Memory "))
        o.append(full("        ID   ID                                                               Usage      "))
        o.append("|" + "=" * (w - 2) + "|")
        rows = []
        if not in_container:
            for (pid, _fd), (g, mib) in sorted(live.items()):
                if g in gpus and mib:
                    try:
                        comm = open("/proc/%d/comm" % pid).read().strip()
                    except OSError:
                        continue
                    rows.append(full("  %3d   N/A  N/A  %15d      C   %-32s %9dMiB " % (g, pid, comm[:38], mib)))
        o.extend(rows or [full("  No running processes found")])
        o.append("+" + "-" * (w - 2) + "+")
        return "\n".join(o) + "\n"

    # ---- server ----------------------------------------------------------------------------------
    def ct_view(self, vmid, gpus):
        """A container's GPUs (the /dev/nvidia<i> in its /dev that are the host's files: its pct config at its
        last start, ctl.sync_devices) and its user-space driver version (the libnvidia-ml.so.* in its nvlib)."""
        d = os.path.join(self.hostdir, "ct%s" % vmid)
        try:
            with open(os.path.join(d, "ct.json")) as f:
                if json.load(f).get("gpus_real"):
                    return gpus, None
        except (OSError, ValueError):
            pass
        seen = []
        for i in range(self.ngpus):
            try:
                if os.path.samefile(os.path.join(d, "dev", "nvidia%d" % i),
                                    os.path.join(self.hostdir, "gpus", "nvidia%d" % i)):
                    seen.append(i)
            except OSError:
                pass
        try:
            libs = [f[len("libnvidia-ml.so."):] for f in os.listdir(os.path.join(d, "nvlib"))
                    if f.startswith("libnvidia-ml.so.")]
        except OSError:
            libs = None  # no nvlib directory (gpus=real): not this simulator's business
        return (seen if os.path.isdir(os.path.join(d, "dev")) else gpus), libs

    def handle(self, conn, gpus, in_container, vmid=None):
        try:
            f = conn.makefile("rb")
            line = f.readline()
            if not line:
                return
            req = json.loads(line)
            op = req.get("op")
            if op == "reset":
                with self.lock:
                    self.gone.clear()
                    self.live = {}
                self.scan()
                resp = {"rc": 0, "out": "", "err": ""}
            elif op == "serve_ct":  # a container `pct create` made after the simulator started
                v = str(int(req["vmid"]))
                self.serve(os.path.join(self.hostdir, "ct%s" % v, "run", "nvidia-sim.sock"), [], True, v)
                resp = {"rc": 0, "out": "", "err": ""}
            elif op == "state":
                used, live = self.scan()
                resp = {"rc": 0, "used": used,
                        "holders": [[pid, fd, g, mib] for (pid, fd), (g, mib) in sorted(live.items())]}
            else:
                if self.faults().get("nvidia_smi_hang"):
                    # a wedged driver: never answer; drop the thread once the client gives up
                    while True:
                        r, _, _ = select.select([conn], [], [], 1.0)
                        if r and not conn.recv(1):
                            return
                mismatch = self.faults().get("nvidia_smi_mismatch")
                libs = None
                if vmid is not None:
                    gpus, libs = self.ct_view(vmid, gpus)
                if mismatch == "everywhere":
                    # what nvidia-smi 550 prints (stdout, exit 18) when libnvidia-ml and the kernel module differ
                    rc, out, err = 18, MISMATCH_TEXT, ""
                elif libs is not None and not libs:
                    rc, out, err = 12, NO_LIB_TEXT, ""
                elif libs and DRIVER not in libs:  # the container's user space differs from the module
                    rc, out, err = 18, MISMATCH_TEXT.replace(MISMATCH_VERSION, sorted(libs)[-1]), ""
                else:
                    rc, out, err = self.smi([str(a) for a in req.get("argv", [])], gpus, in_container)
                resp = {"rc": rc, "out": out, "err": err}
            conn.sendall((json.dumps(resp) + "\n").encode())
        except Exception as e:  # noqa: BLE001 - report to the client, keep serving
            try:
                conn.sendall((json.dumps({"rc": 9, "out": "", "err": "gpusim: %r\n" % (e,)}) + "\n").encode())
            except OSError:
                pass
        finally:
            conn.close()

    def serve(self, path, gpus, in_container, vmid=None):
        try:
            os.unlink(path)
        except OSError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, 0o777)
        s.listen(64)

        def loop():
            while True:
                conn, _ = s.accept()
                threading.Thread(target=self.handle, args=(conn, gpus, in_container, vmid), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()


def main():
    hostdir = sys.argv[1]
    sim = Sim(hostdir)
    sim.serve(os.path.join(hostdir, "gpu.sock"), list(range(sim.ngpus)), False)
    for vmid, c in sim.host["containers"].items():
        sim.serve(os.path.join(hostdir, "ct%s" % vmid, "run", "nvidia-sim.sock"), sorted(c["gpus"]), True, vmid)
    with open(os.path.join(hostdir, "gpusim.ready"), "w") as f:
        f.write("%d\n" % os.getpid())
    sim.background()


if __name__ == "__main__":
    main()
