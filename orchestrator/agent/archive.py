"""The agent as it travels: one zip of orchestrator/agent/container/ (package `vpd_agent` there), named by its
sha256, and the bootstrap each exec sends instead of the agent (container/cache.py has both halves' details).

The archive crosses the wire only when the container lacks this version: the bootstrap runs the copy cached in
STATE_DIR/vpd-agent/ (root's, 0700, verified by hash before each use) or asks for it. Like salt-ssh's "thin"
archive kept on the target under its hash; as with Ansible's AnsiballZ, an action imports only what it needs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import threading
from functools import lru_cache

from .container import cache
from .container.protocol import DEFAULT_STATE_DIR

CONTAINER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "container")
PACKAGE = "vpd_agent"
CACHE_NAME = "vpd-agent"
NEED_EXIT = cache.NEED_EXIT


@lru_cache(maxsize=1)
def _build() -> bytes:
    """The zip of the container-side modules: the same bytes for the same sources (fixed times, sorted names)."""
    import zipfile  # here: only a container that lacks this version needs the bytes (~6 ms to import)

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(os.listdir(CONTAINER_DIR)):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(CONTAINER_DIR, name), "rb") as fh:
                data = fh.read()
            info = zipfile.ZipInfo(f"{PACKAGE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data, compresslevel=9)
    return buf.getvalue()


_checked: list = []  # the recorded sha256 was held against the bytes once they were built


def archive() -> bytes:
    """The archive's bytes (built on first use). When sha256() came from the workstation's record, the bytes are
    held to it before anything is sent: a record that no longer matches its sources is removed and said."""
    data = _build()
    if not _checked:
        if hashlib.sha256(data).hexdigest() != sha256():
            from orchestrator.core.errors import AgentError

            path = _state_file(ARCHIVE_RECORD)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise AgentError(f"the agent archive's sha256 recorded in {path} does not match its sources (one "
                             "changed without changing its size, time or inode); the record is removed",
                             fix="run the command again (the archive's hash is computed from the sources then)")
        _checked.append(True)
    return data


ARCHIVE_RECORD = "agent-archive.json"


def _state_file(name: str) -> str:
    """A file of this module's in the workstation's state directory (the archive's record, the known set)."""
    from orchestrator.core.remote import state_dir

    return os.path.join(state_dir(), name)


def _sources_key() -> list:
    """What the archive's bytes depend on, read with a stat per source (no reading, no compressing): each
    container module's name, size, mtime and inode, this file's, the Python and zlib versions (deflate's output)."""
    import zlib

    def st(path):
        s = os.stat(path)
        return [s.st_size, s.st_mtime_ns, s.st_ino]

    return [sys.version, zlib.ZLIB_RUNTIME_VERSION, st(__file__)] + [
        [n, *st(os.path.join(CONTAINER_DIR, n))] for n in sorted(os.listdir(CONTAINER_DIR)) if n.endswith(".py")]


@lru_cache(maxsize=1)
def sha256() -> str:
    """The archive's sha256, which every exec's bootstrap names. Kept in the workstation's state directory
    (agent-archive.json) with the key its sources had (_sources_key): building the archive (a level-9 deflate of
    the agent's ~400 KB of source) cost ~20 ms of CPU in every deploy (issue 54), and only a container that lacks
    this version needs the bytes; archive() holds them to this hash before they are sent."""
    try:
        key = _sources_key()
    except OSError:
        key = None
    path = _state_file(ARCHIVE_RECORD)
    if key is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                rec = json.load(fh)
            if isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("sha256"), str) \
                    and re.fullmatch(r"[0-9a-f]{64}", rec["sha256"]):
                return rec["sha256"]
        except (OSError, ValueError):
            pass
    sha = hashlib.sha256(_build()).hexdigest()
    _checked.append(True)
    if key is not None:  # best effort, like agent-cache.json: without it the next deploy computes the hash again
        _write_private_json(path, {"key": key, "sha256": sha})
    return sha


def _write_private_json(path: str, obj, **dump_kw) -> None:
    """obj as JSON in path (0600, a temp file created O_EXCL|O_NOFOLLOW, then renamed); best effort: an OSError
    leaves no temp file and the old record as it was."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, **dump_kw)
        os.rename(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def cache_dir(state_dir: str | None) -> str:
    """Where the container keeps the archive: under the playbook's state directory (runtime.state_dir)."""
    return os.path.join(state_dir or DEFAULT_STATE_DIR, CACHE_NAME)


def cache_bootstrap(cache_dir: str | None) -> bytes:
    """The program an exec sends (about a kilobyte): run the archive cached in cache_dir, or ask for it. None
    keeps no cache (the archive, inline, runs from a private temp file)."""
    return cache.bootstrap(sha256(), cache_dir)


@lru_cache(maxsize=1)
def inline() -> bytes:
    """The archive as a preamble line, for an exec whose container asked for it (or a test that runs the agent
    locally)."""
    return cache.inline(archive())


# What this workstation knows the containers hold: {"HOST|ADDRESS|PORT/VMID:CACHE_DIR": archive sha256}, in the
# workstation's state directory. A one-shot exec (`PYTHON - ACTION ARGS`, the program is all of stdin, so the
# container cannot ask for more on the same channel) sends the archive inline when the container is not known to
# have this version, and only the bootstrap when it is: one exec either way. A container that lost its copy
# answers {"need"} and gets the archive in a second exec (then the entry is corrected).
_known: dict | None = None
_known_lock = threading.Lock()


def container_key(host, vmid: int, cache: str) -> str:
    return f"{host.name}|{host.address or host.ssh_config_alias}|{host.port}/{vmid}:{cache}"


def _load() -> dict:
    """The known set, read once per process and state directory (tests switch DEPLOY_STATE_DIR)."""
    global _known
    path = _state_file("agent-cache.json")
    if _known is None or _known.get("") != path:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = {}
        _known = {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}
        _known[""] = path
    return _known


def known(key: str) -> bool:
    with _known_lock:
        return _load().get(key) == sha256()


def remember(key: str, present: bool) -> None:
    """Record (or forget) that the container behind key holds this archive; best effort, written atomically."""
    with _known_lock:
        cur = _load()
        if present == (cur.get(key) == sha256()):
            return
        if present:
            cur[key] = sha256()
        else:
            cur.pop(key, None)
        path = cur[""]
        _write_private_json(path, {k: v for k, v in cur.items() if k}, indent=0, sort_keys=True)
