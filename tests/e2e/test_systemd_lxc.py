"""vLLM supervised by systemd, with a real systemd: a real LXC container whose init is systemd (Debian's lxc and
a debootstrap root file system built once into the test bed's cache), beside a namespace container without
systemd (the setsid path). One test bed for the module; the tests run in order on it (issue 16)."""

import json
import os
import re
import select
import shlex
import subprocess
import sys
import time

import pytest

from e2e_helpers import REPO
from slack import slack
from vpd_testbed.common import free_net

SD, NS = 131, 132  # systemd (LXC) container on GPUs 0,1; namespace container on GPUs 2,3
KEY = "sk-systemd-test-6f1c0e9a2b"
UNIT = "vllm-sd-dflash.service"


def _free_net():
    """A 127.77.N. (N = 61..120, apart from the session test bed's) whose pve1 port is free."""
    return free_net(61, 121) or "127.77.61."


def _skip_reason():
    if os.geteuid() != 0:
        return "LXC containers need root (lxc-start, mounts)"
    return None  # anything else that stops LXC here is a failure with its reason, not a skip


@pytest.fixture(scope="module")
def sdbed(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from vpd_testbed import Testbed

    root = "/tmp/vpd-tb-sd-%d" % os.getpid()
    bed = Testbed(root=root, hosts=1, gpus=4, net=_free_net(), containers={"pve1": {SD: [0, 1], NS: [2, 3]}},
                  options={"pve1": {SD: {"init": "systemd", "onboot": "1"}}})
    try:
        bed.up()  # the first run on a machine builds the root file system (debootstrap, ~45 s)
        yield bed
    finally:
        bed.down()


@pytest.fixture(scope="module")
def pbdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sd-playbooks")
    src = open(os.path.join(REPO, "playbooks", "qwen36-dflash.yaml")).read()
    os.symlink(os.path.join(REPO, "playbooks", "drafters"), d / "drafters")
    os.symlink(os.path.join(REPO, "playbooks", "targets"), d / "targets")  # sizing.target_config
    for name, vmid, gpus in (("sd-dflash", SD, "[0, 1]"), ("ns-dflash", NS, "[2, 3]")):
        text = (src.replace("name: qwen36-dflash", f"name: {name}").replace("vmid: 129", f"vmid: {vmid}")
                .replace("gpus: [0, 1, 2, 3]", f"gpus: {gpus}").replace("tensor_parallel_size: 4",
                                                                          "tensor_parallel_size: 2")
                .replace("  env: {}", "  env: {}\n  api_key_env: SD_TEST_KEY")
                .replace("stop_grace_s: 30", "stop_grace_s: 10"))
        text = re.sub(r"\n  on_low_acceptance: fallback\n  fallback: \S+", "", text)
        text += "\nsupervise:\n  restart_sec: 0.5\n  start_limit_burst: 3\n  start_limit_interval_s: 60\n"
        (d / f"{name}.yaml").write_text(text)
    return d


@pytest.fixture
def deploy(sdbed, pbdir, tmp_path_factory):
    state = tmp_path_factory.getbasetemp() / "sd-state"

    e = dict(os.environ, DEPLOY_INVENTORY=sdbed.inventory_path, DEPLOY_STATE_DIR=str(state), NO_COLOR="1",
             DEPLOY_PLAYBOOKS=str(pbdir), SD_TEST_KEY=KEY)

    def run(*args, timeout=180):
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=e, text=True,
                           capture_output=True, timeout=timeout)
        p.out = p.stdout + p.stderr
        p.json = json.loads(p.stdout) if "--json" in args and p.stdout.strip().startswith("{") else None
        return p

    run.state_dir = state
    run.env = e
    return run


def sh(bed, vmid, script, timeout=30):
    return bed.container_exec("pve1", vmid, ["sh", "-c", script], timeout=timeout)


def show(bed, prop):
    return sh(bed, SD, f"systemctl show {UNIT} -p {prop} --value").stdout.strip()


def status_row(deploy, playbook="sd-dflash"):
    p = deploy("--json", "status", playbook)
    assert p.json, p.stderr
    return p, p.json["rows"][0]


def wait_for(cond, timeout, what):
    timeout = slack(timeout)  # an upper bound: returns as soon as cond() holds
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def serving(bed):
    """/health 200 inside the container (no deploy command involved)."""
    r = sh(bed, SD, "/root/ml-env/bin/python -c \"import urllib.request as u; "
                    "print(u.urlopen('http://127.0.0.1:8000/health', timeout=2).status)\" 2>/dev/null")
    return r.stdout.strip() == "200"


