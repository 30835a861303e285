"""`deploy prepare HOST/VMID --create` on the test bed (issue 34): from a bare host to `deploy up`. The test bed's
pct create makes a real (namespace) container from a template archive on the host's `local` storage (its ./root/
becomes /root), with no GPU lines and no NVIDIA user space; prepare then adds the device lines, starts it, installs
the host's driver user space from the .run, checks, and runs what the playbooks that target it ask for (a venv,
install-vllm). The container is declared in a copy of the inventory first, as a user declares it in hosts.yaml.
reset() removes the created containers and extra templates."""

import json
import os
import re

import pytest
import yaml

from e2e_helpers import deploy_runner

DRIVER = "550.54.15"
RUN = f"/root/NVIDIA-Linux-x86_64-{DRIVER}.run"
TEMPLATE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.gz"
V = 131
RUNTIME = {"python": "/root/ml-env/bin/python", "vllm": "/root/ml-env/bin/vllm", "state_dir": "/var/lib/vllm-pve-deploy"}


@pytest.fixture
def new_ct(tb, tmp_path):
    """A copy of the inventory that declares pve1/131 (GPUs 0-3, a static address on the test bed's network);
    .deploy runs deploy against it; .conf is the container's config file on the host; .address its address."""
    inv = yaml.safe_load(open(tb.inventory_path))
    address = tb.subnet + "61"
    for h in inv["hosts"]:
        if h["name"] == "pve1":
            h["containers"].append({"vmid": V, "name": "vllm-new", "gpus": [0, 1, 2, 3], "address": address,
                                    "runtime": dict(RUNTIME)})
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))

    class NS:
        pass
    ns = NS()
    ns.deploy = deploy_runner(str(path), tmp_path / "state")
    ns.conf = tb.hostdir("pve1") / "pve" / "nodes" / "pve1" / "lxc" / f"{V}.conf"
    ns.address = address
    ns.inventory = path
    return ns


def smi(tb):
    return tb.container_exec("pve1", V, ["nvidia-smi", "--query-gpu=index,driver_version", "--format=csv,noheader"])


