"""`router`: vllm-router in front of the replicas of a playbook with `router:`: its venv installed (as
install-vllm: without pip, filled by the base Python's pip), started (under systemd where it runs, else setsid),
its view of the replicas, the gate through it, a drained stop."""

import base64
import json
import os
import shutil
import signal
import subprocess
import time

from .core import clean, emit, now, wait_while
from .files import UnsafeDirectory, open_dir, remove_owned, write_json_atomic, write_owned
from .net import http, listener_check
from .procs import alive, proc_starttime
from .protocol import M_REQUEST_SUCCESS, M_RUNNING
from .state import read_json_state, signal_proven
from .runner import _pip_ok, index_opts
from .stack import record_check
from .systemd import UNIT_DIR, journal, systemctl, systemd_running, unit_quote, unit_show, unit_stop
from . import core


ROUTER_LAUNCHER = (
    # vllm-router 0.1.17's CLI does not expose api_key_validation_urls, which its Rust router takes: parse the
    # CLI's own arguments with its own parser and start the same Rust router with the URLs (from the environment).
    # One line: it goes into the unit's ExecStart=.
    "import os, sys; from vllm_router.launch_router import parse_router_args; "
    "from vllm_router.router import policy_from_str; from vllm_router_rs import Router; "
    "a = dict(vars(parse_router_args(sys.argv[1:]))); a.pop('mini_lb', None); "
    "a.update({k: policy_from_str(a.get(k)) for k in ('policy', 'prefill_policy', 'decode_policy')}, "
    "prefill_urls=None, decode_urls=None, "
    "api_key_validation_urls=os.environ.get('VPD_ROUTER_KEY_CHECK_URLS', '').split()); Router(**a).start()")


def _router_dir(a):
    return os.path.join(a["state_dir"], "router-" + a["playbook"])


def _router_unit(a):
    return "vllm-router-%s.service" % a["playbook"]


def _router_state(a):
    """router.json, read with the rules of the vLLM state (issue 36 item 3): the router directory root-owned and
    private, the file regular, root-owned, not writable by others, no symlinks (files.read_state_file); the unit it
    names must be exactly this playbook's (`vllm-router-PLAYBOOK.service`), the pid a plain number. None when absent;
    {"corrupt": why, "path": ...} when it may not be used (nothing is then signalled, stopped or deleted)."""
    path = os.path.join(_router_dir(a), "router.json")
    st, err = read_json_state(path)
    if err is not None:
        return {"corrupt": clean(str(err))[:500], "path": path}
    if st is None:
        return None
    unit, pid = st.get("unit"), st.get("pid")
    if unit is not None and unit != _router_unit(a):
        return {"corrupt": "it names the unit %r, not %s: not written by deploy, not used (fix: remove it)"
                           % (clean(str(unit))[:100], _router_unit(a)), "path": path}
    if pid is not None and (type(pid) is not int or pid <= 1):
        return {"corrupt": "its pid %r is not a process deploy started: not used (fix: remove it)"
                           % (clean(str(pid))[:40],), "path": path}
    return st


def _router_proof(st):
    """The record that proves the router's own processes (state.proven): its leader (the unit's MainPID under
    systemd, else the recorded pid with its start time) leads its own process group (start_new_session / systemd)."""
    if not st or st.get("corrupt"):
        return None
    if st.get("unit") and systemd_running():
        pid = int(unit_show(st["unit"]).get("MainPID") or 0)
        return {"pid": pid, "pgid": pid, "starttime": proc_starttime(pid)} if pid else None
    if st.get("pid"):
        return {"pid": st["pid"], "pgid": st["pid"], "starttime": st.get("starttime")}
    return None


def _router_key():
    return (core.SECRETS or {}).get("router_key") if isinstance(core.SECRETS, dict) else None


def _router_http(a, path, method="GET", timeout=5.0, body=None, st=None):
    """A request to the router, only once its listener is proven (issue 36 item 4): every process listening on the
    port must be the router deploy started (net.listener_check), so neither the API key nor our trust in the answer
    goes to a stranger. -> (status, body); (None, why) when nothing was sent."""
    st = st if st is not None else _router_state(a)
    if not st or st.get("corrupt"):
        return None, ("no router of deploy's runs here (%s): nothing was sent"
                      % (st.get("corrupt") if st else "no router.json"))
    ok, problem = listener_check(_router_proof(st), int(a["port"]))
    if not ok:
        return None, problem.replace("the API key was not sent", "the request (and its API key) was not sent")
    return http(int(a["port"]), path, method=method, body=body, timeout=timeout, api_key=_router_key(),
                host=a.get("connect") or "127.0.0.1")


