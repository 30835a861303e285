"""Pure planning: (playbook, inventory, options) -> ordered steps. No I/O; this is what --dry-run prints.

The plan is the program: the executor (ops.execute) is one loop over these Step objects and nothing else. Each
step carries the runner that executes it (`name`, a key of ops.STEPS: runner and agent action), a `phase` (main, on-low-acceptance,
on-failure, finally), a `when` predicate over the run's state (a function of this module whose docstring is what
`deploy plan` prints), and `runs`: the commands it amounts to on the host and in the container, written as the
shell an operator would recognise. The planner reads nothing from disk or network: the Playbook holds its bytes
and sha256 from load time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass, field

from orchestrator.steps import plumbing_check as PL
from orchestrator.core import vllm_facts as vf
from orchestrator.core.gate import playbook_thresholds
from orchestrator.agent import SESSION_BOOT, agent_argv
from orchestrator.agent.container.protocol import SMI_MEMORY_ARGS
from orchestrator.core.remote import pct_exec_argv, shell_join
# what the steps carry, built from the playbook alone (plan_args.py); P.serve_argv etc. stay the plan's names
from orchestrator.steps.plan_args import (drafter_config_path, fetch_args, fetch_dests, fetch_transfer, hub_drafter_dir, install_args,
                        launch_check_args, secret_env_names, serve_argv, serve_env, spec_config, state_paths,
                        state_record, supervise_args, unit_name, verify_args)
from orchestrator.core.spec import Inventory, Playbook, Runtime, fetch_items


# Run-time values the plan cannot know; Context.call fills them in (they are not secret).
TOKEN = "<invocation token>"
HOLDER = "<user@workstation>"


# ------------------------------------------------------------------ run state and the named `when` predicates


@dataclass
class RunState:
    """What a run has learnt so far: the only input of the `when` predicates (ops fills it in)."""
    restart: bool = False
    running: bool = False  # a deployment of ours is alive (state file + proven process group)
    foreign_vllm: bool = False  # vLLM processes deploy did not start are present
    launched: bool = False
    locked: bool = False
    config_replaced: bool = False
    verified_sha: str | None = None
    failed_step: str | None = None
    unreachable: bool = False  # the failure was losing the host
    low: str | None = None  # the acceptance gate's reason, when it failed
    can_fall_back: bool = False  # the plan has an on-low-acceptance phase
    changed: list = field(default_factory=list)
    finished: str | None = None  # set by a runner that ends the main phase early ("already up")
    ungated: bool = False  # the same deployment runs healthy without a passed verdict: gate it (gate-running phase)
    verdict: dict | None = None  # the gate's verdict (gate.Verdict.as_dict()), for the gate-record step
    systemd: bool = False  # the launch made vLLM a systemd unit (it starts when the container boots)


def something_to_stop(st: RunState) -> bool:
    """a restart, or a deployment of ours runs (differs or unhealthy), or vLLM processes deploy did not start are seen"""
    return st.restart or st.running or st.foreign_vllm


def launched_under_systemd(st: RunState) -> bool:
    """this run launched vLLM as a systemd unit (it comes back when the container boots)"""
    return st.launched and st.systemd


def launched_and_reachable(st: RunState) -> bool:
    """this run launched vLLM and the host is still reachable"""
    return st.launched and not st.unreachable


def failed_after_verify(st: RunState) -> bool:
    """the drafter config was verified and a later step failed (the host still reachable)"""
    return bool(st.verified_sha) and not st.unreachable and st.failed_step not in (None, "drafter-config", "verify",
                                                                                     "drift")


def config_replaced_here(st: RunState) -> bool:
    """this run replaced the drafter config and then failed (the host still reachable)"""
    return st.config_replaced and not st.unreachable


def changed_something(st: RunState) -> bool:
    """the run failed after changing something on the host (the host still reachable)"""
    return (bool(st.changed) or st.launched or st.config_replaced) and not st.unreachable and \
        st.failed_step != "lock"


def low_acceptance(st: RunState) -> bool:
    """the acceptance gate failed and the playbook falls back"""
    return st.low is not None


def ungated(st: RunState) -> bool:
    """the same deployment runs healthy, but its launch has no passed gate verdict"""
    return st.ungated


def lock_held(st: RunState) -> bool:
    """this run holds the container lock"""
    return st.locked


def describe_when(fn) -> str | None:
    return (fn.__doc__ or fn.__name__).strip().splitlines()[0] if fn else None


PHASE_TITLES = {"gate-running": "If the same deployment already runs healthy but its launch never passed the gate "
                                "(measure and gate it now)",
                "on-low-acceptance": "On low acceptance (acceptance.on_low_acceptance: fallback)",
                "on-failure": "If a step above fails", "finally": "At the end, whatever happened",
                "measure": "Then deploy compare measures it (--prompts, --rounds, --max-tokens, --concurrency)"}


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
    when: object = None  # a predicate of this module over RunState (None: always); its docstring is shown
    runs: list = field(default_factory=list)  # what it amounts to, as shell an operator would recognise
    phase: str = "main"
    sub: list = field(default_factory=list)  # the fallback's own steps (step `fallback`)
    playbook: str = ""  # whose step (a fallback's steps name the fallback playbook)
    local: bool = False  # runs on this workstation only (checks a result already read)
    judge: dict = field(default_factory=dict)  # what the workstation judges the answer with (never sent)
    drive: dict = field(default_factory=dict)  # how the workstation drives a step of several calls (never sent)

    def remote_argv(self, python: str) -> list[str]:
        """The argv on the Proxmox host (before SSH quoting)."""
        if self.action is None:
            return self.host_argv or []
        argv = agent_argv(self.drive.get("python") or python, self.action, self.args)
        return argv if self.vmid is None else pct_exec_argv(self.vmid, argv)  # vmid None: on the host itself

    def as_dict(self, inv: Inventory, python: str) -> dict:
        h = inv.host(self.host)
        return {"step": self.name, "title": self.title, "host": self.host, "vmid": self.vmid,
                "phase": self.phase, "playbook": self.playbook or None,
                "when": describe_when(self.when), "timeout_s": self.timeout,
                "ssh": ssh_prefix(h), "command": None if self.local else shell_join(self.remote_argv(python)),
                "request": (f"{self.action} {shell_join([json.dumps(self.args, sort_keys=True, separators=(',', ':'))])}"
                            if self.action and not self.local else None),
                "runs": list(self.runs), **({"own_process": True} if self.drive.get("python") else {}),
                **({"host_command": shell_join(self.host_argv)} if self.action and self.host_argv else {}),
                "stdin": " + ".join(([self.payload] if self.payload else [])
                                    + [f"{k} ({_size(v)})" for k, v in self.bulk.items()]) or None,
                **({"steps": [s.as_dict(inv, python) for s in self.sub]} if self.sub else {})}


def session_command(pb, python: str) -> str:
    """The one command that carries every agent step of an operation in this container (agent/AgentSession)."""
    return shell_join(pct_exec_argv(pb.vmid, [python, "-c", SESSION_BOOT, "N"]))


def _size(v) -> str:
    return f"{len(v)} items" if isinstance(v, (list, dict)) else f"{len(str(v))} chars"


def ssh_prefix(h) -> str:
    target = h.ssh_config_alias or f"{h.user}@{h.address}"
    return f"ssh -p {h.port} {target}" if not h.ssh_config_alias else f"ssh {target}"


# ------------------------------------------------------------------ building blocks shared by up/down/restart


def _common(pb: Playbook):
    return dict(host=pb.host, vmid=pb.vmid, playbook=pb.name)


# shown in the plan: the agent runs nvidia-smi with exactly these arguments (agent/container/protocol.py)
NVIDIA_SMI_QUERY = shlex.join(["nvidia-smi", *SMI_MEMORY_ARGS])


def _devs(gpus) -> str:
    return " ".join(f"/dev/nvidia{g}" for g in gpus)


def _state(pb, name) -> str:
    return os.path.join(pb.conf.runtime.state_dir, name)


def step_container(pb):
    return Step("container", "the container exists and runs", host_argv=["pct", "status", str(pb.vmid)],
                timeout=20, **_common(pb))


LOCK_TERM_S = 60.0  # a lock not renewed for this long is stale: its holder died or lost the connection


def step_lock(pb, operation, lease_s):
    return Step("lock", f"take the container lock (fails fast if another deploy holds it); a heartbeat renews it "
                        f"every {LOCK_TERM_S / 4:g} s for at most {lease_s:g} s (the steps' timeouts)", action="lock",
                args={"state_dir": pb.conf.runtime.state_dir, "token": TOKEN, "holder": HOLDER,
                      "lease_s": lease_s, "term_s": LOCK_TERM_S, "wait_s": 0, "operation": operation},
                timeout=30, runs=[f"ln {_state(pb, 'lock.NEW')} {_state(pb, 'lock')}   # atomic: fails if held "
                                  "(holder, operation, lease in the file; a stale one is broken)",
                                  f"every {LOCK_TERM_S / 4:g} s: renew the lease (same command, renew=true)"],
                **_common(pb))


def lease_for(steps: list[Step]) -> float:
    """The longest a run of these steps may hold the lock: the sum of their timeouts, plus a margin."""
    return round(sum(s.timeout for s in steps) + 120)


def step_current(pb):
    port = pb.conf.serve.port
    return Step("current", "read what runs there now (state file, health, gate verdict); if this same playbook "
                           "already runs healthy and its launch passed the gate, stop here: already up (without a "
                           "passed verdict: gate it now)", action="status",
                args={"state_dir": pb.conf.runtime.state_dir,
                      "nvidia_smi_timeout_s": pb.conf.gpu.nvidia_smi_timeout_s},
                timeout=pb.conf.gpu.nvidia_smi_timeout_s + 20,
                runs=[f"cat {_state(pb, 'state.json')}; check its process group is alive (pid, start time, launch id)",
                      "sha256sum the drafter config the state file names; ps for vLLM processes deploy did not start",
                      f"curl -s http://127.0.0.1:{port}/health; curl -s http://127.0.0.1:{port}/v1/models "
                      "(only to our own listener; API key on stdin)",
                      f"{NVIDIA_SMI_QUERY}   # timeout {pb.conf.gpu.nvidia_smi_timeout_s:g} s"],
                **_common(pb))


def step_write_config(pb):
    path, d, hub = drafter_config_path(pb), pb.conf.speculative.drafter, hub_drafter_dir(pb)
    payload = f"{os.path.basename(d.pinned_config)} ({len(pb.drafter_bytes)} bytes, sha256 {d.sha256[:12]}...)"
    if hub:
        return Step("drafter-config", f"serve the pinned config from {hub}: config.json (pinned) "
                                      f"+ links to the other files of the hub snapshot of {d.hub_id} "
                                      f"(the hub cache is only read)", action="hub_drafter",
                    args={"path": path, "dir": hub, "hub_id": d.hub_id, "hf_home": d.hf_home,
                          "sha256": d.sha256, **({"revision": d.revision} if d.revision else {})},
                    timeout=30, payload=payload,
                    runs=[f"mkdir -m 0700 {hub}.NEW; write config.json (the pinned bytes, sha256 "
                          f"{d.sha256}); ln -s every other file of the snapshot of {d.hub_id} in "
                          f"{d.hf_home}", f"mv -T {hub}.NEW {hub}; sha256sum {path}   # read back"],
                    **_common(pb))
    return Step("drafter-config", f"install the pinned drafter config at {path} if its sha256 differs "
                                  "(backup, temp file, fsync, rename, read back)", action="write_file",
                args={"path": path, "sha256": d.sha256}, timeout=30, payload=payload,
                runs=[f"sha256sum {path}   # equal to {d.sha256}: nothing to do",
                      f"else: cp -p {path} {path}.bak-UTCSTAMP; write {path}.tmp-RANDOM (O_EXCL, no symlinks); "
                      f"fsync; mv {path}.tmp-RANDOM {path}; fsync the directory",
                      f"sha256sum {path}   # read back: must be {d.sha256}"],
                **_common(pb))


def step_plumbing(pb):
    """The gpu-plumbing check (orchestrator/steps/plumbing_check.py; docs/gpu-containers.md): read-only, host and container."""
    return Step("gpu-plumbing", "the container sees its GPUs: pct config lines, host and container /dev/nvidia* "
                                "(majors), nvidia-uvm, driver version in user space = the host's module, the "
                                "driver's CUDA >= torch's, /dev/shm for tensor parallelism",
                action="plumbing", args={}, timeout=30,
                host_argv=PL.host_argv(pb.vmid, pb.conf.gpu.nvidia_smi_timeout_s),
                runs=[f"pct config {pb.vmid}; grep nvidia /proc/devices; stat /dev/nvidia*; "
                      "cat /proc/driver/nvidia/version; nvidia-smi   # on the host, one exec",
                      f"stat /dev/nvidia*; ls /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.* libcuda.so.*; "
                      f"df /dev/shm; torch/version.py of {pb.conf.runtime.python}   # in the container, no exec"],
                **_common(pb))


def step_verify(pb):
    if not pb.conf.speculative.drafter or pb.spec_off:
        return Step("verify", "verify the serving stack (vLLM version, complete build, import)", action="verify",
                    args={"stack_only": True, "method": pb.conf.speculative.method,
                          "vllm_min_version": pb.conf.requires.vllm_min_version, **launch_check_args(pb)},
                    timeout=180,
                    runs=_stack_runs(pb), **_common(pb))
    path = drafter_config_path(pb)
    return Step("verify", "verify the drafter config vLLM will read: bytes, fields, as loaded, serving stack",
                action="verify", args=verify_args(pb), bulk={"pinned": pb.drafter_config}, timeout=180,
                runs=[f"realpath {path}; sha256sum it; parse it (duplicate keys refused) and compare every field "
                      "with the pinned config and the target's text_config",
                      f"HF_HUB_OFFLINE=1 {pb.conf.runtime.python} -c 'AutoConfig.from_pretrained(DIR)'   # loaded as "
                      "vLLM loads it, in a subprocess" + ("" if pb.conf.serve.trust_remote_code else
                                                          ", trust_remote_code=False")] + _stack_runs(pb),
                **_common(pb))


def _stack_runs(pb) -> list[str]:
    py = pb.conf.runtime.python
    return [f"{py} -c 'import vllm; print(vllm.__version__)'; grep the fix markers in vllm's sources",
            f"{py} -c 'import vllm._C'   # compiled extensions, in a subprocess",
            "parse vllm/config/speculative.py (Python's ast, vllm not imported): the fields of SpeculativeConfig; "
            f"every key of --speculative-config ({', '.join(spec_config(pb))}) must be one of them"]


def step_stop(pb, clean_gpus, when=something_to_stop, only_this_playbook=False, name="stop", phase="main"):
    g = pb.conf.gpu
    runs = [f"cat {_state(pb, 'state.json')}; prove the recorded group is ours (start time, launch id)" +
            (f" and runs {pb.name}" if only_this_playbook else ""),
            "if it names a systemd unit: systemctl stop UNIT; systemctl disable UNIT   # every process of the unit's "
            f"cgroup: SIGTERM, SIGKILL after TimeoutStopSec={g.stop_grace_s:g}s; the env file with the secrets removed",
            f"else: kill -TERM -PGID; wait up to {g.stop_grace_s:g} s; kill -KILL -PGID   # pidfd-checked, never "
            "a reused id", "wait until the group has left; list what still holds " + _devs(pb.gpus)]
    if clean_gpus:
        runs.append(f"fuser -k -TERM {_devs(pb.gpus)}; wait 5 s; fuser -k -KILL {_devs(pb.gpus)}   # in the "
                    "container only, the playbook's own GPUs only; refused on a Proxmox host")
    return Step(name, "stop vLLM: SIGTERM its process group, grace period, SIGKILL, find leftovers"
                + (", then fuser -k -TERM/-KILL the holders of " + ", ".join(f"/dev/nvidia{g}" for g in pb.gpus)
                   if clean_gpus else ""),
                action="stop", args={"state_dir": pb.conf.runtime.state_dir, "grace_s": g.stop_grace_s,
                                     "clean_gpus": clean_gpus, "fuser_grace_s": 5, "gpus": pb.gpus,
                                     "nvidia_smi_timeout_s": g.nvidia_smi_timeout_s,
                                     **({"only_playbook": pb.name} if only_this_playbook else {})},
                timeout=g.stop_grace_s + 60, when=when, runs=runs, phase=phase, **_common(pb))


OUTSIDE_AFTER_S = 10.0  # busy GPUs that nothing in the container holds for this long: held outside, fail now


def step_gpus_free(pb):
    g = pb.conf.gpu
    return Step("gpus-free", f"prove GPUs {pb.gpus} free: every one under {g.free_threshold_mib} MiB "
                             f"within {g.free_timeout_s:g} s", action="gpus_free",
                args={"gpus": pb.gpus, "threshold_mib": g.free_threshold_mib, "timeout_s": g.free_timeout_s,
                      "outside_after_s": min(OUTSIDE_AFTER_S, g.free_timeout_s),
                      "nvidia_smi_timeout_s": g.nvidia_smi_timeout_s, "poll_s": 0.25},
                timeout=g.free_timeout_s + g.nvidia_smi_timeout_s + 20,
                runs=[f"{NVIDIA_SMI_QUERY}   # every 0.25 s up to {g.free_timeout_s:g} s (each call "
                      f"timeout {g.nvidia_smi_timeout_s:g} s) until GPUs {pb.gpus} are each under "
                      f"{g.free_threshold_mib} MiB; busy for {min(OUTSIDE_AFTER_S, g.free_timeout_s):g} s with "
                      "no holder in the container: held outside, stop waiting",
                      f"if not: fuser -v {_devs(pb.gpus)}   # holders in the container",
                      "if none there: pct list; pct config VMID for each other running container; nvidia-smi "
                      "--query-compute-apps=pid,used_memory,gpu_uuid   # on the host, read-only: who holds the busy "
                      "GPUs (host PID, container)"],
                **_common(pb))


def step_port(pb):
    return Step("port-free", f"port {pb.conf.serve.port} is free in the container", action="port_check",
                args={"port": pb.conf.serve.port}, timeout=20,
                runs=[f"ss -ltn 'sport = :{pb.conf.serve.port}'   # read from /proc/net/tcp and tcp6"], **_common(pb))


def step_launch(pb):
    sp = state_paths(pb)
    return Step("launch", f"start vllm serve as systemd unit {unit_name(pb)} (installed, enabled) where the container "
                          "runs systemd, else detached (setsid, streams redirected); record it in the state file",
                action="launch", args={"argv": serve_argv(pb), "env": serve_env(pb), "state_dir": sp["state_dir"],
                                       "log_path": sp["log_path"], "record": state_record(pb),
                                       "unit": unit_name(pb), "playbook": pb.name, "supervise": supervise_args(pb),
                                       "stop_grace_s": pb.conf.gpu.stop_grace_s},
                payload=("secrets (env: " + ", ".join(secret_env_names(pb)) + ")") if secret_env_names(pb) else None,
                timeout=30, runs=[f"if /run/systemd/system exists: write /etc/systemd/system/{unit_name(pb)} (ExecStart= "
                                  "this argv, Environment= this environment, EnvironmentFile="
                                  f"{_state(pb, unit_name(pb)[:-len('.service')] + '.env')} (0600) with "
                                  + (", ".join(secret_env_names(pb)) or "no secrets") + " and the launch id; only "
                                  "when its bytes differ: temp file, fsync, rename, read back); systemctl "
                                  f"daemon-reload; systemctl reset-failed, enable, start {unit_name(pb)}",
                                  f"else: cd / && setsid env -i {' '.join(f'{k}={v}' for k, v in serve_env(pb).items())}"
                                  + "".join(f" {n}=(from stdin)" for n in secret_env_names(pb))
                                  + f" {shell_join(serve_argv(pb))} </dev/null >>{sp['log_path']} 2>&1 &",
                                  f"write {_state(pb, 'state.json')} (pid, pgid, start time, launch id, argv, "
                                  "drafter sha256; no secrets)"],
                **_common(pb))


def step_onboot(pb):
    """After a launch under systemd: does the container start with the host (a warning only)? A read of its own,
    planned, not work hidden in the launch."""
    return Step("onboot", "the container starts with the host (pct config: onboot: 1), so the unit comes back after "
                          "a host reboot; a warning only", host_argv=["pct", "config", str(pb.vmid)], timeout=20,
                when=launched_under_systemd, **_common(pb))


def step_wait(pb):
    sp = state_paths(pb)
    return Step("wait-ready", "follow the log and /health until /v1/models lists the model and a completion "
                              f"succeeds (timeout {pb.conf.serve.load_timeout_s:g} s)", action="wait_ready",
                args={"state_dir": sp["state_dir"], "log_path": sp["log_path"], "port": pb.conf.serve.port,
                      "served_model_name": pb.conf.serve.served_model_name, "timeout_s": pb.conf.serve.load_timeout_s},
                bulk={"fatal": vf.FATAL, "phases": vf.PHASES, "aux_regex": vf.AUX_LAYERS},
                timeout=pb.conf.serve.load_timeout_s + 60,
                runs=[f"tail -f {sp['log_path']} (journalctl -f _SYSTEMD_INVOCATION_ID=... for a systemd unit)   "
                      "# startup phases, known fatal lines, the auxiliary-layers line",
                      f"curl http://127.0.0.1:{pb.conf.serve.port}/health; curl /v1/models (lists "
                      f"{pb.conf.serve.served_model_name}); POST /v1/completions (1 token)   # until ready, the "
                      f"process exits, or {pb.conf.serve.load_timeout_s:g} s"],
                **_common(pb))


def step_aux_layers(pb):
    return Step("aux-layers", "the taps in the startup log are the pinned target_layer_ids + 1 (PR #40727)",
                local=True, timeout=0,
                runs=["(no remote command: checks the auxiliary-layers line wait-ready read from the log)"],
                **_common(pb))


def step_drift(pb, name="drift", title="re-read the drafter config's sha256 now that the server is up",
               when=None, phase="main"):
    return Step(name, title, action="file_sha", args={"path": drafter_config_path(pb)}, timeout=20,
                runs=[f"sha256sum {drafter_config_path(pb)}"], when=when, phase=phase, **_common(pb))


def step_acceptance(pb, when=None, phase="main"):
    p = pb.conf.acceptance.probe
    th = playbook_thresholds(pb)
    n = len(p.prompts) * p.rounds
    return Step("acceptance", f"measure acceptance: scrape /metrics, {n} probe requests ({p.prompts_source or 'playbook'}"
                              f"), scrape again; gate: {th.describe()}",
                action="acceptance", args={"port": pb.conf.serve.port, "prompts": list(p.prompts), "rounds": p.rounds,
                                           "max_rounds": p.max_rounds, "min_drafts": th.min_drafts,
                                           "max_tokens": p.max_tokens, "timeout_s": p.timeout_s,
                                           "model": pb.conf.serve.served_model_name,
                                           "log_path": state_paths(pb)["log_path"],
                                           "state_dir": pb.conf.runtime.state_dir},
                timeout=p.timeout_s + 30, when=when, phase=phase, judge={"thresholds": th},
                runs=[f"curl http://127.0.0.1:{pb.conf.serve.port}/metrics   # spec-decode counters before",
                      f"{n} x POST /v1/completions (max_tokens {p.max_tokens}); more rounds (up to "
                      f"{p.max_rounds}) while fewer than {th.min_drafts} drafts, within {p.timeout_s:g} s",
                      "curl /metrics again; AL = 1 + delta(accepted) / delta(drafts), rate = delta(accepted) / "
                      "delta(draft tokens), per position = delta(per_pos[p]) / delta(drafts) (else the SpecDecoding "
                      "log line)"],
                **_common(pb))


def step_serving(pb, when=None, phase="main"):
    """deploy tune's baseline has no drafts to gate: its gate is that it serves (wait-ready's completion)."""
    return Step("serving", "the baseline (no --speculative-config) serves: its gate is wait-ready's completion, "
                           "there are no drafts to measure", local=True, timeout=0, when=when, phase=phase,
                runs=["(no remote command: wait-ready's completion answered)"], **_common(pb))


def step_gate_record(pb, when=None, phase="main"):
    """The verdict itself is known only at run time: ops fills in args["verdict"]."""
    return Step("gate-record", "record the gate's verdict and figures with the launch it belongs to (deploy up "
                               "never says `already up` for a launch without a passed verdict; deploy status shows it)",
                action="gate_record", args={"state_dir": pb.conf.runtime.state_dir, "playbook": pb.name, "verdict": {}},
                timeout=20, when=when, phase=phase,
                runs=[f"write {_state(pb, 'gate.json')} (verdict, figures, the launch id of state.json); on a "
                      f"rejection with a fallback also {_state(pb, 'rejected.json')}"], **_common(pb))


def step_note_failure(pb):
    """The failure itself is known only at run time: ops fills in args["failure"]."""
    return Step("note-failure", "record the failure in the state directory, for deploy status", action="note_failure",
                args={"state_dir": pb.conf.runtime.state_dir, "failure": {}}, timeout=20,
                when=changed_something, phase="on-failure",
                runs=[f"write {_state(pb, 'last_failure.json')} (playbook, step, message)"], **_common(pb))


def step_unlock(pb):
    return Step("unlock", "release the container lock", action="unlock",
                args={"state_dir": pb.conf.runtime.state_dir, "token": TOKEN}, timeout=20, when=lock_held,
                phase="finally", runs=[f"rm {_state(pb, 'lock')}   # only if it is still ours"], **_common(pb))


# ------------------------------------------------------------------ fetch: `deploy fetch` and up's step `fetch`
# (here, beside the other steps: fetch.py runs them and imports this; the planner imports nothing above it)

FETCH_TIMEOUT_S = 6 * 3600.0  # the whole fetch; a 55 GB model at 30 MB/s takes about 30 min


def _fetch_describe(it: dict) -> str:
    src = f"{it['hub']}@{it['revision']}" if it.get("hub") and not it.get("source_path") else \
        f"{it['source_path']} (host)" + (f" = {it['hub']}@{it['revision']}" if it.get("hub") and it.get("revision") else "")
    where = it["dest"] if it["dest_kind"] == "dir" else f"the hub cache in {it['hf_home']}"
    if it.get("store"):
        where += f" (links into the host's store {it['store']}, read-only at {it['mount']})"
    return f"{it['role']} {src} -> {where}"


# a directory source copied on the Proxmox host into the container (fetch._copy_from_host): constant shell text,
# every path a positional parameter ($1, $2, then the pct exec argv as "$@"), so a path holding ' or ; is data
COPY_SCRIPT = ('src=$1; manifest=$2; shift 2; '
               'test -d "$src" || { printf "no such directory on the host: %s\\n" "$src" >&2; exit 3; }; '
               'test -f "$src/$manifest" || { printf "no %s in %s\\n" "$manifest" "$src" >&2; exit 4; }; '
               'tar -C "$src" -cf - . | "$@"')
UNPACK_SCRIPT = 'rm -rf "$1" && mkdir -p "$1" && tar -C "$1" --no-same-owner -xf -'


def copy_from_host_argv(vmid: int, src: str, incoming: str, keep_env: bool = True) -> list[str]:
    """The host-side argv that streams SRC (a directory on the Proxmox host) into INCOMING in container VMID: what
    fetch runs and what `deploy plan` shows, the same list."""
    from orchestrator.agent.container.weights import MANIFEST_NAME

    return ["sh", "-c", COPY_SCRIPT, "sh", src, MANIFEST_NAME,
            *pct_exec_argv(vmid, ["sh", "-c", UNPACK_SCRIPT, "sh", incoming], keep_env)]


def step_fetch(pb: Playbook, *, allow: bool = True, rehash: bool = False, connections: int | None = None,
               timeout_s: float = FETCH_TIMEOUT_S) -> Step:
    """The step `fetch` of `up` and of `deploy fetch` (fetch.run drives it: probe, start or re-attach, follow)."""
    its = fetch_args(pb)
    runs = []
    for it in its:
        if it.get("store"):
            tr = fetch_transfer(pb, connections)
            runs.append(f"on {pb.host} (python3 - fetch; only what the store lacks; its lock: one download per host): "
                        f"GET {it['endpoint']}/{it['hub']}/resolve/COMMIT/FILE over up to {tr['connections']} "
                        f"connections -> {it['store']}/hub/models--{it['hub'].replace('/', '--')}/; verify sha256 / "
                        "git blob id")
            runs.append(f"pct exec {pb.vmid} -- link {it['dest']}/* -> {it['mount']}/hub/models--"
                        f"{it['hub'].replace('/', '--')}/snapshots/COMMIT/* (the store, read-only at {it['mount']}: "
                        f"mpN: {it['store']},mp={it['mount']},ro=1 from deploy prepare)"
                        + ("; config.json a copy, pinned by write-config" if it["role"] == "drafter" else ""))
        elif it.get("source_path"):
            runs.append(shell_join(copy_from_host_argv(pb.vmid, it["source_path"], it["incoming"]))
                        + "   # on the host, only when something is missing")
        else:
            runs.append(f"GET {it['endpoint']}/api/models/{it['hub']}/revision/{it['revision']}?blobs=true   # the "
                        "commit and every file's size and hash" + (f" (token from ${it['token_env']}, on stdin)"
                                                                   if it.get("token_env") else ""))
            tr = fetch_transfer(pb, connections)
            runs.append(f"GET {it['endpoint']}/{it['hub']}/resolve/COMMIT/FILE over up to {tr['connections']} "
                        f"connections (files > {tr['range_bytes'] >> 20} MiB in {tr['range_bytes'] >> 20} MiB "
                        "ranges: Range: bytes=A-B, each resumable) -> "
                        f"{'*.incomplete' if it['dest_kind'] == 'cache' else '.' + os.path.basename(it['dest']) + '.deploy-fetch/'}"
                        "; verify sha256 / git blob id; move into place")
    return Step("fetch", ("fetch what is missing, detached, verified against the hub's record: " if allow else
                            "check that the weights are in place and verified (--no-fetch: refuse when not): ")
                  + "; ".join(_fetch_describe(it) for it in its), action="fetch",
                  args={"op": "probe", "state_dir": pb.conf.runtime.state_dir, "items": its, "rehash": rehash},
                  timeout=timeout_s + 600 if allow else 60, runs=runs + (
                      ["every file in place re-hashed (sha256 / git blob id), not trusted from its record"]
                      if rehash else []), host=pb.host, vmid=pb.vmid, playbook=pb.name,
                  drive={"allow_start": allow, "rehash": rehash, "timeout_s": timeout_s,
                         "transfer": fetch_transfer(pb, connections), "python": pb.conf.runtime.python},
                  sub=fetch_calls(pb, its, timeout_s, fetch_transfer(pb, connections)))


def plan_fetch(pb: Playbook, *, rehash: bool = False, connections: int | None = None,
               timeout_s: float = FETCH_TIMEOUT_S, manifest: bool = False) -> list[Step]:
    """`deploy fetch`: the container runs, then the step fetch (no lock: the fetch runner takes its own, one
    download per destination; a second deploy follows the running one); manifest: then read its records."""
    return [step_container(pb), step_fetch(pb, rehash=rehash, connections=connections, timeout_s=timeout_s)] + (
        [step_manifest_records(pb)] if manifest else [])


# ------------------------------------------------------------------ install-vllm: `deploy install-vllm`


INSTALL_FALLBACK_PYTHON = "/usr/bin/python3"  # runs the agent when the runtime venv does not exist yet


def step_install(pb: Playbook, *, force: bool = False, rollback: bool = False) -> Step:
    """The step `install-vllm` (install.run drives it: probe, then start / re-attach / report / nothing to do, then
    follow; or the rollback)."""
    req, rt = pb.conf.requires, pb.conf.runtime
    inst = req.install
    py = inst.python or rt.python
    venv = os.path.dirname(os.path.dirname(rt.python))
    if rollback:
        return Step("install-vllm", f"switch the runtime {venv} back to the venv it had before the last switch, then "
                                    "verify the serving stack there", action="install_vllm",
                    args=install_args(pb, "probe"), timeout=360,
                    runs=[f"readlink {venv}; cat {_state(pb, 'runtime.json')}   # the previous venv",
                          f"ln -sfn PREVIOUS {venv}.NEW; mv -T {venv}.NEW {venv}   # one rename",
                          f"{rt.python} -c 'import vllm' ...   # the stack checks of verify"],
                    drive={"rollback": True, "force": force, "python": py}, sub=install_calls(pb, py), **_common(pb))
    spec = req.vllm or "?"
    runner = "uv pip install (uv venv) when the container has uv, else python -m venv + pip"
    return Step("install-vllm", f"install {spec} into a fresh venv beside {venv} ({venv}.versions/), detached, "
                                f"verify it there, then switch {venv} to it (one rename); the previous venv stays",
                action="install_vllm", args=install_args(pb, "probe"),
                timeout=float(inst.timeout_s) + 1100,
                runs=[f"pct exec {pb.vmid} -- {py} - install_vllm probe   # runtime link, a running or finished install, "
                      "what serves (falls back to " + INSTALL_FALLBACK_PYTHON + " while the venv does not exist)",
                      f"{runner}: {spec} -> {venv}.versions/LABEL-ID   # detached runner, log "
                      f"{_state(pb, 'install-ID.log')}, limit requires.install.timeout_s = {inst.timeout_s:g} s"
                      + (f", --index-url {inst.index_url}" if inst.index_url else "")
                      + (" --require-hashes" if inst.hashes else ""),
                      f"{venv}.versions/LABEL-ID/bin/python -c 'import vllm; import vllm._C'; check the fix markers, "
                      "every file against the distribution's RECORD",
                      f"ln -sfn {venv}.versions/LABEL-ID {venv}.NEW; mv -T {venv}.NEW {venv}   # only when verified",
                      "a serving vLLM is not touched (asked first; -y): the next up/restart starts the new build"]
                + ([] if not force else ["--force: installed again even when requires.vllm is the verified "
                                         "runtime already"]),
                drive={"rollback": False, "force": force, "python": py}, sub=install_calls(pb, py), **_common(pb))


def plan_install(pb: Playbook, *, force: bool = False, rollback: bool = False) -> list[Step]:
    """`deploy install-vllm`: the container runs, then the step install-vllm (the install runner takes its own
    lock; nothing that serves is stopped)."""
    return [step_container(pb), step_install(pb, force=force, rollback=rollback)]


def main_steps(pb: Playbook, *, write_config: bool = True, clean: bool = False, restart: bool = False,
               fetch: bool = True) -> list[Step]:
    """current .. acceptance: what brings one playbook up once the container is known and locked."""
    steps = [step_current(pb)]
    if fetch_items(pb):  # weights from the hub or a host directory: fetched (verified) before anything else
        steps.append(step_fetch(pb, allow=fetch))
    if pb.spec_off:  # deploy tune's baseline: no drafter to write or verify, no drafts to gate
        return steps + [step_verify(pb), step_plumbing(pb),
                        step_stop(pb, clean, when=None if restart else something_to_stop),
                        step_gpus_free(pb), step_port(pb), step_launch(pb), step_wait(pb), step_serving(pb)]
    if pb.conf.speculative.drafter and write_config and drafter_config_path(pb):
        steps.append(step_write_config(pb))
    steps.append(step_verify(pb))
    steps.append(step_plumbing(pb))  # before anything is stopped: a container that cannot serve keeps what runs
    steps.append(step_stop(pb, clean, when=None if restart else something_to_stop))
    steps += [step_gpus_free(pb), step_port(pb), step_launch(pb), step_onboot(pb), step_wait(pb)]
    if pb.conf.speculative.method == "dflash" and pb.drafter_config:
        steps.append(step_aux_layers(pb))
    if drafter_config_path(pb):
        steps.append(step_drift(pb))
    steps += [step_acceptance(pb), step_gate_record(pb)]
    return steps


def gate_running_steps(pb: Playbook) -> list[Step]:
    """The same deployment already runs healthy but has no passed verdict for its launch (an up interrupted before
    the gate, a crash of deploy, an older deploy): measure and gate it now, and act on the verdict."""
    if pb.spec_off:
        return [step_serving(pb, when=ungated, phase="gate-running")]
    return [step_acceptance(pb, when=ungated, phase="gate-running"),
            step_gate_record(pb, when=ungated, phase="gate-running")]


def failure_steps(pb: Playbook) -> list[Step]:
    """What runs when a step of the main phase fails: stop a half-started server, tell drift from its symptom,
    read back what was changed (for `state left:`), leave a record for deploy status."""
    # only_this_playbook: never the deployment of another playbook that took the container over meanwhile (a
    # broken lock, issue 26)
    out = [step_stop(pb, False, when=launched_and_reachable, name="stop-failed", phase="on-failure",
                     only_this_playbook=True)]
    if drafter_config_path(pb):
        out.append(step_drift(pb, "drift-check", "did the drafter config change since verify? (then that is the "
                                                  "news, and the failed step its symptom)",
                              when=failed_after_verify, phase="on-failure"))
        out.append(step_drift(pb, "read-back", "read the replaced drafter config back, for `state left:`",
                              when=config_replaced_here, phase="on-failure"))
    out.append(step_note_failure(pb))
    return out


def plan_up(pb: Playbook, *, write_config: bool = True, clean_gpus: bool | None = None,
            restart: bool = False, ask: bool = False, fetch: bool = True) -> list[Step]:
    """ask: with fuser -k planned, list the GPU holders deploy did not start and ask first (no -y). fetch=False (up
    --no-fetch): the step fetch only checks that the weights are in place."""
    clean = pb.conf.gpu.clean_gpus if clean_gpus is None else clean_gpus
    steps = main_steps(pb, write_config=write_config, clean=clean, restart=restart, fetch=fetch)
    if clean and ask:
        i = next(k for k, s in enumerate(steps) if s.name == "stop")
        steps.insert(i, step_holders(pb, when=steps[i].when))
    fb = pb.fallback if pb.conf.acceptance.on_low_acceptance == "fallback" and pb.fallback else None
    low = []
    if fb is not None:
        # never fuser here: the operator asked for a deployment, not for killing GPU holders
        sub = main_steps(fb, write_config=write_config, clean=False, fetch=fetch) + gate_running_steps(fb) + \
            failure_steps(fb)
        low = [step_stop(pb, False, when=low_acceptance, name="stop-low", phase="on-low-acceptance"),
               Step("fallback", f"bring up {fb.name} under the same lock (its steps below; its own failure steps "
                                f"run if one fails)", host=pb.host, vmid=pb.vmid, playbook=pb.name, local=True,
                    when=low_acceptance, phase="on-low-acceptance", sub=sub, timeout=lease_for(sub),
                    runs=[f"the steps of {fb.name}, listed below"])]
    # everything between lock and unlock runs under the lock: the fallback's own steps and the clean-up included
    guarded = steps + gate_running_steps(pb) + low + failure_steps(pb)
    return ([step_container(pb), step_lock(pb, "restart" if restart else "up", lease_for(guarded))] + guarded
            + [step_unlock(pb)])


def step_holders(pb: Playbook, when=None) -> Step:
    """Before a fuser -k (one rule for up, restart and down): list what holds the playbook's GPUs that deploy did
    not start, and ask; nothing is killed without a yes (the prompt on a terminal, or -y)."""
    return Step("holders", "list what holds the playbook's GPUs in the container (deploy's own processes apart: "
                           "stop ends those) and ask before killing them; nothing is killed without a yes (-y)",
                action="gpu_read", args={"nvidia_smi_timeout_s": 5, "state_dir": pb.conf.runtime.state_dir},
                timeout=30, when=when, runs=[f"fuser -v {_devs(pb.gpus)}; {NVIDIA_SMI_QUERY}"], **_common(pb))


def plan_down(pb: Playbook, *, clean_gpus: bool | None = None, ask: bool = False) -> list[Step]:
    """ask: before a fuser -k, list what holds the playbook's GPUs and ask (--clean-gpus without -y)."""
    clean = pb.conf.gpu.clean_gpus if clean_gpus is None else clean_gpus
    steps = []
    if clean and ask:
        steps.append(step_holders(pb))
    steps += [step_stop(pb, clean, when=None, only_this_playbook=True), step_gpus_free(pb),
             Step("clear-failure", "a deliberate down ends the story of an earlier failed up (deploy status)",
                  action="note_failure", args={"state_dir": pb.conf.runtime.state_dir, "failure": {}}, timeout=20,
                  runs=[f"rm -f {_state(pb, 'last_failure.json')}"], **_common(pb))]
    return [step_container(pb), step_lock(pb, "down", lease_for(steps))] + steps + [step_unlock(pb)]


