"""`deploy status`'s text: the table, the endpoints, a replica playbook's totals and router, the --watch
sparklines. Rows in, text out (status.py gathers the rows: status/v1).
"""

from __future__ import annotations

import re

from orchestrator.core.report import own, table, wrap
from orchestrator.core.spec_schema import NAME as _PLAYBOOK_NAME  # the playbook-name grammar
from orchestrator.core.spec import list_playbooks, load_playbook

NO_RUNTIME = "no vLLM runtime"  # a row's `process` when the inventory gives no vLLM runtime (status/v1)


def render_endpoints(rows) -> str:
    """Where each running deployment answers (after the table): URL, tunnel, or why it is unknown."""
    from orchestrator.core.endpoint import describe  # lazy: gather warms it while the agents run (warm_when_connected), ~2 ms

    lines = [f"  {r['host']}/{r['vmid']}: {describe(r['_endpoint'])}" for r in rows if r.get("_endpoint")]
    text = "\n\nEndpoints:\n" + "\n".join(lines) if lines else ""
    none = [f"{r['host']}/{r['vmid']}" for r in rows if r["process"] == NO_RUNTIME]
    if none:
        text += (f"\n\n{NO_RUNTIME} (nothing of vLLM expected there; healthy): {', '.join(none)}"
                 f"\n  (deploy discover HOST --write records a runtime when there is one)")
    return text


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def acceptance_cell(acc: dict | None) -> str:
    """ACCEPT/LEN: lifetime rate/mean length (recent rate); `no drafts yet` before the first draft."""
    acc = acc or {}
    life = acc.get("lifetime") or {}
    rec = acc.get("recent") or {}
    if not acc:
        return "-"
    if not life or life.get("draft_acceptance_rate") is None or not life.get("drafts", 1):
        return "no drafts yet"
    s = f"{_pct(life.get('draft_acceptance_rate'))}/{life.get('mean_acceptance_length') or 0:.1f}"
    if rec and rec.get("draft_acceptance_rate") is not None:
        s += f" ({_pct(rec['draft_acceptance_rate'])})"
    return s


def render_table(rows, color: bool, width: int | None = None) -> str:
    """The status table; problems under it, whole (wrapped at `width` on a TTY, never cut)."""
    out = []
    for r in rows:
        gpus = _gpu_cell(r["gpus"])
        drift = "-" if not r.get("drafter") else ("DRIFT" if r["drafter"]["drift"] else "ok")
        state = state_word(r)
        up = "-" if r.get("uptime_s") is None else _dur(r["uptime_s"])
        out.append([f"{r['host']}/{r['vmid']}", state, r.get("playbook") or "-", r["process"],
                    str(r.get("health") or "-"), r.get("method") or "-", acceptance_cell(r.get("acceptance")),
                    drift, gpus, up])
    text = table(out, ["CONTAINER", "STATE", "PLAYBOOK", "VLLM", "HTTP", "METHOD", "ACCEPT/LEN", "DRAFTER",
                       "GPU MEM", "UP"], width=width)
    probs = [f"  {r['host']}/{r['vmid']}: {p}" for r in rows for p in r["problems"]]
    probs += [f"  {r['host']}/{r['vmid']}: last error: {r['last_error']}" for r in rows if r.get("last_error")]
    notes = [f"  {r['host']}/{r['vmid']}: {n}" for r in rows for n in r.get("notes") or []]
    if notes:
        text += "\n\nSupervision:\n" + "\n".join(wrap(n, width, indent=4) for n in notes)
    tuned = [f"  {r['host']}/{r['vmid']}: {r['tune']['text']}" for r in rows if r.get("tune")]
    if tuned:
        text += "\n\nSpeculation (deploy tune):\n" + "\n".join(wrap(t, width, indent=4) for t in tuned)
    weights = [f"  {r['host']}/{r['vmid']}: {weights_text(r['weights'])}" for r in rows if r.get("weights")]
    if weights:
        text += "\n\nWeights (fetched and verified by deploy fetch):\n" + "\n".join(wrap(w, width, indent=4)
                                                                                  for w in weights)
    if probs:
        text += "\n\nProblems:\n" + "\n".join(wrap(p, width, indent=4) for p in probs)
    if color:
        text = text.replace("UNHEALTHY", own("\x1b[31mUNHEALTHY\x1b[0m")).replace(
            "UNREACHABLE", own("\x1b[31;1mUNREACHABLE\x1b[0m")).replace(
            "TIMEOUT", own("\x1b[31;1mTIMEOUT\x1b[0m")).replace("DRIFT", own("\x1b[33mDRIFT\x1b[0m"))
    return text


def weights_text(ws: list) -> str:
    """`model acme/X@main (f1b5dbdd0103) at /root/models/X; drafter ...`: the revisions serving."""
    return "; ".join(f"{w.get('role')} {w.get('hub') or w.get('source') or 'files'}@"
                     + ((w.get("commit") or "")[:12] if not w.get("revision") or w["revision"] == w.get("commit")
                        else f"{w['revision']} ({(w.get('commit') or '')[:12]})") + f" at {w.get('dest')}"
                     + (f" (shared store {w['source'][6:]} on the host, read-only)"
                        if str(w.get("source") or "").startswith("store:") else "")
                     + (" WARNING: a privileged container (root in it is the host's uid 0): it can remount the "
                        "store read-write and change what every container of the host serves"
                        if w.get("privileged_container") is True and str(w.get("source") or "").startswith("store:")
                        else "")
                     for w in ws)


