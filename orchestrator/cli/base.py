"""`deploy`: the command group, its context object, completion, and the options and exits several commands share."""

from __future__ import annotations

import importlib
import os
import re
import sys

import click

from .. import __version__
from orchestrator.core.errors import (EXIT_CODES_HELP, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE,
                      DeployError, Unreachable, UsageError)
from orchestrator.core.locate import find_inventory, list_playbooks
from orchestrator.core.report import Progress, dump_json, guard_std_streams, term_width, wrap
from orchestrator.core.spec import load_inventory, load_playbook, playbooks_targeting
# lazy, inside the commands, for start-up time (deploy --help, --version and status do not load what they
# do not run; all of it ~170 ms): fleet


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
# each command's module (orchestrator.cli.X), imported when that command runs (click's "Lazily Loading Subcommands"):
# `deploy status` dials its hosts before the planner's and the other commands' modules are loaded
LAZY = {"loop": "plan size up restart down verify", "monitor": "monitor", "serving": "endpoint status logs",
        "site": "compare tune discover doctor init schema docs unlock prepare",
        "weights": "install-vllm fetch manifest apply-config"}


class LazyGroup(click.Group):
    def get_command(self, ctx, cmd_name):
        if cmd_name not in self.commands:
            for module, names in LAZY.items():
                if cmd_name in names.split():
                    importlib.import_module(f"orchestrator.cli.{module}")  # its commands register on `main`
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx):  # --help, completion: every command
        for name in " ".join(LAZY.values()).split():
            self.get_command(ctx, name)
        return super().list_commands(ctx)


class Obj:
    def __init__(self, inventory, verbose, as_json):
        self.inventory_path = inventory
        self.verbose = verbose
        self.json = as_json

    def inventory(self):
        return load_inventory(find_inventory(self.inventory_path))

    def progress(self):
        return Progress(verbose=self.verbose)


def fail(err: DeployError, as_json: bool) -> None:
    if as_json:
        dump_json({"ok": False, **err.as_dict()})
    else:
        click.echo(wrap(err.render(), term_width(sys.stderr), indent=4), err=True)
    sys.exit(err.exit_code)


def run_guarded(fn, obj: Obj):
    try:
        return fn()
    except DeployError as e:
        fail(e, obj.json)
    except KeyboardInterrupt:  # Ctrl-C outside an operation's steps (those say what they left): exit 130
        click.echo("\ninterrupted (Ctrl-C)", err=True)
        sys.exit(EXIT_INTERRUPTED)


