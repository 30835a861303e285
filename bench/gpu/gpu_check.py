"""The real-GPU check (issues 40, 55): the tool's GPU lifecycle against a real NVIDIA driver, through the test bed.

    scripts/gpu-check.sh [--dry-run] [--rehearse] [--out DIR] [--carry DIR] [--gpu-memory-utilization F] ...

Made for the GPU machine that is lent for this work: it reaches no package registry and receives at most 64 MiB,
so no CUDA vLLM is installed. The test bed's fake vLLM runs with its torch engine instead (the stand-in,
testbed/vpd_testbed/fake_vllm/vllm/_fake/torchgpu.py): the fake's CLI, log lines, API and metrics, but its workers
hold real CUDA contexts and allocate the weights and KV cache that orchestrator/core/sizing.py predicts for the playbook
on this card, and each decode step is a real matrix product. What the machine lacks travels in `gpu-carry/`
(bench/gpu/carry.py). The steps: `deploy prepare --dry-run`, `deploy up`, `deploy status`,
`deploy restart --clean-gpus` with a holder in the container that ignores SIGTERM, `deploy doctor`, the field
report's `fuser -k` (the server's processes SIGKILLed: how long the real driver takes to give the memory back),
`deploy restart --clean-gpus` refused while a process outside the deployment holds the GPU, `deploy down`; GPU
memory sampled all along (the release curve), back at its baseline after each. The report: DATE-CARD.json and .txt
(bench/gpu/ by default, $OUT on the device machine). Never part of CI: without a GPU it refuses at once (exit 2).
Exit: 0 every step as expected, 1 a step was not, 2 refused.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "testbed"), str(Path(__file__).resolve().parent)]

import carry  # noqa: E402
from vpd_testbed import realgpu  # noqa: E402
from vpd_testbed.common import TestbedError  # noqa: E402

SCHEMA = "vpd-gpu-check/2"
BUDGET_S = 480  # the 8 minutes on the GPU machine (its start is extra)
PLAYBOOK = "gpu-check"
BASE_PLAYBOOK = "qwen36-mtp"  # MTP: no drafter file; one GPU here
TARGET_CONFIG = REPO / "testbed" / "vpd_testbed" / "data" / "qwen36-27b-target.trimmed.config.json"
SIZING_INPUTS = {"dtype": "bfloat16", "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                 "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
TOOLS = ("unshare", "nsenter", "mount", "umount", "ip", "ssh-keygen", "setsid", "fuser")  # what the test bed and the agent run
PY_MODULES = ("fabric", "paramiko", "tenacity", "yaml", "click", "prometheus_client", "transformers", "torch")
SMI_QUERY = ["--query-gpu=index,name,memory.used,memory.total,driver_version,pci.bus_id",
             "--format=csv,noheader,nounits"]
HOLDER = Path(__file__).resolve().parent / "holder.py"
# (name, what it runs, what is expected) in order; the runner below follows the same list
STEPS = [
    ("deploy prepare --dry-run", "deploy --json prepare pve1/129 --gpus 0 --dry-run (the gpu-plumbing check against the "
     "real driver version and device nodes)", "exit 0 or 1 (1: something to do is named); the driver version read"),
    ("deploy up", "deploy --json up gpu-check (sizing against the real card's memory, the stand-in loads)", "exit 0"),
    ("deploy status", "deploy --json status", "exit 0, the deployment running"),
    ("deploy restart --clean-gpus (holder ignoring SIGTERM)",
     "a process in the container takes HOLD_MIB with its own CUDA context and ignores SIGTERM; then deploy --json "
     "restart gpu-check --clean-gpus -y", "exit 0; the holder SIGKILLed after the grace period; memory dips and comes "
     "back"),
    ("deploy doctor", "deploy --json doctor", "exit 0"),
    ("fuser -k /dev/nvidia* (the field report)", "in the container: fuser -k -KILL /dev/nvidia0; GPU memory sampled "
     "until it is back at the baseline", "the server's memory returned; the seconds it took"),
    ("deploy restart --clean-gpus (holder outside the deployment)",
     "a process outside the test bed takes HOLD_MIB; deploy --json restart gpu-check --clean-gpus -y",
     "refused (exit != 0, held outside named); the outside holder still alive; then killed here, its release timed"),
    ("deploy down", "deploy --json down gpu-check", "exit 0; GPU memory back at the baseline"),
]


def say(msg):
    print("gpu-check: " + msg, file=sys.stderr, flush=True)


class Refused(Exception):
    """The check cannot run here; the message says why and what to do."""


# ---- nvidia-smi ------------------------------------------------------------------------------------------------

def smi(args, timeout=30):
    exe = realgpu.find_nvidia_smi()
    env = dict(os.environ, **realgpu.driver_env())
    return subprocess.run([exe] + list(args), capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def gpu_facts() -> dict:
    r = smi(SMI_QUERY)
    gpus = []
    for ln in r.stdout.strip().splitlines():
        f = [x.strip() for x in ln.split(",")]
        if len(f) >= 5:
            try:
                gpus.append({"index": int(f[0]), "name": f[1], "memory_used_mib": int(f[2]),
                             "memory_total_mib": int(f[3]), "driver_version": f[4],
                             "pci_bus_id": f[5] if len(f) > 5 else None})
            except ValueError:
                gpus.append({"unparsed": ln})
    table = smi([]).stdout
    m = re.search(r"CUDA Version:\s*([0-9.]+)", table)
    try:
        proc_version = Path("/proc/driver/nvidia/version").read_text().strip()
    except OSError as e:
        proc_version = "unreadable: %s" % e
    return {"gpus": gpus, "cuda_version": m.group(1) if m else None, "proc_driver_version": proc_version,
            "driver_version": gpus[0].get("driver_version") if gpus else None, "query_raw": r.stdout,
            "query_rc": r.returncode, "query_stderr": r.stderr.strip()[-500:]}


def used_mib(gpu=0):
    try:
        r = smi(["--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)], timeout=15)
        return int(r.stdout.strip().split(",")[1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class Sampler(threading.Thread):
    """GPU 0's memory every `every` s for the whole run: samples [(t, MiB)], marks [(t, label)]."""

    def __init__(self, every=0.2):
        super().__init__(daemon=True)
        self.every, self.samples, self.marks, self.stop = every, [], [], threading.Event()
        self.t0 = time.monotonic()

    def now(self):
        return round(time.monotonic() - self.t0, 2)

    def mark(self, label):
        self.marks.append((self.now(), label))

    def run(self):
        while not self.stop.is_set():
            u = used_mib()
            if u is not None:
                self.samples.append((self.now(), u))
            self.stop.wait(self.every)


