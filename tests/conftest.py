"""Shared fixtures: the test bed (a simulated Proxmox GPU fleet on this machine, see docs/testbed.md).

- `testbed` (session): hosts pve1 (containers 129 with GPUs 0-3 and 130 with GPUs 0-1: they share GPUs 0-1)
  and pve2 (container 129 with GPUs 0-3), 4 GPUs each. Started once, always torn down (also via atexit).
- `tb` (function): the same test bed after `reset()` (no processes in containers, stale drafter config,
  no faults, containers running). Use this one in tests.
- `inventory` (function): path of the test bed's hosts.yaml (after reset).

Tests that use them are skipped, with the reason, when not root or when OpenSSH's sshd is missing.
The state directory is $VPD_TEST_TESTBED_DIR or /tmp/vpd-testbed-pytest and the hosts listen on
127.77.1.<i>:2222 ($VPD_TEST_TESTBED_NET), apart from a `deploy testbed up` one (/tmp/vpd-testbed,
127.77.0.<i>), so a demo test bed can stay up while the tests run.
"""
import atexit
import os
import shutil

import pytest

TESTBED_CONTAINERS = {"pve1": {129: [0, 1, 2, 3], 130: [0, 1]}, "pve2": {129: [0, 1, 2, 3]}}


def testbed_skip_reason():
    if os.geteuid() != 0:
        return "needs root (the test bed uses mount/PID/network namespaces)"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "needs OpenSSH's sshd at /usr/sbin/sshd (apt-get install openssh-server)"
    for tool in ("unshare", "nsenter", "ssh", "ssh-keygen", "ip", "fuser"):
        if not shutil.which(tool):
            return "needs %s on PATH" % tool
    return None


@pytest.fixture(scope="session")
def testbed():
    reason = testbed_skip_reason()
    if reason:
        pytest.skip(reason)
    from orchestrator.testbed import Testbed

    root = os.environ.get("VPD_TEST_TESTBED_DIR") or "/tmp/vpd-testbed-pytest"
    if os.path.exists(root):  # left over from a killed session
        try:
            Testbed.load(root).down()
        except Exception:  # noqa: BLE001 - best effort, up() cleans what is left
            pass
    net = os.environ.get("VPD_TEST_TESTBED_NET") or "127.77.1."
    bed = Testbed(root=root, hosts=2, containers=TESTBED_CONTAINERS, gpus=4, net=net)

    def teardown():
        try:
            bed.down()
        except Exception:  # noqa: BLE001
            pass

    atexit.register(teardown)
    bed.up()
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
