"""`deploy`: click commands only. Parse, call, render. Heavy modules are imported inside the commands."""

from __future__ import annotations

import os
import sys

import click

from . import __version__
from .errors import (EXIT_CODES_HELP, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, DeployError,
                     UsageError)
from .render import _echo_wrapped, render_outcome, render_plans, render_verify

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Obj:
    def __init__(self, inventory, verbose, as_json):
        self.inventory_path = inventory
        self.verbose = verbose
        self.json = as_json

    def inventory(self):
        from .locate import find_inventory
        from .spec import load_inventory

        return load_inventory(find_inventory(self.inventory_path))

    def progress(self):
        from .report import Progress

        return Progress(verbose=self.verbose)


def fail(err: DeployError, as_json: bool) -> None:
    from .report import dump_json

    if as_json:
        dump_json({"ok": False, **err.as_dict()})
    else:
        from .report import term_width, wrap

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


@click.group(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

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
    from .report import guard_std_streams

    guard_std_streams()  # a reader that goes away (| head) must not abort an operation half-way
    ctx.obj = Obj(inventory, verbose, as_json)


def complete_playbooks(_ctx, _param, incomplete):
    """Shell completion (click's own): playbook names in the search order."""
    from .locate import list_playbooks

    return [n for n in list_playbooks() if n.startswith(incomplete)]


def complete_targets(ctx, param, incomplete):
    """Shell completion: playbook names, inventory hosts and HOST/VMID."""
    from .locate import find_inventory
    from .spec import load_inventory

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
    from .spec import load_playbook

    inv = obj.inventory()
    not_a_container(inv, playbook)
    return inv, load_playbook(playbook, inv)


def not_a_container(inv, playbook: str) -> None:
    """`deploy down pve1/129`: HOST/VMID of the inventory where a PLAYBOOK is expected -> a usage error (exit 2,
    nothing ran) naming the playbooks that target that container, instead of "file not found"."""
    import re

    m = re.fullmatch(r"([^/\s]+)/(\d+)", playbook)
    if not m or os.path.exists(playbook) or m.group(1) not in inv.hosts:
        return
    from .locate import list_playbooks
    from .spec import SpecError, load_playbook

    cmd = click.get_current_context().info_name or "COMMAND"
    mine = []
    for n in list_playbooks():
        try:
            pb = load_playbook(n, inv)
        except (SpecError, UsageError, OSError):
            continue
        if any(t["host"] == m.group(1) and t["vmid"] == int(m.group(2)) for t in pb.targets):
            mine.append((n, pb.is_fleet))
    which = ", ".join(n for n, _ in mine) or "none here"
    fixes = [f"deploy {cmd} {n}" + (f" {playbook}" if fleet else "") for n, fleet in mine]
    raise UsageError(f"{playbook} is a container, not a playbook: deploy {cmd} takes the PLAYBOOK (playbooks that "
                     f"target {playbook}: {which}); nothing was run",
                     fix=("; ".join(fixes) + "; " if fixes else "")
                     + f"deploy status {playbook} shows which playbook runs there")


# ------------------------------------------------------------------ plan


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--restart", is_flag=True, help="Plan a restart (always stops first).")
@click.option("--clean-gpus", is_flag=True, default=None, help="Include fuser -k on the container's GPUs.")
@json_option
@click.pass_obj
def plan(obj, playbook, restart, clean_gpus):
    """Print the ordered steps of `deploy up PLAYBOOK` and the exact remote commands, without running any.

    \b
    Example:
      deploy plan qwen36-dflash
      deploy --json plan qwen36-mtp | jq '.steps[].command'
    """
    def go():
        from . import plan as P

        inv, pb = load(obj, playbook)
        from .ops import Options
        from .sizing import refuse_if_certain

        refuse_if_certain(pb)
        render_plans(obj.json, inv, pb, lambda m: P.plan_up(m, clean_gpus=clean_gpus, restart=restart,
                                                       ask=Options(clean_gpus=clean_gpus).ask_before_kill(m)))
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
        from . import sizing as Z
        from .report import dump_json

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
    from .errors import SpecError
    from .spec import load_playbook

    try:
        not_a_container(obj.inventory(), playbook)
    except (UsageError, SpecError, OSError) as e:
        if isinstance(e, UsageError) and "is a container, not a playbook" in str(e.message):
            raise
    return load_playbook(playbook, None)


def _local_target(pb, path):
    """--target-config: read the config (and safetensors headers) as sizing.target_config is read at load."""
    import json as _json

    from .sizing import NotUnderstood, weights_from_safetensors

    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, "rb") as fh:
            cfg = _json.loads(fh.read(4 << 20))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        weights = weights_from_safetensors(path) if os.path.isdir(path) else None
    except (OSError, ValueError, NotUnderstood) as e:
        raise UsageError(f"--target-config {path}: cannot read it: {e}", fix="give a config.json or its directory")
    pb.target_config, pb.target_config_path, pb.target_weights = cfg, cfg_path, weights
    for m in pb.members:
        m.target_config, m.target_config_path, m.target_weights = cfg, cfg_path, weights


