"""Tests of the test bed itself: pct formats and errors, exec passthrough over real ssh, isolation, fake GPU
memory and kill semantics, fault switches, reset and cleanup. Formats follow docs/domain/proxmox-lxc.md."""
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from vpd_testbed.core import Testbed, TestbedError, safetensors_header
from slack import slack

pytestmark = pytest.mark.root

QUERY = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"]
HEADER = "%-10s %-10s %-12s %-20s\n" % ("VMID", "Status", "Lock", "Name")


def ssh(tb, host, cmd, input=None, timeout=30, port=None):
    return subprocess.run(tb.ssh_argv(host, cmd, port=port), input=input, capture_output=True, text=True,
                          timeout=timeout)


def used(tb, host, vmid, gpu=None):
    r = tb.container_exec(host, vmid, QUERY, timeout=10)
    assert r.returncode == 0, r.stderr
    rows = {int(a): int(b) for a, b, _ in (line.split(", ") for line in r.stdout.splitlines())}
    return rows if gpu is None else rows[gpu]


def hold(tb, host, vmid, gpu, mib, ignore_term=False):
    """Start a detached process in the container holding /dev/nvidia<gpu> at offset mib MiB; return its PID
    inside the container."""
    code = ("import os, signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "fd = os.open('/dev/nvidia%d', os.O_RDWR)\nos.lseek(fd, %d << 20, 0)\n"
              "print(os.getpid(), flush=True)\ntime.sleep(300)\n" % (gpu, mib))
    r = tb.container_exec(host, vmid, ["sh", "-c", "setsid -f python3 -c %s > /tmp/holder.pid 2>&1 < /dev/null"
                                       % shlex.quote(code)])
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pid = tb.container_exec(host, vmid, ["cat", "/tmp/holder.pid"]).stdout.strip()
        if pid and used(tb, host, vmid, gpu) >= mib:
            return int(pid)
        time.sleep(0.02)
    raise AssertionError("holder did not show up")


def wait_for(cond, timeout=5.0, what="condition"):
    deadline = time.monotonic() + slack(timeout)  # an upper bound: returns as soon as cond() holds
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("timed out waiting for " + what)


# ---- pct -------------------------------------------------------------------------------------------
def test_pct_list_fixed_width(tb):
    r = ssh(tb, "pve1", "pct list")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (HEADER + "%-10s %-10s %-12s %-20s\n" % ("129", "running", "", "vllm-qwen")
                        + "%-10s %-10s %-12s %-20s\n" % ("130", "running", "", "vllm-130"))
    tb.stop_container("pve1", 130)
    r = ssh(tb, "pve1", "pct list")
    assert r.stdout.splitlines()[2] == "%-10s %-10s %-12s %-20s" % ("130", "stopped", "", "vllm-130")


