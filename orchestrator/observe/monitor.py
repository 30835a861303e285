"""`deploy monitor export DIR`: what Prometheus and Grafana need to watch the deployments, from the inventory and the
playbooks (nothing is read from the hosts): a file_sd target list, alerting rules (with promtool unit tests for
every alert), a prometheus.yml that uses both, and a Grafana dashboard. See docs/monitoring.md.

The thresholds are the acceptance gate's, per playbook (orchestrator.core.gate.thresholds; the same
defaults otherwise): an alert says the same thing `deploy up` would have said about that drafter.
"""

from __future__ import annotations

import json
import os
import re

import yaml

from orchestrator.core import vllm_facts as vf
from orchestrator.core.atomic import write_atomic
from orchestrator.core.gate import CLIFF_BEFORE, CLIFF_ZERO, playbook_thresholds  # the cliff: as the gate judges it

JOB = "vllm-pve-deploy"
# vLLM's metric names, as the queries spell them (the families: vllm_facts.py)
DRAFTS = vf.M_DRAFTS + "_total"
ACCEPTED = vf.M_ACCEPTED + "_total"
PER_POS = vf.M_PER_POS + "_total"
GEN_TOKENS = vf.M_GEN_TOKENS + "_total"
# deploy's own facts, from `deploy monitor metrics` (node_exporter textfile collector, see docs/monitoring.md)
VPD_GATED = "vpd_gated"
VPD_RESTARTS = "vpd_unit_restarts_total"
VPD_START_LIMIT = "vpd_unit_start_limit_hit"
VPD_FOREIGN = "vpd_gpu_foreign_memory_mib"
VPD_TIMESTAMP = "vpd_status_timestamp_seconds"
VPD_REACHABLE = "vpd_status_reachable"
VPD_OPERATION = "vpd_operation_in_progress"  # a deploy up/restart/down holds the container's lock (gate pending)
STALE_S = 300  # VpdStatusStale: deploy monitor metrics has not refreshed a host's series for this long
STATUS_JOB = "vllm-pve-deploy-status"  # prometheus.yml's job for node_exporter (--node-exporter)
STALE_MISSING_FOR = "5m"  # VpdStatusMissing: no vpd_status_timestamp_seconds at all for this long

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d))+$")


def duration(text: str) -> str:
    """A Prometheus duration (30s, 5m, 1h30m) or ValueError."""
    if not _DURATION.match(text or ""):
        raise ValueError(f"{text!r} is not a Prometheus duration such as 30s, 5m or 1h")
    return text


def gate_thresholds(pb) -> dict:
    """{min_al, min_first, k, cliff}: the acceptance gate's (orchestrator/core/gate.py), from the playbook."""
    th = playbook_thresholds(pb)
    return {"k": th.k, "min_al": round(float(th.min_al), 3), "min_first": float(th.min_first), "cliff": bool(th.cliff)}


def choose(inv, playbooks: list) -> tuple[list, list]:
    """One playbook per container: -> ([(pb, member, target)], notes). Where several playbooks target a container
    (a playbook and its fallback), the one that is not another's fallback is kept and a note says so."""
    fallbacks = {pb.conf.acceptance.fallback for pb in playbooks}
    by_ct: dict = {}
    for pb in playbooks:
        for t in pb.targets:
            if t.host in inv.hosts:
                by_ct.setdefault((t.host, t.vmid), []).append((pb, t))
    chosen, notes = [], []
    for key in sorted(by_ct):
        cands = sorted(by_ct[key], key=lambda c: (c[0].name in fallbacks, c[0].name))
        pb, t = cands[0]
        if len(cands) > 1:
            notes.append(f"{key[0]}/{key[1]} is targeted by {', '.join(c[0].name for c in cands)}: labelled "
                         f"{pb.name} (after a fallback, export again naming the playbook that runs there)")
        member = pb.member(t.where) if pb.is_fleet else pb
        chosen.append((pb, member, t))
    return chosen, notes


