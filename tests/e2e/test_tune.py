"""`deploy tune`: the baseline without --speculative-config, the largest k, the candidates the prediction ranks
best, each a gated launch swept over concurrency on the test bed; the fake vLLM's step-time model (docs/testbed.md
#speed) makes healthy DFlash win at 1 request with a k below 15 and lose at 64; spec_overhead flips it."""

import json
import re

from e2e_helpers import cat

STATE = "/var/lib/vllm-pve-deploy/state.json"
ARGS = ("--rounds", "1", "--max-tokens", "64", "--concurrency", "1,4,64")


def _steps(playbooks, tb=None):
    """4 ms per memory-bound step (the fake's default is 1 ms): decode time, not a busy machine's HTTP overhead,
    decides the figures, even at 64 concurrent requests. A shorter gate probe (64 tokens still gives it > 100
    drafts) and a faster load keep the launches quick."""
    playbooks("qwen36-dflash", "  env: {}", '  env: {VPD_FAKE_STEP_MS: "4"}')
    playbooks("qwen36-dflash", "    max_tokens: 128", "    max_tokens: 64")
    if tb is not None:
        tb.set_fault("pve1", 129, "load_s", 0.3)
    return playbooks.env


def test_tune_wins_at_one_loses_at_64_and_writes_a_schedule(tb, deploy, playbooks):
    env = _steps(playbooks, tb)
    path = playbooks.dir / "qwen36-dflash.yaml"
    before = path.read_text()
    p = deploy("--json", "tune", "qwen36-dflash", "-y", *ARGS, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    res = p.json
    by = {x["concurrency"]: x for x in res["levels"]}
    assert by[1]["winner"] not in ("off", None) and int(by[1]["winner"]) < 15, by[1]
    assert by[64]["winner"] == "off", by[64]
    assert set(by[1]["tokens_per_s"]) >= {"off", "15"} and len(by[1]["tokens_per_s"]) >= 3
    # the prediction is checked against every measured k, within the stated tolerance
    assert res["prediction_error"] and set(res["prediction_error"]) == set(by[1]["tokens_per_s"]) - {"off"}
    for k, errs in res["prediction_error"].items():
        for c, e in errs.items():
            assert abs(e) <= res["prediction_tolerance"], (k, c, e, res["predicted"][k][c])
    # the schedule (vLLM 0.34.0 has it): drafts at 1 request, none at 64
    sch = res["chosen"]["schedule"]
    assert res["schedule_supported"] and sch[0][0] == 1 and sch[0][2] == int(by[1]["winner"]) and sch[-1][2] == 0
    assert res["chosen"]["k"] == max(r[2] for r in sch)
    assert [ln["config"] for ln in res["launches"]][:2] == ["off", "k=15"]
    assert all(ln["seconds"] > 0 for ln in res["launches"])
    assert res["written"] is None and path.read_text() == before  # without --write: only the diff
    assert "+  schedule: [[1, " in res["diff"] and "num_speculative_tokens" in res["diff"]
    assert res["kept"]["ok"]
    running = json.loads(cat(tb, "pve1", 129, STATE))
    spec = json.loads(running["argv"][running["argv"].index("--speculative-config") + 1])
    assert spec["num_speculative_tokens_per_batch_size"] == sch  # the best configuration is left running
    row = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert row["tune"]["verdict"] == res["verdict"] and row["tune"]["text"].startswith("tuned ")
    assert "Speculation (deploy tune):" in deploy("status", "pve1/129").stdout

    # --write: the same change applied in place; every comment kept; the schema passes; it comes up gated
    p = deploy("tune", "qwen36-dflash", "-y", "--write", "--max-launches", "1", "--rounds", "1", "--max-tokens", "64",
               "--concurrency", "1,64", env=playbooks.env, timeout=300)
    assert p.returncode == 0, p.stderr
    after = path.read_text()
    assert "schedule: [[1, " in after
    for comment in re.findall(r"#.*", before):
        assert comment in after, comment
    assert re.search(r"written: .*qwen36-dflash.yaml \(backup .*\.bak-", p.stdout)
    assert "verdict: " in p.stdout and "predicted vs measured" in p.stdout
    v = deploy("--json", "plan", "qwen36-dflash", env=playbooks.env)
    assert v.returncode == 0, v.stderr
    up = deploy("--json", "up", "qwen36-dflash", env=playbooks.env)
    assert up.returncode == 0 and up.json["status"] == "already up", up.stderr  # tune left the written one running


def test_tune_with_spec_overhead_proposes_turning_speculation_off(tb, deploy, playbooks):
    tb.set_fault("pve1", 129, "spec_overhead", 4.0)
    p = deploy("--json", "tune", "qwen36-dflash", "-y", "--max-launches", "1", "--rounds", "1", "--max-tokens", "64",
               "--concurrency", "1,4", env=_steps(playbooks, tb), timeout=300)
    assert p.returncode == 0, p.stderr
    res = p.json
    assert all(x["winner"] == "off" for x in res["levels"]), res["levels"]
    assert res["chosen"]["off"] and res["chosen"]["schedule"] is None
    assert res["verdict"] == "speculation loses at every measured level: turn it off"
    assert any("turn it off" in w for w in res["warnings"])
    assert res["diff"] == "" and res["kept"]["config"] == "off"  # no key turns it off: the baseline is left running
    running = json.loads(cat(tb, "pve1", 129, STATE))
    assert "--speculative-config" not in running["argv"]


def test_tune_without_the_schedule_picks_one_k_and_names_the_losing_levels(tb, deploy, playbooks):
    tb.set_fault("pve1", 129, "vllm_version", "0.26.0")
    playbooks("qwen36-dflash", '  vllm: "0.34.0"', '  vllm: "0.26.0"')
    p = deploy("--json", "tune", "qwen36-dflash", "-y", "--max-launches", "1", *ARGS, env=_steps(playbooks, tb), timeout=300)
    assert p.returncode == 0, p.stderr
    res = p.json
    assert res["schedule_supported"] is False and res["chosen"]["schedule"] is None
    by = {x["concurrency"]: x for x in res["levels"]}
    assert res["chosen"]["expected_concurrency"] == 1 and res["chosen"]["k"] == int(by[1]["winner"])
    assert any(w.startswith("speculation loses at 64 requests") for w in res["warnings"]), res["warnings"]
    assert "+  schedule:" not in res["diff"]
    assert ("+  num_speculative_tokens: " in res["diff"]) == (res["chosen"]["k"] != 15)  # 15: no change


def test_compare_baseline_measures_the_playbook_against_itself_without_speculation(tb, deploy, playbooks):
    p = deploy("--json", "compare", "qwen36-dflash", "--baseline", "-y", "--rounds", "1", "--max-tokens", "64",
               "--concurrency", "1,64", env=_steps(playbooks, tb), timeout=300)
    assert p.returncode == 0, p.stderr
    res = p.json
    off = "qwen36-dflash (no speculation)"
    assert [(r["playbook"], r["method"], r["ok"]) for r in res["results"]] == [
        ("qwen36-dflash", "dflash", True), (off, "none", True)]
    assert [lv["winner"] for lv in res["levels"]] == ["qwen36-dflash", off]
    assert res["kept"]["playbook"] == "qwen36-dflash" and res["kept"]["ok"]  # the faster at the first level
    assert "--speculative-config" in json.loads(cat(tb, "pve1", 129, STATE))["argv"]
    bad = deploy("compare", "qwen36-dflash", "qwen36-mtp", "--baseline", "-y")
    assert bad.returncode == 2 and "compare needs PLAYBOOK_B or --baseline (not both)" in bad.stderr
