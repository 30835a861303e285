"""The weights a deployment reads, as `deploy fetch` keeps them: the fetch state and records (one per model or
drafter: where it came from, its commit, when it was verified), the manifest of a snapshot, git blob hashes of
the files, and `serving_weights` for `deploy status`. Shared by fetch.py and fetch_runner.py; imports no network
code."""

import json
import os
import re

from .core import LazyRe, _some, sha256_file
from .files import _read_json


FETCH_STATE = "fetch.json"


FETCH_LOCK = "fetch.lock"


FETCH_RECORDS = "fetched"


FETCH_VAR = "VLLM_PVE_DEPLOY_FETCH"


FETCH_FINAL = ("ok", "failed", "timeout", "killed")


MANIFEST_NAME = "deploy-manifest.json"


MANIFEST_FORMAT = "vllm-pve-deploy-manifest/1"


COMMIT_RE = LazyRe(r"^[0-9a-f]{40}$")


CHUNK = 1 << 20


class FetchError(Exception):
    def __init__(self, message, fix="", kind="failed", **details):
        Exception.__init__(self, message)
        self.message, self.fix, self.kind, self.details = message, fix, kind, details


def _repo_dir(hf_home, hub):
    return os.path.join(hf_home, "hub", "models--" + hub.replace("/", "--"))


def git_blob_sha1(path):
    size = os.path.getsize(path)
    import hashlib  # here, as in the two functions below: status loads this module, rarely hashes (OpenSSL, ~2 ms)

    h = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_path(state_dir, dest):
    import hashlib

    return os.path.join(state_dir, FETCH_RECORDS, hashlib.sha1(dest.encode()).hexdigest()[:16] + ".json")


def fetch_record(state_dir, dest):
    return _read_json(_record_path(state_dir, dest))


def _final_path(item, commit, name):
    if item["dest_kind"] == "cache":
        return os.path.join(_repo_dir(item["hf_home"], item["hub"]), "snapshots", commit, name)
    return os.path.join(item["dest"], name)


def _item_dest(item):
    """What `status`/`verify` call the destination: the directory, or the snapshot root of the hub cache."""
    return item["dest"] if item["dest_kind"] == "dir" else _repo_dir(item["hf_home"], item["hub"])


def in_place(item, state_dir, rehash=False):
    """Is this item's verified snapshot in place? From the record fetch wrote when it verified and installed it:
    the same source and revision, every file there with its recorded size (rehash: and its recorded hash). The
    drafter's config.json may hold the pinned bytes instead of the hub's (the pin wins): it only has to exist."""
    rec = fetch_record(state_dir, _item_dest(item))
    out = {"role": item["role"], "dest": _item_dest(item), "record": None, "in_place": False, "missing": [],
           "changed": []}
    if not rec:
        out["why"] = "never fetched here"
        return out
    out["record"] = {k: rec.get(k) for k in ("role", "dest", "hub", "revision", "commit", "source", "verified_at", "total_bytes",
                                              "files_n", "endpoint")}
    want_rev = item.get("revision")
    same_source = (rec.get("hub") == item.get("hub")) if item.get("hub") else True
    if item.get("source_path") and rec.get("source") != "path:" + item["source_path"] and not item.get("hub"):
        same_source = False
    if not same_source or (want_rev and want_rev not in (rec.get("revision"), rec.get("commit"))):
        out["why"] = "%s was fetched at %s@%s, the playbook asks for %s@%s" % (
            out["dest"], rec.get("hub") or rec.get("source"), rec.get("revision"), item.get("hub") or
            item.get("source_path"), want_rev or "(any)")
        return out
    for f in rec.get("files") or []:
        p = _final_path(item, rec["commit"], f["name"])
        if item["role"] == "drafter" and f["name"] == "config.json" and os.path.isfile(p):
            continue  # the pinned bytes replace the hub's: checked by the pin-and-verify step
        try:
            size = os.path.getsize(p)
        except OSError:
            out["missing"].append(f["name"])
            continue
        if size != f["size"]:
            out["changed"].append({"name": f["name"], "expected": "%d bytes" % f["size"], "found": "%d bytes" % size})
            continue
        if rehash:
            got = _hash_as(p, f)
            if got != (f.get("sha256") or f.get("blob")):
                out["changed"].append({"name": f["name"], "expected": f.get("sha256") or f.get("blob"), "found": got})
    out["in_place"] = not out["missing"] and not out["changed"]
    if not out["in_place"]:
        out["why"] = "%s: %s" % (out["dest"], "; ".join(
            (["missing: " + ", ".join(_some(out["missing"]))] if out["missing"] else [])
            + ["%s changed (recorded %s, found %s)" % (c["name"], c["expected"], c["found"]) for c in out["changed"]]))
    return out


def _hash_as(path, f):
    return sha256_file(path) if f.get("sha256") else git_blob_sha1(path)


