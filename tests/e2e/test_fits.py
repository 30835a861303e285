"""Will it fit? (issue 35) on the test bed: plan and up refuse a certain does-not-fit with the real message before
any connection, and up holds the prediction to the fake vLLM's logged figures (a line; the fake's figures for
Qwen3.6-27B were never measured, so only the comparison's presence is checked here)."""

import json
import os

from e2e_helpers import REPO

TRIMMED = os.path.join(REPO, "testbed", "vpd_testbed", "data", "qwen36-27b-target.trimmed.config.json")


def _with_sizing(playbooks, gpu_total_mib):
    """qwen36-dflash with sizing.target_config: the trimmed target plus a dtype and linear-attention dims that are
    TEST INPUTS (the trimmed file lacks them), and the given GPU size."""
    cfg = json.load(open(TRIMMED))
    cfg["text_config"].update(dtype="bfloat16", linear_num_key_heads=16, linear_num_value_heads=48,
                              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    (playbooks.dir / "target.config.json").write_text(json.dumps(cfg))
    from playbook_support import without_sizing

    p = playbooks.dir / "qwen36-dflash.yaml"
    p.write_text(without_sizing(p.read_text()) +
                 f"\nsizing:\n  target_config: target.config.json\n  gpu_total_mib: {gpu_total_mib}\n")


def test_plan_and_up_refuse_a_certain_failure_before_connecting(tb, deploy, playbooks):
    _with_sizing(playbooks, 16384)
    p = deploy("plan", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "qwen36-dflash does not fit on pve1/129: does not fit:" in p.stderr
    assert "No available memory for the cache blocks" in p.stderr and "would fit with:" in p.stderr
    assert "nothing was run" in p.stderr and "Plan for" not in p.stdout
    p = deploy("--json", "up", "qwen36-dflash", "-y", env=playbooks.env)
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert err["error"] == "CheckFailed" and err["details"]["fits"]["level"] == "refuse"
    assert err["details"]["fits"]["sizing"]["kv_cache_mib"] < 0
    s = deploy("--json", "status", env=playbooks.env)
    assert "qwen36-dflash" not in s.stdout  # nothing was launched


def test_plan_sizing_line_and_up_prints_predicted_vs_reported(tb, deploy, playbooks):
    _with_sizing(playbooks, 81559)
    p = deploy("plan", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0 and "\nsizing: fits: KV cache" in p.stdout, p.stdout
    p = deploy("--json", "up", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert "sizing: weights_gib predicted" in p.stderr and "vs reported" in p.stderr
    assert "kv_tokens predicted" in p.stderr
    c = json.loads(p.stdout)["info"]["sizing"]
    assert {r["figure"] for r in c["rows"]} == {"weights_gib", "kv_tokens"}
    assert c["reported"]["kv_tokens"] > 0 and c["reported"]["weights_gib"] > 0
    # deploy status shows the same comparison for the launch serving now (its memory lines kept at up)
    s = deploy("--json", "status", "pve1/129", env=playbooks.env)
    row = json.loads(s.stdout)["rows"][0]
    assert row["sizing"]["reported"] == c["reported"], row["sizing"]
    assert [r["figure"] for r in row["sizing"]["rows"]] == [r["figure"] for r in c["rows"]]
    assert row["sizing"]["off"] == [] and not any(n.startswith("sizing:") for n in row["notes"])


def test_status_memory_lines_from_a_hostile_container_are_only_figures(tb, deploy, playbooks):
    """memory.json is the container's word: junk, huge or mismatched content is shown as figures or not at all."""
    p = deploy("up", "qwen36-mtp", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    st = json.loads(tb.container_exec("pve1", 129, ["cat", "/var/lib/vllm-pve-deploy/state.json"]).stdout)
    junk = {"pid": st["pid"], "started_at": st["started_at"],
            "lines": ["Model loading took 1e999 GiB", {"x": 1}, "GPU KV cache size: 12,3,4 tokens \x1b[31m",
                      "A" * 100000] + ["Available KV cache memory: 5.00 GiB"] * 50}
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > /var/lib/vllm-pve-deploy/memory.json"],
                      input=json.dumps(junk))
    s = deploy("--json", "status", "pve1/129", env=playbooks.env)
    assert s.returncode == 0, s.stdout + s.stderr
    row = json.loads(s.stdout)["rows"][0]
    assert row["healthy"] and row["sizing"]["reported"]["kv_cache_gib"] == 5.0
    # another launch's file (pid differs): not shown
    junk["pid"] = st["pid"] + 1
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > /var/lib/vllm-pve-deploy/memory.json"],
                      input=json.dumps(junk))
    row = json.loads(deploy("--json", "status", "pve1/129", env=playbooks.env).stdout)["rows"][0]
    assert row["sizing"] is None


def test_measured_gpus_refuse_before_anything_is_stopped_and_verify_says_so(tb, deploy, playbooks):
    """No sizing.gpu_total_mib (an assumed 80 GB card: plan only warns); the host's nvidia-smi reports 16 GiB
    cards (host fault gpu_total_mib): the gpu-plumbing step of up refuses with the numbers before anything is
    stopped, and verify fails naming the same."""
    # the shipped playbook as it is (issue 53 item 4: its sizing.target_config is the published config, whole)
    up = deploy("up", "qwen36-mtp", env=playbooks.env)  # something of ours serves on the GPUs
    assert up.returncode == 0, up.stderr
    pid = json.loads(tb.container_exec("pve1", 129, ["cat", "/var/lib/vllm-pve-deploy/state.json"]).stdout)["pid"]
    tb.set_fault("pve1", None, "gpu_total_mib", 16384)
    q = deploy("--json", "up", "qwen36-dflash", "-y", env=playbooks.env)  # -y: it may replace qwen36-mtp
    assert q.returncode == 1, q.stdout + q.stderr
    err = q.json["error"]
    assert "does not fit on the GPUs as measured on pve1 (16384 MiB each)" in err["message"], err
    assert "nothing was stopped" in err["message"] and "--gpu-mib 16384" in err["fix"]
    # filed under `sizing` as verify files it, after a gpu-plumbing that passed; every suggestion possible on the
    # 4-GPU target (no tensor_parallel_size 8) and within the model's max_position_embeddings (issue 53 item 3)
    assert err["step"] == "sizing", err
    steps = [(s["step"], s["ok"]) for s in q.json["steps"]]
    assert ("gpu-plumbing", True) in steps and ("sizing", False) in steps, steps
    assert "tensor_parallel_size 8" not in err["message"] and "3,370,240" not in err["message"]
    fits = q.json["steps"][-1]["details"]["fits"]["sizing"]
    assert fits["max_model_len_that_fits"] is None or fits["max_model_len_that_fits"] <= 262144
    st = json.loads(tb.container_exec("pve1", 129, ["cat", "/var/lib/vllm-pve-deploy/state.json"]).stdout)
    assert st["pid"] == pid and st["playbook"] == "qwen36-mtp"  # the serving one was not touched
    v = deploy("--json", "verify", "qwen36-dflash", env=playbooks.env)
    assert v.returncode == 1, v.stdout + v.stderr
    assert v.json["fits"]["level"] == "refuse" and v.json["fits"]["gpu_mib"] == 16384
    assert "does not fit on the GPUs as measured" in v.json["error"]["message"]
