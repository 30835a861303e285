"""`deploy verify` / `apply-config` in the test bed's containers: the container's own Python and transformers."""

from e2e_helpers import DRAFTER, PINNED_SHA, sha

STALE_SHA = "5d208bf4315f0ab499cbe48effa3473e33a5020c04e9b81fff139cb3d4ed3ede"


def failed(doc):
    return {c["check"]: c for c in doc["checks"] if not c["ok"]}


def test_stale_guess_found_with_every_wrong_field_named(tb, deploy):
    p = deploy("--json", "verify", "qwen36-dflash")
    assert p.returncode == 1
    bad = failed(p.json)
    assert bad["sha256"]["on_disk"] == STALE_SHA and bad["sha256"]["expected"] == PINNED_SHA
    for f in ("dflash_config.target_layer_ids", "dflash_config.mask_token_id", "layer_types", "sliding_window",
              "use_sliding_window", "bos_token_id"):
        assert "field " + f in bad, f
    assert p.json["location"]["realpath"] == DRAFTER
    assert p.json["transformers_version"] and p.json["stack"]["version"] == "0.34.0"
    assert p.json["python"].startswith("/root/ml-env/")  # the container's own Python
    human = deploy("verify", "qwen36-dflash")
    assert "field dflash_config.target_layer_ids" in human.stdout and "[1,17,33,49,63]" in human.stdout
    assert "FAILED:" in human.stderr and "deploy up qwen36-dflash installs the pinned config" in human.stderr


def test_apply_config_then_the_published_config_passes(tb, deploy):
    p = deploy("--json", "apply-config", "qwen36-dflash")
    assert p.returncode == 0, p.stderr
    assert sha(tb, "pve1", 129, DRAFTER) == PINNED_SHA
    v = deploy("--json", "verify", "qwen36-dflash")
    assert v.returncode == 0, failed(v.json)
    checks = {c["check"]: c for c in v.json["checks"]}
    assert checks["loaded sliding_window"]["as_loaded"] == 2048
    assert checks["fix: +1 layer-id offset (PR #40727)"]["ok"] and checks["fix: DFlash sliding window"]["ok"]
    assert checks["weights fc shape"]["ok"]  # the safetensors header agrees with the config


def test_readonly_directory_leaves_the_file_untouched(tb, deploy):
    tb.set_fault("pve1", 129, "readonly_models", True)
    p = deploy("apply-config", "qwen36-dflash")
    assert p.returncode == 1
    assert "could not install the pinned drafter config" in p.stderr and "Read-only file system" in p.stderr
    assert "the old file is untouched" in p.stderr
    assert sha(tb, "pve1", 129, DRAFTER) == STALE_SHA


def test_revert_after_write_is_caught_before_launch(tb, deploy):
    tb.set_fault("pve1", 129, "config_revert_s", 0.3)
    p = deploy("up", "qwen36-dflash")
    assert p.returncode == 1, p.stderr
    assert "changed behind our back between the write and verify" in p.stderr
    assert f"read back as {PINNED_SHA} and is now {STALE_SHA}" in p.stderr
    assert "launch " not in p.stderr


def test_revert_during_startup_is_caught_as_drift(tb, deploy):
    tb.set_fault("pve1", 129, "config_revert_s", 8.0)  # after verify (~1 s; several under load), before the server is up
    tb.set_fault("pve1", 129, "load_s", 12.0)
    p = deploy("up", "qwen36-dflash")
    assert p.returncode == 1, p.stderr
    assert "drift: the drafter config changed behind our back while vLLM started" in p.stderr
    assert f"now has sha256 {STALE_SHA}, it had {PINNED_SHA}" in p.stderr
    # state left is read after the failure: the file was replaced, and now holds the reverted bytes again
    assert "state left: the drafter config /root/models/Qwen3.6-27B-DFlash/config.json was replaced (old file " \
           "kept as /root/models/Qwen3.6-27B-DFlash/config.json.bak-" in p.stderr
    assert f"read now: sha256 {STALE_SHA}, NOT the pinned bytes ({PINNED_SHA})" in p.stderr
    assert "; the failed server was stopped" in p.stderr
    assert "fix: find what rewrites /root/models/Qwen3.6-27B-DFlash/config.json" in p.stderr
    assert "deploy up qwen36-dflash again" in p.stderr
    # status afterwards says the last up failed (not `ok ... none`, exit 0)
    s = deploy("status", "pve1/129")
    assert s.returncode == 1 and "failed" in s.stdout and "the last deploy up/restart of qwen36-dflash failed" \
        in s.stdout, s.stdout
    tb.set_fault("pve1", 129, "config_revert_s", None)
    assert deploy("down", "qwen36-dflash").returncode == 0  # a deliberate down ends that story
    s = deploy("status", "pve1/129")
    assert s.returncode == 0 and "failed" not in s.stdout, s.stdout


