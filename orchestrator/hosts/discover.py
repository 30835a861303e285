"""`deploy discover HOST`: read a Proxmox host as it is and print (or merge) its inventory entry.

Over one SSH connection: `pct list`, `pct config VMID` for every container, the host's `nvidia-smi` GPU list, and
for each running container one read-only `sh` probe inside it (address, /dev/nvidia*, the Pythons that can import
vLLM). Nothing is written on the host. The parsers are pure functions over strings (tests/unit/test_discover.py).

GPUs passed into a container (decision, see docs/cli.md#discover):
- `devN: /dev/nvidiaK[,opts]` (PVE >= 8.1) and `lxc.mount.entry: /dev/nvidiaK dev/nvidiaK ...` name GPU K;
- `lxc.cgroup2.devices.allow: c 195:K rwm` (K < 254) allows GPU K (the node must still come from somewhere);
- `lxc.cgroup2.devices.allow: c 195:* rwm` (or `a`, every device) with no per-GPU entry means *every GPU of the
  host* (the nodes come from a hook or an autodev script): listed as the host's indices from its nvidia-smi
  (else the /dev/nvidia* seen inside), with `gpus_all: true`. With per-GPU entries the same allow line is only
  the permission those entries need, and the entries are the list.
A GPU listed for more than one container is flagged as shared (with the other VMIDs and whether they run).
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import re

import click
import yaml

from orchestrator.agent.container import files as _agent_files
from orchestrator.core.atomic import write_atomic
from orchestrator.core.errors import EXIT_FAILED, EXIT_OK, DeployError, HostKeyError, SpecError, UsageError
from orchestrator.core.facts import NVML_MISMATCH, parse_pct_list
from orchestrator.core.locate import find_inventory
from orchestrator.core.remote import AuditLog, HostSession, run_parallel
from orchestrator.core.report import Progress, dump_json, strip_controls
from orchestrator.core.spec import DEFAULT_STATE_DIR, HostSpec, load_inventory

NVIDIA_MAJOR = 195
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")

# ------------------------------------------------------------------ pure parsers


def parse_target(text: str) -> dict:
    """`[user@]address[:port]` (IPv6 as `[addr]:port`) -> {user, address, port}; ValueError if it is not one."""
    user, _, rest = text.rpartition("@") if "@" in text else (None, "", text)
    port = None
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?", rest)
    if m:
        address, port = m.group(1), m.group(2)
    elif rest.count(":") == 1:
        address, port = rest.split(":")
    else:
        address = rest
    if not address or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,253}", address):
        raise ValueError(f"{text!r} is not [user@]address[:port]")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{text!r}: port must be 1..65535")
    if user is not None and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
        raise ValueError(f"{text!r}: {user!r} is not a user name")
    return {"user": user, "address": address, "port": int(port) if port else None}


def parse_pct_config(text: str) -> dict:
    """`pct config VMID` output -> the facts discover needs (pure; snapshot sections are not printed by pct).

    {hostname, net: [{name, ip, ip6, bridge}], gpu_entries: {K: [lines]}, cgroup_all: bool,
     cgroup_gpus: [K], other_nvidia: [lines], warnings: [...]}
    """
    out = {"hostname": None, "net": [], "gpu_entries": {}, "cgroup_all": False, "cgroup_gpus": [],
           "cgroup_allows_nvidia": False, "other_nvidia": [], "warnings": []}
    for raw in text.splitlines():
        ln = raw.strip()
        if not ln or ln.startswith("#"):
            continue
        if ln.startswith("["):  # a snapshot section: the current config ends here
            break
        key, sep, val = ln.partition(":")
        if not sep:
            continue
        key, val = key.strip(), val.strip()
        if key == "hostname":
            out["hostname"] = val
        elif re.fullmatch(r"net\d+", key):
            opts = dict(p.split("=", 1) for p in val.split(",") if "=" in p)
            ip = opts.get("ip")
            out["net"].append({"key": key, "name": opts.get("name"), "bridge": opts.get("bridge"),
                               "ip": ip.split("/")[0] if ip and ip not in ("dhcp", "manual") else None,
                               "ip_mode": "static" if ip and ip not in ("dhcp", "manual") else (ip or None)})
        elif re.fullmatch(r"dev\d+", key) or key == "lxc.mount.entry":
            src = val.split(",")[0].strip() if key.startswith("dev") else (val.split() or [""])[0]
            m = re.fullmatch(r"/dev/nvidia(\d+)", src)
            if m:
                out["gpu_entries"].setdefault(int(m.group(1)), []).append(ln)
            elif src.startswith("/dev/nvidia"):
                out["other_nvidia"].append(ln)
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            if val == "a":
                out["cgroup_all"] = out["cgroup_allows_nvidia"] = True
                continue
            m = re.fullmatch(r"([cab])\s+(\d+|\*):(\d+|\*)\s*([rwm]*)", val)
            if not m or m.group(1) == "b":
                continue
            major, minor = m.group(2), m.group(3)
            if major in (str(NVIDIA_MAJOR), "*"):
                out["cgroup_allows_nvidia"] = True
                if minor == "*":
                    out["cgroup_all"] = True
                elif int(minor) < 254:  # 254 nvidia-modeset, 255 nvidiactl
                    out["cgroup_gpus"].append(int(minor))
    mount_only = [k for k, lines in out["gpu_entries"].items()
                  if all(x.startswith("lxc.mount.entry") for x in lines)]
    if mount_only and not out["cgroup_allows_nvidia"]:
        out["warnings"].append(f"lxc.mount.entry passes /dev/nvidia{mount_only[0]} in, but no "
                               f"lxc.cgroup2.devices.allow: c {NVIDIA_MAJOR}:* rwm lets the container open it")
    return out


def container_gpus(cfg: dict, host_gpus: list[int] | None, inside: list[int] | None = None) -> dict:
    """-> {gpus, all, source}: see the module docstring for the rules."""
    if cfg["gpu_entries"]:
        kinds = {x.split(":")[0].startswith("dev") and "dev" or "lxc.mount.entry"
                 for lines in cfg["gpu_entries"].values() for x in lines}
        return {"gpus": sorted(cfg["gpu_entries"]), "all": False,
                "source": " + ".join(sorted("devN" if k == "dev" else k for k in kinds))}
    if cfg["cgroup_all"]:
        allowed = host_gpus if host_gpus is not None else inside
        return {"gpus": sorted(allowed or []), "all": True,
                "source": f"lxc.cgroup2.devices.allow: c {NVIDIA_MAJOR}:* rwm"
                          + ("" if host_gpus is not None else
                             " (as seen inside)" if inside is not None else " (host GPU count unknown)")}
    if cfg["cgroup_gpus"]:
        return {"gpus": sorted(set(cfg["cgroup_gpus"])), "all": False,
                "source": f"lxc.cgroup2.devices.allow: c {NVIDIA_MAJOR}:K"}
    return {"gpus": [], "all": False, "source": None}


def parse_host_gpus(text: str) -> list[int]:
    """`nvidia-smi --query-gpu=index --format=csv,noheader` -> [indices]."""
    firsts = (ln.split(",")[0].strip() for ln in text.splitlines())
    return sorted(int(f) for f in firsts if f.isdigit())


def parse_probe(text: str) -> dict:
    """The in-container probe's output (lines `KIND VALUE`) -> {addresses, gpus, vllm_cmd, pythons}."""
    out = {"addresses": [], "gpus": [], "vllm_cmd": None, "pythons": [], "hostname": None}
    for ln in text.splitlines():
        kind, _, val = ln.partition(" ")
        val = val.strip()
        if kind == "addr":
            for a in val.split():
                if a and not a.startswith(("127.", "::1", "fe80:")) and a not in out["addresses"]:
                    out["addresses"].append(a)
        elif kind == "gpu":
            m = re.fullmatch(r"/dev/nvidia(\d+)", val)
            if m:
                out["gpus"].append(int(m.group(1)))
        elif kind == "vllm_cmd":
            out["vllm_cmd"] = val or None
        elif kind == "hostname":
            out["hostname"] = val or None
        elif kind == "py":
            path, _, js = val.partition(" ")
            try:
                info = json.loads(js)
            except ValueError:
                info = {"error": js[:200]}
            out["pythons"].append({"path": path, **(info if isinstance(info, dict) else {})})
    out["gpus"].sort()
    return out


