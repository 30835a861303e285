"""`acceptance` and `speed`: scrape /metrics, send the probe prompts (timed, for `deploy compare`), scrape again;
the tool computes the deltas."""

import json

from .core import now
from .files import tail_file
from .net import http, listener_check, serving_host
from .state import read_state
from . import core


def act_acceptance(a):
    """Scrape /metrics, send the probe workload, scrape again; the caller computes the deltas."""
    port, api_key = int(a["port"]), core.SECRETS.get("api_key")
    state = read_state(a["state_dir"]) if a.get("state_dir") else None
    host = serving_host(state)
    if api_key:
        ok, problem = listener_check(state, port)
        if not ok:
            return {"ok": False, "message": problem}
    deadline = now() + float(a["timeout_s"])
    st, before = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics: %s %s" % (st, before[:200])}
    sent = ok = 0
    errors = []
    for _ in range(int(a["rounds"])):
        for prompt in a["prompts"]:
            if now() >= deadline:
                break
            sent += 1
            st, body = http(port, "/v1/completions", "POST",
                            {"model": a["model"], "prompt": prompt, "max_tokens": int(a["max_tokens"]),
                             "temperature": 0}, timeout=max(1.0, deadline - now()), api_key=api_key, host=host)
            if st == 200:
                ok += 1
            else:
                errors.append("%s %s" % (st, body[:200]))
    st, after = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics after the probe: %s %s" % (st, after[:200])}
    return {"ok": True, "before": before, "after": after, "sent": sent, "succeeded": ok, "errors": errors[:5],
            "log_tail": tail_file(a.get("log_path"), 200) if a.get("log_path") else []}


def act_speed(a):
    """`deploy compare`: the probe prompts, each request timed; /metrics scraped before and after.
    Output tokens come from each response's usage (what the server says it generated)."""
    port, api_key = int(a["port"]), core.SECRETS.get("api_key")
    state = read_state(a["state_dir"]) if a.get("state_dir") else None
    host = serving_host(state)
    if api_key:
        ok, problem = listener_check(state, port)
        if not ok:
            return {"ok": False, "message": problem}
    deadline = now() + float(a["timeout_s"])
    st, before = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics: %s %s" % (st, before[:200])}
    requests, errors = [], []
    for _ in range(int(a["rounds"])):
        for prompt in a["prompts"]:
            if now() >= deadline:
                errors.append("time limit of %ss reached" % a["timeout_s"])
                break
            t0 = now()
            st, body = http(port, "/v1/completions", "POST",
                            {"model": a["model"], "prompt": prompt, "max_tokens": int(a["max_tokens"]),
                             "temperature": 0}, timeout=max(1.0, deadline - now()), api_key=api_key, host=host)
            took = now() - t0
            try:
                tokens = int(json.loads(body)["usage"]["completion_tokens"]) if st == 200 else None
            except (ValueError, KeyError, TypeError):
                tokens = None
            if tokens is None:
                errors.append("%s %s" % (st, body[:200]))
                continue
            requests.append({"tokens": tokens, "seconds": round(took, 6)})
    st, after = http(port, "/metrics", timeout=10, host=host)
    if st != 200:
        return {"ok": False, "message": "GET /metrics after the requests: %s %s" % (st, after[:200])}
    return {"ok": True, "before": before, "after": after, "requests": requests, "errors": errors[:5]}
