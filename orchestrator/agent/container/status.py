"""`status` (deploy status, and `current` before an up): what runs now, read in one exec: the state file,
/health, /v1/models, /metrics, the drafter config's sha256, the lock, systemd's view, the last error line, the last
recorded failure; nvidia-smi runs in a thread meanwhile. Imports only what it reads (no installer, verify, doctor)."""

import json
import os
import re

from .core import _read_json, sha256_file
from .files import tail_file
from .gpus import read_gpu_memory
from .lock import _read_lock
from .net import http, listener_check, serving_host
from .procs import vllm_processes
from .state import read_exit_code, read_state
from .systemd import journal, supervision, systemd_running
from . import core


def act_status(a):
    import threading

    state_dir = a["state_dir"]
    res = {"state": read_state(state_dir), "memory": None, "_fatal": a.get("fatal_regex")}
    argv = (res["state"] or {}).get("argv") or []
    if argv and isinstance(argv[0], str):
        res["argv0_real_now"] = os.path.realpath(argv[0])
    failed = []

    def gpu():  # nvidia-smi (tens of ms here, often hundreds on real GPUs) runs while the HTTP checks run
        try:
            res["memory"] = read_gpu_memory(a.get("nvidia_smi_timeout_s", 5))
        except BaseException as e:  # noqa: BLE001 - re-raised below, as if it had run inline
            failed.append(e)

    smi = threading.Thread(target=gpu)
    smi.start()
    try:
        _status_rest(res, state_dir)
    finally:
        smi.join()
    if failed:
        raise failed[0]
    res.pop("_fatal", None)
    return res


def _status_rest(res, state_dir):
    st = res["state"]
    try:
        dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        dfd = None
    if dfd is not None:
        try:
            cur, _ = _read_lock(dfd)
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
                    res["models"] = [m.get("id") for m in json.loads(body).get("data", [])] if ms == 200 else None
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
        if not st.get("alive"):
            if st.get("unit"):
                ex = sup.get("last_exit") or {}
                res["exit_code"] = ex.get("status") if ex.get("code") == "exited" else None
            else:
                res["exit_code"] = read_exit_code(state_dir, 0)
        if not st.get("alive") or res.get("health") != 200 or (sup.get("restarts") or 0) > 0:
            if st.get("unit"):  # the server's own lines (not systemd's about it)
                lines = journal(["_SYSTEMD_UNIT=" + st["unit"], "-o", "cat", "-n", "400"])
            else:
                lines = tail_file(st.get("log_path") or "", 400)
            errs = [ln for ln in lines if re.search(r"Error|error:|Traceback|died|failed", ln)]
            # the line that names the cause (vLLM's known startup failures) over the wrapper's last words
            # (the table is ordered specific first: "CUDA out of memory" before "Engine core initialization failed")
            named = next(([ln for ln in errs if rx.search(ln)] for rx in map(re.compile, res.get("_fatal") or [])
                          if any(rx.search(ln) for ln in errs)), None)
            res["last_error"] = (named or errs)[-1][-4000:] if errs else None
    else:
        res["vllm_processes"] = vllm_processes()
        res["supervision"] = {"supervisor": "none", "systemd_running": systemd_running()}
    failure = _read_json(os.path.join(state_dir, "last_failure.json"))
    if failure:
        res["last_failure"] = failure
        try:
            res["stopped_at"] = os.path.getctime(  # rename sets ctime: when it was stopped
                os.path.join(state_dir, "state.stopped.json"))
        except OSError:
            res["stopped_at"] = None
