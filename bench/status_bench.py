#!/usr/bin/env python3
"""Benchmark of `deploy status` against the test bed (numbers, not tests). See bench/README.md.

One run builds its own 8-host test bed (default /tmp/vpd-bench on 127.77.9.x), brings qwen36-mtp up on
container 129 of every host (or leaves them idle with --idle), and prints, side by side, medians of
repeated runs of:

  1. `deploy --json status pve1/129` (the real CLI, a subprocess) vs the raw floor
     `ssh pve1 'pct exec 129 -- nvidia-smi --query-gpu=index,memory.used,memory.total ...'` (OpenSSH);
  2. `deploy --json status` on 8 hosts vs the same raw probe 8-wide (8 ssh processes at once);
  3. the same two with a latency_ms fault (default 50 ms round trip) on every host;
  4. SSH connections and remote execs per host per `deploy status` (audit log and sshd logs);
  5. a `--watch` refresh over kept-open connections (gather() with one Fleet, in-process), 2nd and later
     refreshes vs the first (which connects);
  6. `deploy --version` / `deploy --help` start-up next to `python -c pass`;
  7. the remote CPU of one status row on its host (pct exec + the status exec deploy sends) against the raw
     probe's (pct exec + nvidia-smi), and the agent's own CPU in the container.

With --containers 2 (and e.g. --hosts 24) only the whole-fleet `deploy --json status` with the default deadline
(idle containers) against every container's raw probe at once, and the per-row CPU (issue 54).

and PASS/MISS against the targets of issue 8. deploy (and --baseline) run as a user installs them: a wheel
installed with compiled bytecode, in a venv without the editable install's finder (user_install, user_venv).
The test bed is always torn down (finally + atexit).
Every subprocess has a timeout, and the whole run has a budget (--budget-s).

    sudo /tmp/venv/bin/python bench/status_bench.py            # ~2 min on 2 cores
    sudo /tmp/venv/bin/python bench/status_bench.py --runs 11 --latency-ms 100 --json out.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RAW_PROBE = "nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits"
VMID = 129
CMD_TIMEOUT = 60.0          # any single subprocess
DEADLINE = 30.0             # deploy status --deadline (its per-host deadline; generous: the machine may be loaded)
WATCH_INTERVAL = 0.3        # pause between in-process --watch refreshes (the real --watch N sleeps N s)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str):
        if self.left() <= 0:
            raise SystemExit(f"bench: time budget exhausted before {what}; rerun with fewer --runs or a larger "
                             "--budget-s")


# ---------------------------------------------------------------------------------------------- helpers


DEPLOY: list[str] = []  # main(): the user venv's python and its `deploy` (user_venv)


def deploy_argv(*args) -> list[str]:
    """`deploy` as a user has it (user_venv); which checkout's code runs is the env's PYTHONPATH (user_install)."""
    return [*DEPLOY, *args]


def user_install(src: str, workdir: str, tag: str) -> str:
    """`pip install --no-deps` of a checkout as a user gets it: a wheel (not editable), bytecode compiled at
    install, into workdir/TAG-site (returned: the PYTHONPATH of that variant). An editable install measures worse:
    its finder costs ~10-16 ms in `site`, and where PYTHONDONTWRITEBYTECODE is set every changed module is compiled
    again on each run (+40-75 ms here)."""
    whl, site, tree = (os.path.join(workdir, tag + x) for x in ("-wheel", "-site", "-src"))
    # built from a copy: setuptools leaves build/ and *.egg-info in the tree it builds
    shutil.copytree(src, tree, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", whl, tree], check=True, timeout=600)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                    os.path.join(whl, os.listdir(whl)[0])], check=True, timeout=600)
    return site


def user_venv(workdir: str) -> list[str]:
    """A venv of this Python whose site-packages has only a .pth naming this interpreter's site-packages (the
    dependencies: paramiko, click...; its own .pth files, such as an editable install's finder, are not run)."""
    import sysconfig
    import venv

    root = os.path.join(workdir, "user-venv")
    venv.EnvBuilder(with_pip=False).create(root)
    py = os.path.join(root, "bin", "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    with open(os.path.join(purelib, "deps.pth"), "w") as fh:
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    exe = os.path.join(root, "bin", "deploy")
    with open(exe, "w") as fh:
        fh.write("import sys\nfrom orchestrator.cli import main\nsys.argv[0] = 'deploy'\nsys.exit(main())\n")
    return [py, exe]


def timed(argv, env=None, timeout=CMD_TIMEOUT, ok=(0,)) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO)
    dt = time.perf_counter() - t0
    if ok is not None and p.returncode not in ok:
        raise RuntimeError(f"{argv[:6]}... exited {p.returncode}: {p.stderr.decode(errors='replace')[-800:]}")
    return dt, p


