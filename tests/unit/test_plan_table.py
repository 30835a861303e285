"""Issue 39: one table from a step's name to its runner and its agent action (ops.STEPS). Every step that any plan
makes (up, restart, down, apply-config, fetch, install-vllm, with the fallback's own steps) is in it, and sends
the agent action the table names, which the agent knows (agent/container/main.py ACTIONS). Nothing remote runs."""

import dataclasses

from orchestrator import ops
from orchestrator import plan as P
from orchestrator.agent.container.main import ACTIONS
from orchestrator.spec import load_playbook
from test_spec import edit, inv, work  # noqa: F401 - the fixture

MODEL = "model:\n  path: /root/models/Qwen3.6-27B\n"


def _all_steps(steps):
    for s in steps:
        yield s
        yield from _all_steps(s.sub)


def test_every_planned_step_is_in_the_one_table(work):
    edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\n")
    pbs = [load_playbook(str(work / "playbooks" / f"{n}.yaml"), inv(work)) for n in ("qwen36-dflash", "qwen36-mtp")]
    seen = set()
    for pb in pbs:
        plans = [P.plan_up(pb, ask=True, clean_gpus=True), P.plan_up(pb, restart=True, fetch=False),
                 P.plan_down(pb, clean_gpus=True, ask=True), P.plan_install(pb), P.plan_install(pb, rollback=True)]
        plans += [P.plan_apply_config(pb)] if pb.drafter else []
        plans += [P.plan_up(dataclasses.replace(pb, spec_off=True, fallback=None))]  # deploy tune's baseline
        plans += [P.plan_fetch(pb, rehash=True, connections=2)] if P.fetch_args(pb) else []
        for plan in plans:
            for s in _all_steps(plan):
                assert s.name in ops.STEPS, f"step {s.name} of {pb.name} has no row in ops.STEPS"
                runner, action = ops.STEPS[s.name]
                allowed = action if isinstance(action, tuple) else (action,)
                assert s.action in allowed, (s.name, s.action, action)
                assert s.action is None or s.action in ACTIONS, f"the agent knows no action {s.action}"
                assert ops.RUNNERS[s.name] is runner
                seen.add(s.name)
    assert seen == set(ops.STEPS), f"rows no plan uses: {set(ops.STEPS) - seen}"


def test_fetch_and_install_steps_carry_how_they_are_driven(work):
    edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\n")
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    f = P.plan_fetch(pb, rehash=True, connections=3, timeout_s=100)[-1]
    assert f.drive == {"allow_start": True, "rehash": True, "timeout_s": 100,
                       "transfer": {"connections": 3, "range_bytes": 64 << 20}}
    assert f.args["rehash"] is True and f.args["items"][0]["hub"] == "Qwen/Qwen3.6-27B"
    up_fetch = next(s for s in P.plan_up(pb, fetch=False) if s.name == "fetch")
    assert up_fetch.drive["allow_start"] is False and "--no-fetch" in up_fetch.title
    i = P.plan_install(pb, force=True)[-1]
    assert i.drive == {"rollback": False, "force": True} and i.args["op"] == "probe"
    assert i.args["req"] == "vllm==0.34.0" and i.args["check"]["method"] == "dflash"
