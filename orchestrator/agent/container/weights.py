"""The weights a deployment reads, as `deploy fetch` keeps them: the fetch state and records (one per model or
drafter: where it came from, its commit, when it was verified), the manifest of a snapshot, git blob hashes of
the files, and `serving_weights` for `deploy status`. Shared by fetch.py and fetch_runner.py; imports no network
code."""

import os
import stat

from .core import LazyRe, _some
from .files import UnsafeDirectory, _read_json, open_beneath


FETCH_STATE = "fetch.json"
FETCH_LOCK = "fetch.lock"
FETCH_RECORDS = "fetched"
FETCH_VAR = "VLLM_PVE_DEPLOY_FETCH"
FETCH_FINAL = ("ok", "failed", "timeout", "killed")
MANIFEST_NAME = "deploy-manifest.json"
MANIFEST_FORMAT = "vllm-pve-deploy-manifest/1"
COMMIT_RE = LazyRe(r"^[0-9a-f]{40}$")
SHA256_RE = LazyRe(r"^[0-9a-f]{64}$")
MAX_FILE_BYTES = 1 << 42  # 4 TiB: what a hub (or a record) may say one file is; larger is not believed
MAX_FILES = 100000  # files in one listing, manifest or record
MAX_NAME = 1024  # characters in one file name of a listing
CHUNK = 1 << 20


class FetchError(Exception):
    def __init__(self, message, fix="", kind="failed", **details):
        Exception.__init__(self, message)
        self.message, self.fix, self.kind, self.details = message, fix, kind, details


def bad_name(n):
    """Why N cannot be a file name of a snapshot (None when it can): relative, no '.', '..' or empty component,
    no NUL or control character, at most MAX_NAME characters. Checked where a hub's, a manifest's or a record's
    names enter (issue 50: a name is a path on the host)."""
    if not isinstance(n, str) or not n:
        return "not a file name"
    if len(n) > MAX_NAME:
        return "longer than %d characters" % MAX_NAME
    if n.startswith("/") or any(p in ("", ".", "..") for p in n.split("/")):
        return "not a plain relative path (absolute, or a '.', '..' or empty component)"
    if any(ord(c) < 32 or ord(c) == 127 for c in n):
        return "holds a control character"
    return None


def bad_file(f):
    """Why F ({"name", "size", "sha256", "blob"}) is not a believable file entry (None when it is): a safe name
    (bad_name), a size that is an integer from 0 to MAX_FILE_BYTES, sha256 64 and blob 40 lowercase hex digits
    (a hash becomes a file name in blobs/), at least one of them."""
    why = bad_name(f.get("name"))
    if why:
        return "file name %r: %s" % (f.get("name"), why)
    size = f.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        return "%s: size %r is not a number of bytes from 0 to %d" % (f["name"], size, MAX_FILE_BYTES)
    sha, blob = f.get("sha256"), f.get("blob")
    if sha is not None and not (isinstance(sha, str) and SHA256_RE.fullmatch(sha)):
        return "%s: sha256 %r is not 64 lowercase hex digits" % (f["name"], sha)
    if blob is not None and not (isinstance(blob, str) and COMMIT_RE.fullmatch(blob)):
        return "%s: git blob id %r is not 40 lowercase hex digits" % (f["name"], blob)
    if not sha and not blob:
        return "%s: no hash (neither sha256 nor git blob id)" % f["name"]
    return None


def bad_record(rec):
    """Why a fetch record (or a store item) cannot be trusted (None when it can): its commit 40 hex digits, its
    files (at most MAX_FILES) each bad_file-clean. A record lives where a container may have written it."""
    if not isinstance(rec, dict):
        return "not a record"
    if not isinstance(rec.get("commit"), str) or not COMMIT_RE.fullmatch(rec["commit"]):
        return "commit %r is not 40 hex digits" % (rec.get("commit"),)
    files = rec.get("files")
    if not isinstance(files, list) or len(files) > MAX_FILES:
        return "no list of at most %d files" % MAX_FILES
    for f in files:
        why = bad_file(f) if isinstance(f, dict) else "a file entry that is not an object"
        if why:
            return why
    return None


