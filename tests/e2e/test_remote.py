"""The one runner against a real sshd and the test bed's pct: quoting, exit status, streams, keys, timeouts."""

import json
import os
import shutil

import pytest

from orchestrator.core.errors import HostKeyError, RemoteTimeout, Unreachable
from orchestrator.core.remote import AuditLog, Fleet, OutputTooLarge, Redactor
from orchestrator.core.spec import load_inventory
from slack import slack

HOSTILE = ["it's", 'say "hi"', "$(touch /tmp/pwned)", "`touch /tmp/pwned2`", "a; touch /tmp/pwned3", "x && y",
           "line1\nline2", "*", "/etc/*", "?[a]", "ünïcødé ✓ 日本", "", " lead", "trail ", "$HOME", "\\", "-n", "--",
           "a'b\"c", "${IFS}", "|", ">/tmp/pwned4"]


@pytest.fixture
def fleet(inventory, tmp_path):
    inv = load_inventory(inventory)
    f = Fleet(inv, audit=AuditLog(str(tmp_path / "audit.jsonl")))
    yield f
    f.close()


def test_hostile_values_arrive_byte_identical_and_never_execute(tb, fleet):
    s = fleet.session("pve1")
    script = 'import sys, json; sys.stdout.write(json.dumps(sys.argv[1:]))'
    r = s.ct(129, ["/root/ml-env/bin/python", "-c", script, *HOSTILE])
    assert r.exited == 0, r.err
    assert json.loads(r.out) == HOSTILE
    # also through bash -c, the other layer the tool uses
    r = s.ct(129, ["bash", "-c", 'printf "%s\\0" "$@"', "bash", *HOSTILE])
    assert r.stdout.split(b"\0")[:-1] == [h.encode() for h in HOSTILE]
    for n in ("", "2", "3", "4"):
        assert tb.container_exec("pve1", 129, ["test", "-e", f"/tmp/pwned{n}"]).returncode == 1
        assert not os.path.exists(f"/tmp/pwned{n}")


def test_exit_status_and_streams_kept_apart(fleet):
    s = fleet.session("pve1")
    r = s.ct(129, ["bash", "-c", "echo out; echo err >&2; exit 42"])
    assert (r.exited, r.out, r.err) == (42, "out\n", "err\n")
    r = s.ct(129, ["bash", "-c", "cat | wc -c"], stdin=b"x" * 300_000)
    assert r.out.strip() == "300000"


def test_one_connection_for_many_commands_and_an_audit_line_each(fleet, tmp_path):
    s = fleet.session("pve1")
    for _ in range(5):
        assert s.ct(129, ["true"]).ok
    assert s.connects == 1
    lines = [json.loads(ln) for ln in open(tmp_path / "audit.jsonl")]
    assert sum(1 for ln in lines if ln.get("event") == "connect") == 1
    cmds = [ln for ln in lines if "argv" in ln]
    assert len(cmds) == 5 and all(c["argv"] == ["true"] and c["exit"] == 0 and c["vmid"] == 129 for c in cmds)


def test_secrets_are_redacted_in_the_audit_log(inventory, tmp_path):
    red = Redactor()
    red.add("hunter2-secret")
    f = Fleet(load_inventory(inventory), audit=AuditLog(str(tmp_path / "a.jsonl"), red), redact=red)
    try:
        f.session("pve1").ct(129, ["echo", "key=hunter2-secret"])
    finally:
        f.close()
    text = open(tmp_path / "a.jsonl").read()
    assert "hunter2-secret" not in text and "key=***" in text


def test_container_errors_pass_through(tb, fleet):
    s = fleet.session("pve1")
    r = s.run(["pct", "exec", "999", "--", "true"])
    assert r.exited != 0 and "Configuration file 'nodes/" in r.err and "999.conf' does not exist" in r.err
    tb.stop_container("pve1", 130)
    r = s.ct(130, ["true"])
    assert r.exited != 0 and "container '130' not running!" in r.err


def test_command_timeout_is_an_error_not_a_hang(fleet):
    with pytest.raises(RemoteTimeout) as ei:
        fleet.session("pve1").ct(129, ["sleep", "30"], timeout=1)
    assert "did not finish within 1 s" in ei.value.message


