"""Replicas (`targets:`): `deploy up` of three targets on three hosts in parallel, `restart --rolling`, `status`
totals and `down HOST/VMID`, against the test bed (real sshd, pct, fake vLLM)."""

import json

from e2e_helpers import cat

STATE = "/var/lib/vllm-pve-deploy/state.json"
TARGETS = ["pve1/129", "pve2/129", "pve3/129"]


def _fleet(tb, playbooks):
    """qwen36-replicas: qwen36-mtp on pve1/129, pve2/129 and pve3/129, probed with one prompt once (fast)."""
    text = (playbooks.dir / "qwen36-mtp.yaml").read_text()
    text = text.replace("name: qwen36-mtp", "name: qwen36-replicas").replace(
        "target:\n  host: pve1\n  vmid: 129\n  gpus: [0, 1, 2, 3]",
        "targets:\n" + "".join(f"  - {{host: {t.split('/')[0]}, vmid: 129, gpus: [0, 1, 2, 3]}}\n" for t in TARGETS))
    text = text.replace("  probe:\n", '  min_drafts: 20\n  probe:\n    prompts: ["Explain in three sentences why the sky is '
                                      'blue."]\n', 1)
    (playbooks.dir / "qwen36-replicas.yaml").write_text(text)
    for t in TARGETS:
        tb.set_fault(t.split("/")[0], 129, "load_s", 0.3)
    return playbooks.env


def _state(tb, where):
    host, vmid = where.split("/")
    text = cat(tb, host, int(vmid), STATE)
    return json.loads(text) if text else None


def _conns(tb):
    return {h: (tb.root / h / "sshd.log").read_text().count("Accepted publickey") for h in ("pve1", "pve2", "pve3")}


def test_up_three_targets_one_failing_preflight_then_status_totals(tb, deploy, playbooks):
    env = _fleet(tb, playbooks)
    tb.set_fault("pve2", 129, "port_in_use", 8000)  # pve2/129 fails its port-free preflight
    before = _conns(tb)
    p = deploy("up", "qwen36-replicas", env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert {h: n - before[h] for h, n in _conns(tb).items()} == {"pve1": 1, "pve2": 1, "pve3": 1}
    lines = p.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines[:3]] == [["pve1/129", "up"], ["pve2/129", "FAILED"], ["pve3/129", "up"]]
    assert "port-free: port 8000 is already in use" in lines[1]
    assert lines[3].startswith("qwen36-replicas: 2 of 3 target(s) up; FAILED: pve2/129")
    assert "FAILED: pve2/129: port-free:" in p.stderr and "state left: nothing was changed on the host" in p.stderr
    # progress: whole lines, each prefixed with its target
    progress = [ln for ln in p.stderr.splitlines() if ln[:8].strip().endswith("s") and "[" in ln[:12]]
    assert {ln.split("[", 1)[1].split("]", 1)[0] for ln in progress} == set(TARGETS)
    assert all(ln.count("[pve") == 1 for ln in progress)
    assert _state(tb, "pve1/129")["playbook"] == _state(tb, "pve3/129")["playbook"] == "qwen36-replicas"
    assert _state(tb, "pve2/129") is None

    s = deploy("--json", "status", "qwen36-replicas", env=env)
    t = s.json["totals"][0]
    assert (t["serving"], t["total"], t["not_serving"]) == (2, 3, ["pve2/129"])
    assert 0.3 < t["mean_draft_acceptance"] < 1 and t["acceptance_over"] == 2
    assert [f"{r['host']}/{r['vmid']}" for r in s.json["rows"]] == TARGETS

    tb.set_fault("pve2", 129, "port_in_use", None)
    p = deploy("--json", "up", "qwen36-replicas", "--parallel", "2", env=env)
    assert p.returncode == 0, p.stderr
    assert [(r["where"], r["status"]) for r in p.json["targets"]] == [
        ("pve1/129", "already up"), ("pve2/129", "up"), ("pve3/129", "already up")]
    assert p.json["ok"] and p.json["passed"] == 3 and p.json["failed"] == []
    s = deploy("status", "qwen36-replicas", env=env)
    assert s.returncode == 0, s.stderr
    assert s.stdout.splitlines()[-1].startswith("qwen36-replicas: serving 3 of 3; mean draft acceptance ")


