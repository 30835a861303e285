"""`deploy status` across the fleet: every kind of row in one run, a stable JSON schema, per-host deadlines."""

import time

from e2e_helpers import DRAFTER
import pytest
from slack import slack

ROW_KEYS = {"host": str, "vmid": int, "reachable": bool, "container": str, "playbook": (str, type(None)),
            "pid": (int, type(None)), "process": str, "health": (int, type(None)), "served_model": (str, type(None)),
            "method": (str, type(None)), "gpus": list, "acceptance": (dict, type(None)), "drafter": (dict, type(None)),
            "uptime_s": (float, int, type(None)), "last_error": (str, type(None)), "lock": (dict, type(None)),
            "url": (str, type(None)), "tunnel": (str, type(None)), "healthy": bool, "timed_out": bool,
            "problems": list, "supervision": (dict, type(None)), "notes": list, "history": list, "gate": (dict, type(None)),
            "rejected": (dict, type(None)), "weights": (list, type(None)), "gpu_plumbing": (dict, type(None)),
            "sizing": (dict, type(None)), "tune": (dict, type(None))}


def validate_schema(doc):
    assert doc["schema"] == "vllm-pve-deploy/status/v1"
    assert isinstance(doc["generated_at"], str) and isinstance(doc["seconds"], float)
    assert doc["exit_code"] in (0, 1, 3)
    for row in doc["rows"]:
        assert set(row) == set(ROW_KEYS), set(row) ^ set(ROW_KEYS)
        for k, t in ROW_KEYS.items():
            assert isinstance(row[k], t), (k, row[k])
        for g in row["gpus"]:
            assert set(g) == {"index", "used_mib", "total_mib"}
        assert row["container"] in ("running", "stopped", "missing", "unknown")
        assert row["process"] in ("none", "running", "exited", "failed", "not ours", "unknown")
        if row["acceptance"]:
            assert set(row["acceptance"]) == {"lifetime", "recent"}


def mtp_on(playbooks, host):
    """A copy of qwen36-mtp that targets HOST/129."""
    src = (playbooks.dir / "qwen36-mtp.yaml").read_text()
    (playbooks.dir / f"mtp-{host}.yaml").write_text(
        src.replace("name: qwen36-mtp", f"name: mtp-{host}").replace("host: pve1", f"host: {host}"))
    return f"mtp-{host}"


