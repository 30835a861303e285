"""The installed fake vllm package: version, commit id, fix markers, compiled extensions, faults re-layout."""

import json
import os
import subprocess
import sys

import pytest

from fakevllm_support import build

PLUS1 = "# Add 1 to convert DFlash's aux layer id semantics"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
EAGLE3 = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
DFLASH = "vllm/model_executor/models/qwen3_dflash.py"


def _read(sp, rel):
    p = os.path.join(sp, rel)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return f.read()


def _import(sp, env=None, code="import vllm, vllm.platforms; from vllm.platforms import current_platform; "
                               "print(vllm.__version__, vllm.__commit_id__)"):
    e = {k: v for k, v in os.environ.items() if not k.startswith("VPD_")}
    e["PYTHONPATH"] = sp
    e["VPD_FAKE_VLLM_FAULTS"] = os.path.join(sp, "no-faults.json")
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("version,build_,plus1_runner,plus1_eagle,pr,resolve,exts", [
    ("0.21.0", "release", False, None, False, False, ["_C.abi3.so"]),
    ("0.23.0", "release", True, None, False, False, ["_C.abi3.so"]),
    ("0.24.0", "release", True, True, False, False, ["_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"]),
    ("0.25.0", "release", True, True, False, True, ["_C_stable_libtorch.abi3.so"]),
    ("0.30.0", "release", True, True, False, True, ["_C_stable_libtorch.abi3.so"]),
    ("0.34.0", "release", False, True, False, True, ["_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"]),
    ("0.34.0", "pr40898", False, True, True, False, ["_C_stable_libtorch.abi3.so"]),
    ("0.21.0", "pr40898", True, None, True, False, ["_C.abi3.so"]),
])
def test_markers_and_extensions_per_version(tmp_path, version, build_, plus1_runner, plus1_eagle, pr, resolve,
                                            exts):
    sp = str(tmp_path)
    build.install_fake_vllm(sp, version=version, build=build_)
    assert (PLUS1 in _read(sp, RUNNER)) == plus1_runner
    eagle = _read(sp, EAGLE3)
    if plus1_eagle is None:
        assert eagle is None
    else:
        assert (PLUS1 in eagle) == plus1_eagle
    dfl = _read(sp, DFLASH)
    assert ("_get_dflash_layer_types" in dfl and "_DFLASH_VALID_LAYER_TYPES" in dfl) == pr
    assert ("_resolve_layer_attention" in dfl) == resolve
    for e in exts + ["vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm_flash_attn/_vllm_fa3_C.abi3.so",
                     "cumem_allocator.abi3.so"]:
        p = os.path.join(sp, "vllm", e)
        assert os.path.isfile(p) and os.path.getsize(p) == 0, e
    if version < "0.24":
        assert not os.path.exists(os.path.join(sp, "vllm", "_C_stable_libtorch.abi3.so"))
    else:
        assert not os.path.exists(os.path.join(sp, "vllm", "_C.abi3.so"))
    r = _import(sp)
    assert r.returncode == 0, r.stderr
    ver, commit = r.stdout.split()
    assert ver.startswith(version)
    assert len(commit) == 40
    if build_ == "pr40898":
        assert commit == build.PR40898_COMMIT and "+g" in ver
    else:
        assert ver == version and commit != build.PR40898_COMMIT
    assert f"__commit_id__ = commit_id = '{commit}'" in _read(sp, "vllm/_version.py")


def test_missing_extension_import_error(tmp_path):
    sp = str(tmp_path)
    build.install_fake_vllm(sp, missing_extension="_C_stable_libtorch.abi3.so")
    r = _import(sp)
    assert r.returncode == 1
    assert "ImportError" in r.stderr and "_C_stable_libtorch.abi3.so" in r.stderr
    # the CLI fails the same way
    r = _import(sp, code="from vllm.entrypoints.cli.main import main; main(['--version'])")
    assert r.returncode == 1 and "_C_stable_libtorch.abi3.so" in r.stderr


def test_no_fix_markers(tmp_path):
    sp = str(tmp_path)
    build.install_fake_vllm(sp, version="0.34.0", build="pr40898", no_fix_markers=True)
    for rel in (RUNNER, EAGLE3, DFLASH):
        text = _read(sp, rel)
        assert PLUS1 not in text and "_get_dflash_layer_types" not in text and "_resolve_layer_attention" not in text


def test_faults_file_relayouts_on_import_and_back(tmp_path):
    sp = str(tmp_path / "sp")
    os.makedirs(sp)
    build.install_fake_vllm(sp)
    faults = str(tmp_path / "faults.json")
    with open(faults, "w") as f:
        json.dump({"vllm_version": "0.21.0", "missing_extension": "cumem_allocator.abi3.so"}, f)
    r = _import(sp, env={"VPD_FAKE_VLLM_FAULTS": faults})
    assert r.returncode == 1 and "cumem_allocator.abi3.so" in r.stderr
    assert PLUS1 not in _read(sp, RUNNER) and _read(sp, EAGLE3) is None
    assert os.path.exists(os.path.join(sp, "vllm", "_C.abi3.so"))
    with open(faults, "w") as f:
        json.dump({"vllm_build": "pr40898"}, f)
    build.sync(sp, faults)  # without importing
    assert "_get_dflash_layer_types" in _read(sp, DFLASH)
    with open(faults, "w") as f:
        json.dump({}, f)
    r = _import(sp, env={"VPD_FAKE_VLLM_FAULTS": faults})
    assert r.returncode == 0 and r.stdout.split()[0] == "0.34.0"
    assert "_resolve_layer_attention" in _read(sp, DFLASH)
    assert not os.path.exists(os.path.join(sp, "vllm", "_C.abi3.so"))


def test_import_is_cheap(tmp_path):
    sp = str(tmp_path)
    build.install_fake_vllm(sp)
    r = _import(sp, code="import sys, vllm, vllm.platforms; print('transformers' in sys.modules, "
                         "'vllm._fake.server' in sys.modules)")
    assert r.stdout.split() == ["False", "False"]
