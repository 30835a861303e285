"""`deploy monitor metrics`: deploy's own facts as Prometheus series (the ones vLLM's /metrics cannot know: the
gate's verdict, systemd's restarts and start limit, GPU memory held outside the deployment), gathered exactly as
`deploy status` gathers them (orchestrator.observe.status.gather: one SSH connection per host, hosts in parallel), written
as Prometheus text exposition to stdout or, for node_exporter's textfile collector, atomically to a .prom file
that is then read back and parsed. See docs/monitoring.md ("deploy's own series").

Every label value that comes from a container (the playbook name and unit in its state file, GPU indices) is
untrusted: prometheus_client escapes it, and it is first made valid UTF-8 and cut to LABEL_MAX characters.
"""

from __future__ import annotations

import math
import os
import time

from orchestrator.core.atomic import write_atomic
from orchestrator.core.errors import EXIT_OK, EXIT_UNREACHABLE, DeployError, UsageError
from orchestrator.observe.monitor import (VPD_FOREIGN, VPD_GATED, VPD_OPERATION, VPD_REACHABLE, VPD_RESTARTS,
                                          VPD_START_LIMIT, VPD_TIMESTAMP)
from orchestrator.observe.status import gather

HEALTHY = "vpd_status_healthy"
LABEL_MAX = 200  # characters of a label value taken from a container (a longer one is cut, with "...")

HELP = {
    VPD_TIMESTAMP: "Unix time deploy monitor metrics gathered this host's containers (a stale file shows here)",
    VPD_REACHABLE: "1 when deploy reached the container (its host answered over SSH), 0 when unreachable or timed out",
    HEALTHY: "1 when deploy status judges the container healthy (its exit code 0 for this row), else 0",
    VPD_GATED: "1 when the running launch passed the acceptance gate, 0 when not gated or failed (serving only)",
    VPD_OPERATION: "1 while a deploy operation holds the container's lock (its lease live, its holder not proven "
                   "dead): an up may still be loading and gating",
    VPD_RESTARTS: "systemd's restarts of the vLLM unit since deploy up (NRestarts)",
    VPD_START_LIMIT: "1 when systemd hit the unit's start limit and stopped restarting it",
    VPD_FOREIGN: "MiB used on a GPU the container sees that no running deployment of ours on this host holds",
}


def label(value) -> str:
    """A label value from untrusted data: a string (None -> ""), valid UTF-8, at most LABEL_MAX characters.
    Escaping of quotes, backslashes and newlines is prometheus_client's (text exposition format)."""
    if value is None or isinstance(value, bool):
        return "" if value is None else str(value).lower()
    text = value if isinstance(value, str) else str(value) if isinstance(value, (int, float)) else ""
    text = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates from JSON become "?"
    return text if len(text) <= LABEL_MAX else text[:LABEL_MAX - 3] + "..."


def _num(x) -> float | None:
    """A finite number from untrusted data, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def in_progress(lock, now: float) -> bool:
    """Does a live deploy operation hold the container's lock? Not when there is none, its lease expired
    (`expires`, the container's clock: a killed deploy's lapses within one term, 60 s), or its holder is a deploy
    process on this workstation that no longer exists (ops.holder_dead, as the next deploy judges it)."""
    from orchestrator.deploy.ops import holder_dead  # lazy: start-up time, ~60 ms (ops' own imports), only for a row with a lock

    if not isinstance(lock, dict) or not lock:
        return False
    exp = _num(lock.get("expires"))
    if exp is not None and exp < now:
        return False
    try:
        return not holder_dead(lock)
    except (TypeError, ValueError):  # an odd lock file: held, as deploy itself would treat it
        return True


def _held(rows: list[dict]) -> dict[str, set]:
    """{host: GPU indices held by a running deployment of ours there} from the rows' `_gpus` (the state file's
    `gpus`; status.gather(keep_gpus=True) keeps them). Same index space as status's shared-GPU check."""
    held: dict[str, set] = {}
    for r in rows:
        if r.get("process") == "running" and isinstance(r.get("_gpus"), list):
            held.setdefault(r["host"], set()).update(g for g in r["_gpus"] if isinstance(g, int)
                                                     and not isinstance(g, bool))
    return held