def test_revert_noticed_first_by_aux_layers_is_still_drift(tb, deploy):
    """The fault from the issue: the revert lands while vLLM loads, so the taps are wrong before the drift step."""
    # after verify (2-3 s on a quiet machine now that it checks the installed vLLM's SpeculativeConfig and
    # semantics), while the (slowed) server loads: a revert at 2 s could land inside verify, which catches it as
    # "changed between the write and verify" instead
    tb.set_fault("pve1", 129, "config_revert_s", 5.0)
    tb.set_fault("pve1", 129, "load_s", 10.0)
    p = deploy("up", "qwen36-dflash")
    assert p.returncode == 1, p.stderr
    assert "drift: the drafter config changed behind our back while vLLM started" in p.stderr, p.stderr
    assert f"now has sha256 {STALE_SHA}, it had {PINNED_SHA}" in p.stderr
    assert "fix: deploy verify" not in p.stderr


def test_old_vllm_without_the_fixes_is_reported_with_its_version(tb, deploy):
    deploy("apply-config", "qwen36-dflash")
    tb.set_fault("pve1", 129, "vllm_version", "0.21.0")
    p = deploy("--json", "verify", "qwen36-dflash")
    assert p.returncode == 1
    bad = failed(p.json)
    assert "lacks the +1 layer-id fix" in bad["fix: +1 layer-id offset (PR #40727)"]["reason"]
    assert "0.21.0" in bad["fix: +1 layer-id offset (PR #40727)"]["reason"]
    assert "silently runs sliding layers as full attention" in bad["fix: DFlash sliding window"]["reason"]
    assert bad["vllm version"]["on_disk"] == "0.21.0"
    tb.set_fault("pve1", 129, "vllm_version", "0.25.0")
    bad = failed(deploy("--json", "verify", "qwen36-dflash").json)
    assert "0.25.0 refuses a mixed sliding/full DFlash drafter at startup: `NotImplementedError: DFlash does not yet " \
        "support mixed sliding/full attention`" in bad["fix: DFlash sliding window"]["reason"]


def test_pr40898_source_build_is_accepted(tb, deploy):
    deploy("apply-config", "qwen36-dflash")
    tb.set_fault("pve1", 129, "vllm_build", "pr40898")
    v = deploy("--json", "verify", "qwen36-dflash")
    assert v.returncode == 0, failed(v.json)
    assert v.json["stack"]["markers"]["pr40898_sliding_window"] and v.json["stack"]["commit_id"]


def test_missing_extension_and_missing_markers(tb, deploy):
    deploy("apply-config", "qwen36-dflash")
    tb.set_fault("pve1", 129, "missing_extension", "cumem_allocator.abi3.so")
    tb.set_fault("pve1", 129, "no_fix_markers", True)
    bad = failed(deploy("--json", "verify", "qwen36-dflash").json)
    assert bad["vllm extensions"]["on_disk"] == ["cumem_allocator.abi3.so"]
    assert "fix: +1 layer-id offset (PR #40727)" in bad
    assert "cumem_allocator" in bad["vllm import"]["reason"]


def test_mtp_verify_checks_only_the_stack(tb, deploy):
    p = deploy("--json", "verify", "qwen36-mtp")
    assert p.returncode == 0, p.stdout
    assert {c["check"] for c in p.json["checks"]} <= {"vllm import", "vllm extensions", "vllm version",
                                                      "vllm files (RECORD)", "speculative-config keys"}
