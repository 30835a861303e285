"""`deploy prepare HOST/VMID`: make a container GPU-ready, planned first, every change read back (issue 34 part 2).

What it changes, and only that (docs/gpu-containers.md, "deploy prepare"):
- with --create: a new container (`pct create VMID TEMPLATE ...`, refused when VMID exists), read back with
  `pct config`, started without asking (nothing of anyone's runs in it yet);
- the container's own `/etc/pve/lxc/VMID.conf`: a line for each GPU node it lacks: `devN:` entries through
  `pct set` where pve-container has them (Proxmox 8.1+, or the config already uses them), else raw
  `lxc.mount.entry` binds plus an `lxc.cgroup2.devices.allow` rule for each major the host really uses. A backup
  first (BACKUP_DIR on the host), the result read back with `pct config` (every planned line there, every line
  that was there still there). Lines are only added, never removed: an old rule for a stale major is named, not
  deleted;
- a restart of that container (`pct reboot`, or `pct start` when it is stopped) only when confirmed, naming a vLLM
  that runs there;
- the user-space driver in the container, from a `.run` file the user names on the host, of the host module's
  exact version (`--no-kernel-module --silent`), checked afterwards by the container's nvidia-smi.
- then, for each playbook that targets the container: its runtime venv when missing (`python3 -m venv`),
  `install-vllm` when it names requires.vllm, `fetch` when it names a hub or host source (install.py, fetch.py:
  the same code paths as the commands; already done is a no-op).
The host side is otherwise read-only: no `fuser`, no install, no module load on the host (a missing
/dev/nvidia-uvm is refused with its fix). Another container's config is never touched; GPUs a running vLLM in
another container holds (by its playbook) are refused.

plan() is pure (facts in, changes out); run() gathers the facts over the command's one SSH connection, applies,
reads back and checks with the gpu-plumbing check (plumbing.findings).
"""

from __future__ import annotations

import base64
import hashlib
import re
import time

from orchestrator.deploy import ops
from orchestrator.steps import call_on
from orchestrator.steps.plan import step_on
from orchestrator.steps import plumbing_check as PL
from orchestrator.core.errors import DeployError, UsageError
from orchestrator.core.remote import shell_join, shell_word
from orchestrator.core.report import Progress
from orchestrator.core.spec import Runtime, fetch_items
from orchestrator.core.spec_schema import DEFAULT_PYTHON

BACKUP_DIR = "/root/vllm-pve-deploy-backups"
DEV_MIN_PVE = (8, 1)  # pve-container's devN: keys came with Proxmox VE 8.1 (../shared/domain/lxc-gpu-plumbing.md)
RUN_RE = re.compile(r"NVIDIA-Linux-[A-Za-z0-9_]+-(\d{2,4}\.\d{1,4}(?:\.\d{1,4})?)(?:-[A-Za-z0-9_.-]+)?\.run")
HOST_PATH_RE = re.compile(r"/[A-Za-z0-9._+/-]{1,400}")
RUN_IN_CT = "/tmp/vpd-nvidia-driver.run"
VOLID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:vztmpl/[A-Za-z0-9][A-Za-z0-9_.+-]{0,200}")
STORAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
HOSTNAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
NET_KEYS = ("name", "bridge", "ip", "gw", "ip6", "gw6", "hwaddr", "tag", "firewall", "mtu", "rate", "type")
NET_VALUE_RE = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
TEMPLATE_EXAMPLE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
CREATE_DEFAULTS = {"memory": 65536, "cores": 16, "storage": "local-lvm", "rootfs_gb": 200, "swap": 0,
                   "unprivileged": True, "onboot": True, "features": "nesting=1"}

PROBE_SH = r"""
V="$1"; R="$2"
echo "@@ pve"; pveversion 2>/dev/null | head -n 1 | head -c 200; echo
echo "@@ status"; pct status "$V" 2>&1 | head -n 1 | head -c 200; echo
C=/etc/pve/lxc/$V.conf; echo "@@ exists"; if [ -f "$C" ]; then echo yes; else echo no; fi
echo "@@ conf"; if [ -f "$C" ]; then head -c 262144 "$C" | base64 -w0; fi; echo
echo "@@ run"; if [ -n "$R" ]; then if [ -f "$R" ]; then echo "file $(stat -c %s "$R")"; else echo missing; fi; fi
exit 0
"""
# the container's vLLM processes, by their command lines (text to show, never to run)
VLLM_PS = r"""for d in /proc/[0-9]*; do c=$(tr '\0' ' ' < "$d/cmdline" 2>/dev/null); set -f; set -- $c; set +f
case "$1 $2" in
  "vllm serve"|*"/vllm serve") echo "${d#/proc/} $c";;
  *python*" -m") case "$3" in vllm.entrypoints*) echo "${d#/proc/} $c";; esac;;
esac; done | head -n 5 | cut -c1-200"""
WRITE_SH = r"""
C="$1"; OLD="$2"
[ "$(sha256sum "$C" | cut -d' ' -f1)" = "$OLD" ] || { echo "$C changed since it was read"; exit 3; }
cat > "$C.vpd-new" && mv -f "$C.vpd-new" "$C"
"""
BACKUP_SH = r"""
C="$1"; B="$2"
mkdir -p -m 0700 "${B%/*}" && cp -p "$C" "$B" && cmp -s "$C" "$B" && sha256sum "$B" | cut -d' ' -f1
"""


def parse_gpus(text: str) -> list[int]:
    """"0-3" / "0,2" / "1" -> sorted indices; UsageError for anything else."""
    out = set()
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d{1,2})(?:-(\d{1,2}))?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise UsageError(f"--gpus {text!r}: expected indices like 0-3 or 0,1", fix="deploy prepare HOST/VMID --gpus 0-3")
        out.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return sorted(out)


