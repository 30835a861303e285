"""`deploy doctor`'s classification on facts dicts (no container needed)."""

import hashlib
import json
import os

from orchestrator.hosts.doctor import config_differences, diagnose, fixes_present

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PUB = open(os.path.join(REPO, "playbooks/drafters/qwen36-27b-dflash.config.json"), "rb").read()
STALE = open(os.path.join(REPO, "testbed/vpd_testbed/data/qwen36-27b-dflash.stale-guess.config.json"), "rb").read()
PINNED = [{"playbook": "qwen36-dflash", "fallback": "qwen36-mtp", "target": "pve1/129", "min_acceptance": 0.4,
           "path": "/root/models/Qwen3.6-27B-DFlash", "hub_id": None, "config": json.loads(PUB),
           "sha256": hashlib.sha256(PUB).hexdigest()}]
STACK = {"installed": True, "version": "0.34.0", "path": "/x/vllm", "import_ok": True, "extensions_missing": [],
         "markers": {"plus1_fix": True, "pr40898_sliding_window": False, "resolve_layer_attention": True}}


def facts(raw=PUB, kind="local", stack=STACK, holders=None, procs=None, mem=None, started=100.0, mtime=50.0):
    d = {"kind": kind, "path": "/root/models/Qwen3.6-27B-DFlash/config.json", "dir": "/root/models/Qwen3.6-27B-DFlash",
         "text": raw.decode(), "sha256": hashlib.sha256(raw).hexdigest(), "mtime": mtime}
    if kind == "hub":
        d.update(dir=None, hub_id="z-lab/Qwen3.6-27B-DFlash")
    srv = {"pid": 10, "args": {"spec": {"method": "dflash", "model": "x"}, "port": 8000}, "drafter": d, "target": None}
    return {"servers": [srv], "stack": stack, "holders": holders or [],
            "processes": procs if procs is not None else [{"pid": 10, "ppid": 1, "started_at": started}],
            "memory": mem or {}}


def classes(f):
    return [x["class"] for x in f]


def test_published_config_is_fine_and_guessed_is_named():
    assert diagnose(facts(), PINNED, host="pve1", vmid=129) == []
    f = diagnose(facts(STALE), PINNED, host="pve1", vmid=129)
    assert classes(f) == ["guessed-config"] and "deploy up qwen36-dflash --clean-gpus" in f[0]["fix"]
    fields = [x["field"] for x in config_differences(json.loads(STALE), json.loads(PUB))]
    assert fields[:6] == ["dflash_config.target_layer_ids", "dflash_config.mask_token_id", "layer_types",
                          "sliding_window", "use_sliding_window", "bos_token_id"]


def test_a_hub_snapshot_is_never_written_so_the_fix_says_what_instead():
    f = diagnose(facts(STALE, kind="hub"), [dict(PINNED[0], path=None, hub_id="z-lab/Qwen3.6-27B-DFlash")],
                 host="pve1", vmid=129)
    assert classes(f) == ["guessed-config"] and "is never written" in f[0]["fix"]
    assert f[0]["fix"].startswith("deploy up qwen36-dflash --clean-gpus (serves the pinned config from deploy's own")


def test_stale_write_missing_fix_incomplete_build():
    assert classes(diagnose(facts(mtime=200.0), PINNED, host="pve1", vmid=129)) == ["stale-write"]
    old = dict(STACK, version="0.24.0", markers={"plus1_fix": False, "pr40898_sliding_window": False,
                                                 "resolve_layer_attention": False})
    f = diagnose(facts(stack=old), PINNED, host="pve1", vmid=129)
    assert classes(f) == ["missing-fix"] and "PR #40727" in f[0]["cause"] and "PR #40898" in f[0]["cause"]
    assert "deploy up qwen36-mtp --clean-gpus" in f[0]["fix"]
    assert fixes_present(dict(STACK, version="0.22.0", markers={"pr40898_sliding_window": True})) == (True, True)
    broken = dict(STACK, extensions_missing=["cumem_allocator.abi3.so"], import_ok=False, import_error="boom")
    f = diagnose(facts(stack=broken), PINNED, host="pve1", vmid=129, playbook={"playbook": "qwen36-dflash"})
    assert classes(f) == ["incomplete-build"] and "cumem_allocator" in f[0]["cause"] and "boom" in f[0]["cause"]