def _split_url(url):
    rest = url.split("://", 1)[-1]
    hostport = rest.split("/", 1)[0]
    if hostport.startswith("["):
        h, _, p = hostport[1:].partition("]:")
    else:
        h, _, p = hostport.rpartition(":")
    return h, int(p)


def _replica_metrics(url, timeout=5.0):
    """{success, running} from a replica's /metrics (vLLM serves it without the API key), or {error}."""
    h, p = _split_url(url)
    code, text = http(p, "/metrics", timeout=timeout, host=h)
    if code != 200:
        return {"error": "GET %s/metrics: %s" % (url, code or text)}
    out = {"success": 0.0, "running": 0.0}
    for ln in text.splitlines():
        if ln.startswith(M_REQUEST_SUCCESS + "_total"):
            out["success"] += float(ln.rsplit(" ", 1)[1])
        elif ln.startswith(M_RUNNING):
            out["running"] += float(ln.rsplit(" ", 1)[1])
    return out


def _router_venv_python(a):
    return os.path.join(a["venv"], "bin", "python")


def _router_site(py):
    p = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    return p.stdout.decode().strip()


def _router_installed(a):
    """The venv's vllm-router: version, RECORD check, import. -> dict with ok."""
    py = _router_venv_python(a)
    if not os.path.exists(py):
        return {"ok": False, "present": False, "message": "no venv at %s" % a["venv"]}
    try:
        site = _router_site(py)
        rec = record_check(os.path.join(site, "vllm_router"), dist="vllm-router")
        p = subprocess.run([py, "-c", "import vllm_router_rs, importlib.metadata as m; "
                                      "print(m.version('vllm-router'))"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "present": True, "message": "cannot run %s: %s" % (py, e)}
    version = p.stdout.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    out = {"present": True, "version": version[0] if p.returncode == 0 else None, "record": rec,
           "import_ok": p.returncode == 0}
    if p.returncode:
        out.update(ok=False, message="import vllm_router_rs failed: %s" % clean(p.stdout.decode("utf-8", "replace"))[-600:])
    elif rec.get("status") != "ok":
        out.update(ok=False, message="the installed files differ from the wheel's RECORD: %s"
                   % (rec.get("message") or "%d missing, %d changed" % (len(rec["missing"]), len(rec["changed"]))))
    elif out["version"] != a["version"]:
        out.update(ok=False, message="vllm-router %s installed, %s pinned" % (out["version"], a["version"]))
    else:
        out.update(ok=True)
    return out


def _router_install(a):
    have = _router_installed(a)
    if have.get("ok"):
        return dict(have, changed=False)
    t0 = now()
    deadline = t0 + float(a.get("timeout_s") or 900)
    venv = a["venv"]
    parent = os.path.dirname(venv)
    try:
        os.close(open_dir(parent, 0o700))
    except (OSError, UnsafeDirectory) as e:
        return {"ok": False, "message": "refusing to install into %s: %s" % (parent, e)}
    if os.path.lexists(venv):
        # ours (a venv under our state dir, named by version): remove what a failed install left
        if os.path.islink(venv) or not os.path.exists(os.path.join(venv, "pyvenv.cfg")):
            return {"ok": False, "message": "%s exists and is not a venv deploy made: not touching it" % venv}
        shutil.rmtree(venv)
    base, vpy = a["python"], os.path.join(venv, "bin", "python")
    # as install_vllm does: a venv without pip, filled by the base Python's pip (--python, pip >= 22.3); else
    # ensurepip in the new venv (a Debian python3 without python3-venv has neither)
    steps = [[base, "-m", "venv", "--without-pip", venv]]
    if _pip_ok(base):
        pip = [base, "-m", "pip", "--python", vpy]
    else:
        steps.append([vpy, "-m", "ensurepip", "--default-pip"])
        pip = [vpy, "-m", "pip"]
    pip += ["install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"] + index_opts(a)
    steps.append(pip + ["vllm-router==" + a["version"]])
    for cmd in steps:
        left = deadline - now()
        if left <= 0:
            return {"ok": False, "message": "install not finished within %gs" % float(a.get("timeout_s") or 900)}
        emit(event="router", line="$ " + " ".join(cmd))
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=left, cwd="/")
        except subprocess.TimeoutExpired:
            return {"ok": False, "message": "%s did not finish within %gs" % (" ".join(cmd[:4]), left)}
        except OSError as e:
            return {"ok": False, "message": "cannot run %s: %s" % (cmd[0], e.strerror)}
        if p.returncode:
            return {"ok": False, "message": "%s failed (exit %d)" % (" ".join(cmd[:6]), p.returncode),
                    "output": clean(p.stdout.decode("utf-8", "replace"))[-3000:]}
    have = _router_installed(a)
    return dict(have, changed=True, seconds=round(now() - t0, 2))


