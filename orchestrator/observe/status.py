"""`deploy status` and `deploy logs`: one SSH connection per host, one remote exec per container, hosts in parallel.
The rows (status/v1) are gathered here; status_render.py writes them as text.

JSON schema (stable, "vllm-pve-deploy/status/v1"): see docs/cli.md#status.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time

import click

from orchestrator.steps import plumbing_check as PL
from orchestrator.core import vllm_facts as vf
from orchestrator.agent import AgentError, ContainerNotRunning
from orchestrator.core.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DeployError, RemoteTimeout, Unreachable, UsageError
from orchestrator.core.endpoint import endpoint, router_endpoint
from orchestrator.core.facts import nvml_mismatch_fix, parse_pct_status
from orchestrator.core.locate import testbed_inventory
from orchestrator.core.remote import Fleet, run_parallel, shell_word, state_dir, warm_when_connected
from orchestrator.core.report import Progress, dump_json, own, term_width
from orchestrator.core.locate import playbook_dirs
from orchestrator.core.spec import Reach, list_playbooks, load_playbook, reach
from orchestrator.observe.status_render import (NO_RUNTIME, render_endpoints, render_history, render_router, render_table,
                            render_totals)

SCHEMA = "vllm-pve-deploy/status/v1"
from orchestrator.steps import call_on  # noqa: E402 (status's and logs' reads: planned steps, one route)
from orchestrator.steps.plan import step_on  # noqa: E402
FATAL_BULK = {"fatal_regex": [f["regex"] for f in vf.FATAL]}  # last_error: the line naming the cause


def resolve_targets(inv, targets) -> list[tuple[str, int, Reach | None]]:
    """-> [(host, vmid, runtime)] in inventory order. A playbook name brings its runtime paths."""
    want = []
    if not targets:
        every = [(h.name, c.vmid, reach(c.runtime)) for h in inv.hosts.values() for c in h.containers]
        if not every:
            raise UsageError(f"the inventory {inv.path} lists no " + ("containers" if inv.hosts else "hosts")
                             + ": there is nothing to show",
                             fix="add your Proxmox hosts and containers to it, or try the test bed: deploy testbed "
                                 f"up, then export DEPLOY_INVENTORY={testbed_inventory()} (or pass -i PATH)")
        return _with_playbook_runtimes(inv, every)
    playbooks = set(list_playbooks())
    for t in targets:
        named = inv.named(t)
        if named is not None:
            want += [(h, c.vmid, reach(c.runtime)) for h, c in named]
        elif t in playbooks or t.endswith((".yaml", ".yml")):
            pb = load_playbook(t, inv)
            want += [(m.host, m.vmid, reach(m.conf.runtime, api_key_env=m.conf.serve.api_key_env)) for m in pb.members]
        else:
            raise UsageError(f"{t!r} is not a host, HOST/VMID or playbook",
                             fix=f"hosts: {', '.join(inv.hosts) or 'none'}; playbooks: "
                                 f"{', '.join(sorted(playbooks)) or 'none'}")
    return _with_playbook_runtimes(inv, want)


def _with_playbook_runtimes(inv, want):
    """A container without an inventory runtime takes the runtime of a playbook that targets it (a deployment
    that playbook started is then still seen), marked implicit: if that Python is not there, nothing deploy
    started can run there, and the row says `no vLLM runtime` instead of an error about a path nobody set."""
    if all(rt is not None for _, _, rt in want):
        return want
    by_target = {}
    for name in list_playbooks():
        try:
            pb = load_playbook(name, inv)
        except DeployError:
            continue  # an invalid playbook says so when it is used; it must not break status
        for m in pb.members:
            by_target.setdefault((m.host, m.vmid), reach(m.conf.runtime, api_key_env=m.conf.serve.api_key_env,
                                                         implicit=f"playbook {m.name}"))
    return [(h, v, rt if rt is not None else by_target.get((h, v))) for h, v, rt in want]


def no_runtime(host: str, vmid: int) -> tuple[str, str]:
    """What logs and unlock say of a container whose runtime neither the inventory nor a playbook names, and the
    fix: (text, fix)."""
    return (f"{host}/{vmid}: {NO_RUNTIME} in the inventory and no playbook targets it",
            f"deploy discover {host} --write records a runtime")


def local_playbook(inv, playbook, host: str, vmid: int):
    """The member for HOST/VMID of the local playbook named `playbook`, if one targets it, else None. The name
    comes from the container (state.json), so it only selects among the operator's own playbooks."""
    if not isinstance(playbook, str) or inv is None:
        return None
    names = list_playbooks()
    for name in ([playbook] if playbook in names else []) + [n for n in names if n != playbook]:
        try:
            pb = load_playbook(name, inv)
        except (DeployError, OSError):
            continue
        if pb.name != playbook:
            continue
        for m in pb.members:
            if (m.host, m.vmid) == (host, vmid):
                return m
    return None


def local_key_env(inv, playbook, host: str, vmid: int) -> str | None:
    """serve.api_key_env of the local playbook named `playbook` if it targets HOST/VMID, else None."""
    m = local_playbook(inv, playbook, host, vmid)
    return (m.conf.serve.api_key_env or None) if m is not None else None


