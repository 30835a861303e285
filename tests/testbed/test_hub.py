"""The test bed's hub (vpd_testbed/hub.py) against the real client: huggingface_hub's snapshot_download,
model_info(files_metadata=True) and its typed errors must work on it as on huggingface.co. Host loopback only."""

import hashlib
import json
import os
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
    with hubmod.running(root) as h:
        yield {"endpoint": h.endpoint, "commit": commit, "files": files, "root": root}


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


def _get(url, rng=None):
    import urllib.request
    req = urllib.request.Request(url, headers={"Range": rng} if rng else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, dict(r.headers), r.read()


def test_ranges_no_ranges_and_corrupt_at(server):
    root, data = server["root"], server["files"]["model.safetensors"]
    url = server["endpoint"] + "/acme/tiny/resolve/main/model.safetensors"  # a 302 to the CDN path, followed
    code, h, body = _get(url, "bytes=1000-1999")
    assert (code, h["Content-Length"], h["Content-Range"], body) == (206, "1000", "bytes 1000-1999/200000",
                                                                      data[1000:2000])
    code, h, body = _get(url, "bytes=199990-300000")  # past the end: up to the end
    assert (code, h["Content-Range"], body) == (206, "bytes 199990-199999/200000", data[199990:])
    assert _get(url, "bytes=5-")[2] == data[5:]
    (root / "faults.json").write_text(json.dumps({"no_ranges": True}))
    code, h, body = _get(url, "bytes=1000-1999")
    assert (code, body, "Accept-Ranges" in h, "Content-Range" in h) == (200, data, False, False)
    (root / "faults.json").write_text(json.dumps({"corrupt_at": {"model.safetensors": 150_000}}))
    code, h, body = _get(url, "bytes=100000-")
    want = bytearray(data[100000:])
    want[50_000] ^= 0xFF
    assert (code, len(body), body) == (206, 100_000, bytes(want))
    assert _get(url, "bytes=0-99999")[2] == data[:100000]  # a range without that byte is sound
    (root / "faults.json").write_text(json.dumps({"corrupt": ["model.safetensors"]}))
    assert _get(url, "bytes=1-")[2] == data[1:]  # corrupt: the first byte of the file only
    assert _get(url)[2] == bytes([data[0] ^ 0xFF]) + data[1:]


def test_link_bps_is_shared_by_all_connections(server):
    """4 ranged downloads at once, each at most 4 MiB/s, on an 8 MiB/s link: the link is the limit, shared fairly."""
    from concurrent.futures import ThreadPoolExecutor
    root, mib = server["root"], 1 << 20
    big = os.urandom(8 * mib)
    commit = hubmod.make_repo(str(root), "acme/big", {"big.dat": big})
    (root / "faults.json").write_text(json.dumps({"rate_bps": 4 * mib, "link_bps": 8 * mib}))
    url = server["endpoint"] + "/acme/big/resolve/%s/big.dat" % commit
    assert _get(url, "bytes=0-0")[2] == big[:1]  # the hub hashes a new commit's files once: not timed below
    t0 = time.monotonic()

    def part(i):
        body = _get(url, "bytes=%d-%d" % (i * 2 * mib, (i + 1) * 2 * mib - 1))[2]
        return body, time.monotonic() - t0
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(part, range(4)))
    total = time.monotonic() - t0
    assert b"".join(b for b, _ in got) == big
    rate = len(big) / total
    assert 6 * mib < rate < 1.3 * 8 * mib, rate / mib  # not one connection's 4 MiB/s, not the 16 MiB/s of four
    assert min(t for _, t in got) > 0.6 * max(t for _, t in got)  # fair shares: they end about together