def test_pct_list_empty_prints_nothing(tb, tmp_path):
    host = tmp_path / "h"
    host.mkdir()
    (host / "host.json").write_text(json.dumps({"name": "pve9", "containers": {}, "gpus": 1}))
    code = "import sys; sys.path.insert(0, %r); import pct; sys.exit(pct.main(%r, ['list']))" % (
        str(tb.root / "bin"), str(host))
    r = subprocess.run([tb.python, "-SE", "-c", code], capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_pct_status_and_errors(tb):
    tb.stop_container("pve1", 130)
    r = ssh(tb, "pve1", "pct status 129; echo rc=$?; pct status 130; pct status 999; echo rc=$?")
    assert r.stdout == "status: running\nrc=0\nstatus: stopped\nrc=255\n"
    assert r.stderr == "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n"
    r = ssh(tb, "pve1", "pct exec 130 -- true")
    assert (r.returncode, r.stderr) == (255, "container '130' not running!\n")
    r = ssh(tb, "pve1", "pct exec 129 true")
    assert (r.returncode, r.stderr) == (255, "missing command\n")
    r = ssh(tb, "pve1", "pct exec 999 -- true")
    assert (r.returncode, r.stderr) == (255, "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n")
    r = ssh(tb, "pve1", "pct start 130 && pct status 130 && pct exec 130 -- cat /etc/hostname")
    assert (r.returncode, r.stdout) == (0, "status: running\nvllm-130\n"), r.stderr


def test_pct_config_lists_gpus(tb):
    r = ssh(tb, "pve1", "pct config 130")
    lines = r.stdout.splitlines()
    assert "hostname: vllm-130" in lines
    assert "dev0: /dev/nvidia0" in lines and "dev1: /dev/nvidia1" in lines
    assert not any(x.endswith("/dev/nvidia2") for x in lines)
    assert "lxc.cgroup2.devices.allow: c 195:* rwm" in lines


def test_pct_mount_points(tb, tmp_path):
    """pct set --mpN: a bind mount of a host directory, in the config as pve-container writes it, mounted at each
    start (read-only with ro=1; a change while the container runs counts from its next start); bad values are
    refused with pct's messages and leave the config as it was."""
    ro, rw = tmp_path / "store", tb.root / "pve1" / "mp-rw"  # under /tmp: hidden in the container but by the mount
    ro.mkdir()
    rw.mkdir()
    (ro / "weights.txt").write_text("w1\n")
    try:
        tb.stop_container("pve1", 130)
        r = ssh(tb, "pve1", "pct set 130 --mp0 %s,ro=true,mp=/root/store --mp1 volume=%s,mp=/tmp/rw,backup=0"
                % (ro, rw))
        assert r.returncode == 0, r.stderr
        conf = ssh(tb, "pve1", "pct config 130").stdout.splitlines()
        assert "mp0: %s,mp=/root/store,ro=1" % ro in conf and "mp1: %s,mp=/tmp/rw,backup=0" % rw in conf
        assert conf == sorted(k for k in conf if not k.startswith("lxc.")) + [k for k in conf if k.startswith("lxc.")]
        r = ssh(tb, "pve1", "pct start 130")
        assert r.returncode == 0, r.stderr
        (ro / "late.txt").write_text("late\n")  # a bind mount: what the host writes later shows inside
        r = tb.container_exec("pve1", 130, ["cat", "/root/store/weights.txt", "/root/store/late.txt"])
        assert (r.returncode, r.stdout) == (0, "w1\nlate\n"), r.stderr
        r = tb.container_exec("pve1", 130, ["sh", "-c", "echo x > /root/store/new"])
        assert r.returncode != 0 and "Read-only file system" in r.stderr
        assert not (ro / "new").exists()
        r = tb.container_exec("pve1", 130, ["sh", "-c", "echo out > /tmp/rw/out.txt"])
        assert r.returncode == 0, r.stderr
        assert (rw / "out.txt").read_text() == "out\n"
        # while it runs: the next start counts
        assert ssh(tb, "pve1", "pct set 130 --delete mp0").returncode == 0
        assert "mp0:" not in ssh(tb, "pve1", "pct config 130").stdout
        assert tb.container_exec("pve1", 130, ["cat", "/root/store/weights.txt"]).stdout == "w1\n"
        r = ssh(tb, "pve1", "pct reboot 130")
        assert r.returncode == 0, r.stderr
        r = tb.container_exec("pve1", 130, ["sh", "-c", "ls -A /root/store; cat /tmp/rw/out.txt"])
        assert (r.returncode, r.stdout) == (0, "out\n"), r.stderr
        before = ssh(tb, "pve1", "pct config 130").stdout
        for opt, err in (
                ("--mp2 %s,mp=models" % ro, "mp2: invalid format - format error\n"
                                            "mp2.mp: mount point path 'models' is not absolute"),
                ("--mp2 %s" % ro, "mp2: invalid format - format error\n"
                                  "mp2.mp: property is missing and it is not optional"),
                ("--mp2 %s,mp=/m,ro=maybe" % ro, "mp2: invalid format - format error\n"
                                                 "mp2.ro: type check ('boolean') failed - got 'maybe'"),
                ("--mp2 %s,mp=/m,size=1,rw=1" % ro, "mp2: invalid format - invalid key in comma-separated list "
                                                    "property: rw"),
                ("--mp2 %s/nonexistent,mp=/m" % ro, "mp2: directory '%s/nonexistent' does not exist" % ro)):
            r = ssh(tb, "pve1", "pct set 130 %s" % opt)
            assert (r.returncode, r.stderr) == (255, "400 Parameter verification failed.\n%s\n" % err), opt
        assert ssh(tb, "pve1", "pct set 130 --mp256 %s,mp=/m" % ro).stderr.startswith("Unknown option: mp256\n")
        assert ssh(tb, "pve1", "pct config 130").stdout == before
        # the host directory gone before a start: the start fails as pve-container's does
        rw.rename(rw.with_name("mp-rw.gone"))
        tb.stop_container("pve1", 130)
        r = ssh(tb, "pve1", "pct start 130")
        assert (r.returncode, r.stderr) == (255, "startup for container '130' failed: directory '%s' does not exist\n"
                                            % rw), r.stderr
    finally:
        tb.stop_container("pve1", 130)  # reset() puts the config back and starts it without the mount points
        import shutil
        shutil.rmtree(rw, ignore_errors=True)
        shutil.rmtree(rw.with_name("mp-rw.gone"), ignore_errors=True)


def test_exec_status_stdin_and_env_over_ssh(tb):
    r = ssh(tb, "pve1", "pct exec 129 -- sh -c 'cat; echo err >&2; exit 7'", input="line1\n'$(x)';\n")
    assert (r.returncode, r.stdout, r.stderr) == (7, "line1\n'$(x)';\n", "err\n")
    r = ssh(tb, "pve1", "VPD_X=1 pct exec 129 -- sh -c 'echo ${VPD_X:-unset}'")
    assert r.stdout == "1\n"
    r = ssh(tb, "pve1", "VPD_X=1 pct exec 129 --keep-env 0 -- sh -c 'echo ${VPD_X:-unset}'")
    assert r.stdout == "unset\n"
    r = ssh(tb, "pve1", "pct exec 129 -- bash -lc 'command -v python3 vllm nvidia-smi; pwd'")
    assert r.stdout.split() == ["/root/ml-env/bin/python3", "/root/ml-env/bin/vllm", "/usr/bin/nvidia-smi",
                                "/root"]


def test_old_pct_rejects_keep_env(tb):
    tb.set_fault("pve1", None, "keep_env_supported", False)
    r = ssh(tb, "pve1", "pct exec 129 --keep-env 0 -- true")
    assert r.returncode == 255
    assert r.stderr.splitlines()[:2] == ["Unknown option: keep-env", "400 unable to parse option"]
    assert ssh(tb, "pve1", "pct exec 129 -- true").returncode == 0


def test_push_pull(tb, tmp_path):
    src = tmp_path / "f"
    src.write_text("data\n")
    r = tb.host_exec("pve1", ["sh", "-c", "pct push 129 %s /root/pushed --perms 0600 && "
                                          "pct pull 129 /root/models/Qwen3.6-27B/config.json %s/pulled"
                              % (src, tmp_path)])
    assert r.returncode == 0, r.stderr
    r = tb.container_exec("pve1", 129, ["stat", "-c", "%a %s", "/root/pushed"])
    assert r.stdout == "600 5\n"
    assert json.loads((tmp_path / "pulled").read_text())["model_type"] == "qwen3_5"


# ---- containers ------------------------------------------------------------------------------------
def test_pid_and_fs_isolation(tb):
    r = ssh(tb, "pve1", "pct exec 129 -- ps -eo pid=,args=")
    procs = [line.split(None, 1) for line in r.stdout.splitlines()]
    assert procs[0][0] == "1" and "ctinit.py" in procs[0][1]
    assert not any("sshd" in a for _, a in procs)
    assert len(procs) <= 3  # init, (nsenter'd) ps
    r = tb.container_exec("pve1", 129, ["sh", "-c", "touch /tmp/mine; ls /root; cat /etc/hostname"])
    assert r.stdout.split() == ["ml-env", "models", "vllm-qwen"]
    assert tb.container_exec("pve1", 130, ["test", "-e", "/tmp/mine"]).returncode == 1
    # own network namespace: the same port is free in every container
    r = tb.container_exec("pve1", 130, ["ls", "/dev"])
    assert "nvidia1" in r.stdout.split() and "nvidia2" not in r.stdout.split()


def test_container_files(tb):
    cfg = tb.container_exec("pve1", 129, ["cat", "/root/models/Qwen3.6-27B-DFlash/config.json"]).stdout
    stale = (tb.root / "pve1" / "ct129" / "faults" / "stale-drafter-config.json").read_text()
    assert cfg == stale
    raw = tb.container_exec("pve1", 129, ["cat", "/root/models/Qwen3.6-27B-DFlash/model.safetensors"],
                            text=False).stdout
    assert raw == safetensors_header()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    assert hdr["fc.weight"]["shape"] == [5120, 25600]
    assert {k.split(".")[1] for k in hdr if k.startswith("layers.")} == {"0", "1", "2", "3", "4"}
    r = tb.container_exec("pve1", 129, ["cat", "/etc/vpd-testbed/faults.json"])
    assert json.loads(r.stdout) == {}
    assert tb.container_exec("pve1", 129, ["sh", "-c", "echo x > /etc/vpd-testbed/faults.json"]).returncode != 0


def test_transformers_in_container(tb):
    code = ("from transformers import AutoConfig; "
            "c = AutoConfig.from_pretrained('/root/models/Qwen3.6-27B', trust_remote_code=True); "
            "print(type(c).__name__)")
    r = tb.container_exec("pve1", 129, ["/root/ml-env/bin/python", "-c", code], timeout=120)
    assert r.returncode == 0, r.stderr
    r = tb.container_exec("pve1", 129, ["/root/ml-env/bin/python", "-c", "import vllm; print(vllm.__version__)"])
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


# ---- GPUs ------------------------------------------------------------------------------------------
def test_nvidia_smi_formats(tb):
    r = tb.container_exec("pve1", 130, ["nvidia-smi", "--query-gpu=index,name,memory.used,memory.total,uuid",
                                        "--format=csv"])
    lines = r.stdout.splitlines()
    assert lines[0] == "index, name, memory.used [MiB], memory.total [MiB], uuid"
    assert len(lines) == 3
    idx, name, mu, mt, uuid = lines[1].split(", ")
    assert (idx, name, mu, mt) == ("0", "NVIDIA H100 80GB HBM3", "0 MiB", "81559 MiB")
    assert uuid.startswith("GPU-") and len(uuid) == 40
    r = tb.container_exec("pve1", 129, QUERY)
    assert r.stdout == "".join("%d, 0, 81559\n" % i for i in range(4))
    r = tb.container_exec("pve1", 129, ["nvidia-smi", "-L"])
    assert r.stdout.splitlines()[3].startswith("GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-")
    r = tb.container_exec("pve1", 129, ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                        "--format=csv,noheader"])
    assert (r.returncode, r.stdout) == (0, "")
    r = tb.container_exec("pve1", 129, ["nvidia-smi", "-i", "2", "--query-gpu=index", "--format=csv,noheader"])
    assert r.stdout == "2\n"
    r = tb.container_exec("pve1", 129, ["nvidia-smi"])
    assert "NVIDIA H100 80GB HBM3" in r.stdout and "No running processes found" in r.stdout


