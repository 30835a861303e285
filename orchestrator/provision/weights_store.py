"""The host's shared model store (fetch.store, issue 38): each hub revision fetched once per Proxmox host, read by
every container on it through a read-only mount point.

- On the host (the agent run by the host's python3 over the command's one SSH connection; no pct exec): the store
  directory and its marker (agent `store mark`), then the same detached, verified, parallel fetch as in a container
  (agent `fetch`, dest_kind cache: STORE/hub/models--ORG--NAME/{blobs,snapshots/COMMIT}), its records and its lock
  in STORE/.deploy-state. A second deploy that wants the same revision while one downloads it follows that one
  (the lock): one download.
- In the container: agent `store link` proves that MOUNT is this store and read-only, checks the snapshot, and
  makes DEST (model.path, drafter.path) deploy's directory of links into it; the drafter's config.json is a copy
  that up's write-config step pins. The mount point itself is deploy prepare's change (prepare.py: backed up, read
  back, a restart only when confirmed); a container without it is told so, with that command.
"""

from __future__ import annotations

import os
import time

from orchestrator.agent.container.weights import bad_record
from orchestrator.steps.plan import store_host_item as host_item, store_repo_dir as repo_dir, \
    store_state_dir as state_dir

ROUNDS = 4  # another deploy's fetch followed, then ours started: bounded


def snapshot_in_container(it: dict, commit: str) -> str:
    return os.path.join(it["mount"], "hub", "models--" + it["hub"].replace("/", "--"), "snapshots", commit)


def mount_fix(pb, it: dict) -> str:
    return (f"deploy prepare {pb.host}/{pb.vmid} -y adds the mount point (mpN: {it['store']},mp={it['mount']},ro=1: "
            "the config backed up and read back) and restarts the container; without -y it asks first")


