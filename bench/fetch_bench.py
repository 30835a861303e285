"""bench/fetch_bench.py: weights at link speed, once per host (issue 38). Numbers, not a test.

The test bed's hub (testbed/vpd_testbed/hub.py) on this machine's loopback, shaped like a CDN: each connection
capped (--conn-mibs, default 20 MiB/s) under an aggregate link cap (--link-mibs, default 100 MiB/s); a repository
of a few hundred MiB in several files, one of them large.

A. The transfer engine (agent/container/transfer.py, in this process, into a temp dir): one stream (connections=1:
   one file after another over one connection, as deploy fetch did before) vs the default 8 connections with ranges;
   each against the link's limit (size / link cap). Then the same fetch cut in the middle of a range (the hub's cut
   fault), resumed, verified.
B. The host's shared store on a test bed of its own (one host, containers 129-132; --root, --net): 4 containers
   fetching one revision at once through fetch.store (the real CLI, `deploy fetch`, 4 processes) vs 1 container
   alone; the bytes the hub sent (its "sent" log lines) and the disk used in the store. Without the store each
   container downloads and keeps its own copy (4x by construction; not run here: the test bed's containers do not
   reach this machine's loopback, where this hub listens). --no-store-part skips B.

    sudo .venv/bin/python bench/fetch_bench.py                 # about 2-3 minutes on 2 cores
    sudo .venv/bin/python bench/fetch_bench.py --big-mib 512 --conn-mibs 10 --link-mibs 80
"""

import argparse
import atexit
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "testbed")]
MIB = 1 << 20


def machine():
    return f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}"


def start_hub(root, log_path):
    from vpd_testbed import hub as hubmod

    try:
        p, endpoint = hubmod.start(root, open(log_path, "wb"))
    except RuntimeError:
        raise SystemExit("bench: the hub did not start: " + open(log_path).read()[-2000:]) from None
    atexit.register(lambda: (p.kill(), p.wait(5)))
    return p, endpoint


def sent_bytes(log_path):
    n = 0
    for ln in open(log_path, errors="replace"):
        f = ln.split()
        if len(f) == 4 and f[1] == "sent":
            n += int(f[3])
    return n


def make_repo(root, big_mib, small_n, small_mib):
    from vpd_testbed import hub as hubmod

    files = {"config.json": b'{"architectures": ["Bench"]}\n', "model-00001.safetensors": os.urandom(big_mib * MIB)}
    for i in range(small_n):
        files[f"model-{i + 2:05d}.safetensors"] = os.urandom(small_mib * MIB)
    commit = hubmod.make_repo(str(root), "acme/Bench", files)
    return commit, files


def engine_run(endpoint, commit, dest_root, *, connections, range_mib, faults=None, hub_root=None):
    from orchestrator.agent.container import fetch as F
    from orchestrator.agent.container.transfer import Transfer

    os.makedirs(dest_root, exist_ok=True)
    it = {"role": "model", "dest_kind": "dir", "dest": os.path.join(dest_root, "M"), "hub": "acme/Bench",
          "endpoint": endpoint, "revision": commit}
    lst = F.hub_info(it, None, 30)
    it["commit"] = lst["commit"]
    need, _ = F.plan_item(it, lst, os.path.join(dest_root, "state"))
    if hub_root and faults is not None:
        with open(os.path.join(hub_root, "faults.json"), "w") as fh:
            json.dump(faults, fh)
    logs = []
    t0 = time.monotonic()
    Transfer([(it, commit, f, None) for f in need], request=F._hub_request, error=F.hub_error,
             connections=connections, range_bytes=range_mib * MIB, deadline=time.time() + 600, stall_s=30,
             log=logs.append, on_progress=lambda busy, n: None, on_verified=lambda pf, got: None).run()
    return time.monotonic() - t0, logs


