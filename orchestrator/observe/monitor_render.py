"""`deploy monitor render`: a picture of the Grafana dashboard `deploy monitor export` writes, without Grafana.
Each panel's target expressions run against Prometheus' HTTP API (/api/v1/query_range) and matplotlib draws the
panels where their gridPos puts them (Grafana's 24-column grid), with titles, units, legends from legendFormat and
"No data" where a query returns nothing. See docs/monitoring.md ("A picture of the dashboard").

Grafana's variables: the dashboard's own (host, playbook, ...) match everything (`.*`, under =~) unless --var sets
them; $__rate_interval is Grafana's max($__interval + scrape interval, 4 x scrape interval); $__interval is the
step; $__range the span.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.error
from datetime import datetime, timezone
import urllib.parse
import urllib.request

from orchestrator.core.errors import DeployError, Unreachable, UsageError

SUFFIXES = (".png", ".svg", ".pdf")
LEGEND_MAX = 6  # legend entries under a panel (2 rows of 3); the rest are counted
QUERY_TIMEOUT_S = 15.0  # per query_range request
MAX_POINTS = 11000  # Prometheus refuses more than 11,000 points per series: the step is raised to stay under
_DUR = re.compile(r"([0-9]+)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(text: str, what: str) -> float:
    """A Prometheus duration (15m, 1h30m, 30s) or plain seconds -> seconds; UsageError otherwise."""
    t = (text or "").strip()
    try:
        v = float(t)
        if v > 0 and math.isfinite(v):
            return v
    except ValueError:
        pass
    if t and _DUR.sub("", t) == "" and sum(1 for _ in _DUR.finditer(t)):
        v = sum(int(n) * _UNIT_S[u] for n, u in _DUR.findall(t))
        if v > 0:
            return float(v)
    raise UsageError(f"{what} {text!r} is not a duration such as 30s, 15m or 1h (or a number of seconds)")


def prom_duration(s: float) -> str:
    """Seconds -> a Prometheus duration (whole seconds, at least 1s)."""
    return f"{max(1, int(round(s)))}s"


def load_dashboard(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            dash = json.load(fh)
    except OSError as e:
        raise UsageError(f"cannot read the dashboard {path}: {e.strerror}",
                         fix="deploy monitor export DIR writes DIR/dashboard.json") from None
    except ValueError as e:
        raise UsageError(f"{path} is not JSON: {e}", fix="deploy monitor export DIR writes DIR/dashboard.json") from None
    panels = dash.get("panels") if isinstance(dash, dict) else None
    if not isinstance(panels, list) or not any(isinstance(p, dict) and p.get("targets") for p in panels):
        raise UsageError(f"{path} has no panels with targets: not a Grafana dashboard JSON",
                         fix="deploy monitor export DIR writes DIR/dashboard.json")
    return dash


def check_out(path: str) -> str:
    """--out FILE: a suffix matplotlib writes, in a directory that exists, matplotlib importable."""
    if not path.lower().endswith(SUFFIXES):
        raise UsageError(f"--out {path}: the picture's format comes from its suffix: {', '.join(SUFFIXES)}")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UsageError(f"--out {path}: the directory {d} does not exist")
    try:
        import matplotlib  # noqa: F401 - lazy: optional (the plot extra); only whether it imports
    except ImportError:
        raise UsageError("deploy monitor render needs matplotlib, which is not installed",
                         fix="pip install 'vllm-pve-deploy[plot]' (or pip install matplotlib)") from None
    return path


def check_url(url: str) -> str:
    u = urllib.parse.urlsplit(url or "")
    if u.scheme not in ("http", "https") or not u.netloc:
        raise UsageError(f"--prometheus {url!r} is not an http(s) URL", fix="e.g. --prometheus http://127.0.0.1:9090")
    return url.rstrip("/")


def substitute(expr: str, variables: dict, *, step: float, span: float, scrape: float) -> str:
    """Grafana's variables in an expression: $__rate_interval, $__interval, $__range, then the dashboard's own
    ($name, ${name}, [[name]]) from `variables`."""
    rate = max(step + scrape, 4 * scrape)
    builtin = {"__rate_interval": prom_duration(rate), "__interval": prom_duration(step),
               "__range": prom_duration(span), "__interval_ms": str(int(step * 1000))}
    allv = {**variables, **builtin}

    def sub(m):
        name = m.group(1) or m.group(2) or m.group(3)
        return allv.get(name, m.group(0))
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}|\$([A-Za-z_][A-Za-z0-9_]*)|\[\[([A-Za-z_]\w*)\]\]",
                  sub, expr)


def variables_of(dash: dict, given: dict) -> dict:
    """Every templating variable of the dashboard -> its value: --var NAME=VALUE, else `.*` (all)."""
    return {**{v["name"]: ".*" for v in (dash.get("templating") or {}).get("list") or []
               if isinstance(v, dict) and isinstance(v.get("name"), str)}, **given}


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list:
    """Prometheus' /api/v1/query_range -> result (a matrix); raises _QueryError with what Prometheus answered,
    Unreachable when it does not answer."""
    qs = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    url = f"{base}/api/v1/query_range?{qs}"
    try:
        with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as r:
            body = r.read()
    except urllib.error.HTTPError as e:  # 400/422/503: Prometheus says why in its JSON body
        body = e.read()
        try:
            doc = json.loads(body)
            raise _QueryError(f"HTTP {e.code}: {doc.get('errorType')}: {doc.get('error')}") from None
        except ValueError:
            raise _QueryError(f"HTTP {e.code}: {body[:300].decode('utf-8', 'replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise Unreachable(f"Prometheus at {base} does not answer: {reason}",
                          fix="check --prometheus (its address and port) and that Prometheus runs") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise _QueryError(f"not JSON: {body[:300].decode('utf-8', 'replace')}") from None
    if doc.get("status") != "success":
        raise _QueryError(f"{doc.get('errorType')}: {doc.get('error')}")
    data = doc.get("data") or {}
    if data.get("resultType") != "matrix":
        raise _QueryError(f"resultType {data.get('resultType')!r}, expected a matrix")
    return data.get("result") or []


class _QueryError(Exception):
    pass


def legend(fmt: str | None, metric: dict) -> str:
    """Grafana's legendFormat: {{label}} from the series' labels; without one, the label set."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", lambda m: str(metric.get(m.group(1), "")), fmt).strip()
    name = metric.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest or not name else name


