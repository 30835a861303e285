"""Follow a detached job in the container (fetch, install-vllm): the workstation's half of one loop.

The container's half is `agent/container/runner.py` (`follow_runner`): an `attach` call streams the runner's log
lines and progress events for at most `follow_s` seconds and answers with where it stopped (`log_pos`) and whether
the job ended (`done`). This side calls `attach` again and again, prints what comes (within the caps of
report.py: what the container sends is untrusted and bounded), and stops with a clear error on Ctrl-C, a lost
connection, a flood of output, or the job not ending within its limit. The job goes on in the container in every
case, and the message says how to re-attach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.core.errors import DeployError, Unreachable
from orchestrator.core.report import FOLLOW_LINE_MAX, FOLLOW_MAX_BYTES, FOLLOW_MAX_LINES
from orchestrator.steps.plan import Step, call_of


class Calls:
    """The planned calls of a driven step (plan.fetch_calls, plan.install_calls), sent through Context.call, each in
    a process of its own (the detached runner outlives them), with the run-time fields filled in; `python`, when
    set, replaces the planned interpreter (install's fallback). Each answer, checked, is read as its wire dict."""

    def __init__(self, ctx, step: Step):
        self.ctx, self.step, self.python = ctx, step, None

    def call(self, name: str, timeout: float | None = None, on_event=None, secrets=None, **fill) -> dict:
        s = call_of(self.step, name, timeout, **fill)
        if self.python:
            s.drive = dict(s.drive, python=self.python)
        return self.ctx.call(s, secrets=secrets, on_event=on_event, fresh=True, beat=False).as_dict()


@dataclass
class Job:
    """What is followed: `noun` (fetch, install: also the `event` field of its events and the answer's field that
    holds its record), the command that re-attaches, and how this command's errors are made (failed: a
    DeployError from a message and a fix; lost: an Unreachable one)."""
    noun: str
    command: str  # e.g. "deploy fetch qwen36-dflash"
    failed: Callable[..., DeployError]
    lost: Callable[..., Unreachable]


def follow(ctx, attach: Callable, job: Job, record: dict, *, limit_s: float, follow_s: float,
           render: Callable[[dict], "tuple[str, bool] | None"]) -> dict:
    """attach(pos, follow_s, on_event) -> answer, until the answer says done; returns that answer.
    render(event) -> (text, loud) or None (not shown): loud lines are said, the others are details (-v)."""
    t0 = time.monotonic()
    pos = 0
    seen = {"lines": 0, "bytes": 0}

    def on_event(ev):
        # the container chooses how much it sends: the whole follow prints at most FOLLOW_MAX_LINES lines and
        # FOLLOW_MAX_BYTES bytes (terminal and audit log alike); odd fields are ignored, not a traceback
        if not isinstance(ev, dict) or ev.get("event") != job.noun:
            return
        if seen["lines"] >= FOLLOW_MAX_LINES or seen["bytes"] >= FOLLOW_MAX_BYTES:
            return
        try:
            shown = render(ev)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return
        if shown is None:
            return
        text, loud = shown
        seen["lines"] += 1
        seen["bytes"] += len(text)
        (ctx.progress.say if loud else ctx.progress.detail)(ctx.where, text[:FOLLOW_LINE_MAX + 16])

    def goes_on() -> str:
        return (f"the {job.noun} goes on in the container (runner pid {record.get('pid')}, log "
                f"{record.get('log')})")

    again = f"{job.command} re-attaches to it and reports its result"
    while True:
        left = limit_s - (time.monotonic() - t0)
        step = max(1.0, min(follow_s, left))
        try:
            res = attach(pos, step, on_event)
        except KeyboardInterrupt:
            raise job.failed(f"interrupted: deploy stopped following; {goes_on()}", fix=again) from None
        except Unreachable as e:
            raise job.lost(f"lost the connection while following the {job.noun} ({e.message}); {goes_on()}",
                           fix=again) from e
        if not res.get("ok"):
            raise job.failed(res.get("message", "attach failed"), fix=res.get("fix", ""))
        pos = res.get("log_pos", pos)
        record = res.get(job.noun) or record
        if res.get("done"):
            return res
        if seen["lines"] >= FOLLOW_MAX_LINES or seen["bytes"] >= FOLLOW_MAX_BYTES:
            raise job.failed(f"the container sent more {job.noun} output than deploy follows ({seen['lines']} lines, "
                             f"{seen['bytes']} bytes; limits {FOLLOW_MAX_LINES} lines, {FOLLOW_MAX_BYTES} bytes); "
                             f"deploy stopped following, {goes_on()}",
                             fix=f"look at the {job.noun}'s log in the container; {again}")
        if left <= step:
            phase = f" (phase {record.get('phase')})" if record.get("phase") else ""
            raise job.failed(f"the {job.noun} has not ended {limit_s:.0f}s after deploy started following it{phase}; "
                             "it goes on in the container", fix=f"{job.command} re-attaches to it")


def when(at) -> str:
    """A record's time (seconds since the epoch) as people read it, in UTC."""
    if not at:
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(at)))


class Every:
    """At most one event a second of a chatty kind (progress, heartbeat)."""

    def __init__(self, seconds: float = 1.0):
        self.seconds, self.at = seconds, 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.at < self.seconds:
            return False
        self.at = now
        return True
