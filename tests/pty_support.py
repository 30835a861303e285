"""A program on a real pseudo-terminal, for the tests of what reaches the operator's terminal
(tests/unit/test_hostile_local.py, tests/e2e/test_hostile.py). Importable from every test directory: pytest puts
tests/ (the directory of tests/conftest.py) on sys.path."""

import os
import pty
import select
import subprocess
import time


def run_on_pty(argv, cwd, env=None, input=b"", timeout=30, wait_s=10):
    """Run ARGV with stdin, stdout and stderr on a real pseudo-terminal (INPUT typed first) and read what the
    terminal gets until the program closes it, exits, or TIMEOUT seconds pass: -> (exit code, the raw bytes)."""
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, close_fds=True)
    os.close(slave)
    if input:
        os.write(master, input)
    out, end = b"", time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    rc = p.wait(timeout=wait_s)
    os.close(master)
    return rc, out
