"""The in-container agent, run as a real process on real files (no SSH): config writes and verification.

The same agent.py runs inside the test bed's containers in the end-to-end tests.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from agent_support import PUBLISHED, STALE, agent_code, make_models, run_agent, sha
from slack import slack


@pytest.fixture
def models(tmp_path):
    return make_models(tmp_path)


def verify(models, cfg_bytes=None, **kw):
    t, d = models
    if cfg_bytes is not None:
        (d / "config.json").write_bytes(cfg_bytes)
    pinned = json.load(open(PUBLISHED))
    args = {"path": str(d), "sha256": sha(PUBLISHED), "target_path": str(t), "num_speculative_tokens": 15,
            "method": "dflash", "fixes": []}
    args.update(kw)
    r = run_agent("verify", args, bulk={"pinned": pinned})
    return r, {c["check"]: c for c in r["checks"]}


def test_write_only_when_differs_with_backup_and_readback(models):
    _, d = models
    path = str(d / "config.json")
    data = open(PUBLISHED, "rb").read()
    r = run_agent("write_file", {"path": path, "sha256": sha(PUBLISHED)}, payload=data)
    assert r["ok"] and r["changed"] and r["after_sha256"] == sha(PUBLISHED)
    assert open(r["backup"], "rb").read() == open(STALE, "rb").read()
    assert open(path, "rb").read() == data  # the pinned bytes, not a re-serialisation
    again = run_agent("write_file", {"path": path, "sha256": sha(PUBLISHED)}, payload=data)
    assert again["ok"] and not again["changed"] and again["backup"] is None


def test_write_refuses_a_corrupted_payload(models):
    _, d = models
    r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(PUBLISHED)}, payload=b"{}")
    assert not r["ok"] and r["stage"] == "payload"
    assert open(d / "config.json", "rb").read() == open(STALE, "rb").read()


def test_write_into_missing_directory(tmp_path):
    r = run_agent("write_file", {"path": str(tmp_path / "nope" / "config.json"), "sha256": sha(PUBLISHED)},
                  payload=open(PUBLISHED, "rb").read())
    assert not r["ok"] and r["stage"] == "directory" and "does not exist" in r["message"]


def test_stale_guess_every_wrong_field_named(models):
    r, checks = verify(models)
    assert not checks["sha256"]["ok"]
    for field in ("dflash_config.target_layer_ids", "dflash_config.mask_token_id", "layer_types", "sliding_window",
                  "use_sliding_window", "bos_token_id"):
        c = checks["field " + field]
        assert not c["ok"], field
    assert checks["field dflash_config.target_layer_ids"]["on_disk"] == [1, 17, 33, 49, 63]
    assert checks["field dflash_config.target_layer_ids"]["expected"] == [1, 16, 31, 46, 61]
    assert not checks["target_layer_ids range"]["ok"]  # 63 + 1 > 63
    assert len([c for c in r["checks"] if c["check"].startswith("field ")]) == 6


def test_published_config_passes_every_config_check(models):
    r, checks = verify(models, open(PUBLISHED, "rb").read())
    bad = [c for c in r["checks"] if not c["ok"] and not c["check"].startswith("vllm")]
    assert bad == []
    assert checks["loaded sliding_window"]["as_loaded"] == 2048
    assert r["transformers_version"]


def test_window_dropped_is_caught_only_as_loaded(models):
    """use_sliding_window: false keeps a plausible raw file; only loading shows the window is gone."""
    cfg = json.load(open(PUBLISHED))
    cfg["use_sliding_window"] = False
    raw = json.dumps(cfg, indent=2).encode()
    # pin these bytes, so the raw sha256 and field checks pass: only the as-loaded diff remains
    pinned_sha = hashlib.sha256(raw).hexdigest()
    t, d = models
    (d / "config.json").write_bytes(raw)
    r = run_agent("verify", {"path": str(d), "sha256": pinned_sha, "target_path": str(t), "method": "dflash",
                             "num_speculative_tokens": 15}, bulk={"pinned": cfg})
    checks = {c["check"]: c for c in r["checks"]}
    assert checks["sha256"]["ok"] and "fields" in checks and checks["fields"]["ok"]
    lost = checks["loaded sliding_window"]
    assert not lost["ok"] and lost["on_disk"] == 2048 and lost["as_loaded"] is None
    assert "use_sliding_window is not true" in lost["reason"]


def test_absent_key_filled_on_load_is_a_finding(models):
    cfg = json.load(open(PUBLISHED))
    del cfg["layer_types"]
    cfg["sliding_window"] = None
    del cfg["use_sliding_window"]
    raw = json.dumps(cfg).encode()
    t, d = models
    (d / "config.json").write_bytes(raw)
    r = run_agent("verify", {"path": str(d), "sha256": hashlib.sha256(raw).hexdigest(), "target_path": str(t),
                             "method": "dflash", "num_speculative_tokens": 15}, bulk={"pinned": cfg})
    checks = {c["check"]: c for c in r["checks"]}
    c = checks["loaded layer_types"]
    assert not c["ok"] and c["on_disk"] == "<absent>" and c["as_loaded"] == ["full_attention"] * 5


def test_duplicate_keys_are_an_error(models):
    raw = open(PUBLISHED, "rb").read().replace(b'"block_size": 16,', b'"block_size": 16,\n  "block_size": 8,')
    r, checks = verify(models, raw)
    assert not checks["json"]["ok"] and "duplicate key 'block_size'" in checks["json"]["reason"]


def test_hub_id_resolves_to_the_snapshot_vllm_reads(tmp_path, models):
    hub = tmp_path / "hf" / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
    (hub / "refs").mkdir(parents=True)
    (hub / "refs" / "main").write_text("abc123")
    (hub / "blobs").mkdir()
    shutil.copy(STALE, hub / "blobs" / "deadbeef")
    (hub / "snapshots" / "abc123").mkdir(parents=True)
    os.symlink("../../blobs/deadbeef", hub / "snapshots" / "abc123" / "config.json")
    # the operator wrote the published file locally, but with a hub id vLLM reads the snapshot
    _, d = models
    shutil.copy(PUBLISHED, d / "config.json")
    r, checks = verify(models, path=None, hub_id="z-lab/Qwen3.6-27B-DFlash", hf_home=str(tmp_path / "hf"))
    assert r["location"]["realpath"] == str(hub / "blobs" / "deadbeef")
    assert not checks["sha256"]["ok"]


def test_stack_reports_missing_vllm(models):
    r, checks = verify(models, open(PUBLISHED, "rb").read())
    if r["stack"]["installed"]:
        pytest.skip("a vllm is importable here")
    assert not checks["vllm installed"]["ok"]


def test_lock_is_exclusive_names_its_holder_and_breaks_stale_leases(tmp_path):
    sd = str(tmp_path / "state")
    a = run_agent("lock", {"state_dir": sd, "token": "A", "holder": "alice@ws1 pid 1", "lease_s": 60,
                           "operation": "up"})
    assert a == {"locked": True}
    b = run_agent("lock", {"state_dir": sd, "token": "B", "holder": "bob@ws2 pid 2", "lease_s": 60})
    assert b["locked"] is False and b["holder"]["holder"] == "alice@ws1 pid 1" and b["holder"]["operation"] == "up"
    assert run_agent("unlock", {"state_dir": sd, "token": "B"})["unlocked"] is False  # not B's to release
    assert run_agent("unlock", {"state_dir": sd, "token": "A"}) == {"unlocked": True}
    # a lease that ran out (its holder died) is broken by the next taker
    run_agent("lock", {"state_dir": sd, "token": "C", "holder": "carol", "lease_s": 0})
    assert run_agent("lock", {"state_dir": sd, "token": "D", "holder": "dave", "lease_s": 60}) == {"locked": True}


def test_fuser_kill_refuses_outside_a_container():
    """This machine plays the Proxmox host: no container= in PID 1's environment, so nothing is killed."""
    import re

    code = agent_code("from vpd_agent.gpus import fuser_kill\nprint(json.dumps(fuser_kill([0], 0.1)))\n")
    try:
        with open("/proc/1/environ", "rb") as fh:
            if re.search(rb"(^|\0)container=", fh.read()):
                pytest.skip("this test machine is itself an LXC container")
    except PermissionError:
        pass  # unreadable: the agent cannot tell either, and must refuse
    # on stdin: the agent is longer than one argv string may be (MAX_ARG_STRLEN, 128 KiB)
    p = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
    out = json.loads(p.stdout)
    assert "refusing to run fuser -k here" in out["refused"] and "Proxmox host" in out["refused"]


