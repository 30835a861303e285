"""`deploy`: the site and its tools: compare, discover, doctor, init, schema, docs, unlock, prepare. Click commands only."""

from __future__ import annotations

import os
import sys

import click

from orchestrator.core.errors import EXIT_CODES_HELP, EXIT_FAILED, EXIT_OK, DeployError, UsageError
from orchestrator.core.remote import Fleet
from orchestrator.cli.render import _echo_wrapped
from orchestrator.core.report import dump_json
from orchestrator.core.spec import list_playbooks, load_playbook, playbooks_targeting
from .base import CONTEXT, _confirm, complete_playbooks, complete_targets, json_option, main, refuse_json, run_guarded
# lazy, inside the commands, for start-up time (deploy --help, --version and status do not load what they
# do not run; all of it ~170 ms): ops, prepare, compare, discover, doctor, scaffold, status


# ------------------------------------------------------------------ compare


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy compare qwen36-dflash qwen36-mtp -y
  deploy compare qwen36-dflash qwen36-mtp --rounds 5 --prompts my-prompts.txt -y
  deploy --json compare qwen36-dflash qwen36-mtp --keep qwen36-mtp -y
  deploy compare qwen36-dflash qwen36-mtp --concurrency 1,8,32 --plot sweep.png -y
  deploy compare qwen36-dflash --baseline -y""")
@click.argument("playbook_a", shell_complete=complete_playbooks)
@click.argument("playbook_b", required=False, shell_complete=complete_playbooks)
@click.option("--baseline", is_flag=True,
              help="Compare PLAYBOOK_A with itself without speculative decoding (no --speculative-config).")
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
def compare(obj, playbook_a, playbook_b, baseline, prompts_file, rounds, max_tokens, keep, levels, plot_file, yes,
            wait_lock):
    """Which of two playbooks serves faster on one container: bring each up, time the same prompts, compare.

    Both playbooks must target the same host and container. Each is brought up with its own gates (its
    fallback is not used: the playbook itself is measured, or it failed), then a concurrency sweep runs (each
    level: that many clients streaming the prompts, every request timed): output tokens/s, TTFT and inter-token
    latency p50/p99 and the acceptance length per level, the winner per level, a terminal chart (and --plot a
    chart file). Draft acceptance and per-position acceptance over the whole sweep from /metrics deltas. The
    overall winner is the faster at the first level (`--keep` picks another); it is left running. Exit 0 when a
    winner was measured and left running. `--baseline` instead of PLAYBOOK_B: PLAYBOOK_A without speculative
    decoding (deploy tune's baseline), `--keep "NAME (no speculation)"` to keep it.
    """
    def go():
        from orchestrator.deploy import compare as C
        from orchestrator.deploy import ops

        inv = obj.inventory()
        if baseline == bool(playbook_b):
            raise UsageError("compare needs PLAYBOOK_B or --baseline (not both)",
                             fix=f"deploy compare {playbook_a} qwen36-mtp, or deploy compare {playbook_a} --baseline")
        a = load_playbook(playbook_a, inv)
        b = a.variant(off=True) if baseline else load_playbook(playbook_b, inv)  # off: as tune's baseline
        if not baseline:
            C.check_pair(a, b)
        if plot_file:
            C.check_plot(plot_file)
        if keep and keep not in (C.label(a), C.label(b)):
            raise UsageError(f"--keep {keep} is neither {C.label(a)} nor {C.label(b)}", fix=f"--keep {a.name}")
        probe = a.conf.acceptance.probe
        prompts = C.read_prompts(prompts_file) if prompts_file else list(probe.prompts)
        if not yes and not _confirm(f"compare replaces whatever runs on {a.host}/{a.vmid} with {a.name}, then "
                                    f"{C.label(b)}; continue?"):
            raise UsageError("not confirmed; nothing was changed",
                             fix=f"deploy compare {a.name} {b.name} -y (in scripts)")
        with Fleet(inv) as fleet:
            res = C.compare(fleet, a, b, obj.progress(), ops.Options(yes=True, wait_lock_s=wait_lock),
                            prompts=prompts, rounds=rounds or probe.rounds, max_tokens=max_tokens or probe.max_tokens,
                            timeout_s=probe.timeout_s * 2, keep=keep, levels=levels)
        _chart_and_exit(obj, res, C, plot_file if any(r.get("levels") for r in res["results"]) else None)
    run_guarded(go, obj)


def _chart_and_exit(obj, res: dict, mod, plot_file) -> None:
    """compare's and tune's ending: the chart file when asked (and there are levels), the result as JSON or as
    mod.render's lines, the exit code from res["ok"]."""
    if plot_file:
        res["plot"] = mod.plot(res, plot_file)
    if obj.json:
        dump_json(res)
    else:
        for line in mod.render(res):
            click.echo(line)
        if res.get("plot"):
            click.echo(f"chart: {res['plot']}")
    sys.exit(EXIT_OK if res["ok"] else EXIT_FAILED)


def _levels(param, value):
    try:
        levels = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= n <= 1024 for n in levels) or len(set(levels)) != len(levels):
        raise click.BadParameter(f"{value!r}: comma-separated distinct numbers of concurrent requests, 1..1024 "
                                 "(e.g. 1,4,16)", param=param)
    return sorted(levels)


