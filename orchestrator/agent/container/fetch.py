"""`fetch`: bring a model or drafter into the container from the hub (the token only to the hub's own host),
pinned to a commit: plan each file, download, verify it against the manifest, install it into place. `start`
launches the detached runner (fetch_runner.py), `attach` follows it."""

import base64
import json
import os
import stat
import sys

from .core import clean, emit, now
from .files import (
    follow_runner, lock_held, lstat_at, UnsafeDirectory, _read_json, new_runner_log, open_dir, runner_env, runner_id,
    spawn_runner, tail_file, take_runner_lock, unique_name, write_at, write_json_atomic)
from .install import _agent_source
from .transfer import partial_bytes
from .weights import (
    COMMIT_RE, FETCH_FINAL, FETCH_LOCK, FETCH_RECORDS, FETCH_STATE, FETCH_VAR, FetchError, _final_path, _hash_as,
    MAX_FILE_BYTES, MAX_FILES, _item_dest, _partial, _record_path, _repo_dir, _staging, bad_file, bad_record,
    fetch_record, in_place, int_size, safe_dir, snapshot_target, stage_fd)
from . import core


def _hub_opener():
    import urllib.request

    class Redirect(urllib.request.HTTPRedirectHandler):
        """Follow the hub's redirects (LFS files live on a CDN), never sending the token to another host."""

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            from urllib.parse import urlsplit

            new = urllib.request.HTTPRedirectHandler.redirect_request(self, req, fp, code, msg, headers, newurl)
            if new is not None and urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
                new.headers.pop("Authorization", None)
                new.unredirected_hdrs.pop("Authorization", None)
            return new

    return urllib.request.build_opener(Redirect(), urllib.request.ProxyHandler())


def _hub_request(item, url, token, timeout, headers=None):
    import urllib.request

    h = {"User-Agent": "vllm-pve-deploy-fetch/1", "Accept-Encoding": "identity"}
    h.update(headers or {})
    req = urllib.request.Request(url, headers=h)
    if token:
        req.add_unredirected_header("Authorization", "Bearer " + token)
    return _hub_opener().open(req, timeout=timeout)


def hub_error(item, e, token, what):
    """An HTTP or network error from the hub -> a FetchError that says what happened and what to do."""
    import urllib.error

    hub, ep = item["hub"], item["endpoint"].rstrip("/")
    page = "%s/%s" % (ep, hub)
    tvar = item.get("token_env") or "a token variable"
    key = item["role"] if item["role"] == "model" else "speculative.drafter"
    if isinstance(e, urllib.error.HTTPError):
        code = e.code
        ecode = e.headers.get("X-Error-Code") or ""
        emsg = clean(e.headers.get("X-Error-Message") or "")[:300]
        if ecode == "GatedRepo" or (code == 403 and "restricted" in emsg):
            if not token:
                return gated_no_token(item, what)
            return FetchError("%s is gated and the token's account has no access: the terms are not accepted (%s: "
                              "HTTP %d %s)" % (hub, what, code, emsg or "access restricted"),
                              fix="visit %s with the token's account and accept the terms (or ask for access), "
                                  "then run deploy fetch again" % page, kind="terms")
        if code == 401 and token and ecode != "RepoNotFound":
            return FetchError("the hub refused the token in %s: HTTP 401 %s (%s)" % (tvar, emsg or "unauthorized", what),
                              fix="the token is wrong or revoked: create a new read token and export it in %s" % tvar,
                              kind="token")
        if ecode == "RevisionNotFound" or (code == 404 and "rev" in emsg.lower()):
            return FetchError("%s has no revision %r: %s" % (hub, item.get("revision"), emsg or "HTTP 404"),
                              fix="give a commit (40 hex digits), branch or tag that exists: %s/tree/main lists "
                                  "them" % page, kind="revision")
        if ecode == "RepoNotFound" or (code in (401, 404) and what == "repository info"):
            return FetchError("%s: repository not found at %s%s (HTTP %d)" % (
                hub, ep, "" if token else ", or it is private and no token was given", code),
                fix="check %s.hub (ORG/NAME)%s" % (key, "" if token else " or set %s.token_env" % key), kind="repo")
        if code == 404:
            return FetchError("%s: %s is not in the repository at this revision (HTTP 404 %s)" % (hub, what, emsg),
                              fix="the repository changed between the listing and the download; run deploy fetch "
                                  "again", kind="file")
        if code == 416:
            return FetchError("%s: the hub refused the resume of %s (HTTP 416)" % (hub, what),
                              fix="run deploy fetch again (the partial file was removed)", kind="range")
        return FetchError("%s: HTTP %d from %s (%s)%s" % (hub, code, ep, what, ": " + emsg if emsg else ""),
                          fix="retry later; if it persists, check %s in a browser" % page, kind="http")
    reason = getattr(e, "reason", None) or e
    return FetchError("network: cannot reach the hub at %s from the container (%s: %s)" % (ep, what, reason),
                      fix="check the container's network and DNS (curl -I %s from inside it), or set %s.endpoint / "
                          "HF_ENDPOINT to a mirror it can reach, or fetch on another machine and use "
                          "source: {path: HOST_DIR}" % (ep, key), kind="network")


