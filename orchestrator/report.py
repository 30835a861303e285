"""Progress on stderr while things run; tables and JSON at the end. Colour only on a TTY."""

from __future__ import annotations

import json
import os
import sys
import time


def _tty(stream) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


class Progress:
    """One line per event, prefixed with where it happens; quiet=True for --json consumers that want silence."""

    def __init__(self, quiet: bool = False, stream=None, verbose: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.verbose = verbose
        self.color = _tty(self.stream)
        self.t0 = time.monotonic()

    def _c(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def say(self, where: str, msg: str) -> None:
        if not self.quiet:
            print(f"{self._c('2', f'{time.monotonic() - self.t0:6.1f}s')} [{where}] {msg}", file=self.stream,
                  flush=True)

    def step(self, where: str, name: str, ok: bool | None, summary: str, seconds: float) -> None:
        if self.quiet:
            return
        mark = {True: self._c("32", "ok  "), False: self._c("31;1", "FAIL"), None: self._c("33", "skip")}[ok]
        self.say(where, f"{mark} {name:<15} {summary} ({seconds:.2f}s)")

    def detail(self, where: str, msg: str) -> None:
        if self.verbose:
            self.say(where, "     " + msg)


def dump_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(rows: list[list[str]], headers: list[str], width: int = 100) -> str:
    cols = len(headers)
    widths = [len(h) for h in headers]
    for r in rows:
        for i in range(cols):
            widths[i] = max(widths[i], len(str(r[i])))
    # shrink the widest columns until the table fits
    while sum(widths) + 2 * (cols - 1) > width and max(widths) > 8:
        i = widths.index(max(widths))
        widths[i] -= 1

    def fmt(r):
        cells = []
        for i in range(cols):
            s = str(r[i])
            if len(s) > widths[i]:
                s = s[: widths[i] - 1] + "~"
            cells.append(s.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def short(value, n: int = 40, none: str = "-") -> str:
    if value is None:
        return none
    s = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return s if len(s) <= n else s[: n - 1] + "~"


def check_rows(checks: list[dict], widths=(30, 30, 24)) -> list[list[str]]:
    """Rows of check, expected, on disk, as loaded, verdict, reason: null is shown as null, n/a as -."""
    rows = []
    for c in checks:
        loaded = c["check"].startswith("loaded ") or c["check"] == "as loaded"
        field = c["check"].startswith(("field ", "loaded "))
        verdict = "ok" if c["ok"] else ("WARN" if c.get("severity") == "warning" else "FAIL")
        rows.append([c["check"], short(c.get("expected"), widths[0], "null" if field else "-"),
                     short(c.get("on_disk"), widths[1], "null" if field else "-"),
                     short(c.get("as_loaded"), widths[2], "null" if loaded else "-"), verdict, c.get("reason", "")])
    return rows
