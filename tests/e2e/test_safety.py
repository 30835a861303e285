"""Issue 12, "Safe as root", against the test bed: fuser only on the playbook's GPUs and only when asked, the API
key for our own server only (and status authenticating), secrets never in argv, and the lock's holder shown and
broken. Each case failed on the code before the fix."""

import json
import os
import socket
import subprocess
import time

from e2e_helpers import audit, cat
import pytest
from slack import slack

HOLD = ("import os, sys, time; fd = os.open('%s', os.O_RDWR); sys.stdout.write('held\\n'); sys.stdout.flush(); "
        "time.sleep(600)")
STATE = "/var/lib/vllm-pve-deploy"


def hold(tb, dev, host="pve1", vmid=129):
    """A process in the container with an open fd on `dev` (no GPU memory: offset 0)."""
    argv = tb.ssh_argv(host, "pct", "exec", str(vmid), "--", "/root/ml-env/bin/python", "-c", '"%s"' % (HOLD % dev))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def holders(tb, dev, host="pve1", vmid=129):
    out = tb.container_exec(host, vmid, ["sh", "-c", "fuser %s 2>/dev/null || true" % dev]).stdout
    return out.split()


def test_clean_gpus_kills_only_holders_of_the_playbooks_own_gpus(tb, deploy, playbooks):
    """Another user's job on GPU 3 and a process holding only /dev/nvidiactl are not ours to kill."""
    playbooks("qwen36-mtp", "gpus: [0, 1, 2, 3]", "gpus: [0, 1]")
    playbooks("qwen36-mtp", "tensor_parallel_size: 4", "tensor_parallel_size: 2")
    other_gpu = hold(tb, "/dev/nvidia3")
    ctl_only = hold(tb, "/dev/nvidiactl")
    stray = hold(tb, "/dev/nvidia0")
    try:
        p = deploy("--json", "down", "qwen36-mtp", "--clean-gpus", "-y", env=playbooks.env)
        assert p.returncode == 0, p.stderr
        fz = {s["step"]: s for s in p.json["steps"]}["stop"]["details"]["report"]["fuser"]
        assert fz["devices"] == ["/dev/nvidia0", "/dev/nvidia1"] and fz["term"]
        assert holders(tb, "/dev/nvidia3") and holders(tb, "/dev/nvidiactl")
        assert not holders(tb, "/dev/nvidia0")
    finally:
        for h in (other_gpu, ctl_only, stray):
            h.kill()
            h.wait(timeout=10)


def test_the_low_acceptance_fallback_never_runs_fuser(tb, deploy):
    ctl_only = hold(tb, "/dev/nvidiactl")
    try:
        p = deploy("--json", "up", "qwen36-dflash", "--skip-config-write")
        assert p.json["status"] == "fell back" and p.json["fallback"]["ok"], p.stderr
        stops = [s for s in p.json["steps"] if s["step"] in ("stop", "stop-low")]  # stop-low: the fallback's
        assert stops and all(not s["details"]["report"].get("fuser") for s in stops)
        assert holders(tb, "/dev/nvidiactl")
    finally:
        ctl_only.kill()
        ctl_only.wait(timeout=10)


def test_a_key_protected_deployment_is_already_up_and_healthy(tb, deploy, playbooks):
    """status and the `current` step authenticate: no restart of a healthy server, no exit 1 from status."""
    playbooks("qwen36-mtp", "  load_timeout_s: 900", "  load_timeout_s: 900\n  api_key_env: VPD_TEST_API_KEY")
    env = dict(playbooks.env, VPD_TEST_API_KEY="sk-test-0123456789")
    p = deploy("--json", "up", "qwen36-mtp", env=env)
    assert p.returncode == 0, p.stderr
    pid = p.json["info"].get("pid") or json.loads(cat(tb, "pve1", 129, STATE + "/state.json"))["pid"]
    p = deploy("--json", "up", "qwen36-mtp", env=env)
    assert p.returncode == 0 and p.json["status"] == "already up", p.stderr
    assert json.loads(cat(tb, "pve1", 129, STATE + "/state.json"))["pid"] == pid
    for target in ("qwen36-mtp", "pve1/129"):  # by playbook, and by the state file's api_key_env
        s = deploy("--json", "status", target, env=env)
        assert s.returncode == 0 and s.json["rows"][0]["healthy"], s.stdout
    s = deploy("--json", "status", "pve1/129", env=playbooks.env)  # the key is not in this shell
    assert s.returncode == 1 and "export VPD_TEST_API_KEY" in " ".join(s.json["rows"][0]["problems"])
    assert not any("sk-test-0123456789" in json.dumps(a) for a in audit(deploy))
    # the key reached vLLM by its environment, not its argv
    st = json.loads(cat(tb, "pve1", 129, STATE + "/state.json"))
    assert "VLLM_API_KEY" in st["env_keys"] and "sk-test-0123456789" not in json.dumps(st)
    ps = tb.container_exec("pve1", 129, ["ps", "-eo", "args"]).stdout
    assert "sk-test-0123456789" not in ps
    # the state files are private, here and on the workstation
    modes = tb.container_exec("pve1", 129, ["stat", "-c", "%n %a", STATE, STATE + "/state.json",
                                            STATE + "/vllm.log"]).stdout.split()
    assert modes == [STATE, "700", STATE + "/state.json", "600", STATE + "/vllm.log", "600"]
    assert os.stat(deploy.state_dir / "audit.jsonl").st_mode & 0o777 == 0o600
    assert os.stat(deploy.state_dir).st_mode & 0o777 == 0o700


