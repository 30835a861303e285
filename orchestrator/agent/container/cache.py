"""The agent's own cache in the container: the archive this agent runs from, kept under the state directory.

Each exec's program is BOOT (below, a few kilobytes at most): it runs the agent from this Python's compiled copy
STATE_DIR/vpd-agent/SHA256.TAG/ when every entry of it still has the stat its record (SHA256.TAG.rec) gives (see
compile_archive), else from STATE_DIR/vpd-agent/SHA256.zip, read through O_NOFOLLOW and checked by sha256 (with
zipimport); both only in a directory of root's with mode 0700. When neither is usable, BOOT asks for the archive
({"need": SHA} on stdout: an agent session answers on stdin, a one-shot exec is sent again with the archive
inline), checks what arrived and calls `store` (exec'd from the archive itself, so BOOT stays small). See
orchestrator/agent/archive.py.
"""

import os
import stat as _stat
import sys
import time

KEEP = 3  # archives kept in the cache: this one and the newest others (another deploy version may still run)
NEED_EXIT = 3

# BOOT uses this Python's compiled copy H.TAG/ when each entry's lstat is as its record says (compile_archive),
# else H.zip when its sha256 is H; the hash by the interpreter's built-in SHA-256 (no OpenSSL to load: ~1.5 ms less
# per exec), hashlib where that is absent. The compiled copy's path costs ~70 lstat() and no hash (issue 54).
BOOT = '''\
def _vpd(H, D):
    import os, sys
    P = None
    try:
        s = os.lstat(D)
        if s.st_uid in (0, os.geteuid()) and s.st_mode & 0o170777 == 0o40700:
            C = "%s/%s.%s" % (D, H, sys.implementation.cache_tag)
            try:
                f = os.open(C + ".rec", os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    t = os.fstat(f)
                    r = os.read(f, 1 << 20).decode().split("\\n") if t.st_uid in (0, os.geteuid()) and not \\
                        t.st_mode & 0o022 and t.st_mode >> 12 == 8 else []
                finally:
                    os.close(f)
                if r[0] == "vpd-agent-record 1 %d" % (len(r) - 2):
                    for x in r[1:-1]:
                        n, k = x.split("\\t")[:2]
                        t = os.lstat(C + n)
                        if "%d %d %d %d %d %o %d" % (t.st_dev, t.st_ino, t.st_size, t.st_mtime_ns, t.st_ctime_ns,
                                                     t.st_mode, t.st_uid) != k:
                            break
                    else:
                        P = C
            except (OSError, IndexError, ValueError):
                pass
            if P is None:
                try:
                    with os.fdopen(os.open(D + "/" + H + ".zip", os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                        if _sha(f.read()) == H:
                            P = D + "/" + H + ".zip"
                except OSError:
                    pass
    except (OSError, TypeError):
        pass
    if P is None:
        b = sys.modules["__main__"].__dict__.pop("_VPD_ARCHIVE", None)
        if b is None:
            print('{"need": "%s"}' % H, flush=True)
            if sys.argv[1:2] != ["session"]:
                sys.exit(3)
            b = sys.stdin.buffer.read(int(sys.stdin.buffer.readline()))
        if _sha(b) != H:
            print('{"result": {"error": "the agent archive arrived damaged (sha256 differs)", "traceback": ""}}',
                  flush=True)
            sys.exit(1)
        import io, zipfile
        g = {}
        exec(zipfile.ZipFile(io.BytesIO(b)).read("vpd_agent/cache.py"), g)
        P = g["store"](H, D, b)
    sys.path.insert(0, P)
    from vpd_agent import main
    main.run(sys.argv, H, D, P)


def _sha(b):
    try:
        from _sha2 import sha256
    except ImportError:
        try:
            from _sha256 import sha256
        except ImportError:
            from hashlib import sha256
    return sha256(b).hexdigest()
'''


def bootstrap(sha, cache_dir):
    """The program an exec sends (bytes): BOOT and the call with this archive's hash and cache directory."""
    return (BOOT + "_vpd(%r, %r)\n" % (sha, cache_dir)).encode()


