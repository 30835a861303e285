"""`deploy install-vllm`: install the vLLM a playbook requires (`requires.vllm`) next to its runtime.

The install runs in the container, detached from the SSH session (a runner in its own session, its output in
`<state_dir>/install-<id>.log`, its progress in `<state_dir>/install.json`), into a fresh venv in
`<venv>.versions/`; it is verified there (version, DFlash fix markers, compiled extensions, an import in a
subprocess, every file against the distribution's RECORD) and only then does the runtime venv path become a
symlink to it (one rename). The previous venv stays on disk: `--rollback` switches back. A serving vLLM is never
touched: it keeps the files it runs from, and the next `up`/`restart` starts the new build.

This side: choose what to do from one `probe` (start, re-attach to a running install, report one that finished
while nobody watched, or nothing to do), follow the runner with bounded `attach` calls, and report.
"""

from __future__ import annotations

import re
import time

from orchestrator import agent
from orchestrator.steps import plan as P
from orchestrator.core.errors import DeployError, Unreachable, UsageError
from orchestrator.steps import Outcome
from orchestrator.provision.follow import Calls, Every, Job, follow, when as _when
from orchestrator.core.report import FOLLOW_LINE_MAX
from orchestrator.steps.plan_args import install_requirement as requirement
from orchestrator.core.spec import Playbook


class InstallFailed(DeployError):
    pass


class ConnectionLost(Unreachable):
    pass


STALE_BRANCHES = {"40898": ("PR #40898 (DFlash sliding-window support) was never merged: its goals landed in "
                             "releases through other PRs (#43445 causal DFlash, #46104 SWA + DFlash, #47914 hybrid "
                             "sliding/full drafters on Model Runner V2), so its branch is stale; vLLM 0.34.0 serves "
                             "this drafter: set requires.vllm: \"0.34.0\"")}


def stale_source_warning(spec: str) -> str | None:
    """A requires.vllm that builds a stale PR branch (the drafter's model card still names #40898): why, and the
    release to use instead. None for anything else."""
    if not spec.startswith("git+"):
        return None
    ref = spec.rsplit("@", 1)[-1] if "@" in spec.split("://", 1)[-1] else ""
    for pr, why in STALE_BRANCHES.items():
        if re.search(rf"(^|[/_-])(pull/)?{pr}($|[/_-]|/head)", ref) or f"pull/{pr}" in spec:
            return f"{spec}: {why}"
    return None


def refusal(pb: Playbook, option: str = "") -> UsageError | None:
    """Why deploy install-vllm (and its plan, and up --install-vllm) cannot run for PB, or None."""
    if pb.conf.requires.vllm:
        return None
    return UsageError(f"{option + ': ' if option else ''}{pb.name} does not say which vLLM it needs (requires.vllm); "
                      "nothing was run", where=pb.path,
                      fix="add requires.vllm to the playbook: a version (\"0.34.0\"), git+https://github.com/ORG/vllm@"
                          "BRANCH, a wheel URL or a wheel path in the container (deploy docs playbooks#requires); the "
                          "shipped playbooks name none: copy one (deploy init) and add it")


class _Runner(Calls):
    """The install's planned calls: under requires.install.python, else the runtime's Python (the step's drive),
    else (the venv does not exist yet) /usr/bin/python3."""

    def call(self, name: str, timeout: float | None = None, on_event=None, **fill) -> dict:
        """The install's answer as its wire dict (InstallResult, checked, then as_dict(): the install record and the
        runtime pointer are nested data this module reads as such)."""
        try:
            res = super().call(name, timeout, on_event, **fill)
        except agent.AgentError as e:
            if self.python == P.INSTALL_FALLBACK_PYTHON or not e.message.startswith("cannot run"):
                raise
            self.python = P.INSTALL_FALLBACK_PYTHON
            self.ctx.progress.detail(self.ctx.where, f"{self.step.drive['python']} is not there: the agent runs with "
                                                     f"{self.python}")
            res = super().call(name, timeout, on_event, **fill)
        if name == self.step.name and res.get("ok") and not isinstance(res.get("runtime"), dict):
            raise agent.AgentError("agent action 'install_vllm' (probe) answered ok without a runtime object: a "
                                   "malformed answer", where=self.ctx.where,
                                   fix="a bug in deploy's agent, or something in the container answers for it; "
                                       "report it with deploy's audit log")
        return res