def test_up_installs_enabled_unit_with_the_planned_argv_and_no_secret_in_sight(sdbed, deploy):
    plan = deploy("--json", "plan", "sd-dflash")
    assert plan.returncode == 0, plan.stderr
    step = next(s for s in plan.json["steps"] if s["step"] == "launch")
    launch = {"args": json.loads(shlex.split(step["command"])[-1])}  # what `pct exec` runs: ... launch 'ARGS'

    p = deploy("up", "sd-dflash")
    assert p.returncode == 0, p.stderr
    assert f"supervised by systemd: {UNIT}" in p.out and "onboot: 1" in p.out
    assert show(sdbed, "ActiveState") == "active" and show(sdbed, "UnitFileState") == "enabled"

    unit = sh(sdbed, SD, f"cat /etc/systemd/system/{UNIT}").stdout
    for line in ("KillMode=control-group", "TimeoutStopSec=10s", "Restart=on-failure", "RestartSec=0.5s",
                 "StartLimitBurst=3", "StartLimitIntervalSec=60s", "WantedBy=multi-user.target",
                 "EnvironmentFile=/var/lib/vllm-pve-deploy/vllm-sd-dflash.env"):
        assert line in unit, (line, unit)
    # exactly the plan's argv and environment
    main = int(show(sdbed, "MainPID"))
    argv = sh(sdbed, SD, f"cat /proc/{main}/cmdline").stdout.split("\0")[:-1]
    assert argv[-len(launch["args"]["argv"]) + 1:] == launch["args"]["argv"][1:]
    env = dict(x.split("=", 1) for x in sh(sdbed, SD, f"cat /proc/{main}/environ").stdout.split("\0") if "=" in x)
    assert {k: env.get(k) for k in launch["args"]["env"]} == launch["args"]["env"]
    assert env["VLLM_API_KEY"] == KEY  # it got the key, from the 0600 environment file
    assert sh(sdbed, SD, "stat -c %a /var/lib/vllm-pve-deploy/vllm-sd-dflash.env").stdout.strip() == "600"

    # the key is in none of: unit, argv, systemctl show, state file, audit log
    state = sh(sdbed, SD, "cat /var/lib/vllm-pve-deploy/state.json").stdout
    assert json.loads(state)["unit"] == UNIT
    shown = sh(sdbed, SD, f"systemctl show {UNIT}").stdout
    audit = (deploy.state_dir / "audit.jsonl").read_text()
    for where, text in (("unit", unit), ("argv", "\0".join(argv)), ("systemctl show", shown),
                        ("state file", state), ("audit log", audit), ("plan", plan.stdout)):
        assert KEY not in text, where

    p, row = status_row(deploy)
    assert p.returncode == 0, p.stdout
    sup = row["supervision"]
    assert sup["supervisor"] == "systemd" and sup["unit"] == UNIT and sup["restarts"] == 0
    assert sup["serving_passed_gate"] is True

    logs = deploy("logs", "sd-dflash", "-n", "200")  # from the unit's journal
    assert logs.returncode == 0 and "Application startup complete" in logs.stdout, logs.stderr
    # -f follows the journal: a probe request the server logs shows up
    f = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "logs", "sd-dflash", "-f", "-n", "1", "--all"],
                         cwd=REPO, env=deploy.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # until it follows: the line must be new
        sh(sdbed, SD, "/root/ml-env/bin/python -c \"import urllib.request as u; "
                      "u.urlopen('http://127.0.0.1:8000/v1/models?follow-probe=1', timeout=5)\" 2>/dev/null")
        seen = ""
        deadline = time.monotonic() + 20
        while "follow-probe" not in seen and time.monotonic() < deadline:
            if select.select([f.stdout], [], [], 0.5)[0]:
                seen += os.read(f.stdout.fileno(), 65536).decode(errors="replace")
        assert "follow-probe" in seen, (seen[-2000:], f.poll(), f.poll() is not None and f.stderr.read())
    finally:
        f.kill()
        f.wait()


def test_killed_server_is_restarted_by_systemd_and_status_says_so(sdbed, deploy):
    old = int(show(sdbed, "MainPID"))
    sh(sdbed, SD, f"kill -9 {old}")
    wait_for(lambda: show(sdbed, "NRestarts") == "1" and serving(sdbed), 60, "systemd to restart vLLM")
    p, row = status_row(deploy)
    assert p.returncode == 0, p.stdout  # it serves again: healthy
    sup = row["supervision"]
    assert sup["restarts"] == 1 and sup["serving_passed_gate"] is False and not sup["start_limit_hit"]
    assert sup["last_exit"]["code"] == "killed" and sup["last_exit"]["status"] == "SIGKILL"
    assert sup["last_exit"]["at"] > time.time() - 120
    assert row["pid"] != old
    text = deploy("status", "sd-dflash").stdout
    assert "1 restart(s) since deploy up; last exit: signal SIGKILL" in text
    assert "is not the one that passed the acceptance gate" in text


def test_crash_loop_stops_at_the_start_limit(sdbed, deploy):
    sdbed.set_fault("pve1", SD, "oom_at_startup", "cuda_oom")
    try:
        sh(sdbed, SD, f"kill -9 {show(sdbed, 'MainPID')}")
        wait_for(lambda: show(sdbed, "ActiveState") == "failed", 60, "the start limit to stop the restarts")
        p, row = status_row(deploy)
        assert p.returncode == 1
        assert row["supervision"]["start_limit_hit"] is True and row["process"] == "start limit hit"
        assert "CUDA out of memory" in (row["last_error"] or ""), row["last_error"]
        text = deploy("status", "sd-dflash").stdout
        assert "systemd stopped restarting it (start limit" in text and "last exit: code 1" in text
        assert "last error:" in text
    finally:
        sdbed.clear_faults()


