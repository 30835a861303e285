"""Will it fit? A sizing model of vLLM's GPU memory, computed before anything is loaded (issue 35).

Pure functions: config.json dicts and numbers in, a Sizing out. Nothing here reads a host; `weights_from_safetensors`
reads local safetensors *headers* only (8-byte little-endian length + JSON), never the tensors.

How vLLM spends a GPU (per GPU, tensor parallel shards everything evenly), and the assumptions made here:

- budget = total_mib x gpu_memory_utilization. vLLM refuses at startup when the free memory is below it
  ("Free memory on device ... is less than desired GPU memory utilization").
- weights: the target's parameters (from the safetensors headers when the weights are here, else ESTIMATED from the
  config: embeddings + layers x (attention + MLP) + LM head; norms and biases ignored) x bytes per parameter, divided
  by tensor_parallel_size. The drafter's weights are added the same way; a DFlash drafter shares the target's
  embeddings and LM head (not counted twice), MTP adds `mtp_num_hidden_layers` decoder layers of the target, ngram
  adds nothing.
- reserve (activation/graph, ASSUMED, not measured): the profile run's activation peak
  dtype_bytes x max_num_batched_tokens x (4 x hidden + 2 x intermediate / TP) + logits (fp32) for max_num_seqs,
  plus non-torch memory (NON_TORCH_MIB: CUDA context, NCCL buffers with TP > 1), plus CUDA-graph memory
  (GRAPH_MIB, none with --enforce-eager).
- KV cache = budget - weights - reserve. Bytes per token per GPU = sum over the attention layers of the target and
  the drafter of 2 (K and V) x ceil(kv_heads / TP) x head_dim x kv_dtype_bytes. vLLM allocates every attention
  layer from one block pool, so the token figure counts full and sliding layers alike ("GPU KV cache size").
  A request of L tokens needs L + k slots in full-attention layers, min(L + k, window) in sliding-window layers, and
  a fixed-size state in linear-attention layers (Gated DeltaNet / Mamba style: heads x key_dim x value_dim + a
  convolution state), which does not grow with L.
- max concurrency at max_model_len = KV bytes / bytes of one request of max_model_len tokens.
- The CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB): then KV = that, weights live in RAM.

Verdicts: "fits"; "tight" (a warning) when it would no longer fit with weights + reserve TOLERANCE larger (the
model's own error could flip it); "does-not-fit" when vLLM will refuse (with the changes that would fit); "unknown"
when part of the layout is not understood (said explicitly, never guessed, never a refusal).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass, field, replace

from orchestrator.core.errors import CheckFailed

MIB = 1 << 20

TOLERANCE = 0.10  # the model's documented error on weights + reserve (checked against vllm-cpu 0.32.0's figures)
NON_TORCH_MIB = {1: 256, "tp": 768}  # CUDA context etc.; with TP > 1 NCCL buffers as well (ASSUMED)
GRAPH_MIB = 512  # CUDA graphs per GPU (ASSUMED), none with --enforce-eager
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens for online serving (ASSUMED when unset)
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs (ASSUMED when unset)
ASSUMED_GPU_MIB = 81559  # an 80 GB H100/A100 as nvidia-smi reports it, when nothing better is given

DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "float": 4, "fp32": 4,
               "float8_e4m3fn": 1, "fp8": 1}
SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                     "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


class NotUnderstood(Exception):
    """A part of a config this model does not understand; the message says which (the verdict becomes unknown)."""


# ------------------------------------------------------------------ reading a config


def text_config(cfg: dict) -> dict:
    """The language model's fields: `text_config` when nested (Qwen3.5/3.6 `qwen3_5_text`, VLMs), else the config."""
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) and tc.get("num_hidden_layers") else cfg


def _int(c: dict, *keys, default=None):
    for k in keys:
        v = c.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    if default is not None:
        return default
    raise NotUnderstood(f"no {' / '.join(keys)} in the config")


def dtype_bytes(cfg: dict) -> tuple[float, str]:
    """Bytes per weight and how that was read: torch_dtype/dtype; a simple quantization_config (fp8, or 4/8-bit
    GPTQ/AWQ, scales ignored); anything else NotUnderstood."""
    tc = text_config(cfg)
    q = cfg.get("quantization_config") or tc.get("quantization_config")
    if q:
        method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
        bits = q.get("bits") if isinstance(q, dict) else None
        if method == "fp8":
            return 1.0, "fp8 (quantization_config)"
        if method in ("gptq", "awq") and bits in (4, 8):
            return bits / 8, f"{method} {bits}-bit (quantization_config; group scales ignored, an estimate)"
        raise NotUnderstood(f"quantization_config {method or '?'} is not understood by the sizing model")
    for c in (tc, cfg):
        for k in ("torch_dtype", "dtype"):
            v = c.get(k)
            if isinstance(v, str):
                if v.lower() in DTYPE_BYTES:
                    return float(DTYPE_BYTES[v.lower()]), v
                raise NotUnderstood(f"dtype {v!r} is not understood")
    raise NotUnderstood("no torch_dtype / dtype in the config")


