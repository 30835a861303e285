"""`deploy`: what serves: endpoint (and its tunnel), status, logs. Click commands only."""

from __future__ import annotations

import os
import re
import sys

import click

from orchestrator.core.endpoint import playbook_endpoints
from orchestrator.core.errors import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, UsageError
from orchestrator.core.report import dump_json
from .base import CONTEXT, Obj, complete_playbooks, complete_targets, json_option, load, main, refuse_json, run_guarded
# lazy, inside the commands, for start-up time (deploy --help, --version and status do not load what they
# do not run; all of it ~170 ms): status, foreground


# ------------------------------------------------------------------ status / logs


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy endpoint qwen36-dflash                 # the URL and a curl line that asks for a completion
  deploy endpoint qwen36-dflash --tunnel        # not routable from here: forward 127.0.0.1:8000 through pve1""")
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--tunnel", is_flag=True, help="Forward a local port to the endpoint through the Proxmox host's SSH "
                                               "connection, in the foreground, until Ctrl-C.")
@click.option("--local-port", type=click.IntRange(0, 65535), default=None, metavar="N",
              help="Local port of the tunnel (default: the served port when free, else any free port; 0: any).")
@click.option("--target", "where", default=None, metavar="HOST/VMID",
              help="With --tunnel, for a playbook with several targets: which one.")
@json_option
@click.pass_obj
def endpoint(obj, playbook, tunnel, local_port, where):
    """Where a deployment answers: its URL (the container's address from the inventory), a curl line that works,
    and, where that address is not routable from this machine, an SSH tunnel through the Proxmox host. A playbook
    with router: answers at its router (the one URL clients use), not at each replica.

    Nothing is sent without --tunnel. With --tunnel: one SSH connection to the host; the host's sshd connects to
    the container (as `ssh -L` does); the local URL and a curl line for it are printed, then it runs until Ctrl-C
    (exit 0) or until the connection drops (exit 3).

    Exit: 0 every URL known (or the tunnel ran), 1 an address unknown or the host cannot reach the endpoint,
    2 bad usage, 3 the host is unreachable.
    """
    def go():
        inv, pb = load(obj, playbook)
        if where is not None and not pb.is_fleet and where != pb.where:
            raise UsageError(f"{pb.name} runs on {pb.where}, not {where}", fix=f"deploy endpoint {pb.name}")
        if where is not None and pb.is_fleet:
            pb.member(where)  # a UsageError naming the targets when it is not one
        if tunnel and pb.is_fleet and where is None:
            raise UsageError(f"{pb.name} has {len(pb.targets)} targets ({pb.where}): --tunnel needs one",
                             fix=f"deploy endpoint {pb.name} --tunnel --target {pb.targets[0].where}")
        rows = playbook_endpoints(inv, pb)
        if where is not None:
            rows = [r for r in rows if r["where"] == where]
        if tunnel:
            from orchestrator.serving.foreground import run_tunnel

            sys.exit(run_tunnel(inv, pb, rows[0], local_port, as_json=obj.json))
        if obj.json:
            dump_json({"ok": all(r["url"] for r in rows), "playbook": pb.name, "endpoints": rows})
        else:
            for r in rows:
                if not r["url"]:
                    click.echo(f"{pb.name} on {r['where']}: address unknown ({r['note']})")
                    continue
                click.echo(f"{pb.name} on {r['where']}: {r['url']}  (model {r['model']})")
                if r["tunnel"]:
                    how = "not routable from here" if r["routable"] is False else "may not be routable from here"
                    click.echo(f"  {how}: deploy endpoint {pb.name} --tunnel"
                               + (f" --target {r['where']}" if pb.is_fleet else "")
                               + f"   (or: {r['tunnel']})")
                click.echo(f"  {r['curl']}")
        sys.exit(EXIT_OK if all(r["url"] for r in rows) else EXIT_FAILED)
    run_guarded(go, obj)


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("targets", nargs=-1, metavar="[PLAYBOOK|HOST|HOST/VMID]...", shell_complete=complete_targets)
@click.option("--watch", type=click.FloatRange(min=0, min_open=True), default=None, metavar="N",
              help="Refresh every N seconds (connections stay open).")
@click.option("--deadline", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True, metavar="S",
              help="Per-host deadline; a slower host becomes a row that says so.")
@json_option
@click.pass_obj
def status(obj, targets, watch, deadline):
    """What runs where, whether it is healthy, and how well it drafts. One SSH connection and one remote
    exec per container, all hosts in parallel.

    Exit: 0 all healthy, 1 something unhealthy, 3 some host unreachable.

    \b
    Examples:
      deploy status
      deploy status pve1/129 --json
      deploy status --watch 5
    """
    def go():
        from orchestrator.core.remote import Fleet, paramiko_module

        inv = obj.inventory()
        fleet = Fleet(inv)
        fleet.connect_ahead(_hosts_named(inv, targets))
        paramiko_module()  # first (the handshakes wait for it), then status's imports while the handshakes run
        from orchestrator.observe.status import run_status

        code = run_status(obj, targets, watch, deadline, inv=inv, fleet=fleet)
        # Everything is written and every connection closed: skip the interpreter's teardown of paramiko and
        # cryptography (~40 ms, a tenth of a status call). Daemon threads of timed-out hosts die with us.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    run_guarded(go, obj)


def _hosts_named(inv, targets) -> list[str]:
    """The hosts `deploy status TARGETS` connects to when every target is a HOST or HOST/VMID of the inventory (no
    targets: every host with containers); else none yet (a playbook is read first, a bad target fails before any
    connection)."""
    try:
        named = [inv.named(t) for t in targets]
    except UsageError:
        return []
    want = {h for n in named for h, _ in n or ()}
    return [] if None in named else [h.name for h in inv.hosts.values()
                                     if (h.name in want if targets else h.containers)]


def _regex(_ctx, _param, value):
    """--grep is a Python regular expression, checked here: a bad one is a usage error before anything runs."""
    if value is not None:
        try:
            re.compile(value)
        except re.error as e:
            raise click.BadParameter(f"not a valid regular expression: {e} (escape literal characters, e.g. "
                                     "'\\(' for a parenthesis)")
    return value


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("target", metavar="PLAYBOOK|HOST/VMID", shell_complete=complete_targets)
@click.option("-n", "lines", type=click.IntRange(min=1), default=50, show_default=True, help="How many lines.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
@click.option("--grep", default=None, metavar="REGEX", callback=_regex, help="Only lines matching REGEX.")
@click.option("--all", "show_all", is_flag=True,
              help="Also show this tool's own /health, /v1/models and /metrics requests (left out by default).")
@click.option("--json", "as_json_local", is_flag=True, hidden=True, expose_value=False,
              callback=lambda ctx, _p, v: setattr(ctx.find_object(Obj), "json", True) if v else None)
@click.pass_obj
def logs(obj, target, lines, follow, grep, show_all):
    """Show the vLLM log of a deployment (read from the container's state file).

    The tool's own probe requests (GET /health, /v1/models, /metrics from 127.0.0.1) are left out unless --all.

    \b
    Examples:
      deploy logs qwen36-dflash -n 100
      deploy logs pve1/129 -f --grep 'SpecDecoding|ERROR'
      deploy logs pve1/129 --all -n 20
    """
    def go():
        from orchestrator.observe.status import run_logs

        refuse_json(obj, "logs")
        sys.exit(run_logs(obj, target, lines, follow, grep, show_all))
    run_guarded(go, obj)