def fetch_shared(ctx, pb, hr, its: list[dict], secrets: dict, *, allow_start: bool, rehash: bool, timeout_s: float,
                 step_name: str, follow, report) -> dict:
    """The store's items in place on the host (fetched when missing), then linked in the container: the step
    fetch's planned calls (hr: follow.Calls; store-mark, -probe, -start, -attach, -records, -link).
    -> {"records": [...], "summary": str}; raises StepFailed with what to do."""
    t0 = time.monotonic()
    store = its[0]["store"]
    sd = state_dir(store)
    mark = hr.call("store-mark")
    if not mark.get("ok"):
        ctx.fail(step_name, t0, f"the model store {store} on {pb.host}: {mark.get('message')}",
                 fix=mark.get("fix") or f"fetch.store: a directory of root's on {pb.host} that no one else can write")
    hits = [host_item(it) for it in its]
    fetched = False
    for _ in range(ROUNDS):
        probe = hr.call("store-probe", 3600 if rehash else 60, items=hits, rehash=rehash)
        if not probe.get("ok"):
            ctx.fail(step_name, t0, f"{pb.host}: the store's probe failed: {probe.get('message')}")
        missing = [p for p in probe.get("items") or [] if not p.get("in_place")]
        if not missing:
            break
        if not allow_start:
            ctx.fail(step_name, t0, f"not in the model store {store} on {pb.host}: " + "; ".join(
                p.get("why") or p["dest"] for p in missing) + " (--no-fetch: nothing was downloaded)",
                fix=f"deploy fetch {pb.name} (or deploy up without --no-fetch)")
        fst = probe.get("fetch") or {}
        if fst.get("status") == "running":
            ctx.progress.say(ctx.where, f"a fetch into the store {store} on {pb.host} is in progress (pid "
                                        f"{fst.get('pid')}, phase {fst.get('phase')}): following it (one download "
                                        "per host)")
            res = follow(ctx, hr, pb, fst, timeout_s, step_name, "store-attach")
            if (res.get("fetch") or {}).get("status") != "ok":
                report(ctx, pb, res, step_name, t0)
            continue
        for p in missing:
            ctx.progress.say(ctx.where, f"to fetch into the store {store} on {pb.host}: {p['role']}: {p.get('why')}")
        want = {p["role"] for p in missing}
        started = hr.call("store-start", secrets=secrets or None, items=[h for h in hits if h["role"] in want])
        if not started.get("ok"):
            ctx.fail(step_name, t0, f"{pb.host}: the store's fetch did not start: {started.get('message')}",
                     fix=started.get("fix", ""))
        if started.get("started"):
            fst = {"id": started["id"], "pid": started["pid"], "log": started["log"]}
            ctx.progress.say(ctx.where, f"fetch into the store {store} started on {pb.host} (runner pid "
                                        f"{started['pid']}, detached; log {started['log']})")
            fetched = True
        else:
            fst = started.get("fetch") or {}
            ctx.progress.say(ctx.where, f"another fetch into the store is in progress (pid {fst.get('pid')}): "
                                        "following it")
        res = follow(ctx, hr, pb, fst, timeout_s, step_name, "store-attach")
        if (res.get("fetch") or {}).get("status") != "ok":
            report(ctx, pb, res, step_name, t0)
    else:
        ctx.fail(step_name, t0, f"the store {store} on {pb.host} still lacks " + ", ".join(
            p["role"] for p in missing) + f" after {ROUNDS} rounds (other fetches kept it busy)",
            fix=f"deploy fetch {pb.name} again")
    recs = hr.call("store-records").get("records") or {}
    items = []
    for it in its:
        rec = recs.get(repo_dir(store, it["hub"]))
        if not rec or not rec.get("commit"):
            ctx.fail(step_name, t0, f"the store {store} on {pb.host} has no (trustworthy) record of {it['hub']}",
                     fix=f"deploy fetch {pb.name} fetches it again (a record that is not deploy's is not used)")
        bad = bad_record(rec)
        if bad:  # the store is a place a container may have written: its names and commit become paths
            ctx.fail(step_name, t0, f"the store's record of {it['hub']} on {pb.host} cannot be trusted: {bad}; "
                                    "nothing was linked", fix=f"deploy fetch {pb.name} fetches it again", kind="record")
        items.append({"role": it["role"], "dest": it["dest"], "hub": it["hub"], "revision": rec.get("revision"),
                      "commit": rec["commit"], "endpoint": rec.get("endpoint"), "store": store,
                      "verified_at": rec.get("verified_at"), "snapshot": snapshot_in_container(it, rec["commit"]),
                      "files": [{k: f.get(k) for k in ("name", "size", "sha256", "blob")}
                                for f in rec.get("files") or []]})
    link = hr.call("store-link", id=mark["id"], items=items)
    if not link.get("ok"):
        kind = link.get("kind")
        fix = {"mount": mount_fix(pb, its[0]),
               "writable": f"make the mount point read-only: deploy prepare {pb.host}/{pb.vmid} -y (it sets ro=1), "
                           f"or pct set {pb.vmid} --mpN {store},mp={its[0]['mount']},ro=1 and restart it",
               "missing": f"deploy fetch {pb.name} --verify (re-hashes the store's files on {pb.host})",
               "record": f"deploy fetch {pb.name} on a fresh record: remove {sd}/fetched on {pb.host} (the store's "
                         "records; the weights stay), then run it again",
               }.get(kind, "move the directory away (or point the playbook's path elsewhere), then run again")
        ctx.fail(step_name, t0, f"{pb.host}/{pb.vmid}: {link.get('message')}", fix=fix, kind=kind)
    summary = "; ".join(
        f"{i['role']} {i['hub']}@{i['commit'][:12]} from the host's store {store} (read-only at {its[0]['mount']}), "
        f"{i['dest']} {'linked' if c.get('changed') else 'linked already'}"
        for i, c in zip(items, link.get("items") or []))
    if not fetched:
        summary += "; nothing downloaded (in the store already)"
    return {"records": [{k: i[k] for k in ("role", "hub", "revision", "commit", "dest")}
                        | {"source": "store:" + store, "files_n": len(i["files"])} for i in items], "summary": summary,
            "downloaded": fetched, "linked": any(c.get("changed") for c in link.get("items") or [])}