def step_revisions(pb: Playbook) -> Step:
    """verify's read of deploy fetch's records: the revision in place of the model and the drafter."""
    dests = fetch_dests(pb)
    return Step("revisions", "the revision in place of each fetched weight (deploy fetch's records; read only)",
                action="fetch", args={"op": "records", "state_dir": pb.conf.runtime.state_dir,
                                      "dests": list(dests.values())},
                timeout=30, drive={"roles": dests}, runs=[f"read the fetch record of {d}" for d in dests.values()],
                **_common(pb))


def plan_verify(pb: Playbook) -> list[Step]:
    """`deploy verify`: read-only and without the lock: the drafter config and serving stack, the gpu-plumbing check
    (with the sizing on the GPUs as measured), the fetched revisions. Every check runs; verify_only judges them."""
    report = {"report": True}  # the runners collect (ops.verify_only), not fail at the first problem
    steps = [dataclasses.replace(step_verify(pb), drive=report), dataclasses.replace(step_plumbing(pb), drive=report)]
    return steps + ([step_revisions(pb)] if fetch_args(pb) else [])


def plan_apply_config(pb: Playbook) -> list[Step]:
    steps = [step_write_config(pb), step_verify(pb)]
    return [step_container(pb), step_lock(pb, "apply-config", lease_for(steps))] + steps + [step_unlock(pb)]


