"""`deploy discover`'s parsers and inventory merge, on strings (no host needed)."""

import pytest
import yaml

from orchestrator.hosts import discover as d
from orchestrator.core.spec import load_inventory

DEV = """arch: amd64
cores: 32
dev0: /dev/nvidia0
dev1: /dev/nvidia1,mode=0666
dev2: /dev/nvidiactl
dev3: /dev/nvidia-uvm
hostname: vllm-qwen
net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:81,ip=dhcp,type=veth
lxc.cgroup2.devices.allow: c 195:* rwm
"""

MOUNT = """hostname: gpu-box
net0: name=eth0,bridge=vmbr0,ip=10.1.2.31/24,gw=10.1.2.1,type=veth
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.cgroup2.devices.allow: c 508:* rwm
lxc.mount.entry: /dev/nvidia2 dev/nvidia2 none bind,optional,create=file
lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file
"""

ALL = """hostname: all-gpus
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
lxc.hook.autodev: /var/lib/lxc/133/nvidia-autodev.sh
"""


def test_dev_entries_name_the_gpus_and_the_allow_line_is_only_permission():
    cfg = d.parse_pct_config(DEV)
    g = d.container_gpus(cfg, host_gpus=[0, 1, 2, 3])
    assert g == {"gpus": [0, 1], "all": False, "source": "devN"}
    assert cfg["hostname"] == "vllm-qwen" and cfg["net"][0]["ip"] is None and cfg["net"][0]["ip_mode"] == "dhcp"


def test_mount_entry_style_and_static_address():
    cfg = d.parse_pct_config(MOUNT)
    assert d.container_gpus(cfg, [0, 1, 2, 3]) == {"gpus": [2], "all": False, "source": "lxc.mount.entry"}
    assert cfg["net"][0]["ip"] == "10.1.2.31" and not cfg["warnings"]


def test_cgroup_star_without_nodes_is_every_gpu_of_the_host():
    cfg = d.parse_pct_config(ALL)
    g = d.container_gpus(cfg, [0, 1, 2, 3])
    assert g["gpus"] == [0, 1, 2, 3] and g["all"] and "c 195:* rwm" in g["source"]
    # host nvidia-smi failed: what the running container sees
    g = d.container_gpus(cfg, None, inside=[0, 1])
    assert g["gpus"] == [0, 1] and g["all"] and "as seen inside" in g["source"]
    assert d.container_gpus(cfg, None, None)["gpus"] == []
    assert d.container_gpus(d.parse_pct_config("lxc.cgroup2.devices.allow: a\n"), [0, 1])["gpus"] == [0, 1]


def test_cgroup_minor_and_control_devices():
    cfg = d.parse_pct_config("lxc.cgroup2.devices.allow: c 195:1 rwm\nlxc.cgroup2.devices.allow: c 195:255 rwm\n"
                             "lxc.cgroup.devices.allow: c 195:254 rwm\n")
    assert d.container_gpus(cfg, [0, 1]) == {"gpus": [1], "all": False, "source": "lxc.cgroup2.devices.allow: c 195:K"}
    none = d.parse_pct_config("hostname: x\nlxc.cgroup2.devices.allow: c 226:* rwm\n")
    assert d.container_gpus(none, [0, 1]) == {"gpus": [], "all": False, "source": None}


def test_mount_entry_without_cgroup_permission_is_warned():
    cfg = d.parse_pct_config("lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n")
    assert d.container_gpus(cfg, [0])["gpus"] == [0]
    assert "no lxc.cgroup2.devices.allow" in cfg["warnings"][0]


def test_snapshot_sections_are_not_the_current_config():
    cfg = d.parse_pct_config(DEV + "\n[snap1]\ndev5: /dev/nvidia3\n")
    assert d.container_gpus(cfg, [0, 1, 2, 3])["gpus"] == [0, 1]


def test_shared_gpus():
    cts = [{"vmid": 129, "gpus": [0, 1, 2, 3]}, {"vmid": 130, "gpus": [0, 1]}, {"vmid": 131, "gpus": []}]
    assert d.shared_gpus(cts) == {0: [129, 130], 1: [129, 130]}


