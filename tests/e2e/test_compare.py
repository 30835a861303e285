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


def test_compare_sweeps_concurrency_with_every_figure_and_a_chart(tb, deploy, playbooks, tmp_path):
    png = tmp_path / "sweep.png"
    p = deploy("--json", "compare", "qwen36-dflash", "qwen36-mtp", "-y", "--rounds", "1", "--concurrency", "1,4",
               "--plot", str(png), env=_slow_steps(playbooks))
    assert p.returncode == 0, p.stderr
    res = p.json
    assert res["concurrency"] == [1, 4] and res["plot"] == str(png)
    for r in res["results"]:
        assert [lv["concurrency"] for lv in r["levels"]] == [1, 4]
        for lv in r["levels"]:
            assert lv["requests"] == max(lv["concurrency"], res["prompts"]) and lv["failed"] == 0, lv  # the shipped natural-text set
            for key in ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
                        "acceptance_length", "draft_acceptance"):
                assert lv[key] is not None and lv[key] > 0, (key, lv)
            assert lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and lv["itl_ms_p50"] <= lv["itl_ms_p99"]
    assert [lvw["concurrency"] for lvw in res["levels"]] == [1, 4]
    for lvw in res["levels"]:
        assert lvw["winner"] in ("qwen36-dflash", "qwen36-mtp") and set(lvw["tokens_per_s"]) == {
            "qwen36-dflash", "qwen36-mtp"}
    # a valid PNG, that matplotlib reads back
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(str(png)).shape[0] > 100
    # the terminal chart and the per-level verdicts; bad options fail before anything runs
    p = deploy("compare", "qwen36-dflash", "qwen36-mtp", "-y", "--plot", str(tmp_path / "x.gif"))
    assert p.returncode == 2 and "must end in .png, .svg, .pdf" in p.stderr
    p = deploy("compare", "qwen36-dflash", "qwen36-mtp", "-y", "--concurrency", "0,4")
    assert p.returncode == 2 and "1..1024" in p.stderr


def test_compare_table_has_levels_and_a_terminal_chart():
    from orchestrator.deploy.compare import chart, render
    lv = lambda c, t: {"concurrency": c, "tokens_per_s": t, "ttft_ms_p50": 10.0, "ttft_ms_p99": 12.0,  # noqa: E731
                       "itl_ms_p50": 1.0, "itl_ms_p99": 2.0, "acceptance_length": 3.1}
    res = {"target": "pve1/129", "prompts": 3, "rounds": 1, "concurrency": [1, 16], "winner": "a", "speedup": 2.0,
           "kept": None,
           "levels": [{"concurrency": 1, "tokens_per_s": {"a": 200.0, "b": 100.0}, "winner": "a", "speedup": 2.0},
                      {"concurrency": 16, "tokens_per_s": {"a": 900.0, "b": 1000.0}, "winner": "b",
                       "speedup": 1.11}],
           "results": [{"playbook": "a", "method": "dflash", "ok": True, "levels": [lv(1, 200.0), lv(16, 900.0)]},
                       {"playbook": "b", "method": "mtp", "ok": True, "levels": [lv(1, 100.0), lv(16, 1000.0)]}]}
    text = "\n".join(render(res))
    assert "concurrency 16: tokens/s" in text and "concurrency 16: b wins (1.11x)" in text
    c = chart(res)
    assert c[0] == "output tokens/s by concurrency (# a, = b):"
    assert c[4].split()[:2] == ["16", "b"] and c[4].count("=") == 40