def test_an_exit_status_that_comes_after_the_streams_closed_is_waited_for_without_polling(fleet, monkeypatch):
    """Issue 54: after EOF the channel's event pipe stays readable, so the reader used to call select() in a busy
    loop until the exit status came (pct and the interpreter ending after the agent's last line). It waits for the
    status now: the same status and output, few wake-ups, and the deadline still holds."""
    import orchestrator.core.remote as remote

    calls = []
    real = remote.select.select

    class Counting:
        @staticmethod
        def select(r, w, x, t=None):
            calls.append(t)
            return real(r, w, x, t)

    monkeypatch.setattr(remote, "select", Counting)
    s = fleet.session("pve1")
    r = s.run(["sh", "-c", "echo done; exec >&- 2>&-; sleep 1; exit 7"], timeout=30)
    assert (r.exited, r.out) == (7, "done\n")
    assert len(calls) < 50, len(calls)  # a busy loop made thousands in that second
    with pytest.raises(RemoteTimeout):
        s.run(["sh", "-c", "exec >&- 2>&-; sleep 30"], timeout=1)


def test_unknown_host_key_is_refused(tb, tmp_path, inventory):
    text = open(inventory).read().replace(tb.known_hosts, str(tmp_path / "empty_known_hosts"))
    (tmp_path / "empty_known_hosts").write_text("")
    (tmp_path / "inv.yaml").write_text(text)
    f = Fleet(load_inventory(str(tmp_path / "inv.yaml")), audit=AuditLog(str(tmp_path / "a.jsonl")))
    with pytest.raises(HostKeyError) as ei:
        f.session("pve1").run(["true"])
    assert "unknown host key" in ei.value.message and "accept_new_host_keys" in ei.value.fix
    # opting in records the key, and the next connection is checked against it
    (tmp_path / "inv.yaml").write_text(text.replace("accept_new_host_keys: false", "accept_new_host_keys: true"))
    f = Fleet(load_inventory(str(tmp_path / "inv.yaml")), audit=AuditLog(str(tmp_path / "a.jsonl")))
    assert f.session("pve1").run(["true"]).ok
    f.close()
    assert "ssh-ed25519" in (tmp_path / "empty_known_hosts").read_text()


def test_changed_host_key_is_refused(tb, tmp_path, inventory):
    kh = open(tb.known_hosts).read().splitlines()
    a1, a2 = f"[{tb.address('pve1')}]:2222", f"[{tb.address('pve2')}]:2222"
    names = [ln.split()[0].split(",") for ln in kh]
    other = [ln for ln, n in zip(kh, names) if a2 in n][0].split()[1:]  # pve2's key, claimed for pve1
    forged = [ln.split()[0] + " " + " ".join(other) if a1 in n else ln for ln, n in zip(kh, names)]
    (tmp_path / "kh").write_text("\n".join(forged) + "\n")
    (tmp_path / "inv.yaml").write_text(open(inventory).read().replace(tb.known_hosts, str(tmp_path / "kh")))
    f = Fleet(load_inventory(str(tmp_path / "inv.yaml")), audit=AuditLog(str(tmp_path / "a.jsonl")))
    with pytest.raises(HostKeyError) as ei:
        f.session("pve1").run(["true"])
    assert "host key CHANGED" in ei.value.message
    assert ei.value.message.count("SHA256:") == 2  # as OpenSSH shows it (ssh-keygen -lf), not MD5 hex


def test_unreachable_host_is_a_clear_error(tb, fleet):
    tb.set_fault("pve2", None, "unreachable", True)
    with pytest.raises(Unreachable) as ei:
        fleet.session("pve2").run(["true"])
    assert "cannot connect" in ei.value.message and ei.value.exit_code == 3


def test_old_pct_without_keep_env_is_probed_once(tb, fleet, tmp_path):
    tb.set_fault("pve1", None, "keep_env_supported", False)
    s = fleet.session("pve1")
    r = s.ct(129, ["bash", "-c", "echo $HOME; env | grep -c SSH_ || true"])
    assert r.ok and r.out.splitlines()[0] == "/root" and r.out.splitlines()[1] == "0"
    assert s.keep_env_supported is False
    assert s.ct(129, ["true"]).ok
    lines = [json.loads(ln) for ln in open(tmp_path / "audit.jsonl") if '"argv"' in ln]
    assert len(lines) == 3  # the rejected probe, its retry, then one call