def targets(inv, chosen) -> tuple[list, list]:
    """file_sd groups (one per container) and the containers left out (no address in the inventory)."""
    groups, missing = [], []
    for pb, member, t in chosen:
        host = inv.hosts[t.host]
        ct = host.container(t.vmid)
        addr = getattr(ct, "address", None) if ct is not None else None
        if not addr:
            missing.append(t.where)
            continue
        shown = f"[{addr}]" if ":" in addr else addr
        groups.append({"targets": [f"{shown}:{member.conf.serve.port}"],
                       "labels": {"host": t.host, "vmid": str(t.vmid), "playbook": pb.name,
                                  "method": member.conf.speculative.method,
                                  "model": member.conf.serve.served_model_name}})
    return groups, missing


def _al(window: str) -> str:
    return f"1 + rate({ACCEPTED}[{window}]) / rate({DRAFTS}[{window}])"


def _each_playbook(chosen):
    """(pb, member, target, the gate's thresholds) once per playbook of `chosen` (its first container)."""
    seen = set()
    for pb, member, t in chosen:
        if pb.name not in seen:
            seen.add(pb.name)
            yield pb, member, t, gate_thresholds(pb)


def _alert(name: str, expr: str, severity: str, summary: str, description: str, for_: str | None = None,
           **labels) -> dict:
    """One alerting rule, its keys in the rule file's order (`for` only when it waits)."""
    rule = {"alert": name, "expr": expr, **({"for": for_} if for_ else {})}
    rule["labels"] = {"severity": severity, **labels}
    rule["annotations"] = {"summary": summary, "description": description}
    return rule