def test_leftover_holders_inside_and_outside():
    procs = [{"pid": 10, "ppid": 1}, {"pid": 11, "ppid": 10, "comm": "VLLM::EngineCore"},
             {"pid": 20, "ppid": 1, "comm": "VLLM::Worker_TP0"}]
    holders = [{"pid": 11, "comm": "VLLM::EngineCore", "devices": ["/dev/nvidia0"]},
               {"pid": 20, "comm": "VLLM::Worker_TP0", "devices": ["/dev/nvidia1"]}]
    f = diagnose(facts(procs=procs, holders=holders), PINNED, host="pve1", vmid=129,
                 playbook={"playbook": "qwen36-dflash"})
    assert classes(f) == ["leftover-holder"] and "PID 20" in f[0]["cause"]
    assert f[0]["fix"].startswith("deploy down qwen36-dflash --clean-gpus")
    f = diagnose({"servers": [], "holders": [], "memory": {"gpus": {"0": {"used": 30000, "total": 81559}}}},
                 PINNED, host="pve1", vmid=129)
    assert classes(f) == ["leftover-holder"] and "outside" in f[0]["cause"]
    assert f[0]["fix"].startswith("deploy discover pve1")


def test_low_acceptance_from_metrics():
    m = ("vllm:spec_decode_num_drafts_total 100\nvllm:spec_decode_num_draft_tokens_total 1500\n"
         "vllm:spec_decode_num_accepted_tokens_total 15\n")
    fx = facts()
    fx["servers"][0]["metrics"] = m
    f = diagnose(fx, PINNED, host="pve1", vmid=129)
    assert classes(f) == ["low-acceptance"] and "rate 1.0%" in f[0]["cause"] and "AL 1.15" in f[0]["cause"]
    assert "min_draft_acceptance 40%" in f[0]["cause"] and "mean acceptance length 1.15 < 2.2" in f[0]["cause"]
    assert "deploy up qwen36-mtp --clean-gpus" == f[0]["fix"]


HOST_OUT = """gpu 0, GPU-aaa
gpu 1, GPU-bbb
app 501, 30000, GPU-aaa
app 777, 70000, GPU-bbb
app 888, 1000, GPU-bbb
hostns pid:[4026531836]
proc 501 pid:[4026531836] cg=- python3
proc 777 pid:[4026532999] cg=lxc/130 VLLM::Worker_TP
proc 888 pid:[4026532111] cg=lxc/129 VLLM::Worker_TP
"""


def test_holders_outside_the_container_are_named_by_where_they_are():
    from orchestrator.core.facts import parse_host_holders
    hh = parse_host_holders(HOST_OUT)
    assert hh["host_pid_ns"] == "pid:[4026531836]"
    assert [(h["pid"], h["gpu"], h["mib"], h["vmid"]) for h in hh["holders"]] == \
        [(501, 0, 30000, None), (777, 1, 70000, 130), (888, 1, 1000, 129)]
    fx = {"servers": [], "holders": [], "pid_ns": "pid:[4026532111]",
          "memory": {"gpus": {"0": {"used": 30000, "total": 81559}, "1": {"used": 71000, "total": 81559}}}}
    f = diagnose(fx, PINNED, host="pve1", vmid=129, host_holders=hh)
    assert [x["class"] for x in f] == ["leftover-holder", "leftover-holder"]  # its own PID 888 is not outside
    assert "by the host itself (no container): host PID 501 (python3) uses 30000 MiB" in f[0]["cause"]
    assert "never kills on the host" in f[0]["fix"]
    assert "by container 130" in f[1]["cause"] and f[1]["fix"].startswith("GPU 1 is shared with container 130")


