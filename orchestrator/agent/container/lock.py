"""`lock` / `unlock`: one deploy per container. A lock file appears complete (temp file, then link()), carries its
holder, a hard limit and a short expiry that the holder's heartbeat renews; every removal happens under the short
`lock.break` mutex, so the file checked is the file removed."""

import os
import time

from .core import dumps, emit, loads, now
from .files import UnsafeDirectory, create_excl, open_dir, open_regular, unique_name, write_at
from . import core


def _read_lock(dfd):
    """The holder dict of the lock file, None when there is none. Lock files are complete when they
    appear (written, then linked into place), so an unreadable one is damaged, not half-written."""
    try:
        fd = open_regular(dfd, "lock")
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        try:
            cur = loads(fh.read(65536).decode("utf-8", "replace"))
            if not isinstance(cur, dict):
                raise ValueError("not an object")
        except ValueError:  # damaged (or from an older agent that filled it after creating it): one term of grace
            cur = {"holder": "unknown (unreadable lock file)", "token": None,
                   "expires": os.fstat(fh.fileno()).st_mtime + 60}
    return cur


def _place_new(dfd, name, data):
    """Create dir/name with these bytes, only if it does not exist: a complete temp file, link()ed into place."""
    fd, tmp = create_excl(dfd, ".%s.tmp-" % name, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp, dir_fd=dfd)


def _remove_lock_if(dfd, pred):
    """Move the lock aside (to a unique name) if pred(holder) holds, atomically with respect to every other remover:
    removers take the short `lock.break` mutex first, and takers can only add a lock where none is, so the file
    read under the mutex is the file moved. -> True (removed), False (pred false or no lock), None (mutex busy)."""
    def remove():
        cur = _read_lock(dfd)
        if cur is None or not pred(cur):
            return False
        os.rename("lock", unique_name(".lock.stale-"), src_dir_fd=dfd, dst_dir_fd=dfd)
        for n in os.listdir(dfd):  # keep only the newest few stale copies (for the curious)
            if n.startswith((".lock.stale-", "lock.break.stale-")):
                try:
                    if now() - os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mtime > 86400:
                        os.unlink(n, dir_fd=dfd)
                except OSError:
                    pass
        return True
    return _under_break_mutex(dfd, remove)


def _under_break_mutex(dfd, fn):
    """fn() while holding the short `lock.break` mutex (every removal and every renewal of the lock takes it, so
    a renewal cannot rewrite a lock a breaker is moving aside); None when the mutex is busy."""
    if not _place_new(dfd, "lock.break", dumps({"pid": os.getpid(), "since": now()}).encode()):
        try:
            if now() - os.stat("lock.break", dir_fd=dfd, follow_symlinks=False).st_mtime > 10:
                # a remover died inside its few milliseconds: clear its mutex
                os.rename("lock.break", unique_name("lock.break.stale-"), src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            pass
        return None
    try:
        return fn()
    finally:
        try:
            os.unlink("lock.break", dir_fd=dfd)
        except OSError:
            pass


def act_lock(a):
    """Take, or renew, the container lock. A lock file appears complete (temp file, then link()), carries its
    holder's identity, a hard limit (`until`, from the operation's step timeouts) and a short `expires` that the
    holder's heartbeat keeps pushing forward (term_s): a deploy killed by SIGKILL blocks others for one term only.
    Expired locks, and the lock named by break_token (a holder the workstation proved dead), are broken."""
    try:
        dfd = open_dir(a["state_dir"], 0o700)
    except UnsafeDirectory as e:
        return {"locked": False, "error": "refusing to use the state directory: %s" % e}
    try:
        return _lock_in(dfd, a)
    finally:
        os.close(dfd)


def _lock_in(dfd, a):
    deadline = now() + float(a.get("wait_s", 0))
    term = float(a.get("term_s", 60))
    lease = float(a["lease_s"])
    while True:
        t = now()
        me = {"token": a["token"], "holder": a["holder"], "since": t, "until": t + lease,
              "expires": min(t + term, t + lease), "operation": a.get("operation"),
              "workstation": a.get("workstation"), "pid": a.get("pid"), "pid_start": a.get("pid_start")}
        if not a.get("renew") and _place_new(dfd, "lock", dumps(me).encode()):
            return {"locked": True}
        cur = _read_lock(dfd)
        if cur is None:
            if a.get("renew"):
                return {"locked": False, "lost": True, "holder": None}
            continue
        if cur.get("token") == a["token"]:
            # renew: the same identity, a later expiry (never past `until`); replaced atomically by rename, under
            # the lock.break mutex, re-read there: a breaker that saw it expired has moved it aside, or waits
            def renew():
                c = _read_lock(dfd)
                if c is None or c.get("token") != a["token"] or float(c.get("expires", 0)) < now():
                    return {"locked": False, "lost": True, "holder": c}
                c["expires"] = min(now() + term, float(c.get("until", now() + term)))
                write_at(dfd, "lock", dumps(c).encode(), 0o600)
                return {"locked": True, "expires": c["expires"]}
            for _ in range(200):  # the mutex is held for milliseconds; a dead holder's is cleared after 10 s
                r = _under_break_mutex(dfd, renew)
                if r is not None:
                    return r
                time.sleep(0.05)
            return {"locked": False, "lost": True, "holder": cur,
                    "error": "the lock.break mutex stayed busy; the lock was not renewed"}
        if a.get("renew"):
            return {"locked": False, "lost": True, "holder": cur}
        stale = float(cur.get("expires", 0)) < now()
        brk = _break_token(a)
        named = brk and cur.get("token") == brk
        if stale or named:
            tok = cur.get("token")
            gone = _remove_lock_if(dfd, lambda c: c.get("token") == tok and (
                float(c.get("expires", 0)) < now() or (named and c.get("token") == brk)))
            if gone:
                emit(event="lock", message="broke the lock held by %s (%s)"
                     % (cur.get("holder"), "its holder is a dead process on this workstation" if named
                        else "its lease ran out: the holder stopped renewing it"))
            continue
        if now() >= deadline:
            return {"locked": False, "holder": cur}
        time.sleep(min(0.5, max(0.01, deadline - now())))


def _break_token(a):
    """Another holder's token, to break its lock: sent on stdin (SECRETS), never in argv or the audit log."""
    return core.SECRETS.get("break_token") or a.get("break_token")


def act_unlock(a):
    """Release our lock (token), or break the one named by break_token (`deploy unlock` after a confirmation);
    without either, just show the holder."""
    try:
        dfd = open_dir(a["state_dir"], 0o700)
    except UnsafeDirectory as e:
        return {"unlocked": False, "error": "refusing to use the state directory: %s" % e}
    try:
        cur = _read_lock(dfd)
        if cur is None:
            return {"unlocked": False, "holder": None}
        want = a.get("token") or _break_token(a)
        if not want or cur.get("token") != want:
            return {"unlocked": False, "holder": cur}
        deadline = now() + 5
        while True:
            gone = _remove_lock_if(dfd, lambda c: c.get("token") == want)
            if gone is not None or now() >= deadline:
                return {"unlocked": bool(gone)} if a.get("token") else {"unlocked": bool(gone), "holder": cur}
            time.sleep(0.02)
    finally:
        os.close(dfd)