def check_create(opts: dict, vmid: int) -> dict:
    """--create's options -> the same, checked and defaulted; UsageError (before anything runs) for a value that
    is not what pct takes. Every value becomes one argv word, never shell text."""
    o = {**CREATE_DEFAULTS, **{k: v for k, v in opts.items() if v is not None}}
    fix = f"deploy prepare HOST/{vmid} --create --template {TEMPLATE_EXAMPLE} (pveam list local shows yours)"
    if not o.get("template"):
        raise UsageError("--create needs --template: the container template on the host's storage", fix=fix)
    if not VOLID_RE.fullmatch(o["template"]):
        raise UsageError(f"--template {o['template']!r}: expected STORAGE:vztmpl/FILE (letters, digits, ._+-)",
                         fix=fix)
    if not STORAGE_RE.fullmatch(str(o["storage"])):
        raise UsageError(f"--storage {o['storage']!r}: expected a storage name (letters, digits, ._-)",
                         fix="pvesm status lists the host's storages")
    if not HOSTNAME_RE.fullmatch(str(o.get("hostname") or "")):
        raise UsageError(f"hostname {o.get('hostname')!r}: expected a DNS label (letters, digits, -; at most 63)",
                         fix="--hostname vllm-qwen, or the container's name in the inventory")
    parts = []
    for kv in str(o.get("net0") or "").split(","):
        k, eq, v = kv.partition("=")
        if not eq or k not in NET_KEYS or not NET_VALUE_RE.fullmatch(v):
            raise UsageError(f"--net0 {o.get('net0')!r}: {kv!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(NET_KEYS)}", fix="--net0 name=eth0,bridge=vmbr0,ip=10.1.2.31/24,gw=10.1.2.1")
        parts.append(k)
    if "bridge" not in parts or "ip" not in parts:
        raise UsageError(f"--net0 {o.get('net0')!r}: say the bridge and the address (ip=dhcp or ip=ADDR/PREFIX)",
                         fix="--net0 name=eth0,bridge=vmbr0,ip=dhcp")
    return o


def create_argv(vmid: int, o: dict) -> list[str]:
    """`pct create` as deploy prepare --create runs it (o: check_create's result)."""
    return ["pct", "create", str(int(vmid)), o["template"], "--hostname", o["hostname"],
            "--memory", str(int(o["memory"])), "--swap", str(int(o["swap"])), "--cores", str(int(o["cores"])),
            "--rootfs", f"{o['storage']}:{int(o['rootfs_gb'])}", "--net0", o["net0"],
            "--onboot", "1" if o["onboot"] else "0", "--features", o["features"],
            "--unprivileged", "1" if o["unprivileged"] else "0", "--ostype", "debian"]


def parse_probe(text: str) -> dict:
    out = {"pve": None, "running": None, "conf": "", "run": None, "exists": None}
    sec, conf = None, []
    for ln in (text or "").splitlines():
        if ln.startswith("@@ "):
            sec = ln[3:].strip()
            continue
        if sec == "pve" and ln.strip() and out["pve"] is None:
            m = re.search(r"pve-manager/(\d+)\.(\d+)", ln)
            out["pve"] = (int(m.group(1)), int(m.group(2))) if m else None
        elif sec == "status" and ln.strip():
            out["running"] = ln.strip() == "status: running"
        elif sec == "exists" and ln.strip():
            out["exists"] = ln.strip() == "yes"
        elif sec == "conf" and ln.strip():
            conf.append(ln.strip())
        elif sec == "run" and ln.strip():
            out["run"] = ln.strip()
    try:  # the file exactly as it is (base64 on the wire): what is written back is it plus the new lines
        out["conf"] = base64.b64decode("".join(conf), validate=True).decode("utf-8") if conf else ""
    except (ValueError, UnicodeDecodeError):
        out["conf"] = ""
    return out


def wanted_nodes(gpus: list[int], host_nodes: dict | None = None) -> list[str]:
    """The nodes prepare passes in: the GPUs', nvidiactl and nvidia-uvm (CUDA's); nvidia-uvm-tools (profilers
    only) when the host has it, since a devN: line for a missing node stops the container from starting."""
    tools = [PL.UVM_TOOLS] if ((host_nodes or {}).get(PL.UVM_TOOLS) or {}).get("kind") == "char" else []
    return [f"/dev/nvidia{g}" for g in gpus] + ["/dev/nvidiactl", "/dev/nvidia-uvm"] + tools