def wait_baseline(baseline, tol, limit_s, sampler=None) -> dict:
    """Poll until GPU 0 is within tol of baseline: {"seconds", "back", "from_mib", "end_mib"}."""
    t0 = time.monotonic()
    first = u = used_mib()
    while True:  # at least one reading, however slow nvidia-smi is
        if u is not None and baseline is not None and u <= baseline + tol:
            return {"back": True, "seconds": round(time.monotonic() - t0, 2), "from_mib": first, "end_mib": u}
        if time.monotonic() - t0 >= limit_s:
            return {"back": False, "seconds": round(time.monotonic() - t0, 2), "from_mib": first, "end_mib": u}
        time.sleep(0.1)
        u = used_mib()


# ---- preflight -------------------------------------------------------------------------------------------------

def py_probe(py) -> dict:
    """What the check's Python imports, and whether its torch sees CUDA."""
    code = ("import importlib, json, sys\nout = {'python': sys.version.split()[0], 'missing': []}\n"
            "for m in %r:\n    try:\n        importlib.import_module(m)\n    except Exception as e:\n"
            "        out['missing'].append('%%s (%%s)' %% (m, e))\n"
            "try:\n    import torch\n    out['torch'] = torch.__version__\n    out['cuda'] = torch.cuda.is_available()\n"
            "    out['torch_cuda'] = torch.version.cuda\nexcept Exception:\n    pass\nprint(json.dumps(out))\n"
            % (PY_MODULES,))
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"missing": ["(the probe failed: %s)" % r.stderr.strip()[-300:]]}


def preflight(args) -> dict:
    """What this machine has; -> facts (with "refusal": the first reason it cannot run, or None). The GPU first:
    without one it refuses at once."""
    nodes = realgpu.find_nodes()
    facts = {"root": os.geteuid() == 0, "gpu_nodes": sorted(list(nodes["gpus"].values()) +
                                                            list(nodes["control"].values())),
             "nvidia_smi": realgpu.find_nvidia_smi(), "driver_lib_dirs": realgpu.driver_lib_dirs(),
             "proxmox": os.path.exists("/etc/pve") or os.path.exists("/usr/sbin/pct"),
             "machine": platform.node(), "kernel": platform.release(), "arch": platform.machine(),
             "refusal": None}
    if not nodes["gpus"] or "nvidiactl" not in nodes["control"] or not facts["nvidia_smi"]:
        facts["refusal"] = ("no NVIDIA GPU here: expected /dev/nvidia<K>, /dev/nvidiactl and nvidia-smi, found %s; "
                            "nvidia-smi: %s. The real-GPU check runs only on a machine with an NVIDIA GPU and its "
                            "driver (never in CI); `--dry-run` shows what it would run"
                            % (", ".join(facts["gpu_nodes"]) or "no device nodes", facts["nvidia_smi"] or "not found"))
    elif not facts["root"]:
        facts["refusal"] = "needs root (the test bed's namespaces and mounts): run it as root"
    elif facts["proxmox"]:
        facts["refusal"] = ("this looks like a Proxmox VE host (/etc/pve or /usr/sbin/pct): the check starts its own "
                            "simulated hosts; run it on a plain GPU machine")
    return facts


