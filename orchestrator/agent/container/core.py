"""The bottom of the agent: JSON output, the request in progress, control-sequence stripping, and the few helpers
every module uses. Imports nothing of the agent."""

import os
import sys
import time

# The request in progress (set by main.py from the preamble or the session's request line; reset after each):
# secrets and file payloads never come through argv.
INPUT = {}  # bulky, non-secret arguments (pinned config, fatal texts) that would clutter argv
SECRETS = {}
PAYLOAD = None
ARCHIVE = {}  # the archive this agent runs from: sha256, cache_dir, path (cache.py)
EARLY = {}  # processes the exec's preamble started before the agent loaded: {"nvidia-smi": (args, Popen or OSError)}


class LazyRe:
    """A pattern compiled at its first use: `status` imports modules whose patterns it mostly never uses, and each
    compile at import costs 0.1-0.5 ms of every exec (issue 54). Has the compiled pattern's methods (sub, match,
    search, ...), each looked up once."""

    def __init__(self, pattern, flags=0):
        self._args = (pattern, flags)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        import re  # here: `re` (with enum, functools, collections) costs ~9 ms of an exec that uses no pattern

        value = getattr(re.compile(*self._args), name)
        setattr(self, name, value)
        return value


# JSON without importing the `json` package: its decoder compiles patterns at import, so `import json` loads `re`
# and with it enum, functools and collections, ~9 ms of CPU in every status exec (issue 54), which otherwise needs
# no pattern. The same C codec `json` uses (`_json`: its scanner and encoder, with json.dumps/loads' defaults),
# the package itself where that is missing or differs.
def _codec():
    try:
        import _json

        class _Ctx:  # what the C scanner reads from a JSONDecoder
            strict = True
            object_hook = object_pairs_hook = None
            parse_float, parse_int = float, int

            @staticmethod
            def parse_constant(name):
                return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]

        def default(o):
            raise TypeError("Object of type %s is not JSON serializable" % type(o).__name__)

        scan = _json.make_scanner(_Ctx())
        enc = _json.make_encoder({}, default, _json.encode_basestring_ascii, None, ": ", ", ", False, False, True)
        if "".join(enc({"a": [1, 2.5, None, True, "\u00e9"]}, 0)) != '{"a": [1, 2.5, null, true, "\\u00e9"]}':
            raise TypeError("not the encoder this agent knows")
    except (ImportError, AttributeError, TypeError):
        import json

        return json.loads, json.dumps

    ws = " \t\n\r"

    def loads(s):
        """json.loads: one JSON document (str, or UTF-8 bytes), whitespace around it; ValueError otherwise."""
        if isinstance(s, (bytes, bytearray)):
            s = s.decode("utf-8")
        i = len(s) - len(s.lstrip(ws))
        try:
            obj, end = scan(s, i)
        except StopIteration as e:
            raise ValueError("not JSON: expecting a value at character %d" % e.value) from None
        if len(s.rstrip(ws)) != end:
            raise ValueError("not JSON: extra data at character %d" % end)
        return obj

    def dumps(obj):
        """json.dumps(obj) with its defaults (ASCII, ", " and ": ")."""
        markers = {}  # a fresh encoder per call: its circular-reference check keeps state while it runs
        return "".join(_json.make_encoder(markers, default, _json.encode_basestring_ascii, None, ": ", ", ", False,
                                          False, True)(obj, 0))

    return loads, dumps


loads, dumps = _codec()


# Terminal control sequences in log lines, cmdlines and comms: CSI (colours, cursor moves), OSC (window titles,
# hyperlinks; ended by BEL or ESC backslash), other ESC sequences (ESC c resets the terminal), and the remaining C0/C1
# controls except tab. Any of them could hide or rewrite lines of a confirmation prompt.
ANSI = LazyRe(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"
                  r"|\x1b[ -/]*[0-~]?|[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def clean(text):
    if text.replace("\n", "").replace("\t", "").isprintable():
        return text  # no control character (ANSI keeps tab and newline), so nothing to strip: nothing compiled
    return ANSI.sub("", text)


# the workstation refuses event lines over 256 KiB (issue 22): ours stay below, even written as \u escapes
EVENT_TEXT_MAX = 16000


def emit(**kw):
    if "event" in kw:
        for k in ("line", "message", "last"):
            v = kw.get(k)
            if isinstance(v, str) and len(v) > EVENT_TEXT_MAX:
                kw[k] = v[:EVENT_TEXT_MAX] + " ... (%d characters cut)" % (len(v) - EVENT_TEXT_MAX)
    sys.stdout.write(dumps(kw) + "\n")
    sys.stdout.flush()


def now():
    return time.time()


def wait_while(cond, seconds, step=0.05):
    """Poll cond() every `step` seconds while it holds, for at most `seconds`."""
    deadline = now() + seconds
    while cond() and now() < deadline:
        time.sleep(step)


def in_container():
    """True inside an LXC container: its init runs with container=lxc (systemd also records it in
    /run/systemd/container). When unsure, False: the callers then refuse to kill anything."""
    try:
        with open("/proc/1/environ", "rb") as fh:
            env = fh.read().split(b"\0")
        if any(e.startswith(b"container=") for e in env):
            return True
    except OSError:
        pass
    return os.path.exists("/run/systemd/container")


LAUNCH_ID_VAR = "VLLM_PVE_DEPLOY_LAUNCH"  # a random id in the environment of everything `launch` starts


def sha256_file(path):
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_or_none(path):
    try:
        return sha256_file(path)
    except OSError:
        return None


def _some(items, n=5):
    return ", ".join(items[:n]) + (", and %d more (--json lists all)" % (len(items) - n) if len(items) > n else "")