@pytest.mark.deadline
def test_nvidia_smi_starts_fast(tb):
    t = time.monotonic()
    for _ in range(5):
        assert tb.container_exec("pve1", 129, QUERY).returncode == 0
    assert (time.monotonic() - t) / 5 < slack(0.1)


def test_memory_follows_holders_and_release_delay(tb):
    tb.set_fault("pve1", None, "release_delay_s", 1.0)
    pid = hold(tb, "pve1", 129, 1, 1500)
    assert used(tb, "pve1", 129) == {0: 0, 1: 1500, 2: 0, 3: 0}
    assert used(tb, "pve1", 130, 1) == 1500  # same GPU, other container
    assert used(tb, "pve2", 129, 1) == 0  # other host
    tb.container_exec("pve1", 129, ["kill", "-9", str(pid)])
    t = time.monotonic()
    wait_for(lambda: used(tb, "pve1", 130, 1) == 0, 5, "release")
    assert time.monotonic() - t >= 0.8


def test_fuser_kill_is_per_container(tb):
    hold(tb, "pve1", 129, 0, 2000)
    r = tb.container_exec("pve1", 130, ["fuser", "-k", "/dev/nvidia0"])
    assert r.returncode == 1  # no holder in 130
    assert used(tb, "pve1", 130, 0) == 2000  # ... but the memory is used: held from elsewhere
    r = tb.container_exec("pve1", 129, ["fuser", "-v", "/dev/nvidia0"])
    assert "python3" in r.stderr and "kernel" not in r.stdout + r.stderr
    r = tb.container_exec("pve1", 129, ["fuser", "-k", "/dev/nvidia0"])
    assert r.returncode == 0
    wait_for(lambda: used(tb, "pve1", 129, 0) == 0, 3, "release")


