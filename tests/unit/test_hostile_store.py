"""Issue 50: root on the Proxmox host. What the hub answers is untrusted network input, and whatever is inside the
store directory may have been written by a container. Each test is one finding of the review, reproduced the way
the review did it (a hostile test bed hub, links, FIFOs and tampered records planted in a store under tmp), run
in-process against the agent's real code on real files: nothing may be created or changed outside the store, and
the failure names the hub or the store path."""

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

from orchestrator.agent.container import fetch as F
from orchestrator.agent.container import files
from orchestrator.agent.container import store as S
from orchestrator.agent.container.core import now
from orchestrator.agent.container.fetch_runner import act_fetch_run
from orchestrator.agent.container.transfer import MAX_RANGES, Transfer, read_ranges, sidecar_of, split
from orchestrator.agent.container.weights import FetchError, _partial, in_place, MAX_FILE_BYTES
from test_spec import work  # noqa: F401 - the fixture (a work tree of playbooks)
from vpd_testbed import hub as hubmod

MIB = 1 << 20
BIG = "model.safetensors"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def hub(tmp_path):
    root = tmp_path / "hub"
    root.mkdir()
    files_ = {"config.json": b'{"a": 1}\n', BIG: os.urandom(2 * MIB + 17)}
    commit = hubmod.make_repo(str(root), "acme/M", files_)
    with hubmod.running(root) as ns:
        ns.commit, ns.files = commit, files_
        yield ns


def store_item(hub, store):
    return {"role": "model", "dest_kind": "cache", "hf_home": str(store), "hub": "acme/M", "endpoint": hub.endpoint,
            "revision": "main", "dest": None}


def run_fetch(store, items, timeout_s=60.0, stall_s=10.0):
    """The host's detached runner (fetch_run), in-process: its final fetch.json."""
    sd = os.path.join(str(store), ".deploy-state")
    os.close(files.open_dir(sd, 0o700))
    st = {"id": "t1", "status": "running", "phase": "starting", "items": items, "log": os.path.join(sd, "f.log"),
          "t0": now(), "started_at": now(), "timeout_s": timeout_s, "stall_s": stall_s, "connections": 4,
          "range_bytes": MIB}
    files.write_json_atomic(os.path.join(sd, "fetch.json"), st)
    act_fetch_run({"state_dir": sd, "id": "t1"})
    return files._read_json(os.path.join(sd, "fetch.json"))


def blobs(store):
    return os.path.join(str(store), "hub", "models--acme--M", "blobs")


def tree(path):
    """Every path under PATH with its kind and mode (what 'nothing changed outside' compares)."""
    out = {}
    for dp, dns, fns in os.walk(path):
        for n in dns + fns:
            p = os.path.join(dp, n)
            st = os.lstat(p)
            out[os.path.relpath(p, path)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size)
    return out


# ------------------------------------------------------------ a clean fetch: what the store looks like after


