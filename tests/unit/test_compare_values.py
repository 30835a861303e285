"""compare's arithmetic and table, on values (no host)."""

from orchestrator.deploy.compare import pick_winner, render, summarize


def test_summarize_overall_and_per_request():
    s = summarize([{"tokens": 100, "seconds": 1.0}, {"tokens": 100, "seconds": 3.0}])
    assert s == {"requests": 2, "output_tokens": 200, "tokens_per_s": 50.0, "tokens_per_s_mean": 66.67,
                 "tokens_per_s_median": 66.67}
    assert summarize([])["tokens_per_s"] is None


def _row(name, tps, ok=True, error=None):
    return {"playbook": name, "method": name.split("-")[-1], "ok": ok, "status": "up" if ok else "failed",
            "error": error, "speed": {"tokens_per_s": tps, "tokens_per_s_median": tps, "requests": 3} if ok else {},
            "acceptance": {"draft_acceptance_rate": 0.5, "mean_acceptance_length": 3.0,
                           "per_position": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]} if ok else None}


def test_winner_is_the_fastest_that_passed():
    a, b = _row("x-dflash", 100.0), _row("x-mtp", 150.0)
    assert pick_winner([a, b]) is b
    assert pick_winner([a, _row("x-mtp", None, ok=False)]) is a
    assert pick_winner([_row("a-x", None, ok=False), _row("b-x", None, ok=False)]) is None


def test_render_names_a_failure_with_its_fix_and_cuts_nothing():
    bad = _row("x-mtp", None, ok=False, error={"message": "draft acceptance 1.0% is below the playbook's 30%",
                                              "fix": "likeliest causes: a guessed or stale drafter config"})
    res = {"results": [_row("x-dflash", 120.5), bad], "prompts": 3, "rounds": 1, "winner": "x-dflash",
           "speedup": None, "target": "pve1/129", "kept": {"playbook": "x-dflash", "ok": True, "error": None}}
    text = "\n".join(render(res))
    assert "failed: failed" in text and "0.90 0.80 0.70 0.60 0.50 0.40 ..." in text
    assert "x-mtp: draft acceptance 1.0% is below the playbook's 30%\n  fix: likeliest causes: a guessed or stale" \
           " drafter config" in text
    assert "winner: x-dflash (the only one measured)" in text
    assert text.endswith("left running on pve1/129: x-dflash")
