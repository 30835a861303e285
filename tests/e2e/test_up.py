"""`deploy up`: the stale config is replaced, verified, launched and gated; failures are fast and named."""

import json
import signal
import threading
import time

from e2e_helpers import DRAFTER, PINNED_SHA, audit, cat, sha, up_in_background
import pytest
from slack import slack


def test_up_replaces_stale_config_verifies_launches_and_gates(tb, deploy):
    stale = sha(tb, "pve1", 129, DRAFTER)
    p = deploy("--json", "up", "qwen36-dflash")
    assert p.returncode == 0, p.stderr
    out = p.json
    assert out["status"] == "up" and out["ok"]
    steps = {s["step"]: s for s in out["steps"]}
    assert steps["drafter-config"]["details"]["result"]["changed"] is True
    backup = steps["drafter-config"]["details"]["result"]["backup"]
    assert sha(tb, "pve1", 129, backup) == stale  # the replaced file is kept
    assert sha(tb, "pve1", 129, DRAFTER) == PINNED_SHA
    assert steps["verify"]["ok"] and steps["aux-layers"]["ok"] and steps["drift"]["ok"]
    acc = out["info"]["acceptance"]
    # healthy DFlash at k=15, as published: rate 15-20 %, AL ~3.5; the gate passes on AL and the curve
    assert acc["source"] == "metrics" and 0.15 <= acc["draft_acceptance_rate"] <= 0.20
    assert acc["mean_acceptance_length"] > 3
    assert out["info"]["gate"]["passed"] and steps["gate-record"]["ok"]
    gate = json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/gate.json"))
    # the state file in the container records what was launched
    st = json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json"))
    assert st["playbook"] == "qwen36-dflash" and st["drafter_sha256"] == PINNED_SHA
    assert st["argv"][1] == "serve" and "--speculative-config" in st["argv"]
    spec = json.loads(st["argv"][st["argv"].index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "/root/models/Qwen3.6-27B-DFlash", "num_speculative_tokens": 15}
    assert {"NO_COLOR", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES"} <= set(st["env_keys"])
    # the verdict is recorded with the launch it belongs to
    assert gate["launch_id"] == st["launch_id"] and gate["verdict"]["passed"] and gate["playbook"] == "qwen36-dflash"
    # one SSH connection for the whole `up`
    assert sum(1 for a in audit(deploy) if a.get("event") == "connect") == 1

    # a second up is a no-op
    p2 = deploy("--json", "up", "qwen36-dflash")
    assert p2.returncode == 0 and p2.json["status"] == "already up"
    assert "passed the acceptance gate at" in p2.json["steps"][-1]["summary"]
    st2 = json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json"))
    assert st2["pid"] == st["pid"]


def test_forced_stale_config_fails_the_gate_and_falls_back_to_mtp(tb, deploy):
    p = deploy("--json", "up", "qwen36-dflash", "--skip-config-write")
    assert p.returncode == 1, p.stderr
    out = p.json
    assert out["status"] == "fell back"
    steps = {s["step"]: s for s in out["steps"]}
    assert steps["verify"]["ok"] is None  # reported, not blocking in this rehearsal
    acc = steps["acceptance"]["details"]["acceptance"]
    assert acc["draft_acceptance_rate"] < 0.05 and acc["mean_acceptance_length"] < 1.5
    msg = out["error"]["message"]
    assert "the acceptance gate failed" in msg and "position-0 acceptance" in msg and "< 0.5" in msg
    assert "guessed or stale drafter config" in out["error"]["fix"]
    fb = out["fallback"]
    assert fb["ok"] and fb["playbook"] == "qwen36-mtp" and fb["status"] == "up"
    assert fb["info"]["acceptance"]["mean_acceptance_length"] > 1.8 and fb["info"]["gate"]["passed"]
    # the rejection is recorded: status and --json say DFlash was rejected, when, with which figures
    row = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert row["playbook"] == "qwen36-mtp" and row["healthy"] and row["gate"]["verdict"] == "passed"
    rej = row["rejected"]
    assert rej["playbook"] == "qwen36-dflash" and rej["fallback"] == "qwen36-mtp" and rej["at"]
    assert rej["figures"]["mean_acceptance_length"] < 1.5 and "position-0 acceptance" in rej["reason"]
    text = deploy("status", "pve1/129").stdout
    assert "qwen36-dflash was rejected by the acceptance gate at" in text and "AL 1." in text
    # a second up does not silently replace the fallback that now serves: it asks for -y and leaves it running
    again = deploy("up", "qwen36-dflash", "--skip-config-write")
    assert again.returncode == 1, again.stderr
    assert "a different deployment is running; not replacing it without -y" in again.stderr
    assert "fix: deploy up qwen36-dflash -y" in again.stderr
    st = json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json"))
    assert st["playbook"] == "qwen36-mtp" and st["method"] == "mtp"


def test_different_deployment_needs_confirmation(tb, deploy):
    assert deploy("up", "qwen36-mtp").returncode == 0
    p = deploy("up", "qwen36-dflash")
    assert p.returncode == 1
    assert "a different deployment is running; not replacing it without -y" in p.stderr
    assert "running: " in p.stderr and "wanted: " in p.stderr  # the diff is shown
    st = json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json"))
    assert st["playbook"] == "qwen36-mtp"
    p = deploy("up", "qwen36-dflash", "-y")
    assert p.returncode == 0, p.stderr
    assert json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json"))["playbook"] == "qwen36-dflash"


def _assert_failed_fast(p, text, seconds=30):
    assert p.returncode == 1, p.stdout + p.stderr
    assert text in p.stderr, p.stderr


@pytest.mark.deadline
def test_oom_at_startup_fails_fast_with_cause_and_fix(tb, deploy):
    tb.set_fault("pve1", 129, "oom_at_startup", "cuda_oom")
    t0 = time.monotonic()
    p = deploy("up", "qwen36-mtp")
    _assert_failed_fast(p, "vLLM failed to start: CUDA out of memory")
    assert "torch.OutOfMemoryError: CUDA out of memory" in p.stderr
    assert time.monotonic() - t0 < slack(30)
    assert "state left: the failed server" in p.stderr
    assert "fix: lower serve.gpu_memory_utilization or serve.max_model_len in the playbook, or free the GPUs: " \
           "deploy restart qwen36-mtp --clean-gpus" in p.stderr


def test_free_memory_error_points_at_clean_gpus(tb, deploy):
    tb.set_fault("pve1", 129, "oom_at_startup", "free_memory")
    p = deploy("up", "qwen36-mtp")
    _assert_failed_fast(p, "GPU memory is held by someone else")
    # gpus-free proved them free just before: --clean-gpus would not help, so it is not the fix (issue 26 item 7)
    assert "so --clean-gpus will not help" in p.stderr and "deploy testbed fault pve1/129 --clear" in p.stderr


def test_crash_with_exit_code_0_is_a_failure(tb, deploy):
    tb.set_fault("pve1", 129, "crash_after_s", 0.0)
    tb.set_fault("pve1", 129, "load_s", 0.3)
    p = deploy("up", "qwen36-mtp")
    assert p.returncode == 1, p.stderr
    assert "exited during startup with code 0" in p.stderr or "not ready" in p.stderr or \
        "every probe request failed" in p.stderr or "could not measure" in p.stderr, p.stderr


def test_port_in_use_is_caught_before_launch(tb, deploy):
    tb.set_fault("pve1", 129, "port_in_use", 8000)
    p = deploy("--json", "up", "qwen36-mtp")
    assert p.returncode == 1
    assert "port 8000 is already in use in the container" in p.json["error"]["message"]
    # issue 53 item 14: the listener is named (its PID and program), and the fix says which PID to stop
    assert "in the container by PID " in p.json["error"]["message"], p.json["error"]
    assert p.json["error"]["fix"].startswith("stop PID "), p.json["error"]["fix"]
    assert "(pct exec 129 -- kill " in p.json["error"]["fix"] and "set serve.port to a free port" in \
        p.json["error"]["fix"]
    assert "launch" not in [s["step"] for s in p.json["steps"]]


def test_missing_extension_stops_before_launch(tb, deploy):
    tb.set_fault("pve1", 129, "missing_extension", "_C_stable_libtorch.abi3.so")
    p = deploy("up", "qwen36-dflash")
    assert p.returncode == 1
    assert "compiled extension(s) missing: _C_stable_libtorch.abi3.so" in p.stderr
    assert "vLLM 0.34.0" in p.stderr
    assert "fix: the installed vLLM 0.34.0 build is incomplete: reinstall it" in p.stderr, p.stderr
    assert "--force-reinstall --no-deps 'vllm==0.34.0'" in p.stderr and ">= 0.26.0" not in p.stderr
    assert tb.container_exec("pve1", 129, ["test", "-e", "/var/lib/vllm-pve-deploy/state.json"]).returncode == 1


def test_two_concurrent_ups_do_not_both_launch(tb, deploy):
    tb.set_fault("pve1", 129, "load_s", 2.0)
    results = []
    threads = [threading.Thread(target=lambda: results.append(deploy("up", "qwen36-mtp"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 1], [r.stderr for r in results]
    loser = [r for r in results if r.returncode == 1][0]
    assert "another deploy holds the lock" in loser.stderr and "pid" in loser.stderr
    assert "fix: wait for it to finish, or pass --wait-lock SECONDS" in loser.stderr
    launches = [a for a in audit(deploy) if a.get("label") == "agent:launch" and "argv" in a]  # not `starting`
    assert len(launches) == 1


def test_ctrl_c_mid_wait_leaves_a_recorded_consistent_state(tb, deploy):
    import os

    tb.set_fault("pve1", 129, "load_s", 30.0)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir))
    proc = up_in_background(tb, env)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130  # Ctrl-C: the shell's convention (issue 26)
    assert "interrupted: vLLM was launched and is recorded in the container's state file" in err
    assert "state left:" in err
    st = deploy("--json", "status", "pve1/129").json
    row = st["rows"][0]
    assert row["playbook"] == "qwen36-mtp" and row["process"] == "running"
    # the lock was released: down works at once
    assert deploy("down", "qwen36-mtp").returncode == 0


def test_api_key_is_passed_by_environment_and_never_appears(tb, deploy, playbooks):
    secret = "sk-test-0123456789abcdef"
    playbooks("qwen36-mtp", "  load_timeout_s: 900", "  load_timeout_s: 900\n  api_key_env: TEST_VLLM_KEY")
    env = dict(playbooks.env, TEST_VLLM_KEY=secret)
    p = deploy("--json", "up", "qwen36-mtp", env=env)
    assert p.returncode == 0, p.stderr
    assert secret not in p.stdout + p.stderr
    assert secret not in (deploy.state_dir / "audit.jsonl").read_text()
    assert secret not in cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json")
    ps = tb.container_exec("pve1", 129, ["ps", "-eo", "args"]).stdout
    assert "vllm serve" in ps and secret not in ps and "--api-key" not in ps
    # the server really enforces it: without the key /v1/models is refused
    r = tb.container_exec("pve1", 129, ["/root/ml-env/bin/python", "-c",
                                        "import urllib.request as u\ntry:\n u.urlopen('http://127.0.0.1:8000/v1/models')"
                                        "\nexcept Exception as e: print(e)"])
    assert "401" in r.stdout
    plan = deploy("plan", "qwen36-mtp", env=env)
    assert secret not in plan.stdout
    missing = deploy("up", "qwen36-mtp", env=playbooks.env)
    assert missing.returncode == 1 and "TEST_VLLM_KEY, but it is not set in this shell" in missing.stderr


def test_dropped_ssh_during_wait_leaves_a_recorded_state(tb, deploy):
    tb.set_fault("pve1", 129, "load_s", 6.0)
    tb.set_fault("pve1", None, "ssh_drop_after_s", 3.0)
    p = deploy("up", "qwen36-mtp")
    assert p.returncode == 3, p.stderr
    assert "SSH connection lost" in p.stderr
    assert "vLLM was launched and is recorded in the state file" in p.stderr
    tb.set_fault("pve1", None, "ssh_drop_after_s", None)
    row = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert row["playbook"] == "qwen36-mtp" and row["process"] == "running"
    assert deploy("down", "qwen36-mtp", "--wait-lock", "5").returncode == 0