def test_dry_run_plans_the_create_and_changes_nothing(tb, new_ct):
    p = new_ct.deploy("--json", "prepare", f"pve1/{V}", "--create", "--template", TEMPLATE, "--driver-run", RUN,
                      "--gpus", "0-3", "--memory", "32768", "--cores", "8", "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    r = p.json
    assert r["dry_run"] and not r["created"]
    steps = [s["step"] for s in r["plan"]]
    assert steps[:2] == ["create", "read back"] and "backup" not in steps  # nothing to replace: the file is new
    assert steps[2:] == ["config", "read back", "start", "driver", "check"]
    create = r["plan"][0]["command"]
    assert create.startswith(f"pct create {V} {TEMPLATE} --hostname vllm-new --memory 32768 --swap 0 --cores 8 "
                             "--rootfs local-lvm:200 --net0 name=eth0,bridge=vmbr0,ip=%s/24 --onboot 1 "
                             "--features nesting=1 --unprivileged 1" % new_ct.address), create
    assert r["add_lines"] == ["dev0: /dev/nvidia0", "dev1: /dev/nvidia1", "dev2: /dev/nvidia2", "dev3: /dev/nvidia3",
                              "dev4: /dev/nvidiactl", "dev5: /dev/nvidia-uvm", "dev6: /dev/nvidia-uvm-tools"]
    assert not new_ct.conf.exists() and V not in tb.created_containers("pve1")


def test_create_gpus_driver_and_a_second_run_changes_nothing(tb, new_ct):
    p = new_ct.deploy("--json", "prepare", f"pve1/{V}", "--create", "--template", TEMPLATE, "--driver-run", RUN,
                      "--gpus", "0-3", "--no-install", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    r = p.json
    assert r["ok"] and r["created"] and r["findings"] == [] and r["pending"] == [], r
    assert r["applied"][0] == f"pct create {V} from {TEMPLATE}"
    assert f"pct start {V}" in r["applied"] and f"driver {DRIVER} user space from {RUN}" in r["applied"]
    assert r["restore"].startswith(f"pct destroy {V}")
    text = new_ct.conf.read_text()
    assert "hostname: vllm-new\n" in text and "onboot: 1\n" in text and "dev6: /dev/nvidia-uvm-tools\n" in text
    assert f"ip={new_ct.address}/24" in text
    assert smi(tb).stdout.split("\n")[:4] == [f"{i}, {DRIVER}" for i in range(4)]
    # the template's /root is the container's; it is on the network at the inventory's address
    assert "from the template" in tb.container_exec("pve1", V, ["cat", "/root/.bashrc"]).stdout
    assert new_ct.address in tb.container_exec("pve1", V, ["ip", "-o", "-4", "addr", "show", "eth0"]).stdout
    # again, without --create: nothing to change, and the check is clean
    q = new_ct.deploy("--json", "prepare", f"pve1/{V}", "--no-install")
    assert q.returncode == 0, q.stdout + q.stderr
    assert q.json["ok"] and q.json["applied"] == [] and q.json["missing"] == []
    assert new_ct.conf.read_text() == text


def test_create_refused_for_an_existing_container_and_for_bad_values(tb, new_ct):
    conf130 = tb.hostdir("pve1") / "pve" / "nodes" / "pve1" / "lxc" / "130.conf"
    before = conf130.read_text()
    p = new_ct.deploy("prepare", "pve1/130", "--create", "--template", TEMPLATE, "--gpus", "0,1")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "pve1/130 exists already" in p.stderr and "never replaces one" in p.stderr
    assert conf130.read_text() == before
    # hostile or malformed values: refused before any remote command (nothing in the audit of a session)
    for args, said in ((["--net0", "name=eth0,bridge=vmbr0,ip=dhcp;reboot"], "--net0"),
                       (["--net0", "bridge=vmbr0"], "say the bridge and the address"),
                       (["--template", "local:vztmpl/../../etc/shadow"], "--template"),
                       (["--template", "$(reboot)"], "--template"),
                       (["--hostname", "a b"], "hostname"),
                       (["--storage", "x;y"], "--storage")):
        argv = ["prepare", f"pve1/{V}", "--create", "--gpus", "0-3"] + \
            ([] if "--template" in args else ["--template", TEMPLATE]) + args
        q = new_ct.deploy(*argv)
        assert q.returncode == 2, (args, q.stdout, q.stderr)
        assert said in q.stderr, (args, q.stderr)
    assert not new_ct.conf.exists()
    # create options without --create
    q = new_ct.deploy("prepare", "pve1/130", "--memory", "1024")
    assert q.returncode == 2 and "--memory is an option of --create" in q.stderr
    # a container that does not exist, without --create: told how to make it
    q = new_ct.deploy("prepare", f"pve1/{V}", "--gpus", "0-3")
    assert q.returncode == 2 and f"there is no container {V} on pve1" in q.stderr and "--create" in q.stderr


def test_a_missing_template_is_pcts_message_and_no_container(tb, new_ct):
    p = new_ct.deploy("prepare", f"pve1/{V}", "--create", "--template", "local:vztmpl/nope.tar.zst", "--gpus", "0-3",
                      "-y")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "volume 'local:vztmpl/nope.tar.zst' does not exist" in p.stderr
    assert not new_ct.conf.exists() and V not in tb.created_containers("pve1")


@pytest.fixture
def wheels(testbed):
    from vpd_testbed.fake_vllm import wheels

    return wheels.wheelhouse(str(testbed.root / "fake-vllm-wheels"), pth=testbed.site_pth())


def _tree(base, prefix):
    out = {}
    for dirpath, _, files in os.walk(base):
        for f in files:
            full = os.path.join(dirpath, f)
            out[os.path.join(prefix, os.path.relpath(full, base))] = open(full, "rb").read()
    return out


def test_from_a_bare_host_to_deploy_up(tb, new_ct, tmp_path):
    """docs/gpu-containers.md's walk-through, as written (issue 53 item 7): `deploy testbed template` writes a
    template with a wheelhouse and the models (the offline way); one prepare --create: container, GPUs, driver, the
    playbook's venv and vLLM (install-vllm from that wheelhouse); then deploy up passes the acceptance gate."""
    t = new_ct.deploy("testbed", "template", "pve1", "vpd-ml.tar.gz", "--dir", str(tb.root), timeout=300)
    assert t.returncode == 0, t.stdout + t.stderr
    assert t.stdout.strip() == "local:vztmpl/vpd-ml.tar.gz" and "/root/wheelhouse" in t.stderr, t.stderr
    from playbook_support import copy_playbooks

    d = copy_playbooks(tmp_path / "playbooks")
    src = (d / "qwen36-dflash.yaml").read_text()
    pb = src.replace("name: qwen36-dflash", "name: new-dflash", 1).replace("  vmid: 129\n", f"  vmid: {V}\n", 1)
    pb = re.sub(r"(?m)^  on_low_acceptance: fallback\n  fallback: qwen36-mtp\n", "  on_low_acceptance: fail\n", pb)
    inst = {"no_index": True, "find_links": ["/root/wheelhouse"], "timeout_s": 120, "heartbeat_s": 1}
    pb = pb.replace("\nrequires:\n", "\nrequires:\n  install:\n" +
                    "".join(f"    {k}: {json.dumps(v)}\n" for k, v in inst.items()), 1)
    (d / "new-dflash.yaml").write_text(pb)
    env = {"DEPLOY_PLAYBOOKS": str(d)}
    p = new_ct.deploy("--json", "prepare", f"pve1/{V}", "--create", "--template", "local:vztmpl/vpd-ml.tar.gz",
                      "--driver-run", RUN, "-y", env=env, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    r = p.json
    assert r["ok"] and r["created"], r
    chain = [(c["step"], c["playbook"], c["ok"], c["status"]) for c in r["chain"]]
    assert ("venv", "new-dflash", True, "made") in chain, chain
    assert any(c[0] == "install-vllm" and c[1] == "new-dflash" and c[2] for c in chain), chain
    v = tb.container_exec("pve1", V, ["/root/ml-env/bin/python", "-c", "import vllm; print(vllm.__version__)"])
    assert v.stdout.strip() == "0.34.0", v.stdout + v.stderr
    up = new_ct.deploy("up", "new-dflash", env=env, timeout=400)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "new-dflash" in up.stdout and "acceptance" in (up.stdout + up.stderr).lower(), up.stdout
    new_ct.deploy("down", "new-dflash", env=env, timeout=120)