def test_healthy_crashed_drifted_unreachable_in_one_run(tb, deploy, playbooks):
    env = playbooks.env
    assert deploy("up", "qwen36-dflash", env=env).returncode == 0          # pve1/129: drift below
    assert deploy("up", mtp_on(playbooks, "pve2"), env=env).returncode == 0  # pve2/129: healthy
    assert deploy("up", mtp_on(playbooks, "pve3"), env=env).returncode == 0  # pve3/129: crashes below
    assert deploy("up", mtp_on(playbooks, "pve4"), env=env).returncode == 0  # pve4: unreachable below
    tb.container_exec("pve1", 129, ["cp", "/root/models/Qwen3.6-27B-DFlash/config.json.bak-*", DRAFTER])
    tb.container_exec("pve1", 129, ["sh", "-c", f"cp {DRAFTER}.bak-* {DRAFTER}"])
    tb.set_fault("pve3", 129, "crash_after_s", 0.0)
    tb.set_fault("pve4", None, "unreachable", True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait for the crash to end the server (it exits 0)
        doc = deploy("--json", "status", "pve3/129", env=env).json
        if doc["rows"][0]["process"] == "exited":
            break
        time.sleep(0.3)
    p = deploy("--json", "status", env=env)
    doc = p.json
    validate_schema(doc)
    assert p.returncode == 3 and doc["exit_code"] == 3  # some host unreachable wins
    rows = {f"{r['host']}/{r['vmid']}": r for r in doc["rows"]}
    assert list(rows) == ["pve1/129", "pve1/130", "pve2/129", "pve3/129", "pve4/129"]
    d = rows["pve1/129"]
    assert d["process"] == "running" and d["drafter"]["drift"] is True and not d["healthy"]
    assert any("drafter config drift" in x for x in d["problems"])
    assert d["acceptance"]["lifetime"]["draft_acceptance_rate"] > 0.15
    assert rows["pve1/130"]["healthy"] and rows["pve1/130"]["process"] == "none"
    h = rows["pve2/129"]
    assert h["healthy"] and h["health"] == 200 and h["method"] == "mtp" and h["served_model"] == "qwen36"
    assert len(h["gpus"]) == 4 and all(g["used_mib"] > 50_000 for g in h["gpus"])
    c = rows["pve3/129"]
    assert c["process"] == "exited" and not c["healthy"]
    assert any("has exited (code 0)" in x for x in c["problems"]), c["problems"]
    u = rows["pve4/129"]
    assert not u["reachable"] and "cannot connect" in u["problems"][0]
    # the table fits 100 columns and names every problem
    t = deploy("status", env=env)
    assert t.returncode == 3
    table, _, problems = t.stdout.partition("\n\nProblems:\n")
    assert max(len(ln) for ln in table.splitlines()) <= 100
    for r in doc["rows"]:  # not a TTY: every problem whole, one line each (nothing cut)
        for x in r["problems"]:
            assert f"  {r['host']}/{r['vmid']}: {x}\n" in problems + "\n", x
    assert "~" not in t.stdout
    assert "UNREACHABLE" in t.stdout and "DRIFT" in t.stdout and "has exited" in t.stdout


@pytest.mark.deadline
def test_hanging_nvidia_smi_on_one_host_does_not_delay_the_others(tb, deploy, playbooks):
    assert deploy("up", mtp_on(playbooks, "pve2"), env=playbooks.env).returncode == 0
    tb.set_fault("pve3", None, "nvidia_smi_hang", True)
    t0 = time.monotonic()
    p = deploy("--json", "status", "--deadline", "4", env=playbooks.env)
    took = time.monotonic() - t0
    assert took < slack(8), took
    rows = {f"{r['host']}/{r['vmid']}": r for r in p.json["rows"]}
    assert rows["pve2/129"]["healthy"] and rows["pve2/129"]["health"] == 200, rows["pve2/129"]
    hung = rows["pve3/129"]
    assert not hung["healthy"] and any("nvidia-smi" in x and "did not answer" in x for x in hung["problems"])
    assert p.returncode == 1


def test_one_connection_and_one_exec_per_container(tb, deploy):
    from e2e_helpers import audit

    p = deploy("--json", "status")
    assert p.returncode == 0, p.stdout
    entries = audit(deploy)
    connects = [a for a in entries if a.get("event") == "connect"]
    execs = [a for a in entries if "argv" in a]
    assert sorted(a["host"] for a in connects) == ["pve1", "pve2", "pve3", "pve4"]
    assert sorted((a["host"], a["vmid"]) for a in execs) == [("pve1", 129), ("pve1", 130), ("pve2", 129),
                                                              ("pve3", 129), ("pve4", 129)]


def test_status_of_a_stopped_container_and_bad_targets(tb, deploy):
    tb.stop_container("pve1", 130)
    p = deploy("--json", "status", "pve1")
    rows = {r["vmid"]: r for r in p.json["rows"]}
    assert rows[130]["container"] == "stopped" and not rows[130]["healthy"]
    assert p.returncode == 1
    bad = deploy("status", "nohost")
    assert bad.returncode == 2 and "'nohost' is not a host, HOST/VMID or playbook" in bad.stderr


def test_logs_shows_the_deployment_log(tb, deploy):
    assert deploy("up", "qwen36-mtp").returncode == 0
    p = deploy("logs", "qwen36-mtp", "-n", "5", "--grep", "Application startup|SpeculativeConfig")
    assert p.returncode == 0
    assert "Application startup complete." in p.stdout and "SpeculativeConfig(method='mtp'" in p.stdout


def _stream(tb, deploy, *args, until, timeout=30):
    """Start `deploy ARGS` (a long-running form), read stdout until until(text) holds, then Ctrl-C it."""
    import os
    import signal
    import subprocess
    import sys

    from e2e_helpers import REPO

    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    text, deadline = "", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not until(text):
            line = proc.stdout.readline()
            if not line:
                break
            text += line
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
    return text + rest, err, proc.returncode


def test_watch_keeps_connections_open_and_shows_recent_acceptance(tb, deploy):
    from e2e_helpers import audit

    assert deploy("up", "qwen36-mtp").returncode == 0
    (deploy.state_dir / "audit.jsonl").unlink()
    out, err, code = _stream(tb, deploy, "status", "pve1/129", "pve2/129", "--watch", "0.3",
                             until=lambda t: t.count("refreshed in") >= 4)
    assert out.count("refreshed in") >= 4, out + err
    assert code == 0, out[-600:] + err
    connects = [a for a in audit(deploy) if a.get("event") == "connect"]
    assert sorted(a["host"] for a in connects) == ["pve1", "pve2"]  # once per host, for every refresh
    # a later, separate status call has the previous sample at hand: recent acceptance after new traffic
    tb.container_exec("pve1", 129, ["/root/ml-env/bin/python", "-c",
                                    "import json, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:8000/"
                                    "v1/completions', json.dumps({'model': 'qwen36', 'prompt': 'hi', 'max_tokens': 64})"
                                    ".encode(), {'Content-Type': 'application/json'})).read()"])
    row = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert row["acceptance"]["recent"] and row["acceptance"]["recent"]["draft_acceptance_rate"] > 0.08


def test_logs_follow_until_ctrl_c(tb, deploy):
    assert deploy("up", "qwen36-mtp").returncode == 0
    out, err, code = _stream(tb, deploy, "logs", "qwen36-mtp", "-f", "-n", "3",
                             until=lambda t: t.count("\n") >= 3)
    assert code == 0 and out.count("\n") >= 3, err


def test_watch_shows_a_timestamp_and_history_with_the_gate_and_json_the_window(tb, deploy):
    import json as _json
    import os
    import re
    import signal
    import subprocess
    import sys
    import threading
    import urllib.request

    from e2e_helpers import REPO
    assert deploy("up", "qwen36-dflash").returncode == 0
    addr = tb.container_address("pve1", 129)
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            req = urllib.request.Request("http://%s:8000/v1/completions" % addr, data=_json.dumps(
                {"model": "qwen36", "prompt": "Tell me about the sea.", "max_tokens": 32}).encode(),
                headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=10).read()
            except OSError:
                pass
            stop.wait(0.05)
    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    try:
        first = deploy("--json", "status", "pve1/129")
        second = deploy("--json", "status", "pve1/129")
        acc = second.json["rows"][0]["acceptance"]
        w = acc["recent"]["window"]
        assert w["seconds"] > 0 and w["from"] <= w["to"] and w["to"] <= second.json["generated_at"]
        assert acc["recent"]["tokens_per_s"] > 0 and acc["lifetime"]["window"]["seconds"] > 0
        assert first.json["rows"][0]["history"] == [] or first.json["rows"][0]["history"]
        assert second.json["rows"][0]["history"][-1]["al"] == acc["recent"]["mean_acceptance_length"]
        env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir),
                   NO_COLOR="1")
        w = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "status", "pve1/129", "--watch", "0.5"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines, deadline = [], time.monotonic() + 60
        try:
            while time.monotonic() < deadline and sum("pve1/129 qwen36-dflash: AL" in ln for ln in lines) < 3:
                ln = w.stdout.readline()
                if not ln:
                    break
                lines.append(ln.rstrip("\n"))
        finally:
            w.send_signal(signal.SIGINT)
            w.communicate(timeout=20)
        hist = [ln for ln in lines if "pve1/129 qwen36-dflash: AL" in ln]
        assert len(hist) >= 3, "\n".join(lines)
        assert re.match(r"deploy status  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", lines[0]), lines[0]
        m = re.search(r"AL ([▁▂▃▄▅▆▇█·]+) ([0-9.]+) \(gate >= ([0-9.]+) ok\)   tok/s ([▁▂▃▄▅▆▇█·]+) ", hist[-1])
        assert m, hist[-1]
        from orchestrator.observe.monitor import gate_thresholds
        from orchestrator.core.spec import load_inventory, load_playbook
        assert float(m.group(3)) == gate_thresholds(load_playbook("qwen36-dflash",
                                                                  load_inventory(tb.inventory_path)))["min_al"]
        assert len(m.group(1)) >= 2  # one character per refresh, older ones kept
    finally:
        stop.set()
        th.join(timeout=20)
        deploy("down", "qwen36-dflash")


def test_sparkline():
    from orchestrator.observe.status_render import sparkline
    assert sparkline([1.0, 2.0, 3.0, None]) == "▁▅█·"
    assert sparkline([]) == "" and sparkline([None, None]) == "··" and sparkline([5, 5]) == "▅▅"
