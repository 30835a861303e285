"""`deploy compare A B`: which speculative method serves faster here, answered with numbers.

On one container, one after the other: bring each playbook up with its own gates (the fallback is off: the
playbook itself is measured, or it failed), send the same prompts, and measure output tokens per second from the
completion responses' usage and the wall time of each request, and draft acceptance from /metrics deltas. The
winner (or --keep) is left running.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from . import ops
from . import plan as P
from . import vllm_facts as vf
from .errors import DeployError, UsageError
from .report import Progress
from .spec import Playbook


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


def step_speed(pb: Playbook, prompts: list[str], rounds: int, max_tokens: int, timeout_s: float) -> P.Step:
    return P.Step("speed", f"{len(prompts) * rounds} timed completions of {max_tokens} tokens; /metrics before and "
                           "after", action="speed",
                  args={"port": pb.serve["port"], "prompts": prompts, "rounds": rounds, "max_tokens": max_tokens,
                        "timeout_s": timeout_s, "model": pb.serve["served_model_name"],
                        "state_dir": pb.runtime["state_dir"]},
                  timeout=timeout_s + 30, host=pb.host, vmid=pb.vmid)


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


def _gated(pb: Playbook) -> Playbook:
    """The playbook with its fallback off: compare measures this playbook, or reports that it failed."""
    data = dict(pb.data, acceptance=dict(pb.data["acceptance"], on_low_acceptance="fail"))
    return dataclasses.replace(pb, data=data, fallback=None)


def _bring_up(fleet, pb: Playbook, progress: Progress, opts: ops.Options) -> ops.Outcome:
    return ops.up(fleet, _gated(pb), progress, dataclasses.replace(opts, yes=True))


def _measure(fleet, pb: Playbook, progress: Progress, step: P.Step) -> dict:
    ctx = ops.new_context(fleet, pb, progress)
    t0 = time.monotonic()
    api_key = ctx.secrets.get("VLLM_API_KEY")
    r = ctx.call(step, secrets={"api_key": api_key} if api_key else None)
    if not r.get("ok") or not r.get("requests"):
        ctx.fail("speed", t0, f"could not measure: {r.get('message') or r.get('errors')}",
                 fix=f"deploy logs {pb.name}")
    acc = vf.acceptance_from_metrics(r["before"], r["after"])
    speed = summarize(r["requests"])
    ctx.record("speed", True, f"{speed['tokens_per_s']} output tokens/s over {speed['requests']} requests"
               + (f", {len(r['errors'])} failed" if r["errors"] else ""), t0)
    return {"speed": speed, "acceptance": acc.as_dict() if acc is not None and acc.draft_tokens else None,
            "errors": r["errors"], "seconds": round(time.monotonic() - t0, 2)}


def compare(fleet, a: Playbook, b: Playbook, progress: Progress, opts: ops.Options, *, prompts: list[str],
            rounds: int, max_tokens: int, timeout_s: float, keep: str | None = None) -> dict:
    results = []
    for pb in (a, b):
        progress.say(f"{pb.host}/{pb.vmid}", f"compare: bringing up {pb.name} ({pb.spec['method']})")
        out = _bring_up(fleet, pb, progress, opts)
        row = {"playbook": pb.name, "method": pb.spec["method"], "ok": out.ok, "status": out.status,
               "error": out.error.as_dict() if out.error else None,
               "gate_acceptance": out.info.get("acceptance")}
        if out.ok:
            try:
                row.update(_measure(fleet, pb, progress, step_speed(pb, prompts, rounds, max_tokens, timeout_s)))
            except DeployError as e:
                row.update(ok=False, error=e.as_dict())
        results.append(row)
    winner = pick_winner(results)
    keep_name = keep or (winner["playbook"] if winner else None)
    kept = None
    if keep_name:
        if keep_name != results[-1]["playbook"] or not results[-1]["ok"]:
            pb = a if keep_name == a.name else b
            progress.say(f"{pb.host}/{pb.vmid}", f"compare: leaving {pb.name} running")
            out = _bring_up(fleet, pb, progress, opts)
            kept = {"playbook": pb.name, "ok": out.ok, "status": out.status,
                    "error": out.error.as_dict() if out.error else None}
        else:
            kept = {"playbook": keep_name, "ok": True, "status": "up", "error": None}
    ratio = None
    if winner and all(r.get("speed", {}).get("tokens_per_s") for r in results):
        other = next(r for r in results if r is not winner)
        ratio = round(winner["speed"]["tokens_per_s"] / other["speed"]["tokens_per_s"], 3)
    return {"ok": bool(winner) and bool(kept and kept["ok"]), "target": f"{a.host}/{a.vmid}",
            "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens, "results": results,
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
    w0 = max(len(k) for k, _ in rows)
    w = [max(len(v[i]) for _, v in rows) for i in range(len(res["results"]))]
    lines = ["  ".join([k.ljust(w0)] + [v[i].ljust(w[i]) for i in range(len(v))]).rstrip() for k, v in rows]
    for r in res["results"]:
        if r.get("error"):
            lines.append(f"{r['playbook']}: {r['error'].get('message')}"
                         + (f"\n  fix: {r['error']['fix']}" if r["error"].get("fix") else ""))
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