def sizing_row(row: dict, lines, inv, st: dict, host: str, vmid: int) -> None:
    """vLLM's own memory figures of the serving launch (kept at deploy up: memory.json), held to the sizing
    model's prediction when the local playbook has sizing.target_config; a figure off by more than the tolerance
    is a note (the model is wrong, not the deployment)."""
    if not lines:
        return
    from orchestrator.core import sizing as Z  # lazy: gather warms it while the agents run (warm_when_connected), ~8 ms

    rep = Z.parse_reported([str(x) for x in lines][:12])
    if not rep:
        return
    out = {"reported": rep, "rows": [], "off": [], "verdict": None}
    predicted = predicted_size(inv, st.get("playbook"), host, vmid)
    if predicted is not None:
        c = Z.compare(predicted, rep)
        out.update(c)
        if c["off"]:
            row["notes"].append(Z.compare_line(c))
    row["sizing"] = out


_PREDICTED: dict = {}  # (inventory, playbook, HOST, VMID) -> (the files' stamp, the sizing model's prediction)


def _stamp(paths) -> tuple:
    out = []
    for p in paths:
        try:
            s = os.stat(p)
            out.append((p, s.st_mtime_ns, s.st_size, s.st_ino))
        except OSError:
            out.append((p, None))
    return tuple(out)


def predicted_size(inv, playbook, host: str, vmid: int):
    """The sizing model's prediction for the local playbook named `playbook` on HOST/VMID (None when none targets
    it or it has no sizing.target_config), kept while the playbook files and the target's config.json are
    unchanged: a --watch refresh and every row of a large fleet would otherwise parse the playbooks and run the
    model again (issue 54: a few ms of the one client process per row and refresh)."""
    from orchestrator.core import sizing as Z

    if not isinstance(playbook, str) or inv is None:
        return None
    key = (id(inv), playbook, host, vmid)
    files = [d / f"{n}.yaml" for _, d in playbook_dirs() for n in list_playbooks()]
    kept = _PREDICTED.get(key)
    if kept is not None and kept[0] == _stamp(files + kept[2]):
        return kept[1]
    m = local_playbook(inv, playbook, host, vmid)
    inp = Z.from_playbook(m) if m is not None else None
    extra = [m.target_config_path] if m is not None and m.target_config_path else []
    predicted = Z.size(inp, fixes=False) if inp is not None else None
    _PREDICTED[key] = (_stamp(files + extra), predicted, extra)
    return predicted


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


