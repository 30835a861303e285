"""Progress on stderr while things run; tables and JSON at the end. Colour only on a TTY.

Nothing a user needs is cut: on a TTY, text wraps at the terminal width; otherwise lines are written whole. A table
cell too long for its column moves, whole, to a details block under the table (`[n]` marks where it belongs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import textwrap
import threading
import time
from contextlib import contextmanager

DETAIL_CELL = 48  # a longer cell goes to the details block, so a table stays a table (not the last column)


def _tty(stream) -> bool:
    try:
        return stream.isatty() and not os.environ.get("NO_COLOR")
    except (AttributeError, ValueError):
        return False


def term_width(stream=None) -> int | None:
    """The terminal's width when `stream` is a TTY (COLUMNS wins); None (no limit) when it is not."""
    stream = stream or sys.stdout
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return max(40, shutil.get_terminal_size((100, 24)).columns)


def wrap(text: str, width: int | None, indent: int = 0) -> str:
    """Wrap each line of text at width, continuation lines indented by `indent`; words (paths) are never broken."""
    if not width:
        return text
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = len(line) - len(line.lstrip(" "))
        out += textwrap.wrap(line, width=width, subsequent_indent=" " * max(lead, indent), break_long_words=False,
                             break_on_hyphens=False, drop_whitespace=True) or [line]
    return "\n".join(out)


# ---- the output boundary (issue 22, docs/architecture.md "Threat model")
# Much of what deploy prints comes from containers (process names and argv, log lines, state files, agent
# answers): a compromised container could set the window title, clear the screen or hide text before a
# confirmation prompt. Every byte written to stdout/stderr passes SafeStream.write, which strips terminal control
# sequences: CSI, OSC (ended by BEL or ESC \), DCS/SOS/PM/APC, other ESC sequences, and C0/C1 controls except
# newline and tab. deploy's own sequences (colours, erasing a line, clearing the screen in `status --watch`) are
# written with own(): their ESC and CR are replaced by a random marker made at start-up, which no container can
# know, and turned back into ESC/CR here. JSON output keeps its escapes (\u001b is text, not a control).
TERMINAL_CONTROLS = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
                               r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?|\x1b[ -/]*[0-~]?"
                               r"|[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u2028\u2029]")
_OWN_ESC = "".join(chr(0xE000 + b) for b in os.urandom(6))
_OWN_CR = "".join(chr(0xE100 + b) for b in os.urandom(6))
_OWN = re.compile("(%s|%s)" % (re.escape(_OWN_ESC), re.escape(_OWN_CR)))


def own(seq: str) -> str:
    """A terminal sequence of deploy's own (ESC/CR in it), to pass the output boundary."""
    return seq.replace("\x1b", _OWN_ESC).replace("\r", _OWN_CR)


def strip_controls(text: str) -> str:
    """text without terminal control sequences (container-derived strings, for any output)."""
    return TERMINAL_CONTROLS.sub("", text)


def to_terminal(text: str) -> str:
    """What the boundary writes: controls stripped, deploy's own sequences restored."""
    if _OWN_ESC not in text and _OWN_CR not in text:
        return TERMINAL_CONTROLS.sub("", text)
    return "".join("\x1b" if part == _OWN_ESC else "\r" if part == _OWN_CR else TERMINAL_CONTROLS.sub("", part)
                   for part in _OWN.split(text))


