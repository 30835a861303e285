"""`deploy monitor`: export, metrics, render. Click commands only."""

from __future__ import annotations

import os
import sys

import click

from orchestrator.core.errors import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, UsageError
from orchestrator.core.locate import list_playbooks
from orchestrator.core.report import dump_json
from orchestrator.core.spec import load_playbook
from .base import CONTEXT, complete_playbooks, complete_targets, json_option, main, run_guarded
# lazy, inside the commands, for start-up time (deploy --help, --version and status do not load what they
# do not run; all of it ~170 ms): monitor, monitor_metrics, monitor_render, status


@main.group(context_settings=CONTEXT)
def monitor():
    """Watch the deployments with Prometheus and Grafana (see docs/monitoring.md).

    \b
    Examples:
      deploy monitor metrics                      # every container's figures, Prometheus text, to stdout
      deploy monitor export ./monitoring          # Prometheus config, alert rules and a Grafana dashboard
      deploy monitor render ./monitoring/dashboard.json --prometheus http://127.0.0.1:9090 --out dashboard.png
    """


def _duration(_ctx, param, value):
    from orchestrator.observe.monitor import duration

    try:
        return duration(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param=param) from None


@monitor.command("export", context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy monitor export ./monitoring
  promtool check config ./monitoring/prometheus.yml && promtool test rules ./monitoring/rules.test.yml
  deploy monitor export ./monitoring qwen36-mtp --for 5m""")
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("playbooks", nargs=-1, shell_complete=complete_playbooks)
@click.option("--for", "for_", default="10m", show_default=True, callback=_duration, metavar="DURATION",
              help="How long acceptance must stay under the gate before an alert fires.")
@click.option("--rate-window", default="5m", show_default=True, callback=_duration, metavar="DURATION",
              help="The window acceptance rates are computed over.")
@click.option("--down-for", default="2m", show_default=True, callback=_duration, metavar="DURATION",
              help="How long a target must fail its scrape before VllmEndpointDown fires.")
@click.option("--scrape-interval", default="15s", show_default=True, callback=_duration, metavar="DURATION")
@click.option("--evaluation-interval", default="15s", show_default=True, callback=_duration, metavar="DURATION")
@click.option("--node-exporter", "node_exporters", multiple=True, metavar="HOST:PORT",
              help="A node_exporter whose textfile collector serves `deploy monitor metrics` (repeatable): "
                   "prometheus.yml gets a job vllm-pve-deploy-status scraping it.")
@json_option
@click.pass_obj
def monitor_export(obj, directory, playbooks, for_, rate_window, down_for, scrape_interval, evaluation_interval,
                   node_exporters):
    """Write Prometheus and Grafana files for the deployments into DIRECTORY, from the inventory and the
    playbooks (every playbook found, or those named; nothing is read from the hosts): targets.json (file_sd:
    every serving container with labels host, vmid, playbook, method, model), rules.yml (acceptance length under
    the playbook's gate, position-0 acceptance, a per-position cliff, restarts, start limit, not gated, GPU
    memory held outside the deployment, endpoint down, deploy's own series stale or unreachable), rules.test.yml
    (promtool unit tests, one per alert), prometheus.yml (uses both) and dashboard.json (Grafana)."""
    def go():
        from orchestrator.observe.monitor import export

        inv = obj.inventory()
        names = list(playbooks) or list_playbooks()
        pbs = [load_playbook(n, inv) for n in names]
        for ne in node_exporters:
            host, _, port = ne.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"--node-exporter {ne!r} is not HOST:PORT", fix="e.g. --node-exporter localhost:9100")
        res = export(inv, pbs, directory, window=rate_window, for_=for_, down_for=down_for,
                     scrape_interval=scrape_interval, evaluation_interval=evaluation_interval,
                     node_exporters=node_exporters)
        if obj.json:
            dump_json({"ok": True, **res})
            return
        click.echo(f"wrote {', '.join(res['files'])} to {res['directory']}")
        for g in res["targets"]:
            lb = g["labels"]
            th = res["thresholds"][lb["playbook"]]
            click.echo(f"  {lb['host']}/{lb['vmid']}  {g['targets'][0]}  {lb['playbook']} ({lb['method']}): alert under "
                       f"acceptance length {th['min_al']:g} for {for_}")
        for m in res["left_out"]:
            click.echo(f"  {m}: left out, its address is unknown (deploy discover {m.split('/')[0]} --write)")
        for n in res["notes"]:
            click.echo(f"  note: {n}")
        click.echo(f"next: promtool check config {os.path.join(directory, 'prometheus.yml')}; promtool test rules "
                   f"{os.path.join(directory, 'rules.test.yml')}; import dashboard.json into Grafana")
    run_guarded(go, obj)


@monitor.command("metrics", context_settings=CONTEXT, epilog="""\b
Exit codes:
  0  the metrics were written (and read back), whatever the deployments' health: the alerts judge that
  1  they could not be written or read back (said how)
  2  bad usage or invalid inventory (nothing was run)
  3  some host was unreachable: its containers' vpd_status_reachable is 0; the rest is written
  130  interrupted (Ctrl-C)

\b
Examples:
  deploy monitor metrics                          # every container, to stdout
  deploy monitor metrics pve1 qwen36-dflash       # some hosts/playbooks/containers
  deploy monitor metrics --textfile /var/lib/prometheus/node-exporter/vllm-pve-deploy.prom
  (a systemd timer runs the last one every 30 s: docs/monitoring.md)""")
@click.argument("targets", nargs=-1, metavar="[PLAYBOOK|HOST|HOST/VMID]...", shell_complete=complete_targets)
@click.option("--textfile", default=None, metavar="PATH",
              help="Write to PATH (ending in .prom) for node_exporter's textfile collector: atomically (temp file "
                   "in the same directory, fsync, rename, mode 0644), then read back and parsed. Default: stdout.")
@click.option("--deadline", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True, metavar="S",
              help="Per-host deadline, as for deploy status; a slower host is written as unreachable.")
@json_option
@click.pass_obj
def monitor_metrics(obj, targets, textfile, deadline):
    """deploy's own facts as Prometheus series, gathered as deploy status gathers them (one SSH connection
    per host, hosts in parallel): vpd_gated, vpd_unit_restarts_total, vpd_unit_start_limit_hit,
    vpd_gpu_foreign_memory_mib, vpd_operation_in_progress, and vpd_status_reachable / vpd_status_healthy per
    container with
    vpd_status_timestamp_seconds per host, labelled host, vmid, playbook (and unit, gpu) as the targets of
    deploy monitor export are, so the exported alerts (VllmNotGated, VllmStartLimitHit, ...) fire on them."""
    def go():
        from orchestrator.observe import monitor_metrics as M

        inv = obj.inventory()
        from orchestrator.observe.status import resolve_targets
        resolve_targets(inv, targets)  # bad targets fail before any connection
        path = M.check_textfile(textfile) if textfile else None
        with obj.progress().heartbeat("monitor metrics", "the slowest host(s) to answer", deadline):
            rows, times = M.gather_rows(inv, targets, deadline)
        text = M.render(M.series(rows, times=times))
        code = M.exit_code(rows)
        written = M.write_textfile(path, text) if path else {"bytes": len(text.encode()),
                                                             "samples": sum(len(v) for v in M.parse(text).values())}
        bad = [r for r in rows if not r.get("reachable")]
        if obj.json:
            dump_json({"ok": code == EXIT_OK, "exit_code": code, "textfile": path, **written,
                       "containers": [{"host": r["host"], "vmid": r["vmid"], "playbook": r.get("playbook"),
                                       "reachable": r.get("reachable"), "healthy": r.get("healthy")} for r in rows],
                       **({} if path else {"text": text})})
        elif path:
            click.echo(f"wrote {path}: {written['samples']} samples for {len(rows)} container(s), read back and "
                       f"parsed")
        else:
            click.echo(text, nl=False)
        for r in bad:
            click.echo(f"{r['host']}/{r['vmid']}: unreachable, written as vpd_status_reachable 0: "
                       f"{'; '.join(r.get('problems') or [])}", err=True)
        # as deploy status: skip the interpreter's teardown (daemon threads of a timed-out host die with us)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    run_guarded(go, obj)


@monitor.command("render", context_settings=CONTEXT, epilog="""\b
Exit codes:
  0  the picture was written, every query answered (panels without data say "No data")
  1  the picture was written, but some query failed (that panel says so; the message names panel and expr)
  2  bad usage (nothing was queried)
  3  Prometheus did not answer (nothing was written)

\b
Examples:
  deploy monitor export ./monitoring
  deploy monitor render ./monitoring/dashboard.json --prometheus http://127.0.0.1:9090 --out dashboard.png
  deploy monitor render dashboard.json --prometheus http://prom:9090 --since 1h --out last-hour.svg""")
@click.argument("dashboard", metavar="DASHBOARD_JSON", type=click.Path(dir_okay=False))
@click.option("--prometheus", "prometheus", required=True, metavar="URL", help="Prometheus' base URL.")
@click.option("--out", required=True, metavar="FILE", help="The picture: .png, .svg or .pdf (matplotlib).")
@click.option("--since", default="15m", show_default=True, metavar="DURATION", help="How far back from now.")
@click.option("--step", default=None, metavar="DURATION", help="Query resolution (default: the span / 240).")
@click.option("--scrape-interval", default="15s", show_default=True, metavar="DURATION",
              help="Prometheus' scrape interval, for Grafana's $__rate_interval (max(step + it, 4 x it)).")
@click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
              help="A dashboard variable's value (a regex under =~); every other one matches all (.*).")
