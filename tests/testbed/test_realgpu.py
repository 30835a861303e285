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
        finally:
            tb.down()
    finally:
        for p in dev.iterdir():
            p.unlink()
        dev.rmdir()


def _gpu_check(tmp_path, *args):
    env = dict(os.environ, VPD_TESTBED_GPU_DEV=str(tmp_path / "nodev"), OUT="")
    env.pop("VPD_TESTBED_NVIDIA_SMI", None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--out", str(tmp_path / "rep"), *args],
                          capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_gpu_check_refuses_without_a_gpu(tmp_path):
    p = _gpu_check(tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "refused: no NVIDIA GPU here" in p.stderr and "--dry-run" in p.stderr, p.stderr
    rep = json.loads((tmp_path / "rep" / "gpu-check.json").read_text())
    assert rep["outcome"] == "refused" and rep["steps"] == [] and rep["phases"] == {}, rep  # nothing was run
    assert "no NVIDIA GPU here" in (tmp_path / "rep" / "gpu-check.txt").read_text()


def test_gpu_check_dry_run_report(tmp_path):
    p = _gpu_check(tmp_path, "--dry-run", "--cache", str(tmp_path / "cache"), "--wheels", str(tmp_path / "whl"))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "rep" / "gpu-check.json").read_text())
    assert rep["schema"] == "vpd-gpu-check/1" and rep["outcome"] == "dry-run" and rep["dry_run"] is True
    names = [s["name"] for s in rep["steps"]]
    assert names == ["install", "models", "testbed", "deploy up", "deploy status", "deploy restart --clean-gpus",
                     "deploy doctor", "deploy down", "baseline"], names
    assert all(s["outcome"] == "planned" for s in rep["steps"])
    assert str(tmp_path / "whl") in rep["steps"][0]["what"]
    assert any("would be refused: no NVIDIA GPU" in m for m in rep["messages"]), rep["messages"]
    assert not (tmp_path / "cache").exists()  # a dry run installs nothing
    txt = (tmp_path / "rep" / "gpu-check.txt").read_text()
    assert "dry-run" in txt and "deploy restart --clean-gpus" in txt and "budget 480 s" in txt, txt