def rules(chosen, *, window: str, for_: str, down_for: str, status_exporter: bool = False) -> dict:
    """The rule file: recording rules for acceptance, and the alerts. status_exporter (export --node-exporter: the
    operator runs `deploy monitor metrics`): also VpdStatusMissing, when none of its series reach Prometheus."""
    rec = [
        {"record": "vpd:acceptance_length", "expr": _al(window)},
        {"record": "vpd:acceptance_per_position",
         "expr": f"rate({PER_POS}[{window}]) / ignoring(position) group_left rate({DRAFTS}[{window}])"},
        {"record": "vpd:generation_tokens_per_second", "expr": f"rate({GEN_TOKENS}[{window}])"},
    ]
    alerts = [_alert("VllmEndpointDown", f'up{{job="{JOB}"}} == 0', "critical",
                     "{{ $labels.playbook }} on {{ $labels.host }}/{{ $labels.vmid }} does not answer /metrics",
                     "Prometheus cannot scrape {{ $labels.instance }}. deploy status {{ $labels.playbook }}; "
                     "deploy logs {{ $labels.host }}/{{ $labels.vmid }}", for_=down_for)]
    where = "{{ $labels.playbook }} on {{ $labels.host }}/{{ $labels.vmid }}"
    for pb, _member, _t, th in _each_playbook(chosen):
        sel = f'playbook="{pb.name}"'
        alerts.append(_alert(
            "VllmAcceptanceLengthLow", f"vpd:acceptance_length{{{sel}}} < {th['min_al']:g}", "warning",
            f"{where}: acceptance length {{{{ $value | printf \"%.2f\" }}}} under the gate's {th['min_al']:g} "
            f"for {for_}",
            "The drafter accepts too little: a stale or guessed drafter config, or a different target model. "
            "deploy verify {{ $labels.playbook }}; deploy apply-config {{ $labels.playbook }}",
            for_=for_, gate_min_al=f"{th['min_al']:g}"))
        alerts.append(_alert(
            "VllmFirstPositionLow", f'vpd:acceptance_per_position{{{sel},position="0"}} < {th["min_first"]:g}',
            "warning", f"{where}: position-0 acceptance {{{{ $value | printf \"%.2f\" }}}} under {th['min_first']:g}",
            "The first drafted token is rarely right: the drafter does not match the target. "
            "deploy verify {{ $labels.playbook }}", for_=for_))
        if th["cliff"] and th["k"] >= 2:
            terms = [f'(vpd:acceptance_per_position{{{sel},position="{p}"}} <= {CLIFF_ZERO:g}) and on(instance) '
                     f'(vpd:acceptance_per_position{{{sel},position="{p - 1}"}} >= {CLIFF_BEFORE:g})'
                     for p in range(1, th["k"])]
            alerts.append(_alert(
                "VllmAcceptanceCliff", "\nor\n".join(terms), "warning",
                f"{where}: acceptance falls to ~0 at draft position {{{{ $labels.position }}}}",
                "A cliff in the per-position curve: sliding-window layers run as full attention, or a missing "
                "sliding window in the drafter config. deploy verify {{ $labels.playbook }}", for_=for_))
    alerts += [
        _alert("VllmServerRestarted",
               f'changes({vf.M_START_TIME}{{job="{JOB}"}}[15m]) > 0 or increase({VPD_RESTARTS}[15m]) > 0', "warning",
               "vLLM on {{ $labels.host }}/{{ $labels.vmid }} restarted in the last 15 minutes",
               "systemd restarted the server (or it was started again). "
               "deploy logs {{ $labels.host }}/{{ $labels.vmid }}"),
        _alert("VllmStartLimitHit", f"{VPD_START_LIMIT} == 1", "critical",
               "{{ $labels.unit }} on {{ $labels.host }}/{{ $labels.vmid }} hit systemd's start limit: it will not "
               "be restarted",
               "The server crashed repeatedly. deploy logs {{ $labels.host }}/{{ $labels.vmid }}; fix the cause, "
               "then deploy restart {{ $labels.playbook }}"),
        _alert("VllmNotGated", f"{VPD_GATED} == 0 unless on(host, vmid) {VPD_OPERATION} == 1", "warning",
               f"{where} serves without a passed acceptance gate",
               "Started without the gate, or the gate's verdict is missing or failed. "
               "deploy status {{ $labels.playbook }}", for_=for_),
        _alert("GpuMemoryHeldOutsideDeployment", f"{VPD_FOREIGN} > 1024", "warning",
               "GPU {{ $labels.gpu }} of {{ $labels.host }} (seen from container {{ $labels.vmid }}): "
               "{{ $value }} MiB held outside any deployment of ours",
               "Something else uses this GPU's memory (another container, a host process, a server deploy did not "
               "start): the next start may not fit. deploy status {{ $labels.host }}/{{ $labels.vmid }}; "
               "nvidia-smi on the host", for_=for_),
        _alert("VpdStatusUnreachable", f"{VPD_REACHABLE} == 0", "warning",
               "deploy monitor metrics cannot reach {{ $labels.host }}/{{ $labels.vmid }}",
               "Its host did not answer over SSH (or timed out), so its vpd_* facts are unknown. "
               "deploy status {{ $labels.host }}/{{ $labels.vmid }}", for_=down_for),
        _alert("VpdStatusStale", f"time() - {VPD_TIMESTAMP} > {STALE_S}", "warning",
               "deploy's facts about {{ $labels.host }} are {{ $value | printf \"%.0f\" }} s old",
               f"deploy monitor metrics has not refreshed them for over {STALE_S} s: its timer stopped or fails. "
               "systemctl status vpd-metrics.timer vpd-metrics.service; journalctl -u vpd-metrics.service"),
    ]
    if status_exporter:
        alerts.append(_alert(
            "VpdStatusMissing", f"absent({VPD_TIMESTAMP})", "warning",
            "no series of deploy monitor metrics reach Prometheus",
            "node_exporter's textfile collector serves no vllm-pve-deploy .prom file "
            f"(job {STATUS_JOB}): the timer never wrote it, or writes elsewhere. "
            "systemctl status vpd-metrics.timer; ls /var/lib/prometheus/node-exporter", for_=STALE_MISSING_FOR))
    return {"groups": [{"name": "vllm-pve-deploy-recording", "rules": rec},
                       {"name": "vllm-pve-deploy-alerts", "rules": alerts}]}