@json_option
@click.pass_obj
def monitor_render(obj, dashboard, prometheus, out, since, step, scrape_interval, variables):
    """Draw the dashboard that deploy monitor export writes, without Grafana: each panel's queries run against
    Prometheus (/api/v1/query_range) and matplotlib draws the panels where their gridPos puts them, with
    titles, units and legends; "No data" where a query returns nothing."""
    def go():
        from orchestrator.observe import monitor_render as R

        given = {}
        for v in variables:
            name, eq, value = v.partition("=")
            if not eq or not name.isidentifier():
                raise UsageError(f"--var {v!r} is not NAME=VALUE", fix="e.g. --var playbook=qwen36-dflash")
            given[name] = value
        since_s = R.seconds(since, "--since")
        step_s = R.seconds(step, "--step") if step else None
        scrape_s = R.seconds(scrape_interval, "--scrape-interval")
        res = R.render(dashboard, prometheus, out, since=since_s, step=step_s, scrape=scrape_s, variables=given)
        code = EXIT_FAILED if res["failed"] else EXIT_OK
        if obj.json:
            dump_json({"ok": code == EXIT_OK, "exit_code": code, **res})
        else:
            click.echo(f"wrote {res['out']} ({len(res['panels'])} panels, {res['series']} series, "
                       f"{res['bytes'] // 1024} KiB)")
            if res["no_data"]:
                click.echo(f"  no data: {', '.join(res['no_data'])}")
        for f in res["failed"]:
            click.echo(f"panel {f['panel']!r}: query failed: {f['error']}\n  expr: {f['expr']}", err=True)
        sys.exit(code)
    run_guarded(go, obj)
