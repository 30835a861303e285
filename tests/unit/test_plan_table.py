"""Issue 39: one table from a step's name to its runner and its agent action (ops.STEPS). Every step that any plan
makes (up, restart, down, apply-config, fetch, install-vllm, with the fallback's own steps) is in it, and sends
the agent action the table names, which the agent knows (agent/container/main.py ACTIONS). Nothing remote runs."""

import dataclasses

from orchestrator.deploy import ops
from orchestrator.steps import plan as P
from orchestrator.agent.container.main import ACTIONS
from orchestrator.core.spec import load_playbook
from test_spec import edit, inv, work  # noqa: F401 - the fixture

MODEL = "model:\n  path: /root/models/Qwen3.6-27B\n"


def _all_steps(steps):
    for s in steps:
        yield s
        yield from _all_steps(s.sub)


def test_every_planned_step_is_in_the_one_table(work):
    edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\n")
    pbs = [load_playbook(str(work / "playbooks" / f"{n}.yaml"), inv(work)) for n in ("qwen36-dflash", "qwen36-mtp")]
    edit(work, "qwen36-mtp", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\nfetch:\n  store: /srv/vpd-store\n")
    pbs.append(load_playbook(str(work / "playbooks" / "qwen36-mtp.yaml"), inv(work)))  # the host's store's calls
    seen = set()
    for pb in pbs:
        plans = [P.plan_up(pb, ask=True, clean_gpus=True), P.plan_up(pb, restart=True, fetch=False),
                 P.plan_down(pb, clean_gpus=True, ask=True), P.plan_install(pb), P.plan_install(pb, rollback=True)]
        plans += [P.plan_apply_config(pb)] if pb.conf.speculative.drafter else []
        plans += [P.plan_verify(pb)]
        plans += [P.plan_up(dataclasses.replace(pb, spec_off=True, fallback=None))]  # deploy tune's baseline
        plans += [P.plan_fetch(pb, rehash=True, connections=2, manifest=True)] if P.fetch_args(pb) else []
        plans += [P.plan_unlock(pb.host, pb.vmid, pb.conf.runtime)]
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
                       "transfer": {"connections": 3, "range_bytes": 64 << 20}, "python": pb.conf.runtime.python}
    assert f.args["rehash"] is True and f.args["items"][0]["hub"] == "Qwen/Qwen3.6-27B"
    up_fetch = next(s for s in P.plan_up(pb, fetch=False) if s.name == "fetch")
    assert up_fetch.drive["allow_start"] is False and "--no-fetch" in up_fetch.title
    i = P.plan_install(pb, force=True)[-1]
    assert (i.drive["rollback"], i.drive["force"], i.args["op"]) == (False, True, "probe")
    # every later call is a planned sub-step: install.run fills in only the runner's id and position (issue 51)
    assert {c.name: c.args["op"] for c in i.sub} == {"install-start": "start", "install-attach": "attach",
                                                     "install-rollback": "rollback"}
    start = P.call_of(i, "install-start")
    assert start.args["req"] == "vllm==0.34.0" and start.args["follow_s"] == 0 and start.vmid == pb.vmid
    attach = P.call_of(i, "install-attach", 30, id="abc", log_pos=7)
    assert (attach.args["id"], attach.args["log_pos"], attach.timeout, attach.args["req"]) == ("abc", 7, 30, "vllm==0.34.0")
    assert i.args["req"] == "vllm==0.34.0" and i.args["check"]["method"] == "dflash"
    assert [c.name for c in f.sub] == ["fetch-start", "fetch-attach"] and f.sub[0].args["connections"] == 3


def test_the_store_calls_are_planned_on_the_host_and_shown(work):
    """Issue 51: fetch.store's calls (mark, probe, start, attach, records on the host; link in the container) are
    sub-steps of the step fetch, each with its exact command in `deploy plan`."""
    edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\nfetch:\n  store: /srv/st\n")
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    f = P.plan_fetch(pb)[-1]
    names = [c.name for c in f.sub]
    assert names[:6] == ["store-mark", "store-probe", "store-start", "store-attach", "store-records", "store-link"]
    rows = {r["step"]: r for r in f.as_dict(inv(work), pb.conf.runtime.python)["steps"]}
    assert rows["store-mark"]["command"].startswith("python3 - store ") and "/srv/st" in rows["store-mark"]["command"]
    assert rows["store-records"]["command"].startswith("python3 - fetch ") and "/srv/st/.deploy-state" in \
        rows["store-records"]["command"]
    assert rows["store-link"]["command"].startswith(f"pct exec {pb.vmid} ")


