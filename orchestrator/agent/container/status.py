"""`status` (deploy status, and `current` before an up): what runs now, read in one exec: the state file,
/health, /v1/models, /metrics, the drafter config's sha256, the lock, systemd's view, the last error line, the last
recorded failure; nvidia-smi runs in a thread meanwhile. Imports only what it reads (no installer, verify, doctor)."""

import os

from .core import LazyRe, sha256_file
from .files import _read_json, tail_file
from .gate import gate_status
from .gpus import read_gpu_memory
from .lock import _read_lock
from .net import http, listener_check, serving_host
from .procs import vllm_processes
from .state import read_exit_code, read_state
from .systemd import supervision, systemd_running, unit_error_entries
from .weights import serving_weights
from . import core


ERROR_LINE = LazyRe(r"Error|error:|Traceback|died|failed")


def pick_last_error(entries, fatal=()):
    """The last error of THIS launch: entries are (invocation id, line), oldest first, of the launch only. The
    newest invocation (systemd start) that logged an error-looking line wins; in it, the line that names the cause
    (vLLM's known startup failures, `fatal`: specific first) over the wrapper's last words, else its newest error
    line. An older crash's cause never wins over a newer crash."""
    errs = [(inv, ln) for inv, ln in entries if ERROR_LINE.search(ln)]
    if not errs:
        return None
    last_inv = errs[-1][0]
    mine = [ln for inv, ln in errs if inv == last_inv]
    import re

    for rx in map(re.compile, fatal or []):
        named = [ln for ln in mine if rx.search(ln)]
        if named:
            return named[-1][-4000:]
    return mine[-1][-4000:]


def act_status(a):
    state_dir = a["state_dir"]
    timeout = a.get("nvidia_smi_timeout_s", 5)
    res, fatal = {"state": read_state(state_dir), "memory": None}, a.get("fatal_regex")
    argv = (res["state"] or {}).get("argv") or []
    if argv and isinstance(argv[0], str):
        res["argv0_real_now"] = os.path.realpath(argv[0])
    if "nvidia-smi" in core.EARLY:
        # the exec's preamble started nvidia-smi (call.py EARLY_SMI): it runs while the state, lock and HTTP checks
        # run here, and is collected after them within the same timeout, counted from now (no thread to import)
        t0 = core.now()
        _status_rest(res, state_dir, fatal)
        res["memory"] = read_gpu_memory(timeout, wait=max(0.0, timeout - (core.now() - t0)))
    else:
        _status_with_smi_thread(res, state_dir, timeout, fatal)
    if a.get("plumbing"):  # the gpu-plumbing check's container facts: from their record while its key holds
        from .plumbing import facts_recorded
        res["plumbing"] = facts_recorded(state_dir)
    return res


def _status_with_smi_thread(res, state_dir, timeout, fatal):
    """nvidia-smi in a thread while the rest runs (an agent session's `current`: no preamble started it)."""
    import threading

    failed = []

    def gpu():  # nvidia-smi (tens of ms here, often hundreds on real GPUs) runs while the HTTP checks run
        try:
            res["memory"] = read_gpu_memory(timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below, as if it had run inline
            failed.append(e)

    smi = threading.Thread(target=gpu)
    smi.start()
    try:
        _status_rest(res, state_dir, fatal)
    finally:
        smi.join()
    if failed:
        raise failed[0]


def _status_rest(res, state_dir, fatal):
    st = res["state"]
    try:
        dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        dfd = None
    if dfd is not None:
        try:
            cur = _read_lock(dfd)
            if cur is not None:
                cur.pop("token", None)  # the holder's token is its own
                res["lock"] = cur
        except OSError:
            res["lock"] = {"holder": "unreadable"}
        finally:
            os.close(dfd)
    if st and not st.get("corrupt"):
        port = st.get("port")
        key = core.SECRETS.get("api_key")
        host = serving_host(st)
        if port:
            hs, _ = http(port, "/health", timeout=2, host=host)
            res["health"] = hs
            if hs == 200:
                if key:
                    ok, problem = listener_check(st, port)
                    if not ok:
                        key = None
                        res["listener_problem"] = problem
                ms, body = http(port, "/v1/models", timeout=3, api_key=key, host=host)
                res["models_status"] = ms
                try:
                    res["models"] = [m.get("id") for m in core.loads(body).get("data", [])] if ms == 200 else None
                except ValueError:
                    res["models"] = None
                ms, body = http(port, "/metrics", timeout=3, host=host)
                res["metrics"] = body if ms == 200 else None
        if st.get("drafter_path"):
            try:
                res["drafter_sha256"] = sha256_file(st["drafter_path"])
            except OSError as e:
                res["drafter_sha256"] = None
                res["drafter_error"] = e.strerror
        res["supervision"] = sup = supervision(st)
        mem = _read_json(os.path.join(state_dir, "memory.json"))
        if isinstance(mem, dict) and mem.get("pid") == st.get("pid") and \
                mem.get("started_at") == st.get("started_at") and isinstance(mem.get("lines"), list):
            res["memory_lines"] = [str(x)[-300:] for x in mem["lines"][:12]]
        res["weights"] = serving_weights(st, state_dir)
        res["tune"] = _read_json(os.path.join(state_dir, "tune.json"))  # deploy tune's last verdict (tune_record)
        if not st.get("alive"):
            if st.get("unit"):
                ex = sup.get("last_exit") or {}
                res["exit_code"] = ex.get("status") if ex.get("code") == "exited" else None
            else:
                res["exit_code"] = read_exit_code(state_dir, 0)
        if not st.get("alive") or res.get("health") != 200 or (sup.get("restarts") or 0) > 0:
            if st.get("unit"):  # this launch's lines only, by systemd invocation (issue 26)
                entries = unit_error_entries(st["unit"], st.get("started_at"))
            else:  # the log file is this launch's (launch rotates it)
                entries = [(None, ln) for ln in tail_file(st.get("log_path") or "", 400)]
            # the line that names the cause (vLLM's known startup failures) over the wrapper's last words
            # (the table is ordered specific first: "CUDA out of memory" before "Engine core initialization failed")
            res["last_error"] = pick_last_error(entries, fatal)
    else:
        res["vllm_processes"] = vllm_processes()
        res["supervision"] = {"supervisor": "none", "systemd_running": systemd_running()}
    res.update(gate_status(state_dir, st))
    failure = _read_json(os.path.join(state_dir, "last_failure.json"))
    if failure:
        res["last_failure"] = failure
        try:
            res["stopped_at"] = os.path.getctime(  # rename sets ctime: when it was stopped
                os.path.join(state_dir, "state.stopped.json"))
        except OSError:
            res["stopped_at"] = None