def rule_tests(chosen, *, for_: str, status_exporter: bool = False) -> dict:
    """promtool unit tests: for every alert, series that make it fire (and a healthy one that keeps quiet)."""
    def inst(host="pve1", vmid="129", playbook="p", method="dflash"):
        return (f'instance="10.0.0.1:8000",job="{JOB}",host="{host}",vmid="{vmid}",playbook="{playbook}",'
                f'method="{method}"')
    mins = _minutes(for_) + 15  # long enough for every `for` and rate window
    tests = []
    for pb, member, t, th in _each_playbook(chosen):
        k = th["k"]
        lab = inst(t.host, str(t.vmid), pb.name, member.conf.speculative.method)
        # a broken drafter: 100 drafts/min, accepted tokens a tenth of the gate's, position 0 at 0.05
        low_acc = max(0.0, (th["min_al"] - 1) * 100 * 0.1)
        series = [{"series": f"{DRAFTS}{{{lab}}}", "values": f"0+100x{mins}"},
                  {"series": f"{ACCEPTED}{{{lab}}}", "values": f"0+{low_acc:g}x{mins}"},
                  {"series": f'{PER_POS}{{{lab},position="0"}}', "values": f"0+5x{mins}"}]
        low = dict(_labels(lab), severity="warning", gate_min_al=f"{th['min_al']:g}")
        tests.append({"interval": "1m", "input_series": series,
                      "_values": {"VllmAcceptanceLengthLow": 1 + low_acc / 100, "VllmFirstPositionLow": 0.05},
                      "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": "VllmAcceptanceLengthLow",
                                           "exp_alerts": [{"exp_labels": low}]},
                                          {"eval_time": f"{mins}m", "alertname": "VllmFirstPositionLow",
                                           "exp_alerts": [{"exp_labels": dict(_labels(lab), severity="warning",
                                                                              position="0")}]}]})
        # a healthy drafter: nothing fires
        good = [{"series": f"{DRAFTS}{{{lab}}}", "values": f"0+100x{mins}"},
                {"series": f"{ACCEPTED}{{{lab}}}", "values": f"0+{(th['min_al'] - 1) * 100 * 1.5:g}x{mins}"},
                {"series": f'{PER_POS}{{{lab},position="0"}}', "values": f"0+90x{mins}"}]
        tests.append({"interval": "1m", "input_series": good,
                      "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": a, "exp_alerts": []}
                                          for a in ("VllmAcceptanceLengthLow", "VllmFirstPositionLow",
                                                    "VllmAcceptanceCliff")]})
        if th["cliff"] and k >= 2:
            p = min(2, k - 1)  # positions 0..p-1 accept, p on nothing
            cl = [{"series": f"{DRAFTS}{{{lab}}}", "values": f"0+100x{mins}"},
                  {"series": f"{ACCEPTED}{{{lab}}}", "values": f"0+{80 * p}x{mins}"}]
            cl += [{"series": f'{PER_POS}{{{lab},position="{q}"}}', "values": f"0+{80 if q < p else 0}x{mins}"}
                   for q in range(k)]
            tests.append({"interval": "1m", "input_series": cl,
                          "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": "VllmAcceptanceCliff",
                                               "exp_alerts": [{"exp_labels": dict(_labels(lab), severity="warning",
                                                                                  position=str(p))}]}]})
    lab = inst()
    other = [
        ("VllmEndpointDown", [{"series": f"up{{{lab}}}", "values": f"0x{mins}"}], {"severity": "critical"}),
        ("VllmServerRestarted", [{"series": f"{vf.M_START_TIME}{{{lab}}}", "values": f"1000x{mins - 5} 2000x5"}],
         {"severity": "warning"}),
        ("VllmStartLimitHit", [{"series": f'{VPD_START_LIMIT}{{host="pve1",vmid="129",playbook="p",'
                                          f'unit="vllm-p.service"}}', "values": f"1x{mins}"}],
         {"severity": "critical", "host": "pve1", "vmid": "129", "playbook": "p", "unit": "vllm-p.service"}),
        ("VllmNotGated", [{"series": f'{VPD_GATED}{{host="pve1",vmid="129",playbook="p"}}', "values": f"0x{mins}"},
                          {"series": f'{VPD_OPERATION}{{host="pve1",vmid="129",playbook="p",operation=""}}',
                           "values": f"0x{mins}"}],
         {"severity": "warning", "host": "pve1", "vmid": "129", "playbook": "p"}),
        ("GpuMemoryHeldOutsideDeployment", [{"series": f'{VPD_FOREIGN}{{host="pve1",vmid="129",playbook="",'
                                                       f'gpu="0"}}', "values": f"30000x{mins}"}],
         {"severity": "warning", "host": "pve1", "vmid": "129", "gpu": "0"}),
        ("VpdStatusUnreachable", [{"series": f'{VPD_REACHABLE}{{host="pve1",vmid="129",playbook=""}}',
                                   "values": f"0x{mins}"}],
         {"severity": "warning", "host": "pve1", "vmid": "129"}),
        ("VpdStatusStale", [{"series": f'{VPD_TIMESTAMP}{{host="pve1"}}', "values": f"0x{mins}"}],
         {"severity": "warning", "host": "pve1"}),
    ]
    for name, series, labels in other:
        exp = labels if "host" in labels else dict(_labels(lab), **labels)
        tests.append({"interval": "1m", "input_series": series,
                      "_values": {name: mins * 60.0 if name == "VpdStatusStale" else 30000.0},
                      "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": name,
                                           "exp_alerts": [{"exp_labels": exp}]}]})
    if status_exporter:  # nothing from deploy monitor metrics at all, then its series: quiet
        tests.append({"interval": "1m", "input_series": [{"series": f"up{{{lab}}}", "values": f"1x{mins}"}],
                      "_values": {"VpdStatusMissing": 1.0},
                      "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": "VpdStatusMissing",
                                           "exp_alerts": [{"exp_labels": {"severity": "warning"}}]}]})
        tests.append({"interval": "1m", "input_series": [{"series": f'{VPD_TIMESTAMP}{{host="pve1"}}',
                                                          "values": f"0+60x{mins}"}],
                      "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": a, "exp_alerts": []}
                                          for a in ("VpdStatusMissing", "VpdStatusStale")]})
    # a deploy up still loading and gating (it holds the container's lock): not gated yet, and no alert
    tests.append({"interval": "1m", "input_series": [
        {"series": f'{VPD_GATED}{{host="pve1",vmid="129",playbook="p"}}', "values": f"0x{mins}"},
        {"series": f'{VPD_OPERATION}{{host="pve1",vmid="129",playbook="p",operation="up"}}', "values": f"1x{mins}"}],
        "alert_rule_test": [{"eval_time": f"{mins}m", "alertname": "VllmNotGated", "exp_alerts": []}]})
    return {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}


