"""`store`: the host's shared model store (fetch.store, issue 38), both sides of it.

On the Proxmox host (the agent run by the host's own python3, not in a container):
  mark    the store directory made (0755, root's, writable by no one else) with its marker STORE/.deploy-store.json
          ({"format", "id"}): what a container reads through its mount point to prove that MOUNT is this store.
The files come with the `fetch` action run on the host (dest_kind cache, hf_home STORE: the hub cache's layout,
STORE/hub/models--ORG--NAME/{blobs,snapshots/COMMIT}), its records and its lock in STORE/.deploy-state.

In a container (the store mounted read-only at MOUNT, mpN: STORE,mp=MOUNT,ro=1):
  link    for each item: MOUNT is the store (marker id) and read-only, the snapshot's files are there with their
          recorded sizes; then DEST becomes deploy's own directory of links into the snapshot (built beside it, then
          renamed into place; its marker .deploy-store-link): vLLM reads DEST as before. A drafter's config.json is a
          copy, never a link (the pinned config is written there by up's write-config step; the store's copy is
          never modified, and could not be: the mount is read-only). The container's fetch record says where the
          files come from (source store:STORE), so status and verify show it.
"""

import json
import os
import shutil
import tempfile

from .core import now
from .files import open_dir, write_json_atomic
from .weights import FETCH_RECORDS, _record_path, safe_dir

MARKER = ".deploy-store.json"
LINK_MARKER = ".deploy-store-link"
FORMAT = "vllm-pve-deploy-store/1"


def act_store(a):
    op = a.get("op")
    if op == "mark":
        return _mark(a["store"])
    if op == "link":
        return _link(a)
    return {"ok": False, "message": "unknown op %r" % op}


def _mark(store):
    """On the host: the store directory and its marker (made once; read back)."""
    from .weights import FetchError

    try:
        safe_dir(store, "model store")
    except FetchError as e:
        return {"ok": False, "message": e.message, "fix": e.fix}
    path = os.path.join(store, MARKER)
    cur = _read_marker(path)
    if cur is None:
        tmp = os.path.join(store, ".%s.tmp-%d" % (MARKER, os.getpid()))
        with open(tmp, "w") as fh:
            json.dump({"format": FORMAT, "id": os.urandom(12).hex(), "made_at": now()}, fh)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.rename(tmp, path)
        cur = _read_marker(path)
    if cur is None:
        return {"ok": False, "message": "the store's marker %s could not be read back" % path}
    st = os.statvfs(store)
    return {"ok": True, "id": cur["id"], "free": st.f_bavail * st.f_frsize}


def _read_marker(path):
    try:
        with open(path) as fh:
            m = json.loads(fh.read(4096))
        if m.get("format") == FORMAT and isinstance(m.get("id"), str) and len(m["id"]) == 24:
            return m
    except (OSError, ValueError, AttributeError):
        pass
    return None


