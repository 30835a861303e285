"""`deploy`: the container's software and weights: install-vllm, fetch, manifest, apply-config. Click commands only."""

from __future__ import annotations

import json
import os
import sys
import time

import click

from orchestrator.core.errors import EXIT_CODES_HELP, EXIT_OK, UsageError
from orchestrator.core.remote import Fleet
from orchestrator.cli.render import render_plans
from orchestrator.core.report import dump_json
from .base import (CONTEXT, _confirm, _fleet_exit, _outcome_exit, _outcomes_exit, complete_playbooks, json_option, load,
                   main, run_guarded)
# lazy, inside the commands, for start-up time (deploy --help, --version and status do not load what they
# do not run; all of it ~170 ms): ops, plan, fleet, fetch, install, agent


# ------------------------------------------------------------------ install-vllm


@main.command("install-vllm", context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("-y", "--yes", is_flag=True,
              help="Install even while the playbook is serving (the serving process is not touched).")
@click.option("--rollback", is_flag=True, help="Switch the runtime back to the vLLM it had before the last switch.")
@click.option("--force", is_flag=True, help="Install again even when requires.vllm is already the verified runtime.")
@click.option("--dry-run", is_flag=True, help="Print the plan and run nothing (same as deploy plan --op install-vllm).")
@json_option
@click.pass_obj
def install_vllm(obj, playbook, yes, rollback, force, dry_run):
    """Install the vLLM the playbook needs (requires.vllm) into its container, verified, without a gap.

    The install goes into a fresh venv next to the runtime (RUNTIME.versions/), with uv when the container has
    it, else pip; it runs detached from the SSH session (a dropped connection does not stop a long build: run
    the command again to re-attach and get the result). It is verified there (version, the DFlash fix markers,
    compiled extensions, an import in a subprocess, every file against the distribution's RECORD), and only then
    is the runtime venv switched to it: the previous vLLM stays usable until the new one is verified. Reaching
    requires.install.timeout_s is "build not finished", never success. A serving vLLM is not touched (asked
    first; -y to proceed): the next `deploy up`/`restart` starts the new build.

    The shipped qwen36-dflash names requires.vllm "0.34.0" (a release that serves its drafter); qwen36-mtp
    names none: add it to your copy (deploy init; deploy docs playbooks#requires). Without a package index
    (an air-gapped host): requires.install.find_links names a wheel directory in the container, with
    no_index: true (docs/playbooks.md#offline-and-air-gapped-hosts).

    \b
    Examples:
      deploy install-vllm qwen36-dflash --dry-run   # the plan: what is installed from where
      deploy install-vllm qwen36-dflash
      deploy install-vllm qwen36-dflash -y          # even while it serves (the serving process is not touched)
      deploy install-vllm qwen36-dflash --rollback
      deploy --json install-vllm qwen36-dflash
    """
    def go():
        from orchestrator.provision.vllm_install import refusal
        from orchestrator.deploy.ops import install_vllm as install
        from orchestrator.steps.plan import plan_install

        inv, pb = load(obj, playbook)
        refused = None if rollback else refusal(pb)
        if refused:
            raise refused
        if dry_run:
            return render_plans(obj.json, inv, pb, lambda m: plan_install(m, force=force, rollback=rollback))
        with Fleet(inv) as fleet:  # a playbook with targets: each target in turn (a build per container)
            outs = [install(fleet, m, obj.progress(), yes=yes, confirm=_confirm, force=force, rollback=rollback)
                    for m in pb.members]
        if not pb.is_fleet:
            _outcome_exit(obj, outs[0])
        _outcomes_exit(obj, outs)  # every outcome reported
    run_guarded(go, obj)


# ------------------------------------------------------------------ fetch, manifest


@main.command("fetch", context_settings=CONTEXT, epilog=EXIT_CODES_HELP)
@click.argument("playbook", shell_complete=complete_playbooks)
@click.option("--verify", "rehash", is_flag=True,
              help="Also re-hash every file already in place (sha256 / git blob id) instead of trusting the record.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=6 * 3600.0, show_default=True,
              metavar="SECONDS", help="The fetch's time limit (a partial download is kept: the next run resumes).")
@click.option("--connections", type=click.IntRange(1, 64), default=None, metavar="N",
              help="At most N connections at once (several files together, large files in byte ranges); default: "
                   "the playbook's fetch.connections (8). 1: one stream.")
@click.option("--manifest", "manifest_out", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="After the fetch, write the verified record of each item as a manifest (FILE, or FILE.ROLE.json "
                   "for several): copy it beside the files for source: {path: HOST_DIR}.")
@click.option("--dry-run", is_flag=True, help="Print the plan and run nothing (same as deploy plan --op fetch).")
@json_option
@click.pass_obj
def fetch(obj, playbook, rehash, timeout_s, connections, manifest_out, dry_run):
    """Fetch the playbook's model and drafter weights into its container, at the pinned revision, verified.

    The download runs in the container, detached from the SSH session: a dropped connection does not stop
    it, and running the command again re-attaches and reports. Several files come at once and large files in
    byte ranges over several connections (--connections); every range resumes where it stopped. It checks
    the space before it starts, prints bytes, rate and ETA per file and in total, and verifies every file
    against the hub's record (sha256 for LFS files, the git blob id for the others) before moving anything
    into place. Already fetched and verified: nothing to do. A `source: {path: HOST_DIR}` is copied from the
    Proxmox host instead and verified against its deploy-manifest.json.

    The shipped playbooks give paths only (the test bed's models are in place). The examples name
    my-hub-dflash: qwen36-dflash whose model and drafter name a source (model.hub + revision,
    speculative.drafter.hub + revision: docs/playbooks.md#fetch-weights-from-the-hub-or-a-host-directory).
    On the test bed, `deploy testbed hub pve1/129` serves a hub to that container and writes my-hub-dflash
    beside a copy of the shipped playbooks, in the directory it prints; with that, the examples run as written:

    \b
      deploy testbed hub pve1/129
      export DEPLOY_PLAYBOOKS=/tmp/vpd-testbed/playbooks   # $VPD_TESTBED_DIR/playbooks

    \b
    Examples:
      deploy fetch my-hub-dflash
      deploy fetch my-hub-dflash --timeout 7200     # the token: export the variable named in token_env first
      deploy fetch my-hub-dflash --connections 16   # a fast link behind a CDN that caps each connection
      deploy fetch my-hub-dflash --verify
      deploy fetch my-hub-dflash --manifest /tmp/qwen36.manifest.json
      deploy --json fetch my-hub-dflash
    """
    def go():
        from orchestrator.provision.weights_fetch import refusal
        from orchestrator.deploy.ops import fetch as do_fetch
        from orchestrator.steps.plan import plan_fetch

        inv, pb = load(obj, playbook)
        if dry_run:
            refused = refusal(pb)
            if refused:
                raise refused
            return render_plans(obj.json, inv, pb, lambda m: plan_fetch(m, rehash=rehash, connections=connections,
                                                                        timeout_s=timeout_s, manifest=bool(manifest_out)))
        with Fleet(inv) as fleet:
            outs = [do_fetch(fleet, m, obj.progress(), rehash=rehash, timeout_s=timeout_s, connections=connections,
                             manifest=(lambda recs, m=m: _write_fetch_manifests(m, manifest_out, recs))
                             if manifest_out else None) for m in pb.members]
        if len(outs) == 1:
            _outcome_exit(obj, outs[0])
        _outcomes_exit(obj, outs)
    run_guarded(go, obj)


def _write_fetch_manifests(pb, out_path, recs: dict):
    """--manifest FILE: from the records the fetch plan's step manifest-records read ({role: record})."""
    from orchestrator.provision.weights_fetch import manifest_from_record
    from orchestrator.steps.plan import fetch_args

    its = fetch_args(pb)
    for it in its:
        rec = recs.get(it["role"])
        if not rec:
            continue
        path = out_path if len(its) == 1 else f"{os.path.splitext(out_path)[0]}.{it['role']}.json"
        with open(path, "w") as fh:
            json.dump(manifest_from_record(rec), fh, indent=1)
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
        from orchestrator.provision.weights_fetch import write_manifest

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
        from orchestrator.deploy import ops

        inv, pb = load(obj, playbook)
        refusal = ops.apply_config_refusal(pb)
        if refusal is not None:
            raise refusal
        if pb.is_fleet:  # each target's container, in parallel (one connection per host), a line per target
            from orchestrator.serving import fleet as F

            t0 = time.monotonic()
            with Fleet(inv) as fleet:
                progress = F.SharedProgress(verbose=obj.verbose)
                outs = F.run_each(pb.members, lambda m: ops.apply_config(fleet, m, progress), None)
            _fleet_exit(obj, F.result(pb, "apply-config", outs, t0))
        with Fleet(inv) as fleet:
            out = ops.apply_config(fleet, pb, obj.progress())
        _outcome_exit(obj, out)
    run_guarded(go, obj)