def run(ctx, pb: Playbook, step: P.Step, out: Outcome, *, yes: bool = False, confirm=None) -> Outcome:
    """The step install-vllm (plan.step_install; force / rollback in its drive, its later calls its sub-steps):
    probe, then start, re-attach, report one that ended unwatched, or nothing to do; follow; report into `out` (a
    failed install: out.error)."""
    force, rollback = step.drive["force"], step.drive["rollback"]
    progress = ctx.progress
    run = _Runner(ctx, step)
    t0 = time.monotonic()
    try:
        probe = run.call(step.name, 60)  # the planned probe
    except Unreachable as e:  # before anything started here: the same advice as a drop while following
        raise ConnectionLost(f"lost the connection while reading the runtime ({e.message}); an install started "
                             "earlier goes on in the container", where=ctx.where,
                             fix=f"deploy install-vllm {pb.name} re-attaches to it (or starts it) and reports its "
                                 "result") from e
    if not probe.get("ok"):
        ctx.fail("probe", t0, probe.get("message", "probe failed"), fix=probe.get("fix", ""))
    rt, ist, serving = probe["runtime"], probe.get("install") or {}, probe.get("serving")
    ctx.record("probe", True, _describe_runtime(rt) + (f"; {serving['playbook']} is serving (pid {serving['pid']})"
                                                      if serving else "; nothing of ours is serving"), t0,
               runtime=rt, serving=serving, install=ist or None, pointer=probe.get("pointer"))
    if rollback:
        return _rollback(ctx, run, pb, out, serving, yes, confirm)
    want = requirement(pb.conf.requires.vllm)
    stale = stale_source_warning(pb.conf.requires.vllm)
    if stale:
        ctx.record("requires", None, "warning: " + stale, time.monotonic())
    final = ist.get("status") in ("ok", "failed", "timeout", "killed")
    if ist.get("status") == "running":
        progress.say(ctx.where, f"an install is in progress (started {_ago(ist)} ago, pid {ist.get('pid')}, "
                                f"{ist.get('spec')}, phase {ist.get('phase')}): re-attaching")
        res = _follow(ctx, run, pb, ist)
    elif final and not ist.get("reported") and ist.get("req") == want["req"]:
        progress.say(ctx.where, f"the install of {ist.get('spec')} started {_ago(ist)} ago ended while nobody "
                                "was attached: its result")
        res = _follow(ctx, run, pb, ist)
    else:
        cur = (probe.get("pointer") or {}).get("current")
        if (not force and ist.get("status") == "ok" and ist.get("req") == want["req"] and cur
                and rt.get("target") == cur and (ist.get("switched") or {}).get("to") == cur):
            ctx.record("install", True, f"already installed: {pb.conf.requires.vllm} (vLLM "
                                        f"{ist.get('version')}) in {rt.get('real')}, verified "
                                        f"{_when(ist.get('finished_at'))}; nothing changed", time.monotonic())
            out.ok, out.status = True, "already installed"
            out.info = _info(rt, ist)
            return out
        if serving and not yes:
            q = (f"{serving['playbook']} is serving from {rt['venv_root']} (pid {serving['pid']}). The new vLLM "
                 f"goes into a new venv and {rt['venv_root']} is switched to it after verification; the serving "
                 f"process is not touched, and the next `deploy up`/`restart` uses the new build. Proceed?")
            if not (confirm and confirm(q)):
                out.status = "declined"
                raise InstallFailed(f"{serving['playbook']} is serving on {ctx.where} (pid {serving['pid']}); "
                                    "nothing was installed", where=ctx.where,
                                    fix=f"deploy install-vllm {pb.name} -y (the serving process is not touched)")
        t0 = time.monotonic()
        try:
            started = run.call("install-start")
        except Unreachable as e:
            raise ConnectionLost(f"lost the connection while starting the install ({e.message}); it may have "
                                 "started in the container", where=ctx.where,
                                 fix=f"deploy install-vllm {pb.name} re-attaches to it (or starts it) and reports "
                                     "its result") from e
        if not started.get("ok"):
            ctx.fail("install", t0, started.get("message", "the install did not start"),
                     fix=started.get("fix", ""))
        if not started.get("started"):
            ist = started.get("install") or {}
            progress.say(ctx.where, f"another install is in progress (pid {ist.get('pid')}, {ist.get('spec')}): "
                                    "re-attaching to it")
        else:
            progress.say(ctx.where, f"install started with {started['installer']} (runner pid {started['pid']}, "
                                    f"detached): {want['req']} into {started['stage']}; log {started['log']}")
            ist = {"id": started["id"], "pid": started["pid"], "log": started["log"], "spec": want["req"]}
        res = _follow(ctx, run, pb, ist)
    return _report(ctx, pb, out, res)