def head_dim(tc: dict) -> int:
    hd = tc.get("head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    return _int(tc, "hidden_size") // _int(tc, "num_attention_heads")


def layer_kinds(tc: dict) -> list[str]:
    """One of FULL/SLIDING/LINEAR per layer, from layer_types as written (without layer_types: all full, or all
    sliding with use_sliding_window and a window). An unknown layer type is NotUnderstood."""
    n = _int(tc, "num_hidden_layers")
    lts = tc.get("layer_types")
    if lts is None:
        return [SLIDING if tc.get("use_sliding_window") and tc.get("sliding_window") else FULL] * n
    if not isinstance(lts, list) or len(lts) != n:
        raise NotUnderstood(f"layer_types has {len(lts) if isinstance(lts, list) else '?'} entries for {n} layers")
    bad = [t for t in lts if t not in (FULL, SLIDING, LINEAR)]
    if bad:
        raise NotUnderstood(f"layer type {bad[0]!r} is not understood")
    return list(lts)


LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")


def linear_dims(tc: dict) -> dict:
    missing = [k for k in LINEAR_KEYS if not isinstance(tc.get(k), int)]
    if missing:
        raise NotUnderstood("linear-attention layers, but the config lacks " + ", ".join(missing)
                            + " (a trimmed config?): their fixed-size state and weights are not known")
    return {k: tc[k] for k in LINEAR_KEYS}


def estimate_params(cfg: dict, *, layers: int | None = None, embeddings: bool = True) -> int:
    """Parameters from the config (an ESTIMATE: norms, biases, gates and rotary buffers ignored). `layers` counts only
    that many decoder layers of the model's own pattern (MTP); embeddings=False leaves out embed + LM head (DFlash)."""
    tc = text_config(cfg)
    h = _int(tc, "hidden_size")
    inter = _int(tc, "intermediate_size")
    nq = _int(tc, "num_attention_heads")
    nkv = _int(tc, "num_key_value_heads", default=nq)
    hd = head_dim(tc)
    kinds = layer_kinds(tc)
    if layers is not None:
        kinds = [FULL] * layers
    attn = h * nq * hd * 2 + h * nkv * hd * 2  # q, o; k, v
    experts = tc.get("num_local_experts") or tc.get("num_experts")
    if experts:
        moe_inter = _int(tc, "moe_intermediate_size", "intermediate_size")
        shared = tc.get("shared_expert_intermediate_size") or 0
        mlp = experts * 3 * h * moe_inter + 3 * h * shared + h * experts
    else:
        mlp = 3 * h * inter
    total = 0
    for k in kinds:
        if k == LINEAR:
            d = linear_dims(tc)
            qk = d["linear_num_key_heads"] * d["linear_key_head_dim"]
            v = d["linear_num_value_heads"] * d["linear_value_head_dim"]
            total += h * (2 * qk + 2 * v) + h * 2 * d["linear_num_value_heads"] + (2 * qk + v) * \
                d["linear_conv_kernel_dim"] + v * h + mlp
        else:
            total += attn + mlp
    if embeddings:
        vocab = _int(tc, "vocab_size")
        tied = tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        total += vocab * h * (1 if tied else 2)
    return total


def weights_from_safetensors(directory: str) -> tuple[int, int] | None:
    """(bytes, parameters) summed over the *.safetensors headers in a local directory, or None when there are none.
    Reads each header only (8-byte little-endian length + JSON)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    except OSError:
        return None
    if not names:
        return None
    nbytes = params = 0
    for n in names:
        with open(os.path.join(directory, n), "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100 * MIB:
                raise NotUnderstood(f"{n}: safetensors header of {length} bytes")
            header = json.loads(fh.read(length))
        for k, t in header.items():
            if k == "__metadata__":
                continue
            count = math.prod(t["shape"])
            params += count
            nbytes += count * SAFETENSORS_BYTES.get(t["dtype"], 2)
    return nbytes, params


# ------------------------------------------------------------------ the model


@dataclass
class Inputs:
    target: dict
    drafter: dict | None = None
    method: str | None = None  # dflash, mtp, eagle, eagle3, draft_model, ngram, or None
    k: int = 0  # num_speculative_tokens
    tp: int = 1
    gmu: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_total_mib: float | None = None  # per GPU
    gpu_free_mib: float | None = None  # per GPU, the least free one (nvidia-smi), when known
    gpu_source: str = "assumed"  # where gpu_total_mib came from
    cpu_kvcache_space_gib: float | None = None  # VLLM_CPU_KVCACHE_SPACE: the CPU build
    enforce_eager: bool = False
    kv_cache_dtype: str | None = None  # fp8* halves the KV bytes
    target_weights: tuple[int, int] | None = None  # (bytes, params) from safetensors headers
    drafter_weights: tuple[int, int] | None = None
    max_gpus: int | None = None  # the GPUs the target has (measured): no fix suggests a larger tensor_parallel_size


@dataclass
class Sizing:
    verdict: str  # fits | tight | does-not-fit | unknown
    reasons: list = field(default_factory=list)  # why not fits (vLLM's own words where it will refuse)
    notes: list = field(default_factory=list)  # assumptions and estimates this figure rests on
    unknown: list = field(default_factory=list)  # what is not understood
    fixes: list = field(default_factory=list)  # changes that would fit
    mode: str = "gpu"  # gpu | cpu
    tp: int = 1
    gmu: float = 0.9
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # what the activations are sized with: the argv's, or vLLM's default
    gpu_total_mib: float | None = None
    gpu_free_mib: float | None = None
    gpu_source: str = "assumed"
    budget_mib: float | None = None
    weights_mib: float | None = None  # per GPU, target + drafter
    target_weights_mib: float | None = None
    drafter_weights_mib: float | None = None
    weights_source: str = ""
    reserve_mib: float | None = None
    kv_cache_mib: float | None = None
    kv_bytes_per_token: int | None = None  # per GPU, every attention layer
    kv_tokens: int | None = None  # what fits: tokens of every attention layer (linear layers: a fixed state)
    kv_tokens_logged: int | None = None  # what vLLM logs as "GPU KV cache size" (see logged_bytes_per_token)
    kv_logged_bytes_per_token: int | None = None
    request_mib: float | None = None  # one request of max_model_len tokens
    max_concurrency: float | None = None
    max_model_len_that_fits: int | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 3)
        return d


@dataclass
class _Layout:
    bytes_per_token: int = 0  # full + sliding layers, per GPU
    full_per_token: int = 0
    sliding: list = field(default_factory=list)  # [(window, bytes per token)]
    fixed_per_seq: int = 0  # linear-attention state, per GPU
    linear_layers: int = 0
    slot_bytes: int = 0  # the largest attention layer's bytes per token (the page every layer group gets)


def _kv_layout(cfg: dict, tp: int, kv_bytes: float, out: _Layout, notes: list, who: str, only_full: int | None = None):
    tc = text_config(cfg)
    nkv = _int(tc, "num_key_value_heads", "num_attention_heads")
    per_layer = int(2 * math.ceil(nkv / tp) * head_dim(tc) * kv_bytes)
    kinds = [FULL] * only_full if only_full is not None else layer_kinds(tc)
    window = tc.get("sliding_window")
    if any(k in (FULL, SLIDING) for k in kinds):
        out.slot_bytes = max(out.slot_bytes, per_layer)
    for kind in kinds:
        if kind == LINEAR:
            out.linear_layers += 1
        if kind == FULL:
            out.bytes_per_token += per_layer
            out.full_per_token += per_layer
        elif kind == SLIDING:
            if not isinstance(window, int) or window <= 0:
                raise NotUnderstood(f"{who}: sliding-window layers without a sliding_window")
            out.bytes_per_token += per_layer
            out.sliding.append((window, per_layer))
        else:
            d = linear_dims(tc)
            nv = math.ceil(d["linear_num_value_heads"] / tp)
            nk = math.ceil(d["linear_num_key_heads"] / tp)
            state = nv * d["linear_key_head_dim"] * d["linear_value_head_dim"]
            conv = (2 * nk * d["linear_key_head_dim"] + nv * d["linear_value_head_dim"]) * \
                (d["linear_conv_kernel_dim"] - 1)
            out.fixed_per_seq += int((state + conv) * kv_bytes)
    n = {k: kinds.count(k) for k in (FULL, SLIDING, LINEAR) if kinds.count(k)}
    notes.append(f"{who}: " + ", ".join(f"{v} {k.replace('_attention', '')}" for k, v in n.items())
                 + f" layers, {nkv} KV heads x {head_dim(tc)}"
                 + (f", window {window}" if SLIDING in n else ""))


def _also(s: Sizing, what: str, fn) -> None:
    """Run fn only to report what else is not understood (so one run names every missing piece)."""
    try:
        fn()
    except NotUnderstood as e:
        s.unknown.append(f"{what}: {e}")


def _request_bytes(lay: _Layout, length: int, k: int) -> int:
    slots = length + k
    return lay.full_per_token * slots + sum(b * min(slots, w) for w, b in lay.sliding) + lay.fixed_per_seq


def _reserve_mib(tc: dict, inp: Inputs, wbytes: float) -> float:
    h = _int(tc, "hidden_size")
    inter = _int(tc, "intermediate_size", default=4 * h)
    vocab = _int(tc, "vocab_size", default=0)
    tokens = inp.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    seqs = inp.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    act = wbytes * tokens * (4 * h + 2 * inter / inp.tp) + 4 * seqs * (inp.k + 1) * vocab / inp.tp
    non_torch = NON_TORCH_MIB["tp"] if inp.tp > 1 else NON_TORCH_MIB[1]
    return act / MIB + non_torch + (0 if inp.enforce_eager else GRAPH_MIB)


def size(inp: Inputs, *, fixes: bool = True) -> Sizing:
    """The whole prediction (fixes=False: without searching for the changes that would fit). Never raises for a config it does not understand: that is verdict "unknown"."""
    s = Sizing(verdict="unknown", tp=inp.tp, gmu=inp.gmu, max_model_len=inp.max_model_len,
               max_num_batched_tokens=inp.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS,
               gpu_total_mib=inp.gpu_total_mib, gpu_free_mib=inp.gpu_free_mib, gpu_source=inp.gpu_source,
               mode="cpu" if inp.cpu_kvcache_space_gib is not None else "gpu")
    tc = text_config(inp.target)
    method = inp.method or None
    lay = _Layout()
    # ---- weights
    wb = None
    try:
        try:
            wb, how = dtype_bytes(inp.target)
        except NotUnderstood as e:
            if not inp.target_weights:
                _also(s, "weights", lambda: estimate_params(inp.target))  # report a layout problem as well
            raise e
        if inp.target_weights:
            tbytes, tparams = inp.target_weights
            s.weights_source = f"target: {tparams / 1e9:.2f} B parameters from the safetensors headers"
        else:
            tparams = estimate_params(inp.target)
            tbytes = tparams * wb
            s.weights_source = f"target: {tparams / 1e9:.2f} B parameters ESTIMATED from config.json, {how}"
        if method == "mtp":
            mtp_layers = tc.get("mtp_num_hidden_layers") or tc.get("num_nextn_predict_layers")
            if not mtp_layers:
                raise NotUnderstood("method mtp, but the target config has no mtp_num_hidden_layers")
            tbytes += estimate_params(inp.target, layers=mtp_layers, embeddings=False) * wb
            s.notes.append(f"MTP: {mtp_layers} extra decoder layer(s) of the target (an estimate)")
        s.target_weights_mib = tbytes / inp.tp / MIB
        dbytes = 0.0
        if inp.drafter and method in ("dflash", "eagle", "eagle3", "draft_model"):
            if inp.drafter_weights:
                dbytes, dparams = inp.drafter_weights
                s.weights_source += f"; drafter: {dparams / 1e9:.2f} B parameters from the safetensors headers"
            else:
                dwb, dhow = dtype_bytes(inp.drafter)
                shares = method in ("dflash", "eagle", "eagle3")
                dparams = estimate_params(inp.drafter, embeddings=not shares)
                dbytes = dparams * dwb
                s.weights_source += (f"; drafter: {dparams / 1e9:.2f} B parameters ESTIMATED, {dhow}"
                                     + (" (embeddings and LM head shared with the target)" if shares else ""))
        s.drafter_weights_mib = dbytes / inp.tp / MIB
        s.weights_mib = s.target_weights_mib + s.drafter_weights_mib
    except NotUnderstood as e:
        s.unknown.append(f"weights: {e}")
    # ---- KV layout
    kvb = None
    try:
        kvb = wb if wb and wb >= 2 else DTYPE_BYTES.get(str(tc.get("torch_dtype") or tc.get("dtype")
                                                             or inp.target.get("torch_dtype")
                                                             or inp.target.get("dtype") or "").lower())
        if not kvb:
            _also(s, "KV cache", lambda: _kv_layout(inp.target, inp.tp, 2, _Layout(), [], "target"))
            raise NotUnderstood("the KV-cache dtype (the model's dtype) is not known")
        if str(inp.kv_cache_dtype or "").startswith("fp8"):
            kvb = 1
        _kv_layout(inp.target, inp.tp, kvb, lay, s.notes, "target")
        if method == "mtp":
            _kv_layout(inp.target, inp.tp, kvb, lay, s.notes, "MTP", only_full=tc.get("mtp_num_hidden_layers") or 1)
        elif inp.drafter and method in ("dflash", "eagle", "eagle3", "draft_model"):
            _kv_layout(inp.drafter, inp.tp, kvb, lay, s.notes, "drafter")
        s.kv_bytes_per_token = lay.bytes_per_token
        if lay.fixed_per_seq:
            s.notes.append(f"linear-attention state: {lay.fixed_per_seq / MIB:.1f} MiB per sequence per GPU")
    except NotUnderstood as e:
        s.unknown.append(f"KV cache: {e}")
        lay = None
    if inp.max_model_len is None:
        s.unknown.append("max_model_len: not set (vLLM then takes the model's maximum or auto-fits it)")
    # ---- budget
    if s.mode == "cpu":
        s.budget_mib = s.kv_cache_mib = inp.cpu_kvcache_space_gib * 1024
        s.notes.append(f"CPU build: KV cache = VLLM_CPU_KVCACHE_SPACE = {inp.cpu_kvcache_space_gib:g} GiB; "
                       "weights live in RAM")
    else:
        if inp.gpu_total_mib is None:
            s.unknown.append("GPU memory: not known (set sizing.gpu_total_mib or give --gpu-mib)")
        else:
            s.budget_mib = inp.gpu_total_mib * inp.gmu
            if wb is not None:
                try:
                    s.reserve_mib = _reserve_mib(tc, inp, wb)
                except NotUnderstood as e:
                    s.unknown.append(f"reserve: {e}")
            if s.weights_mib is not None and s.reserve_mib is not None:
                s.kv_cache_mib = s.budget_mib - s.weights_mib - s.reserve_mib
            if s.reserve_mib is not None:
                s.notes.append(f"reserve (activation peak + non-torch + CUDA graphs) is an assumption: "
                               f"{s.reserve_mib:.0f} MiB per GPU")
    if lay is not None and lay.bytes_per_token:
        s.kv_logged_bytes_per_token = logged_bytes_per_token(lay)
    if lay is not None and s.kv_cache_mib is not None and lay.bytes_per_token:
        s.kv_tokens = max(0, int(s.kv_cache_mib * MIB // lay.bytes_per_token))
        s.kv_tokens_logged = max(0, int(s.kv_cache_mib * MIB // s.kv_logged_bytes_per_token))
        if s.kv_tokens_logged != s.kv_tokens:
            s.notes.append(f"vLLM will log `GPU KV cache size: ~{s.kv_tokens_logged:,} tokens`, fewer than the "
                           f"{s.kv_tokens:,} that fit: its hybrid allocator counts each of the "
                           f"{lay.linear_layers} linear-attention layers as an attention-sized slot")
        if inp.max_model_len:
            req = _request_bytes(lay, inp.max_model_len, inp.k)
            s.request_mib = req / MIB
            s.max_concurrency = max(0.0, s.kv_cache_mib * MIB / req)
        s.max_model_len_that_fits = _longest(lay, s.kv_cache_mib * MIB, inp.k)
        mpe = _int(text_config(inp.target), "max_position_embeddings", default=0)
        if mpe and s.max_model_len_that_fits > mpe:  # vLLM refuses a max_model_len above the model's own limit
            s.max_model_len_that_fits = int(mpe)
            s.notes.append(f"the longest max_model_len is the model's max_position_embeddings ({int(mpe):,}): "
                           "more would fit in the KV cache, but vLLM refuses a longer max_model_len")
    s.unknown = _merge(s.unknown)
    _judge(s, inp, lay, fixes)
    return s


def logged_bytes_per_token(lay: _Layout) -> int:
    """Bytes per token in the figure vLLM logs as `GPU KV cache size: N tokens`. vLLM (v1 kv_cache_utils) gives
    every layer group pages of one size and logs num_blocks // len(kv_cache_groups) * block_size; with
    linear-attention (Mamba / Gated DeltaNet) layers each of them is one more attention-sized slot, so the logged
    figure is the cache divided by (attention bytes per token + linear layers x the largest attention layer's).
    Without linear layers this is just the attention bytes per token. Checked against a published log of
    Qwen3.6-27B + DFlash at TP 2 (docs/playbooks.md#will-it-fit); vLLM's padding layers and block rounding are
    not modelled (they lower its figure by a few per cent)."""
    return lay.bytes_per_token + lay.linear_layers * lay.slot_bytes


def _merge(items: list) -> list:
    """"weights: X", "KV cache: X" -> "weights, KV cache: X" (one missing piece said once)."""
    by: dict = {}
    for it in items:
        what, _, why = it.partition(": ")
        by.setdefault(why, []).append(what)
    return [f"{', '.join(dict.fromkeys(w))}: {why}" for why, w in by.items()]


def _longest(lay: _Layout, kv: float, k: int) -> int:
    """The longest max_model_len one request fits in (a multiple of 256; 0 when none)."""
    lo, hi = 0, 1 << 24
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _request_bytes(lay, mid, k) <= kv:
            lo = mid
        else:
            hi = mid - 1
    return lo // 256 * 256


def _judge(s: Sizing, inp: Inputs, lay: _Layout | None, fixes: bool = True) -> None:
    if s.mode == "gpu" and s.budget_mib is not None and inp.gpu_free_mib is not None \
            and inp.gpu_free_mib < s.budget_mib:
        s.verdict = "does-not-fit"
        s.reasons.append(f"Free memory on device ({inp.gpu_free_mib / 1024:.1f} GiB) is less than desired GPU memory "
                         f"utilization ({inp.gmu:g}, {s.budget_mib / 1024:.1f} GiB): vLLM refuses at startup")
        s.fixes.append(f"free the GPUs, or gpu_memory_utilization <= {math.floor(inp.gpu_free_mib / inp.gpu_total_mib * 100) / 100:.2f}")
        return
    if s.unknown:
        s.verdict = "unknown"
        return
    if s.kv_cache_mib is None or lay is None:
        return
    if s.kv_cache_mib <= 0:
        s.verdict = "does-not-fit"
        s.reasons.append(f"weights {s.weights_mib / 1024:.1f} GiB + reserve {s.reserve_mib / 1024:.1f} GiB exceed "
                         f"the budget {s.budget_mib / 1024:.1f} GiB per GPU: vLLM: No available memory for the cache "
                         "blocks")
    elif s.max_concurrency is not None and s.max_concurrency < 1:
        s.verdict = "does-not-fit"
        s.reasons.append(f"one request of max_model_len {inp.max_model_len} needs {s.request_mib / 1024:.2f} GiB of "
                         f"KV cache per GPU, {s.kv_cache_mib / 1024:.2f} GiB are left: vLLM: To serve at least one "
                         "request with the model's max seq len ...")
    else:
        s.verdict = "fits"
        if s.mode == "gpu":
            worse = s.budget_mib - (s.weights_mib + s.reserve_mib) * (1 + TOLERANCE)
            need = s.request_mib * MIB if s.request_mib is not None else 0
            if worse * MIB < need or worse <= 0:
                s.verdict = "tight"
                s.reasons.append(f"fits with {s.kv_cache_mib / 1024:.2f} GiB of KV cache per GPU, but not if weights"
                                 f" + reserve are {TOLERANCE:.0%} more than predicted (the model's tolerance)")
        if s.verdict == "fits":
            return
    if fixes:
        _fixes(s, inp)


def _fixes(s: Sizing, inp: Inputs) -> None:
    """The changes that would fit, each computed with the same model."""
    if s.max_model_len_that_fits and inp.max_model_len and s.max_model_len_that_fits < inp.max_model_len:
        s.fixes.append(f"max_model_len {s.max_model_len_that_fits} (the longest that fits)")
    if s.mode == "cpu":
        if inp.max_model_len and s.kv_bytes_per_token:
            need = (s.request_mib or 0) / 1024
            s.fixes.append(f"VLLM_CPU_KVCACHE_SPACE >= {math.ceil(need * (1 + TOLERANCE)):d} (GiB)")
        return
    for g in [x / 100 for x in range(int(inp.gmu * 100) + 1, 99)]:
        t = size(replace(inp, gmu=g), fixes=False)
        if t.verdict == "fits":
            s.fixes.append(f"gpu_memory_utilization {g:.2f}")
            break
    heads = _int(text_config(inp.target), "num_attention_heads", default=1)
    for tp in (2, 4, 8, 16):
        if inp.max_gpus is not None and tp > inp.max_gpus:  # never a fix the target cannot take
            break
        if tp > inp.tp and heads % tp == 0:
            t = size(replace(inp, tp=tp), fixes=False)
            if t.verdict == "fits":
                s.fixes.append(f"tensor_parallel_size {tp} ({tp} GPUs" +
                               (f" of the {inp.max_gpus} the target has)" if inp.max_gpus else ")"))
                break
    if s.weights_mib and s.budget_mib and s.weights_mib > 0.5 * s.budget_mib:
        s.fixes.append("a quantised checkpoint (fp8 halves the bf16 weights)")


# ------------------------------------------------------------------ rendering


def _gib(mib) -> str:
    return "?" if mib is None else f"{mib / 1024:.2f} GiB"


def table(s: Sizing) -> list[str]:
    """The `deploy size` table, one line each."""
    rows = []
    if s.mode == "cpu":
        rows.append(("KV cache (VLLM_CPU_KVCACHE_SPACE)", _gib(s.kv_cache_mib)))
    else:
        rows.append(("GPU memory per GPU", f"{_gib(s.gpu_total_mib)} ({s.gpu_source})"))
        if s.gpu_free_mib is not None:
            rows.append(("free now (least free GPU)", _gib(s.gpu_free_mib)))
        rows.append((f"budget (x gpu_memory_utilization {s.gmu:g})", _gib(s.budget_mib)))
        rows.append((f"weights per GPU (TP {s.tp})", _gib(s.weights_mib)))
        rows.append(("activation/graph reserve (assumed)", _gib(s.reserve_mib)))
        rows.append(("KV cache per GPU", _gib(s.kv_cache_mib)))
    rows.append(("KV bytes per token per GPU", "?" if s.kv_bytes_per_token is None else f"{s.kv_bytes_per_token:,}"))
    rows.append(("KV cache tokens", "?" if s.kv_tokens is None else f"{s.kv_tokens:,}"))
    if s.kv_tokens_logged is not None and s.kv_tokens_logged != s.kv_tokens:
        rows.append(("  as vLLM logs it (GPU KV cache size)", f"{s.kv_tokens_logged:,}"))
    rows.append((f"max concurrency at max_model_len {s.max_model_len or '?'}",
                 "?" if s.max_concurrency is None else f"{s.max_concurrency:.2f}x"))
    rows.append(("longest max_model_len that fits",
                 "?" if s.max_model_len_that_fits is None else f"{s.max_model_len_that_fits:,}"))
    w = max(len(a) for a, _ in rows)
    return [f"  {a:<{w}}  {b}" for a, b in rows]


def summary(s: Sizing) -> str:
    """One line: the verdict with its figures (plan's `fits:` line)."""
    if s.verdict == "unknown":
        return "unknown: " + "; ".join(s.unknown or ["not enough is known"]) + " (not a refusal)"
    figs = (f"KV cache {_gib(s.kv_cache_mib)} per GPU, {s.kv_tokens:,} tokens, "
            f"{s.max_concurrency:.2f}x at max_model_len {s.max_model_len}"
            if s.kv_tokens is not None and s.max_concurrency is not None else "")
    head = {"fits": "fits", "tight": "tight (warning)", "does-not-fit": "does not fit"}[s.verdict]
    return f"{head}: " + "; ".join([x for x in [figs] + s.reasons if x])


# ------------------------------------------------------------------ from a playbook (still no I/O: read at load)


def _flag(argv: list, name: str):
    """The value of --name V / --name=V in argv, True for a bare flag, None when absent."""
    for i, a in enumerate(argv):
        if a == name:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            return nxt if nxt is not None and not str(nxt).startswith("--") else True
        if str(a).startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def from_playbook(pb, *, tp: int | None = None, gmu: float | None = None, max_model_len: int | None = None,
                  gpu_mib: float | None = None, gpu_free_mib: float | None = None,
                  cpu_kvcache_space_gib: float | None = None) -> Inputs | None:
    """The model's inputs for a loaded Playbook and "what if" overrides; None when no target config is here
    (sizing.target_config unset)."""
    if pb.target_config is None:
        return None
    sv, sp, sz = pb.conf.serve, pb.conf.speculative, pb.conf.sizing
    extra = [str(a) for a in sv.extra_args]
    seqs = _flag(extra, "--max-num-seqs")
    cpu = cpu_kvcache_space_gib
    if cpu is None and sv.env.get("VLLM_CPU_KVCACHE_SPACE"):
        try:
            cpu = float(sv.env["VLLM_CPU_KVCACHE_SPACE"])
        except ValueError:
            cpu = None
    if gpu_mib is not None:
        total, source = float(gpu_mib), "--gpu-mib"
    elif sz.gpu_total_mib:
        total, source = float(sz.gpu_total_mib), "sizing.gpu_total_mib"
    else:
        total, source = float(ASSUMED_GPU_MIB), "assumed: an 80 GB GPU; set sizing.gpu_total_mib or --gpu-mib"
    return Inputs(target=pb.target_config, drafter=pb.drafter_config, method=sp.method,
                  k=sp.num_speculative_tokens, tp=tp or sv.tensor_parallel_size,
                  gmu=gmu if gmu is not None else sv.gpu_memory_utilization,
                  max_model_len=max_model_len or sv.max_model_len,
                  max_num_seqs=int(seqs) if isinstance(seqs, str) and seqs.isdigit() else None,
                  # what serve_argv passes (spec._conf derives it once); None: vLLM's own default, assumed below
                  max_num_batched_tokens=sv.max_num_batched_tokens, gpu_total_mib=total,
                  gpu_free_mib=gpu_free_mib, gpu_source=source, cpu_kvcache_space_gib=cpu,
                  enforce_eager=bool(_flag(extra, "--enforce-eager")),
                  kv_cache_dtype=_flag(extra, "--kv-cache-dtype") if isinstance(_flag(extra, "--kv-cache-dtype"),
                                                                                 str) else None,
                  target_weights=getattr(pb, "target_weights", None))


def assess(pb, s: Sizing | None) -> tuple[str, str]:
    """(level, line) for plan/up: level refuse (a certain failure: GPU memory given, not assumed, or the CPU
    build's KV space), warn (tight without sizing.accept_tight, or a failure on an assumed GPU), ok, or unknown."""
    if s is None:
        return "unknown", ("unknown: no local copy of the target's config.json (set sizing.target_config); "
                           "not a refusal")
    line = summary(s)
    if s.fixes:
        line += "; would fit with: " + ", or ".join(s.fixes)
    if s.verdict == "does-not-fit":
        if s.mode == "cpu" or not s.gpu_source.startswith("assumed"):
            return "refuse", line
        return "warn", line + f" (on an {s.gpu_source})"
    if s.verdict == "tight":
        return ("ok", line + " (accepted: sizing.accept_tight)") if pb.conf.sizing.accept_tight else ("warn", line)
    return ("ok" if s.verdict == "fits" else "unknown"), line


def check_playbook(pb) -> dict:
    """plan/up's sizing check of one single-target playbook: {"level", "line", "sizing"} (see assess)."""
    inp = from_playbook(pb)
    s = size(inp) if inp is not None else None
    level, line = assess(pb, s)
    return {"level": level, "line": line, "sizing": s.as_dict() if s else None}


def check_measured(pb, gpu_mem: dict | None, gpu_count: int | None = None) -> dict | None:
    """The sizing check on the GPUs as the host's nvidia-smi measures them ({index: {used, total}}, the
    gpu-plumbing check's one host exec): the smallest total of the playbook's GPUs. None without a target config or
    a reading of every assigned GPU. gpu_count: the GPUs the container has (its /dev/nvidiaN), else the host's
    count bounds a suggested tensor_parallel_size. {"level", "line", "sizing", "gpu_mib"} as check_playbook."""
    if pb.target_config is None or not gpu_mem:
        return None
    got = [gpu_mem.get(g) for g in pb.gpus]
    if not got or any(not isinstance(x, dict) or not x.get("total") for x in got):
        return None
    total = min(float(x["total"]) for x in got)
    inp = from_playbook(pb, gpu_mib=total)  # not None: pb.target_config is set
    s = size(replace(inp, gpu_source=f"measured: nvidia-smi on {pb.host}, GPUs {list(pb.gpus)}",
                     max_gpus=gpu_count or len(gpu_mem)))
    level, line = assess(pb, s)
    return {"level": level, "line": line, "sizing": s.as_dict(), "gpu_mib": total}


def measured_refusal(pb, fits: dict) -> tuple[str, str]:
    """(message, fix) of a playbook that does not fit on the GPUs as measured (check_measured level refuse): the
    same words from up's gpu-plumbing step and from verify."""
    return (f"{pb.name} does not fit on the GPUs as measured on {pb.host} ({fits['gpu_mib']:.0f} MiB each): "
            f"{fits['line']}",
            f"change the playbook as listed, or try values with deploy size {pb.name} --gpu-mib "
            f"{fits['gpu_mib']:.0f} --max-model-len N --tp N --gmu F (docs/playbooks.md#will-it-fit)")


def refuse_if_certain(pb) -> None:
    """Raise CheckFailed (exit 1, nothing run) when a target of pb certainly does not fit (level refuse)."""
    for m in (pb.members or [pb]):
        c = check_playbook(m)
        if c["level"] == "refuse":
            raise CheckFailed(f"{m.name} does not fit on {m.host}/{m.vmid}: {c['line']}; nothing was run",
                              fix=f"change the playbook as listed, or try values with deploy size {m.name} "
                                  "--max-model-len N --tp N --gmu F (docs/playbooks.md#will-it-fit)",
                              details={"fits": c})


# ------------------------------------------------------------------ predicted vs reported (vLLM's own log lines)

REPORTED = {"weights_gib": re.compile(r"Model loading took ([0-9.]+) GiB"),
            "kv_cache_gib": re.compile(r"Available KV cache memory: ([0-9.]+) GiB"),
            "kv_tokens": re.compile(r"(?:GPU|CPU) KV cache size: ([0-9,]+) tokens")}
# the tolerances a prediction is held to (docs/playbooks.md#will-it-fit): beyond them the model is wrong (ours)
REPORT_TOLERANCE = {"weights_gib": 0.10, "kv_tokens": 0.15, "kv_tokens_cpu": 0.01}


def parse_reported(lines) -> dict:
    """vLLM's own figures from its log lines (the last of each wins): weights_gib, kv_cache_gib, kv_tokens."""
    out: dict = {}
    for ln in lines:
        for k, rx in REPORTED.items():
            m = rx.search(ln)
            if m:
                v = m.group(1).replace(",", "")
                out[k] = int(v) if k == "kv_tokens" else float(v)
    return out


def compare(s: Sizing, reported: dict) -> dict:
    """{"rows": [{figure, predicted, reported, off, tolerance, within}], "off": [figures beyond tolerance]}."""
    rows = []
    pred = {"weights_gib": None if s.weights_mib is None else s.weights_mib / 1024,
            "kv_tokens": s.kv_tokens_logged if s.kv_tokens_logged is not None else s.kv_tokens}
    for k in ("weights_gib", "kv_tokens"):
        p, r = pred[k], reported.get(k)
        if p is None or r is None or (k == "weights_gib" and s.mode == "cpu"):
            continue
        off = (p - r) / r if r else (0.0 if p == 0 else math.inf)
        tol = REPORT_TOLERANCE["kv_tokens_cpu" if k == "kv_tokens" and s.mode == "cpu" else k]
        rows.append({"figure": k, "predicted": round(p, 3), "reported": r, "off": round(off, 4), "tolerance": tol,
                     "within": abs(off) <= tol})
    return {"rows": rows, "off": [r["figure"] for r in rows if not r["within"]], "reported": reported,
            "verdict": s.verdict}


def compare_line(c: dict) -> str:
    if not c["rows"]:
        rep = ", ".join(f"{k} {v:,}" for k, v in sorted(c.get("reported", {}).items())) or "no figure"
        why = "the prediction is unknown" if c.get("verdict") == "unknown" else "nothing to compare"
        return f"sizing: {why}; vLLM reported {rep}"
    parts = [f"{r['figure']} predicted {r['predicted']:,} vs reported {r['reported']:,} ({r['off']:+.1%})"
             for r in c["rows"]]
    line = "sizing: " + "; ".join(parts)
    if c["off"]:
        line += (f"; {', '.join(c['off'])} off by more than the documented tolerance: the sizing model is wrong "
                 "here (ours to fix; please report it with the config.json)")
    return line
