"""One agent action in a process of its own: `pct exec VMID -- PYTHON - ACTION ARGS_JSON`, the bootstrap (and any
inputs) on stdin, events and one result back. Also the reading of every answer into its typed result."""

from __future__ import annotations

import base64
import json
import time

from orchestrator.core.errors import AgentError, ContainerNotRunning, OutputTooLarge
from . import archive
from .container.protocol import SMI_MEMORY_ARGS


def _json_literal(obj) -> str:
    """A Python string literal holding obj's JSON (ASCII: json escapes the rest; repr escapes quotes, newlines)."""
    return repr(json.dumps(obj, ensure_ascii=True))


# The first line of a status exec: start nvidia-smi at once (tens of ms on the test bed, 100-500 ms on real GPUs), so
# that it runs while the interpreter verifies the cached agent and imports what status needs; the agent's
# read_gpu_memory adopts that process (gpus.py: nvidia_smi), with the same timeout and error handling as its own.
# By os.posix_spawnp with two pipes, not subprocess: importing subprocess (and with it signal, threading, selectors,
# locale) cost ~6 ms of CPU in every status exec (issue 54); _SMI holds (args, (pid, stdout fd, stderr fd)).
EARLY_SMI = ("import os as _o\ntry:\n _r, _w = _o.pipe(); _q, _e = _o.pipe()\n"
             " _p = _o.posix_spawnp('nvidia-smi', ['nvidia-smi', *%r], _o.environ, file_actions=["
             "(_o.POSIX_SPAWN_OPEN, 0, '/dev/null', _o.O_RDONLY, 0), (_o.POSIX_SPAWN_DUP2, _w, 1), "
             "(_o.POSIX_SPAWN_DUP2, _e, 2)])\n _o.close(_w); _o.close(_e); _SMI = (%r, (_p, _r, _q))\n"
             "except OSError as _x: _SMI = (%r, _x)\n"
             % (list(SMI_MEMORY_ARGS), list(SMI_MEMORY_ARGS), list(SMI_MEMORY_ARGS))).encode()


def agent_stdin(payload: bytes | None = None, secrets: dict | None = None, bulk: dict | None = None, *,
                cache_dir: str | None = None, inline: bool = True, early_smi: bool = False) -> bytes:
    """What a one-shot exec reads on stdin: a preamble with the inputs (secrets and payloads travel here: never in
    argv, never in the audit log), the archive when inline, then the bootstrap. cache_dir None keeps no cache in
    the container (the archive runs from a private temp file): the unit tests' way. early_smi starts nvidia-smi
    first (EARLY_SMI)."""
    pre = EARLY_SMI if early_smi else b""
    # inputs as a Python literal of their (ASCII) JSON: repr() is always a valid literal; the agent decodes them
    # (main.run, with its own JSON codec: `import json` here would load `re` and ~9 ms with it, issue 54; base64
    # would load _struct and binascii in every status exec for nothing)
    if bulk:
        pre += f"INPUT_JSON = {_json_literal(bulk)}\n".encode()
    if secrets:
        pre += f"SECRETS_JSON = {_json_literal(secrets)}\n".encode()
    if payload is not None:
        pre += f"import base64 as _b; PAYLOAD = _b.b64decode('{base64.b64encode(payload).decode()}')\n".encode()
    if inline:
        pre += archive.inline()
    return pre + archive.cache_bootstrap(cache_dir)


# The largest program sent on the command line rather than stdin (Linux takes 128 KiB per argument; sshd and the
# host's shell see it whole); a bigger one (an inline archive) always goes on stdin.
ARGV_PROGRAM_MAX = 32 << 10

# Actions that need nothing but the standard library in the agent's own process (no vllm, transformers or hub
# imports there): run isolated and without `site` (-I -S), so the container's site-packages and their .pth start-up
# hooks never load. Faster (a vLLM venv's .pth files cost milliseconds on every exec) and no venv code runs inside
# `deploy status`. Other actions check vLLM in-process (stack, verify) and keep the interpreter's normal path.
ISOLATED = frozenset({"status"})


