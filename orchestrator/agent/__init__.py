"""Local side of the in-container agent: send agent.py with its inputs, read back events and one result."""

from __future__ import annotations

import base64
import json
import os
import select
import threading
import time
import zlib
from functools import lru_cache

from ..errors import AgentError, ContainerNotRunning, DeployError  # noqa: F401 (re-exported)
from ..errors import OutputTooLarge, RemoteTimeout, Unreachable
from ..remote import HostSession, pct_exec_argv
from .protocol import PROTOCOL, RESULT_TYPES, AgentResult, ProtocolError  # noqa: F401

AGENT_PATH = os.path.join(os.path.dirname(__file__), "agent.py")
PROTOCOL_PATH = os.path.join(os.path.dirname(__file__), "protocol.py")


@lru_cache(maxsize=1)
def agent_source() -> bytes:
    with open(AGENT_PATH, "rb") as fh:
        return fh.read()


@lru_cache(maxsize=1)
def protocol_source() -> bytes:
    with open(PROTOCOL_PATH, "rb") as fh:
        return fh.read()


def _packed(src: bytes, name: str) -> bytes:
    blob = base64.b85encode(zlib.compress(src, 9))
    n = name.encode()
    return (b"_AGENT_SRC['" + n + b"'] = _zl.decompress(_b85.b85decode(b'" + blob + b"'))\n"
            b"exec(compile(_AGENT_SRC['" + n + b"'], '" + n + b"', 'exec'))\n")


@lru_cache(maxsize=1)
def agent_program() -> bytes:
    """The agent as sent on stdin: a bootstrap that inflates the zlib-compressed protocol (the result types both
    sides share) and agent, and runs them in __main__ (about a third of the bytes; base85 has no quote or
    backslash, so the literal is safe). Tracebacks still name protocol.py / agent.py and their line numbers.
    The sources stay in _AGENT_SRC (name -> bytes): an install re-sends them to its detached runner and to a
    staging venv's Python."""
    return (b"import base64 as _b85, zlib as _zl\n_AGENT_SRC = {}\n" + _packed(protocol_source(), "protocol.py")
            + _packed(agent_source(), "agent.py"))


def _b64json(obj) -> str:
    return base64.b64encode(json.dumps(obj).encode()).decode()


def agent_stdin(payload: bytes | None = None, secrets: dict | None = None, bulk: dict | None = None) -> bytes:
    """Secrets and payloads travel in a preamble on stdin: never in argv, never in the audit log."""
    pre = b""
    if bulk:
        pre += f"import base64 as _b, json as _j; INPUT = _j.loads(_b.b64decode('{_b64json(bulk)}'))\n".encode()
    if secrets:
        pre += f"import base64 as _b, json as _j; SECRETS = _j.loads(_b.b64decode('{_b64json(secrets)}'))\n".encode()
    if payload is not None:
        pre += f"import base64 as _b; PAYLOAD = _b.b64decode('{base64.b64encode(payload).decode()}')\n".encode()
    return pre + agent_program()


def agent_argv(python: str, action: str, args: dict) -> list[str]:
    return [python, "-", action, json.dumps(args, sort_keys=True, separators=(",", ":"))]


def call(session: HostSession, vmid: int, python: str, action: str, args: dict, *, payload: bytes | None = None,
         secrets: dict | None = None, bulk: dict | None = None, timeout: float = 60.0, on_event=None,
         streaming: bool = False):
    """Run one agent action in the container, in a process of its own (one `pct exec`); returns its typed result.
    Raises on transport-level failure. AgentSession.call does the same over one agent process for many steps.
    streaming=True (`logs -f`): events are printed and dropped, so only the per-line cap applies."""

    budget = EventBudget(action, f"{session.host.name}/{vmid}", streaming)

    def on_line(raw: bytes):
        """Events go to on_event and are not kept: a long `logs -f` holds only the line in progress."""
        if not raw.startswith(b'{"event"'):
            return True
        budget.take(raw)
        try:
            msg = json.loads(raw)
        except ValueError:
            return True
        if on_event is not None:
            on_event(msg)
        return False

    res = session.ct(vmid, agent_argv(python, action, args), stdin=agent_stdin(payload, secrets, bulk),
                     timeout=timeout, label=f"agent:{action}", on_line=on_line)
    result = proto = None
    for line in res.out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and "result" in msg:
            result, proto = msg["result"], msg.get("protocol")
    return interpret(result, proto, action, python, where=f"{session.host.name}/{vmid}", vmid=vmid,
                     exited=res.exited, err=res.err.strip() or res.out.strip())


