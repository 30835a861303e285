"""`deploy`: the deploy loop: plan, size, up, restart, down, verify. Click commands only."""

from __future__ import annotations

import json
import os
import sys

import click

from orchestrator.core.errors import (EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DeployError, SpecError, Unreachable,
                      UsageError)
from orchestrator.core.remote import Fleet
from orchestrator.cli.render import _echo_wrapped, render_plans, render_verify
from orchestrator.core.report import dump_json
from orchestrator.core.spec import list_playbooks, load_playbook
from .base import (CONTEXT, _confirm, _fleet_exit, _outcome_exit, _outcomes_exit, complete_playbooks, complete_targets,
                   json_option, load, main, not_a_container, run_guarded, up_options)
# lazy, inside the commands, for start-up time (deploy --help, --version and status do not load what they
# do not run; all of it ~170 ms): ops, plan, fleet, fetch, install, sizing, status


# ------------------------------------------------------------------ plan


PLANNED = ("up", "restart", "down", "fetch", "install-vllm", "apply-config", "verify", "compare")


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--op", "op", type=click.Choice(PLANNED), default="up", show_default=True,
              help="Which command's plan: every one of them runs its plan through the same executor.")
@click.option("--restart", is_flag=True, help="Plan a restart (always stops first); the same as --op restart.")
@click.option("--clean-gpus", is_flag=True, default=None, help="Include fuser -k on the container's GPUs.")
@json_option
@click.pass_obj
def plan(obj, playbook, op, restart, clean_gpus):
    """Print the ordered steps of `deploy up PLAYBOOK` (or of --op fetch, install-vllm, down, restart,
    apply-config, verify, compare: its run of PLAYBOOK, with its defaults) and the exact remote commands, without
    running any.

    \b
    Examples:
      deploy plan qwen36-dflash
      deploy plan qwen36-dflash --op install-vllm
      deploy plan qwen36-dflash --op down
      deploy --json plan qwen36-mtp | jq '.steps[].command'
    """
    def go():
        from orchestrator.provision import weights_fetch as F
        from orchestrator.provision import vllm_install as I
        from orchestrator.steps import plan as P
        from orchestrator.deploy.ops import Options, apply_config_refusal
        from orchestrator.core.sizing import refuse_if_certain

        inv, pb = load(obj, playbook)
        kind = "restart" if restart else op
        if kind in ("up", "restart"):
            refuse_if_certain(pb)
        refusal = {"fetch": F.refusal, "install-vllm": I.refusal, "apply-config": apply_config_refusal}.get(kind)
        refused = refusal(pb) if refusal else None
        if refused:
            raise refused
        ask = lambda m: Options(clean_gpus=clean_gpus).ask_before_kill(m)  # noqa: E731
        plans = {"up": lambda m: P.plan_up(m, clean_gpus=clean_gpus, ask=ask(m)),
                 "restart": lambda m: P.plan_up(m, clean_gpus=clean_gpus, restart=True, ask=ask(m)),
                 "down": lambda m: P.plan_down(m, clean_gpus=clean_gpus, ask=ask(m)),
                 "fetch": P.plan_fetch, "install-vllm": P.plan_install, "apply-config": P.plan_apply_config,
                 "verify": P.plan_verify, "compare": lambda m: P.plan_compare(m, clean_gpus=clean_gpus)}
        render_plans(obj.json, inv, pb, plans[kind])
    run_guarded(go, obj)


# ------------------------------------------------------------------ size


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--max-model-len", type=click.IntRange(min=16), default=None, metavar="N",
              help="What if: this max_model_len instead of the playbook's serve.max_model_len.")
@click.option("--tp", type=click.IntRange(1, 64), default=None, metavar="N",
              help="What if: this tensor_parallel_size (that many GPUs).")
@click.option("--gmu", type=click.FloatRange(0.05, 0.99), default=None, metavar="F",
              help="What if: this gpu_memory_utilization.")
@click.option("--gpu-mib", type=click.FloatRange(min=256), default=None, metavar="MIB",
              help="Each GPU's total memory (MiB, as nvidia-smi reports it) instead of sizing.gpu_total_mib "
                   "(default: an assumed 80 GB GPU, 81559 MiB).")
@click.option("--target-config", type=click.Path(), default=None, metavar="PATH",
              help="The target's config.json (or a directory with it and the safetensors) instead of "
                   "sizing.target_config.")
