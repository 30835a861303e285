"""vLLM Router (`vllm-router`) in front of a playbook's replicas: one URL for the fleet (issue 29, docs/router.md).

The router runs in one container of the inventory (`router.host`/`router.vmid`, never on a Proxmox host). This
module is the tool's side: `up` installs the pinned vllm-router (a venv in the state dir, RECORD-checked), starts
it with the replicas that passed their gates (systemd unit `vllm-router-PLAYBOOK.service` where the container runs
systemd, else detached), waits until it sees them healthy, and gates the whole (completions through it succeed and
reach every replica, counted by each replica's own `vllm:request_success_total`). `drain`/`add_back` are the
rolling restart's hooks (the router's own `POST /remove_worker` / `/add_worker`); `view` is the status row;
`down` stops it. The container side is the agent's `router` action.
"""

from __future__ import annotations

import dataclasses
import os
import time

from orchestrator.steps import call_on
from orchestrator.steps.plan import Step, step_on
from orchestrator.core.endpoint import base_url
from orchestrator.core.errors import DeployError, Unreachable
from orchestrator.core.remote import Fleet, shell_join
from orchestrator.core.report import Progress
from orchestrator.core.spec import Playbook

HEALTH_TIMEOUT_S = 5  # vllm-router --health-check-timeout-secs (its default)


class RouterFailed(DeployError):
    pass


def replica_url(inv, pb: Playbook, member: Playbook) -> str:
    """The URL the router reaches a replica at: its container's inventory address (127.0.0.1 in the router's own
    container when that has none) and serve.port."""
    r = pb.conf.router
    host = inv.hosts.get(member.host) if inv is not None else None
    ct = host.container(member.vmid) if host is not None else None
    addr = ct.address if ct is not None else None
    if not addr and (member.host, member.vmid) == (r.host, r.vmid):
        addr = "127.0.0.1"
    if not addr:
        raise RouterFailed(f"{member.host}/{member.vmid} has no address in the inventory: the router cannot reach it",
                           where=f"{member.host}/{member.vmid}", fix=f"deploy discover {member.host} --write")
    return base_url(addr, member.conf.serve.port)


def _base(pb: Playbook) -> dict:
    r = pb.conf.router
    sd = pb.conf.runtime.state_dir
    return {"state_dir": sd, "playbook": pb.name, "venv": os.path.join(sd, f"router-venv-{r.version}"),
            "version": r.version, "port": r.port, "connect": "127.0.0.1" if r.listen in WILDCARD else r.listen}


WILDCARD = ("0.0.0.0", "::", "[::]")


def exposure_warning(pb: Playbook) -> str | None:
    """Issue 41: without serve.api_key_env every router endpoint is open (docs/router.md#api-keys), `/add_worker`
    and `/remove_worker` included; bound to every address, anyone who reaches the container can take the replicas
    out or add a worker of theirs and receive the clients' requests. Said by `plan` and `up`, not refused (a
    closed network is the user's to judge)."""
    r = pb.conf.router
    if not r or pb.conf.serve.api_key_env or r.listen not in WILDCARD:
        return None
    return (f"router {r.where} listens on {r.listen}:{r.port} without an API key: anyone who reaches that "
            "port can call /remove_worker and /add_worker (take the replicas out, or add a server of theirs that "
            "then receives your clients' requests). Close it: set serve.api_key_env (the router then accepts only "
            "the replicas' key, on every endpoint), or set router.listen to an address only your clients reach "
            "(docs/playbooks.md#router)")


def router_argv_args(pb: Playbook, workers: list[str]) -> list[str]:
    """vllm-router's own arguments (after the launcher): exactly what the unit/process runs."""
    r = pb.conf.router
    return ["--host", r.listen, "--port", str(r.port), "--worker-urls", *workers, "--policy", r.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(r.metrics_port),
            "--health-check-interval-secs", str(r.health_check_interval_s),
            "--health-failure-threshold", str(r.health_failure_threshold),
            "--health-check-timeout-secs", str(HEALTH_TIMEOUT_S),
            "--worker-startup-timeout-secs", "120", "--worker-startup-check-interval", "1",
            "--log-level", "info"]


