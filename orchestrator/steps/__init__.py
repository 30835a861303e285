"""Step units: each takes the run context and a planned Step, runs it, and returns a StepResult or raises
StepFailed with what failed, where, expected vs found, and what to do next."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

from .. import agent
from orchestrator.core.errors import DeployError, StepFailed  # noqa: F401 (StepFailed: re-exported)
from orchestrator.core.facts import parse_pct_status
from orchestrator.steps.plan import HOLDER, TOKEN, Step
from orchestrator.core.remote import Fleet, HostSession
from orchestrator.core.report import Progress
from orchestrator.core.spec import Playbook


@dataclass
class StepResult:
    step: str
    ok: bool | None
    summary: str
    seconds: float
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"step": self.step, "ok": self.ok, "summary": self.summary, "seconds": round(self.seconds, 3),
                "details": self.details}


@dataclass
class Context:
    session: HostSession
    pb: Playbook
    progress: Progress
    token: str
    holder: str
    secrets: dict = field(default_factory=dict)
    results: list = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.pb.host}/{self.pb.vmid}"

    def call(self, step: Step, *, payload: bytes | None = None, secrets: dict | None = None, on_event=None,
             fresh: bool = False, beat: bool = True, streaming: bool = False):
        """Run the step's agent action: over this container's agent session (one process for all of an
        operation's steps), or with fresh=True in a process of its own (the lock heartbeat, which runs beside a
        long step, and the calls of a driven step: fetch, install-vllm, under the python its drive names; vmid None:
        on the Proxmox host itself). Returns the typed result (orchestrator/agent/protocol.py)."""
        fill = {TOKEN: self.token, HOLDER: self.holder}
        args = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in step.args.items()}
        py = step.drive.get("python") or self.pb.conf.runtime.python
        how = "> (agent session)" if not fresh else f"$ {py} -   # on the host" if step.vmid is None else \
            f"$ pct exec {step.vmid} -- {py} -"
        self.progress.detail(self.where, self.session.audit.redact(
            f"{how} {step.action} {json.dumps(args, sort_keys=True)}"))
        kw = dict(payload=payload, secrets=secrets, bulk=step.bulk, timeout=step.timeout, on_event=on_event,
                  **({"streaming": True} if streaming else {}))  # deploy logs -f: events until the reader goes
        # the step's own bound when its title states one ("(timeout 900 s)", "within 60 s"), else the channel's;
        # beat=False: a background call (the lock's renewal) prints no "still waiting" of its own (issue 26)
        bounded = re.search(r"\btimeout \d|\bwithin \d", step.title or "")
        hb = self.progress.heartbeat(self.where, f"{step.name}: {step.title}", None if bounded else step.timeout) \
            if beat else contextlib.nullcontext()
        with hb:
            if fresh:
                return agent.call(self.session, step.vmid, py, step.action, args, **kw)
            return agent.session_for(self.session, step.vmid, self.pb.conf.runtime.python,
                                     self.pb.conf.runtime.state_dir).call(step.action, args, **kw)

    def record(self, name: str, ok: bool | None, summary: str, t0: float, **details) -> StepResult:
        r = StepResult(name, ok, summary, time.monotonic() - t0, details)
        self.results.append(r)
        self.progress.step(self.where, name, ok, summary, r.seconds)
        return r

    def fail(self, name: str, t0: float, message: str, *, fix: str = "", state_left: str = "", **details):
        self.record(name, False, message.splitlines()[0], t0, **details)
        raise StepFailed(name, message, where=self.where, fix=fix, details=details, state_left=state_left)


# ------------------------------------------------------------------ the step vocabulary the runners share


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
    refs = dict(pb.conf.serve.secret_env)
    if pb.conf.serve.api_key_env:
        refs["VLLM_API_KEY"] = pb.conf.serve.api_key_env
    out = {}
    for name, local in sorted(refs.items()):
        val = os.environ.get(local)
        if not val:
            key = "serve.api_key_env" if name == "VLLM_API_KEY" and local == pb.conf.serve.api_key_env \
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


def bare_context(session: HostSession, host: str, vmid: int | None, progress: Progress | None = None) -> Context:
    """A context on a container that no playbook is read for (deploy unlock, doctor, prepare's check, the router):
    its steps name their python (plan.step_on, plan_unlock)."""
    return Context(session, SimpleNamespace(host=host, vmid=vmid, runtime={}), progress or Progress(quiet=True), "",
                   holder_id())


def call_on(session: HostSession, step: Step, progress: Progress | None = None, **kw):
    """One planned step (plan.step_on) through Context.call, in a process of its own, on a bare context."""
    return bare_context(session, step.host, step.vmid, progress).call(step, fresh=True, beat=False, **kw)


def check_container(ctx: Context, step: Step) -> None:
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