def timed_parallel(argvs, env=None, timeout=CMD_TIMEOUT) -> float:
    """Popen all, wait all (each wait bounded). Returns the wall time until the last one finished."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              cwd=REPO)
             for a in argvs]
    end = t0 + timeout
    bad = []
    for a, p in zip(argvs, procs):
        try:
            out, err = p.communicate(timeout=max(0.1, end - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            bad.append(f"{a[-2]}: timeout")
            continue
        if p.returncode != 0 or len(out.splitlines()) < 1:
            bad.append(f"{a[-2]}: exit {p.returncode} {err.decode(errors='replace')[-300:]}")
    dt = time.perf_counter() - t0
    if bad:
        raise RuntimeError("raw ssh 8-wide failed: " + "; ".join(bad))
    return dt


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_ms(x):
    return f"{x * 1000:7.0f} ms"


class Results:
    def __init__(self):
        self.samples: dict[str, list[float]] = {}
        self.facts: dict = {}

    def add(self, key, dt):
        self.samples.setdefault(key, []).append(dt)

    def m(self, key):
        return med(self.samples.get(key, []))


# ---------------------------------------------------------------------------------------------- phases


def check_status_json(p: subprocess.CompletedProcess, expect_rows: int, expect_running: bool):
    doc = json.loads(p.stdout)
    rows = doc["rows"]
    if len(rows) != expect_rows:
        raise RuntimeError(f"deploy status returned {len(rows)} rows, expected {expect_rows}")
    bad = [f"{r['host']}/{r['vmid']}: {r['problems']}" for r in rows
           if not r["reachable"] or not r["healthy"] or (expect_running and r["process"] != "running")]
    if bad:
        raise RuntimeError("deploy status rows not as expected: " + "; ".join(bad))
    return doc


def pyinfra_argv(tb, hosts, ports, pyinfra, workdir, tag) -> list[str]:
    """pyinfra's `exec` of the raw probe on every host (an inventory file written for the bed; its own SSH,
    paramiko, strict host keys from the bed's known_hosts)."""
    inv = os.path.join(workdir, f"pyinfra-{tag}.py")
    entries = ",\n".join(
        f"    ({tb.address(h)!r}, {{'ssh_port': {ports[h]}, 'ssh_user': 'root', 'ssh_key': {tb.identity_file!r}, "
        f"'ssh_known_hosts_file': {tb.known_hosts!r}, 'ssh_strict_host_key_checking': 'yes'}})" for h in hosts)
    with open(inv, "w") as fh:
        fh.write(f"hosts = [\n{entries},\n]\n")
    return [pyinfra, inv, "exec", "-y", "--", "pct", "exec", str(VMID), "--"] + RAW_PROBE.split()


def bench_pair(tb, res: Results, env, hosts, runs, budget, tag, expect_running, lag: bool, env_old=None,
               pyinfra=None, workdir=None):
    """deploy status (1 host, 8 hosts) vs raw OpenSSH (1, 8-wide), interleaved run by run; with env_old (the
    --baseline checkout) the older deploy too, right before the current one (A/B pairs back to back); with pyinfra
    (its executable) pyinfra's `exec` of the raw probe on all hosts, beside deploy's 8."""
    ports = {h: (tb.lag_port(h) if lag else 2222) for h in hosts}
    pyi = pyinfra_argv(tb, hosts, ports, pyinfra, workdir, tag) if pyinfra else None
    if pyi:
        timed(pyi, env=env)  # warm-up
    raw1 = tb.ssh_argv(hosts[0], f"pct exec {VMID} -- {RAW_PROBE}", port=ports[hosts[0]])
    # context only: OpenSSH 9.x defaults to sntrup761x25519 key exchange (CPU-heavy); paramiko gets curve25519
    raw1k = raw1[:1] + ["-o", "KexAlgorithms=curve25519-sha256"] + raw1[1:]
    rawn = [tb.ssh_argv(h, f"pct exec {VMID} -- {RAW_PROBE}", port=ports[h]) for h in hosts]
    dep1 = deploy_argv("--json", "status", f"{hosts[0]}/{VMID}", "--deadline", str(DEADLINE))
    depn = deploy_argv("--json", "status", "--deadline", str(DEADLINE))
    # warm-up: page cache, sshd's first fork, the lagproxy's first accept
    for argv in (raw1, dep1):
        timed(argv, env=env)
    timed(depn, env=env)
    timed_parallel(rawn, env=env)
    if env_old is not None:
        timed(dep1, env=env_old)
        timed(depn, env=env_old)
    for i in range(runs):
        budget.check(f"{tag} run {i + 1}")
        dt, _ = timed(raw1, env=env)
        res.add(f"{tag}:raw1", dt)
        res.add(f"{tag}:raw1_curve25519", timed(raw1k, env=env)[0])
        if env_old is not None:
            dt, p = timed(dep1, env=env_old)
            check_status_json(p, 1, expect_running)
            res.add(f"{tag}:old_deploy1", dt)
        dt, p = timed(dep1, env=env)
        check_status_json(p, 1, expect_running)
        res.add(f"{tag}:deploy1", dt)
        res.add(f"{tag}:deploy1_self", json.loads(p.stdout)["seconds"])
        res.add(f"{tag}:rawN", timed_parallel(rawn, env=env))
        if env_old is not None:
            dt, p = timed(depn, env=env_old)
            check_status_json(p, len(hosts), expect_running)
            res.add(f"{tag}:old_deployN", dt)
        dt, p = timed(depn, env=env)
        check_status_json(p, len(hosts), expect_running)
        res.add(f"{tag}:deployN", dt)
        res.add(f"{tag}:deployN_self", json.loads(p.stdout)["seconds"])
        if pyi:
            res.add(f"{tag}:pyinfraN", timed(pyi, env=env)[0])


