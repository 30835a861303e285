"""Local side of the in-container agent: send agent.py with its inputs, read back events and one result."""

from __future__ import annotations

import base64
import json
import os
import zlib
from functools import lru_cache

from ..errors import AgentError, ContainerNotRunning, DeployError  # noqa: F401 (re-exported)
from ..remote import HostSession
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
    return b"exec(compile(_zl.decompress(_b85.b85decode(b'" + blob + b"')), '" + name.encode() + b"', 'exec'))\n"


@lru_cache(maxsize=1)
def agent_program() -> bytes:
    """The agent as sent on stdin: a bootstrap that inflates the zlib-compressed protocol (the result types both
    sides share) and agent, and runs them in __main__ (about a third of the bytes; base85 has no quote or
    backslash, so the literal is safe). Tracebacks still name protocol.py / agent.py and their line numbers."""
    return (b"import base64 as _b85, zlib as _zl\n" + _packed(protocol_source(), "protocol.py")
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
         secrets: dict | None = None, bulk: dict | None = None, timeout: float = 60.0, on_event=None) -> dict:
    """Run one agent action in the container; returns its result dict. Raises on transport-level failure."""

    def on_line(raw: bytes):
        """Events go to on_event and are not kept: a long `logs -f` holds only the line in progress."""
        if not raw.startswith(b'{"event"'):
            return True
        try:
            msg = json.loads(raw)
        except ValueError:
            return True
        if on_event is not None:
            on_event(msg)
        return False

    res = session.ct(vmid, agent_argv(python, action, args), stdin=agent_stdin(payload, secrets, bulk),
                     timeout=timeout, label=f"agent:{action}", on_line=on_line)
    result = None
    proto = None
    for line in res.out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and "result" in msg:
            result, proto = msg["result"], msg.get("protocol")
    where = f"{session.host.name}/{vmid}"
    if result is None:
        err = res.err.strip() or res.out.strip()
        if "not running" in err:
            raise ContainerNotRunning(f"container {vmid} is not running ({err})", where=where,
                                      fix=f"start it: ssh to the host and run `pct start {vmid}`")
        if "does not exist" in err and ".conf" in err:
            raise ContainerNotRunning(f"container {vmid} does not exist on this host ({err})", where=where,
                                      fix="check target.vmid in the playbook and the inventory")
        if res.exited == 127 or "No such file" in err or "not found" in err:
            raise AgentError(f"cannot run {python} in the container: {err[:300]}", where=where,
                             fix="set runtime.python in the playbook to the Python that runs vLLM")
        if res.exited == -1:
            raise AgentError(f"agent action {action!r} ended without an exit status (killed by a signal?)",
                             where=where, fix="look for an OOM kill on the host: dmesg -T | grep -i -e oom -e killed")
        raise AgentError(f"agent action {action!r} failed (exit {res.exited}): {err[:500]}", where=where)
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