def test_nvidia_smi_hang(tb):
    tb.set_fault("pve1", None, "nvidia_smi_hang", True)
    with pytest.raises(subprocess.TimeoutExpired):
        tb.container_exec("pve1", 129, QUERY, timeout=1)
    assert tb.container_exec("pve2", 129, QUERY, timeout=5).returncode == 0
    tb.set_fault("pve1", None, "nvidia_smi_hang", None)
    assert tb.container_exec("pve1", 129, QUERY, timeout=5).returncode == 0


def test_foreign_holder_and_sigterm_ignoring_holder(tb):
    tb.set_fault("pve1", None, "foreign_holder", {"gpu": 2, "mib": 30000})
    assert used(tb, "pve1", 129, 2) == 30000
    assert tb.container_exec("pve1", 129, ["fuser", "/dev/nvidia2"]).returncode == 1
    tb.set_fault("pve1", None, "foreign_holder", None)
    wait_for(lambda: used(tb, "pve1", 129, 2) == 0, 3, "foreign holder gone")
    tb.set_fault("pve1", 130, "sigterm_ignoring_holder_mib", 4000)
    assert used(tb, "pve1", 129, 0) == 4000
    tb.container_exec("pve1", 130, ["fuser", "-k", "-TERM", "/dev/nvidia0"])
    time.sleep(0.3)  # a SIGTERM that is ignored: nothing to poll for
    assert used(tb, "pve1", 130, 0) == 4000
    tb.container_exec("pve1", 130, ["fuser", "-k", "/dev/nvidia0"])
    wait_for(lambda: used(tb, "pve1", 130, 0) == 0, 3, "SIGKILL frees it")