def runtimes_of(probe: dict) -> list[dict]:
    """The vLLM runtimes found: one per Python prefix that has vllm, the one owning `vllm` on PATH first."""
    seen, found = set(), []
    for p in probe["pythons"]:
        if p.get("untrusted") or not p.get("vllm") and not p.get("vllm_path"):
            continue  # untrusted: deploy would run it as root, never proposed (untrusted_runtimes says why)
        key = p.get("prefix") or p["path"]
        if key in seen:
            continue
        seen.add(key)
        bindir = os.path.dirname(p["path"])
        vllm = p.get("vllm_bin") or os.path.join(bindir, "vllm")
        found.append({"python": p["path"], "vllm": vllm, "state_dir": DEFAULT_STATE_DIR,
                      "vllm_version": p.get("vllm"), "transformers_version": p.get("transformers"),
                      "prefix": p.get("prefix")})
    cmd = probe.get("vllm_cmd")
    if cmd:
        found.sort(key=lambda r: r["vllm"] != cmd)
    return found


def untrusted_runtimes(probe: dict) -> list[str]:
    """A problem line for each interpreter with vLLM that deploy must not run as root (another user owns it or a
    directory above it, or one is writable by group/others)."""
    return [f"{p['path']} has vLLM {p.get('vllm') or '?'} but is not proposed as the runtime: {p['untrusted']}; "
            "deploy runs runtime.python as root, so it must be root-owned and not writable by others all the way up "
            "(fix: install vLLM in a root-owned venv, e.g. deploy install-vllm)"
            for p in probe["pythons"] if p.get("untrusted") and (p.get("vllm") or p.get("vllm_path"))]


