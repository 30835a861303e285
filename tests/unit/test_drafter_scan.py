"""`deploy doctor` with no server (issue 26): the agent's drafter_scan over the hub cache and models directories,
run as a real process on real files, hostile ones included; and the workstation's verdicts (doctor.scan_checks)."""

import hashlib
import os
import shutil
import time

from agent_support import PUBLISHED, STALE, run_agent, sha
import pytest
from slack import slack

REV = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(hub, name, blob_src=None, link=None):
    """models--NAME with snapshots/REV/config.json a symlink: into its own blobs/ (a copy of blob_src), or `link`."""
    repo = hub / ("models--" + name)
    (repo / "snapshots" / REV).mkdir(parents=True)
    (repo / "blobs").mkdir()
    if blob_src is not None:
        shutil.copy(blob_src, repo / "blobs" / "b1")
        link = "../../blobs/b1"
    os.symlink(link, repo / "snapshots" / REV / "config.json")
    return repo / "snapshots" / REV / "config.json"


def scan(tmp_path, **more):
    t = time.monotonic()
    r = run_agent("drafter_scan", {"hf_homes": [str(tmp_path / "hf")], "model_dirs": [str(tmp_path / "models")],
                                   "budget_s": 5, **more})
    by = {c["path"]: c for c in r["configs"] if c["path"].startswith(str(tmp_path))}
    return r, by, time.monotonic() - t


