"""`deploy doctor [HOST|HOST/VMID ...]`: read-only diagnosis of a vLLM that `deploy` may not have started.

One agent `doctor` call per container (orchestrator/agent/container/doctor.py: act_doctor) gathers the facts; `diagnose()`
(pure, tested on dicts) names each field-report failure class it finds, with its cause and the `deploy` command
that fixes it. Nothing is changed anywhere.

Classes (docs/domain/field-report.md, "What happened"):
  guessed-config     the drafter config the server read is not the published (pinned) one          FR 1
  stale-write        the file now holds the pinned config, but the server started before it changed FR 3
  missing-fix        vLLM lacks the +1 layer-id offset (PR #40727) or DFlash sliding windows (#40898) FR 4
  incomplete-build   compiled extensions missing (or an import refused: the package is not root-owned) FR 4
  import-fails       every extension present, but `import vllm` raises: the exception's own line   issue 53
  leftover-holder    a process holds the GPUs that belongs to no running vLLM server               FR 7
  low-acceptance     the server's own /metrics fail the acceptance gate (AL, position 0, cliff)       FR 1
  check-timeout      a check did not finish within its bound (retried once): slow, not a diagnosis   issue 37
  driver-mismatch    nvidia-smi: NVML Driver/library version mismatch (container vs host driver)
  privileged-store   the playbook's fetch.store is mounted into a privileged container (it can remount it read-write)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time

import click

from orchestrator import agent
from orchestrator.core import gate as G
from orchestrator.steps import plumbing_check as PL
from orchestrator.core import vllm_facts as vf
from orchestrator.agent.container.protocol import DOCTOR_LOAD_MAX as LOAD_MAX
from orchestrator.agent.protocol import FileShaResult
from orchestrator.core.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DeployError, Unreachable
from orchestrator.core.facts import HOST_HOLDERS_SH, nvml_mismatch_fix, parse_host_holders, parse_pct_config_gpus
from orchestrator.core.remote import Fleet, run_parallel
from orchestrator.core.report import dump_json
from orchestrator.core.spec import list_playbooks, load_playbook
from orchestrator.observe.status import resolve_targets
from orchestrator.steps import call_on
from orchestrator.steps.plan import step_on

CRITICAL = ("dflash_config.target_layer_ids", "dflash_config.mask_token_id", "layer_types", "sliding_window",
            "use_sliding_window", "bos_token_id", "block_size", "num_target_layers")
MIN_DRAFTS = 20  # fewer lifetime drafts say nothing either way


def low_acceptance_verdict(life, p: dict | None):
    """The acceptance gate (orchestrator/core/gate.py) on a server's lifetime counters, with the playbook's thresholds
    (its `acceptance` section; `min_acceptance` is its old rate threshold): the failed verdict, or None."""
    if life is None or not life.draft_tokens:
        return None
    k = len(life.per_position) or (round(life.draft_tokens / life.drafts) if life.drafts else 1)
    cfg = dict((p or {}).get("acceptance") or {})
    if (p or {}).get("min_acceptance") is not None and cfg.get("min_draft_acceptance") is None:
        cfg["min_draft_acceptance"] = p["min_acceptance"]
    cfg["min_drafts"] = min(int(cfg.get("min_drafts") or MIN_DRAFTS), MIN_DRAFTS)
    v = G.judge(life, G.thresholds(cfg, max(1, k)))
    if v.passed or v.too_few:
        return None
    if not life.per_position:  # counters without positions: judge AL and the rate only
        v.reasons = [r for r in v.reasons if not r.startswith("no position-0")]
        if not v.reasons:
            return None
    return v
SCHEMA = "vllm-pve-deploy/doctor/v1"


def _get(d, dotted):
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return "<absent>"
        cur = cur[part]
    return cur


def config_differences(actual: dict, pinned: dict) -> list[dict]:
    """The critical fields that differ (then every other top-level key that differs), as
    [{field, on_disk, pinned}]."""
    out = [{"field": k, "on_disk": _get(actual, k), "pinned": _get(pinned, k)} for k in CRITICAL
           if _get(actual, k) != _get(pinned, k)]
    seen = {k.split(".")[0] for k in CRITICAL}
    for k in sorted(set(actual) | set(pinned)):
        if k not in seen and k != "dflash_config" and actual.get(k, "<absent>") != pinned.get(k, "<absent>"):
            out.append({"field": k, "on_disk": actual.get(k, "<absent>"), "pinned": pinned.get(k, "<absent>")})
    return out


def one_server_per_launch(facts: dict) -> dict:
    """deploy's launch wrapper (`/bin/sh -c '"$@" ...' vllm-pve-deploy vllm serve ...`) carries the same argv as
    the vllm under it: one server, not two (issue 26). Drops a server whose process is a shell with a server
    child."""
    procs = {p["pid"]: p for p in facts.get("processes") or []}
    servers = facts.get("servers") or []
    pids = {s["pid"] for s in servers}

    def wrapper(s):
        argv = (procs.get(s["pid"]) or {}).get("argv") or []
        shell = bool(argv) and os.path.basename(argv[0]) in ("sh", "bash", "dash") and "-c" in argv[1:3]
        return shell and any(q.get("ppid") == s["pid"] and q["pid"] in pids for q in procs.values())

    facts["servers"] = [s for s in servers if not wrapper(s)]
    return facts


def pick_pinned(drafter: dict, pinned: list[dict], prefer: str | None = None) -> dict | None:
    """The pinned config for the drafter a server reads: the playbook `prefer` (the state file's) if it names the
    same path or hub id, else a playbook naming the same path or hub id, else the one of the same architecture
    that shares the most keys."""
    pinned = sorted(pinned, key=lambda p: p.get("playbook") != prefer) if prefer else pinned
    for p in pinned:
        if drafter.get("dir") and p.get("path") == drafter.get("dir"):
            return p
        if drafter.get("hub_id") and p.get("hub_id") == drafter.get("hub_id"):
            return p
    try:
        cfg = json.loads(drafter.get("text") or "")
    except ValueError:
        return None
    if not isinstance(cfg, dict):
        return None
    same = [p for p in pinned if p["config"].get("architectures") == cfg.get("architectures")]
    return max(same, key=lambda p: len(set(p["config"]) & set(cfg)), default=None)


def fixes_present(stack: dict) -> tuple[bool, bool]:
    """(+1 layer-id offset, DFlash sliding window), by the same rules as verify's serving checks (agent/container/stack.py)."""
    v = vf.vtuple(stack.get("version"))
    m = stack.get("markers") or {}
    plus1 = bool(m.get("plus1_fix") or (v is not None and v >= (0, 22) and m.get("pr40898_sliding_window")))
    sw = bool(m.get("pr40898_sliding_window") or (v is not None and v >= (0, 26) and m.get("resolve_layer_attention")))
    return plus1, sw


def _fmt(v):
    return json.dumps(v) if not isinstance(v, str) or v == "<absent>" else v


def diagnose(facts: dict, pinned: list[dict], *, host: str, vmid: int, playbook: dict | None = None,
             host_holders: dict | None = None) -> list[dict]:
    """-> [{class, cause, fix, evidence}] for one container. `pinned`: [{playbook, path, hub_id, config, sha256,
    min_acceptance, fallback}]; `playbook`: the one that targets this container (for the fix commands)."""
    pbname = (playbook or {}).get("playbook") or "PLAYBOOK"
    fallback = (playbook or {}).get("fallback")
    findings = []

    def add(cls, cause, fix, **evidence):
        findings.append({"class": cls, "cause": cause, "fix": fix, "evidence": evidence})

    servers = facts.get("servers") or []
    stack = facts.get("stack") or {}
    procs = facts.get("processes") or []
    guessed_in = set()
    for srv in servers:
        d = srv.get("drafter")
        spec = (srv.get("args") or {}).get("spec") or {}
        if not d or d.get("error"):
            if d and d.get("error"):
                add("guessed-config", f"server pid {srv['pid']}: its drafter config cannot be read "
                                      f"({d.get('path')}: {d['error']})",
                    f"deploy up {pbname} --clean-gpus (installs the pinned config and relaunches)", pid=srv["pid"])
            continue
        p = pick_pinned(d, pinned, (playbook or {}).get("playbook"))
        try:
            cfg = json.loads(d.get("text") or "")
        except ValueError as e:
            add("guessed-config", f"server pid {srv['pid']}: {d['path']} is not valid JSON ({e})",
                f"deploy up {p['playbook'] if p else pbname} --clean-gpus", pid=srv["pid"])
            continue
        d["matches_pinned"] = None
        if p is None:
            continue
        # the fix names a playbook that targets this container: the matching one if it does, else the one
        # that targets it (or a copy of the matching one, retargeted)
        here = f"{host}/{vmid}"
        pb = p["playbook"] if p.get("target") is None or here in p["target"].split(", ") else \
            (playbook or {}).get("playbook") or f"PLAYBOOK (a copy of {p['playbook']} with target {here})"
        d["pinned_by"] = p["playbook"]
        if d.get("sha256") != p["sha256"]:
            diffs = config_differences(cfg, p["config"])
            d["matches_pinned"] = False
            guessed_in.add(srv["pid"])
            shown = ", ".join(f"{x['field']} {_fmt(x['on_disk'])} (published {_fmt(x['pinned'])})"
                              for x in diffs[:4]) or "bytes differ"
            if d.get("kind") == "hub":
                fix = (f"deploy up {pb} --clean-gpus (serves the pinned config from deploy's own drafter "
                       f"directory with links to the snapshot's other files; the hub snapshot {d.get('path')} "
                       f"is never written)")
            else:
                fix = (f"deploy up {pb} --clean-gpus (stops the hand-started server's GPU holders, installs the "
                       f"pinned config, verifies it as vLLM loads it, relaunches, measures acceptance)")
            add("guessed-config", f"server pid {srv['pid']} reads {d['path']}, which is not the published config "
                                  f"pinned by {p['playbook'] or 'playbooks/drafters'}: {shown}", fix,
                pid=srv["pid"], path=d["path"], differences=diffs)
        else:
            d["matches_pinned"] = True
            proc = next((x for x in procs if x["pid"] == srv["pid"]), {})
            started, mtime = proc.get("started_at"), d.get("mtime")
            if started and mtime and mtime > started + 1:
                add("stale-write", f"server pid {srv['pid']} started at {_t(started)}, before {d['path']} got the "
                                   f"published bytes at {_t(mtime)}: vLLM still runs with what it read at start",
                    f"deploy up {pb} --clean-gpus (relaunches reading the pinned config)",
                    pid=srv["pid"], started_at=started, mtime=mtime)
        # the target model and the drafter must agree
        tgt = srv.get("target") or {}
        if tgt.get("text") and cfg:
            try:
                tcfg = json.loads(tgt["text"])
                tcfg = tcfg.get("text_config", tcfg) if isinstance(tcfg, dict) else {}
            except ValueError:
                tcfg = {}
            layers = tcfg.get("num_hidden_layers")
            ids = _get(cfg, "dflash_config.target_layer_ids")
            if isinstance(layers, int) and isinstance(ids, list) and ids and max(ids) >= layers:
                add("guessed-config", f"drafter target_layer_ids {ids} reach past the target's {layers} layers "
                                      f"({tgt['path']})", f"deploy up {pb} --clean-gpus", pid=srv["pid"])
        # the fixes the drafter needs
        if spec.get("method") == "dflash" and stack.get("installed"):
            plus1, sw = fixes_present(stack)
            sliding = "sliding_attention" in (cfg.get("layer_types") or [])
            need = [("the +1 layer-id offset (vLLM PR #40727)", plus1)]
            if sliding:
                need.append(("sliding-window support for DFlash drafters (vLLM PR #40898, or >= 0.26)", sw))
            m = stack.get("markers") or {}
            missing = [n for n, ok in need if not ok]
            if missing:
                add("missing-fix", f"vLLM {stack.get('version')} lacks " + " and ".join(missing),
                    f"install a vLLM build with the fix (deploy verify {pb} checks it); until then "
                    f"deploy up {fallback or 'qwen36-mtp'} --clean-gpus (MTP needs neither fix)",
                    version=stack.get("version"), markers=m)
        # acceptance, from the server's own counters
        if srv.get("metrics"):
            life = vf.lifetime_acceptance(srv["metrics"])
            srv["acceptance"] = life.as_dict() if life else None
            v = low_acceptance_verdict(life, p)
            if v is not None:
                why = "the guessed drafter config above" if srv["pid"] in guessed_in else \
                    "missing vLLM fixes above" if any(f["class"] == "missing-fix" for f in findings) else \
                    "not a config or build problem found here"
                add("low-acceptance", f"server pid {srv['pid']}: {v.figures_text()}: {v.reason}; likely cause: {why}",
                    f"deploy up {pb if srv['pid'] in guessed_in else fallback or 'qwen36-mtp'} --clean-gpus",
                    pid=srv["pid"], acceptance=life.as_dict(), verdict=v.as_dict())
    timed_out = bool(stack.get("import_timed_out"))
    if stack.get("installed") and timed_out and not stack.get("extensions_missing"):
        # slow is not broken (issue 37): a timeout says nothing about the build, and is its own finding
        load = stack.get("load_factor")
        scaled = f" (budget {stack.get('budget_s')}s: x{load:g} for the load measured)" \
            if isinstance(load, (int, float)) and load > 1 else ""
        add("check-timeout", f"vLLM {stack.get('version')} at {stack.get('path')}: {stack.get('import_error')}"
                             + scaled,
            "rerun deploy doctor with a larger --budget (e.g. --budget 60), or when the host is less busy",
            check="import vllm", tries_s=stack.get("import_tries"))
    tried = bool(stack.get("import_tries"))  # an import was run (not refused as untrusted)
    if stack.get("installed") and tried and stack.get("import_ok") is False and not timed_out \
            and not stack.get("extensions_missing"):
        # every compiled extension is there: the build is complete and its import fails (issue 53): say that, with
        # the exception's own line (what a user searches for)
        exc = stack.get("import_exception") or stack.get("import_error")
        add("import-fails", f"vLLM {stack.get('version')} at {stack.get('path')}: every compiled extension is "
                            f"present, but `import vllm` fails: {exc}",
            "run `python -c 'import vllm'` with the runtime's Python in the container for the whole traceback; "
            "a CUDA or driver error: deploy verify " + pbname + " (its gpu-plumbing check names the node or "
            "version); a missing or mismatched package: deploy install-vllm " + pbname + " (reinstalls the "
            f"playbook's requires.vllm); then deploy verify {pbname}", exception=exc, **{"stack": stack})
    elif stack.get("installed") and (stack.get("extensions_missing") or
                                     (stack.get("import_ok") is False and not timed_out)):
        what = []
        if stack.get("extensions_missing"):
            what.append("compiled extensions missing: " + ", ".join(stack["extensions_missing"]))
        if stack.get("import_ok") is False and not timed_out:
            what.append(f"import vllm fails: {stack.get('import_error')}")
        add("incomplete-build", f"vLLM {stack.get('version')} at {stack.get('path')}: " + "; ".join(what),
            f"reinstall vLLM completely (let the build finish), then deploy verify {pbname}", **{"stack": stack})
    # GPU holders that belong to no running server
    serving = {s["pid"] for s in servers}
    by_pid = {x["pid"]: x for x in procs}

    def under_server(pid, hops=0):
        x = by_pid.get(pid)
        if pid in serving:
            return True
        return bool(x) and hops < 20 and under_server(x.get("ppid"), hops + 1)

    for h in facts.get("holders") or []:
        if h["pid"] in serving or under_server(h["pid"]):
            continue
        add("leftover-holder", f"PID {h['pid']} ({h.get('comm')}) holds {', '.join(h.get('devices') or [])} "
                               f"but belongs to no running vLLM server (e.g. an engine left by pkill -9 -f vllm)",
            f"deploy down {pbname} --clean-gpus (lists the holders, asks, then fuser -k in this container only)",
            pid=h["pid"], cmdline=h.get("cmdline"))
    smi = facts.get("memory") or {}
    mismatch = nvml_mismatch_fix(smi.get("message"), host, vmid) if smi.get("error") else None
    if mismatch:  # two driver versions, not a wedged driver (issue 41)
        add("driver-mismatch", f"nvidia-smi in this container fails: {smi['message']}", mismatch)
    mem = smi.get("gpus") or {}
    mine = {int(i) for i in mem}
    outside = [h for h in (host_holders or {}).get("holders", [])
               if h["gpu"] in mine and h.get("pid_ns") and h["pid_ns"] != facts.get("pid_ns")]
    for h in outside:
        if h.get("vmid"):
            where, fix = (f"container {h['vmid']}", f"GPU {h['gpu']} is shared with container {h['vmid']}: "
                          f"deploy doctor {host}/{h['vmid']} (and stop it there), or give each container its own GPU")
        elif h["pid_ns"] == (host_holders or {}).get("host_pid_ns"):
            where, fix = ("the host itself (no container)", f"nothing deploy may stop (it never kills on the host): "
                          f"stop host PID {h['pid']} yourself; deploy discover {host} shows who shares GPU {h['gpu']}")
        else:
            where, fix = ("another container", f"deploy discover {host} shows which containers share GPU "
                                               f"{h['gpu']}; stop it there")
        add("leftover-holder", f"GPU {h['gpu']} is held outside this container, by {where}: host PID {h['pid']} "
                               f"({h.get('comm') or '?'}) uses {h['mib']} MiB", fix, **h)
    if not facts.get("holders") and mem and host_holders is None:
        used = {int(i): g["used"] for i, g in mem.items() if g["used"] > 1024}
        if used:
            add("leftover-holder", "GPU memory is in use but no process in this container holds a GPU: "
                                   + ", ".join(f"GPU {i} {u} MiB" for i, u in sorted(used.items()))
                                   + "; the holder is outside (another container given the same GPU, or the host)",
                f"deploy discover {host} (shows which containers share GPU "
                f"{', '.join(str(i) for i in sorted(used))}); nothing in this container can free it", used_mib=used)
    return findings


def idle_drafter_checks(pinned: list[dict], host: str, vmid: int, file_sha) -> list[dict]:
    """With no server running (issue 26): the drafter configs the playbooks that target this container name (a
    local directory; a hub id is resolved by `deploy verify`), each compared with its pinned bytes, and what a
    server started now would do with it. file_sha(path) -> the agent's file_sha result."""
    out, here = [], f"{host}/{vmid}"
    for p in pinned:
        if not p.get("path") or here not in str(p.get("target") or "").split(", "):
            continue
        path = p["path"].rstrip("/") + "/config.json"
        try:
            r = file_sha(path)
        except Exception as e:  # noqa: BLE001 - one unreadable file must not hide the rest of the diagnosis
            r = FileShaResult(error=str(e))
        c = {"playbook": p["playbook"], "path": path, "sha256": r.sha256, "pinned_sha256": p["sha256"]}
        if r.error or not r.sha256:
            c["verdict"] = (f"cannot be read ({r.error or 'no sha256'}): deploy up {p['playbook']} installs the pinned "
                            "config")
        elif r.sha256 == p["sha256"]:
            c["verdict"] = f"= the published config ({p['playbook']}): a server started now would read it"
        else:
            c["verdict"] = f"differs from the published config ({p['playbook']})"
            c["finding"] = {"class": "guessed-config",
                            "cause": f"no vLLM server runs, but {path} (sha256 {r.sha256[:12]}) is not the "
                                     f"published config pinned by {p['playbook']} ({p['sha256'][:12]}): a server "
                                     "started from it now would draft with the wrong layers (~1% acceptance)",
                            "fix": f"deploy apply-config {p['playbook']} (installs and verifies the pinned config; "
                                   f"deploy up {p['playbook']} does it too)", "evidence": {"path": path}}
        out.append(c)
    return out


def scan_args(pinned: list[dict], by_target: dict) -> dict:
    """The drafter_scan arguments: every playbook's drafter HF_HOME, and the parent directories of every
    playbook's model and drafter paths (the agent adds /root/.cache/huggingface/hub and /root/models)."""
    infos = list(pinned) + list(by_target.values())
    hf = sorted({i["hf_home"] for i in infos if i.get("hf_home")})
    dirs = sorted({os.path.dirname(str(x).rstrip("/")) for i in infos for x in (i.get("model_path"), i.get("path"))
                   if x and str(x).startswith("/") and os.path.dirname(str(x).rstrip("/")) not in ("", "/")})
    return {"hf_homes": hf, "model_dirs": dirs, "budget_s": 5}


def scan_checks(scan: dict, pinned: list[dict], host: str, vmid: int, covered=()) -> list[dict]:
    """With no server running (issue 26): each drafter-looking config.json the agent's drafter_scan found in the
    hub cache or a models directory that the playbook-path checks did not already cover, and what a server
    started from it would do. An unreadable one is said too (not a finding: deploy cannot tell what it is)."""
    here = f"{host}/{vmid}"
    mine = [p for p in pinned if here in str(p.get("target") or "").split(", ")]
    covered = {str(c).rstrip("/") for c in covered}
    out = []
    for c in scan.get("configs") or []:
        if not isinstance(c, dict) or not isinstance(c.get("path"), str) or c["path"] in covered:
            continue
        if c.get("realpath") and c.get("kind") != "hub" and c["realpath"] in covered:
            continue
        where = c["path"]
        item = {"path": where, "kind": c.get("kind"), "hub_id": c.get("hub_id"), "revision": c.get("revision"),
                "sha256": c.get("sha256"), "size": c.get("size"), "drafter": c.get("drafter") or []}
        if c.get("error"):
            item["verdict"] = f"not read ({c['error']})"
            out.append(item)
            continue
        if c.get("parse_error"):
            item["verdict"] = f"not valid JSON ({c['parse_error']}): vLLM would refuse to load it"
            out.append(item)
            continue
        if not item["drafter"] or not isinstance(item["sha256"], str):
            continue  # a target model's config, or anything else that is no drafter's
        same = [p for p in pinned if p.get("sha256") == item["sha256"]]
        if same:
            p = next((x for x in same if x in mine), same[0])
            item["verdict"] = f"= the published config of {p['playbook']}"
            item["pinned_by"] = p["playbook"]
            out.append(item)
            continue
        served = f"--speculative-config model={c.get('hub_id')}" if c.get("kind") == "hub" and c.get("hub_id") \
            else f"--speculative-config model={c.get('dir') or os.path.dirname(where)}"
        name = os.path.basename(str(c.get("dir") or "").rstrip("/"))
        uses = next((p for p in mine if (c.get("kind") == "hub" and c.get("hub_id") and p.get("hub_id") == c["hub_id"])
                     or (c.get("kind") != "hub" and name and p.get("path")
                         and os.path.basename(p["path"].rstrip("/")) == name)), None)
        diff = ""
        ids = c.get("target_layer_ids")
        ref = next((p for p in pinned if p["config"].get("architectures") == c.get("architectures")), None)
        if ids is not None and ref is not None:
            pub = _get(ref["config"], "dflash_config.target_layer_ids")
            if pub != ids:
                diff = (f"; its dflash_config.target_layer_ids {ids} differ from the published {pub} "
                        f"({ref['playbook']})")
        if uses:
            fix = (f"deploy apply-config {uses['playbook']} (installs and verifies the pinned config for the drafter "
                   f"{uses.get('hub_id') or uses.get('path')}" + ("; the hub snapshot itself is never written, so a "
                                                                   "server started by hand from it still reads this file"
                                                                   if c.get("kind") == "hub" else "") + ")")
        else:
            key = f"hub_id: {c['hub_id']}" if c.get("kind") == "hub" and c.get("hub_id") else \
                f"path: {c.get('dir') or os.path.dirname(where)}"
            fix = (f"point a playbook's drafter at it ({key}) and pin its published config (deploy apply-config "
                   "PLAYBOOK then installs and verifies it), or remove it")
        item["verdict"] = "matches no pinned config"
        item["finding"] = {
            "class": "guessed-config",
            "cause": f"no vLLM server runs, but {where} (sha256 {item['sha256'][:12]}; "
                     f"{', '.join(item['drafter'][:2])}) is a drafter config that matches no pinned config: deploy "
                     f"cannot vouch for it, and a server started with {served} would draft with whatever layers it "
                     f"names{diff}",
            "fix": fix, "evidence": {"path": where, "sha256": item["sha256"], "hub_id": c.get("hub_id")}}
        out.append(item)
    return out


def _t(ts) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts)) + "Z"


