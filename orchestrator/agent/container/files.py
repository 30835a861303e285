"""Safe file I/O for an agent that runs as root: every write goes through the fd of a directory checked to be
root's and not writable by others (open_dir), with unpredictable temp names, O_EXCL|O_NOFOLLOW, fsync, rename and
a read-back; log tails with control sequences stripped."""

import stat as _stat
import errno
import os
import time

from .core import ANSI, LazyRe, loads, now
from .protocol import DEFAULT_STATE_DIR


class UnsafeDirectory(Exception):
    pass


def open_dir(path, create_mode=None):
    """An fd of directory `path`, checked as a safe place for root to write in; with create_mode, created first.

    Safe: owned by root (or by us), and not writable by group or others unless the sticky bit is set. A directory
    that another user owns or may write in lets that user plant symlinks, hard links or FIFOs under names we are
    about to use, or swap our files between the write and the read-back: refused. Every later open, rename and
    unlink is relative to this fd, so renaming the path away after the check changes nothing."""
    if create_mode is not None:
        try:
            os.makedirs(path, mode=create_mode)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UnsafeDirectory("%s is a symbolic link (to %s), not a directory: root does not write through a "
                                  "link that someone may have planted (fix: remove the link, or name the real "
                                  "directory)" % (path, os.readlink(path))) from None
        raise
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (0, me):
            raise UnsafeDirectory("%s is owned by uid %d, not root: that user could swap the files written there "
                                  "(fix: chown root:root %s, or use a root-owned directory)" % (path, st.st_uid, path))
        if create_mode is not None and not create_mode & 0o077:
            _check_private_dir(path, st)  # the state dir: deploy's own, before anything touches it (issue 22)
        if st.st_mode & 0o022 and not st.st_mode & 0o1000:
            raise UnsafeDirectory("%s is writable by %s (mode %o) without the sticky bit: other users could plant "
                                  "files under the names written there (fix: chmod go-w %s)"
                                  % (path, "others" if st.st_mode & 0o002 else "its group", st.st_mode & 0o7777, path))
        if create_mode is not None and st.st_mode & 0o077 & ~create_mode and _only_state_files(fd):
            # a state dir from an older version (0755): tighten it, but only when it holds nothing but our files
            # (runtime.state_dir could name a shared directory such as /var/lib)
            os.fchmod(fd, st.st_mode & 0o7777 & ~(0o077 & ~create_mode))
        return fd
    except BaseException:
        os.close(fd)
        raise


def _why_unsafe_below(st):
    """Why a directory below a trusted root is no place for root to write in (None when it is fine): another
    owner, or group/other-writable (a sticky bit does not help: its owner could still plant names)."""
    if st.st_uid not in (0, os.geteuid()):
        return "owned by uid %d" % st.st_uid
    if st.st_mode & 0o022:
        return "writable by %s (mode %o)" % ("others" if st.st_mode & 0o002 else "its group", st.st_mode & 0o7777)
    return None