def _render(text: str, labels: dict, value: float | None) -> str:
    """The alert templates' subset that the rules use: {{ $labels.X }}, {{ $value }}, {{ $value | printf "%.2f" }}."""
    def sub(m):
        expr = m.group(1).strip()
        if expr.startswith("$labels."):
            return labels.get(expr[len("$labels."):], "<no value>")
        if expr == "$value":
            return f"{value:g}"
        fm = re.fullmatch(r'\$value \| printf "(%[^"]+)"', expr)
        if fm:
            return fm.group(1) % value
        raise ValueError(f"template {expr!r} not rendered by the test generator")
    return re.sub(r"\{\{(.*?)\}\}", sub, text)


def add_annotations(tests: dict, rule_file: dict) -> dict:
    """Fill every expected alert's exp_annotations by rendering the rule's templates with its labels and the value
    the series give (each test's _values: alertname -> value)."""
    by_name: dict = {}
    for g in rule_file["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                by_name.setdefault(r["alert"], []).append(r)
    for t in tests["tests"]:
        for a in t["alert_rule_test"]:
            for e in a.get("exp_alerts", []):
                labels = e["exp_labels"]
                cands = by_name[a["alertname"]]
                rule = next((r for r in cands if f'playbook="{labels.get("playbook")}"' in r["expr"]), cands[0])
                e["exp_annotations"] = {k: _render(v, labels, t.get("_values", {}).get(a["alertname"]))
                                        for k, v in rule.get("annotations", {}).items()}
        t.pop("_values", None)
    return tests


def _labels(text: str) -> dict:
    return dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in text.split(",")))