def _router_alive(st):
    return bool(st) and st.get("pid") and proc_starttime(st["pid"]) == st.get("starttime")


def _router_stop(a, st=None):
    """Stop the router deploy started: its unit (the name validated in _router_state), else its proven processes
    only (state.signal_proven: the recorded leader by its start time, its group). A router.json that may not be used
    stops nothing and says why."""
    st = st if st is not None else _router_state(a)
    rep = {"stopped": False}
    if not st:
        return rep
    if st.get("corrupt"):
        return dict(rep, refused="%s: %s" % (st.get("path"), st["corrupt"]))
    if st.get("unit") and systemd_running():
        rep["unit"] = unit_stop(st["unit"], timeout=float(a.get("grace_s") or 10) + 30)
        remove_owned(UNIT_DIR, st["unit"])
        systemctl(["daemon-reload"])
        rep["stopped"] = True
    elif _router_alive(st):
        proof = _router_proof(st)
        pid = st["pid"]
        signal_proven(proof, signal.SIGTERM)
        wait_while(lambda: alive(pid), float(a.get("grace_s") or 10))
        if alive(pid) and signal_proven(proof, signal.SIGKILL):
            rep["killed"] = True
        rep.update(stopped=True, pid=pid)
    d = _router_dir(a)
    for n in ("router.json", "router.env"):
        remove_owned(d, n)
    return rep