def open_beneath(root, path, create_mode=None):
    """An fd of directory PATH, which lies under ROOT (a directory the playbook names: trusted, opened as given and
    checked by open_dir), walked like a hostile tree: every component below ROOT opened relative to its parent
    with O_NOFOLLOW|O_DIRECTORY (mkdir'ed at create_mode when missing and create_mode is given) and refused when it
    is a link, another user's, or writable by group or others. Renaming anything along the way after this changes
    nothing for the caller, which works relative to the fd. UnsafeDirectory names the component and the fix."""
    root = os.path.normpath(root)
    path = os.path.normpath(path)
    if create_mode is not None:
        os.makedirs(root, mode=0o755, exist_ok=True)
    rel = os.path.relpath(path, root)
    parts = [] if rel == "." else rel.split(os.sep)
    if any(p in ("", "..") for p in parts):
        raise UnsafeDirectory("%s is not under %s: refused" % (path, root))
    fd = open_dir(root)
    here = root
    try:
        for p in parts:
            here = os.path.join(here, p)
            try:
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise FileNotFoundError(errno.ENOENT, "no such directory", here) from None
                try:
                    os.mkdir(p, create_mode, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.fchmod(nfd, create_mode)  # the umask does not decide it (blobs/ readable by containers)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                try:
                    lst = os.stat(p, dir_fd=fd, follow_symlinks=False)
                    what = "a symbolic link" if _stat.S_ISLNK(lst.st_mode) else "not a directory"
                except OSError:
                    what = "not a directory"
                raise UnsafeDirectory("%s is %s: root does not follow or replace what it did not make there; "
                                      "nothing was written through it (fix: look at who put it there, remove it, "
                                      "then run again)" % (here, what)) from None
            os.close(fd)
            fd = nfd
            why = _why_unsafe_below(os.fstat(fd))
            if why:
                raise UnsafeDirectory("%s is %s: another user could plant or swap files there; nothing was written "
                                      "into it (fix: chown root:root %s && chmod 755 %s, or remove it and run "
                                      "again)" % (here, why, here, here))
        return fd
    except BaseException:
        os.close(fd)
        raise


def lstat_at(name, dfd):
    """os.stat of dir/NAME without following a link; None when there is nothing there."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def read_capped(dfd, name, limit, what="file", follow=False):
    """The bytes of dir/NAME, a small record: opened O_NOFOLLOW|O_NONBLOCK (a link or a FIFO planted there neither
    redirects nor hangs us; follow=True: a link is followed), a regular file only, at most LIMIT bytes (a larger one
    is refused, never read into memory). Raises FileNotFoundError, or OSError naming what it found."""
    fd = os.open(name, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "the %s is not a regular file (mode %o)" % (what, st.st_mode), name)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, "the %s is %d bytes, more than the %d such a record can be" % (
                what, st.st_size, limit), name)
        out = b""
        while len(out) <= limit:
            chunk = os.read(fd, limit + 1 - len(out))
            if not chunk:
                break
            out += chunk
        if len(out) > limit:
            raise OSError(errno.EFBIG, "the %s grew past %d bytes while read" % (what, limit), name)
        return out
    finally:
        os.close(fd)


STATE_DIR_FIX = ("set runtime.state_dir to a directory of deploy's own that only root can write, e.g. "
                 + DEFAULT_STATE_DIR + " (the default)")


def lock_held(state_dir, name):
    """Does a live process hold the flock on STATE_DIR/NAME? A detached runner (install, fetch) holds its lock
    for its whole life: free means no runner."""
    try:
        dfd = open_dir(state_dir, 0o700)
    except OSError:
        return False
    try:
        fd = take_runner_lock(dfd, name)
    finally:
        os.close(dfd)
    if fd is None:
        return True
    os.close(fd)
    return False


def take_runner_lock(dfd, name):
    """Take the flock on NAME in the directory dfd for a detached runner to inherit (lock_held tests it): the open
    descriptor, or None when another runner holds it."""
    import fcntl

    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def runner_id():
    """A detached run's id: its start in UTC, then a random suffix."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + unique_name("")[:6]


def new_runner_log(dfd, prefix, rid, keep=5):
    """Create PREFIX-RID.log in the directory dfd (new, 0600, appended to) and remove all but the last `keep` of
    the PREFIX-*.log there: (its name, its open descriptor)."""
    logname = "%s-%s.log" % (prefix, rid)
    logfd = os.open(logname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, 0o600, dir_fd=dfd)
    os.fchmod(logfd, 0o600)
    old = sorted(n for n in os.listdir(dfd) if n.startswith(prefix + "-") and n.endswith(".log"))
    for n in old[:-keep]:
        try:
            os.unlink(n, dir_fd=dfd)
        except OSError:
            pass
    return logname, logfd


def runner_gone(kind, st, a):
    """Attaching to a detached run (a["id"], in a["state_dir"]): None while ST (its state file) is that run, else
    the failed answer (none recorded, or another run replaced it)."""
    if not st:
        return {"ok": False, "message": "no %s recorded in %s" % (kind, a["state_dir"])}
    if a.get("id") and st.get("id") != a["id"]:
        return {"ok": False, "message": "%s %s was replaced by %s" % (kind, a["id"], st.get("id"))}
    return None


def follow_runner(a, kind, read, save, final, on_line, finish, tick):
    """The container's half of following a detached runner (the workstation's: orchestrator/provision/follow.py): the new
    lines of its log, in order, through on_line(line); tick(record) each round (progress, heartbeats) until its
    record (read()) says it ended, then the record is marked reported (save(record)) and finish(record, log_pos)
    answers; or follow_s (a["follow_s"]) passes: {"ok", "done": False, KIND: record, "log_pos"}."""
    deadline = now() + float(a.get("follow_s") or 0)
    pos = int(a.get("log_pos") or 0)
    while True:
        st = read()
        gone = runner_gone(kind, st, a)
        if gone:
            return gone
        pos, lines = _tail_lines(st.get("log") or "", pos)
        for ln in lines:
            on_line(ln)
        if st.get("status") in final:
            if not st.get("reported"):
                st["reported"] = True
                save(st)
            return finish(st, pos)
        tick(st)
        if now() >= deadline:
            return {"ok": True, "done": False, kind: st, "log_pos": pos}
        time.sleep(0.2)


def runner_env(var, rid):
    """The environment of a detached runner: PATH, HOME, a UTF-8 locale, unbuffered output, and VAR=RID (how
    its processes are told apart)."""
    return {"PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", var: rid}


def spawn_runner(argv, program, logfd, lock_fd, env):
    """Start a detached runner: its own session, in /, stdout and stderr to the log, the lock passed on (it holds
    it for its whole life), PROGRAM (this agent) on its stdin. The Popen; OSError when it cannot start. The
    caller closes logfd and lock_fd afterwards (after recording a failure, still under the lock)."""
    import subprocess

    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=logfd, stderr=subprocess.STDOUT, cwd="/", env=env,
                            start_new_session=True, pass_fds=(lock_fd,), close_fds=True)
    proc.stdin.write(program)
    proc.stdin.close()
    return proc


