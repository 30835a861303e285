"""Parallel, ranged, resumable downloads (the fetch runner's transfer engine).

Every file still to come is one or more units of work: a file larger than one range is cut into byte ranges, each
fetched over its own connection (HTTP Range: bytes=A-B), written in place (pwrite) into FILE.incomplete; the others
are one unit. At most `connections` units run at once, across all files, so several files come at the same time
and a large one comes over several connections (a CDN caps each connection, not the link).

Resume: what each range has written is kept beside the partial file (FILE.incomplete.ranges, JSON, saved at most
once a second and whenever a range stops); a cut range goes on from its last byte (three tries, then the fetch
fails with the partial kept), and the next run picks up every range where it stopped. A partial file without that
record is a single-stream partial: its bytes count as the start of the first ranges. The file is verified as a
whole (sha256 / git blob id) exactly as a single-stream download is: a bad range fails the whole file, named, with
both hashes (weights.verify_file), and the partial is removed.

A hub that answers a range with the whole file (200 instead of 206) gets one stream for that file: the ranges of
that file stop, the partial is cleared and the file comes again over one connection (the log says so).
"""

import errno
import json
import os
import re
import stat
import threading

from .core import now
from .files import read_capped, write_at
from .weights import CHUNK, FetchError, _existing_dir, _fmt_bytes, _free, _partial, stage_fd, verify_file

CONNECTIONS = 8  # the default number of connections (the playbook's fetch.connections)
RANGE_BYTES = 64 << 20  # the default range (fetch.range_mib): a larger file is cut into ranges
SIDECAR = ".ranges"
MAX_RANGES = 1 << 14  # per file: a larger file gets larger ranges (a record of ranges stays small)
SIDECAR_MAX = 2 << 20  # bytes of a ranges record: more is not ours (a planted /dev/zero is not read into memory)
TRIES = 3  # per range: a cut or a network error is retried where it stopped, then the fetch fails


class _NoRanges(Exception):
    """The server answered a range with the whole file."""


def sidecar_of(part):
    return part + SIDECAR


def split(size, range_bytes):
    """[[start, end), ...] covering SIZE bytes: one range for a file of at most one range; never more than
    MAX_RANGES (the ranges of a huge file are made larger)."""
    range_bytes = max(1, int(range_bytes), -(-size // MAX_RANGES))
    if size <= range_bytes:
        return [[0, size]]
    return [[a, min(a + range_bytes, size)] for a in range(0, size, range_bytes)]


def _dir_of(part, dfd):
    """(fd of part's directory, whether we opened it): the caller's, or part's parent opened O_DIRECTORY."""
    if dfd is not None:
        return dfd, False
    return os.open(os.path.dirname(part) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), True


def read_ranges(part, size, dfd=None):
    """The ranges record of a partial file ([[start, end, got], ...]) when it describes SIZE bytes, else None.
    Read like anything in a store a container may have written (files.read_capped: no link followed, no FIFO
    waited on, at most SIDECAR_MAX bytes, at most MAX_RANGES ranges)."""
    try:
        d, own = _dir_of(part, dfd)
    except OSError:
        return None
    try:
        rec = json.loads(read_capped(d, os.path.basename(sidecar_of(part)), SIDECAR_MAX, "ranges record")
                         .decode("utf-8"))
        rs = rec["ranges"]
        if rec.get("size") != size or not rs or len(rs) > MAX_RANGES:
            return None
        pos = 0
        for a, b, got in rs:
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b, got)):
                return None
            if a != pos or not (a < b or (a == b == 0)) or not 0 <= got <= b - a:
                return None
            pos = b
        return [[int(a), int(b), int(g)] for a, b, g in rs] if pos == size else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        if own:
            os.close(d)


