"""Execute plans: `up`, `restart`, `down`, `verify`, `apply-config`. Each runs the Steps that plan.py built."""

from __future__ import annotations

import getpass
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import plan as P
from .errors import DeployError, Unreachable
from .facts import parse_pct_status
from .remote import Fleet
from .report import Progress, sha
from .spec import Playbook
from .steps import Context, StepFailed, StepResult
from .steps import drafter as D
from .steps import gpu as G
from .steps import vllm as V


class LockHeld(DeployError):
    pass


@dataclass
class Options:
    yes: bool = False
    write_config: bool = True
    clean_gpus: bool | None = None
    wait_lock_s: float = 0.0
    interactive: bool = False
    confirm: object = None  # callable(prompt) -> bool, for the diff-before-restart question


@dataclass
class Outcome:
    ok: bool
    playbook: str
    where: str
    status: str  # "up", "already up", "fell back", "failed", "down", "verified", "interrupted"
    results: list = field(default_factory=list)
    error: DeployError | None = None
    fallback: "Outcome | None" = None
    info: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "playbook": self.playbook, "where": self.where, "status": self.status,
                "steps": [r.as_dict() for r in self.results], "info": self.info,
                "error": self.error.as_dict() if self.error else None,
                "fallback": self.fallback.as_dict() if self.fallback else None}


def holder_id() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}"


def secrets_for(pb: Playbook) -> dict:
    """vLLM's secret environment, read from LOCAL variables named by the playbook (serve.api_key_env,
    serve.secret_env): {NAME_IN_CONTAINER: value}. Sent on stdin only; every value is registered for redaction."""
    refs = dict(pb.serve.get("secret_env") or {})
    if pb.serve.get("api_key_env"):
        refs["VLLM_API_KEY"] = pb.serve["api_key_env"]
    out = {}
    for name, local in sorted(refs.items()):
        val = os.environ.get(local)
        if not val:
            key = "serve.api_key_env" if name == "VLLM_API_KEY" and local == pb.serve.get("api_key_env") \
                else f"serve.secret_env.{name}"
            raise DeployError(f"{key} names {local}, but it is not set in this shell",
                              where=pb.path, fix=f"export {local}=... before running deploy")
        out[name] = val
    return out


def new_context(fleet: Fleet, pb: Playbook, progress: Progress, token: str | None = None) -> Context:
    secrets = secrets_for(pb)
    for v in secrets.values():
        fleet.redact.add(v)
    if getattr(progress, "audit", None) is None:
        progress.audit = fleet.audit  # progress also goes to the audit log: a closed stderr loses nothing
    return Context(session=fleet.session(pb.host), pb=pb, progress=progress, token=token or uuid.uuid4().hex,
                   holder=holder_id(), secrets=secrets)


def check_container(ctx: Context, step: P.Step) -> None:
    t0 = time.monotonic()
    with ctx.progress.heartbeat(ctx.where, f"connect to {ctx.pb.host} and run {' '.join(step.host_argv)}",
                                step.timeout):
        r = ctx.session.run(step.host_argv, timeout=step.timeout, vmid=ctx.pb.vmid)
    if r.exited != 0:
        ctx.fail(step.name, t0, f"`pct status {ctx.pb.vmid}` failed: {(r.err or r.out).strip()}",
                 fix="check target.vmid and the inventory")
    try:
        state = parse_pct_status(r.out)
    except ValueError as e:
        ctx.fail(step.name, t0, str(e), fix="is this a Proxmox VE host? `pct status VMID` should print "
                                            "'status: running'")
    if state != "running":
        ctx.fail(step.name, t0, f"container {ctx.pb.vmid} is {state}", fix=f"pct start {ctx.pb.vmid} on {ctx.pb.host}")
    ctx.record(step.name, True, f"container {ctx.pb.vmid} running on {ctx.pb.host}", t0)


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
        renew = P.Step(**{**self.step.__dict__, "args": dict(self.step.args, renew=True, wait_s=0), "timeout": 30})
        while not self._stop.wait(self.interval):
            try:
                r = self.ctx.call(renew)
            except Exception:  # noqa: BLE001 - a missed beat is retried; the lease term absorbs a few
                continue
            if not r.get("locked"):
                self.lost = r.get("holder")
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
    h = r.get("holder") or {}
    if not r.get("locked") and h and holder_dead(h):
        ctx.progress.say(ctx.where, f"     the lock's holder ({h.get('holder')}) is a dead process on this "
                                    "workstation: breaking its lock")
        r = ctx.call(P.Step(**{**step.__dict__, "args": dict(step.args, break_token=h.get("token"))}), on_event=say)
        h = r.get("holder") or {}
    if not r.get("locked"):
        if r.get("error"):
            ctx.fail(step.name, t0, r["error"], fix="make the state directory root-owned and not writable by others")
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
        ctx.call(step)
    except DeployError:
        pass


