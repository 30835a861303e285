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
import re
import shutil
import stat
import tempfile

from .core import now
from .files import UnsafeDirectory, open_beneath, open_dir, read_capped, write_at, write_json_atomic
from .weights import FETCH_RECORDS, FetchError, _record_path, bad_record, safe_dir

MARKER = ".deploy-store.json"
LINK_MARKER = ".deploy-store-link"
FORMAT = "vllm-pve-deploy-store/1"
HUB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
CONFIG_MAX = 16 << 20  # a drafter's config.json copied out of the store: more is not a config


def act_store(a):
    op = a.get("op")
    if op == "mark":
        return _mark(a["store"])
    if op == "link":
        return _link(a)
    return {"ok": False, "message": "unknown op %r" % op}


def _mark(store):
    """On the host: the store directory and its marker (made once; read back)."""
    try:
        safe_dir(store, "model store")
    except FetchError as e:
        return {"ok": False, "message": e.message, "fix": e.fix}
    path = os.path.join(store, MARKER)
    try:
        dfd = open_dir(store)
    except (OSError, UnsafeDirectory) as e:
        return {"ok": False, "message": "the model store %s: %s" % (store, e)}
    try:
        cur = _read_marker(dfd)
        if cur is None:
            # a new marker through the store's fd: an O_EXCL temp file of a random name, renamed over whatever
            # is there (a link planted at the marker's name is replaced, never written through)
            write_at(dfd, MARKER, (json.dumps({"format": FORMAT, "id": os.urandom(12).hex(), "made_at": now()})
                                   + "\n").encode(), 0o644)
            cur = _read_marker(dfd)
        _open_blobs(store)
        st = os.fstatvfs(dfd)
    except OSError as e:
        return {"ok": False, "message": "the store's marker %s: %s" % (path, e.strerror or e)}
    finally:
        os.close(dfd)
    if cur is None:
        return {"ok": False, "message": "the store's marker %s could not be read back" % path}
    return {"ok": True, "id": cur["id"], "free": st.f_bavail * st.f_frsize}


def _open_blobs(store):
    """blobs/ directories an older deploy left 0700 (its ranges record's write did) made 0755 again: a uid-mapped
    container reads the store as "others". Only deploy's own (root's, 0700 exactly), walked without following a
    link (open_beneath); anything odd is left alone for the fetch to refuse, named."""
    try:
        repos = [n for n in os.listdir(os.path.join(store, "hub")) if n.startswith("models--")][:10000]
    except OSError:
        return
    for n in repos:
        try:
            fd = open_beneath(store, os.path.join(store, "hub", n, "blobs"))
        except (OSError, UnsafeDirectory):
            continue
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) == 0o700:
                os.fchmod(fd, 0o755)
        finally:
            os.close(fd)


def _read_marker(dfd):
    """The marker in the directory dfd (read_capped: no link followed, no FIFO waited on), None if not ours."""
    try:
        m = json.loads(read_capped(dfd, MARKER, 4096, "store marker").decode("utf-8"))
        if m.get("format") == FORMAT and isinstance(m.get("id"), str) and len(m["id"]) == 24:
            return m
    except (OSError, ValueError, AttributeError):
        pass
    return None


def _read_marker_at(mount):
    try:
        dfd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_marker(dfd)
    finally:
        os.close(dfd)


def bad_item(it, mount):
    """Why a store item sent to the container cannot be linked (None when it can): its hub ORG/NAME, commit and
    file names as a record's (weights.bad_record), its snapshot exactly MOUNT's for that hub and commit, its
    destination an absolute path. The host's record was read from the store, which a container may have
    written: a name with '..' would make links outside DEST (issue 50)."""
    why = bad_record(it)
    if why:
        return why
    if not isinstance(it.get("hub"), str) or not HUB_RE.fullmatch(it["hub"]) or ".." in it["hub"]:
        return "hub %r is not ORG/NAME" % (it.get("hub"),)
    want = os.path.join(mount, "hub", "models--" + it["hub"].replace("/", "--"), "snapshots", it["commit"])
    if it.get("snapshot") != want:
        return "snapshot %r is not %s" % (it.get("snapshot"), want)
    dest = it.get("dest")
    if not isinstance(dest, str) or not dest.startswith("/") or os.path.normpath(dest) in ("/", "") \
            or ".." in dest.split("/"):
        return "destination %r is not an absolute path" % (dest,)
    return None


def _link(a):
    """In the container: every item's DEST linked into the store's snapshot, or what stops it (kind: mount,
    writable, missing, unsafe)."""
    mount, store, want = a["mount"], a["store"], a["id"]
    m = _read_marker_at(mount)
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
        why = bad_item(it, mount)
        if why:
            return {"ok": False, "kind": "record", "role": it.get("role"),
                    "message": "the store's record of %s cannot be trusted: %s; nothing was linked" % (
                        it.get("hub"), why)}
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
    parent = os.path.dirname(dest)
    os.makedirs(parent, mode=0o755, exist_ok=True)
    try:
        os.close(open_dir(parent))  # root's (or ours), not writable by others without the sticky bit
    except (OSError, UnsafeDirectory) as e:
        raise _Refused("%s: %s" % (dest, e))
    if os.path.lexists(dest):
        if os.path.islink(dest) or not os.path.isdir(dest):
            raise _Refused("%s exists and is not a directory: not replacing it with the store's links" % dest)
        _owned_by_us(dest, "the destination")
        mk = os.path.join(dest, LINK_MARKER)
        if not os.path.lexists(mk) or os.path.islink(mk) or not os.path.isfile(mk):
            raise _Refused("%s is a directory of files (an earlier copy?), not deploy's links into the store: not "
                           "replacing it" % dest)
        _owned_by_us(mk, "its marker")
    links = {f["name"]: os.path.join(snap, f["name"]) for f in it["files"]}
    if keep_cfg:
        links.pop("config.json", None)
    if os.path.isdir(dest) and _same(dest, links, keep_cfg, snap):
        return False
    tmp = tempfile.mkdtemp(prefix=".%s.store-" % os.path.basename(dest), dir=parent)
    try:
        os.chmod(tmp, 0o755)
        for name, target in sorted(links.items()):
            p = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.symlink(target, p)
        if keep_cfg:
            old_cfg = os.path.join(dest, "config.json")
            data = _read_config(old_cfg, nofollow=True)  # the pinned bytes, in deploy's own checked directory
            if data is None:
                data = _read_config(os.path.join(snap, "config.json"), nofollow=False)  # the store's (a link)
            if data is not None:
                tfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    write_at(tfd, "config.json", data, 0o644)  # copied from the one open file: no check-then-copy
                finally:
                    os.close(tfd)
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


def _owned_by_us(path, what):
    st = os.lstat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _Refused("%s is owned by uid %d with mode %o: %s is not deploy's (root's, writable by no one else); "
                       "another user could swap its links after they were checked; not used"
                       % (path, st.st_uid, stat.S_IMODE(st.st_mode), what))


def _read_config(path, nofollow):
    """The bytes of a config.json (files.read_capped: a regular file, at most CONFIG_MAX, read from one open
    descriptor, O_NONBLOCK: a FIFO does not hang us), None when there is none or it is not one."""
    try:
        return read_capped(None, path, CONFIG_MAX, "config", follow=not nofollow)
    except OSError:
        return None


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