def _follow(ctx, run: _Runner, pb: Playbook, ist: dict) -> dict:
    """attach calls until the runner reports an end (follow.py: the loop shared with fetch); each is bounded
    (FOLLOW_S), the whole by the playbook's limit plus the verification's."""
    inst = pb.conf.requires.install
    beat = Every()

    def render(ev):
        kind = ev.get("kind")
        try:
            elapsed = float(ev.get("elapsed") or 0)
        except (TypeError, ValueError):
            elapsed = 0.0
        if kind == "phase":
            return f"     {elapsed:6.1f}s  phase {str(ev.get('phase'))[:100]}", True
        if kind == "heartbeat":
            if not beat.due():
                return None
            return (f"     {elapsed:6.1f}s  still in phase {str(ev.get('phase'))[:100]} "
                    f"({str(ev.get('lines'))[:20]} log lines so far): {str(ev.get('last') or '-')[:FOLLOW_LINE_MAX]}",
                    True)
        if kind == "line":
            text = str(ev.get("line") or "")[:FOLLOW_LINE_MAX]
            if re.search(r"\b(ERROR|error:|Successfully installed|Installed \d+|Built )", text):
                return "     | " + text, True
            return "| " + text, False
        return None

    job = Job("install", f"deploy install-vllm {pb.name}",
              failed=lambda msg, fix="": InstallFailed(msg, where=run.ctx.where, fix=fix),
              lost=lambda msg, fix="": ConnectionLost(msg, where=run.ctx.where, fix=fix))
    attach = lambda p, follow_s, on_event: run.call(  # noqa: E731 - the planned attach, from where the last stopped
        "install-attach", follow_s + 120, on_event, id=ist.get("id"), log_pos=p, follow_s=follow_s)
    return follow(ctx, attach, job, ist, limit_s=float(inst.timeout_s) + 900.0, follow_s=P.INSTALL_FOLLOW_S,
                  render=render)