def diff_running(cur: dict, pb: Playbook) -> list[str]:
    """What differs between the running deployment (state file) and this playbook."""
    st = cur.get("state") or {}
    diffs = []
    want_argv = P.serve_argv(pb)
    if st.get("argv") != want_argv:
        have = st.get("argv")
        diffs.append("argv:\n      running: " + (" ".join(have) if have else "(not recorded in the state file)")
                     + "\n      wanted:  " + " ".join(want_argv))
    if st.get("playbook") != pb.name:
        diffs.append(f"playbook: running {st.get('playbook') or '(not recorded)'}, wanted {pb.name}")
    elif st.get("playbook_sha256") != pb.sha256:
        diffs.append(f"playbook file changed: {sha(st.get('playbook_sha256'), '(not recorded)')} -> {sha(pb.sha256)}")
    want_d = (pb.drafter or {}).get("sha256")
    if want_d and cur.get("drafter_sha256") != want_d:
        have = cur.get("drafter_sha256")
        if have:
            diffs.append(f"drafter config on disk {sha(have)}, pinned {sha(want_d)}")
        elif cur.get("drafter_error"):
            diffs.append(f"drafter config unreadable ({cur['drafter_error']}), pinned {sha(want_d)}")
        else:
            diffs.append(f"drafter config: the running deployment has none, this playbook pins {sha(want_d)}")
    return diffs