def part_a(a, work, res):
    hub_root = os.path.join(work, "hub-a")
    os.makedirs(hub_root)
    commit, files = make_repo(hub_root, a.big_mib, a.small_n, a.small_mib)
    size = sum(len(v) for v in files.values())
    shaped = {"rate_bps": a.conn_mibs * MIB, "link_bps": a.link_mibs * MIB}
    with open(os.path.join(hub_root, "faults.json"), "w") as fh:
        json.dump(shaped, fh)
    _, ep = start_hub(hub_root, os.path.join(work, "hub-a.log"))
    limit = size / (a.link_mibs * MIB)
    print(f"A. repository: {len(files)} files, {size / MIB:.0f} MiB (largest {a.big_mib} MiB); per connection "
          f"{a.conn_mibs} MiB/s, link {a.link_mibs} MiB/s: the link's limit is {limit:.2f}s", flush=True)
    rows = []
    for label, conns in (("one stream (before)", 1), (f"{a.connections} connections, {a.range_mib} MiB ranges",
                                                      a.connections)):
        times = []
        for r in range(a.runs):
            d = os.path.join(work, f"dest-{conns}-{r}")
            t, _ = engine_run(ep, commit, d, connections=conns, range_mib=a.range_mib)
            shutil.rmtree(d, ignore_errors=True)
            times.append(t)
        med = sorted(times)[len(times) // 2]
        rows.append((label, med, med / limit, size / med / MIB))
        print(f"   {label:<34} median {med:6.2f}s of {a.runs} = {med / limit:4.2f}x the limit, {size / med / MIB:6.1f} "
              f"MiB/s  (runs: {', '.join(f'{x:.2f}' for x in times)})", flush=True)
    res["A"] = {"files": len(files), "bytes": size, "limit_s": limit, "rows": rows}
    # cut in the middle of a range of the large file, resumed, verified
    d = os.path.join(work, "dest-cut")
    cut_at = a.range_mib * MIB // 2  # the hub counts the cut within one response (one range)
    t, logs = engine_run(ep, commit, d, connections=a.connections, range_mib=a.range_mib,
                         faults=dict(shaped, cut={"model-00001.safetensors": cut_at}), hub_root=hub_root)
    staged = os.path.join(d, ".M.deploy-fetch", commit[:12], "model-00001.safetensors")
    ok = hashlib.sha256(open(staged, "rb").read()).hexdigest() == hashlib.sha256(
        files["model-00001.safetensors"]).hexdigest()
    resumed = [ln for ln in logs if "transfer cut" in ln]
    print(f"   cut after {cut_at / MIB:.0f} MiB of a range: {t:.2f}s, {len(resumed)} resume(s), verified: {ok}"
          f"  ({resumed[0] if resumed else 'no cut seen'})", flush=True)
    res["A"]["cut"] = {"seconds": t, "resumes": len(resumed), "verified": ok}


def du(path):
    n = 0
    for dp, _, fns in os.walk(path):
        for fn in fns:
            p = os.path.join(dp, fn)
            if not os.path.islink(p):
                n += os.lstat(p).st_blocks * 512
    return n


def part_b(a, work, res):
    from vpd_testbed import Testbed
    from playbook_support import copy_playbooks  # tests/

    vmids = [129, 130, 131, 132]
    tb = Testbed(root=a.root, hosts=1, containers={v: [0] for v in vmids}, gpus=4, net=a.net)
    atexit.register(tb.down)
    t0 = time.monotonic()
    tb.up()
    print(f"B. test bed up in {time.monotonic() - t0:.1f}s (pve1, containers {vmids}, {a.root}, {a.net}x)", flush=True)
    hub_root = os.path.join(work, "hub-b")
    os.makedirs(hub_root)
    commit, files = make_repo(hub_root, a.store_big_mib, 3, a.small_mib)
    size = sum(len(v) for v in files.values())
    log_path = os.path.join(work, "hub-b.log")
    _, ep = start_hub(hub_root, log_path)
    with open(os.path.join(hub_root, "faults.json"), "w") as fh:
        json.dump({"rate_bps": a.conn_mibs * MIB, "link_bps": a.link_mibs * MIB}, fh)
    store = f"/var/tmp/vpd-fetchbench-store-{os.getpid()}"
    atexit.register(lambda: shutil.rmtree(store, ignore_errors=True))
    pbdir = copy_playbooks(os.path.join(work, "playbooks"))
    base = open(os.path.join(pbdir, "qwen36-mtp.yaml")).read()
    state = os.path.join(work, "state")
    os.makedirs(state)
    env = dict(os.environ, DEPLOY_INVENTORY=tb.inventory_path, DEPLOY_STATE_DIR=state, DEPLOY_PLAYBOOKS=pbdir,
               NO_COLOR="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def write(with_store):
        for v in vmids:
            t = base.replace("name: qwen36-mtp", f"name: b{v}", 1)
            t = t.replace("vmid: 129", f"vmid: {v}", 1).replace("gpus: [0, 1, 2, 3]", "gpus: [0]", 1)
            t = t.replace("tensor_parallel_size: 4", "tensor_parallel_size: 1", 1)
            t = t.replace("model:\n  path: /root/models/Qwen3.6-27B\n",
                          f"model:\n  path: /root/models/Bench\n  hub: acme/Bench\n  revision: {commit}\n"
                          f"  endpoint: {ep}\n", 1)
            if with_store:
                t += f"\nfetch:\n  store: {store}\n  range_mib: {a.range_mib}\n"
            else:
                t += f"\nfetch:\n  range_mib: {a.range_mib}\n"
            open(os.path.join(pbdir, f"b{v}.yaml"), "w").write(t)

    def deploy(*args, timeout=600):
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, env=env, text=True,
                              capture_output=True, timeout=timeout)

    def clean():
        # the store's contents, not the directory: the containers' mount points hold that directory (a store made
        # anew on the host is seen by a container only after its next start)
        for n in os.listdir(store) if os.path.isdir(store) else []:
            p = os.path.join(store, n)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        for v in vmids:
            tb.container_exec("pve1", v, ["sh", "-c", "rm -rf /root/models/Bench /root/models/.Bench.* "
                                                      "/var/lib/vllm-pve-deploy/fetched /var/lib/vllm-pve-deploy/fetch*"])

    def fetch_all(vs):
        n0, t0 = sent_bytes(log_path), time.monotonic()
        with ThreadPoolExecutor(len(vs)) as pool:
            outs = list(pool.map(lambda v: deploy("fetch", f"b{v}"), vs))
        t = time.monotonic() - t0
        bad = [o for o in outs if o.returncode != 0]
        if bad:
            raise SystemExit("bench: deploy fetch failed: " + bad[0].stderr[-3000:])
        return t, sent_bytes(log_path) - n0

    write(True)
    for v in vmids:
        p = deploy("prepare", f"pve1/{v}", "--gpus", "0", "-y", "--no-install")
        if p.returncode != 0:
            raise SystemExit("bench: deploy prepare failed: " + p.stdout[-2000:] + p.stderr[-2000:])
    out = {}
    clean()
    out["store_1"] = fetch_all(vmids[:1])
    clean()
    out["store_4"] = fetch_all(vmids)
    disk = du(store)
    print(f"   repository {size / MIB:.0f} MiB; per connection {a.conn_mibs} MiB/s, link {a.link_mibs} MiB/s", flush=True)
    for k, label in (("store_1", "1 container, fetch.store"), ("store_4", "4 containers at once, fetch.store")):
        t, b = out[k]
        print(f"   {label:<42} {t:6.2f}s, hub sent {b / MIB:7.1f} MiB = {b / size:4.2f}x the repository", flush=True)
    print(f"   store on the host: {disk / MIB:.1f} MiB on disk = {disk / size:.2f}x; 4 at once - 1 alone = "
          f"{out['store_4'][0] - out['store_1'][0]:+.2f}s", flush=True)
    res["B"] = {"bytes": size, **{k: {"seconds": t, "sent": b} for k, (t, b) in out.items()}, "store_disk": disk}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conn-mibs", type=float, default=20.0)
    ap.add_argument("--link-mibs", type=float, default=100.0)
    ap.add_argument("--big-mib", type=int, default=256)
    ap.add_argument("--small-n", type=int, default=4)
    ap.add_argument("--small-mib", type=int, default=24)
    ap.add_argument("--store-big-mib", type=int, default=128)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--range-mib", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--root", default="/tmp/vpd-fetchbench")
    ap.add_argument("--net", default="127.77.8.")
    ap.add_argument("--no-store-part", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not (a.net.startswith("127.") and a.net.endswith(".")):
        raise SystemExit("bench: --net must be in 127.0.0.0/8")
    sys.path.insert(0, os.path.join(REPO, "tests"))
    print("machine:", machine(), flush=True)
    work = tempfile.mkdtemp(prefix="vpd-fetchbench-")
    atexit.register(lambda: shutil.rmtree(work, ignore_errors=True))
    res = {"machine": machine()}
    part_a(a, work, res)
    if not a.no_store_part:
        part_b(a, work, res)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