# ================================================================== the calls of a driven step (issue 51)
# A step of several calls (fetch, install-vllm) carries each later call as a planned sub-step: its action, its
# request and its python (drive["python"]; vmid None: on the Proxmox host itself). The runner sends them through
# Context.call, filling in only what the container answers at run time (the runner's id, the log position, the
# items found missing); `deploy plan` shows them under their step. ops.STEPS names each (its parent's runner).

FETCH_FOLLOW_S = 60.0  # one fetch attach call follows the runner this long; the next continues where it stopped
FETCH_STALL_S = 60.0  # no byte for this long on a connection: it is retried (three times), then the fetch fails
INSTALL_FOLLOW_S = 120.0  # the same for an install
STORE_PYTHON = "python3"  # the host's own (Proxmox VE ships Python 3); the agent uses only the standard library
STORE_STATE = ".deploy-state"  # the store's records, fetch.json, its fetch lock: in the store, beside what they describe
RUNNER_ID, LOG_POS, MISSING = "<the runner's id>", "<where the last attach stopped>", "<the items the probe finds missing>"


def store_state_dir(store: str) -> str:
    return os.path.join(store, STORE_STATE)


def store_repo_dir(store: str, hub: str) -> str:
    return os.path.join(store, "hub", "models--" + hub.replace("/", "--"))