def shared_gpus(containers: list[dict]) -> dict[int, list[int]]:
    """{gpu: [vmids]} for every GPU listed for more than one container."""
    by = {}
    for c in containers:
        for g in c["gpus"]:
            by.setdefault(g, []).append(c["vmid"])
    return {g: v for g, v in sorted(by.items()) if len(v) > 1}


def inventory_name(name: str | None, vmid: int) -> str:
    """A container/host name the inventory accepts (lowercase letters, digits, '-')."""
    n = re.sub(r"[^a-z0-9-]+", "-", (name or "").lower()).strip("-")[:63]
    return n if n and _NAME_RE.fullmatch(n) else f"ct{vmid}"


# ------------------------------------------------------------------ the in-container probe

# One read-only POSIX sh script per running container; Python may be absent. $1 is the Python reader.
# It EXECUTES nothing found in the container's user space: the candidate interpreters (some in other users' homes)
# are only listed; their versions are learned by the reader, which READS files (pyvenv.cfg, dist-info METADATA,
# _version.py) and runs, with -I -S (no site, no .pth code), in the first Python that is trusted: it and every
# directory above it (links resolved) root-owned and not writable by group or others. See docs/architecture.md,
# "Threat model".
PROBE_SH = r"""
echo "hostname $(hostname 2>/dev/null || cat /etc/hostname 2>/dev/null)"
a=$(hostname -I 2>/dev/null) || a=""
[ -n "$a" ] || a=$(ip -4 -o addr show scope global 2>/dev/null | awk '{split($4,x,"/"); printf "%s ", x[1]}')
echo "addr $a"
for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && echo "gpu $d"; done
T=""; command -v timeout >/dev/null 2>&1 && T="timeout -k 2 20"
trusted() {
  r=$(readlink -f -- "$1" 2>/dev/null) && [ -n "$r" ] || return 1
  for q in "$1" "$r"; do
    while :; do
      if [ ! -L "$q" ]; then
        s=$(stat -c '%u %a' -- "$q" 2>/dev/null) || return 1
        case "$s" in "0 "*) ;; *) return 1;; esac
        case "${s#0 }" in *[2367]|*[2367]?) return 1;; esac
      fi
      [ "$q" = / ] && break
      q=$(dirname -- "$q")
    done
  done
  return 0
}
cands=""
v=$(command -v vllm 2>/dev/null) && {
  echo "vllm_cmd $v"
  sb=""; [ -f "$v" ] && sb=$(head -c 300 "$v" 2>/dev/null | head -n 1)
  case "$sb" in "#!"*) p=${sb#??}; p=${p%% *}; cands="$p";; esac
  cands="$cands $(dirname "$v")/python"
}
list=""
for p in $cands /root/ml-env/bin/python /root/venv/bin/python /root/.venv/bin/python /root/vllm/bin/python \
    /root/vllm-env/bin/python /opt/vllm/bin/python /opt/venv/bin/python /root/*/bin/python /opt/*/bin/python \
    /home/*/*/bin/python /root/miniconda3/bin/python /root/anaconda3/bin/python /opt/conda/bin/python \
    /root/miniconda3/envs/*/bin/python /opt/conda/envs/*/bin/python $(command -v python3 2>/dev/null) \
    /usr/local/bin/python3 /usr/bin/python3; do
  case "$p" in /*) ;; *) continue;; esac
  case " $seen " in *" $p "*) continue;; esac
  seen="$seen $p"
  [ -f "$p" ] && [ -x "$p" ] || continue
  list="$list $p"
done
R=""
for p in /usr/bin/python3 /usr/local/bin/python3 $list; do
  [ -f "$p" ] && [ -x "$p" ] && trusted "$p" && { R=$p; break; }
done
if [ -n "$R" ]; then
  $T "$R" -I -S -c "$1" $list 2>/dev/null
else
  for p in $list; do echo "py $p {\"error\": \"not read: no root-owned Python in the container to read it with\"}"; done
fi
exit 0
"""

