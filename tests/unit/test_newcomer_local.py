"""Issue 26 (what a new user meets): the pure parts of its items, on real code without a test bed."""

import os
import time

import pytest

from orchestrator.core.errors import EXIT_USAGE, UsageError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def agent():
    """The agent's functions these tests use (orchestrator/agent/container/: systemd, status, install)."""
    from types import SimpleNamespace

    from orchestrator.agent.container import install, status, systemd

    return SimpleNamespace(**{**vars(systemd), **vars(status), **vars(install)})


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

    from orchestrator.hosts import discover as D

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


# ---------------------------------------------------------------- item 5: doctor counts one server per launch


def test_doctor_counts_the_launch_wrapper_and_vllm_as_one_server_and_names_the_state_files_playbook():
    import hashlib
    import json

    from orchestrator.hosts.doctor import diagnose, one_server_per_launch

    serve = ["/root/ml-env/bin/vllm", "serve", "/root/models/Qwen3.6-27B", "--port", "8000"]
    procs = [{"pid": 20, "ppid": 1, "argv": ["/bin/sh", "-c", '"$@" </dev/null; echo $? >&0', "vllm-pve-deploy"] + serve},
             {"pid": 21, "ppid": 20, "argv": serve}]
    srv = lambda pid: {"pid": pid, "args": {"model": "/root/models/Qwen3.6-27B", "port": 8000}}  # noqa: E731
    facts = one_server_per_launch({"processes": procs, "servers": [srv(20), srv(21)]})
    assert [s["pid"] for s in facts["servers"]] == [21]
    # a shell that is not a wrapper of a server (no server child) stays
    facts = one_server_per_launch({"processes": procs[:1], "servers": [srv(20)]})
    assert [s["pid"] for s in facts["servers"]] == [20]

    raw = open(os.path.join(REPO, "testbed/vpd_testbed/data/qwen36-27b-dflash.stale-guess.config.json"), "rb").read()
    pub = open(os.path.join(REPO, "playbooks/drafters/qwen36-27b-dflash.config.json"), "rb").read()
    pin = lambda name: {"playbook": name, "fallback": None, "target": "pve1/129", "min_acceptance": 0.3,  # noqa: E731
                        "path": "/root/models/Qwen3.6-27B-DFlash", "hub_id": None, "config": json.loads(pub),
                        "sha256": hashlib.sha256(pub).hexdigest()}
    d = {"kind": "local", "path": "/root/models/Qwen3.6-27B-DFlash/config.json", "dir": "/root/models/Qwen3.6-27B-DFlash",
         "text": raw.decode(), "sha256": hashlib.sha256(raw).hexdigest(), "mtime": 50.0}
    facts = {"servers": [{"pid": 21, "args": {"spec": {"method": "dflash", "model": "x"}, "port": 8000},
                          "drafter": d, "target": None}], "processes": [{"pid": 21, "ppid": 1, "started_at": 100.0}],
             "stack": {}, "holders": [], "memory": {}}
    f = diagnose(facts, [pin("a-copy"), pin("qwen36-dflash")], host="pve1", vmid=129,
                 playbook={"playbook": "qwen36-dflash"})
    assert "deploy up qwen36-dflash" in f[0]["fix"] and "a-copy" not in f[0]["fix"]


# ---------------------------------------------------------------- item 4: a lock lost before the end is said


def test_a_lock_broken_during_the_run_is_warned_at_release():
    from types import SimpleNamespace as NS

    from orchestrator.deploy import ops

    from orchestrator.agent.protocol import UnlockResult

    said = []
    ctx = NS(where="pve1/129", call=lambda step: UnlockResult.parse("unlock", {"unlocked": False, "holder": None}),
             progress=NS(say=lambda where, msg: said.append(msg)))
    ops.release_lock(ctx, NS(), None)
    assert said and "WARNING: the container lock was lost before this run ended" in said[0]
    said.clear()
    ctx.call = lambda step: UnlockResult.parse("unlock", {"unlocked": True})
    ops.release_lock(ctx, NS(), None)
    assert not said


# ---------------------------------------------------------------- item 10: no contradictory progress lines


def test_still_waiting_names_one_bound_and_a_lock_renewal_prints_no_wait(agent):
    import contextlib
    from types import SimpleNamespace as NS

    from orchestrator.steps.plan import Step
    from orchestrator.steps import Context

    beats = []

    class P:
        def detail(self, *a):
            pass

        def heartbeat(self, where, what, limit=None):
            beats.append((what, limit))
            return contextlib.nullcontext()

    sess = NS(audit=NS(redact=lambda s: s), agent_session=lambda vmid, py: NS(call=lambda *a, **k: {"ok": True}))
    ctx = Context(session=sess, pb=NS(host="pve1", vmid=129, conf=NS(runtime=NS(python="py", state_dir=None))), progress=P(), token="t",
                  holder="h")
    ctx.call(Step("wait-ready", "follow the log until it serves (timeout 900 s)", action="wait_ready", args={}, host="pve1",
                  timeout=960, vmid=129))
    ctx.call(Step("stop", "stop vLLM", "pve1", 129, action="stop", args={}, timeout=90))
    assert beats == [("wait-ready: follow the log until it serves (timeout 900 s)", None), ("stop: stop vLLM", 90)]
    beats.clear()
    ctx.call(Step("stop", "stop vLLM", "pve1", 129, action="stop", args={}, timeout=90), beat=False)
    assert beats == []
    # the install runner's own result line is not shown as a log line
    assert agent._protocol_line('{"result": {"ok": false}, "protocol": 2}')
    assert not agent._protocol_line("ERROR: No matching distribution found for vllm==9.9")


