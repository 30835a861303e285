"""The wire contract between the tool and the agent: the protocol version, and each action declared once (DECLARED:
the function that runs it and the fields its result must carry). The agent checks each result here before it
leaves the container; the tool parses the same JSON into the dataclass registered under the action's name
(orchestrator/agent/protocol.py, whose REQUIRED come from this table) and refuses another protocol version. Kept
small: the agent imports it for every action."""

PROTOCOL = 2

# nvidia-smi's arguments for GPU memory: the status exec's first line starts it with these (orchestrator/agent/
# call.py EARLY_SMI) and gpus.read_gpu_memory adopts that run only when its own arguments are these same ones
SMI_MEMORY_ARGS = ("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits")
# the most deploy doctor's time budget grows on a busy machine (container/doctor.py load_factor)
DOCTOR_LOAD_MAX = 3.0


# deploy's own directory in the container when runtime.state_dir does not name another (its state files, lock,
# vLLM log, agent cache); the one spelling of it, for the tool (spec.py's default) and the agent alike
DEFAULT_STATE_DIR = "/var/lib/vllm-pve-deploy"

# the vLLM metric families the agent reads itself (the acceptance probe's stop rule, the router's replica view and
# drain wait); the tool's spelling is vllm_facts.py's M_*, held equal by a unit test. A counter's sample is the
# family name + "_total"
M_DRAFTS = "vllm:spec_decode_num_drafts"
M_REQUEST_SUCCESS = "vllm:request_success"
M_RUNNING = "vllm:num_requests_running"


class ProtocolError(Exception):
    pass


# Each agent action, declared once: its name -> (the "module:function" that runs it, imported on first use; the
# fields its result must carry: a result may carry more, the tool keeps them in `.extra`). main.py's ACTIONS and
# REQUIRED below come from it; the tool's result dataclass is registered under the same name
# (orchestrator/agent/protocol.py, @result) and a planned step that sends it is in ops.STEPS.
# tests/unit/test_action_table.py fails when an action lacks any of these parts.
DECLARED = {
    "lock": ("lock:act_lock", ("locked",)),
    "unlock": ("lock:act_unlock", ()),
    "status": ("status:act_status", ("state",)),
    "write_file": ("drafter:act_write_file", ()),
    "file_sha": ("drafter:act_file_sha", ()),
    "hub_drafter": ("hub:act_hub_drafter", ("ok",)),
    "verify": ("verify:act_verify", ("checks",)),
    "stop": ("stop:act_stop", ()),
    "gpu_read": ("gpus:act_gpu_read", ("holders",)),
    "gpus_free": ("gpus:act_gpus_free", ("verdict",)),
    "port_check": ("net:act_port_check", ("listeners",)),
    "launch": ("launch:act_launch", ("ok",)),
    "wait_ready": ("ready:act_wait_ready", ("ready",)),
    "acceptance": ("probe:act_acceptance", ("ok",)),
    "sweep": ("probe:act_sweep", ("ok",)),
    "note_failure": ("state:act_note_failure", ()),
    "logs": ("logs:act_logs", ()),
    "doctor": ("doctor:act_doctor", ("processes", "servers")),
    "drafter_scan": ("scan:act_drafter_scan", ("configs",)),
    "stack_check": ("stack:act_stack_check", ("ok",)),
    "install_vllm": ("install:act_install_vllm", ("ok",)),
    "install_run": ("runner:act_install_run", ("ok",)),
    "gate_record": ("gate:act_gate_record", ("ok",)),
    "tune_record": ("gate:act_tune_record", ("ok",)),
    "fetch": ("fetch:act_fetch", ("ok",)),
    "fetch_run": ("fetch_runner:act_fetch_run", ("ok",)),
    "store": ("store:act_store", ("ok",)),
    "router": ("router:act_router", ()),
    "plumbing": ("plumbing:act_plumbing", ("plumbing",)),
}
REQUIRED = {name: required for name, (_, required) in DECLARED.items()}


def check(action, d):
    """Raise ProtocolError, naming the action and the fields, if result d breaks the contract."""
    if action not in REQUIRED:
        return
    if not isinstance(d, dict):
        raise ProtocolError("agent action %r returned %s, not an object" % (action, type(d).__name__))
    missing = [k for k in REQUIRED[action] if k not in d]
    if missing:
        raise ProtocolError("agent action %r result lacks %s (protocol %d)" % (action, ", ".join(missing), PROTOCOL))
