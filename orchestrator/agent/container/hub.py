"""`hub_drafter`: a deploy-owned drafter directory for a hub id (the pinned config.json and links to the snapshot's
other files), built in a temp dir and renamed into place; the hub cache is only read."""

import hashlib
import os

from .core import sha256_file, sha256_or_none
from .verify import resolve_drafter_path
from . import core


def act_hub_drafter(a):
    """Serve the pinned config for a hub drafter without writing the hub cache: DIR (deploy's own, under the
    state dir) holds config.json = PAYLOAD (the payload on stdin) and a symlink to every other file of the snapshot vLLM would read.
    Built in a temp dir and renamed into place; unchanged when it already matches. The hub cache is only read."""
    import shutil

    want, d = a["sha256"], a["dir"]
    data = core.PAYLOAD
    if data is None or hashlib.sha256(data).hexdigest() != want:
        return {"ok": False, "stage": "payload", "message": "payload does not match the pinned sha256 (transfer error)"}
    loc = resolve_drafter_path({"hub_id": a["hub_id"], "hf_home": a.get("hf_home"), "revision": a.get("revision")})
    res = {"path": os.path.join(d, "config.json"), "dir": d, "hub_id": a["hub_id"], "changed": False,
           "backup": None, "snapshot": None, "revision": loc.get("revision")}
    if not loc.get("path"):
        res.update(ok=False, stage="snapshot", message=loc.get("error"))
        return res
    snap = os.path.dirname(loc["path"])
    res["snapshot"] = snap
    res["snapshot_config_sha256"] = sha256_or_none(loc["path"])
    links = {n: os.path.join(snap, n) for n in sorted(os.listdir(snap)) if n != "config.json"}
    res["links"] = sorted(links)
    cfg = os.path.join(d, "config.json")
    before = sha256_or_none(cfg) if os.path.isfile(cfg) and not os.path.islink(cfg) else None
    res["before_sha256"] = before
    if before == want and os.path.isdir(d) and not os.path.islink(d):
        have = set(os.listdir(d)) - {"config.json"}
        if have == set(links) and all(os.path.islink(os.path.join(d, n)) and
                                      os.readlink(os.path.join(d, n)) == t for n, t in links.items()):
            res.update(ok=True, after_sha256=before)
            return res
    import tempfile

    parent = os.path.dirname(d)
    tmp = None
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".%s.tmp-" % os.path.basename(d), dir=parent)  # unpredictable, 0700
        fd = os.open(os.path.join(tmp, "config.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        for n, t in links.items():
            os.symlink(t, os.path.join(tmp, n))
        old = None
        if os.path.lexists(d):
            if os.path.islink(d) or not os.path.isdir(d):
                res.update(ok=False, stage="directory", message="%s exists and is not a directory of ours" % d)
                shutil.rmtree(tmp, ignore_errors=True)
                return res
            old = tmp + ".old"  # beside the unpredictable temp name
            os.rename(d, old)
        os.rename(tmp, d)
        if old:
            shutil.rmtree(old)  # deploy's own directory of symlinks and one config: never follows the links
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        res.update(ok=False, stage="write", message="cannot build %s: %s" % (e.filename or d, e.strerror))
        return res
    res["changed"] = True
    res["after_sha256"] = sha256_file(cfg)
    res["ok"] = res["after_sha256"] == want
    if not res["ok"]:
        res.update(stage="readback", message="read back %s, expected %s" % (res["after_sha256"], want))
    return res
