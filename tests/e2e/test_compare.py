"""`deploy compare`: both playbooks brought up with their gates on one container, timed on the same prompts,
the faster left running. The fake vLLM's speed follows its acceptance and method (docs/testbed.md)."""

import json

from e2e_helpers import cat

STATE = "/var/lib/vllm-pve-deploy/state.json"


def _slow_steps(playbooks):
    """8 ms per target step (the fake's default is 1 ms): decode time, not a loaded machine's HTTP overhead,
    decides the ratio, so the comparison is about the methods whatever else runs."""
    playbooks("qwen36-dflash", "  env: {}", '  env: {VPD_FAKE_STEP_MS: "8"}')
    playbooks("qwen36-mtp", "  load_timeout_s: 900", '  load_timeout_s: 900\n  env: {VPD_FAKE_STEP_MS: "8"}')
    return playbooks.env


def test_compare_picks_the_faster_and_leaves_it_running(tb, deploy, playbooks):
    p = deploy("--json", "compare", "qwen36-dflash", "qwen36-mtp", "-y", "--rounds", "1", env=_slow_steps(playbooks))
    assert p.returncode == 0, p.stderr
    res = p.json
    assert [r["playbook"] for r in res["results"]] == ["qwen36-dflash", "qwen36-mtp"]
    for r in res["results"]:
        assert r["ok"] and r["status"] == "up"
        assert r["speed"]["requests"] == 8 and r["speed"]["tokens_per_s"] > 0  # the shipped probe set, 1 round
    dflash, mtp = res["results"]
    assert 0.15 <= dflash["acceptance"]["draft_acceptance_rate"] <= 0.20  # k=15: the rate falls, AL rises
    assert mtp["acceptance"]["draft_acceptance_rate"] > 0.5
    assert dflash["acceptance"]["mean_acceptance_length"] > mtp["acceptance"]["mean_acceptance_length"]
    # AL ~3.5 in one drafting pass (+25 %) against MTP's ~2.4 with a head pass per token (+8 % each): ~1.4x
    assert res["winner"] == "qwen36-dflash" and res["speedup"] > 1.2
    assert res["kept"] == {"playbook": "qwen36-dflash", "ok": True, "status": "up", "error": None}
    assert json.loads(cat(tb, "pve1", 129, STATE))["playbook"] == "qwen36-dflash"  # brought back after mtp


def test_compare_keep_and_the_table(tb, deploy, playbooks):
    p = deploy("compare", "qwen36-dflash", "qwen36-mtp", "-y", "--rounds", "1", "--keep", "qwen36-mtp",
               env=_slow_steps(playbooks))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["qwen36-dflash", "qwen36-mtp"]
    assert lines[1].split() == ["method", "dflash", "mtp"]
    assert any(ln.startswith("winner: qwen36-dflash (") for ln in lines)
    assert lines[-1] == "left running on pve1/129: qwen36-mtp"
    assert json.loads(cat(tb, "pve1", 129, STATE))["playbook"] == "qwen36-mtp"


def test_compare_refuses_before_anything_runs(tb, deploy, playbooks):
    p = deploy("compare", "qwen36-dflash", "qwen36-mtp")  # no TTY, no -y
    assert p.returncode == 2
    assert "not confirmed; nothing was changed" in p.stderr and "-y" in p.stderr
    p = deploy("compare", "qwen36-dflash", "qwen36-dflash", "-y")
    assert p.returncode == 2 and "two different playbooks" in p.stderr
    playbooks("qwen36-mtp", "host: pve1", "host: pve2")
    p = deploy("compare", "qwen36-dflash", "qwen36-mtp", "-y", env=playbooks.env)
    assert p.returncode == 2 and "targets pve1/129 but qwen36-mtp targets pve2/129" in p.stderr
    p = deploy("compare", "qwen36-dflash", "qwen36-mtp", "-y", "--keep", "other")
    assert p.returncode == 2 and "--keep other is neither" in p.stderr
    assert cat(tb, "pve1", 129, STATE) == ""  # nothing was started
