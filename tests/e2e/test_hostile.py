"""Issue 22, "A container is not trusted": each finding reproduced on the test bed with a hostile container (a user
of it, or root in it answering for the agent), and shown not to steer root, secrets or the operator's terminal.
The threat model is in docs/architecture.md, "Threat model"."""

import json
import os

from e2e_helpers import audit, cat

STATE = "/var/lib/vllm-pve-deploy"
NOBODY = 65534

# an "interpreter" a container user planted: run as root, it records who ran it
PLANTED = "#!/bin/sh\nid -u > /root/pwned-by-%s\necho '{}'\n"


def plant_interpreter(tb, where, tag, host="pve1", vmid=129):
    """WHERE/bin/python owned by uid 65534, with a vllm dist-info beside it (so it looks like a vLLM runtime)."""
    sp = f"{where}/lib/python3.11/site-packages/vllm-0.99.0.dist-info"
    tb.container_exec(host, vmid, ["sh", "-c",
                                   f"mkdir -p {where}/bin {sp} && printf '%s' \"$0\" > {where}/bin/python && "
                                   f"chmod 755 {where}/bin/python && printf 'Name: vllm\\nVersion: 0.99.0\\n' > "
                                   f"{sp}/METADATA && chown -R {NOBODY}:{NOBODY} {where}", PLANTED % tag], check=True)


def test_discover_runs_no_interpreter_another_user_owns(tb, deploy):
    plant_interpreter(tb, "/root/alice-env", "discover")
    p = deploy("--json", "discover", "pve1")
    assert p.returncode == 0, p.stderr
    assert tb.container_exec("pve1", 129, ["ls", "/root/pwned-by-discover"]).returncode != 0, "ran it as root"
    ct = next(c for c in p.json["containers"] if c["vmid"] == 129)
    assert ct["runtime"]["python"] == "/root/ml-env/bin/python"  # the root-owned venv, read from its files
    assert ct["runtimes"][0]["vllm_version"] == "0.34.0"
    assert all(r["python"] != "/root/alice-env/bin/python" for r in ct["runtimes"])
    prob = [x for x in ct["problems"] if "/root/alice-env/bin/python" in x]
    assert prob and "owned by uid 65534" in prob[0] and "not proposed as the runtime" in prob[0]
