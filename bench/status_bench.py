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
  6. `deploy --version` / `deploy --help` start-up next to `python -c pass`.

and PASS/MISS against the targets of issue 8. The test bed is always torn down (finally + atexit).
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
DEADLINE = 15.0             # deploy status --deadline (its per-host deadline)
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


def deploy_argv(*args) -> list[str]:
    """The installed `deploy` entry point of this interpreter, else an equivalent shim (same interpreter)."""
    exe = os.path.join(os.path.dirname(sys.executable), "deploy")
    if os.access(exe, os.X_OK):
        return [sys.executable, exe, *args]
    return [sys.executable, "-c", "import sys; from orchestrator.cli import main; sys.argv[0] = 'deploy'; main()",
            *args]


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


def bench_pair(tb, res: Results, env, hosts, runs, budget, tag, expect_running, lag: bool):
    """deploy status (1 host, 8 hosts) vs raw OpenSSH (1, 8-wide), interleaved run by run."""
    ports = {h: (tb.lag_port(h) if lag else 2222) for h in hosts}
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
    for i in range(runs):
        budget.check(f"{tag} run {i + 1}")
        dt, _ = timed(raw1, env=env)
        res.add(f"{tag}:raw1", dt)
        res.add(f"{tag}:raw1_curve25519", timed(raw1k, env=env)[0])
        dt, p = timed(dep1, env=env)
        check_status_json(p, 1, expect_running)
        res.add(f"{tag}:deploy1", dt)
        res.add(f"{tag}:deploy1_self", json.loads(p.stdout)["seconds"])
        res.add(f"{tag}:rawN", timed_parallel(rawn, env=env))
        dt, p = timed(depn, env=env)
        check_status_json(p, len(hosts), expect_running)
        res.add(f"{tag}:deployN", dt)
        res.add(f"{tag}:deployN_self", json.loads(p.stdout)["seconds"])


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
    from orchestrator.remote import Fleet
    from orchestrator.spec import load_inventory
    from orchestrator.status import Sampler, gather, resolve_targets

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
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import paramiko'": [sys.executable, "-c", "import paramiko"],
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
    ap.add_argument("--runs", type=int, default=7, help="repetitions per measurement (medians are printed)")
    ap.add_argument("--latency-ms", type=int, default=50, help="round trip added in phase 3")
    ap.add_argument("--idle", action="store_true", help="do not deploy; containers idle (no vLLM)")
    ap.add_argument("--budget-s", type=float, default=900, help="abort (and tear down) after this long")
    ap.add_argument("--json", metavar="PATH", help="also write every sample here")
    a = ap.parse_args()
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
    tb = Testbed(root=a.root, hosts=a.hosts, containers=[VMID], gpus=4, net=a.net)
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
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=state_dir, NO_COLOR="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DEPLOY_VERBOSE", None)
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

        print("startup ...", flush=True)
        startup_names = bench_startup(res, env, a.runs, budget)
        print("no added latency ...", flush=True)
        bench_pair(tb, res, env, hosts, a.runs, budget, "lan", running, lag=False)
        count_per_status(tb, env, hosts, state_dir, "lan", res)
        bench_watch(tb.inventory_path, [f"{hosts[0]}/{VMID}"], a.runs + 1, budget, "watch1:lan", res)
        bench_watch(tb.inventory_path, [], a.runs + 1, budget, "watchN:lan", res)

        print(f"latency {a.latency_ms} ms round trip on every host ...", flush=True)
        for h in hosts:
            tb.set_fault(h, None, "latency_ms", a.latency_ms)
        bench_pair(tb, res, env, hosts, a.runs, budget, "wan", running, lag=True)
        count_per_status(tb, env, hosts, state_dir, "wan", res)
        bench_watch(tb.inventory_path, [f"{hosts[0]}/{VMID}"], a.runs + 1, budget, "watch1:wan", res)
        bench_watch(tb.inventory_path, [], a.runs + 1, budget, "watchN:wan", res)
    finally:
        teardown()

    report(res, a, hosts, startup_names)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"samples": res.samples, "facts": res.facts, "args": vars(a)}, fh, indent=1)


