"""Plain helpers for the end-to-end tests (a module name of its own: every test folder has a conftest)."""

import json
import os
import subprocess
import sys
import time

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


# --- a real Prometheus (and node_exporter) on this machine, for tests/e2e/test_monitor.py ---

def http_get(url, data=None, timeout=10):
    """GET (or POST JSON `data`) -> (status, body text)."""
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def free_port(host="127.0.0.1"):
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_prometheus(prometheus, config_dir, tmp_path):
    """Prometheus with config_dir/prometheus.yml on a free 127.0.0.1 port (tsdb and log under tmp_path).
    -> (Popen, port); stop it with stop_process."""
    import subprocess

    port = free_port()
    proc = subprocess.Popen([prometheus, "--config.file=%s" % os.path.join(str(config_dir), "prometheus.yml"),
                             "--storage.tsdb.path=%s" % (tmp_path / "tsdb"),
                             "--web.listen-address=127.0.0.1:%d" % port, "--log.level=warn"],
                            cwd=str(config_dir), stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "wb"))
    return proc, port


def stop_process(proc, timeout=20):
    """SIGTERM, then SIGKILL after `timeout` s: the process is gone when this returns."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def wait_for_alert(port, name, proc, log_path, seconds):
    """Poll Prometheus' /api/v1/alerts until `name` fires (bounded): -> the firing alerts; AssertionError with the
    alerts seen when it does not within `seconds`."""
    import time

    deadline = time.monotonic() + seconds
    alerts = []
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()
        try:
            alerts = json.loads(http_get("http://127.0.0.1:%d/api/v1/alerts" % port, timeout=3)[1])["data"]["alerts"]
        except OSError:
            alerts = []
        firing = [a for a in alerts if a["state"] == "firing" and a["labels"]["alertname"] == name]
        if firing:
            return firing
        time.sleep(0.5)
    raise AssertionError("no %s firing within %g s; alerts: %s" % (name, seconds, alerts))


def deploy_runner(inventory, state, default_timeout=180, **more_env):
    """deploy(*args, env=None, timeout=default_timeout, input=None) -> CompletedProcess (text; .json: the parsed
    stdout with --json), the real CLI run from the repo root against INVENTORY with state directory STATE (and
    NO_COLOR, MORE_ENV, then ENV); .state_dir is STATE."""
    def run(*args, env=None, timeout=default_timeout, input=None):
        e = dict(os.environ, DEPLOY_INVENTORY=inventory, DEPLOY_STATE_DIR=str(state), NO_COLOR="1", **more_env)
        e.update(env or {})
        p = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=e, text=True,
                           capture_output=True, timeout=timeout, input=input)
        p.json = None
        if "--json" in args:
            try:
                p.json = json.loads(p.stdout)
            except ValueError:
                pass
        return p

    run.state_dir = state
    return run


def up_in_background(tb, env, playbook="qwen36-mtp"):
    """`deploy up PLAYBOOK` started in the background with ENV: its Popen (text pipes), once pve1/129 has a
    state file (at most 60 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", playbook], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if tb.container_exec("pve1", 129, ["test", "-e", "/var/lib/vllm-pve-deploy/state.json"]).returncode == 0:
            break
        time.sleep(0.1)
    return proc