# The reader: versions from files only (it imports nothing from the candidates). One `py PATH JSON` line each.
PROBE_PY = r"""
import glob, json, os, re, stat, sys
def small(path, limit=1 << 16):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
"""
# the agent's own why_untrusted (one definition: a sticky directory is judged as the agent judges it)
PROBE_PY = PROBE_PY + "import stat as _stat\n" + inspect.getsource(_agent_files.why_untrusted) + r"""
def cfg(prefix):
    out = {}
    for ln in (small(os.path.join(prefix, "pyvenv.cfg")) or "").splitlines():
        k, eq, v = ln.partition("=")
        if eq:
            out[k.strip().lower()] = v.strip()
    return out
def sites(prefix):
    ds = glob.glob(os.path.join(prefix, "lib", "python3*", "site-packages")) \
        + glob.glob(os.path.join(prefix, "lib", "python3*", "dist-packages")) \
        + glob.glob(os.path.join(prefix, "local", "lib", "python3*", "dist-packages"))
    out = []
    for d in sorted(set(ds)):
        out.append(d)
        for pth in sorted(glob.glob(os.path.join(d, "*.pth")))[:50]:
            for ln in (small(pth) or "").splitlines()[:50]:
                ln = ln.strip()
                if ln and not ln.startswith(("#", "import ", "import\t")):
                    x = os.path.join(d, ln)
                    if os.path.isdir(x) and x not in out:
                        out.append(x)
    return out
def dist(sp, name):
    pkg = os.path.join(sp, name)
    pkg = pkg if os.path.isfile(os.path.join(pkg, "__init__.py")) else None
    for di in sorted(glob.glob(os.path.join(sp, name + "-*.dist-info"))):
        m = re.search(r"^Version:\s*(\S+)", small(os.path.join(di, "METADATA")) or "", re.M)
        if m:
            return m.group(1), pkg
    if pkg:
        src = small(os.path.join(pkg, "_version.py")) or small(os.path.join(pkg, "__init__.py")) or ""
        m = re.search(r"^(?:__version__|version)\b[^'\"\n]*['\"]([^'\"]+)['\"]", src, re.M)
        return (m.group(1) if m else "unknown"), pkg
    return None, None
for path in sys.argv[1:]:
    bindir = os.path.dirname(path)
    prefix = os.path.dirname(bindir)
    c = cfg(prefix)
    if not c:
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(path)))
    ver = c.get("version") or c.get("version_info")
    if not ver:
        m = re.search(r"python(3\.\d+)$", os.path.realpath(path))
        ver = m.group(1) if m else None
    out = {"prefix": prefix, "python_version": ver, "vllm": None, "vllm_path": None, "transformers": None,
           "untrusted": why_untrusted(path), "venv": bool(c)}
    for sp in sites(prefix):
        if out["vllm"] is None:
            out["vllm"], out["vllm_path"] = dist(sp, "vllm")
        if out["transformers"] is None:
            out["transformers"] = dist(sp, "transformers")[0]
    b = os.path.join(bindir, "vllm")
    out["vllm_bin"] = b if os.path.isfile(b) and os.access(b, os.X_OK) else None
    print("py %s %s" % (path, json.dumps(out)))
"""


def probe_argv() -> list[str]:
    return ["sh", "-c", PROBE_SH, "sh", PROBE_PY]


# ------------------------------------------------------------------ talking to the host


def resolve_host(inv, target: str, *, user: str | None, identity_file: str | None, known_hosts: str | None,
                 accept_new: bool, name: str | None):
    """-> (HostSpec, host name in the inventory or None). An inventory host name uses its own settings and
    host key policy; an address not in the inventory refuses unknown host keys unless accept_new."""
    if inv is not None and target in inv.hosts:
        return inv.hosts[target], target
    known = ", ".join(inv.hosts) if inv is not None and inv.hosts else "none"
    if _NAME_RE.fullmatch(target) and not re.fullmatch(r"[0-9]+", target):
        # a bare name (no user@, no dot, no :port) is meant as an inventory host: no DNS lookup, no connection
        raise UsageError(f"{target!r} is not a host of the inventory (hosts: {known})",
                         fix=f"deploy discover HOST with one of: {known}; a host not in the inventory by address: "
                             f"deploy discover root@ADDRESS --name {target}")
    try:
        t = parse_target(target)
    except ValueError as e:
        raise UsageError(f"{e}; and not a host of the inventory (hosts: {known})",
                         fix="deploy discover HOST where HOST is an inventory host name or [user@]address[:port]"
                         ) from None
    port = t["port"] or 22
    if inv is not None:
        for h in inv.hosts.values():
            if h.address == t["address"] and h.port == port:
                return h, h.name
    hs = HostSpec(name=name or "discover", address=t["address"], ssh_config_alias=None, port=port,
                  user=t["user"] or user or "root", identity_file=os.path.expanduser(identity_file) if identity_file
                  else None, known_hosts=os.path.expanduser(known_hosts or "~/.ssh/known_hosts"),
                  accept_new_host_keys=accept_new, connect_timeout_s=10.0, containers=())
    return hs, None


