"""The acceptance gate end to end: never `already up` without a pass, `not gated` in status, and the installed
vLLM's own rules checked before launch (speculative-config keys, drafter-config semantics)."""

import hashlib
import json
import os
import signal
import time

from e2e_helpers import audit, up_in_background


def test_a_killed_up_then_up_gates_the_running_server_instead_of_already_up(tb, deploy):
    """deploy killed during wait-ready: vLLM keeps loading, recorded, never gated. status says `not gated`; the next
    up measures and gates it (no relaunch), and only then is it up."""
    tb.set_fault("pve1", 129, "load_s", 4.0)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1")
    proc = up_in_background(tb, env)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)  # no clean-up at all: the lock and the server stay
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 60
    row = None
    while time.monotonic() < deadline:  # until the server has loaded and answers
        row = deploy("--json", "status", "pve1/129").json["rows"][0]
        if row["health"] == 200:
            break
        time.sleep(0.5)
    assert row["process"] == "running" and row["health"] == 200, row
    assert row["gate"]["verdict"] == "not gated" and not row["healthy"]
    assert any(p.startswith("not gated since ") and "deploy up qwen36-mtp measures and gates it" in p
               for p in row["problems"]), row["problems"]
    text = deploy("status", "pve1/129")
    assert text.returncode == 1 and "not gated since" in text.stdout + text.stderr
    pid = row["pid"]
    p = deploy("--json", "up", "qwen36-mtp")
    assert p.returncode == 0, p.stderr
    assert p.json["status"] == "up" and p.json["info"]["gated_running"] and p.json["info"]["gate"]["passed"]
    steps = [s["step"] for s in p.json["steps"]]
    assert "launch" not in steps and "acceptance" in steps and "gate-record" in steps
    cur = next(s for s in p.json["steps"] if s["step"] == "current")
    assert "no gate verdict for this launch" in cur["summary"]
    row = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert row["pid"] == pid and row["healthy"] and row["gate"]["verdict"] == "passed"
    p = deploy("--json", "up", "qwen36-mtp")
    assert p.returncode == 0 and p.json["status"] == "already up"


def test_a_spec_key_removed_in_0_34_is_refused_before_launch(tb, deploy, playbooks):
    playbooks("qwen36-mtp", "  num_speculative_tokens: 2",
              "  num_speculative_tokens: 2\n  extra:\n    disable_padded_drafter_batch: \"true\"")
    p = deploy("up", "qwen36-mtp", env=playbooks.env)
    assert p.returncode == 1, p.stderr
    err = p.stderr
    assert "speculative-config keys" in err and "vLLM 0.34.0's SpeculativeConfig" in err
    assert "disable_padded_drafter_batch" in err and "was removed in vLLM 0.34.0" in err
    assert not [a for a in audit(deploy) if a.get("label") == "agent:launch"]  # refused before launch
    assert tb.container_exec("pve1", 129, ["test", "-e", "/var/lib/vllm-pve-deploy/state.json"]).returncode != 0


def test_a_stray_eagle_aux_hidden_state_layer_ids_fails_verify(tb, deploy, playbooks):
    cfg_path = playbooks.dir / "drafters" / "qwen36-27b-dflash.config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 16, 31, 46, 61]
    raw = json.dumps(cfg, indent=2).encode()
    cfg_path.write_bytes(raw)
    yaml = playbooks.dir / "qwen36-dflash.yaml"
    text = yaml.read_text()
    old = text.split("sha256: ", 1)[1].split()[0]
    yaml.write_text(text.replace(old, hashlib.sha256(raw).hexdigest()))
    p = deploy("--json", "apply-config", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1, p.stderr
    v = deploy("--json", "verify", "qwen36-dflash", env=playbooks.env)
    assert v.returncode == 1
    bad = {c["check"]: c for c in v.json["checks"] if not c["ok"]}
    c = bad["semantics eagle_aux_hidden_state_layer_ids"]
    assert "vLLM 0.34.0 taps the target layers given by eagle_aux_hidden_state_layer_ids" in c["reason"]