def _check_private_dir(path, st=None):
    st = st or os.lstat(path)
    if not _stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory("state directory %s is not a directory (fix: %s)" % (path, STATE_DIR_FIX))
    if st.st_uid != 0 or st.st_mode & 0o022:
        who = ("owned by uid %d" % st.st_uid) if st.st_uid != 0 else \
            ("writable by %s" % ("others" if st.st_mode & 0o002 else "its group"))
        shared = st.st_mode & 0o1000  # a sticky directory (/tmp) is everyone's: never offer to chmod it
        raise UnsafeDirectory(
            "state directory %s is %s (mode %o): another user could plant the state files that decide what deploy "
            "stops as root; nothing in it was read or changed (fix: %s%s)"
            % (path, who, st.st_mode & 0o7777, STATE_DIR_FIX, "" if shared else
               "; or, if %s is deploy's own: chown root:root %s && chmod 700 %s" % (path, path, path)))


def open_state_dir(state_dir):
    """An fd of the state directory (not created), checked as deploy's own; FileNotFoundError when absent."""
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private_dir(state_dir, os.fstat(fd))
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_state_file(path, limit=1 << 20):
    """The bytes of a state file: the directory checked (open_state_dir), the file opened O_NOFOLLOW|O_NONBLOCK,
    a regular file, root-owned and not writable by group/others, at most `limit` bytes. Raises FileNotFoundError,
    UnsafeDirectory (with the path and the fix) or OSError."""
    dfd = open_state_dir(os.path.dirname(path))
    try:
        fd = open_regular(dfd, os.path.basename(path))
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise UnsafeDirectory("state file %s is owned by uid %d with mode %o: not written by deploy, not used "
                                  "(fix: remove it; deploy writes its state files root-owned, mode 600)"
                                  % (path, st.st_uid, st.st_mode & 0o7777))
        return fh.read(limit + 1)[:limit]


STATE_FILES = LazyRe(r"(vllm-.*\.env|state\.json|state\.stopped\.json|last_failure\.json|vllm\.log(\.1)?|exit_code|lock"
                         r"|install\.json|install\.lock|install-.*\.log|runtime\.json|plumbing\.json"
                         r"|lock\.break|\.lock\.stale-.*|lock\.break\.stale-.*|\..*\.tmp-.*|vpd-agent)$")


def _only_state_files(dfd):
    try:
        return all(STATE_FILES.match(n) for n in os.listdir(dfd))
    except OSError:
        return False


def unique_name(prefix):
    import base64  # here: status, which imports this module, never makes a name

    return "%s%s" % (prefix, base64.b32encode(os.urandom(10)).decode().lower())


def create_excl(dfd, prefix, mode):
    """mkstemp relative to a directory fd: a new, unpredictable name, O_EXCL|O_NOFOLLOW. -> (fd, name)"""
    for _ in range(100):
        name = unique_name(prefix)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        except FileExistsError:
            continue
        os.fchmod(fd, mode)  # the umask does not decide the mode of what we create
        return fd, name
    raise FileExistsError(errno.EEXIST, "no free temporary name", prefix)


