"""The drafter config: installed from the pinned bytes, read back, verified the way vLLM loads it, watched for drift."""

from __future__ import annotations

import sys
import time

from orchestrator.core import vllm_facts as vf
from orchestrator.steps.plan import Step
from orchestrator.core.report import check_rows, sha, table, term_width
from . import Context


def write_config(ctx: Context, step: Step) -> dict:
    t0 = time.monotonic()
    r = ctx.call(step, payload=ctx.pb.drafter_bytes)
    path, d = step.args["path"], ctx.pb.conf.speculative.drafter
    if not r.ok:
        ctx.fail(step.name, t0, f"could not install the pinned drafter config at {path} ({r.stage}): "
                                f"{r.message}; the old file is untouched "
                                f"(sha256 {r.before_sha256 or 'none: no file yet'})",
                 fix={"directory": "create the drafter directory, or fix speculative.drafter.path",
                      "symlink": "use a plain local directory for speculative.drafter.path",
                      "write": "make the directory writable (read-only mount? full disk?) and run again",
                      "readback": "something rewrote the file while we wrote it; find the sync job",
                      "payload": "the pinned bytes were damaged in transfer; run again (check the SSH link)",
                      "read": "make the existing config.json readable by root in the container",
                      "snapshot": "download the drafter into the container's hub cache first (HF_HOME="
                                  f"{d and d.hf_home} huggingface-cli download {d and d.hub_id}), or use "
                                  "speculative.drafter.path"}.get(
                     r.stage, "check the container"), result=r)
    if r.snapshot is not None:
        what = "built" if r.changed else "already holds the pinned config:"
        ctx.record(step.name, True, f"{what} {r.dir}: config.json {r.after_sha256[:12]} (pinned) + "
                                    f"{len(r.links or [])} link(s) to {r.snapshot} (revision "
                                    f"{str(r.revision)[:12]}; the hub cache is untouched, its config.json is "
                                    f"{sha(r.snapshot_config_sha256, 'unreadable')})", t0, result=r)
    elif r.changed:
        ctx.record(step.name, True, f"wrote {path} (was {sha(r.before_sha256, 'absent')}, now "
                                    f"{r.after_sha256[:12]}, read back); backup {r.backup or '-'}",
                   t0, result=r)
    else:
        ctx.record(step.name, True, f"{path} already has the pinned bytes (sha256 {r.after_sha256[:12]}); "
                                    "not rewritten", t0, result=r)
    return r


def failing(checks: list[dict]) -> list[dict]:
    return [c for c in checks if not c["ok"] and c.get("severity", "error") == "error"]


def verify(ctx: Context, step: Step, *, record: bool = True, blocking: bool = True,
           written_sha: str | None = None) -> dict:
    t0 = time.monotonic()
    r = ctx.call(step)
    now = next((x for x in (r.sha256, r.sha256_after) if x and x != written_sha), None)
    if written_sha and now:
        ctx.fail(step.name, t0, f"the drafter config changed behind our back between the write and verify: "
                                f"{(r.location or {}).get('path')} was read back as {written_sha} and is now "
                                f"{now}", fix=f"find what rewrites it (a sync job, a download) and stop it; then "
                                             f"deploy up {ctx.pb.name} again", result=r)
    bad = r.failed = failing(r.checks or [])
    if record:
        stack = r.stack or {}
        sfx = (f"vLLM {stack.get('version')}"
               + (f", transformers {r.transformers_version}" if r.transformers_version else "")
               + f", {len((r.checks or []))} checks")
        if bad and not blocking:
            ctx.record(step.name, None, f"{len(bad)} check(s) failed, NOT blocking (--skip-config-write): "
                                        + ", ".join(c["check"] for c in bad), t0, result=r)
            for line in render_failures(bad).splitlines():
                ctx.progress.say(ctx.where, "     " + line)
            return r
        if bad:
            ctx.fail(step.name, t0, f"{len(bad)} check(s) failed ({sfx}):\n" + render_failures(bad),
                     fix=verify_fix(bad, ctx.pb, r.stack), result=r)
        what = "serving stack can run this method" if step.args.get("stack_only") else \
            "drafter config correct on disk and as loaded"
        ctx.record(step.name, True, f"{what}; {sfx}", t0, result=r)
    return r


def render_failures(bad: list[dict]) -> str:
    return table(check_rows(bad), ["check", "expected", "on disk", "as loaded", "verdict", "reason"],
                 width=term_width(sys.stderr))