# ------------------------------------------------------------------ gathering


def pinned_configs(inv) -> tuple[list[dict], dict]:
    """Every valid playbook's pinned drafter config, and {(host, vmid): playbook info} for the fix commands."""
    pinned, targets = [], {}
    for name in list_playbooks():
        try:
            pb = load_playbook(name, inv)
        except DeployError:
            continue
        acc, d = pb.conf.acceptance, pb.conf.speculative.drafter
        info = {"playbook": pb.name, "fallback": acc.fallback, "target": pb.where,
                "model_path": pb.conf.model.path, "hf_home": d.hf_home if d else None,
                "store": pb.conf.fetch.store,
                "min_acceptance": acc.min_draft_acceptance,
                "acceptance": {k: getattr(acc, k) for k in ("min_mean_acceptance_length", "min_first_position",
                                                            "cliff_check", "min_drafts", "min_draft_acceptance")}}
        for m in pb.members:  # every target of a playbook with targets: (replicas)
            targets.setdefault((m.host, m.vmid), {**info, "target": f"{m.host}/{m.vmid}", "gpus": list(m.gpus),
                                                  "tp": int(m.conf.serve.tensor_parallel_size or 1)})
        if d and pb.drafter_config is not None:
            pinned.append({**info, "path": d.path, "hub_id": d.hub_id,
                           "config": pb.drafter_config, "sha256": hashlib.sha256(pb.drafter_bytes).hexdigest()})
    return pinned, targets


