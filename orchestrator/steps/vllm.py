"""Launch vLLM, wait until it really serves, check the drafter taps, and gate on measured acceptance."""

from __future__ import annotations

import json
import re
import time

from orchestrator.core import gate as G
from orchestrator.core import vllm_facts as vf
from ..agent.protocol import AcceptanceResult, LaunchResult, PortResult, ReadyResult
from orchestrator.core import sizing as Z
from orchestrator.steps.plan import Step
from . import Context
from .gpu import one_line
from orchestrator.core.remote import shell_word

LOW_ACCEPTANCE_CAUSES = [
    "a guessed or stale drafter config (wrong target_layer_ids, mask_token_id or layer_types): run deploy verify",
    "the config write did not take effect (vLLM reads another file, e.g. a hub cache snapshot)",
    "a vLLM without the +1 layer-id fix (PR #40727) or without DFlash sliding-window support",
    "use_sliding_window false/absent: transformers drops the window silently",
]


def whole_object(line: str) -> str:
    """`SpeculativeConfig(...), tokenizer=...`: the phase's own object, whole up to its closing parenthesis (the rest
    of vLLM's engine-config line is in deploy logs); any other line as it is."""
    m = re.match(r"\w+\(", line)
    if not m:
        return line
    depth = 0
    for i, ch in enumerate(line):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return line[:i + 1]
    return line


def port_free(ctx: Context, step: Step) -> None:
    t0 = time.monotonic()
    r: PortResult = ctx.call(step)
    if r.listeners:
        who = {(p.get("pid"), p.get("comm"), p.get("cmdline")) for ln in r.listeners if isinstance(ln, dict)
               for p in ln.get("pids") or [] if isinstance(p, dict)}
        named = "; ".join(f"PID {pid} ({comm}: {one_line(cmd)})" for pid, comm, cmd in sorted(who, key=str)[:5])
        pids = [str(int(pid)) for pid, _, _ in sorted(who, key=str)[:5] if isinstance(pid, int)]
        ctx.fail(step.name, t0, f"port {step.args['port']} is already in use in the container by "
                                f"{named or f'{len(r.listeners)} listener(s) whose process this agent cannot see'}; "
                                "older vLLM binds with SO_REUSEPORT and would not even fail",
                 fix=(f"stop PID {', '.join(pids)} (pct exec {ctx.pb.vmid} -- kill {' '.join(pids)} on "
                      f"{ctx.pb.host}, if it is not needed), or set serve.port to a free port" if pids else
                      "stop what listens there, or set serve.port to a free port"), result=r)
    ctx.record(step.name, True, f"port {step.args['port']} free", t0)


def launch(ctx: Context, step: Step) -> LaunchResult:
    t0 = time.monotonic()
    r: LaunchResult = ctx.call(step, secrets={"env": ctx.secrets} if ctx.secrets else None)
    if not r.ok:
        if r.supervisor == "systemd":
            ctx.fail(step.name, t0, f"{r.unit}: {(r.message or 'launch failed')}",
                     fix=f"read the unit's journal in the container: pct exec {ctx.pb.vmid} -- journalctl -u "
                         f"{shell_word(r.unit)} -n 50 (deploy logs {ctx.pb.name})", result=r)
        ctx.fail(step.name, t0, (r.message or "launch failed"), fix="check runtime.vllm in the playbook")
    if r.supervisor == "systemd":
        ctx.record(step.name, True, f"vllm serve started as systemd unit {r.unit} (enabled: restarts on failure, "
                                    f"starts at boot): pid {r.pid}, log: journalctl -u {shell_word(r.unit)}", t0, result=r)
    else:
        ctx.record(step.name, True, f"vllm serve started: pid {r.pid}, log {r.log_path}; not supervised: "
                                    "a crash leaves it down (the container does not run systemd)", t0, result=r)
    return r


def onboot_check(ctx: Context, step: Step) -> None:
    """The unit starts when the container boots; the container starts with the host only with `onboot: 1`."""
    t0 = time.monotonic()
    try:
        res = ctx.session.run(step.host_argv, timeout=step.timeout)
    except Exception as e:  # noqa: BLE001 - a warning only; the deployment itself is not at stake
        ctx.record("onboot", None, f"could not read pct config {ctx.pb.vmid}: {e}", t0)
        return
    onboot = None
    for ln in res.out.splitlines():
        k, _, v = ln.partition(":")
        if k.strip() == "onboot":
            onboot = v.strip()
    if onboot == "1":
        ctx.record("onboot", True, "the container starts with the host (onboot: 1): vLLM comes back after a "
                                   "host reboot", t0)
    else:
        ctx.record("onboot", None, f"warning: container {ctx.pb.vmid} does not start with the host (pct config: "
                                   f"onboot {onboot or 'absent'}), so after a host reboot vLLM stays down until "
                                   f"someone starts the container; fix: pct set {ctx.pb.vmid} --onboot 1 on "
                                   f"{ctx.pb.host}", t0)