def _minutes(d: str) -> int:
    total = 0.0
    for n, unit in re.findall(r"([0-9]+)(ms|s|m|h|d)", d):
        total += int(n) * {"ms": 1 / 60000, "s": 1 / 60, "m": 1, "h": 60, "d": 1440}[unit]
    return int(total) + 1


def prometheus_config(*, scrape_interval: str, evaluation_interval: str, node_exporters=()) -> dict:
    """node_exporters: HOST:PORT of node_exporters whose textfile collector serves `deploy monitor metrics`' file
    (a job of their own; their metrics carry host/vmid/playbook labels themselves)."""
    jobs = [{"job_name": JOB, "metrics_path": "/metrics",
             "file_sd_configs": [{"files": ["targets.json"], "refresh_interval": "30s"}]}]
    if node_exporters:
        jobs.append({"job_name": STATUS_JOB, "metrics_path": "/metrics",
                     "static_configs": [{"targets": list(node_exporters)}]})
    return {"global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
            "rule_files": ["rules.yml"], "scrape_configs": jobs}


def dashboard() -> dict:
    """A Grafana dashboard (schema 39): acceptance length and per-position acceptance over time, tokens/s,
    running/waiting requests, KV-cache use, TTFT and inter-token latency quantiles from vLLM's histograms."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    sel = 'job="' + JOB + '",host=~"$host",playbook=~"$playbook"'
    w = "$__rate_interval"

    def panel(pid, title, exprs, unit="none", x=0, y=0, w_=12, h=8, legend="{{playbook}} {{host}}/{{vmid}}"):
        return {"id": pid, "type": "timeseries", "title": title, "datasource": ds,
                "gridPos": {"x": x, "y": y, "w": w_, "h": h},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{"refId": chr(65 + i), "datasource": ds, "expr": e,
                             "legendFormat": lf or legend} for i, (e, lf) in enumerate(exprs)]}
    panels = [
        panel(1, "Acceptance length (1 + accepted / drafts)",
              [(f"1 + rate({ACCEPTED}{{{sel}}}[{w}]) / rate({DRAFTS}{{{sel}}}[{w}])", None)], x=0, y=0),
        panel(2, "Acceptance per draft position",
              [(f"rate({PER_POS}{{{sel}}}[{w}]) / ignoring(position) group_left rate({DRAFTS}{{{sel}}}[{w}])",
                "{{playbook}} {{host}}/{{vmid}} pos {{position}}")], unit="percentunit", x=12, y=0),
        panel(3, "Generated tokens/s", [(f"rate({GEN_TOKENS}{{{sel}}}[{w}])", None)], x=0, y=8),
        panel(4, "Requests running / waiting",
              [(f"{vf.M_RUNNING}{{{sel}}}", "running {{host}}/{{vmid}}"),
               (f"{vf.M_WAITING}{{{sel}}}", "waiting {{host}}/{{vmid}}")],
              x=12, y=8),
        panel(5, "GPU KV-cache use", [(f"{vf.M_KV_USE}{{{sel}}}", None)], unit="percentunit", x=0, y=16),
        panel(6, "Time to first token (p50, p99)",
              [(f"histogram_quantile(0.5, sum by (le, host, vmid, playbook) (rate({vf.M_TTFT}_bucket{{{sel}}}[{w}])))",
                "p50 {{host}}/{{vmid}}"),
               (f"histogram_quantile(0.99, sum by (le, host, vmid, playbook) (rate({vf.M_TTFT}_bucket{{{sel}}}[{w}])))",
                "p99 {{host}}/{{vmid}}")], unit="s", x=12, y=16),
        panel(7, "Inter-token latency (p50, p99)",
              [(f"histogram_quantile(0.5, sum by (le, host, vmid, playbook) (rate({vf.M_ITL}_bucket{{{sel}}}[{w}])))",
                "p50 {{host}}/{{vmid}}"),
               (f"histogram_quantile(0.99, sum by (le, host, vmid, playbook) (rate({vf.M_ITL}_bucket{{{sel}}}[{w}])))",
                "p99 {{host}}/{{vmid}}")], unit="s", x=0, y=24),
        panel(8, "Scrape up (1) / down (0)", [(f'up{{{sel}}}', None)], x=12, y=24),
    ]
    var = lambda name, q: {"name": name, "type": "query", "datasource": ds, "query": q, "refresh": 2,
                           "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}}
    return {"title": "vLLM speculative decoding (vllm-pve-deploy)", "uid": "vllm-pve-deploy", "schemaVersion": 39,
            "version": 1, "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
            "tags": ["vllm", "speculative-decoding", "vllm-pve-deploy"],
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "current": {}},
                                    var("host", f'label_values(up{{job="{JOB}"}}, host)'),
                                    var("playbook", f'label_values(up{{job="{JOB}"}}, playbook)')]},
            "panels": panels}


def export(inv, playbooks: list, directory: str, *, window="5m", for_="10m", down_for="2m", scrape_interval="15s",
           evaluation_interval="15s", node_exporters=()) -> dict:
    """Write targets.json, rules.yml, rules.test.yml, prometheus.yml and dashboard.json into directory (created);
    every file written whole (temp file, then rename) and read back. -> a summary."""
    chosen, notes = choose(inv, playbooks)
    groups, missing = targets(inv, chosen)
    rule_set = rules(chosen, window=window, for_=for_, down_for=down_for, status_exporter=bool(node_exporters))
    files = {
        "targets.json": json.dumps(groups, indent=2) + "\n",
        "rules.yml": yaml.safe_dump(rule_set, sort_keys=False, width=120),
        "rules.test.yml": yaml.safe_dump(add_annotations(rule_tests(chosen, for_=for_,
                                                                    status_exporter=bool(node_exporters)), rule_set),
                                         sort_keys=False, width=120),
        "prometheus.yml": yaml.safe_dump(prometheus_config(scrape_interval=scrape_interval,
                                                           evaluation_interval=evaluation_interval,
                                                           node_exporters=node_exporters), sort_keys=False),
        "dashboard.json": json.dumps(dashboard(), indent=2) + "\n",
    }
    os.makedirs(directory, exist_ok=True)
    for name, text in files.items():
        write_atomic(os.path.join(directory, name), text, mode=0o644)
    return {"directory": os.path.abspath(directory), "files": sorted(files), "targets": groups, "left_out": missing,
            "notes": notes, "playbooks": sorted({pb.name for pb, _m, _t in chosen}),
            "thresholds": {pb.name: gate_thresholds(pb) for pb, _m, _t in chosen}}
