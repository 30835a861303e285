"""Replicas: a playbook with `targets:` (one replica per container, on one or more hosts).

Each target runs the single-target code path, `ops.up` / `ops.down`, on the member playbook of that target
(`Playbook.members`, built at validation): its own lock, verify, launch, readiness and acceptance gate. This
module only schedules them (in parallel, bounded; or rolling, a batch at a time), shares one SSH connection per
host between the targets on it (the `Fleet` of the invocation), keeps their progress lines whole, and sums up.
"""

from __future__ import annotations

import threading
import time

from orchestrator.deploy import ops
from orchestrator.serving import replica_router as R
from orchestrator.core.endpoint import router_endpoint
from orchestrator.core.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DeployError, Unreachable
from orchestrator.core.remote import Fleet
from orchestrator.core.report import Progress
from orchestrator.core.spec import Playbook

SCHEMA = "vllm-pve-deploy/fleet/v1"


class SharedProgress(Progress):
    """A Progress written by several threads (one per target): whole lines under a lock, each prefixed with its
    HOST/VMID (Progress.say does that), and no line rewritten in place (two targets would overwrite each other)."""

    INPLACE = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._lines = threading.RLock()

    def say(self, where: str, msg: str) -> None:
        with self._lines:
            super().say(where, msg)

    def waiting(self, where: str, key: str, msg: str) -> None:
        with self._lines:
            super().waiting(where, key, msg)


def where_of(pb: Playbook) -> str:
    return f"{pb.host}/{pb.vmid}"


def _guarded(fn, member: Playbook) -> ops.Outcome:
    """One target's outcome, whatever happens in its thread: an error that escapes ops is that target's failure
    (never a thread dying silently)."""
    try:
        return fn(member)
    except DeployError as e:
        e.where = e.where or where_of(member)
        return ops.Outcome(False, member.name, where_of(member), "failed", error=e)
    except Exception as e:  # noqa: BLE001 - a bug must still be that target's row, with what it was
        return ops.Outcome(False, member.name, where_of(member), "failed",
                           error=DeployError(f"internal error: {type(e).__name__}: {e}", where=where_of(member),
                                             fix="the audit log (~/.local/state/vllm-pve-deploy/audit.jsonl) has "
                                                 "every command that ran; please report this"))


def run_each(members: list[Playbook], fn, parallel: int | None) -> list[ops.Outcome]:
    """fn(member) -> Outcome for every member, at most `parallel` at a time (None: all at once); in target order.
    Each call is bounded by its own steps' deadlines (ops). Ctrl-C ends the wait: the targets still running
    become `interrupted` outcomes that say what may be left (their threads end with the process)."""
    if len(members) == 1:
        return [_guarded(fn, members[0])]
    slots = threading.BoundedSemaphore(min(parallel or len(members), len(members)))
    outs: list = [None] * len(members)
    started = [False] * len(members)
    done = [threading.Event() for _ in members]

    def work(i, m):
        with slots:
            started[i] = True
            outs[i] = _guarded(fn, m)
        done[i].set()

    threads = [threading.Thread(target=work, args=(i, m), daemon=True, name=f"target-{where_of(m)}")
               for i, m in enumerate(members)]
    for t in threads:
        t.start()
    try:
        for ev in done:
            ev.wait()
    except KeyboardInterrupt:
        for i, m in enumerate(members):
            if outs[i] is None:
                w = where_of(m)
                msg = ("interrupted during its run: a vLLM it may have launched keeps loading and is recorded in "
                       "the container's state file; its lock is freed at once for the next deploy from here (else "
                       "within a minute)" if started[i] else
                       "interrupted before its turn: nothing was started there")
                outs[i] = ops.Outcome(False, m.name, w, "interrupted", error=DeployError(
                    msg, where=w, fix=f"deploy status {w} shows what runs; deploy down {m.name} {w} stops it"))
    return outs


def _check_secrets(pb: Playbook) -> None:
    """The local secret variables are the same for every target: a missing one fails once, before any target."""
    ops.secrets_for(pb.members[0])