def run_doctor(obj, targets, budget_s: float = 12.0) -> int:
    inv = obj.inventory()
    scope = resolve_targets(inv, targets)
    pinned, by_target = pinned_configs(inv)
    t0 = time.monotonic()
    hosts_read: dict = {}
    lock = threading.Lock()

    def host_info(host):
        """The host's GPU processes, read once per host (read-only); None when that fails."""
        with lock:
            ev = hosts_read.get(host)
            first = ev is None
            if first:
                ev = hosts_read[host] = {"done": threading.Event(), "value": None}
        if first:
            try:
                r = fleet.session(host).run(["sh", "-c", HOST_HOLDERS_SH], timeout=25, label="doctor")
                ev["value"] = parse_host_holders(r.out) if r.ok else None
            except DeployError:
                ev["value"] = None
            finally:
                ev["done"].set()
        ev["done"].wait(30)
        return ev["value"]

    def one(item):
        host, vmid, rt = item
        row = {"host": host, "vmid": vmid, "reachable": True, "runtime": rt and rt.python, "servers": [],
               "processes": [], "findings": [], "error": None, "seconds": None}
        t = time.monotonic()
        if rt is None:
            row["note"] = "no vLLM runtime (deploy discover shows what the container has)"
            return row
        try:
            facts = call_on(fleet.session(host), step_on(host, vmid, rt.python, "doctor", "doctor", {
                "budget_s": budget_s, "state_dir": rt.state_dir}, budget_s * LOAD_MAX + 10))  # grows with load
        except DeployError as e:
            row["error"] = e.render()
            row["reachable"] = not isinstance(e, Unreachable)
            return row
        try:
            return _facts_row(row, one_server_per_launch(facts.as_dict()), host, vmid, t, rt)
        except (TypeError, KeyError, AttributeError, ValueError) as e:  # typed, but nested data still odd
            row["error"] = agent.AgentError(
                f"agent action 'doctor' answered a malformed result ({type(e).__name__}: {e})", where=f"{host}/{vmid}",
                fix="a bug in deploy's agent, or something in the container answers for it; report it with "
                    "deploy's audit log").render()
            return row

    def _facts_row(row, facts, host, vmid, t, rt):
        hh = host_info(host)
        pbi = by_target.get((host, vmid))
        if facts.get("state") and not (facts["state"] or {}).get("corrupt"):
            pbi = {**(pbi or {}), "playbook": facts["state"].get("playbook") or (pbi or {}).get("playbook")}
        row["findings"] = diagnose(facts, pinned, host=host, vmid=vmid, playbook=pbi, host_holders=hh)
        row["findings"] += plumbing_findings(fleet.session(host), facts.get("plumbing"), host, vmid,
                                             by_target.get((host, vmid)), row)
        if not facts.get("servers"):  # no server: still check the drafter configs a server started now would read
            row["idle_configs"] = idle_drafter_checks(
                pinned, host, vmid, lambda path: call_on(fleet.session(host), step_on(
                    host, vmid, rt.python, "file_sha", "file_sha", {"path": path}, 20)))
            row["findings"] += [c["finding"] for c in row["idle_configs"] if c.get("finding")]
            row["scanned_configs"], row["scan"] = [], None
            try:  # the hub cache and models directories: one agent call for all of them
                r = call_on(fleet.session(host), step_on(host, vmid, rt.python, "drafter_scan", "drafter_scan",
                                                         scan_args(pinned, by_target), 20))
                row["scan"] = {k: v for k, v in r.as_dict().items() if k != "configs"}
                row["scanned_configs"] = scan_checks(r.as_dict(), pinned, host, vmid,
                                                     [c["path"] for c in row["idle_configs"]])
            except DeployError as e:
                row["scan"] = {"error": e.render()}
            except (TypeError, KeyError, AttributeError, ValueError) as e:  # typed, but nested data still odd
                row["scanned_configs"] = []
                row["scan"] = {"error": f"agent action 'drafter_scan' answered a malformed result "
                                        f"({type(e).__name__}: {e})"}
            row["findings"] += [c["finding"] for c in row["scanned_configs"] if c.get("finding")]
        row["processes"] = [{k: p.get(k) for k in ("pid", "ppid", "pgid", "comm", "devices", "started_at")}
                            | {"argv": " ".join(p.get("argv") or [])[:400]} for p in facts.get("processes") or []]
        row["servers"] = [_server_view(s) for s in facts.get("servers") or []]
        row["stack"] = {k: (facts.get("stack") or {}).get(k) for k in ("version", "path", "markers",
                                                                      "extensions_missing", "import_ok")}
        row["started_by_deploy"] = bool(facts.get("state"))
        row["seconds"] = round(time.monotonic() - t, 2)
        return row

    with Fleet(inv) as fleet:
        res = run_parallel(scope, one, deadline_s=budget_s * LOAD_MAX + 20)
    rows = []
    for item, value, err in res:
        if err is not None:
            value = {"host": item[0], "vmid": item[1], "reachable": False, "servers": [], "processes": [],
                     "findings": [], "error": str(getattr(err, "message", err)), "seconds": None}
        rows.append(value)
    code = EXIT_UNREACHABLE if any(not r["reachable"] for r in rows) else \
        EXIT_FAILED if any(r["findings"] or r.get("error") for r in rows) else EXIT_OK
    if obj.json:
        dump_json({"schema": SCHEMA, "seconds": round(time.monotonic() - t0, 2), "exit_code": code,
                   "containers": rows})
    else:
        click.echo(render(rows))
    return code


