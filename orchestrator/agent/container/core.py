"""The bottom of the agent: JSON output, the request in progress, control-sequence stripping, and the few helpers
every module uses. Imports nothing of the agent."""

import json
import os
import re
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
        value = getattr(re.compile(*self._args), name)
        setattr(self, name, value)
        return value


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
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def now():
    return time.time()


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


def on_pve_host():
    return os.path.isdir("/etc/pve") and not in_container()


LAUNCH_ID_VAR = "VLLM_PVE_DEPLOY_LAUNCH"  # a random id in the environment of everything `launch` starts


def sha256_file(path):
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def _some(items, n=5):
    return ", ".join(items[:n]) + (", and %d more (--json lists all)" % (len(items) - n) if len(items) > n else "")

