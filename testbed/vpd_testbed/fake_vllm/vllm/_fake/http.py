"""HTTP side of the fake vLLM API server (after the engine is ready): OpenAI endpoints, /health, /metrics."""

import json
import os
import signal
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm._fake import accept, logs
from vllm._fake.metrics import Metrics

WORDS = ("the", " model", " speculative", " decoding", " draft", " token", " accepted", " verify", " layer",
         " hidden", " state", " block", " window", " attention", " fast", " and", " of", " to", " a", ".")


def _uv(msg):
    """uvicorn-style line (``INFO:     ...``) with the process prefix, on stdout."""
    logs.raw("INFO:     " + msg, fd=1)


MAX_BATCH = 256   # vLLM's default max_num_seqs: the schedule's lookup covers batch sizes 1..256
SLICE_S = 0.004   # the decode sleeps in slices of at least this long (the steps inside are paced, not slept)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 2048  # uvicorn's backlog: a burst of concurrent clients is queued, not dropped

    def __init__(self, sock, handler):
        super().__init__(sock.getsockname()[:2], handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_activate()


class Stats:
    def __init__(self, k):
        self.lock = threading.Lock()
        self.k = k
        self.reset()

    def reset(self):
        self.requests = 0
        self.prompt = 0
        self.gen = 0
        self.drafts = 0
        self.accepted = 0
        self.per_pos = [0] * self.k

    def add(self, prompt, gen, spec):
        with self.lock:
            self.requests += 1
            self.prompt += prompt
            self.gen += gen
            if spec:
                d, a, pp = spec
                self.drafts += d
                self.accepted += a
                for i, c in enumerate(pp):
                    self.per_pos[i] += c

    def take(self):
        with self.lock:
            snap = (self.requests, self.prompt, self.gen, self.drafts, self.accepted, list(self.per_pos))
            self.reset()
            return snap


def run(ctx, args, sock, st, acc, r_status):
    served = ctx["served"]
    k = acc.k if (acc is not None and ctx.get("spec")) else 0
    metrics = Metrics(served[0], spec_k=k)
    stats = Stats(k)
    api_keys = set(args.api_key or [])
    created = int(time.time())
    st.dead = False
    stop = threading.Event()
    engine_gone = threading.Event()
    exit_code = {"code": 0}
    max_len = ctx["max_len"]
    method = acc.method if k else None
    overhead = float(ctx["faults"].get("spec_overhead") or 1.0) if k else 1.0
    sched = (ctx.get("spec") or {}).get("num_speculative_tokens_per_batch_size") if k else None
    lookup = accept.schedule_lookup(sched, MAX_BATCH, k) if sched else None
    engine = {"running": 0, "lock": threading.Lock()}

    def decode(prompt, prompt_tokens, mt, emit):
        """Decode one request step by step at the pace of the step-time model: every step's cost is read for the
        batch running at that moment (the requests in decode now), k from the batch-size schedule where one is
        set; sleeps to absolute times in slices of at least SLICE_S (per-step sleeps would cost more than the
        steps). emit(n): a streamed request's event per step. Returns (generated tokens, spec stats or None)."""
        dec = accept.Decoder(acc if k else None, prompt, mt)
        unit = accept.step_seconds()
        with engine["lock"]:
            engine["running"] += 1
        metrics.inc("vllm:num_requests_running", 1)
        t_req = time.monotonic()
        t_due = t_req
        first_at = None
        gen = 0
        pending = 0
        nsteps = 0
        try:
            while dec.left > 0:
                batch = engine["running"]
                k_eff = min(k, lookup[min(batch, MAX_BATCH)]) if lookup is not None else k
                t_due += unit * accept.step_units(method, k_eff, batch, overhead, drafter_loaded=bool(k))
                n = dec.step(k_eff)
                nsteps += 1
                gen += n
                pending += n
                wait = t_due - time.monotonic()
                if dec.left > 0 and wait < SLICE_S and first_at is not None:
                    continue
                if wait > 0:
                    time.sleep(wait)
                if first_at is None:
                    first_at = time.monotonic()
                if emit is not None:
                    emit(pending, dec.left == 0)
                pending = 0
        finally:
            with engine["lock"]:
                engine["running"] -= 1
            metrics.inc("vllm:num_requests_running", -1)
        if getattr(st, "decode_w", None) is not None:  # the torch engine (issue 55): the steps run for real
            try:
                os.write(st.decode_w, b"steps %d %d\n" % (max(1, nsteps), 1 + k))
            except OSError:
                pass
        spec = (dec.drafts, dec.accepted, dec.per_pos, dec.draft_tokens) if k else None
        t_end = time.monotonic()
        ttft = (first_at or t_end) - t_req
        metrics.record_request(prompt_tokens, gen, "length", spec)
        metrics.observe_latency(ttft, (t_end - t_req - ttft) / max(gen - 1, 1), gen, t_end - t_req)
        stats.add(prompt_tokens, gen, spec[:3] if spec else None)
        return gen, spec

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, fmt, *a):
            pass

        def _access(self, code):
            if args.disable_uvicorn_access_log:
                return
            phrase = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                      405: "Method Not Allowed", 500: "Internal Server Error",
                      503: "Service Unavailable"}.get(code, "")
            _uv(f'{self.client_address[0]}:{self.client_address[1]} - "{self.command} {self.path} '
                f'HTTP/1.1" {code} {phrase}')

        def _send(self, code, body=b"", ctype="application/json"):
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            elif isinstance(body, str):
                body = body.encode()
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self._access(code)

        def _error(self, code, message, etype):
            # vLLM 0.32.0's ErrorResponse (real, issue 25): {"error": {message, type, param, code}}
            self._send(code, {"error": {"message": message, "type": etype, "param": None, "code": code}})

        def _authorized(self):
            if not api_keys or not self.path.startswith("/v1"):
                return True
            auth = self.headers.get("Authorization", "")
            if auth.startswith("Bearer ") and auth[7:] in api_keys:
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if not self._authorized():
                return
            if path == "/health":
                self._send(503 if st.dead else 200, b"", "application/json")
            elif path == "/ping":
                self._send(503 if st.dead else 200, b"", "application/json")
            elif path == "/version":
                self._send(200, {"version": ctx["version_string"]})
            elif path == "/metrics":
                self._send(200, metrics.render(), metrics.content_type)
            elif path == "/v1/models":
                data = [{"id": n, "object": "model", "created": created, "owned_by": "vllm", "root": ctx["model"],
                         "parent": None, "max_model_len": max_len,
                         "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                         "created": created, "allow_create_engine": False,
                                         "allow_sampling": True, "allow_logprobs": True,
                                         "allow_search_indices": False, "allow_view": True,
                                         "allow_fine_tuning": False, "organization": "*", "group": None,
                                         "is_blocking": False}]} for n in served]
                self._send(200, {"object": "list", "data": data})
            elif path in ("/v1/completions", "/v1/chat/completions"):
                self._send(405, {"detail": "Method Not Allowed"})
            else:
                self._send(404, {"detail": "Not Found"})

        do_HEAD = do_GET

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized():
                return
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, {"detail": "Not Found"})
                return
            try:
                req = json.loads(raw or b"{}")
                if not isinstance(req, dict):
                    raise ValueError("body must be an object")
            except ValueError as e:
                self._error(400, f"JSON decode error: {e}", "BadRequestError")
                return
            model = req.get("model") or served[0]
            if model not in served:
                # vLLM 0.32.0 (real, issue 25) names the served names
                self._error(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
                            "NotFoundError")
                return
            if st.dead:
                self._error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                            "InternalServerError")
                return
            chat = path.endswith("chat/completions")
            if chat:
                msgs = req.get("messages")
                if not isinstance(msgs, list) or not msgs:
                    self._error(400, "messages must be a non-empty list", "BadRequestError")
                    return
                prompt = "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in msgs)
            else:
                prompt = req.get("prompt")
                if prompt is None:
                    self._error(400, "prompt is required", "BadRequestError")
                    return
                if isinstance(prompt, list):
                    prompt = " ".join(str(p) for p in prompt)
                prompt = str(prompt)
            prompt_tokens = max(1, (len(prompt) + 3) // 4)
            mt = req.get("max_completion_tokens") if chat else None
            mt = mt if mt is not None else req.get("max_tokens")
            if mt is None:
                mt = 16 if not chat else min(256, max(1, max_len - prompt_tokens))
            try:
                mt = int(mt)
            except (TypeError, ValueError):
                self._error(400, "max_tokens must be an integer", "BadRequestError")
                return
            if mt < 1:
                self._error(400, f"max_tokens must be at least 1, got {mt}.", "BadRequestError")
                return
            if prompt_tokens + mt > max_len:
                self._error(400, f"This model's maximum context length is {max_len} tokens. However, you "
                                 f"requested {prompt_tokens + mt} tokens ({prompt_tokens} in the messages, {mt} "
                                 f"in the completion). Please reduce the length of the messages or completion.",
                            "BadRequestError")
                return
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            now = int(time.time())
            words = [WORDS[(i * 7 + len(prompt)) % len(WORDS)] for i in range(mt)]
            if req.get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream; charset=utf-8")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                sent = [0]

                def emit(n, last):  # one event per paced slice of steps: the tokens they produced
                    self._chunk(rid, now, model, chat, "".join(words[sent[0]:sent[0] + n]), sent[0] == 0, last)
                    sent[0] += n
            else:
                emit = None
            gen, spec = decode(prompt, prompt_tokens, mt, emit)
            text = "".join(words[:gen])
            usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + gen,
                     "completion_tokens": gen, "prompt_tokens_details": None}
            if req.get("stream"):
                self._stream_end(rid, now, model, chat, usage, req)
                return
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                  "annotations": None, "audio": None, "function_call": None,
                                                  "tool_calls": [], "reasoning_content": None},
                          "logprobs": None, "finish_reason": "length", "stop_reason": None}
                body = {"id": rid, "object": "chat.completion", "created": now, "model": model,
                        "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage,
                        "prompt_logprobs": None, "kv_transfer_params": None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                          "stop_reason": None, "prompt_logprobs": None}
                body = {"id": rid, "object": "text_completion", "created": now, "model": model,
                        "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage,
                        "kv_transfer_params": None}
            self._send(200, body)

        def _chunk(self, rid, now, model, chat, piece, first, last):
            obj = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                ch = {"index": 0, "delta": ({"role": "assistant", "content": piece} if first else {"content": piece}),
                      "logprobs": None, "finish_reason": "length" if last else None}
            else:
                ch = {"index": 0, "text": piece, "logprobs": None, "finish_reason": "length" if last else None,
                      "stop_reason": None}
            chunk = {"id": rid, "object": obj, "created": now, "model": model, "choices": [ch]}
            try:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            except OSError:
                pass

        def _stream_end(self, rid, now, model, chat, usage, req):
            obj = "chat.completion.chunk" if chat else "text_completion"
            try:
                if (req.get("stream_options") or {}).get("include_usage"):
                    chunk = {"id": rid, "object": obj, "created": now, "model": model, "choices": [],
                             "usage": usage}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:
                pass
            self._access(200)

    host = args.host or "0.0.0.0"
    logs.info("api_server.py:1880", f"Starting vLLM server on http://{host}:{args.port}")
    logs.info("launcher.py:34", "Available routes are:")
    for route, methods in (("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/health", "GET"),
                           ("/ping", "POST, GET"), ("/version", "GET"), ("/v1/models", "GET"),
                           ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/metrics", "GET")):
        logs.info("launcher.py:42", f"Route: {route}, Methods: {methods}")
    try:
        httpd = Server(sock, Handler)
    except OSError as e:
        logs.raw(logs.traceback_text([(f"{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}/entrypoints/"
                                       f"openai/api_server.py", 1990, "serve_http", "sock.listen()")],
                                     f"OSError: [Errno {e.errno}] {e.strerror}"), fd=2)
        st.shutting_down = True
        try:
            os.kill(st.engine_pid, signal.SIGTERM)
            os.waitpid(st.engine_pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        return 1
    _uv(f"Started server process [{os.getpid()}]")
    _uv("Waiting for application startup.")
    _uv("Application startup complete.")
    t_http = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 1.0}, daemon=True)
    t_http.start()

    # ---- engine monitor: EngineCore death -> /health 503 for ~1 s, then exit 0 (as vLLM does)
    def monitor():
        try:
            os.waitpid(st.engine_pid, 0)
        except ChildProcessError:
            pass
        engine_gone.set()
        if st.shutting_down:
            return
        st.dead = True
        logs.error("core_client.py:564", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
        time.sleep(1.0)
        logs.error("async_llm.py:480", "AsyncLLM output_handler failed.")
        logs.raw("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
                 "(above) for the root cause.", fd=2)
        exit_code["code"] = 0
        stop.set()

    threading.Thread(target=monitor, daemon=True).start()

    # ---- periodic stats lines
    interval = float(os.environ.get("VPD_FAKE_VLLM_STATS_INTERVAL") or 10.0)

    def stats_loop():
        last = time.time()
        while not stop.wait(interval):
            now = time.time()
            dt = max(1e-6, now - last)
            last = now
            reqs, prompt, gen, drafts, accepted, per_pos = stats.take()
            if args.disable_log_stats or reqs == 0:
                continue
            logs.info("loggers.py:127", f"Engine 000: Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
                                        f"Avg generation throughput: {gen / dt:.1f} tokens/s, Running: 0 reqs, "
                                        f"Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
            if k:
                drafted = drafts * k
                mal = 1 + accepted / drafts if drafts else float("nan")
                rates = ", ".join(f"{(c / drafts if drafts else float('nan')):.3f}" for c in per_pos)
                avg = accepted / drafted * 100 if drafted else float("nan")
                logs.info("metrics.py:96", f"SpecDecoding metrics: Mean acceptance length: {mal:.2f}, "
                                           f"Accepted throughput: {accepted / dt:.2f} tokens/s, "
                                           f"Drafted throughput: {drafted / dt:.2f} tokens/s, "
                                           f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                                           f"Per-position acceptance rate: {rates}, "
                                           f"Avg Draft acceptance rate: {avg:.1f}%")

    threading.Thread(target=stats_loop, daemon=True).start()

    def on_term(signum, frame):
        if not st.dead:
            st.shutting_down = True
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stop.wait(5.0):
        pass

    # ---- shutdown
    if not st.dead:
        st.shutting_down = True
    logs.info("launcher.py:99", "Shutting down FastAPI HTTP server.")
    try:
        httpd.shutdown()
        httpd.server_close()
    except Exception:
        pass
    if not engine_gone.is_set():
        try:
            os.kill(st.engine_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not engine_gone.wait(5.0):
            try:
                os.kill(st.engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            engine_gone.wait(2.0)
    _uv("Shutting down")
    _uv("Waiting for application shutdown.")
    _uv("Application shutdown complete.")
    logs.flush_std()
    return exit_code["code"]
