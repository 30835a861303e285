"""The decisions of up, restart, down and the fallback, without root and without a test bed: a fake transport at
the very edge (the host session) answers each agent action with a recorded result, and the real plan, executor,
step runners and agent-protocol parsing run above it (as pyinfra tests operations from fixtures).

Each test states the situation (recorded results in) and checks the decision (the agent actions that ran, in
order, with their planned arguments, and the outcome). A last check holds for every test: every remote command
the executor ran is one of the planned steps' commands: the plan is the program."""

from __future__ import annotations

import json
import os

import pytest

from orchestrator import ops
from orchestrator import plan as P
from orchestrator.agent.protocol import PROTOCOL
from orchestrator.remote import AuditLog, Fleet, Result
from orchestrator.report import Progress
from orchestrator.spec import load_inventory, load_playbook

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUDIT = os.path.join(os.environ.get("TMPDIR", "/tmp"), "vpd-decisions-audit-%d.jsonl" % os.getpid())


def metrics(drafts: int, draft_tokens: int, accepted: int, k: int = 15) -> str:
    per = [max(0, accepted // drafts - i) if drafts else 0 for i in range(k)]
    lines = [f"vllm:spec_decode_num_drafts_total {drafts}", f"vllm:spec_decode_num_draft_tokens_total {draft_tokens}",
             f"vllm:spec_decode_num_accepted_tokens_total {accepted}"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}' for i, v in enumerate(per)]
    return "\n".join(lines) + "\n"


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

    def ct(self, vmid, argv, stdin=None, timeout=60, label="", on_line=None):
        action, args = argv[2], json.loads(argv[3])
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
    sha = pb.drafter["sha256"]
    good = metrics(10, 150, 90)
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
        "acceptance": {"ok": True, "before": metrics(0, 0, 0), "after": good, "sent": 6, "succeeded": 6, "errors": []},
        "note_failure": {"ok": True},
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
        elif s.host_argv:
            known.setdefault(" ".join(s.host_argv[:2]), []).append({})
    volatile = {"token", "holder", "workstation", "pid", "pid_start", "wait_s", "renew", "failure", "break_token"}
    for action, args in sess.calls:
        if action == "pct list":
            continue  # named in gpus-free's `runs` (who else is given a busy GPU)
        assert action in known, f"{action} ran but is not in the plan"
        trimmed = {k: v for k, v in args.items() if k not in volatile}
        assert any({k: v for k, v in a.items() if k not in volatile} == trimmed for a in known[action]), \
            f"{action} ran with {trimmed}, not as planned"


FULL_UP = ["pct status", "lock", "status", "write_file", "verify", "gpus_free", "port_check", "launch", "wait_ready",
           "file_sha", "acceptance", "unlock"]


def test_up_on_an_empty_container_runs_the_plan_in_order_and_skips_stop(world):
    out, actions, _ = run_up(world, healthy_script(world[1]))
    assert out.ok and out.status == "up", out.error and out.error.render()
    assert actions == FULL_UP  # `stop` skipped: nothing to stop
    assert [r.step for r in out.results] == ["container", "lock", "current", "drafter-config", "verify", "gpus-free",
                                             "port-free", "launch", "wait-ready", "aux-layers", "drift", "acceptance"]
    assert out.info["acceptance"]["draft_acceptance_rate"] == pytest.approx(0.6)


def test_already_up_stops_after_reading_the_current_state(world):
    inv, pb = world
    cur = {"state": {"alive": True, "pid": 7, "argv": P.serve_argv(pb), "playbook": pb.name,
                     "playbook_sha256": pb.sha256}, "drafter_sha256": pb.drafter["sha256"], "health": 200,
           "models": [pb.serve["served_model_name"]], "vllm_processes": []}
    out, actions, _ = run_up(world, healthy_script(pb, status=cur))
    assert out.ok and out.status == "already up"
    assert actions == ["pct status", "lock", "status", "unlock"]


def test_identical_but_unhealthy_deployment_is_restarted(world):
    inv, pb = world
    cur = {"state": {"alive": True, "pid": 7, "argv": P.serve_argv(pb), "playbook": pb.name,
                     "playbook_sha256": pb.sha256}, "drafter_sha256": pb.drafter["sha256"], "health": 503,
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


def test_low_acceptance_falls_back_under_the_same_lock_without_fuser(world):
    inv, pb = world
    low = metrics(10, 150, 2)  # 1.3 %: the guessed config of the field report
    mtp = metrics(10, 20, 14)  # 70 %
    script = healthy_script(pb, acceptance=[{"ok": True, "before": metrics(0, 0, 0), "after": low, "sent": 6,
                                        "succeeded": 6, "errors": []},
                                       {"ok": True, "before": metrics(0, 0, 0), "after": mtp, "sent": 4,
                                        "succeeded": 4, "errors": []}],
                            status=[{"state": None, "vllm_processes": []},
                                    {"state": None, "vllm_processes": []}])
    out, actions, sess = run_up(world, script)
    assert not out.ok and out.status == "fell back" and out.error.step == "acceptance"
    assert out.fallback is not None and out.fallback.ok and out.fallback.playbook == "qwen36-mtp"
    # one lock for both; the low-acceptance stop, then the fallback's own steps; no second container check
    assert actions == FULL_UP[:-1] + ["stop", "status", "verify", "gpus_free", "port_check", "launch",
                                      "wait_ready", "acceptance", "unlock"]
    assert all(a["clean_gpus"] is False for n, a in sess.calls if n == "stop")


def test_failure_after_launch_stops_the_server_checks_drift_and_leaves_a_record(world):
    inv, pb = world
    fatal = {"ready": False, "reason": "fatal", "cause": "CUDA out of memory", "line": "torch.OutOfMemoryError",
             "fix": "lower serve.gpu_memory_utilization in PLAYBOOK"}
    out, actions, sess = run_up(world, healthy_script(pb, wait_ready=fatal))
    assert not out.ok and out.error.step == "wait-ready"
    assert actions == FULL_UP[:-3] + ["stop", "file_sha", "file_sha", "note_failure", "unlock"]
    # stop-failed, drift-check (unchanged: the failure stays wait-ready's), read-back, the record
    assert "the failed server had already exited" in out.error.state_left
    assert "read now: sha256 " + pb.drafter["sha256"] + ", the pinned bytes" in out.error.state_left
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
    from orchestrator.errors import EXIT_INTERRUPTED, Interrupted

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