@click.group(cls=LazyGroup, context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy testbed up                      # a simulated Proxmox GPU host on this machine
  export DEPLOY_INVENTORY=/tmp/vpd-testbed/hosts.yaml
  deploy plan qwen36-dflash              # what would run, exactly
  deploy up qwen36-dflash                # bring it up, verified end to end
  deploy status                          # what runs where, healthy, acceptance""")
@click.version_option(__version__, "--version", prog_name="deploy")
@click.option("--inventory", "-i", default=None, metavar="PATH", envvar="DEPLOY_INVENTORY",
              help="Inventory file (default: $DEPLOY_INVENTORY, else ./hosts.yaml, else "
                   "~/.config/vllm-pve-deploy/hosts.yaml).")
@click.option("-v", "--verbose", is_flag=True, help="Show more detail while running.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (progress stays on stderr).")
@click.pass_context
def main(ctx, inventory, verbose, as_json):
    """Deploy vLLM with speculative decoding onto Proxmox VE GPU containers, and prove it works.

    Every write is read back, every check says what failed and where, and a deployment with bad
    draft acceptance is a failed deployment.
    
    \b
    Where it looks (first found wins; `deploy init` writes both to edit):
      playbooks  $DEPLOY_PLAYBOOKS (only there, when set), ./playbooks/,
                 ~/.config/vllm-pve-deploy/playbooks/, the shipped examples
      inventory  -i PATH or $DEPLOY_INVENTORY (only that, when set), ./hosts.yaml,
                 ~/.config/vllm-pve-deploy/hosts.yaml

    \b
    Shell completion (bash; zsh and fish alike, see deploy docs cli#shell-completion):
      eval "$(_DEPLOY_COMPLETE=bash_source deploy)"
    """
    guard_std_streams()  # a reader that goes away (| head) must not abort an operation half-way
    ctx.obj = Obj(inventory, verbose, as_json)


def complete_playbooks(_ctx, _param, incomplete):
    """Shell completion (click's own): playbook names in the search order."""
    return [n for n in list_playbooks() if n.startswith(incomplete)]


def complete_targets(ctx, param, incomplete):
    """Shell completion: playbook names, inventory hosts and HOST/VMID."""
    names = complete_playbooks(ctx, param, incomplete)
    try:
        inv = load_inventory(find_inventory(ctx.find_root().params.get("inventory")
                                            or os.environ.get("DEPLOY_INVENTORY")))
    except Exception:  # noqa: BLE001 - completion must never fail loudly
        return names
    for h in inv.hosts.values():
        names += [t for t in [h.name] + [f"{h.name}/{c.vmid}" for c in h.containers] if t.startswith(incomplete)]
    return names


def json_option(f):
    """--json is accepted after the command too (deploy status --json)."""
    def cb(ctx, _param, value):
        if value:
            ctx.find_object(Obj).json = True
        return value
    return click.option("--json", "as_json_local", is_flag=True, expose_value=False, callback=cb,
                        help="Print the result as JSON.")(f)


def load(obj: Obj, playbook: str):
    inv = obj.inventory()
    not_a_container(inv, playbook)
    return inv, load_playbook(playbook, inv)


def not_a_container(inv, playbook: str) -> None:
    """`deploy down pve1/129`: HOST/VMID of the inventory where a PLAYBOOK is expected -> a usage error (exit 2,
    nothing ran) naming the playbooks that target that container, instead of "file not found"."""
    m = re.fullmatch(r"([^/\s]+)/(\d+)", playbook)
    if not m or os.path.exists(playbook) or m.group(1) not in inv.hosts:
        return

    cmd = click.get_current_context().info_name or "COMMAND"
    mine = [(n, pb.is_fleet) for n, pb in playbooks_targeting(m.group(1), int(m.group(2)), inv)]
    which = ", ".join(n for n, _ in mine) or "none here"
    fixes = [f"deploy {cmd} {n}" + (f" {playbook}" if fleet else "") for n, fleet in mine]
    raise UsageError(f"{playbook} is a container, not a playbook: deploy {cmd} takes the PLAYBOOK (playbooks that "
                     f"target {playbook}: {which}); nothing was run",
                     fix=("; ".join(fixes) + "; " if fixes else "")
                     + f"deploy status {playbook} shows which playbook runs there")


def _outcome_exit(obj, out):
    from orchestrator.cli.render import render_outcome  # lazy: it loads the planner's modules (steps)
    if obj.json:
        dump_json(out.as_dict())
    else:
        render_outcome(out)
    if out.ok:
        sys.exit(EXIT_OK)
    err = (out.fallback.error if out.fallback else None) or out.error
    sys.exit(EXIT_UNREACHABLE if isinstance(err, Unreachable) else
             (err.exit_code if err is not None and err.exit_code in (EXIT_USAGE, EXIT_INTERRUPTED) else EXIT_FAILED))


def _outcomes_exit(obj, outs):
    """Several outcomes (a playbook's targets, or several playbooks): --json all of them, else each rendered. Exit 0
    all passed, 3 only unreachable hosts failed (as _outcome_exit for one), else 1."""
    from orchestrator.cli.render import render_outcome
    if obj.json:
        dump_json([o.as_dict() for o in outs])
    else:
        for o in outs:
            render_outcome(o)
    sys.exit(EXIT_OK if all(o.ok for o in outs) else
             EXIT_UNREACHABLE if all(isinstance(o.error, Unreachable) for o in outs if not o.ok) else
             EXIT_FAILED)


def up_options(f):
    f = click.option("-y", "--yes", is_flag=True, help="Replace a different running deployment, and with --clean-gpus "
                                                       "kill GPU holders, without asking (for scripts).")(f)
    f = click.option("--wait-lock", type=click.FloatRange(min=0), default=0, metavar="SECONDS",
                     help="Wait this long for another deploy's lock instead of failing at once.")(f)
    f = click.option("--dry-run", is_flag=True, help="Print the plan and run nothing (same as deploy plan).")(f)
    return f


def _confirm(prompt):
    if not sys.stdin.isatty():
        return False
    return click.confirm(wrap(prompt, term_width(sys.stderr), indent=4), default=False, err=True)


def _fleet_exit(obj, res):
    """A playbook with targets: every failed target's error (fix, state left), then one line per target and the
    totals; --json: every target. Exit 0 all passed, 3 only unreachable hosts failed, else 1."""
    from orchestrator.cli.render import _echo_wrapped, render_outcome
    from orchestrator.serving import fleet as F

    if obj.json:
        dump_json(F.as_json(res))
    else:
        for o in res["_outcomes"]:
            if o is not None and not o.ok:
                render_outcome(o)
                _echo_wrapped(f"  this target alone: deploy logs {o.where}; deploy down {res['playbook']} {o.where}; "
                              f"deploy status {o.where}", err=True)
        rr = res.get("router") or {}
        err = rr.get("error")
        if isinstance(err, DeployError):
            _echo_wrapped(f"FAILED: {err.where}: router: {err.message}", err=True)
            if err.fix:
                _echo_wrapped(f"  fix: {err.fix}", err=True)
        for line in F.render(res):
            _echo_wrapped(line)
    sys.exit(F.exit_code(res))


def refuse_json(obj, command: str) -> None:
    if obj.json:
        raise UsageError(f"deploy {command} has no --json output", fix=f"run deploy {command} without --json")
