"""Execute plans: `up`, `restart`, `down`, `verify`, `apply-config`. Each runs the Steps that plan.py built."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from orchestrator.steps import plan as P
from orchestrator.core.errors import (DeployError, Interrupted, LockHeld, StepFailed, Unreachable,  # noqa: F401 (LockHeld: re-exported)
                     UsageError)
from orchestrator.core.gate import Verdict, gate_figures
from orchestrator.agent.protocol import CurrentResult, GpusFreeResult, ReadyResult, StopResult, VerifyResult, WriteFileResult
from orchestrator.core.remote import Fleet, shell_word
from orchestrator.core.report import Progress, sha
from orchestrator.core.spec import Playbook, Runtime
from orchestrator.provision import weights_fetch as F
from orchestrator.provision import vllm_install as I
from orchestrator.core.endpoint import server_endpoint
from orchestrator.core.sizing import measured_refusal
from orchestrator.steps import (Context, Outcome, StepResult, bare_context, check_container, holder_id, new_context,  # noqa: F401 (re-exported)
                    secrets_for)
from orchestrator.steps import drafter as D
from orchestrator.steps import gpu as G
from orchestrator.steps import plumbing as GP
from orchestrator.steps import vllm as V


@dataclass
class Options:
    yes: bool = False
    write_config: bool = True
    clean_gpus: bool | None = None
    wait_lock_s: float = 0.0
    confirm: object = None  # callable(prompt) -> bool, for the diff-before-restart question
    yes_kill: bool | None = None  # kill GPU holders deploy did not start without asking (-y); None: as `yes`
    fetch: bool = True  # step fetch may download what is missing (up --no-fetch: refuse instead)

    @property
    def kill_confirmed(self) -> bool:
        return self.yes if self.yes_kill is None else self.yes_kill

    def ask_before_kill(self, pb) -> bool:
        """One rule for up, restart and down: fuser -k (--clean-gpus or gpu.clean_gpus) asks first unless -y."""
        clean = pb.conf.gpu.clean_gpus if self.clean_gpus is None else self.clean_gpus
        return bool(clean) and not self.kill_confirmed


def holder_fields() -> dict:
    """Who holds a lock, precisely enough for another deploy on this workstation to prove the holder dead."""
    return {"workstation": socket.gethostname(), "pid": os.getpid(), "pid_start": _proc_start(os.getpid())}


def _proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None  # no /proc (macOS): the pid alone decides


def holder_dead(h: dict) -> bool:
    """Is this lock's holder a deploy process on THIS workstation that no longer exists?"""
    pid = h.get("pid")
    if h.get("workstation") != socket.gethostname() or not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, under another user
    return h.get("pid_start") is not None and _proc_start(pid) not in (None, h["pid_start"])


def describe_holder(h: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
    return (f"{h.get('holder')} ({h.get('operation')}) since {since}, lease until "
            f"{time.strftime('%H:%M:%S', time.localtime(h.get('expires', 0)))} unless renewed")


class Heartbeat:
    """Renews the container lock every term/4 while a deploy runs, on its own channel of the same connection.
    If the deploy dies (even by SIGKILL), renewals stop and the lock goes stale within one term."""

    def __init__(self, ctx: Context, step: P.Step):
        self.ctx, self.step = ctx, step
        self.interval = float(step.args.get("term_s", P.LOCK_TERM_S)) / 4
        self._stop = threading.Event()
        self.lost = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="lock-heartbeat")

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self):
        renew = dataclasses.replace(self.step, args=dict(self.step.args, renew=True, wait_s=0), timeout=30)
        while not self._stop.wait(self.interval):
            try:
                r = self.ctx.call(renew, fresh=True, beat=False)  # beside the long step the session is busy with
            except Exception:  # noqa: BLE001 - a missed beat is retried; the lease term absorbs a few
                continue
            if not r.locked:
                self.lost = r.holder
                self.ctx.progress.say(self.ctx.where, "     WARNING: the container lock was lost" +
                                      (f" to {describe_holder(self.lost)}" if self.lost else ""))
                return

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=35)


def take_lock(ctx: Context, step: P.Step, wait_s: float) -> Heartbeat:
    t0 = time.monotonic()
    step.args = dict(step.args, wait_s=wait_s, **holder_fields())
    step.timeout = max(step.timeout, wait_s + 30)
    say = lambda e: ctx.progress.say(ctx.where, "     " + e.get("message", ""))  # noqa: E731
    r = ctx.call(step, on_event=say)
    h = r.holder or {}
    if not r.locked and h and holder_dead(h):
        ctx.progress.say(ctx.where, f"     the lock's holder ({h.get('holder')}) is a dead process on this "
                                    "workstation: breaking its lock")
        # the other holder's token goes on stdin, not in argv (which the audit log and `ps` show)
        r = ctx.call(step, secrets={"break_token": h.get("token")}, on_event=say)
        h = r.holder or {}
    if not r.locked:
        if r.error:
            ctx.fail(step.name, t0, r.error, fix="make the state directory root-owned and not writable by others")
        ctx.record(step.name, False, f"held by {h.get('holder')}", t0)
        raise LockHeld(f"another deploy holds the lock: {describe_holder(h)}", where=ctx.where,
                       fix=f"wait for it to finish, or pass --wait-lock SECONDS; if that deploy is gone, its lock "
                           f"expires within {P.LOCK_TERM_S:g} s, or break it now: deploy unlock {ctx.where}")
    ctx.record(step.name, True, "lock taken", t0)
    return Heartbeat(ctx, step).start()