def up(fleet: Fleet, pb: Playbook, progress: Progress, opts: ops.Options, *, parallel: int | None = None,
       restart: bool = False) -> dict:
    """Every target up (or restarted), in parallel. -> the fleet result (see result())."""
    _check_secrets(pb)
    t0 = time.monotonic()
    warning = R.exposure_warning(pb)
    if warning:  # before anything runs, where it is read (issue 41); again in the router's result
        progress.say(pb.conf.router.where, "warning: " + warning)
    opts = ops.Options(**{**opts.__dict__, "confirm": None})  # no prompt from several threads: -y replaces
    outs = run_each(pb.members, lambda m: ops.up(fleet, m, progress, opts, restart=restart), parallel)
    res = result(pb, "restart" if restart else "up", outs, t0, parallel=parallel)
    if pb.conf.router:
        _router_up(fleet, pb, progress, res)
    return res


def _router_up(fleet: Fleet, pb: Playbook, progress: Progress, res: dict) -> None:
    """The router in front of the replicas that passed; its failure fails the whole (the replicas keep serving)."""
    passed = [m for m, o in zip(pb.members, res["_outcomes"]) if o is not None and o.ok]
    rr = R.up(fleet, pb, progress, passed)
    if rr.get("ok"):
        ep = router_endpoint(fleet.inventory, pb)
        rr.update(url=ep.get("url"), endpoint=ep)
    res["router"] = rr
    res["ok"] = res["ok"] and rr["ok"]


def rolling_restart(fleet: Fleet, pb: Playbook, progress: Progress, opts: ops.Options, *,
                    max_unavailable: int = 1) -> dict:
    """Restart the targets a batch of `max_unavailable` at a time, in playbook order; the next batch starts only
    when every target of this one has passed its gates, so the others keep serving. A failure stops the
    roll-out there: the targets after it are not touched (still on the old deployment)."""
    _check_secrets(pb)
    t0 = time.monotonic()
    opts = ops.Options(**{**opts.__dict__, "yes": True, "confirm": None})
    members = pb.members
    outs: list = [None] * len(members)
    drains = None
    if pb.conf.router:
        rv = R.view(fleet, pb)
        if rv.get("running"):
            drains = {}
        else:
            progress.say(pb.conf.router.where, f"router: {rv.get('state')}: the replicas restart without a drain "
                                      f"(deploy up {pb.name} starts the router)")
    for start in range(0, len(members), max_unavailable):
        batch = members[start:start + max_unavailable]
        if start:
            progress.say(pb.name, f"rolling restart: {', '.join(where_of(m) for m in members[:start])} passed; "
                                  f"next {', '.join(where_of(m) for m in batch)}")
        else:
            progress.say(pb.name, f"rolling restart of {len(members)} target(s), {max_unavailable} at a time: "
                                  f"first {', '.join(where_of(m) for m in batch)}")
        for i, o in enumerate(run_each(batch, lambda m: _rolled(fleet, pb, progress, opts, m, drains),
                                       len(batch)), start):
            outs[i] = o
        if not all(o.ok for o in outs[start:start + len(batch)]):
            break
    res = result(pb, "rolling restart", outs, t0, max_unavailable=max_unavailable)
    if drains is not None:
        res["router"] = {"where": pb.conf.router.where, "ok": all(d.get("ok") for d in drains.values()),
                         "mechanism": "vllm-router POST /remove_worker, then /add_worker after the gates",
                         "drains": drains}
        res["ok"] = res["ok"] and res["router"]["ok"]
    res["rollout"] = {"new": [where_of(m) for m, o in zip(members, outs) if o is not None and o.ok],
                      "failed": [where_of(m) for m, o in zip(members, outs) if o is not None and not o.ok],
                      "old": [where_of(m) for m, o in zip(members, outs) if o is None]}
    return res


