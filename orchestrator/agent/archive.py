"""The agent as it travels: one zip of orchestrator/agent/container/ (package `vpd_agent` there), named by its
sha256, and the bootstrap each exec sends instead of the agent (container/cache.py has both halves' details).

The archive crosses the wire only when the container lacks this version: the bootstrap runs the copy cached in
STATE_DIR/vpd-agent/ (root's, 0700, verified by hash before each use) or asks for it. Like salt-ssh's "thin"
archive kept on the target under its hash; as with Ansible's AnsiballZ, an action imports only what it needs.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from functools import lru_cache

from .container import cache

CONTAINER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "container")
PACKAGE = "vpd_agent"
DEFAULT_STATE_DIR = "/var/lib/vllm-pve-deploy"
CACHE_NAME = "vpd-agent"
NEED_EXIT = cache.NEED_EXIT


@lru_cache(maxsize=1)
def archive() -> bytes:
    """The zip of the container-side modules: the same bytes for the same sources (fixed times, sorted names)."""
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


@lru_cache(maxsize=1)
def sha256() -> str:
    return hashlib.sha256(archive()).hexdigest()


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
