"""Issue 12, "Safe as root": the agent, run as a real process on real files and processes (no SSH), touches no
file, process or secret that is not the deployment's own. Each case here failed on the code before the fix."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.agent import agent_stdin

from agent_support import PUBLISHED, STALE, agent_code, make_models, run_agent, sha

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, other users' files)")


def starttime(pid):
    stat = open("/proc/%d/stat" % pid).read()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def models(tmp_path):
    return make_models(tmp_path)


@pytest.fixture
def procs():
    """Processes started by a test, each in its own session; killed at the end whatever happened."""
    started = []

    def start(argv, **kw):
        p = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


# ------------------------------------------------------------------ writes


def test_backup_never_follows_a_planted_symlink_and_keeps_the_originals_mode(models, tmp_path):
    """The owner of the drafter directory plants config.json.bak-<second> symlinks for the next 30 seconds, aimed
    at a root-owned 0600 file: the write must not touch that file, and the backup keeps the original's mode."""
    _, d = models
    victim = tmp_path / "shadow"
    victim.write_bytes(b"root:secret\n")
    victim.chmod(0o600)
    os.chmod(d / "config.json", 0o640)
    t = time.time()
    for i in range(-2, 30):
        name = "config.json.bak-%s" % time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t + i))
        os.symlink(victim, d / name)
    r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(PUBLISHED)},
                  payload=open(PUBLISHED, "rb").read())
    assert r["ok"] and r["changed"]
    assert victim.read_bytes() == b"root:secret\n"
    assert not os.path.islink(r["backup"]) and open(r["backup"], "rb").read() == open(STALE, "rb").read()
    assert os.stat(r["backup"]).st_mode & 0o7777 == 0o640
    assert os.stat(d / "config.json").st_mode & 0o7777 == 0o640  # the new file keeps the mode as well


def test_backup_names_are_unique(models):
    _, d = models
    names = set()
    for src in (PUBLISHED, STALE, PUBLISHED):
        r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(src)}, payload=open(src, "rb").read())
        assert r["ok"]
        names.add(r["backup"])
    assert len(names) == 3  # three writes within one second: three backups, none overwritten


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_write_refuses_a_directory_others_can_write(models, mode):
    _, d = models
    os.chmod(d, mode)
    r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(PUBLISHED)},
                  payload=open(PUBLISHED, "rb").read())
    assert not r["ok"] and r["stage"] == "directory" and "writable by" in r["message"] and "chmod go-w" in r["message"]
    assert sha(d / "config.json") == sha(STALE)


def test_write_accepts_a_sticky_directory(models):
    _, d = models
    os.chmod(d, 0o1777)
    r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(PUBLISHED)},
                  payload=open(PUBLISHED, "rb").read())
    assert r["ok"] and r["changed"]


@root_only
def test_write_refuses_a_directory_owned_by_another_user(models):
    _, d = models
    os.chown(d, 65534, 65534)
    r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(PUBLISHED)},
                  payload=open(PUBLISHED, "rb").read())
    assert not r["ok"] and r["stage"] == "directory" and "owned by uid 65534" in r["message"]
    assert sha(d / "config.json") == sha(STALE)


def test_write_refuses_a_fifo_planted_as_the_config(models):
    _, d = models
    os.unlink(d / "config.json")
    os.mkfifo(d / "config.json")
    r = run_agent("write_file", {"path": str(d / "config.json"), "sha256": sha(PUBLISHED)},
                  payload=open(PUBLISHED, "rb").read())
    assert not r["ok"] and r["stage"] == "read"  # not a hang on open()


def launch(sd, argv, **kw):
    return run_agent("launch", {"argv": argv, "env": {}, "state_dir": str(sd), "log_path": str(sd / "vllm.log"),
                                "record": {"playbook": "pb"}, **kw})


