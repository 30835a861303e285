"""The agent's own cache in the container: the archive this agent runs from, kept under the state directory.

Each exec's program is BOOT (below, a few hundred bytes): it reads STATE_DIR/vpd-agent/SHA256.zip through
O_NOFOLLOW from a directory of root's with mode 0700, checks the sha256, and runs the agent from it with
zipimport. When the file is missing or does not match, BOOT asks for the archive ({"need": SHA} on stdout: an
agent session answers on stdin, a one-shot exec is sent again with the archive inline), checks what arrived and
calls `store` (exec'd from the archive itself, so BOOT stays small). See orchestrator/agent/archive.py.
"""

import os
import stat as _stat
import sys
import time

KEEP = 3  # archives kept in the cache: this one and the newest others (another deploy version may still run)
NEED_EXIT = 3

BOOT = '''\
def _vpd(H, D):
    import os, sys
    try:  # the interpreter's built-in SHA-256 (no OpenSSL to load: ~1.5 ms less per exec); hashlib where absent
        from _sha2 import sha256
    except ImportError:
        try:
            from _sha256 import sha256
        except ImportError:
            from hashlib import sha256
    P = None
    try:  # this Python's compiled copy (H.TAG.SHA.zip), else the archive itself (H.zip), each checked by hash
        s = os.lstat(D)
        if s.st_uid in (0, os.geteuid()) and s.st_mode & 0o170777 == 0o40700:
            k = "%s.%s." % (H, sys.implementation.cache_tag)
            for n in [x for x in os.listdir(D) if x.startswith(k)] + [H + ".zip"]:
                try:
                    with os.fdopen(os.open(D + "/" + n, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                        if sha256(f.read()).hexdigest() == (n[len(k):-4] if n.startswith(k) else H):
                            P = D + "/" + n
                            break
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
        if sha256(b).hexdigest() != H:
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
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    os.unlink(tmp, dir_fd=dfd)
                    raise
                os.fsync(dfd)
                prune(dfd, name)
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


def prune(dfd, keep_name):
    """Remove all but the newest KEEP archives (keep_name always stays) with their compiled copies, and temp files
    of writers that died."""
    def mtime(n):
        return os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mtime

    try:
        names = os.listdir(dfd)
        others = sorted((mtime(n), n) for n in names if n.endswith(".zip") and n.count(".") == 1 and n != keep_name)
        for _, n in others[:max(0, len(others) - (KEEP - 1))]:
            for m in names:
                if m.startswith(n[:-len("zip")]):
                    os.unlink(m, dir_fd=dfd)
        for n in os.listdir(dfd):
            if n.startswith(".") and ".tmp-" in n and time.time() - mtime(n) > 3600:
                os.unlink(n, dir_fd=dfd)
    except OSError:
        pass


def compile_archive(sha, cache_dir, path):
    """This Python's compiled copy of the archive: every module as unchecked hash-based bytecode (PEP 552, without
    docstrings) beside its source, kept as CACHE/SHA.TAG.SHA256-OF-IT.zip, so later execs of the same Python skip
    compiling (the agent's largest cost per exec). Best effort: the agent runs from the source archive when this
    fails."""
    import hashlib
    import importlib.util
    import io
    import marshal
    import zipfile

    if not cache_dir or os.path.dirname(path) != cache_dir or not path.endswith(sha + ".zip"):
        return None
    try:
        prefix = "%s.%s." % (sha, sys.implementation.cache_tag)
        for n in os.listdir(cache_dir):
            if n.startswith(prefix) and n.endswith(".zip"):
                with open(os.path.join(cache_dir, n), "rb") as fh:
                    if hashlib.sha256(fh.read()).hexdigest() == n[len(prefix):-4]:
                        return None  # another exec compiled it meanwhile
                os.unlink(os.path.join(cache_dir, n))  # damaged: replaced below
        with open(path, "rb") as fh:
            data = fh.read()
        if hashlib.sha256(data).hexdigest() != sha:
            return None
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                body = src.read(info)
                dst.writestr(info.filename, body)
                if info.filename.endswith(".py"):
                    # optimize=2: without docstrings (the agent has no assert and reads no __doc__), ~8 %
                    # less bytecode to hash, inflate and unmarshal in every exec (issue 54); the source stays
                    # beside it for tracebacks
                    code = compile(body, path + "/" + info.filename, "exec", dont_inherit=True, optimize=2)
                    pyc = (importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + importlib.util.source_hash(body)
                           + marshal.dumps(code))
                    dst.writestr(info.filename + "c", pyc)
        blob = out.getvalue()
        name = "%s.%s.%s.zip" % (sha, sys.implementation.cache_tag, hashlib.sha256(blob).hexdigest())
        dfd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            tmp = ".%s.tmp-%d-%s" % (name, os.getpid(), os.urandom(6).hex())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return os.path.join(cache_dir, name)
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
