"""Messages a user can trust, on the test bed: true, actionable, whole; and an operation outlives its reader."""

import subprocess
import sys
import time

from e2e_helpers import REPO
import pytest
from slack import slack


def test_restart_without_playbook_on_an_unreachable_host_exits_3(tb, deploy):
    tb.set_fault("pve2", None, "unreachable", True)
    p = deploy("restart")
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "cannot tell what runs where" in p.stderr and "pve2/129" in p.stderr and "cannot connect" in p.stderr
    assert "fix: bring the host(s) back" in p.stderr and "deploy restart PLAYBOOK" in p.stderr


def test_verify_on_an_unreachable_host_prints_no_none(tb, deploy):
    tb.set_fault("pve1", None, "unreachable", True)
    p = deploy("verify", "qwen36-dflash")
    assert p.returncode == 3, p.stderr
    assert "None" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert "fix: check the address/port" in p.stderr


def test_logs_without_own_probes_and_a_closed_pipe_does_not_abort_down(tb, deploy):
    assert deploy("up", "qwen36-mtp").returncode == 0
    # logs leave out the tool's own probe requests unless --all
    own = ('"GET /health', '"GET /v1/models', '"GET /metrics')
    p = deploy("logs", "pve1/129", "-n", "500")
    assert p.returncode == 0 and p.stdout
    assert not any(o in p.stdout for o in own), p.stdout
    assert "POST /v1/completions" in p.stdout
    every = deploy("logs", "pve1/129", "-n", "500", "--all")
    assert all(o in every.stdout for o in own)
    assert deploy("logs", "pve1/129", "--grep", "(").returncode == 2
    env = dict(__import__("os").environ, DEPLOY_INVENTORY=tb.inventory_path,
               DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1")
    # like `deploy -v down qwen36-mtp 2>&1 | head -2`: the reader goes away after two lines
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "-v", "down", "qwen36-mtp"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdout.readline()
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    s = deploy("--json", "status", "pve1/129")
    row = s.json["rows"][0]
    assert row["process"] == "none" and row["lock"] is None, row  # stopped, and the lock released
    assert deploy("up", "qwen36-mtp").returncode == 0  # not refused by a dead holder's lock
    audit = (deploy.state_dir / "audit.jsonl").read_text()
    assert '"event": "progress"' in audit and "stopped the 7 process(es)" in audit  # the record was kept


@pytest.mark.deadline
def test_deadline_bounds_the_answer_and_names_a_slow_host_timeout(tb, deploy):
    tb.set_fault("pve2", None, "latency_ms", 2000)
    tb.set_fault("pve3", None, "unreachable", True)
    t0 = time.monotonic()
    p = deploy("--json", "status", "pve2", "pve3", "--deadline", "1")
    took = time.monotonic() - t0
    assert took < slack(4), took  # the deadline, plus the interpreter's start
    rows = {r["host"]: r for r in p.json["rows"]}
    assert rows["pve2"]["timed_out"] and not rows["pve2"]["reachable"]
    assert "no answer within 1 s" in rows["pve2"]["problems"][0] and "--deadline" in rows["pve2"]["problems"][0]
    assert not rows["pve3"]["timed_out"] and "cannot connect" in rows["pve3"]["problems"][0]
    t = deploy("status", "pve2", "pve3", "--deadline", "1")
    assert "TIMEOUT" in t.stdout and "UNREACHABLE" in t.stdout and t.returncode == 3


def test_json_is_refused_where_there_is_none(tb, deploy):
    p = deploy("--json", "logs", "pve1/129")
    assert p.returncode == 2 and p.json and p.json["message"] == "deploy logs has no --json output"
    q = deploy("--json", "testbed", "status", env={"VPD_TESTBED_DIR": str(tb.root)})
    assert q.returncode == 0 and q.json and "hosts" in q.json


def test_watch_stops_when_its_reader_goes_away(tb, deploy):
    env = dict(__import__("os").environ, DEPLOY_INVENTORY=tb.inventory_path,
               DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1")
    # like `deploy status --watch 0.2 | head -1`
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "status", "pve1/129", "--watch", "0.2"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert b"Traceback" not in proc.stderr.read()
