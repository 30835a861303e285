"""What the plan gives the container, from the playbook alone (pure, no I/O): `vllm serve`'s argv and environment,
the state record, the drafter config's path, what verify checks the launch against, the systemd supervision, the
fetch items and the install-vllm request. plan.py builds the steps around them; steps/ and the agent never
rebuild them."""

from __future__ import annotations

import dataclasses
import json
import os
import re

from orchestrator.core.spec import Playbook, fetch_items
from orchestrator.core.spec_schema import VERSION_RE


def state_paths(pb: Playbook) -> dict:
    sd = pb.conf.runtime.state_dir
    return {"state_dir": sd, "log_path": os.path.join(sd, "vllm.log")}


def drafter_config_path(pb: Playbook) -> str | None:
    """The config.json vLLM reads: in the drafter directory, or for a hub id in deploy's own drafter directory
    (hub_drafter_dir: the pinned config + links to the snapshot's other files; the hub cache is never written)."""
    d = pb.conf.speculative.drafter
    if not d:
        return None
    return os.path.join(d.path or hub_drafter_dir(pb), "config.json")


def hub_drafter_dir(pb: Playbook) -> str | None:
    d = pb.conf.speculative.drafter
    if not d or not d.hub_id:
        return None
    return os.path.join(pb.conf.runtime.state_dir, "drafters", d.hub_id.replace("/", "--"))


def spec_config(pb: Playbook) -> dict:
    """--speculative-config's JSON; {} for deploy tune's baseline (spec_off: no --speculative-config at all)."""
    if pb.spec_off:
        return {}
    s = pb.conf.speculative
    cfg = {"method": s.method}
    if s.drafter:
        cfg["model"] = s.drafter.path or hub_drafter_dir(pb)
    cfg["num_speculative_tokens"] = s.num_speculative_tokens
    cfg.update(s.extra)
    if s.schedule:
        cfg["num_speculative_tokens_per_batch_size"] = [list(r) for r in s.schedule]
    return cfg


def serve_argv(pb: Playbook) -> list[str]:
    """`vllm serve TARGET --speculative-config JSON ...`, built from the playbook only (secrets go by env)."""
    c = pb.conf
    sv = c.serve
    argv = [c.runtime.vllm, "serve", c.model.path, "--host", sv.host, "--port", str(sv.port),
            "--served-model-name", sv.served_model_name, "--tensor-parallel-size", str(sv.tensor_parallel_size),
            "--gpu-memory-utilization", f"{sv.gpu_memory_utilization:g}"]
    if sv.max_model_len:
        argv += ["--max-model-len", str(sv.max_model_len)]
    if sv.attention_backend:  # flash_attn for DFlash when unset: spec._conf
        argv += ["--attention-backend", sv.attention_backend]
    if sv.max_num_batched_tokens:  # DFLASH_BATCHED_TOKENS for DFlash when unset (and what sizing.py sizes with)
        argv += ["--max-num-batched-tokens", str(sv.max_num_batched_tokens)]
    if not pb.spec_off:  # deploy tune's baseline: no speculation at all
        argv += ["--speculative-config", json.dumps(spec_config(pb), separators=(",", ":"))]
    if sv.trust_remote_code:
        argv += ["--trust-remote-code"]
    return argv + list(sv.extra_args)


def serve_env(pb: Playbook) -> dict:
    # SPT_NOENV: vLLM titles its processes with setproctitle, which otherwise overwrites what /proc/PID/environ
    # shows, and with it the launch id that proves a process ours (agent state.proven)
    env = {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "SPT_NOENV": "1", "CUDA_VISIBLE_DEVICES": ",".join(map(str, pb.gpus))}
    d = pb.conf.speculative.drafter
    if d and d.hub_id:
        env["HF_HOME"] = d.hf_home
    env.update(pb.conf.serve.env)
    return env


def state_record(pb: Playbook) -> dict:
    c = pb.conf
    off = pb.spec_off  # deploy tune's baseline: no drafter, no speculation
    return {"playbook": pb.name, "playbook_sha256": pb.sha256,
            "drafter_sha256": c.speculative.drafter.sha256 if c.speculative.drafter and not off else None,
            "drafter_path": None if off else drafter_config_path(pb), "port": c.serve.port,
            "served_model_name": c.serve.served_model_name, "method": "none" if off else c.speculative.method,
            "gpus": pb.gpus, "api_key_env": c.serve.api_key_env, "host": c.serve.host}


def verify_args(pb: Playbook) -> dict:
    c = pb.conf
    d, sp = c.speculative.drafter, c.speculative
    return {"path": d.path or hub_drafter_dir(pb), "hub_id": d.hub_id, "hf_home": d.hf_home,
            **({"revision": d.revision} if d.revision else {}),
            "sha256": d.sha256, "target_path": c.model.path,
            "num_speculative_tokens": sp.num_speculative_tokens, "method": sp.method,
            "vllm_min_version": c.requires.vllm_min_version, "fixes": list(c.requires.fixes),
            "trust_remote_code": c.serve.trust_remote_code, **launch_check_args(pb)}


SPEC_SHORTCUT_FLAGS = ("--spec-method", "--spec-model", "--spec-tokens")


