"""vLLM Router under systemd (issue 29): the router in a real LXC container with systemd as init, in front of a
replica in a namespace container of the same host (over the test bed's LAN). The unit vllm-router-PLAYBOOK.service
is written, started, restarted by systemd after a crash, and removed by down."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from e2e_helpers import REPO
from playbook_support import copy_playbooks, edit_file, playbook_variant
from vpd_testbed.common import free_net

SD, NS = 131, 132  # the router's container (LXC, systemd), the replica's (namespace)
UNIT = "vllm-router-rt-sd.service"


@pytest.fixture(scope="module")
def bed():
    if os.geteuid() != 0:
        pytest.skip("LXC containers need root")
    from vpd_testbed import Testbed, router_wheels

    try:
        wheels = router_wheels.wheelhouse()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no vllm-router wheels ({e}); scripts/setup.sh downloads them")
    net = free_net(61, 121) or "127.77.61."
    b = Testbed(root="/tmp/vpd-tb-rsd-%d" % os.getpid(), hosts=1, gpus=4, net=net,
                containers={"pve1": {SD: [0, 1], NS: [2, 3]}}, options={"pve1": {SD: {"init": "systemd"}}})
    try:
        b.up()
        shutil.copytree(wheels, b.ctdir("pve1", SD) / "root" / "router-wheels")
        yield b
    finally:
        b.down()


def test_router_as_a_systemd_unit(bed, tmp_path):
    pbdir = copy_playbooks(tmp_path / "pb")
    path = playbook_variant(pbdir, "rt-sd", f"targets:\n  - {{host: pve1, vmid: {NS}, gpus: [2, 3]}}\n",
                            append=f"router:\n  host: pve1\n  vmid: {SD}\n  python: /root/ml-env/bin/python\n"
                                   "  install: {find_links: [/root/router-wheels], no_index: true}\n"
                                   "supervise:\n  restart_sec: 0.5\n  start_limit_burst: 3\n"
                                   "  start_limit_interval_s: 60\n")
    edit_file(path, "tensor_parallel_size: 4", "tensor_parallel_size: 2")
    env = dict(os.environ, DEPLOY_INVENTORY=bed.inventory_path, DEPLOY_STATE_DIR=str(tmp_path / "state"),
               NO_COLOR="1", DEPLOY_PLAYBOOKS=str(pbdir))

    def deploy(*args, timeout=400):
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=env, text=True,
                           capture_output=True, timeout=timeout)
        p.json = json.loads(p.stdout) if "--json" in args and p.stdout.strip().startswith("{") else None
        return p

    def sh(script):
        return bed.container_exec("pve1", SD, ["sh", "-c", script], timeout=30).stdout.strip()

    p = deploy("--json", "up", "rt-sd")
    assert p.returncode == 0, p.stdout + p.stderr
    r = p.json["router"]
    assert r["supervisor"] == "systemd" and r["unit"] == UNIT and r["gate"]["succeeded"] == 2
    assert sh(f"systemctl is-active {UNIT}") == "active"
    assert sh(f"systemctl is-enabled {UNIT}") == "enabled"
    unit = sh(f"cat /etc/systemd/system/{UNIT}")
    assert "Restart=on-failure" in unit and "StartLimitBurst=3" in unit and "KillMode=control-group" in unit
    assert "EnvironmentFile=/var/lib/vllm-pve-deploy/router-rt-sd/router.env" in unit
    assert sh("stat -c %a /var/lib/vllm-pve-deploy/router-rt-sd/router.env") == "600"

    # a crash: systemd starts it again, and the router serves again with its replica
    pid = sh(f"systemctl show {UNIT} -p MainPID --value")
    sh(f"kill -9 {pid}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = sh(f"systemctl show {UNIT} -p MainPID --value")
        if new not in ("0", pid, ""):
            break
        time.sleep(0.3)
    assert new not in ("0", pid, ""), "systemd did not restart the router"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = deploy("--json", "status", "rt-sd")
        rv = s.json["routers"][0]
        if rv.get("workers") and rv["workers"][0]["healthy"]:
            break
        time.sleep(0.5)
    assert rv["running"] and rv["supervisor"] == "systemd" and rv["workers"][0]["healthy"], rv
    assert sh(f"systemctl show {UNIT} -p NRestarts --value") == "1"

    d = deploy("--json", "down", "rt-sd")
    assert d.returncode == 0 and d.json["router"]["stopped"], d.stdout + d.stderr
    assert sh(f"test -e /etc/systemd/system/{UNIT} && echo present || echo gone") == "gone"
    assert sh(f"systemctl is-active {UNIT}") in ("inactive", "unknown")
