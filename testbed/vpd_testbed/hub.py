"""A small Hugging Face hub for the test bed: the endpoints huggingface_hub really uses to fetch a snapshot, served
from local directories, with the faults a fetch must survive.

Layout of ROOT (see make_repo):
  ROOT/repos/ORG/NAME/repo.json           {"refs": {"main": COMMIT, ...}, "gated": false | "manual",
                                            "accepted": [TOKEN, ...]}
  ROOT/repos/ORG/NAME/commits/COMMIT/...  the files of that commit
  ROOT/tokens.json                        ["hf_...", ...]: the valid tokens (others are refused with 401)
  ROOT/faults.json                        read on every request:
      {"rate_bps": N}                     a slow connection: every body is paced to N bytes/s (each on its own)
      {"link_bps": N}                     a slow link: all the bodies being sent at a time share N bytes/s, in fair
                                          shares (they take turns on it); each also within rate_bps
      {"cut": {"FILE": BYTES}}            the next transfer of FILE stops after BYTES (connection closed), once
      {"corrupt": ["FILE"]}               FILE is served with its first byte flipped (size unchanged)
      {"corrupt_at": {"FILE": OFFSET}}    FILE is served with the byte at OFFSET flipped (size unchanged)
      {"no_ranges": true}                 a server without ranges: Range is ignored (200, the whole file), no
                                          Accept-Ranges
      {"down": true}                      every connection is closed without an answer
    a hostile hub (issue 50: what a hub answers is untrusted input):
      {"listing": {"FILE": {"size": N, "sha256": S, "blobId": B, "rfilename": R}}}
                                          the file listing says these values for FILE instead of the true ones
                                          (a size of -1, a sha256 of "../../x"); "lfs" entries follow size/sha256
      {"listing_sha": "VALUE"}            the listing's commit ("sha") is VALUE
      {"drip_s": S}                       every body is sent one byte every S seconds (a hub that never stalls
                                          long enough for a socket timeout, and never ends)
      {"drip_listing_s": S}               the same for the API's JSON answers (the listing)
  rate_bps and link_bps are read again during a transfer (at least every 0.2 s): a link can get fast or slow.

Endpoints (shapes as huggingface.co answers them; huggingface_hub's snapshot_download works against it):
  GET /api/models/ORG/NAME[/revision/REV][?blobs=true]  {"id", "sha", "gated", "private", "siblings": [{"rfilename",
                                                          "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}
  GET|HEAD /ORG/NAME/resolve/REV/PATH                    LFS files: 302 to /cdn/SHA256 with X-Linked-Etag,
                                                          X-Linked-Size; others 200 with ETag = the git blob id.
                                                          Always X-Repo-Commit. Range: bytes=N- and bytes=N-M
                                                          -> 206 (M past the end: to the end), N past the end
                                                          -> 416, M < N: ignored (200).
  errors: X-Error-Code RepoNotFound (401), GatedRepo (401 without token, 403 not accepted), RevisionNotFound (404),
          EntryNotFound (404); a token that is not valid: 401 "Invalid credentials in Authorization header".

Run: python hub.py ROOT PORT [ADDRESS]   (the test bed starts it inside a container's network namespace, so the
container reaches it at http://127.0.0.1:PORT; nothing listens outside 127.0.0.0/8).
"""

import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".h5", ".msgpack", ".onnx")


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name, size):
    return name.endswith(LFS_SUFFIXES) or size >= 10 << 20


def make_repo(root, hub, files, *, branch="main", gated=False, accepted=(), commit=None):
    """Write a repository (one commit) under ROOT/repos: files {name: bytes}. Returns the commit id."""
    org, name = hub.split("/")
    base = os.path.join(root, "repos", org, name)
    if commit is None:
        h = hashlib.sha1()
        for n in sorted(files):
            h.update(n.encode() + b"\0" + hashlib.sha256(files[n]).digest())
        commit = h.hexdigest()
    cdir = os.path.join(base, "commits", commit)
    for n, data in files.items():
        p = os.path.join(cdir, n)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(data)
    meta_path = os.path.join(base, "repo.json")
    meta = {"refs": {}, "gated": gated, "accepted": list(accepted)}
    if os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
    meta["refs"][branch] = commit
    meta["gated"], meta["accepted"] = gated, list(accepted)
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    return commit


