"""remote.py's start-up details (issue 23): paramiko imported without Invoke (and given it back for Fabric), the
early TCP dial, TCP_NODELAY. Real sockets on 127.0.0.1, real imports in a fresh interpreter."""

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_paramiko_without_invoke_and_fabric_gets_it_back():
    out = run_py(
        "import sys\n"
        "from orchestrator.core.remote import paramiko_module, _with_invoke\n"
        "pm = paramiko_module()\n"
        "import paramiko.config as pc\n"
        "print('invoke' in sys.modules, pc.invoke is None, pm.SSHClient.__name__)\n"
        "import fabric\n"
        "_with_invoke()\n"
        "print('invoke' in sys.modules, pc.invoke is sys.modules['invoke'], pc.invoke_import_error)\n")
    first, second = out.splitlines()
    assert first == "False True SSHClient"  # Invoke (~40 ms) not loaded for a host given by address
    assert second == "True True None"  # an ssh_config_alias host: `Match exec` works again


def test_paramiko_without_importlib_metadata_keeps_its_true_version():
    # paramiko/__init__ asks importlib.metadata for its version only; the stand-in answers from the .dist-info
    # folder's name, leaves the real module unloaded (issue 54: ~20-40 ms of `deploy status`) and out of
    # sys.modules afterwards, so a later `import importlib.metadata` gets the real one and the same answer
    out = run_py(
        "import sys\n"
        "from orchestrator.core.remote import paramiko_module\n"
        "pm = paramiko_module()\n"
        "print('importlib.metadata' in sys.modules, pm.__version__)\n"
        "import importlib.metadata as md\n"
        "print(type(md).__name__, md.version('paramiko'), md.version('paramiko') == pm.__version__)\n")
    first, second = out.splitlines()
    loaded, version = first.split()
    assert loaded == "False" and version[0].isdigit()
    assert second == f"module {version} True"