def inline(data):
    """The archive as a line ahead of the bootstrap (base85: no quote or backslash in the literal)."""
    import base64

    return b"import base64 as _b; _VPD_ARCHIVE = _b.b85decode(b'" + base64.b85encode(data) + b"')\n"


def safe_dir(path):
    """Is path a real directory (not a symlink) of root's (or ours), mode 0700?"""
    s = os.lstat(path)
    return s.st_uid in (0, os.geteuid()) and s.st_mode & 0o170777 == 0o40700


def _write_new(path, data, dir_fd=None):
    """A new file (O_EXCL|O_NOFOLLOW, 0600) holding data, fsync'ed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def store(sha, cache_dir, data):
    """Keep the verified archive as CACHE/SHA.zip (temp file O_EXCL|O_NOFOLLOW, fsync, rename, fsync the
    directory), prune all but the newest KEEP, and return its path. Where no cache can be kept (no directory
    given, not root, a read-only file system, a directory that is not root's and 0700): a private temp file,
    removed at exit. Not in a state directory that others may write, nor where it does not exist."""
    if cache_dir:
        try:
            parent = os.path.dirname(cache_dir)
            try:
                os.mkdir(parent, 0o700)  # the state directory, as `lock` would create it
            except FileExistsError:
                p = os.lstat(parent)  # not in a state directory others may write (deploy refuses to use it)
                if not _stat.S_ISDIR(p.st_mode) or p.st_uid not in (0, os.geteuid()) or p.st_mode & 0o022:
                    raise OSError("the state directory %s is not deploy's own: no cache there" % parent)
            try:
                os.mkdir(cache_dir, 0o700)
            except FileExistsError:
                pass
            if not safe_dir(cache_dir):
                raise OSError("%s is not a directory of root's with mode 0700: not used" % cache_dir)
            dfd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                name = sha + ".zip"
                tmp = ".%s.tmp-%d-%s" % (sha, os.getpid(), os.urandom(6).hex())
                try:
                    _write_new(tmp, data, dfd)
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    os.unlink(tmp, dir_fd=dfd)
                    raise
                os.fsync(dfd)
                prune(dfd, name, cache_dir)
            finally:
                os.close(dfd)
            return os.path.join(cache_dir, name)
        except OSError:
            pass
    import atexit
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="vpd-agent-")
    atexit.register(shutil.rmtree, d, True)
    path = os.path.join(d, sha + ".zip")
    with open(path, "wb") as f:
        f.write(data)
    return path


def _remove(cache_dir, name):
    """Remove CACHE/name, a file or a compiled copy's directory (renamed aside first, so no exec finds half of it;
    rmtree does not follow links)."""
    path = os.path.join(cache_dir, name)
    if not os.path.isdir(path) or os.path.islink(path):
        os.unlink(path)
        return
    import shutil

    aside = os.path.join(cache_dir, ".%s.tmp-%d-%s" % (name, os.getpid(), os.urandom(6).hex()))
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def prune(dfd, keep_name, cache_dir=None):
    """Remove all but the newest KEEP archives (keep_name always stays) with their compiled copies and records,
    and temp files (and directories) of writers that died."""
    def mtime(n):
        return os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mtime

    def drop(n):
        try:
            _remove(cache_dir, n) if cache_dir else os.unlink(n, dir_fd=dfd)
        except OSError:
            pass

    try:
        names = os.listdir(dfd)
        others = sorted((mtime(n), n) for n in names if n.endswith(".zip") and n.count(".") == 1 and n != keep_name)
        for _, n in others[:max(0, len(others) - (KEEP - 1))]:
            for m in names:
                if m.startswith(n[:-len("zip")]):
                    drop(m)
        for n in os.listdir(dfd):
            if n.startswith(".") and ".tmp-" in n and time.time() - mtime(n) > 3600:
                drop(n)
    except OSError:
        pass


# This Python's compiled copy of an archive: CACHE/SHA.TAG/ (a directory of root's, 0700) holding vpd_agent/NAME.py
# and vpd_agent/__pycache__/NAME.TAG.pyc, and its record CACHE/SHA.TAG.rec (0600): a header line with the number of
# entries, then one line per entry (the directory itself, its two directories, every file): the path below
# SHA.TAG, the key "dev ino size mtime_ns ctime_ns mode(octal) uid" and, for a file, the sha256 of the bytes
# written (for a directory "d"). The files are checked once, when they are written from the hash-checked archive;
# BOOT then uses the copy only while every entry's lstat gives its key (a write, a rename, a chmod, chown or link
# moves ctime, which no one can set back; an entry added or removed moves its directory's), otherwise it runs from
# SHA.zip, checked by hash, and the agent calls compile_archive, which rehashes the copy (check_compiled) and
# writes a fresh record, or replaces it. Issue 54: the SHA-256 of the compiled zip and zipimport cost ~7 ms of CPU
# in every exec; ~70 lstat() cost well under 1 ms.
RECORD_HEAD = "vpd-agent-record 1"


def _key(st):
    return "%d %d %d %d %d %o %d" % (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode,
                                     st.st_uid)


def compiled_path(sha, cache_dir):
    return os.path.join(cache_dir, "%s.%s" % (sha, sys.implementation.cache_tag))


def _read_record(path):
    """[(relative path, key, sha256 or "d")] from a record of root's (or ours), not writable by others; None if
    it is missing, not such a file, or damaged (the header's count must match)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            return None
        lines = os.read(fd, 1 << 20).decode("utf-8", "replace").split("\n")
    finally:
        os.close(fd)
    if lines[0] != "%s %d" % (RECORD_HEAD, len(lines) - 2) or lines[-1] != "":
        return None
    rows = [x.split("\t") for x in lines[1:-1]]
    return rows if all(len(r) == 3 for r in rows) else None


def _write_record(cache_dir, name, rows):
    """CACHE/name.rec, atomically (temp file O_EXCL|O_NOFOLLOW, fsync, rename, fsync the directory)."""
    body = "".join("%s\t%s\t%s\n" % r for r in rows)
    body = "%s %d\n%s" % (RECORD_HEAD, len(rows), body)
    tmp = os.path.join(cache_dir, ".%s.rec.tmp-%d-%s" % (name, os.getpid(), os.urandom(6).hex()))
    try:
        _write_new(tmp, body.encode("utf-8"))
        os.rename(tmp, os.path.join(cache_dir, name + ".rec"))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def check_compiled(sha, cache_dir):
    """Is this Python's compiled copy usable? "ok": every entry's lstat gives its recorded key (what BOOT checks);
    "rehashed": some keys moved, but every file is still a regular file of root's (or ours), not writable by
    group or others, with the recorded sha256, and every directory a real one of root's, 0700, holding exactly
    the recorded entries: the record is written again with the new keys; None: missing, its record missing or
    damaged, or an entry differs (the copy must not be used)."""
    import hashlib

    base = compiled_path(sha, cache_dir)
    rows = _read_record(base + ".rec")
    if not rows or rows[0][0] != "" or rows[0][2] != "d":
        return None
    moved = []
    for rel, key, digest in rows:
        try:
            st = os.lstat(base + rel)
        except OSError:
            return None
        if _key(st) != key:
            moved.append((rel, digest, st))
    if not moved:
        return "ok"
    names = {r[0] for r in rows}
    fresh = {}
    for rel, digest, st in moved:
        path = base + rel
        if st.st_uid not in (0, os.geteuid()):
            return None
        if digest == "d":
            if st.st_mode & 0o170777 != 0o40700:
                return None
            inside = {rel + "/" + n for n in os.listdir(path)}
            if inside != {n for n in names if n.startswith(rel + "/") and "/" not in n[len(rel) + 1:]}:
                return None
        else:
            if not _stat.S_ISREG(st.st_mode) or st.st_mode & 0o022:
                return None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    if hashlib.sha256(f.read()).hexdigest() != digest:
                        return None
                    st = os.fstat(f.fileno())
            except OSError:
                return None
        fresh[rel] = _key(st)
    _write_record(cache_dir, os.path.basename(base), [(r, fresh.get(r, k), d) for r, k, d in rows])
    return "rehashed"


def compile_archive(sha, cache_dir, path):
    """This Python's compiled copy of the archive (CACHE/SHA.TAG/ and its record, above): every module as
    unchecked hash-based bytecode (PEP 552, without docstrings) in __pycache__ beside its source, so later execs
    of the same Python skip compiling (the agent's largest cost per exec) and import from a plain directory.
    A copy already there is checked (check_compiled) and kept, re-recorded, or replaced. Best effort: the agent
    runs from the source archive when this fails."""
    import hashlib
    import importlib.util
    import io
    import marshal
    import zipfile

    if not cache_dir or os.path.dirname(path) != cache_dir or not path.endswith(sha + ".zip"):
        return None
    try:
        if not safe_dir(cache_dir):
            return None
        base = compiled_path(sha, cache_dir)
        name = os.path.basename(base)
        if check_compiled(sha, cache_dir):
            return base
        if os.path.lexists(base):
            if not os.path.lexists(base + ".rec") and time.time() - os.lstat(base).st_mtime < 60:
                return None  # another exec is writing its record now
            _remove(cache_dir, name)
        if os.path.lexists(base + ".rec"):
            os.unlink(base + ".rec")
        with open(path, "rb") as fh:
            data = fh.read()
        if hashlib.sha256(data).hexdigest() != sha:
            return None
        tmp = os.path.join(cache_dir, ".%s.tmp-%d-%s" % (name, os.getpid(), os.urandom(6).hex()))
        digests = {"": "d", "/vpd_agent": "d", "/vpd_agent/__pycache__": "d"}
        os.mkdir(tmp, 0o700)
        try:
            for d in ("/vpd_agent", "/vpd_agent/__pycache__"):
                os.mkdir(tmp + d, 0o700)

            def put(rel, body):
                _write_new(tmp + rel, body)
                digests[rel] = hashlib.sha256(body).hexdigest()

            with zipfile.ZipFile(io.BytesIO(data)) as src:
                for info in src.infolist():
                    mod = info.filename.split("/")
                    if len(mod) != 2 or mod[0] != "vpd_agent" or not mod[1].endswith(".py"):
                        continue  # the archive holds vpd_agent/*.py only
                    body = src.read(info)
                    put("/vpd_agent/" + mod[1], body)
                    # optimize=2: without docstrings (the agent has no assert and reads no __doc__), ~8 % less
                    # bytecode to read and unmarshal in every exec (issue 54); the source beside it for tracebacks
                    code = compile(body, base + "/vpd_agent/" + mod[1], "exec", dont_inherit=True, optimize=2)
                    pyc = (importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + importlib.util.source_hash(body)
                           + marshal.dumps(code))
                    put("/vpd_agent/__pycache__/%s.%s.pyc" % (mod[1][:-3], sys.implementation.cache_tag), pyc)
            for d in ("/vpd_agent/__pycache__", "/vpd_agent", ""):
                dfd = os.open(tmp + d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            os.rename(tmp, base)  # another exec's copy already there: this one is removed below
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # the keys after the rename (it moves the directory's own ctime); the record last: until it is there,
        # BOOT does not use the copy
        _write_record(cache_dir, name, [(rel, _key(os.lstat(base + rel)), digests[rel]) for rel in sorted(digests)])
        return base
    except (OSError, SyntaxError, ValueError):
        return None


def compile_in_background(sha, cache_dir, path):
    """compile_archive in a detached child (its own session, no stdio of ours), so this exec's answer does not
    wait for it: the first exec of a version runs from the sources, the next ones from the compiled copy."""
    try:
        pid = os.fork()
    except OSError:
        return
    if pid:
        try:  # the child forks again and exits at once: reaped here, the grandchild is init's
            os.waitpid(pid, 0)
        except OSError:
            pass
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        compile_archive(sha, cache_dir, path)
    finally:
        os._exit(0)


def program(sha, cache_dir, path):
    """This agent as a program for another interpreter's stdin (the detached install runner, a staging venv's
    Python): the archive inline (so it runs even if the cache was pruned meanwhile), then the bootstrap."""
    import hashlib

    if not path.endswith("/" + sha + ".zip"):  # a compiled copy: send the archive it was built from
        path = os.path.join(cache_dir, sha + ".zip")
    with open(path, "rb") as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != sha:
        raise OSError("the agent archive %s changed while this agent ran (sha256 differs)" % path)
    return inline(data) + bootstrap(sha, cache_dir)
