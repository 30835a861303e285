"""Loopback HTTP to vLLM (a plain HTTP/1.0 exchange on a socket: importing http.client would cost ~11 ms of every
status), TCP listeners from /proc/net/tcp{,6}, and the rule that the API key goes only to a listener proven ours."""

import errno
import os

from .core import dumps, now
from .procs import pids, proc_cmdline, proc_comm
from .state import proven


HTTP_MAX_BYTES = 64 << 20


def http(port, path, method="GET", body=None, timeout=5.0, api_key=None, host="127.0.0.1"):
    """(status, body_text) or (None, error_text). Loopback only: vLLM runs in this container.

    A plain HTTP/1.0 exchange on a socket (the server closes the connection to end the body; chunked replies are
    decoded anyway): importing http.client would cost ~11 ms of every status call."""
    data = dumps(body).encode() if body is not None else b""
    head = ["%s %s HTTP/1.0" % (method, path), "Host: %s:%d" % (host, port), "Connection: close",
            "Content-Length: %d" % len(data)]
    if body is not None:
        head.append("Content-Type: application/json")
    if api_key:
        head.append("Authorization: Bearer " + api_key)
    deadline = now() + timeout
    try:
        sock = _connect(host, port, timeout)
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            chunks, got = [], 0
            while True:
                left = deadline - now()
                if left <= 0:
                    raise TimeoutError("no complete answer within %gs" % timeout)
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
                if got > HTTP_MAX_BYTES:
                    raise OSError(errno.EFBIG, "answer larger than %d bytes" % HTTP_MAX_BYTES)
        finally:
            sock.close()
        raw = b"".join(chunks)
        header, sep, payload = raw.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if not sep or len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            return None, "BadStatusLine: %r" % lines[0][:100]
        if any(ln.lower().replace(" ", "") == "transfer-encoding:chunked" for ln in lines[1:]):
            payload = _dechunk(payload)
        return int(parts[1]), payload.decode("utf-8", "replace")
    except OSError as e:
        return None, "%s: %s" % (type(e).__name__, e)


def _connect(host, port, timeout):
    """socket.create_connection on the C module: `socket` builds its enums and imports selectors at import (~2 ms
    of every status exec). Each address getaddrinfo gives, in turn; the last error if none answers."""
    import _socket  # here: an idle container's status sends no request

    try:  # an ASCII address as bytes: getaddrinfo then skips the idna codec (~1 ms to import per status)
        where = host.encode("ascii")
    except UnicodeEncodeError:
        where = host
    err = None
    for family, kind, proto, _, addr in _socket.getaddrinfo(where, port, 0, _socket.SOCK_STREAM):
        sock = _socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as e:
            err = e
            sock.close()
    raise err or OSError("getaddrinfo returned nothing for %s" % host)


def _dechunk(payload):
    out, rest = [], payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)


def port_listeners(port):
    """Is anything listening on TCP `port` in this container? Parsed from /proc/net/tcp{,6} (state 0A)."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    local, state, inode = f[1], f[3], f[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        found.append({"table": name, "local": local, "inode": inode})
        except (OSError, StopIteration):
            continue
    return found


def socket_owners(inodes):
    """{pid: [inode, ...]} of the processes holding the sockets with these inodes (from /proc/PID/fd links)."""
    want = {"socket:[%s]" % i: i for i in inodes}
    out = {}
    for pid in pids():
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                t = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if t in want:
                out.setdefault(pid, []).append(want[t])
    return out


def serving_host(st):
    """Where to reach vLLM: serve.host when it is a specific address (then 127.0.0.1 is not vLLM's), else loopback."""
    h = (st or {}).get("host")
    return h if h and h not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"


def listener_check(st, port):
    """May the API key go to whatever listens on `port`? Only if every process holding a listening socket on that
    port is proven ours (the recorded group and launch id): any other listener could be the one that answers.
    -> (ok, problem) where problem names the strangers."""
    listeners = port_listeners(int(port))
    if not listeners:
        return False, "nothing listens on port %s yet" % port
    owners = socket_owners([ln["inode"] for ln in listeners])
    strangers = [p for p in owners if not (st and proven(st, p))]
    if strangers or not owners:
        who = ", ".join("pid %d (%s)" % (p, proc_comm(p)) for p in strangers[:5]) or "a process this agent cannot see"
        return False, ("port %s is held by %s, not by the deployment's own processes: the API key was not sent"
                       % (port, who))
    return True, ""


def act_port_check(a):
    listeners = port_listeners(int(a["port"]))
    if listeners:  # name who listens (issue 53: "1 listener(s)" said nothing of what to stop)
        owners = socket_owners([ln["inode"] for ln in listeners])
        for ln in listeners:
            ln["pids"] = [{"pid": p, "comm": proc_comm(p), "cmdline": proc_cmdline(p)[:300]}
                          for p, inodes in sorted(owners.items()) if ln["inode"] in inodes][:5]
    return {"port": a["port"], "listeners": listeners}
