"""deploy prepare's pure planning (orchestrator/hosts/prepare.py): the style chosen, the lines added (never removed),
the host's majors used, a stale rule named, snapshot sections kept, and the driver .run's version checked."""

import pytest

from orchestrator.hosts import prepare as P
from orchestrator.core.errors import UsageError


def node(major, minor):
    return {"kind": "char", "major": major, "minor": minor}


NODES = {"/dev/nvidia0": node(195, 0), "/dev/nvidia1": node(195, 1), "/dev/nvidiactl": node(195, 255),
         "/dev/nvidia-uvm": node(509, 0), "/dev/nvidia-uvm-tools": node(509, 1)}


def facts(config):
    return {"config": config, "nodes": dict(NODES), "proc_devices": {"nvidia-uvm": 509}, "module_version": "550.54.15"}


def test_dev_style_adds_next_free_indices():
    hf = facts(["arch: amd64", "dev0: /dev/nvidia0", "dev1: /dev/nvidiactl", "dev3: /dev/nvidia-uvm"])
    r = P.plan(hf, {"pve": (8, 2)}, host="pve1", vmid=130, gpus=[0, 1])
    assert r["style"] == "dev" and r["blockers"] == []
    assert r["set_argv"] == ["pct", "set", "130", "--dev2", "/dev/nvidia1", "--dev4", "/dev/nvidia-uvm-tools"]


def test_raw_style_uses_the_hosts_major_and_names_a_stale_rule():
    conf = ["arch: amd64", "lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 508:* rwm",
            "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]
    text = "\n".join(conf) + "\n\n[snap]\narch: amd64\n"
    r = P.plan(facts(conf), {"pve": (8, 2), "conf": text}, host="pve1", vmid=130, gpus=[0])
    assert r["style"] == "raw"
    assert r["add_lines"][0] == "lxc.cgroup2.devices.allow: c 509:* rwm"
    assert any("508" in n and "left in place" in n for n in r["notes"])
    head, snap = r["conf_new"].split("[snap]")
    assert head.splitlines()[:4] == conf and "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl" in head
    assert snap == "\narch: amd64\n"


def test_old_proxmox_or_no_pveversion_means_raw():
    assert P.plan(facts(["arch: amd64"]), {"pve": (8, 0)}, host="h", vmid=101, gpus=[0])["style"] == "raw"
    assert P.plan(facts(["arch: amd64"]), {"pve": None}, host="h", vmid=101, gpus=[0])["style"] == "raw"
    assert P.plan(facts(["arch: amd64"]), {"pve": (8, 1)}, host="h", vmid=101, gpus=[0])["style"] == "dev"


def test_a_missing_host_node_blocks():
    hf = facts(["arch: amd64"])
    del hf["nodes"]["/dev/nvidia-uvm"]
    r = P.plan(hf, {"pve": (8, 2)}, host="pve1", vmid=130, gpus=[0])
    assert [b["problem"] for b in r["blockers"]] == ["uvm-missing-on-host"]


def test_gpus_and_driver_run_parsing():
    assert P.parse_gpus("0-3") == [0, 1, 2, 3] and P.parse_gpus("2,0") == [0, 2]
    for bad in ("a", "3-1", "0;1", ""):
        with pytest.raises(UsageError):
            P.parse_gpus(bad)
    assert P.check_driver_run("/root/NVIDIA-Linux-x86_64-550.54.15.run", "550.54.15") is None
    assert "is driver 550.90" in P.check_driver_run("/root/NVIDIA-Linux-x86_64-550.90.run", "550.54.15")
    assert "does not say its version" in P.check_driver_run("/root/driver.run", "550.54.15")
    assert "absolute path" in P.check_driver_run("/root/x.run;reboot", None)
    assert P.parse_smi("0, 550.54.15\n1, 550.54.15\n") == {"gpus": [0, 1], "versions": ["550.54.15"], "error": None}
    assert P.parse_smi("Failed to initialize NVML: Driver/library version mismatch\n")["error"].startswith("Failed")


# ---- --create: every value one argv word, checked before anything runs -------------------------------------
def test_check_create_defaults_and_argv():
    from orchestrator.hosts.prepare import check_create, create_argv

    o = check_create({"template": "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst", "hostname": "vllm-a",
                      "net0": "name=eth0,bridge=vmbr0,ip=10.1.2.31/24,gw=10.1.2.1", "memory": None}, 131)
    assert o["memory"] == 65536 and o["unprivileged"] and o["onboot"]
    argv = create_argv(131, o)
    assert argv[:4] == ["pct", "create", "131", "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"]
    assert argv[argv.index("--net0") + 1] == "name=eth0,bridge=vmbr0,ip=10.1.2.31/24,gw=10.1.2.1"
    assert argv[argv.index("--rootfs") + 1] == "local-lvm:200" and argv[argv.index("--unprivileged") + 1] == "1"


def test_check_create_refuses_what_pct_would_not_take():
    import pytest

    from orchestrator.core.errors import UsageError
    from orchestrator.hosts.prepare import check_create

    good = {"template": "local:vztmpl/t.tar.zst", "hostname": "h", "net0": "bridge=vmbr0,ip=dhcp"}
    check_create(good, 131)
    for bad in ({"template": None}, {"template": "t.tar.zst"}, {"template": "local:vztmpl/a b"},
                {"template": "local:iso/x.iso"}, {"hostname": "-x"}, {"hostname": "a" * 64},
                {"net0": "bridge=vmbr0"}, {"net0": "ip=dhcp"}, {"net0": "bridge=vmbr0,ip=dhcp,evil=1"},
                {"net0": "bridge=vmbr0,ip=$(id)"}, {"storage": "a/b"}):
        with pytest.raises(UsageError):
            check_create({**good, **bad}, 131)


def test_a_host_without_uvm_tools_gets_no_line_for_it():
    """Issue 53 item 2: a devN: line for a node the host lacks stops the container; uvm-tools is not required."""
    hf = facts(["arch: amd64"])
    del hf["nodes"]["/dev/nvidia-uvm-tools"]
    r = P.plan(hf, {"pve": (8, 2)}, host="pve1", vmid=130, gpus=[0])
    assert r["blockers"] == [] and r["add_lines"] == ["dev0: /dev/nvidia0", "dev1: /dev/nvidiactl",
                                                      "dev2: /dev/nvidia-uvm"]


def test_old_proxmox_gets_raw_lines_even_when_the_config_has_dev_lines():
    """Issue 53 item 10: pve 8.0.4 refuses `pct set --devN`: the version decides before the config's style."""
    hf = facts(["arch: amd64", "dev0: /dev/nvidia0", "dev1: /dev/nvidiactl", "dev3: /dev/nvidia-uvm"])
    r = P.plan(hf, {"pve": (8, 0), "conf": "arch: amd64\n"}, host="pve1", vmid=130, gpus=[0, 1])
    assert r["style"] == "raw" and r["set_argv"] is None, r
    assert "older than 8.1" in r["why_style"] and "not this version's" in r["why_style"]
