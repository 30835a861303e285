"""Step units: each takes the run context and a planned Step, runs it, and returns a StepResult or raises
StepFailed with what failed, where, expected vs found, and what to do next."""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field

from .. import agent
from ..errors import DeployError, StepFailed  # noqa: F401 (StepFailed: re-exported)
from ..plan import HOLDER, TOKEN, Step
from ..remote import HostSession
from ..report import Progress
from ..spec import Playbook


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
             fresh: bool = False, beat: bool = True):
        """Run the step's agent action: over this container's agent session (one process for all of an
        operation's steps), or with fresh=True in a process of its own (the lock heartbeat, which runs beside a
        long step). Returns the typed result (orchestrator/agent/protocol.py)."""
        fill = {TOKEN: self.token, HOLDER: self.holder}
        args = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in step.args.items()}
        how = f"$ pct exec {step.vmid} -- {self.pb.runtime['python']} -" if fresh else "> (agent session)"
        self.progress.detail(self.where, self.session.audit.redact(
            f"{how} {step.action} {json.dumps(args, sort_keys=True)}"))
        kw = dict(payload=payload, secrets=secrets, bulk=step.bulk, timeout=step.timeout, on_event=on_event)
        # the step's own bound when its title states one ("(timeout 900 s)", "within 60 s"), else the channel's;
        # beat=False: a background call (the lock's renewal) prints no "still waiting" of its own (issue 26)
        bounded = re.search(r"\btimeout \d|\bwithin \d", step.title or "")
        hb = self.progress.heartbeat(self.where, f"{step.name}: {step.title}", None if bounded else step.timeout) \
            if beat else contextlib.nullcontext()
        with hb:
            if fresh:
                return agent.call(self.session, step.vmid, self.pb.runtime["python"], step.action, args, **kw)
            return agent.session_for(self.session, step.vmid, self.pb.runtime["python"],
                                     self.pb.runtime.get("state_dir")).call(step.action, args, **kw)

    def record(self, name: str, ok: bool | None, summary: str, t0: float, **details) -> StepResult:
        r = StepResult(name, ok, summary, time.monotonic() - t0, details)
        self.results.append(r)
        self.progress.step(self.where, name, ok, summary, r.seconds)
        return r

    def fail(self, name: str, t0: float, message: str, *, fix: str = "", state_left: str = "", **details):
        self.record(name, False, message.splitlines()[0], t0, **details)
        raise StepFailed(name, message, where=self.where, fix=fix, details=details, state_left=state_left)
