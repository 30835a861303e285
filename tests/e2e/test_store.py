"""fetch.store (issue 38) on the test bed: each hub revision fetched once per host into a store on the Proxmox host,
every container of the host reading it read-only through a mount point (`mpN: STORE,mp=/models,ro=1`, added by
deploy prepare: backed up, read back, restarted when confirmed), the model and drafter directories deploy's links
into it, the pinned drafter config a copy of deploy's own. The hub listens on the host's loopback (the host
fetches); nothing leaves the machine."""

import hashlib
import os
import shutil
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import REPO

H = "pve1"
TARGET = "acme/Tiny-Target"
DRAFT = "z-lab/Tiny-DFlash"
WEIGHTS = "model-00001-of-00001.safetensors"
PINNED = "df82aa8b0e47c4312ffb0fab14d20fdb80a5d6a94c5dd4e4878c19165c654fb9"


@pytest.fixture
def store():
    d = f"/var/tmp/vpd-test-store-{uuid.uuid4().hex[:10]}"  # not under /tmp: a container has its own /tmp
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def hub(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "testbed"))
    from vpd_testbed import hub as hubmod
    from vpd_testbed.core import DATA, STALE_CONFIG, safetensors_header

    root = tmp_path / "hub"
    root.mkdir()
    weights = os.urandom(3 << 20)
    commits = {
        "target": hubmod.make_repo(str(root), TARGET, {
            "config.json": (DATA / "qwen36-27b-target.trimmed.config.json").read_bytes(), WEIGHTS: weights,
            "tokenizer/vocab.txt": b"a\nb\n"}),
        "drafter": hubmod.make_repo(str(root), DRAFT, {"config.json": STALE_CONFIG.read_bytes(),
                                                       "model.safetensors": safetensors_header()}),
    }
    with open(tmp_path / "hub.log", "wb") as log, hubmod.running(root, log) as ns:
        ns.commits, ns.weights, ns.log = commits, weights, tmp_path / "hub.log"
        yield ns


def playbooks_with_store(playbooks, hub, store):
    """qwen36-dflash (pve1/129) and a copy of it for pve1/130 (qwen36-b), both reading the host's store."""
    p = playbooks.dir / "qwen36-dflash.yaml"
    text = p.read_text()
    text = text.replace("model:\n  path: /root/models/Qwen3.6-27B\n",
                        f"model:\n  path: /root/models/Tiny-Target\n  hub: {TARGET}\n  revision: main\n"
                        f"  endpoint: {hub.endpoint}\n", 1)
    text = text.replace("    path: /root/models/Qwen3.6-27B-DFlash\n",
                        f"    path: /root/models/Tiny-DFlash\n    hub: {DRAFT}\n    revision: {hub.commits['drafter']}\n"
                        f"    endpoint: {hub.endpoint}\n", 1)
    text += f"\nfetch:\n  store: {store}\n"
    p.write_text(text)
    b = text.replace("name: qwen36-dflash", "name: qwen36-b", 1).replace("  vmid: 129\n  gpus: [0, 1, 2, 3]",
                                                                         "  vmid: 130\n  gpus: [0, 1]", 1)
    b = b.replace("tensor_parallel_size: 4", "tensor_parallel_size: 2")
    assert "vmid: 130" in b
    (playbooks.dir / "qwen36-b.yaml").write_text(b)


def sh(tb, vmid, cmd):
    return tb.container_exec(H, vmid, ["sh", "-c", cmd])


def conf(tb, vmid):
    return tb.hostdir(H) / "pve" / "nodes" / H / "lxc" / f"{vmid}.conf"


def downloads(hub, name):
    return sum(1 for ln in hub.log.read_text(errors="replace").splitlines() if "GET" in ln and f"/{name}" in ln
               and "/cdn/" not in ln)


