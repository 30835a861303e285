"""`deploy prepare HOST/VMID` on the test bed (issue 34 part 2): a container made GPU-ready, planned first, the
config backed up and read back, a restart only when confirmed, the host's driver in user space, and the
gpu-plumbing check clean afterwards. The test bed's pct really rewrites /etc/pve/lxc/VMID.conf, a container's
/dev/nvidia* follow its config at each start, and its nvidia-smi lists what it sees (docs/testbed.md).

pve1/130 has GPUs 0,1 (devN: lines dev0..dev4); pve1/129 is the target of the playbook qwen36-dflash (GPUs 0-3)."""

import os
import re

DRIVER = "550.54.15"
RUN = f"/root/NVIDIA-Linux-x86_64-{DRIVER}.run"


def conf(tb, vmid):
    return tb.hostdir("pve1") / "pve" / "nodes" / "pve1" / "lxc" / f"{vmid}.conf"


def restart(tb, vmid):
    tb.stop_container("pve1", vmid)
    tb.start_container("pve1", vmid)


def ct_smi(tb, vmid):
    return tb.container_exec("pve1", vmid, ["nvidia-smi", "--query-gpu=index,driver_version", "--format=csv,noheader"])


def test_dry_run_plans_every_host_command_and_changes_nothing(tb, deploy):
    before = conf(tb, 130).read_text()
    p = deploy("prepare", "pve1/130", "--gpus", "0-3", "--dry-run")
    assert p.returncode == 0, p.stderr + p.stdout
    out = " ".join(p.stdout.split())
    assert "style dev (the config already passes GPUs with devN: lines)" in out
    assert "missing from the config: /dev/nvidia2, /dev/nvidia3" in out
    assert "pct set 130 --dev5 /dev/nvidia2 --dev6 /dev/nvidia3" in out
    assert "cp -p /etc/pve/lxc/130.conf /root/vllm-pve-deploy-backups/130.conf." in out
    assert "pct reboot 130" in out and "dry run: nothing was changed" in out
    assert "assigned by playbook qwen36-dflash to pve1/129" in out  # GPUs 2,3: a note, nothing runs there
    assert conf(tb, 130).read_text() == before
    j = deploy("--json", "prepare", "pve1/130", "--gpus", "0-3", "--dry-run")
    assert j.json["dry_run"] and j.json["add_lines"] == ["dev5: /dev/nvidia2", "dev6: /dev/nvidia3"]
    assert [s["step"] for s in j.json["plan"]] == ["backup", "config", "read back", "restart", "check"]


def test_adds_the_gpus_restarts_and_the_container_sees_them_backup_restorable(tb, deploy):
    before = conf(tb, 130).read_text()
    assert len(ct_smi(tb, 130).stdout.splitlines()) == 2
    p = deploy("--json", "prepare", "pve1/130", "--gpus", "0-3", "-y")
    assert p.returncode == 0, p.stdout + p.stderr
    r = p.json
    assert r["ok"] and r["findings"] == [] and r["pending"] == []
    assert "pct reboot 130" in r["applied"]
    text = conf(tb, 130).read_text()
    assert "dev5: /dev/nvidia2\n" in text and "dev6: /dev/nvidia3\n" in text
    assert all(ln in text.splitlines() for ln in before.splitlines())  # nothing that was there is gone
    assert os.path.exists(tb.ctdir("pve1", 130) / "dev" / "nvidia3")
    assert ct_smi(tb, 130).stdout.split() == [f"{i}, {DRIVER}" for i in range(4)] or \
        len(ct_smi(tb, 130).stdout.splitlines()) == 4
    assert r["container_nvidia_smi"]["gpus"] and len(r["container_nvidia_smi"]["gpus"]) == 4
    # the backup, on the host, restores the config as it was
    backup = r["backup"]
    assert re.fullmatch(r"/root/vllm-pve-deploy-backups/130\.conf\.\d{8}-\d{6}", backup)
    assert (tb.hostdir("pve1") / "home" / backup[len("/root/"):]).read_text() == before
    assert r["restore"].startswith(f"cp {backup} /etc/pve/lxc/130.conf")
    h = tb.host_exec("pve1", ["sh", "-c", f"cp {backup} /etc/pve/lxc/130.conf && pct config 130"])
    assert h.returncode == 0, h.stderr
    assert conf(tb, 130).read_text() == before and "nvidia2" not in h.stdout
    # a second run finds nothing to add
    again = deploy("--json", "prepare", "pve1/130", "--gpus", "0,1", "--dry-run")
    assert again.json["add_lines"] == [] and [s["step"] for s in again.json["plan"]] == ["check"]