def release_lock(ctx: Context, step: P.Step, beat: Heartbeat | None = None) -> None:
    if beat is not None:
        beat.stop()
    try:
        r = ctx.call(step)
    except DeployError:
        return
    if not r.unlocked and not r.error and (beat is None or beat.lost is None):
        # the heartbeat (every 15 s) did not see it: the lock was broken (deploy unlock) or taken meanwhile
        h = r.holder
        ctx.progress.say(ctx.where, "     WARNING: the container lock was lost before this run ended" +
                         (f" (now held by {describe_holder(h)})" if h else " (broken: deploy unlock?)") +
                         "; another deploy may have acted on this container meanwhile: check deploy status "
                         f"{ctx.where} before trusting this run's result")


def diff_running(cur: CurrentResult, pb: Playbook) -> list[str]:
    """What differs between the running deployment (state file) and this playbook."""
    st = cur.state or {}
    diffs = []
    want_argv = P.serve_argv(pb)
    if st.get("argv") != want_argv:
        have = st.get("argv")
        diffs.append("argv:\n      running: " + (" ".join(have) if have else "(not recorded in the state file)")
                     + "\n      wanted:  " + " ".join(want_argv))
    if st.get("argv0_real") and cur.argv0_real_now and st["argv0_real"] != cur.argv0_real_now:
        diffs.append(f"vLLM runtime: running from {st['argv0_real']}, {st['argv'][0]} is now "
                     f"{cur.argv0_real_now} (deploy install-vllm switched it)")
    if st.get("playbook") != pb.name:
        diffs.append(f"playbook: running {st.get('playbook') or '(not recorded)'}, wanted {pb.name}")
    elif st.get("playbook_sha256") != pb.sha256:
        diffs.append(f"playbook file changed: {sha(st.get('playbook_sha256'), '(not recorded)')} -> {sha(pb.sha256)}")
    d = pb.conf.speculative.drafter
    want_d = d.sha256 if d and not pb.spec_off else None
    if want_d and cur.drafter_sha256 != want_d:
        have = cur.drafter_sha256
        if have:
            diffs.append(f"drafter config on disk {sha(have)}, pinned {sha(want_d)}")
        elif cur.drafter_error:
            diffs.append(f"drafter config unreadable ({cur.drafter_error}), pinned {sha(want_d)}")
        else:
            diffs.append(f"drafter config: the running deployment has none, this playbook pins {sha(want_d)}")
    return diffs


# ------------------------------------------------------------------ the executor: one loop over the planned steps


@dataclass
class Run:
    """One execution of a plan: the run state the `when` predicates read, plus what the runners hand on."""
    ctx: Context
    fleet: Fleet
    opts: Options
    out: Outcome
    st: P.RunState
    t_start: float
    beat: Heartbeat | None = None
    cur: CurrentResult | None = None
    written: WriteFileResult | None = None  # what drafter-config wrote
    read_back: dict = field(default_factory=dict)  # the config read again after a failure: now, or now_error
    verified: dict | None = None
    ready: ReadyResult | None = None
    launch_result: dict | None = None  # LaunchResult: the supervisor (systemd unit or none)
    stop_report: dict | None = None
    free: dict | None = None
    fetched: dict | None = None  # what the step fetch found or fetched: {status, records, items}
    error: DeployError | None = None
    guarded: bool = False  # the plan takes the container lock: a failure says what state it left
    holder: dict | None = None  # deploy unlock: the lock's holder as read (its token included: never shown)


def new_run(fleet: Fleet, pb: Playbook, progress: Progress, opts: Options, *, token: str | None = None,
            st: P.RunState | None = None) -> Run:
    """A run of a plan for PB: its context (the host's session), a failed Outcome until a runner says otherwise."""
    ctx = new_context(fleet, pb, progress, token)
    return Run(ctx, fleet, opts, Outcome(False, pb.name, ctx.where, "failed", ctx.results), st or P.RunState(),
               time.monotonic())


def execute(run: Run, steps: list[P.Step]) -> Outcome:
    """Run the plan: the main phase in order (a failing `when` skips a step; a runner may end the phase early),
    then the on-low-acceptance phase when the gate failed, the on-failure phase when a step failed, and the
    finally phase whatever happened. The plan is the only input: nothing here decides what runs."""
    ctx, st = run.ctx, run.st
    phase = lambda name: [s for s in steps if s.phase == name]  # noqa: E731
    st.can_fall_back = bool(phase("on-low-acceptance"))
    run.guarded = any(s.name == "lock" for s in steps)
    try:
        try:
            for step in phase("main"):
                if st.finished or st.ungated:
                    break
                _run_step(run, step)
            for step in phase("gate-running") + phase("on-low-acceptance"):
                if st.finished:
                    break
                _run_step(run, step)
        except DeployError as e:
            run.error = run.out.error = e
            st.failed_step = getattr(e, "step", None) or "?"
            st.unreachable = isinstance(e, Unreachable)
            if not isinstance(e, LockHeld):
                for step in phase("on-failure"):
                    try:
                        _run_step(run, step)
                    except DeployError:
                        pass  # clean-up is best effort; what it could not do shows in `state left:`
            _finish_failure(run)
        except KeyboardInterrupt:
            run.out.status = "interrupted"
            if st.launched:
                msg = ("interrupted: vLLM was launched and is recorded in the container's state file; it keeps "
                       f"loading. deploy status {ctx.pb.name} shows it, deploy down {ctx.pb.name} stops it")
            else:
                msg = "interrupted before launch: nothing was started"
            run.out.error = run.error = Interrupted("interrupted", msg, where=ctx.where,
                                                    state_left=interrupted_state_left(run))
    finally:
        for step in phase("finally"):
            _run_step(run, step)
    return run.out


