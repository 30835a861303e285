"""The simulated host's /usr/sbin/pct (stdlib only, run with python3 -SE; see docs/testbed.md).

Behaves like Proxmox VE's pct for the sub-commands the deploy tool uses: list, status, exec, start, stop,
shutdown, reboot, config, set (devN and mpN, as `deploy prepare` uses them), create (as `deploy prepare --create`
uses it: a namespace container from a template archive), push, pull. Errors go to stderr with exit status 255, like pct's `die`.

Mount points: only bind mounts of host directories (`--mpN /HOST/DIR,mp=/PATH[,ro=1]...`; no storage volumes or
devices, and not in the test bed's real LXC containers). pct set writes them into the config (a property string as
pve-container prints it: the volume, mp=, then the other keys sorted, booleans as 0/1); each start mounts the
config's mount points into the container (ctl.sync_mounts, ctinit.py), read-only with ro=1. Proxmox can hot-plug a
bind mount into a running container; the test bed does not: a mount point set or deleted while the container runs
takes effect at its next start. Unlike pve-container (which takes a relative mp= as relative to the container's
root), the test bed refuses a relative mp=; and it refuses a host directory that does not exist at `pct set` already
(pve-container finds that at the next start: "directory '/X' does not exist"). A mount point directory that the
container lacks is made at start, on this machine's own file system where that is what the container sees (the
test bed's containers share it outside /root, /tmp, /etc, /var/lib, /dev and /run).
"""
import json
import os
import sys

import ctl

USAGE_EXEC = "pct exec <vmid> [<extra-args>] [OPTIONS]"


def die(msg, code=255):
    sys.stderr.write(msg.rstrip("\n") + "\n")
    sys.exit(code)