# ------------------------------------------------------------------ up / restart / down


def _outcome_exit(obj, out):
    from .errors import Unreachable
    from .report import dump_json

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
    from .errors import Unreachable
    from .report import dump_json

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
    from .report import term_width, wrap

    return click.confirm(wrap(prompt, term_width(sys.stderr), indent=4), default=False, err=True)


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
      deploy up my-dflash --install-vllm         # a playbook with requires.vllm
      deploy --json up qwen36-mtp -y > result.json
      deploy up qwen36-replicas --parallel 2      # a playbook with targets:
    """
    def go():
        from . import ops
        from . import plan as P
        from .remote import Fleet

        inv, pb = load(obj, playbook)
        from .sizing import refuse_if_certain

        refuse_if_certain(pb)  # a certain does-not-fit stops here, before any connection (nothing is stopped)
        if dry_run:
            return render_plans(obj.json, inv, pb, lambda m: P.plan_up(
                m, write_config=not skip_config_write, clean_gpus=clean_gpus,
                ask=ops.Options(clean_gpus=clean_gpus, yes=yes).ask_before_kill(m)))
        if install_first and not pb.data["requires"].get("vllm"):
            raise UsageError(f"--install-vllm: {pb.name} does not say which vLLM it needs (requires.vllm); "
                             "nothing was run",
                             where=pb.path, fix="add requires.vllm to the playbook (deploy docs playbooks#requires)")
        if install_first and pb.is_fleet:
            raise UsageError(f"--install-vllm: {pb.name} has targets; up --install-vllm takes a one-target playbook",
                             where=pb.path, fix=f"deploy install-vllm {pb.name} (each target in turn), then "
                                                f"deploy up {pb.name}")
        opts = ops.Options(yes=yes, write_config=not skip_config_write, clean_gpus=clean_gpus, wait_lock_s=wait_lock,
                           confirm=_confirm, fetch=not no_fetch)
        from .fetch import tokens as fetch_tokens
        from .plan import fetch_args

        fetch_tokens(pb, fetch_args(pb))  # an unset token variable stops here, before any connection
        if pb.is_fleet:
            from . import fleet as F

            with Fleet(inv) as fleet:
                res = F.up(fleet, pb, F.SharedProgress(verbose=obj.verbose), opts, parallel=parallel)
            _fleet_exit(obj, res)
        with Fleet(inv) as fleet:
            if install_first:
                from .install import install

                out = install(fleet, pb, obj.progress(), yes=yes, confirm=_confirm)
                if not out.ok:
                    _outcome_exit(obj, out)
            out = ops.up(fleet, pb, obj.progress(), opts)
        _outcome_exit(obj, out)
    run_guarded(go, obj)


def _fleet_exit(obj, res):
    """A playbook with targets: every failed target's error (fix, state left), then one line per target and the
    totals; --json: every target. Exit 0 all passed, 3 only unreachable hosts failed, else 1."""
    from . import fleet as F
    from .report import dump_json

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
        from . import ops
        from . import plan as P
        from .remote import Fleet

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
        from .spec import load_playbook

        if playbook:
            not_a_container(inv, playbook)
        pbs = [load_playbook(n, inv) for n in names]
        if dry_run:
            for pb in pbs:
                render_plans(obj.json, inv, pb, lambda m: P.plan_up(m, clean_gpus=clean_gpus, restart=True,
                                                               ask=ops.Options(clean_gpus=clean_gpus, yes_kill=yes)
                                                               .ask_before_kill(m)))
            return
        opts = ops.Options(yes=True, clean_gpus=clean_gpus, wait_lock_s=wait_lock, yes_kill=yes, confirm=_confirm)
        if len(pbs) == 1 and (rolling or pbs[0].is_fleet):
            from . import fleet as F

            with Fleet(inv) as fleet:
                progress = F.SharedProgress(verbose=obj.verbose)
                res = F.rolling_restart(fleet, pbs[0], progress, opts, max_unavailable=max_unavailable or 1) \
                    if rolling else F.up(fleet, pbs[0], progress, opts, restart=True)
            _fleet_exit(obj, res)
        with Fleet(inv) as fleet:
            outs = []
            for pb in pbs:
                if pb.is_fleet:  # named by a container's state file (deploy restart without PLAYBOOK)
                    from . import fleet as F

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
    from .errors import SpecError, Unreachable
    from .spec import list_playbooks, load_playbook
    from .status import gather

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
        pb = None
        if name in known:
            try:
                pb = load_playbook(name, inv)
            except SpecError:
                pb = None
        if pb is None or (r["host"], r["vmid"]) not in {(t["host"], t["vmid"]) for t in pb.targets}:
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
        from . import ops
        from .remote import Fleet

        inv, pb = load(obj, playbook)
        members = [pb.member(only)] if only else pb.members
        opts = ops.Options(clean_gpus=clean_gpus, wait_lock_s=wait_lock, yes=yes, confirm=_confirm)
        if pb.is_fleet:
            from . import fleet as F

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
        from . import ops
        from .remote import Fleet
        from .report import dump_json

        inv, pb = load(obj, playbook)
        members = pb.members if pb.is_fleet else [pb]
        with Fleet(inv) as fleet:  # one connection per host; a playbook with targets: each container in turn
            outs = [(m, *ops.verify_only(fleet, m, obj.progress())) for m in members]
        docs = []
        for m, out, r in outs:
            doc = {"ok": out.ok, "playbook": m.name, "where": out.where,
                   "error": out.error.as_dict() if out.error else None,
                   **r.as_dict()}
            if "revisions" in out.info:
                doc["revisions"] = out.info["revisions"]
            if "gpu_plumbing" in out.info:
                doc["gpu_plumbing"] = out.info["gpu_plumbing"]
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


# ------------------------------------------------------------------ install-vllm


@main.command("install-vllm", context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("-y", "--yes", is_flag=True,
              help="Install even while the playbook is serving (the serving process is not touched).")
@click.option("--rollback", is_flag=True, help="Switch the runtime back to the vLLM it had before the last switch.")
@click.option("--force", is_flag=True, help="Install again even when requires.vllm is already the verified runtime.")
@json_option
@click.pass_obj
def install_vllm(obj, playbook, yes, rollback, force):
    """Install the vLLM the playbook needs (requires.vllm) into its container, verified, without a gap.

    The install goes into a fresh venv next to the runtime (RUNTIME.versions/), with uv when the container has
    it, else pip; it runs detached from the SSH session (a dropped connection does not stop a long build: run
    the command again to re-attach and get the result). It is verified there (version, the DFlash fix markers,
    compiled extensions, an import in a subprocess, every file against the distribution's RECORD), and only then
    is the runtime venv switched to it: the previous vLLM stays usable until the new one is verified. Reaching
    requires.install.timeout_s is "build not finished", never success. A serving vLLM is not touched (asked
    first; -y to proceed): the next `deploy up`/`restart` starts the new build.

    The shipped playbooks name no requires.vllm: add it to your copy first (deploy init; deploy docs
    playbooks#requires), e.g. `requires: {vllm: "0.34.0"}`, as my-dflash below.

    \b
    Examples:
      deploy install-vllm my-dflash                # my-dflash.yaml: a copy with requires.vllm
      deploy install-vllm my-dflash -y
      deploy install-vllm my-dflash --rollback
      deploy --json install-vllm my-dflash
    """
    def go():
        from .install import install
        from .remote import Fleet

        inv, pb = load(obj, playbook)
        if not rollback and not pb.data["requires"].get("vllm"):
            raise UsageError(f"{pb.name} does not say which vLLM it needs (requires.vllm); nothing was run",
                             where=pb.path, fix="add requires.vllm to the playbook: a version (\"0.34.0\"), "
                                                "git+https://github.com/ORG/vllm@BRANCH, a wheel URL or a wheel path "
                                                "in the container (deploy docs playbooks#requires); the shipped "
                                                "playbooks name none: copy one (deploy init) and add it")
        if not pb.is_fleet:
            with Fleet(inv) as fleet:
                out = install(fleet, pb, obj.progress(), yes=yes, confirm=_confirm, force=force, rollback=rollback)
            _outcome_exit(obj, out)
        # a playbook with targets: each target in turn (a build per container), every outcome reported
        outs = []
        with Fleet(inv) as fleet:
            for m in pb.members:
                outs.append(install(fleet, m, obj.progress(), yes=yes, confirm=_confirm, force=force,
                                    rollback=rollback))
        _outcomes_exit(obj, outs)
    run_guarded(go, obj)


# ------------------------------------------------------------------ fetch, manifest


@main.command("fetch", context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--verify", "rehash", is_flag=True,
              help="Also re-hash every file already in place (sha256 / git blob id) instead of trusting the record.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=6 * 3600.0, show_default=True,
              metavar="SECONDS", help="The fetch's time limit (a partial download is kept: the next run resumes).")
@click.option("--manifest", "manifest_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="After the fetch, write the verified record of each item as a manifest (FILE, or FILE.ROLE.json "
                   "for several): copy it beside the files for source: {path: HOST_DIR}.")
@json_option
@click.pass_obj
def fetch(obj, playbook, rehash, timeout_s, manifest_out):
    """Fetch the playbook's model and drafter weights into its container, at the pinned revision, verified.

    The download runs in the container, detached from the SSH session: a dropped connection does not stop
    it, and running the command again re-attaches and reports. It resumes partial files (HTTP Range), checks
    the space before it starts, prints bytes, rate and ETA per file and in total, and verifies every file
    against the hub's record (sha256 for LFS files, the git blob id for the others) before moving anything
    into place. Already fetched and verified: nothing to do. A `source: {path: HOST_DIR}` is copied from the
    Proxmox host instead and verified against its deploy-manifest.json.

    \b
    Examples:
      deploy fetch qwen36-dflash
      deploy fetch qwen36-dflash --timeout 7200    # the token: export the variable named in token_env first
      deploy fetch qwen36-dflash --verify
      deploy fetch qwen36-dflash --manifest /tmp/qwen36.manifest.json
      deploy --json fetch qwen36-dflash
    """
    def go():
        from .fetch import fetch as do_fetch
        from .remote import Fleet

        inv, pb = load(obj, playbook)
        outs = []
        with Fleet(inv) as fleet:
            for m in pb.members:
                outs.append(do_fetch(fleet, m, obj.progress(), rehash=rehash, timeout_s=timeout_s))
                if manifest_out and outs[-1].ok:
                    _write_fetch_manifests(fleet, m, manifest_out)
        if len(outs) == 1:
            _outcome_exit(obj, outs[0])
        _outcomes_exit(obj, outs)
    run_guarded(go, obj)


def _write_fetch_manifests(fleet, pb, out_path):
    import json as _json

    from . import agent
    from .fetch import dest_of, manifest_from_record
    from .plan import fetch_args

    its = fetch_args(pb)
    res = agent.call(fleet.session(pb.host), pb.vmid, pb.runtime["python"], "fetch",
                     {"op": "records", "state_dir": pb.runtime["state_dir"], "dests": [dest_of(it) for it in its]},
                     timeout=30)
    for it in its:
        rec = (res.get("records") or {}).get(dest_of(it))
        if not rec:
            continue
        path = out_path if len(its) == 1 else f"{os.path.splitext(out_path)[0]}.{it['role']}.json"
        with open(path, "w") as fh:
            _json.dump(manifest_from_record(rec), fh, indent=1)
            fh.write("\n")
        click.echo(f"wrote {path}: the manifest of {it['role']} ({len(rec.get('files') or [])} files)", err=True)


@main.command("manifest", context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--hub", default=None, metavar="ORG/NAME", help="Record the repository the files come from.")
@click.option("--revision", default=None, metavar="REV", help="Record the revision (a 40-hex commit names the "
                                                              "snapshot in a hub cache destination).")
@json_option
@click.pass_obj
def manifest(obj, directory, hub, revision):
    """Write DIRECTORY/deploy-manifest.json: every file with its size and sha256.

    For air-gapped sites: put the weights in a directory on the Proxmox host with this manifest, and name it in
    the playbook as `source: {path: DIRECTORY}` (model or speculative.drafter); deploy fetch copies it into the
    container and verifies every file against the manifest. Runs on this machine; nothing is sent anywhere.

    \b
    Example:
      deploy manifest /srv/models/Qwen3.6-27B --hub Qwen/Qwen3.6-27B --revision 0123456789abcdef0123456789abcdef01234567
    """
    def go():
        from .fetch import write_manifest
        from .report import dump_json

        if not os.path.isdir(directory):
            raise UsageError(f"{directory} is not a directory; nothing was written",
                             fix="give the directory that holds the model's files")
        res = write_manifest(directory, hub, revision)
        if obj.json:
            dump_json(res)
        else:
            click.echo(f"wrote {res['path']}: {res['files']} files, {res['bytes']} bytes")
        sys.exit(EXIT_OK)
    run_guarded(go, obj)


@main.command("apply-config", context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@json_option
@click.pass_obj
def apply_config(obj, playbook):
    """Install the playbook's pinned drafter config (only if its sha256 differs), read it back, verify it.

    A timestamped backup of the replaced file is kept beside it (config.json.bak-YYYYmmddTHHMMSSZ).

    \b
    Example:
      deploy apply-config qwen36-dflash
    """
    def go():
        from . import ops
        from .remote import Fleet

        from . import plan as P

        inv, pb = load(obj, playbook)
        if not pb.drafter or not P.drafter_config_path(pb):
            raise UsageError(f"{pb.name} has no drafter config to install (method {pb.spec['method']}); nothing was "
                             "run", where=pb.path,
                             fix=f"apply-config is for a playbook with a drafter (method dflash); deploy up {pb.name} "
                                 "brings this one up")
        if pb.is_fleet:  # each target's container, in parallel (one connection per host), a line per target
            import time

            from . import fleet as F

            t0 = time.monotonic()
            with Fleet(inv) as fleet:
                progress = F.SharedProgress(verbose=obj.verbose)
                outs = F.run_each(pb.members, lambda m: ops.apply_config(fleet, m, progress), None)
            _fleet_exit(obj, F.result(pb, "apply-config", outs, t0))
        with Fleet(inv) as fleet:
            out = ops.apply_config(fleet, pb, obj.progress())
        _outcome_exit(obj, out)
    run_guarded(go, obj)


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
        from .endpoint import playbook_endpoints

        inv, pb = load(obj, playbook)
        if where is not None and not pb.is_fleet and where != pb.where:
            raise UsageError(f"{pb.name} runs on {pb.where}, not {where}", fix=f"deploy endpoint {pb.name}")
        if where is not None and pb.is_fleet:
            pb.member(where)  # a UsageError naming the targets when it is not one
        if tunnel and pb.is_fleet and where is None:
            raise UsageError(f"{pb.name} has {len(pb.targets)} targets ({pb.where}): --tunnel needs one",
                             fix=f"deploy endpoint {pb.name} --tunnel --target {pb.targets[0]['host']}/"
                                 f"{pb.targets[0]['vmid']}")
        rows = playbook_endpoints(inv, pb)
        if where is not None:
            rows = [r for r in rows if r["where"] == where]
        if tunnel:
            sys.exit(_run_tunnel(obj, inv, pb, rows[0], local_port))
        if obj.json:
            from .report import dump_json
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


def _run_tunnel(obj, inv, pb, row, local_port) -> int:
    """deploy endpoint --tunnel: forward until Ctrl-C / SIGTERM (0) or the connection drops (3)."""
    import signal
    import socket
    import threading

    from .endpoint import Tunnel, curl_line
    from .errors import CheckFailed
    from .remote import AuditLog, HostSession

    if not row["url"]:
        raise CheckFailed(f"the address of {row['where']} is unknown, so there is nothing to tunnel to",
                          where=row["where"], fix=row.get("note") or f"deploy discover {row['host']} --write")
    host = inv.host(row["host"])
    if local_port is None:  # the served port when it is free here, else any
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", row["port"]))
                local_port = row["port"]
            except OSError:
                local_port = 0
    session = HostSession(host, AuditLog())
    conn = session.connect()
    transport = conn.transport
    remote = (row["address"], row["port"])
    try:  # can the host reach it at all? (one TCP connection from the host, closed at once)
        transport.open_channel("direct-tcpip", remote, ("127.0.0.1", 0), timeout=15).close()
    except Exception as e:  # noqa: BLE001 - paramiko's ChannelException and friends: said with the fix
        session.close()
        raise CheckFailed(f"{host.name} cannot connect to {remote[0]}:{remote[1]} ({e})", where=row["where"],
                          fix=f"is it serving? deploy status {pb.name}; is {remote[0]} the container's address? "
                              f"deploy discover {host.name}") from None
    tun = Tunnel(transport, remote, local_port,
                 on_event=lambda kind, what: click.echo(f"tunnel: {what}", err=True) if kind == "error" else None)
    try:
        port = tun.start()
    except OSError as e:
        session.close()
        raise UsageError(f"cannot listen on 127.0.0.1:{local_port}: {e.strerror or e}",
                         fix="pick another --local-port (0: any free one)") from None
    local = f"http://127.0.0.1:{port}/v1"
    via = f"{host.user}@{host.ssh_config_alias or host.address}:{host.port}"
    if obj.json:
        import json as _json
        click.echo(_json.dumps({"ok": True, "playbook": pb.name, "where": row["where"], "local_url": local,
                                "url": row["url"], "via": via, "curl": curl_line(local, row["model"],
                                                                                   row["api_key_env"])}), nl=True)
    else:
        click.echo(f"tunnel: {local} -> {remote[0]}:{remote[1]} ({pb.name} on {row['where']}) through {host.name} "
                   f"({via}); Ctrl-C closes it")
        click.echo(f"  {curl_line(local, row['model'], row['api_key_env'])}")
    sys.stdout.flush()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    code = EXIT_OK
    while not stop.wait(0.5):
        if not transport.is_active():
            click.echo(f"tunnel: the SSH connection to {host.name} ({via}) was lost; deploy endpoint {pb.name} "
                       "--tunnel opens a new one", err=True)
            code = EXIT_UNREACHABLE
            break
    tun.close()
    session.close()
    if code == EXIT_OK:
        click.echo(f"tunnel closed ({tun.connections} connection(s) carried)", err=True)
    return code


@main.group(context_settings=CONTEXT)
def monitor():
    """Watch the deployments with Prometheus and Grafana (see docs/monitoring.md)."""


def _duration(_ctx, param, value):
    from .monitor import duration

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
        from .locate import list_playbooks
        from .monitor import export
        from .spec import load_playbook

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
            from .report import dump_json
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
        from . import monitor_metrics as M

        inv = obj.inventory()
        from .status import resolve_targets

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
            from .report import dump_json
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
        from . import monitor_render as R

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
            from .report import dump_json
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
        from .status import run_status

        code = run_status(obj, targets, watch, deadline)
        # Everything is written and every connection closed: skip the interpreter's teardown of paramiko and
        # cryptography (~40 ms, a tenth of a status call). Daemon threads of timed-out hosts die with us.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    run_guarded(go, obj)


def _regex(_ctx, _param, value):
    """--grep is a Python regular expression, checked here: a bad one is a usage error before anything runs."""
    import re

    if value is not None:
        try:
            re.compile(value)
        except re.error as e:
            raise click.BadParameter(f"not a valid regular expression: {e} (escape literal characters, e.g. "
                                     "'\\(' for a parenthesis)")
    return value


def refuse_json(obj, command: str) -> None:
    if obj.json:
        raise UsageError(f"deploy {command} has no --json output", fix=f"run deploy {command} without --json")


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
        from .status import run_logs

        refuse_json(obj, "logs")
        sys.exit(run_logs(obj, target, lines, follow, grep, show_all))
    run_guarded(go, obj)


# ------------------------------------------------------------------ compare


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy compare qwen36-dflash qwen36-mtp -y
  deploy compare qwen36-dflash qwen36-mtp --rounds 5 --prompts my-prompts.txt -y
  deploy --json compare qwen36-dflash qwen36-mtp --keep qwen36-mtp -y
  deploy compare qwen36-dflash qwen36-mtp --concurrency 1,8,32 --plot sweep.png -y""")
@click.argument("playbook_a", shell_complete=complete_playbooks)
@click.argument("playbook_b", shell_complete=complete_playbooks)
@click.option("--prompts", "prompts_file", default=None, metavar="FILE",
              help="One prompt per line (default: PLAYBOOK_A's acceptance.probe.prompts).")
@click.option("--rounds", type=click.IntRange(1, 1000), default=None,
              help="Times each prompt is sent (default: PLAYBOOK_A's acceptance.probe.rounds).")
@click.option("--max-tokens", type=click.IntRange(1, 1_000_000), default=None,
              help="Output tokens per request (default: PLAYBOOK_A's acceptance.probe.max_tokens).")
@click.option("--keep", default=None, metavar="PLAYBOOK", help="Leave this one running (default: the winner).")
@click.option("--concurrency", "levels", default="1,4,16", show_default=True, metavar="N,N,...",
              callback=lambda _c, p, v: _levels(p, v), help="Concurrent requests per level of the sweep.")
@click.option("--plot", "plot_file", default=None, metavar="FILE",
              help="Also write the sweep as a chart (.png, .svg or .pdf; needs matplotlib: the [plot] extra).")
@click.option("-y", "--yes", is_flag=True, help="Replace what runs on the container without asking.")
@click.option("--wait-lock", type=float, default=0, metavar="SECONDS",
              help="Wait this long for another deploy's lock instead of failing at once.")
@json_option
@click.pass_obj
def compare(obj, playbook_a, playbook_b, prompts_file, rounds, max_tokens, keep, levels, plot_file, yes, wait_lock):
    """Which of two playbooks serves faster on one container: bring each up, time the same prompts, compare.

    Both playbooks must target the same host and container. Each is brought up with its own gates (its
    fallback is not used: the playbook itself is measured, or it failed), then a concurrency sweep runs (each
    level: that many clients streaming the prompts, every request timed): output tokens/s, TTFT and inter-token
    latency p50/p99 and the acceptance length per level, the winner per level, a terminal chart (and --plot a
    chart file). Draft acceptance and per-position acceptance over the whole sweep from /metrics deltas. The
    overall winner is the faster at the first level (`--keep` picks another); it is left running. Exit 0 when a
    winner was measured and left running.
    """
    def go():
        from . import compare as C
        from . import ops
        from .errors import UsageError
        from .remote import Fleet

        inv = obj.inventory()
        from .spec import load_playbook
        a, b = load_playbook(playbook_a, inv), load_playbook(playbook_b, inv)
        C.check_pair(a, b)
        if plot_file:
            C.check_plot(plot_file)
        if keep and keep not in (a.name, b.name):
            raise UsageError(f"--keep {keep} is neither {a.name} nor {b.name}", fix=f"--keep {a.name}")
        probe = a.data["acceptance"]["probe"]
        prompts = C.read_prompts(prompts_file) if prompts_file else list(probe["prompts"])
        rounds_ = rounds or probe["rounds"]
        if not yes and not _confirm(f"compare replaces whatever runs on {a.host}/{a.vmid} with {a.name}, then "
                                    f"{b.name}; continue?"):
            raise UsageError("not confirmed; nothing was changed",
                             fix=f"deploy compare {a.name} {b.name} -y (in scripts)")
        with Fleet(inv) as fleet:
            res = C.compare(fleet, a, b, obj.progress(), ops.Options(yes=True, wait_lock_s=wait_lock),
                            prompts=prompts, rounds=rounds_, max_tokens=max_tokens or probe["max_tokens"],
                            timeout_s=probe["timeout_s"] * 2, keep=keep, levels=levels)
        if plot_file and any(r.get("levels") for r in res["results"]):
            res["plot"] = C.plot(res, plot_file)
        if obj.json:
            from .report import dump_json
            dump_json(res)
        else:
            for line in C.render(res):
                click.echo(line)
            if res.get("plot"):
                click.echo(f"chart: {res['plot']}")
        sys.exit(EXIT_OK if res["ok"] else EXIT_FAILED)
    run_guarded(go, obj)


def _levels(param, value):
    try:
        levels = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= n <= 1024 for n in levels) or len(set(levels)) != len(levels):
        raise click.BadParameter(f"{value!r}: comma-separated distinct numbers of concurrent requests, 1..1024 "
                                 "(e.g. 1,4,16)", param=param)
    return sorted(levels)


