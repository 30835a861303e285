"""The gpu-plumbing check's decisions (orchestrator/steps/plumbing_check.py), on strings and dicts: no host, no container."""

from orchestrator.steps import plumbing_check as PL

CONF_DEV = """arch: amd64
cores: 32
dev0: /dev/nvidia0
dev1: /dev/nvidia1
dev2: /dev/nvidiactl
dev3: /dev/nvidia-uvm
dev4: /dev/nvidia-uvm-tools
hostname: ct129
memory: 262144
"""

CONF_RAW = """arch: amd64
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.cgroup2.devices.allow: c 508:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file
lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file
"""

NODES = {"/dev/nvidia0": (195, 0), "/dev/nvidia1": (195, 1), "/dev/nvidiactl": (195, 255),
         "/dev/nvidia-uvm": (508, 0), "/dev/nvidia-uvm-tools": (508, 1)}


def host_text(conf=CONF_DEV, nodes=NODES, uvm=508, version="550.54.15", smi="12.4"):
    lines = ["@@ config", *conf.strip().splitlines(), "@@ rc 0", "@@ devices", " 195 nvidia-frontend"]
    if uvm:
        lines.append(f" {uvm} nvidia-uvm")
    lines.append("@@ nodes")
    for p, (ma, mi) in nodes.items():
        lines.append(f"{p}|character special file|{ma:x}|{mi:x}|0")
    lines += ["@@ version"]
    if version:
        lines.append(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Mar  5 22:23:56 UTC 2024")
    lines += ["@@ smi", f"| NVIDIA-SMI {version}   Driver Version: {version}   CUDA Version: {smi}     |"]
    return "\n".join(lines) + "\n"


def ct_facts(nodes=NODES, libs=("550.54.15",), shm=131072, torch="12.4", module="550.54.15"):
    return {"nodes": {p: {"kind": "char", "major": a, "minor": b} for p, (a, b) in nodes.items()},
            "libs": {"libnvidia-ml": list(libs), "libcuda": list(libs)}, "module_version": module,
            "shm_mib": shm, "torch_cuda": torch}


def run(host=None, ct=None, gpus=(0, 1), tp=2):
    h = PL.parse_host(host if host is not None else host_text())
    return PL.findings(h, ct if ct is not None else ct_facts(), host_name="pve1", vmid=129, gpus=list(gpus), tp=tp)


def problems(found):
    return [f["problem"] for f in found]


def test_clean_dev_and_raw_styles_find_nothing():
    assert run() == []
    assert run(host_text(conf=CONF_RAW)) == []


def test_parse_host_reads_every_section():
    h = PL.parse_host(host_text())
    assert h["module_version"] == "550.54.15" and h["smi_cuda"] == "12.4" and h["proc_devices"]["nvidia-uvm"] == 508
    assert h["nodes"]["/dev/nvidia-uvm"] == {"kind": "char", "major": 508, "minor": 0}
    assert "dev0: /dev/nvidia0" in h["config"]


def test_open_kernel_module_version_line():
    t = host_text(version=None).replace("@@ version\n", "@@ version\nNVRM version: NVIDIA UNIX Open Kernel Module "
                                                       "for x86_64  570.86.15  Release Build  (dvs-builder)\n")
    assert PL.parse_host(t)["module_version"] == "570.86.15"


def test_missing_dev_line_names_the_line_to_add():
    conf = CONF_DEV.replace("dev1: /dev/nvidia1\n", "")
    f = run(host_text(conf=conf))
    assert problems(f) == ["config-line-missing"]
    assert "/dev/nvidia1" in f[0]["expected"] and "pct set 129 -dev5 /dev/nvidia1" in f[0]["fix"]
    assert "/etc/pve/lxc/129.conf" in f[0]["where"]


def test_missing_mount_entry_in_raw_style_names_the_raw_lines():
    conf = CONF_RAW.replace("lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n", "")
    ct = ct_facts(nodes={k: v for k, v in NODES.items() if k != "/dev/nvidia-uvm"})
    f = run(host_text(conf=conf), ct)
    assert problems(f) == ["config-line-missing"]
    assert "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file" in f[0]["fix"]


def test_uvm_missing_on_host_with_optional_bind_skipped():
    nodes = {k: v for k, v in NODES.items() if "uvm" not in k}
    f = run(host_text(conf=CONF_RAW, nodes=nodes, uvm=None), ct_facts(nodes=nodes))
    p = problems(f)
    assert p[0] == "uvm-missing-on-host" and "nvidia-modprobe -u -c=0" in f[0]["fix"]
    assert "modules-load.d" in f[0]["fix"] and "not loaded" in f[0]["found"]
    assert "optional-bind-skipped" in p and "container-node-missing" in p


def test_stale_cgroup_major_after_a_driver_update():
    nodes = dict(NODES, **{"/dev/nvidia-uvm": (511, 0), "/dev/nvidia-uvm-tools": (511, 1)})
    f = run(host_text(conf=CONF_RAW, nodes=nodes, uvm=511), ct_facts(nodes=nodes))
    assert problems(f) == ["cgroup-stale-major"]  # nvidia-uvm's; nvidia-uvm-tools is not required (issue 53)
    assert "c 511:* rwm" in f[0]["fix"] and "508" in f[0]["found"]


def test_version_mismatch_names_both_versions_and_the_run_file():
    f = run(ct=ct_facts(libs=("550.90",)))
    assert problems(f) == ["driver-version-mismatch"]
    assert "550.54.15" in f[0]["expected"] and "550.90" in f[0]["found"]
    assert "NVIDIA-Linux-x86_64-550.54.15.run --no-kernel-module" in f[0]["fix"]


def test_no_user_space_driver():
    f = run(ct=ct_facts(libs=()))
    assert problems(f) == ["user-space-missing"]


def test_cuda_above_the_driver():
    f = run(host_text(smi="12.4"), ct_facts(torch="12.8"))
    assert problems(f) == ["cuda-above-driver"]
    assert "12.8" in f[0]["expected"] and "570.26" in f[0]["expected"] and "12.4" in f[0]["found"]


def test_driver_max_cuda_table():
    assert PL.driver_max_cuda("550.54.15") == "12.4"
    assert PL.driver_max_cuda("570.86.15") == "12.8"
    assert PL.driver_max_cuda("580.65.06") == "13.0"
    assert PL.driver_max_cuda("470.1") is None and PL.driver_max_cuda("garbage") is None


def test_small_shm_states_the_requirement():
    f = run(ct=ct_facts(shm=256), tp=4, gpus=(0, 1))
    assert problems(f) == ["shm-too-small"]
    assert "4096 MiB" in f[0]["expected"] and "tensor_parallel_size 4" in f[0]["expected"]
    assert "256 MiB" in f[0]["found"] and "size=4G" in f[0]["fix"]
    assert run(ct=ct_facts(shm=256), tp=1) == []


def test_regular_file_node_is_a_skipped_bind():
    ct = ct_facts()
    ct["nodes"]["/dev/nvidia1"] = {"kind": "file", "major": None, "minor": None, "size": 0}
    f = run(ct=ct)
    assert problems(f) == ["not-a-device"] and "regular file" in f[0]["found"]


def test_container_only_view_for_status():
    f = PL.findings(None, ct_facts(libs=("550.90",)), host_name="pve1", vmid=129, gpus=[0, 1], tp=2)
    assert problems(f) == ["driver-version-mismatch"]
    assert PL.summary(f).startswith("driver-version-mismatch: pve1/129")


def test_untrusted_container_values_are_dropped_or_cleaned():
    ct = {"nodes": {"/dev/nvidia0; rm -rf /": {"kind": "char"}, "/dev/nvidia0": "x"},
          "libs": {"libcuda": ["550.54.15\x1b[31m", 5, "1" * 5000]}, "shm_mib": "lots", "torch_cuda": "12.4\n"}
    c = PL.sane_container(ct)
    assert c["nodes"] == {} and c["libs"]["libcuda"] == [] and c["shm_mib"] is None and c["torch_cuda"] is None
    assert "\x1b" not in PL.clean("a\x1b[31mb\nc")


def test_fix_quotes_a_hostile_host_name():
    conf = CONF_DEV.replace("dev1: /dev/nvidia1\n", "")
    h = PL.parse_host(host_text(conf=conf))
    f = PL.findings(h, ct_facts(), host_name="pve1;reboot", vmid=129, gpus=[0, 1], tp=1)
    assert "'pve1;reboot'" in f[0]["fix"]


def test_test_bed_simulated_node():
    assert PL.parse_node_line("/dev/nvidia0|regular empty file|0|0|0|vpd-testbed-node c 195:0") == \
        {"path": "/dev/nvidia0", "kind": "char", "major": 195, "minor": 0}
    assert PL.parse_node_line("/dev/nvidia0|regular empty file|0|0|0|")["kind"] == "file"


def test_a_plain_file_on_the_host_is_no_device():
    t = host_text().replace("/dev/nvidia-uvm|character special file|1fc|0|0", "/dev/nvidia-uvm|regular empty file|0|0|0|")
    assert problems(run(t))[0] == "uvm-missing-on-host"


def test_agent_reads_torch_cuda_and_library_versions_without_importing(tmp_path, monkeypatch):
    import sys

    from orchestrator.agent.container import plumbing as AP

    t = tmp_path / "lib" / ("python%d.%d" % sys.version_info[:2]) / "site-packages" / "torch"
    t.mkdir(parents=True)
    (t / "version.py").write_text("__version__ = '2.8.0+cu128'\ndebug = False\ncuda: Optional[str] = '12.8'\n")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert AP.read_torch_cuda() == "12.8"
    lib = tmp_path / "libdir"
    lib.mkdir()
    for n in ("libcuda.so.550.54.15", "libnvidia-ml.so.550.54.15", "libnvidia-ml.so.1", "libcuda.so.evil;x"):
        (lib / n).write_text("")
    monkeypatch.setattr(AP, "LIB_DIRS", (str(lib),))
    assert AP.read_libs() == {"libnvidia-ml": ["550.54.15"], "libcuda": ["550.54.15"]}


def test_status_row_from_the_container_side():
    from orchestrator.observe.status import _row, plumbing_row

    row = _row("pve1", 129)
    plumbing_row(row, {"nodes": {}, "libs": {}, "shm_mib": 64}, None, "pve1", 129)  # no GPUs at all: a router's
    assert row["gpu_plumbing"] is None and row["problems"] == []
    st = {"gpus": [0, 1], "argv": ["vllm", "serve", "m", "--tensor-parallel-size", "2"]}
    plumbing_row(row, ct_facts(shm=512), st, "pve1", 129)
    assert row["gpu_plumbing"]["findings"][0]["problem"] == "shm-too-small"
    assert row["problems"][0].startswith("GPU plumbing: shm-too-small: pve1/129: /dev/shm: expected at least 2048 MiB")
    assert row["healthy"] is False


def test_the_host_script_runs_and_parses(tmp_path):
    import os
    import subprocess

    pct = tmp_path / "pct"
    pct.write_text('#!/bin/sh\n[ "$2" = 129 ] || { echo "Configuration file does not exist" >&2; exit 2; }\n'
                   'printf "arch: amd64\\ndev0: /dev/nvidia0\\n[snap1]\\ndev0: /dev/nvidia9\\n"\n')
    pct.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    ok = subprocess.run(["sh", "-c", PL.HOST_PLUMBING_SH, "sh", "129"], env=env, capture_output=True, text=True)
    h = PL.parse_host(ok.stdout)
    assert h["config"] == ["arch: amd64", "dev0: /dev/nvidia0"] and h["config_rc"] == 0
    bad = subprocess.run(["sh", "-c", PL.HOST_PLUMBING_SH, "sh", "130"], env=env, capture_output=True, text=True)
    assert PL.parse_host(bad.stdout)["config_rc"] == 2


def _recorded_bed(tmp_path, monkeypatch):
    """A library folder with the 550.54.15 user space, a venv prefix without torch, a private state directory."""
    import os
    import sys

    import pytest

    from orchestrator.agent.container import plumbing as AP

    if os.geteuid() != 0:
        pytest.skip("the record is a state file: read back only when root-owned (as in a container)")
    lib = tmp_path / "libdir"
    lib.mkdir()
    for n in ("libcuda.so.550.54.15", "libnvidia-ml.so.550.54.15"):
        (lib / n).write_text("")
    monkeypatch.setattr(AP, "LIB_DIRS", (str(lib),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return AP, lib, str(state)


def test_status_reads_the_plumbing_facts_from_their_record_while_its_key_holds(tmp_path, monkeypatch):
    """Issue 54: the first status reads the facts and records them with their key; later ones reuse the record; a
    library installed after it (its folder's mtime moves the key) is seen at the next status."""
    AP, lib, state = _recorded_bed(tmp_path, monkeypatch)
    first = AP.facts_recorded(state)
    assert first["record"]["reused"] is False and first["record"]["error"] is None
    assert first["libs"] == {"libnvidia-ml": ["550.54.15"], "libcuda": ["550.54.15"]}
    again = AP.facts_recorded(state)
    assert again["record"]["reused"] is True and again["libs"] == first["libs"]
    (lib / "libnvidia-ml.so.550.90").write_text("")  # a second user space installed: the folder changed
    moved = AP.facts_recorded(state)
    assert moved["record"]["reused"] is False and moved["libs"]["libnvidia-ml"] == ["550.54.15", "550.90"]
    assert AP.facts_recorded(state)["record"]["reused"] is True


def test_the_plumbing_record_is_read_again_when_the_container_restarts_or_the_driver_reloads(tmp_path, monkeypatch):
    """A change the key does not see (the folder's mtime put back) stays unseen by status until the key moves: a
    container restart (init's start time) or another kernel module; verify/up/doctor read fresh (facts())."""
    import os

    from orchestrator.agent.container import procs

    AP, lib, state = _recorded_bed(tmp_path, monkeypatch)
    assert AP.facts_recorded(state)["record"]["reused"] is False
    before = os.stat(lib)
    (lib / "libcuda.so.550.90").write_text("")
    os.utime(lib, ns=(before.st_atime_ns, before.st_mtime_ns))  # the key does not move
    kept = AP.facts_recorded(state)
    assert kept["record"]["reused"] is True and kept["libs"]["libcuda"] == ["550.54.15"]
    assert AP.facts()["libs"]["libcuda"] == ["550.54.15", "550.90"]  # what verify, up and doctor read: fresh
    monkeypatch.setattr(procs, "init_starttime", lambda: 123456789)  # the container restarted
    rebooted = AP.facts_recorded(state)
    assert rebooted["record"]["reused"] is False and rebooted["libs"]["libcuda"] == ["550.54.15", "550.90"]
    assert AP.facts_recorded(state)["record"]["reused"] is True
    real_read = AP._read_small
    monkeypatch.setattr(AP, "_read_small", lambda p, n=400: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  "
                        "550.90.07" if p == "/proc/driver/nvidia/version" else real_read(p, n))  # driver reloaded
    assert AP.facts_recorded(state)["record"]["reused"] is False


def test_the_plumbing_record_is_not_kept_where_it_cannot_be_trusted(tmp_path, monkeypatch):
    """No state directory (nothing deployed): fresh facts, no record, no error. A state directory others may write:
    fresh facts and the reason no record is kept (status shows it as a note), never a failure."""
    import os

    AP, lib, state = _recorded_bed(tmp_path, monkeypatch)
    none = AP.facts_recorded(str(tmp_path / "absent"))
    assert none["record"] == {"reused": False, "at": none["record"]["at"], "error": None}
    os.chmod(state, 0o777)
    shared = AP.facts_recorded(state)
    assert shared["record"]["reused"] is False and "not recorded in" in shared["record"]["error"]
    assert shared["libs"]["libcuda"] == ["550.54.15"] and not os.path.exists(os.path.join(state, AP.RECORD))


def test_the_host_script_reports_a_hung_nvidia_smi_as_a_timeout_finding(tmp_path):
    """Issue 53 item 1: a probe that timed out is no ok: the check names it, with the bound it waited."""
    import os
    import subprocess

    (tmp_path / "pct").write_text('#!/bin/sh\nprintf "arch: amd64\\ndev0: /dev/nvidia0\\n"\n')
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 30\n")
    for f in ("pct", "nvidia-smi"):
        (tmp_path / f).chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    p = subprocess.run(PL.host_argv(129, 0.5), env=env, capture_output=True, text=True, timeout=20)
    h = PL.parse_host(p.stdout)
    assert sorted(h["smi_timeout"]) == sorted(["nvidia-smi", PL.shlex.join(["nvidia-smi", *PL.SMI_MEMORY_ARGS])])
    h["smi_timeout_s"] = 0.5
    f = [x for x in PL.findings(h, None, host_name="pve1", vmid=129, gpus=[0]) if x["problem"] == "nvidia-smi-timeout"]
    assert len(f) == 2 and f[0]["expected"] == "an answer within 0.5s" and "may be wedged" in f[0]["fix"]
    assert "were not read" in f[0]["found"]


def test_an_answering_nvidia_smi_is_no_timeout():
    t = host_text().replace("@@ smi\n", "@@ smi\n").rstrip("\n") + "\n@@ smi_rc 0\n@@ gpumem\n0, 10, 81559\n@@ smi_rc 0\n"
    h = PL.parse_host(t)
    assert h["smi_timeout"] == [] and h["gpu_mem"] == {0: {"used": 10, "total": 81559}}
    assert run(t) == []


def test_uvm_tools_missing_is_a_note_not_a_refusal():
    """Issue 53 item 2: CUDA needs nvidiactl, nvidia-uvm and the GPUs' nodes; nvidia-uvm-tools serves profilers."""
    nodes = {k: v for k, v in NODES.items() if k != "/dev/nvidia-uvm-tools"}
    conf = CONF_DEV.replace("dev4: /dev/nvidia-uvm-tools\n", "")
    h = PL.parse_host(host_text(conf=conf, nodes=nodes))
    assert PL.findings(h, ct_facts(nodes=nodes), host_name="pve1", vmid=129, gpus=[0, 1], tp=2) == []
    n = PL.notes(h, host_name="pve1", vmid=129)
    assert len(n) == 1 and "/dev/nvidia-uvm-tools is not on pve1" in n[0] and "not required" in n[0]
    # on the host but not passed in: a note too; passed in: nothing to say
    h = PL.parse_host(host_text(conf=conf))
    assert run(host_text(conf=conf)) == []
    assert "container 129 is not given /dev/nvidia-uvm-tools" in PL.notes(h, host_name="pve1", vmid=129)[0]
    assert PL.notes(PL.parse_host(host_text()), host_name="pve1", vmid=129) == []