def _key(pb: Playbook) -> str | None:
    env = pb.conf.serve.api_key_env
    return os.environ.get(env) if env else None


def step(pb: Playbook, op: str, timeout: float = 60.0, *, runs=(), when=None, **kw) -> Step:
    """One request to the router's container: the agent action `router`, op OP (RUNS: what it amounts to, shown by
    deploy plan; WHEN: the condition up sends it under, described by its docstring)."""
    r = pb.conf.router
    args = dict(_base(pb), op=op, timeout_s=kw.pop("op_timeout", None) or max(1.0, timeout - 10), **kw)
    st = step_on(r.host, r.vmid, r.python, f"router-{op}", "router", args, timeout, f"router {op}")
    st.runs, st.when = list(runs), when
    return st


def send(fleet: Fleet, pb: Playbook, st: Step, on_event=None) -> dict:
    key = _key(pb)
    if key:
        fleet.redact.add(key)
    res = call_on(fleet.session(pb.conf.router.host), st, secrets={"router_key": key} if key else None,
                  on_event=on_event)
    return res.as_dict()  # RouterResult, checked; its per-op fields are data this module reads as such


def call(fleet: Fleet, pb: Playbook, op: str, *, timeout: float = 60.0, on_event=None, **kw) -> dict:
    return send(fleet, pb, step(pb, op, timeout, **kw), on_event)


def _differs(view: dict, args: list[str]) -> bool:
    """the router that runs (view) has other arguments, or none runs"""
    return not (view.get("running") and ((view.get("state") or {}).get("argv") or [])[3:] == args)


def up_steps(pb: Playbook, workers: list[str]) -> list[Step]:
    """up's requests to the router's container, in order, as `deploy plan PLAYBOOK` shows them: install, view, start
    (only when what runs differs), wait (then each open circuit breaker re-added: _reset_open_circuits), gate."""
    r = pb.conf.router
    ins, venv, args = r.install, _base(pb)["venv"], router_argv_args(pb, workers)
    n = r.gate_requests_per_replica * len(workers)
    return [
        step(pb, "install", ins.timeout_s + 60, python=r.python, index_url=ins.index_url,
             find_links=list(ins.find_links), no_index=ins.no_index, op_timeout=ins.timeout_s,
             runs=[f"{r.python} -m venv {venv}; pip install vllm-router=={r.version} (skipped when installed and "
                   "intact); every file checked against its RECORD, the version, import vllm_router_rs"]),
        step(pb, "view", 30, runs=["the running router's state and arguments"]),
        step(pb, "start", 90, when=_differs, args=args, workers=workers, policy=r.policy,
             key_check_urls=[u + "/v1/models" for u in workers] if _key(pb) else [],
             supervise=dataclasses.asdict(pb.conf.supervise),
             runs=[f"unit vllm-router-{pb.name}.service where systemd runs, else detached: {venv}/bin/python -c "
                   f"LAUNCHER {shell_join(args)}"]),
        step(pb, "wait", 90, workers=workers, op_timeout=60,
             runs=["until GET /workers shows every replica healthy (60 s); then each replica's circuit breaker "
                   "(vllm_router_cb_state on 127.0.0.1:port+1): one not closed (opened by failures while replicas "
                   "were down) is re-added: POST /remove_worker, then /add_worker"]),
        step(pb, "gate", 180, workers=workers, model=pb.conf.serve.served_model_name, requests=n, op_timeout=60,
             runs=[f"{n} completions through it; each replica's vllm:request_success_total must grow"]),
    ]


def _fail(pb, message, fix, **details):
    raise RouterFailed(message, where=pb.conf.router.where, fix=fix, details=details or None)