def gated_no_token(item, what):
    page = "%s/%s" % (item["endpoint"].rstrip("/"), item["hub"])
    key = item["role"] if item["role"] == "model" else "speculative.drafter"
    return FetchError("%s is a gated repository: downloading it needs a hub token, and %s.token_env is not set (%s); "
                      "nothing was downloaded" % (item["hub"], key, what),
                      fix="accept the terms at %s with your account, create a read token, export it in a local "
                          "variable and name that variable in %s.token_env" % (page, key), kind="gated")


LISTING_MAX = 64 << 20  # bytes of one repository listing


def hub_info(item, token, timeout, deadline=None):
    """The repository at a revision: commit, files with their sizes and hashes (the hub's own record). Read in
    what each receive brings, at most LISTING_MAX bytes, by the deadline (default: 10 stall limits): a hub that
    drips its answer does not hold the fetch (and, on the host, the store's lock) forever."""
    from urllib.parse import quote

    rev = item.get("revision") or "main"
    url = "%s/api/models/%s/revision/%s?blobs=true" % (item["endpoint"].rstrip("/"), item["hub"], quote(rev, safe=""))
    deadline = deadline if deadline is not None else now() + 10 * float(timeout)
    try:
        with _hub_request(item, url, token, timeout) as r:
            body = b""
            read1 = getattr(r, "read1", None) or (lambda n: r.read(min(n, 1 << 16)))
            while len(body) <= LISTING_MAX:
                if now() >= deadline:
                    raise FetchError("%s: the hub's listing did not arrive in time (%d bytes so far)" % (
                        item["hub"], len(body)), fix="check the hub at %s; run deploy fetch again" % item["endpoint"],
                        kind="timeout")
                chunk = read1(LISTING_MAX + 1 - len(body))
                if not chunk:
                    break
                body += chunk
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 - HTTP and network errors become messages
        raise hub_error(item, e, token, "repository info") from None
    if len(body) > LISTING_MAX:
        raise FetchError("%s: the hub's listing for revision %s is larger than %d bytes: not read" % (
            item["hub"], rev, LISTING_MAX), fix="is %s a Hugging Face hub (or a compatible mirror)?" % item["endpoint"],
            kind="hub")
    try:
        info = json.loads(body.decode("utf-8"))
        commit = info["sha"]
        files = []
        sib = info["siblings"]
        if not isinstance(sib, list) or len(sib) > MAX_FILES:
            raise TypeError("siblings is not a list of at most %d files" % MAX_FILES)
        for s in sib:
            lfs = s.get("lfs") or None
            size = int_size(lfs["size"] if lfs else s["size"])
            files.append({"name": s["rfilename"], "size": size, "sha256": lfs["sha256"] if lfs else None,
                          "blob": s.get("blobId")})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FetchError("%s: the hub's answer for revision %s is not a repository listing (%s)" % (item["hub"], rev, e),
                         fix="is %s a Hugging Face hub (or a compatible mirror)?" % item["endpoint"]) from None
    # everything in the answer is untrusted network input: a hash becomes a file name in blobs/, a size an
    # allocation and a space check, a name a path (issue 50); checked here, before any of it is used
    if not isinstance(commit, str) or not COMMIT_RE.fullmatch(commit):
        raise FetchError("%s: the hub gave no commit for revision %s (%r is not 40 hex digits)" % (
            item["hub"], rev, commit if isinstance(commit, str) and len(commit) < 100 else type(commit).__name__),
            fix="is %s a Hugging Face hub (or a compatible mirror)?" % item["endpoint"], kind="hub")
    for f in files:
        if isinstance(f["name"], str) and not f["sha256"] and not f["blob"]:
            raise FetchError("%s: the hub gave no hash for %s (asked with blobs=true)" % (item["hub"], f["name"]),
                             fix="use a hub or mirror that lists blob ids and LFS sha256")
        why = bad_file(f)
        if why:
            raise FetchError("%s: the hub's listing for revision %s is not believable: %s; nothing was downloaded"
                             % (item["hub"], rev, why),
                             fix="the hub at %s (or a proxy in between) answers what a hub does not: check "
                                 "the playbook's endpoint / HF_ENDPOINT; hub files are at most %d bytes and hashed in hex"
                             % (item["endpoint"], MAX_FILE_BYTES), kind="hub")
    return {"commit": commit, "files": files, "gated": info.get("gated") or False}