def test_serve_args_of_both_entry_points():
    from orchestrator.agent.container import doctor as ag
    a = ag._serve_args(["/root/ml-env/bin/python", "/root/ml-env/bin/vllm", "serve", "/m", "--port=8002",
                        "-sc", '{"method":"dflash","model":"/d"}'])
    assert (a["model"], a["port"], a["spec"]) == ("/m", 8002, {"method": "dflash", "model": "/d"})
    a = ag._serve_args(["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
                        "--speculative-config", "{bad"])
    assert a["model"] == "/m" and a["port"] == 8000 and a["spec"] is None and a["spec_error"]
    assert ag._serve_args(["python", "train.py"]) is None


def test_an_import_that_timed_out_is_slow_not_broken():
    """Issue 37: under load `import vllm` may miss doctor's bound; that is a check-timeout, never incomplete-build."""
    slow = dict(STACK, import_ok=False, import_timed_out=True, import_tries=[8.0, 3.5],
                import_error="import vllm did not finish within 8.0s then 3.5s (a slow or busy machine, not proof "
                             "of a broken build)")
    f = diagnose(facts(stack=slow), PINNED, host="pve1", vmid=129, playbook={"playbook": "qwen36-dflash"})
    assert classes(f) == ["check-timeout"]
    assert "8.0s then 3.5s" in f[0]["cause"] and "--budget" in f[0]["fix"]
    assert f[0]["evidence"]["tries_s"] == [8.0, 3.5]


def test_slow_then_fast_import_retries_and_a_failing_one_shows_its_traceback(tmp_path):
    """The agent's import check itself (container/stack.py) on a stand-in vllm package: a first bound that is too
    short is retried with what is left; an import that fails reports the traceback's last lines, not one line."""
    import subprocess
    import sys
    pkg = tmp_path / "slow" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import time\ntime.sleep(1.5)\n__version__ = '0.34.0'\n")
    (pkg / "platforms.py").write_text("current_platform = None\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.34.0'\n")
    bad = tmp_path / "bad" / "vllm"
    bad.mkdir(parents=True)
    (bad / "__init__.py").write_text("def f():\n    raise ImportError('libcudart.so.13: cannot open shared object "
                                     "file')\nf()\n")
    (bad / "_version.py").write_text("__version__ = version = '0.34.0'\n")
    code = ("import json, sys, time; sys.path.insert(0, %r); from orchestrator.agent.container.stack import "
            "_vllm_stack; s = _vllm_stack(0.6, retry_until=time.monotonic() + float(sys.argv[1])); "
            "print(json.dumps({k: s.get(k) for k in ('import_ok', 'import_timed_out', 'import_tries', "
            "'import_error')}))" % REPO)

    def run(root, budget):
        env = dict(os.environ, PYTHONPATH=str(root))
        p = subprocess.run([sys.executable, "-c", code, str(budget)], env=env, capture_output=True, text=True,
                           timeout=120, cwd=str(tmp_path))
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    ok = run(tmp_path / "slow", 60)
    assert ok["import_ok"] and not ok["import_timed_out"] and ok["import_tries"][0] == 0.6
    assert len(ok["import_tries"]) == 2
    slow = run(tmp_path / "slow", 0.3)  # nothing left for a retry: reported as a timeout, not as a failure
    assert not slow["import_ok"] and slow["import_timed_out"] and "did not finish within 0.6s" in slow["import_error"]
    failed = run(tmp_path / "bad", 60)
    assert not failed["import_ok"] and not failed["import_timed_out"]
    assert "in f" in failed["import_error"] and "libcudart.so.13" in failed["import_error"]


