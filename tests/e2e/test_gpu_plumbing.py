"""The gpu-plumbing check (issue 34 part 1) on the test bed: verify, up (before anything is stopped), doctor and
status name each plumbing problem with what was expected and found, where, and the fix; the clean case finds
nothing. Faults: nvidia_smi_mismatch (the containers' user space), missing_dev_line, shm_mib, uvm_missing."""


def plumbing(doc):
    return {f["problem"]: f for f in (doc.get("gpu_plumbing") or {}).get("findings") or []}


def test_clean_case_finds_nothing(tb, deploy):
    p = deploy("--json", "verify", "qwen36-dflash")  # fails on the stale drafter config, not on plumbing
    assert p.json["gpu_plumbing"] == {"findings": [], "host_error": None}, p.json["gpu_plumbing"]
    d = deploy("--json", "doctor", "pve1/129")
    rows = d.json["containers"]
    assert not [f for f in rows[0]["findings"] if f["class"] == "gpu-plumbing"], rows[0]["findings"]
    assert rows[0]["gpu_plumbing"] is None and rows[0]["gpu_plumbing_host_error"] is None
    s = deploy("--json", "status", "pve1/129")
    assert s.json["rows"][0]["gpu_plumbing"]["findings"] == []
    assert not [x for x in s.json["rows"][0]["problems"] if x.startswith("GPU plumbing")]


def test_version_mismatch_named_with_both_versions(tb, deploy):
    tb.set_fault("pve1", None, "nvidia_smi_mismatch", "containers")
    p = deploy("--json", "verify", "qwen36-dflash")
    assert p.returncode == 1
    f = plumbing(p.json)["driver-version-mismatch"]
    assert "550.54.15" in f["expected"] and "550.90" in f["found"]
    assert "NVIDIA-Linux-x86_64-550.54.15.run --no-kernel-module" in f["fix"]
    human = deploy("verify", "qwen36-dflash")
    assert "GPU PLUMBING driver-version-mismatch" in human.stdout
    s = deploy("--json", "status", "pve1/129")
    line = [x for x in s.json["rows"][0]["problems"] if x.startswith("GPU plumbing: ")]
    assert line and "driver-version-mismatch" in line[0] and "550.90" in line[0], s.json["rows"][0]["problems"]
    assert "GPU plumbing: driver-version-mismatch" in " ".join(deploy("status", "pve1/129").stdout.split())


def test_missing_dev_line_named_with_the_line_to_add_and_up_stops_nothing(tb, deploy):
    tb.set_fault("pve1", 129, "missing_dev_line", "/dev/nvidia2")
    p = deploy("--json", "verify", "qwen36-dflash")
    f = plumbing(p.json)["config-line-missing"]
    assert "/dev/nvidia2" in f["expected"] and "/etc/pve/lxc/129.conf" in f["where"]
    assert "pct set 129 -dev7 /dev/nvidia2" in f["fix"] and "pct reboot 129" in f["fix"]
    u = deploy("up", "qwen36-dflash")
    assert u.returncode == 1
    assert "1 GPU plumbing problem(s) in container 129 (config-line-missing); nothing was stopped" in u.stderr
    assert "pct set 129 -dev7 /dev/nvidia2" in " ".join(u.stderr.split())
    assert "launch " not in u.stderr and "stop " not in u.stderr.replace("nothing was stopped", "")
    d = deploy("--json", "doctor", "pve1/129")
    assert any(x["class"] == "gpu-plumbing" and "pct set 129 -dev7 /dev/nvidia2" in x["fix"]
               for x in d.json["containers"][0]["findings"])


def test_small_shm_named_with_the_requirement(tb, deploy):
    tb.set_fault("pve1", 129, "shm_mib", 256)
    p = deploy("--json", "verify", "qwen36-dflash")
    f = plumbing(p.json)["shm-too-small"]
    assert f["expected"].startswith("at least 4096 MiB for tensor_parallel_size 4") and f["found"] == "256 MiB"
    assert "remount,size=4G /dev/shm" in f["fix"] and "NCCL" in f["cause"]


def test_uvm_missing_on_the_host(tb, deploy):
    tb.set_fault("pve1", None, "uvm_missing", True)
    p = deploy("--json", "verify", "qwen36-dflash")
    f = plumbing(p.json)["uvm-missing-on-host"]
    assert "/dev/nvidia-uvm" in f["where"] and "nvidia-modprobe -u -c=0" in f["fix"]
    tb.clear_faults("pve1")
    p = deploy("--json", "verify", "qwen36-dflash")
    assert plumbing(p.json) == {}


def test_cuda_above_the_drivers_maximum(tb, deploy):
    tb.set_fault("pve1", 129, "torch_cuda", "12.8")
    p = deploy("--json", "verify", "qwen36-dflash")
    f = plumbing(p.json)["cuda-above-driver"]
    assert "CUDA 12.8 (570.26 or newer)" in f["expected"] and "driver 550.54.15 supports CUDA 12.4 at most" in f["found"]
    tb.clear_faults("pve1", 129)
    assert "cuda-above-driver" not in plumbing(deploy("--json", "verify", "qwen36-dflash").json)


def test_status_reads_the_facts_from_their_record_until_its_key_moves_and_verify_reads_fresh(tb, deploy):
    """Issue 54: status keeps the container's plumbing facts in a record (STATE_DIR/plumbing.json) keyed by what
    proves them current. A fault planted after the record was made, without moving the key, is found by verify at
    once; status finds it at its next refresh once the key moves (here: the container restarts)."""
    import os

    assert deploy("--json", "verify", "qwen36-dflash").json["gpu_plumbing"]["findings"] == []  # makes the state dir
    deploy("--json", "status", "pve1/129")
    s = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert s["gpu_plumbing"]["record"]["reused"] is True and s["gpu_plumbing"]["findings"] == [], s["gpu_plumbing"]
    nvlib = tb.ctdir("pve1", 129) / "nvlib"  # the container's /usr/lib/x86_64-linux-gnu/nvidia/current
    before = os.stat(nvlib)
    tb.set_fault("pve1", None, "nvidia_smi_mismatch", "containers")  # the user space becomes 550.90
    os.utime(nvlib, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... with the folder's mtime put back
    s = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert s["gpu_plumbing"]["record"]["reused"] is True and s["gpu_plumbing"]["findings"] == [], s["gpu_plumbing"]
    v = deploy("--json", "verify", "qwen36-dflash")  # verify reads fresh: found at once
    assert v.returncode == 1 and "550.90" in plumbing(v.json)["driver-version-mismatch"]["found"]
    tb.stop_container("pve1", 129)
    tb.start_container("pve1", 129)  # the key moves: init's start time
    s = deploy("--json", "status", "pve1/129").json["rows"][0]
    assert s["gpu_plumbing"]["record"]["reused"] is False, s["gpu_plumbing"]
    line = [x for x in s["problems"] if x.startswith("GPU plumbing: ")]
    assert line and "driver-version-mismatch" in line[0] and "550.90" in line[0], s["problems"]
    s = deploy("--json", "status", "pve1/129").json["rows"][0]  # and from the new record after that
    assert s["gpu_plumbing"]["record"]["reused"] is True and "driver-version-mismatch" in s["gpu_plumbing"]["summary"]