def wait_ready(ctx: Context, step: Step) -> ReadyResult:
    t0 = time.monotonic()
    phase_lines = []  # vLLM's own figures, held to the sizing model's prediction once it serves (issue 35)

    def on_event(e):
        if e.get("event") == "phase":
            phase_lines.append(str(e.get("line") or ""))
            ctx.progress.say(ctx.where, f"     {e['elapsed']:>6}s  {e['phase']:<22} {whole_object(e['line'])}")
        elif e.get("event") == "waiting":  # on change of the last log line, else every 10 s
            ctx.progress.waiting(ctx.where, "load " + e["line"],
                                 f"     {e['elapsed']:>6}s  still loading; last log line: {e['line']}")

    api_key = ctx.secrets.get("VLLM_API_KEY")
    r: ReadyResult = ctx.call(step, secrets={"api_key": api_key} if api_key else None, on_event=on_event)
    if r.ready:
        ctx.record(step.name, True, f"serving after {r.seconds}s: /v1/models lists {step.args['served_model_name']} "
                                    "and a completion succeeded", t0, result=r)
        r.sizing_check = _predicted_vs_reported(ctx, phase_lines)  # up --json: info.sizing
        return r
    reason = r.reason
    tail = "\n".join("    | " + ln for ln in (r.log_tail or [])[-8:])
    if reason == "fatal":
        msg = f"vLLM failed to start: {r.cause}\n    > {r.line}"
        fix = r.fix.replace("PLAYBOOK", ctx.pb.name)
        if r.cause == "GPU memory is held by someone else" and any(x.step == "gpus-free" and x.ok for x in ctx.results):
            # measured free just before this launch: freeing them again will not help (issue 26, item 7)
            fix = (f"gpus-free measured GPU(s) {','.join(map(str, ctx.pb.gpus))} free just before this launch, so "
                   "--clean-gpus will not help: something took GPU memory since, or gpu_memory_utilization asks for "
                   f"more than is free; see deploy status and deploy doctor {ctx.where} (on the test bed: a fault "
                   f"such as oom_at_startup is on; deploy testbed fault {ctx.where} --clear)")
    elif reason == "exited":
        ex = r.last_exit or {}
        if r.exit_code is not None:
            how = f"with code {r.exit_code}" + (" (exit 0 is not a clean stop: the engine crashed)"
                                                if r.exit_code == 0 else "")
        elif ex.get("code") in ("killed", "dumped"):
            how = f"killed by signal {ex.get('status')}"
        else:  # nothing recorded its status: a signal took it (or the wrapper that records it) down
            how = "(its exit status was not recorded: a signal ended it, or the wrapper that records it)"
        msg = (f"vLLM exited during startup {how}" +
               (f"; last log lines:\n{tail}" if tail else ""))
        fix = f"read the full log: deploy logs {ctx.pb.name}"
    elif reason == "timeout":
        msg = f"not serving after {r.seconds}s (serve.load_timeout_s); phases seen: {r.phases}" + \
              (f"; last log lines:\n{tail}" if tail else "")
        fix = "raise serve.load_timeout_s if loading is just slow, or read the log: deploy logs " + ctx.pb.name
    elif reason == "model_missing":
        msg = f"/v1/models does not list {step.args['served_model_name']!r} (it lists {r.models})"
        fix = "check serve.served_model_name"
    elif reason == "auth":
        msg = f"the server refused our API key ({r.status})"
        fix = "export the key in the variable named by serve.api_key_env"
    elif reason == "foreign_listener":
        msg = r.message
        fix = "find what else listens on that port in the container (ss -ltnp) and stop it, or set serve.port"
    elif reason == "no_state":
        msg = f"the state file written at launch is gone ({r.message}): something removed it"
        fix = f"deploy status {ctx.pb.name}, then deploy down/up"
    else:
        msg = f"not ready ({reason}): {json.dumps(r.as_dict())}"
        fix = "deploy logs " + ctx.pb.name
    ctx.fail(step.name, t0, msg, fix=fix, result=r)


