"""An agent session: one agent process in a container for all of an operation's steps, one request per stdin
line, over one channel of the host's SSH connection (remote.py, the transport below it)."""

from __future__ import annotations

import base64
import json
import select
import threading
import time

from orchestrator.core.errors import AgentError, OutputTooLarge, RemoteTimeout, Unreachable
from orchestrator.core.remote import HostSession, pct_exec_argv
from . import archive
from .call import MAX_LINE, MAX_STDERR, EventBudget, agent_argv, interpret
from .container.protocol import PROTOCOL


def session_for(host: HostSession, vmid: int, python: str, state_dir: str | None = None) -> "AgentSession":
    """The agent process kept for this container and Python during this invocation (started on first use),
    kept by the host session, which closes it with the connection. A transport double without `keep` (the
    decision tests' fake host session) brings its own: its agent_session(vmid, python)."""
    keep = getattr(host, "keep", None)
    if keep is None:
        return host.agent_session(vmid, python)
    return keep(("agent", vmid, python), lambda: AgentSession(host, vmid, python, state_dir))


# The session bootstrap, in argv: read the agent's bootstrap (archive.py; its length is argv[1]) from stdin and run
# it as `agent.py session`: it runs the cached archive (or asks for it on this channel), which then reads one
# request per line from the rest of stdin.
SESSION_BOOT = ('import sys; n = int(sys.argv[1]); src = sys.stdin.buffer.read(n); '
                'sys.argv = ["agent.py", "session"]; exec(compile(src, "<agent>", "exec"))')


