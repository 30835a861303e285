"""bench/gpu/carry.py (issue 55): what the real-GPU check carries to the lent GPU machine stays within the device
tool's 64 MiB, and its setup installs only what is missing, never unpacking a package into /. Cheap; never needs a
GPU. The tests of a built carry skip where `scripts/gpu-check.sh --build-carry` has not been run (CI)."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import carry  # noqa: E402

sys.path.pop(0)


def test_pins_are_this_venvs_versions_and_nothing_the_image_has():
    pins = carry.pinned()
    names = [p.split("==")[0] for p in pins]
    assert names == list(carry.WHEELS) and all("==" in p and p.split("==")[1] for p in pins), pins
    assert not set(n.lower() for n in names) & set(n.lower() for n in carry.ALREADY_THERE)
    assert carry.LIMIT_MIB < 64


def test_describe_without_a_carry(tmp_path):
    assert carry.describe(tmp_path / "none") == {"present": False, "path": str(tmp_path / "none"), "bytes": 0}


def built():
    if not (carry.DEFAULT_DEST / "MANIFEST.json").exists():
        pytest.skip("gpu-carry/ not built here (scripts/gpu-check.sh --build-carry)")
    return carry.DEFAULT_DEST


def test_the_built_carry_fits_and_matches_its_manifest():
    dest = built()
    d = carry.describe(dest)
    assert d["bytes"] <= carry.LIMIT_MIB * 2**20, carry.mib(d["bytes"])
    m = json.loads((dest / "MANIFEST.json").read_text())
    for pin in m["wheels"]:
        name, version = pin.split("==")
        infos = [p.name for p in (dest / "site").glob("*.dist-info")]
        assert any(i.lower().replace("_", "-").startswith("%s-%s." % (name.lower(), version)) or
                   i.lower().startswith("%s-%s.dist" % (name.lower().replace("-", "_"), version)) for i in infos), \
            (pin, infos)
    assert list((dest / "site").glob("_cffi_backend.cpython-312-x86_64-linux-gnu.so"))  # built for the GPU machine


def test_setup_installs_only_missing_tools_into_a_root(tmp_path, monkeypatch):
    dest = built()
    if not shutil.which("dpkg-deb"):
        pytest.skip("no dpkg-deb here")
    monkeypatch.setattr(carry.shutil, "which", lambda name: None)  # as on a machine without them
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "fuser").write_text("#!/bin/sh\n")  # already there: left as it is
    done = carry.setup(dest, root=str(root))
    assert (root / "usr/sbin/sshd").stat().st_size > 100_000 and os.access(root / "usr/sbin/sshd", os.X_OK)
    assert (root / "usr/bin/ssh-keygen").exists() and (root / "usr/bin/ip").exists()
    assert (root / "usr/bin/fuser").read_text() == "#!/bin/sh\n"
    assert any(x.startswith("installed /usr/sbin/sshd (from openssh-server_") for x in done), done
    assert not any("fuser" in x for x in done), done
    # nothing else was written under the root: no package unpacked whole
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == ["usr/bin/fuser", "usr/bin/ip", "usr/bin/ssh", "usr/bin/ssh-keygen", "usr/sbin/sshd"], files