def test_a_crash_loop_with_exit_0_shows_this_launchs_exit_and_error(sdbed, deploy):
    """Issue 26 item 1: vLLM exits 0 when its engine dies; systemd logs no "Main process exited" for that. Last
    exit and last error must come from this launch (not the CUDA OOM of the crash loop before this `up`)."""
    p = deploy("up", "sd-dflash", "-y")
    assert p.returncode == 0, p.out
    launched = time.time()
    sdbed.set_fault("pve1", SD, "oom_at_startup", "no_kv_cache")
    sdbed.set_fault("pve1", SD, "oom_exit_code", 0)
    try:
        sh(sdbed, SD, f"kill -9 {show(sdbed, 'MainPID')}")
        wait_for(lambda: show(sdbed, "ActiveState") == "failed", 90, "the start limit to stop the exit-0 restarts")
        p, row = status_row(deploy)
        ex = row["supervision"]["last_exit"]
        assert ex and ex["code"] == "exited" and ex["status"] == 0 and ex["at"] >= launched - 2, ex
        err = row["last_error"] or ""
        assert "No available memory for the cache blocks" in err and "CUDA out of memory" not in err, err
        assert "last exit: code 0" in deploy("status", "sd-dflash").stdout
    finally:
        sdbed.clear_faults()


def test_container_reboot_brings_vllm_back_without_deploy(sdbed, deploy):
    p = deploy("up", "sd-dflash", "-y")
    assert p.returncode == 0, p.stderr
    r = sdbed.host_exec("pve1", ["pct", "reboot", str(SD)], timeout=120)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: serving(sdbed), 60, "vLLM to serve again after the container rebooted")
    p, row = status_row(deploy)
    assert p.returncode == 0, p.stdout
    sup = row["supervision"]
    assert sup["container_restarted"] is True and sup["serving_passed_gate"] is False
    assert "the container rebooted since" in deploy("status", "sd-dflash").stdout


def test_restart_clean_gpus_frees_a_holder_outside_the_units_cgroup(sdbed, deploy):
    sdbed.set_fault("pve1", SD, "sigterm_ignoring_holder_mib", 3000)  # in the container, not in the unit
    try:
        p = deploy("restart", "sd-dflash", "--clean-gpus", "-y")
        assert p.returncode == 0, p.out
        assert "fuser -k freed the devices (TERM: PID " in p.out, p.out
        # each holder named with its command line, as the refusal without -y names it (issue 41)
        assert "vpd-testbed-sigterm-holder" in p.out.split("fuser -k freed the devices", 1)[1], p.out
    finally:
        sdbed.clear_faults()
    p, row = status_row(deploy)
    assert p.returncode == 0 and row["supervision"]["serving_passed_gate"] is True, p.stdout


def test_down_stops_and_disables_the_unit_and_frees_the_gpus(sdbed, deploy):
    p = deploy("down", "sd-dflash")
    assert p.returncode == 0, p.stderr
    assert f"unit {UNIT}: inactive, disabled" in p.out
    assert show(sdbed, "ActiveState") == "inactive" and show(sdbed, "UnitFileState") == "disabled"
    left = sh(sdbed, SD, "ps -eo comm= | grep -vE '^(systemd|systemd-journal|systemd-logind|dbus-daemon|ps|sh|grep)$'")
    assert left.stdout.strip() == "", left.stdout
    assert sdbed.gpu_used("pve1")[:2] == [0, 0]
    assert sh(sdbed, SD, "test -e /var/lib/vllm-pve-deploy/vllm-sd-dflash.env").returncode == 1


def test_failed_up_leaves_the_unit_stopped_and_disabled(sdbed, deploy):
    sdbed.set_fault("pve1", SD, "oom_at_startup", "cuda_oom")
    try:
        p = deploy("up", "sd-dflash")
    finally:
        sdbed.clear_faults()
    assert p.returncode == 1
    assert "state left: the failed server" in p.out and f"unit {UNIT} is inactive and disabled" in p.out
    assert show(sdbed, "ActiveState") in ("inactive", "failed") and show(sdbed, "UnitFileState") == "disabled"


def test_setsid_path_without_systemd_says_not_supervised(sdbed, deploy):
    p = deploy("up", "ns-dflash")
    assert p.returncode == 0, p.stderr
    assert "not supervised: a crash leaves it down" in p.out
    p, row = status_row(deploy, "ns-dflash")
    assert row["supervision"]["supervisor"] == "none"
    assert "not supervised: a crash leaves it down" in deploy("status", "ns-dflash").stdout
    assert deploy("logs", "ns-dflash").returncode == 0
    p = deploy("down", "ns-dflash")
    assert p.returncode == 0, p.stderr
    assert sdbed.gpu_used("pve1")[2:] == [0, 0]