# ---- container faults ------------------------------------------------------------------------------
def test_readonly_models_port_in_use_and_faults_file(tb):
    tb.set_fault("pve1", 129, "readonly_models", True)
    r = tb.container_exec("pve1", 129, ["sh", "-c", "echo x > /root/models/Qwen3.6-27B-DFlash/config.json"])
    assert r.returncode != 0 and "Read-only" in r.stderr
    tb.set_fault("pve1", 129, "readonly_models", None)
    assert tb.container_exec("pve1", 129, ["touch", "/root/models/x"]).returncode == 0
    tb.set_fault("pve1", 129, "port_in_use", 8000)
    r = tb.container_exec("pve1", 129, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                        "http://127.0.0.1:8000/health"])
    assert r.stdout == "404"
    r = tb.container_exec("pve1", 130, ["curl", "-s", "http://127.0.0.1:8000/health"])
    assert r.returncode == 7  # refused: containers have their own network namespace
    tb.set_fault("pve1", 129, "load_s", 0.5)
    r = tb.container_exec("pve1", 129, ["cat", "/etc/vpd-testbed/faults.json"])
    assert json.loads(r.stdout) == {"port_in_use": 8000, "load_s": 0.5}


def test_config_revert(tb):
    tb.set_fault("pve1", 129, "config_revert_s", 0.3)
    path = "/root/models/Qwen3.6-27B-DFlash/config.json"
    stale = tb.container_exec("pve1", 129, ["cat", path]).stdout
    tb.container_exec("pve1", 129, ["sh", "-c", "cat > %s" % path], input='{"new": 1}\n')
    assert tb.container_exec("pve1", 129, ["cat", path]).stdout == '{"new": 1}\n'
    wait_for(lambda: tb.container_exec("pve1", 129, ["cat", path]).stdout == stale, 5, "revert")


@pytest.mark.deadline
def test_reset_restores_state(tb):
    tb.container_exec("pve1", 129, ["sh", "-c", "mkdir -p /var/lib/vllm-pve-deploy && echo 1 > "
                                    "/var/lib/vllm-pve-deploy/state.json && echo {} > "
                                    "/root/models/Qwen3.6-27B-DFlash/config.json && "
                                    "touch /root/models/Qwen3.6-27B-DFlash/config.json.bak-20260101T000000Z"])
    hold(tb, "pve1", 129, 3, 100)
    tb.set_fault("pve1", 129, "readonly_models", True)
    tb.stop_container("pve1", 130)
    t = time.monotonic()
    tb.reset()
    assert time.monotonic() - t < slack(1.0)
    assert tb.init_pid("pve1", 130)
    assert tb.container_pids("pve1", 129) == []
    assert tb.gpu_used("pve1") == [0, 0, 0, 0]
    r = tb.container_exec("pve1", 129, ["sh", "-c", "ls /var/lib/vllm-pve-deploy; ls /root/models/*DFlash; "
                                        "touch /root/models/w && echo writable"])
    assert r.stdout.split() == ["config.json", "model.safetensors", "writable"]
    assert tb.faults("pve1", 129) == {}