def test_metadata_stand_in_hands_what_it_cannot_answer_to_the_real_module():
    from orchestrator.core.remote import _VersionOnlyMetadata

    m = _VersionOnlyMetadata()
    assert m.version("paramiko") == subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('paramiko'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    import importlib.metadata as real

    assert m.version("PyYAML") == real.version("PyYAML")  # no module of that name: the real lookup
    assert m.distribution is real.distribution  # anything else: the real module's


def test_dial_connects_early_and_sets_nodelay():
    from orchestrator.core.remote import _Dial

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        d = _Dial("127.0.0.1", srv.getsockname()[1], 5.0)
        sock = d.take()
        assert sock is not None and sock.getblocking()
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        sock.close()
    finally:
        srv.close()


def test_a_refused_dial_falls_back_to_paramikos_own_connect():
    """Refused at once: take() returns None and the caller connects as before (so its error reads as before)."""
    from orchestrator.core.remote import _Dial

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    d = _Dial("127.0.0.1", port, 5.0)
    assert d.take() is None
    d.close()


CONNECT_WITH = (
    "import sys, time\n"
    "from orchestrator.core import remote\n"
    "from orchestrator.core.spec import HostSpec\n"
    "fails = %r\n"
    "class Conn:\n"
    "    is_connected = True\n"
    "    transport = None\n"
    "    def open(self):\n"
    "        if fails:\n"
    "            raise fails.pop(0)\n"
    "opened = []\n"
    "remote.HostSession._connection = lambda self, sock=None: opened.append(time.monotonic()) or Conn()\n"
    "h = HostSpec('pve1', '127.0.0.1', None, 1, 'root', None, '/dev/null', False, 5.0, ())\n"
    "s = remote.HostSession(h, remote.AuditLog(path=sys.argv[1]))\n"
    "try:\n"
    "    s.connect()\n"
    "    print('connected', len(opened), 'tenacity' in sys.modules, round(opened[-1] - opened[0], 1))\n"
    "except Exception as e:\n"
    "    print(type(e).__name__, len(opened), 'tenacity' in sys.modules, e.message.split(':')[0])\n")


def test_tenacity_is_imported_only_when_a_first_connect_attempt_fails(tmp_path):
    """The connect's retry (tenacity, ~25 ms of start-up) is loaded only on the retry path; the policy is as it
    was: a refused connect is tried again after 0.2 s, at most 3 attempts in all, then Unreachable."""
    def run(fails: str) -> str:
        p = subprocess.run([sys.executable, "-c", CONNECT_WITH.replace("%r", fails),
                            str(tmp_path / "audit.jsonl")], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout.split()

    assert run("[]") == ["connected", "1", "False", "0.0"]
    done, attempts, loaded, waited = run("[ConnectionRefusedError(111, 'refused')]")
    assert (done, attempts, loaded) == ("connected", "2", "True") and 0.2 <= float(waited) < 1.0
    assert run("[ConnectionRefusedError(111, 'refused')] * 5") == ["Unreachable", "3", "True", "cannot", "connect"]
    # not retryable (a bad key file, an auth failure...): one attempt, tenacity never loaded
    assert run("[PermissionError(13, 'denied')]")[:3] == ["Unreachable", "1", "False"]


def test_prometheus_parser_without_the_package_init_then_the_whole_package_as_usual():
    """status reads vLLM's /metrics with prometheus_client's own parser, loaded without the package's __init__ and
    its HTTP exposition (~40 ms of CPU); afterwards `import prometheus_client` (deploy monitor metrics) is whole."""
    out = run_py(
        "import sys\n"
        "from orchestrator.core.vllm_facts import prometheus_parser, parse_spec_counters\n"
        "fams = list(prometheus_parser().text_string_to_metric_families('# TYPE a gauge\\na{x=\"1\"} 2\\n'))\n"
        "print(fams[0].name, fams[0].samples[0].value, 'http.server' in sys.modules,\n"
        "      sorted(m for m in sys.modules if m.startswith('prometheus_client')))\n"
        "import prometheus_client.parser, prometheus_client\n"
        "from prometheus_client import CollectorRegistry, generate_latest\n"
        "print(prometheus_client.parser.text_string_to_metric_families is not None, generate_latest(CollectorRegistry()),\n"
        "      prometheus_parser() is prometheus_client.parser)\n")
    first, second = out.splitlines()
    assert first == "a 2 False []"
    assert second == "True b'' True"



def test_connect_ahead_hands_its_connection_or_its_error_to_the_next_connect(monkeypatch, tmp_path):
    """deploy status connects ahead (while it imports): the row's connect() gets that connection and its first
    channel (opened ahead: the spare), or the error the attempts met, raised once: no second round of attempts."""
    import threading
    import time

    from orchestrator.core import remote
    from orchestrator.core.errors import Unreachable
    from orchestrator.core.spec import HostSpec, Inventory

    opened, release, refuse = [], threading.Event(), []

    class Transport:
        def open_session(self, timeout=None):
            return Channel()

    class Channel:
        closed, active, transport = False, True, None

    class Conn:
        is_connected, transport = True, Transport()

        def open(self):
            release.wait(10)  # the row's connect() comes while this one is still under way
            if refuse:
                raise ConnectionRefusedError(111, "Connection refused")

    Channel.transport = Conn.transport
    monkeypatch.setattr(remote.HostSession, "_connection", lambda self, sock=None: opened.append(1) or Conn())
    h = HostSpec("pve1", "127.0.0.1", None, 1, "root", None, "/dev/null", False, 5.0, ())
    for fails in (False, True):
        opened.clear()
        refuse[:] = [1] if fails else []
        release.clear()
        fleet = remote.Fleet(Inventory("hosts.yaml", {"pve1": h}), audit=remote.AuditLog(path=str(tmp_path / "a")))
        s = fleet.session("pve1")
        fleet.connect_ahead(["pve1"])
        end = time.monotonic() + 10
        while not opened and time.monotonic() < end:  # the ahead thread is connecting (it holds the lock)
            time.sleep(0.01)
        threading.Timer(0.1, release.set).start()
        if not fails:
            conn = s.connect()
            assert isinstance(conn, Conn) and isinstance(s._take_spare(), Channel) and opened == [1]
            assert s.connect() is conn and opened == [1]
            continue
        try:
            s.connect()
            raise AssertionError("connect() did not raise the error met ahead")
        except Unreachable as e:
            assert "Connection refused" in e.message
        assert len(opened) == 3  # the ahead round's 3 attempts only: the row's connect raised its error
        try:
            s.connect()  # a later connect (--watch's next refresh) tries again, as before
        except Unreachable:
            pass
        assert len(opened) == 6


def test_commands_load_lazily_and_help_lists_them_all():
    """`deploy status` loads its own command module only (click's lazily loaded subcommands); --help and
    completion list every command, as before."""
    out = run_py(
        "import sys\n"
        "from orchestrator.cli import main\n"
        "main.get_command(None, 'status')\n"
        "print(sorted(m for m in sys.modules if m.startswith('orchestrator.cli.')), 'orchestrator.steps' in sys.modules)\n"
        "print(' '.join(main.list_commands(None)))\n")
    first, second = out.splitlines()
    assert first == "['orchestrator.cli.base', 'orchestrator.cli.serving'] False"
    assert second == ("apply-config compare discover docs doctor down endpoint fetch init install-vllm logs manifest "
                      "monitor plan prepare restart schema size status testbed tune unlock up verify")


def test_prometheus_parser_is_loaded_once_per_process():
    """Every row of a status (48 on a big fleet, each --watch refresh) parses /metrics: the parser's modules load
    once, not once per call."""
    out = run_py(
        "from orchestrator.core.vllm_facts import prometheus_parser\n"
        "print(prometheus_parser() is prometheus_parser())\n")
    assert out.strip() == "True"