def plan_item(item, listing, state_dir):
    """Which files still have to come (not already verified in staging or in place), and how many bytes. Every
    directory is walked from the trusted root (weights.stage_fd: no link followed), every file looked at without
    following it."""
    commit = listing["commit"]
    need, have = [], 0
    _safe_staging(item, commit)
    for f in listing["files"]:
        final = _final_path(item, commit, f["name"])
        part, done = _partial(item, commit, f)
        # a staged or cached file of the right size is only counted once it is ours and its hash matches: the same
        # size proves nothing (another user, or another tool, can have put those bytes there)
        if _verified_at(item, done, f):
            have += f["size"]  # a blob (or a staged file) whose bytes match the listing's hash
            f["state"] = "verified"
            continue
        # in place: a drafter's config.json (pinned bytes, or the hub's to be pinned by up: never replaced by a
        # fetch), or a file of a directory destination with the listing's hash
        pinned = item["role"] == "drafter" and f["name"] == "config.json" and os.path.isfile(final) \
            and not os.path.islink(final)
        if item["dest_kind"] == "dir" and (pinned or os.path.isdir(item["dest"]) and _verified_at(item, final, f)):
            have += f["size"]
            f["state"] = "in place"
            continue
        dfd = stage_fd(item, os.path.dirname(part))
        try:
            f["partial"] = partial_bytes(part, f["size"], dfd)
        finally:
            os.close(dfd)
        need.append(f)
    return need, have


def _verified_at(item, path, f):
    """PATH is a regular file of ours (not a link, no one else may write it), of F's size, with F's hash."""
    try:
        dfd = stage_fd(item, os.path.dirname(path), create=False)
    except (OSError, FetchError):
        return False
    try:
        name = os.path.basename(path)
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != f["size"] or st.st_uid != os.geteuid() \
                or st.st_mode & 0o022:
            return False
        return _hash_as(name, f, dfd) == (f["sha256"] or f["blob"])
    except OSError:
        return False
    finally:
        os.close(dfd)


def _safe_staging(item, commit):
    """The staging directories (and a directory destination) must be ours and writable by no one else, every
    directory from the trusted root down (stage_fd)."""
    st = _staging(item, commit)
    if item["dest_kind"] == "dir":
        safe_dir(os.path.dirname(st), "staging directory")  # its parent: not anyone's to write (no sticky bit)
    os.close(stage_fd(item, st))
    if item["dest_kind"] == "dir" and os.path.lexists(item["dest"]):
        safe_dir(item["dest"], "destination directory")