# ------------------------------------------------------------------ tune


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP + """

\b
Examples:
  deploy tune qwen36-dflash -y
  deploy tune qwen36-dflash --concurrency 1,8,32 --max-launches 3 -y
  deploy tune qwen36-dflash --write -y
  deploy --json tune qwen36-dflash --plot tune.png -y""")
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--concurrency", "levels", default="1,4,16,64", show_default=True, metavar="N,N,...",
              callback=lambda _c, p, v: _levels(p, v),
              help="Concurrent requests per level (capped by what the sizing model fits at max_model_len).")
@click.option("--max-launches", type=click.IntRange(0, 16), default=2, show_default=True,
              help="Candidate values of k measured after the baseline and the largest k.")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE",
              help="One prompt per line (default: the playbook's acceptance.probe.prompts).")
@click.option("--rounds", type=click.IntRange(1, 1000), default=None,
              help="Times each prompt is sent per level (default: acceptance.probe.rounds).")
@click.option("--max-tokens", type=click.IntRange(1, 1_000_000), default=None,
              help="Output tokens per request (default: acceptance.probe.max_tokens).")
@click.option("--write", is_flag=True, help="Edit the playbook in place (comments kept, a backup beside it).")
@click.option("--plot", "plot_file", default=None, metavar="FILE",
              help="Also write tokens/s and ITL against concurrency as a chart (.png, .svg or .pdf).")
@click.option("-y", "--yes", is_flag=True, help="Replace what runs on the container without asking.")
@click.option("--wait-lock", type=float, default=0, metavar="SECONDS",
              help="Wait this long for another deploy's lock instead of failing at once.")
@json_option
@click.pass_obj
def tune(obj, playbook, levels, max_launches, prompts_file, rounds, max_tokens, write, plot_file, yes, wait_lock):
    """Is speculative decoding faster than none here, with which k, at which load? Measure it and say.

    On the playbook's container, one launch after the other (each a real `up` with its gate): the baseline
    without --speculative-config, then the largest k (its per-position acceptance predicts tokens/s for every
    smaller k), then the --max-launches candidates the prediction ranks best; each swept over the concurrency
    levels like `deploy compare`. Per level the fastest of {off, each k} with its margin; then the playbook change:
    a batch-size schedule (vLLM >= 0.27) with 0 where no speculation wins, else the k that wins at
    tune.expected_concurrency. Prints the diff; --write applies it (comments kept, a backup, the schema checked).
    The best configuration is left running. Exit 0 when it was measured and left running.
    """
    def go():
        from orchestrator.deploy import compare as C
        from orchestrator.deploy import ops
        from orchestrator.deploy import tune as T

        inv = obj.inventory()
        pb = load_playbook(playbook, inv)
        T.check_args(pb, max_launches)
        if plot_file:
            C.check_plot(plot_file)
        probe = pb.conf.acceptance.probe
        prompts = C.read_prompts(prompts_file) if prompts_file else list(probe.prompts)
        if not yes and not _confirm(f"tune replaces whatever runs on {pb.host}/{pb.vmid} with {pb.name} "
                                    f"without speculation, then with several values of k; continue?"):
            raise UsageError("not confirmed; nothing was changed", fix=f"deploy tune {pb.name} -y (in scripts)")
        with Fleet(inv) as fleet:
            res = T.tune(fleet, pb, obj.progress(), ops.Options(yes=True, wait_lock_s=wait_lock), prompts=prompts,
                         rounds=rounds or probe.rounds, max_tokens=max_tokens or probe.max_tokens,
                         timeout_s=probe.timeout_s * 2, levels=levels, max_launches=max_launches, write=write,
                         inventory=inv)
        _chart_and_exit(obj, res, T, plot_file if res.get("levels") else None)
    run_guarded(go, obj)


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
        from orchestrator.hosts.discover import run_discover

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
              help="Time for the in-container examination on a quiet machine (the `import vllm` check gets at "
                   "most 8 s of it); both grow with the load measured in the container, at most x3.")