@json_option
@click.pass_obj
def size(obj, playbook, max_model_len, tp, gmu, gpu_mib, target_config):
    """Will it fit? Predict vLLM's memory for PLAYBOOK on its GPUs, without connecting to anything.

    Weights per GPU, the activation/graph reserve (an assumption), the KV cache in bytes and tokens, the
    concurrency at max_model_len, and a verdict: fits, tight (a warning), does not fit (with the changes that
    would fit), or unknown (what the model does not understand is named; never a refusal). The same figures
    decide the `fits:` line of `deploy plan`. Exit 0, or 1 when it does not fit. See docs/playbooks.md#will-it-fit.

    \b
    Examples:
      deploy size qwen36-dflash
      deploy size qwen36-dflash --max-model-len 131072 --tp 2
      deploy size qwen36-dflash --gpu-mib 49140 --gmu 0.95
      deploy --json size qwen36-mtp --max-model-len 131072 | jq .sizing
    """
    def go():
        from orchestrator.core import sizing as Z

        pb = _load_offline(obj, playbook)
        if target_config:
            _local_target(pb, target_config)
        inp = Z.from_playbook(pb, tp=tp, gmu=gmu, max_model_len=max_model_len, gpu_mib=gpu_mib)
        s = Z.size(inp) if inp is not None else None
        level, line = Z.assess(pb, s)
        if obj.json:
            dump_json({"playbook": pb.name, "level": level, "line": line,
                       "target_config": pb.target_config_path, "sizing": s.as_dict() if s else None})
        else:
            click.echo(f"Will {pb.name} fit? (predicted, nothing was contacted; target config: "
                       f"{pb.target_config_path or 'none'})")
            if s is not None:
                for ln in Z.table(s):
                    click.echo(ln)
                for n in s.notes + ([s.weights_source] if s.weights_source else []):
                    _echo_wrapped(f"  - {n}")
            _echo_wrapped(f"sizing: {line}")
        sys.exit(EXIT_FAILED if s is not None and s.verdict == "does-not-fit" else EXIT_OK)
    run_guarded(go, obj)


def _load_offline(obj, playbook):
    """The playbook, validated without the inventory (size contacts nothing and needs no host); HOST/VMID of an
    inventory there is still told apart from a playbook name."""
    try:
        not_a_container(obj.inventory(), playbook)
    except (UsageError, SpecError, OSError) as e:
        if isinstance(e, UsageError) and "is a container, not a playbook" in str(e.message):
            raise
    return load_playbook(playbook, None)


def _local_target(pb, path):
    """--target-config: read the config (and safetensors headers) as sizing.target_config is read at load."""
    from orchestrator.core.sizing import NotUnderstood, weights_from_safetensors

    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, "rb") as fh:
            cfg = json.loads(fh.read(4 << 20))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        weights = weights_from_safetensors(path) if os.path.isdir(path) else None
    except (OSError, ValueError, NotUnderstood) as e:
        raise UsageError(f"--target-config {path}: cannot read it: {e}", fix="give a config.json or its directory")
    pb.target_config, pb.target_config_path, pb.target_weights = cfg, cfg_path, weights
    for m in pb.members:
        m.target_config, m.target_config_path, m.target_weights = cfg, cfg_path, weights


# ------------------------------------------------------------------ up / restart / down


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@up_options
@click.option("--skip-config-write", is_flag=True,
              help="Do not install the pinned drafter config. Verify still runs and reports, but does not stop the "
                   "launch: a rehearsal of the field report, where the acceptance gate must catch a stale config.")
@click.option("--clean-gpus", is_flag=True, default=None,
              help="fuser -k the container's GPUs when stopping (asks first, listing the holders deploy did not "
                   "start; -y does not ask).")
@click.option("--parallel", type=click.IntRange(min=1), default=None, metavar="N",
              help="A playbook with targets: bring up at most N targets at a time (default: all at once).")
@click.option("--install-vllm", "install_first", is_flag=True,
              help="First install the vLLM the playbook requires (requires.vllm), as deploy install-vllm does "
                   "(nothing to do when it is already the verified runtime).")
@click.option("--no-fetch", is_flag=True,
              help="A playbook with a hub or directory source: refuse (exit 1) when the weights are not in place and "
                   "verified, instead of fetching them first.")