def int_size(v):
    """A size from JSON as an int (None when it is not an integral number: the caller says so)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _repo_dir(hf_home, hub):
    return os.path.join(hf_home, "hub", "models--" + hub.replace("/", "--"))


def hash_file(path, dfd=None, kind="sha256"):
    """sha256 (or the git blob id) of a regular file: opened O_NONBLOCK (a FIFO does not hang us), refused when
    it is not a regular file (a link to /dev/zero is not read forever), read up to the size it had when opened.
    With dfd: PATH is a name in that directory, opened O_NOFOLLOW."""
    import hashlib  # here: status loads this module, rarely hashes (OpenSSL, ~2 ms)

    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags | os.O_NOFOLLOW, dir_fd=dfd) if dfd is not None else os.open(path, flags)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(22, "not a regular file (mode %o): not hashed" % st.st_mode, path)
        size = st.st_size
        h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size)
        left = size
        while left > 0:
            chunk = fh.read(min(CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        return h.hexdigest()


def _record_path(state_dir, dest):
    import hashlib

    return os.path.join(state_dir, FETCH_RECORDS, hashlib.sha1(dest.encode()).hexdigest()[:16] + ".json")


def fetch_record(state_dir, dest, checked=True):
    """The fetch record of DEST; checked (the default): None unless bad_record finds nothing wrong with it (a
    record in a shared store may have been written by a container: its names and commit become paths)."""
    rec = _read_json(_record_path(state_dir, dest))
    if checked and rec is not None and bad_record(rec):
        return None
    return rec


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
    rec = fetch_record(state_dir, _item_dest(item), checked=False)
    out = {"role": item["role"], "dest": _item_dest(item), "record": None, "in_place": False, "missing": [],
           "changed": []}
    if not rec:
        out["why"] = "never fetched here"
        return out
    out["record"] = {k: rec.get(k) for k in ("role", "dest", "hub", "revision", "commit", "source", "verified_at", "total_bytes",
                                              "files_n", "endpoint")}
    bad = bad_record(rec)
    if bad:
        out["record"] = None
        out["why"] = ("its record %s is not one deploy writes (%s): not trusted; fetched again"
                      % (_record_path(state_dir, _item_dest(item)), bad))
        return out
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
        if item["dest_kind"] == "cache":
            link = _snapshot_link(item, rec["commit"], f)
            if link is None:
                out["missing"].append(f["name"])
                continue
            if link is not True:
                out["changed"].append({"name": f["name"], "expected": "a link to blobs/%s" % (f.get("sha256") or
                                                                                             f.get("blob")),
                                       "found": link})
                continue
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
            (["missing: " + _some(out["missing"])] if out["missing"] else [])
            + ["%s changed (recorded %s, found %s)" % (c["name"], c["expected"], c["found"]) for c in out["changed"]]))
    return out


def snapshot_target(f):
    """Where the snapshot's link for F points (relative, as the hub cache has it): ../../blobs/ETAG, one more ../
    per directory in its name."""
    return "../" * (f["name"].count("/") + 2) + "blobs/" + (f.get("sha256") or f.get("blob"))


def _snapshot_link(item, commit, f):
    """True when the snapshot's entry for F is our link to its blob, reached without following any planted link
    on the way (open_beneath from hf_home); else what was found instead."""
    base = _repo_dir(item["hf_home"], item["hub"])
    d = os.path.dirname(os.path.join(base, "snapshots", commit, f["name"]))
    try:
        dfd = open_beneath(item["hf_home"], d)
    except FileNotFoundError:
        return None
    except (OSError, UnsafeDirectory) as e:
        return str(e)
    try:
        return True if os.readlink(os.path.basename(f["name"]), dir_fd=dfd) == snapshot_target(f) else \
            "a link elsewhere"
    except FileNotFoundError:
        return None
    except OSError as e:
        return "not a link (%s)" % (e.strerror or e)
    finally:
        os.close(dfd)


def _hash_as(path, f, dfd=None):
    return hash_file(path, dfd, "sha256" if f.get("sha256") else "blob")


def read_manifest(item):
    path = os.path.join(item["incoming"], MANIFEST_NAME)
    m = _read_json(path)
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), list):
        raise FetchError("%s: no manifest (%s) in the copied directory %s, or not format %s" % (
            item["role"], MANIFEST_NAME, item["source_path"], MANIFEST_FORMAT),
            fix="write it on the machine that has the files: deploy manifest DIR (or deploy fetch PLAYBOOK "
                "--manifest FILE in a container that fetched from the hub), and copy it into %s" % item["source_path"])
    files = []
    if len(m["files"]) > MAX_FILES:
        raise FetchError("manifest %s: %d files, more than %d" % (item["source_path"], len(m["files"]), MAX_FILES))
    for f in m["files"]:
        f = f if isinstance(f, dict) else {}
        e = {"name": f.get("name"), "size": int_size(f.get("size")), "sha256": f.get("sha256"), "blob": f.get("blob")}
        why = "it is the manifest itself" if e["name"] == MANIFEST_NAME else bad_file(e)
        if why:
            raise FetchError("manifest %s: unsafe or unbelievable entry: %s" % (item["source_path"], why),
                             fix="write the manifest again with deploy manifest DIR", kind="unsafe")
        files.append(e)
    import hashlib
    import json

    commit = m.get("commit") or hashlib.sha1(json.dumps(m["files"], sort_keys=True).encode()).hexdigest()
    if not isinstance(commit, str) or not COMMIT_RE.fullmatch(commit):
        raise FetchError("manifest %s: commit %r is not 40 hex digits" % (item["source_path"], commit),
                         fix="write the manifest again with deploy manifest DIR", kind="unsafe")
    return {"commit": commit, "files": files, "hub": m.get("hub"), "revision": m.get("revision")}


def _staging(item, commit):
    if item["dest_kind"] == "cache":
        return os.path.join(_repo_dir(item["hf_home"], item["hub"]), "blobs")
    d = item["dest"].rstrip("/")
    return os.path.join(os.path.dirname(d), ".%s.deploy-fetch" % os.path.basename(d), commit[:12])


def ours(path):
    """A file (or directory) this fetch may trust without hashing it again: not a symlink, owned by the user the
    agent runs as, writable by no one else. A planted file (another owner, or group/other-writable) is not."""
    try:
        s = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(s.st_mode) and s.st_uid == os.geteuid() and not s.st_mode & 0o022


def safe_dir(path, what):
    """Create PATH (0755) if missing, then refuse it unless it is a real directory of ours that no one else can
    write (a staging or destination directory under a shared path: another user could plant or swap files)."""
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


def stage_root(item):
    """The trusted directory the item's staging lies under (the playbook names it): the hub cache's hf_home, or
    the destination's parent. Everything below it is opened with open_beneath (no link followed)."""
    if item["dest_kind"] == "cache":
        return item["hf_home"]
    return os.path.dirname(item["dest"].rstrip("/")) or "/"