def _rolled(fleet: Fleet, pb: Playbook, progress: Progress, opts: ops.Options, m: Playbook, drains) -> ops.Outcome:
    """One target of a rolling restart; with a running router: drained from it first, added back once it passed
    its gates (a target that failed stays out of the router)."""
    w = where_of(m)
    if drains is None:
        return ops.up(fleet, m, progress, opts, restart=True)
    try:
        d = R.drain(fleet, pb, progress, m)
    except DeployError as e:
        d = {"ok": False, "message": e.message}
    drains[w] = d
    if not d.get("ok"):
        progress.say(pb.conf.router.where, f"router: could not remove {w} ({d.get('message')}): restarting it anyway")
    o = ops.up(fleet, m, progress, opts, restart=True)
    if o.ok:
        try:
            a = R.add_back(fleet, pb, progress, m)
        except DeployError as e:
            a = {"ok": False, "message": e.message}
        d["added_back"] = a.get("ok")
        if not a.get("ok"):
            d.update(ok=False, message=a.get("message"))
            progress.say(pb.conf.router.where, f"router: could not add {w} back: {a.get('message')}")
    return o


def down(fleet: Fleet, pb: Playbook, progress: Progress, opts: ops.Options, *, only: str | None = None,
         parallel: int | None = None) -> dict:
    """Every target down (or only HOST/VMID), in parallel (parallel=1: one at a time, e.g. when each asks before
    killing GPU holders). With a router: all targets -> the router is stopped first; one target -> it is removed
    from the router first."""
    t0 = time.monotonic()
    members = [pb.member(only)] if only else pb.members
    rr = None
    if pb.conf.router:
        if only:
            try:
                rr = {"where": pb.conf.router.where, **R.drain(fleet, pb, progress, members[0])}
            except DeployError as e:
                rr = {"where": pb.conf.router.where, "ok": False, "message": e.message}
        else:
            rr = R.down(fleet, pb, progress)
    outs = run_each(members, lambda m: ops.down(fleet, m, progress, opts), parallel)
    res = result(pb, "down", outs, t0, members=members)
    if rr is not None:
        res["router"] = rr
        if rr.get("refused"):  # a router.json deploy may not use: the router may still run; never a silent 0
            res["ok"] = False
    return res


def result(pb: Playbook, action: str, outs: list, t0: float, members: list | None = None, **extra) -> dict:
    members = members or pb.members
    rows = []
    for m, o in zip(members, outs):
        row = {"where": where_of(m), "host": m.host, "vmid": m.vmid}
        row.update(o.as_dict() if o is not None else
                   {"ok": None, "status": "not restarted", "note": "still on the old deployment (not touched)"})
        rows.append({**row, "where": where_of(m)})  # the target's own where, not the outcome's
    ran = [o for o in outs if o is not None]
    return {"schema": SCHEMA, "ok": len(ran) == len(members) and all(o.ok for o in ran), "playbook": pb.name,
            "action": action, "seconds": round(time.monotonic() - t0, 2), **extra,
            "passed": sum(1 for o in ran if o.ok), "total": len(members),
            "failed": [r["where"] for r in rows if r["ok"] is False], "targets": rows, "_outcomes": outs}


def exit_code(res: dict) -> int:
    """0 every target passed; 3 every failure was an unreachable host; else 1."""
    if res["ok"]:
        return EXIT_OK
    errs = [o.error for o in res["_outcomes"] if o is not None and not o.ok]
    if any(o is not None and o.status == "interrupted" for o in res["_outcomes"]):
        return 130  # Ctrl-C (errors.EXIT_INTERRUPTED)
    if errs and all(isinstance(e, Unreachable) for e in errs):
        return EXIT_UNREACHABLE
    return EXIT_FAILED


def as_json(res: dict) -> dict:
    out = {k: v for k, v in res.items() if not k.startswith("_")}
    if isinstance(out.get("router"), dict):
        out["router"] = {k: (v.message if isinstance(v, DeployError) else v) for k, v in out["router"].items()}
    return out