# ---------------------------------------------------------------- item 19: status flags two servers on one GPU


def test_status_flags_two_running_deployments_on_one_gpu():
    from orchestrator.observe.status import shared_gpu_problems

    def row(host, vmid, gpus, pb):
        return {"host": host, "vmid": vmid, "process": "running", "_gpus": gpus, "playbook": pb, "problems": [],
                "healthy": True}

    a, b, c = row("pve1", 129, [0, 1], "x"), row("pve1", 130, [1, 2], "y"), row("pve2", 129, [0, 1], "z")
    shared_gpu_problems([a, b, c])
    assert not a["healthy"] and not b["healthy"] and c["healthy"] and "_gpus" not in a
    assert "GPU(s) 1 are used by pve1/130 too, where y runs" in a["problems"][0] and "deploy down y" in a["problems"][0]


# ---------------------------------------------------------------- item 13: deploy docs


def test_deploy_docs_prints_the_shipped_pages_and_sections():
    from orchestrator.deploy.scaffold import doc_topics, docs_text

    topics = doc_topics()
    for t in ("quickstart", "cli", "playbooks", "troubleshooting", "architecture", "testbed", "domain/field-report"):
        assert t in topics, sorted(topics)
    assert docs_text("quickstart") == open(os.path.join(REPO, "docs", "quickstart.md"), encoding="utf-8").read()
    sec = docs_text("playbooks#requires")
    assert sec.startswith("### `requires`") and "\n### " not in sec[5:]
    assert "quickstart" in docs_text(None)
    with pytest.raises(UsageError) as e:
        docs_text("nope")
    assert "deploy docs lists them" in e.value.fix
    with pytest.raises(UsageError):
        docs_text("cli#no-such-section")


def test_every_deploy_docs_pointer_in_the_code_resolves():
    """Messages and --help point at `deploy docs TOPIC#SECTION`: each must print something."""
    import glob
    import re

    from orchestrator.deploy.scaffold import docs_text

    seen = set()
    for path in glob.glob(os.path.join(REPO, "orchestrator", "**", "*.py"), recursive=True):
        for m in re.finditer(r"deploy docs ([a-z/-]+(?:#[a-z0-9-]+)?)", open(path, encoding="utf-8").read()):
            if m.group(1) in ("lists", "topic"):
                continue
            seen.add(m.group(1))
            assert docs_text(m.group(1)), (path, m.group(1))
    assert "playbooks#requires" in seen


# ---------------------------------------------------------------- item 12: nothing cut on a 100-column terminal


def test_up_summary_and_errors_wrap_between_words_on_a_terminal(monkeypatch, capsys):
    from orchestrator.cli import render as cli
    from orchestrator.core import report
    from orchestrator.core.errors import StepFailed
    from orchestrator.deploy.ops import Outcome

    monkeypatch.setattr(report, "term_width", lambda stream=None: 100)
    long_ep = "http://10.1.2.31:8000/v1 (not routable from here: ssh -N -L 8000:10.1.2.31:8000 root@10.1.2.5, then " \
              "http://127.0.0.1:8000/v1)"
    out = Outcome(True, "qwen36-dflash", "pve1/129", "up", [])
    out.info = {"url": None, "endpoint": {"url": "x", "tunnel": "t", "routable": False, "local_url": "y"},
                "model": "qwen36", "method": "dflash", "total_s": 3.2, "phases_s": {f"step-{i}": 0.1 for i in range(12)},
                "acceptance": {"draft_acceptance_rate": 0.5, "mean_acceptance_length": 8.6, "source": "metrics"}}
    monkeypatch.setattr(cli, "_where_it_answers", lambda info: long_ep)
    cli.render_outcome(out)
    fail = Outcome(False, "qwen36-dflash", "pve1/129", "failed", [])
    fail.error = StepFailed("gpus-free", "GPU memory is held OUTSIDE this container " + "x" * 10 + " word " * 30,
                            where="pve1/129", fix="deploy down mtp-130 frees them " * 4, state_left="nothing " * 20)
    cli.render_outcome(fail)
    got = capsys.readouterr()
    text = got.out + got.err
    for ln in text.splitlines():
        assert len(ln) <= 100 or " " not in ln.strip(), ln
    flat = " ".join(text.split())
    for word in (long_ep.split() + ["root@10.1.2.5,", "step-11", "mtp-130"]):
        assert word in flat.split() or word in flat, word  # whole, never split


