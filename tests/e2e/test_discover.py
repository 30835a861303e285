"""`deploy discover` on a test bed of its own: every passthrough style, a shared GPU, a stopped container,
one with Python but no vLLM and one without Python at all (Testbed(options=...), docs/testbed.md)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from e2e_helpers import REPO


def testbed_skip_reason():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_root_conftest", os.path.join(REPO, "tests", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.testbed_skip_reason()

CONTAINERS = {"pve1": {129: [0, 1, 2, 3], 130: [0, 1], 131: [2], 133: [0, 1, 2, 3], 134: [3], 135: [3]}}
OPTIONS = {"pve1": {131: {"passthrough": "mount", "ip": "10.99.0.31/24"},
                    133: {"passthrough": "cgroup-all", "python": "none"},
                    134: {"python": "system"}}}


def _net():
    for n in range(1, 60):
        net = "127.78.%d." % ((os.getpid() + n) % 250 + 1)
        with socket.socket() as s:
            try:
                s.bind((net + "1", 2222))
                return net
            except OSError:
                continue
    pytest.skip("no free 127.78.N.1:2222")


@pytest.fixture(scope="module")
def dbed():
    reason = testbed_skip_reason()
    if reason:
        pytest.skip(reason)
    from vpd_testbed import Testbed

    root = "/tmp/vpd-tb-disc-%d" % os.getpid()  # the shared fixture's stale-bed cleaner knows this pattern
    bed = Testbed(root=root, hosts=1, gpus=4, containers=CONTAINERS, options=OPTIONS, net=_net())
    bed.up()
    try:
        bed.stop_container("pve1", 135)
        yield bed
    finally:
        bed.down()


def run(bed, *args, inventory=None, input=None, cwd=REPO):
    env = dict(os.environ, DEPLOY_INVENTORY=inventory or bed.inventory_path, NO_COLOR="1",
               DEPLOY_STATE_DIR=str(bed.root / "deploy-state"))
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120, input=input)


def test_discover_reads_every_container_as_it_is(dbed):
    p = run(dbed, "discover", "pve1", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    cts = {c["vmid"]: c for c in out["containers"]}
    assert sorted(cts) == [129, 130, 131, 133, 134, 135]
    assert out["host_gpus"] == [0, 1, 2, 3]
    # devN, lxc.mount.entry, cgroup c 195:* (every GPU), one GPU
    assert cts[129]["gpus"] == [0, 1, 2, 3] and cts[129]["gpu_source"] == "devN"
    assert cts[131]["gpus"] == [2] and cts[131]["gpu_source"] == "lxc.mount.entry"
    assert cts[133]["gpus"] == [0, 1, 2, 3] and cts[133]["gpus_all"]
    assert cts[134]["gpus"] == [3]
    # shared GPUs flagged, with the running state of the sharers
    assert out["shared_gpus"]["3"]["vmids"] == [129, 133, 134, 135]
    assert 135 not in out["shared_gpus"]["3"]["running"]
    assert cts[130]["shared_gpus"] == {"0": [129, 133], "1": [129, 133]}
    # runtimes: the venv with versions; none where there is only a system Python, or no Python at all
    rt = cts[129]["runtimes"][0]
    assert cts[129]["runtime"] == {"python": "/root/ml-env/bin/python", "vllm": "/root/ml-env/bin/vllm",
                                   "state_dir": "/var/lib/vllm-pve-deploy"}
    assert rt["vllm_version"] == "0.34.0" and rt["transformers_version"]
    assert cts[134]["runtime"] is None and [x["path"] for x in cts[134]["pythons"]] == ["/usr/bin/python3"]
    assert cts[133]["runtime"] is None and cts[133]["pythons"] == []
    # addresses: net0 ip= (static); the stopped one is listed, not probed
    assert cts[131]["address"] == "10.99.0.31" and cts[131]["address_source"] == "net0 ip="
    assert cts[135]["status"] == "stopped" and cts[135]["gpus"] == [3] and cts[135]["runtime"] is None


def test_discover_yaml_is_an_inventory_and_nothing_is_written_on_the_host(dbed, tmp_path):
    before = dbed.host_exec("pve1", ["sh", "-c", "find /root /etc/pve -newer %s/hosts.yaml 2>/dev/null | wc -l"
                                     % dbed.root]).stdout
    log = dbed.root / "pve1" / "sshd.log"
    conns = log.read_text().count("Accepted publickey")
    p = run(dbed, "discover", "pve1")
    assert p.returncode == 0, p.stderr
    assert log.read_text().count("Accepted publickey") == conns + 1  # one SSH connection for all of it
    text = p.stdout
    assert "every GPU of the host (lxc.cgroup2.devices.allow: c 195:* rwm)" in text
    assert "no vLLM runtime: no Python found" in text and "none imports vllm (/usr/bin/python3)" in text
    assert "GPU 3 is SHARED by containers 129, 133, 134, 135 (3 running)" in text
    assert "stopped, address and runtime not read" in text
    f = tmp_path / "hosts.yaml"
    f.write_text(text)
    from orchestrator.core.spec import load_inventory
    inv = load_inventory(str(f))
    assert [c.vmid for c in inv.hosts["pve1"].containers] == [129, 130, 131, 133, 134, 135]
    after = dbed.host_exec("pve1", ["sh", "-c", "find /root /etc/pve -newer %s/hosts.yaml 2>/dev/null | wc -l"
                                    % dbed.root]).stdout
    assert before == after


def test_discover_write_merges_shows_diff_asks_and_keeps_a_backup(dbed, tmp_path):
    inv = tmp_path / "hosts.yaml"
    orig = "# mine\n" + open(dbed.inventory_path).read().replace("    user: root\n",
                                                                    "    user: root\n    connect_timeout_s: 7\n")
    inv.write_text(orig)
    p = run(dbed, "discover", "pve1", "--write", inventory=str(inv), input="n\n")
    assert p.returncode == 1 and "+        runtime:" in p.stdout and "nothing written" in p.stderr
    assert inv.read_text() == orig
    p = run(dbed, "discover", "pve1", "--write", inventory=str(inv), input="y\n")
    assert p.returncode == 0, p.stderr
    backups = [x for x in os.listdir(tmp_path) if x.startswith("hosts.yaml.bak-")]
    assert len(backups) == 1 and (tmp_path / backups[0]).read_text() == orig
    data = yaml.safe_load(inv.read_text())
    assert inv.read_text().startswith("# mine\n") and data["hosts"][0]["connect_timeout_s"] == 7
    assert data["hosts"][0]["containers"][0]["runtime"]["python"] == "/root/ml-env/bin/python"
    p = run(dbed, "discover", "pve1", "--write", "-y", inventory=str(inv))
    assert p.returncode == 0 and "nothing to write" in p.stdout


def test_discover_by_address_follows_the_host_key_policy(dbed, tmp_path):
    addr = "root@%s:2222" % dbed.address("pve1")
    empty_kh = tmp_path / "known_hosts"
    empty_kh.write_text("")
    common = ["--identity-file", dbed.identity_file, "--known-hosts", str(empty_kh)]
    p = run(dbed, "discover", addr, *common, inventory=str(tmp_path / "none.yaml"))
    assert p.returncode == 3 and "unknown host key" in p.stderr, p.stderr
    # issue 53 item 12: an address outside the inventory is told this command's option, not an inventory key
    err = " ".join(p.stderr.split())
    assert "--accept-new-host-key" in err and "accept_new_host_keys" not in err, p.stderr
    assert empty_kh.read_text() == ""
    p = run(dbed, "discover", addr, "--name", "newpve", "--accept-new-host-key", *common,
            inventory=str(tmp_path / "none.yaml"))
    assert p.returncode == 0, p.stderr
    assert "name: newpve" in p.stdout and "[%s]:2222" % dbed.address("pve1") in empty_kh.read_text()
    p = run(dbed, "discover", "nosuchhost!", inventory=str(tmp_path / "none.yaml"))
    assert p.returncode == 2 and "not [user@]address[:port]" in p.stderr


# ---------------------------------------------------------------- the inventory runtime, status and URLs


def _playbooks(tmp_path, vmid, gpus, runtime=False):
    """The shipped MTP playbook aimed at another container of this test bed (copy in tmp_path)."""
    import shutil
    d = tmp_path / "playbooks"
    shutil.copytree(os.path.join(REPO, "playbooks"), d)
    text = (d / "qwen36-mtp.yaml").read_text()
    text = text.replace("  vmid: 129\n  gpus: [0, 1, 2, 3]", "  vmid: %d\n  gpus: %s" % (vmid, gpus))
    text = text.replace("tensor_parallel_size: 4", "tensor_parallel_size: %d" % len(gpus))
    if runtime:
        text += "\nruntime:\n  python: /root/ml-env/bin/python\n"
    (d / "qwen36-mtp.yaml").write_text(text)
    (d / "qwen36-dflash.yaml").unlink()  # it targets pve1/129, which these tests leave alone
    return {"DEPLOY_PLAYBOOKS": str(d)}


def run_env(bed, *args, env, inventory=None):
    e = dict(os.environ, DEPLOY_INVENTORY=inventory or bed.inventory_path, NO_COLOR="1",
             DEPLOY_STATE_DIR=str(bed.root / "deploy-state"), **env)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=e, text=True,
                          capture_output=True, timeout=180)


def test_status_without_a_runtime_is_healthy_not_an_error(dbed, tmp_path):
    env = _playbooks(tmp_path, 130, [0, 1])
    p = run_env(dbed, "status", "pve1/133", "pve1/134", "--json", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(p.stdout)["rows"]
    assert [(r["vmid"], r["process"], r["container"], r["healthy"], r["problems"]) for r in rows] == \
        [(133, "no vLLM runtime", "running", True, []), (134, "no vLLM runtime", "running", True, [])]
    p = run_env(dbed, "status", "pve1/133", env=env)
    assert "UNHEALTHY" not in p.stdout and "ml-env" not in p.stdout
    assert "no vLLM runtime (nothing of vLLM expected there; healthy): pve1/133" in p.stdout
    p = run_env(dbed, "logs", "pve1/134", env=env)
    assert p.returncode == 1 and "no vLLM runtime in the inventory" in p.stderr


def test_a_playbook_targeting_a_container_without_python_is_no_runtime_too(dbed, tmp_path):
    env = _playbooks(tmp_path, 133, [0])  # the playbook has no runtime key: its defaults are implicit
    p = run_env(dbed, "status", "pve1/133", "--json", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    row = json.loads(p.stdout)["rows"][0]
    assert row["process"] == "no vLLM runtime" and row["healthy"]


def test_up_and_status_print_the_real_address_with_a_tunnel(dbed, tmp_path):
    env = _playbooks(tmp_path, 131, [2])
    try:
        p = run_env(dbed, "up", "qwen36-mtp", env=env)
        assert p.returncode == 0, p.stderr
        host = "%s" % dbed.address("pve1")
        tunnel = "ssh -N -L 8000:10.99.0.31:8000 -p 2222 -i %s root@%s" % (dbed.identity_file, host)
        assert "is up on pve1/131: http://10.99.0.31:8000/v1 (not routable from here: %s, then " \
               "http://127.0.0.1:8000/v1)" % tunnel in p.stdout, p.stdout
        assert "<pve1 container" not in p.stdout
        p = run_env(dbed, "status", "pve1/131", "--json", env=env)
        row = json.loads(p.stdout)["rows"][0]
        assert row["url"] == "http://10.99.0.31:8000/v1" and row["tunnel"] == tunnel
        p = run_env(dbed, "status", "pve1/131", env=env)
        assert "Endpoints:\n  pve1/131: http://10.99.0.31:8000/v1 (not routable" in p.stdout
        # a container whose address the inventory does not have: no made-up URL
        env2 = _playbooks(tmp_path / "b", 130, [0, 1])
        inv = tmp_path / "no-address.yaml"
        inv.write_text(open(dbed.inventory_path).read().replace(
            "        address: %s\n" % dbed.container_address("pve1", 130), ""))
        p = run_env(dbed, "--json", "up", "qwen36-mtp", env=env2, inventory=str(inv))
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout)["info"]
        assert info["url"] is None and "deploy discover pve1 --write" in info["endpoint"]["note"]
    finally:
        run_env(dbed, "down", "qwen36-mtp", env=env)
        run_env(dbed, "down", "qwen36-mtp", env=_playbooks(tmp_path / "c", 130, [0, 1]))


def test_a_playbook_runtime_overrides_the_inventory(dbed, tmp_path):
    from orchestrator.core.spec import load_inventory, load_playbook
    env = _playbooks(tmp_path, 131, [2])
    inv = tmp_path / "hosts.yaml"
    inv.write_text(open(dbed.inventory_path).read().replace(
        "runtime: {python: /root/ml-env/bin/python, vllm: /root/ml-env/bin/vllm",
        "runtime: {python: /opt/other/bin/python, vllm: /opt/other/bin/vllm"))
    old = os.environ.get("DEPLOY_PLAYBOOKS")
    os.environ["DEPLOY_PLAYBOOKS"] = env["DEPLOY_PLAYBOOKS"]
    try:
        pb = load_playbook("qwen36-mtp", load_inventory(str(inv)))
        assert pb.conf.runtime.python == "/opt/other/bin/python" and pb.runtime_source == "inventory"
        os.environ["DEPLOY_PLAYBOOKS"] = _playbooks(tmp_path / "r", 131, [2], runtime=True)["DEPLOY_PLAYBOOKS"]
        pb = load_playbook("qwen36-mtp", load_inventory(str(inv)))
        assert pb.conf.runtime.python == "/root/ml-env/bin/python" and pb.runtime_source == "playbook"
    finally:
        if old is None:
            os.environ.pop("DEPLOY_PLAYBOOKS", None)
        else:
            os.environ["DEPLOY_PLAYBOOKS"] = old
