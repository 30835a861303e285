"""deploy tune's pure parts: the prediction, the candidates, the choice per level, the schedule, the playbook edit;
and the fake vLLM's step-time model it is tested against (docs/testbed.md#speed)."""

import re
from pathlib import Path

import pytest

from orchestrator.deploy import tune as T

ROOT = Path(__file__).resolve().parents[2]


def _fake_accept():
    """The fake vLLM's vllm/_fake/accept.py (stdlib only), loaded by path: the fake package is not importable here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fake_vllm_accept", ROOT / "testbed" / "vpd_testbed" / "fake_vllm" / "vllm" / "_fake" / "accept.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
PER_POS = [0.7, 0.38, 0.25, 0.18, 0.14, 0.12, 0.1, 0.08]


def _lv(c, tps, al=None, rse=0.01, itl=1.0):
    return {"concurrency": c, "tokens_per_s": tps, "acceptance_length": al, "tokens_per_s_rse": rse,
            "itl_ms_p50": itl}


def test_predict_reproduces_both_ends_and_interpolates_the_step_time():
    off = [_lv(1, 100.0), _lv(8, 600.0)]
    big = [_lv(1, 200.0, al=T.mean_tokens(PER_POS, 8)), _lv(8, 400.0, al=T.mean_tokens(PER_POS, 8))]
    pred = T.predict(off, big, PER_POS, 8)
    assert pred[8][1] == pytest.approx(200.0) and pred[8][8] == pytest.approx(400.0)  # the measured end
    t0, t8 = 1 / 100.0, T.mean_tokens(PER_POS, 8) / 200.0  # step times at 1 request
    t4 = t0 + (t8 - t0) * 4 / 8
    assert pred[4][1] == pytest.approx(T.mean_tokens(PER_POS, 4) / t4, rel=1e-3)
    assert T.mean_tokens(PER_POS, 2) == pytest.approx(2.08)


def test_candidates_each_levels_best_first_never_the_largest_only_winners():
    pred = {1: {1: 150, 8: 700}, 2: {1: 180, 8: 650}, 5: {1: 220, 8: 500}, 8: {1: 230, 8: 400}}
    off = {1: 100, 8: 600}
    assert T.pick_candidates(pred, off, 8, 2) == [5, 1]  # 8 is measured already; 5 best at 1 (bar 8), 1 best at 8
    assert T.pick_candidates(pred, off, 8, 0) == []
    assert T.pick_candidates({1: {1: 90}}, {1: 100}, 8, 3) == []  # nothing predicted to beat the baseline


def test_choose_names_winner_margin_and_noise():
    measured = {"off": [_lv(1, 100.0), _lv(64, 1000.0)], "5": [_lv(1, 210.0), _lv(64, 990.0)],
                "2": [_lv(1, 170.0, rse=0.2), _lv(64, 800.0)]}
    c1, c64 = T.choose([1, 64], measured, noise_run=0.15)
    assert c1["winner"] == "5" and c1["runner_up"] == "2" and c1["margin"] == pytest.approx(210 / 170 - 1, abs=1e-4)
    assert c1["noise"] == pytest.approx(0.30) and not c1["significant"]  # 23.5 % < twice the measured 15 %
    assert T.choose([1], measured, noise_run=0.05)[0]["significant"]
    assert T.run_noise({"tokens_per_s": 100.0}, {"tokens_per_s": 110.0}) == pytest.approx(0.0952, abs=1e-4)
    assert T.run_noise({"tokens_per_s": 100.0}, None) is None
    assert c1["speedup_vs_off"] == 2.1
    assert c64["winner"] == "off" and c64["margin"] == pytest.approx(0.0101, abs=1e-4)
    assert not c64["significant"]  # 1 % is under the noise floor


def test_schedule_covers_every_batch_size_from_1_and_is_valid_for_vllm():
    chosen = [{"concurrency": 1, "winner": "6"}, {"concurrency": 4, "winner": "2"},
              {"concurrency": 16, "winner": "off"}, {"concurrency": 64, "winner": "off"}]
    sch = T.schedule_of(chosen)
    assert sch == [[1, 2, 6], [3, 8, 2], [9, 4096, 0]]
    accept = _fake_accept()  # the fake vLLM's port of vLLM's own validator

    dense = accept.schedule_lookup(sch, 64, 6)
    assert dense[1] == 6 and dense[4] == 2 and dense[16] == 0 and dense[64] == 0
    assert "k=6 at 1-2 requests" in T.verdict_text(
        [dict(c, speedup_vs_off=2.0 if c["concurrency"] == 1 else None) for c in chosen], sch, 6)


def test_edit_keeps_every_comment_and_layout_and_passes_the_schema(tmp_path):
    src = (ROOT / "playbooks" / "qwen36-dflash.yaml").read_text()
    out = T.edit_text(src, k=6, schedule=[[1, 2, 6], [3, 8, 2], [9, 4096, 0]])
    for comment in re.findall(r"#.*", src):
        assert comment in out
    diff = T.unified("p.yaml", src, out)
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == ["-  num_speculative_tokens: 15           # block_size 16 - 1",
                       "+  num_speculative_tokens: 6            # block_size 16 - 1",
                       "+  schedule: [[1, 2, 6], [3, 8, 2], [9, 4096, 0]] # k by batch size, 0 = no drafts "
                       "(deploy tune)"]
    # the strict schema on the result, beside the pinned drafter config it names
    import shutil

    shutil.copytree(ROOT / "playbooks", tmp_path / "pb")
    p = tmp_path / "pb" / "qwen36-dflash.yaml"
    p.write_text(out)
    from orchestrator.core.spec import load_playbook

    pb = load_playbook(str(p), None)
    assert pb.data["speculative"]["schedule"] == [[1, 2, 6], [3, 8, 2], [9, 4096, 0]]
    assert T.edit_text(out, k=6, schedule=None).count("schedule") == 0  # a single k: the schedule goes


def test_a_bad_schedule_is_refused_at_its_line(tmp_path):
    import shutil

    from orchestrator.core.errors import SpecError
    from orchestrator.core.spec import load_playbook

    shutil.copytree(ROOT / "playbooks", tmp_path / "pb")
    p = tmp_path / "pb" / "qwen36-dflash.yaml"
    p.write_text(T.edit_text(p.read_text(), k=6, schedule=[[2, 8, 9], [5, 10, 0]]))
    with pytest.raises(SpecError) as e:
        load_playbook(str(p), None)
    text = "\n".join(e.value.problems)
    assert "k 9 is more than num_speculative_tokens 6" in text and "must start at 1" in text and "overlap" in text


def test_fake_step_model_calibration():
    """Healthy DFlash wins at 1 request with a best k below 15, still at 8, loses from 16 on; MTP sequential
    drafting makes it slower than DFlash at 1 request; spec_overhead 4 makes speculation lose everywhere."""
    A = _fake_accept()

    acc = A.Acceptance("dflash", 15, cond=A.dflash_cond(15, **A.CURVES["ok"]))

    def speedup(k, b, overhead=1.0):
        return (1 + sum(acc.per_pos[:k])) * A.step_units(None, 0, b) / A.step_units("dflash", k, b, overhead)

    best1 = max(range(1, 16), key=lambda k: speedup(k, 1))
    assert best1 < 15 and speedup(best1, 1) > speedup(15, 1) * 1.05 and speedup(15, 1) > 1.5
    assert max(speedup(k, 8) for k in range(1, 16)) > 1.05
    assert max(speedup(k, b) for k in range(1, 16) for b in (16, 64)) < 1.0
    assert max(speedup(k, b, 4.0) for k in range(1, 16) for b in (1, 4, 64)) < 1.0
    mtp = A.for_mtp(2)
    assert (1 + sum(mtp.per_pos)) / A.step_units("mtp", 2, 1) < speedup(15, 1) / 1.2
    assert A.step_units("dflash", 0, 4, drafter_loaded=True) == pytest.approx(A.step_units(None, 0, 4) * A.K0_TAX)


def _res():
    levels = T.choose([1, 64], {"off": [_lv(1, 100.0), _lv(64, 1000.0)], "5": [_lv(1, 210.0), _lv(64, 600.0)],
                                "15": [_lv(1, 190.0), _lv(64, 300.0)]})
    return {"ok": True, "target": "pve1/129", "playbook": "qwen36-dflash", "concurrency": [1, 64], "levels": levels,
            "predicted": {"5": {"1": 200.0, "64": 650.0}}, "prediction_error": {"5": {"1": -0.0476, "64": 0.0833}},
            "prediction_tolerance": T.PREDICTION_TOLERANCE,
            "launches": [{"config": "off", "seconds": 3.2, "ok": True, "error": None, "status": "up"},
                         {"config": "k=9", "seconds": 4.0, "ok": False, "status": "failed",
                          "error": {"message": "acceptance gate failed"}}],
            "warnings": ["no drafts (k=0) at 64 requests: ..."], "chosen": {"k": 5, "schedule": [[1, 7, 5], [8, 4096, 0]],
                                                                          "off": False},
            "verdict": "k=5 at 1-7 requests; off at 8+ requests; 2.10x plain at 1 request", "diff": "--- a\n+++ b\n",
            "written": None, "kept": {"config": "k=5 schedule [[1, 7, 5], [8, 4096, 0]]", "ok": True}}


def test_render_shows_the_table_the_check_of_the_prediction_and_each_launch():
    out = "\n".join(T.render(_res()))
    assert re.search(r"^1 +100 \(1\) +210 \(1\) +190 \(1\) +k=5 +\+10\.5%", out, re.M), out
    assert re.search(r"^64 +1000 \(1\) .* off +\+66\.7%", out, re.M), out
    assert "k=5 predicted vs measured tok/s: 1: 200 vs 210 (-5%), 64: 650 vs 600 (+8%)" in out
    assert "launch k=9: 4.0 s, dropped: acceptance gate failed" in out
    assert "verdict: k=5 at 1-7 requests; off at 8+ requests; 2.10x plain at 1 request" in out
    assert "the playbook change (not written; --write applies it):" in out
    assert out.rstrip().endswith("left running on pve1/129: k=5 schedule [[1, 7, 5], [8, 4096, 0]]")
    assert "output tokens/s by concurrency (# off, = k=5, * k=15):" in out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = T.plot(_res(), str(tmp_path / "t.png"))
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