def router_lines(res: dict) -> list[str]:
    rr = res.get("router")
    if not rr:
        return []
    w = rr.get("where")
    w = f" {w}" if w and w != "router" else ""  # never `router router:` (issue 53)
    if res["action"] == "down":
        return [f"router{w}: " + ("stopped" if rr.get("stopped") else "removed from it first" if rr.get("url") else
                                   "nothing was running" if rr.get("ok") else f"NOT stopped: {rr.get('message')}")]
    if res["action"] == "rolling restart":
        d = rr.get("drains") or {}
        if not rr.get("ok"):
            bad = [f"{k}: {v.get('message')}" for k, v in d.items() if not v.get("ok")]
            return [f"router{w}: drained each target first; FAILED for " + "; ".join(bad)]
        return [f"router{w}: each target was removed from the router before its restart and added back after its "
                f"gates ({len(d)} drained)"]
    if rr.get("ok"):
        g = rr.get("gate") or {}
        per = g.get("per_replica") or {}
        counts = [(per.get(u) or {}).get("requests") for u in rr.get("workers") or []]
        spread = "/".join(str(c) for c in counts)
        served = sum(c for c in counts if isinstance(c, (int, float)))
        # the spread is each replica's request counter over the gate: other clients' requests count too (issue 53)
        others = f" (the replicas served {served:g} meanwhile: other clients' requests included)" \
            if isinstance(g.get("sent"), int) and served > g["sent"] else ""
        return [f"router{w}: {'already up' if rr.get('status') == 'already up' else 'up'} at "
                f"{rr.get('url') or 'port %s (address unknown)' % rr.get('port')}, policy {rr.get('policy')}, "
                f"{len(rr.get('workers') or [])} replica(s); gate: {g.get('succeeded')} of {g.get('sent')} "
                f"completions through it, spread {spread}{others}"]
    return [f"router{w}: FAILED: {rr.get('message')}",
            "  the replicas that passed keep serving on their own addresses (deploy status shows them)"]


def summary_line(row: dict, outcome) -> str:
    """One line per target: where, its status, and the one fact that matters (acceptance, or what failed)."""
    where = row["where"]
    if outcome is None:
        return f"{where:<14} not restarted  still on the old deployment (the roll-out stopped before it)"
    st = outcome.status
    i = outcome.info or {}
    if outcome.ok:
        if st == "up":
            a = i.get("acceptance") or {}
            return (f"{where:<14} up             draft acceptance {a.get('draft_acceptance_rate', 0):.1%}, mean "
                    f"acceptance length {a.get('mean_acceptance_length', 0):.2f}; {i.get('total_s')}s")
        if st == "already up":
            return f"{where:<14} already up     pid {i.get('pid')}: nothing changed"
        if st == "down":
            stopped = i.get("stopped") or []
            return f"{where:<14} down           stopped {len(stopped)} process(es); GPUs proven free"
        return f"{where:<14} {st}"
    err = outcome.error
    if st == "fell back" and outcome.fallback is not None:
        fb = outcome.fallback
        return (f"{where:<14} FELL BACK      low acceptance; {'serving' if fb.ok else 'FAILED to bring up'} the "
                f"fallback {fb.playbook}")
    step = getattr(err, "step", "") if err is not None else ""
    msg = (err.message.splitlines()[0] if err is not None and err.message else st)
    kind = "UNREACHABLE" if isinstance(err, Unreachable) else "INTERRUPTED" if st == "interrupted" else "FAILED"
    return f"{where:<14} {kind:<14} {step + ': ' if step else ''}{msg}"


def render(res: dict) -> list[str]:
    """The summary: one line per target, then the totals (and for a rolling restart, who is on what)."""
    lines = [summary_line(r, o) for r, o in zip(res["targets"], res["_outcomes"])]
    verb = {"up": "up", "restart": "restarted", "rolling restart": "restarted", "down": "down",
            "apply-config": "with the pinned config, verified"}[res["action"]]
    total = f"{res['playbook']}: {res['passed']} of {res['total']} target(s) {verb}"
    if res["failed"]:
        total += f"; FAILED: {', '.join(res['failed'])}"
    lines.append(total + f" ({res['seconds']}s)")
    lines += router_lines(res)
    ro = res.get("rollout")
    if ro is not None and not res["ok"]:
        lines.append("rolling restart stopped at " + ", ".join(ro["failed"]) + ":")
        lines.append("  on the new deployment:            " + (", ".join(ro["new"]) or "none"))
        lines.append("  failed (see its state left above): " + ", ".join(ro["failed"]))
        lines.append("  still on the old deployment:       " + (", ".join(ro["old"]) or "none"))
        lines.append(f"  fix: correct what failed (above), then deploy restart {res['playbook']} --rolling again "
                     "(it restarts every target, one batch at a time, the ones already new included)")
    return lines


__all__ = ["SharedProgress", "up", "rolling_restart", "down", "result", "render", "exit_code", "as_json"]
