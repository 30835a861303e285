"""Rendering for people: plans, outcomes of up/restart/down/install, and verify tables (beside report.py, which
has the table engine, progress lines and JSON). cli/ calls these; nothing here runs anything remote."""

from __future__ import annotations

import sys

import click

from orchestrator.core.endpoint import describe
from orchestrator.core.errors import DeployError
from orchestrator.steps.plumbing_check import render as render_plumbing
from orchestrator.core.remote import shell_word
from orchestrator.core.spec import playbooks_targeting


def render_plans(as_json, inv, pb, plan_of):
    """The plan of a playbook; of each of its targets for a playbook with `targets:` (JSON: {"targets": [...]})."""
    from orchestrator.core.report import dump_json  # lazy: start-up time, ~3.5 ms of every command

    if not pb.is_fleet:
        return render_plan(as_json, inv, pb, plan_of(pb))
    rplan = _router_plan(inv, pb)
    if as_json:
        dump_json({"playbook": pb.name, "targets": [render_plan(as_json, inv, m, plan_of(m), emit=False)
                                                    for m in pb.members], **({"router": rplan} if rplan else {})})
        return
    click.echo(f"{pb.name} has {len(pb.members)} targets; deploy up brings them up in parallel, each with the steps "
               "below (one SSH connection per host, shared by its targets).")
    for m in pb.members:
        click.echo("")
        render_plan(as_json, inv, m, plan_of(m))
    if rplan:
        click.echo(f"\nThen the router in {rplan['where']} (agent action `router`, {rplan['python']}), with the targets "
                   "that passed their gates:")
        for i, st in enumerate(rplan["steps"], 1):
            _render_step(st, f"{i:2}.")
        for wn in rplan["warnings"]:
            click.echo(f"\nwarning: {wn}")


def _router_plan(inv, pb):
    """What up does for `router:` after the targets (docs/cli.md#the-router): the router's steps as up sends them
    (replica_router.up_steps), each with its exact remote command."""
    from orchestrator.serving import replica_router as R  # lazy: start-up time, ~6 ms of every command

    r = pb.conf.router
    if not r:
        return None
    workers = []
    for m in pb.members:
        try:
            workers.append(R.replica_url(inv, pb, m))
        except DeployError as e:
            workers.append(f"<{e.message}>")
    warning, steps = R.exposure_warning(pb), R.up_steps(pb, workers)
    start = next(st for st in steps if st.args["op"] == "start")
    return {"where": r.where, "python": r.python, "venv": R._base(pb)["venv"], "argv_args": start.args["args"],
            "warnings": [warning] if warning else [], "steps": [st.as_dict(inv, r.python) for st in steps]}


def render_plan(as_json, inv, pb, steps, emit=True):
    from orchestrator.steps.plan import PHASE_TITLES, session_command  # lazy: start-up time, ~6.5 ms of every command
    from orchestrator.core.report import dump_json  # lazy: start-up time, ~3.5 ms
    from orchestrator.core.sizing import check_playbook  # lazy: start-up time, ~3 ms

    py = pb.conf.runtime.python
    rows = [s.as_dict(inv, py) for s in steps]
    session = session_command(pb, py)
    warnings = shared_gpu_warnings(inv, pb)
    fits = check_playbook(pb)
    if fits["level"] == "warn":
        warnings.append(f"sizing: {fits['line']}")
    if as_json or not emit:
        data = {"playbook": pb.name, "host": pb.host, "vmid": pb.vmid, "agent_session": session, "steps": rows,
                "fallback": pb.fallback.name if pb.fallback else None, "warnings": warnings, "fits": fits}
        if emit:
            dump_json(data)
        return data
    click.echo(f"Plan for {pb.name} on {pb.host}/{pb.vmid} ({rows[0]['ssh']}); one SSH connection for all steps.")
    for w in warnings:
        click.echo(f"warning: {w}")
    if fits["level"] != "warn":
        click.echo(f"sizing: {fits['line']}")
    click.echo("One agent process in the container runs every agent step (each `>` line below is one request to it;"
               " the agent's bootstrap, N bytes, arrives on stdin):")
    click.echo(f"  $ {session}")
    phase, n = "main", 0
    for r in rows:
        if r["phase"] != phase:
            phase = r["phase"]
            click.echo(f"\n{PHASE_TITLES.get(phase, phase)}:")
        n += 1
        _render_step(r, f"{n:2}.")
    lock = next((r for r in rows if r["step"] == "lock"), None)
    detached = any(r["step"] in ("fetch", "install-vllm") for r in rows)
    click.echo(f"\n{n} steps. " + (f"The lock heartbeat runs beside them as its own command: `{lock['command']}` with "
                                   "renew=true. " if lock else "No container lock: the detached runner takes its own "
                                   "(one at a time; a second deploy re-attaches). " if detached else
                                   "No container lock: every step only reads. ")
               + "`deploy -v` prints each step's commands as it runs them; --json gives this plan for review tools.")