class SafeStream:
    """A stdout/stderr whose reader went away (a closed pipe, `| head`) must not abort the operation: writes to
    it are dropped from then on. The audit log keeps the record. It is also the output boundary (to_terminal)."""

    def __init__(self, stream):
        self._stream = stream
        self.closed_by_reader = False

    def write(self, s):
        if not self.closed_by_reader:
            try:
                self._stream.write(to_terminal(s) if isinstance(s, str) else s)
            except (BrokenPipeError, ValueError, OSError):
                self._gone()
        return len(s)

    def flush(self):
        if self.closed_by_reader:
            return
        try:
            self._stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._gone()

    def _gone(self):
        self.closed_by_reader = True
        try:  # point the fd at /dev/null so the interpreter's final flush does not complain either
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    @property
    def buffer(self):
        """The binary layer, filtered too: click writes to it around the text stream when the encoding is ASCII
        (PYTHONIOENCODING=ascii, LC_ALL=C), so the boundary holds there as well (issue 36 item 7)."""
        return _SafeBuffer(self._stream.buffer, self)

    def isatty(self):
        try:
            return not self.closed_by_reader and self._stream.isatty()
        except (ValueError, AttributeError):
            return False

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _SafeBuffer:
    """The binary side of a SafeStream: bytes are decoded (undecodable bytes kept), filtered, encoded back."""

    def __init__(self, raw, owner):
        self._raw, self._owner = raw, owner

    def write(self, b):
        n = len(b)
        if self._owner.closed_by_reader:
            return n
        text = bytes(b).decode("utf-8", "surrogateescape")
        try:
            self._raw.write(to_terminal(text).encode("utf-8", "surrogateescape"))
        except (BrokenPipeError, ValueError, OSError):
            self._owner._gone()
        return n

    def flush(self):
        try:
            self._raw.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._owner._gone()

    def __getattr__(self, name):
        return getattr(self._raw, name)


def guard_std_streams() -> None:
    """Called first by the CLI: from here on a closed stdout/stderr drops output instead of raising."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name) or open(os.devnull, "w")  # None: started with the descriptor closed (>&-)
        setattr(sys, name, stream if isinstance(stream, SafeStream) else SafeStream(stream))


class Progress:
    """One line per event, prefixed with where it happens; quiet=True for --json consumers that want silence.

    Every line also goes to the audit log (when one is attached), so a closed stderr loses nothing.
    Waits report on change: `waiting()` prints a line when its text changes, or every WAIT_EVERY_S seconds when
    it does not (on a TTY, one line updated in place).
    """

    WAIT_EVERY_S = 10.0
    INPLACE = True  # a wait's line may be updated in place on a TTY (not when threads share the stream)

    def __init__(self, quiet: bool = False, stream=None, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.verbose = verbose
        self.color = _tty(self.stream)
        self.t0 = time.monotonic()
        self.audit = None  # an AuditLog; set by whoever opens the connections
        self._wait: dict[str, tuple[str, float]] = {}
        self._inplace = False
        self.last_out = time.monotonic()

    def _c(self, code: str, text: str) -> str:
        return own(f"\x1b[{code}m") + text + own("\x1b[0m") if self.color else text

    def _raw(self, text: str) -> str:
        """A stream that is not the guarded stdout/stderr (tests, a file) gets the output boundary here."""
        return text if isinstance(self.stream, SafeStream) else to_terminal(text)

    def _write(self, text: str) -> None:
        self.last_out = time.monotonic()
        try:
            print(self._raw(text), file=self.stream, flush=True)
        except (BrokenPipeError, ValueError, OSError):
            self.quiet = True  # the reader went away; the operation goes on, the audit log keeps the record

    def _end_inplace(self) -> None:
        if self._inplace:
            self._inplace = False
            self._write("")

    def say(self, where: str, msg: str) -> None:
        if self.audit is not None:
            self.audit.write(event="progress", where=where, message=msg)
        if self.quiet:
            return
        self._end_inplace()
        self._wait.pop(where, None)
        stamp = f"{time.monotonic() - self.t0:6.1f}s"
        head = f"{stamp} [{where}] "
        text = wrap(head + msg, term_width(self.stream), indent=len(head) + 5)
        self._write(text.replace(stamp, self._c("2", stamp), 1))

    def waiting(self, where: str, key: str, msg: str) -> None:
        """A wait's status: printed when `key` (what the user would see change) changes, else every 10 s."""
        now = time.monotonic()
        last = self._wait.get(where)
        if last and last[0] == key and now - last[1] < self.WAIT_EVERY_S:
            self.last_out = now  # the line on screen is still current: not silence
            if self.audit is not None:
                self.audit.write(event="progress", where=where, message=msg)
            line = f"{time.monotonic() - self.t0:6.1f}s [{where}] {msg}"
            # one line updated in place, when it fits the terminal (a wrapped line cannot be rewritten in place;
            # it was printed whole when it last changed)
            if self.INPLACE and self.color and not self.quiet and len(line) < (term_width(self.stream) or 0):
                try:
                    self.stream.write(self._raw(own("\r\x1b[2K") + line))
                    self.stream.flush()
                    self._inplace = True
                except (BrokenPipeError, ValueError, OSError):
                    self.quiet = True
            return
        self.say(where, msg)
        self._wait[where] = (key, now)

    @contextmanager
    def heartbeat(self, where: str, what: str, limit_s: float | None = None, quiet_s: float = 2.0):
        """No silent step longer than `quiet_s`: while the body runs and nothing was printed for that long, say
        what it waits for; after that, again whenever 10 s pass without any line (a step that reports its own
        progress, such as a GPU wait, is not interrupted)."""
        done = threading.Event()
        t0 = time.monotonic()

        def beat():
            first = True
            while not done.wait(0.25):
                if time.monotonic() - self.last_out >= (quiet_s if first else self.WAIT_EVERY_S):
                    first = False
                    el = time.monotonic() - t0
                    self.say(where, f"     still waiting: {what} ({el:.0f}s"
                             + (f" of at most {limit_s:g}s)" if limit_s else ")"))

        th = threading.Thread(target=beat, daemon=True)
        th.start()
        try:
            yield
        finally:
            done.set()
            th.join(1.0)
            self._end_inplace()

    def step(self, where: str, name: str, ok: bool | None, summary: str, seconds: float) -> None:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[ok]
        if self.quiet:
            if self.audit is not None:
                self.audit.write(event="progress", where=where, message=f"{mark} {name:<15} {summary} ({seconds:.2f}s)")
            return
        colored = {True: self._c("32", mark), False: self._c("31;1", mark), None: self._c("33", mark)}[ok]
        self.say(where, f"{colored} {name:<15} {summary} ({seconds:.2f}s)")

    def detail(self, where: str, msg: str) -> None:
        if self.verbose:
            self.say(where, "     " + msg)


