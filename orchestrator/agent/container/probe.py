"""`acceptance` and `sweep`: scrape /metrics, send the probe prompts (the sweep's streamed and timed, for `deploy
compare` and `tune`), scrape again; the tool computes the deltas."""

import json
import re
import socket
import threading

from .core import emit, now
from .files import tail_file
from .net import HTTP_MAX_BYTES, http, listener_check, serving_host
from .protocol import M_DRAFTS
from .state import read_state
from . import core


def _target(a):
    """What every probe starts with: the port, the API key, the host the server listens on (from the state) and
    the deadline; with an API key, the listener on the port must be ours first (the key goes to no stranger).
    Returns ((port, api_key, host, deadline), None), or ((None,) * 4, the failed answer)."""
    port, api_key = int(a["port"]), core.SECRETS.get("api_key")
    state = read_state(a["state_dir"]) if a.get("state_dir") else None
    host = serving_host(state)
    if api_key:
        ok, problem = listener_check(state, port)
        if not ok:
            return (None,) * 4, {"ok": False, "message": problem}
    return (port, api_key, host, now() + float(a["timeout_s"])), None


def _scrape(port, host, when=""):
    """GET /metrics: (text, None), or (None, the failed answer naming `when` -- e.g. " after the probe")."""
    st, text = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return None, {"ok": False, "message": "GET /metrics%s: %s %s" % (when, st, text[:200])}
    return text, None


def _target_scraped(a):
    """_target, then /metrics before the workload: ((port, api_key, host, deadline), the text, None), or
    (..., None, the failed answer)."""
    t, failed = _target(a)
    if failed:
        return t, None, failed
    before, failed = _scrape(t[0], t[2])
    return t, before, failed


def _completion(a, prompt):
    """The body of one probe request: greedy, `max_tokens` long."""
    return {"model": a["model"], "prompt": prompt, "max_tokens": int(a["max_tokens"]), "temperature": 0}


def act_acceptance(a):
    """Scrape /metrics, send the probe workload, scrape again; the caller computes the deltas."""
    (port, api_key, host, deadline), before, failed = _target_scraped(a)
    if failed:
        return failed
    sent = ok = 0
    errors = []
    rounds, planned = 0, int(a["rounds"])
    max_rounds, min_drafts = max(planned, int(a.get("max_rounds") or planned)), int(a.get("min_drafts") or 0)
    while rounds < max_rounds and now() < deadline:
        if rounds >= planned:  # the planned rounds are done: more only while the drafts are too few to judge
            st, after = http(port, "/metrics", timeout=10, host=host)
            drafts = drafts_total(after) - drafts_total(before) if st == 200 else None
            if drafts is None or drafts >= min_drafts:
                break
            emit(event="probe_extended", drafts=drafts, rounds=rounds)
        rounds += 1
        for prompt in a["prompts"]:
            if now() >= deadline:
                break
            sent += 1
            st, body = http(port, "/v1/completions", "POST", _completion(a, prompt),
                            timeout=max(1.0, deadline - now()), api_key=api_key, host=host)
            if st == 200:
                ok += 1
            else:
                errors.append("%s %s" % (st, body[:200]))
    after, failed = _scrape(port, host, " after the probe")
    if failed:
        return failed
    return {"ok": True, "before": before, "after": after, "sent": sent, "succeeded": ok, "errors": errors[:5],
            "rounds": rounds, "log_tail": tail_file(a.get("log_path"), 200) if a.get("log_path") else []}


DRAFTS_LINE = re.compile("^" + re.escape(M_DRAFTS) + r"(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.M)


def drafts_total(text):
    """Sum of vllm:spec_decode_num_drafts over its engine labels (the probe's own stop rule; the tool parses the
    whole exposition with prometheus_client)."""
    tot = 0.0
    for m in DRAFTS_LINE.finditer(text or ""):
        try:
            tot += float(m.group(1))
        except ValueError:
            pass
    return tot


def stream_timed(port, body, timeout, api_key=None, host="127.0.0.1"):
    """One streamed completion, timed: {tokens, seconds, ttft, itl} or {"error"}. TTFT is the time to the first
    `data:` event, ITL the mean gap between the first and the last event per later token; tokens from the final
    usage event (stream_options.include_usage)."""
    data = json.dumps(dict(body, stream=True, stream_options={"include_usage": True})).encode()
    head = ["POST /v1/completions HTTP/1.0", "Host: %s:%d" % (host, port), "Connection: close",
            "Content-Length: %d" % len(data), "Content-Type: application/json"]
    if api_key:
        head.append("Authorization: Bearer " + api_key)
    t0 = now()
    deadline = t0 + timeout
    first = last = None
    buf = b""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            while True:
                left = deadline - now()
                if left <= 0:
                    return {"error": "no complete answer within %gs" % timeout}
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > HTTP_MAX_BYTES:
                    return {"error": "answer larger than %d bytes" % HTTP_MAX_BYTES}
                body_part = buf.partition(b"\r\n\r\n")[2]
                if b"data: {" in chunk or (first is None and b"data: {" in body_part):
                    t = now()
                    if first is None:
                        first = t
                    last = t
        finally:
            sock.close()
    except OSError as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    header, _sep, payload = buf.partition(b"\r\n\r\n")
    status = header.split(b" ", 2)[1] if header.startswith(b"HTTP/") else b"?"
    if status != b"200":
        return {"error": "%s %s" % (status.decode("latin-1"), payload[:200].decode("utf-8", "replace"))}
    tokens = None
    for line in payload.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            try:
                u = json.loads(line[6:]).get("usage")
                if u:
                    tokens = int(u["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                pass
    if tokens is None or first is None:
        return {"error": "no usage in the stream"}
    return {"tokens": tokens, "seconds": round(last - t0, 6), "ttft": round(first - t0, 6),
            "itl": round((last - first) / (tokens - 1), 6) if tokens > 1 else None}


def act_sweep(a):
    """`deploy compare --concurrency`: for each level, /metrics before, `level` clients sending the prompts
    (streamed, each request timed) until each has sent its share, /metrics after."""
    (port, api_key, host, deadline), failed = _target(a)
    if failed:
        return failed
    prompts, levels = list(a["prompts"]), [int(x) for x in a["levels"]]
    out = []
    for level in levels:
        before, failed = _scrape(port, host)
        if failed:
            return failed
        n = max(level, len(prompts)) * int(a["rounds"])
        jobs = list(range(n))
        lock = threading.Lock()
        requests, errors = [], []

        def worker():
            while True:
                with lock:
                    if not jobs:
                        return
                    i = jobs.pop()
                if now() >= deadline:
                    with lock:
                        errors.append("time limit of %ss reached" % a["timeout_s"])
                    return
                r = stream_timed(port, _completion(a, prompts[i % len(prompts)]),
                                 max(1.0, deadline - now()), api_key, host)
                with lock:
                    (errors.append(r["error"]) if "error" in r else requests.append(r))
        t0 = now()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(level)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - now()) + 5)
        wall = now() - t0
        after, failed = _scrape(port, host, " after level %d" % level)
        if failed:
            return failed
        out.append({"concurrency": level, "wall_s": round(wall, 6), "before": before, "after": after,
                    "requests": requests, "errors": errors[:5], "failed": len(errors)})
    return {"ok": True, "levels": out}