def _run_step(run: Run, step: P.Step) -> None:
    if step.when is not None and not step.when(run.st):
        run.ctx.progress.detail(run.ctx.where, f"skip {step.name}: not ({P.describe_when(step.when)})")
        return
    if run.ctx.progress.verbose and step.runs:
        for line in step.runs:
            run.ctx.progress.detail(run.ctx.where, f"{step.name}: {line}")
    RUNNERS[step.name](run, step)


def _finish_failure(run: Run) -> None:
    e, st = run.error, run.st
    if st.launched and isinstance(e, Unreachable):
        e.fix = (e.fix + "; " if e.fix else "") + ("vLLM was launched and is recorded in the state file in "
                                                   "the container: deploy status shows it, deploy down stops it")
    if isinstance(e, StepFailed) and not e.state_left and not isinstance(e, LockHeld) and not st.unreachable \
            and run.guarded:
        e.state_left = state_left_text(run)


def up(fleet: Fleet, pb: Playbook, progress: Progress, opts: Options, *, restart: bool = False,
       token: str | None = None) -> Outcome:
    steps = P.plan_up(pb, write_config=opts.write_config, clean_gpus=opts.clean_gpus, restart=restart,
                      ask=opts.ask_before_kill(pb), fetch=opts.fetch)
    return execute(new_run(fleet, pb, progress, opts, token=token, st=P.RunState(restart=restart)), steps)


# ------------------------------------------------------------------ runners: one per step name (RUNNERS)


def r_container(run: Run, step: P.Step) -> None:
    check_container(run.ctx, step)


def r_lock(run: Run, step: P.Step) -> None:
    run.beat = take_lock(run.ctx, step, run.opts.wait_lock_s)
    run.st.locked = True


def r_unlock(run: Run, step: P.Step) -> None:
    release_lock(run.ctx, step, run.beat)
    run.st.locked = False


def r_current(run: Run, step: P.Step) -> None:
    ctx, st, pb, opts = run.ctx, run.st, run.ctx.pb, run.opts
    t0 = time.monotonic()
    key = ctx.secrets.get("VLLM_API_KEY")
    cur: CurrentResult = ctx.call(step, secrets={"api_key": key} if key else None)
    run.cur = cur
    mem = cur.memory if isinstance(cur.memory, dict) else {}
    if mem.get("error") == "timeout":  # the probe did not answer: fail now, naming it (never an ok unlooked)
        ctx.fail("current", t0, f"`{P.NVIDIA_SMI_QUERY}` in container {pb.vmid} {mem.get('message')}: what holds "
                                "the GPUs cannot be read; nothing was stopped",
                 fix=f"the NVIDIA driver may be wedged: run nvidia-smi on {pb.host} itself (a hung one needs the "
                     "driver reloaded or the host rebooted); gpu.nvidia_smi_timeout_s in the playbook sets the bound",
                 state_left="unchanged: nothing was stopped or started")
    s = cur.state or {}
    running = st.running = bool(s.get("alive"))
    st.foreign_vllm = bool(cur.vllm_processes)
    diffs = diff_running(cur, pb) if running else []
    healthy = running and cur.health == 200 and pb.conf.serve.served_model_name in (cur.models or [])
    if running and not diffs and healthy and not st.restart:
        g = cur.gate or {}
        v = g.get("verdict") or {}
        if g.get("for_current_launch") and v.get("passed"):
            ctx.record("current", True, f"already up: pid {s.get('pid')}, same argv and drafter sha256, healthy; "
                                        f"passed the acceptance gate at {_when(g.get('at'))} "
                                        f"({gate_figures(v)})", t0, gate=g)
            run.out.ok, run.out.status = True, "already up"
            run.out.info = {**_ep(server_endpoint(run.fleet.inventory, pb)), "pid": s.get("pid"), "gate": g}
            st.finished = "already up"
            return
        # the same deployment serves, but its launch never passed the gate (an up interrupted before the gate, a
        # killed deploy, an older deploy): it is not "already up" until it is measured; this run owns it now
        why = (f"it failed the gate at {_when(g.get('at'))}: {v.get('reason')}" if g.get("for_current_launch")
               else f"no gate verdict for this launch (started {_when(s.get('started_at'))}): an up interrupted "
                    "before the gate?")
        ctx.record("current", True, f"runs healthy with the same argv and drafter sha256 (pid {s.get('pid')}), but "
                                    f"{why}; measuring and gating it now", t0, gate=g or None)
        st.ungated = st.launched = True
        return
    if running and diffs and not st.restart:
        ctx.record("current", True, f"running {s.get('playbook')} (pid {s.get('pid')}) differs:", t0, diffs=diffs)
        for d in diffs:
            ctx.progress.say(ctx.where, "     " + d)
        if not opts.yes and not (opts.confirm and opts.confirm("Restart it with this playbook?")):
            raise StepFailed("current", "a different deployment is running; not replacing it without -y",
                             where=ctx.where, fix=f"deploy up {pb.name} -y to replace it",
                             state_left="unchanged: the running deployment was left as it was")
    elif running:
        ctx.record("current", True, f"running {s.get('playbook')} (pid {s.get('pid')}, "
                                    f"health {cur.health}); will restart it", t0)
    else:
        ctx.record("current", True, "nothing of ours is running" +
                   (f" ({len(cur.vllm_processes)} vLLM process(es) not started by deploy seen: "
                    "left alone; if they hold the GPUs, --clean-gpus frees them)"
                    if cur.vllm_processes else ""), t0)