def discover(session, *, timeout: float = 60.0, progress=None) -> dict:
    """Read the host (read-only) -> {containers: [...], host_gpus, shared_gpus, warnings}."""
    say = progress or (lambda msg: None)
    r = session.run(["pct", "list"], timeout=timeout, label="discover")
    if not r.ok:
        raise DeployError(f"`pct list` failed (exit {r.exited}): {r.err.strip()[:300] or 'no output'}",
                          where=session.host.name,
                          fix="is this a Proxmox VE host, and does this user may run pct (root)?")
    try:
        listed = parse_pct_list(r.out)
    except ValueError as e:
        raise DeployError(f"cannot read `pct list`: {e}", where=session.host.name) from None
    say(f"{len(listed)} container(s) in pct list")
    warnings = []
    smi = session.run(["timeout", "-k", "2", "15", "nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                      timeout=timeout, label="discover")
    host_gpus = parse_host_gpus(smi.out) if smi.ok else None
    if host_gpus is None:
        said = (smi.err or smi.out).strip()
        warnings.append(f"host nvidia-smi failed (exit {smi.exited}: {said[:200]}); "
                        "'every GPU' passthrough is resolved from inside running containers only"
                        + ("; a version mismatch on the host itself: its NVIDIA driver was upgraded and the old "
                           "kernel module is still loaded: reboot the host (or unload and reload the nvidia modules)"
                           if NVML_MISMATCH.lower() in said.lower() else ""))

    def read_one(ct):
        vmid = ct["vmid"]
        c = session.run(["pct", "config", str(vmid)], timeout=timeout, label="discover")
        cfg = parse_pct_config(c.out) if c.ok else None
        probe = None
        if ct["status"] == "running":
            p = session.ct(vmid, probe_argv(), timeout=timeout, label="discover")
            probe = parse_probe(p.out) if p.ok else {"error": (p.err or p.out).strip()[:300] or f"exit {p.exited}"}
        return {"cfg": cfg, "cfg_error": None if c.ok else (c.err.strip()[:300] or f"exit {c.exited}"),
                "probe": probe}

    results = run_parallel(listed, read_one, deadline_s=timeout + 5) if listed else []
    containers = [_container(ct, value, err, host_gpus, warnings) for ct, value, err in results]
    shared = shared_gpus(containers)
    running = {c["vmid"]: c["status"] == "running" for c in containers}
    for c in containers:
        c["shared_gpus"] = {str(g): [v for v in shared[g] if v != c["vmid"]] for g in c["gpus"] if g in shared}
    return {"host": session.host.name, "address": session.host.address, "port": session.host.port,
            "host_gpus": host_gpus, "containers": containers,
            "shared_gpus": {str(g): {"vmids": v, "running": [x for x in v if running.get(x)]} for g, v in shared.items()},
            "warnings": warnings}


def _container(ct, value, err, host_gpus, warnings) -> dict:
    vmid = ct["vmid"]
    c = {"vmid": vmid, "name": ct["name"], "status": ct["status"], "lock": ct["lock"], "gpus": [],
         "gpus_all": False, "gpu_source": None, "address": None, "address_source": None, "runtime": None,
         "runtimes": [], "problems": []}
    if err is not None:
        c["problems"].append(f"could not be read: {getattr(err, 'message', None) or err}")
        return c
    cfg, probe = value["cfg"], value["probe"]
    if cfg is None:
        c["problems"].append(f"pct config failed: {value['cfg_error']}")
        return c
    c["problems"] += cfg["warnings"]
    inside = probe.get("gpus") if probe and "error" not in probe else None
    g = container_gpus(cfg, host_gpus, inside)
    c.update(gpus=g["gpus"], gpus_all=g["all"], gpu_source=g["source"])
    static = next((n["ip"] for n in cfg["net"] if n["ip"]), None)
    if static:
        c.update(address=static, address_source=f"{next(n['key'] for n in cfg['net'] if n['ip'])} ip=")
    if probe is None:
        return c
    if "error" in probe:
        c["problems"].append(f"probe inside failed: {probe['error']}")
        return c
    if not c["address"] and probe["addresses"]:
        c.update(address=probe["addresses"][0], address_source="inside (hostname -I)")
    rts = runtimes_of(probe)
    c["runtimes"] = rts
    c["problems"] += untrusted_runtimes(probe)
    c["pythons"] = [{"path": p["path"], "vllm": p.get("vllm")} for p in probe["pythons"]]
    if rts:
        c["runtime"] = {k: rts[0][k] for k in ("python", "vllm", "state_dir")}
    return c


# ------------------------------------------------------------------ rendering


def _flow(items) -> str:
    return "[" + ", ".join(str(x) for x in items) + "]"


def _q(s: str) -> str:
    """A YAML scalar that stays a string (quoted only when needed)."""
    return yaml.safe_dump(s, default_style=None).strip().removesuffix("\n...").removesuffix("...").strip()


def container_yaml(c: dict, indent: int) -> list[str]:
    """The lines of one container entry (a list item at `indent` spaces), with comments."""
    p = " " * indent
    head = f"{p}- vmid: {c['vmid']}"
    notes = [c["status"]] + ([f"lock {c['lock']}"] if c.get("lock") else [])
    if c["status"] != "running":
        notes.append("address and runtime not read (start it and discover again)")
    lines = [head + "  # " + ", ".join(notes)]
    name = inventory_name(c["name"], c["vmid"])
    lines.append(f"{p}  name: {name}" + (f"  # pct name {c['name']!r}" if name != c["name"] else ""))
    gnote = []
    if c["gpu_source"]:
        gnote.append(f"every GPU of the host ({c['gpu_source']})" if c["gpus_all"] else c["gpu_source"])
    if c.get("shared_gpus"):
        gnote.append("SHARED: " + ", ".join(f"{gi} with {'+'.join(map(str, o))}"
                                             for gi, o in c["shared_gpus"].items()))
    lines.append(f"{p}  gpus: {_flow(c['gpus'])}" + ("  # " + "; ".join(gnote) if gnote else ""))
    if c.get("address"):
        lines.append(f"{p}  address: {_q(c['address'])}  # from {c['address_source']}")
    elif c["status"] == "running" and not c["problems"]:
        lines.append(f"{p}  # address: none found (no ip= on a net line of pct config, and none but loopback "
                     "inside); set address: by hand if clients reach it some other way")
    rt = c.get("runtime")
    if rt:
        first = c["runtimes"][0]
        lines.append(f"{p}  runtime:  # vLLM {first.get('vllm_version') or '?'}, transformers "
                     f"{first.get('transformers_version') or 'not installed'}")
        for k in ("python", "vllm", "state_dir"):
            lines.append(f"{p}    {k}: {_q(rt[k])}")
        for other in c["runtimes"][1:]:
            lines.append(f"{p}  # also found: {other['python']} (vLLM {other.get('vllm_version') or '?'})")
    elif c["status"] == "running" and not c.get("runtime_kept") and not any("probe" in x for x in c["problems"]):
        py = c.get("pythons") or []
        lines.append(f"{p}  # no vLLM runtime: " + (f"{len(py)} Python(s) found, none imports vllm ("
                                                    + ", ".join(x["path"] for x in py[:3]) + ")" if py
                                                    else "no Python found"))
    for prob in c["problems"]:
        lines.append(f"{p}  # problem: {prob}")
    return [one_line(ln) for ln in lines]


def one_line(text: str) -> str:
    """A generated YAML line whose comment carries container-reported text (versions, error output): line breaks
    escaped (\\n), so that text cannot start a line of YAML of its own; other controls removed."""
    return strip_controls(str(text).replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\r")
                          .replace("\x85", "\\n").replace("\u2028", "\\n").replace("\u2029", "\\n"))


def host_yaml(host: dict, found: dict, indent: int = 2) -> list[str]:
    """The start of one `hosts:` list item: the keys of `host` but `containers` (in its order: the user's keys
    are kept as written) and what discover saw on the host, as comments."""
    p = " " * indent
    lines = []
    for k, v in host.items():
        if k == "containers":
            continue
        dumped = yaml.safe_dump({k: v}, default_flow_style=False, sort_keys=False, width=1000).rstrip("\n")
        for dl in dumped.splitlines():
            lines.append((f"{p}- " if not lines else f"{p}  ") + dl)
    hg = found.get("host_gpus")
    lines.append(f"{p}  # discovered by `deploy discover`: {len(found['containers'])} container(s), "
                 + (f"{len(hg)} GPU(s) on the host" if hg is not None else "host GPU count unknown"))
    for g, s in (found.get("shared_gpus") or {}).items():
        lines.append(f"{p}  # GPU {g} is SHARED by containers {', '.join(map(str, s['vmids']))}"
                     f" ({len(s['running'])} running)")
    for w in found.get("warnings") or []:
        lines.append(one_line(f"{p}  # warning: {w}"))
    return lines


def host_entry(hs, name: str) -> dict:
    """The connection keys of a discovered host, as the inventory writes them."""
    where = {"ssh_config_alias": hs.ssh_config_alias} if hs.ssh_config_alias else {"address": hs.address}
    return {"name": name, **where, "port": hs.port, "user": hs.user,
            **({"identity_file": hs.identity_file} if hs.identity_file else {}),
            "known_hosts": hs.known_hosts, "accept_new_host_keys": hs.accept_new_host_keys}


def render_inventory(host: dict, found: dict) -> str:
    """A whole inventory with this one host (what `deploy discover HOST` prints)."""
    return ("# written by `deploy discover`; see `deploy docs playbooks#inventory` for every key\n"
            "hosts:\n" + "\n".join(_host_block(merge_host(None, found, host), found, 2)) + "\n")


# ------------------------------------------------------------------ merging into an inventory file

_DISCOVERED_KEYS = ("name", "gpus", "address")  # facts read from the host replace what the file said


def merge_host(existing: dict | None, found: dict, new_host: dict) -> dict:
    """The host mapping to write: the user's keys (all kept), the discovered containers merged by vmid.

    A container the file already lists keeps every key it has except the facts (name, gpus, address), which
    discover replaces; its `runtime` is kept when the user wrote one (a choice, not a fact), else filled.
    Containers that pct list no longer shows are kept as written (in `containers` of the result, marked).
    """
    host = dict(existing) if existing else dict(new_host)
    old = {c.get("vmid"): c for c in (existing or {}).get("containers") or [] if isinstance(c, dict)}
    for c in found["containers"]:
        prev = old.pop(c["vmid"], None)
        if prev:
            c["user_keys"] = {k: v for k, v in prev.items() if k not in _DISCOVERED_KEYS + ("vmid",)}
            if "runtime" in prev and prev["runtime"] != c.get("runtime"):
                if c.get("runtime"):
                    c["problems"].append(f"kept the runtime the file had ({prev['runtime'].get('python')}); "
                                         f"found {c['runtime']['python']}")
                c["runtime_kept"] = prev["runtime"]
    host["containers"] = list(old.values())
    return host


def container_yaml_merged(c: dict, indent: int) -> list[str]:
    lines = container_yaml(c if not c.get("runtime_kept") else {**c, "runtime": None}, indent)
    p = " " * indent
    extra = dict(c.get("user_keys") or {})
    if c.get("runtime_kept"):
        extra["runtime"] = c["runtime_kept"]
    if c.get("runtime") and not c.get("runtime_kept"):
        extra.pop("runtime", None)
    if extra:
        dumped = yaml.safe_dump(extra, default_flow_style=None, sort_keys=False, width=1000).rstrip("\n")
        lines += [f"{p}  {dl}" for dl in dumped.splitlines()]
    return lines


def merge_text(text: str | None, host_name: str, found: dict, new_host: dict) -> str:
    """The inventory file's new text: only the discovered host's list item is rewritten (or appended);
    everything else in the file, comments included, stays byte for byte."""
    if not text or not text.strip():
        return render_inventory(new_host, found)
    root = yaml.compose(text)
    if root is None or not isinstance(root, yaml.MappingNode):
        raise UsageError("the inventory file is not a YAML mapping; refusing to merge into it",
                         fix="fix the file (deploy plan shows its problems) or write discover's output by hand")
    hosts_node = next((v for k, v in root.value if k.value == "hosts"), None)
    lines = text.splitlines()
    existing_node = None
    if isinstance(hosts_node, yaml.SequenceNode):
        for item in hosts_node.value:
            if isinstance(item, yaml.MappingNode) and any(k.value == "name" and v.value == host_name
                                                          for k, v in item.value if isinstance(v, yaml.ScalarNode)):
                existing_node = item
    if existing_node is not None:
        data = yaml.safe_load(yaml.serialize(existing_node))
        host = merge_host(data, found, new_host)
        indent = existing_node.start_mark.column - 2
        block = _host_block(host, found, indent)
        start = existing_node.start_mark.line
        em = existing_node.end_mark  # where the next token starts: the next item's `- ` ends this one there
        end = em.line if em.line >= len(lines) or not lines[em.line][:em.column].strip() else em.line + 1
        while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1  # comments after the item belong to what follows
        new = lines[:start] + block + lines[end:]
    else:
        host = merge_host(None, found, new_host)
        if isinstance(hosts_node, yaml.SequenceNode) and hosts_node.flow_style is False and hosts_node.value:
            indent = hosts_node.value[0].start_mark.column - 2
            end = hosts_node.end_mark.line if hosts_node.end_mark.column == 0 else hosts_node.end_mark.line + 1
            while end > 0 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
                end -= 1
            new = lines[:end] + _host_block(host, found, indent) + lines[end:]
        elif hosts_node is None or (isinstance(hosts_node, yaml.SequenceNode) and not hosts_node.value) or \
                (isinstance(hosts_node, yaml.ScalarNode) and hosts_node.value in ("", "null", "~")):
            if hosts_node is None:
                new = lines + ["hosts:"] + _host_block(host, found, 2)
            else:
                ln = hosts_node.start_mark.line
                new = lines[:ln] + ["hosts:"] + _host_block(host, found, 2) + lines[hosts_node.end_mark.line + 1:]
        else:
            raise UsageError("cannot find where to add the host in the inventory's `hosts:`",
                             fix="add it by hand from `deploy discover HOST` output")
    return "\n".join(new) + "\n"


def _host_block(host: dict, found: dict, indent: int) -> list[str]:
    p = " " * indent
    lines = host_yaml(host, found, indent) + [f"{p}  containers:"]
    for c in found["containers"]:
        lines += container_yaml_merged(c, indent + 4)
    for c in host.get("containers") or []:
        dumped = yaml.safe_dump([c], default_flow_style=None, sort_keys=False, width=1000).rstrip("\n").splitlines()
        lines.append(f"{p}    # vmid {c.get('vmid')} is not in pct list any more; kept as written")
        lines += [f"{p}    {dl}" for dl in dumped]
    if not found["containers"] and not host.get("containers"):
        lines[-1] = f"{p}  containers: []"
    return lines


def unified_diff(old: str, new: str, path: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), fromfile=path,
                                        tofile=path + " (discovered)"))


