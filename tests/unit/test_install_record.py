"""install-vllm pieces on real files: the RECORD check (against a real wheel installed by real pip), the switch of
the runtime link, requires.vllm parsing and validation."""

import os
import subprocess
import sys

import pytest

from orchestrator.agent.container import install as A
from orchestrator.agent.container.runner import switch_runtime
from orchestrator.agent.container.stack import record_check
from orchestrator.provision.vllm_install import requirement
from orchestrator.core.spec_schema import _vllm_source
from vpd_testbed.fake_vllm import wheels


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The 0.34.0 wheel installed by pip into a target directory: site-packages with vllm and its RECORD."""
    d = tmp_path_factory.mktemp("rec")
    whl = wheels.make_wheel(str(d / "wh"), "0.34.0")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(d / "v")], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(d / "v" / "bin" / "python"), "install", "--no-index",
                    "--no-deps", "--disable-pip-version-check", "-q", whl], check=True)
    return next((d / "v" / "lib").glob("python*/site-packages"))


def test_record_ok_then_missing_and_changed(installed):
    pkg = installed / "vllm"
    r = record_check(str(pkg))
    assert r["status"] == "ok" and r["files"] > 30 and not r["missing"] and not r["changed"], r
    victim = pkg / "_fake" / "http.py"
    data = victim.read_bytes()
    other = pkg / "platforms" / "__init__.py"
    odata = other.read_bytes()
    try:
        victim.unlink()
        other.write_bytes(odata + b"# x\n")
        r = record_check(str(pkg))
        assert r["status"] == "failed"
        assert r["missing"] == ["vllm/_fake/http.py"]
        assert [c["path"] for c in r["changed"]] == ["vllm/platforms/__init__.py"]
        assert "1 of" in r["message"] and "differ from RECORD" in r["message"]
    finally:
        victim.write_bytes(data)
        other.write_bytes(odata)


def test_record_absent(tmp_path):
    (tmp_path / "vllm").mkdir()
    r = record_check(str(tmp_path / "vllm"))
    assert r["status"] == "no-record" and "not installed by a package installer" in r["message"]
    (tmp_path / "vllm-0.1.dist-info").mkdir()
    r = record_check(str(tmp_path / "vllm"))
    assert r["status"] == "failed" and "RECORD" in r["message"] and "did not finish" in r["message"]


def test_switch_runtime_moves_the_original_once(tmp_path):
    root = tmp_path / "ml-env"
    (root / "bin").mkdir(parents=True)
    (tmp_path / "ml-env.versions" / "a").mkdir(parents=True)
    (tmp_path / "ml-env.versions" / "b").mkdir()
    with pytest.raises(A.NotAVenv, match="no pyvenv.cfg"):  # issue 22: only a real venv is moved aside
        switch_runtime(str(root), str(tmp_path / "ml-env.versions" / "a"))
    assert root.is_dir() and not root.is_symlink()
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    prev, new = switch_runtime(str(root), str(tmp_path / "ml-env.versions" / "a"))
    assert prev.startswith("ml-env.versions/original-") and new == "ml-env.versions/a"
    assert os.readlink(root) == "ml-env.versions/a" and (tmp_path / prev / "bin").is_dir()
    prev2, _ = switch_runtime(str(root), str(tmp_path / "ml-env.versions" / "b"))
    assert prev2 == "ml-env.versions/a" and os.readlink(root) == "ml-env.versions/b"
    with pytest.raises(ValueError):
        switch_runtime(str(root), str(tmp_path / "elsewhere"))


def test_install_vllm_refuses_what_is_not_a_venv(tmp_path):
    """issue 22: runtime.python /usr/bin/python3 made /usr the venv root to move aside."""
    for py in ("/usr/bin/python3", "/usr/local/bin/python3", "/root/bin/python"):
        r = A.act_install_vllm({"op": "probe", "python": py, "state_dir": str(tmp_path / "s")})
        assert not r["ok"] and "system prefix" in r["message"] and "python3 -m venv" in r["fix"], r
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "conda-meta").mkdir()
    r = A.act_install_vllm({"op": "probe", "python": str(conda / "bin" / "python"), "state_dir": str(tmp_path / "s")})
    assert not r["ok"] and "conda installation" in r["message"]
    assert not (tmp_path / "conda.versions").exists() and not (tmp_path / "s").exists()


def test_install_vllm_refuses_sources_another_user_owns(tmp_path):
    """issue 22: a wheel, git+file repository or find_links directory another user owns or may write."""
    os.chmod(tmp_path, 0o755)
    whl = tmp_path / "vllm-0.34.0-py3-none-any.whl"
    whl.write_bytes(b"x")
    os.chown(whl, 65534, 65534)
    assert "owned by uid 65534" in A._install_source_problem({"req": str(whl)})
    repo = tmp_path / "repo"
    repo.mkdir()
    os.chmod(repo, 0o777)
    assert "writable by others" in A._install_source_problem({"req": "git+file://%s@main" % repo})
    assert "writable by others" in A._install_source_problem({"req": "vllm==0.34.0", "find_links": [str(repo)]})
    os.chmod(repo, 0o755)
    assert A._install_source_problem({"req": "git+file://%s@main" % repo, "find_links": [str(repo)]}) is None
    r = A._install_start({"req": str(whl), "state_dir": str(tmp_path / "s"), "python": "/x/bin/python",
                          "base_python": sys.executable},
                         {"kind": "missing", "venv_root": str(tmp_path / "env"), "store": str(tmp_path / "env.versions")})
    assert not r["ok"] and "refusing to install from" in r["message"] and not (tmp_path / "env.versions").exists()


@pytest.mark.parametrize("spec, req, version", [
    ("0.34.0", "vllm==0.34.0", "0.34.0"),
    ("git+https://github.com/ORG/vllm@dflash-swa-support", "git+https://github.com/ORG/vllm@dflash-swa-support", None),
    ("https://example.invalid/vllm-0.34.0-cp38-abi3-manylinux1_x86_64.whl",
     "https://example.invalid/vllm-0.34.0-cp38-abi3-manylinux1_x86_64.whl", None),
    ("/root/wheels/vllm-0.30.0-py3-none-any.whl", "/root/wheels/vllm-0.30.0-py3-none-any.whl", None),
])
def test_requirement(spec, req, version):
    assert _vllm_source(spec) is None
    r = requirement(spec)
    assert r["req"] == req and r["version"] == version


@pytest.mark.parametrize("bad, says", [
    ("latest", "is not one of"), ("git+https://me:tok@github.com/x/vllm", "credentials"),
    ("https://example.invalid/vllm.tar.gz", "not a wheel URL"), ("wheels/vllm.whl", "is not one of"),
    ("/root/vllm.tar.gz", "not a wheel file"),
])
def test_requirement_refused(bad, says):
    assert says in (_vllm_source(bad) or "")


def test_phases_from_installer_output():
    assert A.install_phase("Collecting vllm==0.34.0") == "download"
    assert A.install_phase("  Building wheel for vllm (pyproject.toml): started") == "build"
    assert A.install_phase("Installing collected packages: vllm") == "install"
    assert A.install_phase("Resolved 140 packages in 2.1s") == "download"
    assert A.install_phase("   Built vllm @ git+https://github.com/x/vllm@b") == "build"
    assert A.install_phase("Installed 140 packages in 800ms") == "install"
