"""The agent's entry: one action per exec (`PYTHON - ACTION ARGS_JSON`), or an agent session that answers one
request per stdin line. Each action's module is imported when that action runs, so `status` loads only what
status needs (not the installer, verify or doctor).

Output: zero or more {"event": ...} lines, then exactly one {"result": ..., "protocol": N}; an exception becomes
{"result": {"error", "traceback"}}. Every result is checked against the wire contract (protocol.py) before it
leaves.
"""

import os
import sys

from . import core
from .core import emit
from .protocol import DECLARED, PROTOCOL, check

# action -> "module:function" (imported on first use), from the one declaration of each action (protocol.py)
ACTIONS = {name: target for name, (target, _) in DECLARED.items()}


def handler(action):
    """The function that runs `action`, its module imported now; None for an unknown action."""
    target = ACTIONS.get(action)
    if target is None:
        return None
    mod, fn = target.split(":")
    __import__(__package__ + "." + mod)
    return getattr(sys.modules[__package__ + "." + mod], fn)


def run_action(action, args, rid=None):
    """Run one action and emit its one result line; 0 on success, 1 when it raised, 2 for an unknown action."""
    extra = {} if rid is None else {"id": rid}
    fn = handler(action)
    if fn is None:
        emit(result={"error": "unknown action %r" % action}, protocol=PROTOCOL, **extra)
        return 2
    try:
        res = fn(args)
        check(action, res)  # a result that breaks the shared protocol fails here, by name
        emit(result=res, protocol=PROTOCOL, **extra)
    except BrokenPipeError:
        raise
    except Exception as e:  # noqa: BLE001 - reported as data, with the traceback's last line
        import traceback

        emit(result={"error": "%s: %s" % (type(e).__name__, e), "traceback": traceback.format_exc()[-2000:]},
             **extra)
        return 1
    return 0


def session():
    """One agent process for all of an operation's steps (`deploy up` runs ~11 of them): each stdin line is a
    request {"id", "action", "args", "input", "secrets", "payload"} (base64); its events and its one result line
    (carrying the id) go to stdout, as for a single action. Ends at end of input. Secrets and payloads arrive on
    stdin, never in argv."""
    emit(ready=True, protocol=PROTOCOL, pid=os.getpid())
    for raw in sys.stdin.buffer:
        if not raw.strip():
            continue
        req = core.loads(raw)
        core.INPUT = req.get("input") or {}
        core.SECRETS = req.get("secrets") or {}
        if req.get("payload") is not None:
            import base64  # sessions only: a status exec does not load it (nor _struct and binascii)

            core.PAYLOAD = base64.b64decode(req["payload"])
        else:
            core.PAYLOAD = None
        args = dict(req.get("args") or {})
        args.update(core.INPUT)
        try:
            run_action(req.get("action"), args, req.get("id"))
        finally:
            core.INPUT, core.SECRETS, core.PAYLOAD = {}, {}, None  # nothing of one request outlives it
    return 0


def main(argv):
    action = argv[1]
    if action == "session":
        return session()
    args = core.loads(argv[2]) if len(argv) > 2 else {}
    args.update(core.INPUT)
    try:
        return run_action(action, args)
    except BrokenPipeError:
        return 1


def run(argv, sha, cache_dir, path):
    """Called by the bootstrap: take the preamble's inputs from __main__ (INPUT, SECRETS, PAYLOAD), note the
    archive this agent runs from (an install re-sends it to other interpreters), run, exit."""
    import _signal  # the C module: `signal` builds its enums at import (~1 ms of every exec)

    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    g = sys.modules["__main__"].__dict__
    core.INPUT = core.loads(g["INPUT_JSON"]) if "INPUT_JSON" in g else g.get("INPUT") or {}
    core.SECRETS = core.loads(g["SECRETS_JSON"]) if "SECRETS_JSON" in g else g.get("SECRETS") or {}
    core.PAYLOAD = g.get("PAYLOAD")
    if g.get("_SMI") is not None:
        core.EARLY["nvidia-smi"] = g["_SMI"]
    core.ARCHIVE = {"sha256": sha, "cache_dir": cache_dir, "path": path}
    if cache_dir and os.path.dirname(path) != cache_dir and argv[1:2] != ["session"]:
        emit(cache=False)  # ran from a temp file: the tool should not count on a cached copy here
    if cache_dir and path == os.path.join(cache_dir, sha + ".zip"):  # no usable compiled copy for this Python
        from .cache import compile_in_background

        compile_in_background(sha, cache_dir, path)
    sys.exit(main(argv))