class Hub:
    def __init__(self, root):
        self.root = root
        self._cache = {}
        self._link = threading.Lock()
        self._link_next = 0.0  # when the shared link (link_bps) is free for the next slot

    def faults(self):
        try:
            with open(os.path.join(self.root, "faults.json")) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    def take_cut(self, name):
        """A cut happens once: the entry is removed when it is used."""
        path = os.path.join(self.root, "faults.json")
        f = self.faults()
        n = (f.get("cut") or {}).pop(name, None)
        if n is not None:
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(f, fh)
            os.replace(tmp, path)
        return n

    def tokens(self):
        try:
            with open(os.path.join(self.root, "tokens.json")) as fh:
                return set(json.load(fh))
        except (OSError, ValueError):
            return set()

    def repo(self, hub):
        base = os.path.join(self.root, "repos", *hub.split("/"))
        try:
            with open(os.path.join(base, "repo.json")) as fh:
                return base, json.load(fh)
        except (OSError, ValueError):
            return None, None

    def files(self, base, commit):
        key = (base, commit)
        if key not in self._cache:
            cdir = os.path.join(base, "commits", commit)
            out = {}
            for dp, _, fns in os.walk(cdir):
                for fn in fns:
                    p = os.path.join(dp, fn)
                    rel, size = os.path.relpath(p, cdir), os.path.getsize(p)
                    blob, sha = hashlib.sha1(b"blob %d\0" % size), hashlib.sha256()
                    with open(p, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            blob.update(chunk)
                            sha.update(chunk)
                    out[rel] = {"path": p, "size": size, "blob": blob.hexdigest(),
                                "sha256": sha.hexdigest() if is_lfs(rel, size) else None}
            self._cache[key] = out
        return self._cache[key]

    def link_slot(self, n, bps):
        """Wait for a slot of n bytes on the link all responses share: slots are handed out one after the other, so
        the responses sending at a time take turns (a fair share each) and together stay within bps."""
        with self._link:
            now = time.monotonic()
            t = max(now, self._link_next)
            self._link_next = t + n / bps
        if t > now:
            time.sleep(t - now)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vpd-testbed-hub/1"
    hub = None  # set by serve()

    def log_message(self, fmt, *args):  # one line per request in the server's log
        sys.stderr.write("%s %s\n" % (time.strftime("%H:%M:%S"), fmt % args))

    def do_HEAD(self):
        self.handle_any(head=True)

    def do_GET(self):
        self.handle_any(head=False)

    # ---------------------------------------------------------------- helpers

    def send(self, code, body=b"", headers=None, head=False):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = dict(headers or {}, **{"Content-Type": "application/json"})
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        drip = float(self.hub.faults().get("drip_listing_s") or 0)
        if not drip:
            self.wfile.write(body)
            return
        for i in range(len(body)):  # the answer one byte at a time (a listing that never arrives)
            try:
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
            except OSError:
                return
            time.sleep(drip)

    def error(self, code, ecode, msg, head=False):
        h = {"X-Error-Message": msg}
        if ecode:
            h["X-Error-Code"] = ecode
        self.send(code, {"error": msg}, h, head)

    def token(self):
        auth = self.headers.get("Authorization") or ""
        return auth[7:] if auth.startswith("Bearer ") else None

    def access(self, hub, meta, for_files, head):
        """None when the request may go on; else the error was sent."""
        tok = self.token()
        if tok is not None and tok not in self.hub.tokens():
            self.error(401, None, "Invalid credentials in Authorization header", head)
            return False
        if meta is None:
            self.error(401, "RepoNotFound", "Repository Not Found for url: %s." % self.path, head)
            return False
        if meta.get("gated") and for_files:
            if tok is None:
                self.error(401, "GatedRepo", "Access to model %s is restricted. You must have access to it and be "
                                             "authenticated to access it. Please log in." % hub, head)
                return False
            if tok not in meta.get("accepted", []):
                self.error(403, "GatedRepo", "Access to model %s is restricted and you are not in the authorized "
                                             "list. Visit http://%s/%s to ask for access."
                           % (hub, self.headers.get("Host") or "hub", hub), head)
                return False
        return True

    def commit_of(self, meta, rev):
        if re.fullmatch(r"[0-9a-f]{40}", rev) and rev in meta["refs"].values():
            return rev
        return meta["refs"].get(rev)

    def revision(self, hub, rev, for_files, head):
        """The repo HUB at REV -> (its directory, its meta, the commit); None when the error was sent (no access, no
        such revision)."""
        base, meta = self.hub.repo(hub)
        if not self.access(hub, meta, for_files, head):
            return None
        commit = self.commit_of(meta, rev)
        if commit is None:
            self.error(404, "RevisionNotFound", "Invalid rev id: %s" % rev, head)
            return None
        return base, meta, commit

    # ---------------------------------------------------------------- routing

    def handle_any(self, head):
        f = self.hub.faults()
        if f.get("down"):
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        u = urlsplit(self.path)
        path = unquote(u.path)
        m = re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?/?$", path)
        if m:
            return self.info(m.group(1), m.group(2) or "main", "blobs=true" in (u.query or ""), head)
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
        if m:
            return self.tree(m.group(1), unquote(m.group(2)), m.group(3) or "", head)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self.resolve(m.group(1), unquote(m.group(2)), m.group(3), head, f)
        m = re.match(r"^/cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)$", path)
        if m:
            return self.cdn(m.group(1), m.group(2), m.group(3), head, f)
        self.error(404, None, "not found", head)

    def info(self, hub, rev, blobs, head):
        found = self.revision(hub, rev, False, head)
        if found is None:
            return
        base, meta, commit = found
        sib = []
        lie = self.hub.faults().get("listing") or {}
        for name, fi in sorted(self.hub.files(base, commit).items()):
            s = {"rfilename": name}
            over = lie.get(name) or {}
            if blobs:
                size, sha = over.get("size", fi["size"]), over.get("sha256", fi["sha256"])
                s.update(size=size, blobId=over.get("blobId", fi["blob"]))
                if sha:
                    s["lfs"] = {"sha256": sha, "size": size, "pointerSize": 134}
            if "rfilename" in over:
                s["rfilename"] = over["rfilename"]
            sib.append(s)
        body = {"_id": hashlib.md5(hub.encode()).hexdigest()[:24], "id": hub, "modelId": hub,
                "sha": self.hub.faults().get("listing_sha", commit),
                "private": False, "gated": meta.get("gated") or False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": [], "siblings": sib, "lastModified": "2026-12-01T00:00:00.000Z",
                "usedStorage": sum(fi["size"] for fi in self.hub.files(base, commit).values())}
        self.send(200, body, head=head)

    def tree(self, hub, rev, prefix, head):
        """GET /api/models/ORG/NAME/tree/REV?recursive=true (what huggingface_hub 1.x/2.x lists a snapshot with)."""
        found = self.revision(hub, rev, False, head)
        if found is None:
            return
        base, meta, commit = found
        out, dirs = [], set()
        for name, fi in sorted(self.hub.files(base, commit).items()):
            if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                continue
            parts = name.split("/")
            for i in range(1, len(parts)):
                dirs.add("/".join(parts[:i]))
            e = {"type": "file", "oid": fi["blob"], "size": fi["size"], "path": name}
            if fi["sha256"]:
                e["lfs"] = {"oid": fi["sha256"], "size": fi["size"], "pointerSize": 134}
            out.append(e)
        out += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                for d in sorted(dirs)]
        self.send(200, out, head=head)

    def resolve(self, hub, rev, name, head, faults):
        found = self.revision(hub, rev, True, head)
        if found is None:
            return
        base, meta, commit = found
        fi = self.hub.files(base, commit).get(name)
        if fi is None:
            return self.error(404, "EntryNotFound", "%s does not exist on \"%s\"" % (name, rev), head)
        common = {"X-Repo-Commit": commit} if faults.get("no_ranges") else {"X-Repo-Commit": commit,
                                                                            "Accept-Ranges": "bytes"}
        if fi["sha256"]:
            # absolute, like the hub's CDN URLs: clients follow only relative redirects on HEAD
            # the CDN is another host name for this same server (localhost vs 127.0.0.1): a client must not send
            # the token there, and follows it only for the download
            port = self.server.server_address[1]
            loc = "http://localhost:%d/cdn/%s/%s/%s" % (port, hub, commit, name)
            return self.send(302, b"", dict(common, **{"Location": loc, "ETag": '"%s"' % fi["blob"],
                                                        "X-Linked-Etag": '"%s"' % fi["sha256"],
                                                        "X-Linked-Size": str(fi["size"])}), head)
        self.body(fi, name, dict(common, ETag='"%s"' % fi["blob"]), head, faults)

    def cdn(self, hub, commit, name, head, faults):
        base, meta = self.hub.repo(hub)
        if meta is None:
            return self.error(404, None, "not found", head)
        fi = self.hub.files(base, commit).get(name)
        if fi is None:
            return self.error(404, None, "not found", head)
        self.body(fi, name, {"ETag": '"%s"' % fi["sha256"], "Accept-Ranges": "bytes"}, head, faults)

    def body(self, fi, name, headers, head, faults):
        """The file (or the asked range of it), streamed from disk with the faults applied."""
        size = fi["size"]
        flip = {0} if name in (faults.get("corrupt") or []) else set()
        at = (faults.get("corrupt_at") or {}).get(name)
        flip.update(int(x) for x in (at if isinstance(at, list) else [] if at is None else [at]))
        start, end, code = 0, size - 1, 200
        rng = None if faults.get("no_ranges") else self.headers.get("Range")
        if faults.get("no_ranges"):
            headers = {k: v for k, v in headers.items() if k != "Accept-Ranges"}
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= size > 0:
                return self.send(416, b"", {"Content-Range": "bytes */%d" % size}, head)
            if not m.group(2) or int(m.group(2)) >= int(m.group(1)):  # M < N: not a valid range, ignored
                start, code = int(m.group(1)), 206
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                headers = dict(headers, **{"Content-Range": "bytes %d-%d/%d" % (start, end, size)})
        length = max(0, end - start + 1)
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if head:
            return
        cut = self.hub.take_cut(name)
        rate, link = float(faults.get("rate_bps") or 0), float(faults.get("link_bps") or 0)
        try:
            if faults.get("drip_s"):
                return self._drip(fi, start, length, float(faults["drip_s"]))
            self._stream(fi, name, start, length, cut, rate, link, flip)
        finally:  # what each body really sent: the log's "sent NAME BYTES" lines (bench/fetch_bench.py adds them up)
            sys.stderr.write("%s sent %s %d\n" % (time.strftime("%H:%M:%S"), name, self._sent))

    def _drip(self, fi, start, length, every):
        """One byte every EVERY seconds, until the client goes away (or the body ends)."""
        self._sent = 0
        with open(fi["path"], "rb") as fh:
            fh.seek(start)
            for _ in range(length):
                try:
                    self.wfile.write(fh.read(1))
                    self.wfile.flush()
                except OSError:
                    return
                self._sent += 1
                time.sleep(every)

    def _stream(self, fi, name, start, length, cut, rate, link, flip):
        self._sent = 0
        sent, t0, base, checked = 0, time.monotonic(), 0, time.monotonic()
        with open(fi["path"], "rb") as fh:
            fh.seek(start)
            while sent < length:
                if cut is not None and sent >= cut:
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                # paced: small steps, so that a slow link sends smoothly and a cut lands where it is asked
                step = 16384 if rate or link else 65536
                n = min(step, length - sent) if cut is None else max(1, min(step, length - sent, cut - sent))
                data = fh.read(n)
                if len(data) < n:  # the file got shorter under us: end the connection, as a broken server would
                    self.close_connection = True
                    return
                off = start + sent
                hit = [i for i in flip if off <= i < off + n]
                if hit:
                    data = bytearray(data)
                    for i in hit:
                        data[i - off] ^= 0xFF
                if link:
                    self.hub.link_slot(n, link)
                try:
                    self.wfile.write(data)
                except OSError:
                    return
                sent += n
                self._sent = sent
                if rate:
                    ahead = (sent - base) / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(min(ahead, 1.0))
                if (rate or link) and time.monotonic() - checked >= 0.2:  # the link may get fast (or slow) again
                    f = self.hub.faults()
                    checked, link = time.monotonic(), float(f.get("link_bps") or 0)
                    if float(f.get("rate_bps") or 0) != rate:
                        rate, t0, base = float(f.get("rate_bps") or 0), checked, sent


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # many parallel downloads connect at once (the default backlog is 5)