def up(fleet: Fleet, pb: Playbook, progress: Progress, passed: list[Playbook]) -> dict:
    """Install (if needed), (re)start with the replicas that passed, wait until it sees them healthy, gate.
    -> the router section of the fleet result: {ok, where, url, workers, gate, ...}; raises nothing: a failure is
    the section's error (the replicas keep serving either way)."""
    r = pb.conf.router
    w = r.where
    t0 = time.monotonic()
    out = {"where": w, "port": r.port, "policy": r.policy, "version": r.version, "ok": False}
    warning = exposure_warning(pb)
    if warning:
        out["warnings"] = [warning]
    try:
        if not passed:
            _fail(pb, "not started: no replica passed its gates", "fix the replicas (above), then deploy up again")
        out["workers"] = workers = [replica_url(fleet.inventory, pb, m) for m in passed]
        install, view_step, start, wait, gate = up_steps(pb, workers)
        progress.say(w, f"router: vllm-router=={r.version} in {_base(pb)['venv']} (installed if missing, then "
                        "checked against its RECORD)")
        res = send(fleet, pb, install,
                   on_event=lambda e: progress.say(w, "router: " + str(e.get("line", ""))[:300]) if e.get("line")
                   else None)
        if not res.get("ok"):
            _fail(pb, f"router install failed: {res.get('message')}",
                  "see the output above; router.install in the playbook sets where pip finds vllm-router "
                  "(index_url, find_links, no_index)", output=res.get("output"))
        out["install"] = {"changed": res.get("changed"), "version": res.get("version"),
                          "record": (res.get("record") or {}).get("message")}
        view = send(fleet, pb, view_step)
        if not _differs(view, start.args["args"]):  # start.when: what deploy plan shows of this test
            progress.say(w, f"router: already running with these {len(workers)} replica(s) (pid {view.get('pid')})")
            out["status"] = "already up"
        else:
            res = send(fleet, pb, start)
            if not res.get("ok"):
                _fail(pb, f"router did not start: {res.get('message')}", "see docs/troubleshooting.md#router")
            progress.say(w, f"router: started ({res.get('supervisor') == 'systemd' and res.get('unit') or 'detached, not supervised'}"
                            f", pid {res.get('pid')}) on port {r.port}, policy {r.policy}")
            out.update(status="up", supervisor=res.get("supervisor"), unit=res.get("unit"), pid=res.get("pid"))
        res = send(fleet, pb, wait)
        if not res.get("ready"):
            tail = "\n".join((res.get("log_tail") or [])[-15:])
            why = ("its process exited" if res.get("reason") == "exited" else
                   f"not every replica healthy in its view within 60 s (missing: {', '.join(res.get('missing') or [])})")
            _fail(pb, f"router not ready: {why}" + (f"\nlast lines of its log:\n{tail}" if tail else ""),
                  f"deploy status {pb.name} shows the replicas (they keep serving on their own addresses); "
                  "docs/troubleshooting.md#router")
        out["circuits_reset"] = _reset_open_circuits(fleet, pb, progress, workers, res)
        n = gate.args["requests"]
        res = send(fleet, pb, gate)
        out["gate"] = {"sent": res.get("sent"), "succeeded": res.get("succeeded"),
                       "per_replica": res.get("per_replica"), "errors": res.get("errors")}
        if not res.get("ok"):
            first = (res.get("errors") or [{}])[0]
            _fail(pb, f"router gate: {res.get('succeeded')} of {res.get('sent')} completions through the router "
                      f"succeeded; first error: {first}",
                  ("the router's circuit breakers are open (failures it saw while replicas were down): "
                   f"deploy up {pb.name} re-adds the workers, which resets them; docs/troubleshooting.md#router"
                   if "circuits open" in str(first) else "docs/troubleshooting.md#router"))
        per = res.get("per_replica") or {}
        bad = [u for u in workers if (per.get(u) or {}).get("error") or not (per.get(u) or {}).get("requests")]
        if bad:
            _fail(pb, f"router gate: {n} completions through the router, but none reached "
                      + ", ".join(f"{u} ({(per.get(u) or {}).get('error') or '0 requests'})" for u in bad),
                  f"with policy {r.policy} every replica should get some; deploy status {pb.name} shows the "
                  "router's view")
        spread = ", ".join(f"{u.split('//')[1]}: {per[u]['requests']}" for u in workers)
        progress.say(w, f"router: ok   {n} completions through it, all succeeded, spread over the replicas ({spread})")
        out["ok"] = True
    except DeployError as e:
        if not isinstance(e, Unreachable):
            e.where = e.where or w
        out.update(error=e, message=e.message)
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def _reset_open_circuits(fleet: Fleet, pb: Playbook, progress: Progress, workers: list[str],
                         ready: dict) -> list[dict]:
    """Issue 41: the router's circuit breaker per worker (vllm-router defaults: 10 failures in 120 s open it for
    60 s) is opened by the requests that failed while a replica was down, e.g. across a plain (non-rolling)
    restart; the router then answers 503 "No available workers (all circuits open or unhealthy)" for up to 60 s
    although every replica serves and /workers calls it healthy. Waiting would cost clients that minute, so a worker
    whose circuit is not closed is re-added (remove_worker + add_worker: a new worker entry, a closed circuit;
    measured: the next request is served at once), one at a time. `ready`: the wait's answer, which carries the
    breakers read once every worker was healthy. -> [{url, circuit, readded, message}]."""
    w = pb.conf.router.where
    circuits = ready.get("circuits")
    if not isinstance(circuits, dict):
        progress.say(w, f"router: circuit breakers not read ({ready.get('circuits_error')}); the gate below tells")
        return []
    done = []
    for url in workers:  # only the replicas deploy gave it: any other key the container reports is not read
        state = circuits.get(url)
        if state not in ("open", "half_open"):
            continue
        progress.say(w, f"router: {url}: its circuit breaker is {state.replace('_', '-')} (failures while it was "
                        "down), so the router sends it nothing: re-adding it (remove_worker + add_worker)")
        rm = call(fleet, pb, "remove", timeout=40, url=url)
        add = call(fleet, pb, "add", timeout=150, url=url, op_timeout=130)
        ok = bool(add.get("ok")) or "already exists" in str(add.get("message"))
        msg = ("re-added: circuit closed" if ok else
               f"re-adding failed: remove_worker {rm.get('status')} {str(rm.get('message'))[:200]}, add_worker "
               f"{add.get('status')} {str(add.get('message'))[:200]}")
        progress.say(w, f"router: {url}: {msg}")
        done.append({"url": url, "circuit": state, "readded": ok, "message": msg})
    return done


