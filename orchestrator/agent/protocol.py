"""The typed results of the agent's actions: one dataclass per action result, read as attributes, made a dataclass
and registered under the action's name by @result (RESULT_TYPES).

The wire contract (the protocol version, each action declared once with the fields its result must carry:
DECLARED) is container/protocol.py, which travels with the agent: the agent checks each result against it before it
leaves the container, and `parse` here checks the same table (a result missing a required field is a protocol error on either side, named with the action and the
field). Fields a newer agent adds are kept in `.extra`, not dropped. The tool refuses a result from another protocol
version (agent/call.py `interpret`).

One name per concept: the step, the agent action and the step function share it (`gpus_free`: step
`gpus-free`; `acceptance`: step `acceptance`, measured and gated by steps/vllm.py `acceptance`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .container.protocol import PROTOCOL, ProtocolError  # noqa: F401 (re-exported)
from .container.protocol import DECLARED, REQUIRED


_TYPES = {"bool": bool, "int": int, "float": (int, float), "str": str, "list": list, "dict": dict}


RESULT_TYPES: dict = {}  # action -> its result dataclass (every action in DECLARED has one: test_action_table.py)


def result(*actions):
    """Make the AgentResult subclass below a dataclass (unless it is one already) and register it as the result of
    these actions, each declared in container/protocol.py."""
    def register(cls):
        cls = cls if "__dataclass_fields__" in cls.__dict__ else dataclass(cls)
        for action in actions:
            if action not in DECLARED:
                raise ProtocolError(f"{cls.__name__}: no agent action {action!r} is declared (container/protocol.py)")
            RESULT_TYPES[action] = cls
        return cls
    return register


@dataclass
class AgentResult:
    """Base: typed fields, read as attributes, plus `extra` for fields this side does not know (a newer agent's);
    as_dict() gives the wire form back (for --json and the outcome's details)."""

    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, action, d):
        if not isinstance(d, dict):
            raise ProtocolError("agent action %r returned %s, not an object" % (action, type(d).__name__))
        missing = [k for k in REQUIRED.get(action, ()) if k not in d]
        if missing:
            raise ProtocolError("agent action %r result lacks %s (protocol %d, %s)"
                                % (action, ", ".join(missing), PROTOCOL, cls.__name__))
        names = {f.name for f in fields(cls)} - {"extra"}
        for f in fields(cls):  # the answer comes from the container: each known field has its declared type
            v = d.get(f.name)
            want = _TYPES.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
            if f.name != "extra" and v is not None and want is not None and not isinstance(v, want):
                raise ProtocolError("agent action %r result field %r is %s, not %s (%s)"
                                    % (action, f.name, type(v).__name__, f.type, cls.__name__))
        obj = cls(**{k: v for k, v in d.items() if k in names})
        obj.extra = {k: v for k, v in d.items() if k not in names}
        return obj

    def as_dict(self):
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


@result("lock")
class LockResult(AgentResult):
    locked: bool = False
    holder: dict = None
    error: str = None
    lost: bool = None  # a renewal found the lock gone or taken
    expires: float = None


@result("unlock")
class UnlockResult(AgentResult):
    unlocked: bool = False
    holder: dict = None
    error: str = None


@result("status")
class CurrentResult(AgentResult):
    """`status`: what runs in the container now (read by `current`, and by deploy status)."""
    state: dict = None
    memory: dict = None
    health: int = None
    models: list = None
    models_status: int = None
    vllm_processes: list = None
    drafter_sha256: str = None
    drafter_error: str = None
    lock: dict = None
    last_failure: dict = None
    stopped_at: float = None  # when state.json became state.stopped.json
    metrics: str = None  # /metrics text
    supervision: dict = None  # systemd's view (container/systemd.py supervision)
    listener_problem: str = None  # the port is held by a process not proven ours: the key was not sent
    exit_code: object = None  # the server's recorded exit (int, or a signal name under systemd)
    last_error: str = None  # the log line that names the cause
    argv0_real_now: str = None  # where the recorded argv[0] resolves now (install-vllm switches the runtime link)
    gate: dict = None  # gate.json: the verdict, and whether it is for the launch running now (for_current_launch)
    rejected: dict = None  # rejected.json: the last rejection a fallback followed
    weights: list = None  # deploy fetch's records of the model/drafter this server reads (issue 27)


@result("write_file")
class WriteFileResult(AgentResult):
    ok: bool = False
    changed: bool = False
    path: str = None
    realpath: str = None
    before_sha256: str = None
    after_sha256: str = None
    backup: str = None
    stage: str = None
    message: str = None
    errno: str = None
    # hub_drafter: deploy's own drafter directory for a hub id
    dir: str = None
    hub_id: str = None
    snapshot: str = None
    revision: str = None
    snapshot_config_sha256: str = None
    links: list = None


@result("verify")
class VerifyResult(AgentResult):
    checks: list = field(default_factory=list)
    sha256: str = None
    sha256_after: str = None
    location: dict = None
    stack: dict = None
    transformers_version: str = None
    python: str = None
    target: dict = None
    trust_remote_code: bool = None
    loader: str = None
    loaded_error: str = None
    local_hint: str = None
    failed: list = None  # the tool's own: the failing checks (steps/drafter.py verify)


@result("stop")
class StopResult(AgentResult):
    unit: dict = None  # systemd's stop + disable report
    unit_problem: str = None
    cgroup_left: list = None
    sigterm: list = None  # the pids SIGTERM reached (the others were already exiting)
    terminated: list = field(default_factory=list)
    killed: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    foreign: list = field(default_factory=list)
    fuser: dict = None
    seconds: float = 0.0
    state: dict = None
    gpu_before: dict = None
    refused: str = None
    running: str = None
    not_ours: str = None
    state_error: str = None
    stopped: list = None  # the tool's own summary: terminated + killed


@result("gpus_free")
class GpusFreeResult(AgentResult):
    verdict: str = None  # free | held_inside | held_outside | gpu_missing | nvidia_smi_*
    before: dict = None
    after: dict = None
    seconds: float = 0.0
    busy: list = None
    holders: list = None
    missing: list = None
    seen: list = None
    command: str = None
    message: str = None
    timeout_s: float = None


@result("port_check")
class PortResult(AgentResult):
    listeners: list = field(default_factory=list)
    port: int = None


@result("launch")
class LaunchResult(AgentResult):
    ok: bool = False
    pid: int = None
    pgid: int = None
    log_path: str = None
    message: str = None
    supervisor: str = None  # systemd | none
    unit: str = None
    unit_path: str = None
    unit_changed: bool = None
    unit_sha256: str = None
    env_file: str = None
    unit_state: dict = None
    invocation: str = None
    systemd: bool = None


@result("wait_ready")
class ReadyResult(AgentResult):
    """`wait_ready`: serving, or why not (reason: fatal, exited, timeout, model_missing, auth, ...)."""
    ready: bool = False
    seconds: float = 0.0
    reason: str = None
    cause: str = None
    line: str = None
    fix: str = None
    exit_code: int = None
    log_tail: list = None
    phases: list = None
    aux_layers: list = None
    models: list = None
    status: int = None
    message: str = None
    alive: bool = None
    body: str = None
    unit: str = None
    last_exit: dict = None


@result("file_sha")
class FileShaResult(AgentResult):
    sha256: str = None
    path: str = None
    realpath: str = None
    size: int = None
    error: str = None
    errno: int = None


@result("acceptance")
class AcceptanceResult(AgentResult):
    """`acceptance`: /metrics before and after the probe requests (and the log tail for the fallback line)."""
    ok: bool = False
    before: str = None
    after: str = None
    sent: int = 0
    succeeded: int = 0
    errors: list = field(default_factory=list)
    log_tail: list = None
    message: str = None
    rounds: int = None  # the rounds the probe ran (more than planned while the drafts were too few)


@result("note_failure")
class NoteFailureResult(AgentResult):
    ok: bool = False


@result("logs")
class LogsResult(AgentResult):
    """`logs`: the last lines (or, following, events and then this)."""
    lines: list = None
    exists: bool = None
    unit: str = None
    source: str = None
    followed_s: float = None


@result("doctor")
class DoctorResult(AgentResult):
    """`doctor`: read-only facts for diagnose() (doctor.py)."""
    processes: list = field(default_factory=list)
    servers: list = field(default_factory=list)
    holders: list = None
    memory: dict = None
    stack: dict = None
    state: dict = None
    now: float = None
    pid_ns: str = None


@result("drafter_scan")
class DrafterScanResult(AgentResult):
    """`drafter_scan`: the config.json files in the hub cache and models directories (container/scan.py), each
    {path, kind, hub_id, revision, dir, realpath, size, sha256, drafter (why it looks like one), error,
    parse_error}; truncated says why the scan stopped early."""
    configs: list = field(default_factory=list)
    roots: dict = None
    truncated: str = None
    notes: list = None
    seconds: float = None


@result("hub_drafter")
class HubDrafterResult(AgentResult):
    ok: bool = False
    path: str = None
    dir: str = None
    hub_id: str = None
    changed: bool = False
    stage: str = None
    message: str = None
    snapshot: str = None
    snapshot_config_sha256: str = None
    before_sha256: str = None
    after_sha256: str = None
    links: list = None
    revision: str = None
    backup: str = None  # (none: deploy's own directory is rebuilt, not edited)


@dataclass
class _Detached(AgentResult):
    """What a detached job's actions (`fetch`, `install_vllm`) have in common: ok or why not, and, from start and
    attach, the runner's id, pid, where its log was read to and its last lines."""
    ok: bool = False
    message: str = None
    fix: str = None
    started: bool = None
    done: bool = None
    id: str = None
    pid: int = None
    log: str = None
    log_pos: int = None
    log_tail: list = None


@result("install_vllm")
class InstallResult(_Detached):
    """`install_vllm` (probe, start, attach, rollback)."""
    runtime: dict = None
    install: dict = None
    serving: dict = None
    pointer: dict = None


@result("gate_record")
class GateRecordResult(AgentResult):
    ok: bool = False
    launch_known: bool = False
    rejected: bool = False
    cleared: bool = False
    message: str = None


@result("tune_record")
class TuneRecordResult(AgentResult):
    """`tune_record` (deploy tune's verdict beside the launch it left running)."""
    ok: bool = False
    message: str = None


@result("router")
class RouterResult(AgentResult):
    """`router` (op: install, start, wait, view, gate, remove, add, drain_wait, stop; issue 29): the fields every op
    that has them gives the same type; the rest (per op) are in .extra."""
    ok: bool = None
    message: str = None
    ready: bool = None
    installed: bool = None
    drained: bool = None
    sent: int = None
    succeeded: int = None
    workers: list = None
    state: dict = None
    circuits: dict = None


@result("plumbing")
class PlumbingResult(AgentResult):
    """`plumbing`: the container's facts for the gpu-plumbing check (orchestrator/steps/plumbing_check.py sane_container
    validates them further)."""
    plumbing: dict = None


@result("gpu_read")
class GpuReadResult(AgentResult):
    """`gpu_read`: the holders of GPU devices (pid, comm, cmdline, devices, ours), GPU memory, where it ran."""
    holders: list = field(default_factory=list)
    memory: dict = None
    in_container: bool = None


@result("fetch")
class FetchResult(_Detached):
    """`fetch` (op probe, start, attach, records): the items in place, the runner's record (`fetch`), the records
    of fetched items. Its callers (fetch.py, store.py, cli/weights.py) read it as its wire dict (as_dict())."""
    items: list = None
    fetch: dict = None
    records: dict = None


@result("fetch_run", "install_run")
class RunnerResult(AgentResult):
    """`fetch_run`, `install_run`: the detached runner's own exit (its record in the state directory says more);
    the runner is started by the agent in the container, the tool never calls it."""
    ok: bool = False
    message: str = None


@result("stack_check")
class StackCheckResult(AgentResult):
    """`stack_check`: the serving stack of the interpreter it runs in (the install runner calls it in a staging
    venv, in the container)."""
    ok: bool = False
    checks: list = field(default_factory=list)
    stack: dict = None
    python: str = None


@result("sweep")
class ProbeResult(AgentResult):
    """`sweep` (per concurrency level: timed streamed requests, /metrics before and after each level): ok or why
    not."""
    ok: bool = False
    message: str = None
    before: str = None
    after: str = None
    requests: list = None
    errors: list = None
    levels: list = None


@result("store")
class StoreResult(AgentResult):
    """`store` (op mark: the host store's marker id and free bytes; op link: the container's links into it, or the
    kind of problem). store.py reads it as its wire dict (as_dict())."""
    ok: bool = False
    message: str = None
    fix: str = None
    id: str = None
    free: int = None
    kind: str = None
    role: str = None
    items: list = None