def count_per_status(tb, env, hosts, state_dir, tag, res: Results):
    """One `deploy status` over all hosts: connections and execs per host, from the audit log and sshd.log."""
    audit = os.path.join(state_dir, "audit.jsonl")
    a0 = os.path.getsize(audit) if os.path.exists(audit) else 0
    s0 = {h: os.path.getsize(tb.root / h / "sshd.log") for h in hosts}
    _, p = timed(deploy_argv("--json", "status", "--deadline", str(DEADLINE)), env=env)
    inv_id = None
    per = {h: {"audit_connect": 0, "audit_exec": 0, "sshd_accepted": 0, "sshd_sessions": 0, "containers": 0}
           for h in hosts}
    for r in json.loads(p.stdout)["rows"]:
        per[r["host"]]["containers"] += 1
    time.sleep(0.2)  # sshd writes "Starting session" before the exec, but give the log a moment to land
    with open(audit, "rb") as fh:
        fh.seek(a0)
        for line in fh.read().decode().splitlines():
            e = json.loads(line)
            inv_id = inv_id or e.get("invocation")
            if e.get("invocation") != inv_id or e.get("host") not in per:
                continue
            if e.get("event") == "connect":
                per[e["host"]]["audit_connect"] += 1
            if "argv" in e:
                per[e["host"]]["audit_exec"] += 1
    for h in hosts:
        with open(tb.root / h / "sshd.log", "rb") as fh:
            fh.seek(s0[h])
            text = fh.read().decode(errors="replace")
        per[h]["sshd_accepted"] = len(re.findall(r"^Accepted publickey for ", text, re.M))
        per[h]["sshd_sessions"] = len(re.findall(r"^Starting session: ", text, re.M))
    res.facts[f"{tag}:counts"] = per
    return per


def bench_watch(inv_path, hosts_scope, refreshes, budget, tag, res: Results):
    """A --watch loop in-process, as run_status does it: one Fleet, gather(), open_spares(), pause; again.
    The 1st refresh connects, the rest reuse the connections. Only gather() is timed."""
    from orchestrator.core.remote import Fleet
    from orchestrator.core.spec import load_inventory
    from orchestrator.observe.status import Sampler, gather, resolve_targets

    inv = load_inventory(inv_path)
    sampler = Sampler(persist=False)
    times = []
    with Fleet(inv) as fleet:
        for i in range(refreshes):
            budget.check(f"{tag} refresh {i + 1}")
            t0 = time.perf_counter()
            rows = gather(inv, hosts_scope, fleet, deadline=DEADLINE, sampler=sampler)
            times.append(time.perf_counter() - t0)
            fleet.open_spares()  # what run_status does between --watch refreshes
            time.sleep(WATCH_INTERVAL)
            if len(rows) != len(resolve_targets(inv, hosts_scope)) or not all(r["healthy"] for r in rows):
                raise RuntimeError(f"watch refresh {i + 1}: {[r['problems'] for r in rows]}")
        conns = {h: s.connects for h, s in fleet._sessions.items()}
    res.samples[f"{tag}:first"] = times[:1]
    res.samples[f"{tag}:later"] = times[1:]
    res.facts[f"{tag}:connects"] = conns


def bench_startup(res: Results, env, runs, budget):
    cmds = {
        "python -c pass": [DEPLOY[0], "-c", "pass"],
        "python -c 'import paramiko'": [DEPLOY[0], "-c", "import paramiko"],
        "deploy --version": deploy_argv("--version"),
        "deploy --help": deploy_argv("--help"),
        "deploy status --help": deploy_argv("status", "--help"),
    }
    for argv in cmds.values():
        timed(argv, env=env)
    for i in range(runs):
        budget.check(f"startup run {i + 1}")
        for name, argv in cmds.items():
            dt, _ = timed(argv, env=env)
            res.add(f"startup:{name}", dt)
    return list(cmds)


# ---------------------------------------------------------------------------------------------- main


AGENT_CPU = ("import atexit, resource, sys\n"
             "atexit.register(lambda: sys.stderr.write('AGENT_CPU %f\\n' % sum(resource.getrusage("
             "resource.RUSAGE_SELF)[:2])))\n")


def agent_stdin_of(env, state_dir) -> bytes:
    """What `deploy status` sends for one container, built by the deploy in env (current, or --baseline)."""
    code = ("import sys, inspect\nfrom orchestrator.agent import agent_stdin\nfrom orchestrator.observe.status import FATAL_BULK\n"
            "kw = {}\n"
            "if 'cache_dir' in inspect.signature(agent_stdin).parameters:\n"
            "    from orchestrator.agent import archive\n"
            "    kw = dict(cache_dir=archive.cache_dir(%r), inline=False)\n"
            "if 'early_smi' in inspect.signature(agent_stdin).parameters:\n"
            "    kw['early_smi'] = True\n"
            "sys.stdout.buffer.write(agent_stdin(None, None, FATAL_BULK, **kw))\n" % state_dir)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True, timeout=60,
                          cwd="/").stdout