def fetch(dash: dict, base: str, *, since: float, step: float | None, scrape: float, variables: dict,
          end: float | None = None) -> dict:
    """Run every panel's queries. -> {start, end, step, panels: [{id, title, unit, gridPos, series: [{legend, t,
    v}], errors: [{expr, error}]}]}. Unreachable when Prometheus does not answer at all."""
    end = time.time() if end is None else end
    start = end - since
    step = max(step or max(1.0, since / 240), since / MAX_POINTS)
    out = []
    for p in dash.get("panels") or []:
        if not isinstance(p, dict) or p.get("type") == "row" or not p.get("targets"):
            continue
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit") or "none"
        panel = {"id": p.get("id"), "title": str(p.get("title") or f"panel {p.get('id')}"), "unit": unit,
                 "gridPos": p.get("gridPos") or {}, "series": [], "errors": []}
        for t in p["targets"]:
            if not isinstance(t, dict) or not t.get("expr") or t.get("hide"):
                continue
            expr = substitute(t["expr"], variables, step=step, span=since, scrape=scrape)
            try:
                result = query_range(base, expr, start, end, step)
            except _QueryError as e:
                panel["errors"].append({"expr": expr, "error": str(e)})
                continue
            found = []
            for s in result:
                pts = [(float(ts), float(v)) for ts, v in s.get("values") or []]
                found.append({"legend": legend(t.get("legendFormat"), s.get("metric") or {}),
                              "t": [a for a, _ in pts], "v": [b for _, b in pts]})
            # a target's series in natural order of their legends (pos 2 before pos 10)
            panel["series"] += sorted(found, key=lambda x: [(0, int(w)) if w.isdigit() else (1, w)
                                                            for w in re.split(r"(\d+)", x["legend"])])
        out.append(panel)
    return {"start": start, "end": end, "step": step, "panels": out}


def _formatter(unit: str):
    from matplotlib.ticker import EngFormatter, PercentFormatter, ScalarFormatter  # lazy: optional, ~0.5 s

    if unit == "percentunit":
        return PercentFormatter(1.0, decimals=0)
    if unit == "percent":
        return PercentFormatter(100.0, decimals=0)
    if unit in ("s", "ms"):
        return EngFormatter(unit="s" if unit == "s" else "ms", sep="")
    return ScalarFormatter(useOffset=False)


