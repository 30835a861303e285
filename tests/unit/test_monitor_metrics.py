"""`deploy monitor metrics`' rendering, from crafted status rows (status/v1 plus `_gpus`): every series, its labels
as `deploy monitor export`'s targets and rules expect them, hostile strings from a container's state file, the
textfile written atomically and read back, and the real `promtool check metrics` on the output."""

import os
import shutil
import stat
import subprocess

import pytest

from orchestrator.observe import monitor as MON
from orchestrator.observe import monitor_metrics as M
from orchestrator.core.errors import UsageError
from orchestrator.observe.status import _row

PROMTOOL = shutil.which("promtool")


def serving(host="pve1", vmid=129, playbook="qwen36-dflash", verdict="passed", gpus=(0, 1), used=(70000, 70000),
            systemd=True, restarts=2, start_limit=False, process="running"):
    r = _row(host, vmid, playbook=playbook, process=process, healthy=verdict == "passed", container="running",
             gpus=[{"index": i, "used_mib": u, "total_mib": 81920} for i, u in enumerate(used)],
             gate={"verdict": verdict} if process == "running" else None)
    r["_gpus"] = list(gpus)
    r["supervision"] = {"supervisor": "systemd", "unit": f"vllm-{playbook}.service", "restarts": restarts,
                        "start_limit_hit": start_limit} if systemd else {"supervisor": "none", "unit": None}
    return r


def by_name(rows, **kw):
    return M.parse(M.render(M.series(rows, now=1700000000.0, **kw)))


def test_every_series_with_the_labels_the_rules_and_targets_use():
    rows = [serving(),
            serving(vmid=130, playbook="qwen36-mtp", verdict="not gated", gpus=(2,), used=(5, 5, 40000),
                    restarts=0, start_limit=False),
            _row("pve2", 131, reachable=False, timed_out=True, healthy=False, problems=["timed out"])]
    s = by_name(rows)
    assert s[MON.VPD_TIMESTAMP] == [({"host": "pve1"}, 1700000000.0), ({"host": "pve2"}, 1700000000.0)]
    assert s[MON.VPD_REACHABLE] == [({"host": "pve1", "vmid": "129", "playbook": "qwen36-dflash"}, 1.0),
                                    ({"host": "pve1", "vmid": "130", "playbook": "qwen36-mtp"}, 1.0),
                                    ({"host": "pve2", "vmid": "131", "playbook": ""}, 0.0)]
    assert [v for _, v in s[M.HEALTHY]] == [1.0, 0.0, 0.0]
    assert s[MON.VPD_GATED] == [({"host": "pve1", "vmid": "129", "playbook": "qwen36-dflash"}, 1.0),
                                ({"host": "pve1", "vmid": "130", "playbook": "qwen36-mtp"}, 0.0)]
    assert s[MON.VPD_RESTARTS] == [
        ({"host": "pve1", "vmid": "129", "playbook": "qwen36-dflash", "unit": "vllm-qwen36-dflash.service"}, 2.0),
        ({"host": "pve1", "vmid": "130", "playbook": "qwen36-mtp", "unit": "vllm-qwen36-mtp.service"}, 0.0)]
    assert [v for _, v in s[MON.VPD_START_LIMIT]] == [0.0, 0.0]
    # foreign: GPUs 0 and 1 are held by 129's deployment, 2 by 130's: on this host, nothing is foreign
    foreign = {(lab["vmid"], lab["gpu"]): v for lab, v in s[MON.VPD_FOREIGN]}
    assert foreign == {("129", "0"): 0.0, ("129", "1"): 0.0, ("130", "0"): 0.0, ("130", "1"): 0.0,
                       ("130", "2"): 0.0}
    # the exposition names the counter with _total, as the rules read it
    text = M.render(M.series(rows, now=1.0))
    assert "# TYPE vpd_unit_restarts_total counter" in text and "vpd_unit_restarts_total{" in text


def test_foreign_gpu_memory_is_memory_on_a_gpu_no_deployment_of_ours_holds():
    rows = [serving(gpus=(0,), used=(70000, 30000)),  # GPU 1 is used by someone else
            serving(vmid=140, playbook="old", process="exited", gpus=(2,), used=(0, 0, 12000), systemd=True,
                    start_limit=True, restarts=5),  # its server is gone: what GPU 2 holds is not a deployment's
            _row("pve1", 150, playbook=None, process="not ours", healthy=False,
                 gpus=[{"index": 3, "used_mib": 50000, "total_mib": 81920}])]
    s = by_name(rows)
    foreign = {(lab["vmid"], lab["gpu"]): v for lab, v in s[MON.VPD_FOREIGN]}
    assert foreign[("129", "0")] == 0.0 and foreign[("129", "1")] == 30000.0
    assert foreign[("140", "2")] == 12000.0 and foreign[("150", "3")] == 50000.0
    assert {lab["playbook"] for lab, _ in s[MON.VPD_FOREIGN] if lab["vmid"] == "150"} == {""}
    # gated only where our launch serves; the start limit of the exited one
    assert [lab["vmid"] for lab, _ in s[MON.VPD_GATED]] == ["129"]
    assert ({"host": "pve1", "vmid": "140", "playbook": "old", "unit": "vllm-old.service"}, 1.0) in \
        s[MON.VPD_START_LIMIT]
    # the same GPU on another host is another GPU
    other = serving(host="pve2", vmid=200, gpus=(5,), used=(9000,))
    foreign = {(lab["host"], lab["gpu"]): v for lab, v in by_name(rows + [other])[MON.VPD_FOREIGN]}
    assert foreign[("pve2", "0")] == 9000.0 and foreign[("pve1", "0")] == 0.0


