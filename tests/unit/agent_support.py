"""Running the in-container agent as a real process on real files (no SSH), for the unit tests that do:
test_agent_local.py, test_safety_local.py (and test_messages.py's agent_code)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

from orchestrator.agent import agent_stdin

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "testbed", "vpd_testbed", "data")
PUBLISHED = os.path.join(DATA, "qwen36-27b-dflash.config.json")
STALE = os.path.join(DATA, "qwen36-27b-dflash.stale-guess.config.json")
TARGET = os.path.join(DATA, "qwen36-27b-target.trimmed.config.json")


def run_agent(action, args, payload=None, bulk=None, secrets=None):
    """Run the agent's ACTION with ARGS (and PAYLOAD, BULK, SECRETS on its stdin, as deploy sends them): its
    result (the last `result` line it printed)."""
    p = subprocess.run([sys.executable, "-", action, json.dumps(args)], input=agent_stdin(payload, secrets, bulk),
                       capture_output=True, timeout=120)
    lines = [json.loads(ln) for ln in p.stdout.decode().splitlines() if ln.startswith("{")]
    res = [ln["result"] for ln in lines if "result" in ln]
    assert res, p.stderr.decode()
    return res[-1]


def agent_code(body):
    """A program that runs `body` with the agent's modules importable as in a container (the archive, package
    vpd_agent, on sys.path)."""
    from orchestrator.agent import archive

    return (archive.inline().decode() + "import json, os, sys, tempfile\n_d = tempfile.mkdtemp()\n"
            "open(_d + '/a.zip', 'wb').write(_VPD_ARCHIVE)\nsys.path.insert(0, _d + '/a.zip')\n" + body)


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def make_models(tmp_path):
    """A target model directory (the trimmed Qwen3.6-27B config) and a drafter one (the stale guessed config):
    (target, drafter)."""
    t = tmp_path / "Qwen3.6-27B"
    d = tmp_path / "Qwen3.6-27B-DFlash"
    t.mkdir()
    d.mkdir()
    shutil.copy(TARGET, t / "config.json")
    shutil.copy(STALE, d / "config.json")
    return t, d