def _link(a):
    """In the container: every item's DEST linked into the store's snapshot, or what stops it (kind: mount,
    writable, missing, unsafe)."""
    mount, store, want = a["mount"], a["store"], a["id"]
    m = _read_marker(os.path.join(mount, MARKER))
    if m is None or m["id"] != want:
        return {"ok": False, "kind": "mount",
                "message": "%s in the container is not the host's store %s (%s)" % (
                    mount, store, "no store there: no mount point, the container not restarted since it was added, "
                                  "or the store directory made anew on the host since the container started" if m is None else "another store's marker")}
    if not os.statvfs(mount).f_flag & os.ST_RDONLY:
        return {"ok": False, "kind": "writable",
                "message": "the store %s is mounted read-write at %s: one container could change the weights every "
                           "other container serves" % (store, mount)}
    out = []
    for it in a["items"]:
        snap = it["snapshot"]
        missing, changed = [], []
        for f in it["files"]:
            p = os.path.join(snap, f["name"])
            try:
                size = os.stat(p).st_size
            except OSError:
                missing.append(f["name"])
                continue
            if size != f["size"]:
                changed.append("%s (%d bytes, recorded %d)" % (f["name"], size, f["size"]))
        if missing or changed:
            return {"ok": False, "kind": "missing", "role": it["role"],
                    "message": "the store's snapshot %s lacks what the host verified: %s" % (
                        snap, "; ".join((["missing " + ", ".join(missing[:5])] if missing else []) + changed[:5]))}
        try:
            changed_dir = _build(it)
        except _Refused as e:
            return {"ok": False, "kind": "unsafe", "role": it["role"], "message": str(e)}
        rec = {"role": it["role"], "hub": it["hub"], "revision": it.get("revision") or it["commit"],
               "commit": it["commit"], "endpoint": it.get("endpoint"), "source": "store:" + store, "store": store,
               "mount": mount, "snapshot": snap, "dest": it["dest"], "dest_kind": "dir", "verified_at": it.get(
                   "verified_at") or now(), "linked_at": now(), "total_bytes": sum(f["size"] for f in it["files"]),
               "files_n": len(it["files"]), "files": it["files"]}
        sd = a["state_dir"]
        os.close(open_dir(sd, 0o700))
        os.close(open_dir(os.path.join(sd, FETCH_RECORDS), 0o700))
        write_json_atomic(_record_path(sd, it["dest"]), rec)
        out.append({"role": it["role"], "dest": it["dest"], "changed": changed_dir, "files_n": len(it["files"])})
    return {"ok": True, "items": out}


class _Refused(Exception):
    pass


def _build(it):
    """DEST as a directory of links into the snapshot (a drafter's config.json a copy, an existing one kept: it may
    hold the pinned bytes); unchanged when it already is. -> whether it changed."""
    dest, snap = it["dest"].rstrip("/"), it["snapshot"]
    keep_cfg = it["role"] == "drafter"
    if os.path.lexists(dest):
        if os.path.islink(dest) or not os.path.isdir(dest):
            raise _Refused("%s exists and is not a directory: not replacing it with the store's links" % dest)
        if not os.path.isfile(os.path.join(dest, LINK_MARKER)):
            raise _Refused("%s is a directory of files (an earlier copy?), not deploy's links into the store: not "
                           "replacing it" % dest)
    links = {f["name"]: os.path.join(snap, f["name"]) for f in it["files"]}
    if keep_cfg:
        links.pop("config.json", None)
    if os.path.isdir(dest) and _same(dest, links, keep_cfg, snap):
        return False
    parent = os.path.dirname(dest)
    os.makedirs(parent, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".%s.store-" % os.path.basename(dest), dir=parent)
    try:
        os.chmod(tmp, 0o755)
        for name, target in sorted(links.items()):
            p = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.symlink(target, p)
        if keep_cfg:
            old_cfg = os.path.join(dest, "config.json")
            src = old_cfg if os.path.isfile(old_cfg) and not os.path.islink(old_cfg) else os.path.join(snap,
                                                                                                       "config.json")
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(tmp, "config.json"))
                os.chmod(os.path.join(tmp, "config.json"), 0o644)
        with open(os.path.join(tmp, LINK_MARKER), "w") as fh:
            json.dump({"format": FORMAT, "store": it["store"], "snapshot": snap, "commit": it["commit"]}, fh)
            fh.write("\n")
        old = None
        if os.path.isdir(dest):
            old = tmp + ".old"
            os.rename(dest, old)
        os.rename(tmp, dest)
        if old:
            shutil.rmtree(old)  # deploy's own links, a config copy and the marker: rmtree never follows a link
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def _same(dest, links, keep_cfg, snap):
    have = {}
    for dp, dns, fns in os.walk(dest):
        for n in fns + [d for d in dns if os.path.islink(os.path.join(dp, d))]:
            p = os.path.join(dp, n)
            rel = os.path.relpath(p, dest)
            if rel == LINK_MARKER or (keep_cfg and rel == "config.json"):
                continue
            have[rel] = os.readlink(p) if os.path.islink(p) else None
    cfg_ok = not keep_cfg or os.path.isfile(os.path.join(dest, "config.json")) or \
        not os.path.isfile(os.path.join(snap, "config.json"))
    return have == links and cfg_ok
