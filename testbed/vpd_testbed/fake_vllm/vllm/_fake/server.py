"""The ``vllm serve`` API server process of the fake vLLM.

Order of events (as in vLLM): banner, non-default args, socket bound (not listening), config (spec config
validated strictly, drafter config loaded with transformers AutoConfig), fork ``VLLM::EngineCore`` (which forks
``VLLM::Worker_TP<n>``), wait for the engine, then listen and serve HTTP.
"""

import errno
import json
import os
import signal
import socket
import sys
import time

from vllm import _layout
from vllm._fake import accept, engine, logs, proc, torchgpu
from vllm._fake.specconfig import MTP_ALIASES, SpecConfigError, validate

API = "api_server.py"


def _frames_cli():
    exe = sys.argv[0] if sys.argv and sys.argv[0] else "/usr/local/bin/vllm"
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return exe, pkg


def _fatal_api(frames, exc_line, code=1):
    """Uncaught exception in the API server: a traceback on stderr, with the process prefix."""
    exe, pkg = _frames_cli()
    base = [(exe, 10, "<module>", "sys.exit(main())"),
            (f"{pkg}/entrypoints/cli/main.py", 73, "main", "args.dispatch_function(args)"),
            (f"{pkg}/entrypoints/cli/serve.py", 60, "cmd", "uvloop.run(run_server(args))")]
    logs.raw(logs.traceback_text(base + list(frames), exc_line), fd=2)
    logs.flush_std()
    return code


def resolve_model_dir(model: str):
    if os.path.isdir(model):
        return model
    if model.startswith("/") or model.startswith("."):
        return None
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(hf_home, "hub")
    repo = os.path.join(hub, "models--" + model.replace("/", "--"))
    ref = os.path.join(repo, "refs", "main")
    snaps = os.path.join(repo, "snapshots")
    try:
        if os.path.exists(ref):
            with open(ref) as f:
                d = os.path.join(snaps, f.read().strip())
            if os.path.isdir(d):
                return d
        cands = sorted(os.listdir(snaps))
        if cands:
            return os.path.join(snaps, cands[-1])
    except OSError:
        pass
    return None


def _invalid_model(model):
    return (f"ValueError: Invalid repository ID or local directory specified: '{model}'.\n"
            "Please verify the following requirements:\n"
            "1. Provide a valid Hugging Face repository ID.\n"
            "2. Specify a local directory that contains a recognized configuration file.\n"
            "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
            "   - For Mistral models: ensure the presence of a 'params.json'.")


