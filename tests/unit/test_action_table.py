"""Issue 51: every agent action is declared once (agent/container/protocol.py DECLARED: the function that runs it
and the fields its result must carry); the agent's ACTIONS and the wire's REQUIRED come from it, the tool's result
dataclass is registered under the same name, and an action that a planned step sends has its runner in ops.STEPS.
This test fails when an action lacks any of those parts."""

import importlib
from dataclasses import fields

import pytest

from orchestrator.deploy import ops
from orchestrator.agent.container import main as agent_main
from orchestrator.agent.container import protocol as wire
from orchestrator.agent.protocol import RESULT_TYPES, AgentResult, ProtocolError, result

# actions no planned step sends yet, each with who sends it instead (issue 51: "every remote call a planned step";
# this list may only shrink)
NOT_A_STEP = {
    "doctor": "doctor.py: a plan.step_on step sent through Context.call (steps.call_on), read-only",
    "drafter_scan": "doctor.py: a plan.step_on step, like doctor",
    "logs": "status.py: deploy logs (read-only)",
    "router": "replica_router.py: a plan.step_on step per op, sent through Context.call (steps.call_on)",
    "sweep": "plan.step_sweep (deploy plan --op compare shows it), sent by compare.py after up, not by execute()",
    "tune_record": "plan.step_tune_record, sent by tune.py after the sweep (the verdict beside the launch it left running)",
    "fetch_run": "the detached runner: started by the agent's fetch start, in the container",
    "install_run": "the detached runner: started by the agent's install_vllm start, in the container",
    "stack_check": "the install runner, in a staging venv, in the container",
}


def _step_actions():
    out = set()
    for _, action in ops.STEPS.values():
        out |= set(action) if isinstance(action, tuple) else {action}
    return out - {None}


@pytest.mark.parametrize("action", sorted(wire.DECLARED))
def test_each_action_has_every_part(action):
    target, required = wire.DECLARED[action]
    mod, fn = target.split(":")
    module = importlib.import_module(f"orchestrator.agent.container.{mod}")
    assert callable(getattr(module, fn, None)), f"{action}: {target} does not name a function of the agent"
    assert agent_main.ACTIONS[action] == target and agent_main.handler(action) is getattr(module, fn)
    assert isinstance(required, tuple) and all(isinstance(k, str) for k in required), action
    assert wire.REQUIRED[action] == required
    typ = RESULT_TYPES.get(action)
    assert typ is not None and issubclass(typ, AgentResult), f"{action}: no result dataclass (agent/protocol.py)"
    known = {f.name for f in fields(typ)}
    assert set(required) <= known, f"{action}: {typ.__name__} lacks the required field(s) {set(required) - known}"
    assert action in _step_actions() or action in NOT_A_STEP, f"{action}: no row of ops.STEPS sends it"


def test_the_tables_are_the_declaration():
    assert set(agent_main.ACTIONS) == set(wire.REQUIRED) == set(RESULT_TYPES) == set(wire.DECLARED)
    assert _step_actions() <= set(wire.DECLARED), f"ops.STEPS sends undeclared actions: {_step_actions() - set(wire.DECLARED)}"
    assert not set(NOT_A_STEP) & _step_actions(), "an action now sent by a step: remove it from NOT_A_STEP"
    assert set(NOT_A_STEP) <= set(wire.DECLARED)


def test_a_result_type_for_an_undeclared_action_is_refused():
    with pytest.raises(ProtocolError, match="no agent action 'gpu_clock' is declared"):
        result("gpu_clock")(type("GpuClockResult", (AgentResult,), {}))


def test_a_result_missing_a_declared_field_is_refused_on_both_sides():
    with pytest.raises(ProtocolError, match="'gpu_read' result lacks holders"):
        RESULT_TYPES["gpu_read"].parse("gpu_read", {"memory": {}})
    with pytest.raises(wire.ProtocolError, match="'fetch' result lacks ok"):
        wire.check("fetch", {"items": []})
    r = RESULT_TYPES["fetch"].parse("fetch", {"ok": True, "fetch": {"pid": 3}, "newer": 1})
    assert r.fetch == {"pid": 3} and r.extra == {"newer": 1} and r.as_dict()["newer"] == 1
