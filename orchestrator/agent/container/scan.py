"""`drafter_scan`: the drafter configs a server started now could read besides the playbooks' own paths (issue 26):
`config.json` in the Hugging Face hub cache (HF_HOME/hub/models--*/snapshots/*/config.json) and in models
directories (DIR/*/config.json, one level). Read-only.

Everything here is untrusted (the container is hostile input): a fixed pattern, no recursion; directories are
listed without following links and at most MAX_ENTRIES entries each; files are regular files opened O_NOFOLLOW |
O_NONBLOCK (a FIFO or a device is never read), at most 1 MiB; at most MAX_FILES files; a time budget. A hub
snapshot's config.json is a symlink into the same repo's blobs/: followed only when its target stays inside that
models--* directory."""

import errno
import hashlib
import json
import os
import signal
import stat as _stat

from .core import now

MAX_BYTES = 1 << 20
MAX_FILES = 200
MAX_ENTRIES = 1000  # entries looked at per directory listed
DEFAULT_HUB = "/root/.cache/huggingface/hub"
DEFAULT_MODELS = "/root/models"


class _Stop(Exception):
    pass


def _dirs(path, budget):
    """The real subdirectories (not links) of path, sorted, at most MAX_ENTRIES entries looked at."""
    out = []
    try:
        it = os.scandir(path)
    except OSError:
        return out
    with it:
        for n, e in enumerate(it):
            if n >= MAX_ENTRIES:
                budget["notes"].append("%s: more than %d entries, the rest not looked at" % (path, MAX_ENTRIES))
                break
            if now() > budget["end"]:
                raise _Stop("time budget spent")
            try:
                if e.is_dir(follow_symlinks=False):
                    out.append(e.name)
            except OSError:
                continue
    return sorted(out)


def drafter_signs(cfg):
    """Why a parsed config.json looks like a speculative-decoding drafter's (DFlash, EAGLE), or [] (a target
    model's, or anything else). The published DFlash config: architectures ["DFlashDraftModel"], dflash_config
    {target_layer_ids, mask_token_id} (docs/domain/qwen36-dflash.md)."""
    if not isinstance(cfg, dict):
        return []
    signs = []
    archs = cfg.get("architectures")
    if isinstance(archs, list):
        signs += ["architectures %s" % a for a in archs
                  if isinstance(a, str) and any(w in a.lower() for w in ("dflash", "eagle"))]
    for k in ("dflash_config", "target_layer_ids", "eagle_aux_hidden_state_layer_ids", "eagle_config"):
        if k in cfg:
            signs.append("key %s" % k)
    return signs


def _read(path, budget):
    """sha256, size and drafter signs of one regular file (opened O_NOFOLLOW|O_NONBLOCK, at most MAX_BYTES)."""
    if budget["files"] >= MAX_FILES:
        raise _Stop("more than %d config files" % MAX_FILES)
    if now() > budget["end"]:
        raise _Stop("time budget spent")
    budget["files"] += 1
    info = {"path": path}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        info["error"] = "a symlink (not followed)" if e.errno == errno.ELOOP else (e.strerror or str(e))
        return info
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        info["size"] = st.st_size
        if not _stat.S_ISREG(st.st_mode):
            info["error"] = "not a regular file (not read)"
            return info
        if st.st_size > MAX_BYTES:
            info["error"] = "%d bytes, over the %d-byte limit (not read)" % (st.st_size, MAX_BYTES)
            return info
        raw = fh.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:  # grew while read
        info["error"] = "over the %d-byte limit (not read)" % MAX_BYTES
        return info
    info["sha256"] = hashlib.sha256(raw).hexdigest()
    info["size"] = len(raw)
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is one
        info["parse_error"] = str(e)[:200]
        cfg = None
    info["drafter"] = drafter_signs(cfg)
    if isinstance(cfg, dict):
        archs = cfg.get("architectures")
        info["architectures"] = [a for a in archs if isinstance(a, str)][:4] if isinstance(archs, list) else None
        ids = (cfg.get("dflash_config") or {}).get("target_layer_ids") if isinstance(cfg.get("dflash_config"),
                                                                                      dict) else None
        if isinstance(ids, list) and len(ids) <= 64 and all(isinstance(i, int) for i in ids):
            info["target_layer_ids"] = ids
    return info