def up(fleet: Fleet, pb: Playbook, progress: Progress, opts: Options, *, restart: bool = False,
       token: str | None = None, _depth: int = 0) -> Outcome:
    ctx = new_context(fleet, pb, progress, token)
    steps = {s.name: s for s in P.plan_up(pb, write_config=opts.write_config, clean_gpus=opts.clean_gpus,
                                          restart=restart)}
    out = Outcome(False, pb.name, ctx.where, "failed", ctx.results)
    t_start = time.monotonic()
    locked = None
    launched = False
    changed: list[str] = []  # what this run changed on the host so far, for "state left" on failure
    written: dict = {}
    verified = None
    try:
        check_container(ctx, steps["container"])
        locked = take_lock(ctx, steps["lock"], opts.wait_lock_s)
        t0 = time.monotonic()
        key = ctx.secrets.get("VLLM_API_KEY")
        cur = ctx.call(steps["current"], secrets={"api_key": key} if key else None)
        st = cur.get("state") or {}
        running = bool(st.get("alive"))
        diffs = diff_running(cur, pb) if running else []
        healthy = running and cur.get("health") == 200 and pb.serve["served_model_name"] in (cur.get("models") or [])
        if running and not diffs and healthy and not restart:
            ctx.record("current", True, f"already up: pid {st.get('pid')}, same argv and drafter sha256, healthy", t0)
            out.ok, out.status = True, "already up"
            out.info = {**_ep(url(pb, fleet.inventory)), "pid": st.get("pid")}
            return out
        if running and diffs and not restart:
            ctx.record("current", True, f"running {st.get('playbook')} (pid {st.get('pid')}) differs:", t0,
                       diffs=diffs)
            for d in diffs:
                progress.say(ctx.where, "     " + d)
            if not opts.yes and not (opts.confirm and opts.confirm("Restart it with this playbook?")):
                raise StepFailed("current", "a different deployment is running; not replacing it without -y",
                                 where=ctx.where, fix=f"deploy up {pb.name} -y to replace it",
                                 state_left="unchanged: the running deployment was left as it was")
        elif running:
            ctx.record("current", True, f"running {st.get('playbook')} (pid {st.get('pid')}, "
                                        f"health {cur.get('health')}); will restart it", t0)
        else:
            ctx.record("current", True, "nothing of ours is running" +
                       (f" ({len(cur.get('vllm_processes') or [])} vLLM process(es) not started by deploy seen: "
                        "left alone; if they hold the GPUs, --clean-gpus frees them)"
                        if cur.get("vllm_processes") else ""), t0)
        written = D.write_config(ctx, steps["drafter-config"]) if "drafter-config" in steps else {}
        if written.get("changed"):
            changed.append("config")  # described from a fresh read if this run fails (state_left)
        verified = D.verify(ctx, steps["verify"], blocking=opts.write_config or not pb.drafter,
                            written_sha=written.get("after_sha256"))
        if running or restart or cur.get("vllm_processes"):
            rep = G.stop(ctx, steps["stop"])
            if rep.get("stopped"):
                changed.append(f"the deployment that ran before ({st.get('playbook') or 'unknown'}, pid "
                               f"{st.get('pid')}) was stopped")
        G.prove_free(ctx, steps["gpus-free"])
        V.port_free(ctx, steps["port-free"])
        V.launch(ctx, steps["launch"])
        launched = True
        ready = V.wait_ready(ctx, steps["wait-ready"])
        V.check_aux_layers(ctx, ready, verified, blocking=opts.write_config)
        if "drift" in steps:
            D.drift(ctx, steps["drift"], (verified or {}).get("sha256"))
        m = V.measure(ctx, steps["acceptance"])
        low = V.gate(ctx, steps["acceptance"], m)
        out.info = {**_ep(url(pb, fleet.inventory)), "model": pb.serve["served_model_name"],
                    "method": pb.spec["method"],
                    "acceptance": m["acceptance"].as_dict(),
                    "phases_s": {r.step: round(r.seconds, 2) for r in ctx.results},
                    "total_s": round(time.monotonic() - t_start, 2)}
        if low is None:
            out.ok, out.status = True, "up"
            return out
        acc = pb.data["acceptance"]
        if acc["on_low_acceptance"] == "fallback" and pb.fallback is not None and _depth == 0:
            progress.say(ctx.where, f"{low}: stopping it and falling back to {pb.fallback.name}")
            # never fuser here: the operator asked for a deployment, not for killing GPU holders
            G.stop(ctx, P.step_stop(pb, False, when="low acceptance"))
            launched = False
            out.status = "fell back"
            out.error = StepFailed("acceptance", low, where=ctx.where, fix="likeliest causes: " +
                                   "; ".join(V.LOW_ACCEPTANCE_CAUSES))
            fb = up(fleet, pb.fallback, progress, Options(**{**opts.__dict__, "yes": True}), restart=False,
                    token=ctx.token, _depth=1)
            out.fallback = fb
            out.ok = False  # the requested deployment failed; the fallback's own outcome is reported beside it
            return out
        raise StepFailed("acceptance", low + ". A deployment with bad acceptance is a failed deployment.",
                         where=ctx.where, fix="likeliest causes: " + "; ".join(V.LOW_ACCEPTANCE_CAUSES) +
                         (f"; or set acceptance.on_low_acceptance: fallback" if not pb.fallback else ""))
    except DeployError as e:
        out.error = e
        if launched and isinstance(e, Unreachable):
            e.fix = (e.fix + "; " if e.fix else "") + ("vLLM was launched and is recorded in the state file in "
                                                       "the container: deploy status shows it, deploy down stops it")
            return out
        if isinstance(e, Unreachable) or isinstance(e, LockHeld):
            return out
        if launched:
            changed.append(stop_after_failure(ctx, pb))
        verified_sha = (verified or {}).get("sha256")
        if isinstance(e, StepFailed) and verified_sha and "drift" in steps and e.step not in (
                "drafter-config", "verify", "drift"):
            e = out.error = drift_instead(ctx, steps["drift"], verified_sha, e)
        if isinstance(e, StepFailed) and not e.state_left:
            e.state_left = state_left(ctx, pb, changed, written)
        if changed or launched:
            note_failure(ctx, pb, e)
        return out
    except KeyboardInterrupt:
        out.status = "interrupted"
        if launched:
            msg = ("interrupted: vLLM was launched and is recorded in the container's state file; it keeps "
                   f"loading. deploy status {pb.name} shows it, deploy down {pb.name} stops it")
        else:
            msg = "interrupted before launch: nothing was started"
        out.error = DeployError(msg, where=ctx.where)
        return out
    finally:
        if locked:
            release_lock(ctx, steps["unlock"], locked)


