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
