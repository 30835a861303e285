"""`deploy compare A B`: which speculative method serves faster here, answered with numbers.

On one container, one after the other: bring each playbook up with its own gates (the fallback is off: the
playbook itself is measured, or it failed), send the same prompts, and measure output tokens per second from the
completion responses' usage and the wall time of each request, and draft acceptance from /metrics deltas. The
winner (or --keep) is left running.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from orchestrator.deploy import ops
from orchestrator.steps import plan as P
from orchestrator.core import vllm_facts as vf
from orchestrator.core.errors import DeployError, UsageError
from orchestrator.core.report import Progress
from orchestrator.core.spec import Playbook


def check_pair(a: Playbook, b: Playbook) -> None:
    if a.name == b.name:
        raise UsageError(f"compare needs two different playbooks, got {a.name} twice",
                         fix="deploy compare qwen36-dflash qwen36-mtp")
    if (a.host, a.vmid) != (b.host, b.vmid):
        raise UsageError(f"{a.name} targets {a.host}/{a.vmid} but {b.name} targets {b.host}/{b.vmid}; compare runs "
                         "both on one container, one after the other",
                         fix="point both playbooks' target at the same host and vmid")


def read_prompts(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            prompts = [ln.strip() for ln in fh if ln.strip()]
    except OSError as e:
        raise UsageError(f"cannot read --prompts {path}: {e.strerror}", fix="one prompt per line") from None
    if not prompts:
        raise UsageError(f"--prompts {path} has no prompts", fix="one prompt per line")
    return prompts


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None without values."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def level_figures(lv: dict) -> dict:
    """One concurrency level's figures: throughput (all output tokens / the level's wall time), TTFT and ITL
    p50/p99 in ms, acceptance from the /metrics delta."""
    reqs = lv["requests"]
    ms = lambda x: round(x * 1000, 2) if x is not None else None  # noqa: E731
    acc = vf.acceptance_from_metrics(lv["before"], lv["after"])
    tokens = sum(r["tokens"] for r in reqs)
    per = [r["tokens"] / r["seconds"] for r in reqs if r.get("seconds")]
    # the noise of the level's figure: the relative standard error of the requests' own tokens/s (deploy tune)
    rse = (statistics.stdev(per) / statistics.fmean(per) / len(per) ** 0.5) if len(per) > 1 and any(per) else None
    return {"concurrency": lv["concurrency"], "requests": len(reqs), "failed": lv.get("failed", 0),
            "output_tokens": tokens, "wall_s": lv["wall_s"],
            "tokens_per_s": round(tokens / lv["wall_s"], 2) if lv["wall_s"] and tokens else None,
            "tokens_per_s_rse": round(rse, 4) if rse is not None else None,
            "ttft_ms_p50": ms(percentile([r["ttft"] for r in reqs], 50)),
            "ttft_ms_p99": ms(percentile([r["ttft"] for r in reqs], 99)),
            "itl_ms_p50": ms(percentile([r["itl"] for r in reqs], 50)),
            "itl_ms_p99": ms(percentile([r["itl"] for r in reqs], 99)),
            "acceptance_length": round(acc.mean_acceptance_length, 3)
            if acc is not None and acc.draft_tokens and acc.mean_acceptance_length is not None else None,
            "draft_acceptance": round(acc.draft_acceptance, 4)
            if acc is not None and acc.draft_tokens and acc.draft_acceptance is not None else None,
            "errors": lv.get("errors", [])}


def summarize(requests: list[dict]) -> dict:
    """Output tokens/s: overall (all tokens / all request time) and per request (mean, median)."""
    per = [r["tokens"] / r["seconds"] for r in requests if r["seconds"] > 0]
    total_t = sum(r["seconds"] for r in requests)
    return {"requests": len(requests), "output_tokens": sum(r["tokens"] for r in requests),
            "tokens_per_s": round(sum(r["tokens"] for r in requests) / total_t, 2) if total_t else None,
            "tokens_per_s_mean": round(statistics.fmean(per), 2) if per else None,
            "tokens_per_s_median": round(statistics.median(per), 2) if per else None}


def pick_winner(results: list[dict]) -> dict | None:
    measured = [r for r in results if r["ok"] and r.get("speed", {}).get("tokens_per_s")]
    return max(measured, key=lambda r: r["speed"]["tokens_per_s"]) if measured else None


def _bring_up(fleet, pb: Playbook, progress: Progress, opts: ops.Options) -> ops.Outcome:
    """With its fallback off: compare measures this playbook, or reports that it failed."""
    return ops.up(fleet, pb.variant(), progress, dataclasses.replace(opts, yes=True))


def _measure(fleet, pb: Playbook, progress: Progress, step: P.Step) -> dict:
    """The sweep: per level figures; `speed` (the first level's requests, as sequential compare had it) and
    `acceptance` (over every level) for the side-by-side table."""
    ctx = ops.new_context(fleet, pb, progress)
    t0 = time.monotonic()
    api_key = ctx.secrets.get("VLLM_API_KEY")
    r = ctx.call(step, secrets={"api_key": api_key} if api_key else None).as_dict()  # ProbeResult, checked
    if not r.get("ok") or not r.get("levels") or not r["levels"][0]["requests"]:
        errs = [e for lv in r.get("levels") or [] for e in lv.get("errors", [])]
        ctx.fail("sweep", t0, f"could not measure: {r.get('message') or errs}", fix=f"deploy logs {pb.name}")
    levels = [level_figures(lv) for lv in r["levels"]]
    first = r["levels"][0]
    acc = vf.acceptance_from_metrics(first["before"], r["levels"][-1]["after"])
    speed = summarize(first["requests"])
    errors = [e for lv in levels for e in lv["errors"]][:5]
    ctx.record("sweep", True, "; ".join(f"c={lv['concurrency']}: {lv['tokens_per_s']} tok/s" for lv in levels)
               + (f", {sum(lv['failed'] for lv in levels)} failed" if errors else ""), t0)
    return {"speed": speed, "levels": levels,
            "acceptance": acc.as_dict() if acc is not None and acc.draft_tokens else None,
            "errors": errors, "seconds": round(time.monotonic() - t0, 2)}


def level_winners(results: list[dict]) -> list[dict]:
    """Per concurrency level: each playbook's tokens/s and the faster one (DFlash and MTP can swap with batch)."""
    measured = [r for r in results if r["ok"] and r.get("levels")]
    out = []
    for i, lv in enumerate(measured[0]["levels"] if measured else []):
        tps = {r["playbook"]: r["levels"][i]["tokens_per_s"] for r in measured if len(r["levels"]) > i}
        ok = {k: v for k, v in tps.items() if v}
        win = max(ok, key=ok.get) if ok else None
        others = [v for k, v in ok.items() if k != win]
        out.append({"concurrency": lv["concurrency"], "tokens_per_s": tps, "winner": win,
                    "speedup": round(ok[win] / max(others), 3) if win and others else None})
    return out


def label(pb: Playbook) -> str:
    """The name a result row shows: the playbook's, `NAME (no speculation)` for the baseline of --baseline."""
    return f"{pb.name} (no speculation)" if pb.spec_off else pb.name


def compare(fleet, a: Playbook, b: Playbook, progress: Progress, opts: ops.Options, *, prompts: list[str],
            rounds: int, max_tokens: int, timeout_s: float, keep: str | None = None,
            levels: list[int]) -> dict:
    results = []
    for pb in (a, b):
        method = "none" if pb.spec_off else pb.conf.speculative.method
        progress.say(f"{pb.host}/{pb.vmid}", f"compare: bringing up {label(pb)} ({method})")
        out = _bring_up(fleet, pb, progress, opts)
        row = {"playbook": label(pb), "method": method, "ok": out.ok, "status": out.status,
               "error": out.error.as_dict() if out.error else None,
               "gate_acceptance": out.info.get("acceptance")}
        if out.ok:
            try:
                row.update(_measure(fleet, pb, progress, P.step_sweep(pb, prompts, rounds, max_tokens,
                                                                      timeout_s * len(levels), list(levels))))
            except DeployError as e:
                row.update(ok=False, error=e.as_dict())
        results.append(row)
    winner = pick_winner(results)
    keep_name = keep or (winner["playbook"] if winner else None)
    kept = None
    if keep_name:
        if keep_name != results[-1]["playbook"] or not results[-1]["ok"]:
            pb = a if keep_name == label(a) else b
            progress.say(f"{pb.host}/{pb.vmid}", f"compare: leaving {label(pb)} running")
            out = _bring_up(fleet, pb, progress, opts)
            kept = {"playbook": label(pb), "ok": out.ok, "status": out.status,
                    "error": out.error.as_dict() if out.error else None}
        else:
            kept = {"playbook": keep_name, "ok": True, "status": "up", "error": None}
    ratio = None
    if winner and all(r.get("speed", {}).get("tokens_per_s") for r in results):
        other = next(r for r in results if r is not winner)
        ratio = round(winner["speed"]["tokens_per_s"] / other["speed"]["tokens_per_s"], 3)
    return {"ok": bool(winner) and bool(kept and kept["ok"]), "target": f"{a.host}/{a.vmid}",
            "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens, "concurrency": list(levels),
            "levels": level_winners(results), "results": results,
            "winner": winner["playbook"] if winner else None, "speedup": ratio, "kept": kept}


def render(res: dict) -> list[str]:
    """The side-by-side table, then the verdict; nothing cut."""
    rows = [("", [r["playbook"] for r in res["results"]])]

    def col(f):
        return [f(r) for r in res["results"]]

    def acc(r, key, fmt):
        a = r.get("acceptance") or {}
        return fmt(a[key]) if a.get(key) is not None else "-"
    rows += [
        ("method", col(lambda r: r["method"])),
        ("status", col(lambda r: "measured" if r["ok"] else f"failed: {r['status']}")),
        ("output tokens/s", col(lambda r: str(r.get("speed", {}).get("tokens_per_s") or "-"))),
        ("  per request median", col(lambda r: str(r.get("speed", {}).get("tokens_per_s_median") or "-"))),
        ("draft acceptance", col(lambda r: acc(r, "draft_acceptance_rate", lambda v: f"{v:.1%}"))),
        ("mean acceptance length", col(lambda r: acc(r, "mean_acceptance_length", lambda v: f"{v:.2f}"))),
        ("per position", col(lambda r: acc(r, "per_position", lambda v: " ".join(f"{x:.2f}" for x in v[:6])
                                             + (" ..." if len(v) > 6 else "")))),
        ("requests", col(lambda r: f"{r.get('speed', {}).get('requests', 0)}/{res['prompts'] * res['rounds']}")),
    ]
    def lv(r, i, key, fmt=str):
        levels = r.get("levels") or []
        return fmt(levels[i][key]) if len(levels) > i and levels[i].get(key) is not None else "-"
    for i, c in enumerate(res.get("concurrency") or []):
        rows += [
            (f"concurrency {c}: tokens/s", col(lambda r: lv(r, i, "tokens_per_s"))),
            ("  TTFT p50/p99 ms", col(lambda r: f"{lv(r, i, 'ttft_ms_p50')}/{lv(r, i, 'ttft_ms_p99')}")),
            ("  ITL p50/p99 ms", col(lambda r: f"{lv(r, i, 'itl_ms_p50')}/{lv(r, i, 'itl_ms_p99')}")),
            ("  acceptance length", col(lambda r: lv(r, i, "acceptance_length", lambda v: f"{v:.2f}"))),
        ]
    w0 = max(len(k) for k, _ in rows)
    w = [max(len(v[i]) for _, v in rows) for i in range(len(res["results"]))]
    lines = ["  ".join([k.ljust(w0)] + [v[i].ljust(w[i]) for i in range(len(v))]).rstrip() for k, v in rows]
    for r in res["results"]:
        if r.get("error"):
            lines.append(f"{r['playbook']}: {r['error'].get('message')}"
                         + (f"\n  fix: {r['error']['fix']}" if r["error"].get("fix") else ""))
    for lvw in res.get("levels") or []:
        lines.append(f"concurrency {lvw['concurrency']}: "
                     + (f"{lvw['winner']} wins" + (f" ({lvw['speedup']:.2f}x)" if lvw["speedup"] else "")
                        if lvw["winner"] else "no winner"))
    lines += chart(res)
    if res["winner"]:
        lines.append(f"winner: {res['winner']}"
                     + (f" ({res['speedup']:.2f}x the output tokens/s)" if res["speedup"] else " (the only one measured)"))
    else:
        lines.append("no winner: neither playbook passed its gates and was measured")
    k = res["kept"]
    if k:
        lines.append(f"left running on {res['target']}: {k['playbook']}" if k["ok"] else
                     f"could not leave {k['playbook']} running on {res['target']}: {(k['error'] or {}).get('message')}")
    return lines


def chart(res: dict, width: int = 40) -> list[str]:
    """Tokens/s per concurrency level as horizontal bars, one per playbook (a terminal chart)."""
    levels = res.get("levels") or []
    order = [r["playbook"] for r in res["results"]]
    return bars(levels, sorted(names_seen(levels), key=order.index), width)


def names_seen(levels: list[dict]) -> list[str]:
    """The configurations measured at any level, in the order first seen."""
    return list(dict.fromkeys(n for x in levels for n in x["tokens_per_s"]))


def bars(levels: list[dict], names: list[str], width: int = 40) -> list[str]:
    """compare's and tune's terminal chart: per level ({concurrency, tokens_per_s: {name: value}}) a bar per name,
    each name's mark in the order NAMES gives."""
    top = max((v for x in levels for v in x["tokens_per_s"].values() if v), default=0)
    if not top:
        return []
    marks = dict(zip(names, "#=*+o%@"))
    nw = max(len(n) for n in names)
    out = ["output tokens/s by concurrency (" + ", ".join(f"{marks.get(n, '.')} {n}" for n in names) + "):"]
    for x in levels:
        for n, v in x["tokens_per_s"].items():
            bar = marks.get(n, ".") * max(1, round(v / top * width)) if v else ""
            out.append(f"  {x['concurrency']:>4}  {n.ljust(nw)}  {bar} {v if v is not None else '-'}")
    return out


PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_plot(path: str) -> None:
    """--plot FILE: a suffix matplotlib writes, and matplotlib importable; a UsageError before anything runs."""
    if not path.lower().endswith(PLOT_SUFFIXES):
        raise UsageError(f"--plot {path}: the file name must end in {', '.join(PLOT_SUFFIXES)}",
                         fix="deploy compare A B --plot sweep.png")
    try:
        import matplotlib  # noqa: F401 - lazy: optional (the plot extra); only whether it imports
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         fix="pip install 'vllm-pve-deploy[plot]' (or pip install matplotlib)") from None
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UsageError(f"--plot {path}: directory {d} does not exist", fix="create it, or pick another path")