GEN_TOKENS_LINE = re.compile("^" + re.escape(vf.M_GEN_TOKENS + "_total") + r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def generation_tokens(text: str) -> float | None:
    """vllm:generation_tokens_total summed over its series (every engine), None when absent."""
    vals = [float(v) for v in GEN_TOKENS_LINE.findall(text or "")]
    return sum(vals) if vals else None


class Sampler:
    """Keeps the previous counters per container so a refresh can show recent acceptance."""

    def __init__(self, persist: bool):
        self.path = os.path.join(state_dir(), "status-samples.json") if persist else None
        self.prev = {}
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as fh:
                    self.prev = json.load(fh)
            except (OSError, ValueError):
                self.prev = {}
        self._lock = threading.Lock()

    HISTORY = 24  # refreshes kept per container for the --watch sparklines

    def recent(self, key: str, counters: dict | None, pid, gen_tokens: float | None = None) -> dict | None:
        """Acceptance (and generated tokens/s) since the previous sample of this container, with the window it
        covers; each result is also appended to the container's history (same server process only)."""
        with self._lock:
            prev = self.prev.get(key)
            cur = {"t": time.time(), "pid": pid, "c": counters, "g": gen_tokens,
                   "h": (prev or {}).get("h", []) if (prev or {}).get("pid") == pid else []}
            self.prev[key] = cur
        if not prev or not counters or prev.get("pid") != pid or not prev.get("c"):
            return None
        p, c = prev["c"], counters
        dd, dt, da = c["drafts"] - p["drafts"], c["draft_tokens"] - p["draft_tokens"], c["accepted"] - p["accepted"]
        span = cur["t"] - prev["t"]
        window = {"from": _iso(prev["t"]), "to": _iso(cur["t"]), "seconds": round(span, 1)}
        tps = None
        if gen_tokens is not None and prev.get("g") is not None and span > 0 and gen_tokens >= prev["g"]:
            tps = round((gen_tokens - prev["g"]) / span, 2)
        if dd <= 0 or dt <= 0:
            out = {"since_s": round(span, 1), "draft_acceptance_rate": None, "mean_acceptance_length": None,
                   "drafts": 0, "tokens_per_s": tps, "window": window}
        else:
            out = {"since_s": round(span, 1), "draft_acceptance_rate": round(da / dt, 4),
                   "mean_acceptance_length": round(1 + da / dd, 3), "drafts": dd, "tokens_per_s": tps,
                   "window": window}
        with self._lock:
            cur["h"] = (cur["h"] + [{"t": round(cur["t"], 1), "al": out["mean_acceptance_length"],
                                     "tps": tps}])[-self.HISTORY:]
        return out

    def history(self, key: str) -> list:
        with self._lock:
            return list((self.prev.get(key) or {}).get("h", []))

    def save(self):
        if self.path:
            try:
                with open(self.path, "w") as fh:
                    json.dump(self.prev, fh)
            except OSError:
                pass


def no_runtime_row(fleet: Fleet, host: str, vmid: int) -> dict:
    """A container whose inventory entry has no vLLM runtime (and no playbook names it): nothing of vLLM is
    expected there, so only whether it runs is read (`pct status`), and it is healthy."""
    row = _row(host, vmid, container="unknown", process=NO_RUNTIME, healthy=True)
    r = fleet.session(host).run(["pct", "status", str(vmid)], timeout=15, vmid=vmid, label="status")
    try:
        row["container"] = parse_pct_status(r.out) if r.ok else "missing"
    except ValueError:
        row["container"] = "unknown"
    if not r.ok:
        row["healthy"] = False
        row["problems"].append(f"container {vmid} does not exist on this host ({r.err.strip()[:200]})")
    return row


def container_row(fleet: Fleet, host: str, vmid: int, runtime: Reach | None, sampler: Sampler,
                  smi_timeout: float) -> dict:
    if runtime is None:
        return no_runtime_row(fleet, host, vmid)
    row = _row(host, vmid, container="running", process="none", healthy=True)
    sdir, python, key_env = runtime.state_dir, runtime.python, runtime.api_key_env
    key = os.environ.get(key_env) if key_env else None
    if key:
        fleet.redact.add(key)
    try:
        args = {"state_dir": sdir, "nvidia_smi_timeout_s": smi_timeout, "plumbing": True}
        step = step_on(host, vmid, python, "status", "status", args, smi_timeout + 15, bulk=FATAL_BULK)
        r = call_on(fleet.session(host), step, secrets={"api_key": key} if key else None)
        st = r.state or {}
        # The state file is the container's word: it names the playbook, and only a LOCAL playbook of that name
        # that targets this container chooses the local variable (never the state file's api_key_env, which a
        # compromised container could point at any workstation secret; docs/architecture.md, "Threat model").
        local = local_key_env(fleet.inventory, st.get("playbook") if isinstance(st, dict) else None, host, vmid) \
            if not key and r.models_status in (401, 403) else None
        if local and os.environ.get(local):
            # key-protected, and our own playbook names the local variable holding its key: ask again, with it
            key = os.environ[local]
            fleet.redact.add(key)
            r = call_on(fleet.session(host), step, secrets={"api_key": key})
    except AgentError as e:
        if runtime.implicit and e.message.startswith("cannot run "):
            row.update(process=NO_RUNTIME)
            return row  # that playbook's Python is not in this container: nothing it started runs here
        raise
    except ContainerNotRunning as e:
        row.update(container="stopped" if "not running" in e.message else "missing", healthy=False)
        row["problems"].append(e.message)
        return row
    mem = r.memory or {}
    if "error" in mem:
        fix = nvml_mismatch_fix(mem.get("message"), host, vmid)
        row["problems"].append(f"nvidia-smi: {mem.get('message')}" + (f" (fix: {fix})" if fix else ""))
        row["healthy"] = False
    else:
        row["gpus"] = [{"index": int(i), "used_mib": g["used"], "total_mib": g["total"]}
                       for i, g in sorted(mem.get("gpus", {}).items(), key=lambda x: int(x[0]))]
    row["lock"] = r.lock
    plumbing_row(row, r.extra.get("plumbing"), r.state, host, vmid)
    st = r.state
    if st and st.get("corrupt"):
        row["problems"].append(f"state file unreadable: {st['corrupt']}")
        row["healthy"] = False
        return row
    if not st:
        gate_row(row, r, None)
        fail = r.last_failure
        if fail and fail.get("at", 0) >= (r.stopped_at or 0):
            pb = fail.get("playbook")
            row.update(playbook=pb, process="failed", healthy=False)
            row["problems"].append(
                f"the last deploy up/restart of {pb} failed at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(fail['at']))} ({fail.get('step')}: "
                f"{fail.get('message')}); nothing of ours runs now. deploy logs {pb} shows the server's log; "
                f"deploy up {pb} tries again")
        stray = r.vllm_processes or []
        if stray:
            row["process"] = "not ours"
            row["problems"].append(f"{len(stray)} vLLM process(es) not started by deploy: "
                                   + ", ".join(f"{p['pid']} ({p['comm']})" for p in stray)
                                   + "; deploy never signals them: stop them yourself, or free their GPUs with deploy down "
                                     "PLAYBOOK --clean-gpus")
            row["healthy"] = False
        return row
    row.update(playbook=st.get("playbook"), pid=st.get("pid"), method=st.get("method"),
               served_model=st.get("served_model_name"))
    row["tune"] = tune_of(r.extra.get("tune"), st)
    row["_gpus"] = st.get("gpus") if isinstance(st.get("gpus"), list) else None  # for shared_gpu_problems
    sup = supervision_of(r.supervision, st)
    row["supervision"] = sup
    if st.get("alive"):
        _add_endpoint(row, fleet, host, vmid, st.get("port") or 8000)
    if st.get("alive"):
        row["process"] = "running"
        started = (r.supervision or {}).get("main_started_at") or st.get("started_at", time.time())
        row["uptime_s"] = round(time.time() - started, 1)  # of the process serving now (systemd may restart it)
        row["health"] = r.health
        if r.health != 200:
            row["healthy"] = False
            row["problems"].append(f"/health: {r.health or 'no answer'}")
        elif r.listener_problem:
            row["healthy"] = False
            row["problems"].append(r.listener_problem)
        elif r.models_status in (401, 403):
            row["healthy"] = False
            local = local_key_env(fleet.inventory, st.get("playbook"), host, vmid)
            row["problems"].append(f"/v1/models needs the API key ({r.models_status})" +
                                   (f": export {local} (serve.api_key_env) and run status again" if local else ""))
        elif st.get("served_model_name") not in (r.models or []):
            row["healthy"] = False
            row["problems"].append(f"/v1/models does not list {st.get('served_model_name')}")
    elif sup["supervisor"] == "systemd":
        row["process"] = "start limit hit" if sup.get("start_limit_hit") else f"unit {sup.get('active') or 'unknown'}"
        row["healthy"] = False
        ex = sup.get("last_exit")
        if sup.get("start_limit_hit"):
            row["problems"].append(
                f"{sup['unit']} crashed {sup.get('restarts') or 0} time(s) after start and systemd stopped restarting "
                f"it (start limit: supervise.start_limit_burst within supervise.start_limit_interval_s); last exit: "
                f"{exit_text(ex)}; deploy logs {shell_word(st.get('playbook'))} shows why, then deploy up "
                f"{shell_word(st.get('playbook'))}")
        else:
            row["problems"].append(f"{sup['unit']} is {sup.get('active')}/{sup.get('sub')} (no main process); last "
                                   f"exit: {exit_text(ex)}; deploy logs {st.get('playbook')}")
    else:
        row["process"] = "exited"
        row["healthy"] = False
        row["problems"].append(f"vLLM (pid {st.get('pid')}) has exited (code {r.exit_code})")
    if sup["supervisor"] == "systemd":
        since = "the container booted (it rebooted after deploy up)" if sup.get("container_restarted") else \
            "deploy up"
        row["notes"].insert(0, f"supervised by systemd ({sup['unit']}, {sup.get('enabled')}): "
                               f"{sup.get('restarts') if sup.get('restarts') is not None else '?'} restart(s) since "
                               f"{since}; last exit: {exit_text(sup.get('last_exit'))}")
    if sup["supervisor"] == "none":
        row["problems" if row["process"] != "running" else "notes"].append(
            "not supervised: a crash leaves it down (the container does not run systemd)")
    elif st.get("alive") and not sup.get("serving_passed_gate"):
        row["notes"].append(
            f"the process serving now (pid {st.get('pid')}) is not the one that passed the acceptance gate at deploy up"
            + (f": systemd restarted it {sup['restarts']} time(s)" if sup.get("restarts") else "")
            + (" and the container rebooted since" if sup.get("container_restarted") else "")
            + f"; last exit: {exit_text(sup.get('last_exit'))}; its acceptance since that restart is shown as recent")
    gate_row(row, r, st)
    if st.get("alive"):
        sizing_row(row, r.extra.get("memory_lines"), fleet.inventory, st, host, vmid)
    if r.last_error:
        row["last_error"] = r.last_error
    if st.get("drafter_path"):
        pinned, disk = st.get("drafter_sha256"), r.drafter_sha256
        row["drafter"] = {"path": st["drafter_path"], "pinned_sha256": pinned, "on_disk_sha256": disk,
                          "drift": disk != pinned}
        if disk != pinned:
            row["healthy"] = False
            row["problems"].append(f"drafter config drift: {st['drafter_path']} has sha256 "
                                   f"{disk or 'none (unreadable)'}, "
                                   f"launched with {pinned}; deploy apply-config {st.get('playbook')} reinstalls "
                                   f"the pinned bytes, then deploy restart {st.get('playbook')}")
    if r.weights:  # fetched by deploy fetch: the revision serving
        row["weights"] = list(r.weights)
    if r.metrics:
        counters = vf.parse_spec_counters(r.metrics)
        life = vf.lifetime_acceptance(r.metrics) if counters else None
        row["acceptance"] = {"lifetime": life.as_dict() if life else None,
                             "recent": sampler.recent(f"{host}/{vmid}", counters, st.get("pid"),
                                                      generation_tokens(r.metrics))}
        if row["acceptance"]["lifetime"] is not None and row.get("uptime_s") is not None:
            # vLLM's counters start with its process: the lifetime figures cover its uptime
            now_t = time.time()
            row["acceptance"]["lifetime"]["window"] = {"from": _iso(now_t - row["uptime_s"]), "to": _iso(now_t),
                                                       "seconds": row["uptime_s"]}
        row["history"] = sampler.history(f"{host}/{vmid}")
        if sup.get("supervisor") == "systemd" and st.get("alive") and not sup.get("serving_passed_gate") \
                and row["acceptance"]["recent"] is None and life:
            # vLLM's counters start at its own start: for a restarted server, its lifetime is "since that restart"
            row["acceptance"]["recent"] = {**life.as_dict(), "since": "restart",
                                           "since_s": row.get("uptime_s")}
    return row


def plumbing_row(row: dict, facts, st, host: str, vmid: int) -> None:
    """The gpu-plumbing check from the container's side only (status makes no host exec for it): the GPUs and
    tensor parallelism of the deployment recorded in the state file, else every /dev/nvidiaN the container has.
    A short `GPU plumbing:` problem line when something is wrong; row["gpu_plumbing"] for --json."""
    if not isinstance(facts, dict):  # an older agent
        return
    st = st if isinstance(st, dict) and not st.get("corrupt") else {}
    gpus = st.get("gpus") if isinstance(st.get("gpus"), list) and all(isinstance(g, int) for g in st["gpus"]) \
        else None
    if gpus is None:
        nodes = facts.get("nodes") if isinstance(facts.get("nodes"), dict) else {}
        gpus = sorted(int(p[11:]) for p in nodes if isinstance(p, str) and p[11:].isdigit()
                      and p.startswith("/dev/nvidia"))[:64]
    if not gpus:  # no deployment recorded and no GPU node: a container without GPUs (a router's), nothing to check
        return
    tp = 1
    argv = st.get("argv") if isinstance(st.get("argv"), list) else []
    for i, a in enumerate(argv[:400]):
        if a == "--tensor-parallel-size" and i + 1 < len(argv) and str(argv[i + 1]).isdigit():
            tp = min(int(argv[i + 1]), 64)
    found = PL.findings(None, facts, host_name=host, vmid=vmid, gpus=gpus, tp=tp)
    rec = record_of(facts)
    row["gpu_plumbing"] = {"summary": PL.summary(found), "findings": found, "record": rec}
    if rec and rec["error"]:  # status still works, reading them fresh each time
        row["notes"].append(f"GPU plumbing facts are read fresh on every status: {rec['error']}")
    if found:
        row["problems"].append("GPU plumbing: " + PL.summary(found))
        row["healthy"] = False


def record_of(facts: dict) -> dict | None:
    """Where the container's plumbing facts came from (agent/container/plumbing.py facts_recorded): {reused: the
    record kept since the container's boot / the driver's load was still current, at: when they were read, error:
    why no record could be kept}; the container's word, bounded."""
    rec = facts.get("record")
    if not isinstance(rec, dict):
        return None
    at = rec.get("at")
    return {"reused": rec.get("reused") is True, "at": at if isinstance(at, (int, float)) else None,
            "error": PL.clean(rec["error"], 300) if rec.get("error") else None}


def _at(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "an unknown time"


def tune_of(rec, st: dict) -> dict:
    """deploy tune's verdict for the configuration running now (tune.json's argv is the state file's), else
    `not tuned` (never tuned, or tuned for another configuration)."""
    if not isinstance(rec, dict) or not rec.get("verdict"):
        return {"verdict": "not tuned", "at": None, "text": "not tuned"}
    if rec.get("argv") != st.get("argv"):
        return {"verdict": "not tuned", "at": None, "text": "not tuned (the last tune, "
                f"{time.strftime('%Y-%m-%d', time.localtime(rec.get('at') or 0))}, ran another configuration)"}
    day = time.strftime("%Y-%m-%d", time.localtime(rec.get("at") or 0))
    return {"verdict": rec["verdict"], "at": rec.get("at"), "chosen": rec.get("chosen"),
            "text": f"tuned {day}: {rec['verdict']}"}


def gate_row(row: dict, r: dict, st: dict | None) -> None:
    """The acceptance gate in a status row (status/v1 `gate` and `rejected`): a running launch without a passed
    verdict is a problem (`not gated`, since its launch); a rejection a fallback followed is shown beside it."""
    from orchestrator.core.gate import gate_figures  # lazy: gather warms it while the agents run (warm_when_connected), ~3 ms

    g, rej = r.gate or None, r.rejected or None
    if rej and isinstance(rej, dict):
        v = rej.get("verdict") or {}
        row["rejected"] = {"playbook": rej.get("playbook"), "at": rej.get("at"), "figures": v.get("figures"),
                           "reason": v.get("reason"), "fallback": v.get("rejected_fallback")}
        row["notes"].append(f"{rej.get('playbook')} was rejected by the acceptance gate at {_at(rej.get('at'))} "
                            f"({gate_figures(v)}): {v.get('reason')}"
                            + (f"; {v.get('rejected_fallback')} was brought up instead" if v.get("rejected_fallback")
                               else "") + f". deploy up {shell_word(rej.get('playbook'))} tries it again")
    if not st or not st.get("alive"):
        return
    if g and g.get("for_current_launch"):
        v = g.get("verdict") or {}
        row["gate"] = {"verdict": "passed" if v.get("passed") else "failed", "at": g.get("at"),
                       "since": st.get("started_at"), "figures": v.get("figures"), "reason": v.get("reason")}
        if not v.get("passed"):
            row["healthy"] = False
            row["problems"].append(f"failed the acceptance gate at {_at(g.get('at'))} ({gate_figures(v)}): "
                                   f"{v.get('reason')}; deploy up {shell_word(st.get('playbook'))} measures it again")
        return
    row["gate"] = {"verdict": "not gated", "at": None, "since": st.get("started_at"), "figures": None, "reason": None}
    row["healthy"] = False
    row["problems"].append(f"not gated since {_at(st.get('started_at'))}: this launch (pid {st.get('pid')}) never "
                           "passed the acceptance gate (an up interrupted before the gate, or launched by a deploy "
                           f"without gate records); deploy up {st.get('playbook')} measures and gates it")


def supervision_of(raw: dict | None, st: dict) -> dict:
    """The row's `supervision` object (status/v1): supervisor systemd or none, and for systemd the unit, restarts
    since up (NRestarts), the last exit, whether the serving process passed the gate itself."""
    raw = raw or {}
    if raw.get("supervisor") != "systemd":
        return {"supervisor": "none", "unit": None, "restarts": None, "last_exit": None,
                "serving_passed_gate": None if not st.get("alive") else True, "start_limit_hit": False,
                "container_restarted": None, "enabled": None, "active": None, "sub": None}
    return {"supervisor": "systemd", "unit": raw.get("unit"), "restarts": raw.get("restarts"),
            "last_exit": raw.get("last_exit"), "serving_passed_gate": raw.get("serving_passed_gate"),
            "start_limit_hit": bool(raw.get("start_limit_hit")), "container_restarted": raw.get("container_restarted"),
            "enabled": raw.get("enabled"), "active": raw.get("active"), "sub": raw.get("sub")}


def exit_text(ex: dict | None) -> str:
    """'signal KILL at 14:03:12' / 'code 1 at ...' / 'none recorded'."""
    if not ex:
        return "none since deploy up launched it"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ex["at"])) if ex.get("at") else "unknown time"
    what = f"signal {ex.get('status')}" if ex.get("code") in ("killed", "dumped") else f"code {ex.get('status')}"
    return f"{what} at {when}"


