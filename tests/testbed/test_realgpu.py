"""The real-GPU tier without a GPU (issue 40): the test bed's gpus=real option refusing where the machine has no NVIDIA
GPU, its plumbing checked with stand-in device nodes (char devices 1:3 named nvidia0, nvidiactl, nvidia-uvm) and a
stand-in nvidia-smi, and scripts/gpu-check.sh's no-GPU refusal and --dry-run report. The GPU run itself
(bench/gpu/gpu_check.py on a real card) is never run here."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vpd_testbed.common import free_net
from vpd_testbed.core import Testbed, TestbedError

REPO = Path(__file__).resolve().parents[2]
STAND_IN_SMI = REPO / "tests" / "gpu" / "stand_in_nvidia_smi.py"


def _no_gpu_env(monkeypatch, tmp_path):
    empty = tmp_path / "dev"
    empty.mkdir()
    monkeypatch.setenv("VPD_TESTBED_GPU_DEV", str(empty))
    monkeypatch.delenv("VPD_TESTBED_NVIDIA_SMI", raising=False)
    return empty


def test_gpus_real_refused_without_nvidia_devices(monkeypatch, tmp_path):
    dev = _no_gpu_env(monkeypatch, tmp_path)
    tb = Testbed(root=str(tmp_path / "tb"), gpus=1, containers={"pve1": {129: [0]}}, net="127.77.250.",
                 options={"pve1": {129: {"gpus": "real"}}})
    with pytest.raises(TestbedError) as e:
        tb.up()
    msg = str(e.value)
    assert "gpus=real (pve1/129)" in msg and "no NVIDIA GPU" in msg and "%s/nvidiactl" % dev in msg, msg
    assert "found none" in msg and "default (fake" in msg, msg  # what was found, and the way out
    assert not (tmp_path / "tb").exists()  # refused before anything was built or started


def test_gpus_real_option_combinations_refused():
    with pytest.raises(TestbedError, match="every container of pve1 must have it"):
        Testbed(containers=[129, 130], options={"pve1": {129: {"gpus": "real"}}})
    with pytest.raises(TestbedError, match="not init=systemd"):
        Testbed(containers=[129], options={"pve1": {129: {"gpus": "real", "init": "systemd"}}})
    with pytest.raises(TestbedError, match="needs vllm=real"):
        Testbed(containers=[129], options={"pve1": {129: {"vllm_venv": sys.prefix}}})
    with pytest.raises(TestbedError, match="gpus='cuda': one of fake, real"):
        Testbed(containers=[129], options={"pve1": {129: {"gpus": "cuda"}}})


def test_gpus_real_refuses_a_gpu_the_machine_lacks(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in ("nvidia0", "nvidiactl"):
        os.mknod(dev / n, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    monkeypatch.setenv("VPD_TESTBED_GPU_DEV", str(dev))
    monkeypatch.setenv("VPD_TESTBED_NVIDIA_SMI", str(STAND_IN_SMI))
    tb = Testbed(root=str(tmp_path / "tb"), gpus=2, containers={"pve1": {129: [1]}}, net="127.77.250.",
                 options={"pve1": {129: {"gpus": "real"}}})
    with pytest.raises(TestbedError, match=r"given GPU 1, but this machine has only .*nvidia0"):
        tb.up()


@pytest.mark.root
def test_gpus_real_binds_the_nodes_and_the_real_nvidia_smi(monkeypatch, tmp_path):
    """With stand-ins for the machine's nodes and nvidia-smi: the container's /dev/nvidia0, nvidiactl, nvidia-uvm are
    those nodes (bind mounts, same rdev), nvidia-smi in the container and on the host is the stand-in, and the fake
    is kept beside it for comparisons."""
    if os.geteuid() != 0:
        pytest.skip("the test bed needs root")
    dev = Path("/var/tmp") / ("vpd-realgpu-dev-%d" % os.getpid())  # not under /tmp: a container has its own
    dev.mkdir()
    try:
        for n in ("nvidia0", "nvidiactl", "nvidia-uvm"):
            os.mknod(dev / n, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        monkeypatch.setenv("VPD_TESTBED_GPU_DEV", str(dev))
        monkeypatch.setenv("VPD_TESTBED_NVIDIA_SMI", str(STAND_IN_SMI))
        net = free_net(251, 254)
        if not net:
            pytest.skip("no free 127.77.251-253. prefix")
        tb = Testbed(root="/tmp/vpd-tb-realgpu-%d" % os.getpid(), gpus=1, containers={"pve1": {129: [0]}}, net=net,
                     options={"pve1": {129: {"gpus": "real"}}})
        tb.up()
        try:
            r = tb.container_exec("pve1", 129, ["sh", "-c", "stat -c '%n %F %t:%T' /dev/nvidia0 /dev/nvidiactl "
                                                            "/dev/nvidia-uvm; nvidia-smi -L; ls /dev"])
            assert r.returncode == 0, r.stderr
            out = r.stdout
            for n in ("nvidia0", "nvidiactl", "nvidia-uvm"):
                assert "/dev/%s character special file 1:3" % n in out, out
            assert "GPU 0: NVIDIA TEST" in out, out
            assert "nvidia-uvm-tools" not in out.split()  # the machine has none: none made up
            h = tb.host_exec("pve1", ["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                                      "--format=csv,noheader,nounits"])
            assert h.stdout.strip() == "0, 3, 81559", h.stdout + h.stderr
            assert (tb.root / "pve1" / "nvidia-smi.fake").exists()
            # issue 55: the user-space driver the plumbing check reads is the (stand-in) real driver's version, the
            # host sees the stand-in nodes as a real host sees its driver's, and the fake vLLM runs its torch engine
            r = tb.container_exec("pve1", 129, ["sh", "-c", "ls /usr/lib/x86_64-linux-gnu/nvidia/current; "
                                                            "cat /etc/vpd-testbed/engine.json"])
            assert "libnvidia-ml.so.580.159.04" in r.stdout and "libcuda.so.580.159.04" in r.stdout, r.stdout
            assert json.loads(r.stdout[r.stdout.index("{"):]) == {"engine": "torch"}, r.stdout
            h = tb.host_exec("pve1", ["stat", "-c", "%n %t:%T", "/dev/nvidia0", "/dev/nvidia-uvm"])
            assert h.stdout.split() == ["/dev/nvidia0", "1:3", "/dev/nvidia-uvm", "1:3"], h.stdout + h.stderr
        finally:
            tb.down()
    finally:
        for p in dev.iterdir():
            p.unlink()
        dev.rmdir()


def _gpu_check(tmp_path, *args, out=True):
    env = dict(os.environ, VPD_TESTBED_GPU_DEV=str(tmp_path / "nodev"), OUT="")
    env.pop("VPD_TESTBED_NVIDIA_SMI", None)
    extra = ["--out", str(tmp_path / "rep")] if out else []
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), *extra, *args],
                          capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)


def _report(tmp_path, ext):
    files = list((tmp_path / "rep").glob("*." + ext))
    assert len(files) == 1, files
    return files[0]


def test_gpu_check_refuses_without_a_gpu(tmp_path):
    p = _gpu_check(tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "refused: no NVIDIA GPU here" in p.stderr and "--dry-run" in p.stderr, p.stderr
    rep = json.loads(_report(tmp_path, "json").read_text())
    assert rep["outcome"] == "refused" and rep["steps"] == [] and rep["phases"] == {}, rep  # nothing was run
    assert _report(tmp_path, "json").name.endswith("-no-gpu.json")  # dated, named by the card (none here)
    assert "no NVIDIA GPU here" in _report(tmp_path, "txt").read_text()


def test_gpu_check_dry_run_prints_every_step_and_what_it_carries(tmp_path):
    p = _gpu_check(tmp_path, "--dry-run", "--carry", str(tmp_path / "carry"), out=False)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    steps = ["setup", "testbed", "deploy prepare --dry-run", "deploy up", "deploy status",
             "deploy restart --clean-gpus (holder ignoring SIGTERM)", "deploy doctor",
             "fuser -k /dev/nvidia* (the field report)", "deploy restart --clean-gpus (holder outside the deployment)",
             "deploy down"]
    pos = [out.find("  " + s + " ") for s in steps]
    assert all(x >= 0 for x in pos) and pos == sorted(pos), list(zip(steps, pos))
    assert out.count("planned") == len(steps) and out.count("runs: ") == len(steps), out
    assert "carries nothing: %s not built (scripts/gpu-check.sh --build-carry)" % (tmp_path / "carry") in out, out
    assert "of the device tool's 64 MiB" in out and "budget 480 s" in out, out
    assert "would be refused: no NVIDIA GPU here" in out, out
    assert not (tmp_path / "rep").exists() and not list(tmp_path.iterdir())  # a dry run writes nothing by default


def test_gpu_check_dry_run_report_when_asked(tmp_path):
    p = _gpu_check(tmp_path, "--dry-run", "--carry", str(tmp_path / "carry"))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(_report(tmp_path, "json").read_text())
    assert rep["schema"] == "vpd-gpu-check/2" and rep["outcome"] == "dry-run" and rep["dry_run"] is True
    assert all(s["outcome"] == "planned" and s["what"] and s["expects"] for s in rep["steps"]), rep["steps"]
    assert rep["carry"] == {"present": False, "path": str(tmp_path / "carry"), "bytes": 0}