def start(root, log=None, timeout=20.0):
    """This hub as a process of its own on a free port of 127.0.0.1 (the tests' and the bench's way): -> (Popen,
    endpoint URL), once it answers (ROOT/hub.ready); its log lines go to LOG (a file), else nowhere."""
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = log if log is not None else subprocess.DEVNULL
    p = subprocess.Popen([sys.executable, "-SE", os.path.abspath(__file__), str(root), str(port)], stdout=out,
                         stderr=out, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(str(root), "hub.ready")):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError("the test bed hub did not start (exit %s)" % p.poll())
        time.sleep(0.05)
    return p, "http://127.0.0.1:%d" % port


class running:
    """`with running(ROOT) as hub:` the hub of ROOT (its repos made first, make_repo) for the block, as start() runs
    it; hub.endpoint, hub.root, hub.fault(**FAULTS) (writes ROOT/faults.json); the process is killed after."""

    def __init__(self, root, log=None):
        self.root, self.log = root, log

    def __enter__(self):
        self.proc, self.endpoint = start(self.root, self.log)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait(5)

    def fault(self, **kw):
        with open(os.path.join(str(self.root), "faults.json"), "w") as fh:
            json.dump(kw, fh)


def serve(root, port, address="127.0.0.1"):
    if not address.startswith("127."):
        raise SystemExit("the test bed hub listens on 127.0.0.0/8 only")
    Handler.hub = Hub(root)
    srv = Server((address, int(port)), Handler)
    with open(os.path.join(root, "hub.ready"), "w") as fh:
        fh.write("%d\n" % os.getpid())
    srv.serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), *(sys.argv[3:4] or ["127.0.0.1"]))