def gather(inv, targets, fleet: Fleet | None = None, *, deadline: float = 15.0, sampler: Sampler | None = None,
           smi_timeout: float | None = None, keep_gpus: bool = False) -> list[dict]:
    """The status rows. keep_gpus: each row keeps `_gpus`, its state file's GPUs (not in status/v1; for `deploy
    monitor metrics`' foreign GPU memory)."""
    scope = resolve_targets(inv, targets)
    # a hung nvidia-smi must be reported by the agent itself, well inside the host's deadline
    smi_timeout = smi_timeout or max(0.5, min(5.0, deadline / 3))
    sampler = sampler or Sampler(persist=False)
    # what the rows need once the agents answer (~20 ms of imports), imported while the first agent runs
    warm_when_connected("orchestrator.agent.protocol", vf.prometheus_parser, "orchestrator.core.gate",
                        "orchestrator.core.endpoint", "orchestrator.core.sizing")
    own = fleet is None
    fleet = fleet or Fleet(inv)
    by_host: dict[str, list] = {}
    for host, vmid, rt in scope:
        by_host.setdefault(host, []).append((vmid, rt))

    def do_host(host):
        items = by_host[host]
        if len(items) == 1:
            vmid, rt = items[0]
            return [_row_or_error(fleet, host, vmid, rt, sampler, smi_timeout)]
        res = run_parallel(items, lambda it: _row_or_error(fleet, host, it[0], it[1], sampler, smi_timeout),
                           deadline_s=deadline)
        return [v if e is None else _error_row(host, it[0], e) for it, v, e in res]

    try:
        results = run_parallel(list(by_host), do_host, deadline_s=deadline)
    finally:
        if own:
            fleet.close()
    rows = []
    for host, value, err in results:
        if err is None:
            rows += value
        else:
            refused = fleet.session(host).last_connect_error
            # still retrying a connect that was refused (not one that was merely slow): UNREACHABLE, not TIMEOUT
            if isinstance(err, RemoteTimeout) and refused is not None and not isinstance(refused, TimeoutError):
                h = inv.host(host)
                err = Unreachable(f"cannot connect to {h.user}@{h.address or h.ssh_config_alias}:{h.port}: "
                                  f"{getattr(refused, 'strerror', None) or refused or type(refused).__name__}",
                                  fix="check the address/port in the inventory and that the host and its sshd are up")
            rows += [_error_row(host, vmid, err) for vmid, _ in by_host[host]]
    sampler.save()
    shared_gpu_problems(rows, keep=keep_gpus)
    return rows


