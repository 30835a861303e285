"""Reaching a deployment: the container's real address on the test bed's network (docs/testbed.md,
"Networking"), from this machine, through an SSH tunnel via the Proxmox host, and by a scraper (/metrics)."""

import json
import socket
import subprocess
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def _get(url, data=None, timeout=10):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def test_a_deployment_answers_on_its_container_address(tb, deploy):
    p = deploy("--json", "up", "qwen36-dflash")
    assert p.returncode == 0, p.stderr
    addr = tb.container_address("pve1", 129)
    assert p.json["info"]["url"] == "http://%s:8000/v1" % addr
    assert p.json["info"]["endpoint"]["routable"] is True and p.json["info"]["endpoint"]["tunnel"] is None
    status, body = _get("http://%s:8000/v1/models" % addr)
    assert status == 200 and json.loads(body)["data"]
    status, body = _get("http://%s:8000/v1/completions" % addr,
                        {"model": json.loads(_get("http://%s:8000/v1/models" % addr)[1])["data"][0]["id"],
                         "prompt": "The capital of France is", "max_tokens": 8})
    assert status == 200 and json.loads(body)["choices"][0]["text"]
    # a scraper reads vLLM's metrics there
    _, text = _get("http://%s:8000/metrics" % addr)
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "vllm:spec_decode_num_accepted_tokens" in names, sorted(names)
    # and an SSH tunnel through the Proxmox host carries it too
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        lport = s.getsockname()[1]
    argv = tb.ssh_argv("pve1")
    argv[-1:-1] = ["-N", "-o", "ExitOnForwardFailure=yes", "-L", "127.0.0.1:%d:%s:8000" % (lport, addr)]
    tun = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                assert _get("http://127.0.0.1:%d/v1/models" % lport, timeout=3)[0] == 200
                break
            except OSError:
                assert tun.poll() is None, tun.stderr.read()
                assert time.monotonic() < deadline, "the tunnel did not carry a request within 15 s"
                time.sleep(0.1)
    finally:
        tun.terminate()
        tun.wait(timeout=10)
    deploy("down", "qwen36-dflash")


def test_deploy_endpoint_prints_a_url_and_a_curl_that_works_and_tunnels_a_completion(tb, deploy):
    import os
    import signal
    import sys

    from e2e_helpers import REPO

    # nothing serves yet: the URL is known (the inventory has the address); the tunnel says the host cannot connect
    p = deploy("endpoint", "qwen36-dflash")
    addr = tb.container_address("pve1", 129)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "qwen36-dflash on pve1/129: http://%s:8000/v1  (model qwen36)" % addr
    p = deploy("endpoint", "qwen36-dflash", "--tunnel", "--local-port", "0")
    assert p.returncode == 1 and "pve1 cannot connect to %s:8000" % addr in p.stderr, p.stderr
    assert "deploy status qwen36-dflash" in p.stderr
    assert deploy("up", "qwen36-dflash").returncode == 0
    try:
        p = deploy("--json", "endpoint", "qwen36-dflash")
        row = p.json["endpoints"][0]
        assert row["url"] == "http://%s:8000/v1" % addr and row["routable"] is True and row["model"] == "qwen36"
        # the printed curl line works as printed
        curl = deploy("endpoint", "qwen36-dflash").stdout.splitlines()[1].strip()
        assert curl.startswith("curl -s http://%s:8000/v1/completions" % addr)
        r = subprocess.run(["sh", "-c", curl], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["choices"][0]["text"], r.stdout + r.stderr
        # --tunnel: the local URL carries a real completion; Ctrl-C closes it with exit 0
        env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir),
                   NO_COLOR="1")
        tun = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "--json", "endpoint", "qwen36-dflash",
                                "--tunnel", "--local-port", "0"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            line = tun.stdout.readline()
            assert line, tun.stderr.read()
            info = json.loads(line)
            assert info["url"] == row["url"] and info["local_url"].startswith("http://127.0.0.1:")
            assert info["curl"].startswith("curl -s %s/completions" % info["local_url"])
            status, body = _get(info["local_url"] + "/completions",
                                {"model": "qwen36", "prompt": "The capital of France is", "max_tokens": 16})
            assert status == 200 and json.loads(body)["choices"][0]["text"]
            r = subprocess.run(["sh", "-c", info["curl"]], capture_output=True, text=True, timeout=60)
            assert json.loads(r.stdout)["usage"]["completion_tokens"] > 0, r.stdout + r.stderr
        finally:
            tun.send_signal(signal.SIGINT)
            out, err = tun.communicate(timeout=20)
        assert tun.returncode == 0, err
        assert "tunnel closed (2 connection(s) carried)" in err, err
    finally:
        deploy("down", "qwen36-dflash")
