"""Shared fixtures: the test bed (a simulated Proxmox GPU fleet on this machine, see docs/testbed.md).

- `testbed` (session): hosts pve1 (containers 129 with GPUs 0-3 and 130 with GPUs 0-1: they share GPUs 0-1)
  and pve2, pve3, pve4 (container 129 with GPUs 0-3 each), 4 GPUs per host. Started once, always torn down (also via atexit).
- `tb` (function): the same test bed after `reset()` (no processes in containers, stale drafter config,
  no faults, containers running). Use this one in tests.
- `inventory` (function): path of the test bed's hosts.yaml (after reset).

Tests that use them are skipped, with the reason, when not root or when OpenSSH's sshd is missing.
The state directory is $VPD_TEST_TESTBED_DIR or /tmp/vpd-tb-<pytest pid>, and the hosts listen on
127.77.N.<i>:2222 with the first free N >= 1 ($VPD_TEST_TESTBED_NET to force one), apart from a
`deploy testbed up` one (/tmp/vpd-testbed, 127.77.0.<i>): a demo test bed can stay up while the tests
run, and concurrent pytest sessions do not tear down each other's test bed.
"""
import atexit
import os
import shutil

import pytest

TESTBED_CONTAINERS = {"pve1": {129: [0, 1, 2, 3], 130: [0, 1]}, "pve2": {129: [0, 1, 2, 3]},
                      "pve3": {129: [0, 1, 2, 3]}, "pve4": {129: [0, 1, 2, 3]}}


def testbed_skip_reason():
    if os.geteuid() != 0:
        return "needs root (the test bed uses mount/PID/network namespaces)"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "needs OpenSSH's sshd at /usr/sbin/sshd (apt-get install openssh-server)"
    for tool in ("unshare", "nsenter", "ssh", "ssh-keygen", "ip", "fuser"):
        if not shutil.which(tool):
            return "needs %s on PATH" % tool
    return None


def _clean_stale_beds(Testbed):
    """Test beds of pytest sessions that died without tearing down (their PID is gone)."""
    import glob
    for d in glob.glob("/tmp/vpd-tb-*"):
        pid = d.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists("/proc/%s" % pid):
            try:
                Testbed.load(d).down()
            except Exception:  # noqa: BLE001 - best effort
                shutil.rmtree(d, ignore_errors=True)


def _free_net(skip=()):
    """First 127.77.N. (N = 1..60) whose pve1/pve2 ports are free: concurrent sessions do not collide."""
    import socket
    fixed = os.environ.get("VPD_TEST_TESTBED_NET")
    if fixed:
        return fixed
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]  # pytest -n: each worker its own range
    start = 1 + 12 * (int(worker) % 5 if worker.isdigit() else 0)
    for n in list(range(start, 61)) + list(range(1, start)):
        if "127.77.%d." % n in skip:
            continue
        ok = True
        for i in (1, 2, 3, 4):
            with socket.socket() as s:
                try:
                    s.bind(("127.77.%d.%d" % (n, i), 2222))
                except OSError:
                    ok = False
        if ok:
            return "127.77.%d." % n
    return "127.77.1."


@pytest.fixture(scope="session")
def testbed():
    reason = testbed_skip_reason()
    if reason:
        pytest.skip(reason)
    from vpd_testbed import Testbed

    _clean_stale_beds(Testbed)
    root = os.environ.get("VPD_TEST_TESTBED_DIR") or "/tmp/vpd-tb-%d" % os.getpid()
    if os.path.exists(root):
        try:
            Testbed.load(root).down()
        except Exception:  # noqa: BLE001 - best effort, up() cleans what is left
            pass
    from vpd_testbed.common import TestbedError

    tried, bed = set(), None

    def teardown():
        try:
            if bed is not None:
                bed.down()
        except Exception:  # noqa: BLE001
            pass

    atexit.register(teardown)
    for attempt in range(3):  # another pytest session on this machine may take the chosen addresses first
        bed = Testbed(root=root, hosts=len(TESTBED_CONTAINERS), containers=TESTBED_CONTAINERS, gpus=4,
                      net=_free_net(tried))
        try:
            bed.up()
            break
        except TestbedError:
            if attempt == 2 or os.environ.get("VPD_TEST_TESTBED_NET"):
                raise
            tried.add(bed.net)
    try:
        yield bed
    finally:
        teardown()
        atexit.unregister(teardown)


@pytest.fixture
def tb(testbed):
    testbed.reset()
    yield testbed


@pytest.fixture
def inventory(tb):
    return tb.inventory_path


def pytest_collection_modifyitems(config, items):
    """The real-vLLM tier (tests/e2e/test_real_vllm.py) is the longest file: first, so that one pytest-xdist worker
    (--dist loadfile: the whole file on one worker, its servers one at a time) starts on it at once."""
    items.sort(key=lambda it: 0 if "test_real_vllm.py" in it.nodeid else 1)  # stable: the rest keep their order

