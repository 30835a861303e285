"""Issue 26, what a new user meets, against the test bed: every message true, bad input refused before anything
runs (exit 2), Ctrl-C is 130 and says what it left, GPUs of another container's deployment named at once."""

import os
import re
import signal
import subprocess
import sys
import time

from e2e_helpers import REPO
import pytest
from slack import slack


@pytest.mark.deadline
def test_bad_input_is_refused_before_anything_runs(tb, deploy):
    t = time.monotonic()
    p = deploy("discover", "pve9")  # item 15: not in the inventory: no DNS lookup, no connection
    assert p.returncode == 2, p.stderr
    assert "'pve9' is not a host of the inventory (hosts: pve1, pve2, pve3, pve4)" in p.stderr
    p = deploy("down", "pve1/129")  # item 16: a container where a playbook is expected
    assert p.returncode == 2, p.stderr
    assert "pve1/129 is a container, not a playbook" in p.stderr and "qwen36-dflash, qwen36-mtp" in p.stderr
    assert "deploy down qwen36-dflash" in p.stderr and "file not found" not in p.stderr
    p = deploy("apply-config", "qwen36-mtp")  # item 8: nothing to apply is not a failure with "fix: none needed"
    assert p.returncode == 2 and "qwen36-mtp has no drafter config to install (method mtp)" in p.stderr, p.stderr
    assert "none needed" not in p.stderr and "FAILED" not in p.stderr
    assert time.monotonic() - t < slack(60)


def test_logs_grep_without_a_match_and_logs_json(tb, deploy):
    assert deploy("up", "qwen36-mtp").returncode == 0
    p = deploy("logs", "qwen36-mtp", "--grep", "no-such-line-xyz", "-n", "1")  # item 14
    assert p.returncode == 1 and "matched --grep 'no-such-line-xyz'" in p.stderr, (p.returncode, p.stderr)
    for argv in (["logs", "qwen36-mtp", "--json"], ["--json", "logs", "qwen36-mtp"]):
        p = deploy(*argv)
        assert p.returncode == 2 and "deploy logs has no --json output" in (p.stdout + p.stderr), p.stderr


def test_stop_counts_agree(tb, deploy):
    """Items 2-3: the SIGTERM line and the summary count the same processes; nothing killed is 'left alone'."""
    assert deploy("up", "qwen36-mtp").returncode == 0
    p = deploy("down", "qwen36-mtp")
    assert p.returncode == 0, p.stderr
    m = re.search(r"SIGTERM sent to process group (\d+): (\d+) of the (\d+) process\(es\)", p.stderr)
    assert m, p.stderr
    assert f"stopped the {m.group(3)} process(es) deploy started in process group {m.group(1)}" in p.stderr


@pytest.mark.deadline
def test_gpus_of_another_containers_deployment_are_named_at_once(tb, deploy, playbooks):
    """Item 19: plan warns, up fails fast naming `deploy down THAT-PLAYBOOK`, status flags both rows."""
    text = (playbooks.dir / "qwen36-mtp.yaml").read_text()
    other = (text.replace("name: qwen36-mtp", "name: mtp-130").replace("vmid: 129", "vmid: 130")
             .replace("gpus: [0, 1, 2, 3]", "gpus: [0, 1]").replace("tensor_parallel_size: 4", "tensor_parallel_size: 2")
             )
    (playbooks.dir / "mtp-130.yaml").write_text(other)
    p = deploy("up", "mtp-130", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    p = deploy("plan", "qwen36-mtp", env=playbooks.env)
    assert "warning: GPU(s) 0, 1 of pve1/129 are also given to pve1/130 (targeted by mtp-130)" in p.stdout, p.stdout
    t = time.monotonic()
    p = deploy("up", "qwen36-mtp", env=playbooks.env)
    took = time.monotonic() - t
    assert p.returncode == 1 and "GPU memory is held OUTSIDE this container" in p.stderr, p.stderr
    assert "targeted by playbook mtp-130" in p.stderr and "fix: deploy down mtp-130 frees them" in p.stderr
    assert "host PID" in p.stderr and "in container 130" in p.stderr
    assert took < slack(45, below=60), took  # not the full gpu.free_timeout_s (60 s)
    p = deploy("down", "mtp-130", env=playbooks.env)
    assert p.returncode == 0, p.stderr


def test_ctrl_c_exits_130_and_says_what_it_left(tb, deploy):
    """Item 17: SIGINT during the wait for readiness: exit 130, the launch named, `state left:` printed."""
    tb.set_fault("pve1", 129, "load_s", 30)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1")
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", "qwen36-mtp"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = ""
    deadline = time.monotonic() + 120
    try:
        while "launch" not in err and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            err += line
            if re.search(r"ok\s+launch", line):
                break
        time.sleep(1)
        p.send_signal(signal.SIGINT)
        out, rest = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    err += rest
    assert p.returncode == 130, err
    assert "interrupted: vLLM was launched" in err and "state left:" in err, err
    assert deploy("down", "qwen36-mtp").returncode == 0


def test_the_free_memory_fault_fix_says_to_clear_it(tb, deploy):
    """Item 7: gpus-free proved the GPUs free, so --clean-gpus is not offered as the fix; clearing the fault is."""
    tb.set_fault("pve1", 129, "oom_at_startup", "free_memory")
    p = deploy("up", "qwen36-mtp")
    assert p.returncode == 1 and "GPU memory is held by someone else" in p.stderr, p.stderr
    assert "so --clean-gpus will not help" in p.stderr and "deploy testbed fault pve1/129 --clear" in p.stderr