def shared_gpu_problems(rows: list[dict], keep: bool = False) -> None:
    """Two running deployments of one host on the same GPU (their state files' gpus) compete for its memory: each
    row says so and is not healthy (issue 26: both showed ok)."""
    running = [r for r in rows if r.get("process") == "running" and r.get("_gpus")]
    for r in running:
        for o in running:
            shared = sorted(set(r["_gpus"]) & set(o["_gpus"]))
            if o is r or o["host"] != r["host"] or not shared:
                continue
            r["healthy"] = False
            r["problems"].append(f"GPU(s) {', '.join(map(str, shared))} are used by {o['host']}/{o['vmid']} too, "
                                 f"where {o.get('playbook')} runs: two servers on one GPU compete for its memory; "
                                 f"deploy down {o.get('playbook')} (or {r.get('playbook')}) frees them, or give each "
                                 "container its own GPUs")
    for r in rows:
        if not keep:
            r.pop("_gpus", None)


def _row_or_error(fleet, host, vmid, rt, sampler, smi_timeout):
    try:
        return container_row(fleet, host, vmid, rt, sampler, smi_timeout)
    except DeployError as e:
        return _error_row(host, vmid, e)
    except (TypeError, KeyError, AttributeError, ValueError) as e:  # the answer is typed; nested data may be odd
        return _error_row(host, vmid, AgentError(
            f"agent action 'status' answered a malformed result ({type(e).__name__}: {e})", where=f"{host}/{vmid}",
            fix="a bug in deploy's agent, or something in the container answers for it; report it with deploy's "
                "audit log"))