def test_launch_state_files_are_private_and_the_exit_status_is_recorded(tmp_path):
    sd = tmp_path / "state"
    r = launch(sd, ["/bin/sh", "-c", "echo hello; exit 3"])
    assert r["ok"]
    assert wait_for(lambda: (sd / "exit_code").read_text().strip() == "3")
    assert os.stat(sd).st_mode & 0o777 == 0o700
    for name in ("state.json", "vllm.log", "exit_code"):
        assert os.stat(sd / name).st_mode & 0o777 == 0o600, name
    assert (sd / "vllm.log").read_text() == "hello\n"
    st = json.loads((sd / "state.json").read_text())
    assert st["launch_id"] and st["starttime"]


def test_launch_tightens_an_older_state_dir_and_refuses_one_others_can_write(tmp_path):
    sd = tmp_path / "state"
    sd.mkdir(mode=0o755)
    os.chmod(sd, 0o755)
    assert launch(sd, ["/bin/true"])["ok"]
    assert os.stat(sd).st_mode & 0o777 == 0o700
    victim = tmp_path / "victim"
    victim.write_text("keep")
    bad = tmp_path / "bad"
    bad.mkdir()
    os.chmod(bad, 0o777)
    os.symlink(victim, bad / "vllm.log")
    r = launch(bad, ["/bin/true"])
    assert not r["ok"] and "writable by others" in r["message"]
    assert victim.read_text() == "keep"


# ------------------------------------------------------------------ remote code


def evil_drafter(d, marker):
    cfg = json.load(open(PUBLISHED))
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "configuration_evil.py").write_text(
        "open(%r, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n" % str(marker))


def verify_args(t, d, **kw):
    return {"path": str(d), "sha256": sha(PUBLISHED), "target_path": str(t), "num_speculative_tokens": 15,
            "method": "dflash", "fixes": [], **kw}


def test_verify_runs_no_code_from_the_drafter_directory_without_opt_in(models, tmp_path):
    pytest.importorskip("transformers")
    t, d = models
    marker = tmp_path / "ran"
    evil_drafter(d, marker)
    r = run_agent("verify", verify_args(t, d), bulk={"pinned": json.load(open(PUBLISHED))})
    checks = {c["check"]: c for c in r["checks"]}
    assert not marker.exists()
    c = checks["remote code"]
    assert not c["ok"] and "configuration_evil" in c["reason"] and "serve.trust_remote_code: true" in c["reason"]
    assert r["trust_remote_code"] is False


def test_verify_loads_remote_code_only_when_the_playbook_opts_in(models, tmp_path):
    pytest.importorskip("transformers")
    t, d = models
    marker = tmp_path / "ran"
    evil_drafter(d, marker)
    r = run_agent("verify", verify_args(t, d, trust_remote_code=True), bulk={"pinned": json.load(open(PUBLISHED))})
    assert marker.exists() and "remote code" not in {c["check"] for c in r["checks"]}


def test_the_published_config_loads_without_remote_code(models):
    """Its auto_map names only AutoModel (vLLM's own class serves it): no opt-in needed."""
    pytest.importorskip("transformers")
    t, d = models
    shutil.copy(PUBLISHED, d / "config.json")
    r = run_agent("verify", verify_args(t, d), bulk={"pinned": json.load(open(PUBLISHED))})
    checks = {c["check"]: c for c in r["checks"]}
    assert checks["as loaded"]["ok"] and "remote code" not in checks


# ------------------------------------------------------------------ kills


def fake_state(sd, pid, **kw):
    sd.mkdir(mode=0o700, exist_ok=True)
    st = {"pid": pid, "pgid": pid, "playbook": "pb", "log_path": str(sd / "vllm.log"), "port": 1}
    if "starttime" not in kw:
        st["starttime"] = starttime(pid)
    st.update(kw)
    (sd / "state.json").write_text(json.dumps(st))


def test_stop_with_a_stale_state_file_kills_nothing_and_says_so(tmp_path, procs):
    """After a reboot, or a reused pid: the recorded group belongs to someone else now."""
    other = procs(["sleep", "60"])
    sd = tmp_path / "state"
    fake_state(sd, other.pid, starttime=starttime(other.pid) - 1000)
    r = run_agent("stop", {"state_dir": str(sd), "grace_s": 1})
    assert other.poll() is None
    assert r["terminated"] == [] and r["killed"] == []
    assert "not the ones deploy started" in r["not_ours"] and "nothing was signalled" in r["not_ours"]