def plot(res: dict, path: str) -> str:
    """The sweep as a chart file (matplotlib, Agg: no display): tokens/s, TTFT and ITL p50/p99, acceptance length,
    each against concurrency, one line per playbook. Returns the path."""
    import matplotlib  # lazy: optional (the plot extra), ~0.5 s with pyplot

    matplotlib.use("Agg")  # before pyplot is imported
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [(axes[0][0], "output tokens/s", [("tokens_per_s", "-", "")]),
              (axes[0][1], "TTFT (ms)", [("ttft_ms_p50", "-", " p50"), ("ttft_ms_p99", "--", " p99")]),
              (axes[1][0], "inter-token latency (ms)", [("itl_ms_p50", "-", " p50"), ("itl_ms_p99", "--", " p99")]),
              (axes[1][1], "mean acceptance length", [("acceptance_length", "-", "")])]
    for ax, title, series in panels:
        for r in res["results"]:
            levels = r.get("levels") or []
            for key, style, suffix in series:
                pts = [(lv["concurrency"], lv[key]) for lv in levels if lv.get(key) is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            label=f"{r['playbook']} ({r['method']}){suffix}")
        concurrency_axes(ax, title, res.get("concurrency"))
    fig.suptitle(f"deploy compare on {res['target']}: " + " vs ".join(r["playbook"] for r in res["results"]))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def concurrency_axes(ax, title: str, levels) -> None:
    """One chart of compare's and tune's plots: concurrency on a log2 axis with a tick per measured level."""
    ax.set_title(title)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels or [1])
    ax.set_xticklabels([str(c) for c in levels or [1]])
    ax.set_xlabel("concurrent requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