def draw(data: dict, title: str, out: str, *, subtitle: str = "") -> None:
    """The panels on Grafana's 24-column grid (gridPos; one grid row = 30 px there), one picture."""
    import matplotlib  # lazy: optional (the plot extra), ~0.5 s with pyplot

    matplotlib.use("Agg")  # before pyplot is imported
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    panels = data["panels"]
    rows = max((int((p["gridPos"].get("y") or 0)) + int(p["gridPos"].get("h") or 8)) for p in panels)
    row_in, head_in = 0.36, 0.85  # inches per grid row; the title above the panels
    fig = plt.figure(figsize=(16, rows * row_in + head_in), dpi=90)
    fw, fh = fig.get_figwidth(), fig.get_figheight()
    left, right, top = 0.55 / fw, 1 - 0.15 / fw, 1 - head_in / fh
    cw, rh = (right - left) / 24, (top - 0.05 / fh) / rows
    fig.suptitle(title, x=left, y=1 - 0.12 / fh, ha="left", va="top", fontsize=14, fontweight="bold")
    if subtitle:
        fig.text(left, 1 - 0.5 / fh, subtitle, ha="left", va="top", fontsize=9, color="#555")
    tz = timezone.utc
    for p in panels:
        g = p["gridPos"]
        x, y, w, h = (int(g.get(k) or d) for k, d in (("x", 0), ("y", 0), ("w", 12), ("h", 8)))
        w = min(24 - x, w)
        # inside its cell: room for the title above, the ticks and the legend below, the y labels left
        pad_l, pad_r, pad_t, pad_b = 0.5 / fw, 0.12 / fw, 0.32 / fh, 0.95 / fh
        ax = fig.add_axes((left + x * cw + pad_l, top - (y + h) * rh + pad_b,
                           w * cw - pad_l - pad_r, h * rh - pad_t - pad_b))
        ax.set_title(p["title"], loc="left", fontsize=10, fontweight="bold")
        ax.grid(True, color="#ddd", linewidth=0.6)
        ax.set_xlim(datetime.fromtimestamp(data["start"], tz), datetime.fromtimestamp(data["end"], tz))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if data["end"] - data["start"] <= 900
                                                          else "%H:%M", tz=tz))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=4, maxticks=8, tz=tz))
        ax.tick_params(labelsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        if p["errors"]:
            msg = "query failed: " + p["errors"][0]["error"]
            ax.text(0.5, 0.5, msg[:90] + ("..." if len(msg) > 90 else ""), transform=ax.transAxes, ha="center",
                    va="center", color="#b00", fontsize=9, wrap=True)
        if not any(s["t"] for s in p["series"]):
            if not p["errors"]:
                ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="#888",
                        fontsize=12)
            ax.set_yticks([])
            continue
        lines = []
        for s in p["series"]:
            ts = [datetime.fromtimestamp(t, tz) for t in s["t"]]
            lines += ax.plot(ts, s["v"], linewidth=1.4, label=s["legend"] or "-")
        ax.yaxis.set_major_formatter(_formatter(p["unit"]))
        finite = [v for s in p["series"] for v in s["v"] if math.isfinite(v)]
        if finite and min(finite) >= 0:
            ax.set_ylim(bottom=0, top=max(finite) * 1.08 if max(finite) > 0 else 1)
        # the legend below the panel: as many entries as fit in 2 rows of 3, then "+N more" (Grafana scrolls)
        shown = lines if len(lines) <= LEGEND_MAX else lines[:LEGEND_MAX - 1]
        labels = [ln.get_label() for ln in shown]
        if len(lines) > len(shown):
            from matplotlib.lines import Line2D  # lazy: optional (the plot extra)
            shown = shown + [Line2D([], [], linestyle="none")]
            labels.append(f"+{len(lines) - len(labels)} more series")
        ax.legend(shown, labels, loc="upper left", bbox_to_anchor=(0, -0.2 / (ax.get_position().height * fh)), ncol=3, fontsize=7.5, frameon=False,
                  handlelength=1.5, borderaxespad=0.2)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def render(dashboard_path: str, prometheus: str, out: str, *, since: float = 900, step: float | None = None,
           scrape: float = 15, variables: dict | None = None, end: float | None = None) -> dict:
    """Fetch and draw. -> a summary {out, panels, no_data, failed, series}; the picture is written even when
    some query failed (that panel says so); the caller decides the exit code from `failed`."""
    dash = load_dashboard(dashboard_path)
    base = check_url(prometheus)
    check_out(out)
    data = fetch(dash, base, since=since, step=step, scrape=scrape, variables=variables_of(dash, variables or {}),
                 end=end)
    span = f"last {prom_duration(since)}, step {prom_duration(data['step'])}"
    sub = (f"rendered by deploy monitor render from {os.path.basename(dashboard_path)}'s queries against "
           f"{base} ({span}, up to "
           f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(data['end']))})")
    draw(data, str(dash.get("title") or "dashboard"), out, subtitle=sub)
    with open(out, "rb") as fh:
        head = fh.read(16)
    if out.lower().endswith(".png") and not head.startswith(b"\x89PNG\r\n\x1a\n"):
        raise DeployError(f"{out}: written, but it does not start with the PNG signature", where=out)
    panels = data["panels"]
    return {"out": os.path.abspath(out), "bytes": os.path.getsize(out), "start": data["start"], "end": data["end"],
            "step": data["step"], "panels": [p["title"] for p in panels],
            "series": sum(len(p["series"]) for p in panels),
            "no_data": [p["title"] for p in panels if not any(s["t"] for s in p["series"]) and not p["errors"]],
            "failed": [{"panel": p["title"], **e} for p in panels for e in p["errors"]]}