def plumbing_findings(session, ct_facts, host: str, vmid: int, target: dict | None, row: dict) -> list[dict]:
    """The gpu-plumbing check (orchestrator/steps/plumbing_check.py) for doctor: the host side in one exec per container, the
    container side from the doctor action's own result. Without a playbook for the container, the GPUs it is
    given in pct config stand for the assigned ones. Findings in doctor's {class, cause, fix, evidence} form."""
    if not isinstance(ct_facts, dict):  # an older agent: nothing to compare
        return []
    h = PL.read_host(session, vmid, label="doctor")
    row["gpu_plumbing_host_error"] = h.get("error")
    host_facts = None if h.get("error") else h
    extra = store_findings(host_facts, host, vmid, target)
    gpus = (target or {}).get("gpus")
    if gpus is None:
        gpus = parse_pct_config_gpus("\n".join((host_facts or {}).get("config") or []))
        if not gpus:  # no playbook and no GPU passed in: a container without GPUs, nothing to check
            row["gpu_plumbing"] = None
            return extra
    found = PL.findings(host_facts, ct_facts, host_name=host, vmid=vmid, gpus=gpus, tp=(target or {}).get("tp", 1))
    row["gpu_plumbing"] = PL.summary(found)
    return [{"class": PL.CHECK, "cause": f"{f['problem']}: {f['where']}: expected {f['expected']}, found "
                                         f"{f['found']} ({f['cause']})", "fix": f["fix"],
             "evidence": {k: f[k] for k in ("problem", "where", "expected", "found")}} for f in found] + extra


