"""The tool as a user gets it with pip: a non-editable install of the built wheel into a fresh venv, used from
an empty directory. `deploy init`, then `deploy testbed up`, `plan`, `up` and `status` work there.
(Dependencies come from the package index, or pip's cache; the venv lives only for this test.)"""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def _skip_reason():
    if os.geteuid() != 0:
        return "needs root (the test bed uses namespaces)"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "needs OpenSSH's sshd at /usr/sbin/sshd"
    return None


def _free_net():
    """A 127.77.N. prefix (N from 100) where nothing listens on port 2222 of .1."""
    from vpd_testbed.common import free_net

    return free_net(100, 160) or pytest.skip("no free 127.77.N.1:2222")


def _build(tmp_path_factory, src):
    """The wheel, built from a copy of SRC: setuptools writes build/ and *.egg-info beside the sources it builds."""
    out, copy = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src") / "src"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.egg-info",
                                                             "gpu-carry", ".gpu-carry-*"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(copy)], check=True,
                   capture_output=True, timeout=300)
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return _build(tmp_path_factory, REPO)


@pytest.fixture(scope="module")
def testbed_wheel(tmp_path_factory):
    return _build(tmp_path_factory, os.path.join(REPO, "testbed"))


def test_wheel_ships_playbooks_drafters_and_schemas(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("orchestrator/examples/qwen36-dflash.yaml", "orchestrator/examples/qwen36-mtp.yaml",
              "orchestrator/examples/hosts.example.yaml",
              "orchestrator/examples/drafters/qwen36-27b-dflash.config.json",
              "orchestrator/examples/targets/qwen36-27b.config.json",  # sizing.target_config (issue 53)
              "orchestrator/examples/schemas/playbook.schema.json",
              "orchestrator/examples/schemas/inventory.schema.json",
              # the docs, for `deploy docs` (pip users have no clone; issue 26)
              "orchestrator/docs/quickstart.md", "orchestrator/docs/cli.md", "orchestrator/docs/troubleshooting.md",
              "orchestrator/docs/domain/field-report.md"):
        assert f in names, f


def test_product_wheel_holds_no_test_bed_and_no_fake_vllm(wheel, testbed_wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if ("testbed" in n and not n.startswith("orchestrator/docs/")) or "/vllm/" in n
                or n.startswith("vllm/")], names  # the shipped docs may describe the test bed (deploy docs testbed)
    tb = set(zipfile.ZipFile(testbed_wheel).namelist())
    for f in ("vpd_testbed/core.py", "vpd_testbed/scripts/pct.py", "vpd_testbed/fake_vllm/vllm/__init__.py",
              "vpd_testbed/fake_vllm/vllm/_fake/server.py", "vpd_testbed/data/qwen36-27b-target.trimmed.config.json",
              "vpd_testbed/data/qwen36-27b-target.config.json"):
        assert f in tb, f


def test_installed_tool_from_an_empty_directory(wheel, testbed_wheel, tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    venv, work, home = tmp_path / "venv", tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel), str(testbed_wheel)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEPLOY_", "VPD_", "PYTHON", "XDG_"))}
    env.update(HOME=str(home), NO_COLOR="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}")
    bed = f"/tmp/vpd-inst-{os.getpid()}"

    def deploy(*args, timeout=180, **extra):
        r = subprocess.run(["deploy", *args], cwd=work, env=dict(env, **extra), text=True, capture_output=True,
                           timeout=timeout)
        return r

    r = deploy("plan", "qwen36-dflash")
    assert r.returncode == 2 and "no inventory found; looked in:" in r.stderr, r.stderr
    r = deploy("init")
    assert r.returncode == 0, r.stderr
    r = deploy("docs", "playbooks#requires")  # the shipped pages, offline
    assert r.returncode == 0 and r.stdout.startswith("### `requires`"), r.stdout[:300] + r.stderr
    assert (work / "hosts.yaml").is_file() and (work / "playbooks" / "qwen36-dflash.yaml").is_file()
    # the copies are the ones used: not the repo (not on sys.path) and not the shipped examples
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
                           cwd=work, env=env, text=True, capture_output=True, timeout=60)
    assert probe.stdout.startswith(str(venv)), probe.stdout
    try:
        r = deploy("testbed", "up", "--dir", bed, "--net", _free_net(), timeout=120)
        assert r.returncode == 0, r.stderr
        inventory = r.stdout.strip().split("=", 1)[1]
        r = deploy("plan", "qwen36-dflash", DEPLOY_INVENTORY=inventory)
        assert r.returncode == 0, r.stderr
        assert "pct exec 129" in r.stdout
        r = deploy("up", "qwen36-dflash", DEPLOY_INVENTORY=inventory, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "qwen36-dflash is up on pve1/129" in r.stdout + r.stderr
        r = deploy("status", "--json", DEPLOY_INVENTORY=inventory)
        assert r.returncode == 0, r.stdout + r.stderr
        assert '"qwen36-dflash"' in r.stdout
    finally:
        deploy("testbed", "down", "--dir", bed, timeout=120)
        shutil.rmtree(bed + ".failed", ignore_errors=True)