def r_fetch(run: Run, step: P.Step) -> None:
    run.fetched = F.run(run.ctx, run.ctx.pb, step)


def r_install(run: Run, step: P.Step) -> None:
    I.run(run.ctx, run.ctx.pb, step, run.out, yes=run.opts.yes, confirm=run.opts.confirm)
    if run.out.error is not None:  # the install ran and failed (its record and log are in the outcome)
        raise run.out.error


def r_write_config(run: Run, step: P.Step) -> None:
    run.written = D.write_config(run.ctx, step)
    if run.written.changed:
        run.st.config_replaced = True  # described from a fresh read if this run fails (state_left)


def r_verify(run: Run, step: P.Step) -> None:
    pb = run.ctx.pb
    if step.drive.get("report"):  # deploy verify: every check's result, judged by verify_only
        run.verified = D.verify(run.ctx, step, record=False)
        return
    run.verified = D.verify(run.ctx, step, blocking=run.opts.write_config or not pb.conf.speculative.drafter,
                            written_sha=run.written.after_sha256 if run.written else None)
    run.st.verified_sha = run.verified.sha256 if run.verified is not None else None


def r_plumbing(run: Run, step: P.Step) -> None:
    if not step.drive.get("report"):
        GP.gpu_plumbing(run.ctx, step)
        return
    ctx = run.ctx  # deploy verify: the findings and the sizing on the measured GPUs, judged by verify_only
    found, facts = GP.run_check(ctx, step)
    run.out.info["gpu_plumbing"] = {"findings": found, "host_error": (facts["host"] or {}).get("error")}
    fits = GP.sized_on_measured_gpus(ctx, facts["host"], facts["container"])
    if fits:
        run.out.info["fits"] = fits
        ctx.progress.say(ctx.where, f"sizing on the measured GPUs: {fits['line']}")


def r_revisions(run: Run, step: P.Step) -> None:
    try:
        recs = run.ctx.call(step).records or {}
    except DeployError:  # a report, not a check: no records is no revisions
        recs = {}
    run.out.info["revisions"] = F.revisions(recs, step.drive["roles"])


def r_manifest_records(run: Run, step: P.Step) -> None:
    recs = run.ctx.call(step).records or {}
    run.fetched["manifest"] = {role: recs.get(dest) for role, dest in step.drive["roles"].items()}


def r_lock_holder(run: Run, step: P.Step) -> None:
    """deploy unlock: who holds the lock; nothing more to do when no one does or the user keeps it."""
    r = run.ctx.call(step, fresh=True, beat=False)
    if r.error:
        raise DeployError(r.error, where=run.ctx.where)
    run.holder = h = r.holder
    if not h:
        run.out.info, run.st.finished = {"holder": None, "broken": False, "state": "free"}, "free"
        return
    view = {k: v for k, v in h.items() if k != "token"}
    view["dead_here"] = holder_dead(h)
    run.out.info = {"holder": view, "broken": False, "state": "kept"}
    if not run.opts.confirm(view):
        run.st.finished = "kept"


def r_break_lock(run: Run, step: P.Step) -> None:
    r = run.ctx.call(step, secrets={"break_token": run.holder.get("token")}, fresh=True, beat=False)
    view = run.out.info["holder"]
    run.out.info = {"holder": view, "broken": True, "state": "broken"} if r.unlocked else {
        "holder": view, "broken": False, "state": "changed",
        "now": {k: v for k, v in (r.holder or {}).items() if k != "token"} or None}


def r_stop(run: Run, step: P.Step) -> None:
    """The three planned stops (one agent action `stop`), by phase: main (what ran before, for `state left:`),
    on-low-acceptance (the rejected server, before the fallback), on-failure (a half-started server of this run:
    best effort, described, never raised)."""
    ctx, pb = run.ctx, run.ctx.pb
    if step.phase == "on-failure":
        run.st.changed.append(stop_after_failure(ctx, step))
        return
    if step.phase == "on-low-acceptance":
        ctx.progress.say(ctx.where, f"{run.st.low}: stopping it and falling back to {pb.fallback.name}")
        G.stop(ctx, step)
        run.st.launched = False
        run.out.status = "fell back"
        run.out.error = StepFailed("acceptance", run.st.low, where=ctx.where, fix=low_fix_of(run.st.verdict, pb.name))
        return
    rep = run.stop_report = G.stop(ctx, step)
    if rep.stopped:
        s = (run.cur.state if run.cur else None) or {}
        run.st.changed.append(f"the deployment that ran before ({s.get('playbook') or 'unknown'}, pid "
                              f"{s.get('pid')}) was stopped")