def interpret(result, proto, action: str, python: str, *, where: str, vmid: int, exited: int | None, err: str):
    """One agent answer -> its typed result, or the error that says what went wrong and what to do."""
    if result is None:
        if "not running" in err:
            raise ContainerNotRunning(f"container {vmid} is not running ({err})", where=where,
                                      fix=f"start it: ssh to the host and run `pct start {vmid}`")
        if "does not exist" in err and ".conf" in err:
            raise ContainerNotRunning(f"container {vmid} does not exist on this host ({err})", where=where,
                                      fix="check target.vmid in the playbook and the inventory")
        if exited == 127 or "No such file" in err or "not found" in err:
            raise AgentError(f"cannot run {python} in the container: {err}", where=where,
                             fix="set runtime.python in the playbook to the Python that runs vLLM")
        if exited == -1:
            raise AgentError(f"agent action {action!r} ended without an exit status (killed by a signal?)",
                             where=where, fix="look for an OOM kill on the host: dmesg -T | grep -i -e oom -e killed")
        raise AgentError(f"agent action {action!r} failed (exit {exited}): {err}", where=where)
    if isinstance(result, dict) and "error" in result and "traceback" in result:
        raise AgentError(f"agent action {action!r} crashed: {result['error']}", where=where,
                         details={"traceback": result["traceback"]})
    if proto != PROTOCOL:
        raise AgentError(f"agent action {action!r} answered in protocol {proto}, this deploy speaks {PROTOCOL}",
                         where=where, fix="a bug: the agent is sent with the tool, so both should match; report it")
    typ = RESULT_TYPES.get(action)
    if typ is None:
        return result
    try:
        return typ.parse(action, result)
    except ProtocolError as e:
        raise AgentError(str(e), where=where, fix="a bug in deploy's agent; report it with deploy's audit log")


# The session bootstrap, in argv: read the agent program (its length is argv[1]) from stdin, then run it as
# `agent.py session`, which reads one request per line from the rest of stdin.
SESSION_BOOT = ('import sys; n = int(sys.argv[1]); src = sys.stdin.buffer.read(n); '
                'sys.argv = ["agent.py", "session"]; exec(compile(src, "<agent>", "exec"))')


class AgentSession:
    """One agent process in a container for all of an operation's steps: one `pct exec` and one Python start
    instead of one per step (`deploy up` has ~11). Requests go one at a time (a lock); each has its own deadline,
    and a missed deadline or a lost channel ends the session (the next call starts a new one). Every request is
    written to the audit log like a command of its own (secrets redacted, stdin bytes counted)."""

    def __init__(self, session: HostSession, vmid: int, python: str):
        self.session, self.vmid, self.python = session, vmid, python
        self.where = f"{session.host.name}/{vmid}"
        self._chan = None
        self._buf = bytearray()
        self._err = bytearray()
        self._next = 0
        self._lock = threading.Lock()
        self.starts = 0

    # ---------------------------------------------------------------- channel

    def _open(self, timeout: float) -> None:
        prog = agent_program()
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
        if hello.get("protocol") != PROTOCOL:
            self.close()
            raise AgentError(f"the agent session answered {line[:200]!r}, not protocol {PROTOCOL}", where=self.where,
                             fix="a bug: the agent is sent with the tool, so both should match; report it")

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
                    if line.startswith(b'{"event"'):
                        budget.take(line)
                        try:
                            ev = json.loads(line)
                        except ValueError:
                            continue
                        if on_event is not None:
                            on_event(ev)
                        continue
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(msg, dict) and "result" in msg and msg.get("id") in (rid, None):
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


# ---- untrusted input: caps on what an agent answer may make deploy hold, print and log (issue 22)
MAX_LINE = 64 << 20        # one answer line (a result: logs and doctor bring the most)
MAX_STDERR = 1 << 20       # the session's stderr (only read for an error message)
MAX_EVENT_LINE = 256 << 10  # one progress event
MAX_EVENTS = 50000         # events per request (an install's log lines come in attach calls of FOLLOW_S each)
MAX_EVENT_BYTES = 16 << 20  # event bytes per request: what one request may add to the screen and the audit log
# (the agent itself cuts an event's text at 16000 characters, so its own events stay below MAX_EVENT_LINE;
# `logs -f`, whose lines are printed and neither kept nor audited, has no count or byte cap, only the line cap)


class EventBudget:
    """Counts one request's events; over a cap, OutputTooLarge (the request fails, a session ends)."""

    def __init__(self, action: str, where: str, streaming: bool = False):
        self.action, self.where, self.n, self.bytes, self.streaming = action, where, 0, 0, streaming

    def take(self, line: bytes) -> None:
        self.n += 1
        self.bytes += len(line)
        why = (f"an event line of {len(line)} bytes (cap {MAX_EVENT_LINE})" if len(line) > MAX_EVENT_LINE else
               None if self.streaming else
               f"more than {MAX_EVENTS} events" if self.n > MAX_EVENTS else
               f"more than {MAX_EVENT_BYTES} bytes of events" if self.bytes > MAX_EVENT_BYTES else None)
        if why:
            raise OutputTooLarge(f"the agent's {self.action!r} answer sent {why}; it was stopped there",
                                 where=self.where, fix="something in the container floods the agent's output; check "
                                                       "it directly (deploy doctor), then retry")


class _SessionEnded(Exception):
    def __init__(self, exited: int):
        super().__init__(exited)
        self.exited = exited