def series(rows: list[dict], *, now: float | None = None, times: dict | None = None) -> list[dict]:
    """The families: [{name, type, help, samples: [(labels, value)]}] from status rows (status/v1, plus `_gpus`).

    - vpd_status_timestamp_seconds{host}: when each host was gathered (`times`, else `now`)
    - vpd_status_reachable / vpd_status_healthy{host,vmid,playbook}: every row
    - vpd_gated{host,vmid,playbook}: rows serving a launch of ours (status sets `gate` only then)
    - vpd_operation_in_progress{host,vmid,playbook,operation}: running containers that were read; 1 while a live
      deploy operation holds the lock (VllmNotGated waits for it)
    - vpd_unit_restarts_total, vpd_unit_start_limit_hit{host,vmid,playbook,unit}: rows supervised by systemd
    - vpd_gpu_foreign_memory_mib{host,vmid,playbook,gpu}: every GPU a container's nvidia-smi lists; its memory
      used when no running deployment of ours on that host holds that GPU index, else 0 (that memory is ours)
    """
    now = time.time() if now is None else now
    times = times or {}
    held = _held(rows)
    fam = {n: [] for n in HELP}  # every family, in HELP's order
    for host in dict.fromkeys(r["host"] for r in rows):
        fam[VPD_TIMESTAMP].append(({"host": label(host)}, float(times.get(host, now))))
    for r in rows:
        base = {"host": label(r["host"]), "vmid": label(r["vmid"]), "playbook": label(r.get("playbook"))}
        fam[VPD_REACHABLE].append((base, 1.0 if r.get("reachable") else 0.0))
        fam[HEALTHY].append((base, 1.0 if r.get("healthy") else 0.0))
        gate = r.get("gate")
        if isinstance(gate, dict) and r.get("process") == "running":
            fam[VPD_GATED].append((base, 1.0 if gate.get("verdict") == "passed" else 0.0))
        if r.get("reachable") and r.get("container") == "running":
            lock = r.get("lock")
            busy = in_progress(lock, now)
            fam[VPD_OPERATION].append(({**base, "operation": label(lock.get("operation")) if busy else ""},
                                       1.0 if busy else 0.0))
        sup = r.get("supervision")
        if isinstance(sup, dict) and sup.get("supervisor") == "systemd":
            unit = {**base, "unit": label(sup.get("unit"))}
            restarts = _num(sup.get("restarts"))
            if restarts is not None and restarts >= 0:
                fam[VPD_RESTARTS].append((unit, restarts))
            fam[VPD_START_LIMIT].append((unit, 1.0 if sup.get("start_limit_hit") else 0.0))
        mine = held.get(r["host"], set())
        seen = set()
        for g in r.get("gpus") or []:
            idx, used = g.get("index") if isinstance(g, dict) else None, _num((g or {}).get("used_mib"))
            if not isinstance(idx, int) or isinstance(idx, bool) or used is None or idx in seen:
                continue  # an index twice (a container's odd nvidia-smi): the first one counts
            seen.add(idx)
            fam[VPD_FOREIGN].append(({**base, "gpu": str(idx)}, 0.0 if idx in mine else max(0.0, used)))
    types = {VPD_RESTARTS: "counter"}
    return [{"name": n, "type": types.get(n, "gauge"), "help": HELP[n], "samples": s} for n, s in fam.items()]


def render(families: list[dict]) -> str:
    """Prometheus text exposition (prometheus_client's own writer: escaping, HELP/TYPE, counter naming)."""
    from orchestrator.core.vllm_facts import prometheus_package

    prometheus_package()  # lazy: ~50 ms
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self):
            for f in families:
                if not f["samples"]:
                    continue
                names = list(f["samples"][0][0])
                if f["type"] == "counter":
                    m = CounterMetricFamily(f["name"].removesuffix("_total"), f["help"], labels=names)
                else:
                    m = GaugeMetricFamily(f["name"], f["help"], labels=names)
                for labels, value in f["samples"]:
                    m.add_metric([labels[k] for k in names], value)
                yield m

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return generate_latest(reg).decode("utf-8")


def parse(text: str) -> dict:
    """{metric family name: [(labels, value)]} by prometheus_client's parser; ValueError when it is not valid."""
    from orchestrator.core.vllm_facts import prometheus_parser

    text_string_to_metric_families = prometheus_parser().text_string_to_metric_families  # warmed by status.gather

    out: dict = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def check_textfile(path: str) -> str:
    """--textfile PATH: a .prom file (node_exporter reads no other name) in a directory that exists; -> abs path.
    A UsageError before anything is gathered."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    if not path.endswith(".prom"):
        raise UsageError(f"--textfile {path}: node_exporter's textfile collector reads only files ending in .prom",
                         fix=f"name it e.g. {os.path.join(d, 'vllm-pve-deploy.prom')}")
    if not os.path.isdir(d):
        raise UsageError(f"--textfile {path}: the directory {d} does not exist",
                         fix="create it, or use node_exporter's --collector.textfile.directory (Debian: "
                             "/var/lib/prometheus/node-exporter)")
    if os.path.isdir(path):
        raise UsageError(f"--textfile {path} is a directory", fix="name a file in it, ending in .prom")
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"--textfile {path}: this user may not write in {d}",
                         fix="run it as a user that may (the timer's User=), or make the directory writable for it")
    return path


def write_textfile(path: str, text: str) -> dict:
    """Write atomically for the textfile collector: a temp file in the same directory (a name node_exporter skips),
    fsync, mode 0644, rename over PATH, fsync the directory; then read it back and parse it. -> {bytes, samples}.
    Raises DeployError saying what failed."""
    data = text.encode("utf-8")
    write_atomic(path, data, mode=0o644,
                 fix="run as a user that may write there (node_exporter's textfile directory); check its free space")
    with open(path, "rb") as fh:
        back = fh.read()
    try:
        parsed = parse(back.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DeployError(f"the file written does not parse as Prometheus text exposition: {e}", where=path,
                          fix="a bug in deploy; report it with the file") from None
    mode = os.stat(path).st_mode & 0o777
    if mode != 0o644:
        raise DeployError(f"mode is {mode:o}, expected 644 (node_exporter must read it)", where=path,
                          fix="check the file system's permissions handling")
    return {"bytes": len(data), "samples": sum(len(v) for v in parsed.values())}


def gather_rows(inv, targets, deadline: float) -> tuple[list[dict], dict]:
    """status.gather with the state files' GPUs kept; -> (rows, {host: time gathered})."""
    rows = gather(inv, targets, deadline=deadline, keep_gpus=True)
    t = time.time()
    return rows, {r["host"]: t for r in rows}


def exit_code(rows: list[dict]) -> int:
    """0 written (whatever the deployments' health: the alerts judge that), 3 some host unreachable."""
    return EXIT_UNREACHABLE if any(not r.get("reachable") for r in rows) else EXIT_OK