def test_stop_for_another_playbook_is_refused_even_when_not_alive(tmp_path, procs):
    other = procs(["sleep", "60"])
    sd = tmp_path / "state"
    fake_state(sd, other.pid, starttime=starttime(other.pid) - 1000, playbook="theirs")
    r = run_agent("stop", {"state_dir": str(sd), "grace_s": 1, "only_playbook": "mine"})
    assert "not mine" in r["refused"] and "not running" in r["refused"]
    assert other.poll() is None and (sd / "state.json").exists()


def test_stop_kills_what_it_launched_and_only_that(tmp_path, procs):
    sd = tmp_path / "state"
    # a group member that ignores SIGTERM: SIGKILLed after the grace period, proven by its launch id
    r = launch(sd, ["/bin/sh", "-c", "trap '' TERM; sleep 60 & wait"])
    assert r["ok"]
    bystander = procs(["sleep", "60"])
    st = json.loads((sd / "state.json").read_text())
    assert wait_for(lambda: len([p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == st["pgid"]]) >= 2)
    rep = run_agent("stop", {"state_dir": str(sd), "grace_s": 0.5})
    assert rep["terminated"] and bystander.poll() is None
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == st["pgid"] and _alive(int(p))]


def _pgid(pid):
    try:
        stat = open("/proc/%d/stat" % pid).read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[2])


def _alive(pid):
    try:
        stat = open("/proc/%d/stat" % pid).read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def test_a_group_member_without_our_launch_id_is_not_signalled(tmp_path, procs):
    """The leader is gone; a process in a group with the recorded id but without our launch id is a stranger."""
    p = procs(["sleep", "60"])
    sd = tmp_path / "state"
    fake_state(sd, p.pid + 100000, pgid=p.pid, launch_id="abc", starttime=1)
    rep = run_agent("stop", {"state_dir": str(sd), "grace_s": 0.2})
    assert p.poll() is None and rep["terminated"] == []


# ------------------------------------------------------------------ API key


def key_server(seen):
    """An HTTP server that answers like vLLM and records every Authorization header it receives."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "m"}]}' if self.path == "/v1/models" else b"")

        do_POST = do_GET

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_the_api_key_goes_to_no_listener_outside_our_group(tmp_path, procs):
    """Someone else bound the port while vLLM loads and answers /health: it must not receive the key."""
    seen = []
    srv = key_server(seen)
    try:
        ours = procs(["sleep", "60"])
        sd = tmp_path / "state"
        fake_state(sd, ours.pid, port=srv.server_address[1])
        (sd / "vllm.log").write_text("")
        args = {"state_dir": str(sd), "log_path": str(sd / "vllm.log"), "port": srv.server_address[1],
                "served_model_name": "m", "timeout_s": 5, "fatal": [], "phases": [], "aux_regex": "^$"}
        r = run_agent("wait_ready", args, secrets={"api_key": "sk-secret-123"})
        assert r["ready"] is False and r["reason"] == "foreign_listener"
        assert "the API key was not sent" in r["message"]
        assert "Bearer sk-secret-123" not in seen
        st = run_agent("status", {"state_dir": str(sd), "nvidia_smi_timeout_s": 1}, secrets={"api_key": "sk-secret-123"})
        assert "Bearer sk-secret-123" not in seen and "not by the deployment" in st["listener_problem"]
    finally:
        srv.shutdown()


SERVER = r"""
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        if self.path == "/v1/models" and self.headers.get("Authorization") != "Bearer sk-secret-123":
            self.send_response(401); self.end_headers(); return
        self.send_response(200); self.end_headers()
        self.wfile.write(b'{"data": [{"id": "m"}]}' if self.path == "/v1/models" else b"")