def bench_agent_cpu(tb, res: Results, env, env_old, host, python, state_dir, runs, budget):
    """The agent's own CPU per status exec in the container (no SSH, no pct: Testbed.container_exec), the
    process's RUSAGE_SELF at exit: interpreter start-up, bootstrap, imports, the action; nvidia-smi (a child) not
    counted. Current and --baseline interleaved; `python -c pass` for scale."""
    args = json.dumps({"nvidia_smi_timeout_s": 5, "state_dir": state_dir}, sort_keys=True, separators=(",", ":"))
    from orchestrator.agent.call import agent_argv

    flags = agent_argv(python, "status", {}, one_shot=True)[1:-3]  # what deploy status runs (-I -S since issue 23)
    variants = [("new", flags, AGENT_CPU.encode() + agent_stdin_of(env, state_dir))]
    if env_old is not None:
        variants.append(("old", [], AGENT_CPU.encode() + agent_stdin_of(env_old, state_dir)))
    variants.append(("pass", flags, AGENT_CPU.encode()))
    res.facts["agent_flags"] = flags
    res.facts["agent_stdin_bytes"] = {k: len(v) - len(AGENT_CPU) for k, _, v in variants}
    for i in range(runs + 1):  # the first round is a warm-up
        budget.check(f"agent cpu run {i + 1}")
        for name, fl, stdin in variants:
            p = tb.container_exec(host, VMID, [python, *fl, "-", "status", args], input=stdin, text=False, timeout=60)
            m = re.search(rb"AGENT_CPU ([0-9.]+)", p.stderr)
            if not m or (name != "pass" and b'"result"' not in p.stdout):
                raise RuntimeError(f"agent cpu ({name}): exit {p.returncode}: {p.stderr[-500:]!r} {p.stdout[-300:]!r}")
            if i:
                res.add(f"agent_cpu:{name}", float(m.group(1)))


ROW_ARGV = ("import json, sys\nfrom orchestrator.agent import archive\nfrom orchestrator.agent.call import agent_argv, "
            "agent_stdin\nfrom orchestrator.observe.status import FATAL_BULK\nsd, py = sys.argv[1], sys.argv[2]\n"
            "args = {'state_dir': sd, 'nvidia_smi_timeout_s': 5, 'plumbing': True}\n"
            "prog = agent_stdin(None, None, FATAL_BULK, cache_dir=archive.cache_dir(sd), inline=False,\n"
            "                   early_smi=True)\n"
            "print(json.dumps(agent_argv(py, 'status', args, one_shot=True, program=prog.decode())))\n")


def row_argv_of(env, state_dir, python) -> list[str]:
    """The argv `deploy status` runs in the container for one row (the agent program on the command line, its
    archive cached there), built by the deploy in env (current, or --baseline)."""
    out = subprocess.run([sys.executable, "-c", ROW_ARGV, state_dir, python], env=env, capture_output=True,
                         check=True, timeout=60, cwd="/").stdout
    return json.loads(out)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def bench_row_cpu(tb, res: Results, env, env_old, host, python, state_dir, runs, budget):
    """The remote CPU of one status row on its host, no SSH (Testbed.host_exec): `pct exec 129 -- <the status
    exec deploy sends>` (pct, the agent, its nvidia-smi) vs the raw probe `pct exec 129 -- nvidia-smi ...`, as
    RUSAGE_CHILDREN of this process around each (every process there is waited for by its parent). Current,
    --baseline and raw interleaved; the first two rounds are warm-ups (the first runs from the archive and compiles
    it for the container's Python in the background), after a `deploy status` of each (the archive reaches it)."""
    for e in [env] + ([env_old] if env_old is not None else []):
        timed(deploy_argv("--json", "status", f"{host}/{VMID}"), env=e, ok=None, timeout=120)
    variants = [("new", ["pct", "exec", str(VMID), "--", *row_argv_of(env, state_dir, python)])]
    if env_old is not None:
        variants.append(("old", ["pct", "exec", str(VMID), "--", *row_argv_of(env_old, state_dir, python)]))
    variants.append(("raw", ["pct", "exec", str(VMID), "--", *RAW_PROBE.split()]))
    for i in range(runs + 2):
        budget.check(f"row cpu run {i + 1}")
        for name, argv in variants:
            c0 = children_cpu()
            p = tb.host_exec(host, argv, timeout=60)
            c1 = children_cpu()
            if p.returncode or (name != "raw" and '"result"' not in p.stdout):
                raise RuntimeError(f"row cpu ({name}): exit {p.returncode}: {p.stderr[-500:]!r} {p.stdout[-300:]!r}")
            if i > 1:
                res.add(f"row_cpu:{name}", c1 - c0)


def bench_fleet(tb, res: Results, env, env_old, hosts, vmids, runs, budget):
    """`deploy --json status` over the whole bed with the default deadline (no --deadline), as a user runs it:
    its wall time, exit status and rows that timed out, beside every container's raw probe at once (one OpenSSH
    process per container). Current and --baseline interleaved."""
    dep = deploy_argv("--json", "status")
    raw = [tb.ssh_argv(h, f"pct exec {v} -- {RAW_PROBE}") for h in hosts for v in vmids]
    variants = [("new", env)] + ([("old", env_old)] if env_old is not None else [])
    for _, e in variants:  # warm-up (the archive reaches every container)
        timed(dep, env=e, ok=None, timeout=120)
    for i in range(runs):
        budget.check(f"fleet run {i + 1}")
        res.add("fleet:raw", timed_parallel(raw, env=env, timeout=120))
        for name, e in variants:
            dt, p = timed(dep, env=e, ok=None, timeout=120)
            try:
                rows = json.loads(p.stdout)["rows"]
            except ValueError:
                rows = []
            late = [f"{r['host']}/{r['vmid']}" for r in rows if not r.get("reachable")]
            res.add(f"fleet:{name}", dt)
            res.add(f"fleet:{name}:exit", p.returncode)
            res.add(f"fleet:{name}:late_rows", len(late))
            res.facts.setdefault(f"fleet:{name}:late_examples", late[:5])