@json_option
@click.pass_obj
def up(obj, playbook, yes, wait_lock, dry_run, skip_config_write, clean_gpus, parallel, install_first, no_fetch):
    """Bring PLAYBOOK up, verified end to end: config, stack, GPUs, launch, readiness, acceptance.

    Already up with the same argv and drafter config and healthy: nothing changes (exit 0). A different
    deployment running there is shown as a diff and replaced only with -y (or a yes at the prompt).
    Below the acceptance threshold the deployment has failed; with on_low_acceptance: fallback it is
    stopped and the fallback playbook is brought up and gated instead.

    A playbook with `targets:` (replicas) brings every target up in parallel (--parallel N at a time), each
    through all of the above with its own lock and gates, progress lines prefixed with HOST/VMID, and ends
    with one summary line per target. Exit 0 only when every target passed; a differing deployment on a
    target is replaced only with -y (no prompt).

    \b
    Examples:
      deploy up qwen36-dflash
      deploy up qwen36-dflash --dry-run
      deploy up qwen36-dflash --install-vllm     # its requires.vllm ("0.34.0") first, then up
      deploy --json up qwen36-mtp -y > result.json
      deploy up qwen36-replicas --parallel 2      # a playbook with targets:
    """
    def go():
        from orchestrator.core.sizing import refuse_if_certain
        from orchestrator.deploy import ops
        from orchestrator.provision.vllm_install import refusal
        from orchestrator.provision.weights_fetch import tokens as fetch_tokens
        from orchestrator.steps import plan as P

        inv, pb = load(obj, playbook)
        refuse_if_certain(pb)  # a certain does-not-fit stops here, before any connection (nothing is stopped)
        if dry_run:
            return render_plans(obj.json, inv, pb, lambda m: P.plan_up(
                m, write_config=not skip_config_write, clean_gpus=clean_gpus,
                ask=ops.Options(clean_gpus=clean_gpus, yes=yes).ask_before_kill(m), fetch=not no_fetch))
        if install_first:
            refused = refusal(pb, "--install-vllm")
            if refused:
                raise refused
        if install_first and pb.is_fleet:
            raise UsageError(f"--install-vllm: {pb.name} has targets; up --install-vllm takes a one-target playbook",
                             where=pb.path, fix=f"deploy install-vllm {pb.name} (each target in turn), then "
                                                f"deploy up {pb.name}")
        opts = ops.Options(yes=yes, write_config=not skip_config_write, clean_gpus=clean_gpus, wait_lock_s=wait_lock,
                           confirm=_confirm, fetch=not no_fetch)
        fetch_tokens(pb, P.fetch_args(pb))  # an unset token variable stops here, before any connection
        if pb.is_fleet:
            from orchestrator.serving import fleet as F

            with Fleet(inv) as fleet:
                res = F.up(fleet, pb, F.SharedProgress(verbose=obj.verbose), opts, parallel=parallel)
            _fleet_exit(obj, res)
        with Fleet(inv) as fleet:
            if install_first:
                out = ops.install_vllm(fleet, pb, obj.progress(), yes=yes, confirm=_confirm)
                if not out.ok:
                    _outcome_exit(obj, out)
            out = ops.up(fleet, pb, obj.progress(), opts)
        _outcome_exit(obj, out)
    run_guarded(go, obj)


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", required=False, shell_complete=complete_playbooks)
@click.option("--wait-lock", type=click.FloatRange(min=0), default=0, metavar="SECONDS",
              help="Wait this long for another deploy's lock instead of failing at once.")
@click.option("--dry-run", is_flag=True, help="Print the plan and run nothing.")
@click.option("--clean-gpus", is_flag=True, default=None,
              help="After stopping, fuser -k -TERM then -KILL whatever in the container still holds the playbook's "
                   "/dev/nvidiaN (asks first, listing the holders deploy did not start).")
@click.option("-y", "--yes", is_flag=True, help="With --clean-gpus: kill the GPU holders without asking (scripts).")
@click.option("--rolling", is_flag=True,
              help="A playbook with targets: one target at a time, the next only after this one passed its gates "
                   "(the others keep serving); a failure stops the roll-out there.")
