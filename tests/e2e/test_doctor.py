"""`deploy doctor` on a vLLM started by hand (not by deploy): the guessed config, the published one, a stale
write; and the fix it names really fixes it. Read-only: nothing changes in the container."""

import json
import shlex
import subprocess
import time

from e2e_helpers import DRAFTER, PINNED_SHA, REPO, sha
import pytest
from slack import slack

SPEC = {"method": "dflash", "model": "/root/models/Qwen3.6-27B-DFlash", "num_speculative_tokens": 15}


def start_by_hand(tb, vmid=129, gpus="0,1,2,3"):
    script = ("CUDA_VISIBLE_DEVICES=%s setsid /root/ml-env/bin/vllm serve /root/models/Qwen3.6-27B "
              "--tensor-parallel-size %d --served-model-name byhand --attention-backend flash_attn "
              "--speculative-config %s > /tmp/byhand.log 2>&1 < /dev/null &"
              % (gpus, len(gpus.split(",")), shlex.quote(json.dumps(SPEC))))
    subprocess.run(tb.ssh_argv("pve1", shlex.join(["pct", "exec", str(vmid), "--", "sh", "-c", script])),
                   timeout=30, check=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = tb.container_exec("pve1", vmid, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                             "http://127.0.0.1:8000/health"])
        if r.stdout.strip() == "200":
            return
        time.sleep(0.2)
    raise AssertionError("the hand-started vLLM did not come up: "
                         + tb.container_exec("pve1", vmid, ["tail", "-5", "/tmp/byhand.log"]).stdout)


def traffic(tb, vmid=129, n=3):
    body = json.dumps({"model": "byhand", "prompt": "Explain why the sky is blue.", "max_tokens": 64})
    for _ in range(n):
        tb.container_exec("pve1", vmid, ["curl", "-s", "-X", "POST", "-H", "Content-Type: application/json",
                                         "-d", body, "http://127.0.0.1:8000/v1/completions"])


def pinned_bytes():
    with open(REPO + "/playbooks/drafters/qwen36-27b-dflash.config.json", "rb") as fh:
        return fh.read()


@pytest.mark.deadline
def test_doctor_names_the_guessed_config_and_its_fix_fixes_it(tb, deploy):
    start_by_hand(tb)
    traffic(tb)
    before = (sha(tb, "pve1", 129, DRAFTER), sorted(tb.container_pids("pve1", 129)))
    t0 = time.monotonic()
    p = deploy("doctor", "pve1/129", "--json")
    assert time.monotonic() - t0 < slack(15)
    assert p.returncode == 1, p.stdout + p.stderr
    row = p.json["containers"][0]
    assert row["started_by_deploy"] is False
    classes = [f["class"] for f in row["findings"]]
    assert classes == ["guessed-config", "low-acceptance"], row["findings"]
    g = row["findings"][0]
    assert "dflash_config.target_layer_ids [1, 17, 33, 49, 63] (published [1, 16, 31, 46, 61])" in g["cause"]
    assert g["fix"].startswith("deploy up qwen36-dflash --clean-gpus")
    srv = row["servers"][0]
    assert srv["speculative_config"] == SPEC and srv["drafter"]["matches_pinned"] is False
    assert srv["acceptance"]["draft_acceptance_rate"] < 0.05
    assert any(pr["comm"].startswith("VLLM::Worker") and "/dev/nvidia0" in pr["devices"] for pr in row["processes"])
    # changed nothing
    assert (sha(tb, "pve1", 129, DRAFTER), sorted(tb.container_pids("pve1", 129))) == before
    text = deploy("doctor", "pve1/129").stdout
    assert "GUESSED-CONFIG: server pid" in text and "(not started by deploy)" in text
    assert "    fix: deploy up qwen36-dflash --clean-gpus" in text
    # the named fix really fixes it
    p = deploy("up", "qwen36-dflash", "--clean-gpus", "-y")
    assert p.returncode == 0, p.stderr
    p = deploy("doctor", "pve1/129", "--json")
    row = p.json["containers"][0]
    assert p.returncode == 0 and row["findings"] == [] and row["started_by_deploy"], row
    assert row["servers"][0]["drafter"]["matches_pinned"] is True