def bench_up(tb, res: Results, env, env_old, runs, budget):
    """`deploy --json up qwen36-mtp` on pve1 (after a down), current and --baseline in turn: its wall time minus
    what it waits for (verify, vLLM's load in wait-ready, the acceptance probe) is deploy's own overhead."""
    variants = [("new", env)] + ([("old", env_old)] if env_old is not None else [])
    for i in range(runs):
        for name, e in variants:
            budget.check(f"up run {i + 1}")
            timed(deploy_argv("down", "qwen36-mtp", "-y"), env=e, timeout=180)
            dt, p = timed(deploy_argv("--json", "up", "qwen36-mtp", "-y"), env=e, timeout=180)
            doc = json.loads(p.stdout)
            info = doc.get("info") or {}
            phases = info.get("phases_s") or {r["step"]: r["seconds"] for r in doc.get("steps", [])}
            waits = sum(phases.get(k, 0) for k in ("verify", "wait-ready", "acceptance"))
            res.add(f"up:{name}:wall", dt)
            res.add(f"up:{name}:waits", waits)
            res.add(f"up:{name}:overhead", dt - waits)


def machine() -> dict:
    model = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "kernel": platform.release(), "load_avg_at_start": os.getloadavg()}


def deploy_everywhere(tb, env, hosts, workdir, budget):
    """`deploy up qwen36-mtp` on pve1 (the shipped playbook) and copies of it retargeted at pve2..pveN."""
    src = os.path.join(REPO, "playbooks", "qwen36-mtp.yaml")
    text = open(src).read()
    argvs = [deploy_argv("up", "qwen36-mtp", "-y")]
    if not os.path.exists(os.path.join(workdir, "targets")):  # sizing.target_config, relative to the copies
        os.symlink(os.path.join(REPO, "playbooks", "targets"), os.path.join(workdir, "targets"))
    for h in hosts[1:]:
        p = os.path.join(workdir, f"qwen36-mtp-{h}.yaml")
        with open(p, "w") as fh:
            fh.write(re.sub(r"(?m)^(\s+host:\s*)pve1\s*$", rf"\g<1>{h}", text))
        argvs.append(deploy_argv("up", p, "-y"))
    # two at a time: 2 cores, and the fake vLLM's startup is CPU-bound
    with ThreadPoolExecutor(max_workers=2) as ex:
        futs = [ex.submit(timed, a, env, min(180.0, max(10.0, budget.left()))) for a in argvs]
        for f in futs:
            f.result()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/vpd-bench", help="test bed state directory (its own, not /tmp/vpd-testbed)")
    ap.add_argument("--net", default="127.77.9.", help="loopback /24 for the bed's hosts")
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--containers", type=int, default=1, help="containers per host (129, 130, ...); more than 1: "
                    "the fleet phase only, idle (issue 54's 24-host / 48-container check: --hosts 24 --containers 2)")
    ap.add_argument("--runs", type=int, default=7, help="repetitions per measurement (medians are printed)")
    ap.add_argument("--latency-ms", type=int, default=50, help="round trip added in phase 3")
    ap.add_argument("--idle", action="store_true", help="do not deploy; containers idle (no vLLM)")
    ap.add_argument("--budget-s", type=float, default=900, help="abort (and tear down) after this long")
    ap.add_argument("--json", metavar="PATH", help="also write every sample here")
    ap.add_argument("--baseline", metavar="DIR", help="an older checkout (e.g. git archive REV | tar -x -C DIR): its "
                    "deploy runs right before the current one in every pair, side by side in the report")
    ap.add_argument("--up-runs", type=int, default=3, help="deploy up runs (each variant) for its own overhead")
    ap.add_argument("--no-watch", action="store_true", help="skip the in-process --watch phases")
    ap.add_argument("--row-cpu-only", action="store_true", help="only the per-row remote CPU phase (with --hosts 1: "
                    "a quick A/B of the agent's cost per row, issue 54)")
    ap.add_argument("--pyinfra", metavar="EXE", help="pyinfra's executable (in a venv of its own, e.g. python3 -m venv "
                    "/tmp/pyinfra-venv && /tmp/pyinfra-venv/bin/pip install pyinfra): time its `exec` of the raw "
                    "probe on all hosts beside deploy status")
    a = ap.parse_args()
    fleet_only = a.containers > 1
    if fleet_only:
        a.idle = True
    if not a.net.startswith("127."):
        raise SystemExit("bench: --net must be in 127.0.0.0/8")
    if os.path.realpath(a.root) == "/tmp/vpd-testbed":
        raise SystemExit("bench: use your own --root, not the demo test bed's")

    from vpd_testbed import Testbed

    budget = Budget(a.budget_s)
    res = Results()
    res.facts["machine"] = machine()
    workdir = tempfile.mkdtemp(prefix="vpd-bench-work-")
    state_dir = os.path.join(workdir, "state")
    os.makedirs(state_dir)
    vmids = [VMID + i for i in range(a.containers)]
    tb = Testbed(root=a.root, hosts=a.hosts, containers=vmids, gpus=4, net=a.net)
    torn = []

    def teardown():
        if torn:
            return
        torn.append(1)
        try:
            tb.down()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    atexit.register(teardown)
    hosts = tb.hosts
    # deploy as a user runs it: installed from a wheel, compiled, in a venv without an editable install's finder
    print("installing this checkout (and --baseline) as a user would: pip wheel + install --no-deps ...", flush=True)
    DEPLOY[:] = user_venv(workdir)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=state_dir, NO_COLOR="1",
               PYTHONPATH=user_install(REPO, workdir, "current"))
    env.pop("DEPLOY_VERBOSE", None)
    env_old = None
    if a.baseline:
        env_old = dict(env, PYTHONPATH=user_install(os.path.abspath(a.baseline), workdir, "baseline"))
    os.environ["DEPLOY_STATE_DIR"] = state_dir  # the in-process --watch phase
    os.chdir(REPO)
    try:
        t0 = time.monotonic()
        tb.up()
        print(f"test bed up: {a.hosts} hosts on {a.net}x in {a.root} ({time.monotonic() - t0:.2f}s)", flush=True)
        running = not a.idle
        if running:
            t0 = time.monotonic()
            deploy_everywhere(tb, env, hosts, workdir, budget)
            print(f"qwen36-mtp up on {VMID} of {len(hosts)} hosts ({time.monotonic() - t0:.1f}s)", flush=True)
        res.facts["containers"] = "running qwen36-mtp (fake vLLM)" if running else "idle (no vLLM)"
        if a.row_cpu_only:
            print("per-row remote CPU (pct exec + the status exec vs pct exec + nvidia-smi) ...", flush=True)
            bench_row_cpu(tb, res, env, env_old, hosts[0], "/root/ml-env/bin/python", "/var/lib/vllm-pve-deploy",
                          a.runs, budget)
        elif fleet_only:
            print(f"fleet: {len(hosts)} hosts x {len(vmids)} containers, default deadline ...", flush=True)
            bench_fleet(tb, res, env, env_old, hosts, vmids, a.runs, budget)
            print("per-row remote CPU (pct exec + the status exec vs pct exec + nvidia-smi) ...", flush=True)
            bench_row_cpu(tb, res, env, env_old, hosts[0], "/root/ml-env/bin/python", "/var/lib/vllm-pve-deploy",
                          a.runs, budget)

        if not fleet_only and not a.row_cpu_only:
            print("startup ...", flush=True)
            startup_names = bench_startup(res, env, a.runs, budget)
            print("no added latency ...", flush=True)
            bench_pair(tb, res, env, hosts, a.runs, budget, "lan", running, lag=False, env_old=env_old,
                       pyinfra=a.pyinfra, workdir=workdir)
            count_per_status(tb, env, hosts, state_dir, "lan", res)
            print("per-row remote CPU (pct exec + the status exec vs pct exec + nvidia-smi) ...", flush=True)
            bench_row_cpu(tb, res, env, env_old, hosts[0], "/root/ml-env/bin/python", "/var/lib/vllm-pve-deploy",
                          a.runs, budget)
            print("agent CPU per status exec in the container ...", flush=True)
            bench_agent_cpu(tb, res, env, env_old, hosts[0], "/root/ml-env/bin/python", "/var/lib/vllm-pve-deploy",
                            a.runs, budget)
            if not a.no_watch:
                bench_watch(tb.inventory_path, [f"{hosts[0]}/{VMID}"], a.runs + 1, budget, "watch1:lan", res)
                bench_watch(tb.inventory_path, [], a.runs + 1, budget, "watchN:lan", res)
            if running and a.up_runs:
                print("deploy up's own overhead ...", flush=True)
                bench_up(tb, res, env, env_old, a.up_runs, budget)

            print(f"latency {a.latency_ms} ms round trip on every host ...", flush=True)
            for h in hosts:
                tb.set_fault(h, None, "latency_ms", a.latency_ms)
            bench_pair(tb, res, env, hosts, a.runs, budget, "wan", running, lag=True, env_old=env_old,
                       pyinfra=a.pyinfra, workdir=workdir)
            count_per_status(tb, env, hosts, state_dir, "wan", res)
            if not a.no_watch:
                bench_watch(tb.inventory_path, [f"{hosts[0]}/{VMID}"], a.runs + 1, budget, "watch1:wan", res)
                bench_watch(tb.inventory_path, [], a.runs + 1, budget, "watchN:wan", res)
    finally:
        teardown()

    if a.row_cpu_only:
        print()
        print_machine(res, a)
        print(f"containers: {res.facts['containers']}; medians of {a.runs} runs"
              + (f"; baseline: {a.baseline}" if a.baseline else ""))
        print_row_cpu(res, a)
    elif fleet_only:
        report_fleet(res, a, hosts, vmids)
    else:
        report(res, a, hosts, startup_names)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"samples": res.samples, "facts": res.facts, "args": vars(a)}, fh, indent=1)