def agent_argv(python: str, action: str, args: dict, *, one_shot: bool = False, program: str | None = None
               ) -> list[str]:
    """The argv of one action in a process of its own (one_shot: `call`, -I -S for ISOLATED actions), or as a plan
    shows a step that an agent session runs (the session's interpreter has its normal path). The program comes
    on stdin (`-`), or with `program` on the command line (`-c PROGRAM`)."""
    flags = ["-I", "-S"] if one_shot and action in ISOLATED else []
    source = ["-"] if program is None else ["-c", program]
    return [python, *flags, *source, action, json.dumps(args, sort_keys=True, separators=(",", ":"))]


def call(session, vmid: int, python: str, action: str, args: dict, *, payload: bytes | None = None,
         secrets: dict | None = None, bulk: dict | None = None, timeout: float = 60.0, on_event=None,
         streaming: bool = False):
    """Run one agent action in the container, in a process of its own (one `pct exec`); returns its typed result.
    The archive goes inline only when this workstation does not know the container to hold this version
    (archive.known); a container that answers {"need": SHA} (exit 3, before anything ran: it lost its copy) gets
    the exec again with the archive inline, which it keeps. Raises on transport-level failure.
    AgentSession.call does the same over one agent process for many steps.
    streaming=True (`logs -f`): events are printed and dropped, so only the per-line cap applies."""

    where = session.host.name + ("" if vmid is None else f"/{vmid}")
    budget = EventBudget(action, where, streaming)

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

    cache_dir = archive.cache_dir(args.get("state_dir"))
    key = archive.container_key(session.host, vmid, cache_dir)
    inline = not archive.known(key)
    deadline = time.monotonic() + timeout
    while True:
        if inline:
            session.audit.write(host=session.host.name, vmid=vmid, event="agent archive sent", sha256=archive.sha256(),
                                bytes=len(archive.archive()), cache_dir=cache_dir)
        program = agent_stdin(payload, secrets, bulk, cache_dir=cache_dir, inline=inline,
                              early_smi=action == "status")
        argv = agent_argv(python, action, args, one_shot=True)
        audit_argv = None
        if not (payload is not None or secrets or inline) and len(program) <= ARGV_PROGRAM_MAX:
            # nothing secret and no archive: the program goes on the command line (`-c`), not stdin. sshd opens
            # a session channel with a zero window and grants it once the command runs, so stdin costs a round
            # trip of its own: on the command line the answer comes one round trip sooner (50 ms at 50 ms RTT)
            argv = agent_argv(python, action, args, one_shot=True, program=program.decode())
            audit_argv = agent_argv(python, action, args, one_shot=True,
                                    program=f"<agent bootstrap, {len(program)} bytes>")
            program = None
        kw = dict(stdin=program, audit_argv=audit_argv, timeout=max(1.0, deadline - time.monotonic()),
                  label=f"agent:{action}", on_line=on_line)
        # vmid None: on the Proxmox host itself (the shared model store's fetch; store.py), by the host's python3
        res = session.ct(vmid, argv, **kw) if vmid is not None else session.run(argv, **kw)
        result = proto = need = None
        cached = True
        for line in res.out.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and "result" in msg:
                result, proto = msg["result"], msg.get("protocol")
            elif isinstance(msg, dict) and "need" in msg:
                need = msg["need"]
            elif isinstance(msg, dict) and msg.get("cache") is False:
                cached = False  # it could not keep the archive (a state directory that is not deploy's own)
        if result is None and need == archive.sha256() and res.exited == archive.NEED_EXIT and not inline:
            archive.remember(key, False)  # it lost its copy; nothing ran: send the exec again with the archive
            inline = True
            continue
        if result is not None:
            archive.remember(key, cached)
        break
    return interpret(result, proto, action, python, where=where, vmid=vmid, exited=res.exited,
                     err=res.err.strip() or res.out.strip())


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
    from .protocol import PROTOCOL, RESULT_TYPES, ProtocolError  # its ~20 dataclasses: loaded when answers come

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