def test_verify_is_a_read_only_plan_with_its_exact_requests(work):
    """Issue 51: deploy verify runs plan_verify through ops.execute; `deploy plan --op verify` shows it."""
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    assert [s.name for s in P.plan_verify(pb)] == ["verify", "gpu-plumbing"]
    edit(work, "qwen36-dflash", MODEL, MODEL + "  hub: Qwen/Qwen3.6-27B\n  revision: main\n")
    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    steps = P.plan_verify(pb)
    assert [s.name for s in steps] == ["verify", "gpu-plumbing", "revisions"]
    assert all(s.drive.get("report") for s in steps[:2]) and not any(s.action == "lock" for s in steps)
    rev = steps[-1]
    assert rev.action == "fetch" and rev.args["op"] == "records"
    assert rev.args["dests"] == ["/root/models/Qwen3.6-27B", "/root/models/Qwen3.6-27B-DFlash"]
    assert rev.drive["roles"] == {"model": rev.args["dests"][0], "drafter": rev.args["dests"][1]}


def test_compare_is_up_with_the_fallback_off_then_the_sweep_and_plan_shows_it(work):
    """Issue 51: compare's sweep is declared in plan.py with the other steps (step_sweep); `deploy plan --op compare`
    shows compare's run of a playbook with its defaults: up without the fallback, then the sweep."""
    import json

    from click.testing import CliRunner

    from orchestrator.cli import main

    pb = load_playbook(str(work / "playbooks" / "qwen36-dflash.yaml"), inv(work))
    steps, p = P.plan_compare(pb), pb.conf.acceptance.probe
    assert "fallback" in [s.name for s in P.plan_up(pb)] and "fallback" not in [s.name for s in steps]
    assert [s.name for s in steps] == [s.name for s in P.plan_up(pb.variant())] + ["sweep"]
    sw = steps[-1]
    assert (sw.action, sw.phase, sw.args["levels"], sw.args["rounds"], sw.args["prompts"]) == (
        "sweep", "measure", [1, 4, 16], p.rounds, list(p.prompts))
    assert sw.timeout == p.timeout_s * 2 * 3 + 30 and sw.args["state_dir"] == pb.conf.runtime.state_dir
    res = CliRunner().invoke(main, ["--inventory", str(work / "hosts.yaml"), "--json", "plan",
                                    str(work / "playbooks" / "qwen36-dflash.yaml"), "--op", "compare"])
    assert res.exit_code == 0, res.output
    last = json.loads(res.output)["steps"][-1]
    assert last["step"] == "sweep" and last["command"].startswith(f"pct exec {pb.vmid} ") and " - sweep " in \
        last["command"]


# ---- every remote call a planned step (issue 51): direct agent calls outside the executor, counted per module.
# The executor's one route is steps.Context.call (steps/__init__.py); the agent package defines the calls. Today's
# counts are a ceiling: move a call into a planned step (plan.py builds it, a runner in ops.STEPS sends it via
# Context.call) and lower its number here.
DIRECT_CALLS_CEILING: dict = {}  # 0: a new direct call fails here


def direct_agent_calls() -> dict:
    import ast
    import os

    pkg = os.path.dirname(os.path.dirname(ops.__file__))  # orchestrator/ (ops.py is in deploy/)
    out = {}
    for root, _, files in os.walk(pkg):
        rel_root = os.path.relpath(root, pkg)
        if rel_root.split(os.sep)[0] == "agent":
            continue
        for f in files:
            rel = os.path.normpath(os.path.join(rel_root, f))
            if not f.endswith(".py") or rel == os.path.join("steps", "__init__.py"):
                continue
            with open(os.path.join(root, f)) as fh:
                tree = ast.parse(fh.read())
            n = sum(1 for c in ast.walk(tree) if isinstance(c, ast.Call) and (
                isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                and c.func.value.id == "agent" and c.func.attr in ("call", "session_for", "AgentSession")
                or isinstance(c.func, ast.Name) and c.func.id in ("session_for", "AgentSession")))
            if n:
                out[rel] = n
    return out


def test_direct_agent_calls_only_go_down():
    got = direct_agent_calls()
    over = {m: (n, DIRECT_CALLS_CEILING.get(m, 0)) for m, n in got.items() if n > DIRECT_CALLS_CEILING.get(m, 0)}
    assert not over, (f"agent calls outside the executor above the ceiling (module: (now, ceiling)): {over}; make it "
                      "a planned step (plan.py) run by ops.execute, whose runner calls Context.call")
    # 18 in 9 modules by this count before issue 51; verify's records read, fetch (its store, --manifest), install-vllm
    # and unlock are steps run by ops.execute now; doctor's reads, prepare's check and the router's ops are planned
    # steps (plan.step_on) sent through Context.call (steps.call_on), and so are status's and logs' reads
    assert sum(got.values()) == 0