def r_gpus_free(run: Run, step: P.Step) -> None:
    run.free = G.gpus_free(run.ctx, step)


def r_port(run: Run, step: P.Step) -> None:
    V.port_free(run.ctx, step)


def r_launch(run: Run, step: P.Step) -> None:
    run.launch_result = V.launch(run.ctx, step)
    run.st.launched = True
    run.st.systemd = run.launch_result.supervisor == "systemd"


def r_onboot(run: Run, step: P.Step) -> None:
    V.onboot_check(run.ctx, step)


def r_wait(run: Run, step: P.Step) -> None:
    run.ready = V.wait_ready(run.ctx, step)


def r_aux_layers(run: Run, step: P.Step) -> None:
    V.check_aux_layers(run.ctx, run.ready, run.verified, blocking=run.opts.write_config)


def r_drift(run: Run, step: P.Step) -> None:
    D.drift(run.ctx, step, run.verified.sha256 if run.verified is not None else None)


def r_acceptance(run: Run, step: P.Step) -> None:
    ctx, pb = run.ctx, run.ctx.pb
    m, low = V.acceptance(ctx, step)
    run.st.verdict = m["verdict"].as_dict()
    run.out.info = {**_ep(server_endpoint(run.fleet.inventory, pb)), "model": pb.conf.serve.served_model_name,
                    "method": pb.conf.speculative.method, "acceptance": m["acceptance"].as_dict(), "gate": run.st.verdict,
                    **({"gated_running": True} if run.st.ungated else {}),
                    "supervisor": (run.launch_result.supervisor if run.launch_result else None) or "none",
                    "unit": run.launch_result.unit if run.launch_result else None,
                    "phases_s": {r.step: round(r.seconds, 2) for r in ctx.results},
                    "total_s": round(time.monotonic() - run.t_start, 2)}
    if getattr(run.ready, "sizing_check", None) is not None:  # sizing.target_config: predicted vs reported
        run.out.info["sizing"] = run.ready.sizing_check
    if low is None:
        run.out.ok, run.out.status = True, "up"
        return
    if run.st.can_fall_back:
        run.st.low = low  # the on-low-acceptance phase runs next
        return
    raise StepFailed("acceptance", low + ". A deployment with bad acceptance is a failed deployment.",
                     where=ctx.where, fix=low_fix(m["verdict"], pb.name) +
                     ("; or set acceptance.on_low_acceptance: fallback" if not pb.fallback else ""))


def r_serving(run: Run, step: P.Step) -> None:
    """deploy tune's baseline: up when it serves (no drafts, no acceptance gate)."""
    ctx, pb = run.ctx, run.ctx.pb
    ctx.record("serving", True, "serves without speculation (the baseline: no drafts to gate)", time.monotonic())
    run.out.ok, run.out.status = True, "up"
    run.out.info = {**_ep(server_endpoint(run.fleet.inventory, pb)), "model": pb.conf.serve.served_model_name,
                    "method": "none", "gate": {"passed": True, "reason": "serves (baseline, no speculation)"},
                    "total_s": round(time.monotonic() - run.t_start, 2)}


def low_fix(verdict, playbook: str) -> str:
    """What to do about a failed gate: the cause its shape names first, then the usual suspects."""
    if verdict.too_few and len(verdict.reasons) == 1:
        return ("let the probe produce more output: raise acceptance.probe.max_tokens or max_rounds (or lower "
                f"acceptance.min_drafts); deploy logs {playbook} shows whether the requests produced tokens")
    first = []
    if verdict.cliff_at is not None:
        first.append("a cliff: check use_sliding_window/sliding_window with deploy verify, and the vLLM version (>= "
                     "0.26, V2 model runner)")
    return "likeliest causes: " + "; ".join(first + V.LOW_ACCEPTANCE_CAUSES)


def r_gate_record(run: Run, step: P.Step) -> None:
    """Record the verdict with its launch (gate.json; rejected.json when a fallback follows). A failure to record
    is a warning: without a record the next up measures and gates again, which is safe."""
    ctx, pb, st = run.ctx, run.ctx.pb, run.st
    t0 = time.monotonic()
    verdict = dict(st.verdict or {}, rejected_fallback=pb.fallback.name if st.low and pb.fallback else None)
    try:
        r = ctx.call(dataclasses.replace(step, args=dict(step.args, verdict=verdict)))
        problem = None if r.ok else r.message
    except DeployError as e:
        problem = e.message
    if problem is not None:
        ctx.record(step.name, None, f"warning: could not record the gate's verdict ({problem}); the next deploy up "
                                    "measures and gates again", t0)
        return
    what = "passed" if verdict.get("passed") else "failed"
    ctx.record(step.name, True, f"verdict recorded ({what}) for this launch in {step.args['state_dir']}/gate.json"
               + (f"; the rejection of {pb.name} is kept for deploy status beside {verdict['rejected_fallback']}"
                  if verdict.get("rejected_fallback") else ""), t0)