def test_secrets_by_reference_reach_vllm_and_nothing_else(tb, deploy, playbooks):
    playbooks("qwen36-mtp", "  load_timeout_s: 900", "  load_timeout_s: 900\n  secret_env:\n    HF_TOKEN: VPD_HF")
    env = dict(playbooks.env, VPD_HF="hf_supersecret_987654")
    plan = deploy("-v", "plan", "qwen36-mtp", env=env)
    assert plan.returncode == 0 and "hf_supersecret_987654" not in plan.stdout + plan.stderr
    assert "secrets (env: HF_TOKEN)" in plan.stdout
    p = deploy("-v", "up", "qwen36-mtp", env=env)
    assert p.returncode == 0, p.stderr
    assert "hf_supersecret_987654" not in p.stdout + p.stderr
    assert not any("hf_supersecret_987654" in json.dumps(a) for a in audit(deploy))
    pid = json.loads(cat(tb, "pve1", 129, STATE + "/state.json"))["pid"]
    environ = tb.container_exec("pve1", 129, ["cat", "/proc/%d/environ" % pid]).stdout
    assert "HF_TOKEN=hf_supersecret_987654" in environ.split("\0")
    # and a secret written into serve.env is refused before anything runs, with its line
    playbooks("qwen36-mtp", "  secret_env:\n    HF_TOKEN: VPD_HF", "  env:\n    HF_TOKEN: hf_inline")
    bad = deploy("up", "qwen36-mtp", env=playbooks.env)
    assert bad.returncode == 2 and "serve.env.HF_TOKEN" in bad.stderr and "qwen36-mtp.yaml:" in bad.stderr


def plant_lock(tb, holder, **kw):
    now = time.time()
    lock = {"token": "their-token", "holder": holder, "since": now, "until": now + 3600, "expires": now + 3600,
            "operation": "up", **kw}
    tb.container_exec("pve1", 129, ["sh", "-c", "mkdir -p -m 700 %s && cat > %s/lock" % (STATE, STATE)],
                      input=json.dumps(lock), check=True)


def test_unlock_shows_the_holder_and_breaks_only_after_confirmation(tb, deploy):
    plant_lock(tb, "bob@lost-laptop pid 4242", workstation="lost-laptop", pid=4242)
    p = deploy("down", "qwen36-mtp")
    assert p.returncode == 1 and "bob@lost-laptop pid 4242" in p.stderr and "deploy unlock pve1/129" in p.stderr
    p = deploy("unlock", "pve1/129", input="")
    assert p.returncode == 1 and "bob@lost-laptop pid 4242" in p.stderr and "not confirmed" in p.stderr
    assert tb.container_exec("pve1", 129, ["test", "-e", STATE + "/lock"]).returncode == 0
    p = deploy("--json", "unlock", "pve1/129", "-y")
    assert p.returncode == 0 and p.json["state"] == "broken" and "token" not in p.json["holder"]
    assert tb.container_exec("pve1", 129, ["test", "-e", STATE + "/lock"]).returncode == 1
    assert not any("their-token" in json.dumps(a) for a in audit(deploy))  # issue 22: on stdin, not in argv
    p = deploy("unlock", "pve1/129")
    assert p.returncode == 0 and "no deploy lock is held" in p.stdout


@pytest.mark.deadline
def test_a_lock_held_by_a_dead_process_on_this_workstation_is_broken_at_once(tb, deploy):
    dead = subprocess.Popen(["true"])
    dead.wait()
    plant_lock(tb, "me pid %d" % dead.pid, workstation=socket.gethostname(), pid=dead.pid)
    t0 = time.monotonic()
    p = deploy("down", "qwen36-mtp")
    assert p.returncode == 0, p.stderr
    assert "dead process on this workstation" in p.stderr and time.monotonic() - t0 < slack(60)
    left = tb.container_exec("pve1", 129, ["sh", "-c", "ls -a %s" % STATE]).stdout.split()
    assert "lock" not in left and any(n.startswith(".lock.stale-") for n in left)


def test_restart_without_a_playbook_does_not_trust_names_from_the_container(tb, deploy):
    assert deploy("up", "qwen36-mtp").returncode == 0
    tb.container_exec("pve1", 129, ["sed", "-i", 's|"playbook": "qwen36-mtp"|"playbook": "../../tmp\\\\u001b[2Jx"|',
                                    STATE + "/state.json"], check=True)
    p = deploy("restart")
    assert p.returncode == 1, p.stderr
    assert "which is not a playbook here for that container; skipped" in p.stderr and "\x1b" not in p.stderr
    assert "no container's state file names a running deployment" in p.stderr