def test_parse_target():
    assert d.parse_target("10.1.2.5") == {"user": None, "address": "10.1.2.5", "port": None}
    assert d.parse_target("admin@pve.example:2222") == {"user": "admin", "address": "pve.example", "port": 2222}
    assert d.parse_target("[fd00::5]:22")["address"] == "fd00::5"
    for bad in ("a b", "x:0", "x:99999", "Bad User@x", ""):
        with pytest.raises(ValueError):
            d.parse_target(bad)


PROBE = """hostname vllm-qwen
addr 127.0.0.1 10.1.2.31 fe80::1
gpu /dev/nvidia0
gpu /dev/nvidia1
vllm_cmd /root/ml-env/bin/vllm
py /root/ml-env/bin/python {"prefix": "/root/ml-env", "vllm": "0.34.0", "vllm_path": "/x/vllm", "transformers": "4.57.1", "vllm_bin": "/root/ml-env/bin/vllm"}
py /root/venv2/bin/python {"prefix": "/root/venv2", "vllm": "0.21.0", "vllm_path": "/y/vllm", "transformers": null, "vllm_bin": null}
py /usr/bin/python3 {"prefix": "/usr", "vllm": null, "vllm_path": null, "transformers": null}
py /root/broken/bin/python {"error": "did not run"}
"""


def test_probe_and_runtimes():
    p = d.parse_probe(PROBE)
    assert p["addresses"] == ["10.1.2.31"] and p["gpus"] == [0, 1] and p["vllm_cmd"] == "/root/ml-env/bin/vllm"
    rts = d.runtimes_of(p)
    assert [r["python"] for r in rts] == ["/root/ml-env/bin/python", "/root/venv2/bin/python"]
    assert rts[0]["vllm_version"] == "0.34.0" and rts[0]["transformers_version"] == "4.57.1"
    assert rts[1]["vllm"] == "/root/venv2/bin/vllm"
    assert d.runtimes_of(d.parse_probe("hostname x\naddr \n")) == []


def _found():
    return {"host": "pve1", "host_gpus": [0, 1], "shared_gpus": {"0": {"vmids": [129, 130], "running": [129]}},
            "warnings": [], "containers": [
                {"vmid": 129, "name": "vllm-qwen", "status": "running", "lock": None, "gpus": [0, 1],
                 "gpus_all": False, "gpu_source": "devN", "address": "10.1.2.31", "address_source": "net0 ip=",
                 "runtime": {"python": "/root/ml-env/bin/python", "vllm": "/root/ml-env/bin/vllm",
                             "state_dir": "/var/lib/vllm-pve-deploy"},
                 "runtimes": [{"python": "/root/ml-env/bin/python", "vllm_version": "0.34.0",
                               "transformers_version": "4.57.1"}], "problems": [], "shared_gpus": {"0": [130]}},
                {"vmid": 130, "name": "Stopped_One", "status": "stopped", "lock": None, "gpus": [0],
                 "gpus_all": False, "gpu_source": "devN", "address": None, "runtime": None, "runtimes": [],
                 "problems": [], "shared_gpus": {"0": [129]}}]}


HOST = {"name": "pve1", "address": "127.0.0.1", "port": 2222, "user": "root", "known_hosts": "/tmp/kh",
        "accept_new_host_keys": False}


def test_render_is_a_valid_inventory(tmp_path):
    text = d.render_inventory(HOST, _found())
    p = tmp_path / "hosts.yaml"
    p.write_text(text)
    inv = load_inventory(str(p))
    c129, c130 = inv.hosts["pve1"].containers
    assert c129.runtime.python == "/root/ml-env/bin/python" and c129.address == "10.1.2.31"
    assert c130.runtime is None and c130.name == "stopped-one"
    assert "SHARED" in text and "stopped" in text and "vLLM 0.34.0, transformers 4.57.1" in text