def low_fix_of(verdict: dict | None, playbook: str) -> str:
    v = verdict or {}
    return low_fix(Verdict(False, reasons=v.get("reasons") or [], cliff_at=v.get("cliff_at"),
                           too_few=bool(v.get("too_few_drafts"))), playbook)


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "an unknown time"


def r_fallback(run: Run, step: P.Step) -> None:
    """The fallback's own planned steps, under the lock this run holds, with their own outcome."""
    sub = new_run(run.fleet, run.ctx.pb.fallback, run.ctx.progress, Options(**{**run.opts.__dict__, "yes": True}),
                  token=run.ctx.token)
    run.out.fallback = execute(sub, step.sub)
    run.out.ok = False  # the requested deployment failed; the fallback's own outcome is reported beside it


def r_drift_check(run: Run, step: P.Step) -> None:
    e = run.error
    if isinstance(e, StepFailed):
        run.error = run.out.error = drift_instead(run.ctx, step, run.st.verified_sha, e)


def r_read_back(run: Run, step: P.Step) -> None:
    try:
        run.read_back["now"] = run.ctx.call(step).sha256
    except DeployError as e:
        run.read_back["now_error"] = e.message
        raise


def r_note_failure(run: Run, step: P.Step) -> None:
    e = run.error
    failure = {"playbook": run.ctx.pb.name, "step": getattr(e, "step", ""), "message": e.message.splitlines()[0]}
    run.ctx.call(dataclasses.replace(step, args=dict(step.args, failure=failure)))


def r_holders(run: Run, step: P.Step) -> None:
    """Before a fuser -k: show the holders of the playbook's own GPUs and ask (opts.confirm shows the list)."""
    ctx, pb = run.ctx, run.ctx.pb
    t0 = time.monotonic()
    r = ctx.call(step)
    devs = {f"/dev/nvidia{g}" for g in pb.gpus}  # fuser acts on the playbook's own GPUs only
    mine = [h for h in r.holders or [] if devs & set(h.get("devices") or [])]
    holders = [h for h in mine if not h.get("ours")]  # deploy's own processes: the stop step ends them
    if not holders:
        ctx.record(step.name, True, "nothing but deploy's own vLLM holds the playbook's GPUs (the stop step ends it): "
                                    "fuser will have nothing else to kill" if mine else
                   "nothing holds the playbook's GPUs: fuser will have nothing to kill", t0)
        return
    listing = "".join(f"\n  PID {h['pid']} {h['comm']}: {G.one_line(h['cmdline'])}" for h in holders)
    if run.opts.kill_confirmed or (run.opts.confirm and run.opts.confirm(
            f"Will kill (fuser -k -TERM, then -KILL) in container {ctx.where}, holders of GPU(s) {pb.gpus} that "
            f"deploy did not start:{listing}\nProceed?")):
        ctx.record(step.name, True, f"{len(holders)} holder(s) of the playbook's GPUs: confirmed", t0,
                   holders=holders)
        return
    ctx.fail(step.name, t0, f"not confirmed; nothing was killed ({len(holders)} holder(s) of GPU(s) {pb.gpus} that "
                            f"deploy did not start:{listing})",
             fix="answer yes at the prompt (on a terminal), or pass -y (scripts) to kill them; or stop them yourself")


def r_clear_failure(run: Run, step: P.Step) -> None:
    try:  # a deliberate, successful down ends the story of an earlier failed up (deploy status)
        run.ctx.call(step)
    except DeployError:
        pass


# One table: each planned step's name, its runner here, and the agent action it sends (None: a host command or a
# workstation-only step); the agent's own table (agent/container/main.py ACTIONS) maps the action to its module.
# tests/unit/test_plan_table.py holds every plan's steps against it.
STEPS = {
    "container": (r_container, None), "lock": (r_lock, "lock"), "current": (r_current, "status"),
    "fetch": (r_fetch, "fetch"), "install-vllm": (r_install, "install_vllm"),
    "drafter-config": (r_write_config, ("write_file", "hub_drafter")), "verify": (r_verify, "verify"),
    "gpu-plumbing": (r_plumbing, "plumbing"), "holders": (r_holders, "gpu_read"),
    "stop": (r_stop, "stop"), "stop-low": (r_stop, "stop"), "stop-failed": (r_stop, "stop"),
    "gpus-free": (r_gpus_free, "gpus_free"), "port-free": (r_port, "port_check"), "launch": (r_launch, "launch"),
    "onboot": (r_onboot, None),
    "wait-ready": (r_wait, "wait_ready"), "aux-layers": (r_aux_layers, None), "drift": (r_drift, "file_sha"),
    "acceptance": (r_acceptance, "acceptance"), "gate-record": (r_gate_record, "gate_record"),
    "serving": (r_serving, None),
    "fallback": (r_fallback, None), "drift-check": (r_drift_check, "file_sha"), "read-back": (r_read_back, "file_sha"),
    "note-failure": (r_note_failure, "note_failure"), "clear-failure": (r_clear_failure, "note_failure"),
    "unlock": (r_unlock, "unlock"), "revisions": (r_revisions, "fetch"),
    # the planned calls of a driven step (its sub-steps, plan.fetch_calls / install_calls), sent by its runner
    "fetch-start": (r_fetch, "fetch"), "fetch-attach": (r_fetch, "fetch"), "store-mark": (r_fetch, "store"),
    "store-probe": (r_fetch, "fetch"), "store-start": (r_fetch, "fetch"), "store-attach": (r_fetch, "fetch"),
    "store-records": (r_fetch, "fetch"), "store-link": (r_fetch, "store"), "install-start": (r_install, "install_vllm"),
    "install-attach": (r_install, "install_vllm"), "install-rollback": (r_install, "install_vllm"),
    "manifest-records": (r_manifest_records, "fetch"), "lock-holder": (r_lock_holder, "unlock"),
    "break-lock": (r_break_lock, "unlock"),
}
RUNNERS = {name: runner for name, (runner, _) in STEPS.items()}


