"""Workstation files written the one way: a temp file in the same directory, fsync, mode, an optional check of
the temp file, an optional backup of the file it replaces, rename, fsync the directory, read back.

Used by `deploy init` (scaffold), `deploy discover --write` (the inventory), `deploy monitor export` and
`deploy monitor metrics --textfile`. Files written inside a container go through the agent (agent/container/
files.py), never through this module.
"""
from __future__ import annotations

import datetime
import os
import secrets
import tempfile
from typing import Callable

from orchestrator.core.errors import DeployError


def backup_copy(path: str) -> str:
    """A copy of PATH as PATH.bak-<UTC time>-<random>: created O_EXCL|O_NOFOLLOW (a planted name or symlink is
    never written through), with the original's mode (a 0600 inventory keeps a 0600 backup). -> its path."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    sfd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(sfd, "rb") as src:
        mode = os.fstat(src.fileno()).st_mode & 0o7777
        data = src.read()
    for _ in range(20):
        backup = f"{path}.bak-{stamp}-{secrets.token_hex(3)}"
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as dst:
            os.fchmod(dst.fileno(), mode)
            dst.write(data)
        return backup
    raise DeployError(f"cannot create a backup of {path}: 20 names taken", fix="remove old .bak- files beside it")


def write_atomic(path: str, data: str | bytes, *, mode: int | None = None, keep_mode: bool = False,
                 backup: bool = False, fsync: bool = True, check: Callable[[str], None] | None = None,
                 fix: str = "check the directory's free space and permissions, then run again") -> str | None:
    """Write DATA to PATH atomically and read it back.

    mode: the new file's mode (default: mkstemp's 0600 unless keep_mode); keep_mode: the replaced file's mode;
    backup: keep the replaced file (backup_copy) and return the backup's path; check(tmp): called on the complete
    temp file before the rename (it raises to refuse; nothing is replaced then). A temp file is never left behind.
    Raises DeployError naming the file and what failed. -> the backup's path, or None."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    except OSError as e:
        raise DeployError(f"cannot create a temporary file in {d}: {e.strerror}", where=path, fix=fix) from None
    saved = None
    try:
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(raw)
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
            if check is not None:
                check(tmp)
            exists = os.path.lexists(path)
            if keep_mode and exists:
                os.chmod(tmp, os.stat(path).st_mode & 0o7777)
            elif mode is not None:
                os.chmod(tmp, mode)
            if backup and exists:
                saved = backup_copy(path)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            raise DeployError(f"writing {path} failed: {e.strerror} ({e.filename or path})", where=path,
                              fix=fix) from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    if fsync:
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass  # some file systems cannot fsync a directory; the rename is done
    with open(path, "rb") as fh:
        back = fh.read()
    if back != raw:
        raise DeployError(f"{path} does not read back as written (read {len(back)} bytes, wrote {len(raw)})",
                          where=path, fix="check the file system, then run again")
    return saved


__all__ = ["backup_copy", "write_atomic"]
