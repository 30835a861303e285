"""`doctor`: everything `deploy doctor` needs, read-only: vLLM processes (argv, group, GPUs held, start time), the
drafter and target configs each server read, the vLLM build, GPU memory and holders, /health and /metrics."""

import stat as _stat
import errno
import hashlib
import json
import os
import signal
import time

from .core import now
from .files import why_untrusted
from .gpus import gpu_holders, read_gpu_memory
from .net import http
from .protocol import DEFAULT_STATE_DIR, DOCTOR_LOAD_MAX as LOAD_MAX  # the most the budget grows
from .procs import _argv, _boot_time, _environ, pids, proc_cmdline, proc_name, proc_stat, vllm_processes
from .stack import _vllm_stack
from .state import read_state
from .verify import resolve_drafter_path


def _serve_args(argv):
    """The `vllm serve` arguments that matter here: model, port, --speculative-config (raw and parsed)."""
    api = "vllm.entrypoints.openai.api_server"
    if "serve" in argv:
        rest = argv[argv.index("serve") + 1:]
    elif api in argv:  # the older `python -m vllm.entrypoints.openai.api_server --model M` form
        rest = ["--"] + argv[argv.index(api) + 1:]  # no positional model in this form
    else:
        return None
    out = {"model": None, "port": 8000, "spec_raw": None, "spec": None, "spec_error": None}
    i = 0
    while i < len(rest):
        a = rest[i]
        key, eq, val = a.partition("=")
        if key in ("--port", "--model", "--speculative-config", "-sc"):
            if not eq:
                val = rest[i + 1] if i + 1 < len(rest) else ""
                i += 1
            if key == "--port":
                out["port"] = int(val) if val.isdigit() else val
            elif key == "--model":
                out["model"] = val
            else:
                out["spec_raw"] = val
        elif not a.startswith("-") and out["model"] is None and i == 0:
            out["model"] = a
        i += 1
    if out["spec_raw"]:
        try:
            out["spec"] = json.loads(out["spec_raw"])
        except ValueError as e:
            out["spec_error"] = str(e)
    return out


def _read_config(path, limit=1 << 20):
    """A config.json at a path taken from another process's argv (untrusted): a regular file only, opened
    O_NONBLOCK (a FIFO or a device would block or be read forever), at most `limit` bytes."""
    info = {"path": path}
    # a symlink is followed only in a directory nobody but root controls (the hub cache's snapshot links);
    # in another user's directory it could point root's read anywhere
    nofollow = 0 if why_untrusted(os.path.dirname(path) or "/") is None else os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | nofollow | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not _stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or directory is not read)")
            raw = fh.read(limit)
        info.update(realpath=os.path.realpath(path), mtime=st.st_mtime, size=st.st_size,
                    sha256=hashlib.sha256(raw).hexdigest(), text=raw.decode("utf-8", "replace"))
    except OSError as e:
        info["error"] = (e.strerror or str(e)) if e.errno != errno.ELOOP else "a symlink (not followed)"
    return info


def load_factor():
    """How busy this machine is, measured as tests/slack.py measures it (issue 53): the larger of 1 / the CPU share
    a 50 ms spin gets and the 1-minute load average per core, never below 1, at most LOAD_MAX."""
    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < 0.05:
        pass
    share = (time.process_time() - c0) / max(time.perf_counter() - w0, 1e-6)
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        per_core = 0.0
    return min(LOAD_MAX, max(1.0, 1.0 / max(share, 1e-3), per_core))


def act_doctor(a):
    """Everything `deploy doctor` needs, read-only: vLLM processes (argv, tree, GPUs held, start time), the
    drafter and target configs each server read, the vLLM build, GPU memory and holders, /health and /metrics.
    The budget (budget_s) grows with the load measured here: `import vllm` on a busy machine is slow, not broken."""
    factor = load_factor()
    budget = float(a.get("budget_s", 12)) * factor
    end = now() + budget
    # the tool gives up at budget_s x LOAD_MAX + 10 s: by then this process is gone too, whatever it was reading (a
    # path from another user's argv may name a FIFO or a hung mount; issue 22)
    signal.alarm(int(budget) + 8)
    btime, tck = _boot_time(), os.sysconf("SC_CLK_TCK")
    holders = gpu_holders()
    held = {h["pid"]: h["devices"] for h in holders}
    procs = []
    found = vllm_processes()
    seen = {p["pid"] for p in found}
    for pid in pids():  # the older entry point, which vllm_processes() does not name
        if pid not in seen and "vllm.entrypoints.openai.api_server" in proc_cmdline(pid):
            found.append({"pid": pid})
    for p in found:
        f = proc_stat(p["pid"]) or []
        st = int(f[19]) if len(f) > 19 else None
        procs.append({"pid": p["pid"], "ppid": int(f[1]) if len(f) > 1 else None,
                      "pgid": int(f[2]) if len(f) > 2 else None, "comm": proc_name(p["pid"]),
                      "argv": _argv(p["pid"])[:200], "devices": held.get(p["pid"], []),
                      "started_at": (btime + st / float(tck)) if btime and st is not None else None,
                      "env": _environ(p["pid"], ("CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_OFFLINE"))})
    servers = []
    for p in procs:
        sa = _serve_args(p["argv"])
        if sa is None:
            continue
        srv = {"pid": p["pid"], "args": sa, "drafter": None, "target": None}
        if sa["model"]:
            srv["target"] = _read_config(os.path.join(sa["model"], "config.json")) if sa["model"].startswith("/") \
                else {"hub_id": sa["model"]}
        spec = sa["spec"] if isinstance(sa["spec"], dict) else {}
        dm = spec.get("model")
        if dm:
            if dm.startswith("/"):
                srv["drafter"] = dict(_read_config(os.path.join(dm, "config.json")), kind="local", dir=dm)
            else:
                r = resolve_drafter_path({"hub_id": dm, "hf_home": p["env"].get("HF_HOME")})
                srv["drafter"] = dict(_read_config(r["path"]) if r.get("path") else {"error": r.get("error")},
                                      kind="hub", hub_id=dm, revision=r.get("revision"))
        if now() < end - 1:
            srv["health"], _ = http(sa["port"], "/health", timeout=min(2.0, end - now())) \
                if isinstance(sa["port"], int) else (None, "")
            if srv["health"] == 200:
                ms, body = http(sa["port"], "/metrics", timeout=min(3.0, max(0.5, end - now())))
                srv["metrics"] = body if ms == 200 else None
        servers.append(srv)
    mem = read_gpu_memory(min(float(a.get("nvidia_smi_timeout_s", 4)), max(0.5, end - now())))
    stack = _vllm_stack(max(1.0, min(8.0 * factor, end - now() - 0.5)),
                        retry_until=time.monotonic() + (end - now() - 0.5))
    stack.update(load_factor=round(factor, 2), budget_s=round(budget, 1))
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")  # namespace inodes are global: the host compares its holders'
    except OSError:
        pid_ns = None
    from .plumbing import facts as plumbing_facts  # the gpu-plumbing check's container side (a few stats)

    return {"processes": procs, "servers": servers, "holders": holders, "memory": mem, "stack": stack,
            "state": read_state(a.get("state_dir") or DEFAULT_STATE_DIR), "now": now(), "pid_ns": pid_ns,
            "plumbing": plumbing_facts()}
