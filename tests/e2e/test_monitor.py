"""`deploy monitor export`: the files pass the real promtool (config, rules, the generated unit tests), and a real
Prometheus on this machine scrapes a test bed deployment through targets.json and fires the acceptance alert for a
broken drafter (short intervals, bounded waits). Skipped, with the reason, without Debian's prometheus package."""

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="needs promtool (apt-get install prometheus; setup.sh does)")


def _get(url, data=None, timeout=10):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


@needs_promtool
def test_export_passes_promtool_check_and_its_unit_tests(tb, deploy, tmp_path):
    d = tmp_path / "mon"
    p = deploy("--json", "monitor", "export", str(d))
    assert p.returncode == 0, p.stderr
    out = p.json
    assert out["files"] == ["dashboard.json", "prometheus.yml", "rules.test.yml", "rules.yml", "targets.json"]
    # one target per container; the shipped dflash/mtp pair share pve1/129: the primary is kept, and said
    assert out["targets"] == [{"targets": ["%s:8000" % tb.container_address("pve1", 129)],
                               "labels": {"host": "pve1", "vmid": "129", "playbook": "qwen36-dflash",
                                          "method": "dflash", "model": "qwen36"}}]
    assert any("qwen36-dflash, qwen36-mtp" in n for n in out["notes"])
    assert json.loads((d / "targets.json").read_text()) == out["targets"]
    # the gate's threshold, from the playbook (not hard-coded here either)
    from orchestrator.monitor import gate_thresholds
    from orchestrator.spec import load_inventory, load_playbook
    th = gate_thresholds(load_playbook("qwen36-dflash", load_inventory(tb.inventory_path)))
    rules = yaml.safe_load((d / "rules.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == {"VllmEndpointDown", "VllmAcceptanceLengthLow", "VllmFirstPositionLow",
                           "VllmAcceptanceCliff", "VllmServerRestarted", "VllmStartLimitHit", "VllmNotGated",
                           "GpuMemoryHeldOutsideDeployment"}
    assert alerts["VllmAcceptanceLengthLow"]["expr"] == 'vpd:acceptance_length{playbook="qwen36-dflash"} < %g' \
        % th["min_al"]
    for args in (["check", "config", str(d / "prometheus.yml")], ["check", "rules", str(d / "rules.yml")],
                 ["test", "rules", str(d / "rules.test.yml")]):
        r = subprocess.run([PROMTOOL] + args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    # every alert has a unit test that expects it to fire
    tests = yaml.safe_load((d / "rules.test.yml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    assert fired == set(alerts)
    dash = json.loads((d / "dashboard.json").read_text())
    exprs = " ".join(t["expr"] for pn in dash["panels"] for t in pn["targets"])
    for name in ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:generation_tokens_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert name in exprs, name
    # a bad duration is a usage error before anything is written
    p = deploy("monitor", "export", str(tmp_path / "x"), "--for", "ten minutes")
    assert p.returncode == 2 and "not a Prometheus duration" in p.stderr and not (tmp_path / "x").exists()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not PROMETHEUS or not PROMTOOL, reason="needs prometheus (apt-get install prometheus)")
def test_a_real_prometheus_scrapes_the_test_bed_and_fires_for_a_broken_drafter(tb, deploy, tmp_path):
    d = tmp_path / "mon"
    p = deploy("monitor", "export", str(d), "--for", "2s", "--rate-window", "15s", "--scrape-interval", "1s",
               "--evaluation-interval", "1s")
    assert p.returncode == 0, p.stderr
    # the dashboard's metric names are on the fake vLLM's page (as on vLLM's): a broken drafter serves, by hand
    # (deploy up would refuse it at the gate): the stale guessed config the test bed starts with
    addr = tb.container_address("pve1", 129)
    import shlex

    from orchestrator.plan import serve_argv
    from orchestrator.spec import load_inventory, load_playbook
    argv = serve_argv(load_playbook("qwen36-dflash", load_inventory(tb.inventory_path)))
    r = tb.container_exec("pve1", 129, ["sh", "-c", "CUDA_VISIBLE_DEVICES=0,1,2,3 setsid -f %s >/tmp/vllm.log 2>&1 "
                                        "</dev/null" % shlex.join(argv)])
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 60
    while True:
        try:
            if _get("http://%s:8000/health" % addr, timeout=2)[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, tb.container_exec("pve1", 129, ["cat", "/tmp/vllm.log"]).stdout
        time.sleep(0.2)
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                _get("http://%s:8000/v1/completions" % addr, {"model": "qwen36", "prompt": "Tell me about the sea.",
                                                              "max_tokens": 64})
            except OSError:
                pass
            stop.wait(0.1)
    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    port = _free_port()
    prom = subprocess.Popen([PROMETHEUS, "--config.file=%s" % (d / "prometheus.yml"),
                             "--storage.tsdb.path=%s" % (tmp_path / "tsdb"), "--web.listen-address=127.0.0.1:%d" % port,
                             "--log.level=warn"], cwd=str(d), stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        text = _get("http://%s:8000/metrics" % addr)[1]
        for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                     "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "process_start_time_seconds"):
            assert name in text, name
        deadline = time.monotonic() + 120
        firing = []
        while time.monotonic() < deadline:
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                alerts = json.loads(_get("http://127.0.0.1:%d/api/v1/alerts" % port, timeout=3)[1])["data"]["alerts"]
            except OSError:
                alerts = []
            firing = [a for a in alerts if a["state"] == "firing" and a["labels"]["alertname"] ==
                      "VllmAcceptanceLengthLow"]
            if firing:
                break
            time.sleep(1)
        assert firing, "no VllmAcceptanceLengthLow firing within 120 s; alerts: %s" % alerts
        lab = firing[0]["labels"]
        assert (lab["host"], lab["vmid"], lab["playbook"], lab["method"]) == ("pve1", "129", "qwen36-dflash", "dflash")
        assert lab["instance"] == "%s:8000" % addr and float(firing[0]["value"]) < float(lab["gate_min_al"])
        targets = json.loads(_get("http://127.0.0.1:%d/api/v1/targets" % port)[1])["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"]
    finally:
        stop.set()
        prom.terminate()
        prom.wait(timeout=20)
        th.join(timeout=20)