@json_option
@click.pass_obj
def doctor(obj, targets, budget):
    """Read-only diagnosis of a vLLM that deploy did not start (or did): its processes (argv,
    --speculative-config, GPUs held, parent/child tree), the drafter config it read checked against the pinned
    configs of the playbooks and the target model's config, the vLLM build (version, the two DFlash fixes,
    compiled extensions), GPU holders, and draft acceptance from /metrics. Names each failure class of the
    field report it finds (guessed config, stale write, missing fix, incomplete build, an import that fails,
    leftover holder, low acceptance) with its cause and the deploy command that fixes it. Changes nothing.

    Exit: 0 nothing found, 1 something found, 3 some host unreachable.
    """
    def go():
        from orchestrator.hosts.doctor import run_doctor

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
        from orchestrator.deploy.scaffold import init as do_init

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
    from orchestrator.deploy.scaffold import schema_text

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
        from orchestrator.deploy.scaffold import docs_text

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
        from orchestrator.deploy import ops
        from orchestrator.observe.status import no_runtime, resolve_targets

        inv = obj.inventory()
        scope = resolve_targets(inv, [target])
        if len(scope) != 1:
            raise DeployError(f"{target} names {len(scope)} containers; unlock takes one", fix="deploy unlock HOST/VMID")
        host, vmid, rt = scope[0]
        if rt is None:  # no Python and no state directory known: a guessed one could answer "no lock" wrongly
            text, fix = no_runtime(host, vmid)
            raise UsageError(f"{text}: the state directory a deploy would lock it in is unknown",
                             where=f"{host}/{vmid}", fix=f"{fix}, or name the playbook: deploy unlock PLAYBOOK")

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


# ------------------------------------------------------------------ prepare