def drift_instead(ctx: Context, step: P.Step, verified_sha: str, err: StepFailed) -> StepFailed:
    """A step after verify failed: if the drafter config changed since verify, that change is the news (whatever
    step noticed it first), reported as drift with both hashes; the step's own failure follows as its symptom."""
    try:
        r = ctx.call(step)
    except DeployError:
        return err
    now = r.sha256
    if now == verified_sha:
        return err
    pinned = ctx.pb.conf.speculative.drafter.sha256
    msg = (f"the drafter config changed behind our back while vLLM started: {step.args['path']} now has sha256 "
           f"{now or r.error}, it had {verified_sha} when verified (pinned {pinned}); "
           f"{err.step} failed as a consequence: {err.message}")
    ctx.record("drift", False, msg.split(";")[0], time.monotonic(), result=r)
    return StepFailed("drift", msg, where=err.where, details=err.details,
                      fix=f"find what rewrites {step.args['path']} (a sync job, a download) and stop it; "
                          f"then deploy up {ctx.pb.name} again")


def interrupted_state_left(run: Run) -> str:
    """After Ctrl-C: what this run changed (from what its steps returned; nothing is read back, the user asked to
    stop), and that the lock is released by the finally phase."""
    st, written = run.st, run.written or WriteFileResult()
    parts = list(st.changed)
    if st.config_replaced:
        parts.insert(0, f"the drafter config {written.path} was replaced with the pinned bytes (old file kept "
                        f"as {written.backup}; not read back after the interruption: deploy verify "
                        f"{run.ctx.pb.name} checks it)")
    if st.launched:
        parts.append("vLLM was launched and keeps running (deploy status shows it)")
    return "; ".join(parts) if parts else "nothing was changed on the host"


def state_left_text(run: Run) -> str:
    """What the host holds now, from facts read after the failure (the read-back step), not from intentions."""
    st, written, back = run.st, run.written or WriteFileResult(), run.read_back
    parts = list(st.changed)
    if st.config_replaced:
        if "now" not in back:
            read = f"it could not be read back now ({back.get('now_error', 'not read')})"
        else:
            now, pinned = back["now"], run.ctx.pb.conf.speculative.drafter.sha256
            read = f"read now: sha256 {now}, " + ("the pinned bytes" if now == pinned else
                                                   f"NOT the pinned bytes ({pinned}): something rewrote it")
        parts.insert(0, f"the drafter config {written.path} was replaced (old file kept as {written.backup}); {read}")
    return "; ".join(parts) if parts else "nothing was changed on the host"


def stop_after_failure(ctx: Context, step: P.Step) -> str:
    """A failed up does not leave a half-working server holding the GPUs: stop it, keep its log."""
    pb = ctx.pb
    try:
        rep = ctx.call(step)
        if rep.refused:  # another playbook's deployment took the container over (a broken lock)
            return (f"the failed server was not stopped: {rep.refused} (another deploy took the container over "
                    f"meanwhile; deploy status {ctx.where} shows it)")
        n = len((rep.terminated or []) + (rep.killed or []))
        left = rep.leftovers or []
        log = P.state_paths(pb)["log_path"]
        u = rep.unit
        s = f"the failed server was stopped ({n} process(es))" if n else "the failed server had already exited"
        if u:  # systemd's unit: stopped and disabled, so it does not come back at the next boot
            s += (f"; unit {u['unit']} is {u.get('active') or 'unknown'} and {u.get('enabled') or 'unknown'}; its log "
                  f"is kept in the journal (deploy logs {pb.name}, or journalctl -u {shell_word(u['unit'])})")
        else:
            s += f"; its log is kept at {log} (deploy logs {pb.name})"
        if left:
            s += "; still holding GPUs: " + ", ".join(f"PID {p['pid']} ({p['comm']})" for p in left) + \
                 f" (deploy down {pb.name} --clean-gpus)"
        return s
    except DeployError as e:
        return f"could not stop the failed server ({e.message}); run deploy down {pb.name}"


def _ep(ep: dict) -> dict:
    return {"url": ep["url"], "tunnel": ep.get("tunnel"), "endpoint": ep}