def test_restart_not_confirmed_is_pending_and_said(tb, deploy):
    p = deploy("prepare", "pve1/130", "--gpus", "0-2")  # stdin is not a terminal: no confirmation
    assert p.returncode == 1
    out = " ".join(p.stdout.split())
    assert "PENDING: pct reboot 130 on pve1 (not confirmed" in out and "pass -y" in out
    assert "dev5: /dev/nvidia2" in conf(tb, 130).read_text()
    assert not os.path.exists(tb.ctdir("pve1", 130) / "dev" / "nvidia2")  # not restarted: not seen yet


def test_missing_line_found_named_fixed_and_found_fixed(tb, deploy):
    c = conf(tb, 129)
    c.write_text(c.read_text().replace("dev2: /dev/nvidia2\n", ""))
    restart(tb, 129)
    v = deploy("--json", "verify", "qwen36-dflash")
    probs = {f["problem"] for f in v.json["gpu_plumbing"]["findings"]}
    assert "config-line-missing" in probs, v.json["gpu_plumbing"]
    p = deploy("prepare", "pve1/129", "-y")  # the GPUs of its playbook
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pct set 129 --dev2 /dev/nvidia2" in " ".join(p.stdout.split())
    v = deploy("--json", "verify", "qwen36-dflash")
    assert v.json["gpu_plumbing"]["findings"] == []


