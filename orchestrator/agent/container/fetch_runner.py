"""`fetch_run`: the detached fetch runner (its own session; stdout and stderr are the fetch log): every item
planned, downloaded, verified and installed, its record written, the state updated as it goes."""

import errno
import os
import time

from .core import now
from .fetch import _hub_request, gated_no_token, hub_error, hub_info, install_item, plan_item
from .transfer import CONNECTIONS, RANGE_BYTES, Transfer
from .files import UnsafeDirectory, _read_json, write_json_atomic
from .procs import proc_starttime
from .weights import (
    COMMIT_RE, FETCH_STATE, FetchError, _existing_dir, _fmt_bytes, _free, _partial, _staging, read_manifest,
    stage_fd, verify_file)
from . import core


def act_fetch_run(a):
    """The detached runner: resolve every item, check the space, download, verify, move into place, record."""
    state_dir = a["state_dir"]
    path = os.path.join(state_dir, FETCH_STATE)
    st = _read_json(path)
    if not st or st.get("id") != a["id"]:
        return {"ok": False, "message": "fetch.json does not describe fetch %s" % a["id"]}
    st.update(pid=os.getpid(), starttime=proc_starttime(os.getpid()))
    deadline = st["t0"] + float(st["timeout_s"])
    stall = float(st.get("stall_s") or 60)

    def save():
        write_json_atomic(path, st)

    def log(msg):
        print("[deploy] %s %s" % (time.strftime("%H:%M:%S"), msg), flush=True)

    def verified(it, f, got):
        f["state"], f["partial"] = "verified", 0
        log("%s: %s verified (%s, %s %s)" % (it["role"], f["name"], _fmt_bytes(f["size"]),
                                             "sha256" if f["sha256"] else "git blob", got[:12]))

    def finish(status, message, fix=None, **kw):
        st.update(status=status, message=message, fix=fix, finished_at=now(), progress=None, **kw)
        save()
        log("%s: %s" % (status, message))
        return {"ok": status == "ok"}

    try:
        listings = []
        st["phase"] = "resolve"
        save()
        for it in st["items"]:
            token = (core.SECRETS or {}).get("token:" + it["role"])
            if it.get("source_path"):
                lst = read_manifest(it)
                if it.get("hub") and lst.get("hub") and lst["hub"] != it["hub"]:
                    raise FetchError("the manifest in %s is for %s, the playbook names %s" % (
                        it["source_path"], lst["hub"], it["hub"]), fix="copy the right directory, or correct the "
                                                                        "playbook")
                if it.get("revision") and COMMIT_RE.match(it["revision"]) and lst["commit"] != it["revision"]:
                    raise FetchError("the manifest in %s is commit %s, the playbook pins %s" % (
                        it["source_path"], lst["commit"], it["revision"]), fix="copy the files of the pinned "
                                                                               "revision, or correct the playbook")
                it["commit"] = lst["commit"]
                log("%s: %s from %s (manifest: %d files, %s)" % (it["role"], lst.get("hub") or "files",
                                                                   it["source_path"], len(lst["files"]),
                                                                   _fmt_bytes(sum(f["size"] for f in lst["files"]))))
            else:
                lst = hub_info(it, token, min(stall, max(1.0, deadline - now())), deadline)
                if lst["gated"] and not token:
                    raise gated_no_token(it, "the listing says gated: %s" % lst["gated"])
                it["commit"] = lst["commit"]
                shown = it.get("revision") or "main"
                log("%s: %s@%s is commit %s (%d files, %s)" % (it["role"], it["hub"], shown, lst["commit"],
                                                              len(lst["files"]),
                                                              _fmt_bytes(sum(f["size"] for f in lst["files"]))))
            need, have = plan_item(it, lst, state_dir)
            it["need"] = [f["name"] for f in need]
            listings.append((it, lst, need, have, token))
        save()
        # the space: by filesystem, what is still to come (partials count as come) against what is free
        st["phase"] = "space"
        by_dev = {}
        for it, lst, need, have, _ in listings:
            if not need:
                continue
            where = _existing_dir(_staging(it, lst["commit"]))
            dev = os.stat(where).st_dev
            e = by_dev.setdefault(dev, {"where": where, "need": 0, "total": 0, "items": []})
            e["need"] += sum(f["size"] - f.get("partial", 0) for f in need)
            e["total"] += sum(f["size"] for f in lst["files"])
            e["items"].append("%s %s" % (it["role"], it.get("hub") or it.get("source_path")))
        for e in by_dev.values():
            free = _free(e["where"])
            if e["need"] > free:
                return finish("failed", "not enough space at %s for %s: %s still to download (%d bytes; the "
                                        "repository is %s), %s free (%d bytes); nothing was downloaded"
                              % (e["where"], ", ".join(e["items"]), _fmt_bytes(e["need"]), e["need"],
                                 _fmt_bytes(e["total"]), _fmt_bytes(free), free),
                              fix="free at least %s there, or point the playbook at a larger filesystem"
                                  % _fmt_bytes(e["need"] - free), kind="space", need=e["need"], free=free)
        total = sum(sum(f["size"] for f in lst["files"]) for _, lst, _, _, _ in listings)
        done0 = sum(have + sum(f.get("partial", 0) for f in need) for _, _, need, have, _ in listings)
        st.update(phase="download", total_bytes=total, done_bytes=done0)
        save()
        t_start, bytes_at_start = now(), done0
        finished = [sum(have for _, _, _, have, _ in listings)]
        # directory sources: the copied files, verified in place (no download)
        for it, lst, need, have, token in listings:
            if not it.get("source_path"):
                continue
            for f in need:
                st["file"] = f["name"]
                part, dn = _partial(it, lst["commit"], f)
                src = os.path.join(it["incoming"], f["name"])
                if not os.path.isfile(src) or os.path.islink(src):
                    raise FetchError("%s: %s is listed in the manifest but not in %s" % (
                        it["role"], f["name"], it["source_path"]), fix="copy the complete directory, or write "
                                                                      "the manifest again")
                dfd = stage_fd(it, os.path.dirname(part))
                try:
                    os.rename(src, os.path.basename(part), dst_dir_fd=dfd)
                    got = verify_file(it, f, part, dn, dfd)
                finally:
                    os.close(dfd)
                finished[0] += f["size"]
                verified(it, f, got)
        # the hub: every file still to come, in parallel ranges (transfer.py)
        work = [(it, lst["commit"], f, token) for it, lst, need, have, token in listings
                if not it.get("source_path") for f in need]
        if work:
            conns = int(st.get("connections") or CONNECTIONS)
            rbytes = int(st.get("range_bytes") or RANGE_BYTES)
            big = sum(1 for _, _, f, _ in work if f["size"] > rbytes)
            log("downloading %d file%s (%s) over up to %d connection%s%s" % (
                len(work), "" if len(work) == 1 else "s", _fmt_bytes(sum(f["size"] for _, _, f, _ in work)), conns,
                "" if conns == 1 else "s", ", %d in %s ranges" % (big, _fmt_bytes(rbytes)) if big else ""))

            def on_progress(busy, n):
                t = now()
                done = finished[0] + tr.done_bytes()
                rate = (done - bytes_at_start) / max(t - t_start, 1e-6)
                pf = max(busy, key=lambda x: x.f["size"] - x.got()) if busy else None
                prog = {"done": done, "total": total, "rate": round(rate), "connections": n,
                        "files_active": len({id(x) for x in busy}),
                        "eta_s": round((total - done) / rate, 1) if rate > 0 else None}
                if pf is not None:
                    got = pf.got()
                    rate_f = (got - pf.got0) / max(t - pf.t0, 1e-6)
                    prog.update(role=pf.item["role"], file=pf.f["name"], file_bytes=got, file_total=pf.f["size"],
                                file_rate=round(rate_f),
                                file_eta_s=round((pf.f["size"] - got) / rate_f, 1) if rate_f > 0 else None)
                    st["file"] = pf.f["name"]
                st["done_bytes"] = done
                st["progress"] = prog
                save()

            tr = Transfer(work, request=_hub_request, error=hub_error, connections=conns, range_bytes=rbytes,
                          deadline=deadline, stall_s=stall, log=log, on_progress=on_progress,
                          on_verified=lambda pf, got: verified(pf.item, pf.f, got))
            tr.run()
        st["phase"] = "install"
        save()
        recs = []
        for it, lst, need, have, _ in listings:
            source = "path:" + it["source_path"] if it.get("source_path") else "hub:" + (it.get("endpoint") or "")
            rec = install_item(it, lst["commit"], lst, state_dir, source)
            if it.get("incoming"):
                import shutil

                shutil.rmtree(it["incoming"], ignore_errors=True)
            recs.append({k: rec[k] for k in ("role", "hub", "revision", "commit", "dest", "total_bytes", "files_n")})
            log("%s: %s in place at %s (%d files, every one verified)" % (
                it["role"], rec["commit"][:12], rec["dest"], rec["files_n"]))
        return finish("ok", "; ".join("%s %s@%s (%s) in place at %s, %d files verified" % (
            r["role"], r["hub"] or "files", r["revision"] if r["revision"] == r["commit"] else "%s = %s" % (
                r["revision"], r["commit"]), _fmt_bytes(r["total_bytes"]), r["dest"], r["files_n"]) for r in recs),
            records=recs)
    except FetchError as e:
        return finish("timeout" if e.kind == "timeout" else "failed", e.message, e.fix, kind=e.kind, **e.details)
    except UnsafeDirectory as e:
        return finish("failed", str(e), "remove what was planted there (the message names it), then run deploy "
                                        "fetch again", kind="unsafe")
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return finish("failed", "disk full at %s: partial files are kept for resume, nothing half-done is in "
                                    "place" % (e.filename or "?"), "free space there, then run deploy fetch again",
                          kind="disk")
        return finish("failed", "%s: %s" % (e.filename or "fetch", e.strerror or e), kind="os")