def _jsonable(v):
    as_dict = getattr(v, "as_dict", None)  # typed agent results (orchestrator/agent/protocol.py)
    return as_dict() if callable(as_dict) else str(v)


def dump_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, default=_jsonable))


CELL_MAX = 2048  # a table cell's characters (the rest is cut, said in the cell)
FIRST_CELL_MAX = 64  # the first column (the row's name): every row is padded to its width


def cap_cell(value, n: int) -> str:
    """A cell of at most about `n` characters; a longer one is cut and says how much was left out."""
    text = str(value)
    if len(text) <= n:
        return text
    return text[:n] + f"...({len(text) - n} more chars cut)"


def table(rows: list[list[str]], headers: list[str], width: int | None = None, *,
          detail_cell: int = DETAIL_CELL) -> str:
    """A plain-text table. A cell over CELL_MAX (the first column: FIRST_CELL_MAX) is cut, saying so. A middle cell longer than `detail_cell` is replaced by `[n]` and
    printed whole in a details block under the table. With a `width` (a TTY), more middle cells move there until
    the table fits, and the last column wraps inside its own column; the first column (the row's name) stays."""
    cols = len(headers)
    # cells can be container-chosen (check names, values, paths): each is capped before layout and the first
    # column's width is bounded, so a small answer cannot become gigabytes of padding (issue 36 item 1)
    rows = [[cap_cell(r[i], FIRST_CELL_MAX if i == 0 else CELL_MAX) for i in range(cols)] for r in rows]
    cells = [list(r) for r in rows]
    moved: dict[tuple[int, int], int] = {}

    def move(ri, ci):
        if (ri, ci) not in moved:
            moved[(ri, ci)] = len(moved) + 1
            cells[ri][ci] = f"[{moved[(ri, ci)]}]"

    for ri, r in enumerate(cells):
        for ci in range(1, cols - 1):
            if len(r[ci]) > detail_cell:
                move(ri, ci)

    def widths():
        return [max([len(headers[i])] + [len(r[i]) for r in cells]) for i in range(cols)]

    last_min = min(24, widths()[-1])
    if width:
        while True:
            w = widths()
            if sum(w[:-1]) + 2 * (cols - 1) + last_min <= width:
                break
            # only a long value is worth a details line; short ones stay (the terminal wraps an overlong row)
            movable = [(len(r[ci]), ri, ci) for ri, r in enumerate(cells) for ci in range(1, cols - 1)
                       if (ri, ci) not in moved and len(r[ci]) > max(len(headers[ci]), 16)]
            if not movable:
                break
            _, ri, ci = max(movable)
            move(ri, ci)
    w = widths()
    lead = sum(w[:-1]) + 2 * (cols - 1)
    last_w = max(10, width - lead) if width else None
    if last_w:  # a word too long for the last column's room: that cell goes to the details block instead
        for ri, r in enumerate(cells):
            if len(r[-1]) > last_w and max(map(len, r[-1].split() or [""])) > last_w:
                move(ri, cols - 1)

    def fmt(r):
        head = "  ".join(r[i].ljust(w[i]) for i in range(cols - 1)) + "  "
        tail = r[-1]
        if last_w and len(tail) > last_w:
            parts = textwrap.wrap(tail, width=last_w, break_long_words=False, break_on_hyphens=False) or [tail]
            return "\n".join([(head + parts[0]).rstrip()] + [" " * lead + p for p in parts[1:]])
        return (head + tail).rstrip()

    text = "\n".join([fmt(headers), fmt(["-" * x for x in w[:-1]] + ["-" * min(w[-1], last_w or w[-1])])]
                     + [fmt(r) for r in cells])
    if moved:
        text += "\n\nDetails:"
        for (ri, ci), n in sorted(moved.items(), key=lambda x: x[1]):
            label = f"  [{n}] {rows[ri][0]}, {headers[ci]}: "
            text += "\n" + wrap(label + str(rows[ri][ci]), width, indent=len(f"  [{n}] ") + 2)
    return text