# ------------------------------------------------------------------ discover


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy discover pve1                          # a host of the inventory: print what it has
  deploy discover root@10.1.2.5 --name pve1     # a host not in the inventory yet
  deploy discover pve1 --write                  # merge into the inventory (shows the diff, asks first)
  deploy discover pve1 --json""")
@click.argument("host", metavar="HOST")
@click.option("--write", is_flag=True, help="Merge into the inventory file: show the diff, ask, keep a backup.")
@click.option("-y", "--yes", is_flag=True, help="With --write: do not ask.")
@click.option("--name", default=None, metavar="NAME", help="Inventory name for a host given by address.")
@click.option("--user", default=None, metavar="USER", help="SSH user for an address (default root).")
@click.option("--identity-file", default=None, metavar="PATH", help="Private key for an address.")
@click.option("--known-hosts", default=None, metavar="PATH", help="known_hosts for an address "
              "(default ~/.ssh/known_hosts).")
@click.option("--accept-new-host-key", is_flag=True,
              help="For an address not in the inventory: trust and record a host key seen for the first time.")
@click.option("--timeout", type=float, default=60.0, show_default=True, metavar="S", help="Per-command deadline.")
@json_option
@click.pass_obj
def discover(obj, host, write, yes, name, user, identity_file, known_hosts, accept_new_host_key, timeout):
    """Read a Proxmox host as it is and print its inventory entry: every container (running or not), the GPUs
    passed into each (devN, lxc.mount.entry, cgroup `c 195:*` = every GPU; shared GPUs flagged), and for
    running containers their address and the vLLM runtimes inside (Python, vLLM and transformers versions).

    HOST is an inventory host name or [user@]address[:port]. One SSH connection, read-only: nothing is
    written on the host. Host keys follow the inventory's policy; an address not in the inventory refuses
    unknown keys unless --accept-new-host-key.
    """
    def go():
        from .discover import run_discover

        sys.exit(run_discover(obj, host, write=write, yes=yes, accept_new=accept_new_host_key,
                              identity_file=identity_file, known_hosts=known_hosts, user=user, name=name,
                              timeout=timeout))
    run_guarded(go, obj)


# ------------------------------------------------------------------ doctor


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy doctor pve1/129           # the vLLM someone started by hand there
  deploy doctor                    # every container with a vLLM runtime in the inventory
  deploy doctor pve1 --json""")