def write_at(dfd, name, data, mode, owner=None):
    """Replace dir/name atomically: unique temp file (O_EXCL), write, fsync, rename, fsync the directory."""
    fd, tmp = create_excl(dfd, ".%s.tmp-" % name, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            if owner is not None:
                try:
                    os.fchown(fh.fileno(), *owner)
                    os.fchmod(fh.fileno(), mode)
                except OSError:
                    pass
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    os.fsync(dfd)


def open_regular(dfd, name, flags=os.O_RDONLY):
    """Open dir/name without following a final symlink and without blocking on a FIFO; only a regular file."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    if not _stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", name)
    return fd


def write_json_atomic(path, data):
    """state.json and friends: 0600 in a 0700 state directory that is checked before every write."""
    import json  # indented and sorted, as people read them: not in the status path

    dfd = open_dir(os.path.dirname(path), 0o700)
    try:
        write_at(dfd, os.path.basename(path), json.dumps(data, indent=1, sort_keys=True).encode(), 0o600)
    finally:
        os.close(dfd)


def _sha_at(dfd, name, follow=True):
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), dir_fd=dfd)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not _stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        import hashlib

        h = hashlib.sha256()
        raw = bytearray()  # kept for the backup: the exact bytes hashed
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
            raw += chunk
        return h.hexdigest(), bytes(raw), st


def _open_log(path):
    """A runner's log for reading: its name comes from a state file (in a shared store, one a container may have
    written), so no final link is followed and no FIFO waited on; a regular file only."""
    return os.fdopen(open_regular(None, path), "rb")


def _tail_lines(path, pos, limit=4 << 20):
    """Complete lines after byte `pos`, at most `limit` bytes per call (a log that grows by gigabytes between two
    polls is read in steps); a line longer than the limit is cut, not waited for forever."""
    try:
        with _open_log(path) as fh:
            fh.seek(pos)
            data = fh.read(limit)
    except OSError:
        return pos, []
    cut = data.rfind(b"\n")
    if cut < 0:
        if len(data) < limit:
            return pos, []
        return pos + len(data), [ANSI.sub("", data.decode("utf-8", "replace"))]
    lines = data[:cut].decode("utf-8", "replace").splitlines()
    return pos + cut + 1, [ANSI.sub("", ln) for ln in lines]


def tail_file(path, n, grep=None, exclude=None):
    try:
        with _open_log(path) as fh:
            fh.seek(max(0, fh.seek(0, 2) - 256 * 1024))
            data = fh.read()
    except OSError:
        return []
    return last_lines([ANSI.sub("", ln) for ln in data.decode("utf-8", "replace").splitlines()], n, grep, exclude)


def last_lines(lines, n, grep=None, exclude=None):
    """The last n of LINES that match the regular expression grep (if given) and not exclude (if given)."""
    import re

    if grep:
        rx = re.compile(grep)
        lines = [ln for ln in lines if rx.search(ln)]
    if exclude:
        ex = re.compile(exclude)
        lines = [ln for ln in lines if not ex.search(ln)]
    return lines[-n:]


def write_owned(d, name, data, mode):
    """A file that only deploy writes (the unit, its environment file): only when its bytes differ; temp file,
    fsync, rename, read back; through a checked directory fd, never through a symlink. -> (changed, sha256)"""
    import hashlib

    want = hashlib.sha256(data).hexdigest()
    dfd = open_dir(d)
    try:
        lst = lstat_at(name, dfd)
        if lst is not None and not _stat.S_ISREG(lst.st_mode):
            raise OSError(errno.EEXIST, "%s/%s exists and is not a regular file (a symlink?): refusing to write "
                                        "through it" % (d, name))
        if lst is not None and _stat.S_IMODE(lst.st_mode) == mode and _sha_at(dfd, name, follow=False)[0] == want:
            return False, want
        write_at(dfd, name, data, mode, owner=(0, 0))
        got = _sha_at(dfd, name, follow=False)[0]
        if got != want:
            raise OSError(errno.EIO, "read back %s/%s: sha256 %s, wrote %s" % (d, name, got, want))
        return True, want
    finally:
        os.close(dfd)


def remove_owned(d, name):
    try:
        dfd = open_dir(d)
    except (OSError, UnsafeDirectory):
        return False
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(dfd)


def create_excl_path(d, name):
    """A new file d/name (O_EXCL|O_NOFOLLOW, 0600) in a directory checked by open_dir. -> (fd, path)"""
    dfd = open_dir(d)
    try:
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=dfd), os.path.join(d, name)
    finally:
        os.close(dfd)


def why_untrusted(path):
    """None if path and every directory above it (links resolved) are root-owned and not writable by group or
    others; else which one is not (issue 22: a file root installs or runs)."""
    for q in {path, os.path.realpath(path)}:
        while True:
            try:
                st = os.lstat(q)
            except OSError as e:
                return "%s (%s)" % (q, e.strerror)
            if not _stat.S_ISLNK(st.st_mode):
                if st.st_uid != 0:
                    return "%s, owned by uid %d" % (q, st.st_uid)
                if st.st_mode & 0o022 and not (_stat.S_ISDIR(st.st_mode) and st.st_mode & 0o1000 and q != path):
                    return "%s, writable by %s" % (q, "others" if st.st_mode & 0o002 else "its group")
            if q == "/":
                break
            q = os.path.dirname(q)
    return None


def _read_json(path):
    """A state file's JSON (read_state_file's checks), None if absent, unsafe or unreadable."""
    try:
        return loads(read_state_file(path).decode("utf-8", "replace"))
    except (OSError, ValueError, UnsafeDirectory):
        return None

