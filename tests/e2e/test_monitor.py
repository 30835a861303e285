"""`deploy monitor export`: the files pass the real promtool (config, rules, the generated unit tests), and a real
Prometheus on this machine scrapes a test bed deployment through targets.json and fires the acceptance alert for a
broken drafter (short intervals, bounded waits). Skipped, with the reason, without Debian's prometheus package."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from e2e_helpers import REPO, free_port, start_prometheus, stop_process, wait_for_alert
from e2e_helpers import http_get as _get

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NODE_EXPORTER = shutil.which("prometheus-node-exporter")
needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="needs promtool (apt-get install prometheus; setup.sh does)")


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
    from orchestrator.observe.monitor import gate_thresholds
    from orchestrator.core.spec import load_inventory, load_playbook
    th = gate_thresholds(load_playbook("qwen36-dflash", load_inventory(tb.inventory_path)))
    rules = yaml.safe_load((d / "rules.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == {"VllmEndpointDown", "VllmAcceptanceLengthLow", "VllmFirstPositionLow",
                           "VllmAcceptanceCliff", "VllmServerRestarted", "VllmStartLimitHit", "VllmNotGated",
                           "GpuMemoryHeldOutsideDeployment", "VpdStatusUnreachable", "VpdStatusStale"}
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

    from orchestrator.steps.plan import serve_argv
    from orchestrator.core.spec import load_inventory, load_playbook
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
    # a server deploy did not start: its GPU memory is foreign (deploy monitor metrics, to stdout)
    p = deploy("--json", "monitor", "metrics", "pve1/129")
    assert p.returncode == 0, p.stdout + p.stderr
    from orchestrator.observe.monitor_metrics import parse
    foreign = parse(p.json["text"])["vpd_gpu_foreign_memory_mib"]
    assert foreign and all(v > 1024 and lab["playbook"] == "" for lab, v in foreign), foreign
    assert "vpd_gated" not in parse(p.json["text"])  # nothing of ours serves there
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
    prom, port = start_prometheus(PROMETHEUS, d, tmp_path)
    try:
        text = _get("http://%s:8000/metrics" % addr)[1]
        for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                     "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "process_start_time_seconds"):
            assert name in text, name
        firing = wait_for_alert(port, "VllmAcceptanceLengthLow", prom, tmp_path / "prometheus.log", 120)
        lab = firing[0]["labels"]
        assert (lab["host"], lab["vmid"], lab["playbook"], lab["method"]) == ("pve1", "129", "qwen36-dflash", "dflash")
        assert lab["instance"] == "%s:8000" % addr and float(firing[0]["value"]) < float(lab["gate_min_al"])
        targets = json.loads(_get("http://127.0.0.1:%d/api/v1/targets" % port)[1])["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"]
        # the dashboard drawn from this Prometheus (deploy monitor render): the scraped deployment's panels have
        # data, a valid PNG that matplotlib reads back
        png = tmp_path / "dashboard.png"
        p = deploy("--json", "monitor", "render", str(d / "dashboard.json"), "--prometheus",
                   "http://127.0.0.1:%d" % port, "--since", "2m", "--step", "1s", "--scrape-interval", "1s",
                   "--out", str(png))
        assert p.returncode == 0, p.stdout + p.stderr
        res = p.json
        assert res["failed"] == [] and res["series"] >= 5
        for title in ("Acceptance length (1 + accepted / drafts)", "Generated tokens/s", "Requests running / waiting",
                      "Scrape up (1) / down (0)"):
            assert title not in res["no_data"], res
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image
        assert matplotlib.image.imread(str(png)).shape[1] > 1000
    finally:
        stop.set()
        stop_process(prom)
        th.join(timeout=20)


@pytest.mark.skipif(not PROMETHEUS or not PROMTOOL or not NODE_EXPORTER,
                    reason="needs prometheus and prometheus-node-exporter (apt-get install; setup.sh does)")
def test_deploy_metrics_through_node_exporter_fire_not_gated_for_an_ungated_server(tb, deploy, tmp_path):
    """deploy killed before the gate leaves a server of ours running, never gated (as in test_gate). `deploy
    monitor metrics --textfile` writes vpd_gated 0 for it, a real node_exporter (only its textfile collector)
    serves the file, a real Prometheus scrapes it with the exported rules: VllmNotGated fires with its labels."""
    tb.set_fault("pve1", 129, "load_s", 4.0)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(deploy.state_dir), NO_COLOR="1")
    up = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", "qwen36-mtp"], cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while tb.container_exec("pve1", 129, ["test", "-e", "/var/lib/vllm-pve-deploy/state.json"]).returncode:
            assert time.monotonic() < deadline and up.poll() is None, "deploy up wrote no state file in 60 s"
            time.sleep(0.1)
    finally:
        up.send_signal(signal.SIGKILL)  # before the gate: the server stays, recorded, never gated
        up.wait(timeout=30)
    deadline = time.monotonic() + 45
    while True:  # until the server has loaded: its GPU memory is in use (else "not foreign" below proves nothing)
        row = deploy("--json", "status", "pve1/129").json["rows"][0]
        if row["gpus"] and all(g["used_mib"] > 1024 for g in row["gpus"]):
            break
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    assert row["lock"] and row["lock"]["operation"] == "up", row["lock"]  # the killed deploy's, left behind
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    prom_file = textdir / "vllm-pve-deploy.prom"
    p = deploy("--json", "monitor", "metrics", "pve1", "--textfile", str(prom_file))
    assert p.returncode == 0, p.stdout + p.stderr  # written: unhealthy is for the alerts to judge
    assert p.json["textfile"] == str(prom_file) and p.json["samples"] > 0
    from orchestrator.observe.monitor_metrics import parse
    series = parse(prom_file.read_text())
    assert ({"host": "pve1", "vmid": "129", "playbook": "qwen36-mtp"}, 0.0) in series["vpd_gated"]
    # the killed deploy's lock is still there (its lease has not lapsed), but its process is gone from this
    # workstation: no operation in progress, so VllmNotGated does not wait for one
    assert ({"host": "pve1", "vmid": "129", "playbook": "qwen36-mtp", "operation": ""}, 0.0) in \
        series["vpd_operation_in_progress"]
    assert {lab["vmid"]: v for lab, v in series["vpd_status_reachable"]} == {"129": 1.0, "130": 1.0}
    # GPUs 0-3 are held by that deployment (its state file's gpus): whatever they use is not foreign, also as
    # 130 (which shares GPUs 0-1) sees them
    foreign = {(lab["vmid"], lab["gpu"]): v for lab, v in series["vpd_gpu_foreign_memory_mib"]}
    assert set(foreign) >= {("129", "0"), ("129", "3"), ("130", "0"), ("130", "1")} and not any(foreign.values())
    assert oct(prom_file.stat().st_mode & 0o777) == "0o644" and os.listdir(textdir) == [prom_file.name]
    # bad usage: 2, before any connection
    p = deploy("monitor", "metrics", "--textfile", str(textdir / "x.txt"))
    assert p.returncode == 2 and "ending in .prom" in p.stderr

    ne_port = free_port()
    ne = subprocess.Popen([NODE_EXPORTER, "--web.listen-address=127.0.0.1:%d" % ne_port, "--collector.disable-defaults",
                           "--collector.textfile", "--collector.textfile.directory=%s" % textdir],
                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / "node_exporter.log", "wb"))
    prom = None
    try:
        deadline = time.monotonic() + 20
        while True:
            assert ne.poll() is None, (tmp_path / "node_exporter.log").read_text()
            try:
                page = _get("http://127.0.0.1:%d/metrics" % ne_port, timeout=2)[1]
                if "vpd_gated" in page:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "node_exporter does not serve the textfile within 20 s"
            time.sleep(0.2)
        d = tmp_path / "mon"
        p = deploy("monitor", "export", str(d), "--for", "1s", "--scrape-interval", "1s", "--evaluation-interval",
                   "1s", "--node-exporter", "127.0.0.1:%d" % ne_port)
        assert p.returncode == 0, p.stderr
        for args in (["check", "config", str(d / "prometheus.yml")], ["test", "rules", str(d / "rules.test.yml")]):
            r = subprocess.run([PROMTOOL] + args, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert "VpdStatusMissing" in (d / "rules.yml").read_text()  # with --node-exporter only
        prom, port = start_prometheus(PROMETHEUS, d, tmp_path)
        firing = wait_for_alert(port, "VllmNotGated", prom, tmp_path / "prometheus.log", 40)
        lab = firing[0]["labels"]
        assert (lab["host"], lab["vmid"], lab["playbook"], lab["job"]) == ("pve1", "129", "qwen36-mtp",
                                                                           "vllm-pve-deploy-status"), lab
        assert firing[0]["annotations"]["summary"] == "qwen36-mtp on pve1/129 serves without a passed acceptance gate"
    finally:
        if prom is not None:
            stop_process(prom)
        stop_process(ne)


def test_metrics_of_an_unreachable_host_are_written_with_reachable_0_and_exit_3(tb, deploy, tmp_path):
    tb.set_fault("pve4", None, "unreachable", True)
    path = tmp_path / "vpd.prom"
    p = deploy("monitor", "metrics", "pve3", "pve4", "--textfile", str(path), "--deadline", "5")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "pve4/129: unreachable, written as vpd_status_reachable 0" in p.stderr
    assert "read back and parsed" in p.stdout
    from orchestrator.observe.monitor_metrics import parse
    s = parse(path.read_text())
    assert {lab["host"]: v for lab, v in s["vpd_status_reachable"]} == {"pve3": 1.0, "pve4": 0.0}
    assert {lab["host"] for lab, _ in s["vpd_status_timestamp_seconds"]} == {"pve3", "pve4"}
