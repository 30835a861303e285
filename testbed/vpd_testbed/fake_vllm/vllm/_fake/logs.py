"""vLLM-style log lines: ``(APIServer pid=N) INFO MM-DD HH:MM:SS [file.py:NN] message``.

ANSI colours unless NO_COLOR is set (like vLLM's colour formatter). Each line is one os.write (atomic with
O_APPEND), so lines of several processes sharing one log file never interleave mid-line.
"""

import os
import sys
import time

_RESET = "\x1b[0m"
_LEVEL_COLOURS = {"DEBUG": "\x1b[37m", "INFO": "\x1b[32m", "WARNING": "\x1b[33m", "ERROR": "\x1b[31m",
                  "CRITICAL": "\x1b[1;31m"}
_GREY = "\x1b[90m"
_CYAN = "\x1b[36m"

_state = {"name": "APIServer"}


def colour() -> bool:
    return not os.environ.get("NO_COLOR") and os.environ.get("VLLM_LOGGING_COLOR", "1") != "0"


def set_process_name(name: str) -> None:
    _state["name"] = name


def prefix(name=None, pid=None) -> str:
    p = f"({name or _state['name']} pid={pid or os.getpid()})"
    return f"{_CYAN}{p}{_RESET} " if colour() else p + " "


def _emit(fd: int, text: str) -> None:
    data = text.encode("utf-8", "replace")
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return
        data = data[n:]


def log(level: str, where: str, msg: str, name=None, pid=None, fd: int = 1) -> None:
    ts = time.strftime("%m-%d %H:%M:%S")
    lines = str(msg).split("\n")
    out = []
    for line in lines:
        if colour():
            out.append(f"{prefix(name, pid)}{_LEVEL_COLOURS.get(level, '')}{level}{_RESET} {_GREY}{ts}{_RESET} "
                       f"{_GREY}[{where}]{_RESET} {line}\n")
        else:
            out.append(f"{prefix(name, pid)}{level} {ts} [{where}] {line}\n")
    _emit(fd, "".join(out))


def info(where, msg, **kw):
    log("INFO", where, msg, **kw)


def warning(where, msg, **kw):
    log("WARNING", where, msg, **kw)


def error(where, msg, **kw):
    log("ERROR", where, msg, **kw)


def raw(text: str, name=None, pid=None, fd: int = 2) -> None:
    """Unformatted lines (tracebacks, uvicorn lines) with the process prefix, to stderr by default."""
    out = "".join(f"{prefix(name, pid)}{line}\n" for line in str(text).rstrip("\n").split("\n"))
    _emit(fd, out)


def traceback_text(frames, exc_line: str) -> str:
    """A realistic traceback: frames = [(file, line, func, code), ...]."""
    out = ["Traceback (most recent call last):"]
    for f, ln, func, code in frames:
        out.append(f'  File "{f}", line {ln}, in {func}')
        out.append(f"    {code}")
    out.append(exc_line)
    return "\n".join(out)


def error_traceback(where, frames, exc_line, **kw):
    """ERROR-level traceback, every line with the log prefix (as vLLM's EngineCore logs it)."""
    log("ERROR", where, traceback_text(frames, exc_line), **kw)


def flush_std():
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
