"""Plain helpers for the end-to-end tests (a module name of its own: every test folder has a conftest)."""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def audit(deploy):
    path = deploy.state_dir / "audit.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def cat(tb, host, vmid, path):
    return tb.container_exec(host, vmid, ["cat", path]).stdout


def sha(tb, host, vmid, path):
    return tb.container_exec(host, vmid, ["sha256sum", path]).stdout.split()[0]


PINNED_SHA = "df82aa8b0e47c4312ffb0fab14d20fdb80a5d6a94c5dd4e4878c19165c654fb9"
DRAFTER = "/root/models/Qwen3.6-27B-DFlash/config.json"