def drain(fleet: Fleet, pb: Playbook, progress: Progress, member: Playbook) -> dict:
    """Before a replica stops: the router's own remove_worker (new requests go elsewhere at once), then wait
    (bounded by router.drain_timeout_s) until the replica runs no request."""
    w = pb.conf.router.where
    url = replica_url(fleet.inventory, pb, member)
    res = call(fleet, pb, "remove", timeout=40, url=url)
    if not res.get("ok"):
        return {"ok": False, "message": f"remove_worker {url}: {res.get('status')} {res.get('message')}"}
    r = pb.conf.router
    res = call(fleet, pb, "drain_wait", timeout=r.drain_timeout_s + 30, url=url,
               op_timeout=max(0.1, r.drain_timeout_s))
    if res.get("drained"):
        progress.say(w, f"router: {member.host}/{member.vmid} removed from the router; its running requests finished "
                        f"({res.get('seconds')}s)")
    else:
        progress.say(w, f"router: {member.host}/{member.vmid} removed from the router; still {res.get('running'):g} "
                        f"request(s) running after {r.drain_timeout_s:g}s (router.drain_timeout_s): restarting "
                        "anyway")
    return {"ok": True, "url": url, **res}


def add_back(fleet: Fleet, pb: Playbook, progress: Progress, member: Playbook) -> dict:
    w = pb.conf.router.where
    url = replica_url(fleet.inventory, pb, member)
    res = call(fleet, pb, "add", timeout=150, url=url, op_timeout=130)
    if res.get("ok") or "already exists" in str(res.get("message")):
        progress.say(w, f"router: {member.host}/{member.vmid} added back")
        return {"ok": True, "url": url}
    return {"ok": False, "url": url, "message": f"add_worker {url}: {res.get('status')} {res.get('message')}"}


