"""A drafter given by hub id whose hub snapshot holds the stale guessed config: `deploy up` serves the pinned
config from a deploy-owned directory (pinned config.json + links to the snapshot's other files); the hub cache
is never written."""

import json

from e2e_helpers import PINNED_SHA, cat, sha

HUB = "/root/.cache/huggingface/hub/models--z-lab--Qwen3.6-27B-DFlash"
REV = "0123456789abcdef0123456789abcdef01234567"
OWN = "/var/lib/vllm-pve-deploy/drafters/z-lab--Qwen3.6-27B-DFlash"


def make_hub_cache(tb):
    """The real layout: snapshots/REV/FILE -> ../../blobs/HASH; refs/main names REV. The config is the stale one."""
    script = f"""set -e
mkdir -p {HUB}/blobs {HUB}/refs {HUB}/snapshots/{REV}
cp /root/models/Qwen3.6-27B-DFlash/config.json {HUB}/blobs/aaa1
cp /root/models/Qwen3.6-27B-DFlash/model.safetensors {HUB}/blobs/bbb2
ln -s ../../blobs/aaa1 {HUB}/snapshots/{REV}/config.json
ln -s ../../blobs/bbb2 {HUB}/snapshots/{REV}/model.safetensors
printf %s {REV} > {HUB}/refs/main
"""
    tb.container_exec("pve1", 129, ["sh", "-c", script], check=True)


def test_hub_drafter_with_a_stale_snapshot_serves_the_pinned_config(tb, deploy, playbooks):
    playbooks("qwen36-dflash", "    path: /root/models/Qwen3.6-27B-DFlash\n", "    hub_id: z-lab/Qwen3.6-27B-DFlash\n")
    make_hub_cache(tb)
    try:
        stale = sha(tb, "pve1", 129, f"{HUB}/snapshots/{REV}/config.json")
        assert stale != PINNED_SHA
        p = deploy("plan", "qwen36-dflash", env=playbooks.env)
        assert f"serve the pinned config from {OWN}" in p.stdout, p.stdout
        launch = p.stdout[p.stdout.index("launch:"):]
        assert OWN in launch.split("\n\n")[0]  # vLLM is given deploy's directory as the drafter
        p = deploy("--json", "up", "qwen36-dflash", env=playbooks.env)
        assert p.returncode == 0, p.stdout + p.stderr
        steps = {s["step"]: s for s in p.json["steps"]}
        assert f"built {OWN}: config.json {PINNED_SHA[:12]} (pinned) + 1 link(s)" in steps["drafter-config"]["summary"]
        assert steps["verify"]["ok"] and p.json["info"]["acceptance"]["draft_acceptance_rate"] >= 0.15  # healthy DFlash at k = 15 (issue 24)
        # what vLLM reads: the pinned config and the snapshot's weights; the hub cache untouched
        assert sha(tb, "pve1", 129, f"{OWN}/config.json") == PINNED_SHA
        assert tb.container_exec("pve1", 129, ["readlink", f"{OWN}/model.safetensors"]).stdout.strip() == \
            f"{HUB}/snapshots/{REV}/model.safetensors"
        assert sha(tb, "pve1", 129, f"{HUB}/snapshots/{REV}/config.json") == stale
        assert sha(tb, "pve1", 129, f"{HUB}/blobs/aaa1") == stale
        st = json.loads(cat(tb, "pve1", 129, "/var/lib/vllm-pve-deploy/state.json"))
        spec = json.loads(st["argv"][st["argv"].index("--speculative-config") + 1])
        assert spec["model"] == OWN and st["drafter_path"] == f"{OWN}/config.json"
        # verify and apply-config work for it too (no circle: the fix commands do what they say)
        assert deploy("verify", "qwen36-dflash", env=playbooks.env).returncode == 0
        p = deploy("apply-config", "qwen36-dflash", env=playbooks.env)
        assert p.returncode == 0 and "installed and verified" in p.stdout, p.stdout + p.stderr
        assert sha(tb, "pve1", 129, f"{HUB}/snapshots/{REV}/config.json") == stale
        # status reads the deploy-owned config for drift
        row = deploy("--json", "status", "qwen36-dflash", env=playbooks.env).json["rows"][0]
        assert row["healthy"] and row["drafter"]["path"] == f"{OWN}/config.json" and not row["drafter"]["drift"]
    finally:
        deploy("down", "qwen36-dflash", env=playbooks.env)
        tb.container_exec("pve1", 129, ["rm", "-rf", "/root/.cache/huggingface"])
