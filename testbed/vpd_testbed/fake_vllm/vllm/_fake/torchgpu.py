"""The torch-backed engine of the fake vLLM: the stand-in for a real GPU (the real-GPU check, issue 55).

The fake vLLM's CLI, log lines, API and metrics stay as they are; only what its ``VLLM::Worker_TP<n>`` processes
hold changes. With the torch engine on, each worker imports the machine's PyTorch (EngineCore and the API server
never do, so forking them stays safe) and:

- on a machine whose torch sees CUDA: creates a real CUDA context on its GPU (the driver itself opens
  ``/dev/nvidiactl``, ``/dev/nvidia<K>``, ``/dev/nvidia-uvm``: `fuser`, `nvidia-smi` and the memory release after
  a kill are the real driver's), then allocates the weights and the KV cache with ``torch.empty`` on that GPU (a
  real ``cudaMalloc``, counted by ``nvidia-smi``); an allocation the card cannot give fails with torch's own
  ``torch.OutOfMemoryError`` text, which EngineCore reports as vLLM does;
- on a machine whose torch has no CUDA (a rehearsal): holds the device files as the default fake does and
  allocates small CPU tensors instead (``scale``, default 1/1024), so the same code runs end to end.

Each decode step is a real kernel: a matrix product of the step's tokens (1 + k with speculation) against the
weights allocation viewed as bf16 rows of the model's hidden size, so one step reads every weight once, as a
memory-bound decode does. Worker 0 times it at startup; the API server then paces requests by that measured step.

Switched on by ``engine.json`` beside the faults file (``/etc/vpd-testbed/engine.json``, which the test bed writes
for ``gpus=real`` containers) or ``VPD_FAKE_VLLM_ENGINE=torch``. Keys (all optional): ``weights_mib`` and
``kv_cache_mib`` (per GPU, what orchestrator/core/sizing.py predicts for the playbook on this card; default: the fake's
own figures), ``scale`` (multiplies every allocation; default 1 on CUDA, 1/1024 on CPU), ``hidden`` (the matrix
product's inner size, default 5120), ``max_steps`` (cap of one decode request's kernels, default 4096).
"""

import json
import os
import time

from vllm import _layout

ENGINE_FILE = "engine.json"
CHUNK_MIB = 2048  # one allocation at most this large: weights and KV cache are several tensors, as in vLLM
CPU_SCALE = 1.0 / 1024


def engine_path() -> str:
    return os.environ.get("VPD_FAKE_VLLM_ENGINE_FILE") or os.path.join(os.path.dirname(_layout.faults_path()),
                                                                       ENGINE_FILE)


def config():
    """The torch engine's settings when it is on, else None (the default fake engine)."""
    data = {}
    try:
        with open(engine_path(), "r", encoding="utf-8") as f:
            loaded = json.load(f)
        if isinstance(loaded, dict):
            data = loaded
    except (OSError, ValueError):
        pass
    env = os.environ.get("VPD_FAKE_VLLM_ENGINE")
    if env:
        data["engine"] = env
    return data if data.get("engine") == "torch" else None


class TorchHold:
    """One worker's device: its CUDA context (or, without CUDA, the device files) and its allocations."""

    def __init__(self, local_index, gpus, cfg):
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # torch's index = nvidia-smi's, as in vLLM
        import torch

        self.torch = torch
        self.cfg = cfg or {}
        self.cuda = bool(torch.cuda.is_available())
        self.fds = None
        if self.cuda:
            torch.cuda.set_device(local_index)
            self.dev = torch.device("cuda", local_index)
            torch.zeros(1, device=self.dev)  # the context: the driver opens /dev/nvidia* for this process
            self.where = "cuda:%d (%s)" % (local_index, torch.cuda.get_device_name(local_index))
        else:
            from vllm._fake import proc

            self.dev = torch.device("cpu")
            self.fds = proc.GpuHold(gpus)  # a rehearsal: the device files held as the default fake holds them
            self.where = "cpu (rehearsal: torch %s has no CUDA)" % torch.__version__
        scale = self.cfg.get("scale")
        self.scale = float(scale) if scale is not None else (1.0 if self.cuda else CPU_SCALE)
        self.weights = []  # bf16 tensors [rows, hidden]
        self.kv = []
        self.held_mib = 0.0
        self.hidden = int(self.cfg.get("hidden") or 5120)
        self.x = None

    def _alloc(self, mib, into, as_matrix):
        torch = self.torch
        left = mib
        while left > 0:
            n = min(left, CHUNK_MIB)
            rows = max(1, int(n * 2**20 // (2 * self.hidden)))
            if self.cuda:
                t = torch.empty((rows, self.hidden), dtype=torch.bfloat16, device=self.dev)
            else:
                t = torch.zeros((rows, self.hidden), dtype=torch.bfloat16)  # touched: real pages, small
            into.append(t)
            got = rows * self.hidden * 2 / 2**20
            self.held_mib += got
            left -= max(got, 1e-3)

    def load(self, weights_mib, kv_mib):
        """Weights then KV cache, each `scale`d. -> {"status": "ok", ...} or {"status": "failed", "error": ...}."""
        t0 = time.monotonic()
        try:
            if weights_mib and not self.weights:
                self._alloc(weights_mib * self.scale, self.weights, True)
            if kv_mib and not self.kv:
                self._alloc(kv_mib * self.scale, self.kv, False)
            if self.cuda:
                self.torch.cuda.synchronize(self.dev)
        except Exception as e:  # torch.OutOfMemoryError and the driver's own errors, in torch's words
            mod = type(e).__module__
            name = type(e).__name__ if mod in ("builtins",) else "%s.%s" % (mod, type(e).__name__)
            if name == "torch.OutOfMemoryError" or name.endswith("OutOfMemoryError"):
                name = "torch.OutOfMemoryError"
            return {"status": "failed", "error": "%s: %s" % (name, str(e).strip())}
        out = {"status": "ok", "held_mib": round(self.held_mib, 1), "seconds": round(time.monotonic() - t0, 3)}
        if self.cuda:
            out["reserved_mib"] = round(self.torch.cuda.memory_reserved(self.dev) / 2**20, 1)
        return out

    def step(self, tokens=1):
        """One decode step: (tokens x hidden) @ every weight matrix^T, on the device."""
        torch = self.torch
        if not self.weights:
            return
        if self.x is None or self.x.shape[0] != tokens:
            self.x = torch.ones((tokens, self.hidden), dtype=torch.bfloat16, device=self.dev)
        for w in self.weights:
            torch.matmul(self.x, w.t())

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def bench(self, tokens=1, n=5):
        """-> milliseconds of one decode step (mean of n after one warm-up)."""
        self.step(tokens)
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step(tokens)
        self.sync()
        return (time.perf_counter() - t0) / n * 1000.0

    def steps(self, n, tokens=1):
        for _ in range(min(int(n), int(self.cfg.get("max_steps") or 4096))):
            self.step(tokens)
        self.sync()

    def close(self):
        self.weights, self.kv, self.x = [], [], None
        if self.fds:
            self.fds.close()