class AgentSession:
    """One agent process in a container for all of an operation's steps: one `pct exec` and one Python start
    instead of one per step (`deploy up` has ~11). Requests go one at a time (a lock); each has its own deadline,
    and a missed deadline or a lost channel ends the session (the next call starts a new one). Every request is
    written to the audit log like a command of its own (secrets redacted, stdin bytes counted)."""

    def __init__(self, session: HostSession, vmid: int, python: str, state_dir: str | None = None):
        self.session, self.vmid, self.python = session, vmid, python
        self.cache_dir = archive.cache_dir(state_dir)
        self.where = f"{session.host.name}/{vmid}"
        self._chan = None
        self._buf = bytearray()
        self._err = bytearray()
        self._next = 0
        self._lock = threading.Lock()
        self.starts = 0

    # ---------------------------------------------------------------- channel

    def _open(self, timeout: float) -> None:
        prog = archive.cache_bootstrap(self.cache_dir)
        argv = [self.python, "-c", SESSION_BOOT, str(len(prog))]
        keep = self.session.keep_env_supported is not False
        chan = self.session.open_exec(pct_exec_argv(self.vmid, argv, keep), vmid=self.vmid,
                                      audit_argv=[self.python, "-c", "<agent session bootstrap>", str(len(prog))],
                                      label="agent:session", stdin_bytes=len(prog), timeout=timeout)
        chan.sendall(prog)
        self._chan, self._buf, self._err = chan, bytearray(), bytearray()
        self.starts += 1
        try:
            line = self._readline(time.monotonic() + timeout)
        except OutputTooLarge:
            self.close()
            raise
        except _SessionEnded as e:
            if keep and self.session.keep_env_supported is None and b"Unknown option: keep-env" in self._err:
                self.session.keep_env_supported = False  # pct refused while parsing: nothing ran
                self.close()
                return self._open(timeout)
            self.close()
            interpret(None, None, "session", self.python, where=self.where, vmid=self.vmid, exited=e.exited,
                      err=self._err.decode("utf-8", "replace").strip())
        if keep and self.session.keep_env_supported is None:
            self.session.keep_env_supported = True
        try:
            hello = json.loads(line)
        except ValueError:
            hello = {}
        if isinstance(hello, dict) and hello.get("need") == archive.sha256():
            line, hello = self._send_archive(time.monotonic() + timeout)
        if isinstance(hello, dict) and hello.get("protocol") == PROTOCOL:
            archive.remember(archive.container_key(self.session.host, self.vmid, self.cache_dir), True)
        if hello.get("protocol") != PROTOCOL:
            self.close()
            raise AgentError(f"the agent session answered {line[:200]!r}, not protocol {PROTOCOL}", where=self.where,
                             fix="a bug: the agent is sent with the tool, so both should match; report it")

    def _send_archive(self, deadline: float):
        """The container lacks this version of the agent: send the archive on the same channel (its length, a
        newline, the bytes); the bootstrap checks its sha256, keeps it, and answers with the session's hello."""
        data = archive.archive()
        self._chan.sendall(b"%d\n" % len(data) + data)
        self.session.audit.write(host=self.session.host.name, vmid=self.vmid, event="agent archive sent",
                                 sha256=archive.sha256(), bytes=len(data), cache_dir=self.cache_dir)
        try:
            line = self._readline(deadline)
        except _SessionEnded as e:
            self.close()
            interpret(None, None, "session", self.python, where=self.where, vmid=self.vmid, exited=e.exited,
                      err=self._err.decode("utf-8", "replace").strip())
        try:
            return line, json.loads(line)
        except ValueError:
            return line, {}

    def _readline(self, deadline: float) -> bytes:
        chan = self._chan
        while True:
            k = self._buf.find(b"\n")
            if k >= 0:
                line = bytes(self._buf[:k])
                del self._buf[:k + 1]
                return line
            if len(self._buf) > MAX_LINE:
                raise OutputTooLarge(f"the agent wrote a line of more than {MAX_LINE} bytes", where=self.where,
                                     fix="the remote side misbehaves; check it directly")
            while chan.recv_stderr_ready():
                self._err += chan.recv_stderr(65536)
                if len(self._err) > MAX_STDERR:
                    raise OutputTooLarge(f"the agent wrote more than {MAX_STDERR} bytes to stderr; the session was "
                                         "ended", where=self.where,
                                         fix="something in the container floods the agent's stderr; check it "
                                             "directly (deploy doctor), then retry")
            if chan.recv_ready():
                chunk = chan.recv(65536)
                if chunk:
                    self._buf += chunk
                    continue
            if chan.exit_status_ready() and not chan.recv_ready():
                while chan.recv_stderr_ready():
                    self._err += chan.recv_stderr(65536)
                raise _SessionEnded(chan.recv_exit_status())
            if chan.closed or chan.eof_received and not chan.recv_ready():
                raise _SessionEnded(-1)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteTimeout("no answer in time")
            select.select([chan], [], [], min(remaining, 1.0))

    def close(self) -> None:
        if self._chan is not None:
            try:
                self._chan.close()
            except Exception:  # noqa: BLE001
                pass
            self._chan = None

    # ---------------------------------------------------------------- requests

    def call(self, action: str, args: dict, *, payload: bytes | None = None, secrets: dict | None = None,
             bulk: dict | None = None, timeout: float = 60.0, on_event=None):
        with self._lock:
            started = time.monotonic()
            deadline = started + timeout
            if self._chan is None or self._chan.closed:
                self._open(min(timeout, 60.0))
            self._next += 1
            rid = self._next
            req = {"id": rid, "action": action, "args": args, "input": bulk or None, "secrets": secrets or None,
                   "payload": base64.b64encode(payload).decode() if payload is not None else None}
            raw = json.dumps(req, separators=(",", ":")).encode() + b"\n"
            audit = self.session.audit
            argv = agent_argv(self.python, action, args)
            audit.write(host=self.session.host.name, vmid=self.vmid, starting=argv, label=f"agent:{action}",
                        session=self.starts)
            result = proto = None
            exited = 0
            budget = EventBudget(action, self.where)
            try:
                self._chan.sendall(raw)
                while True:
                    line = self._readline(deadline)
                    event = line.startswith(b'{"event"')
                    if event:
                        budget.take(line)
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if event:
                        if on_event is not None:
                            on_event(msg)
                    elif isinstance(msg, dict) and "result" in msg and msg.get("id") in (rid, None):
                        result, proto = msg["result"], msg.get("protocol")
                        break
            except RemoteTimeout:
                self.close()  # a late answer would belong to no request: the session ends here
                audit.write(host=self.session.host.name, vmid=self.vmid, argv=argv, exit=None, session=self.starts,
                            duration=round(time.monotonic() - started, 4), label=f"agent:{action}",
                            error=f"no answer within {timeout:g} s")
                raise RemoteTimeout(f"command did not finish within {timeout:g} s: agent {action} in container "
                                    f"{self.vmid}", where=self.where,
                                    fix="the remote side may be hung (e.g. a wedged nvidia-smi); check the host")
            except _SessionEnded as e:
                exited = e.exited
                self.close()
                if exited == -1 and not self.session.alive():
                    raise Unreachable("SSH connection lost during a command", where=self.session.host.name,
                                      fix="check the host; run `deploy status` to see what state was left")
            except OutputTooLarge as e:
                self.close()  # over a cap: this request fails and the session ends (the next call starts anew)
                audit.write(host=self.session.host.name, vmid=self.vmid, argv=argv, exit=None, session=self.starts,
                            duration=round(time.monotonic() - started, 4), label=f"agent:{action}",
                            error=e.message[:300])
                raise
            except (OSError, EOFError) as e:
                self.close()
                raise Unreachable(f"SSH connection lost during a command: {e or type(e).__name__}",
                                  where=self.session.host.name,
                                  fix="check the host; run `deploy status` to see what state was left") from e
            except BaseException:  # Ctrl-C mid-request: its answer would block the next request; start afresh
                self.close()
                raise
            audit.write(host=self.session.host.name, vmid=self.vmid, argv=argv, exit=0 if result is not None else exited,
                        duration=round(time.monotonic() - started, 4), label=f"agent:{action}", session=self.starts,
                        stdin_bytes=len(raw))
            return interpret(result, proto, action, self.python, where=self.where, vmid=self.vmid, exited=exited,
                             err=self._err.decode("utf-8", "replace").strip())


class _SessionEnded(Exception):
    def __init__(self, exited: int):
        super().__init__(exited)
        self.exited = exited
