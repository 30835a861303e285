"""Issue 36 items 3 and 4: the router's state file is read with the vLLM state's rules, and the router's API key
(and our trust in its answers) goes only to a listener proven to be the router deploy started. The agent runs as a
real process on real files and real sockets (tests/unit/agent_support.py); the "router" is a small HTTP server."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from agent_support import run_agent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root: root-owned state files and chown")

SERVER = r"""
import http.server, sys
log = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def _any(self):
        with open(log, "a") as fh:
            fh.write("%s %s %s\n" % (self.command, self.path, self.headers.get("Authorization")))
        body = b'{"workers": []}'
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _any
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def starttime(pid):
    with open("/proc/%d/stat" % pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def serve(port, log):
    p = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(log)], start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return p
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the test server did not listen")


@pytest.fixture
def state(tmp_path):
    d = tmp_path / "state" / "router-rt"
    d.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "state", 0o700)

    def write(st, uid=0, mode=0o600):
        p = d / "router.json"
        p.write_text(json.dumps(st))
        os.chown(p, uid, uid)
        os.chmod(p, mode)
        return p
    write.dir = d
    write.args = {"state_dir": str(tmp_path / "state"), "playbook": "rt"}
    return write


def test_a_router_json_not_written_by_root_stops_nothing(state, tmp_path):
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a root process group
    try:
        state({"pid": victim.pid, "starttime": starttime(victim.pid), "supervisor": "none"}, uid=65534)
        r = run_agent("router", dict(state.args, op="stop", grace_s=1))
        assert not r["stopped"] and "owned by uid 65534" in r["refused"], r
        time.sleep(0.2)
        assert victim.poll() is None, "a process named by an untrusted router.json was signalled"
        assert (state.dir / "router.json").exists()  # not deleted either
    finally:
        victim.kill()
        victim.wait()


def test_a_unit_name_that_is_not_the_playbooks_is_refused(state):
    state({"pid": 4242, "starttime": 1, "unit": "../../../etc/systemd/system/ssh.service", "supervisor": "systemd"})
    r = run_agent("router", dict(state.args, op="stop", grace_s=1))
    assert not r["stopped"] and "not vllm-router-rt.service" in r["refused"], r
    r = run_agent("router", dict(state.args, op="view", port=1))
    assert not r["installed"] and "router.json not used" in r["error"]


def test_the_key_goes_only_to_the_proven_router(state, tmp_path):
    port = free_port()
    log = tmp_path / "requests.log"
    stranger = serve(port, log)  # listens on the router's port, but deploy did not start it
    try:
        decoy = subprocess.Popen(["sleep", "60"], start_new_session=True)
        state({"pid": decoy.pid, "starttime": starttime(decoy.pid), "supervisor": "none"})
        r = run_agent("router", dict(state.args, op="remove", port=port, url="http://10.0.0.1:8000"),
                      secrets={"router_key": "sekret-router-key"})
        assert not r["ok"] and r["sent"] is False and r["status"] is None, r
        assert "not by the deployment's own processes" in r["message"] and "was not sent" in r["message"]
        assert not log.exists() or "sekret" not in log.read_text()
        # no router.json at all: nothing is sent, and the answer is not "removed"
        (state.dir / "router.json").unlink()
        r = run_agent("router", dict(state.args, op="remove", port=port, url="http://10.0.0.1:8000"),
                      secrets={"router_key": "sekret-router-key"})
        assert not r["ok"] and "no router of deploy's runs here" in r["message"], r
        assert not log.exists() or "sekret" not in log.read_text()
        decoy.kill()
        decoy.wait()
    finally:
        stranger.kill()
        stranger.wait()
    # the router deploy started (its record names it): the request goes, with the key; stop stops only it
    router = serve(port, log)
    try:
        state({"pid": router.pid, "starttime": starttime(router.pid), "supervisor": "none",
               "started_at": time.time()})
        r = run_agent("router", dict(state.args, op="remove", port=port, url="http://10.0.0.1:8000"),
                      secrets={"router_key": "sekret-router-key"})
        assert r["ok"] and r["sent"], r
        assert "POST /remove_worker?url=http://10.0.0.1:8000 Bearer sekret-router-key" in log.read_text()
        r = run_agent("router", dict(state.args, op="stop", grace_s=5))
        assert r["stopped"] and r["pid"] == router.pid
        assert router.wait(timeout=10) == -signal.SIGTERM
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()