def drift_instead(ctx: Context, step: P.Step, verified_sha: str, err: StepFailed) -> StepFailed:
    """A step after verify failed: if the drafter config changed since verify, that change is the news (whatever
    step noticed it first), reported as drift with both hashes; the step's own failure follows as its symptom."""
    try:
        r = ctx.call(step)
    except DeployError:
        return err
    now = r.get("sha256")
    if now == verified_sha:
        return err
    pinned = ctx.pb.drafter["sha256"]
    msg = (f"the drafter config changed behind our back while vLLM started: {step.args['path']} now has sha256 "
           f"{now or r.get('error')}, it had {verified_sha} when verified (pinned {pinned}); "
           f"{err.step} failed as a consequence: {err.message}")
    ctx.record("drift", False, msg.split(";")[0], time.monotonic(), result=r)
    return StepFailed("drift", msg, where=err.where, details=err.details,
                      fix=f"find what rewrites {step.args['path']} (a sync job, a download) and stop it; "
                          f"then deploy up {ctx.pb.name} again")


def state_left(ctx: Context, pb: Playbook, changed: list[str], written: dict) -> str:
    """What the host holds now, from facts read after the failure (not from what this run meant to do)."""
    if not changed:
        return "nothing was changed on the host"
    parts = [c for c in changed if c != "config"]
    if "config" in changed:
        path = written.get("path")
        try:
            now = ctx.call(P.step_drift(pb)).get("sha256")
        except DeployError as e:
            now = None
            parts.insert(0, f"the drafter config {path} was replaced (old file kept as {written.get('backup')}); "
                            f"it could not be read back now ({e.message})")
        else:
            pinned = pb.drafter["sha256"]
            what = "the pinned bytes" if now == pinned else f"NOT the pinned bytes ({pinned}): something rewrote it"
            parts.insert(0, f"the drafter config {path} was replaced (old file kept as {written.get('backup')}); "
                            f"read now: sha256 {now}, {what}")
    return "; ".join(parts)


def note_failure(ctx: Context, pb: Playbook, err: DeployError) -> None:
    """Leave a record in the container so `deploy status` reports the failed up/restart (best effort)."""
    try:
        ctx.call(P.step_note_failure(pb, {"playbook": pb.name, "step": getattr(err, "step", ""),
                                          "message": err.message.splitlines()[0]}))
    except DeployError:
        pass


def stop_after_failure(ctx: Context, pb: Playbook) -> str:
    """A failed up does not leave a half-working server holding the GPUs: stop it, keep its log."""
    try:
        rep = ctx.call(P.step_stop(pb, False, when="after a failure"))
        n = len(rep.get("terminated", []) + rep.get("killed", []))
        left = rep.get("leftovers") or []
        log = P.state_paths(pb)["log_path"]
        s = (f"the failed server was stopped ({n} process(es))" if n else "the failed server had already exited") + \
            f"; its log is kept at {log} (deploy logs {pb.name})"
        if left:
            s += "; still holding GPUs: " + ", ".join(f"PID {p['pid']} ({p['comm']})" for p in left) + \
                 f" (deploy down {pb.name} --clean-gpus)"
        return s
    except DeployError as e:
        return f"could not stop the failed server ({e.message}); run deploy down {pb.name}"


def _ep(ep: dict) -> dict:
    return {"url": ep["url"], "tunnel": ep.get("tunnel"), "endpoint": ep}


def url(pb: Playbook, inv=None) -> dict:
    """{url, tunnel, ...}: the container's real address from the inventory (orchestrator/endpoint.py)."""
    from .endpoint import endpoint

    host = inv.hosts.get(pb.host) if inv is not None else None
    if host is None:
        return {"url": None, "tunnel": None, "port": pb.serve["port"], "note": "address unknown"}
    return endpoint(host, host.container(pb.vmid), pb.serve["port"])