def _regular_size(dfd, name):
    """The size of dir/NAME when it is a regular file (not followed if a link), else None."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def partial_bytes(part, size, dfd=None):
    """Bytes of a partial download already there (by its ranges record; else the single-stream partial's size)."""
    rs = read_ranges(part, size, dfd)
    if rs is not None:
        return sum(g for _, _, g in rs)
    try:
        d, own = _dir_of(part, dfd)
    except OSError:
        return 0
    try:
        return min(_regular_size(d, os.path.basename(part)) or 0, size)
    finally:
        if own:
            os.close(d)


class _File:
    def __init__(self, item, commit, f, range_bytes):
        self.item, self.f = item, f
        self.part, self.done = _partial(item, commit, f)
        self.pname, self.sname = os.path.basename(self.part), os.path.basename(sidecar_of(self.part))
        size = f["size"]
        dfd = stage_fd(item, os.path.dirname(self.part))
        try:
            rs = read_ranges(self.part, size, dfd)
            if rs is None:  # none yet, or a single-stream partial (its prefix counts)
                pre = min(_regular_size(dfd, self.pname) or 0, size)
                rs = [[a, b, max(0, min(pre - a, b - a))] for a, b in split(size, range_bytes)]
        finally:
            os.close(dfd)
        self.ranges = rs
        # a file whose record says every range is in still has one unit: its hash (never skipped, issue 50)
        self.left = sum(1 for a, b, g in rs if g < b - a) or 1
        self.single = False
        self.fd = self.dfd = None
        self.saved_at = 0.0
        self.t0, self.got0 = now(), self.got()

    def got(self):
        return sum(g for _, _, g in self.ranges)

    def open(self):
        """The partial opened for writing, through its directory's fd (stage_fd: walked from the trusted root,
        no link followed): O_NOFOLLOW|O_NONBLOCK, a regular file with one link only (not a FIFO, not a hard link
        to another file that a container put there)."""
        if self.fd is None:
            if self.dfd is None:
                self.dfd = stage_fd(self.item, os.path.dirname(self.part))
            self.save(force=True)  # the record first: a partial without one is read as a single stream
            fd = os.open(self.pname, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                         dir_fd=self.dfd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                os.close(fd)
                raise FetchError("%s: the partial file %s is not a plain file of ours (mode %o, %d links): not "
                                 "written through" % (self.item["role"], self.part, st.st_mode, st.st_nlink),
                                 fix="remove %s and run deploy fetch again" % self.part, kind="unsafe",
                                 path=self.part)
            os.fchmod(fd, 0o644)
            self.fd = fd
            if st.st_size > self.f["size"]:
                os.ftruncate(self.fd, 0)
                for r in self.ranges:
                    r[2] = 0
            os.ftruncate(self.fd, self.f["size"])  # sparse; the ranges fill it in place

    def save(self, force=False):
        t = now()
        if force or t - self.saved_at >= 1.0:
            self.saved_at = t
            try:
                # 0644 in a directory left as it was made (0755): a container reading the store can read blobs/
                write_at(self.dfd, self.sname, json.dumps({"size": self.f["size"], "ranges": self.ranges}).encode(),
                         0o644)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise self.disk_full() from None

    def disk_full(self):
        """The FetchError of a full disk while this file (or its ranges record) was written."""
        d = os.path.dirname(self.part)
        return FetchError("disk full at %s while writing %s (%s of %s in; %s free there now); the partial file %s is "
                          "kept for resume and nothing was moved into place" % (
                              _existing_dir(d), self.f["name"], _fmt_bytes(self.got()), _fmt_bytes(self.f["size"]),
                              _fmt_bytes(_free(d)), self.part),
                          fix="free space there (or point the playbook elsewhere), then run deploy fetch again: it "
                              "resumes", kind="disk")

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close_dir(self):
        self.close()
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None


class Transfer:
    """Download FILES ([(item, commit, f, token)]) with at most CONNECTIONS connections; each file verified and
    renamed beside its partial (weights.verify_file) as soon as its last range is in. request(item, url, token,
    timeout, headers) opens one HTTP request; error(item, e, token, what) turns its failure into a FetchError."""

    def __init__(self, files, *, request, error, connections, range_bytes, deadline, stall_s, log, on_progress,
                 on_verified):
        self.request, self.error, self.log = request, error, log
        self.connections, self.deadline, self.stall_s = max(1, int(connections)), deadline, stall_s
        self.on_progress, self.on_verified = on_progress, on_verified
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.failure = None
        self.files = [(_File(it, commit, f, range_bytes), token) for it, commit, f, token in files]
        self.units = []
        for pf, token in self.files:
            todo = [r for r in pf.ranges if r[2] < r[1] - r[0]]
            # every range in (by its record, or a file of 0 bytes): one unit still, that hashes it before it counts
            self.units += [(pf, token, r) for r in (todo or pf.ranges[-1:])]
        self.active = {}
        self.reported_at = 0.0

    # ------------------------------------------------------------ progress

    def done_bytes(self):
        return sum(pf.got() for pf, _ in self.files)

    def _progress(self, force=False):
        t = now()
        with self.lock:
            if not force and t - self.reported_at < 0.5:
                return
            self.reported_at = t
            busy = list(self.active.values())
        self.on_progress(busy, len(busy))

    # ------------------------------------------------------------ the work

    def run(self):
        """Every file downloaded and verified, or a FetchError (the first failure; the others stop, every partial
        and its ranges record kept for the next run)."""
        units = list(self.units)

        def worker():
            while not self.stop.is_set():
                with self.lock:
                    if not units:
                        return
                    pf, token, r = units.pop(0)
                    self.active[id(r)] = pf
                try:
                    self._unit(pf, token, r)
                except BaseException as e:  # noqa: BLE001 - the first failure wins, the others stop
                    with self.lock:
                        if self.failure is None:
                            self.failure = e
                    self.stop.set()
                    return
                finally:
                    with self.lock:
                        self.active.pop(id(r), None)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(self.connections, len(units)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for pf, _ in self.files:
            try:
                if pf.fd is not None:
                    pf.save(force=True)
            except (OSError, FetchError):
                pass  # the record stays as last saved: a resume re-fetches a little more, verified all the same
            pf.close_dir()
        if self.failure is not None:
            raise self.failure
        self._progress(force=True)

    def _unit(self, pf, token, r):
        with self.lock:
            pf.open()
        if not pf.single:
            try:
                if not self._range(pf, token, r):
                    return  # stopped: another unit failed
            except _NoRanges:
                with self.lock:
                    if not pf.single:
                        pf.single = True
                        self.log("%s: %s: the hub answered a byte range with the whole file (no ranges): one "
                                 "stream for this file" % (pf.item["role"], pf.f["name"]))
        with self.lock:
            pf.left -= 1
            if pf.left > 0:
                pf.save()
                return
        if pf.single:  # every range of it has stopped: the whole file again, over one connection
            whole = [0, pf.f["size"], 0]
            with self.lock:
                os.ftruncate(pf.fd, 0)
                os.ftruncate(pf.fd, pf.f["size"])
                pf.ranges = [whole]
                pf.save(force=True)
            if not self._range(pf, token, whole, whole_ok=True):
                return
        with self.lock:
            pf.save(force=True)
            pf.close()
            dfd, pf.dfd = pf.dfd, None
        try:
            os.unlink(pf.sname, dir_fd=dfd)  # our record's name, in our checked directory: never followed
            got = verify_file(pf.item, pf.f, pf.part, pf.done, dfd)
        finally:
            os.close(dfd)
        self.on_verified(pf, got)

    def _url(self, pf):
        from urllib.parse import quote

        it = pf.item
        return "%s/%s/resolve/%s/%s" % (it["endpoint"].rstrip("/"), it["hub"], it["commit"], quote(pf.f["name"]))

    def _range(self, pf, token, r, whole_ok=False):
        """Range R = [start, end, got] of PF: from start+got to end, in place; a cut or a network error is retried
        where it stopped (TRIES), a 200 answer to a range is _NoRanges (unless whole_ok: the one-stream fallback).
        True when the range is complete, False when the transfer was stopped (another unit failed)."""
        from http.client import HTTPException

        f, it = pf.f, pf.item
        size = f["size"]
        cut = None
        for attempt in range(TRIES):
            if self.stop.is_set():
                return False
            a = r[0] + r[2]
            if a >= r[1]:
                return True
            self._check_deadline(pf)
            want_whole = a == 0 and r[1] == size
            headers = {} if want_whole else {"Range": "bytes=%d-%d" % (a, r[1] - 1)}
            try:
                resp = self.request(it, self._url(pf), token, self._timeout(), headers)
            except Exception as e:  # noqa: BLE001 - HTTP and network errors become messages
                err = self.error(it, e, token, f["name"])
                if err.kind == "network" and attempt < TRIES - 1:
                    self.log("%s: %s: network: %s; retrying at byte %d" % (it["role"], f["name"], err.message, a))
                    self.stop.wait(min(5.0, 1.0 + attempt * 2))
                    continue
                raise err from None
            with resp:
                repo_commit = resp.headers.get("X-Repo-Commit")
                if repo_commit and repo_commit != it["commit"]:
                    raise FetchError("%s: the hub answered %s for commit %s (X-Repo-Commit %s)" % (
                        it["hub"], f["name"], it["commit"], repo_commit))
                if headers and resp.status != 206:
                    if not whole_ok:
                        raise _NoRanges()
                    a = r[0]  # one stream that ignores Range: from the start again
                    with self.lock:
                        r[2] = 0
                elif headers:
                    cr = resp.headers.get("Content-Range") or ""
                    m = re.match(r"bytes (\d+)-(\d+)/", cr)
                    if not m or int(m.group(1)) != a or int(m.group(2)) != r[1] - 1:
                        raise FetchError("%s: %s: asked for bytes %d-%d, the server sent %r" % (
                            it["hub"], f["name"], a, r[1] - 1, cr))
                pos = a
                cut = None
                while pos < r[1]:
                    if self.stop.is_set():
                        return False
                    self._check_deadline(pf)
                    try:
                        # read1: what one receive brings (at most CHUNK), so a hub that drips a byte at a time
                        # meets the deadline check above between bytes, not after a whole chunk (issue 50)
                        chunk = self._read(resp, min(CHUNK, r[1] - pos))
                    except (OSError, ValueError, HTTPException) as e:  # a cut, a stall (socket timeout)
                        chunk, cut = b"", e
                    if not chunk:
                        break
                    self._write(pf, chunk, pos)
                    pos += len(chunk)
                    with self.lock:
                        r[2] = pos - r[0]
                        pf.save()
                    self._progress()
            if pos >= r[1]:
                return True
            self.log("%s: %s: transfer cut at %s of %s%s%s; resuming" % (
                it["role"], f["name"], _fmt_bytes(pos), _fmt_bytes(size),
                "" if r[1] - r[0] == size else " (in bytes %d-%d)" % (r[0], r[1] - 1), " (%s)" % cut if cut else ""))
        with self.lock:
            pf.save(force=True)
        raise FetchError("%s: %s: bytes %d-%d still missing after %d attempts (%s of %s in); the partial file is kept "
                         "for the next run" % (it["hub"], f["name"], r[0] + r[2], r[1] - 1, TRIES,
                                               _fmt_bytes(pf.got()), _fmt_bytes(size)),
                         fix="run deploy fetch again (it resumes every range where it stopped); check the network",
                         kind="network")

    def _write(self, pf, chunk, pos):
        try:
            os.pwrite(pf.fd, chunk, pos)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise pf.disk_full() from None
            raise

    def _timeout(self):
        """The socket timeout of a request: the stall limit, but never past the deadline."""
        return max(0.5, min(self.stall_s, self.deadline - now()))

    def _read(self, resp, n):
        sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
        if sock is not None:
            try:
                sock.settimeout(self._timeout())
            except OSError:
                pass
        read1 = getattr(resp, "read1", None)
        return read1(n) if read1 is not None else resp.read(min(n, 1 << 16))

    def _check_deadline(self, pf):
        if now() >= self.deadline:
            raise FetchError("time limit reached while downloading %s (%s of %s); the partial file is kept for the "
                             "next run" % (pf.f["name"], _fmt_bytes(pf.got()), _fmt_bytes(pf.f["size"])),
                             kind="timeout")