def store_host_item(it: dict) -> dict:
    """A container item (dest_kind dir, with store) as the host fetches it: into the store's hub-cache layout."""
    out = {k: v for k, v in it.items() if k not in ("store", "mount")}
    out.update(dest_kind="cache", hf_home=it["store"], dest=None)
    return out


def _call(pb, name: str, title: str, action: str, args: dict, timeout: float, *, host: bool = False,
          python: str | None = None, **kw) -> Step:
    py = STORE_PYTHON if host else python or pb.conf.runtime.python
    where = f"on {pb.host} itself, by its {py}" if host else f"in container {pb.vmid}, by {py}"
    return Step(name, title, host=pb.host, vmid=None if host else pb.vmid, playbook=pb.name, action=action, args=args,
                timeout=timeout, drive={"python": py}, runs=[f"{where}, in a process of its own"], **kw)


def _attach(pb, name: str, action: str, args: dict, follow_s: float, slack: float, **kw) -> Step:
    return _call(pb, name, f"follow the detached runner (at most {follow_s:g} s a call, again until it ends)", action,
                 dict(args, op="attach", id=RUNNER_ID, log_pos=LOG_POS, follow_s=follow_s), follow_s + slack, **kw)


def fetch_calls(pb: Playbook, its: list[dict], timeout_s: float, transfer: dict) -> list[Step]:
    """The step fetch's later calls: in the container (start, attach) and, for the host's store, on the host (mark,
    probe, start, attach, records) and the container's links."""
    sd, tokens = pb.conf.runtime.state_dir, "the hub tokens (token:ROLE)" if any(it.get("token_env") for it in its) else None
    start = {"op": "start", "items": MISSING, "timeout_s": timeout_s, "stall_s": FETCH_STALL_S, **transfer}
    out = []
    shared = [it for it in its if it.get("store")]
    if shared:
        store, mount = shared[0]["store"], shared[0]["mount"]
        ssd = store_state_dir(store)
        out += [_call(pb, "store-mark", f"the store {store} and its marker (made once; root's, no one else writes it)",
                      "store", {"op": "mark", "store": store}, 30, host=True),
                _call(pb, "store-probe", "what the store holds (again after following another deploy's download)",
                      "fetch", {"op": "probe", "state_dir": ssd, "items": [store_host_item(it) for it in shared],
                                "rehash": False}, 60, host=True),
                _call(pb, "store-start", "start the detached fetch of what the store lacks", "fetch",
                      dict(start, state_dir=ssd), 120, host=True, payload=tokens),
                _attach(pb, "store-attach", "fetch", {"state_dir": ssd, "heartbeat_s": 2.0}, FETCH_FOLLOW_S, 60, host=True),
                _call(pb, "store-records", "the store's records of what it holds", "fetch",
                      {"op": "records", "state_dir": ssd, "dests": [store_repo_dir(store, it["hub"]) for it in shared]},
                      30, host=True),
                _call(pb, "store-link", f"prove {mount} is the store, read-only; link each destination into it",
                      "store", {"op": "link", "store": store, "mount": mount, "id": "<the store's id, from mark>",
                                "items": "<the records read>", "state_dir": sd}, 120)]
    if len(shared) < len(its):
        out += [_call(pb, "fetch-start", "start the detached fetch of what the probe finds missing", "fetch",
                      dict(start, state_dir=sd), 120, payload=tokens),
                _attach(pb, "fetch-attach", "fetch", {"state_dir": sd, "heartbeat_s": 2.0}, FETCH_FOLLOW_S, 60)]
    return out