def plan(host_facts: dict, probe: dict, *, host: str, vmid: int, gpus: list[int], style: str | None = None) -> dict:
    """-> {style, why_style, missing, blockers: [finding], set_argv, add_lines, notes, conf_new}: the config change
    that passes every wanted node in (nothing when all are). Pure."""
    cfg = PL.parse_config(host_facts["config"])
    nodes = host_facts.get("nodes") or {}
    want = wanted_nodes(gpus, nodes)
    blockers = [f for f in PL.findings(host_facts, None, host_name=host, vmid=vmid, gpus=gpus)
                if f["problem"] in ("uvm-missing-on-host", "host-node-missing")]
    raw_used = bool(cfg["mounts"] or any(a["major"] not in ("*",) for a in cfg["allow"])) and not cfg["dev"]
    pve = probe.get("pve")
    if style:
        why = f"--style {style}"
    elif pve and pve < DEV_MIN_PVE:  # before any line of the config: this pct refuses `pct set --devN` (issue 53)
        style, why = "raw", (f"Proxmox VE {pve[0]}.{pve[1]} is older than 8.1: no devN: keys" +
                             (" (the devN: lines already in the config are not this version's)" if cfg["dev"] else ""))
    elif cfg["dev"]:
        style, why = "dev", "the config already passes GPUs with devN: lines"
    elif raw_used:
        style, why = "raw", "the config already passes GPUs with lxc.mount.entry lines (one style per config)"
    elif pve and pve >= DEV_MIN_PVE:
        style, why = "dev", f"Proxmox VE {pve[0]}.{pve[1]} has pve-container's devN: keys"
    else:
        style, why = "raw", "pveversion not found: raw lxc lines work on every version"
    missing = [p for p in want if p not in cfg["dev"] and p not in cfg["mounts"]]
    res = {"style": style, "why_style": why, "missing": missing, "blockers": blockers, "set_argv": None,
           "add_lines": [], "notes": [], "conf_new": None}
    if style == "dev":
        used = {int(m.group(1)) for ln in host_facts["config"] if (m := re.match(r"dev(\d+):", ln))}
        argv, n = ["pct", "set", str(int(vmid))], 0
        for p in missing:
            while n in used:
                n += 1
            used.add(n)
            argv += [f"--dev{n}", p]
            res["add_lines"].append(f"dev{n}: {p}")
        res["set_argv"] = argv if missing else None
    else:
        add, majors = [], set()
        for p in want:
            node = nodes.get(p) or {}
            mj = node.get("major")
            if mj is not None and not PL.allowed(cfg, mj, node.get("minor")) and mj not in majors:
                majors.add(mj)
                add.append(f"lxc.cgroup2.devices.allow: c {mj}:* rwm")
        add += [f"lxc.mount.entry: {p} {p[1:]} none bind,optional,create=file" for p in missing]
        host_majors = {str(n["major"]) for p, n in nodes.items() if n.get("major") is not None}
        for a in cfg["allow"]:
            if a["major"] != "*" and a["major"] not in host_majors and int(a["major"]) in (243, 234, 235, 236, 237) + \
                    tuple(range(500, 512)):
                res["notes"].append(f"left in place: `{a['line']}` (no /dev/nvidia* node on the host has major "
                                    f"{a['major']} now: a stale rule from before a driver update; remove it by hand "
                                    "if nothing else uses it)")
        res["add_lines"] = add
        if add:
            res["conf_new"] = insert_lines(probe.get("conf") or "", add)
    return res


def mount_plan(config: list[str], stores: list[tuple[str, str]], vmid: int) -> dict:
    """The read-only mount point of each shared model store (fetch.store) the container lacks:
    -> {lines: ["mpN: STORE,mp=MOUNT,ro=1"], set_argv, blockers: [message]}. An mpN that mounts STORE at MOUNT
    without ro=1 gets ro=1 (same key); another volume at MOUNT is a blocker (never replaced). Pure."""
    have = {}
    for ln in config:
        m = re.match(r"(mp\d+):\s*(.*)", ln)
        if not m:
            continue
        parts = m.group(2).split(",")
        opts = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        have[m.group(1)] = {"volume": parts[0].strip(), "mp": opts.get("mp"), "ro": opts.get("ro") in ("1", "true"),
                            "line": ln, "opts": parts[1:]}
    used = {int(k[2:]) for k in have}
    lines, argv, blockers, n = [], ["pct", "set", str(int(vmid))], [], 0
    for store, mount in dict.fromkeys(stores):
        at = [(k, h) for k, h in have.items() if h["mp"] == mount]
        if at and at[0][1]["volume"] != store:
            blockers.append(f"the container's {at[0][0]} mounts {at[0][1]['volume']} at {mount}, not the store "
                            f"{store}: not replaced (`{at[0][1]['line']}`)")
            continue
        if at and at[0][1]["ro"]:
            continue
        if at:
            key = at[0][0]
            value = ",".join([store] + [o for o in at[0][1]["opts"] if not o.startswith("ro=")] + ["ro=1"])
        else:
            while n in used:
                n += 1
            used.add(n)
            key, value = f"mp{n}", f"{store},mp={mount},ro=1"
        lines.append(f"{key}: {value}")
        argv += [f"--{key}", value]
    return {"lines": lines, "set_argv": argv if lines else None, "blockers": blockers,
            "stores": [s for s, _ in dict.fromkeys(stores)], "privileged": is_privileged(config)}


def is_privileged(config: list[str]) -> bool:
    """A container whose config has no `unprivileged: 1` is privileged (Proxmox's default for pct create)."""
    return not any(re.match(r"unprivileged:\s*(1|true)\s*$", ln.strip()) for ln in config)


def privileged_store_warning(host: str, vmid: int, stores: list[str]) -> str:
    """What a privileged container can do to a store mounted read-only into it (issue 50)."""
    return (f"{host}/{vmid} is a privileged container (no `unprivileged: 1` in its config): root in it is uid 0 on "
            f"the host (only AppArmor in between) and can remount the store {', '.join(stores)} read-write, change the weights every "
            "other container serves and plant links or records for the host's fetch (the host's agent treats the "
            "store as untrusted, the other containers cannot); prefer an unprivileged container for a shared store")


def venv_root(python: str) -> str:
    """runtime.python ROOT/bin/python -> ROOT (the venv prepare makes when the container has none)."""
    return python.rsplit("/bin/", 1)[0]


def insert_lines(conf: str, lines: list[str]) -> str:
    """The config with `lines` added at the end of its main section (before the first [snapshot] section)."""
    text = conf if conf.endswith("\n") or not conf else conf + "\n"
    m = re.search(r"^\[", text, re.M)
    head, tail = (text[: m.start()], text[m.start():]) if m else (text, "")
    head = head.rstrip("\n") + "\n" if head.strip() else ""
    return head + "".join(ln + "\n" for ln in lines) + ("\n" + tail if tail else "")


def check_driver_run(path: str | None, module: str | None) -> str | None:
    """--driver-run PATH -> None when usable, else why not (the version its name says vs the host's module)."""
    if path is None:
        return None
    if not HOST_PATH_RE.fullmatch(path) or "/../" in path + "/":
        return f"--driver-run {path!r}: expected an absolute path on the host (letters, digits, ._+-/)"
    m = RUN_RE.fullmatch(path.rsplit("/", 1)[-1])
    if not m:
        return (f"--driver-run {path}: the name does not say its version (NVIDIA-Linux-x86_64-VERSION.run), so it "
                f"cannot be checked against the host's kernel module {module or '(unknown)'}")
    if module and m.group(1) != module:
        return (f"--driver-run {path} is driver {m.group(1)}, the host's kernel module is {module}: the user space "
                f"must be exactly {module} (else NVML's Driver/library version mismatch)")
    return None