def test_router_lines_never_say_router_router():
    """Issue 53 item 13: `deploy down qwen36-replicas pve2/129` printed `router router: ...`."""
    from orchestrator.serving.fleet import router_lines

    one = router_lines({"action": "down", "router": {"ok": True, "url": "http://x:9000"}})
    assert one == ["router: removed from it first"]
    two = router_lines({"action": "down", "router": {"where": "pve1/140", "ok": True, "stopped": True}})
    assert two == ["router pve1/140: stopped"]


def test_router_gate_line_says_when_other_clients_were_counted():
    """Issue 53 item 13: under client traffic the gate line read "4 completions ... spread 2/3"."""
    from orchestrator.serving.fleet import router_lines

    rr = {"where": "pve1/130", "ok": True, "url": "http://a:30000/v1", "policy": "round_robin",
          "workers": ["u1", "u2"], "gate": {"sent": 4, "succeeded": 4,
                                            "per_replica": {"u1": {"requests": 2}, "u2": {"requests": 3}}}}
    line = router_lines({"action": "up", "router": rr})[0]
    assert "gate: 4 of 4 completions through it, spread 2/3 (the replicas served 5 meanwhile: other clients' " \
           "requests included)" in line, line
    rr["gate"]["per_replica"]["u2"]["requests"] = 2
    assert router_lines({"action": "up", "router": rr})[0].endswith("spread 2/2")


def test_plain_status_finds_the_replica_playbooks_that_run(tmp_path, monkeypatch, capsys):
    """Issue 53 item 13: plain `deploy status` shows the totals and router of a replica playbook that runs (only
    `status PLAYBOOK` did); a playbook without `targets:` is not even loaded, and one that no longer loads is said."""
    import shutil

    from orchestrator.core.spec import load_inventory
    from orchestrator.observe.status import deployed_fleets

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pbs = tmp_path / "playbooks"
    shutil.copytree(os.path.join(repo, "playbooks"), pbs)
    mtp = (pbs / "qwen36-mtp.yaml").read_text()
    (pbs / "fleet.yaml").write_text(mtp.replace("name: qwen36-mtp", "name: fleet", 1).replace(
        "target:\n  host: pve1\n  vmid: 129\n  gpus: [0, 1, 2, 3]\n",
        "targets:\n  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n  - {host: pve2, vmid: 129, gpus: [0, 1, 2, 3]}\n"))
    (pbs / "broken.yaml").write_text("name: broken\ntargets: [oops]\n")
    inv_path = tmp_path / "hosts.yaml"
    inv_path.write_text("hosts:\n" + "".join(
        f"  - name: {h}\n    address: 127.0.0.{i}\n    containers:\n      - vmid: 129\n        gpus: [0, 1, 2, 3]\n"
        for i, h in ((1, "pve1"), (2, "pve2"))))
    monkeypatch.setenv("DEPLOY_PLAYBOOKS", str(pbs))
    inv = load_inventory(str(inv_path))
    rows = [{"host": "pve1", "vmid": 129, "playbook": "fleet"}, {"host": "pve2", "vmid": 129, "playbook": "fleet"},
            {"host": "pve1", "vmid": 130, "playbook": "qwen36-dflash"}, {"host": "pve2", "vmid": 130, "playbook": None},
            {"host": "pve3", "vmid": 129, "playbook": "broken"}]
    assert [pb.name for pb in deployed_fleets(inv, rows)] == ["fleet"]
    err = capsys.readouterr().err
    assert "status: broken runs here but its playbook does not load (" in err and "deploy status broken" in err, err