def install_calls(pb: Playbook, python: str) -> list[Step]:
    """The step install-vllm's later calls (after its probe): start, attach, or the rollback."""
    return [_call(pb, "install-start", "start the detached install", "install_vllm",
                  install_args(pb, "start", follow_s=0), 120, python=python),
            _attach(pb, "install-attach", "install_vllm", install_args(pb, "attach"), INSTALL_FOLLOW_S, 120, python=python),
            _call(pb, "install-rollback", "switch back (--rollback)", "install_vllm", install_args(pb, "rollback"),
                  300, python=python)]


def call_of(step: Step, name: str, timeout: float | None = None, **fill) -> Step:
    """The planned call NAME of a driven step (the step itself: its first call), with its run-time fields filled in."""
    s = step if name == step.name else next(s for s in step.sub if s.name == name)
    return dataclasses.replace(s, args={**s.args, **fill}, timeout=s.timeout if timeout is None else timeout)


def step_manifest_records(pb: Playbook) -> Step:
    """deploy fetch --manifest FILE: after the fetch, the records of what it verified (the hub's own hashes)."""
    return dataclasses.replace(step_revisions(pb), name="manifest-records", title="read the fetch records, for "
                               "--manifest FILE (the hub's hashes of every file)")


def plan_unlock(host: str, vmid: int, runtime: Runtime) -> list[Step]:
    """`deploy unlock`: who holds the container lock (read only), then, when confirmed, break it: only if it is
    still that holder's (its token on stdin). Each in a process of its own."""
    sd = runtime.state_dir
    kw = dict(host=host, vmid=vmid, action="unlock", args={"state_dir": sd}, timeout=30,
              drive={"python": runtime.python})
    return [Step("lock-holder", "who holds the container lock (read only)", runs=[f"cat {sd}/lock"], **kw),
            Step("break-lock", "break the lock, when confirmed, only if the holder shown still holds it",
                 payload="the holder's token (break_token)", runs=[f"rm {sd}/lock   # if its token is still the "
                                                                   "one shown"], **kw)]