def stage_fd(item, path, create=True):
    """An fd of the directory PATH (a partial's, a staged file's), walked from stage_root (open_beneath);
    an UnsafeDirectory becomes a FetchError naming it."""
    try:
        return open_beneath(stage_root(item), path, 0o755 if create else None)
    except UnsafeDirectory as e:
        raise FetchError("%s: %s" % (item["role"], e), fix="remove what was planted there (the message names it), "
                         "then run deploy fetch again", kind="unsafe", path=path) from None


def _partial(item, commit, f):
    st = _staging(item, commit)
    if item["dest_kind"] == "cache":
        etag = f["sha256"] or f["blob"]
        if not (SHA256_RE.fullmatch(etag or "") or COMMIT_RE.fullmatch(etag or "")):
            raise FetchError("%s: %s: hash %r is not hex: not used as a file name" % (item["role"], f["name"], etag),
                             kind="unsafe")
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


def verify_file(item, f, part, done, dfd=None):
    """Hash the partial PART (always: whatever a ranges record says) and, when it is the listing's, rename it to
    DONE (same directory); else remove it and fail naming both hashes. Through the directory's fd (stage_fd):
    PART opened O_NOFOLLOW|O_NONBLOCK, a regular file only."""
    want = f["sha256"] or f["blob"]
    own = dfd is None
    if own:
        dfd = stage_fd(item, os.path.dirname(part), create=False)
    try:
        pname, dname = os.path.basename(part), os.path.basename(done)
        try:
            got = _hash_as(pname, f, dfd)
        except OSError as e:
            raise FetchError("%s: %s: the downloaded file %s cannot be hashed (%s); nothing was moved into place" % (
                item.get("hub") or item.get("source_path"), f["name"], part, e.strerror or e),
                fix="remove %s and run deploy fetch again" % part, kind="unsafe") from None
        if got != want:
            os.unlink(pname, dir_fd=dfd)  # a resume would only append to bad bytes
            raise FetchError("%s: %s does not match the %s's record: expected %s %s, found %s (%d bytes); the file was "
                             "removed, nothing was moved into place" % (
                                 item.get("hub") or item.get("source_path"), f["name"],
                                 "hub" if item.get("hub") and not item.get("source_path") else "manifest",
                                 "sha256" if f["sha256"] else "git blob id", want, got, f["size"]),
                             fix="run deploy fetch again (it downloads the file afresh); if it fails the same way, the "
                                 "mirror serves wrong bytes", kind="mismatch", file=f["name"], expected=want, found=got)
        os.rename(pname, dname, src_dir_fd=dfd, dst_dir_fd=dfd)
        return got
    finally:
        if own:
            os.close(dfd)


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
            if str(rec.get("source") or "").startswith("store:"):
                out[-1]["privileged_container"] = not uid_mapped()
    return out


def uid_mapped():
    """Is this process's root uid-mapped (an unprivileged container)? Its /proc/self/uid_map is not the identity
    map `0 0 4294967295` of the host (and of a privileged container, whose root is the host's root)."""
    try:
        with open("/proc/self/uid_map") as fh:
            first = fh.read(4096).split()
    except OSError:
        return False
    return first[:3] != ["0", "0", "4294967295"]