def test_doctor_on_the_published_config_finds_nothing_and_a_stale_write_is_named(tb, deploy):
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > %s" % DRAFTER], input=pinned_bytes(), text=False)
    assert sha(tb, "pve1", 129, DRAFTER) == PINNED_SHA
    start_by_hand(tb)
    traffic(tb)
    p = deploy("doctor", "pve1/129", "--json")
    row = p.json["containers"][0]
    assert p.returncode == 0 and row["findings"] == [], row["findings"]
    assert row["servers"][0]["drafter"]["matches_pinned"] is True
    assert "no problem found" in deploy("doctor", "pve1/129").stdout


def test_doctor_names_a_stale_write(tb, deploy):
    start_by_hand(tb)
    started = min(pr["started_at"] for pr in deploy("doctor", "pve1/129", "--json").json["containers"][0]["processes"])
    deadline = time.monotonic() + 5
    while time.time() < started + 1.5 and time.monotonic() < deadline:  # the start time has 1 s resolution
        time.sleep(0.1)
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > %s" % DRAFTER], input=pinned_bytes(), text=False)
    p = deploy("doctor", "pve1/129", "--json")
    classes = [f["class"] for f in p.json["containers"][0]["findings"]]
    assert classes == ["stale-write"], p.json["containers"][0]["findings"]
    f = p.json["containers"][0]["findings"][0]
    assert "vLLM still runs with what it read at start" in f["cause"]
    assert f["fix"].startswith("deploy up qwen36-dflash --clean-gpus")


def test_doctor_without_vllm_and_on_a_broken_build(tb, deploy):
    # no server, but the drafter directory holds the guessed config: said, with what to run (issue 26)
    p = deploy("doctor", "pve1/129", "--json")
    row = p.json["containers"][0]
    assert p.returncode == 1 and row["servers"] == [], row
    assert [x["class"] for x in row["findings"]] == ["guessed-config"]
    assert "no vLLM server runs, but " + DRAFTER in row["findings"][0]["cause"]
    assert row["findings"][0]["fix"].startswith("deploy apply-config qwen36-dflash")
    text = deploy("doctor", "pve1/129").stdout
    assert "drafter config %s (no server runs; for qwen36-dflash): differs" % DRAFTER in text
    assert "no problem found" not in text
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > %s" % DRAFTER], input=pinned_bytes(), text=False)
    p = deploy("doctor", "pve1/129", "--json")
    assert p.returncode == 0 and p.json["containers"][0]["servers"] == []
    assert "= the published config (qwen36-dflash)" in deploy("doctor", "pve1/129").stdout
    tb.set_fault("pve1", 129, "missing_extension", "_C_stable_libtorch.abi3.so")
    p = deploy("doctor", "pve1/129", "--json")
    f = p.json["containers"][0]["findings"]
    assert p.returncode == 1 and [x["class"] for x in f] == ["incomplete-build"]
    assert "_C_stable_libtorch.abi3.so" in f[0]["cause"] and "deploy verify qwen36-dflash" in f[0]["fix"]


def test_doctor_names_a_holder_outside_the_container(tb, deploy):
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > %s" % DRAFTER], input=pinned_bytes(), text=False)
    tb.set_fault("pve1", None, "foreign_holder", {"gpu": 0, "mib": 30000})
    deadline = time.monotonic() + 10
    while tb.gpu_used("pve1")[0] < 30000 and time.monotonic() < deadline:
        time.sleep(0.1)
    p = deploy("doctor", "pve1/129", "--json")
    f = p.json["containers"][0]["findings"]
    assert p.returncode == 1 and [x["class"] for x in f] == ["leftover-holder"], f
    assert "GPU 0 is held outside this container, by the host itself (no container)" in f[0]["cause"]
    assert "30000 MiB" in f[0]["cause"] and "never kills on the host" in f[0]["fix"]


