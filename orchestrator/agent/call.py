"""One agent action in a process of its own: `pct exec VMID -- PYTHON - ACTION ARGS_JSON`, the bootstrap (and any
inputs) on stdin, events and one result back. Also the reading of every answer into its typed result."""

from __future__ import annotations

import base64
import json
import time

from ..errors import AgentError, ContainerNotRunning
from . import archive
from .protocol import PROTOCOL, RESULT_TYPES, ProtocolError


def _b64json(obj) -> str:
    return base64.b64encode(json.dumps(obj).encode()).decode()


def agent_stdin(payload: bytes | None = None, secrets: dict | None = None, bulk: dict | None = None, *,
                cache_dir: str | None = None, inline: bool = True) -> bytes:
    """What a one-shot exec reads on stdin: a preamble with the inputs (secrets and payloads travel here: never in
    argv, never in the audit log), the archive when inline, then the bootstrap. cache_dir None keeps no cache in
    the container (the archive runs from a private temp file): the unit tests' way."""
    pre = b""
    if bulk:
        pre += f"import base64 as _b, json as _j; INPUT = _j.loads(_b.b64decode('{_b64json(bulk)}'))\n".encode()
    if secrets:
        pre += f"import base64 as _b, json as _j; SECRETS = _j.loads(_b.b64decode('{_b64json(secrets)}'))\n".encode()
    if payload is not None:
        pre += f"import base64 as _b; PAYLOAD = _b.b64decode('{base64.b64encode(payload).decode()}')\n".encode()
    if inline:
        pre += archive.inline()
    return pre + archive.cache_bootstrap(cache_dir)


def agent_argv(python: str, action: str, args: dict) -> list[str]:
    return [python, "-", action, json.dumps(args, sort_keys=True, separators=(",", ":"))]


def call(session, vmid: int, python: str, action: str, args: dict, *, payload: bytes | None = None,
         secrets: dict | None = None, bulk: dict | None = None, timeout: float = 60.0, on_event=None):
    """Run one agent action in the container, in a process of its own (one `pct exec`); returns its typed result.
    The archive goes inline only when this workstation does not know the container to hold this version
    (archive.known); a container that answers {"need": SHA} (exit 3, before anything ran: it lost its copy) gets
    the exec again with the archive inline, which it keeps. Raises on transport-level failure.
    AgentSession.call does the same over one agent process for many steps."""

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

    cache_dir = archive.cache_dir(args.get("state_dir"))
    key = archive.container_key(session.host, vmid, cache_dir)
    inline = not archive.known(key)
    deadline = time.monotonic() + timeout
    while True:
        res = session.ct(vmid, agent_argv(python, action, args),
                         stdin=agent_stdin(payload, secrets, bulk, cache_dir=cache_dir, inline=inline),
                         timeout=max(1.0, deadline - time.monotonic()), label=f"agent:{action}", on_line=on_line)
        result = proto = need = None
        for line in res.out.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and "result" in msg:
                result, proto = msg["result"], msg.get("protocol")
            elif isinstance(msg, dict) and "need" in msg:
                need = msg["need"]
        if result is None and need == archive.sha256() and res.exited == archive.NEED_EXIT and not inline:
            archive.remember(key, False)  # it lost its copy; nothing ran: send the exec again with the archive
            inline = True
            continue
        if result is not None:
            archive.remember(key, True)
        break
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