# ---- host faults -----------------------------------------------------------------------------------
def test_unreachable(tb):
    tb.set_fault("pve2", None, "unreachable", True)
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex((tb.address("pve2"), 2222)) != 0
    assert ssh(tb, "pve2", "true").returncode == 255
    assert tb.container_exec("pve2", 129, ["true"]).returncode == 0  # containers keep running
    tb.set_fault("pve2", None, "unreachable", None)
    assert ssh(tb, "pve2", "pct status 129").stdout == "status: running\n"


def test_latency_ms(tb):
    base = tb.inventory_path
    tb.set_fault("pve2", None, "latency_ms", 200)
    assert "port: %d" % tb.lag_port("pve2") in open(base).read()
    t = time.monotonic()
    r = ssh(tb, "pve2", "pct status 129")
    assert r.stdout == "status: running\n", r.stderr
    assert time.monotonic() - t > 0.6  # several round trips of 200 ms
    tb.set_fault("pve2", None, "latency_ms", None)
    assert "port: %d" % tb.lag_port("pve2") not in open(base).read()


@pytest.mark.deadline
def test_ssh_drop_after_s(tb):
    # the cut counts from when the connection opened, so it must leave room for the handshake and the
    # first echo on a busy machine (0.5 s did not, under a parallel suite); still well short of the sleep
    drop = min(slack(2.0), 6.0)
    tb.set_fault("pve2", None, "ssh_drop_after_s", drop)
    t = time.monotonic()
    r = ssh(tb, "pve2", "echo started; sleep 12; echo finished", timeout=20)
    assert r.returncode == 255 and r.stdout == "started\n", r.stderr
    assert time.monotonic() - t < drop + slack(5)


# ---- life cycle ------------------------------------------------------------------------------------
@pytest.mark.deadline
def test_up_refuses_taken_port_and_down_leaves_nothing(tb, tmp_path):
    root = str(tb.root) + "-2"
    with pytest.raises(TestbedError, match="already in use"):
        Testbed(root=root + "x", hosts=1, containers=[129], gpus=2, net=tb.net).up()
    assert not os.path.exists(root + "x") or not os.listdir(root + "x")
    bed = Testbed(root=root, hosts=1, containers=[129, 131], gpus=2, net="127.77.%d." % (200 + os.getpid() % 50))
    t = time.monotonic()
    bed.up()
    assert time.monotonic() - t < slack(5)
    try:
        r = subprocess.run(bed.ssh_argv("pve1", "pct list | wc -l; pct exec 131 -- setsid -f sleep 300 "
                                        "</dev/null >/dev/null 2>&1; setsid -f sleep 301 </dev/null >/dev/null 2>&1"),
                           capture_output=True, text=True, timeout=30)
        assert r.stdout == "3\n", r.stderr
        hold(bed, "pve1", 129, 1, 10)
        bed.set_fault("pve1", None, "foreign_holder", {"gpu": 0, "mib": 5})
        bed.set_fault("pve1", None, "latency_ms", 10)
        bed.set_fault("pve1", 129, "config_revert_s", 1.0)
        sess = subprocess.Popen(bed.ssh_argv("pve1", "sleep 300"), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: "Starting session" in (bed.root / "pve1" / "sshd.log").read_text(), 10, "session")
    finally:
        t = time.monotonic()
        bed.down()
        took = time.monotonic() - t
    sess.wait(timeout=10)
    assert took < slack(5)
    assert not os.path.exists(root)
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != me:
            try:
                cmd = open("/proc/%s/cmdline" % pid, "rb").read()
            except OSError:
                continue
            assert root.encode() not in cmd, cmd
    assert root not in open("/proc/self/mountinfo").read()
    for port in (2222, 2301):
        with socket.socket() as s:
            assert s.connect_ex((bed.address("pve1"), port)) != 0
    assert subprocess.run(["ip", "link", "show", "dev", bed.ws_if], capture_output=True).returncode != 0