def check_aux_layers(ctx: Context, ready: ReadyResult, verified, *, blocking: bool = True) -> None:
    """The taps in the startup log must be the pinned target_layer_ids + 1 (the +1 fix, PR #40727)."""
    if ctx.pb.conf.speculative.method != "dflash" or not ctx.pb.drafter_config:
        return
    t0 = time.monotonic()
    ids = (ctx.pb.drafter_config.get("dflash_config") or {}).get("target_layer_ids") or []
    want = vf.expected_aux_layers(ids, True)
    got = ready.aux_layers
    if got is None:
        ctx.record("aux-layers", None, "the log has no auxiliary-layers line to check", t0)
        return
    if got == want:
        ctx.record("aux-layers", True, f"vLLM taps {tuple(got)} as the drafter expects", t0)
        return
    disk = next((c.get("on_disk") for c in (verified.checks if verified is not None else [])
                 if c["check"] == "field dflash_config.target_layer_ids"), None)
    if got == ids:
        msg, fix = (f"vLLM taps target layers {tuple(got)}, expected {tuple(want)}: these are the raw ids, so this "
                    "vLLM lacks the +1 layer-id fix", "install a vLLM with the +1 layer-id fix (PR #40727, >= 0.22)")
    elif isinstance(disk, list) and got == vf.expected_aux_layers(disk, True):
        msg, fix = (f"vLLM taps {tuple(got)}: it loaded the config on disk (target_layer_ids {disk}), not the "
                    f"pinned one (expected taps {tuple(want)})", f"deploy apply-config {ctx.pb.name}")
    else:
        msg, fix = f"vLLM taps target layers {tuple(got)}, expected {tuple(want)}", "deploy verify " + ctx.pb.name
    if not blocking:
        ctx.record("aux-layers", None, msg + " (not blocking: --skip-config-write)", t0)
        return
    ctx.fail("aux-layers", t0, msg, fix=fix)


def acceptance(ctx: Context, step: Step) -> tuple[dict, str | None]:
    """Step `acceptance` (agent action acceptance): measure, then gate. -> (the numbers, None or why it fails)."""
    m = measure(ctx, step)
    return m, gate(ctx, step, m)


def measure(ctx: Context, step: Step) -> dict:
    """Probe (longer while the drafts are too few, up to max_rounds), compute acceptance from the metric deltas
    (or the log line), and return the numbers."""
    t0 = time.monotonic()
    api_key = ctx.secrets.get("VLLM_API_KEY")

    def on_event(e):
        if e.get("event") == "probe_extended":
            ctx.progress.say(ctx.where, f"     only {e['drafts']:g} drafts after {e['rounds']} round(s), fewer than "
                                        f"min_drafts {step.args.get('min_drafts')}: probing longer (up to "
                                        f"{step.args.get('max_rounds')} rounds)")

    r: AcceptanceResult = ctx.call(step, secrets={"api_key": api_key} if api_key else None, on_event=on_event)
    if not r.ok:
        ctx.fail(step.name, t0, f"could not measure acceptance: {r.message}", fix="deploy logs " + ctx.pb.name)
    if r.succeeded == 0:
        ctx.fail(step.name, t0, f"every probe request failed: {r.errors}", fix="deploy logs " + ctx.pb.name)
    acc = vf.acceptance_from_metrics(r.before, r.after)
    note = ""
    if acc is None or not acc.draft_tokens:
        acc = vf.acceptance_from_log(r.log_tail or [])
        note = "spec-decode counters missing from /metrics; used the SpecDecoding log line"
    if acc is None:
        ctx.fail(step.name, t0, "no acceptance numbers: neither spec-decode counters in /metrics nor a "
                                "SpecDecoding log line (is speculative decoding on?)",
                 fix="check the SpeculativeConfig line in deploy logs " + ctx.pb.name)
    rounds, planned = r.rounds or step.args.get("rounds"), step.args.get("rounds")
    extended = (f"probing {rounds} rounds instead of {planned} ({r.sent} requests)"
                if rounds and planned and rounds > planned else None)
    return {"acceptance": acc, "note": note, "extended": extended,
            "probe": {"sent": r.sent, "succeeded": r.succeeded, "errors": r.errors, "rounds": rounds,
                      "planned_rounds": planned}, "t0": t0}


def gate(ctx: Context, step: Step, m: dict) -> str | None:
    """Judge the numbers (orchestrator/core/gate.py) and record the acceptance step; return None when it passes, else
    the reason it failed in words (with the figures)."""
    th = step.judge["thresholds"]  # planned (plan.step_acceptance: gate.playbook_thresholds)
    v = G.judge(m["acceptance"], th, extended=m.get("extended"))
    m["verdict"] = v
    text = v.text() + (f" [{m['note']}]" if m["note"] else "") + (f" [{m['extended']}]" if m.get("extended") else "")
    ctx.record(step.name, v.passed, text, m["t0"], acceptance=m["acceptance"].as_dict(), probe=m["probe"],
               verdict=v.as_dict())
    return None if v.passed else f"the acceptance gate failed: {v.figures_text()}: {v.reason}"


def _predicted_vs_reported(ctx: Context, lines: list) -> dict | None:
    """With sizing.target_config: one progress line, the prediction against vLLM's logged weights and KV tokens,
    saying when it is off by more than the documented tolerance (the model is then wrong: ours)."""
    if getattr(ctx.pb, "target_config", None) is None:
        return None
    try:
        inp = Z.from_playbook(ctx.pb)
        c = Z.compare(Z.size(inp), Z.parse_reported(lines))
    except Exception as e:  # noqa: BLE001 - a report, never a reason to fail a deployment that serves
        ctx.progress.say(ctx.where, f"     sizing: no comparison ({type(e).__name__}: {e})")
        return None
    ctx.progress.say(ctx.where, "     " + Z.compare_line(c))
    return c