def install_item(item, commit, listing, state_dir, source):
    """Every file verified: move them into place (the directory), or link the snapshot (the hub cache); then the
    record that `in_place`, status and verify read."""
    files = listing["files"]
    if item["dest_kind"] == "cache":
        base = _repo_dir(item["hf_home"], item["hub"])
        snap = os.path.join(base, "snapshots", commit)
        for f in files:
            _link_blob(item, snap, f)
        rev = item.get("revision")
        if rev and not COMMIT_RE.match(rev):
            parts = rev.split("/")
            if any(p in ("", ".", "..") for p in parts):
                raise FetchError("revision %r is not a name for the cache's refs/" % rev, kind="unsafe")
            rfd = stage_fd(item, os.path.join(base, "refs", *parts[:-1]))
            try:
                write_at(rfd, parts[-1], commit.encode(), 0o644)
            finally:
                os.close(rfd)
    else:
        st = _staging(item, commit)
        safe_dir(item["dest"], "destination directory")
        for f in files:
            src = os.path.join(st, f["name"])
            dst = os.path.join(item["dest"], f["name"])
            if f.get("state") == "in place" and not os.path.exists(src):
                continue
            _move_in(item, src, dst)
        import shutil

        shutil.rmtree(os.path.dirname(st) if os.path.basename(st) == commit[:12] else st, ignore_errors=True)
    rec = {"role": item["role"], "hub": item.get("hub") or listing.get("hub"), "revision": item.get("revision")
           or listing.get("revision") or commit, "commit": commit, "endpoint": item.get("endpoint"), "source": source,
           "dest": _item_dest(item), "dest_kind": item["dest_kind"], "verified_at": now(),
           "total_bytes": sum(f["size"] for f in files), "files_n": len(files),
           "files": [{"name": f["name"], "size": f["size"], "sha256": f["sha256"], "blob": f["blob"]} for f in files]}
    bad = bad_record(rec)
    if bad:
        raise FetchError("%s: not writing a record deploy could not read back: %s" % (item["role"], bad),
                         kind="unsafe")
    os.close(open_dir(state_dir, 0o700))  # checked before the records directory in it is made
    os.close(open_dir(os.path.join(state_dir, FETCH_RECORDS), 0o700))
    write_json_atomic(_record_path(state_dir, _item_dest(item)), rec)
    return rec


def _move_in(item, src, dst):
    """A verified staged file renamed into place, both directories walked from the destination's parent
    (stage_fd: no link followed): the staged file still a regular file of ours, nothing but a regular file
    replaced at the destination."""
    sfd = stage_fd(item, os.path.dirname(src), create=False)
    try:
        dfd = stage_fd(item, os.path.dirname(dst))
        try:
            sname, dname = os.path.basename(src), os.path.basename(dst)
            dl = lstat_at(dname, dfd)
            if dl is not None and not stat.S_ISREG(dl.st_mode):
                raise FetchError("%s exists and is not a regular file: not replacing it" % dst,
                                 fix="move it away, then run deploy fetch again")
            sl = lstat_at(sname, sfd)
            if sl is None or not stat.S_ISREG(sl.st_mode) or sl.st_uid != os.geteuid() or sl.st_mode & 0o022:
                raise FetchError("%s: the verified file %s is no longer a regular file of ours (owner or mode "
                                 "changed): not moving it into place" % (item["role"], src),
                                 fix="remove %s and run deploy fetch again" % os.path.dirname(src), kind="unsafe")
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _link_blob(item, snap, f):
    """snapshots/COMMIT/NAME -> ../../blobs/ETAG, made through its directory's fd (stage_fd: no planted link
    followed on the way). What is there already is replaced only when it is a link (unlinking a link never
    touches its target); a file or a directory there is not deploy's: refused, named."""
    link = os.path.join(snap, f["name"])
    dfd = stage_fd(item, os.path.dirname(link))
    try:
        name, rel = os.path.basename(link), snapshot_target(f)
        lst = lstat_at(name, dfd)
        if lst is not None:
            if not stat.S_ISLNK(lst.st_mode):
                raise FetchError("%s: %s is not a link (mode %o): deploy made only links there; not replacing it" % (
                    item["role"], link, lst.st_mode), fix="look at who put it there, remove it, then run deploy "
                                                          "fetch again", kind="unsafe", path=link)
            if os.readlink(name, dir_fd=dfd) == rel:
                return
        tmp = unique_name(".%s.link-" % name[:100])
        os.symlink(rel, tmp, dir_fd=dfd)
        try:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link atomically; never a directory
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def _fetch_state(state_dir):
    st = _read_json(os.path.join(state_dir, FETCH_STATE))
    if st and st.get("status") == "running" and not lock_held(state_dir, FETCH_LOCK):
        st = _read_json(os.path.join(state_dir, FETCH_STATE)) or st
        if st.get("status") == "running":
            st.update(status="killed", finished_at=now(),
                      message="the fetch process ended without a result (killed, or the container restarted) "
                              "while on %s; partial files are kept and nothing half-done is in place"
                              % (st.get("file") or "-"),
                      fix="run deploy fetch again: it resumes")
            write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
    if st and st.get("t0"):
        st["elapsed"] = round((st.get("finished_at") or now()) - st["t0"], 1)
    return st