def _hub_config(repo_dir, snap, budget):
    """snapshots/SNAP/config.json of one models--ORG--NAME directory: a symlink is followed only into the same
    repo directory (its blobs/)."""
    path = os.path.join(repo_dir, "snapshots", snap, "config.json")
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if _stat.S_ISLNK(st.st_mode):
        try:
            target = os.path.realpath(path)
            root = os.path.realpath(repo_dir)
        except (OSError, ValueError):
            target, root = None, None
        if not target or not root or os.path.commonpath([target, root]) != root or target == root:
            budget["files"] += 1
            return {"path": path, "error": "a symlink that leaves %s (not followed)" % repo_dir}
        info = _read(target, budget)
        info.update(path=path, realpath=target)
        return info
    return _read(path, budget)


def act_drafter_scan(a):
    """-> {configs: [{path, kind (hub|models), hub_id, revision, realpath, size, sha256, drafter (signs), error,
    parse_error}], roots, truncated, notes, seconds}. Args: hf_homes (each HF_HOME; its hub/ is looked in, and
    /root/.cache/huggingface/hub always), model_dirs (directories whose subdirectories hold models; /root/models
    always), budget_s."""
    t0 = now()
    budget_s = max(0.5, min(float(a.get("budget_s", 5)), 30.0))
    budget = {"end": t0 + budget_s, "files": 0, "notes": []}
    # a read on a hung mount cannot block the tool: it gives up after its own timeout, and this process ends too
    signal.alarm(int(budget_s) + 5)
    hubs = list(dict.fromkeys([os.path.join(os.path.normpath(h), "hub") for h in list(a.get("hf_homes") or [])[:16]
                               if isinstance(h, str) and h.startswith("/")] + [DEFAULT_HUB]))
    models = list(dict.fromkeys(os.path.normpath(d) for d in [DEFAULT_MODELS] + list(a.get("model_dirs") or [])[:16]
                                if isinstance(d, str) and d.startswith("/")))
    configs, truncated = [], None
    try:
        for hub in hubs:
            for repo in _dirs(hub, budget):
                if not repo.startswith("models--"):
                    continue
                repo_dir = os.path.join(hub, repo)
                parts = repo[len("models--"):].split("--", 1)
                hub_id = "/".join(parts) if len(parts) == 2 else None
                snaps = os.path.join(repo_dir, "snapshots")
                if os.path.islink(snaps):  # would lead the walk out of the repo directory
                    budget["notes"].append("%s is a symlink (not followed)" % snaps)
                    continue
                for snap in _dirs(snaps, budget):
                    info = _hub_config(repo_dir, snap, budget)
                    if info is not None:
                        info.update(kind="hub", hub_id=hub_id, revision=snap, hf_home=os.path.dirname(hub))
                        configs.append(info)
        for d in models:
            for sub in _dirs(d, budget):
                path = os.path.join(d, sub, "config.json")
                try:
                    os.lstat(path)
                except OSError:
                    continue
                info = _read(path, budget)
                info.update(kind="models", dir=os.path.join(d, sub))
                configs.append(info)
    except _Stop as e:
        truncated = str(e)
    finally:
        signal.alarm(0)
    seen, out = set(), []
    for c in configs:  # a models dir given twice (a parent of two playbooks' paths) is listed once
        if c["path"] not in seen:
            seen.add(c["path"])
            out.append(c)
    return {"configs": out, "roots": {"hub": hubs, "models": models}, "truncated": truncated,
            "notes": budget["notes"][:20], "seconds": round(now() - t0, 3)}
