"""The simulated host's /usr/sbin/pct (stdlib only, run with python3 -SE; see docs/testbed.md).

Behaves like Proxmox VE's pct for the sub-commands the deploy tool uses: list, status, exec, start, stop,
shutdown, reboot, config, set (devN only, as `deploy prepare` uses it), push, pull. Errors go to stderr with exit status 255, like pct's `die`.
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


def cmd_set(hostdir, host, args):
    """pct set VMID --devN PATH[,opts] ... [--delete devN[,devM]]: like pve-container, the config is rewritten
    with its keys sorted (raw lxc.* keys after them, snapshot sections untouched); the host path must exist."""
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


def cmd_push(hostdir, host, args):
    usage = "pct push <vmid> <file> <destination> [OPTIONS]"
    pos, opts = _split_opts(args, ("perms", "user", "group"), usage)
    if len(pos) != 3:
        die("400 not enough arguments\n" + usage)
    vmid = get_ct(host, pos[0])
    pid = ctl.init_pid(hostdir, vmid)
    if not pid:
        die("container '%d' not running!" % vmid)
    src, dst = pos[1], pos[2]
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
    usage = "pct pull <vmid> <path> <destination> [OPTIONS]"
    pos, opts = _split_opts(args, ("perms", "user", "group"), usage)
    if len(pos) != 3:
        die("400 not enough arguments\n" + usage)
    vmid = get_ct(host, pos[0])
    pid = ctl.init_pid(hostdir, vmid)
    if not pid:
        die("container '%d' not running!" % vmid)
    src, dst = pos[1], pos[2]
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
            "shutdown": cmd_shutdown, "reboot": cmd_reboot, "config": cmd_config, "set": cmd_set, "push": cmd_push, "pull": cmd_pull}


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