def parse_smi(out: str) -> dict:
    """The container's `nvidia-smi --query-gpu=index,driver_version --format=csv,noheader` -> {gpus, versions, error}."""
    gpus, versions, err = [], set(), None
    for ln in (out or "").splitlines()[:64]:
        f = [x.strip() for x in ln.split(",")]
        if len(f) == 2 and f[0].isdigit() and PL.VERSION_RE.fullmatch(f[1]):
            gpus.append(int(f[0]))
            versions.add(f[1])
        elif ln.strip() and err is None:
            err = PL.clean(ln, 200)
    return {"gpus": gpus, "versions": sorted(versions), "error": err if not gpus else None}


SMI_ARGV = ["nvidia-smi", "--query-gpu=index,driver_version", "--format=csv,noheader"]


def container_smi(session, vmid: int) -> dict:
    try:
        r = session.ct(vmid, SMI_ARGV, timeout=30, label="prepare: nvidia-smi", max_output=64 << 10)
    except DeployError as e:
        return {"gpus": [], "versions": [], "error": PL.clean(e.message, 200)}
    s = parse_smi(r.out)
    if r.exited == 127 or (not s["gpus"] and not s["error"]):
        s["error"] = PL.clean((r.err or r.out).strip() or f"exit {r.exited}", 200)
    return s


def vllm_in(session, vmid: int) -> list[str]:
    try:
        r = session.ct(vmid, ["sh", "-c", VLLM_PS], timeout=20, label="prepare: vllm processes", max_output=8192)
    except DeployError:
        return []
    return [PL.clean(ln, 160) for ln in r.out.splitlines() if ln.strip()][:5] if r.ok else []