def verify_fix(bad: list[dict], pb, stack: dict | None = None) -> str:
    """One fix per class of failed check, each naming the command or edit that addresses that failure."""
    name = pb.name
    py = pb.conf.runtime.python
    ver = (stack or {}).get("version")
    minv = pb.conf.requires.vllm_min_version
    fixes: list[str] = []

    def add(f):
        if f not in fixes:
            fixes.append(f)

    stale = any(c["check"] == "sha256" for c in bad)  # the file is not the pinned one: its content is no news
    for c in bad:
        n = c["check"]
        if stale and not n.startswith(("vllm", "fix: ", "spec key ", "speculative", "path", "weights")):
            n = "sha256"
        if n == "vllm installed":
            add(f"install vLLM into the container's Python: {py} -m pip install 'vllm>={minv or '0.26.0'}' "
                "(or set runtime.python to the Python that has vLLM)")
        elif n in ("vllm import", "vllm extensions"):
            pin = f"=={ver}" if ver else ""
            add(f"the installed vLLM {ver or ''} build is incomplete: reinstall it, {py} -m pip install "
                f"--force-reinstall --no-deps 'vllm{pin}' (a source build: rebuild with its compiled extensions)")
        elif n == "vllm files (RECORD)":
            pin = f"=={ver}" if ver else ""
            add(f"the installed vLLM differs from what its installer wrote (a partial or altered install): "
                f"deploy install-vllm {name} --force installs requires.vllm afresh into a new venv, or {py} -m pip "
                f"install --force-reinstall --no-deps 'vllm{pin}'")
        elif n == "vllm version":
            add(f"upgrade vLLM: {py} -m pip install 'vllm>={minv}', then deploy verify {name}")
        elif n.startswith("fix: "):
            add(f"install a vLLM that has this fix: {py} -m pip install 'vllm>=0.26.0' (or the PR #40898 build), "
                f"then deploy verify {name}")
        elif n == "speculative-config keys":
            keys = [k for k in (c.get("on_disk") or []) if isinstance(k, str)] if isinstance(c.get("on_disk"), list) else []
            gone = [f"{k} was removed in vLLM {vf.SPEC_KEYS_REMOVED[k]}" for k in keys if k in vf.SPEC_KEYS_REMOVED]
            add(f"remove {', '.join(keys) or 'the key(s)'} from speculative.extra in {pb.path}"
                + (f" ({'; '.join(gone)})" if gone else "") + ", or install a vLLM whose SpeculativeConfig has "
                "them; then deploy verify " + name)
        elif n.startswith("speculative shortcut "):
            add(f"remove {n[len('speculative shortcut '):]} from serve.extra_args in {pb.path}: the playbook's "
                "speculative keys already set it through --speculative-config")
        elif n == "fix: DFlash sliding window" and "Model Runner V1" in (c.get("reason") or ""):
            add("serve this drafter on a GPU vLLM >= 0.26.0 (Model Runner V2), or use a drafter without mixed "
                "sliding/full layers (e.g. the MTP fallback) on this platform")
        elif n == "fix: DFlash sliding window" and "VLLM_USE_V2_MODEL_RUNNER" in (c.get("reason") or ""):
            add(f"remove VLLM_USE_V2_MODEL_RUNNER from serve.env in {pb.path}")
        elif n.startswith("spec key "):
            add(f"upgrade vLLM ({py} -m pip install 'vllm{c.get('expected', '').replace(' ', '')}'), or remove "
                f"{n[len('spec key '):]} from speculative.extra in {pb.path}")
        elif n in ("sha256", "unchanged during verify") or n.startswith(("field ", "fields", "json", "loaded ")):
            add(f"deploy up {name} installs the pinned config (or deploy apply-config {name})")
        elif n == "path":
            add(f"check speculative.drafter.path in {pb.path}: the directory must exist in the container")
        elif n.startswith("weights"):
            add("the drafter weights do not match this config: download the drafter that goes with the pinned "
                "config into speculative.drafter.path")
        else:
            add(f"correct the pinned config {getattr(pb.conf.speculative.drafter, 'pinned_config', '')} (and its "
                f"sha256 in {pb.path}), then deploy verify {name}")
    return "; ".join(fixes) or f"deploy verify {name}"


def drift(ctx: Context, step: Step, launched_sha: str | None) -> dict:
    """The file must still be what was there at launch (normally the pinned bytes)."""
    t0 = time.monotonic()
    r = ctx.call(step)
    want = launched_sha or ctx.pb.conf.speculative.drafter.sha256
    if r.sha256 != want:
        ctx.fail(step.name, t0, f"the drafter config changed behind our back while vLLM started: "
                                f"{step.args['path']} now has sha256 {r.sha256 or r.error}, "
                                f"it had {want} when verified (pinned {ctx.pb.conf.speculative.drafter.sha256})",
                 fix=f"find what rewrites {step.args['path']} (a sync job, a download) and stop it; then deploy up "
                     f"{ctx.pb.name} again", result=r)
    note = "" if want == ctx.pb.conf.speculative.drafter.sha256 else " (NOT the pinned config: --skip-config-write)"
    ctx.record(step.name, True, f"unchanged since verify (sha256 {want[:12]}){note}", t0)
    return r
