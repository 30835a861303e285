"""deploy fetch (issue 27) on the test bed: a hub-compatible server (testbed/vpd_testbed/hub.py) in the container's
own network namespace (the container reaches it at 127.0.0.1; nothing leaves the machine), serving small
repositories through the endpoints huggingface_hub uses, with its faults: gated, slow, cut, corrupt."""

import json
import os
import subprocess
import sys
import time

import pytest

from e2e_helpers import REPO
from playbook_support import edit_file

H, V = "pve1", 129
PORT = 8077
ENDPOINT = f"http://127.0.0.1:{PORT}"
TARGET = "acme/Tiny-Target"
DRAFT = "z-lab/Tiny-DFlash"
WEIGHTS = "model-00001-of-00001.safetensors"
STATE = "/var/lib/vllm-pve-deploy"
PINNED = "df82aa8b0e47c4312ffb0fab14d20fdb80a5d6a94c5dd4e4878c19165c654fb9"


@pytest.fixture
def hub(tb, tmp_path):
    """The hub, started in pve1/129's network namespace; repos: the target (its config is the test bed's target
    config, plus 3 MiB of weights), the drafter (the published-looking config and a safetensors header), a gated
    copy of the drafter. fault(**kw) writes faults.json."""
    sys.path.insert(0, os.path.join(REPO, "testbed"))
    from vpd_testbed import hub as hubmod
    from vpd_testbed.core import DATA, STALE_CONFIG, safetensors_header

    root = tmp_path / "hub"
    root.mkdir()
    weights = os.urandom(3 << 20)
    target_cfg = (DATA / "qwen36-27b-target.trimmed.config.json").read_bytes()
    commits = {
        "target": hubmod.make_repo(str(root), TARGET, {"config.json": target_cfg, WEIGHTS: weights,
                                                       "tokenizer/vocab.txt": b"a\nb\n"}),
        "drafter": hubmod.make_repo(str(root), DRAFT, {"config.json": STALE_CONFIG.read_bytes(),
                                                       "model.safetensors": safetensors_header()}),
        "gated": hubmod.make_repo(str(root), "z-lab/Gated-DFlash", {"config.json": STALE_CONFIG.read_bytes(),
                                                                    "model.safetensors": safetensors_header()},
                                  gated="manual", accepted=["hf_accepted"]),
    }
    (root / "tokens.json").write_text(json.dumps(["hf_accepted", "hf_noaccess"]))
    pid = tb.init_pid(H, V)
    log = open(tmp_path / "hub.log", "wb")
    proc = subprocess.Popen(["nsenter", "-t", str(pid), "-n", "--", sys.executable, "-SE",
                             os.path.join(REPO, "testbed", "vpd_testbed", "hub.py"), str(root), str(PORT)],
                            stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 20
    while not (root / "hub.ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "hub.log").read_text()
        time.sleep(0.05)
    tb.container_exec(H, V, ["sh", "-c", "rm -rf /root/.cache/huggingface /root/models/Tiny-*"])

    class NS:
        pass
    ns = NS()
    ns.root, ns.commits, ns.weights, ns.log = root, commits, weights, tmp_path / "hub.log"

    def fault(**kw):
        (root / "faults.json").write_text(json.dumps(kw))
    ns.fault = fault
    yield ns
    proc.kill()
    proc.wait(5)
    log.close()


def playbook(playbooks, model=None, drafter=None):
    """qwen36-dflash with the model block (and the drafter's path line) replaced."""
    p = playbooks.dir / "qwen36-dflash.yaml"
    text = p.read_text()
    if model is not None:
        text = text.replace("model:\n  path: /root/models/Qwen3.6-27B\n", "model:\n" + model, 1)
    if drafter is not None:
        text = text.replace("    path: /root/models/Qwen3.6-27B-DFlash\n", drafter, 1)
    p.write_text(text)


MODEL = f"  path: /root/models/Tiny-Target\n  hub: {TARGET}\n  revision: main\n  endpoint: {ENDPOINT}\n"


def drafter_block(hub, repo=DRAFT, extra=""):
    return (f"    hub_id: {repo}\n    revision: {hub.commits['drafter'] if repo == DRAFT else hub.commits['gated']}\n"
            f"    endpoint: {ENDPOINT}\n" + extra)


def edit(playbooks, old, new):
    edit_file(playbooks.dir / "qwen36-dflash.yaml", old, new)


def sh(tb, cmd):
    return tb.container_exec(H, V, ["sh", "-c", cmd]).stdout.strip()


def test_fetch_then_up_rerun_and_revision_shown(tb, hub, deploy, playbooks):
    playbook(playbooks, MODEL, drafter_block(hub))
    # issue 39: deploy fetch is a plan run by the executor: `deploy plan --op fetch` and `fetch --dry-run` show it
    p = deploy("--json", "plan", "qwen36-dflash", "--op", "fetch", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert [s["step"] for s in p.json["steps"]] == ["container", "fetch"], p.stdout
    assert '"op":"probe"' in p.json["steps"][1]["command"] and TARGET in p.json["steps"][1]["command"]
    d = deploy("fetch", "qwen36-dflash", "--dry-run", "--connections", "3", env=playbooks.env)
    assert d.returncode == 0 and "over up to 3 connections" in d.stdout and "No container lock" in d.stdout, d.stdout
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    # the branch is resolved once, shown and recorded
    assert f"{TARGET}@main is commit {hub.commits['target']}" in p.stderr, p.stderr
    assert "verified" in p.stderr and "in place at /root/models/Tiny-Target" in p.stdout, p.stdout
    assert sh(tb, f"sha256sum /root/models/Tiny-Target/{WEIGHTS}").split()[0] == __import__("hashlib").sha256(
        hub.weights).hexdigest()
    assert sh(tb, "cat /root/models/Tiny-Target/tokenizer/vocab.txt") == "a\nb"
    assert sh(tb, "ls -a /root/models | grep -c deploy-fetch || true") == "0"  # staging removed
    # the drafter went into the hub cache as huggingface_hub lays it out: snapshot links into blobs/
    snap = f"/root/.cache/huggingface/hub/models--z-lab--Tiny-DFlash/snapshots/{hub.commits['drafter']}"
    assert sh(tb, f"readlink {snap}/model.safetensors").startswith("../../blobs/")
    # again: nothing to do
    p = deploy("--json", "fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0 and p.json["status"] == "already fetched", p.stderr
    assert {r["role"]: r["commit"] for r in p.json["info"]["records"]} == {"model": hub.commits["target"],
                                                                          "drafter": hub.commits["drafter"]}
    # --verify re-hashes
    p = deploy("fetch", "qwen36-dflash", "--verify", env=playbooks.env)
    assert p.returncode == 0 and "re-hashed" in p.stderr, p.stderr
    assert "matches its record" in p.stdout and "--verify" not in p.stdout, p.stdout  # not advised again (issue 53)
    # up: the fetch step has nothing to do, the pinned config is served from deploy's own drafter dir
    p = deploy("up", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert "already fetched and verified" in p.stderr
    # the hub cache was not written by the pinning: the snapshot's config.json is still the hub's
    assert sh(tb, f"sha256sum {snap}/config.json").split()[0] != PINNED
    # verify and status show the revision serving
    p = deploy("--json", "verify", "qwen36-dflash", env=playbooks.env)
    assert p.json["revisions"]["model"]["commit"] == hub.commits["target"], p.stdout[-2000:]
    p = deploy("verify", "qwen36-dflash", env=playbooks.env)
    assert f"{TARGET}@main ({hub.commits['target'][:12]})" in p.stdout + p.stderr
    p = deploy("status", env=playbooks.env)
    assert "Weights (fetched and verified by deploy fetch):" in p.stdout, p.stdout
    assert f"model {TARGET}@main ({hub.commits['target'][:12]}) at /root/models/Tiny-Target" in p.stdout
    assert f"drafter {DRAFT}@{hub.commits['drafter'][:12]}" in p.stdout, p.stdout
    p = deploy("--json", "status", env=playbooks.env)
    row = next(r for r in p.json["rows"] if r["vmid"] == V and r["host"] == H)
    assert {w["role"] for w in row["weights"]} == {"model", "drafter"}


def test_up_fetches_first_and_no_fetch_refuses(tb, hub, deploy, playbooks):
    """The drafter here goes into a directory (drafter.path + hub): the pinned config replaces the hub's there."""
    playbook(playbooks, MODEL, f"    path: /root/models/Tiny-DFlash\n    hub: {DRAFT}\n"
                               f"    revision: {hub.commits['drafter']}\n    endpoint: {ENDPOINT}\n")
    p = deploy("up", "qwen36-dflash", "--no-fetch", env=playbooks.env)
    assert p.returncode == 1 and "not in place" in p.stderr and "--no-fetch" in p.stderr, p.stderr
    assert sh(tb, "test -e /root/models/Tiny-Target && echo yes || echo no") == "no"
    p = deploy("up", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert "ok   fetch" in p.stderr and "is up on pve1/129" in p.stdout, p.stderr
    st = json.loads(sh(tb, f"cat {STATE}/state.json"))
    assert st["argv"][2] == "/root/models/Tiny-Target"
    assert sh(tb, "sha256sum /root/models/Tiny-DFlash/config.json").split()[0] == PINNED
    assert sh(tb, "ls /root/models/Tiny-DFlash | grep -c config.json.bak-") == "1"  # the hub's, kept as backup
    # the pinned config in the drafter directory is not "missing": nothing to fetch, and it stays pinned
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0 and "already fetched" in p.stderr, p.stderr
    assert sh(tb, "sha256sum /root/models/Tiny-DFlash/config.json").split()[0] == PINNED


def test_cut_transfer_resumes_and_slow_link_shows_progress(tb, hub, deploy, playbooks):
    playbook(playbooks, MODEL)
    hub.fault(cut={WEIGHTS: 1 << 20}, rate_bps=1 << 20)
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert "transfer cut at 1.0 MiB of 3.0 MiB" in p.stderr and "resuming" in p.stderr, p.stderr
    assert "/s, ETA" in p.stderr and "| total" in p.stderr, p.stderr
    log = hub.log.read_text()
    assert log.count(f"GET /cdn/{TARGET}/") == 2, log  # the second one with a Range
    assert sh(tb, f"sha256sum /root/models/Tiny-Target/{WEIGHTS}").split()[0] == __import__("hashlib").sha256(
        hub.weights).hexdigest()


def test_corrupted_file_is_named_and_nothing_installed(tb, hub, deploy, playbooks):
    playbook(playbooks, MODEL)
    hub.fault(corrupt=[WEIGHTS])
    p = deploy("--json", "fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1
    err = p.json["error"]
    assert WEIGHTS in err["message"] and "expected sha256" in err["message"], err
    assert __import__("hashlib").sha256(hub.weights).hexdigest() in err["message"]
    assert sh(tb, "test -e /root/models/Tiny-Target && echo yes || echo no") == "no"
    hub.fault()
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr


def test_parallel_ranges_cut_range_resumed_and_bad_range_caught(tb, hub, deploy, playbooks):
    """Issue 38: 1 MiB ranges, so the 3 MiB weights come as 3 ranges over several connections."""
    playbook(playbooks, MODEL)
    p = playbooks.dir / "qwen36-dflash.yaml"
    p.write_text(p.read_text() + "\nfetch:\n  connections: 4\n  range_mib: 1\n")
    # a bad byte in the last range: the whole-file hash catches it, named, both hashes
    hub.fault(corrupt_at={WEIGHTS: (5 << 19)})
    r = deploy("--json", "fetch", "qwen36-dflash", env=playbooks.env)
    assert r.returncode == 1
    msg = r.json["error"]["message"]
    want = __import__("hashlib").sha256(hub.weights).hexdigest()
    bad = bytearray(hub.weights)
    bad[5 << 19] ^= 0xFF
    assert WEIGHTS in msg and want in msg and __import__("hashlib").sha256(bad).hexdigest() in msg, msg
    assert sh(tb, "test -e /root/models/Tiny-Target && echo yes || echo no") == "no"
    # a range cut mid-way resumes from where it stopped; three ranges were asked for
    hub.fault(cut={WEIGHTS: 300_000})
    r = deploy("fetch", "qwen36-dflash", "--connections", "3", env=playbooks.env)
    assert r.returncode == 0, r.stderr
    assert "over up to 3 connections, 1 in 1.0 MiB ranges" in r.stderr, r.stderr
    assert "transfer cut at" in r.stderr and "(in bytes" in r.stderr and "resuming" in r.stderr, r.stderr
    assert sh(tb, f"sha256sum /root/models/Tiny-Target/{WEIGHTS}").split()[0] == want
    assert sh(tb, "ls -a /root/models | grep -c deploy-fetch || true") == "0"


def test_gated_token_messages_and_wrong_revision(tb, hub, deploy, playbooks):
    playbook(playbooks, drafter=drafter_block(hub, "z-lab/Gated-DFlash"))
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1 and "gated repository" in p.stderr and "token_env" in p.stderr, p.stderr
    assert f"{ENDPOINT}/z-lab/Gated-DFlash" in p.stderr
    edit(playbooks, f"    endpoint: {ENDPOINT}\n    pinned", f"    endpoint: {ENDPOINT}\n    token_env: TEST_HUB_TOKEN\n    pinned")
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 2 and "TEST_HUB_TOKEN" in p.stderr and "not set" in p.stderr, p.stderr
    p = deploy("fetch", "qwen36-dflash", env=dict(playbooks.env, TEST_HUB_TOKEN="hf_wrong"))
    assert p.returncode == 1 and "refused the token in TEST_HUB_TOKEN" in p.stderr, p.stderr
    p = deploy("fetch", "qwen36-dflash", env=dict(playbooks.env, TEST_HUB_TOKEN="hf_noaccess"))
    assert p.returncode == 1 and "terms are not accepted" in p.stderr, p.stderr
    assert f"visit {ENDPOINT}/z-lab/Gated-DFlash" in p.stderr
    p = deploy("fetch", "qwen36-dflash", env=dict(playbooks.env, TEST_HUB_TOKEN="hf_accepted"))
    assert p.returncode == 0, p.stderr
    # the token never reached argv or the audit log
    assert "hf_accepted" not in (deploy.state_dir / "audit.jsonl").read_text()


def test_unknown_revision_and_network_down(tb, hub, deploy, playbooks):
    playbook(playbooks, MODEL.replace("revision: main", "revision: no-such-branch"))
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1 and "has no revision 'no-such-branch'" in p.stderr, p.stderr
    edit(playbooks, "revision: no-such-branch", "revision: main")
    edit(playbooks, f":{PORT}", ":8079")
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1 and "network: cannot reach the hub at http://127.0.0.1:8079" in p.stderr, p.stderr


def test_disk_too_small_is_refused_before_download(tb, hub, deploy, playbooks):
    tb.container_exec(H, V, ["sh", "-c", "mkdir -p /root/models/Tiny-small && "
                                         "mount -t tmpfs -o size=1m tmpfs /root/models/Tiny-small"], check=True)
    try:
        playbook(playbooks, MODEL.replace("/root/models/Tiny-Target", "/root/models/Tiny-small/target"))
        p = deploy("--json", "fetch", "qwen36-dflash", env=playbooks.env)
        assert p.returncode == 1
        msg = p.json["error"]["message"]
        assert "not enough space at /root/models/Tiny-small" in msg and "free" in msg and "nothing was downloaded" in msg
        assert p.json["error"]["details"]["need"] > p.json["error"]["details"]["free"]
        assert "GET /cdn/" not in hub.log.read_text()
    finally:
        tb.container_exec(H, V, ["umount", "/root/models/Tiny-small"])


def test_ssh_drop_during_fetch_then_reattach(tb, hub, deploy, playbooks):
    playbook(playbooks, MODEL)
    hub.fault(rate_bps=512 << 10)  # 3 MiB: about 6 s
    tb.set_fault(H, None, "ssh_drop_after_s", 3.5)
    try:
        p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    finally:
        tb.set_fault(H, None, "ssh_drop_after_s", None)
    assert p.returncode == 3, p.stderr
    assert "lost the connection" in p.stderr and "re-attaches" in p.stderr, p.stderr
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert "re-attaching" in p.stderr or "ended while nobody was attached" in p.stderr, p.stderr
    assert "in place at /root/models/Tiny-Target" in p.stdout


def test_path_source_from_the_host(tb, hub, deploy, playbooks, tmp_path):
    src = tmp_path / "host-models" / "tiny"
    (src / "tokenizer").mkdir(parents=True)
    (src / "config.json").write_bytes((hub.root / "repos" / "acme" / "Tiny-Target" / "commits" / hub.commits["target"]
                                       / "config.json").read_bytes())
    (src / WEIGHTS).write_bytes(hub.weights)
    (src / "tokenizer" / "vocab.txt").write_bytes(b"a\nb\n")
    p = deploy("manifest", str(src), "--hub", TARGET, "--revision", hub.commits["target"])
    assert p.returncode == 0 and "3 files" in p.stdout, p.stderr
    playbook(playbooks, f"  path: /root/models/Tiny-Target\n  hub: {TARGET}\n  revision: {hub.commits['target']}\n"
                        f"  source: {{path: {src}}}\n")
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 0, p.stderr
    assert "copying" in p.stderr and "in place at /root/models/Tiny-Target" in p.stdout, p.stdout + p.stderr
    assert "GET" not in hub.log.read_text()  # nothing from the hub
    # a changed file on the host is caught against the manifest
    tb.container_exec(H, V, ["sh", "-c", f"rm -rf /root/models/Tiny-Target {STATE}/fetched"])
    (src / WEIGHTS).write_bytes(bytes([hub.weights[0] ^ 0xFF]) + hub.weights[1:])  # b"x" + ...: 1 in 256 unchanged
    p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
    assert p.returncode == 1 and WEIGHTS in p.stderr and "manifest" in p.stderr, p.stderr


def test_disk_full_midway_keeps_the_partial_and_resumes(tb, hub, deploy, playbooks):
    """The space check passes (3 MiB to come, 3.5 MiB free), then something else fills the disk mid-download."""
    small = "/root/models/Tiny-small"
    tb.container_exec(H, V, ["sh", "-c", f"mkdir -p {small} && mount -t tmpfs -o size=3584k tmpfs {small}"], check=True)
    try:
        playbook(playbooks, MODEL.replace("/root/models/Tiny-Target", f"{small}/target"))
        hub.fault(rate_bps=1 << 20)
        e = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1",
                 **playbooks.env)
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "fetch", "qwen36-dflash"], cwd=REPO, env=e,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        part = f"{small}/.target.deploy-fetch/{hub.commits['target'][:12]}/{WEIGHTS}.incomplete"
        deadline = time.monotonic() + 60
        while sh(tb, f"test -s {part} && echo yes") != "yes":
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        sh(tb, f"dd if=/dev/zero of={small}/filler bs=64k count=100 2>/dev/null; true")  # ~ fills what is left
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert f"disk full at {small}" in err and "kept for resume" in err and "nothing was moved into place" in err, err
        assert sh(tb, f"test -s {part} && echo kept") == "kept"
        assert sh(tb, f"test -e {small}/target && echo yes || echo no") == "no"
        sh(tb, f"rm -f {small}/filler")
        hub.fault()
        p = deploy("fetch", "qwen36-dflash", env=playbooks.env)
        assert p.returncode == 0, p.stderr
        assert __import__("hashlib").sha256(hub.weights).hexdigest() == sh(
            tb, f"sha256sum {small}/target/{WEIGHTS}").split()[0]
    finally:
        tb.container_exec(H, V, ["umount", "-l", small])


def test_testbed_hub_cli_serves_a_fetch_that_exits_0(tb, deploy, playbooks):
    """Issue 53 items 6-7: the test bed seeds and serves its hub from the CLI (`deploy testbed hub`); a playbook
    with a source fetches from it with exit 0, the published target config arriving whole."""
    port = 8079  # not the hub fixture's
    h = deploy("testbed", "hub", f"{H}/{V}", "--port", str(port), "--dir", str(tb.root), timeout=120)
    assert h.returncode == 0, h.stdout + h.stderr
    try:
        assert h.stdout.strip() == f"http://127.0.0.1:{port}" and "Qwen/Qwen3.6-27B" in h.stderr
        # the playbook the fetch --help examples name, beside the shipped ones (issue 53 item 6)
        written = tb.root / "playbooks" / "my-hub-dflash.yaml"
        assert f"export DEPLOY_PLAYBOOKS={tb.root / 'playbooks'}" in h.stderr and written.is_file(), h.stderr
        assert f"endpoint: http://127.0.0.1:{port}" in written.read_text()
        assert (tb.root / "playbooks" / "qwen36-mtp.yaml").is_file()  # qwen36-dflash's fallback, in reach
        p = playbooks.dir / "my-hub-mtp.yaml"
        text = (playbooks.dir / "qwen36-mtp.yaml").read_text().replace("name: qwen36-mtp", "name: my-hub-mtp", 1)
        p.write_text(text.replace("model:\n  path: /root/models/Qwen3.6-27B\n",
                                  "model:\n  path: /root/models/Hub-Qwen3.6-27B\n  hub: Qwen/Qwen3.6-27B\n"
                                  f"  revision: main\n  endpoint: http://127.0.0.1:{port}\n", 1))
        f = deploy("fetch", "my-hub-mtp", env=playbooks.env, timeout=300)
        assert f.returncode == 0, f.stdout + f.stderr
        got = sh(tb, "sha256sum /root/models/Hub-Qwen3.6-27B/config.json").split()[0]
        from vpd_testbed.core import TARGET_CONFIG
        assert got == __import__("hashlib").sha256(TARGET_CONFIG.read_bytes()).hexdigest()
    finally:
        s = deploy("testbed", "hub", f"{H}/{V}", "--stop", "--dir", str(tb.root))
        sh(tb, "rm -rf /root/models/Hub-Qwen3.6-27B /var/lib/vllm-pve-deploy/fetch*")
    assert s.returncode == 0, s.stderr
    assert not (tb.root / "playbooks" / "my-hub-dflash.yaml").exists() and "its playbook" in s.stderr, s.stderr