srv = HTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def test_status_authenticates_to_our_own_key_protected_server(tmp_path, procs):
    p = procs([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    port = int(p.stdout.readline())
    sd = tmp_path / "state"
    fake_state(sd, p.pid, port=port, served_model_name="m")
    r = run_agent("status", {"state_dir": str(sd), "nvidia_smi_timeout_s": 1}, secrets={"api_key": "sk-secret-123"})
    assert r["health"] == 200 and r["models"] == ["m"] and "listener_problem" not in r
    r = run_agent("status", {"state_dir": str(sd), "nvidia_smi_timeout_s": 1})
    assert r["models_status"] == 401 and r["models"] is None


# ------------------------------------------------------------------ lock


def lock(sd, token, **kw):
    return run_agent("lock", {"state_dir": str(sd), "token": token, "holder": token, "lease_s": 600, **kw})


def test_a_lock_file_just_created_is_not_broken(tmp_path):
    """The old lock was created empty and filled after: a taker in between read it as expired and broke it."""
    sd = tmp_path / "state"
    sd.mkdir(mode=0o700)
    (sd / "lock").write_bytes(b"")
    assert lock(sd, "B")["locked"] is False


def test_a_lock_not_renewed_within_its_term_is_broken_and_kept_aside_under_a_unique_name(tmp_path):
    sd = tmp_path / "state"
    expires = lambda: json.loads((sd / "lock").read_text())["expires"]  # noqa: E731
    assert lock(sd, "A", term_s=30)["locked"]
    e1 = expires()
    time.sleep(0.05)
    assert lock(sd, "A", term_s=30, renew=True)["locked"]  # the heartbeat pushes expires forward
    assert expires() > e1
    assert lock(sd, "B")["locked"] is False  # renewed: still A's
    assert lock(sd, "A", term_s=0.01, renew=True)["locked"]  # a last beat with a tiny term: stale right after
    assert wait_for(lambda: time.time() > expires() + 0.05)
    assert lock(sd, "B")["locked"] is True  # not renewed within its term: broken
    assert lock(sd, "A", term_s=30, renew=True) == {"locked": False, "lost": True,
                                                     "holder": json.loads((sd / "lock").read_text())}
    stale = [n for n in os.listdir(sd) if n.startswith(".lock.stale-")]
    assert len(stale) == 1 and json.loads((sd / stale[0]).read_text())["token"] == "A"


def test_renewal_never_extends_a_lock_past_its_lease(tmp_path):
    sd = tmp_path / "state"
    assert lock(sd, "A", term_s=60, lease_s=0.3)["locked"]
    time.sleep(0.4)
    assert lock(sd, "A", term_s=60, lease_s=0.3, renew=True)["locked"] is False
    assert lock(sd, "B")["locked"]


def test_break_token_breaks_only_the_named_holder(tmp_path):
    sd = tmp_path / "state"
    assert lock(sd, "A")["locked"]
    assert lock(sd, "B", break_token="not-A")["locked"] is False
    assert lock(sd, "B", break_token="A")["locked"] is True
    assert run_agent("unlock", {"state_dir": str(sd), "break_token": "A"})["unlocked"] is False
    shown = run_agent("unlock", {"state_dir": str(sd)})
    assert shown["unlocked"] is False and shown["holder"]["token"] == "B"
    assert run_agent("unlock", {"state_dir": str(sd), "break_token": "B"})["unlocked"] is True
    assert not (sd / "lock").exists()


def test_concurrent_takers_of_a_stale_lock_one_wins(tmp_path):
    agent = agent_stdin()
    for trial in range(8):
        sd = tmp_path / ("s%d" % trial)
        assert lock(sd, "old", lease_s=0)["locked"]
        ps = [subprocess.Popen([sys.executable, "-", "lock", json.dumps(
            {"state_dir": str(sd), "token": "T%d" % i, "holder": "T%d" % i, "lease_s": 60})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE) for i in range(4)]
        for p in ps:
            p.stdin.write(agent)
            p.stdin.close()
        wins = 0
        for p in ps:
            out = p.stdout.read().decode()
            p.wait(timeout=60)
            wins += json.loads(out.strip().splitlines()[-1])["result"]["locked"]
        assert wins == 1, trial


def test_a_dead_holder_on_this_workstation_is_recognised():
    from orchestrator.deploy.ops import _proc_start, holder_dead, holder_fields

    p = subprocess.Popen(["true"])
    p.wait()
    me = holder_fields()
    assert holder_dead({**me, "pid": p.pid})
    assert not holder_dead({**me, "pid": os.getppid(), "pid_start": _proc_start(os.getppid())})
    assert holder_dead({**me, "pid": os.getppid(), "pid_start": 1})  # that pid now is another process
    assert not holder_dead({**me, "pid": p.pid, "workstation": "elsewhere"})


# ------------------------------------------------------------------ terminal


def test_escape_sequences_are_stripped_from_names_and_log_lines(tmp_path, procs):
    p = procs([sys.executable, "-c", "import time; time.sleep(60)", "\x1b]0;pwned\x07\x1bc\x1b[2Jhidden"])
    code = agent_code("from vpd_agent.core import clean\nfrom vpd_agent.procs import proc_cmdline\n"
                      "print(json.dumps([proc_cmdline(%d), clean(%r)]))\n" % (
        p.pid, "a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\b\x1bc\x9b31m"))
    out = json.loads(subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                                    timeout=60).stdout)  # on stdin: longer than one argv string may be
    assert "\x1b" not in out[0] and "hidden" in out[0]
    assert "\x1b" not in out[1] and "\x9b" not in out[1] and out[1].startswith("a") and "link" in out[1]


def test_a_shared_directory_named_as_state_dir_is_not_tightened(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    (shared / "someone-elses-file").write_text("x")
    assert launch(shared, ["/bin/true"])["ok"]
    assert os.stat(shared).st_mode & 0o777 == 0o755  # not ours alone: left as it was


def test_the_heartbeat_renews_the_lock_until_stopped_and_reports_a_loss():
    from orchestrator.deploy import ops
    from orchestrator.steps.plan import Step

    calls, said = [], []

    class Ctx:
        where = "pve1/129"

        class progress:
            @staticmethod
            def say(where, msg):
                said.append(msg)

        def __init__(self, answers):
            self.answers = answers

        def call(self, step, fresh=False, **kw):  # as Context.call: the typed result
            from orchestrator.agent.protocol import LockResult

            calls.append(step.args)
            return LockResult.parse("lock", self.answers.pop(0) if self.answers else {"locked": True})

    step = Step("lock", "t", "pve1", 129, action="lock", args={"token": "T", "term_s": 0.2, "lease_s": 60})
    beat = ops.Heartbeat(Ctx([]), step).start()
    assert wait_for(lambda: len(calls) >= 3, 5)
    beat.stop()
    n = len(calls)
    time.sleep(0.15)
    assert len(calls) == n and all(c["renew"] and c["token"] == "T" for c in calls)
    calls.clear()
    beat = ops.Heartbeat(Ctx([{"locked": False, "lost": True, "holder": {"holder": "bob", "expires": 0}}]), step)
    beat.start()
    assert wait_for(lambda: beat.lost is not None, 5)
    beat.stop()
    assert beat.lost["holder"] == "bob" and "lock was lost" in said[0] and len(calls) == 1


def test_a_renewal_waits_for_the_break_mutex_and_rereads_the_lock_there(tmp_path):
    """issue 22: a renewal rewrote the lock by rename outside lock.break, racing a breaker at expiry."""
    import threading

    sd = tmp_path / "state"
    assert lock(sd, "A", term_s=30)["locked"]
    (sd / "lock.break").write_text("{}")  # a breaker holds the mutex
    os.chmod(sd / "lock.break", 0o600)
    before = (sd / "lock").read_text()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", lock(sd, "A", term_s=30, renew=True)))
    t.start()
    time.sleep(1.0)
    assert (sd / "lock").read_text() == before  # not rewritten while the mutex is held
    os.rename(sd / "lock", sd / ".lock.stale-x")  # the breaker moves it aside, then lets go
    os.unlink(sd / "lock.break")
    t.join(15)
    assert out["r"]["locked"] is False and out["r"]["lost"] is True  # renewal saw it was gone: no resurrection
    assert not (sd / "lock").exists()


def test_break_token_travels_on_stdin(tmp_path):
    sd = tmp_path / "state"
    assert lock(sd, "A")["locked"]
    r = run_agent("unlock", {"state_dir": str(sd)}, secrets={"break_token": "A"})
    assert r["unlocked"] is True and not (sd / "lock").exists()