def shared_gpu_warnings(inv, pb) -> list[str]:
    """From the inventory alone (plan runs nothing): other containers of the same host given any of the playbook's
    GPUs, with the playbooks that target them (issue 26: a deployment there makes gpus-free fail)."""
    host = inv.hosts.get(pb.host)
    out = []
    for c in (host.containers if host else ()):
        shared = sorted(set(c.gpus or []) & set(pb.gpus))
        if c.vmid == pb.vmid or not shared:
            continue
        names = [n for n, other in playbooks_targeting(pb.host, c.vmid) if other.name != pb.name]
        out.append(f"GPU(s) {', '.join(map(str, shared))} of {pb.host}/{pb.vmid} are also given to {pb.host}/{c.vmid}"
                   + (f" (targeted by {', '.join(names)})" if names else "")
                   + f": while a vLLM runs there, gpus-free fails (deploy status {pb.host}/{c.vmid} shows it"
                   + (f"; deploy down {shell_word(names[0])} frees them" if names else "") + ")")
    return out


def _render_step(r, label, indent=""):
    click.echo(f"\n{indent}{label} {r['step']}: {r['title']}" + (f"  [when {r['when']}]" if r["when"] else ""))
    if r["request"] and not r.get("own_process"):  # a request to the agent session; else its own command
        click.echo(f"{indent}    > {r['request']}")
    elif r["command"]:
        click.echo(f"{indent}    $ {r['command']}")
    if r["stdin"]:
        click.echo(f"{indent}      < stdin: {r['stdin']}")
    for line in r.get("runs") or []:
        click.echo(f"{indent}      runs: {line}")
    for i, sub in enumerate(r.get("steps") or [], 1):
        _render_step(sub, f"{label}{i}.", indent + "    ")


def _echo_wrapped(text: str = "", err: bool = False, indent: int = 0) -> None:
    """click.echo, wrapped at the terminal width on a TTY (never inside a word or path); whole lines otherwise."""
    from orchestrator.core.report import term_width, wrap  # lazy: start-up time, ~3.5 ms

    click.echo(wrap(text, term_width(sys.stderr if err else sys.stdout), indent=indent + 4), err=err)


