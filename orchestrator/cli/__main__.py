"""`python -m orchestrator.cli`: the same as the `deploy` command."""

from . import main

main(prog_name="deploy")