def test_load_reattaches(tb):
    other = Testbed.load(str(tb.root))
    assert other.spec == tb.spec and other.is_up()
    st = other.status()
    assert [c["status"] for h in st["hosts"] for c in h["containers"]] == \
        ["running"] * sum(len(c) for c in tb.spec.values())


def test_cli_fault_and_status(tb):
    env = dict(os.environ, VPD_TESTBED_DIR=str(tb.root))
    cli = [sys.executable, "-c", "from vpd_testbed.cli import testbed; testbed()"]
    r = subprocess.run(cli + ["fault", "pve1/129", "oom_at_startup=cuda_oom"], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert tb.faults("pve1", 129) == {"oom_at_startup": "cuda_oom"}
    r = subprocess.run(cli + ["status", "--json"], env=env, capture_output=True, text=True)
    st = json.loads(r.stdout)
    assert st["hosts"][0]["containers"][0]["faults"] == {"oom_at_startup": "cuda_oom"}
    r = subprocess.run(cli + ["fault", "pve1", "oom_at_startup=cuda_oom"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "container-level" in r.stderr
    r = subprocess.run(cli + ["fault", "--clear"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and tb.faults("pve1", 129) == {}


def test_failed_start_quotes_the_log_and_keeps_it(tb, monkeypatch):
    """An sshd that cannot start: the error quotes its log's last lines, and the logs outlive the removed state
    directory, at the path the message names."""
    root = str(tb.root) + "-bad"
    orig = Testbed._build_host

    def broken(self, h, py):
        orig(self, h, py)
        with open(self.root / h / "sshd_config", "a") as fh:
            fh.write("NoSuchSshdOption yes\n")
    monkeypatch.setattr(Testbed, "_build_host", broken)
    bed = Testbed(root=root, hosts=1, containers=[129], gpus=1, net="127.77.%d." % (200 + (os.getpid() + 7) % 50))
    with pytest.raises(TestbedError) as e:
        bed.up()
    msg = str(e.value)
    assert "sshd of pve1" in msg and "last lines of" in msg
    assert "NoSuchSshdOption" in msg  # sshd's own words about the bad line
    assert "kept in %s.failed" % root in msg
    assert not os.path.exists(root)
    kept = open(os.path.join(root + ".failed", "pve1", "sshd.log")).read()
    assert "NoSuchSshdOption" in kept
    import shutil
    shutil.rmtree(root + ".failed")


def test_hostinit_creates_sshd_privsep_dir(tb):
    """/run is empty after a boot: the host's init makes sshd's privilege separation directory itself."""
    assert "mkdir -p -m 0755 /run/sshd" in (tb.root / "pve1" / "hostinit.sh").read_text()


# ---- networking ------------------------------------------------------------------------------------
def _serve_http(tb, host, vmid, port=8000):
    """A tiny HTTP server in the container on 0.0.0.0:port (answers GET / with a directory listing)."""
    r = tb.container_exec(host, vmid, ["sh", "-c", "setsid -f python3 -m http.server %d --bind 0.0.0.0 "
                                       "</dev/null >/dev/null 2>&1" % port])
    assert r.returncode == 0, r.stderr
    wait_for(lambda: tb.container_exec(host, vmid, ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/%d" % port]).returncode
             == 0, 20, "http.server in %s/%d" % (host, vmid))


def _get(url, timeout=5):
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def test_containers_have_addresses_this_machine_and_a_tunnel_reach(tb):
    import yaml
    inv = yaml.safe_load(open(tb.inventory_path))
    recorded = {(h["name"], c["vmid"]): c["address"] for h in inv["hosts"] for c in h["containers"]}
    want = {(h, v): tb.container_address(h, v) for h in tb.hosts for v in tb.spec[h]}
    assert recorded == want and len(set(want.values())) == len(want)
    assert all(a.startswith(tb.subnet) for a in want.values()) and tb.workstation_address == tb.subnet + "254"
    # eth0 inside, with the address and the pct config's MAC
    r = tb.container_exec("pve1", 130, ["ip", "-o", "addr", "show", "dev", "eth0"])
    assert tb.container_address("pve1", 130) + "/24" in r.stdout, r.stdout
    mac = [ln for ln in tb.host_exec("pve1", ["pct", "config", "130"]).stdout.splitlines() if ln.startswith("net0")]
    out = tb.container_exec("pve1", 130, ["ip", "-o", "link", "show", "dev", "eth0"]).stdout.split()
    link = out[out.index("link/ether") + 1]
    assert "hwaddr=%s," % link.upper() in mac[0]
    # reached from here (the root namespace) on two hosts; a container reaches another one too
    _serve_http(tb, "pve1", 130)
    _serve_http(tb, "pve2", 129)
    assert _get("http://%s:8000/" % tb.container_address("pve1", 130)) == 200
    assert _get("http://%s:8000/" % tb.container_address("pve2", 129)) == 200
    r = tb.container_exec("pve1", 129, ["python3", "-c", "import urllib.request as u; print(u.urlopen('http://%s:8000/',"
                                        " timeout=5).status)" % tb.container_address("pve2", 129)])
    assert r.stdout.strip() == "200", r.stderr
    # through an SSH tunnel via the simulated Proxmox host (sshd forwards from the host's side)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        lport = s.getsockname()[1]
    argv = tb.ssh_argv("pve1")
    argv[-1:-1] = ["-N", "-o", "ExitOnForwardFailure=yes", "-L",
                   "127.0.0.1:%d:%s:8000" % (lport, tb.container_address("pve1", 130))]
    tun = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def through():
            try:
                return _get("http://127.0.0.1:%d/" % lport, timeout=2) == 200
            except OSError:
                assert tun.poll() is None, tun.stderr.read()
                return False
        wait_for(through, 15, "the tunnel")
    finally:
        tun.terminate()
        tun.wait(timeout=10)
    # a restarted container comes back on the same address (same MAC: no stale neighbour entry here)
    tb.stop_container("pve1", 130)
    tb.start_container("pve1", 130)
    _serve_http(tb, "pve1", 130)
    assert _get("http://%s:8000/" % tb.container_address("pve1", 130)) == 200
    st = tb.status()
    assert st["network"] == {"subnet": tb.subnet + "0/24", "workstation": tb.workstation_address,
                             "link": tb.ws_if, "up": True}
    assert st["hosts"][0]["containers"][0]["address"] == tb.container_address("pve1", 129)


def test_reset_rebuilds_a_killed_network(tb):
    lan = tb.lan()
    os.kill(lan["pid"], 9)
    wait_for(lambda: tb.lan() is None, 5, "the holder to go")
    tb.reset()
    assert tb.lan()["pid"] != lan["pid"]
    _serve_http(tb, "pve1", 129)
    assert _get("http://%s:8000/" % tb.container_address("pve1", 129)) == 200


def test_a_static_ip_option_is_the_container_address(tb, tmp_path):
    bed = Testbed(root=str(tb.root) + "-ip", hosts=1, containers=[129, 131], gpus=1,
                  net="127.77.%d." % (150 + os.getpid() % 40), options={"pve1": {131: {"ip": "10.99.0.31/24"}}})
    bed.up()
    try:
        assert bed.container_address("pve1", 131) == "10.99.0.31"
        assert "address: 10.99.0.31" in open(bed.inventory_path).read()
        r = bed.container_exec("pve1", 131, ["ip", "-o", "addr", "show", "dev", "eth0"])
        assert "10.99.0.31/24" in r.stdout
    finally:
        bed.down()
    r = subprocess.run(["ip", "link", "show", "dev", bed.ws_if], capture_output=True)
    assert r.returncode != 0  # its link went with it


def test_text_fault_values_need_no_quotes():
    """Issue 53 item 10: `deploy testbed fault pve1/129 torch_cuda=12.8` is the string "12.8" (JSON made it a
    number, refused); numbers and JSON stay JSON for the other faults."""
    from vpd_testbed import faults as F

    assert F.parse_value("12.8", "torch_cuda") == "12.8" and F.parse_value('"12.8"', "torch_cuda") == "12.8"
    assert F.parse_value("8.0.4", "pve_version") == "8.0.4" and F.parse_value("0.25.0", "vllm_version") == "0.25.0"
    F.validate("torch_cuda", F.parse_value("12.8", "torch_cuda"), True)
    assert F.parse_value("5", "load_s") == 5 and F.parse_value('{"gpu": 0, "mib": 1}', "foreign_holder") == {
        "gpu": 0, "mib": 1}
