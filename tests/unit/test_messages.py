"""Messages a user can trust: every kind rendered at 80 columns loses no text; fixes name what to run."""

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

from orchestrator.core.errors import DeployError, SpecError
from orchestrator.core.report import Progress, SafeStream, check_rows, table, wrap
from orchestrator.observe.status import _row
from orchestrator.observe.status_render import render_table
from orchestrator.steps import StepFailed

LONG_PATH = "/root/models/Qwen3.6-27B-DFlash-with-a-very-long-directory-name/snapshots/0123456789abcdef/config.json"
SHA = "5d208bf4315f0ab499cbe48effa3473e33a5020c04e9b81fff139cb3d4ed3ede"


def norm(text: str) -> str:
    return " ".join(text.split())


def assert_whole(value: str, out: str):
    assert norm(value) in norm(out), f"lost text: {value!r}\nin:\n{out}"


def assert_fits_or_unbreakable(out: str, width: int, table_rows: int = 0):
    """Text fits `width` except a single word longer than the width (a path, a hash). The first `table_rows`
    lines (a table of short values that cannot be narrowed further) may be wider: the terminal wraps them."""
    for ln in out.splitlines()[table_rows:]:
        if len(ln) > width:
            assert any(len(w) > width // 3 for w in ln.split()), f"line over {width} columns: {ln!r}"


CHECKS = [
    {"check": "path", "ok": True, "expected": LONG_PATH, "on_disk": LONG_PATH, "as_loaded": None, "reason": ""},
    {"check": "sha256", "ok": False, "expected": "df82" * 16, "on_disk": SHA, "as_loaded": None,
     "reason": f"the file vLLM reads is not the pinned config ({LONG_PATH})"},
    {"check": "field layer_types", "ok": False, "expected": ["sliding_attention"] * 4 + ["full_attention"],
     "on_disk": ["full_attention"] * 5, "as_loaded": None, "reason": "differs from the pinned config"},
    {"check": "vllm extensions", "ok": False, "expected": "complete build",
     "on_disk": ["_C_stable_libtorch.abi3.so", "_moe_C.abi3.so"], "as_loaded": None,
     "reason": "compiled extension(s) missing: _C_stable_libtorch.abi3.so, _moe_C.abi3.so (an incomplete build)"},
    {"check": "fix: DFlash sliding window", "ok": False, "expected": ">= 0.26 or the PR #40898 build",
     "on_disk": "0.25.0", "as_loaded": None,
     "reason": "vLLM 0.25.0 refuses mixed sliding/full DFlash drafters (NotImplementedError)"},
]


@pytest.mark.parametrize("width", [80, None])
def test_verify_table_keeps_every_value(width):
    rows = check_rows(CHECKS)
    out = table(rows, ["check", "expected", "on disk", "as loaded", "verdict", "reason"], width)
    assert "~" not in out
    for r in rows:
        for v in r:
            assert_whole(v, out)
    if width:
        head = out.split("\n\n")[0].splitlines()
        assert "Details:" in out and max(map(len, head)) < 100  # long values moved; what stays is short
        assert_fits_or_unbreakable(out, width, table_rows=len(head))
    else:  # not a TTY: one line per row
        assert len([ln for ln in out.splitlines() if ln.startswith(("path", "sha256", "field", "vllm", "fix"))]) == 5


def test_status_table_and_problems_at_80_columns():
    problems = [f"the last deploy up/restart of qwen36-dflash failed at 2026-12-03 20:04:13 (drift: the drafter "
                f"config changed behind our back while vLLM started: {LONG_PATH} now has sha256 {SHA})",
                "nvidia-smi: `nvidia-smi --query-gpu=index,memory.used,memory.total` did not answer within 5 s"]
    rows = [_row("pve1", 129, container="running", process="failed", playbook="qwen36-dflash", problems=problems),
            _row("pve2", 129, reachable=False, timed_out=True, problems=["no answer within 1 s (fix: raise "
                                                                         "--deadline)"]),
            _row("pve3", 129, reachable=False, problems=["cannot connect: Connection refused"])]
    rows[0]["last_error"] = "torch.OutOfMemoryError: CUDA out of memory. " * 6
    out = render_table(rows, False, 80)
    for p in problems + ["no answer within 1 s (fix: raise --deadline)", rows[0]["last_error"].strip()]:
        assert_whole(p, out)
    assert "TIMEOUT" in out and "UNREACHABLE" in out and "~" not in out
    assert_fits_or_unbreakable(out, 80, table_rows=2 + len(rows))
    full = render_table(rows, False, None)  # not a TTY: every problem on one line
    assert f"  pve1/129: {problems[0]}" in full.splitlines()


def test_acceptance_cell_before_any_draft():
    r = _row("pve1", 129, healthy=True, process="running")
    r["acceptance"] = {"lifetime": {"draft_acceptance_rate": None, "mean_acceptance_length": None, "drafts": 0},
                       "recent": None}
    out = render_table([r], False, None)
    assert "no drafts yet" in out and "-/0.0" not in out


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_wraps_on_a_tty_and_keeps_whole_lines_otherwise(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("NO_COLOR", "1")
    msg = f"FAIL drafter-config  cannot write {LONG_PATH}: Read-only file system; the old file is untouched"
    tty = FakeTTY()
    Progress(stream=tty).say("pve1/129", msg)
    assert_whole(msg, tty.getvalue())
    assert_fits_or_unbreakable(tty.getvalue(), 80)
    plain = io.StringIO()
    Progress(stream=plain).say("pve1/129", msg)
    assert len(plain.getvalue().splitlines()) == 1 and msg in plain.getvalue()


def test_errors_render_whole():
    e = StepFailed("wait-ready", "vLLM failed to start: CUDA out of memory\n    > " + "x" * 500,
                   where="pve1/129", fix="lower serve.gpu_memory_utilization", state_left="nothing was changed")
    out = e.render()
    assert "x" * 500 in out and "fix: lower serve.gpu_memory_utilization" in out and "state left:" in out
    s = SpecError([f"p.yaml:{i}:1: key{i}: problem {i}" for i in range(3)])
    assert all(f"key{i}: problem {i}" in s.render() for i in range(3)) and "3 problem(s)" in s.render()


def test_wrap_never_breaks_a_word():
    out = wrap("see " + LONG_PATH + " now", 40, indent=4)
    assert LONG_PATH in out.split()


def test_a_closed_stream_is_dropped_not_raised():
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise io.UnsupportedOperation

    s = SafeStream(Closed())
    assert s.write("hello\n") == 6 and s.closed_by_reader
    s.flush()
    p = Progress(stream=Closed())
    p.say("pve1/129", "still going")  # no exception: the operation goes on
    assert p.quiet


def test_waits_print_on_change_only(monkeypatch):
    out = io.StringIO()
    p = Progress(stream=out)
    for _ in range(55):
        p.waiting("pve1/129", "GPU0 30000 MiB", "waiting for GPU memory: GPU0 30000 MiB")
    p.waiting("pve1/129", "GPU0 100 MiB", "waiting for GPU memory: GPU0 100 MiB")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    monkeypatch.setattr(Progress, "WAIT_EVERY_S", 0.0)  # the same reading again after 10 s: a line again
    p.waiting("pve1/129", "GPU0 100 MiB", "waiting for GPU memory: GPU0 100 MiB")
    assert len(out.getvalue().splitlines()) == 3


def test_heartbeat_names_a_silent_step():
    out = io.StringIO()
    p = Progress(stream=out)
    with p.heartbeat("pve1/129", "current: read what runs there now", 20, quiet_s=0.2):
        time.sleep(0.6)
    assert "still waiting: current: read what runs there now" in out.getvalue()


def test_cli_usage_errors_before_anything_runs():
    from click.testing import CliRunner

    from orchestrator.cli import main

    r = CliRunner()
    for args, text in [(["logs", "pve1/129", "--grep", "("], "not a valid regular expression"),
                       (["status", "--deadline", "0"], "--deadline"),
                       (["status", "--watch", "-1"], "--watch"),
                       (["up", "x", "--wait-lock", "-5"], "--wait-lock"),
                       (["logs", "pve1/129", "-n", "0"], "-n"),
                       (["--json", "testbed", "fault", "pve1", "x"], "--json is not supported")]:
        res = r.invoke(main, args)
        assert res.exit_code == 2, (args, res.output)
        assert text in res.output, (args, res.output)
    res = r.invoke(main, ["--json", "logs", "pve1/129"])
    assert res.exit_code == 2 and "has no --json output" in res.output


def test_deploy_error_fix_text_is_rendered():
    e = DeployError("boom", where="pve1", fix="deploy status")
    assert e.render() == "pve1: boom\n  fix: deploy status"
    assert re.search(r"fix: deploy", e.render())


# ------------------------------------------------------------------ validation and fixes, without a test bed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inventory(tmp_path, identity):
    p = tmp_path / "hosts.yaml"
    p.write_text("hosts:\n  - name: pve1\n    address: 127.0.0.1\n    identity_file: %s\n    containers:\n"
                 "      - vmid: 129\n        gpus: [0, 1, 2, 3]\n" % identity)
    return str(p)


def test_missing_or_empty_identity_file_is_a_validation_error(tmp_path):
    from orchestrator.core.spec import load_inventory

    with pytest.raises(SpecError) as e:
        load_inventory(_inventory(tmp_path, "keys/nope"))
    msg = e.value.render()
    assert "hosts[0].identity_file: no such file: " + str(tmp_path / "keys" / "nope") in msg
    assert "ssh-keygen -t ed25519 -f" in msg and e.value.exit_code == 2
    (tmp_path / "empty").write_text("")
    with pytest.raises(SpecError) as e:
        load_inventory(_inventory(tmp_path, "empty"))
    assert "is empty: not a private key" in e.value.render()
    (tmp_path / "key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    assert load_inventory(_inventory(tmp_path, "key")).hosts["pve1"].identity_file == str(tmp_path / "key")


def test_status_on_an_empty_inventory_says_what_to_do(tmp_path):
    from click.testing import CliRunner

    from orchestrator.cli import main

    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts: []\n")
    res = CliRunner().invoke(main, ["-i", str(inv), "status"])
    assert res.exit_code == 2, res.output
    assert "lists no hosts" in res.output and "deploy testbed up" in res.output and "DEPLOY_INVENTORY" in res.output


def test_every_playbook_problem_at_once_unknown_keys_included(tmp_path, monkeypatch):
    from orchestrator.core.spec import load_playbook
    from playbook_support import copy_playbooks

    p = copy_playbooks(tmp_path / "playbooks") / "qwen36-dflash.yaml"
    text = p.read_text()
    text = re.sub(r"attention_backend: \S+", "attention_backend: flashinfer", text)
    text = re.sub(r"num_speculative_tokens: \d+", "num_speculative_tokens: 16", text)
    text = text.replace("\nserve:\n", "\nbogus_key: 1\nserve:\n", 1)
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        load_playbook(str(p), None)
    probs = "\n".join(e.value.problems)
    assert len(e.value.problems) == 3, probs
    assert "bogus_key: unknown key" in probs and "serve.attention_backend" in probs
    assert "speculative.num_speculative_tokens: 16 exceeds" in probs


def _pb(name="qwen36-dflash"):
    from orchestrator.core.spec import load_playbook

    return load_playbook(f"{REPO}/playbooks/{name}.yaml", None)


def test_verify_fixes_name_the_command_for_each_failure_class():
    from orchestrator.steps.drafter import verify_fix

    pb = _pb()
    ext = verify_fix([{"check": "vllm extensions", "ok": False}], pb, {"version": "0.34.0"})
    assert "--force-reinstall --no-deps 'vllm==0.34.0'" in ext and ">= 0.26.0" not in ext
    assert "pip install 'vllm>=0.26.0'" in verify_fix([{"check": "fix: DFlash sliding window", "ok": False}], pb,
                                                       {"version": "0.25.0"})
    stale = verify_fix([{"check": "sha256", "ok": False}, {"check": "field layer_types", "ok": False},
                        {"check": "target_layer_ids range", "ok": False}], pb, {"version": "0.34.0"})
    assert stale == "deploy up qwen36-dflash installs the pinned config (or deploy apply-config qwen36-dflash)"
    own = verify_fix([{"check": "target_layer_ids range", "ok": False}], pb, {})
    assert own.startswith("correct the pinned config") and "deploy verify qwen36-dflash" in own
    assert "pip install 'vllm>=" in verify_fix([{"check": "vllm installed", "ok": False}], pb, {})
    key = verify_fix([{"check": "spec key draft_tensor_parallel_size", "ok": False, "expected": ">= 0.30"}], pb, {})
    assert "remove draft_tensor_parallel_size from speculative.extra" in key


def test_up_diff_never_prints_none():
    from orchestrator.agent.protocol import CurrentResult
    from orchestrator.deploy.ops import diff_running

    pb = _pb()
    diffs = diff_running(CurrentResult.parse("status", {"state": {"alive": True, "pid": 7}}), pb)
    text = "\n".join(diffs)
    assert "None" not in text, text
    assert "not recorded" in text and "the running deployment has none" in text


def test_zombie_vllm_workers_are_not_foreign_processes():
    """An exited-but-not-reaped group worker (a zombie: init in the container reaps late) is no live process."""
    from agent_support import agent_code

    child = subprocess.Popen([sys.executable, "-c", "import ctypes; ctypes.CDLL(None).prctl(15, b'VLLM::Worker_T', "
                                                    "0, 0, 0)"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # wait until it has exited (a zombie: we have not reaped it)
            with open(f"/proc/{child.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        # the agent's own code, run as a separate process (as in a container), asked for vLLM processes
        code = agent_code("from vpd_agent.procs import vllm_processes\n"
                          "print(json.dumps([p['pid'] for p in vllm_processes()]))")
        out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert child.pid not in json.loads(out.stdout.splitlines()[-1])
    finally:
        child.wait()


def test_a_slow_connect_is_timeout_a_refused_one_unreachable():
    from orchestrator.core.errors import RemoteTimeout, Unreachable
    from orchestrator.observe.status import _error_row
    from orchestrator.observe.status_render import state_word

    slow = Unreachable("no answer to the connection within 10 s (timed out)", where="pve1")
    slow.timed_out = True
    rows = [_error_row("pve1", 129, slow), _error_row("pve2", 129, RemoteTimeout("no answer within 1 s")),
            _error_row("pve3", 129, Unreachable("cannot connect: Connection refused", where="pve3"))]
    assert [state_word(r) for r in rows] == ["TIMEOUT", "TIMEOUT", "UNREACHABLE"]
    assert [r["timed_out"] for r in rows] == [True, True, False]


def test_outcomes_and_plans_render_whole(capsys):
    from orchestrator.cli.render import render_outcome
    from orchestrator.deploy.ops import Outcome

    err = StepFailed("drift", f"the drafter config changed behind our back while vLLM started: {LONG_PATH} now "
                              f"has sha256 {SHA}", where="pve1/129", fix=f"find what rewrites {LONG_PATH}",
                     state_left=f"the drafter config {LONG_PATH} was replaced; read now: sha256 {SHA}")
    render_outcome(Outcome(False, "qwen36-dflash", "pve1/129", "failed", [], err))
    out = capsys.readouterr()
    for text in (err.message, err.fix, err.state_left):
        assert text in out.err
    assert "None" not in out.err + out.out


def test_a_wait_on_a_tty_is_one_line_updated_in_place(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "120")
    tty = FakeTTY()
    p = Progress(stream=tty)
    for i in range(5):
        p.waiting("pve1/129", "GPU0 30000 MiB", f"waiting for GPU memory: GPU0 30000 MiB ({i}s)")
    p.say("pve1/129", "ok   gpus-free")
    text = tty.getvalue()  # Progress applies the output boundary itself on a plain stream (own() restored)
    assert text.count("\r\x1b[2K") == 4 and text.count("\n") == 3  # first line, in-place updates, end, next line
    assert "(4s)" in text and "gpus-free" in text


def test_unlock_without_a_known_runtime_says_so_before_connecting(tmp_path, monkeypatch):
    """A container with no runtime in the inventory and no playbook targeting it: unlock cannot know the state
    directory the lock is in, so it refuses (exit 2) instead of crashing or answering 'no lock' from a guess."""
    from click.testing import CliRunner

    from orchestrator.cli import main

    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts:\n  - name: lab\n    address: 127.0.0.9\n    containers:\n      - vmid: 555\n")
    monkeypatch.setenv("DEPLOY_PLAYBOOKS", str(tmp_path))  # no playbook of its own targets lab/555
    res = CliRunner().invoke(main, ["-i", str(inv), "unlock", "lab/555", "-y"])
    assert res.exit_code == 2, res.output
    assert "lab/555" in res.output and "runtime" in res.output and "deploy discover lab --write" in res.output