def render_outcome(out, indent=""):
    def e(text="", err=False):
        _echo_wrapped(text, err=err, indent=len(indent))
    if out.error is not None:
        e(indent + ("FAILED: " if out.status != "fell back" else "LOW ACCEPTANCE: ") + out.error.render(), err=True)
    if out.fallback is not None:
        e(f"{indent}Fell back to {out.fallback.playbook} because of the low acceptance above"
          + (" (exit 1: the requested playbook is not what runs)." if out.fallback.ok else "; the fallback failed too:"),
          err=True)
        render_outcome(out.fallback, indent + "  ")
        return
    if out.ok:
        i = out.info
        if out.status == "already up":
            e(f"{indent}{out.playbook} is already up on {out.where} (pid {i.get('pid')}): nothing changed.")
        elif out.status == "up":
            a = i["acceptance"]
            e(f"{indent}{out.playbook} is up on {out.where}: {_where_it_answers(i)}  model {i['model']}  method {i['method']}")
            g = i.get("gate") or {}
            e(f"{indent}  acceptance gate passed: AL {a['mean_acceptance_length']:.2f}, draft acceptance "
              f"{a['draft_acceptance_rate']:.1%} over {a['drafts']:g} drafts ({a['source']})"
              + (" on the server that was already running" if i.get("gated_running") else "")
              + f"; total {i['total_s']}s" if g.get("passed") else
              f"{indent}  draft acceptance {a['draft_acceptance_rate']:.1%}, mean acceptance length "
              f"{a['mean_acceptance_length']:.2f} ({a['source']}); total {i['total_s']}s")
            e(f"{indent}  phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in i["phases_s"].items()))
            e(f"{indent}  supervised by systemd: {i['unit']} (enabled; restarts on failure, starts at boot)"
              if i.get("supervisor") == "systemd" else
              f"{indent}  not supervised: a crash leaves it down (the container does not run systemd)")
        elif out.status == "down":
            stopped = i.get("stopped") or []
            e(f"{indent}{out.playbook} is down on {out.where}: stopped "
              + (", ".join(f"{p['pid']} ({p.get('comm')})" for p in stopped) or "nothing (nothing was running)"))
            u = i.get("unit")
            if u:
                e(f"{indent}  unit {u['unit']}: {u.get('active')}, {u.get('enabled')} (it will not start at boot)")
            before, after = i.get("gpu_mib_before") or {}, i.get("gpu_mib_after") or {}
            e(f"{indent}  GPU MiB before -> after: " + ", ".join(
                f"GPU{g} {before[g]['used']} -> {after.get(g, {}).get('used')}" for g in sorted(before, key=int))
              + f"; free after {i.get('free_s')}s")
        elif out.status == "verified":
            e(f"{indent}{out.playbook}: drafter config installed and verified on {out.where}.")
        elif out.status in ("installed", "already installed"):
            sw = i.get("switched") or {}
            e(f"{indent}vLLM {i.get('version')} ({i.get('spec')}) is {out.status} on {out.where}: {i.get('venv_root')} -> "
              f"{sw.get('to') or i.get('venv')}" + (f" (previous: {sw['from']}; deploy install-vllm "
                                                    f"{out.playbook} --rollback returns to it)" if sw.get("from") else ""))
            e(f"{indent}  a vLLM serving now keeps running from its own files; the next `deploy up`/`restart` "
              f"starts this build")
        elif out.status in ("fetched", "linked", "already fetched"):
            for r in i.get("records") or []:
                rev = r.get("revision")
                shown = r["commit"] if not rev or rev == r["commit"] else f"{rev} = {r['commit']}"
                e(f"{indent}{r.get('role')}: {r.get('hub') or r.get('source') or 'files'} at {shown} is in place at "
                  f"{r.get('dest')} on {out.where}, every file verified ({r.get('files_n')} files)")
            if out.status == "linked":
                e(f"{indent}  nothing was downloaded (the host's store had it): linked into the container now")
            elif out.status == "already fetched" and i.get("rehashed"):
                e(f"{indent}  nothing was downloaded; every file was re-hashed now and matches its record")
            elif out.status == "already fetched":
                e(f"{indent}  nothing was downloaded (deploy fetch {out.playbook} --verify re-hashes every file)")
        elif out.status == "rolled back":
            e(f"{indent}{i.get('venv_root')} -> {i.get('to')} again on {out.where} (vLLM {i.get('version')}); "
              f"the next `deploy up`/`restart` starts it")


def _where_it_answers(info) -> str:
    return describe(info["endpoint"]) if info.get("endpoint") else str(info.get("url"))


def render_verify(pb, out, r):
    from orchestrator.core.report import check_rows, table, term_width  # lazy: start-up time, ~3.5 ms

    checks = (r.checks or []) + [c for c in (r.failed or []) if c not in (r.checks or [])]
    rows = check_rows(checks)
    if rows:
        click.echo(table(rows, ["check", "expected", "on disk", "as loaded", "verdict", "reason"], term_width()))
    st = r.stack or {}
    loc = r.location or {}
    if loc.get("path"):
        click.echo(f"\nfile: {loc['path']}" + (f" -> {loc['realpath']}" if loc.get("realpath") else
                                                " (does not resolve)"))
    if st.get("installed") is False:
        click.echo(f"vLLM: not installed for {r.python}")
    elif st.get("version"):
        click.echo(f"vLLM {st['version']}" + (f" (commit {st['commit_id']})" if st.get("commit_id") else "")
                   + (f" at {st['path']}" if st.get("path") else "")
                   + (f"; transformers {r.transformers_version}" if r.transformers_version else "")
                   + (f"; python {r.python}" if r.python else ""))
    for role, rec in (out.info.get("revisions") or {}).items():
        from orchestrator.provision.weights_fetch import _rev, _when  # lazy: start-up time, ~13 ms of every command

        click.echo(f"{role}: {_rev(rec)} at {rec['dest']}, fetched and verified {_when(rec.get('verified_at'))}"
                   if rec else f"{role}: not fetched by deploy (no record; deploy fetch {pb.name})")
    gp = out.info.get("gpu_plumbing")
    if gp is not None:
        if gp.get("findings"):
            click.echo(render_plumbing(gp["findings"]))
        else:
            click.echo("GPU plumbing: ok" + (f" (container side only; host side not read: {gp['host_error']})"
                                             if gp.get("host_error") else ""))
    if out.error:
        click.echo("FAILED: " + out.error.render(), err=True)
    else:
        click.echo(f"OK: {pb.name} can be launched correctly on {out.where}")
