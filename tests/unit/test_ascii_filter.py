"""issue 36 item 7: the terminal filter holds when stdout's encoding is ASCII (click writes to .buffer)."""
import os
import subprocess
import sys

CODE = r"""
import click
from orchestrator.core import report
report.guard_std_streams()
click.echo("a\x1b]0;pwned\x07b\x1b[2Jc")
click.echo(b"d\x1b[2Je")
"""


def test_controls_stripped_under_ascii_and_c_locale():
    for env in ({"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "PYTHONUTF8": "0", "LANG": "C"}):
        e = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "LC_ALL", "LANG", "PYTHONUTF8")}
        e.update(env)
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, env=e, timeout=30,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert out.returncode == 0, out.stderr
        assert b"\x1b" not in out.stdout, (env, out.stdout)
        assert b"abc" in out.stdout and b"de" in out.stdout