def _error_row(host, vmid, err) -> dict:
    """A container whose host did not answer: TIMEOUT when it was too slow for --deadline, UNREACHABLE when the
    connection was refused, unroutable or rejected."""
    timed_out = isinstance(err, RemoteTimeout) or getattr(err, "timed_out", False)
    unreachable = isinstance(err, Unreachable) or timed_out
    if isinstance(err, DeployError):
        msg = (f"{err.where}: " if err.where and not err.where.startswith(f"{host}/") else "") + err.message + \
            (f" (fix: {err.fix})" if err.fix else "")
    else:
        msg = f"{type(err).__name__}: {err}"
    return _row(host, vmid, reachable=not unreachable, timed_out=timed_out, container="unknown", process="unknown",
                healthy=False, problems=[msg])


def _add_endpoint(row, fleet, host, vmid, port) -> None:

    hs = fleet.inventory.hosts.get(host)
    if hs is not None:
        ep = endpoint(hs, hs.container(vmid), port)
        row.update(url=ep["url"], tunnel=ep["tunnel"])
        row["_endpoint"] = ep


def _row(host, vmid, **values) -> dict:
    """One row of the status/v1 schema: every key present, in schema order."""
    row = {"host": host, "vmid": vmid, "reachable": True, "container": "unknown", "playbook": None, "pid": None,
           "process": "unknown", "health": None, "served_model": None, "method": None, "gpus": [],
           "acceptance": None, "drafter": None, "uptime_s": None, "last_error": None, "lock": None,
           "url": None, "tunnel": None, "supervision": None, "gate": None, "rejected": None, "sizing": None,
           "healthy": False,
           "timed_out": False, "problems": [], "history": [],
           "notes": [], "weights": None, "gpu_plumbing": None, "tune": None}
    row.update(values)
    return row