def step_on(host: str, vmid: int | None, python: str, name: str, action: str, args: dict, timeout: float,
            title: str = "", bulk: dict | None = None) -> Step:
    """One request to a container that no playbook is read for (deploy doctor's reads, prepare's check, the router's
    ops, status's and logs' reads), under the python its drive names; sent by steps.call_on through Context.call."""
    return Step(name, title or f"agent action {action}", host=host, vmid=vmid, action=action, args=args,
                timeout=timeout, drive={"python": python}, bulk=bulk or {})


def step_sweep(pb: Playbook, prompts: list[str], rounds: int, max_tokens: int, timeout_s: float,
               levels: list[int]) -> Step:
    """deploy compare's and tune's measurement of a launch: every level, that many clients streaming the prompts."""
    return Step("sweep", f"concurrency {', '.join(map(str, levels))}: streamed completions of {max_tokens} tokens, "
                         "each timed; /metrics before and after each level", action="sweep",
                args={"port": pb.conf.serve.port, "prompts": prompts, "rounds": rounds, "max_tokens": max_tokens,
                      "timeout_s": timeout_s, "model": pb.conf.serve.served_model_name, "levels": levels,
                      "state_dir": pb.conf.runtime.state_dir}, timeout=timeout_s + 30, host=pb.host, vmid=pb.vmid,
                phase="measure")


def step_tune_record(pb: Playbook, verdict, chosen) -> Step:
    """deploy tune's verdict, kept beside the launch it left running (tune.json: deploy status shows it)."""
    return Step("tune-record", "record the tune's verdict with the launch left running", action="tune_record",
                args={"state_dir": pb.conf.runtime.state_dir, "playbook": pb.name, "verdict": verdict,
                      "chosen": chosen}, timeout=20, host=pb.host, vmid=pb.vmid, playbook=pb.name)


def plan_compare(pb: Playbook, **up) -> list[Step]:
    """`deploy compare` of one playbook with its defaults: up with the fallback off, then the sweep (docs/cli.md)."""
    p = pb.conf.acceptance.probe  # compare's --prompts, --rounds, --max-tokens; --concurrency 1,4,16
    return plan_up(pb.variant(), **up) + [step_sweep(pb, list(p.prompts), p.rounds, p.max_tokens, p.timeout_s * 2 * 3,
                                                      [1, 4, 16])]