@click.option("--max-unavailable", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --rolling: restart N targets at a time (default 1).")
@json_option
@click.pass_obj
def restart(obj, playbook, wait_lock, dry_run, clean_gpus, yes, rolling, max_unavailable):
    """Stop, free and prove the GPUs free, verify the drafter config, start again, and gate on acceptance.

    Without PLAYBOOK: restart what the state file in each inventory container says is running there.
    A playbook with `targets:` restarts every target in parallel; with --rolling one at a time (or
    --max-unavailable N at a time), moving on only when the restarted target(s) passed their gates. A
    target that fails stops the roll-out: the output says which targets are on the new deployment, which
    failed, and which are still on the old one (untouched).

    \b
    Examples:
      deploy restart qwen36-dflash --clean-gpus
      deploy restart --clean-gpus -y
      deploy restart qwen36-replicas --rolling
      deploy restart qwen36-replicas --rolling --max-unavailable 2
    """
    def go():
        from orchestrator.deploy import ops
        from orchestrator.steps import plan as P

        if max_unavailable and not rolling:
            raise UsageError("--max-unavailable is for a rolling restart", fix="add --rolling")
        if rolling and not playbook:
            raise UsageError("--rolling needs the PLAYBOOK whose targets to roll through",
                             fix="deploy restart PLAYBOOK --rolling")
        inv = obj.inventory()
        names = [playbook] if playbook else _running_playbooks(obj, inv)
        if not names:
            raise DeployError("no playbook given and no container's state file names a running deployment",
                              fix="deploy restart PLAYBOOK")
        if playbook:
            not_a_container(inv, playbook)
        pbs = [load_playbook(n, inv) for n in names]
        for pb in pbs:
            if pb.is_fleet and pb.conf.router and not rolling:  # issue 53: clients saw 500/503 meanwhile
                _echo_wrapped(f"warning: {pb.name} is served through its router: a plain restart stops every "
                              "replica at once, so clients get errors (500/503) until they are back; deploy restart "
                              f"{pb.name} --rolling restarts them one at a time while the router keeps serving",
                              err=True)
        if dry_run:
            for pb in pbs:
                render_plans(obj.json, inv, pb, lambda m: P.plan_up(m, clean_gpus=clean_gpus, restart=True,
                                                               ask=ops.Options(clean_gpus=clean_gpus, yes_kill=yes)
                                                               .ask_before_kill(m)))
            return
        opts = ops.Options(yes=True, clean_gpus=clean_gpus, wait_lock_s=wait_lock, yes_kill=yes, confirm=_confirm)
        if len(pbs) == 1 and (rolling or pbs[0].is_fleet):
            from orchestrator.serving import fleet as F

            with Fleet(inv) as fleet:
                progress = F.SharedProgress(verbose=obj.verbose)
                res = F.rolling_restart(fleet, pbs[0], progress, opts, max_unavailable=max_unavailable or 1) \
                    if rolling else F.up(fleet, pbs[0], progress, opts, restart=True)
            _fleet_exit(obj, res)
        with Fleet(inv) as fleet:
            outs = []
            for pb in pbs:
                if pb.is_fleet:  # named by a container's state file (deploy restart without PLAYBOOK)
                    from orchestrator.serving import fleet as F

                    outs += F.up(fleet, pb, F.SharedProgress(verbose=obj.verbose), opts, restart=True)["_outcomes"]
                else:
                    outs.append(ops.up(fleet, pb, obj.progress(), opts, restart=True))
        if len(outs) == 1:
            _outcome_exit(obj, outs[0])
        _outcomes_exit(obj, outs)  # as a single restart: 3 when only unreachable hosts failed
    run_guarded(go, obj)


def _running_playbooks(obj, inv):
    """The playbooks the containers' state files name, kept only if they are local playbooks that target that
    same container: a state file is data from the container, not an instruction to run some other playbook."""
    from orchestrator.observe.status import gather

    rows = gather(inv, None)
    lost = [r for r in rows if not r["reachable"]]
    if lost:
        raise Unreachable("cannot tell what runs where without every container's state file: "
                          + "; ".join(f"{r['host']}/{r['vmid']}: {r['problems'][0] if r['problems'] else '?'}"
                                      for r in lost),
                          fix="bring the host(s) back (deploy status shows them), or name what to restart: "
                              "deploy restart PLAYBOOK")
    known = set(list_playbooks())
    names = set()
    for r in rows:
        name, where = r.get("playbook"), f"{r['host']}/{r['vmid']}"
        if not name or r.get("process") != "running":
            continue
        try:
            pb = load_playbook(name, inv) if name in known else None
        except SpecError:
            pb = None
        if pb is None or where not in {t.where for t in pb.targets}:
            click.echo(f"{where}: its state file names {name!r}, which is not a playbook here for that container; "
                       "skipped (deploy restart PLAYBOOK to choose)", err=True)
            continue
        names.add(name)
    return sorted(names)


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.argument("only", required=False, metavar="[HOST/VMID]", shell_complete=complete_targets)
@click.option("--clean-gpus", is_flag=True, default=None,
              help="Also fuser -k -TERM, then -KILL, whatever in the container still holds /dev/nvidia*.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before killing GPU holders (for scripts).")
@click.option("--wait-lock", type=click.FloatRange(min=0), default=0, metavar="SECONDS",
              help="Wait this long for another deploy's lock instead of failing at once.")
@json_option
@click.pass_obj
def down(obj, playbook, only, clean_gpus, yes, wait_lock):
    """Stop PLAYBOOK's vLLM (SIGTERM the group, grace, SIGKILL), and prove its GPUs free.

    Never runs fuser on the Proxmox host itself; --clean-gpus acts only inside the container.
    A playbook with `targets:` takes every target down (in parallel), or only HOST/VMID when given.

    \b
    Examples:
      deploy down qwen36-dflash
      deploy down qwen36-dflash --clean-gpus -y
      deploy down qwen36-replicas pve2/129
    """
    def go():
        from orchestrator.deploy import ops

        inv, pb = load(obj, playbook)
        members = [pb.member(only)] if only else pb.members
        opts = ops.Options(clean_gpus=clean_gpus, wait_lock_s=wait_lock, yes=yes, confirm=_confirm)
        if pb.is_fleet:
            from orchestrator.serving import fleet as F

            with Fleet(inv) as fleet:  # --clean-gpus without -y asks per target: one target at a time then
                res = F.down(fleet, pb, F.SharedProgress(verbose=obj.verbose), opts, only=only,
                             parallel=1 if clean_gpus and not yes else None)
            _fleet_exit(obj, res)
        with Fleet(inv) as fleet:
            out = ops.down(fleet, members[0], obj.progress(), opts)
        _outcome_exit(obj, out)
    run_guarded(go, obj)


# ------------------------------------------------------------------ verify / apply-config


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@json_option
@click.pass_obj
def verify(obj, playbook):
    """Verify the drafter config vLLM will read, and the serving stack, in one round trip per container.

    Checks the real path (symlinks followed), sha256 against the pin, every field, cross-checks against the
    target model, the config as loaded by the container's own transformers, the vLLM version, fixes and build.

    \b
    Example:
      deploy verify qwen36-dflash
      deploy --json verify qwen36-dflash | jq '.checks[] | select(.ok == false)'
    """
    def go():
        from orchestrator.deploy import ops

        inv, pb = load(obj, playbook)
        members = pb.members if pb.is_fleet else [pb]
        with Fleet(inv) as fleet:  # one connection per host; a playbook with targets: each container in turn
            outs = [(m, *ops.verify_only(fleet, m, obj.progress())) for m in members]
        docs = []
        for m, out, r in outs:
            doc = {"ok": out.ok, "playbook": m.name, "where": out.where,
                   "error": out.error.as_dict() if out.error else None,
                   **r.as_dict(), **{k: out.info[k] for k in ("revisions", "gpu_plumbing", "fits") if k in out.info}}
            docs.append(doc)
            if obj.json:
                continue
            if len(outs) > 1:
                click.echo(f"\n== {out.where}")
            render_verify(m, out, r)
        if obj.json:
            dump_json(docs[0] if not pb.is_fleet else
                      {"ok": all(d["ok"] for d in docs), "playbook": pb.name, "targets": docs})
        bad = [out for _, out, _ in outs if not out.ok]
        if len(outs) > 1 and not obj.json:
            click.echo(f"\n{pb.name}: {len(outs) - len(bad)} of {len(outs)} targets verified"
                       + (": failed on " + ", ".join(o.where for o in bad) if bad else ""))
        codes = [o.error.exit_code if o.error else EXIT_FAILED for o in bad]
        others = [c for c in codes if c != EXIT_UNREACHABLE]  # 3 only when every failure was an unreachable host
        sys.exit(EXIT_OK if not bad else max(others) if others else EXIT_UNREACHABLE)
    run_guarded(go, obj)