def write_inventory(path: str, text: str) -> str | None:
    """Write text to path (validated first, atomically, read back); keep the old file as PATH.bak-<UTC time>.
    -> the backup's path (None when there was no file)."""
    def valid(tmp: str) -> None:
        try:
            load_inventory(tmp)
        except SpecError as e:
            raise DeployError("the merged inventory would not be valid; nothing was written:\n  "
                              + "\n  ".join(p.replace(tmp, path) for p in e.problems),
                              fix="correct the file by hand, then run deploy discover --write again") from None

    return write_atomic(path, text, keep_mode=True, backup=True, check=valid)


def to_json(found: dict) -> dict:
    return {"schema": "vllm-pve-deploy/discover/v1", **found}


# ------------------------------------------------------------------ the command


def run_discover(obj, target: str, *, write: bool, yes: bool, accept_new: bool, identity_file: str | None,
                 known_hosts: str | None, user: str | None, name: str | None, timeout: float) -> int:
    """`deploy discover`: read the host, print YAML (or JSON), optionally merge into the inventory file."""
    inv_path = None
    try:
        inv_path = find_inventory(obj.inventory_path)
    except UsageError:
        if obj.inventory_path:
            raise
    inv = load_inventory(inv_path) if inv_path and os.path.exists(inv_path) else None
    hs, inv_name = resolve_host(inv, target, user=user, identity_file=identity_file, known_hosts=known_hosts,
                                accept_new=accept_new, name=name)
    if name and not _NAME_RE.fullmatch(name):
        raise UsageError(f"--name {name!r}: lowercase letters, digits and '-', at most 63")
    progress = Progress(quiet=obj.json)
    where = f"{hs.user}@{hs.ssh_config_alias or hs.address}:{hs.port}"
    progress.say(where, "reading pct list, pct config and each running container (read-only)")
    session = HostSession(hs, AuditLog())
    try:
        found = discover(session, timeout=timeout, progress=lambda m: progress.say(where, m))
    except HostKeyError as e:
        if inv_name is None and "accept_new_host_keys: true" in (e.fix or ""):
            # an address outside the inventory has no inventory key to set: the option of this command is the way
            e.fix = e.fix.replace("set accept_new_host_keys: true for this host",
                                  f"run again with --accept-new-host-key (deploy discover {target} "
                                  "--accept-new-host-key; the key is then recorded)")
        raise
    finally:
        session.close()
    host_name = name or inv_name or inventory_name(hs.ssh_config_alias or hs.address, 0)
    found["host"] = host_name
    entry = host_entry(hs, host_name)
    if not write:
        if obj.json:
            dump_json(to_json(found))
        else:
            click.echo(render_inventory(entry, found), nl=False)
        return EXIT_OK
    path = inv_path or "hosts.yaml"
    old = open(path).read() if os.path.exists(path) else ""
    new = merge_text(old, host_name, found, entry)
    diff = unified_diff(old, new, path)
    if not diff:
        msg = f"{path} already says what {host_name} has; nothing to write"
        dump_json({**to_json(found), "written": None, "backup": None}) if obj.json else click.echo(msg)
        return EXIT_OK
    if not obj.json:
        click.echo(diff, nl=False)
    if not yes:
        try:
            ok = click.confirm(f"write these changes to {path}?", default=False, err=True)
        except click.exceptions.Abort:  # no answer (stdin closed)
            ok = False
        if not ok:
            click.echo(f"nothing written to {path} (run again with -y to write without asking)", err=True)
            return EXIT_FAILED
    backup = write_inventory(path, new)
    if obj.json:
        dump_json({**to_json(found), "written": path, "backup": backup})
    else:
        click.echo(f"wrote {path}" + (f" (the previous file is kept as {backup})" if backup else ""))
    return EXIT_OK