def exit_code(rows) -> int:
    if any(not r["reachable"] for r in rows):
        return EXIT_UNREACHABLE
    return EXIT_OK if all(r["healthy"] for r in rows) else EXIT_FAILED


def fleet_playbooks(inv, targets) -> list:
    """The playbooks with `targets:` (replicas) named among the arguments: each gets a totals line."""
    names = set(list_playbooks())
    out = []
    for t in targets or ():
        if inv.named(t) is not None:
            continue
        if t in names or t.endswith((".yaml", ".yml")):
            pb = load_playbook(t, inv)
            if pb.is_fleet:
                out.append(pb)
    return out


def deployed_fleets(inv, rows) -> list:
    """Plain `deploy status` (no arguments; issue 53 item 13): the replica playbooks the rows say run there, so
    their totals line and router row show as with `status PLAYBOOK`. Only a playbook file with a top-level
    `targets:` line is loaded (the others cost nothing); one that no longer loads is said on stderr."""
    from orchestrator.core.locate import find_playbook

    out, names = [], set(list_playbooks())
    for name in dict.fromkeys(r.get("playbook") for r in rows):
        if name not in names:
            continue
        try:
            with open(find_playbook(name), encoding="utf-8") as f:
                if not re.search(r"(?m)^targets:", f.read()):
                    continue
            pb = load_playbook(name, inv)
        except (OSError, DeployError) as e:
            click.echo(f"status: {name} runs here but its playbook does not load ({e}); its totals and router are "
                       f"not shown (deploy status {name} says why)", err=True)
            continue
        if pb.is_fleet:
            out.append(pb)
    return out


def totals(pb, rows) -> dict:
    """A replica playbook's totals: serving = its targets that run this playbook and are healthy; the mean of
    their lifetime draft acceptance (and mean acceptance length) over those that have drafted."""
    mine = {(m.host, m.vmid) for m in pb.members}
    rows = [r for r in rows if (r["host"], r["vmid"]) in mine]
    serving = [r for r in rows if r["healthy"] and r["process"] == "running" and r.get("playbook") == pb.name]
    lives = [((r.get("acceptance") or {}).get("lifetime") or {}) for r in serving]
    rates = [x["draft_acceptance_rate"] for x in lives if x.get("draft_acceptance_rate") is not None]
    lens = [x["mean_acceptance_length"] for x in lives if x.get("mean_acceptance_length") is not None]
    return {"playbook": pb.name, "total": len(rows), "serving": len(serving),
            "serving_targets": [f"{r['host']}/{r['vmid']}" for r in serving],
            "not_serving": [f"{r['host']}/{r['vmid']}" for r in rows if r not in serving],
            "mean_draft_acceptance": round(sum(rates) / len(rates), 4) if rates else None,
            "mean_acceptance_length": round(sum(lens) / len(lens), 3) if lens else None,
            "acceptance_over": len(rates)}


def router_status(fleet, inv, pb, rows) -> dict:
    """The router row of a playbook with router: (its own view of the replicas) and the flags against the rows."""
    from orchestrator.serving import replica_router as R  # lazy: only a playbook with router:, ~5 ms

    rv = R.view(fleet, pb)
    t = totals(pb, rows)
    rv["playbook"] = pb.name
    rv["flags"] = R.compare(pb, inv, rv, set(t["serving_targets"]))
    rv["ok"] = bool(rv.get("ok")) and not rv["flags"]
    if rv.get("running"):
        rv["url"] = router_endpoint(inv, pb).get("url")
    return rv