def test_store_once_per_host_read_only_pinned_config_and_backup(tb, hub, store, deploy, playbooks):
    playbooks_with_store(playbooks, hub, store)
    env = playbooks.env
    # the plan shows where the files come from and the mount point
    p = deploy("plan", "qwen36-dflash", env=env)
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert f"-> {store}/hub/models--acme--Tiny-Target/" in out and f"mpN: {store},mp=/models,ro=1" in out, out

    # without the mount point: the host's store gets the files, the container is told what to do
    before = conf(tb, 129).read_text()
    p = deploy("fetch", "qwen36-dflash", env=env)
    assert p.returncode == 1, p.stderr
    err = " ".join(p.stderr.split())
    assert "/models in the container is not the host's store" in err and "deploy prepare pve1/129 -y" in err, err
    snap = f"{store}/hub/models--acme--Tiny-Target/snapshots/{hub.commits['target']}"
    with open(f"{snap}/{WEIGHTS}", "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == hashlib.sha256(hub.weights).hexdigest()
    assert conf(tb, 129).read_text() == before  # fetch never changes a container's config

    # deploy prepare adds the mount point (planned, backed up, read back, restarted when confirmed)
    j = deploy("--json", "prepare", "pve1/129", "--dry-run", env=env)
    assert j.returncode == 0, j.stdout + j.stderr
    assert j.json["mount_lines"] == [f"mp0: {store},mp=/models,ro=1"], j.json
    assert [s["step"] for s in j.json["plan"]][:4] == ["backup", "store", "config", "read back"]
    j = deploy("--json", "prepare", "pve1/129", "-y", env=env)
    assert j.returncode == 0, j.stdout + j.stderr
    r = j.json
    assert "pct reboot 129" in r["applied"] and f"mp0: {store},mp=/models,ro=1\n" in conf(tb, 129).read_text()
    assert [c["step"] for c in r["chain"]][-1] == "fetch" and r["chain"][-1]["ok"], r["chain"]
    assert r["chain"][-1]["status"] == "linked", r["chain"]  # linked now, not "already fetched" (issue 53 item 14)
    backup = r["backup"]
    assert (tb.hostdir(H) / "home" / backup[len("/root/"):]).read_text() == before

    # the container reads the store read-only; the model dir is links into it
    c = sh(tb, 129, f"readlink /root/models/Tiny-Target/{WEIGHTS}; sha256sum /root/models/Tiny-Target/{WEIGHTS}; "
                    "cat /root/models/Tiny-Target/tokenizer/vocab.txt")
    lines = c.stdout.split("\n")
    assert lines[0] == f"/models/hub/models--acme--Tiny-Target/snapshots/{hub.commits['target']}/{WEIGHTS}", c.stdout
    assert lines[1].split()[0] == hashlib.sha256(hub.weights).hexdigest() and lines[2:4] == ["a", "b"]
    w = sh(tb, 129, f"echo x > /models/hub/models--acme--Tiny-Target/snapshots/{hub.commits['target']}/{WEIGHTS}")
    assert w.returncode != 0 and "Read-only file system" in w.stderr, w.stderr

    # a second container of the host: its mount point, then its fetch downloads nothing
    j = deploy("--json", "prepare", "pve1/130", "-y", "--no-install", env=env)
    assert j.returncode == 0, j.stdout + j.stderr
    n = downloads(hub, WEIGHTS)
    assert n == 1, hub.log.read_text()
    p = deploy("--json", "fetch", "qwen36-b", env=env)
    assert p.returncode == 0, p.stderr
    assert "nothing downloaded (in the store already)" in p.stderr and downloads(hub, WEIGHTS) == 1
    assert p.json["status"] == "linked", p.json
    assert sh(tb, 130, f"sha256sum /root/models/Tiny-Target/{WEIGHTS}").stdout.split()[0] == \
        hashlib.sha256(hub.weights).hexdigest()
    blobs = os.listdir(f"{store}/hub/models--acme--Tiny-Target/blobs")
    assert len([b for b in blobs if not b.endswith((".incomplete", ".ranges"))]) == 3  # one copy on the host

    # up: the pinned drafter config is served from the container's own copy; the store's copy is the hub's
    p = deploy("up", "qwen36-dflash", env=env)
    assert p.returncode == 0, p.stderr
    got = sh(tb, 129, "sha256sum /root/models/Tiny-DFlash/config.json; test -L /root/models/Tiny-DFlash/config.json "
                      "&& echo link || echo file").stdout.split()
    assert got[0] == PINNED and got[-1] == "file"
    dsnap = f"{store}/hub/models--z-lab--Tiny-DFlash/snapshots/{hub.commits['drafter']}"
    with open(f"{dsnap}/config.json", "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() != PINNED
    s = deploy("status", env=env)
    assert f"(shared store {store} on the host, read-only)" in " ".join(s.stdout.split()), s.stdout
    # the test bed's containers are not uid-mapped: privileged, as far as the store is concerned (issue 50)
    assert "WARNING: a privileged container" in " ".join(s.stdout.split()), s.stdout

    # the config backup restores the container's config as it was
    h = tb.host_exec(H, ["sh", "-c", f"cp {backup} /etc/pve/lxc/129.conf && pct config 129"])
    assert h.returncode == 0 and "mp0:" not in h.stdout and conf(tb, 129).read_text() == before


def test_two_fetches_at_once_download_once(tb, hub, store, deploy, playbooks):
    playbooks_with_store(playbooks, hub, store)
    env = playbooks.env
    for v in (129, 130):
        j = deploy("--json", "prepare", f"pve1/{v}", "-y", "--no-install", env=env)
        assert j.returncode == 0, j.stdout + j.stderr
    hub.fault(rate_bps=2 << 20)  # 3 MiB of weights: both fetches overlap
    with ThreadPoolExecutor(2) as pool:  # two deploy processes at once, one per container
        outs = list(pool.map(lambda name: deploy("fetch", name, env=env, timeout=120), ("qwen36-dflash", "qwen36-b")))
    for p in outs:
        assert p.returncode == 0, p.stderr
    assert downloads(hub, WEIGHTS) == 1, hub.log.read_text()
    both = " ".join(p.stderr for p in outs)
    assert "in progress" in both and "following it" in both, both
    for v in (129, 130):
        assert sh(tb, v, f"sha256sum /root/models/Tiny-Target/{WEIGHTS}").stdout.split()[0] == \
            hashlib.sha256(hub.weights).hexdigest()


def test_store_refusals_before_anything_runs(deploy, playbooks, store, hub):
    playbooks_with_store(playbooks, hub, store)
    p = playbooks.dir / "qwen36-dflash.yaml"
    text = p.read_text()
    p.write_text(text.replace(f"  store: {store}\n", "  store: /etc/pve\n"))
    r = deploy("plan", "qwen36-dflash", env=playbooks.env)
    assert r.returncode == 2 and "fetch.store" in r.stderr and "not a directory of its own" in r.stderr, r.stderr
    p.write_text(text.replace(f"  store: {store}\n", f"  store: {store}\n  mount: /root/models\n"))
    r = deploy("plan", "qwen36-dflash", env=playbooks.env)
    assert r.returncode == 2 and "overlaps model.path" in r.stderr, r.stderr
    p.write_text(text.replace(f"  store: {store}\n", "  store: \"/srv/x;rm -rf /\"\n"))
    r = deploy("plan", "qwen36-dflash", env=playbooks.env)
    assert r.returncode == 2 and "fetch.store" in r.stderr, r.stderr


def test_hostile_hub_and_planted_links_leave_nothing_outside_the_store(tb, hub, store, deploy, playbooks):
    """Issue 50 on the test bed: the host runs the fetch as root; a hub hash that is a path, and a snapshot
    directory planted as a link out of the store, end in a clear error naming the hub or the store path, and
    nothing outside the store is made or changed. Then the clean fetch says how many files it verified."""
    playbooks_with_store(playbooks, hub, store)
    env = playbooks.env
    pwn = f"/var/tmp/vpd-test-pwn-{uuid.uuid4().hex[:8]}"
    depth = len(f"{store}/hub/models--acme--Tiny-Target/blobs".strip("/").split("/"))
    hub.fault(listing={WEIGHTS: {"sha256": "../" * depth + pwn.strip("/") + "/evil"}}, cut={WEIGHTS: 1000})
    try:
        p = deploy("fetch", "qwen36-dflash", env=env)
        err = " ".join(p.stderr.split())
        assert p.returncode == 1 and TARGET in err and "is not 64 lowercase hex digits" in err, err
        assert not os.path.exists(pwn)
    finally:
        shutil.rmtree(pwn, ignore_errors=True)

    hub.fault()
    outside = f"/var/tmp/vpd-test-outside-{uuid.uuid4().hex[:8]}"
    os.makedirs(outside)
    try:
        with open(f"{outside}/config.json", "w") as fh:
            fh.write("precious\n")
        snaps = f"{store}/hub/models--acme--Tiny-Target/snapshots"
        os.makedirs(snaps, exist_ok=True)
        os.symlink(outside, f"{snaps}/{hub.commits['target']}")
        p = deploy("fetch", "qwen36-dflash", env=env)
        err = " ".join(p.stderr.split())
        assert p.returncode == 1 and f"{snaps}/{hub.commits['target']} is a symbolic link" in err, err
        assert os.listdir(outside) == ["config.json"] and open(f"{outside}/config.json").read() == "precious\n"
        os.unlink(f"{snaps}/{hub.commits['target']}")
    finally:
        shutil.rmtree(outside, ignore_errors=True)

    j = deploy("--json", "prepare", "pve1/129", "-y", "--no-install", env=env)
    assert j.returncode == 0, j.stdout + j.stderr
    assert any("privileged container" in n for n in j.json["notes"]), j.json["notes"]  # the test bed's are
    p = deploy("fetch", "qwen36-dflash", env=env)
    assert p.returncode == 0, p.stderr
    assert "(None files)" not in p.stdout and "every file verified (3 files)" in p.stdout, p.stdout
    assert oct(os.stat(f"{store}/hub/models--acme--Tiny-Target/blobs").st_mode & 0o777) == "0o755"
