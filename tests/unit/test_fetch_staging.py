"""Issue 36 item 5: a fetch counts a staged or cached file as verified only when it is ours and its hash matches,
and refuses staging in a directory others can write (the agent's real plan_item / install_item, no network)."""

import hashlib
import os

import pytest

from orchestrator.agent.container import fetch as F
from orchestrator.agent.container.weights import FetchError, _partial, _staging

COMMIT = "a" * 40
DATA = os.urandom(4096)


def item(tmp_path):
    return {"role": "model", "dest_kind": "dir", "dest": str(tmp_path / "models" / "M"), "hub": "org/M"}


def listing():
    return {"commit": COMMIT, "files": [{"name": "w.safetensors", "size": len(DATA),
                                         "sha256": hashlib.sha256(DATA).hexdigest(), "blob": None}]}


def plant(path, data, uid=None, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)


def test_same_size_planted_bytes_in_staging_are_downloaded_not_trusted(tmp_path):
    (tmp_path / "models").mkdir()
    it, lst = item(tmp_path), listing()
    _, done = _partial(it, COMMIT, lst["files"][0])
    plant(done, b"\0" * len(DATA))  # the right size, other bytes: today's code called it verified
    need, have = F.plan_item(it, lst, str(tmp_path / "state"))
    assert [f["name"] for f in need] == ["w.safetensors"] and have == 0


def test_a_staged_file_of_the_right_hash_counts_only_when_it_is_ours(tmp_path):
    (tmp_path / "models").mkdir()
    it, lst = item(tmp_path), listing()
    _, done = _partial(it, COMMIT, lst["files"][0])
    plant(done, DATA)
    need, have = F.plan_item(it, lst, str(tmp_path / "state"))
    assert need == [] and have == len(DATA)
    if os.geteuid() == 0:
        os.chown(done, 65534, -1)  # nobody's file, right bytes: a later swap would go unnoticed
        lst = listing()
        need, have = F.plan_item(it, lst, str(tmp_path / "state"))
        assert [f["name"] for f in need] == ["w.safetensors"]
    lst = listing()
    os.chmod(done, 0o666)
    need, _ = F.plan_item(it, lst, str(tmp_path / "state"))
    assert [f["name"] for f in need] == ["w.safetensors"]


def test_staging_in_a_directory_others_can_write_is_refused(tmp_path):
    (tmp_path / "models").mkdir()
    it = item(tmp_path)
    st = _staging(it, COMMIT)
    os.makedirs(st)
    os.chmod(os.path.dirname(st), 0o777)  # a pre-made .M.deploy-fetch anyone can write
    with pytest.raises(FetchError) as e:
        F.plan_item(it, listing(), str(tmp_path / "state"))
    assert e.value.kind == "unsafe" and os.path.dirname(st) in e.value.message and "777" in e.value.message


def test_a_parent_anyone_can_write_without_sticky_bit_is_refused(tmp_path):
    (tmp_path / "models").mkdir()
    os.chmod(tmp_path / "models", 0o777)
    with pytest.raises(FetchError) as e:
        F.plan_item(item(tmp_path), listing(), str(tmp_path / "state"))
    assert e.value.kind == "unsafe" and "no sticky bit" in e.value.message


def test_a_destination_planted_by_another_user_is_refused(tmp_path):
    (tmp_path / "models").mkdir()
    os.chmod(tmp_path / "models", 0o1777)  # like /tmp: our own staging dir in it is fine
    it = item(tmp_path)
    os.makedirs(it["dest"])
    os.chmod(it["dest"], 0o777)
    with pytest.raises(FetchError) as e:
        F.plan_item(it, listing(), str(tmp_path / "state"))
    assert "destination directory" in e.value.message


def test_install_refuses_a_staged_file_that_changed_owner(tmp_path):
    (tmp_path / "models").mkdir()
    it, lst = item(tmp_path), listing()
    _, done = _partial(it, COMMIT, lst["files"][0])
    plant(done, DATA, mode=0o666)
    with pytest.raises(FetchError) as e:
        F.install_item(it, COMMIT, lst, str(tmp_path / "state"), "hub:x")
    assert "no longer a regular file of ours" in e.value.message
    assert not os.path.exists(os.path.join(it["dest"], "w.safetensors"))
