"""`deploy`: the click commands, one module a theme (base.py holds the group, the shared options and the exits).

Heavy modules are imported inside the commands: `deploy --help` and `deploy status` start without paramiko's
and the planner's import cost until a command needs them (the only reason for imports inside functions here)."""

from __future__ import annotations

import sys

import click

from orchestrator.core.errors import EXIT_USAGE
from .base import Obj, main  # the commands' modules are imported as each runs (base.LazyGroup)

__all__ = ["Obj", "main"]


def _add_testbed():
    """`deploy testbed` comes from the test bed's own distribution (testbed/ in the repo, import name vpd_testbed);
    without it, the command says how to get it instead of click's bare "No such command"."""
    try:
        from vpd_testbed.cli import testbed
    except ImportError:
        @main.command("testbed", context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                      add_help_option=False, hidden=True)
        def testbed():
            click.echo("error: the test bed is not installed (it is its own distribution, not part of the tool)\n"
                       "  fix: in a clone of vllm-pve-deploy: pip install ./testbed (scripts/setup.sh does it)",
                       err=True)
            sys.exit(EXIT_USAGE)
        return
    main.add_command(testbed)


_add_testbed()