def run_status(obj, targets, watch, deadline, inv=None, fleet: Fleet | None = None) -> int:
    """fleet: one whose connections may be under way already (Fleet.connect_ahead); closed here."""
    inv = inv or obj.inventory()
    resolve_targets(inv, targets)  # bad targets fail before any connection
    fleets = fleet_playbooks(inv, targets)
    sampler = Sampler(persist=True)
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    code = None
    gates: dict = {}
    try:
        with fleet or Fleet(inv) as fleet:
            while True:
                t0 = time.monotonic()
                with obj.progress().heartbeat("status", "the slowest host(s) to answer", deadline):
                    rows = gather(inv, targets, fleet, deadline=deadline, sampler=sampler)
                code = exit_code(rows)
                if not targets and not fleets:  # plain status: the replica playbooks that run (issue 53)
                    fleets = deployed_fleets(inv, rows)
                routers = {pb.name: router_status(fleet, inv, pb, rows) for pb in fleets if pb.conf.router}
                if any(not r["ok"] for r in routers.values()) and code == 0:
                    code = 1
                if obj.json:
                    dump_json({"schema": SCHEMA, "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "seconds": round(time.monotonic() - t0, 3), "exit_code": code,
                               "rows": [{k: v for k, v in r.items() if k != "_endpoint"} for r in rows],
                               **({"totals": [totals(pb, rows) for pb in fleets]} if fleets else {}),
                               **({"routers": list(routers.values())} if routers else {})})
                else:
                    if watch and color:
                        click.echo(own("\x1b[H\x1b[2J"), nl=False)
                    if watch:
                        click.echo(f"deploy status  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}")
                    click.echo(render_table(rows, color, term_width()) + render_endpoints(rows))
                    if watch:
                        hist = render_history(rows, inv, gates)
                        if hist:
                            click.echo(hist)
                    for pb in fleets:
                        click.echo("\n" + render_totals(totals(pb, rows)))
                        if pb.name in routers:
                            click.echo(render_router(routers[pb.name]))
                    if watch:
                        click.echo(f"\n(refreshed in {time.monotonic() - t0:.2f}s; every {watch:g}s; Ctrl-C to stop)")
                if not watch or reader_gone():  # `--watch | head`: nobody reads any more, stop watching
                    return code
                fleet.open_spares()  # the next refresh then costs one round trip less per host
                time.sleep(max(0.0, watch - (time.monotonic() - t0)))
    except KeyboardInterrupt:  # Ctrl-C ends --watch with the last refresh's exit code
        if code is None:
            raise
        return code


def run_logs(obj, target, n, follow, grep, show_all=False) -> int:
    inv = obj.inventory()
    scope = resolve_targets(inv, [target])
    if len(scope) > 1:  # a playbook with targets: each target's log in turn, under a header
        if follow:
            raise UsageError(f"{target} has {len(scope)} targets; -f follows one log",
                             fix="deploy logs HOST/VMID -f, with one of: "
                                 + ", ".join(f"{h}/{v}" for h, v, _ in scope))
        codes = []
        with Fleet(inv) as fleet:
            for i, (h, v, rt) in enumerate(scope):
                click.echo(("\n" if i else "") + f"==> {h}/{v} <==")
                codes.append(_logs_one(fleet, h, v, rt, n, False, grep, show_all))
        return max(codes)
    with Fleet(inv) as fleet:
        return _logs_one(fleet, *scope[0], n, follow, grep, show_all)


def _logs_one(fleet, host, vmid, rt, n, follow, grep, show_all) -> int:
    if rt is None:
        text, fix = no_runtime(host, vmid)
        click.echo(f"{text}: nothing deploy launched there ({fix})", err=True)
        return EXIT_FAILED
    log_path = os.path.join(rt.state_dir, "vllm.log")
    args = {"log_path": log_path, "state_dir": rt.state_dir, "n": n, "grep": grep,
            "follow": follow, "follow_s": 24 * 3600, "exclude": None if show_all else vf.OWN_PROBE_REQUESTS}
    if not follow:
        with Progress().heartbeat(f"{host}/{vmid}", f"read {log_path}", 30):
            r = call_on(fleet.session(host), step_on(host, vmid, rt.python, "logs", "logs", args, 30))
        if grep and not r.lines and (r.unit or r.exists):  # like grep: said, exit 1 (issue 26)
            click.echo(f"{host}/{vmid}: no line of {r.unit and 'the journal of ' + r.unit or log_path} "
                       f"matched --grep {grep!r}", err=True)
            return EXIT_FAILED
        if r.unit and not r.lines:  # a systemd unit's journal (agent: the state file names the unit)
            click.echo(f"{host}/{vmid}: the journal of {r.unit} is empty ({r.source})", err=True)
            return EXIT_FAILED
        if not r.exists:
            click.echo(f"{host}/{vmid}: no log at {log_path} (nothing was launched there?)", err=True)
            return EXIT_FAILED
        for ln in r.lines or []:
            click.echo(str(ln))
        return EXIT_OK
    def line(e):
        click.echo(e.get("line", ""))
        if reader_gone():  # `logs -f | head`: stop following (closing the channel ends the remote side)
            raise _ReaderGone()

    try:
        call_on(fleet.session(host), step_on(host, vmid, rt.python, "logs", "logs", args, 24 * 3600 + 60),
                on_event=line, streaming=True)
    except (KeyboardInterrupt, _ReaderGone):
        pass
    return EXIT_OK


class _ReaderGone(Exception):
    pass


def reader_gone() -> bool:
    """stdout's reader went away (see report.SafeStream)."""
    return bool(getattr(sys.stdout, "closed_by_reader", False))