def read_manifest(item):
    path = os.path.join(item["incoming"], MANIFEST_NAME)
    m = _read_json(path)
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), list):
        raise FetchError("%s: no manifest (%s) in the copied directory %s, or not format %s" % (
            item["role"], MANIFEST_NAME, item["source_path"], MANIFEST_FORMAT),
            fix="write it on the machine that has the files: deploy manifest DIR (or deploy fetch PLAYBOOK "
                "--manifest FILE in a container that fetched from the hub), and copy it into %s" % item["source_path"])
    files = []
    for f in m["files"]:
        n = f.get("name") or ""
        if n.startswith("/") or ".." in n.split("/") or n == MANIFEST_NAME or not n:
            raise FetchError("manifest %s: unsafe file name %r" % (item["source_path"], n))
        files.append({"name": n, "size": int(f["size"]), "sha256": f.get("sha256"), "blob": f.get("blob")})
    import hashlib

    commit = m.get("commit") or hashlib.sha1(json.dumps(m["files"], sort_keys=True).encode()).hexdigest()
    return {"commit": commit, "files": files, "hub": m.get("hub"), "revision": m.get("revision")}


def _staging(item, commit):
    if item["dest_kind"] == "cache":
        return os.path.join(_repo_dir(item["hf_home"], item["hub"]), "blobs")
    d = item["dest"].rstrip("/")
    return os.path.join(os.path.dirname(d), ".%s.deploy-fetch" % os.path.basename(d), commit[:12])


def ours(path):
    """A file (or directory) this fetch may trust without hashing it again: not a symlink, owned by the user the
    agent runs as, writable by no one else. A planted file (another owner, or group/other-writable) is not."""
    import stat

    try:
        s = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(s.st_mode) and s.st_uid == os.geteuid() and not s.st_mode & 0o022


def safe_dir(path, what):
    """Create PATH (0755) if missing, then refuse it unless it is a real directory of ours that no one else can
    write (a staging or destination directory under a shared path: another user could plant or swap files)."""
    import stat

    os.makedirs(path, mode=0o755, exist_ok=True)
    parent = os.path.dirname(os.path.abspath(path))
    ps = os.stat(parent)
    if ps.st_mode & 0o002 and not ps.st_mode & stat.S_ISVTX:
        raise FetchError("the %s %s is in %s, which anyone can write (mode %o, no sticky bit): another user could "
                         "swap it; nothing was downloaded into it" % (what, path, parent, stat.S_IMODE(ps.st_mode)),
                         fix="point the playbook's path at a directory no other user can write", kind="unsafe",
                         path=path)
    s = os.lstat(path)
    if stat.S_ISLNK(s.st_mode) or not stat.S_ISDIR(s.st_mode) or s.st_uid != os.geteuid() or s.st_mode & 0o022:
        raise FetchError("the %s %s is not a directory of ours that only we can write (owner uid %d, mode %o%s): "
                         "another user could plant or swap files there; nothing was downloaded into it" % (
                             what, path, s.st_uid, stat.S_IMODE(s.st_mode), ", a symlink" if stat.S_ISLNK(s.st_mode)
                             else ""),
                         fix="point the playbook's path at a directory owned by root and not writable by others "
                             "(not under /tmp or another shared directory), or remove %s and run deploy fetch again"
                         % path, kind="unsafe", path=path)
    return path


def _partial(item, commit, f):
    st = _staging(item, commit)
    if item["dest_kind"] == "cache":
        etag = f["sha256"] or f["blob"]
        return os.path.join(st, etag + ".incomplete"), os.path.join(st, etag)
    return os.path.join(st, f["name"] + ".incomplete"), os.path.join(st, f["name"])


def _existing_dir(path):
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path or "/"


def _fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024


def verify_file(item, f, part, done):
    want = f["sha256"] or f["blob"]
    got = _hash_as(part, f)
    if got != want:
        os.unlink(part)  # a resume would only append to bad bytes
        raise FetchError("%s: %s does not match the %s's record: expected %s %s, found %s (%d bytes); the file was "
                         "removed, nothing was moved into place" % (
                             item.get("hub") or item.get("source_path"), f["name"],
                             "hub" if item.get("hub") and not item.get("source_path") else "manifest",
                             "sha256" if f["sha256"] else "git blob id", want, got, f["size"]),
                         fix="run deploy fetch again (it downloads the file afresh); if it fails the same way, the "
                             "mirror serves wrong bytes", kind="mismatch", file=f["name"], expected=want, found=got)
    os.rename(part, done)
    return got


def _free(path):
    st = os.statvfs(_existing_dir(path))
    return st.f_bavail * st.f_frsize


def serving_weights(st, state_dir):
    """The fetch records (deploy fetch) of what the state file's server reads: its model directory (argv[2]) and
    its drafter (a directory, or the hub cache a deploy-owned drafter dir links into). [] when none."""
    try:
        names = sorted(os.listdir(os.path.join(state_dir, FETCH_RECORDS)))
    except OSError:
        return []
    argv = st.get("argv") or []
    model = argv[2] if len(argv) > 2 and isinstance(argv[2], str) else None
    dp = os.path.dirname(st.get("drafter_path") or "") or None
    out = []
    for n in names:
        rec = _read_json(os.path.join(state_dir, FETCH_RECORDS, n))
        if not isinstance(rec, dict):
            continue
        dest = rec.get("dest")
        hit = dest in (model, dp) or (dp and rec.get("dest_kind") == "cache"
                                      and os.path.basename(dest or "") == "models--" + os.path.basename(dp))
        if hit:
            out.append({k: rec.get(k) for k in ("role", "hub", "revision", "commit", "dest", "source", "verified_at")})
    return out