def test_hostile_strings_from_a_container_are_escaped_and_parse_back():
    evil = 'x"} 1\nvpd_gated{host="pve1",vmid="129",playbook="fake"} 1\n# \\ \ud800 ' + "é" * 300
    r = serving(playbook=evil)
    r["supervision"]["unit"] = 'u"\n'
    r["gpus"].append({"index": "7; rm -rf /", "used_mib": 1})  # not an int: not a GPU index
    r["gpus"].append({"index": 9, "used_mib": float("nan")})  # not a number: left out
    r["gpus"].append({"index": 10, "used_mib": True})  # a bool is not a number either
    r["_gpus"] = [0, 1, "2", None, True]
    text = M.render(M.series([r], now=1.0))
    s = M.parse(text)
    # one row, one series per family: nothing injected
    assert len(s[MON.VPD_GATED]) == 1 and len(s[MON.VPD_REACHABLE]) == 1
    pb = s[MON.VPD_GATED][0][0]["playbook"]
    assert pb.startswith('x"} 1\nvpd_gated{host="pve1"') and "\ud800" not in pb and len(pb) == M.LABEL_MAX
    assert pb.endswith("...")
    assert s[MON.VPD_START_LIMIT][0][0]["unit"] == 'u"\n'
    assert sorted(lab["gpu"] for lab, _ in s[MON.VPD_FOREIGN]) == ["0", "1"]
    assert all(ln.startswith(("#", "vpd_")) for ln in text.splitlines())


def test_label_values():
    assert M.label(None) == "" and M.label(129) == "129" and M.label({"a": 1}) == "" and M.label(True) == "true"
    assert M.label("a" * 500) == "a" * (M.LABEL_MAX - 3) + "..."


def test_textfile_is_written_atomically_with_mode_0644_and_read_back(tmp_path):
    path = M.check_textfile(str(tmp_path / "vllm-pve-deploy.prom"))
    old = os.umask(0o077)
    try:
        res = M.write_textfile(path, M.render(M.series([serving()], now=5.0)))
    finally:
        os.umask(old)
    # timestamp, reachable+healthy, gated, operation, restarts, limit, 2 GPUs
    assert res["samples"] == 1 + 2 + 1 + 1 + 1 + 1 + 2
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(tmp_path) == ["vllm-pve-deploy.prom"]  # no temp file left
    with pytest.raises(UsageError, match="ending in .prom"):
        M.check_textfile(str(tmp_path / "x.txt"))
    with pytest.raises(UsageError, match="does not exist"):
        M.check_textfile(str(tmp_path / "nope" / "x.prom"))


def test_exit_code_is_0_when_written_whatever_the_health_and_3_when_a_host_is_unreachable():
    assert M.exit_code([serving(verdict="failed")]) == 0
    assert M.exit_code([serving(), _row("pve2", 1, reachable=False)]) == 3


@pytest.mark.skipif(not PROMTOOL, reason="needs promtool (apt-get install prometheus; setup.sh does)")
def test_promtool_check_metrics_accepts_the_output():
    rows = [serving(), serving(vmid=130, playbook='q"\n', verdict="failed", gpus=(), used=(3000,)),
            _row("pve2", 131, reachable=False)]
    text = M.render(M.series(rows, now=1.0))
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.stdout, p.stderr, text)


def test_a_failed_write_says_what_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    from orchestrator.core.errors import DeployError

    path = M.check_textfile(str(tmp_path / "v.prom"))

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", src)
    monkeypatch.setattr(M.os, "replace", full)
    with pytest.raises(DeployError) as e:
        M.write_textfile(path, M.render(M.series([serving()], now=1.0)))
    assert "No space left on device" in e.value.message and e.value.where == path
    assert os.listdir(tmp_path) == []


def test_an_operation_in_progress_is_a_live_lock_only():
    import socket
    import subprocess as sp
    import sys

    now = 1000.0
    mine = {"holder": "me@ws", "operation": "up", "expires": now + 30, "workstation": socket.gethostname(),
            "pid": os.getppid(), "pid_start": None}
    assert M.in_progress(mine, now)
    assert not M.in_progress(dict(mine, expires=now - 1), now)  # the lease lapsed: a killed deploy's
    gone = sp.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not M.in_progress(dict(mine, pid=gone.pid), now)  # its deploy process is gone from this workstation
    assert M.in_progress(dict(mine, workstation="elsewhere", pid=gone.pid), now)  # another machine's: live lease
    assert not M.in_progress(None, now) and not M.in_progress({}, now)
    assert M.in_progress({"holder": "unknown (unreadable lock file)", "expires": "x", "pid": "1; rm"}, now)
    r = serving()
    r["lock"] = dict(mine, operation='up"\n')
    s = M.parse(M.render(M.series([r], now=now)))
    assert s[MON.VPD_OPERATION] == [({"host": "pve1", "vmid": "129", "playbook": "qwen36-dflash",
                                      "operation": 'up"\n'}, 1.0)]
    r["lock"] = None
    assert M.parse(M.render(M.series([r], now=now)))[MON.VPD_OPERATION][0] == (
        {"host": "pve1", "vmid": "129", "playbook": "qwen36-dflash", "operation": ""}, 0.0)