class Prepare:
    """One `deploy prepare`: facts, plan, and (unless dry_run) the changes, in order; the result as a dict."""

    def __init__(self, fleet, inv, host: str, vmid: int, runtime: Runtime | None, gpus: list[int], *, driver_run=None,
                 style=None, yes=False, confirm=None, progress=None, tp: int = 1, others=(), create=None,
                 chain=(), stores=()):
        self.fleet, self.inv, self.host, self.vmid = fleet, inv, host, int(vmid)
        self.create, self.chain, self.created, self.stores = create, list(chain), False, list(stores)
        self.runtime, self.gpus, self.driver_run, self.style = runtime, gpus, driver_run, style
        self.yes, self.confirm, self.progress, self.tp, self.others = yes, confirm, progress, tp, list(others)
        self.conf, self.where = f"/etc/pve/lxc/{self.vmid}.conf", f"{host}/{self.vmid}"
        self.res = {"where": self.where, "gpus": gpus, "ok": False, "dry_run": False, "plan": [],
                    "applied": [], "pending": [], "backup": None, "restore": None, "notes": [], "findings": [],
                    "container_nvidia_smi": None, "created": False, "chain": [], "mount_lines": []}

    def say(self, msg):
        if self.progress is not None:
            self.progress.say(self.where, msg)

    def step(self, name, command, why):
        self.res["plan"].append({"step": name, "command": command, "why": why})

    # ---------------------------------------------------------------- facts and plan
    def gather(self):
        if self.driver_run is not None and not HOST_PATH_RE.fullmatch(self.driver_run) or \
                "/../" in (self.driver_run or "") + "/":
            raise UsageError(check_driver_run(self.driver_run, None) + "; nothing was run", fix="--driver-run "
                             "/root/NVIDIA-Linux-x86_64-VERSION.run (an absolute path on the host)")
        s = self.session = self.fleet.session(self.host)
        self.pr = self.probe(self.driver_run or "")
        where = self.where
        if self.create and self.pr["exists"]:
            raise UsageError(f"{where} exists already ({self.conf}); --create only makes a new container, and never "
                             "replaces one; nothing was changed", where=where,
                             fix=f"deploy prepare {where} (without --create) makes that one GPU-ready")
        if not self.create and self.pr["exists"] is False:
            raise UsageError(f"there is no container {self.vmid} on {self.host} (no {self.conf}); nothing was changed",
                             where=where, fix=f"deploy prepare {where} --create --template {TEMPLATE_EXAMPLE} "
                                              "(pveam list local shows the host's templates)")
        self.hf = self.read_host_facts("prepare: host facts")
        self.running = bool(self.pr["running"])
        self.module = self.hf.get("module_version") or self.hf.get("smi_driver")
        why = check_driver_run(self.driver_run, self.module)
        if why is None and self.driver_run and not str(self.pr["run"] or "").startswith("file "):
            why = f"--driver-run {self.driver_run}: no such file on {self.host}"
        if why:
            raise UsageError(why + "; nothing was changed",
                             fix=f"the .run the host was installed with: NVIDIA-Linux-x86_64-{self.module or 'VERSION'}"
                                 f".run (download.nvidia.com/XFree86/Linux-x86_64/{self.module or 'VERSION'}/)")
        # GPUs a running vLLM in another container of this host serves (by its playbook): never shared silently
        for name, other, ogpus in self.others:
            both = sorted(set(ogpus) & set(self.gpus))
            if not both:
                continue
            procs = vllm_in(s, other)
            if procs:
                raise UsageError(f"GPU(s) {both} are served by playbook {name} in container {self.host}/{other} "
                                 f"(vLLM running: {procs[0]}); passing them into {self.vmid} too would let two "
                                 "containers load onto the same GPUs; nothing was changed", where=self.where,
                                 fix=f"choose other GPUs (--gpus), or deploy down {name} first")
            self.res["notes"].append(f"GPU(s) {both} are also assigned by playbook {name} to {self.host}/{other} "
                                     "(not running now): do not run both at once")
        self.pl = plan(self.hf, self.pr, host=self.host, vmid=self.vmid, gpus=self.gpus, style=self.style)
        self.res.update(style=self.pl["style"], why_style=self.pl["why_style"], missing=self.pl["missing"],
                        add_lines=self.pl["add_lines"], blockers=self.pl["blockers"],
                        running=self.running, module_version=self.module)
        self.res["notes"] += self.pl["notes"]
        self.plan_mounts()
        self.smi = container_smi(s, self.vmid) if self.running else None
        self.res["container_nvidia_smi"] = self.smi

    def probe(self, run: str) -> dict:
        return parse_probe(self.session.run(["sh", "-c", PROBE_SH, "sh", str(self.vmid), run], timeout=30,
                                            vmid=self.vmid, label="prepare: probe", max_output=512 << 10).out)

    def plan_mounts(self):
        self.mp = mount_plan(self.hf["config"], self.stores, self.vmid)
        if self.mp["blockers"]:
            raise UsageError("; ".join(self.mp["blockers"]) + "; nothing was changed", where=self.where,
                             fix="set fetch.mount in the playbook to a free path, or remove that mount point")
        self.res["mount_lines"] = self.mp["lines"]
        privileged = self.mp["privileged"] if not (self.create and not self.created) else \
            not self.create.get("unprivileged")
        if self.stores and privileged:
            self.res["notes"].append("WARNING: " + privileged_store_warning(self.host, self.vmid, self.mp["stores"]))

    def read_host_facts(self, label: str) -> dict:
        """The host side (plumbing.HOST_PLUMBING_SH). Before --create makes the container there is no config to
        read: the host's nodes and driver only, with an empty config."""
        hf = PL.read_host(self.session, self.vmid, label=label, need_config=not (self.create and not self.created))
        if hf.get("error"):
            raise DeployError(f"cannot read the host side of {self.host}/{self.vmid}: {hf['error']}",
                              where=self.where, fix=f"pct config {self.vmid} on {self.host}")
        return hf

    def make_plan(self, stamp: str):
        v = self.vmid
        self.backup = f"{BACKUP_DIR}/{v}.conf.{stamp}"
        changing = bool(self.pl["add_lines"] or self.mp["lines"])
        if self.create and not self.created:
            o = self.create
            self.step("create", shell_join(create_argv(v, o)),
                      f"a new container from {o['template']}: {o['cores']} cores, {o['memory']} MiB, "
                      f"{o['rootfs_gb']} GB on {o['storage']}, {'un' if o['unprivileged'] else ''}privileged, "
                      f"onboot {1 if o['onboot'] else 0}; refused by pct if {v} exists")
            self.step("read back", f"pct config {v}", "the container is there, with what was asked")
        if changing:
            if not self.create:  # a new container's config is not replaced: nothing to back up
                self.step("backup", f"cp -p {self.conf} {self.backup}", "a copy of the config before it changes")
            if self.mp["lines"]:
                self.step("store", "mkdir -p -m 0755 " + " ".join(shell_word(x) for x in self.mp["stores"]),
                          "the shared model store on the host (fetch.store), when missing: a bind mount needs it")
                self.step("config", shell_join(self.mp["set_argv"]),
                          "the store, read-only in the container (every container of the host reads one copy)")
        if self.pl["add_lines"]:
            if self.pl["style"] == "dev":
                self.step("config", shell_join(self.pl["set_argv"]), f"devN: lines ({self.pl['why_style']})")
            else:
                self.step("config", f"append to {self.conf}: " + "; ".join(self.pl["add_lines"]),
                          f"raw lxc lines ({self.pl['why_style']}); written only if the file did not change since "
                          "it was read")
        if changing:
            self.step("read back", f"pct config {v}", "every line above there, every line that was there kept")
        verb = "pct reboot" if self.running else "pct start"
        if self.create:
            self.step("start", f"pct start {v}", "the new container (nothing runs there yet: not asked)")
        elif changing or not self.running:
            self.step("restart", f"{verb} {v}", "the container sees new device lines only at its start; asked "
                                                "first (-y: without asking)")
        if self.driver_run:
            run = shell_word(self.driver_run)
            self.step("driver", f"pct push {v} {run} {RUN_IN_CT}; pct exec {v} -- sh {RUN_IN_CT} "
                                f"--no-kernel-module --silent; pct exec {v} -- rm -f {RUN_IN_CT}",
                      f"the user-space driver {self.module} (the host's kernel module), no kernel module")
        self.step("check", f"gpu-plumbing check and pct exec {v} -- {shell_join(SMI_ARGV)}",
                  f"GPUs {self.gpus} seen, driver {self.module} in user space")
        for name, pb in self.chain:
            py = pb.conf.runtime.python or ""
            if pb.conf.requires.vllm:
                self.step("venv", f"pct exec {v} -- python3 -m venv {shell_word(venv_root(py))} (only if {py} is "
                                  "missing)",
                          f"the runtime venv of playbook {name}, for install-vllm to install into")
                self.step("install", f"deploy install-vllm {name} (only if {pb.conf.runtime.vllm} is missing)",
                          f"requires.vllm {pb.conf.requires.vllm}, verified")
            if fetch_items(pb):
                self.step("fetch", f"deploy fetch {name}", "the playbook's weights, verified (already fetched: "
                                                           "nothing)")

    # ---------------------------------------------------------------- changes
    def do_create(self):
        """pct create, read back; then the facts and the plan again, now of the container that exists."""
        s, v = self.session, self.vmid
        argv = create_argv(v, self.create)
        self.say(f"pct create from {self.create['template']}")
        r = s.run(argv, timeout=600, vmid=v, label="prepare: pct create", max_output=256 << 10)
        if not r.ok:
            raise DeployError(f"`{shell_join(argv)}` failed on {self.host} (exit {r.exited}): "
                              f"{PL.clean((r.err or r.out).strip()[-400:], 400)}; no container was made by deploy",
                              where=self.where,
                              fix="pveam list local (the templates), pvesm status (the storages); then run again")
        self.created = self.res["created"] = True
        self.res["restore"] = f"pct destroy {v} (on {self.host}): removes the container this command made"
        self.res["applied"].append(f"pct create {v} from {self.create['template']}")
        self.hf = self.read_host_facts("prepare: read back")
        cfg = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in self.hf["config"] if ":" in ln}
        want = {"hostname": self.create["hostname"], "memory": str(int(self.create["memory"])),
                "cores": str(int(self.create["cores"]))}
        off = [f"{k}: {cfg.get(k)!r} (asked {w!r})" for k, w in want.items() if cfg.get(k) != w]
        if off:
            raise DeployError(f"read back of the new container {self.host}/{v} (pct config {v}) differs from what "
                              f"was asked: {'; '.join(off)}", where=f"{self.host}/{v} {self.conf}",
                              fix=f"pct config {v} on {self.host}; pct destroy {v} to start over")
        self.res["applied"].append(f"read back: pct config {v} (hostname {want['hostname']}, {want['cores']} cores, "
                                   f"{want['memory']} MiB)")
        self.pr = self.probe("")
        self.running = False
        before = self.pl["add_lines"]
        self.pl = plan(self.hf, self.pr, host=self.host, vmid=v, gpus=self.gpus, style=self.pl["style"])
        self.plan_mounts()
        if self.pl["add_lines"] != before:
            self.res["notes"].append("the device lines differ from the plan shown (the new config was not empty): "
                                     + "; ".join(self.pl["add_lines"]))
        self.res["add_lines"] = self.pl["add_lines"]

    def apply_config(self):
        v = self.vmid
        if not self.created:
            r = self.session.run(["sh", "-c", BACKUP_SH, "sh", self.conf, self.backup], timeout=30, vmid=v,
                                 label="prepare: backup")
            if not r.ok or not re.fullmatch(r"[0-9a-f]{64}", r.out.strip()):
                raise DeployError(f"backup of {self.conf} to {self.backup} failed: {PL.clean(r.err or r.out)}; "
                                  "nothing was changed", where=self.where, fix=f"check {BACKUP_DIR} on {self.host}")
            self.res["backup"] = self.backup
            self.res["restore"] = f"cp {self.backup} {self.conf} (on {self.host}), then pct reboot {v}"
            self.res["applied"].append(f"backup {self.backup}")
        if self.pl["add_lines"]:
            self._change_config(list(self.hf["config"]))
        if self.mp["lines"]:
            self._change_mounts(list(self.hf["config"]))

    def _read_back(self) -> dict:
        after = PL.read_host(self.session, self.vmid, label="prepare: read back")
        if after.get("error"):
            raise DeployError(f"read back of {self.conf} failed: {after['error']}", where=self.where,
                              fix=self.res["restore"])
        return after

    def _change_mounts(self, before):
        s, v = self.session, self.vmid
        r = s.run(["mkdir", "-p", "-m", "0755", *self.mp["stores"]], timeout=30, vmid=v, label="prepare: store dir")
        if not r.ok:
            raise DeployError(f"cannot make the store directory {', '.join(self.mp['stores'])} on {self.host}: "
                              f"{PL.clean(r.err or r.out, 400)}; the config is as it was", where=self.host,
                              fix="check fetch.store in the playbook (a directory on the host)")
        r = s.run(self.mp["set_argv"], timeout=60, vmid=v, label="prepare: pct set mount point")
        if not r.ok:
            raise DeployError(f"`{shell_join(self.mp['set_argv'])}` failed on {self.host}: "
                              f"{PL.clean(r.err or r.out, 400)}; the config is as it was (backup {self.backup})",
                              where=f"{self.host}/{v} {self.conf}", fix="see pct's message")
        self.res["applied"].append("config: " + "; ".join(self.mp["lines"]))
        after = self._read_back()
        absent = [ln for ln in self.mp["lines"] if ln not in [x.strip() for x in after["config"]]]
        lost = [ln for ln in before if ln not in after["config"] and not any(
            ln.split(":", 1)[0] == a.split(":", 1)[0] for a in self.mp["lines"])]
        if absent or lost:
            raise DeployError(f"read back of {self.conf} (pct config {v}) does not show the change: " + "; ".join(
                ([f"missing `{a}`" for a in absent]) + ([f"gone: `{x}`" for x in lost[:5]])),
                where=f"{self.host}/{v} {self.conf}", fix=f"restore it: {self.res['restore']}")
        self.hf = after
        self.res["applied"].append(f"read back: pct config {v} mounts " + ", ".join(self.mp["stores"]) +
                                   " read-only")

    def _change_config(self, before):
        s, v = self.session, self.vmid
        if self.pl["style"] == "dev":
            r = s.run(self.pl["set_argv"], timeout=60, vmid=v, label="prepare: pct set")
            if not r.ok:
                raise DeployError(f"`{shell_join(self.pl['set_argv'])}` failed on {self.host}: "
                                  f"{PL.clean(r.err or r.out, 400)}; the config is as it was (backup {self.backup})",
                                  where=f"{self.host}/{v} {self.conf}",
                                  fix="--style raw writes lxc.mount.entry lines instead (pve-container without devN:)")
        else:
            old = hashlib.sha256(self.pr["conf"].encode()).hexdigest()
            r = s.run(["sh", "-c", WRITE_SH, "sh", self.conf, old], stdin=self.pl["conf_new"], timeout=30, vmid=v,
                      label="prepare: write config")
            if not r.ok:
                raise DeployError(f"writing {self.conf} failed: {PL.clean(r.err or r.out, 400)}; the config is as it "
                                  f"was (backup {self.backup})", where=f"{self.host}/{v} {self.conf}",
                                  fix=f"deploy prepare {self.host}/{v} again")
        self.res["applied"].append("config: " + "; ".join(self.pl["add_lines"]))
        after = self._read_back()
        cfg = PL.parse_config(after["config"])
        lost = [ln for ln in before if ln not in after["config"]]
        absent = [p for p in self.pl["missing"] if p not in cfg["dev"] and p not in cfg["mounts"]]
        if lost or absent:
            restored = self._restore_backup()  # never leave a change that did not read back (issue 53)
            fix = (f"see what changes the config besides deploy (pct config {v} and the file differ?), then "
                   "deploy prepare again") if restored.startswith("restored") else \
                f"restore it: {self.res['restore']}"
            raise DeployError(f"read back of {self.conf} (pct config {v}) does not show the change: " +
                              (f"no line passing {', '.join(absent)} in" if absent else "") +
                              ("; " if lost and absent else "") +
                              (f"lines that were there are gone: {'; '.join(lost[:5])}" if lost else "") +
                              (f"; {restored}" if restored else ""),
                              where=f"{self.host}/{v} {self.conf}", fix=fix)
        self.hf = after
        self.res["applied"].append(f"read back: pct config {v} passes in {', '.join(self.pl['missing'])}")

    def _restore_backup(self) -> str:
        """Put the config back from the backup taken before the change (the container was not restarted yet):
        -> what was done, for the message."""
        if self.create or not getattr(self, "backup", None):
            return ""
        r = self.session.run(["cp", self.backup, self.conf], timeout=30, vmid=self.vmid, label="prepare: restore")
        if r.ok:
            self.res["applied"].append(f"restored {self.conf} from {self.backup} (the change did not read back)")
            return f"restored {self.conf} from the backup {self.backup}: nothing of the change is left"
        return f"restoring it from {self.backup} failed too: {PL.clean(r.err or r.out, 200)}"

    def restart(self, changed: bool):
        s, v = self.session, self.vmid
        if self.running and not changed:
            return True
        procs = vllm_in(s, v) if self.running else []
        verb = "reboot" if self.running else "start"
        what = f"{'Restart' if self.running else 'Start'} container {self.host}/{v} now (pct {verb})?"
        if procs:
            what += f" vLLM runs there and stops with it: {procs[0]}"
            self.res["notes"].append(f"vLLM was running in {self.host}/{v}: {procs[0]}")
        if not (self.yes or self.created or (self.confirm and self.confirm(what))):
            self.res["pending"].append(f"pct {verb} {v} on {self.host} (not confirmed: the container sees the new "
                                       "lines at its next start; pass -y to do it)")
            return False
        self.say(f"pct {verb}")
        r = s.run(["pct", verb, str(v)], timeout=180, vmid=v, label=f"prepare: pct {verb}")
        if not r.ok:
            raise DeployError(f"pct {verb} {v} failed on {self.host}: {PL.clean(r.err or r.out, 400)}",
                              where=self.where,
                              fix=f"see the message; the config backup: {self.res['restore'] or 'none made'}")
        self.running = True
        self.res["applied"].append(f"pct {verb} {v}")
        return True

    def install_driver(self):
        s, v = self.session, self.vmid
        self.say(f"installing the user-space driver {self.module} from {self.driver_run}")
        push = ["pct", "push", str(v), self.driver_run, RUN_IN_CT, "--perms", "0700"]
        inst = ["sh", RUN_IN_CT, "--no-kernel-module", "--silent"]
        for argv, run in ((push, lambda: s.run(push, timeout=300, vmid=v, label="prepare: push driver")),
                          (["pct", "exec", str(v), "--"] + inst,
                           lambda: s.ct(v, inst, timeout=900, label="prepare: driver install", max_output=1 << 20))):
            r = run()
            if not r.ok:
                s.ct(v, ["rm", "-f", RUN_IN_CT], timeout=30, label="prepare: rm")
                tail = PL.clean((r.err or r.out).strip()[-400:], 400)
                raise DeployError(f"`{shell_join(argv)}` failed (exit {r.exited}): {tail}",
                                  where=self.where, fix="see the installer's message; in the container its "
                                                                "log is /var/log/nvidia-installer.log")
        s.ct(v, ["rm", "-f", RUN_IN_CT], timeout=30, label="prepare: rm")
        self.res["applied"].append(f"driver {self.module} user space from {self.driver_run}")

    def final_check(self):
        s, v = self.session, self.vmid
        self.smi = container_smi(s, v)
        self.res["container_nvidia_smi"] = self.smi
        ct = None
        try:
            py = "python3" if self.created else self.runtime.python if self.runtime else DEFAULT_PYTHON  # new: no venv
            r = call_on(s, step_on(self.host, v, py, "plumbing", "plumbing", {}, 30))
            ct = r.plumbing if isinstance(r.plumbing, dict) else None
        except DeployError as e:
            self.res["notes"].append(f"the container side of the gpu-plumbing check was not read ({e.message}); "
                                     "nvidia-smi in the container stands in for it")
        host = PL.read_host(s, v, label="prepare: check")
        found = PL.findings(None if host.get("error") else host, ct, host_name=self.host, vmid=v, gpus=self.gpus,
                            tp=self.tp)
        sm = self.smi
        if sm["error"] or sm["versions"] != [self.module] or len(sm["gpus"]) != len(self.gpus):
            PL._f(found, "container-nvidia-smi", f"{self.host}/{v}: nvidia-smi",
                  f"{len(self.gpus)} GPU(s) listed, driver {self.module}",
                  sm["error"] or f"{len(sm['gpus'])} GPU(s), driver {', '.join(sm['versions']) or '?'}",
                  f"deploy prepare {self.host}/{v} --gpus {','.join(map(str, self.gpus))}" +
                  ("" if self.driver_run else f" --driver-run /root/NVIDIA-Linux-x86_64-{self.module}.run") + " -y",
                  "what vLLM will see: the container's own nvidia-smi")
        uniq = {}
        for f in found:
            uniq.setdefault((f["problem"], f["where"]), f)
        self.res["findings"] = list(uniq.values())

    def run(self, dry_run: bool = False) -> dict:
        self.gather()
        self.make_plan(time.strftime("%Y%m%d-%H%M%S"))
        if self.pl["blockers"]:
            self.res["findings"] = self.pl["blockers"]
            self.res["pending"].append("the host side first (see the findings): prepare changes nothing on the host")
            return self.res
        if dry_run:
            self.res["dry_run"] = True
            return self.res
        if self.create:
            self.do_create()
        changed = bool(self.pl["add_lines"] or self.mp["lines"])
        if changed:
            self.apply_config()
        started = self.restart(changed)
        if started and self.driver_run:
            self.install_driver()
        elif not started and self.driver_run:
            self.res["pending"].append("driver install (the container is not restarted)")
        if self.running:
            self.final_check()
        self.res["ok"] = not self.res["pending"] and not self.res["findings"]
        if self.res["ok"] and self.chain:
            self.run_chain()
            self.res["ok"] = all(c["ok"] for c in self.res["chain"])
        return self.res

    # ---------------------------------------------------------------- then what the playbooks ask for
    def run_chain(self):
        """For each playbook that targets the container: its runtime venv when missing, install-vllm when it names
        requires.vllm, fetch when it names a source; each through the command's own code path, in order; the
        first failure stops the rest (named, with its fix)."""
        progress = self.progress or Progress(quiet=True)
        for name, pb in self.chain:
            if pb.conf.requires.vllm:
                have = self.ensure_venv(name, pb)
                if have is None:
                    return
                if have:
                    self.res["notes"].append(f"{pb.conf.runtime.vllm} is there: install-vllm {name} left out "
                                             f"(deploy install-vllm {name} installs requires.vllm over it)")
                else:
                    self.say(f"install-vllm {name}")
                    if not self.chained("install-vllm", name, ops.install_vllm(self.fleet, pb, progress, yes=self.yes)):
                        return
            if fetch_items(pb):
                self.say(f"fetch {name}")
                if not self.chained("fetch", name, ops.fetch(self.fleet, pb, progress)):
                    return

    def chained(self, step: str, name: str, out) -> bool:
        e = out.error
        self.res["chain"].append({"step": step, "playbook": name, "ok": bool(out.ok), "status": out.status,
                                  "error": e.message if e else None, "fix": getattr(e, "fix", None) if e else None})
        if out.ok:
            self.res["applied"].append(f"{step} {name}: {out.status}")
        return bool(out.ok)

    def ensure_venv(self, name: str, pb):
        """The playbook's runtime.python, made as a venv (python3 -m venv ROOT) when the container has none;
        read back by running it. -> True: its vLLM is there already (install-vllm left to the user); False: no
        vLLM yet (install it); None: the venv could not be made (named in the chain)."""
        py = pb.conf.runtime.python or ""
        root = venv_root(py)
        s, v = self.session, self.vmid
        entry = {"step": "venv", "playbook": name, "ok": True, "status": "present", "error": None, "fix": None}

        def runs():
            return s.ct(v, [py, "-c", "import sys; print(sys.prefix)"], timeout=30, label="prepare: runtime python")

        if not runs().ok:
            self.say(f"python3 -m venv {root}")
            r = s.ct(v, ["python3", "-m", "venv", root], timeout=300, label="prepare: venv", max_output=64 << 10)
            check = runs()
            if not r.ok or not check.ok:
                entry.update(ok=False, status="failed",
                             error=f"python3 -m venv {root} in {self.host}/{v} failed: "
                                   f"{PL.clean((r.err or r.out or check.err).strip()[-300:], 300)}",
                             fix=f"pct exec {v} -- apt-get install -y python3-venv, then deploy prepare again")
                self.res["chain"].append(entry)
                return None
            entry["status"] = "made"
            self.res["applied"].append(f"venv {root} (python3 -m venv) for {name}")
        self.res["chain"].append(entry)
        vllm = pb.conf.runtime.vllm
        return bool(vllm) and s.ct(v, ["test", "-x", vllm], timeout=30, label="prepare: runtime vllm").ok