def test_rolling_restart_stops_at_the_failing_target_and_down_one(tb, deploy, playbooks):
    env = _fleet(tb, playbooks)
    assert deploy("up", "qwen36-replicas", env=env).returncode == 0
    pids = {t: _state(tb, t)["pid"] for t in TARGETS}
    tb.set_fault("pve2", 129, "oom_at_startup", "cuda_oom")  # the second target fails its readiness gate
    p = deploy("restart", "qwen36-replicas", "--rolling", env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    out = p.stdout.splitlines()
    assert [ln.split()[:2] for ln in out[:3]] == [["pve1/129", "up"], ["pve2/129", "FAILED"],
                                                 ["pve3/129", "not"]]
    assert "wait-ready: vLLM failed to start: CUDA out of memory" in out[1]
    assert "rolling restart stopped at pve2/129:" in out
    assert [ln.split(":", 1)[1].strip() for ln in out if ln.startswith("  on the new") or
            ln.startswith("  still on the old")] == ["pve1/129", "pve3/129"]
    # pve2 was started only after pve1 passed its gate; pve3 was never touched
    stderr = p.stderr
    assert stderr.index("[pve1/129] ok   acceptance") < stderr.index("[pve2/129] ok   container")
    assert "[pve3/129]" not in stderr
    assert _state(tb, "pve1/129")["pid"] != pids["pve1/129"]
    assert _state(tb, "pve3/129")["pid"] == pids["pve3/129"]
    s = deploy("--json", "status", "qwen36-replicas", env=env)
    t = s.json["totals"][0]
    assert (t["serving"], t["serving_targets"], t["not_serving"]) == (2, ["pve1/129", "pve3/129"], ["pve2/129"])
    assert s.returncode == 1  # pve2/129: its failed restart is on record

    d = deploy("--json", "down", "qwen36-replicas", "pve3/129", env=env)
    assert d.returncode == 0, d.stderr
    assert [r["where"] for r in d.json["targets"]] == ["pve3/129"]
    s = deploy("--json", "status", "qwen36-replicas", env=env)
    assert s.json["totals"][0]["serving_targets"] == ["pve1/129"]


def test_fleet_usage_errors(tb, deploy, playbooks):
    env = _fleet(tb, playbooks)
    p = deploy("restart", "qwen36-replicas", "--max-unavailable", "2", env=env)
    assert p.returncode == 2 and "--max-unavailable is for a rolling restart" in p.stderr
    p = deploy("down", "qwen36-replicas", "pve4/129", env=env)
    assert p.returncode == 2 and "pve4/129 is not a target of qwen36-replicas" in p.stderr
    assert "pve1/129, pve2/129, pve3/129" in p.stderr
    p = deploy("--json", "verify", "qwen36-replicas", env=env)  # each target in turn
    assert p.returncode == 0 and p.json["ok"] and [t["where"] for t in p.json["targets"]] == TARGETS, p.stdout
    tb.set_fault("pve2", 129, "vllm_version", "0.10.0")  # below the playbook's vllm_min_version
    p = deploy("verify", "qwen36-replicas", env=env)
    assert p.returncode == 1 and "== pve2/129" in p.stdout
    assert "qwen36-replicas: 2 of 3 targets verified: failed on pve2/129" in p.stdout, p.stdout + p.stderr
    tb.set_fault("pve2", 129, "vllm_version", None)
    p = deploy("--json", "plan", "qwen36-replicas", env=env)
    assert p.returncode == 0 and [(t["host"], t["vmid"]) for t in p.json["targets"]] == [
        ("pve1", 129), ("pve2", 129), ("pve3", 129)]
    assert all(_state(tb, t) is None for t in TARGETS)  # nothing ran


def test_two_targets_on_one_host_share_its_connection(tb, deploy, playbooks):
    """pve1/129 on GPUs 2-3 and pve1/130 on GPUs 0-1 (tensor parallel 2): one SSH connection to pve1 for both."""
    _fleet(tb, playbooks)
    tb.set_fault("pve1", 130, "load_s", 0.3)
    path = playbooks.dir / "qwen36-replicas.yaml"
    text = path.read_text()
    start, end = text.index("targets:\n"), text.index("\nmodel:")
    path.write_text(text[:start] + "targets:\n  - {host: pve1, vmid: 129, gpus: [2, 3]}\n"
                    "  - {host: pve1, vmid: 130, gpus: [0, 1]}\n" + text[end:]
                    .replace("tensor_parallel_size: 4", "tensor_parallel_size: 2"))
    before = _conns(tb)["pve1"]
    p = deploy("--json", "up", "qwen36-replicas", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert [(r["where"], r["status"]) for r in p.json["targets"]] == [("pve1/129", "up"), ("pve1/130", "up")]
    assert _conns(tb)["pve1"] == before + 1
    assert _state(tb, "pve1/129")["playbook"] == _state(tb, "pve1/130")["playbook"] == "qwen36-replicas"


def test_apply_config_installs_the_pinned_config_in_every_target(tb, deploy, playbooks):
    """A DFlash playbook with three targets: apply-config replaces the stale guess in each container (backup, read
    back, verified) and says so per target; a second run finds the pinned bytes everywhere."""
    text = (playbooks.dir / "qwen36-dflash.yaml").read_text().replace("name: qwen36-dflash", "name: dflash-replicas")
    start, end = text.index("target:\n"), text.index("\nmodel:")
    text = text[:start] + "targets:\n" + "".join(
        f"  - {{host: {t.split('/')[0]}, vmid: 129, gpus: [0, 1, 2, 3]}}\n" for t in TARGETS) + text[end:]
    (playbooks.dir / "dflash-replicas.yaml").write_text(text)
    p = deploy("apply-config", "dflash-replicas", env=playbooks.env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "dflash-replicas: 3 of 3 target(s) with the pinned config, verified" in p.stdout, p.stdout
    for t in TARGETS:
        host = t.split("/")[0]
        assert '"use_sliding_window": true' in cat(tb, host, 129, "/root/models/Qwen3.6-27B-DFlash/config.json")
    p = deploy("--json", "apply-config", "dflash-replicas", env=playbooks.env)
    assert p.returncode == 0 and p.json["passed"] == 3 and [r["where"] for r in p.json["targets"]] == TARGETS
    assert all("already has the pinned bytes" in s["summary"] for r in p.json["targets"] for s in r["steps"]
               if s["step"] == "drafter-config")
