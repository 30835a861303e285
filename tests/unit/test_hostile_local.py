"""Issue 22 on the workstation side: what a hostile container answers cannot choose a secret, crash deploy, or
write to the operator's terminal. The container is faked at the agent edge (its answers are the input here)."""

import types

import pytest

from orchestrator.observe import status


class _Redact:
    def add(self, s):
        pass


INVENTORY = """hosts:
  - name: pve1
    address: 127.0.0.1
    containers:
      - vmid: 129
        name: vllm-qwen
        gpus: [0]
"""


class _Fleet:
    redact = _Redact()

    def __init__(self, inventory):
        self.inventory = inventory

    def session(self, host):
        return None


@pytest.fixture
def inv(tmp_path, monkeypatch):
    from orchestrator.core.spec import load_inventory

    (tmp_path / "hosts.yaml").write_text(INVENTORY)
    monkeypatch.setenv("DEPLOY_PLAYBOOKS", str(tmp_path / "playbooks"))
    return load_inventory(str(tmp_path / "hosts.yaml"))


def test_a_forged_state_file_does_not_choose_which_local_secret_is_sent(monkeypatch, inv):
    """state.json's api_key_env named a workstation variable; a plain status sent that variable's value."""
    monkeypatch.setenv("VPD_WORKSTATION_SECRET", "ws-secret-5551234")
    sent = []

    def call(session, step, **kw):  # as steps.call_on (status's one route): the typed result
        from orchestrator.agent.protocol import CurrentResult

        assert step.action == "status"

        sent.append(kw.get("secrets"))
        return CurrentResult.parse("status", {
            "state": {"playbook": "evil", "api_key_env": "VPD_WORKSTATION_SECRET", "alive": True, "pid": 7,
                      "port": 8000, "served_model_name": "x"}, "models_status": 401, "health": 200,
            "memory": {"gpus": {}}})

    monkeypatch.setattr(status, "call_on", call)
    row = status.container_row(_Fleet(inv), "pve1", 129, status.Reach("/root/ml-env/bin/python",
                               "/root/ml-env/bin/vllm", "/var/lib/vllm-pve-deploy"),
                               status.Sampler(persist=False), 1.0)
    assert sent == [None], sent  # one request, and no secret in it
    assert not row["healthy"] and "VPD_WORKSTATION_SECRET" not in " ".join(row["problems"])


HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x1b[8mhidden\x1b[0m\x1bc\r\x9b31mEVIL\x07\x08"


def pty_run(code: str, input: bytes = b"") -> bytes:
    """Run python CODE with stdout and stderr on a real pseudo-terminal; -> the raw bytes the terminal got."""
    import os
    import sys

    from pty_support import run_on_pty

    return run_on_pty([sys.executable, "-c", code], os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), input=input)[1]


def test_the_output_boundary_strips_container_controls_on_a_real_terminal():
    code = ("import click, sys; from orchestrator.core.report import guard_std_streams, Progress, table, own; "
            "guard_std_streams(); h = %r; print('row', h); click.echo('echo ' + h); "
            "Progress().say('pve1/129', 'log: ' + h); print(table([[h, 'x']], ['NAME', 'V'])); "
            "print(own('\\x1b[31m') + 'RED' + own('\\x1b[0m')); "
            "click.confirm('replace ' + h + '?', default=False, err=True)" % HOSTILE)
    raw = pty_run(code, input=b"n\n")
    for bad in (b"\x1b]0;", b"\x1b[2J", b"\x1b[8m", b"\x1bc", b"\x9b", b"\xc2\x9b", b"\x07", b"\x08"):
        assert bad not in raw, (bad, raw)
    assert raw.count(b"hidden") >= 4 and b"EVIL" in raw and b"replace " in raw
    assert b"\x1b[31mRED\x1b[0m" in raw  # deploy's own colour passes


def test_json_output_stays_escaped():
    import json

    code = "from orchestrator.core.report import guard_std_streams, dump_json; guard_std_streams(); dump_json({'n': %r})" \
        % HOSTILE
    raw = pty_run(code)
    assert b"\x1b" not in raw
    assert "PWNED" in json.loads(raw.decode().replace("\r\n", "\n"))["n"]


def test_discover_write_escapes_newlines_from_the_container_in_yaml_comments(tmp_path):
    import yaml

    from orchestrator.hosts import discover

    c = {"vmid": 129, "name": "ct", "status": "running", "lock": None, "gpus": [0], "gpus_all": False,
         "gpu_source": "devN", "address": "10.0.0.5", "address_source": "net0 ip=",
         "runtime": {"python": "/root/ml-env/bin/python", "vllm": "/root/ml-env/bin/vllm", "state_dir": "/var/lib/x"},
         "runtimes": [{"python": "/root/ml-env/bin/python", "vllm_version": "0.34.0\nextra_key: injected",
                       "transformers_version": "4\u2028evil: 1"}],
         "problems": ["probe inside failed: boom\n      - vmid: 666\n        name: planted\x1b]0;t\x07"]}
    text = "hosts:\n  - name: pve1\n    address: 10.0.0.1\n    containers:\n" + "\n".join(
        discover.container_yaml(c, 6)) + "\n"
    data = yaml.safe_load(text)
    cts = data["hosts"][0]["containers"]
    assert [x["vmid"] for x in cts] == [129] and "extra_key" not in cts[0] and "evil" not in cts[0]["runtime"]
    assert "\x1b" not in text and "boom\\n" in text


def test_the_hosts_yaml_backup_is_exclusive_private_and_never_through_a_symlink(tmp_path):
    import os

    from orchestrator.core import atomic

    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts: []\n")
    os.chmod(inv, 0o600)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    import datetime
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    os.symlink(victim, f"{inv}.bak-{stamp}")  # the old, predictable name
    b = atomic.backup_copy(str(inv))
    assert victim.read_text() == "keep" and not os.path.islink(b)
    assert os.stat(b).st_mode & 0o777 == 0o600 and open(b).read() == "hosts: []\n"
    assert b != atomic.backup_copy(str(inv))  # unpredictable: a new name each time


@pytest.mark.parametrize("action, answer, field", [
    ("doctor", {"processes": "x", "servers": []}, "processes"),
    ("doctor", {"servers": []}, "processes"),
    ("install_vllm", {"ok": "yes"}, "ok"),
    ("install_vllm", {"ok": True, "runtime": ["x"]}, "runtime"),
    ("hub_drafter", {"ok": True, "links": "../../etc"}, "links"),
    ("logs", {"lines": "not a list", "exists": True}, "lines"),
    ("status", {"state": ["x"]}, "state"),
    ("stop", {"terminated": 5}, "terminated"),
    ("gpus_free", {"verdict": {"x": 1}}, "verdict"),
])
def test_a_malformed_agent_answer_is_an_agent_error_naming_the_action(action, answer, field):
    from orchestrator.agent import PROTOCOL, AgentError, interpret

    with pytest.raises(AgentError) as e:
        interpret(answer, PROTOCOL, action, "/root/ml-env/bin/python", where="pve1/129", vmid=129, exited=0, err="")
    assert repr(action) in e.value.message and field in e.value.message


def test_odd_nested_data_in_a_status_answer_is_an_error_row_not_a_traceback(monkeypatch, inv):
    from orchestrator.agent.protocol import CurrentResult

    monkeypatch.setattr(status, "call_on", lambda *a, **k: CurrentResult.parse(
        "status", {"state": {"playbook": "p", "alive": True, "pid": 5}, "memory": {"gpus": {"0": 7}}}))
    row = status._row_or_error(_Fleet(inv), "pve1", 129, {"python": "/root/ml-env/bin/python"},
                               status.Sampler(persist=False), 1.0)
    assert "agent action 'status' answered a malformed result" in " ".join(row["problems"]) + str(row), row


def test_event_caps_and_logs_follow_exemption():
    from orchestrator.agent import MAX_EVENT_LINE, MAX_EVENTS, EventBudget
    from orchestrator.core.errors import OutputTooLarge

    b = EventBudget("status", "pve1/129")
    with pytest.raises(OutputTooLarge, match="more than %d events" % MAX_EVENTS):
        for _ in range(MAX_EVENTS + 1):
            b.take(b'{"event": "x"}')
    s = EventBudget("logs", "pve1/129", streaming=True)  # logs -f: printed and dropped, no count cap
    for _ in range(MAX_EVENTS + 1):
        s.take(b'{"event": "line"}')
    with pytest.raises(OutputTooLarge, match="event line of"):
        s.take(b"x" * (MAX_EVENT_LINE + 1))


def test_the_agent_cuts_its_own_event_texts_below_the_cap(capsys):
    import json

    from orchestrator.agent import MAX_EVENT_LINE
    from orchestrator.agent.container import core as A

    A.emit(event="line", line="\U0001F600" * 100000)
    out = capsys.readouterr().out
    assert len(out.encode()) < MAX_EVENT_LINE and "characters cut" in json.loads(out)["line"]


def test_hub_refs_content_is_a_snapshot_name_never_a_path(tmp_path):
    import os

    from orchestrator.agent.container import verify as A

    base = tmp_path / "hub" / "models--org--drafter"
    (base / "refs").mkdir(parents=True)
    (base / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (base / "refs" / "main").write_text("../../../../etc\n")
    r = A.resolve_drafter_path({"hub_id": "org/drafter", "hf_home": str(tmp_path)})
    assert r["path"] is None and "not a snapshot name" in r["error"]
    (base / "refs" / "main").write_text("a" * 40 + "\n")
    r = A.resolve_drafter_path({"hub_id": "org/drafter", "hf_home": str(tmp_path)})
    assert r["path"] == str(base / "snapshots" / ("a" * 40) / "config.json")
    os.unlink(base / "refs" / "main")
    os.mkfifo(base / "refs" / "main")  # a FIFO: not read (it would block), the newest snapshot is used
    r = A.resolve_drafter_path({"hub_id": "org/drafter", "hf_home": str(tmp_path)})
    assert r["revision"] == "a" * 40


def test_doctor_reads_a_config_only_as_a_regular_file(tmp_path):
    import os

    from orchestrator.agent.container import doctor as A

    os.mkfifo(tmp_path / "config.json")
    assert "not a regular file" in A._read_config(str(tmp_path / "config.json"))["error"]
    (tmp_path / "real.json").write_text("{}")
    os.symlink(tmp_path / "real.json", tmp_path / "link.json")
    assert A._read_config(str(tmp_path / "link.json"))["text"] == "{}"  # a root-owned directory: followed
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(tmp_path / "real.json", other / "config.json")
    os.chown(other, 65534, 65534)  # another user's directory: their symlink is not followed
    assert "symlink" in A._read_config(str(other / "config.json"))["error"]
    assert A._read_config(str(tmp_path / "real.json"))["text"] == "{}"