def report(res: Results, a, hosts, startup_names):
    m = res.m
    n = len(hosts)
    mc = res.facts["machine"]
    rtt = a.latency_ms / 1000
    print()
    print(f"machine: nproc={mc['nproc']}  cpu={mc['cpu']}  python={mc['python']}  kernel={mc['kernel']}")
    print(f"containers: {res.facts['containers']}; medians of {a.runs} runs; latency phase +{a.latency_ms} ms RTT")
    la0, la1 = mc["load_avg_at_start"], os.getloadavg()
    print(f"load average (1/5/15 min) at start {la0[0]:.2f}/{la0[1]:.2f}/{la0[2]:.2f}, at end "
          f"{la1[0]:.2f}/{la1[1]:.2f}/{la1[2]:.2f} (other work on the machine skews every number)")
    print()
    print(f"{'':34}{'deploy status':>16}{'raw OpenSSH':>16}{'ratio':>9}   (deploy's own 'seconds')")
    for tag, label in (("lan", "no added latency"), ("wan", f"+{a.latency_ms} ms RTT")):
        for k, what in (("1", "1 host"), ("N", f"{n} hosts (raw {n}-wide)")):
            d, r = m(f"{tag}:deploy{k}"), m(f"{tag}:raw{k}")
            print(f"  {what + ', ' + label:32}{fmt_ms(d):>16}{fmt_ms(r):>16}{d / r:8.2f}x   "
                  f"({fmt_ms(m(f'{tag}:deploy{k}_self')).strip()} in gather)")
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
    print(f"{'--watch refresh (in-process, one Fleet)':42}{'1st (connects)':>16}{'2nd+ (median)':>16}")
    for tag, label in (("watch1:lan", "1 host"), ("watchN:lan", f"{n} hosts"),
                       ("watch1:wan", f"1 host, +{a.latency_ms} ms"), ("watchN:wan", f"{n} hosts, +{a.latency_ms} ms")):
        print(f"  {label:40}{fmt_ms(m(tag + ':first')):>16}{fmt_ms(m(tag + ':later')):>16}")
    extra1 = (m("watch1:wan:later") - m("watch1:lan:later")) / rtt
    extraN = (m("watchN:wan:later") - m("watchN:lan:later")) / rtt
    print(f"  latency cost of a kept-open refresh: {extra1:.1f} RTT (1 host), {extraN:.1f} RTT ({n} hosts in parallel)")
    print()
    print("start-up (same interpreter):")
    base = m("startup:python -c pass")
    for name in startup_names:
        v = m(f"startup:{name}")
        print(f"  {name:32}{fmt_ms(v):>12}   (+{(v - base) * 1000:.0f} ms over python -c pass)")
    print()
    targets = [
        (f"1 host within 1.15x of raw OpenSSH with +{a.latency_ms} ms",
         m("wan:deploy1") <= 1.15 * m("wan:raw1"), f"{m('wan:deploy1') / m('wan:raw1'):.2f}x"),
        (f"{n} hosts no slower than raw OpenSSH {n}-wide (no added latency)",
         m("lan:deployN") <= m("lan:rawN"), f"{m('lan:deployN') / m('lan:rawN'):.2f}x"),
        (f"{n} hosts no slower than raw OpenSSH {n}-wide (+{a.latency_ms} ms)",
         m("wan:deployN") <= m("wan:rawN"), f"{m('wan:deployN') / m('wan:rawN'):.2f}x"),
        ("exactly 1 connection and 1 exec per container", counts_ok, "see counts above"),
        ("--watch refresh about one round trip per host (added latency cost <= 1.5 RTT)",
         max(extra1, extraN) <= 1.5, f"{extra1:.1f} / {extraN:.1f} RTT"),
    ]
    print("targets (issue 8):")
    for name, ok, val in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {val}")


if __name__ == "__main__":
    main()