def host_faults(hostdir):
    try:
        with open(os.path.join(hostdir, "faults.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def get_ct(host, vmid_s):
    if not vmid_s.isdigit() or not (100 <= int(vmid_s) <= 999999999):
        die("400 Parameter verification failed.\nvmid: invalid format - value does not look like a valid VM ID\n")
    vmid = int(vmid_s)
    if str(vmid) not in host["containers"]:
        die("Configuration file 'nodes/%s/lxc/%d.conf' does not exist" % (host["name"], vmid))
    return vmid


def need_vmid(args, usage):
    if not args:
        die("400 not enough arguments\n" + usage)
    return args[0]


def cmd_list(hostdir, host, args):
    rows = []
    for vmid in sorted(host["containers"], key=int):
        st = "running" if ctl.init_pid(hostdir, vmid) else "stopped"
        rows.append("%-10s %-10s %-12s %-20s\n" % (vmid, st, "", host["containers"][vmid]["name"]))
    if rows:
        sys.stdout.write("%-10s %-10s %-12s %-20s\n" % ("VMID", "Status", "Lock", "Name") + "".join(rows))
    return 0


def cmd_status(hostdir, host, args):
    vmid = get_ct(host, need_vmid(args, "pct status <vmid> [OPTIONS]"))
    sys.stdout.write("status: %s\n" % ("running" if ctl.init_pid(hostdir, vmid) else "stopped"))
    return 0


def cmd_exec(hostdir, host, args):
    if "--" in args:
        k = args.index("--")
        opts, cmd = args[:k], args[k + 1:]
    else:
        opts, cmd = args, []
    keep_env = True
    pos = []
    i = 0
    supported = host_faults(hostdir).get("keep_env_supported", True)
    while i < len(opts):
        a = opts[i]
        if a.startswith("--keep-env") or a.startswith("-keep-env"):
            if not supported:
                die("Unknown option: keep-env\n400 unable to parse option\n" + USAGE_EXEC)
            if "=" in a:
                v = a.split("=", 1)[1]
            elif i + 1 < len(opts):
                i += 1
                v = opts[i]
            else:
                die("Option keep-env requires an argument\n400 unable to parse option\n" + USAGE_EXEC)
            if v.lower() in ("0", "false", "no", "off"):
                keep_env = False
            elif v.lower() in ("1", "true", "yes", "on"):
                keep_env = True
            else:
                die("400 Parameter verification failed.\nkeep-env: type check ('boolean') failed - got '%s'\n"
                    % v + USAGE_EXEC)
        elif a.startswith("-") and a != "-":
            die("Unknown option: %s\n400 unable to parse option\n" % a.lstrip("-") + USAGE_EXEC)
        else:
            pos.append(a)
        i += 1
    if not pos:
        die("400 not enough arguments\n" + USAGE_EXEC)
    vmid = get_ct(host, pos[0])
    if len(pos) > 1 or not cmd:  # like pve-container: the command must follow `--`
        die("missing command")
    pid = ctl.init_pid(hostdir, vmid)
    if not pid:
        die("container '%d' not running!" % vmid)
    env = dict(os.environ) if keep_env else {"PATH": ctl.DEFAULT_PATH, "container": "lxc"}
    lx = ctl.lxc_of(hostdir, vmid)
    if lx:  # a real LXC container: lxc-attach, as Proxmox's pct does
        argv = ctl._lxcct().attach_argv(lx, cmd, env={"PATH": ctl.DEFAULT_PATH}, keep_env=keep_env)
        env = dict(os.environ)
    else:
        argv = ctl.enter_argv(pid, cmd)
    sys.stdout.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        die("failed to exec: %s" % e)


def cmd_start(hostdir, host, args):
    vmid = get_ct(host, need_vmid(args, "pct start <vmid> [OPTIONS]"))
    if ctl.init_pid(hostdir, vmid):
        die("CT %d already running" % vmid)
    rootpid = None
    try:
        rootpid = int(open(os.path.join(hostdir, "gpusim.ready")).read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if host["containers"][str(vmid)].get("created_by_pct"):
        ctl.ensure_ct_socket(hostdir, vmid)
    try:
        ctl.start(hostdir, vmid, sys.executable, root_ns_pid=rootpid)
    except RuntimeError as e:
        die("startup for container '%d' failed: %s" % (vmid, e))
    return 0


def cmd_stop(hostdir, host, args):
    vmid = get_ct(host, need_vmid(args, "pct stop <vmid> [OPTIONS]"))
    if not ctl.stop(hostdir, vmid):
        die("CT %d not running" % vmid)
    return 0


def cmd_shutdown(hostdir, host, args):
    vmid = get_ct(host, need_vmid(args, "pct shutdown <vmid> [OPTIONS]"))
    try:
        if not ctl.stop(hostdir, vmid, clean=True):
            die("CT %d not running" % vmid)
    except RuntimeError as e:
        die("shutdown of container '%d' failed: %s" % (vmid, e))
    return 0


def cmd_reboot(hostdir, host, args):
    """Like PVE: a clean shutdown, then a start (the container must be running)."""
    vmid = get_ct(host, need_vmid(args, "pct reboot <vmid> [OPTIONS]"))
    if not ctl.init_pid(hostdir, vmid):
        die("CT %d not running" % vmid)
    try:
        ctl.stop(hostdir, vmid, clean=True)
    except RuntimeError as e:
        die("reboot of container '%d' failed: %s" % (vmid, e))
    return cmd_start(hostdir, host, [str(vmid)])


def conf_path(hostdir, host, vmid):
    return os.path.join(hostdir, "pve", "nodes", host["name"], "lxc", "%d.conf" % vmid)


def cmd_config(hostdir, host, args):
    vmid = get_ct(host, need_vmid(args, "pct config <vmid> [OPTIONS]"))
    path = conf_path(hostdir, host, vmid)
    try:  # the container fault missing_dev_line: the line passing that device in is not printed
        with open(os.path.join(hostdir, "ct%d" % vmid, "faults", "faults.json")) as f:
            hide = json.load(f).get("missing_dev_line")
    except (OSError, ValueError):
        hide = None
    for line in open(path):
        if line.startswith("["):  # snapshot sections
            break
        if hide and line.split(":", 1)[-1].strip().split(",")[0].split(" ")[0] == hide:
            continue
        if line.strip() and not line.startswith("#"):
            sys.stdout.write(line)
    return 0


def old_pve(hostdir):
    """pve_version (a host fault) below 8.1: a pve-container without devN: keys."""
    v = str(host_faults(hostdir).get("pve_version") or "8.2.4")
    return tuple(int(x) for x in v.split(".")[:2]) < (8, 1)


MP_BOOLS = ("acl", "backup", "keepattrs", "quota", "replicate", "ro", "shared")
MP_KEYS = ("volume", "mp", "size", "mountoptions", "idmap") + MP_BOOLS
PVE_BOOL = {"1": "1", "on": "1", "yes": "1", "true": "1", "0": "0", "off": "0", "no": "0", "false": "0"}


def _mp_string_bad(v):
    """pve-container's pve-lxc-mp-string format (verify_lxc_mp_string): no /./ /../, no /. /.. at the end, no ../
    at the start."""
    return "/./" in v or "/../" in v or v.endswith(("/.", "/..")) or v.startswith("../")


def parse_mp(key, value):
    """--mpN's property string as pve-container parses it (PVE::JSONSchema::parse_property_string with $mp_desc, then
    check_object): {key: value}, or die with its message (`mpN: invalid format - ...`, the sub-errors after it)."""
    def bad(msg, errors=()):
        die("400 Parameter verification failed.\n%s: invalid format - %s\n%s" % (
            key, msg, "".join("%s.%s: %s\n" % e for e in sorted(errors))))
    res = {}
    for part in value.split(","):
        if not part.strip():
            continue
        k, eq, v = part.partition("=")
        if eq and k and v:
            if k in res:
                bad("duplicate key in comma-separated list property: %s" % k)
            if k not in MP_KEYS:
                bad("invalid key in comma-separated list property: %s" % k)
            res[k] = PVE_BOOL.get(v.lower(), v) if k in MP_BOOLS else v
        elif not eq:
            if "volume" in res:
                bad("duplicate key in comma-separated list property: volume")
            res["volume"] = part
        else:
            bad("missing key in comma-separated list property")
    errors = [(key, k, "property is missing and it is not optional") for k in ("mp", "volume") if k not in res]
    errors += [(key, k, "type check ('boolean') failed - got '%s'" % res[k]) for k in MP_BOOLS
               if k in res and res[k] not in ("0", "1")]
    errors += [(key, k, "invalid format - %s contains illegal character sequences" % res[k]) for k in ("mp", "volume")
               if k in res and _mp_string_bad(res[k])]
    if "mp" in res and not errors and not res["mp"].startswith("/"):  # the test bed's rule, see the docstring
        errors.append((key, "mp", "mount point path '%s' is not absolute" % res["mp"]))
    if errors:
        bad("format error", errors)
    return res


def print_mp(mp):
    """pve-container's print_ct_mountpoint: the volume, then the required mp=, then the other keys sorted."""
    return ",".join([mp["volume"], "mp=" + mp["mp"]] + ["%s=%s" % (k, mp[k]) for k in sorted(mp)
                                                        if k not in ("volume", "mp")])


def cmd_set(hostdir, host, args):
    """pct set VMID --devN PATH[,opts] --mpN DIR,mp=PATH[,opts] ... [--delete devN[,mpM]]: like pve-container, the
    config is rewritten with its keys sorted (raw lxc.* keys after them, snapshot sections untouched); the host path
    must exist (for mpN: a directory, see the module docstring)."""
    usage = "pct set <vmid> [OPTIONS]"
    if not args:
        die("400 not enough arguments\n" + usage)
    vmid = get_ct(host, args[0])
    sets, delete = {}, []
    i = 1
    while i < len(args):
        a = args[i].lstrip("-")
        if not args[i].startswith("-"):
            die("400 too many arguments\n" + usage)
        k, eq, v = a.partition("=")
        if not eq:
            if i + 1 >= len(args):
                die("Option %s requires an argument\n400 unable to parse option\n%s" % (k, usage))
            i += 1
            v = args[i]
        if k == "delete":
            delete += [x.strip() for x in v.split(",") if x.strip()]
        elif k.startswith("dev") and k[3:].isdigit() and int(k[3:]) < 256 and not old_pve(hostdir):
            path = v.split(",")[0]
            path = path[len("path="):] if path.startswith("path=") else path
            if not path.startswith("/dev/"):
                die("400 Parameter verification failed.\n%s: invalid format - not a device path\n" % k)
            if ctl.host_node_missing(hostdir, path):
                die("400 Parameter verification failed.\n%s: Path %s does not exist\n" % (k, path))
            sets[k] = v
        elif k.startswith("mp") and k[2:].isdigit() and int(k[2:]) < 256 and str(int(k[2:])) == k[2:]:
            mp = parse_mp(k, v)
            if not mp["volume"].startswith("/") or mp["volume"].startswith("/dev/"):
                die("%s: only bind mounts of host directories are simulated by the test bed, not %s" % (
                    k, "storage volumes" if not mp["volume"].startswith("/") else "devices"))
            if not os.path.isdir(mp["volume"]):
                die("400 Parameter verification failed.\n%s: directory '%s' does not exist\n" % (k, mp["volume"]))
            if ctl.lxc_of(hostdir, vmid):
                die("%s: mount points are not simulated in the test bed's real LXC containers (CT %d)" % (k, vmid))
            sets[k] = print_mp(mp)
        else:
            die("Unknown option: %s\n400 unable to parse option\n%s" % (k, usage))
        i += 1
    path = conf_path(hostdir, host, vmid)
    text = open(path).read()
    cut = len(text)
    for m in ("\n[",):
        j = text.find(m)
        if j >= 0:
            cut = j + 1
    if text.startswith("["):
        cut = 0
    main_, rest = text[:cut], text[cut:]
    comments, keys, raw = [], {}, []
    for ln in main_.splitlines():
        if not ln.strip():
            continue
        if ln.startswith("#"):
            comments.append(ln)
            continue
        k, _, v = ln.partition(":")
        if k.strip().startswith("lxc."):
            raw.append(ln)
        else:
            keys[k.strip()] = v.strip()
    for k in delete:
        keys.pop(k, None)
    keys.update(sets)
    out = comments + ["%s: %s" % (k, keys[k]) for k in sorted(keys)] + raw
    tmp = path + ".tmp.%d" % os.getpid()
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n" + (("\n" + rest.lstrip("\n")) if rest else ""))
    os.rename(tmp, path)
    return 0


def _split_opts(args, names, usage):
    pos, opts = [], {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            k, _, v = a[2:].partition("=")
            if k not in names:
                die("Unknown option: %s\n400 unable to parse option\n%s" % (k, usage))
            if not _:
                if i + 1 >= len(args):
                    die("Option %s requires an argument\n400 unable to parse option\n%s" % (k, usage))
                i += 1
                v = args[i]
            opts[k] = v
        else:
            pos.append(a)
        i += 1
    return pos, opts

CREATE_OPTS = ("hostname", "memory", "swap", "cores", "rootfs", "net0", "onboot", "features", "unprivileged",
               "ostype", "start", "arch")


def _volume_path(hostdir, volid):
    """local:vztmpl/NAME -> the file of the test bed's `local` storage (HOSTDIR/vz is the host's /var/lib/vz)."""
    store, _, rest = volid.partition(":")
    if not rest:
        return volid if volid.startswith("/") else None
    if store != "local":
        die("storage '%s' does not exist" % store)
    if not rest.startswith("vztmpl/") or "/" in rest[len("vztmpl/"):] or rest.endswith("/"):
        die("unable to parse volume ID '%s'" % volid)
    return os.path.join(hostdir, "vz", "template", "cache", rest[len("vztmpl/"):])


def _extract_root(archive, dest):
    """The template's ./root/ into the container's /root (the rest of its file system is this machine's, in the
    test bed); only plain files, directories and symlinks, nothing outside root/."""
    import tarfile
    n = 0
    with tarfile.open(archive) as t:
        for m in t:
            name = m.name[2:] if m.name.startswith("./") else m.name
            if not (name == "root" or name.startswith("root/")) or ".." in name.split("/"):
                continue
            rel = name[len("root"):].lstrip("/")
            target = os.path.join(dest, rel) if rel else dest
            if m.isdir():
                os.makedirs(target, exist_ok=True)
                os.chmod(target, m.mode & 0o7777 or 0o755)
            elif m.isfile():
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with t.extractfile(m) as src, open(target, "wb") as out:
                    out.write(src.read())
                os.chmod(target, m.mode & 0o7777)
            elif m.issym():
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.symlink(m.linkname, target)
            else:
                continue
            n += m.size if m.isfile() else 0
    return n


def _lan_cidr(hostdir, tpl, ip):
    """ip= of net0: a static address as it is (with /24 when it has no prefix), dhcp: the lowest free address of the
    test bed's /24 (what its DHCP server would hand out); tpl: the host's create.json."""
    if ip and ip != "dhcp":
        return ip if "/" in ip else ip + "/24"
    root = os.path.dirname(hostdir)
    used = set()
    for h in os.listdir(root):
        hd = os.path.join(root, h)
        for d in (os.listdir(hd) if os.path.isdir(hd) else []):
            try:
                with open(os.path.join(hd, d, "ct.json")) as f:
                    used.add(json.load(f)["net"]["cidr"].split("/")[0])
            except (OSError, ValueError, KeyError, TypeError):
                pass
    for n in range(tpl["lan_first"], tpl["lan_last"] + 1):
        if tpl["subnet"] + str(n) not in used:
            return "%s%d/24" % (tpl["subnet"], n)
    die("no free address on the test bed's network (dhcp)")


def cmd_create(hostdir, host, args):
    """pct create VMID OSTEMPLATE [--hostname ... --memory ... --cores ... --rootfs STORAGE:GB --net0 ... --onboot
    --features ... --unprivileged ...]: a stopped container with the template's /root, a config as Proxmox writes
    it (keys sorted) and no GPU lines; an existing VMID or a missing template is refused as pct refuses them."""
    usage = "pct create <vmid> <ostemplate> [OPTIONS]"
    pos, opts = _split_opts(args, CREATE_OPTS, usage)
    if len(pos) != 2:
        die("400 not enough arguments\n" + usage)
    vmid_s, tpl = pos
    if not vmid_s.isdigit() or not (100 <= int(vmid_s) <= 999999999):
        die("400 Parameter verification failed.\nvmid: invalid format - value does not look like a valid VM ID\n")
    vmid = int(vmid_s)
    if str(vmid) in host["containers"] or os.path.exists(ctl.ctdir(hostdir, vmid)):
        die("unable to create CT %d - CT %d already exists on node '%s'" % (vmid, vmid, host["name"]))
    archive = _volume_path(hostdir, tpl)
    if not archive or not os.path.isfile(archive):
        die("unable to create CT %d - volume '%s' does not exist" % (vmid, tpl))
    rootfs = opts.get("rootfs", "local-lvm:8")
    store, _, size = rootfs.partition(":")
    if store not in ("local", "local-lvm") or not size.isdigit():
        die("unable to create CT %d - storage '%s' does not exist" % (vmid, store) if store not in
            ("local", "local-lvm") else "400 Parameter verification failed.\nrootfs: invalid format - %s\n" % rootfs)
    for k in ("memory", "swap", "cores"):
        if k in opts and not opts[k].isdigit():
            die("400 Parameter verification failed.\n%s: type check ('integer') failed - got '%s'\n" % (k, opts[k]))
    with open(os.path.join(hostdir, "create.json")) as f:
        t = json.load(f)
    net = dict(kv.split("=", 1) for kv in opts.get("net0", "name=eth0,bridge=vmbr0,ip=dhcp").split(",") if "=" in kv)
    cidr = _lan_cidr(hostdir, t, net.get("ip"))
    mac = ctl.mac(t["host_no"], vmid)
    name = opts.get("hostname") or "CT%d" % vmid
    d = ctl.ctdir(hostdir, vmid)
    sys.stdout.write("  Logical volume \"vm-%d-disk-0\" created.\n" % vmid)
    ctl.make_ct_dirs(d)
    sys.stdout.write("extracting archive '/var/lib/vz/template/cache/%s'\n" % os.path.basename(archive))
    n = _extract_root(archive, os.path.join(d, "root"))
    sys.stdout.write("Total bytes read: %d\nDetected container architecture: amd64\n" % n)
    binds = [[src, os.path.join(d, rel)] for src, rel in t["binds_rel"]]
    ct = {"ctdir": d, "hostdir": hostdir, "cbin": t["cbin"], "name": name, "gpus": [], "binds": binds,
          "net": {"port": "p%dc%d" % (t["host_no"], vmid), "cidr": cidr, "mac": mac}, "created_by_pct": True}
    with open(os.path.join(d, "ct.json"), "w") as f:
        json.dump(ct, f, indent=1)
    keys = {"arch": opts.get("arch", "amd64"), "cores": opts.get("cores", "1"), "hostname": name,
            "memory": opts.get("memory", "512"), "swap": opts.get("swap", "512"),
            "net0": "name=%s,bridge=%s,hwaddr=%s,ip=%s,type=veth" % (net.get("name", "eth0"),
                                                                    net.get("bridge", "vmbr0"), mac,
                                                                    net.get("ip", "dhcp")),
            "ostype": opts.get("ostype", "debian"), "rootfs": "%s:vm-%d-disk-0,size=%sG" % (store, vmid, size)}
    for k in ("onboot", "features", "unprivileged"):
        if k in opts:
            keys[k] = opts[k]
    tmp = conf_path(hostdir, host, vmid) + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join("%s: %s\n" % (k, keys[k]) for k in sorted(keys)))
    os.rename(tmp, conf_path(hostdir, host, vmid))
    host["containers"][str(vmid)] = {"name": name, "gpus": [], "created_by_pct": True}
    with open(os.path.join(hostdir, "host.json.tmp"), "w") as f:
        json.dump(host, f, indent=1)
    os.rename(os.path.join(hostdir, "host.json.tmp"), os.path.join(hostdir, "host.json"))
    sys.stdout.write("Creating SSH host keys from the template... done\n")
    if opts.get("start") == "1":
        return cmd_start(hostdir, host, [str(vmid)])
    return 0


def _copy_args(hostdir, host, args, usage):
    """pct push's and pull's arguments -> (vmid, its init's pid, source, destination, options); dies as pct does."""
    pos, opts = _split_opts(args, ("perms", "user", "group"), usage)
    if len(pos) != 3:
        die("400 not enough arguments\n" + usage)
    vmid = get_ct(host, pos[0])
    pid = ctl.init_pid(hostdir, vmid)
    if not pid:
        die("container '%d' not running!" % vmid)
    return vmid, pid, pos[1], pos[2], opts


def cmd_push(hostdir, host, args):
    vmid, pid, src, dst, opts = _copy_args(hostdir, host, args, "pct push <vmid> <file> <destination> [OPTIONS]")
    try:
        fin = open(src, "rb")
    except OSError as e:
        die("can't open file '%s' - %s" % (src, e.strerror))
    perms = opts.get("perms", "0644")
    perms = oct(int(perms, 16))[2:] if perms.lower().startswith("0x") else perms
    owner = "%s:%s" % (opts.get("user", "0"), opts.get("group", "0"))
    import subprocess
    r = subprocess.run(ctl.enter_argv(pid, ["sh", "-c", 'cat > "$1" && chmod "$2" "$1" && chown "$3" "$1"',
                                            "sh", dst, perms, owner]), stdin=fin)
    if r.returncode:
        die("error writing '%s' in container %d" % (dst, vmid))
    return 0


def cmd_pull(hostdir, host, args):
    vmid, pid, src, dst, opts = _copy_args(hostdir, host, args, "pct pull <vmid> <path> <destination> [OPTIONS]")
    import subprocess
    tmp = dst + ".pct-pull.tmp"
    with open(tmp, "wb") as fout:
        r = subprocess.run(ctl.enter_argv(pid, ["cat", "--", src]), stdout=fout, stderr=subprocess.PIPE)
    if r.returncode:
        os.unlink(tmp)
        die("failed to open %s for reading: %s" % (src, r.stderr.decode(errors="replace").strip().split(": ")[-1]))
    if "perms" in opts:
        os.chmod(tmp, int(opts["perms"], 8))
    os.rename(tmp, dst)
    return 0


COMMANDS = {"list": cmd_list, "status": cmd_status, "exec": cmd_exec, "start": cmd_start, "stop": cmd_stop,
            "shutdown": cmd_shutdown, "reboot": cmd_reboot, "config": cmd_config, "set": cmd_set, "create": cmd_create, "push": cmd_push, "pull": cmd_pull}


def main(hostdir, argv):
    host = ctl.load_host(hostdir)
    if not argv or argv[0] in ("help", "-h", "--help"):
        sys.stdout.write("USAGE: pct <COMMAND> [ARGS] [OPTIONS]\n\n" + "".join(
            "       pct %s\n" % c for c in sorted(COMMANDS)) + "\n(vllm-pve-deploy test bed simulation)\n")
        return 0 if argv else 255
    fn = COMMANDS.get(argv[0])
    if fn is None:
        die("unknown command 'pct %s'\nUSAGE: pct <COMMAND> [ARGS] [OPTIONS]" % argv[0])
    return fn(hostdir, host, argv[1:]) or 0