# ---------------------------------------------------------------- item 20: the root file system build says what it does


def test_rootfs_build_reports_progress(tmp_path, monkeypatch):
    import subprocess as sp

    from vpd_testbed import lxc

    monkeypatch.setattr(lxc, "rootfs_path", lambda: tmp_path / "rootfs-v1")
    real = sp.Popen

    def fake_debootstrap(argv, **kw):  # writes a line, takes a moment, makes the directory
        target = argv[-1]
        return real(["sh", "-c", 'echo "I: Retrieving Packages"; sleep 0.5; mkdir -p "$1/etc/systemd/system"',
                     "sh", target], **kw)

    monkeypatch.setattr(lxc.subprocess, "Popen", fake_debootstrap)
    said = []
    dest = lxc.ensure_rootfs(say=said.append, every_s=0.2)
    assert dest == tmp_path / "rootfs-v1" and (dest / ".vpd-complete").exists()
    assert said[0].startswith("building the LXC root file system once (debootstrap bookworm")
    assert any(s.startswith("still building the root file system") and "Retrieving Packages" in s for s in said)
    assert said[-1].startswith("root file system built in")


# ---------------------------------------------------------------- item 9: discover says when it found no address


def test_discover_says_it_found_no_address_and_the_note_is_true():
    from types import SimpleNamespace as NS

    from orchestrator.hosts.discover import container_yaml
    from orchestrator.core.endpoint import endpoint

    c = {"vmid": 129, "name": "ct129", "status": "running", "lock": None, "gpus": [0], "gpus_all": False,
         "gpu_source": "dev0", "address": None, "address_source": None, "runtime": None, "runtimes": [],
         "problems": [], "pythons": []}
    text = "\n".join(container_yaml(c, 4))
    assert "# address: none found (no ip= on a net line of pct config, and none but loopback inside)" in text
    note = endpoint(NS(name="pve1"), None, 8000)["note"]
    assert note == "address unknown: none in the inventory; deploy discover pve1 --write reads it, or set address:"
    assert "records it" not in note  # it may find none: not a promise


def test_docs_section_not_found_suggests_and_lists_every_level():
    """Issue 53 item 14: `deploy docs` listed only the ## sections when a section was not found."""
    import pytest

    from orchestrator.core.errors import UsageError
    from orchestrator.deploy.scaffold import docs_text

    assert docs_text("playbooks#offline-and-air-gapped-hosts").startswith("#### Offline and air-gapped hosts")
    with pytest.raises(UsageError) as e:
        docs_text("playbooks#offline-and-air-gaped-hosts")
    assert "(did you mean #offline-and-air-gapped-hosts?)" in e.value.message
    assert "requires" in e.value.fix and "offline-and-air-gapped-hosts" in e.value.fix  # ### and #### too


def test_every_docs_anchor_named_in_the_code_exists():
    """Issue 53 item 6: a fix text linked docs/playbooks.md#fetch, which does not exist. Every
    `docs/PAGE.md#ANCHOR` (and `deploy docs PAGE#ANCHOR`) in the code and its help texts names a real heading."""
    import glob
    import re

    from orchestrator.deploy.scaffold import _slug

    anchors = {}
    for md in glob.glob(os.path.join(REPO, "docs", "*.md")):
        fenced, heads = False, set()
        for ln in open(md, encoding="utf-8"):
            if ln.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{1,6} ", ln):
                heads.add(_slug(ln.lstrip("#")))
        anchors[os.path.basename(md)[:-3]] = heads
    bad = []
    for py in glob.glob(os.path.join(REPO, "orchestrator", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(REPO, "testbed", "vpd_testbed", "**", "*.py"), recursive=True):
        text = open(py, encoding="utf-8").read()
        for page, anchor in re.findall(r"docs/([a-z-]+)\.md#([a-z0-9-]+)", text) + \
                re.findall(r"deploy docs ([a-z-]+)#([a-z0-9-]+)", text):
            if page in anchors and anchor not in anchors[page]:
                bad.append(f"{os.path.relpath(py, REPO)}: {page}#{anchor}")
    assert not bad, bad


def test_a_holders_argv_with_newlines_stays_on_one_line():
    """Issue 53 item 14: a holder started as `python -c 'SCRIPT'` has newlines in its argv; printed as is, they
    broke the FAILED block (its fix and state-left lines read as the script's)."""
    from orchestrator.steps.gpu import one_line

    s = one_line("python3 -c import os\nfd = os.open('/dev/nvidia0', 0)\r\n  while True: pass")
    assert "\n" not in s and "\r" not in s
    assert s == "python3 -c import os ⏎ fd = os.open('/dev/nvidia0', 0) ⏎ while True: pass"