def print_machine(res: Results, a):
    mc = res.facts["machine"]
    print(f"machine: nproc={mc['nproc']}  cpu={mc['cpu']}  python={mc['python']}  kernel={mc['kernel']}")
    la0, la1 = mc["load_avg_at_start"], os.getloadavg()
    print(f"load average (1/5/15 min) at start {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f}, at end "
          f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} (other work on the machine skews every number)")


def print_row_cpu(res: Results, a):
    m = res.m
    raw = m("row_cpu:raw")
    print("remote CPU per status row on its host (pct exec + the status exec, or pct exec + nvidia-smi; "
          "RUSAGE_CHILDREN):")
    print(f"  raw probe (pct exec 129 -- nvidia-smi ...)   {raw * 1000:6.1f} ms")
    if a.baseline:
        print(f"  baseline deploy's status exec                {m('row_cpu:old') * 1000:6.1f} ms   "
              f"{m('row_cpu:old') / raw:.2f}x raw")
    print(f"  this deploy's status exec                    {m('row_cpu:new') * 1000:6.1f} ms   "
          f"{m('row_cpu:new') / raw:.2f}x raw")


def report_fleet(res: Results, a, hosts, vmids):
    """--containers > 1: the whole-fleet status with the default deadline, and the per-row CPU."""
    m = res.m
    print()
    print_machine(res, a)
    print(f"containers: {len(hosts)} hosts x {len(vmids)} = {len(hosts) * len(vmids)} rows, idle (no vLLM); "
          f"medians of {a.runs} runs" + (f"; baseline: {a.baseline}" if a.baseline else ""))
    print()
    print(f"  raw OpenSSH, every container's probe at once   {fmt_ms(m('fleet:raw'))}")
    for name in (["old"] if a.baseline else []) + ["new"]:
        ex = res.samples.get(f"fleet:{name}:exit", [])
        late = res.samples.get(f"fleet:{name}:late_rows", [])
        print(f"  {'baseline' if name == 'old' else 'this deploy':12} deploy --json status (default deadline)  "
              f"{fmt_ms(m(f'fleet:{name}'))}  {m(f'fleet:{name}') / m('fleet:raw'):.2f}x raw; exit statuses "
              f"{sorted(set(int(x) for x in ex))}, rows not answered per run {[int(x) for x in late]} "
              f"{res.facts.get(f'fleet:{name}:late_examples') or ''}")
    print()
    print_row_cpu(res, a)
    print()
    ok = all(int(x) == 0 for x in res.samples.get("fleet:new:exit", [1]))
    print(f"  {'PASS' if ok else 'MISS'}  {len(hosts)} hosts / {len(hosts) * len(vmids)} containers: deploy status "
          "exits 0 inside the default deadline in every run")
    print(f"  {'PASS' if m('row_cpu:new') <= 1.5 * m('row_cpu:raw') else 'MISS'}  per-row remote CPU at most 1.5x "
          f"raw's: {m('row_cpu:new') / m('row_cpu:raw'):.2f}x")