def tools_missing() -> list:
    return [t for t in TOOLS if not shutil.which(t)] + ([] if os.access("/usr/sbin/sshd", os.X_OK)
                                                       else ["/usr/sbin/sshd"])


# ---- the run ---------------------------------------------------------------------------------------------------

def check_python():
    return os.environ.get("VPD_GPU_CHECK_PYTHON") or sys.executable


def run_deploy(tb, state, argv, timeout, playbooks):
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(state), NO_COLOR="1",
               DEPLOY_PLAYBOOKS=str(playbooks))
    try:
        p = subprocess.run([check_python(), "-m", "orchestrator.cli", "--json"] + argv, cwd=REPO, env=env,
                           text=True, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return 124, None, "timed out after %d s: %s" % (timeout, err[-800:])
    try:
        out = json.loads(p.stdout)
    except ValueError:
        out = None
    return p.returncode, out, (p.stderr or "")[-3000:]


def write_playbook(dest: Path, gmu: float) -> Path:
    """The check's playbook: qwen36-mtp on pve1/129's one GPU, sized from the target's config (sizing.target_config),
    short GPU timeouts (the check's 8 minutes)."""
    import yaml

    shutil.copytree(REPO / "playbooks", dest)
    data = yaml.safe_load((dest / (BASE_PLAYBOOK + ".yaml")).read_text())
    data["name"] = PLAYBOOK
    data["description"] = "the real-GPU check (issue 55): Qwen3.6-27B + MTP, the torch stand-in, one real GPU"
    data["target"]["gpus"] = [0]
    data["serve"]["tensor_parallel_size"] = 1
    data["serve"]["gpu_memory_utilization"] = gmu
    data["serve"]["load_timeout_s"] = 240
    env = dict(data["serve"].get("env") or {}, **realgpu.driver_env())
    if env:
        data["serve"]["env"] = env
    # the trimmed target config lacks what sizing needs for its linear-attention layers and its dtype: the same
    # TEST INPUTS as tests/unit/test_sizing.py's qwen36_full() (chosen for the arithmetic, not facts of the model)
    cfg = json.loads(TARGET_CONFIG.read_text())
    cfg.setdefault("text_config", cfg).update({k: v for k, v in SIZING_INPUTS.items()
                                               if k not in cfg.get("text_config", cfg)})
    (dest / "gpu-check-target.config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    data["sizing"] = {"target_config": "gpu-check-target.config.json"}
    data["gpu"] = {"free_timeout_s": 30, "stop_grace_s": 5, "free_threshold_mib": 1024}
    (dest / (PLAYBOOK + ".yaml")).write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def sizing_for(playbooks: Path, inventory: str, total_mib: float) -> dict:
    """orchestrator/core/sizing.py's figures for the check's playbook on this card (what the stand-in allocates)."""
    from orchestrator.core import sizing
    from orchestrator.core import spec

    pb = spec.load_playbook(str(playbooks / (PLAYBOOK + ".yaml")), spec.load_inventory(inventory))
    s = sizing.size(sizing.from_playbook(pb, gpu_mib=total_mib))
    return s.as_dict()


def start_holder(argv_prefix, mode, mib, device, seconds=600, env=None):
    p = subprocess.Popen(argv_prefix + [mode, str(mib), device, str(seconds)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True,
                         env=dict(os.environ, **(env or {})))
    line = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        line = p.stdout.readline()
        if line.startswith("held"):
            return p, line.strip()
    raise RuntimeError("the %s holder did not start (exit %s): %s %s" % (mode, p.poll(), line,
                                                                        (p.stderr.read() if p.poll() is not None
                                                                         else "")[-800:]))


def alive(pid) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def run(args, report, out, t_start) -> int:
    from vpd_testbed import Testbed
    from vpd_testbed.scripts import ctl

    sampler = Sampler()
    t = time.monotonic()
    report["gpu"] = facts = gpu_facts()
    report["nvidia_smi_before"] = smi([]).stdout
    total = facts["gpus"][0]["memory_total_mib"] if facts["gpus"] and "memory_total_mib" in facts["gpus"][0] else None
    if not total:
        raise Refused("nvidia-smi %s gave no memory.total for GPU 0: %r" % (" ".join(SMI_QUERY), facts["query_raw"]))
    phase(report, "facts", t)
    t = time.monotonic()
    ngpus = max(realgpu.find_nodes()["gpus"]) + 1
    tb = Testbed(root=args.dir, hosts=1, gpus=ngpus, net=args.net, containers={"pve1": {129: [0]}},
                 options={"pve1": {129: {"gpus": "real"}}})
    if Path(args.dir).exists():
        tb.down()
    try:
        tb.up()
    except TestbedError as e:
        raise Refused("the test bed did not start: %s" % e) from None
    failed = False
    holders = []
    try:
        shutil.rmtree(args.dir + ".playbooks", ignore_errors=True)
        playbooks = write_playbook(Path(args.dir + ".playbooks"), args.gpu_memory_utilization)
        sz = sizing_for(playbooks, tb.inventory_path, total)
        report["sizing"] = {k: sz.get(k) for k in ("verdict", "gpu_total_mib", "budget_mib", "weights_mib",
                                                   "reserve_mib", "kv_cache_mib", "kv_tokens", "max_concurrency")}
        engine = {"engine": "torch", "weights_mib": sz.get("weights_mib"), "kv_cache_mib": sz.get("kv_cache_mib")}
        if args.scale is not None:
            engine["scale"] = args.scale
        realgpu.torch_engine(tb.ctdir("pve1", 129), engine)
        report["engine"] = engine
        shutil.copy(HOLDER, tb.ctdir("pve1", 129) / "root" / "vpd-gpu-holder.py")
        phase(report, "testbed", t)
        state = Path(args.dir + ".state")
        shutil.rmtree(state, ignore_errors=True)
        sampler.start()
        baseline = used_mib()
        report["baseline_mib"] = baseline
        tol = args.tolerance_mib

        def deploy_step(name, dargs, timeout, ok_rc=(0,), after=None, memory_bound=False):
            nonlocal failed
            left = args.deadline - (time.monotonic() - t_start)
            if left < 45:
                raise StopRun("out of time (--deadline %d s) before %s: the steps after it did not run"
                              % (args.deadline, name))
            timeout = int(min(timeout, left - 30))
            checkpoint(report, out, t_start)
            before = used_mib()
            sampler.mark(name)
            t0 = time.monotonic()
            rc, js, err = run_deploy(tb, state, dargs, timeout, playbooks)
            step = {"name": name, "command": "deploy --json " + " ".join(dargs), "rc": rc,
                    "seconds": round(time.monotonic() - t0, 1), "memory_before_mib": before,
                    "memory_after_mib": used_mib()}
            ok = rc in ok_rc if ok_rc else rc != 0  # ok_rc None: a refusal is what is expected
            if js is not None:
                step["json"] = _trim(js)
            if rc:
                step["stderr"] = err[-1500:]
            if after:
                ok = after(step, rc, js) and ok
            step["outcome"] = "ok" if ok else "failed"
            if not ok and memory_bound and args.rehearse:  # the stand-in nvidia-smi's memory never moves
                step["outcome"] = "rehearsal"
                step["note"] = "not as expected, as in every rehearsal: the stand-in nvidia-smi's memory is constant"
            failed = failed or step["outcome"] == "failed"
            report["steps"].append(step)
            say("%s: %s (exit %s) in %.1f s, GPU 0 %s -> %s MiB" % (name, step["outcome"], rc, step["seconds"],
                                                                    before, step["memory_after_mib"]))
            return step

        # 1. prepare --dry-run: the plumbing check reads the real driver version and device nodes
        deploy_step(STEPS[0][0], ["prepare", "pve1/129", "--gpus", "0", "--dry-run"], 120, ok_rc=(0, 1))
        # 2. up
        up = deploy_step(STEPS[1][0], ["up", PLAYBOOK], args.step_timeout)
        up["vllm_log_tail"] = _container_log(tb)
        if up["rc"] != 0:
            raise StopRun("deploy up failed: nothing to restart or compare")
        report["loaded_mib"] = up["memory_after_mib"]
        # 3. status
        deploy_step(STEPS[2][0], ["status"], 90)
        # 4. restart --clean-gpus with a holder in the container that ignores SIGTERM
        pid = tb.init_pid("pve1", 129)
        pre = ctl.enter_argv(pid, ["/root/ml-env/bin/python", "/root/vpd-gpu-holder.py"], "/root")
        hp, line = start_holder(pre, "stubborn", args.hold_mib, "/dev/nvidia0",
                                env=dict({"PATH": ctl.CT_PATH, "HOME": "/root"}, **realgpu.driver_env()))
        holders.append(hp)
        held = re.search(r"held (\d+)", line)
        report["holders"] = [{"where": "pve1/129 (in the container)", "mode": "stubborn", "line": line}]

        def stubborn_gone(step, rc, js):
            step["holder"] = {"line": line, "alive_after": hp.poll() is None}
            return hp.poll() is not None

        deploy_step(STEPS[3][0], ["restart", PLAYBOOK, "--clean-gpus", "-y"], args.step_timeout, after=stubborn_gone)
        # 5. doctor
        deploy_step(STEPS[4][0], ["doctor"], 180)
        # 6. the field report's fuser -k: SIGKILL of everything holding the GPU in the container, release timed
        sampler.mark(STEPS[5][0])
        before = used_mib()
        t0 = time.monotonic()
        r = tb.container_exec("pve1", 129, ["fuser", "-k", "-KILL", "/dev/nvidia0"], timeout=60)
        rel = wait_baseline(baseline, tol, args.release_limit_s)
        step = {"name": STEPS[5][0], "rc": r.returncode, "fuser_output": (r.stdout + r.stderr).strip()[-500:],
                "memory_before_mib": before, "memory_after_mib": rel["end_mib"], "release": rel, "seconds": round(time.monotonic() - t0, 1),
                "outcome": "ok" if rel["back"] else "failed"}
        failed = failed or not rel["back"]
        report["steps"].append(step)
        say("%s: %s; %s MiB back to %s MiB in %.2f s" % (step["name"], step["outcome"], before, rel["end_mib"],
                                                         rel["seconds"]))
        # 7. restart --clean-gpus while a process outside the deployment holds the GPU: refused, the holder lives
        op, oline = start_holder([check_python(), str(HOLDER)], "polite", args.hold_mib, realgpu.find_nodes()["gpus"][0])
        holders.append(op)
        report["holders"].append({"where": "this machine, outside the test bed", "mode": "polite", "line": oline})

        def outside_alive(step, rc, js):
            step["holder"] = {"line": oline, "alive_after": op.poll() is None}
            return op.poll() is None

        deploy_step(STEPS[6][0], ["restart", PLAYBOOK, "--clean-gpus", "-y"], args.step_timeout, ok_rc=None,
                    after=outside_alive, memory_bound=True)
        sampler.mark("outside holder SIGKILLed")
        op.kill()
        op.wait(10)
        report["steps"][-1]["holder_release"] = wait_baseline(baseline, tol, args.release_limit_s)
        # 8. down
        down = deploy_step(STEPS[7][0], ["down", PLAYBOOK], 180)
        down["release"] = wait_baseline(baseline, tol, args.release_limit_s)
        if not down["release"]["back"]:
            down["outcome"] = "failed"
            failed = True
    except StopRun as e:
        report["messages"].append(str(e))
        failed = True
    except Exception as e:  # the report is written whatever happened; the traceback is in it
        import traceback
        report["messages"].append("the check broke: %s\n%s" % (e, traceback.format_exc()[-3000:]))
        failed = True
    finally:
        for hp in holders:
            if hp.poll() is None:
                hp.kill()
        sampler.stop.set()
        sampler.join(5)
        report["release_curve"] = {"every_s": sampler.every, "samples": sampler.samples, "marks": sampler.marks,
                                   "by_step": curve_by_step(sampler.samples, sampler.marks,
                                                            report.get("baseline_mib"), args.tolerance_mib)}
        try:
            report["nvidia_smi_after"] = smi([]).stdout
            report["differences"] = compare_with_fake(tb, report)
        except Exception as e:
            report["messages"].append("comparing with the fake failed: %r" % e)
        if args.keep:
            say("test bed kept up in %s (DEPLOY_INVENTORY=%s)" % (tb.root, tb.inventory_path))
        else:
            tb.down()
        phase(report, "steps", t)
    report["outcome"] = "failed" if failed else "ok"
    return finish(report, out, t_start, 1 if failed else 0)


def curve_by_step(samples, marks, baseline, tol) -> list:
    """Per step (between its mark and the next): GPU 0's highest and lowest MiB, and when (s after the step began)
    it was first back within tol of the baseline: a restart's dip, a kill's release."""
    out = []
    for i, (t0, label) in enumerate(marks):
        t1 = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        seg = [(t, m) for t, m in samples if t0 <= t < t1]
        if not seg:
            continue
        low = [t for t, m in seg if baseline is not None and m <= baseline + tol]
        out.append({"step": label, "start_s": t0, "max_mib": max(m for _, m in seg), "min_mib": min(m for _, m in seg),
                    "first_at_baseline_s": round(low[0] - t0, 2) if low else None, "samples": len(seg)})
    return out


class StopRun(Exception):
    pass


def _trim(js):
    """A deploy --json answer, kept small enough for the report."""
    s = json.dumps(js)
    return js if len(s) < 20000 else {"truncated": s[:20000]}


def _container_log(tb):
    try:
        r = tb.container_exec("pve1", 129, ["sh", "-c", "tail -n 80 /var/lib/vllm-pve-deploy/vllm.log"], timeout=30)
        return r.stdout[-6000:]
    except Exception as e:
        return "unreadable: %r" % e


def compare_with_fake(tb, report) -> list:
    """Every place the tool reads the driver, the real answer beside the fake's (nvidia-smi.fake kept by gpus=real):
    same shape? The report's differences section; each one found is to be fixed in the fake with a contract test."""
    from orchestrator.agent.container.protocol import SMI_MEMORY_ARGS

    diffs = []
    fake = tb.root / "pve1" / "nvidia-smi.fake"
    for a in (list(SMI_MEMORY_ARGS), ["--query-gpu=index,name,uuid,memory.used,memory.total,driver_version",
                                      "--format=csv"], ["-L"], ["--query-compute-apps=pid,used_memory",
                                                               "--format=csv,noheader,nounits"], ["-i", "9"]):
        real = smi(a)
        fk = subprocess.run([str(fake)] + a, capture_output=True, text=True, timeout=30) if fake.exists() else None
        shape = lambda text: [len(ln.split(",")) for ln in text.splitlines()[:2]]  # noqa: E731
        d = {"what": "nvidia-smi " + " ".join(a), "real": (real.stdout + real.stderr).splitlines()[:3],
             "real_rc": real.returncode, "fake": (fk.stdout + fk.stderr).splitlines()[:3] if fk else None,
             "fake_rc": fk.returncode if fk else None}
        d["same"] = bool(fk) and shape(real.stdout) == shape(fk.stdout) and real.returncode == fk.returncode
        diffs.append(d)
    try:
        real_v = Path("/proc/driver/nvidia/version").read_text().splitlines()[:1]
    except OSError as e:
        real_v = ["unreadable: %s" % e]
    from vpd_testbed.scripts.gpusim import DRIVER
    diffs.append({"what": "/proc/driver/nvidia/version (first line)", "real": real_v, "fake": DRIVER,
                  "same": bool(real_v) and DRIVER in real_v[0]})
    # the release: how long the real driver took against the fake's (which frees at once)
    rel = [s.get("release") for s in report.get("steps", []) if s.get("release")]
    diffs.append({"what": "memory back at the baseline after a SIGKILL / a stop (s)", "real": [r["seconds"] for r
                                                                                               in rel],
                  "fake": "at once (the simulator counts open fds)", "same": all(r["seconds"] < 0.5 for r in rel)})
    return diffs


def working_tree_bytes():
    """What travels to the device machine besides the carry: tracked and untracked-not-ignored files."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode:
        return None
    n = 0
    for f in r.stdout.decode(errors="replace").split("\0"):
        if f:
            try:
                n += os.lstat(REPO / f).st_size
            except OSError:
                pass
    return n


def phase(report, name, t0):
    report["phases"][name] = round(time.monotonic() - t0, 1)
    say("phase %s: %.1f s" % (name, report["phases"][name]))


# ---- the report ------------------------------------------------------------------------------------------------

def card_slug(report) -> str:
    g = (report.get("gpu") or {}).get("gpus") or []
    name = g[0].get("name", "") if g else ""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return s or ("dry-run" if report.get("dry_run") else "no-gpu")


def text_report(r) -> str:
    lines = ["vllm-pve-deploy real-GPU check, %s: %s%s" % (r["date"], r["outcome"],
                                                           " (dry run: nothing started)" if r["dry_run"] else "")]
    g = r.get("gpu") or {}
    for x in g.get("gpus", []):
        lines.append("GPU %s: %s, %s MiB; driver %s, CUDA %s" % (x.get("index"), x.get("name"),
                                                                x.get("memory_total_mib"), x.get("driver_version"),
                                                                g.get("cuda_version")))
    if g.get("proc_driver_version"):
        lines.append("/proc/driver/nvidia/version: " + g["proc_driver_version"].splitlines()[0])
    m = r.get("machine") or {}
    py = r.get("python")
    lines.append("machine %s (kernel %s, %s): GPU nodes %s, nvidia-smi %s%s"
                 % (m.get("machine"), m.get("kernel"), m.get("arch"), ", ".join(m.get("gpu_nodes") or []) or "none",
                    m.get("nvidia_smi") or "not found", "; python %s, torch %s (CUDA available: %s)"
                    % (py.get("python"), py.get("torch"), py.get("cuda")) if py else ""))
    c = r.get("carry") or {}
    tree = r.get("working_tree_bytes")
    lines.append(("carries %s (%s)" % (carry.mib(c.get("bytes", 0)), c.get("path")) if c.get("present") else
                  "carries nothing: %s not built (scripts/gpu-check.sh --build-carry)" % c.get("path")) +
                 ("; with the working tree %s, %s of the device tool's 64 MiB" % (carry.mib(tree), carry.mib(
                     tree + c.get("bytes", 0))) if tree is not None else ""))
    for d in r.get("setup", []):
        lines.append("  setup: " + d)
    if r.get("sizing"):
        lines.append("sizing (orchestrator/core/sizing.py, this card): " + json.dumps(r["sizing"]))
    lines.append("phases: " + (", ".join("%s %.1f s" % kv for kv in r["phases"].items()) or "none run"))
    if r.get("baseline_mib") is not None:
        lines.append("baseline: GPU 0 %s MiB used before deploy up; loaded: %s MiB" % (r["baseline_mib"],
                                                                                  r.get("loaded_mib")))
    for s in r["steps"]:
        mem = ""
        if "memory_before_mib" in s or "memory_after_mib" in s:
            mem = "  GPU 0 MiB %s -> %s" % (s.get("memory_before_mib"), s.get("memory_after_mib"))
        lines.append("  %-60s %-8s %s%s" % (s["name"], s["outcome"], ("%.1f s" % s["seconds"]) if "seconds" in s
                                            else "", mem))
        if s.get("outcome") == "planned":
            lines.append("      runs: %s\n      expects: %s" % (s["what"], s["expects"]))
        for key in ("release", "holder_release"):
            if s.get(key):
                lines.append("      %s: back=%s in %.2f s (%s -> %s MiB)" % (key, s[key]["back"], s[key]["seconds"],
                                                                          s[key]["from_mib"], s[key]["end_mib"]))
        if s.get("holder"):
            lines.append("      holder: %s; alive after: %s" % (s["holder"]["line"], s["holder"]["alive_after"]))
        if s.get("stderr") and s.get("outcome") != "ok":
            lines.append("      stderr: %s" % json.dumps(s["stderr"][-600:]))
    curve = (r.get("release_curve") or {}).get("samples") or []
    if curve:
        lines.append("release curve: %d samples every %.1f s, %s .. %s MiB (JSON: release_curve)"
                     % (len(curve), r["release_curve"]["every_s"], min(x[1] for x in curve), max(x[1] for x in curve)))
        for b in r["release_curve"].get("by_step", []):
            lines.append("  %-60s %6s .. %6s MiB; at the baseline %s" % (
                b["step"], b["min_mib"], b["max_mib"], "after %.2f s" % b["first_at_baseline_s"]
                if b["first_at_baseline_s"] is not None else "never"))
    lines.append("differences between the real driver and the fake:")
    if not r.get("differences"):
        lines.append("  (none compared: nothing ran)")
    for d in r.get("differences", []):
        lines.append("  %s %s: real %s | fake %s" % ("same  " if d.get("same") else "DIFFERS", d["what"],
                                                     json.dumps(d.get("real"))[:200], json.dumps(d.get("fake"))[:200]))
    lines += ["note: " + x for x in r["messages"]]
    lines.append("total %.1f s (budget %d s)" % (r["total_s"], r["budget_s"]))
    if r.get("nvidia_smi_before"):
        lines += ["", "nvidia-smi before:", r["nvidia_smi_before"].rstrip()]
    if r.get("nvidia_smi_after"):
        lines += ["", "nvidia-smi after:", r["nvidia_smi_after"].rstrip()]
    return "\n".join(lines) + "\n"


def checkpoint(report, out, t_start):
    """The report so far (outcome "running"), so a run killed from outside still leaves what it did."""
    if out is None or report.get("dry_run"):
        return
    r = dict(report, outcome=report.get("outcome") or "running")
    try:
        finish(r, out, t_start, 0, quiet=True)
    except Exception as e:  # a checkpoint is a courtesy; the final report says what happened
        say("checkpoint not written: %r" % e)


def finish(report, out, t_start, rc, quiet=False) -> int:
    report["total_s"] = round(time.monotonic() - t_start, 1)
    report["within_budget"] = report["total_s"] <= report["budget_s"]
    text = text_report(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = "%s-%s" % (report["date"][:10], card_slug(report))
        (out / (stem + ".json")).write_text(json.dumps(report, indent=1) + "\n")
        (out / (stem + ".txt")).write_text(text)
        if quiet:
            return rc
        say("report: %s/%s.json and .txt (%s, %.1f s)" % (out, stem, report["outcome"], report["total_s"]))
    if report["dry_run"]:
        print(text, end="")
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print every step and what it carries; start nothing")
    ap.add_argument("--rehearse", action="store_true",
                    help="accept a torch without CUDA (stand-in device nodes and nvidia-smi: a rehearsal here)")
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="report folder (default: $OUT where set, else bench/gpu/ for a real run, none for a dry run)")
    ap.add_argument("--carry", default=str(carry.DEFAULT_DEST), help="what travels (bench/gpu/carry.py)")
    ap.add_argument("--dir", default="/tmp/vpd-gpu-check", help="the test bed's state folder")
    ap.add_argument("--net", default=os.environ.get("VPD_TESTBED_NET") or "127.77.240.")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--scale", type=float, default=None,
                    help="multiply the stand-in's allocations (default 1 on CUDA, 1/1024 on a CPU rehearsal)")
    ap.add_argument("--hold-mib", type=int, default=4096, help="GPU memory each holder takes")
    ap.add_argument("--tolerance-mib", type=int, default=256, help="memory 'back at baseline' within this much")
    ap.add_argument("--release-limit-s", type=float, default=60, help="longest wait for memory to come back")
    ap.add_argument("--step-timeout", type=int, default=240, help="longest deploy up / restart")
    ap.add_argument("--keep", action="store_true", help="leave the test bed up at the end (to look around)")
    ap.add_argument("--budget", type=int, default=BUDGET_S, help="seconds the whole run should fit in")
    ap.add_argument("--deadline", type=int, default=510,
                    help="no step starts after this many seconds, and none runs past it (the device tool's command "
                         "limit is 600 s): the report is written either way")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    report = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
              "rehearsal": args.rehearse, "budget_s": args.budget, "outcome": None, "phases": {}, "steps": [],
              "messages": []}
    out = Path(args.out) if args.out else (None if args.dry_run else REPO / "bench" / "gpu")
    facts = preflight(args)
    report["machine"] = facts
    report["carry"] = c = carry.describe(Path(args.carry))
    c.pop("manifest", None)
    if args.dry_run:
        report["working_tree_bytes"] = working_tree_bytes()
        report["outcome"] = "dry-run"
        report["steps"] = [{"name": n, "what": w.replace("HOLD_MIB", "%d MiB" % args.hold_mib), "expects": e,
                            "outcome": "planned"} for n, w, e in STEPS]
        report["steps"].insert(0, {"name": "setup", "outcome": "planned", "expects": "the tools and modules there",
                                   "what": "install what the machine lacks from %s (%s); PYTHONPATH=%s/site"
                                           % (args.carry, ", ".join("%s: %s" % (p, ", ".join(f.values()))
                                                                    for p, f in carry.TOOLS.items()), args.carry)})
        report["steps"].insert(1, {"name": "testbed", "outcome": "planned", "expects": "up in seconds",
                                   "what": "test bed in %s: pve1/129 with gpus=real (the fake vLLM's torch engine), "
                                           "playbook %s from %s (one GPU, TP 1, gmu %.2f), sized by "
                                           "orchestrator/core/sizing.py on the card's memory.total"
                                           % (args.dir, PLAYBOOK, BASE_PLAYBOOK, args.gpu_memory_utilization)})
        if facts["refusal"]:
            report["messages"].append("a real run here would be refused: " + facts["refusal"])
        say("carries %s" % (carry.mib(c["bytes"]) if c["present"] else "nothing: %s not built (--build-carry)"
                            % args.carry))
        return finish(report, out, t_start, 0)
    try:
        if facts["refusal"]:
            raise Refused(facts["refusal"])
        t = time.monotonic()
        if tools_missing() and c["present"]:
            report["setup"] = carry.setup(Path(args.carry))
        missing = tools_missing()
        if missing:
            raise Refused("the test bed needs %s: build the carry here (scripts/gpu-check.sh --build-carry) and let "
                          "it travel, or apt-get install openssh-server openssh-client psmisc iproute2"
                          % ", ".join(missing))
        report["python"] = py = py_probe(check_python())
        if py.get("missing"):
            raise Refused("the check's Python (%s) lacks %s: PYTHONPATH=%s/site (built by --build-carry)"
                          % (check_python(), "; ".join(py["missing"]), args.carry))
        if not py.get("cuda") and not args.rehearse:
            raise Refused("torch %s here sees no CUDA device (torch.cuda.is_available() is False) although "
                          "nvidia-smi answers: a driver/torch mismatch? (--rehearse runs on the CPU)" % py.get("torch"))
        phase(report, "preflight", t)
        return run(args, report, out, t_start)
    except Refused as e:
        say("refused: %s" % e)
        report["outcome"] = "refused"
        report["messages"].append(str(e))
        return finish(report, out if args.out else None, t_start, 2)


if __name__ == "__main__":
    sys.exit(main())