def store_findings(host_facts: dict | None, host: str, vmid: int, target: dict | None) -> list[dict]:
    """The playbook's shared model store (fetch.store) mounted into a privileged container: a finding (issue 50:
    root in that container can remount the store read-write and change what every container serves)."""
    from orchestrator.hosts.prepare import is_privileged, privileged_store_warning

    store = (target or {}).get("store")
    config = (host_facts or {}).get("config") or []
    if not store or not host_facts:
        return []
    mounted = [ln for ln in config if re.match(r"mp\d+:\s*" + re.escape(store.rstrip("/")) + r"/?,", ln.strip())]
    if not mounted or not is_privileged(config):
        return []
    return [{"class": "privileged-store", "cause": privileged_store_warning(host, vmid, [store]),
             "fix": f"move the deployment to an unprivileged container (pct create ... --unprivileged 1; deploy "
                    f"prepare {host}/VMID --create), or drop fetch.store for this one and remove `{mounted[0]}` "
                    f"from its config", "evidence": {"mount": mounted[0], "unprivileged": False}}]


def _server_view(s: dict) -> dict:
    d = s.get("drafter") or {}
    return {"pid": s["pid"], "port": (s.get("args") or {}).get("port"), "model": (s.get("args") or {}).get("model"),
            "speculative_config": (s.get("args") or {}).get("spec") or (s.get("args") or {}).get("spec_raw"),
            "drafter": {k: d.get(k) for k in ("kind", "path", "realpath", "sha256", "mtime", "hub_id", "revision",
                                              "matches_pinned", "pinned_by", "error")} if d else None,
            "health": s.get("health"), "acceptance": s.get("acceptance")}


