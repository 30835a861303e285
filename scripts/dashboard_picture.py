#!/usr/bin/env python3
"""Make docs/img/dashboard.png: the dashboard `deploy monitor export` writes, drawn by `deploy monitor render` from
a real Prometheus that scraped a test bed of its own for a few minutes. Needs root (the test bed), Debian's
prometheus (scripts/setup.sh installs it) and matplotlib (the [test] extra). About 5 minutes; light on the CPU.

  .venv/bin/python scripts/dashboard_picture.py [--minutes 4] [--out docs/img/dashboard.png]

What runs (all on 127.x addresses this script's test bed owns; everything it starts is stopped at the end):
- pve1/129: `deploy up qwen36-dflash` (the pinned drafter config written, verified, gated): the healthy one;
- pve2/129: the same playbook copied as `qwen36-dflash-stale` (a playbook that only names pve2/129), its vLLM
  started by hand with the stale guessed drafter config the test bed starts with (deploy up would refuse it at
  the gate): the broken one;
- bounded traffic to both, in phases of 1, 4 and 8 concurrent clients (each client pauses between requests);
- a real Prometheus (scrape and evaluation every 2 s) with the exported prometheus.yml, rules and targets;
- then `deploy monitor render` over the whole run.
"""

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_net():
    for n in range(200, 250):  # away from the tests' 127.77.1-60 and the demo's 127.77.0
        ok = True
        for i in (1, 2):
            with socket.socket() as s:
                try:
                    s.bind((f"127.77.{n}.{i}", 2222))
                except OSError:
                    ok = False
        if ok:
            return f"127.77.{n}."
    raise SystemExit("no free 127.77.N. range for the test bed")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, doc, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


PROMPTS = ["Tell me about the sea.", "Explain how a bicycle stays upright.", "Write a short poem about autumn.",
           "Summarise the history of the printing press.", "What makes bread rise?"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="how long traffic runs (default 4)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "img", "dashboard.png"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the test bed uses namespaces)")
    prometheus = shutil.which("prometheus")
    if not prometheus:
        raise SystemExit("needs Debian's prometheus (bash scripts/setup.sh installs it)")
    from vpd_testbed import Testbed

    from orchestrator.steps.plan import serve_argv
    from orchestrator.core.spec import load_inventory, load_playbook

    work = tempfile.mkdtemp(prefix="vpd-picture-")
    bed = Testbed(root=os.path.join(work, "bed"), hosts=2, containers={"pve1": {129: [0, 1, 2, 3]},
                                                                      "pve2": {129: [0, 1, 2, 3]}},
                  gpus=4, net=free_net())
    procs, stop = [], threading.Event()
    threads = []
    try:
        say(f"test bed up in {bed.root}")
        bed.up()
        pbdir = os.path.join(work, "playbooks")
        shutil.copytree(os.path.join(REPO, "playbooks"), pbdir)
        text = open(os.path.join(pbdir, "qwen36-dflash.yaml")).read()
        stale = text.replace("name: qwen36-dflash", "name: qwen36-dflash-stale", 1) \
            .replace("  host: pve1\n", "  host: pve2\n", 1) \
            .replace("description: Qwen3.6-27B + DFlash", "description: (stale drafter config, started by hand) "
                                                          "Qwen3.6-27B + DFlash", 1)
        assert "host: pve2" in stale, "the playbook's target is not where this script expects it"
        open(os.path.join(pbdir, "qwen36-dflash-stale.yaml"), "w").write(stale)
        env = dict(os.environ, DEPLOY_INVENTORY=bed.inventory_path, DEPLOY_PLAYBOOKS=pbdir,
                   DEPLOY_STATE_DIR=os.path.join(work, "state"), NO_COLOR="1")
        deploy = [sys.executable, "-m", "orchestrator.cli"]

        say("deploy up qwen36-dflash (pve1/129)")
        p = subprocess.run(deploy + ["up", "qwen36-dflash", "-y"], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=600)
        if p.returncode:
            raise SystemExit(f"deploy up failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")

        say("the stale drafter config's server on pve2/129, started by hand")
        inv = load_inventory(bed.inventory_path)
        os.environ["DEPLOY_PLAYBOOKS"] = pbdir
        argv = serve_argv(load_playbook("qwen36-dflash-stale", inv))
        r = bed.container_exec("pve2", 129, ["sh", "-c", "CUDA_VISIBLE_DEVICES=0,1,2,3 setsid -f %s >/tmp/vllm.log "
                                             "2>&1 </dev/null" % shlex.join(argv)])
        if r.returncode:
            raise SystemExit(f"launching the stale server failed: {r.stderr}")
        addrs = {h: bed.container_address(h, 129) for h in ("pve1", "pve2")}
        deadline = time.monotonic() + 120
        for h, a in addrs.items():
            while True:
                try:
                    urllib.request.urlopen(f"http://{a}:8000/health", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{h}/129 does not answer /health within 120 s") from None
                    time.sleep(0.5)

        mon = os.path.join(work, "mon")
        p = subprocess.run(deploy + ["monitor", "export", mon, "--rate-window", "30s", "--for", "30s",
                                     "--scrape-interval", "2s", "--evaluation-interval", "2s"],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        if p.returncode:
            raise SystemExit(f"deploy monitor export failed:\n{p.stdout}\n{p.stderr}")
        say(p.stdout.strip())
        port = free_port()
        prom = subprocess.Popen([prometheus, f"--config.file={mon}/prometheus.yml",
                                 f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], cwd=mon, stdout=subprocess.DEVNULL,
                                stderr=open(os.path.join(work, "prometheus.log"), "wb"))
        procs.append(prom)
        t_start = time.time()

        # traffic: phases of 1, 4, 8 concurrent clients per deployment, each client pausing 0.3 s between requests
        phase_s = args.minutes * 60 / 3
        level = {"n": 1}

        def client(i, addr):
            k = 0
            while not stop.is_set():
                if i < level["n"]:
                    try:
                        post(f"http://{addr}:8000/v1/completions",
                             {"model": "qwen36", "prompt": PROMPTS[(i + k) % len(PROMPTS)], "max_tokens": 96})
                    except OSError:
                        pass
                    k += 1
                stop.wait(0.3)
        for addr in addrs.values():
            for i in range(8):
                th = threading.Thread(target=client, args=(i, addr), daemon=True)
                th.start()
                threads.append(th)
        for n in (1, 4, 8):
            level["n"] = n
            say(f"traffic: {n} concurrent client(s) per deployment for {phase_s:.0f} s")
            end = time.monotonic() + phase_s
            while time.monotonic() < end:
                if prom.poll() is not None:
                    raise SystemExit(open(os.path.join(work, "prometheus.log")).read())
                time.sleep(1)
        since = int(time.time() - t_start) + 2  # drawn while the last phase's traffic still flows
        say(f"deploy monitor render over the last {since} s -> {args.out}")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        p = subprocess.run(deploy + ["monitor", "render", os.path.join(mon, "dashboard.json"), "--prometheus",
                                     f"http://127.0.0.1:{port}", "--since", f"{since}s", "--step", "2s",
                                     "--scrape-interval", "2s", "--out", args.out],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        print(p.stdout + p.stderr, end="")
        if p.returncode:
            raise SystemExit(p.returncode)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=40)
        for pr in procs:
            if pr.poll() is None:
                pr.terminate()
                try:
                    pr.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pr.kill()
        try:
            bed.down()
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
