"""Issue 38: the fetch runner's transfer engine (agent/container/transfer.py) against the test bed's hub (a real HTTP
server process on loopback): several files at once, a large file in byte ranges, a cut range resumed where it
stopped, a ranges record resumed by the next run, a hub that ignores Range (one stream), a bad byte in a later
range caught by the whole-file hash."""

import hashlib
import json
import os
import threading
import time

import pytest

from orchestrator.agent.container import fetch as F
from orchestrator.agent.container.transfer import Transfer, partial_bytes, read_ranges, sidecar_of, split
from orchestrator.agent.container.weights import FetchError, _partial
from vpd_testbed import hub as hubmod

MIB = 1 << 20
BIG = "model-00001-of-00002.safetensors"


@pytest.fixture
def hub(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    files = {"config.json": b'{"a": 1}\n', BIG: os.urandom(5 * MIB + 12345),
             "model-00002-of-00002.safetensors": os.urandom(MIB // 2), "tok/vocab.txt": b"a\nb\n"}
    commit = hubmod.make_repo(str(root), "acme/M", files)
    with hubmod.running(root) as ns:
        ns.commit, ns.files = commit, files
        yield ns


def setup_item(hub, tmp_path):
    (tmp_path / "models").mkdir(exist_ok=True)
    it = {"role": "model", "dest_kind": "dir", "dest": str(tmp_path / "models" / "M"), "hub": "acme/M",
          "endpoint": hub.endpoint, "revision": hub.commit}
    lst = F.hub_info(it, None, 10)
    it["commit"] = lst["commit"]
    need, _ = F.plan_item(it, lst, str(tmp_path / "state"))
    return it, lst, need


def run(it, need, *, connections=4, range_bytes=MIB, seen=None, strip_range=False, deadline=None):
    logs, verified = [], []

    def request(item, url, token, timeout, headers=None):
        h = dict(headers or {})
        if seen is not None:
            seen.append(h.get("Range"))
        if strip_range:
            h.pop("Range", None)
        return F._hub_request(item, url, token, timeout, h)

    tr = Transfer([(it, it["commit"], f, None) for f in need], request=request, error=F.hub_error,
                  connections=connections, range_bytes=range_bytes, deadline=deadline or time.time() + 60,
                  stall_s=10, log=logs.append, on_progress=lambda busy, n: None,
                  on_verified=lambda pf, got: verified.append(pf.f["name"]))
    tr.run()
    return logs, verified


def staged(it, f):
    return open(_partial(it, it["commit"], f)[1], "rb").read()


def test_split_ranges():
    assert split(5, 5) == [[0, 5]]
    assert split(10, 5) == [[0, 5], [5, 10]]
    assert split(11, 5) == [[0, 5], [5, 10], [10, 11]]
    assert split(0, 5) == [[0, 0]]


def test_parallel_ranges_every_file_verified(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    seen = []
    logs, verified = run(it, need, seen=seen)
    assert sorted(verified) == sorted(hub.files)
    for f in need:
        assert staged(it, f) == hub.files[f["name"]]
        assert not os.path.exists(sidecar_of(_partial(it, it["commit"], f)[0]))
    ranges = [r for r in seen if r]
    assert len(ranges) == 6 and "bytes=0-1048575" in ranges and f"bytes=5242880-{5 * MIB + 12344}" in ranges
    assert not logs


def test_cut_range_resumes_where_it_stopped(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    hub.fault(cut={BIG: 300_000})
    seen = []
    logs, verified = run(it, need, seen=seen)
    assert BIG in verified
    big = [f for f in need if f["name"] == BIG][0]
    assert staged(it, big) == hub.files[BIG]
    assert any("transfer cut at" in ln and "resuming" in ln for ln in logs), logs
    # the cut range was asked again from its last byte, not from its start
    starts = [int(r.split("=")[1].split("-")[0]) for r in seen if r]
    assert any(s % MIB == 300_000 for s in starts), seen


def test_ranges_record_resumed_by_the_next_run(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    big = [f for f in need if f["name"] == BIG][0]
    part, _ = _partial(it, it["commit"], big)
    os.makedirs(os.path.dirname(part), exist_ok=True)
    data = hub.files[BIG]
    # an earlier run wrote ranges 0 and 2 completely and 1 half way, then stopped
    with open(part, "wb") as fh:
        fh.truncate(len(data))
        fh.seek(0)
        fh.write(data[:MIB])
        fh.seek(MIB)
        fh.write(data[MIB:MIB + MIB // 2])
        fh.seek(2 * MIB)
        fh.write(data[2 * MIB:3 * MIB])
    rs = [[a, b, 0] for a, b in split(len(data), MIB)]
    rs[0][2], rs[1][2], rs[2][2] = MIB, MIB // 2, MIB
    with open(sidecar_of(part), "w") as fh:
        json.dump({"size": len(data), "ranges": rs}, fh)
    assert partial_bytes(part, len(data)) == 2 * MIB + MIB // 2
    need2, _ = F.plan_item(it, lst, str(tmp_path / "state"))
    assert [f["partial"] for f in need2 if f["name"] == BIG] == [2 * MIB + MIB // 2]  # not the sparse file's size
    seen = []
    run(it, [f for f in need2 if f["name"] == BIG], seen=seen)
    assert sorted(seen) == sorted([f"bytes={MIB + MIB // 2}-{2 * MIB - 1}", f"bytes={3 * MIB}-{4 * MIB - 1}",
                                   f"bytes={4 * MIB}-{5 * MIB - 1}", f"bytes={5 * MIB}-{len(data) - 1}"])
    assert staged(it, big) == data


def test_single_stream_partial_counts_as_the_first_ranges(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    big = [f for f in need if f["name"] == BIG][0]
    part, _ = _partial(it, it["commit"], big)
    os.makedirs(os.path.dirname(part), exist_ok=True)
    with open(part, "wb") as fh:  # yesterday's single-stream partial: 1.5 MiB, no ranges record
        fh.write(hub.files[BIG][:MIB + MIB // 2])
    assert read_ranges(part, big["size"]) is None and partial_bytes(part, big["size"]) == MIB + MIB // 2
    seen = []
    run(it, [big], seen=seen)
    assert f"bytes={MIB + MIB // 2}-{2 * MIB - 1}" in seen and not any(r and r.startswith("bytes=0-") for r in seen)
    assert staged(it, big) == hub.files[BIG]


def test_a_hub_without_ranges_gets_one_stream(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    logs, verified = run(it, need, strip_range=True)
    assert sorted(verified) == sorted(hub.files)
    big = [f for f in need if f["name"] == BIG][0]
    assert staged(it, big) == hub.files[BIG]
    assert any("no ranges" in ln and "one stream" in ln and BIG in ln for ln in logs), logs


def test_a_bad_byte_in_one_range_fails_the_file_with_both_hashes(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    hub.fault(corrupt=[BIG])
    with pytest.raises(FetchError) as e:
        run(it, need)
    msg = e.value.message
    want = hashlib.sha256(hub.files[BIG]).hexdigest()
    bad = bytearray(hub.files[BIG])
    bad[0] ^= 0xFF
    assert e.value.kind == "mismatch" and BIG in msg and want in msg and hashlib.sha256(bad).hexdigest() in msg
    big = [f for f in need if f["name"] == BIG][0]
    part, done = _partial(it, it["commit"], big)
    assert not os.path.exists(part) and not os.path.exists(done)  # removed: a resume would keep the bad bytes


def test_time_limit_keeps_every_range_for_the_next_run(hub, tmp_path):
    it, lst, need = setup_item(hub, tmp_path)
    big = [f for f in need if f["name"] == BIG][0]
    hub.fault(rate_bps=MIB // 2)  # 4 connections: about 2 MiB/s, 2.6 s for the file
    with pytest.raises(FetchError) as e:
        run(it, [big], deadline=time.time() + 1.0)
    assert e.value.kind == "timeout"
    part, _ = _partial(it, it["commit"], big)
    rs = read_ranges(part, big["size"])
    assert rs is not None and 0 < sum(g for _, _, g in rs) < big["size"]
    hub.fault()
    run(it, [big])
    assert staged(it, big) == hub.files[BIG]


def test_threads_do_not_outlive_the_transfer(hub, tmp_path):
    before = threading.active_count()
    it, lst, need = setup_item(hub, tmp_path)
    run(it, need, connections=6)
    assert threading.active_count() <= before