def load_draft_config(model):
    """The drafter's config exactly as vLLM loads it: transformers AutoConfig, trust_remote_code=True."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model, trust_remote_code=True)


def bind_socket(host, port, version):
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if _layout.vtuple(version) <= (0, 24, 99):
        # up to 0.24 vLLM set SO_REUSEPORT: a second server on the same port may NOT fail
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host or "", port))
    sock.set_inheritable(False)
    return sock


class State:
    pass


def serve_main(args, non_default) -> int:
    import vllm
    info = _layout.read_build(os.path.dirname(os.path.abspath(vllm.__file__)))
    eff = info.get("effective") or {"version": vllm.__version__, "build": "release", "no_fix_markers": False}
    version, build = eff["version"], eff["build"]
    vstr = vllm.__version__
    feat = info.get("features") or _layout.features(version, build, eff.get("no_fix_markers"))
    v = _layout.vtuple(version)
    faults = _layout.read_faults()
    logs.set_process_name("APIServer")
    t_start = time.time()

    logs.info(f"{API}:1839", f"vLLM API server version {vstr}")
    shown = {k: (val if k != "api_key" else "<redacted>") for k, val in non_default.items()}
    logs.info("utils.py:233", f"non-default args: {shown}")

    # the listening socket is created before the engine (port conflicts fail before model load)
    try:
        sock = bind_socket(args.host, args.port, version)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return _fatal_api([(f"{_frames_cli()[1]}/entrypoints/openai/api_server.py", 1954, "create_server_socket",
                                "sock.bind(addr)")], "OSError: [Errno 98] Address already in use")
        return _fatal_api([], f"OSError: [Errno {e.errno}] {e.strerror}")

    # ---- target model config
    model = args.model
    mdir = resolve_model_dir(model)
    cfg_path = os.path.join(mdir, "config.json") if mdir else None
    if not cfg_path or not os.path.isfile(cfg_path):
        return _fatal_api([], _invalid_model(model))
    try:
        with open(cfg_path) as f:
            target = json.load(f)
    except (OSError, ValueError) as e:
        return _fatal_api([], f"OSError: It looks like the config file at '{cfg_path}' is not a valid JSON file. {e}")
    text_cfg = target.get("text_config") or target
    arch = (target.get("architectures") or ["Qwen3_5ForConditionalGeneration"])[0]
    logs.info("model.py:547", f"Resolved architecture: {arch}")
    derived_len = int(text_cfg.get("max_position_embeddings") or target.get("max_position_embeddings") or 32768)
    max_len = args.max_model_len
    if max_len is not None and max_len > derived_len and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        return _fatal_api([], f"ValueError: User-specified max_model_len ({max_len}) is greater than the derived "
                              f"max_model_len (max_position_embeddings={derived_len} or model_max_length=None in "
                              f"model's config.json). To allow overriding this maximum, set the env var "
                              f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with "
                              f"extreme caution. If the model uses relative position encoding (RoPE), positions "
                              f"exceeding derived_max_model_len lead to nan. If the model uses absolute position "
                              f"encoding, positions exceeding derived_max_model_len will cause a CUDA array "
                              f"out-of-bounds error.")
    if max_len is None:
        max_len = derived_len
    if max_len != -1:
        logs.info("model.py:1510", f"Using max model len {max_len}")
    mnbt = args.max_num_batched_tokens or 8192
    logs.info("scheduler.py:205", f"Chunked prefill is enabled with max_num_batched_tokens={mnbt}.")

    # ---- speculative config
    spec = None
    acc = None
    draft_cfg = None
    taps = None
    taps_line = None
    mixed = False
    backend = args.attention_backend
    pkg = _frames_cli()[1]
    spec_frames = [(f"{pkg}/engine/arg_utils.py", 1602, "create_engine_config",
                    "speculative_config = self.create_speculative_config("),
                   (f"{pkg}/engine/arg_utils.py", 1355, "create_speculative_config",
                    "return SpeculativeConfig(**self.speculative_config)")]
    if args.speculative_config is not None:
        try:
            spec = validate(args.speculative_config, version)
        except SpecConfigError as e:
            return _fatal_api(spec_frames, e.exc_line)
        method = spec.get("method")
        if method in MTP_ALIASES:
            logs.warning("speculative.py:451", f"method `{method}` is deprecated and replaced with mtp.")
            method = "mtp"
        if method is None:
            method = "draft_model" if spec.get("model") else "ngram"
        spec["method"] = method
        k = spec.get("num_speculative_tokens")
        post = spec_frames + [(f"{pkg}/config/speculative.py", 380, "__post_init__", "raise ValueError(")]
        if method == "mtp":
            n_predict = int(text_cfg.get("mtp_num_hidden_layers") or target.get("num_nextn_predict_layers") or 0)
            if n_predict <= 0:
                return _fatal_api(post, f"ValueError: MTP is not supported for {arch}: the model has no MTP layers "
                                        f"(mtp_num_hidden_layers is 0).")
            if k is None:
                k = n_predict
            if k > n_predict and k % n_predict != 0:
                return _fatal_api(post, f"ValueError: num_speculative_tokens:{k} must be divisible by "
                                        f"n_predict={n_predict}")
            spec["model"] = model
            acc = accept.for_mtp(k)
        elif method == "ngram":
            k = k or 5
            acc = accept.for_other("ngram", k)
        else:
            dmodel = spec.get("model")
            if not dmodel:
                return _fatal_api(post, "ValueError: num_speculative_tokens was provided but without speculative "
                                        "model.")
            if k is None:
                return _fatal_api(post, "ValueError: num_speculative_tokens must be provided with speculative "
                                        "model unless the draft model config contains an n_predict parameter.")
            if resolve_model_dir(dmodel) is None or not os.path.isfile(os.path.join(resolve_model_dir(dmodel),
                                                                                     "config.json")):
                # as vLLM 0.32.0 (real, issue 25): the hub lookup logs its retries, then SpeculativeConfig's
                # pydantic validation fails with the reason on the line after the exception's
                logs.error("repo_utils.py:124", f"Error retrieving file list: Repo id must be in the form "
                                                f"'repo_name' or 'namespace/repo_name': '{dmodel}'. Use `repo_type` "
                                                f"argument if needed.")
                text = _invalid_model(dmodel).replace("ValueError: ", "  Value error, ", 1)
                return _fatal_api(spec_frames, "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                               "SpeculativeConfig\n" + text + " [type=value_error, input_value=ArgsKwargs(("
                                               "), {'model': ...config_format': 'auto'}), input_type=ArgsKwargs]\n"
                                               "    For further information visit "
                                               "https://errors.pydantic.dev/2.14/v/value_error")
            try:
                draft_cfg = load_draft_config(dmodel)
            except Exception as e:  # the real vLLM dies with transformers' own error
                exc = f"{type(e).__module__}.{type(e).__name__}" if type(e).__module__ not in (
                    "builtins",) else type(e).__name__
                return _fatal_api(spec_frames + [(f"{pkg}/transformers_utils/config.py", 640, "get_config",
                                                  "config = AutoConfig.from_pretrained(")], f"{exc}: {e}")
            if method == "dflash":
                dfc = getattr(draft_cfg, "dflash_config", None) or {}
                override = getattr(draft_cfg, "eagle_aux_hidden_state_layer_ids", None) or \
                    dfc.get("eagle_aux_hidden_state_layer_ids")
                tli = dfc.get("target_layer_ids")
                n_t = int(text_cfg.get("num_hidden_layers") or 64)
                if override:
                    taps = tuple(int(i) for i in override)
                elif tli:
                    taps = tuple(int(i) + (1 if feat.get("plus1") else 0) for i in tli)
                else:
                    taps = (2, n_t // 2, n_t - 3)
                lt = list(getattr(draft_cfg, "layer_types", None) or [])
                mixed = "sliding_attention" in lt and "full_attention" in lt
                sliding_supported = bool(feat.get("pr40898")) or (
                    v >= (0, 26, 0) and bool(feat.get("resolve_layer_attention")))
                acc = accept.for_dflash(k, draft_cfg, text_cfg, taps, sliding_supported)
                use_v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" or (
                    (0, 26, 0) <= v <= (0, 30, 99) and mixed and not feat.get("pr40898"))
                if use_v2:
                    taps_line = ("eagle3_utils.py:47", f"Using Eagle3 auxiliary layers from config: {taps}")
                else:
                    taps_line = ("gpu_model_runner.py:4012",
                                 f"Using auxiliary layers from speculative config: {taps}")
                spec_backend = spec.get("attention_backend")
                if spec_backend:
                    backend = str(spec_backend).upper()
            else:
                acc = accept.for_other(method, k)
        spec["num_speculative_tokens"] = k
    spec_repr = None
    if spec:
        spec_repr = f"SpeculativeConfig(method={spec['method']!r}, model={spec.get('model')!r}, " \
                    f"num_spec_tokens={spec['num_speculative_tokens']!r})"

    served = args.served_model_name or [model]
    ctx = {
        "version": version, "version_string": vstr, "build": build, "features": feat, "model": model,
        "served": served, "tp": args.tensor_parallel_size, "util": args.gpu_memory_utilization,
        "max_len": max_len, "derived_len": derived_len, "mnbt": mnbt, "spec": spec, "spec_repr": spec_repr,
        "backend": backend, "taps_line": taps_line, "mixed": mixed, "faults": faults,
        "load_s": float(faults.get("load_s", 1.0) if faults.get("load_s") is not None else 1.0),
        "enforce_eager": bool(args.enforce_eager), "kv_cache_dtype": args.kv_cache_dtype,
        "trust_remote_code": bool(args.trust_remote_code), "t_start": t_start,
        "draft_layers": int(getattr(draft_cfg, "num_hidden_layers", 0) or 0) if draft_cfg is not None else 0,
        "target_text": {k2: text_cfg.get(k2) for k2 in ("num_hidden_layers", "num_key_value_heads", "head_dim",
                                                          "layer_types", "full_attention_interval")},
    }
    if acc is not None:
        ctx["acceptance"] = acc.describe()
    ctx["torch"] = torchgpu.config()  # the torch engine (the real-GPU stand-in), or None: the default fake


    # ---- API server holds its GPUs (0 MiB), then forks the engine
    gpus = proc.visible_gpus()
    api_hold = None
    decode_w = None
    if ctx["torch"] is None:
        try:
            api_hold = proc.GpuHold(gpus)
        except OSError:
            api_hold = None
    else:  # the torch engine: decode steps go to EngineCore, which runs them on its workers' GPUs
        decode_r, decode_w = os.pipe()
        os.set_blocking(decode_w, False)
        ctx["decode_fd"] = decode_r
    logs.flush_std()
    r_status, w_status = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r_status)
            sock.close()
            if api_hold:
                api_hold.close()
            engine.run_engine_core(ctx, w_status)
        finally:
            os._exit(1)
    os.close(w_status)
    if decode_w is not None:
        os.close(ctx.pop("decode_fd"))
    st = State()
    st.engine_pid = pid
    st.decode_w = decode_w
    st.shutting_down = False

    def _term_during_load(signum, frame):
        st.shutting_down = True
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        _reap(pid, 5.0)
        os._exit(0)

    signal.signal(signal.SIGTERM, _term_during_load)
    signal.signal(signal.SIGINT, _term_during_load)

    msg = _read_status(r_status)
    if not msg or msg.get("status") != "ready":
        _, status = _reap(pid, 10.0)
        failed = "{}" if msg else "{'EngineCore_DP0': %d}" % (status if status is not None else 1)
        code = 1
        if faults.get("oom_at_startup") and faults.get("oom_exit_code") is not None:
            code = int(faults["oom_exit_code"])
        return _fatal_api([(f"{pkg}/v1/engine/core_client.py", 95, "make_async_mp_client",
                            "return AsyncMPClient(*client_args)"),
                           (f"{pkg}/v1/engine/utils.py", 1209, "wait_for_engine_startup", "raise RuntimeError(")],
                          f"RuntimeError: Engine core initialization failed. See root cause above. "
                          f"Failed core proc(s): {failed}", code=code)
    ctx["max_len"] = msg.get("max_len", max_len)
    ctx["kv_tokens"] = msg.get("kv_tokens")
    if msg.get("step_ms") and not os.environ.get("VPD_FAKE_STEP_MS"):  # the torch engine's measured step
        os.environ["VPD_FAKE_STEP_MS"] = str(msg["step_ms"])

    from vllm._fake import http
    return http.run(ctx, args, sock, st, acc, r_status)


def _read_status(fd):
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        if b"\n" in buf:
            break
    line = buf.split(b"\n", 1)[0]
    try:
        return json.loads(line) if line else None
    except ValueError:
        return None


def _reap(pid, timeout):
    deadline = time.time() + timeout
    while True:
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return pid, None
        if wpid:
            return wpid, (os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status)
        if time.time() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.time() + 5
        time.sleep(0.05)