def test_ssh_config_alias_is_resolved_by_fabric(tb, tmp_path, monkeypatch):
    """A host named only by an ssh_config alias: Fabric reads HostName/Port/User from ~/.ssh/config."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host gpu-box\n  HostName {tb.address('pve1')}\n  Port 2222\n"
                                          f"  User root\n  IdentityFile {tb.identity_file}\n")
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "inv.yaml").write_text(f"hosts:\n  - name: pve1\n    ssh_config_alias: gpu-box\n"
                                       f"    known_hosts: {tb.known_hosts}\n    identity_file: {tb.identity_file}\n"
                                       "    containers:\n      - vmid: 129\n        gpus: [0, 1, 2, 3]\n")
    f = Fleet(load_inventory(str(tmp_path / "inv.yaml")), audit=AuditLog(str(tmp_path / "a.jsonl")))
    try:
        r = f.session("pve1").ct(129, ["hostname"])
        assert r.ok and r.out.strip() == "vllm-qwen"
    finally:
        f.close()


# ---------------------------------------------------------------- issue 12: bounded output, redaction, audit


@pytest.mark.deadline
def test_output_without_newlines_cannot_outlive_the_deadline(fleet):
    """32 MiB with no newline used to take 9.6 s against a 3 s timeout (an rfind over the buffer per chunk)."""
    import time

    t0 = time.monotonic()
    with pytest.raises((RemoteTimeout, OutputTooLarge)):
        fleet.session("pve1").run(["sh", "-c", "head -c 33554432 /dev/zero; sleep 30"], timeout=3,
                                  on_line=lambda line: None)
    assert time.monotonic() - t0 < slack(5, below=30)


@pytest.mark.deadline
def test_output_is_capped_in_bytes(fleet):
    import time

    t0 = time.monotonic()
    with pytest.raises(OutputTooLarge) as ei:
        fleet.session("pve1").run(["sh", "-c", "head -c 20000000 /dev/zero"], timeout=30, max_output=1 << 20)
    assert "more than 1048576 bytes to stdout" in ei.value.message and time.monotonic() - t0 < slack(10, below=30)


def test_stderr_of_a_one_shot_command_is_capped_at_1_mib(fleet):
    """Issue 36, Low: a one-shot exec's stderr (read only for an error message) has the session's 1 MiB cap, not
    stdout's 64 MiB."""
    with pytest.raises(OutputTooLarge) as ei:
        fleet.session("pve1").run(["sh", "-c", "head -c 3000000 /dev/zero >&2"], timeout=30)
    assert "more than 1048576 bytes to stderr" in ei.value.message


def test_lines_the_reader_consumed_are_not_kept(fleet):
    seen = []

    def on_line(line):
        if line.startswith(b"event"):
            seen.append(line)
            return False  # consumed: not kept in stdout

    r = fleet.session("pve1").run(["sh", "-c", "for i in 1 2 3; do echo event$i; done; echo result"], timeout=10,
                                  on_line=on_line)
    assert seen == [b"event1", b"event2", b"event3"] and r.stdout == b"result\n"


def test_a_timeout_message_is_redacted_and_the_audit_log_is_private_with_a_line_before_each_command(inventory,
                                                                                                     tmp_path):
    red = Redactor()
    red.add("hunter2-secret")
    f = Fleet(load_inventory(inventory), audit=AuditLog(str(tmp_path / "a.jsonl"), red), redact=red)
    try:
        with pytest.raises(RemoteTimeout) as ei:
            f.session("pve1").run(["sh", "-c", "sleep 5 # hunter2-secret"], timeout=1)
    finally:
        f.close()
    assert "hunter2-secret" not in ei.value.message and "***" in ei.value.message
    text = (tmp_path / "a.jsonl").read_text()
    assert "hunter2-secret" not in text
    assert os.stat(tmp_path / "a.jsonl").st_mode & 0o777 == 0o600
    lines = [json.loads(ln) for ln in text.splitlines()]
    starting = [ln for ln in lines if "starting" in ln]
    done = [ln for ln in lines if "argv" in ln]
    assert len(starting) == 1 and len(done) == 1 and lines.index(starting[0]) < lines.index(done[0])


