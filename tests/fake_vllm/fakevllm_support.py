"""Helpers for the fake vLLM tests (imported by conftest.py and the test modules; a unique module name so
it never collides with other conftest.py files): a temp site-packages with the fake package, fake /dev, model dirs,
a faults file, and a server runner that always kills what it starts (whole process group)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "testbed", "vpd_testbed", "fake_vllm")
DOMAIN = os.environ.get("VPD_DOMAIN_DIR") or os.path.join(REPO, "docs", "domain")

sys.path.insert(0, FAKE)
import build  # noqa: E402

sys.path.pop(0)


def domain_file(name):
    p = os.path.join(DOMAIN, name)
    if os.path.exists(p):
        return p
    for top in ("testbed/vpd_testbed", "playbooks", "tests"):
        for dirpath, _, files in os.walk(os.path.join(REPO, top)):
            if name in files:
                return os.path.join(dirpath, name)
    pytest.skip(f"domain file {name} not found (set VPD_DOMAIN_DIR)")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Bed:
    def __init__(self, root):
        self.root = root
        self.dev = os.path.join(root, "dev")
        self.models = os.path.join(root, "models")
        self.faults_path = os.path.join(root, "faults.json")
        self.bin = os.path.join(root, "bin")
        os.makedirs(self.bin)
        os.makedirs(self.dev)
        for i in range(4):
            open(os.path.join(self.dev, f"nvidia{i}"), "w").close()
        open(os.path.join(self.dev, "nvidiactl"), "w").close()
        self.target = os.path.join(self.models, "Qwen3.6-27B")
        os.makedirs(self.target)
        shutil.copy(domain_file("qwen36-27b-target.trimmed.config.json"), os.path.join(self.target, "config.json"))
        self.sites = {}
        self.procs = []
        self.faults({"load_s": 0.3})

    def drafter(self, name="published", mutate=None):
        src = {"published": "qwen36-27b-dflash.config.json",
               "stale": "qwen36-27b-dflash.stale-guess.config.json"}[name]
        with open(domain_file(src)) as f:
            cfg = json.load(f)
        if mutate:
            mutate(cfg)
        d = os.path.join(self.models, f"D-{name}-{len(os.listdir(self.models))}")
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        return d

    def faults(self, data):
        with open(self.faults_path, "w") as f:
            json.dump(data, f)

    def site(self, version="0.34.0", build_="release", **kw):
        key = (version, build_, tuple(sorted(kw.items())))
        if key not in self.sites:
            sp = os.path.join(self.root, f"sp{len(self.sites)}")
            os.makedirs(sp)
            build.install_fake_vllm(sp, version=version, build=build_, **kw)
            self.sites[key] = sp
        return self.sites[key]

    def env(self, site, extra=None):
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("VPD_") or k in ("CUDA_VISIBLE_DEVICES", "VLLM_API_KEY", "NO_COLOR",
                                             "VLLM_USE_V2_MODEL_RUNNER"):
                env.pop(k)
        env.update({"PYTHONPATH": site, "VPD_FAKE_DEV": self.dev, "VPD_FAKE_VLLM_FAULTS": self.faults_path,
                    "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "VPD_FAKE_VLLM_STATS_INTERVAL": "0.5",
                    "PATH": self.bin + ":" + env.get("PATH", "")})
        env.update(extra or {})
        return env

    def start(self, args, version="0.34.0", build_="release", env=None, port=None, site=None, python=None):
        site = site or self.site(version, build_)
        port = port or free_port()
        log = os.path.join(self.root, f"vllm-{len(self.procs)}.log")
        argv = [python or sys.executable, "-c", "import sys; from vllm.entrypoints.cli.main import main; sys.exit(main())",
                "serve", self.target, "--port", str(port), "--host", "127.0.0.1"] + list(args)
        with open(log, "wb") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.env(site, env), start_new_session=True, cwd=self.root)
        srv = Server(p, port, log)
        self.procs.append(srv)
        return srv

    def cleanup(self):
        for s in self.procs:
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                s.proc.wait(5)
            except Exception:
                pass


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log_path = proc, port, log

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_exit(self, timeout=20):
        return self.proc.wait(timeout)

    def get(self, path, headers=None, timeout=5):
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path, body, headers=None, timeout=10):
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def wait_ready(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                code, _ = self.get("/health", timeout=1)
                if code == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        raise AssertionError("not ready:\n" + self.log())

    def metrics(self):
        code, body = self.get("/metrics")
        assert code == 200
        out = {}
        for line in body.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, val = line.rsplit(" ", 1)
            out[name_labels] = float(val)
        return out

    def spec_totals(self):
        m = self.metrics()
        tot = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
        for key, v in m.items():
            name = key.split("{", 1)[0]
            if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(key.split('position="', 1)[1].split('"', 1)[0])
                tot["per_pos"][pos] = tot["per_pos"].get(pos, 0) + v
            elif name == "vllm:spec_decode_num_drafts_total":
                tot["drafts"] += v
            elif name == "vllm:spec_decode_num_draft_tokens_total":
                tot["draft_tokens"] += v
            elif name == "vllm:spec_decode_num_accepted_tokens_total":
                tot["accepted"] += v
        return tot

    def measure(self, n=16, max_tokens=256):
        a = self.spec_totals()
        for i in range(n):
            code, body = self.post("/v1/completions", {"prompt": f"probe {i}: tell me a story", "max_tokens": max_tokens})
            assert code == 200, body
        b = self.spec_totals()
        dd = b["drafts"] - a["drafts"]
        rate = (b["accepted"] - a["accepted"]) / (b["draft_tokens"] - a["draft_tokens"])
        mal = 1 + (b["accepted"] - a["accepted"]) / dd
        per_pos = [(b["per_pos"][p] - a["per_pos"].get(p, 0)) / dd for p in sorted(b["per_pos"])]
        return rate, mal, per_pos


def pids_in_group(pgid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
                fields = st[st.rindex(")") + 2:].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def comm(pid):
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def held_offsets(pid, dev):
    """{device name: MiB offset} of fds the pid holds under dev."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(dev + "/"):
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                pos = int(f.readline().split()[1])
            out[os.path.basename(target)] = pos // 2**20
    return out