@main.command(context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("target", metavar="HOST/VMID", shell_complete=complete_targets)
@click.option("--gpus", metavar="LIST", help="GPU indices to pass in (0-3, 0,1); default: what the playbook that "
                                             "targets the container assigns, else the inventory's gpus for it.")
@click.option("--driver-run", metavar="HOST_PATH", help="The NVIDIA-Linux-x86_64-VERSION.run on the host (the one "
              "the host was installed with): its user space goes into the container (--no-kernel-module).")
@click.option("--style", type=click.Choice(["dev", "raw"]), default=None,
              help="devN: lines (pct set; Proxmox VE 8.1+) or raw lxc.mount.entry/cgroup lines (default: what the "
                   "config already uses, else what the host supports).")
@click.option("--create", is_flag=True, help="Make the container first (pct create; refused when VMID exists). "
              "Declare it in the inventory first: its vmid, name, gpus and address.")
@click.option("--template", metavar="VOLID", help="With --create: the template, STORAGE:vztmpl/FILE "
                                                  "(pveam list local).")
@click.option("--hostname", metavar="NAME", help="With --create (default: the container's name in the inventory).")
@click.option("--memory", type=click.IntRange(256, 1 << 22), metavar="MIB",
              help="With --create: memory in MiB (default 65536).")
@click.option("--cores", type=click.IntRange(1, 1024), help="With --create: CPU cores (default 16).")
@click.option("--storage", metavar="NAME", help="With --create: the root disk's storage (default local-lvm).")
@click.option("--rootfs-size", "rootfs_gb", type=click.IntRange(4, 1 << 16), metavar="GB",
              help="With --create: the root disk in GB (default 200: room for the weights).")
@click.option("--net0", metavar="SPEC", help="With --create: pct's net0 (default name=eth0,bridge=vmbr0 with "
              "ip=ADDRESS/24 from the inventory, or ip=dhcp when it gives none).")
@click.option("--privileged", is_flag=True, help="With --create: a privileged container (default: unprivileged).")
@click.option("--no-install", is_flag=True, help="Stop after the GPUs: no venv, install-vllm or fetch for the "
                                                 "playbooks that target the container.")
@click.option("--dry-run", is_flag=True, help="Print the plan (every host command) and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Restart the container without asking (for scripts).")
@json_option
@click.pass_obj
def prepare(obj, target, gpus, driver_run, style, create, template, hostname, memory, cores, storage, rootfs_gb,
            net0, privileged, no_install, dry_run, yes):
    """Make a container GPU-ready: device lines, a restart when confirmed, the host's driver in user space.

    Planned first and read back: a backup of /etc/pve/lxc/VMID.conf on the host, the missing lines added
    (never removed), `pct config` read again, a restart only when you confirm (a vLLM running there is named),
    the user-space driver from a .run you name, then the gpu-plumbing check and the container's nvidia-smi.
    With --create the container is made first (pct create, read back, started). Then, for each playbook
    that targets it: its runtime venv when missing, install-vllm (requires.vllm) and fetch (a weights
    source), so one command goes from a bare host to `deploy up`; --no-install stops after the GPUs.
    The host itself is only read (a missing /dev/nvidia-uvm is reported with its fix); another container's
    config is never touched. Exit 0: ready; 1: something is left (named); 2: refused, nothing changed.

    \b
    Examples:
      deploy prepare pve1/130 --gpus 0-3 --dry-run
      deploy prepare pve1/130 --gpus 0-3 -y
      deploy prepare pve1/129 --driver-run /root/NVIDIA-Linux-x86_64-550.54.15.run -y
      deploy prepare pve1/131 --create --template local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst \\
          --driver-run /root/NVIDIA-Linux-x86_64-550.54.15.run --dry-run
    """
    def go():
        from orchestrator.hosts import prepare as P
        from orchestrator.observe.status import resolve_targets

        inv = obj.inventory()
        if "/" not in target or not target.split("/", 1)[1].isdigit():
            raise UsageError(f"{target!r}: deploy prepare takes HOST/VMID (one container of the inventory)",
                             fix="deploy prepare pve1/129 --gpus 0-3 --dry-run")
        host, vmid, rt = resolve_targets(inv, [target])[0]
        mine = playbooks_targeting(host, vmid, inv)
        assigned = sorted({t.gpus for _, pb in mine for t in pb.targets if (t.host, t.vmid) == (host, vmid)})
        declared = inv.hosts[host].container(vmid)
        if gpus is None and not assigned and declared is not None and declared.gpus:
            want = list(declared.gpus)  # no playbook targets it yet: the GPUs the inventory gives it
        elif gpus is None:
            if len(assigned) != 1:
                raise UsageError(f"{target}: say which GPUs (--gpus): " +
                                 ("no playbook targets it" if not assigned else
                                  f"its playbooks assign different GPUs: {', '.join(map(str, assigned))}"),
                                 fix=f"deploy prepare {target} --gpus 0-3")
            want = list(assigned[0])
        else:
            want = P.parse_gpus(gpus)
            short = [(n, sorted(set(t.gpus) - set(want))) for n, pb in mine for t in pb.targets
                     if (t.host, t.vmid) == (host, vmid) and set(t.gpus) - set(want)]
            if short:
                raise UsageError(f"{target}: playbook {short[0][0]} runs there on GPUs that --gpus {gpus} leaves "
                                 f"out ({short[0][1]}); prepare adds lines and would leave that playbook short",
                                 fix=f"deploy prepare {target} (its playbook's GPUs), or change the playbook")
        others = []
        for name in list_playbooks():
            try:
                pb = load_playbook(name, inv)
            except Exception:  # noqa: BLE001 - a broken playbook elsewhere is not this command's business
                continue
            others += [(name, t.vmid, list(t.gpus)) for t in pb.targets if t.host == host and t.vmid != vmid]
        tps = {pb.conf.serve.tensor_parallel_size for _, pb in mine}
        create_opts = None
        given = {"--template": template, "--hostname": hostname, "--memory": memory, "--cores": cores,
                 "--storage": storage, "--rootfs-size": rootfs_gb, "--net0": net0,
                 "--privileged": privileged or None}
        if create:
            addr = declared.address if declared is not None else None
            create_opts = P.check_create({
                "template": template,
                "hostname": hostname or (declared.name if declared is not None else None) or f"ct{vmid}",
                "memory": memory, "cores": cores, "storage": storage, "rootfs_gb": rootfs_gb,
                "net0": net0 or "name=eth0,bridge=vmbr0,ip=" + (f"{addr}/24" if addr else "dhcp"),
                "unprivileged": not privileged}, vmid)
        elif any(v is not None for v in given.values()):
            flag = next(k for k, v in given.items() if v is not None)
            raise UsageError(f"{flag} is an option of --create (making a new container); {target} is prepared as "
                             "it is", fix=f"deploy prepare {target} --create {flag} ..., or leave {flag} out")
        chain = [] if no_install else [(name, m) for name, pb in mine for m in pb.members
                                       if m.host == host and m.vmid == vmid]
        # the shared model stores its playbooks read (fetch.store): a read-only mount point each
        stores = [(pb.conf.fetch.store, pb.conf.fetch.mount) for _, pb in mine if pb.conf.fetch.store]
        with Fleet(inv) as fleet:
            res = P.Prepare(fleet, inv, host, vmid, rt, want, driver_run=driver_run, style=style, yes=yes,
                            confirm=_confirm, progress=None if obj.json else obj.progress(),
                            tp=max(tps) if tps else 1, others=others, create=create_opts,
                            chain=chain, stores=stores).run(dry_run=dry_run)
        if obj.json:
            dump_json(res)
        else:
            _echo_wrapped(P.render(res))
        sys.exit(EXIT_OK if res["ok"] or res["dry_run"] and not res["findings"] else EXIT_FAILED)
    run_guarded(go, obj)