def test_agent_http_client_against_a_real_server(tmp_path):
    """The agent's small HTTP/1.0 client: status codes, bodies, JSON POST, auth header, chunked replies."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/chunked":
                self.protocol_version = "HTTP/1.1"
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in (b"hello ", b"world"):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")
                return
            code = 200 if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"" if code == 200 else b"nope")

        def do_POST(self):
            n = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(n))
            self.send_response(401 if self.headers.get("Authorization") != "Bearer k" else 200)
            self.end_headers()
            self.wfile.write(json.dumps({"got": body}).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    code = agent_code("from vpd_agent.net import http\n") + f"""
print(json.dumps([http({port}, "/health"), http({port}, "/x"), http({port}, "/chunked"),
                  http({port}, "/v1/completions", "POST", {{"a": 1}}, api_key="k"),
                  http({port}, "/v1/completions", "POST", {{"a": 1}}), http(1, "/health", timeout=1)]))
"""
    try:
        p = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
    finally:
        srv.shutdown()
    ok, missing, chunked, post, unauth, refused = json.loads(p.stdout)
    assert ok == [200, ""] and missing == [404, "nope"] and chunked == [200, "hello world"]
    assert post[0] == 200 and json.loads(post[1]) == {"got": {"a": 1}} and unauth[0] == 401
    assert refused[0] is None and "ConnectionRefusedError" in refused[1]


def test_unit_file_quoting_keeps_the_argv_exact_and_secrets_out():
    """ExecStart=/Environment= arguments: double-quoted with systemd's escapes, % and $ doubled (no specifier or
    variable expansion); the environment file single-quotes (systemd expands nothing there)."""
    from orchestrator.agent.container import systemd as mod

    assert mod.unit_quote('{"a":"b c"}') == '"{\\"a\\":\\"b c\\"}"'
    assert mod.unit_quote("50%$HOME\\x") == '"50%%$$HOME\\\\x"'
    with pytest.raises(ValueError):
        mod.unit_quote("a\nb")
    assert mod.env_file_line("VLLM_API_KEY", "s3cr$t\"x") == "VLLM_API_KEY='s3cr$t\"x'\n"
    with pytest.raises(ValueError):
        mod.env_file_line("K", "it's")
    text = mod.unit_text({"playbook": "p", "argv": ["/bin/vllm", "serve"], "stop_grace_s": 12,
                          "supervise": {"restart_sec": 2, "start_limit_burst": 4, "start_limit_interval_s": 90}},
                         {"A": "1"}, "/var/lib/x/vllm-p.env").decode()
    for line in ('ExecStart="/bin/vllm" "serve"', 'Environment="A=1"', "EnvironmentFile=/var/lib/x/vllm-p.env",
                 "KillMode=control-group", "TimeoutStopSec=12s", "Restart=on-failure", "RestartSec=2s",
                 "StartLimitBurst=4", "StartLimitIntervalSec=90s", "WantedBy=multi-user.target"):
        assert line in text.splitlines(), line


def test_layer_types_values_row_shows_what_is_on_disk_when_ok(models):
    """Issue 26: an ok `layer_types values` row showed `[]` on disk (the list of bad values)."""
    _, checks = verify(models, open(PUBLISHED, "rb").read())
    c = checks["layer_types values"]
    assert c["ok"] and c["on_disk"] == "full_attention|sliding_attention", c


def _status_with_smi(tmp_path, script, timeout_s):
    """`status` as deploy sends it (early nvidia-smi in the first line, -I -S), with
    a stand-in nvidia-smi first on PATH; -> (result, seconds, how many times nvidia-smi ran)."""
    import time

    from orchestrator.agent.call import agent_argv, agent_stdin

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho run >> %s/runs\n%s\n" % (tmp_path, script))
    smi.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    args = {"state_dir": str(state), "nvidia_smi_timeout_s": timeout_s}
    # the program with the archive inline is over Linux's 128 KiB per argument: on stdin, as deploy sends it then
    # (call.ARGV_PROGRAM_MAX); the early nvidia-smi is still its first line
    prog = agent_stdin(None, None, None, early_smi=True)
    argv = agent_argv(sys.executable, "status", args, one_shot=True)
    env = dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ.get("PATH", "/usr/bin:/bin")))
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, timeout=60, env=env, input=prog)
    took = time.monotonic() - t0
    res = [json.loads(ln)["result"] for ln in p.stdout.decode().splitlines() if ln.startswith('{"result"')]
    assert res, p.stderr.decode()
    runs = (tmp_path / "runs").read_text().count("run") if (tmp_path / "runs").exists() else 0
    return res[-1], took, runs


def test_status_adopts_the_nvidia_smi_its_first_line_started(tmp_path):
    r, _, runs = _status_with_smi(tmp_path, "echo '0, 1024, 81559'; echo '1, 0, 81559'", 5)
    assert r["memory"] == {"gpus": {"0": {"used": 1024, "total": 81559}, "1": {"used": 0, "total": 81559}}}
    assert runs == 1  # started once, by the preamble, and read by the agent


@pytest.mark.deadline
def test_an_early_nvidia_smi_that_hangs_is_killed_at_the_timeout(tmp_path):
    r, took, _ = _status_with_smi(tmp_path, "exec sleep 30", 0.5)
    assert r["memory"] == {"error": "timeout", "message": "nvidia-smi did not answer within 0.5s"}
    assert took < slack(20, below=30)  # bounded: killed at the timeout, not waited for


def test_a_status_exec_loads_no_subprocess_threading_signal_or_socket_module(tmp_path):
    """Issue 54: their imports were ~7 ms of CPU in every status exec. The preamble spawns nvidia-smi with
    os.posix_spawnp, the agent collects it without a thread, and HTTP goes through _socket; the plumbing facts
    come from their record (no importlib.util); JSON by the agent's own codec over `_json` (`json` loads `re`, and
    with it enum, functools and collections: ~9 ms more)."""
    from orchestrator.agent.call import agent_argv, agent_stdin

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho '0, 1, 81559'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    hook = (b"import atexit, sys\natexit.register(lambda: sys.stderr.write('MODULES ' + ' '.join(sorted("
            b"sys.modules)) + '\\n'))\n")
    argv = agent_argv(sys.executable, "status", {"state_dir": str(state), "nvidia_smi_timeout_s": 5,
                                                  "plumbing": True}, one_shot=True)
    env = dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ.get("PATH", "/usr/bin:/bin")))
    cache = str(state / "vpd-agent")
    for inline in (True, False):  # the first exec keeps the archive (and the plumbing record); the second is checked
        p = subprocess.run(argv, capture_output=True, timeout=60, env=env,
                           input=hook + agent_stdin(None, None, None, early_smi=True, cache_dir=cache, inline=inline))
    res = [json.loads(ln)["result"] for ln in p.stdout.decode().splitlines() if ln.startswith('{"result"')]
    assert res and res[-1]["memory"] == {"gpus": {"0": {"used": 1, "total": 81559}}}, p.stderr.decode()
    assert "plumbing" in res[-1] and "nodes" in res[-1]["plumbing"]
    loaded = set(p.stderr.decode().split("MODULES ", 1)[1].split())
    unwanted = {"subprocess", "threading", "signal", "socket", "selectors", "json", "json.decoder"}
    if os.geteuid() == 0:  # the record is read back only when root-owned: elsewhere the facts are read fresh
        unwanted.add("importlib.util")
    assert not loaded & unwanted, loaded & unwanted


def test_an_early_nvidia_smi_that_fails_is_reported_as_before(tmp_path):
    r, _, _ = _status_with_smi(tmp_path, "echo 'NVIDIA-SMI has failed because it could not communicate' >&2; exit 9",
                               5)
    assert r["memory"]["error"] == "failed" and "could not communicate" in r["memory"]["message"]


def test_a_process_fuser_signalled_is_named_with_its_command_line_cleaned_and_capped():
    """Issue 41: fuser_kill names each pid it signalled as read while it held the GPU (else from /proc now):
    comm and cmdline, terminal controls and newlines gone, capped."""
    code = agent_code("from vpd_agent.gpus import named\nimport os\n"
                      "seen = {7: {'comm': 'python3', 'cmdline': 'python3 a.py\\n--b ' + 'x' * 300 + ' --device /dev/nvidia3'}}\n"
                      "print(json.dumps([named(7, seen), named(os.getpid(), {}), named(2 ** 22 + 7, {})]))\n")
    p = subprocess.run([sys.executable, "-", "--marker\x1b[2Jhere"], input=code, capture_output=True, text=True,
                       timeout=60)
    held, me, gone = json.loads(p.stdout)
    assert held["pid"] == 7 and held["comm"] == "python3" and "\n" not in held["cmdline"]
    assert held["cmdline"].startswith("python3 a.py --b xxx") and held["cmdline"].endswith("x --device /dev/nvidia3")
    assert " ... " in held["cmdline"] and len(held["cmdline"]) == 205  # head and tail: the telling arguments kept
    assert "--markerhere" in me["cmdline"] and "\x1b" not in me["cmdline"]
    assert gone["cmdline"] == "" and gone["comm"] == ""