def test_a_clean_fetch_leaves_blobs_readable_by_containers(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    st = run_fetch(store, [store_item(hub, store)])
    assert st["status"] == "ok", st
    b = blobs(store)
    assert stat.S_IMODE(os.stat(b).st_mode) == 0o755  # not 0700: a uid-mapped container reads it as others
    for n in os.listdir(b):
        assert stat.S_IMODE(os.lstat(os.path.join(b, n)).st_mode) == 0o644, n
    assert in_place(store_item(hub, store), os.path.join(str(store), ".deploy-state"))["in_place"]


# ------------------------------------------------------------ finding 1: a hash from the hub becomes a path


def test_1_a_hub_hash_with_dotdot_makes_no_path_outside_the_store(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    # from blobs/: models--acme--M, hub, store, tmp_path: four levels up, then pwn/evil
    hub.fault(listing={BIG: {"sha256": "../../../../pwn/evil"}}, cut={BIG: 1000})
    st = run_fetch(store, [store_item(hub, store)])
    assert st["status"] == "failed"
    assert "acme/M" in st["message"] and "sha256" in st["message"] and "../../../../pwn/evil" in st["message"]
    assert not (tmp_path / "pwn").exists()


# ------------------------------------------------------------ finding 2: negative and huge sizes


@pytest.mark.parametrize("size", [-2 * MIB, 2 ** 56, "12", 1.5, True])
def test_2_an_unbelievable_size_from_the_hub_is_refused_before_anything(hub, tmp_path, size):
    hub.fault(listing={BIG: {"size": size}})
    it = store_item(hub, tmp_path / "store")
    with pytest.raises(FetchError) as e:
        F.hub_info(it, None, 10)
    assert e.value.kind == "hub" and "size" in e.value.message and "acme/M" in e.value.message
    assert str(MAX_FILE_BYTES) in e.value.fix


def test_2_the_number_of_ranges_is_bounded():
    assert len(split(2 ** 36, MIB)) <= MAX_RANGES  # 64 GiB in 1 MiB ranges would be 65536
    rs = split(2 ** 36 + 5, MIB)
    assert rs[0][0] == 0 and rs[-1][1] == 2 ** 36 + 5 and all(a[1] == b[0] for a, b in zip(rs, rs[1:]))


def test_2_a_bad_commit_or_blob_id_is_refused(hub, tmp_path):
    it = store_item(hub, tmp_path / "store")
    hub.fault(listing={"config.json": {"blobId": "../x"}})
    with pytest.raises(FetchError) as e:
        F.hub_info(it, None, 10)
    assert "git blob id" in e.value.message
    hub.fault(listing={"config.json": {"rfilename": "a/../../b"}})
    with pytest.raises(FetchError) as e:
        F.hub_info(it, None, 10)
    assert "a/../../b" in e.value.message
    hub.fault(listing_sha="../" * 10)
    with pytest.raises(FetchError) as e:
        F.hub_info(it, None, 10)
    assert "no commit" in e.value.message


# ------------------------------------------------------------ finding 3: links planted in the store


def test_3a_a_snapshot_linked_outside_is_not_written_through(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("precious")
    snaps = os.path.join(str(store), "hub", "models--acme--M", "snapshots")
    os.makedirs(snaps)
    os.symlink(str(outside), os.path.join(snaps, hub.commit))
    before = tree(str(outside))
    st = run_fetch(store, [store_item(hub, store)])
    assert st["status"] == "failed" and st["kind"] == "unsafe"
    assert os.path.join(snaps, hub.commit) in st["message"] and "symbolic link" in st["message"]
    assert tree(str(outside)) == before and (outside / "config.json").read_text() == "precious"


def test_3a_a_file_planted_where_a_snapshot_link_goes_is_not_unlinked(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    snap = os.path.join(str(store), "hub", "models--acme--M", "snapshots", hub.commit)
    os.makedirs(snap)
    with open(os.path.join(snap, "config.json"), "w") as fh:
        fh.write("not deploy's")
    st = run_fetch(store, [store_item(hub, store)])
    assert st["status"] == "failed" and "is not a link" in st["message"]
    assert open(os.path.join(snap, "config.json")).read() == "not deploy's"


def test_3b_a_state_directory_linked_elsewhere_is_refused(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    outside = tmp_path / "elsewhere"
    outside.mkdir(mode=0o755)
    os.chmod(outside, 0o755)
    os.symlink(str(outside), os.path.join(str(store), ".deploy-state"))
    r = F.act_fetch({"op": "start", "state_dir": os.path.join(str(store), ".deploy-state"),
                     "items": [store_item(hub, store)], "timeout_s": 30})
    assert not r["ok"] and "symbolic link" in r["message"] and ".deploy-state" in r["message"]
    assert os.listdir(str(outside)) == [] and stat.S_IMODE(os.stat(outside).st_mode) == 0o755


def test_3c_the_marker_is_never_written_through_a_planted_link(tmp_path):
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    os.chmod(store, 0o755)
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA admin\n")
    os.chmod(victim, 0o600)
    # every name the old code could have used for its temp file, and the marker's own name
    os.symlink(str(victim), os.path.join(str(store), "..deploy-store.json.tmp-%d" % os.getpid()))
    r = S._mark(str(store))
    assert r["ok"]
    assert victim.read_text() == "ssh-ed25519 AAAA admin\n" and stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    os.unlink(os.path.join(str(store), S.MARKER))
    os.symlink(str(victim), os.path.join(str(store), S.MARKER))
    r = S._mark(str(store))
    assert r["ok"] and not os.path.islink(os.path.join(str(store), S.MARKER))  # replaced, not followed
    assert victim.read_text() == "ssh-ed25519 AAAA admin\n" and stat.S_IMODE(os.stat(victim).st_mode) == 0o600


def test_3_a_hub_directory_linked_outside_is_refused(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    outside = tmp_path / "out"
    outside.mkdir()
    os.symlink(str(outside), os.path.join(str(store), "hub"))
    st = run_fetch(store, [store_item(hub, store)])
    assert st["status"] == "failed" and "symbolic link" in st["message"]
    assert os.listdir(str(outside)) == []


# ------------------------------------------------------------ finding 4: a tampered record


def link_setup(tmp_path, monkeypatch, names=("config.json", "w.bin"), dest_owner=None):
    """A store mounted (read-only, as the statvfs says) at MOUNT with one snapshot; the link request."""
    mount = tmp_path / "mount"
    mount.mkdir()
    assert S._mark(str(mount))["ok"]
    commit = "c" * 40
    snap = os.path.join(str(mount), "hub", "models--acme--M", "snapshots", commit)
    fl = []
    for n in names:
        data = n.encode()
        p = os.path.normpath(os.path.join(snap, n))  # a '../' name's file too (inside the mount): only the name is bad
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(data)
        fl.append({"name": n, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "blob": None})
    real = os.statvfs

    class RO:
        def __init__(self, st):
            self.f_flag, self.f_bavail, self.f_frsize = st.f_flag | os.ST_RDONLY, st.f_bavail, st.f_frsize

    monkeypatch.setattr(S.os, "statvfs", lambda p: RO(real(p)) if str(p) == str(mount) else real(p))
    mid = json.load(open(os.path.join(str(mount), S.MARKER)))["id"]
    models = tmp_path / "models"
    models.mkdir(mode=0o755)
    sd = tmp_path / "state"
    item = {"role": "model", "hub": "acme/M", "commit": commit, "revision": commit, "store": "/srv/store",
            "snapshot": snap, "dest": str(models / "M"), "files": fl}
    return {"op": "link", "mount": str(mount), "store": "/srv/store", "id": mid, "items": [item],
            "state_dir": str(sd)}


def test_4_a_record_name_with_dotdot_links_nothing_outside_the_destination(tmp_path, monkeypatch):
    # from DEST (tmp_path/models/M), ../../root/linked.sh is tmp_path/root/linked.sh: outside the destination
    a = link_setup(tmp_path, monkeypatch, names=("config.json", "../../root/linked.sh"))
    r = S.act_store(a)
    assert not r["ok"] and r["kind"] == "record" and "../../root/linked.sh" in r["message"]
    assert not (tmp_path / "root").exists() and not os.path.lexists(str(tmp_path / "models" / "M"))


def test_4_a_record_commit_that_is_a_path_is_refused(tmp_path, monkeypatch):
    a = link_setup(tmp_path, monkeypatch)
    a["items"][0]["commit"] = "../../x"
    r = S.act_store(a)
    assert not r["ok"] and r["kind"] == "record" and "commit" in r["message"]


def test_4_a_tampered_host_record_is_not_trusted_where_it_is_read(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    it = store_item(hub, store)
    assert run_fetch(store, [it])["status"] == "ok"
    sd = os.path.join(str(store), ".deploy-state")
    dest = F._item_dest(it)
    rec = F.fetch_record(sd, dest)
    rec["files"][0]["name"] = "../../../../etc/profile.d/x.sh"
    files.write_json_atomic(F._record_path(sd, dest), rec)
    assert F.fetch_record(sd, dest) is None  # what `records` answers the workstation
    p = in_place(it, sd)
    assert not p["in_place"] and "not trusted" in p["why"] and "etc/profile.d/x.sh" in p["why"]
    from orchestrator.agent.container.weights import bad_record

    assert bad_record(rec)  # and the workstation's own check (orchestrator/provision/weights_store.py) says so too


# ------------------------------------------------------------ finding 5: the ranges record read without limits


PROBE = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, %r)
    resource.setrlimit(resource.RLIMIT_AS, (600 << 20, 600 << 20))
    from orchestrator.agent.container.transfer import read_ranges
    print("ranges:", read_ranges(sys.argv[1], 1000))
""")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_5_a_ranges_record_that_is_a_fifo_or_endless_neither_hangs_nor_eats_memory(tmp_path, kind):
    part = str(tmp_path / ("a" * 64 + ".incomplete"))
    side = sidecar_of(part)
    if kind == "fifo":
        os.mkfifo(side)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", side)
    else:
        with open(side, "wb") as fh:
            fh.truncate(1 << 30)  # sparse: 1 GiB of nothing, a record no fetch writes
    r = subprocess.run([sys.executable, "-c", PROBE % ROOT, part], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ranges: None" in r.stdout, r.stderr[-2000:]


# ------------------------------------------------------------ finding 6: a destination another user owns


def test_6_a_destination_another_user_owns_is_not_linked_already(tmp_path, monkeypatch):
    a = link_setup(tmp_path, monkeypatch)
    dest = a["items"][0]["dest"]
    os.makedirs(dest)
    with open(os.path.join(dest, S.LINK_MARKER), "w") as fh:
        fh.write("{}\n")
    snap = a["items"][0]["snapshot"]
    for f in a["items"][0]["files"]:
        os.symlink(os.path.join(snap, f["name"]), os.path.join(dest, f["name"]))
    os.chown(dest, 65534, 65534)  # nobody's: it could swap the links after they were checked
    r = S.act_store(a)
    assert not r["ok"] and r["kind"] == "unsafe" and "uid 65534" in r["message"] and dest in r["message"]
    os.chown(dest, 0, 0)
    os.chmod(dest, 0o777)
    r = S.act_store(a)
    assert not r["ok"] and r["kind"] == "unsafe" and "777" in r["message"]
    os.chmod(dest, 0o755)
    r = S.act_store(a)
    assert r["ok"], r


# ------------------------------------------------------------ finding 7: a hub that drips


def test_7_a_dripping_hub_meets_the_deadline(hub, tmp_path):
    (tmp_path / "models").mkdir()
    it = {"role": "model", "dest_kind": "dir", "dest": str(tmp_path / "models" / "M"), "hub": "acme/M",
          "endpoint": hub.endpoint, "revision": hub.commit}
    lst = F.hub_info(it, None, 10)
    it["commit"] = lst["commit"]
    need, _ = F.plan_item(it, lst, str(tmp_path / "state"))
    big = [f for f in need if f["name"] == BIG]
    hub.fault(drip_s=0.05)  # a byte every 50 ms: never a stall, never an end
    out = {}

    def go():
        tr = Transfer([(it, it["commit"], f, None) for f in big], request=F._hub_request, error=F.hub_error,
                      connections=1, range_bytes=8 * MIB, deadline=now() + 1.5, stall_s=30, log=lambda m: None,
                      on_progress=lambda busy, n: None, on_verified=lambda pf, got: None)
        try:
            tr.run()
        except FetchError as e:
            out["e"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)  # generous: the deadline is 1.5 s; the old code read 1 MiB at 20 B/s (14 hours)
    assert not t.is_alive(), "the transfer outlived its deadline"
    assert out["e"].kind == "timeout" and "time limit" in out["e"].message


# ------------------------------------------------------------ finding 8: shell text built by hand


def test_8_a_source_path_with_a_quote_is_data_and_plan_shows_the_command_that_runs(tmp_path):
    from orchestrator.steps import plan as P

    src = str(tmp_path / "it's; touch pwned; '")
    os.makedirs(src)
    (tmp_path / "it's; touch pwned; '" / "deploy-manifest.json").write_text("{}")
    (tmp_path / "it's; touch pwned; '" / "w.bin").write_bytes(b"w")
    inc = str(tmp_path / "in coming")
    argv = P.copy_from_host_argv(101, src, inc)
    i = argv.index("pct")
    local = argv[:i] + argv[argv.index("--", i) + 1:]  # the same text, the container half run here
    r = subprocess.run(local, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(inc)) == ["deploy-manifest.json", "w.bin"]
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")
    r = subprocess.run(P.copy_from_host_argv(101, src + "-gone", inc)[:6] + ["true"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 3 and "no such directory on the host: " + src + "-gone" in r.stderr
    src2 = str(tmp_path / "m")
    os.makedirs(src2)
    r = subprocess.run(P.copy_from_host_argv(101, src2, inc)[:6] + ["true"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 4 and "no deploy-manifest.json in " + src2 in r.stderr


# ------------------------------------------------------------ finding 9: a "complete" ranges record


def test_9_a_complete_ranges_record_never_skips_the_hash(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    it = store_item(hub, store)
    lst = F.hub_info(it, None, 10)
    it["commit"] = lst["commit"]
    F.plan_item(it, lst, str(store / ".deploy-state"))
    f = [x for x in lst["files"] if x["name"] == BIG][0]
    part, done = _partial(it, it["commit"], f)
    with open(part, "wb") as fh:
        fh.write(os.urandom(f["size"]))  # swapped bytes, the right size
    with open(sidecar_of(part), "w") as fh:
        json.dump({"size": f["size"], "ranges": [[0, f["size"], f["size"]]]}, fh)
    assert read_ranges(part, f["size"]) == [[0, f["size"], f["size"]]]
    tr = Transfer([(it, it["commit"], f, None)], request=F._hub_request, error=F.hub_error, connections=2,
                  range_bytes=MIB, deadline=now() + 60, stall_s=10, log=lambda m: None,
                  on_progress=lambda busy, n: None, on_verified=lambda pf, got: None)
    with pytest.raises(FetchError) as e:
        tr.run()
    assert e.value.kind == "mismatch" and e.value.details["expected"] == f["sha256"]
    assert not os.path.exists(done) and not os.path.exists(part)


# ------------------------------------------------------------ the small ones


def test_missing_files_are_listed_by_name_not_by_letter(hub, tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    it = store_item(hub, store)
    assert run_fetch(store, [it])["status"] == "ok"
    snap = os.path.join(str(store), "hub", "models--acme--M", "snapshots", hub.commit)
    os.unlink(os.path.join(snap, "config.json"))
    p = in_place(it, os.path.join(str(store), ".deploy-state"))
    assert "missing: config.json" in p["why"] and "c, o, n" not in p["why"]


# ------------------------------------------------------------ a store mounted into a privileged container


def test_a_privileged_container_is_told_what_it_can_do_to_the_store():
    from orchestrator.hosts.doctor import store_findings
    from orchestrator.hosts.prepare import mount_plan

    assert mount_plan(["arch: amd64"], [("/srv/store", "/models")], 101)["privileged"]
    assert not mount_plan(["unprivileged: 1"], [("/srv/store", "/models")], 101)["privileged"]
    cfg = ["arch: amd64", "mp0: /srv/store,mp=/models,ro=1"]
    f = store_findings({"config": cfg}, "pve1", 101, {"store": "/srv/store"})
    assert [x["class"] for x in f] == ["privileged-store"]
    assert "remount the store /srv/store read-write" in f[0]["cause"] and "pve1/101" in f[0]["cause"]
    assert store_findings({"config": cfg + ["unprivileged: 1"]}, "pve1", 101, {"store": "/srv/store"}) == []
    assert store_findings({"config": ["mp0: /srv/other,mp=/models,ro=1"]}, "pve1", 101, {"store": "/srv/store"}) == []
    assert store_findings({"config": cfg}, "pve1", 101, {"store": None}) == []


def test_7_a_dripping_listing_meets_the_deadline(hub, tmp_path):
    hub.fault(drip_listing_s=0.05)
    it = store_item(hub, tmp_path / "store")
    out = {}

    def go():
        try:
            F.hub_info(it, None, 30, now() + 1.5)
        except FetchError as e:
            out["e"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the listing read outlived its deadline"
    assert out["e"].kind == "timeout" and "acme/M" in out["e"].message and "listing" in out["e"].message


def test_a_blobs_directory_an_older_version_left_0700_is_readable_again(tmp_path):
    store = tmp_path / "store"
    assert S._mark(str(store))["ok"]
    b = blobs(store)
    os.makedirs(b)
    os.chmod(b, 0o700)
    assert S._mark(str(store))["ok"]
    assert stat.S_IMODE(os.stat(b).st_mode) == 0o755


def read_as_mapped_root(paths):
    """{path: sha256 or 'error: ...'} read by a process in a user namespace whose root is host uid 100000: an
    unprivileged (uid-mapped) Proxmox container's root, to which the host root's files belong to nobody (65534)
    and are readable only through their "others" bits. Skips where user namespaces are not allowed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: unshare, wait for its maps, drop to the mapped root, read
        code = 0
        try:
            os.close(go_w)
            os.close(out_r)
            if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
                code = 90
            else:
                os.write(out_w, b"U")
                os.read(go_r, 1)
                os.setgid(0)
                os.setuid(0)
                res = {}
                for p in paths:
                    try:
                        with open(p, "rb") as fh:
                            res[p] = hashlib.sha256(fh.read()).hexdigest()
                    except OSError as e:
                        res[p] = "error: %s" % e.strerror
                os.write(out_w, json.dumps(res).encode())
        except BaseException:  # noqa: BLE001 - the child never returns into pytest
            code = 91
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(out_w)
    try:
        if os.read(out_r, 1) != b"U":
            os.waitpid(pid, 0)
            pytest.skip("user namespaces are not allowed here")
        for f, text in (("uid_map", "0 100000 65536\n"), ("setgroups", "deny\n"), ("gid_map", "0 100000 65536\n")):
            with open("/proc/%d/%s" % (pid, f), "w") as fh:
                fh.write(text)
        os.write(go_w, b"x")
        data = b""
        while True:
            chunk = os.read(out_r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(go_w)
        os.close(out_r)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    return json.loads(data.decode())


def test_an_unprivileged_uid_mapped_container_reads_the_store_after_a_fetch(hub):
    """The uid-mapping question (issue 50): the store, as the host's fetch leaves it, read by a uid-mapped root
    (host uid 100000) through the snapshot's links, every file with the hub's bytes."""
    import shutil
    import uuid

    if os.geteuid() != 0:
        pytest.skip("needs root (writes the namespace's uid map)")
    store = "/var/tmp/vpd-unit-store-%s" % uuid.uuid4().hex[:10]  # /tmp/pytest-of-root is 0700: not for others
    try:
        assert S._mark(store)["ok"]
        assert run_fetch(store, [store_item(hub, store)])["status"] == "ok"
        snap = os.path.join(store, "hub", "models--acme--M", "snapshots", hub.commit)
        got = read_as_mapped_root([os.path.join(snap, n) for n in hub.files])
        assert got == {os.path.join(snap, n): hashlib.sha256(d).hexdigest() for n, d in hub.files.items()}, got
    finally:
        shutil.rmtree(store, ignore_errors=True)


def test_status_flags_a_store_read_by_a_privileged_container():
    from orchestrator.agent.container.weights import uid_mapped
    from orchestrator.observe.status_render import weights_text

    assert uid_mapped() is False  # this test runs with the host's identity map
    w = {"role": "model", "hub": "acme/M", "commit": "c" * 40, "revision": "c" * 40, "dest": "/root/models/M",
         "source": "store:/srv/store"}
    assert "WARNING" not in weights_text([dict(w, privileged_container=False)])
    t = weights_text([dict(w, privileged_container=True)])
    assert "(shared store /srv/store on the host, read-only) WARNING: a privileged container" in t
    assert "WARNING" not in weights_text([dict(w, source="hub:x", privileged_container=True)])


@pytest.mark.parametrize("lie", [{"sha256": "a" * 64 + "\n"}, {"sha256": "A" * 64}, {"sha256": "a" * 63},
                                 {"blobId": "b" * 40 + "\n"}, {"rfilename": "x\n"}, {"rfilename": "./w"}])
def test_2_hashes_and_names_match_exactly(hub, tmp_path, lie):
    hub.fault(listing={BIG: lie})
    with pytest.raises(FetchError) as e:
        F.hub_info(store_item(hub, tmp_path / "store"), None, 10)
    assert e.value.kind == "hub" and "not believable" in e.value.message


def test_8_plan_shows_the_argv_that_fetch_runs(work):  # noqa: F811 - the fixture
    """deploy plan's line for a directory source is the argv _copy_from_host runs, quoted once (issue 50 finding 8:
    they differed, and the one that ran was built by hand)."""
    import contextlib

    from orchestrator.provision import weights_fetch as OF
    from orchestrator.steps import plan as P
    from orchestrator.core.remote import shell_join
    from orchestrator.core.spec import load_playbook
    from test_spec import edit, inv

    src = "/srv/it's; id > /tmp/pwned; '"
    p = edit(work, "qwen36-dflash", "model:\n  path: /root/models/Qwen3.6-27B\n",
             "model:\n  path: /root/models/Qwen3.6-27B\n  source: {path: \"%s\"}\n" % src.replace('"', '\\"'))
    pb = load_playbook(p, inv(work))
    step = P.step_fetch(pb)
    it = next(i for i in P.fetch_args(pb) if i.get("source_path"))
    assert it["source_path"] == src
    want = P.copy_from_host_argv(pb.vmid, src, it["incoming"])
    assert any(r.startswith(shell_join(want) + "   #") for r in step.runs), step.runs
    ran = []

    class Res:
        exited, out, err = 0, "", ""

    class Session:
        keep_env_supported = True

        def run(self, argv, **kw):
            ran.append(argv)
            return Res()

    class Progress:
        def say(self, *a, **kw):
            pass

        detail = say

        def heartbeat(self, *a, **kw):
            return contextlib.nullcontext()

    class Ctx:
        session, progress, where = Session(), Progress(), "pve1/129"

    OF._copy_from_host(Ctx(), pb, it)
    assert ran == [want]