@click.argument("targets", nargs=-1, metavar="[HOST|HOST/VMID|PLAYBOOK]...", shell_complete=complete_targets)
@click.option("--budget", type=float, default=12.0, show_default=True, metavar="S",
              help="Time for the in-container examination (the `import vllm` check gets at most 8 s of it).")
@json_option
@click.pass_obj
def doctor(obj, targets, budget):
    """Read-only diagnosis of a vLLM that deploy did not start (or did): its processes (argv,
    --speculative-config, GPUs held, parent/child tree), the drafter config it read checked against the pinned
    configs of the playbooks and the target model's config, the vLLM build (version, the two DFlash fixes,
    compiled extensions), GPU holders, and draft acceptance from /metrics. Names each failure class of the
    field report it finds (guessed config, stale write, missing fix, incomplete build, leftover holder, low
    acceptance) with its cause and the deploy command that fixes it. Changes nothing.

    Exit: 0 nothing found, 1 something found, 3 some host unreachable.
    """
    def go():
        from .doctor import run_doctor

        sys.exit(run_doctor(obj, targets, budget))
    run_guarded(go, obj)


# ------------------------------------------------------------------ init, schema


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy init                    # hosts.yaml and playbooks/ in the current directory
  deploy init ~/pve && cd ~/pve  # or in a directory of their own
  deploy init --force            # replace files that differ (each kept as FILE.bak-<UTC time>-<random>)""")