def down(fleet: Fleet, pb: Playbook, progress: Progress, opts: Options) -> Outcome:
    ctx = new_context(fleet, pb, progress)
    steps = {s.name: s for s in P.plan_down(pb, clean_gpus=opts.clean_gpus)}
    out = Outcome(False, pb.name, ctx.where, "failed", ctx.results)
    locked = None
    try:
        check_container(ctx, steps["container"])
        locked = take_lock(ctx, steps["lock"], opts.wait_lock_s)
        rep = G.stop(ctx, steps["stop"])
        free = G.prove_free(ctx, steps["gpus-free"])
        try:  # a deliberate, successful down ends the story of an earlier failed up (deploy status)
            ctx.call(P.step_note_failure(pb, None))
        except DeployError:
            pass
        out.ok, out.status = True, "down"
        out.info = {"stopped": rep.get("stopped"), "fuser": rep.get("fuser"), "stop_s": rep.get("seconds"),
                    "gpu_mib_before": rep.get("gpu_before") or free.get("before"), "gpu_mib_after": free.get("after"),
                    "free_s": free.get("seconds")}
    except DeployError as e:
        out.error = e
    finally:
        if locked:
            release_lock(ctx, steps["unlock"], locked)
    return out


def verify_only(fleet: Fleet, pb: Playbook, progress: Progress) -> tuple[Outcome, dict]:
    ctx = new_context(fleet, pb, progress)
    out = Outcome(False, pb.name, ctx.where, "failed", ctx.results)
    step = P.step_verify(pb)
    try:
        r = D.verify(ctx, step, record=False)
        out.ok = not r["failed"]
        out.status = "verified" if out.ok else "failed"
        if not out.ok:
            out.error = StepFailed("verify", f"{len(r['failed'])} check(s) failed", where=ctx.where,
                                   fix=D.verify_fix(r["failed"], pb, r.get("stack")))
        return out, r
    except DeployError as e:
        out.error = e
        return out, {}


def apply_config(fleet: Fleet, pb: Playbook, progress: Progress) -> Outcome:
    ctx = new_context(fleet, pb, progress)
    out = Outcome(False, pb.name, ctx.where, "failed", ctx.results)
    if not pb.drafter or not P.drafter_config_path(pb):
        out.error = DeployError("this playbook has no drafter to install a config for", where=pb.path,
                                fix="none needed: nothing to install (method mtp/ngram)")
        return out
    locked = None
    try:
        check_container(ctx, P.step_container(pb))
        steps = [P.step_write_config(pb), P.step_verify(pb)]
        locked = take_lock(ctx, P.step_lock(pb, "apply-config", P.lease_for(steps)), 0)
        w = D.write_config(ctx, steps[0])
        D.verify(ctx, steps[1], written_sha=w.get("after_sha256"))
        out.ok, out.status = True, "verified"
    except DeployError as e:
        out.error = e
    finally:
        if locked:
            release_lock(ctx, P.step_unlock(pb), locked)
    return out


def unlock(fleet: Fleet, host: str, vmid: int, runtime: dict, confirm, progress: Progress) -> dict:
    """`deploy unlock`: show the holder of a container's lock; break it if confirm(holder) says yes.
    -> {"holder": ..., "broken": bool, "state": "free" | "broken" | "kept" | "changed"}"""
    from . import agent
    from .status import DEFAULT_PYTHON, DEFAULT_STATE_DIR

    sdir = runtime.get("state_dir") or DEFAULT_STATE_DIR
    python = runtime.get("python") or DEFAULT_PYTHON
    s = fleet.session(host)
    r = agent.call(s, vmid, python, "unlock", {"state_dir": sdir}, timeout=30)
    if r.get("error"):
        raise DeployError(r["error"], where=f"{host}/{vmid}")
    h = r.get("holder")
    if not h:
        return {"holder": None, "broken": False, "state": "free"}
    view = {k: v for k, v in h.items() if k != "token"}
    view["dead_here"] = holder_dead(h)
    if not confirm(view):
        return {"holder": view, "broken": False, "state": "kept"}
    r = agent.call(s, vmid, python, "unlock", {"state_dir": sdir, "break_token": h.get("token")}, timeout=30)
    if r.get("unlocked"):
        return {"holder": view, "broken": True, "state": "broken"}
    return {"holder": view, "broken": False, "state": "changed",
            "now": {k: v for k, v in (r.get("holder") or {}).items() if k != "token"} or None}


__all__ = ["up", "down", "verify_only", "apply_config", "unlock", "Options", "Outcome", "StepResult"]