def test_merge_keeps_user_keys_comments_and_other_hosts(tmp_path):
    old = """# my comment, kept
hosts:
  - name: other
    address: 127.0.0.9
  # a comment between hosts
  - name: pve1
    address: 127.0.0.1
    port: 2222
    connect_timeout_s: 7
    containers:
      - vmid: 130
        gpus: [3]
        runtime: {python: /opt/mine/bin/python}
      - vmid: 555
        name: gone
# the end
"""
    new = d.merge_text(old, "pve1", _found(), HOST)
    p = tmp_path / "hosts.yaml"
    p.write_text(new)
    inv = load_inventory(str(p))
    h = inv.hosts["pve1"]
    assert h.connect_timeout_s == 7 and h.port == 2222 and "other" in inv.hosts
    assert [c.vmid for c in h.containers] == [129, 130, 555]
    assert h.container(130).gpus == (0,)  # a fact: replaced
    assert h.container(130).runtime.python == "/opt/mine/bin/python"  # a choice: kept
    assert h.container(555).name == "gone"
    for kept in ("# my comment, kept", "# a comment between hosts", "# the end", "  - name: other"):
        assert kept in new
    # merging again changes nothing
    assert d.merge_text(new, "pve1", _found(), HOST) == new


def test_merge_of_a_host_followed_by_another(tmp_path):
    """Issue 53 (found by the --help examples test): pve1 right before pve2, as `deploy testbed up` writes the
    inventory: the next item's `- name: pve2` line stayed in pve1's range and its keys became pve1's (duplicate
    key, the merge refused)."""
    old = "hosts:\n  - name: pve1\n    address: 127.0.0.1\n    containers:\n      - vmid: 129\n        gpus: [0]\n" \
          "  - name: pve2\n    address: 127.0.0.2\n    containers: []\n"
    new = d.merge_text(old, "pve1", _found(), HOST)
    p = tmp_path / "hosts.yaml"
    p.write_text(new)
    inv = load_inventory(str(p))
    assert list(inv.hosts) == ["pve1", "pve2"] and inv.hosts["pve2"].address == "127.0.0.2"
    assert new.endswith("  - name: pve2\n    address: 127.0.0.2\n    containers: []\n")
    assert d.merge_text(new, "pve1", _found(), HOST) == new


def test_merge_adds_a_new_host(tmp_path):
    for old in ("hosts: []\n", "# nothing yet\nhosts:\n  - name: a\n    address: 127.0.0.2\n", ""):
        new = d.merge_text(old, "pve1", _found(), HOST)
        p = tmp_path / "hosts.yaml"
        p.write_text(new)
        inv = load_inventory(str(p))
        assert "pve1" in inv.hosts and len(inv.hosts["pve1"].containers) == 2
        if "name: a" in old:
            assert "a" in inv.hosts


def test_write_inventory_keeps_a_backup_and_refuses_invalid(tmp_path):
    p = tmp_path / "hosts.yaml"
    p.write_text("hosts: []\n")
    backup = d.write_inventory(str(p), d.render_inventory(HOST, _found()))
    assert backup and open(backup).read() == "hosts: []\n"
    assert "pve1" in load_inventory(str(p)).hosts
    from orchestrator.core.errors import DeployError
    with pytest.raises(DeployError, match="would not be valid"):
        d.write_inventory(str(p), "hosts:\n  - name: BAD NAME\n")
    assert "pve1" in yaml.safe_load(p.read_text())["hosts"][0]["name"]


def test_testbed_ct_option_parsing():
    import click
    from vpd_testbed.cli import _parse_ct_options
    assert _parse_ct_options(["pve1/131:passthrough=mount,ip=10.99.0.31/24", "pve1/133:python=none"]) == \
        {"pve1": {131: {"passthrough": "mount", "ip": "10.99.0.31/24"}, 133: {"python": "none"}}}
    for bad in ("pve1:python=none", "pve1/131", "pve1/131:python"):
        with pytest.raises(click.BadParameter):
            _parse_ct_options([bad])


def test_the_probe_judges_ownership_with_the_agents_own_why_untrusted():
    """One definition (issue 39): discover's probe carries the agent's why_untrusted source, so a sticky
    directory (/tmp-like) above a runtime is judged the same way on both paths."""
    import inspect

    from orchestrator.agent.container import files

    assert inspect.getsource(files.why_untrusted) in d.PROBE_PY
    assert d.PROBE_PY.count("def why_untrusted(") == 1