@click.argument("directory", default=".", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace files that differ, keeping a backup of each.")
@json_option
@click.pass_obj
def init(obj, directory, force):
    """Write an inventory and the shipped playbooks into DIRECTORY (default: here) to edit.

    Writes DIRECTORY/hosts.yaml (an inert, commented example: uncomment and set your host) and
    DIRECTORY/playbooks/ (the playbooks, their pinned drafter configs and JSON Schemas for editors). `deploy`
    run in DIRECTORY then finds both (see `deploy --help` for the search order). Existing files that differ are
    left alone unless --force; identical ones are not rewritten.
    """
    def go():
        from .report import dump_json
        from .scaffold import init as do_init

        out = do_init(directory, force)
        if obj.json:
            dump_json({"ok": True, **out})
            return
        for f in out["written"]:
            click.echo(f"wrote {f}")
        for f in out["backups"]:
            click.echo(f"kept the previous file as {f}")
        if out["unchanged"]:
            click.echo(f"{len(out['unchanged'])} file(s) already as shipped, left alone")
        click.echo(f"next: edit {os.path.join(directory, 'hosts.yaml')} (uncomment the example, set address and "
                   f"key), then deploy plan qwen36-dflash")
    run_guarded(go, obj)


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy schema playbook > playbook.schema.json
  deploy schema inventory""")
@click.argument("kind", type=click.Choice(["playbook", "inventory"]))
@click.pass_obj
def schema(obj, kind):
    """Print the JSON Schema of a playbook or the inventory (generated from the validator's own schema).

    The shipped playbooks and `deploy init`'s files carry a `# yaml-language-server: $schema=...` first line
    that points editors (VS Code's YAML extension, neovim's yamlls) at playbooks/schemas/. The schema checks
    shapes, types, ranges and unknown keys; `deploy plan` adds the cross-checks (target in the inventory,
    pinned sha256) with FILE:LINE:COL.
    """
    from .scaffold import schema_text

    click.echo(schema_text(kind), nl=False)


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy docs                         # the pages shipped with deploy
  deploy docs quickstart
  deploy docs cli#status              # one section
  deploy docs troubleshooting | less""")
@click.argument("topic", required=False, metavar="[TOPIC[#SECTION]]")
@click.pass_obj
def docs(obj, topic):
    """Print a documentation page shipped with deploy (offline; the same pages as docs/ in the repository).

    Without TOPIC: the list of pages. TOPIC#SECTION prints one section (the anchor of its heading, as in the
    links of the pages and of deploy's messages: playbooks#requires).
    """
    def go():
        from .scaffold import docs_text

        refuse_json(obj, "docs")
        click.echo(docs_text(topic), nl=False)
    run_guarded(go, obj)


# ------------------------------------------------------------------ unlock


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("target", metavar="HOST/VMID|PLAYBOOK")
@click.option("-y", "--yes", is_flag=True, help="Break the lock without asking (for scripts).")
@json_option
@click.pass_obj
def unlock(obj, target, yes):
    """Show who holds a container's deploy lock, and break it after a confirmation.

    A running deploy renews its lock every 15 s; a lock that is not renewed expires within 60 s, and one held by
    a dead deploy process on this workstation is broken by the next deploy at once. Use unlock for the rest: a
    deploy on a lost laptop, when you cannot wait a minute. Breaking the lock of a deploy that still runs lets
    two deploys act on one container: check the holder first.

    \b
    Examples:
      deploy unlock pve1/129
      deploy unlock qwen36-dflash -y
    """
    def go():
        from . import ops
        from .remote import Fleet
        from .report import dump_json
        from .status import resolve_targets

        inv = obj.inventory()
        scope = resolve_targets(inv, [target])
        if len(scope) != 1:
            raise DeployError(f"{target} names {len(scope)} containers; unlock takes one", fix="deploy unlock HOST/VMID")
        host, vmid, rt = scope[0]

        def confirm(h):
            click.echo(f"{host}/{vmid} is locked by {ops.describe_holder(h)}" +
                       (f"; workstation {h.get('workstation')}, pid {h.get('pid')}" if h.get("workstation") else "") +
                       (" (a dead process on this workstation)" if h.get("dead_here") else ""), err=True)
            return yes or _confirm("Break this lock?")

        with Fleet(inv) as fleet:
            r = ops.unlock(fleet, host, vmid, rt, confirm, obj.progress())
        if obj.json:
            dump_json({"where": f"{host}/{vmid}", **r})
        elif r["state"] == "free":
            click.echo(f"{host}/{vmid}: no deploy lock is held.")
        elif r["state"] == "broken":
            click.echo(f"{host}/{vmid}: lock broken (it was held by {r['holder'].get('holder')}).")
        elif r["state"] == "kept":
            click.echo(f"{host}/{vmid}: not confirmed; the lock was left in place" +
                       ("" if sys.stdin.isatty() else " (pass -y in scripts)"), err=True)
        else:
            click.echo(f"{host}/{vmid}: the lock changed hands meanwhile; nothing was broken" +
                       (f" (now held by {r['now'].get('holder')})" if r.get("now") else ""), err=True)
        sys.exit(EXIT_OK if r["state"] in ("free", "broken") else EXIT_FAILED)
    run_guarded(go, obj)


# ------------------------------------------------------------------ test bed


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

if __name__ == "__main__":  # pragma: no cover
    main(prog_name="deploy")
