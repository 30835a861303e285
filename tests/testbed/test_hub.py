"""The test bed's hub (vpd_testbed/hub.py) against the real client: huggingface_hub's snapshot_download,
model_info(files_metadata=True) and its typed errors must work on it as on huggingface.co. Host loopback only."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from vpd_testbed import hub as hubmod

hf = pytest.importorskip("huggingface_hub")


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    files = {"config.json": b'{"a": 1}\n', "model.safetensors": os.urandom(200_000), "sub/t.txt": b"x" * 100}
    commit = hubmod.make_repo(str(root), "acme/tiny", files)
    hubmod.make_repo(str(root), "acme/gated", {"config.json": b"{}"}, gated="manual", accepted=["hf_ok"])
    (root / "tokens.json").write_text(json.dumps(["hf_ok", "hf_other"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, hubmod.__file__, str(root), str(port)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not (root / "hub.ready").exists():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    yield {"endpoint": f"http://127.0.0.1:{port}", "commit": commit, "files": files, "root": root}
    p.kill()
    p.wait(5)


def test_snapshot_download_and_model_info(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    ep = server["endpoint"]
    d = hf.snapshot_download("acme/tiny", revision="main", cache_dir=str(tmp_path / "c"), endpoint=ep)
    assert os.path.basename(d) == server["commit"]
    for name, data in server["files"].items():
        with open(os.path.join(d, name), "rb") as fh:
            assert fh.read() == data
    info = hf.HfApi(endpoint=ep).model_info("acme/tiny", files_metadata=True)
    sib = {s.rfilename: s for s in info.siblings}
    assert info.sha == server["commit"]
    assert sib["model.safetensors"].lfs.sha256 == hashlib.sha256(server["files"]["model.safetensors"]).hexdigest()
    assert sib["config.json"].lfs is None and sib["config.json"].size == len(server["files"]["config.json"])


def test_errors_are_the_hubs(server, tmp_path):
    ep = server["endpoint"]
    from huggingface_hub.errors import GatedRepoError, RevisionNotFoundError

    with pytest.raises(RevisionNotFoundError):
        hf.hf_hub_download("acme/tiny", "config.json", revision="nope", cache_dir=str(tmp_path / "c"), endpoint=ep)
    with pytest.raises(GatedRepoError):
        hf.hf_hub_download("acme/gated", "config.json", cache_dir=str(tmp_path / "c"), endpoint=ep, token=False)
    with pytest.raises(GatedRepoError):
        hf.hf_hub_download("acme/gated", "config.json", cache_dir=str(tmp_path / "c"), endpoint=ep, token="hf_other")
    p = hf.hf_hub_download("acme/gated", "config.json", cache_dir=str(tmp_path / "c"), endpoint=ep, token="hf_ok")
    assert open(p, "rb").read() == b"{}"