def _router_start(a):
    d = _router_dir(a)
    try:
        dfd = open_dir(d, 0o700)
    except (OSError, UnsafeDirectory) as e:
        return {"ok": False, "message": "refusing to use %s: %s" % (d, e)}
    old = _router_state(a)
    if old and old.get("corrupt"):
        os.close(dfd)
        return {"ok": False, "message": "refusing to replace the router: %s: %s" % (old.get("path"), old["corrupt"])}
    prev = _router_stop(a, old) if old else None
    argv = [_router_venv_python(a), "-c", ROUTER_LAUNCHER] + list(a["args"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "VPD_ROUTER_KEY_CHECK_URLS": " ".join(a.get("key_check_urls") or [])}
    st = {"playbook": a["playbook"], "argv": argv, "workers": a["workers"], "policy": a["policy"],
          "port": a["port"], "version": a["version"], "started_at": now()}
    if systemd_running():
        unit = _router_unit(a)
        s = a["supervise"]
        env_file = os.path.join(d, "router.env")
        try:
            exec_start = "ExecStart=" + " ".join(unit_quote(x) for x in argv)
            env_lines = ["Environment=" + unit_quote("%s=%s" % (k, v)) for k, v in sorted(env.items())]
        except ValueError as e:
            os.close(dfd)
            return {"ok": False, "message": "cannot write the unit: %s" % e}
        lines = ["# Written by vllm-pve-deploy (`deploy up %s`): deploy rewrites it; edit the playbook." % a["playbook"],
                 "[Unit]", "Description=vLLM Router for playbook %s (vllm-pve-deploy)" % a["playbook"],
                 "After=network.target", "StartLimitBurst=%d" % int(s["start_limit_burst"]),
                 "StartLimitIntervalSec=%gs" % float(s["start_limit_interval_s"]), "",
                 "[Service]", "Type=simple", exec_start, "WorkingDirectory=/"]
        lines += env_lines
        lines += ["# secrets: only in this 0600 file (the router itself needs none today: see docs/router.md)",
                  "EnvironmentFile=" + env_file, "StandardOutput=journal", "StandardError=inherit",
                  "SyslogIdentifier=vllm-router-%s" % a["playbook"], "KillMode=control-group",
                  "TimeoutStopSec=10s", "Restart=on-failure", "RestartSec=%gs" % float(s["restart_sec"]), "",
                  "[Install]", "WantedBy=multi-user.target", ""]
        try:
            write_owned(d, "router.env", b"", 0o600)
            changed, sha = write_owned(UNIT_DIR, unit, "\n".join(lines).encode(), 0o644)
        except (OSError, UnsafeDirectory, ValueError) as e:
            os.close(dfd)
            return {"ok": False, "message": "cannot write the unit: %s" % e}
        for cmd in [["daemon-reload"], ["reset-failed", unit], ["enable", "--quiet", unit], ["restart", unit]]:
            rc, out = systemctl(cmd)
            if rc and cmd[0] != "reset-failed":
                os.close(dfd)
                return {"ok": False, "message": "systemctl %s failed (exit %d): %s" % (" ".join(cmd), rc, out[-2000:])}
        u = unit_show(unit)
        pid = int(u.get("MainPID") or 0)
        st.update(supervisor="systemd", unit=unit, unit_path=os.path.join(UNIT_DIR, unit), env_file=env_file,
                  unit_sha256=sha, pid=pid, starttime=proc_starttime(pid) if pid else None, log="journal")
    else:
        log = os.path.join(d, "router.log")
        try:
            logfd = os.open("router.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        except OSError as e:
            os.close(dfd)
            return {"ok": False, "message": "cannot open %s: %s" % (log, e.strerror)}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfd, stderr=subprocess.STDOUT, env=env,
                                    cwd="/", start_new_session=True, close_fds=True)
        except OSError as e:
            return {"ok": False, "message": "cannot start %s: %s" % (argv[0], e.strerror)}
        finally:
            os.close(logfd)
        st.update(supervisor="none", pid=proc.pid, starttime=proc_starttime(proc.pid), log=log)
    os.close(dfd)
    write_json_atomic(os.path.join(d, "router.json"), st)
    return {"ok": True, "pid": st["pid"], "supervisor": st["supervisor"], "unit": st.get("unit"),
            "replaced": prev, "log": st["log"]}


def _router_log_tail(st, n=30):
    if not st:
        return []
    if st.get("unit"):
        return [clean(x) for x in journal(["-u", st["unit"], "-n", str(n), "-o", "cat"])]
    try:
        with open(st["log"], "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 16384))
            return [clean(x) for x in fh.read().decode("utf-8", "replace").splitlines()[-n:]]
    except (OSError, KeyError, TypeError):
        return []


def _router_view(a, circuits=True):
    """The router's own view: {running, pid, supervisor, readiness, workers: [{url, healthy, load}], circuits}
    (circuits=False: without the breaker gauge, for the wait's polls)."""
    st = _router_state(a)
    out = {"installed": bool(st), "state": st, "running": False}
    if not st:
        return out
    if st.get("corrupt"):
        out.update(installed=False, error="router.json not used: %s" % st["corrupt"])
        return out
    if st.get("unit") and systemd_running():
        u = unit_show(st["unit"])
        pid = int(u.get("MainPID") or 0)
        out.update(unit_state={k: u.get(k) for k in ("ActiveState", "SubState", "NRestarts", "Result")},
                   pid=pid or None, running=bool(pid) and u.get("ActiveState") == "active")
    else:
        out.update(pid=st.get("pid"), running=bool(_router_alive(st)))
    out["supervisor"] = st.get("supervisor")
    if out["running"]:
        code, body = _router_http(a, "/workers", timeout=float(a.get("timeout_s") or 5), st=st)
        if code == 200:
            try:
                ws = json.loads(body).get("workers") or []
                out["workers"] = [{"url": w.get("url"), "healthy": w.get("is_healthy"), "load": w.get("load")}
                                  for w in ws]
            except (ValueError, AttributeError) as e:
                out["error"] = "GET /workers: not JSON (%s)" % e
        else:
            out["error"] = "GET /workers: %s %s" % (code, (body or "")[:200])
        code, body = _router_http(a, "/readiness", timeout=float(a.get("timeout_s") or 5), st=st)
        out["readiness"] = {"status": code, "body": (body or "")[:300]}
        if circuits:
            out.update(_router_circuit_fields(a, st))
    return out


def _router_circuit_fields(a, st):
    cb = _router_circuits(a, st)
    return {"circuits": cb["circuits"]} if cb["ok"] else {"circuits": None, "circuits_error": cb["message"]}


CB_STATES = {0: "closed", 1: "open", 2: "half_open"}  # vllm_router_cb_state's values (measured, docs/router.md)
CB_METRIC = 'vllm_router_cb_state{worker="'


def _router_circuits(a, st=None):
    """Each worker's circuit breaker as the router itself reports it: its Prometheus gauge `vllm_router_cb_state`
    (0 closed, 1 open, 2 half-open) on --prometheus-port (the router's port + 1, bound to 127.0.0.1), read once
    its listener is proven the router's (as _router_http). /workers says is_healthy: true while a circuit is open
    (vllm-router #158, measured): only this tells that the router sends a worker nothing.
    -> {ok, circuits: {url: state}} or {ok: False, message}. A worker with no gauge yet has had no outcome."""
    st = st if st is not None else _router_state(a)
    if not st or st.get("corrupt"):
        return {"ok": False, "message": "no router of deploy's runs here"}
    port = int(a["port"]) + 1
    ok, problem = listener_check(_router_proof(st), port)
    if not ok:
        return {"ok": False, "message": "metrics port %d: %s" % (port, problem.replace(": the API key was not sent", ""))}
    code, text = http(port, "/metrics", timeout=float(a.get("timeout_s") or 5))
    if code != 200:
        return {"ok": False, "message": "GET 127.0.0.1:%d/metrics: %s" % (port, code or text)}
    out = {}
    for ln in text.splitlines()[:20000]:
        if ln.startswith(CB_METRIC) and len(out) < 256:
            url, _, rest = ln[len(CB_METRIC):].partition('"}')
            try:
                out[url[:300]] = CB_STATES.get(int(float(rest.strip())), "unknown")
            except ValueError:
                out[url[:300]] = "unknown"
    return {"ok": True, "circuits": out}


def _router_wait(a):
    """Until the router answers and sees every expected worker healthy (bounded), or its process is gone."""
    deadline = now() + float(a.get("timeout_s") or 60)
    want = set(a["workers"])
    while True:
        last = _router_view(a, circuits=False)
        healthy = {w["url"] for w in last.get("workers") or [] if w.get("healthy")}
        if last.get("running") and want <= healthy:  # ready: with the breakers as they stand (up re-adds open ones)
            return dict(last, ready=True, **_router_circuit_fields(a, last["state"]))
        if not last.get("running") and now() - float((last.get("state") or {}).get("started_at") or 0) > 2:
            return dict(last, ready=False, reason="exited", log_tail=_router_log_tail(last.get("state")))
        if now() >= deadline:
            return dict(last, ready=False, reason="timeout", missing=sorted(want - healthy),
                        log_tail=_router_log_tail(last.get("state")))
        time.sleep(0.2)


def _router_gate(a):
    """n completions through the router (distinct prompts), and each replica's request counter before/after."""
    before = {u: _replica_metrics(u) for u in a["workers"]}
    sent, ok, errors = 0, 0, []
    for i in range(int(a["requests"])):
        body = {"model": a["model"], "prompt": "router gate %d: %s" % (i, base64.b32encode(os.urandom(5)).decode()),
                "max_tokens": int(a.get("max_tokens") or 4), "temperature": 0}
        code, text = _router_http(a, "/v1/completions", method="POST", body=body,
                                  timeout=float(a.get("timeout_s") or 60))
        sent += 1
        if code == 200:
            ok += 1
        else:
            errors.append({"status": code, "body": (text or "")[:300]})
    after = {u: _replica_metrics(u) for u in a["workers"]}
    per = {}
    for u in a["workers"]:
        b, f = before[u], after[u]
        per[u] = {"error": b.get("error") or f.get("error")} if (b.get("error") or f.get("error")) else \
            {"requests": int(round(f["success"] - b["success"]))}
    return {"ok": ok == sent, "sent": sent, "succeeded": ok, "errors": errors[:5], "per_replica": per}


def _router_drain_wait(a):
    """After remove_worker: until the replica runs no request (its own vllm:num_requests_running), bounded."""
    t0 = now()
    deadline = t0 + float(a.get("timeout_s") or 120)
    while True:
        last = _replica_metrics(a["url"], timeout=5.0)
        if "error" in last:
            return {"ok": True, "drained": True, "seconds": round(now() - t0, 2), "note": last["error"]}
        if last["running"] <= 0:
            return {"ok": True, "drained": True, "seconds": round(now() - t0, 2), "running": 0}
        if now() >= deadline:
            return {"ok": False, "drained": False, "seconds": round(now() - t0, 2), "running": last["running"]}
        time.sleep(0.1)


OPS = {"install": _router_install, "start": _router_start, "wait": _router_wait, "view": _router_view,
       "gate": _router_gate, "drain_wait": _router_drain_wait, "stop": lambda a: dict(_router_stop(a), ok=True)}


def act_router(a):
    op = a.get("op")
    if op in OPS:
        return OPS[op](a)
    if op in ("remove", "add"):
        code, body = _router_http(a, "/%s_worker?url=%s" % (op, a["url"]), method="POST",
                                  timeout=float(a.get("timeout_s") or 30))
        return {"ok": code == 200, "status": code, "message": (body or "")[:500], "sent": code is not None}
    return {"ok": False, "message": "unknown router op %r" % op}