def act_fetch(a):
    """op probe: what is in place, what runs; start: start the detached runner; attach: follow it (events) for at
    most follow_s; manifest: the record of a fetched item (a manifest for source: {path})."""
    op, state_dir = a["op"], a["state_dir"]
    items = a.get("items") or []
    if op == "probe":
        return {"ok": True, "items": [in_place(it, state_dir, rehash=bool(a.get("rehash"))) for it in items],
                "fetch": _fetch_state(state_dir)}
    if op == "start":
        return _fetch_start(a)
    if op == "attach":
        return _fetch_follow(a)
    if op == "records":
        return {"ok": True, "records": {d: fetch_record(state_dir, d) for d in a.get("dests") or []}}
    return {"ok": False, "message": "unknown op %r" % op}


def _fetch_start(a):
    state_dir = a["state_dir"]
    try:
        dfd = open_dir(state_dir, 0o700)
    except (UnsafeDirectory, OSError) as e:
        return {"ok": False, "message": "state directory %s: %s" % (state_dir, e),
                "fix": "the state directory must be a real directory (not a link) of root's that no one else can "
                       "write: see the message"}
    try:
        lock_fd = take_runner_lock(dfd, FETCH_LOCK)
        if lock_fd is None:
            return {"ok": True, "started": False, "fetch": _fetch_state(state_dir)}
        fid = runner_id()
        logname, logfd = new_runner_log(dfd, "fetch", fid)
    finally:
        os.close(dfd)
    items = [dict(it) for it in a["items"]]
    st = {"id": fid, "status": "running", "phase": "starting", "items": items, "log": os.path.join(state_dir, logname),
          "started_at": now(), "t0": now(), "timeout_s": float(a.get("timeout_s") or 21600),
          "stall_s": float(a.get("stall_s") or 60), "connections": int(a.get("connections") or 0) or None,
          "range_bytes": int(a.get("range_bytes") or 0) or None, "reported": False, "done_bytes": 0, "total_bytes": None}
    write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
    env = runner_env(FETCH_VAR, fid)
    for k in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    args = {"state_dir": state_dir, "id": fid}
    # the tokens reach the runner on its stdin, like they reached this agent: never argv, never the environment
    pre = ("import base64 as _b, json as _j; SECRETS = _j.loads(_b.b64decode('%s'))\n"
           % base64.b64encode(json.dumps(core.SECRETS or {}).encode()).decode()).encode()
    try:
        proc = spawn_runner([sys.executable, "-", "fetch_run", json.dumps(args)], pre + _agent_source(), logfd,
                            lock_fd, env)
    except OSError as e:
        st.update(status="failed", message="cannot start the fetch runner: %s" % e.strerror, finished_at=now())
        write_json_atomic(os.path.join(state_dir, FETCH_STATE), st)
        return {"ok": False, "message": st["message"]}
    finally:
        os.close(logfd)
        os.close(lock_fd)
    return {"ok": True, "started": True, "id": fid, "pid": proc.pid, "log": st["log"]}


def _fetch_follow(a):
    """Progress events from fetch.json (bytes, rate, ETA per file and in total, every heartbeat_s) until the runner
    ends or follow_s passes; log lines (what the runner did) as events too (files.follow_runner)."""
    state_dir = a["state_dir"]
    beat = float(a.get("heartbeat_s") or 2)
    last = [0.0]

    def tick(st):
        if now() - last[0] >= beat and st.get("progress"):
            last[0] = now()
            emit(event="fetch", kind="progress", **st["progress"])

    return follow_runner(
        a, "fetch", lambda: _fetch_state(state_dir),
        lambda st: write_json_atomic(os.path.join(state_dir, FETCH_STATE), st), FETCH_FINAL,
        lambda ln: emit(event="fetch", kind="line", line=clean(ln)),
        lambda st, pos: {"ok": True, "done": True, "fetch": st, "log_pos": pos,
                         "log_tail": tail_file(st["log"], 20) if st.get("status") != "ok" else []},
        tick)
