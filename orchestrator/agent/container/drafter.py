"""The drafter config file: `file_sha`, and `write_file` (only when the sha256 differs: a backup with the
original's bytes, mode and owner, temp file, fsync, rename, read back; never through a symlink)."""

import stat as _stat
import errno
import hashlib
import os
import time

from .core import sha256_file
from .files import UnsafeDirectory, _sha_at, create_excl, lstat_at, open_dir, write_at
from . import core


def act_file_sha(a):
    path = a["path"]
    try:
        return {"path": path, "realpath": os.path.realpath(path), "sha256": sha256_file(path),
                "size": os.path.getsize(path)}
    except OSError as e:
        return {"path": path, "error": e.strerror, "errno": e.errno}


def act_write_file(a):
    """Write PAYLOAD (the payload on stdin) to path only if its sha256 differs: backup (the original's bytes, mode and owner, under a new
    unpredictable name), temp file, fsync, rename, read back; all through one checked directory fd, O_EXCL and
    O_NOFOLLOW. On any error the old file is untouched."""
    path, want = a["path"], a["sha256"]
    data = core.PAYLOAD
    if data is None or hashlib.sha256(data).hexdigest() != want:
        return {"ok": False, "stage": "payload", "message": "payload does not match the pinned sha256 (transfer error)"}
    d, name = os.path.dirname(path), os.path.basename(path)
    res = {"path": path, "realpath": os.path.realpath(path), "changed": False, "backup": None}
    if not os.path.isdir(d):
        res.update(ok=False, stage="directory", message="directory %s does not exist" % d)
        return res
    try:
        dfd = open_dir(d)
    except UnsafeDirectory as e:
        res.update(ok=False, stage="directory", message="refusing to write in %s" % e)
        return res
    try:
        return _write_in(dfd, d, name, path, data, want, res)
    finally:
        os.close(dfd)


def _write_in(dfd, d, name, path, data, want, res):
    try:
        old, old_raw, _ = _sha_at(dfd, name)
    except FileNotFoundError:
        old = old_raw = None
    except OSError as e:
        res.update(ok=False, stage="read", message="cannot read %s: %s" % (path, e.strerror))
        return res
    res["before_sha256"] = old
    if old == want:
        res.update(ok=True, after_sha256=old)
        return res
    lst = lstat_at(name, dfd)
    if lst is not None and _stat.S_ISLNK(lst.st_mode):
        res.update(ok=False, stage="symlink",
                   message="%s is a symlink to %s; refusing to write through it (a hub cache blob?)"
                           % (path, os.path.realpath(path)))
        return res
    try:
        if old is not None:
            # the bytes, mode and owner of what the read saw, copied under a new name nobody could predict
            bfd, bname = create_excl(dfd, "%s.bak-%s-" % (name, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())),
                                     0o600)
            res["backup"] = os.path.join(d, bname)
            with os.fdopen(bfd, "wb") as dst:
                try:
                    os.fchown(dst.fileno(), lst.st_uid, lst.st_gid)
                except OSError:
                    pass
                os.fchmod(dst.fileno(), lst.st_mode & 0o7777)
                dst.write(old_raw)
                dst.flush()
                os.fsync(dst.fileno())
        owner = (lst.st_uid, lst.st_gid) if lst is not None else None
        write_at(dfd, name, data, (lst.st_mode & 0o7777) if lst is not None else 0o644, owner)
    except OSError as e:
        if res["backup"] and e.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM):
            try:
                os.unlink(os.path.basename(res["backup"]), dir_fd=dfd)
                res["backup"] = None
            except OSError:
                pass
        res.update(ok=False, stage="write", errno=errno.errorcode.get(e.errno, str(e.errno)),
                   message="cannot write %s: %s" % (e.filename or path, e.strerror))
        return res
    res["changed"] = True
    res["after_sha256"] = _sha_at(dfd, name, follow=False)[0]
    res["ok"] = res["after_sha256"] == want
    if not res["ok"]:
        res.update(stage="readback", message="read back %s, expected %s" % (res["after_sha256"], want))
    return res