def render(rows) -> str:
    out = []
    for r in rows:
        where = f"{r['host']}/{r['vmid']}"
        if r.get("error"):
            out.append(f"{where}: could not be examined: {r['error']}")
            continue
        if r.get("note"):
            out.append(f"{where}: {r['note']}")
            continue
        st = r.get("stack") or {}
        plus1, sw = fixes_present(st)
        out.append(f"{where}: vLLM {st.get('version') or 'not installed'}"
                   + (f" (+1 layer-id fix {'yes' if plus1 else 'no'}, DFlash sliding window {'yes' if sw else 'no'})"
                      if st.get("version") else "")
                   + f"; {len(r['servers'])} vLLM server(s)"
                   + ("" if not r["servers"] else " (started by deploy)" if r.get("started_by_deploy")
                      else " (not started by deploy)") + f"; examined in {r['seconds']}s")
        for s in r["servers"]:
            d = s.get("drafter") or {}
            acc = s.get("acceptance") or {}
            out.append(f"  server pid {s['pid']} port {s['port']} model {s['model']}  /health {s.get('health') or '-'}")
            if s.get("speculative_config"):
                out.append(f"    --speculative-config {json.dumps(s['speculative_config'], separators=(',', ':'))}")
            if d:
                verdict = {True: f"= the published config ({d.get('pinned_by')})", False: "differs from the published "
                           f"config ({d.get('pinned_by')})", None: "no pinned config to compare"}[d.get("matches_pinned")]
                out.append(f"    drafter config {d.get('path')} sha256 {str(d.get('sha256'))[:12]}: {verdict}")
            if acc.get("draft_acceptance_rate") is not None:
                out.append(f"    draft acceptance {acc['draft_acceptance_rate']:.1%}, mean acceptance length "
                           f"{acc.get('mean_acceptance_length') or 0:.2f} ({acc.get('drafts'):g} drafts, /metrics)")
        for c in r.get("idle_configs") or []:
            out.append(f"  drafter config {c['path']} (no server runs; for {c['playbook']}): {c['verdict']}")
        for c in r.get("scanned_configs") or []:
            sha = f" sha256 {c['sha256'][:12]}" if c.get("sha256") else ""
            where = "hub cache" if c.get("kind") == "hub" else "models directory"
            out.append(f"  drafter config {c['path']}{sha} (no server runs; {where}): {c['verdict']}")
        sc = r.get("scan") or {}
        if sc.get("error"):
            out.append(f"  hub cache and models directories not scanned: {sc['error']}")
        elif sc.get("truncated"):
            out.append(f"  hub cache and models directories: scan stopped early ({sc['truncated']}); "
                       "configs past that point were not examined")
        for p in r["processes"]:
            out.append(f"  pid {p['pid']} (parent {p['ppid']}, group {p['pgid']}) {p['comm']}"
                       + (f" holds {', '.join(p['devices'])}" if p.get("devices") else ""))
        if not r["findings"]:
            out.append("  no problem found")
        for f in r["findings"]:
            out.append(f"  {f['class'].upper()}: {f['cause']}")
            out.append(f"    fix: {f['fix']}")
    return "\n".join(out)
