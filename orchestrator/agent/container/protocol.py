"""The wire contract between the tool and the agent: the protocol version, and for each action with a typed result
the fields its result must carry. The agent checks each result here before it leaves the container; the tool
parses the same JSON into its dataclass (orchestrator/agent/protocol.py, whose REQUIRED come from this table) and
refuses another protocol version. Kept small: the agent imports it for every action."""

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


# action -> the fields its result must have (a result may carry more: the tool keeps them in `.extra`)
REQUIRED = {
    "lock": ("locked",),
    "unlock": (),
    "status": ("state",),
    "write_file": (),
    "verify": ("checks",),
    "stop": (),
    "gpus_free": ("verdict",),
    "port_check": ("listeners",),
    "launch": ("ok",),
    "wait_ready": ("ready",),
    "file_sha": (),
    "acceptance": ("ok",),
    "hub_drafter": ("ok",),
    "note_failure": (),
    "logs": (),
    "doctor": ("processes", "servers"),
    "drafter_scan": ("configs",),
    "install_vllm": ("ok",),
    "gate_record": ("ok",),
    "router": (),
    "plumbing": ("plumbing",),
}


def check(action, d):
    """Raise ProtocolError, naming the action and the fields, if result d breaks the contract."""
    if action not in REQUIRED:
        return
    if not isinstance(d, dict):
        raise ProtocolError("agent action %r returned %s, not an object" % (action, type(d).__name__))
    missing = [k for k in REQUIRED[action] if k not in d]
    if missing:
        raise ProtocolError("agent action %r result lacks %s (protocol %d)" % (action, ", ".join(missing), PROTOCOL))