def render(res: dict) -> str:
    """The result for a person (the output layer makes it terminal-safe)."""
    out = [f"prepare {res['where']}: GPUs {res['gpus']}, style {res.get('style')} ({res.get('why_style')})"]
    out.append(f"  missing from the config: {', '.join(res['missing'])}" if res.get("missing") else
               "  the config already passes every node in")
    for ln in res.get("mount_lines") or []:
        out.append(f"  the shared model store, read-only: {ln}")
    out.append("plan:" if res["dry_run"] or not res["applied"] else "plan (run):")
    for n, st in enumerate(res["plan"], 1):
        out.append(f"  {n}. {st['step']:<10} {st['command']}")
        out.append(f"     {'':<10} ({st['why']})")
    for a in res["applied"]:
        out.append(f"done:    {a}")
    for c in res.get("chain") or []:
        if not c["ok"]:
            out.append(f"FAILED:  {c['step']} {c['playbook']}: {c['error']}" + (f"\n  fix: {c['fix']}" if c["fix"] else ""))
    for p in res["pending"]:
        out.append(f"PENDING: {p}")
    for n in res["notes"]:
        out.append(f"note:    {n}")
    if res.get("backup"):
        out.append(f"backup:  {res['backup']}; to undo: {res['restore']}")
    if res["findings"]:
        out.append(PL.render(res["findings"]))
    if res["dry_run"]:
        out.append("dry run: nothing was changed")
    elif res["ok"]:
        sm = res.get("container_nvidia_smi") or {}
        out.append(f"OK: {res['where']} sees GPUs {res['gpus']} (its nvidia-smi lists {len(sm.get('gpus') or [])}, "
                   f"driver {', '.join(sm.get('versions') or [])}); next: deploy up PLAYBOOK")
    return "\n".join(out)