def test_an_nvml_version_mismatch_is_its_own_finding_with_the_version_check():
    """Issue 41: nvidia-smi failing with NVML's version mismatch is named, with the check of both versions; another
    nvidia-smi failure is not this finding."""
    mem = {"error": "failed", "message": "Failed to initialize NVML: Driver/library version mismatch\n"
                                         "NVML library version: 550.90"}
    f = diagnose(facts(mem=mem), PINNED, host="pve1", vmid=129)
    assert classes(f) == ["driver-mismatch"]
    assert "nvidia-smi in this container fails: Failed to initialize NVML" in f[0]["cause"]
    assert "`cat /proc/driver/nvidia/version` on pve1" in f[0]["fix"] and "--no-kernel-module" in f[0]["fix"]
    assert "wedged" not in f[0]["fix"]
    other = {"error": "timeout", "message": "nvidia-smi did not answer within 4s"}
    assert diagnose(facts(mem=other), PINNED, host="pve1", vmid=129) == []


def test_a_complete_build_whose_import_raises_is_import_fails_with_the_exception_line(tmp_path):
    """Issue 53 item 5: every extension present and `import vllm` raising is not an incomplete build; the finding
    says the import fails and shows the exception's own line, the words a user searches for."""
    import subprocess
    import sys

    from orchestrator.agent.container.stack import import_exception

    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise RuntimeError("CUDA initialisation failed: no device")\n')
    p = subprocess.run([sys.executable, "-c", "import vllm"], cwd=tmp_path, capture_output=True, text=True)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith("Traceback")
    assert import_exception(lines) == "RuntimeError: CUDA initialisation failed: no device"
    assert import_exception(["  only indented lines", "Traceback (most recent call last):"]) is None
    err = "exit 1: RuntimeError: CUDA initialisation failed: no device | Traceback (most recent call last): | ..."
    raised = dict(STACK, import_ok=False, import_tries=[8.0], import_error=err,
                  import_exception="RuntimeError: CUDA initialisation failed: no device")
    f = diagnose(facts(stack=raised), PINNED, host="pve1", vmid=129, playbook={"playbook": "qwen36-dflash"})
    assert classes(f) == ["import-fails"], f
    assert f[0]["cause"].endswith("`import vllm` fails: RuntimeError: CUDA initialisation failed: no device")
    assert "every compiled extension is present" in f[0]["cause"] and "deploy verify qwen36-dflash" in f[0]["fix"]
    assert f[0]["evidence"]["exception"] == "RuntimeError: CUDA initialisation failed: no device"
    # a package refused as untrusted was never imported: not import-fails
    refused = dict(STACK, import_ok=False, import_error="not imported: owned by uid 1000")
    assert classes(diagnose(facts(stack=refused), PINNED, host="pve1", vmid=129)) == ["incomplete-build"]


def test_doctor_budget_grows_with_the_load_measured(monkeypatch):
    """Issue 53 item 15: on a busy machine `import vllm` missed doctor's 8 s bound twice; the agent measures its
    load as tests/slack.py does and scales its budget (at most x DOCTOR_LOAD_MAX), and the tool waits for that."""
    from orchestrator.agent.container import doctor as AD
    from orchestrator.agent.container.protocol import DOCTOR_LOAD_MAX

    monkeypatch.setattr(AD.os, "getloadavg", lambda: (4.0 * (AD.os.cpu_count() or 1), 0, 0))
    assert AD.load_factor() == DOCTOR_LOAD_MAX
    monkeypatch.setattr(AD.os, "getloadavg", lambda: (0.0, 0, 0))
    assert 1.0 <= AD.load_factor() <= DOCTOR_LOAD_MAX
    slow = dict(STACK, import_ok=False, import_timed_out=True, import_tries=[16.0, 19.5], load_factor=2.0,
                budget_s=24.0, import_error="import vllm did not finish within 16.0s then 19.5s (a slow or busy "
                                            "machine, not proof of a broken build)")
    f = diagnose(facts(stack=slow), PINNED, host="pve1", vmid=129)
    assert classes(f) == ["check-timeout"] and "(budget 24.0s: x2 for the load measured)" in f[0]["cause"]