def short(value, none: str = "-") -> str:
    """A value for a table cell: null as `none`, JSON for non-strings. Never cut (the table moves long ones)."""
    if value is None:
        return none
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def sha(value, none: str = "none") -> str:
    """A sha256 abbreviated to 12 hex digits (git-style: an identifier, not a cut message)."""
    return none if not value else str(value)[:12]


def check_rows(checks: list[dict]) -> list[list[str]]:
    """Rows of check, expected, on disk, as loaded, verdict, reason: null is shown as null, n/a as -."""
    rows = []
    for c in checks:
        loaded = c["check"].startswith("loaded ") or c["check"] == "as loaded"
        field = c["check"].startswith(("field ", "loaded "))
        verdict = "ok" if c["ok"] else ("WARN" if c.get("severity") == "warning" else "FAIL")
        rows.append([c["check"], short(c.get("expected"), none="null" if field else "-"),
                     short(c.get("on_disk"), none="null" if field else "-"),
                     short(c.get("as_loaded"), none="null" if loaded else "-"), verdict, c.get("reason", "")])
    return rows


# A detached runner followed over several attach calls (fetch, install-vllm): the container chooses how much it
# sends, so the whole follow prints (and audits) at most this much, all attaches together (issue 36 item 2)
FOLLOW_MAX_LINES = 20_000  # lines
FOLLOW_MAX_BYTES = 4 << 20  # their bytes
FOLLOW_LINE_MAX = 2048  # one line