@pytest.mark.deadline
def test_drafter_scan_reads_the_hub_cache_and_models_dirs_and_nothing_hostile(tmp_path):
    hub, models = tmp_path / "hf" / "hub", tmp_path / "models"
    models.mkdir()
    good = hub_repo(hub, "org--good", PUBLISHED)
    (tmp_path / "secret").write_text('{"architectures": ["DFlashDraftModel"]}')
    escape = hub_repo(hub, "org--evil", link=str(tmp_path / "secret"))  # leaves its models--* directory
    sibling = hub_repo(hub, "org--sib", link="../../../models--org--good/blobs/b1")  # into another repo's blobs
    (models / "Other-DFlash").mkdir()
    shutil.copy(STALE, models / "Other-DFlash" / "config.json")
    (models / "fifo").mkdir()
    os.mkfifo(models / "fifo" / "config.json")  # would block a plain open()
    (models / "big").mkdir()
    with open(models / "big" / "config.json", "wb") as fh:
        fh.write(b'{"dflash_config": {}, "pad": "' + b"x" * (2 << 20) + b'"}')
    (models / "bad").mkdir()
    (models / "bad" / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')
    (models / "target").mkdir()
    (models / "target" / "config.json").write_text('{"architectures": ["Qwen3_5ForConditionalGeneration"]}')
    deep = models / "deep"
    for i in range(40):  # deep junk: never walked (one level only)
        deep = deep / ("d%d" % i)
    deep.mkdir(parents=True)
    shutil.copy(STALE, deep / "config.json")
    os.symlink(tmp_path / "secretdir", models / "linked")  # a symlinked model dir is not listed
    (tmp_path / "secretdir").mkdir()
    shutil.copy(STALE, tmp_path / "secretdir" / "config.json")
    os.symlink(STALE, models / "Other-DFlash" / "x")  # files beside config.json are not looked at
    (tmp_path / "secretdir" / "sub").mkdir()
    shutil.copy(STALE, tmp_path / "secretdir" / "sub" / "config.json")
    (hub / "models--org--snaplink").mkdir()
    os.symlink(tmp_path / "secretdir", hub / "models--org--snaplink" / "snapshots")  # not walked

    r, by, took = scan(tmp_path)
    assert took < slack(10), took
    assert by[str(good)]["sha256"] == sha(PUBLISHED) and by[str(good)]["hub_id"] == "org/good"
    assert by[str(good)]["revision"] == REV and by[str(good)]["drafter"] == ["architectures DFlashDraftModel",
                                                                             "key dflash_config"]
    assert by[str(good)]["realpath"] == str(hub / "models--org--good" / "blobs" / "b1")
    for p in (escape, sibling):
        assert "leaves" in by[str(p)]["error"] and "sha256" not in by[str(p)], by[str(p)]
    other = by[str(models / "Other-DFlash" / "config.json")]
    assert other["sha256"] == sha(STALE) and other["kind"] == "models" and other["target_layer_ids"] == [1, 17, 33,
                                                                                                          49, 63]
    assert "not a regular file" in by[str(models / "fifo" / "config.json")]["error"]
    big = by[str(models / "big" / "config.json")]
    assert "over the" in big["error"] and "sha256" not in big and big["size"] > 2 << 20
    assert "parse_error" in by[str(models / "bad" / "config.json")]
    assert by[str(models / "target" / "config.json")]["drafter"] == []
    assert not [p for p in by if "/deep/" in p or "/linked/" in p or "secret" in p or "snaplink" in p], sorted(by)
    assert r["truncated"] is None
    assert any("models--org--snaplink/snapshots is a symlink" in n for n in r["notes"]), r["notes"]
    assert str(hub) in r["roots"]["hub"] and "/root/.cache/huggingface/hub" in r["roots"]["hub"]
    assert str(models) in r["roots"]["models"] and "/root/models" in r["roots"]["models"]


@pytest.mark.deadline
def test_drafter_scan_is_bounded(tmp_path):
    models = tmp_path / "models"
    for i in range(220):  # more config files than are read
        (models / ("m%04d" % i)).mkdir(parents=True)
        (models / ("m%04d" % i) / "config.json").write_text('{"target_layer_ids": [1]}')
    r, by, took = scan(tmp_path)
    assert took < slack(10), took
    assert r["truncated"] == "more than 200 config files" and len(by) == 200
    r, by, took = scan(tmp_path, budget_s=0.5)  # the time budget: at most about half a second of reading
    assert took < slack(10) and (r["truncated"] in (None, "time budget spent", "more than 200 config files"))
    shutil.rmtree(models)
    models.mkdir()
    for i in range(1100):  # more entries than one directory listing looks at
        (models / ("m%04d" % i)).mkdir()
    r, by, took = scan(tmp_path)
    assert any("more than 1000 entries" in n for n in r["notes"]), r["notes"]


def test_scan_checks_verdicts():
    from orchestrator.hosts import doctor

    pub = open(PUBLISHED, "rb").read()
    import json

    pinned = [{"playbook": "qwen36-dflash", "path": "/root/models/Qwen3.6-27B-DFlash", "hub_id": None,
               "target": "pve1/129", "config": json.loads(pub), "sha256": hashlib.sha256(pub).hexdigest()},
              {"playbook": "hubbed", "path": None, "hub_id": "z-lab/X-DFlash", "target": "pve1/129",
               "config": json.loads(pub), "sha256": "0" * 64}]
    stale = {"sha256": sha(STALE), "drafter": ["architectures DFlashDraftModel"], "size": 10,
             "architectures": ["DFlashDraftModel"], "target_layer_ids": [1, 17, 33, 49, 63]}
    configs = [
        {"path": "/root/models/Qwen3.6-27B-DFlash/config.json", **stale},  # covered by the playbook-path check
        {"path": "/root/models/Other-DFlash/config.json", "kind": "models", "dir": "/root/models/Other-DFlash",
         **stale},
        {"path": "/srv/m/Qwen3.6-27B-DFlash/config.json", "kind": "models", "dir": "/srv/m/Qwen3.6-27B-DFlash",
         **stale},
        {"path": "/h/hub/models--z-lab--X-DFlash/snapshots/r/config.json", "kind": "hub",
         "hub_id": "z-lab/X-DFlash", **stale},
        {"path": "/h/hub/models--a--b/snapshots/r/config.json", "kind": "hub", "hub_id": "a/b", **stale,
         "sha256": hashlib.sha256(pub).hexdigest()},
        {"path": "/root/models/T/config.json", "kind": "models", "sha256": "1" * 64, "drafter": []},
        {"path": "/root/models/F/config.json", "kind": "models", "error": "not a regular file (not read)"},
    ]
    out = {c["path"]: c for c in doctor.scan_checks({"configs": configs}, pinned, "pve1", 129,
                                                    ["/root/models/Qwen3.6-27B-DFlash/config.json"])}
    assert "/root/models/Qwen3.6-27B-DFlash/config.json" not in out and "/root/models/T/config.json" not in out
    f = out["/root/models/Other-DFlash/config.json"]["finding"]
    assert f["class"] == "guessed-config" and sha(STALE)[:12] in f["cause"]
    assert "matches no pinned config" in f["cause"]
    assert "[1, 17, 33, 49, 63] differ from the published [1, 16, 31, 46, 61]" in f["cause"]
    assert f["fix"].startswith("point a playbook's drafter at it (path: /root/models/Other-DFlash)")
    fix = out["/srv/m/Qwen3.6-27B-DFlash/config.json"]["finding"]["fix"]
    assert fix.startswith("deploy apply-config qwen36-dflash")
    hubf = out["/h/hub/models--z-lab--X-DFlash/snapshots/r/config.json"]["finding"]
    assert hubf["fix"].startswith("deploy apply-config hubbed")
    assert "hub snapshot itself is never written" in hubf["fix"]
    assert out["/h/hub/models--a--b/snapshots/r/config.json"]["verdict"] == "= the published config of qwen36-dflash"
    assert "finding" not in out["/h/hub/models--a--b/snapshots/r/config.json"]
    assert out["/root/models/F/config.json"]["verdict"].startswith("not read (not a regular file")
    assert "finding" not in out["/root/models/F/config.json"]
