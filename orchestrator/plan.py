"""Pure planning: (playbook, inventory, options) -> ordered steps. No I/O; this is what --dry-run prints.

Every step names the exact remote command it will run; the executor (ops.py) runs these same Step objects,
so the plan and the real run cannot drift apart. Steps that only run when a condition holds at run time
(e.g. `stop` when something is running) say so in `when`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .agent import agent_argv
from .remote import pct_exec_argv, shell_join
from .spec import Inventory, Playbook


# Run-time values the plan cannot know; Context.call fills them in (they are not secret).
TOKEN = "<invocation token>"
HOLDER = "<user@workstation>"


@dataclass
class Step:
    name: str
    title: str
    host: str
    vmid: int
    action: str | None = None  # agent action; None for a plain host command
    args: dict = field(default_factory=dict)
    host_argv: list[str] | None = None  # for plain host commands (pct status, pct list)
    timeout: float = 60.0
    payload: str | None = None  # what travels on stdin besides the agent (described, never the secret)
    bulk: dict = field(default_factory=dict)  # large non-secret inputs, sent on stdin instead of argv
    when: str = ""  # a run-time condition, shown in the plan

    def remote_argv(self, python: str) -> list[str]:
        """The argv on the Proxmox host (before SSH quoting)."""
        if self.action is None:
            return self.host_argv or []
        return pct_exec_argv(self.vmid, agent_argv(python, self.action, self.args))

    def as_dict(self, inv: Inventory, python: str) -> dict:
        h = inv.host(self.host)
        return {"step": self.name, "title": self.title, "host": self.host, "vmid": self.vmid,
                "when": self.when or None, "timeout_s": self.timeout,
                "ssh": ssh_prefix(h), "command": shell_join(self.remote_argv(python)),
                "stdin": (f"agent.py ({self.action})" + (f" + {self.payload}" if self.payload else "")
                          + "".join(f" + {k} ({_size(v)})" for k, v in self.bulk.items()))
                if self.action else None}


def _size(v) -> str:
    return f"{len(v)} items" if isinstance(v, (list, dict)) else f"{len(str(v))} chars"


def ssh_prefix(h) -> str:
    target = h.ssh_config_alias or f"{h.user}@{h.address}"
    return f"ssh -p {h.port} {target}" if not h.ssh_config_alias else f"ssh {target}"


# ------------------------------------------------------------------ building blocks shared by up/down/restart


def state_paths(pb: Playbook) -> dict:
    sd = pb.runtime["state_dir"]
    return {"state_dir": sd, "log_path": os.path.join(sd, "vllm.log")}


def drafter_config_path(pb: Playbook) -> str | None:
    """The config.json vLLM reads: in the drafter directory, or for a hub id in deploy's own drafter directory
    (hub_drafter_dir: the pinned config + links to the snapshot's other files; the hub cache is never written)."""
    d = pb.drafter
    if not d:
        return None
    return os.path.join(d["path"] or hub_drafter_dir(pb), "config.json")


def hub_drafter_dir(pb: Playbook) -> str | None:
    d = pb.drafter
    if not d or not d.get("hub_id"):
        return None
    return os.path.join(pb.runtime["state_dir"], "drafters", d["hub_id"].replace("/", "--"))


def spec_config(pb: Playbook) -> dict:
    s = pb.spec
    cfg = {"method": s["method"]}
    d = s.get("drafter")
    if d:
        cfg["model"] = d["path"] or hub_drafter_dir(pb)
    cfg["num_speculative_tokens"] = s["num_speculative_tokens"]
    cfg.update(s["extra"])
    return cfg


def serve_argv(pb: Playbook) -> list[str]:
    """`vllm serve TARGET --speculative-config JSON ...`, built from the playbook only (secrets go by env)."""
    sv = pb.serve
    argv = [pb.runtime["vllm"], "serve", pb.data["model"]["path"],
            "--host", sv["host"], "--port", str(sv["port"]),
            "--served-model-name", sv["served_model_name"],
            "--tensor-parallel-size", str(sv["tensor_parallel_size"]),
            "--gpu-memory-utilization", f"{sv['gpu_memory_utilization']:g}"]
    if sv.get("max_model_len"):
        argv += ["--max-model-len", str(sv["max_model_len"])]
    method = pb.spec["method"]
    backend = sv.get("attention_backend") or ("flash_attn" if method == "dflash" else None)
    if backend:
        argv += ["--attention-backend", backend]
    mnbt = sv.get("max_num_batched_tokens") or (32768 if method == "dflash" else None)
    if mnbt:
        argv += ["--max-num-batched-tokens", str(mnbt)]
    argv += ["--speculative-config", json.dumps(spec_config(pb), separators=(",", ":"))]
    if sv.get("trust_remote_code"):
        argv += ["--trust-remote-code"]
    argv += list(sv["extra_args"])
    return argv


def serve_env(pb: Playbook) -> dict:
    env = {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ",".join(map(str, pb.gpus))}
    d = pb.drafter
    if d and d.get("hub_id"):
        env["HF_HOME"] = d["hf_home"]
    env.update(pb.serve["env"])
    return env


def state_record(pb: Playbook) -> dict:
    return {"playbook": pb.name, "playbook_sha256": pb.sha256, "drafter_sha256": (pb.drafter or {}).get("sha256"),
            "drafter_path": drafter_config_path(pb), "port": pb.serve["port"],
            "served_model_name": pb.serve["served_model_name"], "method": pb.spec["method"], "gpus": pb.gpus,
            "api_key_env": pb.serve.get("api_key_env"), "host": pb.serve["host"]}


def verify_args(pb: Playbook) -> dict:
    d = pb.drafter
    return {"path": d.get("path") or hub_drafter_dir(pb), "hub_id": d.get("hub_id"), "hf_home": d.get("hf_home"),
            "sha256": d["sha256"], "target_path": pb.data["model"]["path"],
            "num_speculative_tokens": pb.spec["num_speculative_tokens"], "method": pb.spec["method"],
            "vllm_min_version": pb.data["requires"].get("vllm_min_version"),
            "fixes": pb.data["requires"].get("fixes") or [],
            "trust_remote_code": bool(pb.serve.get("trust_remote_code"))}


def _common(pb: Playbook):
    return dict(host=pb.host, vmid=pb.vmid)


def step_container(pb):
    return Step("container", "the container exists and runs", host_argv=["pct", "status", str(pb.vmid)],
                timeout=20, **_common(pb))


LOCK_TERM_S = 60.0  # a lock not renewed for this long is stale: its holder died or lost the connection


def step_lock(pb, operation, lease_s):
    return Step("lock", f"take the container lock (fails fast if another deploy holds it); a heartbeat renews it "
                        f"every {LOCK_TERM_S / 4:g} s for at most {lease_s:g} s (the steps' timeouts)", action="lock",
                args={"state_dir": pb.runtime["state_dir"], "token": TOKEN, "holder": HOLDER,
                      "lease_s": lease_s, "term_s": LOCK_TERM_S, "wait_s": 0, "operation": operation},
                timeout=30, **_common(pb))


def lease_for(steps: list[Step]) -> float:
    """The longest a run of these steps may hold the lock: the sum of their timeouts, plus a margin."""
    return round(sum(s.timeout for s in steps) + 120)


def step_current(pb):
    return Step("current", "read what runs there now (state file, health)", action="status",
                args={"state_dir": pb.runtime["state_dir"],
                      "nvidia_smi_timeout_s": pb.data["gpu"]["nvidia_smi_timeout_s"]},
                timeout=pb.data["gpu"]["nvidia_smi_timeout_s"] + 20, **_common(pb))


def step_write_config(pb):
    path = drafter_config_path(pb)
    if hub_drafter_dir(pb):
        d = pb.drafter
        return Step("drafter-config", f"serve the pinned config from {hub_drafter_dir(pb)}: config.json (pinned) "
                                      f"+ links to the other files of the hub snapshot of {d['hub_id']} "
                                      f"(the hub cache is only read)", action="hub_drafter",
                    args={"path": path, "dir": hub_drafter_dir(pb), "hub_id": d["hub_id"], "hf_home": d["hf_home"],
                          "sha256": d["sha256"]}, timeout=30,
                    payload=f"{os.path.basename(d['pinned_config'])} ({len(pb.drafter_bytes)} bytes, "
                            f"sha256 {d['sha256'][:12]}...)", **_common(pb))
    return Step("drafter-config", f"install the pinned drafter config at {path} if its sha256 differs "
                                  "(backup, temp file, fsync, rename, read back)", action="write_file",
                args={"path": path, "sha256": pb.drafter["sha256"]}, timeout=30,
                payload=f"{os.path.basename(pb.drafter['pinned_config'])} ({len(pb.drafter_bytes)} bytes, "
                        f"sha256 {pb.drafter['sha256'][:12]}...)", **_common(pb))


def step_verify(pb):
    if not pb.drafter:
        return Step("verify", "verify the serving stack (vLLM version, complete build, import)", action="verify",
                    args={"stack_only": True, "method": pb.spec["method"],
                          "vllm_min_version": pb.data["requires"].get("vllm_min_version")}, timeout=180,
                    **_common(pb))
    return Step("verify", "verify the drafter config vLLM will read: bytes, fields, as loaded, serving stack",
                action="verify", args=verify_args(pb), bulk={"pinned": pb.drafter_config}, timeout=180,
                **_common(pb))


def step_stop(pb, clean_gpus, when="something of ours is running", only_this_playbook=False):
    g = pb.data["gpu"]
    return Step("stop", "stop vLLM: SIGTERM its process group, grace period, SIGKILL, find leftovers"
                + (", then fuser -k -TERM/-KILL the holders of " + ", ".join(f"/dev/nvidia{g}" for g in pb.gpus)
                   if clean_gpus else ""),
                action="stop", args={"state_dir": pb.runtime["state_dir"], "grace_s": g["stop_grace_s"],
                                     "clean_gpus": clean_gpus, "fuser_grace_s": 5, "gpus": pb.gpus,
                                     "nvidia_smi_timeout_s": g["nvidia_smi_timeout_s"],
                                     **({"only_playbook": pb.name} if only_this_playbook else {})},
                timeout=g["stop_grace_s"] + 60, when=when, **_common(pb))


def step_gpus_free(pb):
    g = pb.data["gpu"]
    return Step("gpus-free", f"prove GPUs {pb.gpus} free: every one under {g['free_threshold_mib']} MiB "
                             f"within {g['free_timeout_s']:g} s", action="wait_free",
                args={"gpus": pb.gpus, "threshold_mib": g["free_threshold_mib"], "timeout_s": g["free_timeout_s"],
                      "nvidia_smi_timeout_s": g["nvidia_smi_timeout_s"], "poll_s": 0.25},
                timeout=g["free_timeout_s"] + g["nvidia_smi_timeout_s"] + 20, **_common(pb))


def step_port(pb):
    return Step("port-free", f"port {pb.serve['port']} is free in the container", action="port_check",
                args={"port": pb.serve["port"]}, timeout=20, **_common(pb))


def step_launch(pb):
    sp = state_paths(pb)
    return Step("launch", "start vllm serve detached (setsid, streams redirected) and record it in the state file",
                action="launch", args={"argv": serve_argv(pb), "env": serve_env(pb), "state_dir": sp["state_dir"],
                                       "log_path": sp["log_path"], "record": state_record(pb)},
                payload=("secrets (env: " + ", ".join(secret_env_names(pb)) + ")") if secret_env_names(pb) else None,
                timeout=30, **_common(pb))


def secret_env_names(pb: Playbook) -> list[str]:
    """The names (never the values) of the secrets vLLM gets in its environment, sent on stdin."""
    return sorted(set(pb.serve.get("secret_env") or {}) | ({"VLLM_API_KEY"} if pb.serve.get("api_key_env") else set()))


def step_wait(pb):
    from . import vllm_facts as vf

    sp = state_paths(pb)
    return Step("wait-ready", "follow the log and /health until /v1/models lists the model and a completion "
                              f"succeeds (timeout {pb.serve['load_timeout_s']:g} s)", action="wait_ready",
                args={"state_dir": sp["state_dir"], "log_path": sp["log_path"], "port": pb.serve["port"],
                      "served_model_name": pb.serve["served_model_name"], "timeout_s": pb.serve["load_timeout_s"]},
                bulk={"fatal": vf.FATAL, "phases": vf.PHASES, "aux_regex": vf.AUX_LAYERS},
                timeout=pb.serve["load_timeout_s"] + 60, **_common(pb))


def step_drift(pb):
    return Step("drift", "re-read the drafter config's sha256 now that the server is up", action="file_sha",
                args={"path": drafter_config_path(pb)}, timeout=20, **_common(pb))


def step_acceptance(pb):
    acc = pb.data["acceptance"]
    p = acc["probe"]
    return Step("acceptance", f"measure draft acceptance: scrape /metrics, {len(p['prompts']) * p['rounds']} probe "
                              f"requests, scrape again; gate at {acc['min_draft_acceptance']:.0%}",
                action="probe", args={"port": pb.serve["port"], "prompts": p["prompts"], "rounds": p["rounds"],
                                      "max_tokens": p["max_tokens"], "timeout_s": p["timeout_s"],
                                      "model": pb.serve["served_model_name"], "log_path": state_paths(pb)["log_path"],
                                      "state_dir": pb.runtime["state_dir"]},
                timeout=p["timeout_s"] + 30, **_common(pb))


def step_note_failure(pb, failure: dict | None = None):
    return Step("note-failure", "record the failure in the state directory, for deploy status", action="note_failure",
                args={"state_dir": pb.runtime["state_dir"], "failure": failure or {}}, timeout=20,
                when="the run failed after changing something", **_common(pb))


def step_unlock(pb):
    return Step("unlock", "release the container lock", action="unlock",
                args={"state_dir": pb.runtime["state_dir"], "token": TOKEN}, timeout=20, **_common(pb))


def plan_up(pb: Playbook, *, write_config: bool = True, clean_gpus: bool | None = None,
            restart: bool = False) -> list[Step]:
    clean = pb.data["gpu"]["clean_gpus"] if clean_gpus is None else clean_gpus
    steps = [step_current(pb)]
    if pb.drafter and write_config and drafter_config_path(pb):
        steps.append(step_write_config(pb))
    steps.append(step_verify(pb))
    steps.append(step_stop(pb, clean, when="always (restart)" if restart else
                           "something of ours runs and differs from this playbook"))
    steps += [step_gpus_free(pb), step_port(pb), step_launch(pb), step_wait(pb)]
    if drafter_config_path(pb):
        steps.append(step_drift(pb))
    steps.append(step_acceptance(pb))
    # a fallback's own steps run under the same lock
    fb = pb.fallback if pb.data["acceptance"]["on_low_acceptance"] == "fallback" and pb.fallback else None
    lease = lease_for(steps) + (lease_for(plan_up(fb, write_config=write_config)) if fb else 0)
    return [step_container(pb), step_lock(pb, "restart" if restart else "up", lease)] + steps + [step_unlock(pb)]


def plan_down(pb: Playbook, *, clean_gpus: bool | None = None) -> list[Step]:
    clean = pb.data["gpu"]["clean_gpus"] if clean_gpus is None else clean_gpus
    steps = [step_stop(pb, clean, when="it runs this playbook", only_this_playbook=True), step_gpus_free(pb)]
    return [step_container(pb), step_lock(pb, "down", lease_for(steps))] + steps + [step_unlock(pb)]