def launch_check_args(pb) -> dict:
    """What the verify step checks the launch against, in the container's own vLLM: the keys of the
    --speculative-config JSON, the shortcut flags in serve.extra_args that clash with it, the model runner."""
    sv = pb.conf.serve
    flags = [a.split("=", 1)[0] for a in sv.extra_args if a.split("=", 1)[0] in SPEC_SHORTCUT_FLAGS]
    return {"spec_keys": sorted(spec_config(pb)), "spec_flags": flags,
            "v2_runner_off": sv.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0"}


def supervise_args(pb: Playbook) -> dict:
    return dataclasses.asdict(pb.conf.supervise)


def unit_name(pb: Playbook) -> str:
    """The systemd unit that supervises the playbook's server where the container runs systemd."""
    return f"vllm-{pb.name}.service"


def secret_env_names(pb: Playbook) -> list[str]:
    """The names (never the values) of the secrets vLLM gets in its environment, sent on stdin."""
    sv = pb.conf.serve
    return sorted(set(sv.secret_env) | ({"VLLM_API_KEY"} if sv.api_key_env else set()))


HUB_ENDPOINT = "https://huggingface.co"


def fetch_args(pb: Playbook) -> list[dict]:
    """The playbook's fetch items, as the agent takes them (endpoint defaulted, the incoming directory of a
    directory source)."""
    out = []
    for it in fetch_items(pb):
        it = dict(it)
        if it["hub"] and not it["source_path"]:
            it["endpoint"] = (it["endpoint"] or os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT).rstrip("/")
        if it["source_path"]:
            it["incoming"] = _fetch_incoming_dir(it)
        out.append(it)
    return out


def fetch_dests(pb: Playbook) -> dict:
    """{role: directory} where deploy fetch puts the model and the drafter (and keeps the record of each)."""
    c = pb.conf
    out = {"model": c.model.path}
    d = c.speculative.drafter
    if d:
        out["drafter"] = d.path or os.path.join(d.hf_home, "hub", "models--" + d.hub_id.replace("/", "--"))
    return out


def fetch_transfer(pb: Playbook, connections: int | None = None) -> dict:
    """How the fetch runner downloads: connections (deploy fetch --connections wins over fetch.connections) and the
    range size in bytes."""
    f = pb.conf.fetch
    return {"connections": int(connections or f.connections), "range_bytes": f.range_mib << 20}


def _fetch_incoming_dir(it: dict) -> str:
    """Where a directory source is copied into the container: beside its destination (one file system, so the
    verified files are moved into place by rename)."""
    if it["dest_kind"] == "cache":
        return os.path.join(it["hf_home"], "hub", "models--" + it["hub"].replace("/", "--"), ".deploy-incoming")
    d = it["dest"].rstrip("/")
    return os.path.join(os.path.dirname(d), f".{os.path.basename(d)}.deploy-fetch", "incoming")


def install_requirement(spec: str) -> dict:
    """requires.vllm -> what the installer is given: {req, label, version (exact, or None), kind}."""
    if re.fullmatch(VERSION_RE, spec):
        return {"req": f"vllm=={spec}", "label": spec, "version": spec, "kind": "release"}
    if spec.startswith("git+"):
        ref = spec.rsplit("@", 1)[1] if "@" in spec.split("://", 1)[-1].split("/", 1)[-1] else "default"
        # the bare URL: pip and uv read the name from the source; `vllm @ git+file:///...` is refused by older pip
        return {"req": spec, "label": "git-" + ref, "version": None, "kind": "git"}
    name = os.path.basename(spec.split("?", 1)[0])
    m = re.match(r"vllm-([^-]+)-", name)
    label = m.group(1) if m else name
    if spec.startswith(("http://", "https://")):
        return {"req": spec, "label": label, "version": None, "kind": "wheel-url"}
    return {"req": spec, "label": label, "version": None, "kind": "wheel-file"}


def _install_check_args(pb: Playbook, version: str | None) -> dict:
    rq = pb.conf.requires
    return {"version": version, "method": pb.conf.speculative.method, "vllm_min_version": rq.vllm_min_version,
            "fixes": list(rq.fixes), "layer_types": (pb.drafter_config or {}).get("layer_types") or []}


def install_args(pb: Playbook, op: str, **kw) -> dict:
    """The request of agent action install_vllm (OP: probe, start, attach, rollback) for PB."""
    rq, rt = pb.conf.requires, pb.conf.runtime
    inst = rq.install
    args = {"op": op, "python": rt.python, "vllm": rt.vllm, "state_dir": rt.state_dir, "heartbeat_s": inst.heartbeat_s}
    if rq.vllm:
        r = install_requirement(rq.vllm)
        args.update(spec=rq.vllm, req=r["req"], label=r["label"], installer=inst.installer,
                    base_python=inst.python, index_url=inst.index_url, find_links=list(inst.find_links),
                    no_index=inst.no_index, timeout_s=inst.timeout_s, hashes=list(inst.hashes),
                    check=_install_check_args(pb, r["version"]))
    else:
        args["check"] = _install_check_args(pb, None)
    args.update(kw)
    return args