def test_raw_lines_with_the_hosts_majors_and_a_stale_rule_named(tb, deploy):
    raw = ["arch: amd64", "hostname: vllm-130", "memory: 65536",
           "lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 507:* rwm"] + \
        [f"lxc.mount.entry: {d} {d[1:]} none bind,optional,create=file"
         for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")]
    conf(tb, 130).write_text("\n".join(raw) + "\n\n[snap1]\narch: amd64\n")
    restart(tb, 130)
    p = deploy("--json", "prepare", "pve1/130", "--gpus", "0,1", "-y")
    assert p.returncode == 0, p.stdout + p.stderr
    r = p.json
    assert r["style"] == "raw"
    assert r["add_lines"] == ["lxc.cgroup2.devices.allow: c 508:* rwm",
                              "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file"]
    assert any("c 507:* rwm" in n and "left in place" in n for n in r["notes"])
    text = conf(tb, 130).read_text()
    main, snap = text.split("[snap1]")
    assert "c 508:* rwm" in main and "dev/nvidia1 none" in main and "c 507:* rwm" in main
    assert snap == "\narch: amd64\n"  # the snapshot section untouched
    assert len(ct_smi(tb, 130).stdout.splitlines()) == 2


def test_old_proxmox_gets_raw_lines(tb, deploy):
    tb.set_fault("pve1", None, "pve_version", "8.0.4")
    conf(tb, 130).write_text("arch: amd64\nhostname: vllm-130\nmemory: 65536\n")
    restart(tb, 130)
    p = deploy("--json", "prepare", "pve1/130", "--gpus", "1", "--dry-run")
    assert p.json["style"] == "raw" and "older than 8.1" in p.json["why_style"]
    assert "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file" in p.json["add_lines"]
    assert "lxc.cgroup2.devices.allow: c 195:* rwm" in p.json["add_lines"]
    h = tb.host_exec("pve1", ["pct", "set", "130", "--dev0", "/dev/nvidia1"])
    assert h.returncode == 255 and "Unknown option: dev0" in h.stderr  # the old pve-container has no devN:
    # issue 53 item 10: a config that already has devN: lines (129) gets raw lines too on that version
    tb.set_fault("pve1", 129, "missing_dev_line", "/dev/nvidia1")
    p = deploy("--json", "prepare", "pve1/129", "--dry-run")
    assert p.json["style"] == "raw" and "older than 8.1" in p.json["why_style"], p.json
    assert not any(s["command"].startswith("pct set") for s in p.json["plan"]), p.json["plan"]


def test_a_change_that_does_not_read_back_is_restored(tb, deploy):
    """Issue 53 item 10: --style raw under missing_dev_line wrote a raw line, failed its read-back and left the line
    in 129.conf; the backup is now put back at once, and the message says so."""
    tb.set_fault("pve1", 129, "missing_dev_line", "/dev/nvidia1")
    before = conf(tb, 129).read_text()
    p = deploy("--json", "prepare", "pve1/129", "--style", "raw", "-y")
    assert p.returncode == 1, p.stdout + p.stderr
    msg = " ".join((p.stdout + p.stderr).split())
    assert "does not show the change" in msg and "restored" in msg, msg
    assert conf(tb, 129).read_text() == before


def test_driver_mismatch_fixed_from_the_hosts_run_file(tb, deploy):
    tb.set_fault("pve1", None, "nvidia_smi_mismatch", "containers")
    p = deploy("--json", "prepare", "pve1/130", "--gpus", "0,1")
    assert p.returncode == 1
    probs = {f["problem"]: f for f in p.json["findings"]}
    assert "driver-version-mismatch" in probs and "container-nvidia-smi" in probs, probs
    assert f"--driver-run /root/NVIDIA-Linux-x86_64-{DRIVER}.run" in probs["container-nvidia-smi"]["fix"]
    # a .run of another version is refused before anything changes
    tb.host_exec("pve1", ["cp", RUN, "/root/NVIDIA-Linux-x86_64-550.90.run"])
    w = deploy("prepare", "pve1/130", "--gpus", "0,1", "--driver-run", "/root/NVIDIA-Linux-x86_64-550.90.run", "-y")
    assert w.returncode == 2 and "is driver 550.90, the host's kernel module is 550.54.15" in " ".join(w.stderr.split())
    ok = deploy("--json", "prepare", "pve1/130", "--gpus", "0,1", "--driver-run", RUN, "-y")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.json["container_nvidia_smi"]["versions"] == [DRIVER]
    assert any(a.startswith(f"driver {DRIVER} user space") for a in ok.json["applied"])
    assert ct_smi(tb, 130).returncode == 0
    assert sorted(os.listdir(tb.ctdir("pve1", 130) / "nvlib")) == [f"libcuda.so.{DRIVER}", f"libnvidia-ml.so.{DRIVER}"]


def test_gpus_another_playbook_serves_are_refused(tb, deploy):
    tb.container_exec("pve1", 129, ["sh", "-c", "setsid bash -c \"exec -a 'vllm serve /root/models/Qwen3.6-27B' "
                                                "sleep 120\" </dev/null >/dev/null 2>&1 &"])
    before = conf(tb, 130).read_text()
    p = deploy("prepare", "pve1/130", "--gpus", "2,3", "-y")
    assert p.returncode == 2
    err = " ".join(p.stderr.split())
    assert "served by playbook qwen36-dflash in container pve1/129 (vLLM running" in err
    assert "nothing was changed" in err and conf(tb, 130).read_text() == before
    # and --gpus that would leave the container's own playbook short
    s = deploy("prepare", "pve1/129", "--gpus", "0,1")
    assert s.returncode == 2 and "playbook qwen36-dflash runs there on GPUs" in " ".join(s.stderr.split())


def test_uvm_missing_on_the_host_is_refused_with_its_fix(tb, deploy):
    tb.set_fault("pve1", None, "uvm_missing", True)
    before = conf(tb, 130).read_text()
    p = deploy("--json", "prepare", "pve1/130", "--gpus", "0-3", "-y")
    assert p.returncode == 1
    f = {x["problem"]: x for x in p.json["findings"]}["uvm-missing-on-host"]
    assert "nvidia-modprobe -u -c=0" in f["fix"]
    assert conf(tb, 130).read_text() == before and p.json["applied"] == []


def test_hostile_driver_path_refused_before_anything_runs(tb, deploy):
    p = deploy("prepare", "pve1/130", "--gpus", "0", "--driver-run", "/root/x.run;reboot")
    assert p.returncode == 2 and "expected an absolute path on the host" in p.stderr
    q = deploy("prepare", "pve1/999", "--gpus", "0")
    assert q.returncode == 2 and "no container pve1/999" in q.stderr