def _report(ctx, pb: Playbook, out: Outcome, res: dict) -> Outcome:
    ist = res.get("install") or {}
    status = ist.get("status")
    t = time.monotonic() - float(ist.get("elapsed") or 0.0)
    chk = ist.get("verify") or {}
    checks = chk.get("checks") or []
    if chk:
        bad = [c for c in checks if not c["ok"] and c.get("severity", "error") == "error"]
        ctx.record("verify", not bad and status != "killed" if checks else False,
                   (f"{len(checks) - len(bad)} of {len(checks)} checks passed" if checks else chk.get("error", ""))
                   + ("" if not bad else ": " + "; ".join(f"{c['check']}: {c['reason']}" for c in bad)),
                   time.monotonic(), result=chk)
    out.info = _info({}, ist, res.get("pointer"))
    if status == "ok":
        ctx.record("install", True, ist.get("message", ""), t, log=ist.get("log"))
        out.ok, out.status = True, "installed"
        return out
    out.status = {"timeout": "build not finished", "killed": "killed"}.get(status, "failed")
    tail = res.get("log_tail") or []
    msg = ist.get("message") or f"install ended with status {status}"
    if tail and status in ("failed", "timeout"):
        msg += f"\n  last lines of {ist.get('log')}:\n" + "\n".join("    " + ln for ln in tail[-15:])
    ctx.record("install", False, (ist.get("message") or msg).splitlines()[0], t, log=ist.get("log"))
    out.error = InstallFailed(msg, where=ctx.where, fix=ist.get("fix") or f"deploy install-vllm {pb.name}",
                              details={"status": status, "log": ist.get("log")})
    return out


def _rollback(ctx, run: _Runner, pb: Playbook, out: Outcome, serving, yes, confirm) -> Outcome:
    if serving and not yes:
        q = (f"{serving['playbook']} is serving (pid {serving['pid']}); the runtime is switched back, the serving "
             "process is not touched, and the next `deploy up`/`restart` uses the previous build. Proceed?")
        if not (confirm and confirm(q)):
            out.status = "declined"
            raise InstallFailed(f"{serving['playbook']} is serving on {ctx.where}; nothing was changed",
                                where=ctx.where, fix=f"deploy install-vllm {pb.name} --rollback -y")
    t0 = time.monotonic()
    r = run.call("install-rollback")
    if not r.get("ok"):
        ctx.fail("rollback", t0, r.get("message", "rollback failed"), fix=r.get("fix", ""))
    chk = r.get("verify") or {}
    st = chk.get("stack") or {}
    bad = [c for c in chk.get("checks") or [] if not c["ok"] and c.get("severity", "error") == "error"]
    ctx.record("rollback", True, f"{r['runtime']['venv_root']} -> {r['to']} again (was {r['from']}): vLLM "
                                 f"{st.get('version')}" + (f"; {len(bad)} check(s) fail there: "
                                                           + "; ".join(f"{c['check']}: {c['reason']}" for c in bad)
                                                           if bad else ", checks pass"), t0, result=r)
    out.ok, out.status = True, "rolled back"
    out.info = {"venv_root": r["runtime"]["venv_root"], "runtime": r["runtime"].get("real"), "from": r["from"],
                "to": r["to"], "version": st.get("version"), "commit_id": st.get("commit_id"),
                "checks_failed": [c["check"] for c in bad]}
    return out


def _describe_runtime(rt: dict) -> str:
    kind = rt.get("kind")
    if kind == "symlink":
        return f"runtime {rt['venv_root']} -> {rt.get('target')}"
    if kind == "dir":
        return f"runtime {rt['venv_root']} (a venv not yet managed by deploy)"
    return f"runtime {rt['venv_root']} does not exist yet"


def _info(rt: dict, ist: dict, pointer: dict | None = None) -> dict:
    return {"install_id": ist.get("id"), "spec": ist.get("spec"), "status": ist.get("status"),
            "version": ist.get("version"), "commit_id": ist.get("commit_id"), "venv": ist.get("stage"),
            "venv_root": ist.get("venv_root") or rt.get("venv_root"), "switched": ist.get("switched"),
            "installer": ist.get("installer"), "log": ist.get("log"), "phase": ist.get("phase"),
            "started_at": ist.get("started_at"), "finished_at": ist.get("finished_at"),
            "previous": (pointer or {}).get("previous")}


def _ago(ist: dict) -> str:
    s = float(ist.get("elapsed") or 0.0)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f} min"
