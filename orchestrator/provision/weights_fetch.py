"""`deploy fetch`: the target model and the drafter at a pinned revision, fetched into the container and verified.

The download runs in the container, detached from the SSH session (a runner in its own session, started by the
agent's `fetch` action; progress in `<state_dir>/fetch.json`, its log in `<state_dir>/fetch-<id>.log`): a dropped
connection does not stop it, and the next `deploy fetch` (or `up`) re-attaches. Every file is verified against the
hub's record (sha256 for LFS files, the git blob id for the others) before anything is moved into place, and a
record of what was verified is kept in `<state_dir>/fetched/` (what `status`, `verify` and a re-run read).

This side: one `probe` (what is in place, what runs), then start or re-attach, then bounded `attach` calls that
print progress (bytes, rate, ETA per file and in total), then the report. `up` runs the same as its step `fetch`
when something is missing (`--no-fetch`: refuse instead).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from orchestrator.steps import plan as P
from orchestrator.provision import weights_store as S
from orchestrator.agent.container.weights import MANIFEST_FORMAT, MANIFEST_NAME
from orchestrator.core.atomic import write_atomic
from orchestrator.core.errors import StepFailed, Unreachable, UsageError
from orchestrator.provision.follow import Calls, Every, Job, follow, when as _when
from orchestrator.core.report import FOLLOW_LINE_MAX
from orchestrator.core.spec import Playbook


class FetchFailed(StepFailed):
    pass


class ConnectionLost(Unreachable):
    pass


def tokens(pb: Playbook, its: list[dict]) -> dict:
    """{"token:ROLE": value} from the LOCAL variables the playbook names; an unset one stops before any connection."""
    out = {}
    for it in its:
        var = it.get("token_env")
        if not var:
            continue
        val = os.environ.get(var)
        if not val:
            raise UsageError(f"{it['key']}.token_env names {var}, but it is not set in this shell; nothing was run",
                             where=pb.path,
                              fix=f"export {var}=hf_... (a read token of an account with access to {it['hub']}) "
                                  "before running deploy")
        out["token:" + it["role"]] = val
    return out


def refusal(pb: Playbook) -> UsageError | None:
    """Why deploy fetch (and its plan) cannot run for PB, or None."""
    if P.fetch_args(pb):
        return None
    return UsageError(f"{pb.name} names no source to fetch: model and speculative.drafter give only paths",
                      where=pb.path, fix="add model.hub + model.revision (or source: {path: HOST_DIR}) to the "
                                         "playbook (docs/playbooks.md#fetch-weights-from-the-hub-or-a-host-directory)")


def run(ctx, pb: Playbook, step: P.Step) -> dict:
    """The step fetch (plan.step_fetch: its items, its calls, and how to drive it): probe; re-attach, report, start
    or do nothing; follow to the end. Returns {status, records, items}; raises FetchFailed / ConnectionLost with what to
    do."""
    its, d, step_name = step.args["items"], step.drive, step.name
    allow_start, rehash, timeout_s = d["allow_start"], d["rehash"], d["timeout_s"]
    secrets = tokens(pb, its)
    red = getattr(ctx.session.audit, "redact", None)
    if red is not None:
        for v in secrets.values():
            red.add(v)
    t0 = time.monotonic()
    shared = [it for it in its if it.get("store")]
    r = Calls(ctx, step)
    if shared:  # once per host, into fetch.store; the container links to it (store.py)
        its = [it for it in its if not it.get("store")]
        got = S.fetch_shared(ctx, pb, r, shared, secrets, allow_start=allow_start, rehash=rehash, timeout_s=timeout_s,
                             step_name=step_name, follow=_follow, report=_report)
        if not its:
            ctx.record(step_name, True, got["summary"], t0, records=got["records"])
            # links made now are not "already fetched" (issue 53 item 14: prepare said so right after linking)
            status = "fetched" if got["downloaded"] else "linked" if got["linked"] else "already fetched"
            return {"status": status, "records": got["records"], "items": [], "rehashed": bool(rehash)}
        ctx.record(step_name + "-store", True, got["summary"], t0, records=got["records"])
    try:
        probe = r.call(step_name, 3600 if rehash else 60, items=its)
    except Unreachable as e:  # before anything started: the same advice as a drop while following
        raise ConnectionLost(f"lost the connection while reading what is in place ({e.message}); a fetch started "
                             "earlier goes on in the container", where=ctx.where,
                             fix=f"deploy fetch {pb.name} re-attaches to it (or starts it) and reports its result") from e
    if not probe.get("ok"):
        ctx.fail(step_name, t0, probe.get("message", "probe failed"))
    fst = probe.get("fetch") or {}
    places = probe.get("items") or []
    if fst.get("status") == "running":
        ctx.progress.say(ctx.where, f"a fetch is in progress (started {fst.get('elapsed', 0):.0f}s ago, pid "
                                    f"{fst.get('pid')}, phase {fst.get('phase')}): re-attaching")
        return _report(ctx, pb, _follow(ctx, r, pb, fst, timeout_s, step_name), step_name, t0)
    if fst.get("status") in ("ok", "failed", "timeout", "killed") and not fst.get("reported") \
            and _same_items(fst.get("items") or [], its):
        ctx.progress.say(ctx.where, f"the fetch started {fst.get('elapsed', 0):.0f}s ago ended while nobody was "
                                    "attached: its result")
        res = _follow(ctx, r, pb, fst, 60, step_name)
        if res["fetch"].get("status") != "ok" or not allow_start:
            return _report(ctx, pb, res, step_name, t0)
        probe = r.call(step_name, 60, items=its, rehash=False)
        places = probe.get("items") or []
    missing = [p for p in places if not p.get("in_place")]
    if not missing:
        recs = [p["record"] for p in places]
        ctx.record(step_name, True, "already fetched and verified: " + "; ".join(
            f"{p['role']} {_rev(p['record'])} at {p['dest']} (verified {_when(p['record'].get('verified_at'))})"
            for p in places) + ("; every file re-hashed" if rehash else "; nothing to do"), t0, records=recs)
        return {"status": "already fetched", "records": recs, "items": places, "rehashed": bool(rehash)}
    if not allow_start:
        ctx.fail(step_name, t0, "the weights are not in place: " + "; ".join(p.get("why") or p["dest"] for p in missing)
                 + " (--no-fetch: nothing was downloaded)",
                 fix=f"deploy fetch {pb.name} (or deploy up without --no-fetch, which fetches first)")
    for p in missing:
        ctx.progress.say(ctx.where, f"to fetch: {p['role']}: {p.get('why')}")
    want = {p["role"] for p in missing}
    start_items = [it for it in its if it["role"] in want]
    for it in start_items:
        if it.get("source_path"):
            _copy_from_host(ctx, pb, it)
    t1 = time.monotonic()
    try:
        started = r.call("fetch-start", secrets=secrets or None, items=start_items)
    except Unreachable as e:
        raise ConnectionLost(f"lost the connection while starting the fetch ({e.message}); it may have started in the "
                             "container", where=ctx.where,
                             fix=f"deploy fetch {pb.name} re-attaches to it (or starts it) and reports its result") from e
    if not started.get("ok"):
        ctx.fail(step_name, t1, started.get("message", "the fetch did not start"), fix=started.get("fix", ""))
    if not started.get("started"):
        fst = started.get("fetch") or {}
        ctx.progress.say(ctx.where, f"another fetch is in progress (pid {fst.get('pid')}): re-attaching to it")
    else:
        fst = {"id": started["id"], "pid": started["pid"], "log": started["log"]}
        ctx.progress.say(ctx.where, f"fetch started (runner pid {started['pid']}, detached; log {started['log']})")
    return _report(ctx, pb, _follow(ctx, r, pb, fst, timeout_s, step_name), step_name, t0)


def _same_items(a: list[dict], b: list[dict]) -> bool:
    key = lambda it: (it.get("role"), it.get("hub"), it.get("revision"), it.get("dest"), it.get("source_path"))  # noqa: E731
    return {key(x) for x in a} <= {key(x) for x in b}


def _copy_from_host(ctx, pb: Playbook, it: dict) -> None:
    """A directory on the Proxmox host into the container's incoming directory: one tar stream over the host's
    own pct exec (never through this workstation). Verified in the container against the manifest."""
    t0 = time.monotonic()
    src, inc = it["source_path"], it["incoming"]
    argv = P.copy_from_host_argv(pb.vmid, src, inc, getattr(ctx.session, "keep_env_supported", None) is not False)
    ctx.progress.say(ctx.where, f"copying {src} from {pb.host} into the container ({inc})")
    with ctx.progress.heartbeat(ctx.where, f"copy {src} into the container", 3600):
        res = ctx.session.run(argv, timeout=3600, vmid=pb.vmid)
    if res.exited != 0:
        err = (res.err or res.out).strip()
        fix = (f"put the files and {MANIFEST_NAME} in {src} on {pb.host} (deploy manifest DIR writes the manifest)"
               if res.exited in (3, 4) else "check the space in the container and the directory on the host")
        ctx.fail("fetch", t0, f"copying {src} from {pb.host} into container {pb.vmid} failed (exit {res.exited}): {err}",
                 fix=fix)
    ctx.progress.detail(ctx.where, f"copied {src} in {time.monotonic() - t0:.1f}s")


def _follow(ctx, r, pb: Playbook, fst: dict, timeout_s: float, step_name: str, attach: str = "fetch-attach") -> dict:
    """Follow the fetch runner to its end (follow.py: the loop shared with install-vllm)."""
    every = Every()

    def render(ev):
        if ev.get("kind") == "progress":
            return ("     " + progress_line(ev), True) if every.due() else None
        if ev.get("kind") == "line":
            line = str(ev.get("line") or "")[:FOLLOW_LINE_MAX]
            return ("     " + line[len("[deploy] "):], True) if line.startswith("[deploy]") else ("| " + line, False)
        return None

    job = Job("fetch", f"deploy fetch {pb.name}",
              failed=lambda msg, fix="": FetchFailed(step_name, msg, where=ctx.where, fix=fix),
              lost=lambda msg, fix="": ConnectionLost(msg, where=ctx.where, fix=fix))
    call = lambda pos, follow_s, on_event: r.call(  # noqa: E731 - the planned attach, from where the last one stopped
        attach, follow_s + 60, on_event, id=fst.get("id"), log_pos=pos, follow_s=follow_s)
    return follow(ctx, call, job, fst, limit_s=float(timeout_s) + 300.0, follow_s=P.FETCH_FOLLOW_S, render=render)


def _report(ctx, pb: Playbook, res: dict, step_name: str, t0: float) -> dict:
    fst = res.get("fetch") or {}
    status = fst.get("status")
    if status == "ok":
        ctx.record(step_name, True, fst.get("message", "fetched"), t0, records=fst.get("records"))
        return {"status": "fetched", "records": fst.get("records") or [], "items": fst.get("items")}
    msg = fst.get("message") or f"the fetch ended with status {status}"
    tail = [ln for ln in res.get("log_tail") or [] if ln.strip()]
    if tail and status in ("failed", "timeout", "killed") and fst.get("kind") in (None, "os"):
        msg += f"\n  last lines of {fst.get('log')}:\n" + "\n".join("    " + ln for ln in tail[-10:])
    details = {k: fst.get(k) for k in ("kind", "file", "expected", "found", "need", "free", "log") if fst.get(k)}
    ctx.fail(step_name, t0, msg, fix=fst.get("fix") or f"deploy fetch {pb.name}", **details)


def progress_line(ev: dict) -> str:
    f_pct = 100.0 * ev["file_bytes"] / ev["file_total"] if ev.get("file_total") else 100.0
    t_pct = 100.0 * ev["done"] / ev["total"] if ev.get("total") else 100.0
    return (f"{ev.get('role')} {ev.get('file')}: {size(ev['file_bytes'])} of {size(ev['file_total'])} ({f_pct:.0f}%), "
            f"{size(ev.get('file_rate') or 0)}/s, ETA {eta(ev.get('file_eta_s'))} | total {size(ev['done'])} of "
            f"{size(ev['total'])} ({t_pct:.0f}%), {size(ev.get('rate') or 0)}/s, ETA {eta(ev.get('eta_s'))}"
            + (f", {ev['connections']} connections" if (ev.get("connections") or 0) > 1 else ""))


def size(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def eta(s) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s}s" if s < 120 else f"{s // 60}m{s % 60:02d}s" if s < 7200 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _rev(rec: dict | None) -> str:
    if not rec:
        return "?"
    src = rec.get("hub") or rec.get("source") or "files"
    rev, commit = rec.get("revision"), rec.get("commit") or ""
    return f"{src}@{commit[:12]}" if not rev or rev == commit else f"{src}@{rev} ({commit[:12]})"


def revisions(recs: dict, dests: dict) -> dict:
    """{role: record or None} from the agent's fetch records and plan.step_revisions' {role: destination}."""
    return {role: _short(recs.get(dest)) for role, dest in dests.items()}


def _short(rec):
    if not rec:
        return None
    return {k: rec.get(k) for k in ("hub", "revision", "commit", "source", "dest", "verified_at", "files_n",
                                    "total_bytes", "store")}


# ---------------------------------------------------------------- manifests (offline sources)


def write_manifest(directory: str, hub: str | None = None, revision: str | None = None) -> dict:
    """deploy manifest DIR: every file of DIR (but the manifest) with its size and sha256, written as DIR's
    deploy-manifest.json. Copy DIR to the Proxmox host and name it in source: {path: ...}."""
    files = []
    for dp, dns, fns in os.walk(directory):
        dns[:] = sorted(d for d in dns if not d.startswith(".deploy"))
        for fn in sorted(fns):
            p = os.path.join(dp, fn)
            rel = os.path.relpath(p, directory)
            if rel == MANIFEST_NAME or os.path.islink(p) or fn.endswith(".incomplete"):
                continue
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            files.append({"name": rel, "size": os.path.getsize(p), "sha256": h.hexdigest()})
    m = {"format": MANIFEST_FORMAT, "hub": hub, "revision": revision, "commit": None, "files": files,
         "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        m["commit"] = revision
    path = os.path.join(directory, MANIFEST_NAME)
    write_atomic(path, json.dumps(m, indent=1) + "\n", mode=0o644)
    return {"path": path, "files": len(files), "bytes": sum(f["size"] for f in files)}


def manifest_from_record(rec: dict) -> dict:
    """A fetched item's record as a manifest (deploy fetch --manifest FILE): the hub's own hashes."""
    return {"format": MANIFEST_FORMAT, "hub": rec.get("hub"), "revision": rec.get("revision"),
            "commit": rec.get("commit"), "files": [{k: f.get(k) for k in ("name", "size", "sha256", "blob")}
                                                   for f in rec.get("files") or []]}
