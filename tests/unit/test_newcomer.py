"""Issue 26 (what a new user meets): the pure parts of its items, on real code without a test bed."""

import importlib.util
import os
import time

import pytest

from orchestrator.errors import EXIT_USAGE, UsageError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def agent():
    spec = importlib.util.spec_from_file_location("vpd_agent_t26", os.path.join(REPO, "orchestrator", "agent",
                                                                                  "agent.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def entry(at, message, mid=None, **kw):
    d = {"__REALTIME_TIMESTAMP": str(int(at * 1e6)), "MESSAGE": message, **kw}
    if mid:
        d["MESSAGE_ID"] = mid
    return d


# ---------------------------------------------------------------- item 1: last exit / last error of this launch


def test_exit_0_is_read_from_deactivated_successfully(agent):
    """vLLM exits 0 when its engine dies: systemd logs no "Main process exited" for it, only "Deactivated
    successfully"; an older exit (before this launch) must not be shown instead."""
    t = time.time()
    entries = [entry(t - 5, "vllm-x.service: Deactivated successfully.", agent.SUCCESS_MESSAGE_ID),
               entry(t - 4, "vllm-x.service: Scheduled restart job, restart counter is at 1.")]
    ex = agent.pick_last_exit(entries, {}, since=t - 10)
    assert ex["code"] == "exited" and ex["status"] == 0 and abs(ex["at"] - (t - 5)) < 1e-3


def test_failed_with_result_takes_the_exit_just_before_it(agent):
    t = time.time()
    entries = [entry(t - 3, "vllm-x.service: Main process exited, code=exited, status=1/FAILURE",
                     agent.EXIT_MESSAGE_ID, EXIT_CODE="exited", EXIT_STATUS="1"),
               entry(t - 3, "vllm-x.service: Failed with result 'exit-code'.", agent.FAILURE_MESSAGE_ID)]
    assert agent.pick_last_exit(entries)["status"] == 1
    killed = [entry(t, "x: Main process exited, code=killed, status=9/KILL", agent.EXIT_MESSAGE_ID,
                    EXIT_CODE="killed", EXIT_STATUS="9")]
    assert agent.pick_last_exit(killed)["status"] == "SIGKILL"


def test_systemctl_show_exit_of_this_launch_wins_and_an_older_one_does_not(agent):
    mono = int((time.monotonic() - 2) * 1e6)  # exited 2 s ago
    u = {"ExecMainCode": "1", "ExecMainStatus": "0", "ExecMainExitTimestampMonotonic": str(mono), "Id": "u"}
    ex = agent.pick_last_exit([], u, since=time.time() - 60)
    assert ex["code"] == "exited" and ex["status"] == 0 and abs(ex["at"] - (time.time() - 2)) < 1
    # the launch came after that exit (a boot-time failure): not this launch's
    assert agent.pick_last_exit([], u, since=time.time() - 1) is None
    # no exit yet: the running main process has no exit timestamp
    assert agent.pick_last_exit([], {"ExecMainCode": "0", "ExecMainExitTimestampMonotonic": "0"}) is None


def test_last_error_is_the_newest_crash_not_an_older_named_cause(agent):
    fatal = [r"CUDA out of memory", r"Engine core initialization failed"]
    entries = [("inv1", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"),
               ("inv1", "RuntimeError: Engine core initialization failed."),
               ("inv2", "INFO loading weights"),
               ("inv2", "ValueError: error: max_model_len too large")]
    assert agent.pick_last_error(entries, fatal) == "ValueError: error: max_model_len too large"
    # within one crash the line naming the cause wins over the wrapper's last words
    assert "CUDA out of memory" in agent.pick_last_error(entries[:2], fatal)
    assert agent.pick_last_error([("a", "INFO all good")], fatal) is None


# ---------------------------------------------------------------- item 15: discover of an unknown name


def test_discover_of_a_name_not_in_the_inventory_is_a_usage_error_without_dns(monkeypatch):
    import socket

    from orchestrator import discover as D

    def no_dns(*a, **k):
        raise AssertionError("a DNS lookup")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)

    from types import SimpleNamespace as NS

    class Inv:
        hosts = {n: NS(name=n, address="10.9.9.%d" % i, port=22) for i, n in enumerate(("pve1", "pve2"))}

    with pytest.raises(UsageError) as e:
        D.resolve_host(Inv(), "pve9", user=None, identity_file=None, known_hosts=None, accept_new=False, name=None)
    assert e.value.exit_code == EXIT_USAGE
    assert "not a host of the inventory (hosts: pve1, pve2)" in e.value.message
    assert "root@ADDRESS --name pve9" in e.value.fix
    # an address (user@, a dot, an IP) is still taken as one
    hs, name = D.resolve_host(Inv(), "root@pve9", user=None, identity_file=None, known_hosts=None,
                              accept_new=False, name=None)
    assert hs.address == "pve9" and name is None
    hs, _ = D.resolve_host(Inv(), "10.1.2.5", user=None, identity_file=None, known_hosts=None, accept_new=False,
                           name=None)
    assert hs.address == "10.1.2.5"