def down(fleet: Fleet, pb: Playbook, progress: Progress, opts: Options) -> Outcome:
    run = new_run(fleet, pb, progress, opts)
    execute(run, P.plan_down(pb, clean_gpus=opts.clean_gpus, ask=opts.ask_before_kill(pb)))
    if run.error is None:
        rep, free = run.stop_report or StopResult(), run.free or GpusFreeResult()
        run.out.ok, run.out.status = True, "down"
        run.out.info = {"stopped": rep.stopped, "fuser": rep.fuser, "unit": rep.unit, "stop_s": rep.seconds,
                        "gpu_mib_before": rep.gpu_before or free.before, "gpu_mib_after": free.after,
                        "free_s": free.seconds}
    return run.out


def fetch(fleet: Fleet, pb: Playbook, progress: Progress, *, rehash: bool = False,
          timeout_s: float = P.FETCH_TIMEOUT_S, connections: int | None = None, manifest=None) -> Outcome:
    """deploy fetch PLAYBOOK (one target): plan.plan_fetch, run by the executor. manifest (--manifest FILE):
    called with {role: record} of what was fetched, after a fetch that succeeded."""
    refused = F.refusal(pb)
    if refused:
        raise refused
    for v in F.tokens(pb, P.fetch_args(pb)).values():  # an unset variable stops here, before any connection
        fleet.redact.add(v)
    run = new_run(fleet, pb, progress, Options())
    execute(run, P.plan_fetch(pb, rehash=rehash, connections=connections, timeout_s=timeout_s,
                              manifest=manifest is not None))
    if run.error is None:
        run.out.ok, run.out.status = True, run.fetched["status"]
        run.out.info = {"records": run.fetched.get("records") or [],
                        "rehashed": bool(run.fetched.get("rehashed"))}  # --verify re-hashed every file
        if manifest is not None:
            manifest(run.fetched["manifest"])
    return run.out


def install_vllm(fleet: Fleet, pb: Playbook, progress: Progress, *, yes: bool = False, confirm=None,
                 force: bool = False, rollback: bool = False) -> Outcome:
    """deploy install-vllm PLAYBOOK (one target): plan.plan_install, run by the executor."""
    return execute(new_run(fleet, pb, progress, Options(yes=yes, confirm=confirm)), P.plan_install(pb, force=force, rollback=rollback))


def verify_only(fleet: Fleet, pb: Playbook, progress: Progress) -> tuple[Outcome, VerifyResult]:
    """`deploy verify`: plan.plan_verify run by execute(), then judged: every check failed, or verified."""
    run = new_run(fleet, pb, progress, Options())
    out = execute(run, P.plan_verify(pb))
    if run.error is not None:
        return out, VerifyResult()
    r, where = run.verified, run.ctx.where
    found, fits = out.info["gpu_plumbing"]["findings"], out.info.get("fits")
    refuse = bool(fits) and fits["level"] == "refuse"
    out.ok = not r.failed and not found and not refuse
    out.status = "verified" if out.ok else "failed"
    if refuse and not r.failed and not found:
        msg, fix = measured_refusal(pb, fits)
        out.error = StepFailed("sizing", msg, where=where, fix=fix)
    if r.failed:
        out.error = StepFailed("verify", f"{len(r.failed)} check(s) failed"
                               + (f"; {len(found)} GPU plumbing problem(s)" if found else ""), where=where,
                               fix=D.verify_fix(r.failed, pb, r.stack)
                               + ("; " + "; ".join(dict.fromkeys(f["fix"] for f in found)) if found else ""))
    elif found:
        out.error = StepFailed("gpu-plumbing", f"{len(found)} GPU plumbing problem(s)", where=where,
                               fix="; ".join(dict.fromkeys(f["fix"] for f in found)))
    return out, r


def apply_config_refusal(pb: Playbook) -> UsageError | None:
    """Why apply-config cannot run for PB (no drafter config to install), or None: the one message, for the CLI and
    for apply_config."""
    if pb.conf.speculative.drafter and P.drafter_config_path(pb):
        return None
    return UsageError(f"{pb.name} has no drafter config to install (method {pb.conf.speculative.method}); nothing was run",
                      where=pb.path, fix=f"apply-config is for a playbook with a drafter (method dflash); deploy up "
                                         f"{pb.name} brings this one up")


def apply_config(fleet: Fleet, pb: Playbook, progress: Progress) -> Outcome:
    run = new_run(fleet, pb, progress, Options())
    refusal = apply_config_refusal(pb)
    if refusal is not None:
        run.out.error = refusal
        return run.out
    execute(run, P.plan_apply_config(pb))
    if run.error is None:
        run.out.ok, run.out.status = True, "verified"
    return run.out


def unlock(fleet: Fleet, host: str, vmid: int, runtime: Runtime, confirm, progress: Progress) -> dict:
    """`deploy unlock`: show the holder of a container's lock; break it if confirm(holder) says yes.
    -> {"holder": ..., "broken": bool, "state": "free" | "broken" | "kept" | "changed"}"""
    steps = P.plan_unlock(host, vmid, runtime)  # run by the executor without a playbook: the container alone
    ctx = bare_context(fleet.session(host), host, vmid, progress)
    run = Run(ctx, fleet, Options(confirm=confirm), Outcome(False, ctx.where, ctx.where, "failed", ctx.results),
              P.RunState(), time.monotonic())
    execute(run, steps)
    if run.error is not None:
        raise run.error
    return run.out.info


__all__ = ["up", "down", "verify_only", "apply_config", "unlock", "Options", "Outcome", "StepResult"]