def view(fleet: Fleet, pb: Playbook) -> dict:
    """The status row: the router's process, readiness and workers as it sees them, set against the replicas."""
    out = {"where": pb.conf.router.where, "port": pb.conf.router.port, "policy": pb.conf.router.policy}
    try:
        res = call(fleet, pb, "view", timeout=30)
    except DeployError as e:
        return dict(out, ok=False, state="unreachable" if isinstance(e, Unreachable) else "error", message=e.message)
    st = res.get("state") if isinstance(res.get("state"), dict) else {}
    # the container's answer: only well-formed workers and circuits are read (issue 36, Low: a worker list of
    # non-objects was a traceback)
    workers = res.get("workers")
    if workers is not None:
        workers = [{"url": w["url"][:300], "healthy": w.get("healthy") is True, "load": w.get("load")}
                   for w in (workers if isinstance(workers, list) else [])[:256]
                   if isinstance(w, dict) and isinstance(w.get("url"), str)]
    circuits = res.get("circuits")
    circuits = ({k: v for k, v in list(circuits.items())[:256] if isinstance(k, str) and isinstance(v, str)}
                if isinstance(circuits, dict) else None)
    configured = st.get("workers") if isinstance(st.get("workers"), list) else []
    out.update(running=bool(res.get("running")), pid=res.get("pid"), supervisor=res.get("supervisor"),
               unit=st.get("unit"), configured=[c for c in configured if isinstance(c, str)],
               workers=workers, readiness=res.get("readiness"), error=res.get("error"), circuits=circuits)
    if not res.get("installed"):
        out.update(ok=False, state="not deployed")
    elif not res.get("running"):
        out.update(ok=False, state="down")
    elif workers is None:
        out.update(ok=False, state="not answering")
    else:
        healthy = [w["url"] for w in workers if w.get("healthy")]
        out.update(ok=bool(healthy), state="healthy" if healthy else "no healthy replica")
    return out


def compare(pb: Playbook, inv, rview: dict, serving: set) -> list[str]:
    """Flags: a replica that serves but is not in the router; one the router routes to that does not serve (or
    that it sees unhealthy)."""
    flags = []
    workers = {w["url"]: w for w in rview.get("workers") or []}
    if not rview.get("running"):
        return flags
    for m in pb.members:
        try:
            url = replica_url(inv, pb, m)
        except DeployError:
            continue
        wm = f"{m.host}/{m.vmid}"
        if wm in serving and url not in workers:
            flags.append(f"{wm} serves but is not in the router (deploy up {pb.name} adds it)")
        elif url in workers and wm not in serving:
            flags.append(f"{wm} is in the router but does not serve" +
                         (" (the router sees it unhealthy: it sends it nothing)" if not workers[url].get("healthy")
                          else ""))
        elif url in workers and not workers[url].get("healthy"):
            flags.append(f"{wm} serves but the router sees it unhealthy")
        elif url in workers and (rview.get("circuits") or {}).get(url) in ("open", "half_open"):
            # vllm-router #158: healthy in /workers, yet sent nothing while its circuit breaker is open
            flags.append(f"{wm} serves and the router calls it healthy, but its circuit breaker is "
                         f"{rview['circuits'][url].replace('_', '-')}: the router sends it nothing for up to 60 s "
                         f"(deploy up {pb.name} re-adds it, which closes it)")
    return flags


def down(fleet: Fleet, pb: Playbook, progress: Progress) -> dict:
    w = pb.conf.router.where
    try:
        res = call(fleet, pb, "stop", timeout=60)
    except DeployError as e:
        return {"where": w, "ok": False, "message": e.message, "error": e}
    if res.get("refused"):
        msg = f"router {w}: not stopped: {res['refused']}"
        progress.say(w, "router: NOT stopped: " + str(res["refused"]))
        return {"where": w, "ok": False, "stopped": False, "refused": True, "message": msg}
    if res.get("stopped"):
        progress.say(w, "router: stopped" + (f" (unit {res['unit'].get('unit')} stopped and removed)"
                                              if isinstance(res.get("unit"), dict) else f" (pid {res.get('pid')})"))
    return {"where": w, "ok": True, "stopped": bool(res.get("stopped"))}