def state_word(r: dict) -> str:
    if r["healthy"]:
        return "ok"
    if not r["reachable"]:
        return "TIMEOUT" if r.get("timed_out") else "UNREACHABLE"
    return "UNHEALTHY"


def _gpu_cell(gpus: list) -> str:
    """'4x 72/80G' when every GPU reads the same, else 'idx:usedG' per GPU."""
    if not gpus:
        return "-"
    cells = {(round(g["used_mib"] / 1024), round(g["total_mib"] / 1024)) for g in gpus}
    if len(cells) == 1:
        u, t = cells.pop()
        return f"{len(gpus)}x {u}/{t}G"
    return " ".join(f"{g['index']}:{g['used_mib'] / 1024:.0f}G" for g in gpus)


def _dur(s: float) -> str:
    s = int(s)
    return f"{s // 86400}d{s % 86400 // 3600}h" if s >= 86400 else f"{s // 3600}h{s % 3600 // 60}m" if s >= 3600 \
        else f"{s // 60}m{s % 60}s"


def render_totals(t: dict) -> str:
    s = f"{t['playbook']}: serving {t['serving']} of {t['total']}"
    if t["not_serving"]:
        s += f" (not serving: {', '.join(t['not_serving'])})"
    if t["mean_draft_acceptance"] is not None:
        s += (f"; mean draft acceptance {t['mean_draft_acceptance']:.1%}, mean acceptance length "
              f"{t['mean_acceptance_length'] or 0:.2f} (over {t['acceptance_over']})")
    else:
        s += "; mean acceptance: - (" + ("nothing serving" if not t["serving"] else "no serving target has drafted yet") + ")"
    return s


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list, lo: float | None = None, hi: float | None = None) -> str:
    """One block character per value, scaled between lo and hi (default: the values' own range); `·` for none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "·" * len(values)
    lo = min(vals) if lo is None else min(lo, min(vals))
    hi = max(vals) if hi is None else max(hi, max(vals))
    span = hi - lo
    return "".join("·" if v is None else SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))
                                                if span > 0 else len(SPARKS) // 2] for v in values)


def gate_of(inv, name: str | None, cache: dict) -> dict | None:
    """The gate's thresholds of the playbook a row says runs there (None when it cannot be loaded)."""
    # the name comes from the container's state: a name in the spec's playbook-name grammar, looked up only
    # among the user's own playbooks, never a path (a FIFO or /dev/tty there would block the watch; issue 36 item 6)
    if not isinstance(name, str) or not re.fullmatch(_PLAYBOOK_NAME["pattern"], name):
        return None
    if name not in cache:
        try:
            from orchestrator.observe.monitor import gate_thresholds  # lazy: --watch only, ~4 ms (monitor's own module body)

            cache[name] = gate_thresholds(load_playbook(name, inv)) if name in set(list_playbooks()) else None
        except Exception:  # noqa: BLE001 - a playbook renamed or gone: no threshold shown, nothing fails
            cache[name] = None
    return cache[name]


def render_history(rows, inv, cache: dict) -> str:
    """Per deployment: recent acceptance length and tokens/s as sparklines (oldest left), the latest values and
    the gate's threshold; what `deploy status --watch` shows under the table."""
    lines = []
    for r in rows:
        h = r.get("history") or []
        if not r.get("playbook") or not r.get("acceptance"):
            continue
        g = gate_of(inv, r.get("playbook"), cache)
        als, tps = [x.get("al") for x in h], [x.get("tps") for x in h]
        last_al = next((v for v in reversed(als) if v is not None), None)
        last_tps = next((v for v in reversed(tps) if v is not None), None)
        where = f"{r['host']}/{r['vmid']}"
        if not h:
            lines.append(f"  {where} {r['playbook']}: history starts at the next refresh")
            continue
        gate = ""
        if g:
            verdict = "" if last_al is None else (" ok" if last_al >= g["min_al"] else " UNDER THE GATE")
            gate = f" (gate >= {g['min_al']:g}{verdict})"
        lines.append(f"  {where} {r['playbook']}: AL {sparkline(als, lo=1.0)} "
                     f"{'-' if last_al is None else f'{last_al:.2f}'}{gate}   tok/s {sparkline(tps, lo=0.0)} "
                     f"{'-' if last_tps is None else f'{last_tps:g}'}")
    if not lines:
        return ""
    span = ""
    ts = [x["t"] for r in rows for x in (r.get("history") or [])]
    if ts:
        span = f", {len(max((r.get('history') or [] for r in rows), key=len))} refreshes over " \
               f"{max(ts) - min(ts):.0f}s"
    return "\nRecent (per refresh, oldest left" + span + "):\n" + "\n".join(lines)


def render_router(rv: dict) -> str:
    head = f"router {rv['where']} ({rv['playbook']}): "
    if not rv.get("running"):
        return head + f"{rv.get('state')}" + (f": {rv['message']}" if rv.get("message") else "") + \
            f" (deploy up {rv['playbook']} starts it)"
    ws = rv.get("workers") or []
    lines = [head + f"{rv.get('state')}, policy {rv.get('policy')}, port {rv.get('port')}, "
                    f"{sum(1 for w in ws if w.get('healthy'))} of {len(ws)} replica(s) healthy in its view"
             + (f", {rv['url']}" if rv.get("url") else "") + (f"; {rv['error']}" if rv.get("error") else "")]
    for w in ws:
        lines.append(f"  {w['url']:<32} {'healthy' if w.get('healthy') else 'UNHEALTHY (sent nothing)'}")
    for f in rv.get("flags") or []:
        lines.append(f"  ! {f}")
    return "\n".join(lines)