def test_a_newly_accepted_host_key_is_audited(tb, tmp_path, inventory):
    text = open(inventory).read().replace(tb.known_hosts, str(tmp_path / "kh"))
    (tmp_path / "inv.yaml").write_text(text.replace("accept_new_host_keys: false", "accept_new_host_keys: true"))
    f = Fleet(load_inventory(str(tmp_path / "inv.yaml")), audit=AuditLog(str(tmp_path / "a.jsonl")))
    try:
        assert f.session("pve1").run(["true"]).ok
    finally:
        f.close()
    acc = [json.loads(ln) for ln in (tmp_path / "a.jsonl").read_text().splitlines() if "host key accepted" in ln]
    assert len(acc) == 1 and acc[0]["fingerprint"].startswith("SHA256:") and acc[0]["host"] == "pve1"


def test_proxyjump_gateway_host_keys_are_checked(tb, tmp_path, monkeypatch):
    """Fabric gives a ProxyJump gateway its own client with AutoAddPolicy: the gateway's key must be checked too."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host jump\n  HostName {tb.address('pve2')}\n  Port 2222\n  User root\n  IdentityFile {tb.identity_file}\n"
        f"Host gpu-box\n  HostName {tb.address('pve1')}\n  Port 2222\n  User root\n"
        f"  IdentityFile {tb.identity_file}\n  ProxyJump jump\n")
    monkeypatch.setenv("HOME", str(home))
    pve2 = f"[{tb.address('pve2')}]:2222"
    (tmp_path / "kh").write_text("".join(ln for ln in open(tb.known_hosts).readlines() if pve2 not in ln))
    (tmp_path / "inv.yaml").write_text(f"hosts:\n  - name: pve1\n    ssh_config_alias: gpu-box\n"
                                       f"    known_hosts: {tmp_path / 'kh'}\n    identity_file: {tb.identity_file}\n"
                                       "    containers:\n      - vmid: 129\n        gpus: [0, 1, 2, 3]\n")
    f = Fleet(load_inventory(str(tmp_path / "inv.yaml")), audit=AuditLog(str(tmp_path / "a.jsonl")))
    try:
        with pytest.raises(HostKeyError) as ei:
            f.session("pve1").run(["true"])
        assert "unknown host key" in ei.value.message and tb.address("pve2") in ei.value.message
    finally:
        f.close()
    assert pve2 not in (tmp_path / "kh").read_text()  # nothing was added behind our back


def test_an_agent_session_carries_many_requests_and_a_missed_deadline_ends_it(tb, fleet, tmp_path):
    """One agent process for many steps: requests in order, secrets and payloads on stdin (never in the audit log),
    a request past its deadline ends the session, and the next request starts a new one."""
    from orchestrator.agent import session_for
    from orchestrator.agent.protocol import FileShaResult, GpusFreeResult

    fleet.redact.add("s3cr3t-value")
    a = session_for(fleet.session("pve1"), 129, "/root/ml-env/bin/python")
    r = a.call("file_sha", {"path": "/root/models/Qwen3.6-27B/config.json"})
    assert isinstance(r, FileShaResult) and len(r.sha256) == 64
    r = a.call("gpus_free", {"gpus": [0], "threshold_mib": 1024, "timeout_s": 5, "nvidia_smi_timeout_s": 5,
                             "poll_s": 0.1}, secrets={"api_key": "s3cr3t-value"})
    assert isinstance(r, GpusFreeResult) and r.verdict == "free"
    assert a.starts == 1
    with pytest.raises(RemoteTimeout):
        a.call("gpus_free", {"gpus": [0], "threshold_mib": -1, "timeout_s": 20, "nvidia_smi_timeout_s": 5,
                             "poll_s": 0.1}, timeout=1)
    r = a.call("file_sha", {"path": "/root/models/Qwen3.6-27B/config.json"})
    assert r.sha256 and a.starts == 2
    audit = (tmp_path / "audit.jsonl").read_text()
    assert "s3cr3t-value" not in audit
    rows = [json.loads(x) for x in audit.splitlines()]
    assert sum(1 for x in rows if x.get("label") == "agent:session" and "exit" in x) == 2
    assert [x["label"] for x in rows if "exit" in x and x.get("label", "").startswith("agent:")
            and x["label"] != "agent:session"] == ["agent:file_sha", "agent:gpus_free", "agent:gpus_free",
                                                    "agent:file_sha"]