def report(res: Results, a, hosts, startup_names):
    m = res.m
    n = len(hosts)
    mc = res.facts["machine"]
    rtt = a.latency_ms / 1000
    old = bool(a.baseline)
    print()
    print(f"machine: nproc={mc['nproc']}  cpu={mc['cpu']}  python={mc['python']}  kernel={mc['kernel']}")
    print(f"containers: {res.facts['containers']}; medians of {a.runs} runs; latency phase +{a.latency_ms} ms RTT"
          + (f"; baseline: {a.baseline}" if old else ""))
    la0, la1 = mc["load_avg_at_start"], os.getloadavg()
    print(f"load average (1/5/15 min) at start {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f}, at end "
          f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} (other work on the machine skews every number)")
    print()
    head = f"{'':34}{'raw OpenSSH':>13}" + (f"{'baseline':>11}{'ratio':>8}" if old else "") + \
        f"{'deploy':>10}{'ratio':>8}   (deploy's own 'seconds')"
    print(head)
    for tag, label in (("lan", "no added latency"), ("wan", f"+{a.latency_ms} ms RTT")):
        for k, what in (("1", "1 host"), ("N", f"{n} hosts (raw {n}-wide)")):
            d, r = m(f"{tag}:deploy{k}"), m(f"{tag}:raw{k}")
            cells = f"{fmt_ms(r):>13}"
            if old:
                o = m(f"{tag}:old_deploy{k}")
                cells += f"{fmt_ms(o):>11}{o / r:7.2f}x"
            print(f"  {what + ', ' + label:32}{cells}{fmt_ms(d):>10}{d / r:7.2f}x   "
                  f"({fmt_ms(m(f'{tag}:deploy{k}_self')).strip()} in gather)")
    for tag, label in (("lan", "no added latency"), ("wan", f"+{a.latency_ms} ms RTT")):
        py = m(f"{tag}:pyinfraN")
        if py == py:
            print(f"  ({n} hosts, {label}: pyinfra `exec` of the raw probe {fmt_ms(py).strip()}; deploy status/that = "
                  f"{m(f'{tag}:deployN') / py:.2f}x)")
    for tag, label in (("lan", "no added latency"), ("wan", f"+{a.latency_ms} ms RTT")):
        print(f"  (raw 1 host with -o KexAlgorithms=curve25519-sha256, paramiko's kex, {label}: "
              f"{fmt_ms(m(f'{tag}:raw1_curve25519')).strip()}; deploy/that = "
              f"{m(f'{tag}:deploy1') / m(f'{tag}:raw1_curve25519'):.2f}x)")
    print()
    print("connections / execs per host per `deploy status` (audit: connect events / argv lines; "
          "sshd.log: Accepted publickey / Starting session):")
    counts_ok = True
    for tag in ("lan", "wan"):
        per = res.facts[f"{tag}:counts"]
        cells = sorted({(v["audit_connect"], v["audit_exec"], v["sshd_accepted"], v["sshd_sessions"], v["containers"])
                        for v in per.values()})
        for c in cells:
            hs = [h for h, v in per.items() if (v["audit_connect"], v["audit_exec"], v["sshd_accepted"],
                                                 v["sshd_sessions"], v["containers"]) == c]
            print(f"  {tag}: {len(hs)} host(s) with {c[4]} container(s): audit {c[0]} connect / {c[1]} exec, "
                  f"sshd {c[2]} accepted / {c[3]} sessions")
            counts_ok &= c[0] == 1 and c[2] == 1 and c[1] == c[4] and c[3] == c[4]
    print()
    cpu_new, cpu_old, cpu_pass = m("agent_cpu:new"), m("agent_cpu:old"), m("agent_cpu:pass")
    sizes = res.facts.get("agent_stdin_bytes", {})
    print("agent CPU per status exec in the container (RUSAGE_SELF at exit: start-up + agent; nvidia-smi not counted):")
    print(f"  python {' '.join(res.facts.get('agent_flags') or [])} -c pass (same stdin prefix)   {cpu_pass * 1000:6.1f} ms")
    if old:
        print(f"  baseline agent                      {cpu_old * 1000:6.1f} ms   (+{(cpu_old - cpu_pass) * 1000:.1f} ms "
              f"over bare Python; stdin {sizes.get('old', 0):,} bytes)")
    print(f"  this agent (archive cached)         {cpu_new * 1000:6.1f} ms   (+{(cpu_new - cpu_pass) * 1000:.1f} ms "
          f"over bare Python; stdin {sizes.get('new', 0):,} bytes)")
    print()
    print_row_cpu(res, a)
    if m("up:new:wall") == m("up:new:wall"):
        print()
        print("deploy up qwen36-mtp (after a down): wall, what it waits for (verify + wait-ready + acceptance), "
              "its own overhead")
        for name in (["old"] if old else []) + ["new"]:
            print(f"  {'baseline' if name == 'old' else 'this deploy':12}  wall {fmt_ms(m(f'up:{name}:wall'))}  "
                  f"waits {fmt_ms(m(f'up:{name}:waits'))}  own {fmt_ms(m(f'up:{name}:overhead'))}")
    if not a.no_watch:
        print()
        print(f"{'--watch refresh (in-process, one Fleet)':42}{'1st (connects)':>16}{'2nd+ (median)':>16}")
        for tag, label in (("watch1:lan", "1 host"), ("watchN:lan", f"{n} hosts"),
                           ("watch1:wan", f"1 host, +{a.latency_ms} ms"),
                           ("watchN:wan", f"{n} hosts, +{a.latency_ms} ms")):
            print(f"  {label:40}{fmt_ms(m(tag + ':first')):>16}{fmt_ms(m(tag + ':later')):>16}")
        extra1 = (m("watch1:wan:later") - m("watch1:lan:later")) / rtt
        extraN = (m("watchN:wan:later") - m("watchN:lan:later")) / rtt
        print(f"  latency cost of a kept-open refresh: {extra1:.1f} RTT (1 host), {extraN:.1f} RTT ({n} hosts in "
              "parallel)")
    print()
    print("start-up (same interpreter):")
    base = m("startup:python -c pass")
    for name in startup_names:
        v = m(f"startup:{name}")
        print(f"  {name:32}{fmt_ms(v):>12}   (+{(v - base) * 1000:.0f} ms over python -c pass)")
    print()
    targets = [
        ("1 host, LAN: at most 1.3x raw OpenSSH", m("lan:deploy1") <= 1.3 * m("lan:raw1"),
         f"{m('lan:deploy1') / m('lan:raw1'):.2f}x"),
        (f"1 host, +{a.latency_ms} ms RTT: at most 1.1x raw OpenSSH", m("wan:deploy1") <= 1.1 * m("wan:raw1"),
         f"{m('wan:deploy1') / m('wan:raw1'):.2f}x"),
        (f"{n} hosts: at most 1.0x raw OpenSSH {n}-wide (no added latency)", m("lan:deployN") <= m("lan:rawN"),
         f"{m('lan:deployN') / m('lan:rawN'):.2f}x"),
        (f"{n} hosts, +{a.latency_ms} ms RTT: at most 1.0x raw OpenSSH {n}-wide",
         m("wan:deployN") <= m("wan:rawN"), f"{m('wan:deployN') / m('wan:rawN'):.2f}x"),
        ("the agent's CPU per status exec at most 25 ms", cpu_new <= 0.025, f"{cpu_new * 1000:.1f} ms"),
        ("exactly 1 connection and 1 exec per container", counts_ok, "see counts above"),
    ]
    if m("lan:pyinfraN") == m("lan:pyinfraN"):
        targets.append((f"{n} hosts: at most 0.8x pyinfra's exec of the same probe", m("lan:deployN") <= 0.8 * m(
            "lan:pyinfraN"), f"{m('lan:deployN') / m('lan:pyinfraN'):.2f}x"))
    if m("up:new:overhead") == m("up:new:overhead"):
        targets.append(("deploy up's own overhead at most 1 s", m("up:new:overhead") <= 1.0,
                        f"{m('up:new:overhead'):.2f} s"))
    print("targets (issue 23):")
    for name, ok, val in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {val}")
    targets = [
        ("1 host, LAN: at most 1.05x raw OpenSSH", m("lan:deploy1") <= 1.05 * m("lan:raw1"),
         f"{m('lan:deploy1') / m('lan:raw1'):.2f}x"),
        (f"1 host, +{a.latency_ms} ms RTT: at most 1.0x raw OpenSSH", m("wan:deploy1") <= m("wan:raw1"),
         f"{m('wan:deploy1') / m('wan:raw1'):.2f}x"),
        (f"{n} hosts: at most 0.85x raw OpenSSH {n}-wide (no added latency)", m("lan:deployN") <= 0.85 * m("lan:rawN"),
         f"{m('lan:deployN') / m('lan:rawN'):.2f}x"),
        ("per-row remote CPU at most 1.5x raw's", m("row_cpu:new") <= 1.5 * m("row_cpu:raw"),
         f"{m('row_cpu:new') / m('row_cpu:raw'):.2f}x"),
    ]
    print("targets (issue 54):")
    for name, ok, val in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {val}")


if __name__ == "__main__":
    main()