def test_doctor_with_no_server_names_guessed_configs_in_the_hub_cache_and_models_dir(tb, deploy):
    # issue 26: no server runs; guessed drafter configs outside the playbooks' paths are found and named
    hub = "/root/.cache/huggingface/hub/models--org--name"
    rev = "0123456789abcdef0123456789abcdef01234567"
    with open(REPO + "/testbed/vpd_testbed/data/qwen36-27b-dflash.stale-guess.config.json", "rb") as fh:
        stale = fh.read()
    script = (f"set -e; mkdir -p {hub}/blobs {hub}/refs {hub}/snapshots/{rev} /root/models/Other-DFlash "
              f"/root/models/Copy-DFlash; cat > {hub}/blobs/aaa1; "
              f"ln -s ../../blobs/aaa1 {hub}/snapshots/{rev}/config.json; printf %s {rev} > {hub}/refs/main; "
              f"cp {hub}/blobs/aaa1 /root/models/Other-DFlash/config.json")
    try:
        tb.container_exec("pve1", 129, ["sh", "-c", script], input=stale, text=False, check=True)
        tb.container_exec("pve1", 129, ["sh", "-c", "cat > /root/models/Copy-DFlash/config.json"],
                          input=pinned_bytes(), text=False, check=True)
        stale_sha = __import__("hashlib").sha256(stale).hexdigest()
        p = deploy("--json", "doctor", "pve1/129")
        assert p.returncode == 1, p.stdout + p.stderr
        row = p.json["containers"][0]
        assert row["servers"] == [] and [x["class"] for x in row["findings"]] == ["guessed-config"] * 3, row["findings"]
        snap = f"{hub}/snapshots/{rev}/config.json"
        causes = {f["evidence"]["path"]: f for f in row["findings"]}
        assert set(causes) == {DRAFTER, snap, "/root/models/Other-DFlash/config.json"}, causes
        for path in (snap, "/root/models/Other-DFlash/config.json"):
            f = causes[path]
            assert f"no vLLM server runs, but {path} (sha256 {stale_sha[:12]}" in f["cause"]
            assert "matches no pinned config: deploy cannot vouch for it" in f["cause"]
            assert "[1, 17, 33, 49, 63] differ from the published [1, 16, 31, 46, 61]" in f["cause"]
            assert f["fix"].startswith("point a playbook's drafter at it") and f["fix"].endswith("or remove it")
        assert "(hub_id: org/name)" in causes[snap]["fix"]
        assert "(path: /root/models/Other-DFlash)" in causes["/root/models/Other-DFlash/config.json"]["fix"]
        scanned = {c["path"]: c for c in row["scanned_configs"]}
        assert scanned["/root/models/Copy-DFlash/config.json"]["verdict"] == "= the published config of qwen36-dflash"
        assert scanned[snap]["hub_id"] == "org/name" and scanned[snap]["revision"] == rev
        assert DRAFTER not in scanned and "/root/models/Qwen3.6-27B/config.json" not in scanned  # covered; a target
        assert row["scan"]["truncated"] is None and "/root/models" in row["scan"]["roots"]["models"]
        text = deploy("doctor", "pve1/129").stdout
        assert (f"drafter config {snap} sha256 {stale_sha[:12]} (no server runs; hub cache): matches no pinned "
                "config") in text
        assert (f"drafter config /root/models/Copy-DFlash/config.json sha256 {PINNED_SHA[:12]} (no server runs; "
                "models directory): = the published config of qwen36-dflash") in text
        assert text.count("GUESSED-CONFIG: no vLLM server runs") == 3 and "no problem found" not in text
    finally:
        tb.container_exec("pve1", 129, ["rm", "-rf", "/root/.cache/huggingface", "/root/models/Other-DFlash",
                                        "/root/models/Copy-DFlash"])


def test_doctor_on_a_complete_build_whose_import_raises(tb, deploy):
    """Issue 53 item 5: a RuntimeError planted at the top of vllm/__init__.py, every extension file present: the
    class says the import fails (not incomplete-build) and the cause carries the exception's own line."""
    init = tb.container_exec("pve1", 129, ["/root/ml-env/bin/python", "-I", "-c",
                                           "import importlib.util as u; print(u.find_spec('vllm').origin)"]).stdout.strip()
    assert init.endswith("vllm/__init__.py"), init
    plant = "raise RuntimeError('CUDA initialisation failed: no device')\n"
    tb.container_exec("pve1", 129, ["sh", "-c", 'f="$1"; cp -p "$f" "$f.bak"; { printf %s "$2"; cat "$f.bak"; } > "$f"',
                                    "sh", init, plant])
    try:
        p = deploy("doctor", "pve1/129", "--json")
        f = p.json["containers"][0]["findings"]
        assert p.returncode == 1 and "import-fails" in [x["class"] for x in f], f
        assert "incomplete-build" not in [x["class"] for x in f], f
        x = next(x for x in f if x["class"] == "import-fails")
        assert x["cause"].endswith("fails: RuntimeError: CUDA initialisation failed: no device"), x["cause"]
        text = deploy("doctor", "pve1/129").stdout
        assert "IMPORT-FAILS: " in text and "RuntimeError: CUDA initialisation failed: no device" in text
    finally:
        tb.container_exec("pve1", 129, ["sh", "-c", 'mv "$1.bak" "$1"', "sh", init])
