"""The schema of playbooks and the inventory: every key, its type, range, default and doc, declared once.

`spec.py` checks a file against these (schema.py's engine gives FILE:LINE:COL, "did you mean", unknown keys),
then cross-checks and resolves it; `json_schema` turns the same declarations into `deploy schema`'s JSON Schema.
Nothing here reads a file or touches the network.
"""

from __future__ import annotations

import difflib
import re
from urllib.parse import urlsplit

from orchestrator.core.schema import ABS_PATH, Bool, Field, Float, FreeMap, Int, List, Map, Str

# runtime.state_dir's default: the workstation's one spelling (status, discover and ops take it from spec.py); the
# agent's is agent/container/protocol.py's (this module cannot import the agent package), held equal by a unit test
DEFAULT_STATE_DIR = "/var/lib/vllm-pve-deploy"
DEFAULT_PYTHON = "/root/ml-env/bin/python"  # the container's Python when neither the playbook nor the inventory names one

NAME = dict(pattern=r"[a-z0-9][a-z0-9-]{0,62}", pattern_hint="lowercase letters, digits and '-', at most 63")
HOSTNAME = dict(pattern=r"[A-Za-z0-9_.:\[\]-]{1,253}", pattern_hint="an IP address or DNS name")
SERVED_NAME = dict(pattern=r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}", pattern_hint="letters, digits, . _ / : -")
HUB_ID = dict(pattern=r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*", pattern_hint="ORG/NAME")
VERSION = dict(pattern=r"\d+\.\d+(\.\d+)?", pattern_hint="a version like 0.26.0")
SHA256 = dict(pattern=r"[0-9a-f]{64}", pattern_hint="64 lowercase hex digits")
ENV_KEY = r"[A-Z_][A-Z0-9_]{0,127}"
VERSION_RE = r"\d+\.\d+(\.\d+)?((a|b|rc)\d+|\.post\d+|\.dev\d+)?"

METHODS = ("dflash", "mtp", "eagle3", "ngram")
KNOWN_FIXES = ("dflash_layer_id_offset", "dflash_sliding_window")
# Flags the tool sets itself from typed settings; passing them again in extra_args would fight the playbook.
RESERVED_FLAGS = ("--port", "--host", "--speculative-config", "-sc", "--tensor-parallel-size", "-tp",
                  "--gpu-memory-utilization", "--max-model-len", "--served-model-name", "--api-key",
                  "--attention-backend", "--max-num-batched-tokens", "--trust-remote-code")
# Environment names that hold secrets: their values must not be in the playbook (argv, plan, ps, audit log).
SECRET_PARTS = {"KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "CREDENTIAL"}


def is_secret_name(name: str) -> bool:
    """HF_TOKEN, VLLM_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD...: any _-separated part names a secret."""
    return bool(set(name.upper().split("_")) & SECRET_PARTS)


def _vllm_source(value: str) -> str | None:
    """requires.vllm: a release version, a git source, a wheel URL, or a wheel file in the container."""
    if re.fullmatch(VERSION_RE, value):
        return None
    forms = ("a version like \"0.34.0\", git+https://github.com/ORG/vllm@BRANCH_OR_COMMIT (also git+ssh://, "
             "git+file://), an https://.../vllm-*.whl URL, or the absolute path of a wheel in the container")
    if value.startswith("git+"):
        u = urlsplit(value[4:])
        if u.scheme not in ("https", "http", "ssh", "file") or (u.scheme != "file" and not u.netloc):
            return f"{value!r} is not a git source I can install: use {forms}"
        if u.password or (u.username and u.scheme in ("https", "http")):
            return ("credentials in the URL would be in argv, the plan and the audit log; use a credential helper "
                    "or ~/.netrc in the container instead")
        return None
    if value.startswith(("https://", "http://")):
        u = urlsplit(value)
        if not u.netloc or not u.path.endswith(".whl"):
            return f"{value!r} is not a wheel URL (…/vllm-VERSION-….whl); use {forms}"
        if u.username or u.password:
            return "credentials in the URL would be in argv, the plan and the audit log; use ~/.netrc in the container"
        return None
    if value.startswith("/"):
        if not value.endswith(".whl"):
            return f"{value!r} is not a wheel file (….whl); use {forms}"
        return None
    return f"{value!r} is not one of: {forms}"


def _index_url(value: str) -> str | None:
    u = urlsplit(value)
    if u.scheme not in ("https", "http", "file") or (u.scheme != "file" and not u.netloc):
        return f"{value!r} is not an http(s):// or file:// URL"
    if u.username or u.password:
        return "credentials in the URL would be in argv and the audit log; use ~/.netrc or pip/uv config in the container"
    return None


def _find_links(value: str) -> str | None:
    return None if value.startswith("/") else _index_url(value)


def _package_sources(installer: str) -> dict:
    """Where an install finds its packages (requires.install, router.install): index_url, find_links, no_index."""
    return {
        "index_url": Field(Str(validate=_index_url), doc=f"the package index ({installer} --index-url)"),
        "find_links": Field(List(Str(validate=_find_links), max_len=20), default=list,
                            doc="directories or URLs with wheels (--find-links)"),
        "no_index": Field(Bool(), default=False, doc="only find_links, no index (--no-index)"),
    }


def _defaulted(m: Map, doc: str = "", skip_none: bool = False) -> Field:
    """An optional map key whose value, when it is left out, is the defaults of its own keys (said once, there)."""
    return Field(m, default=lambda: m.defaults(skip_none), doc=doc)


def _method(value: str) -> str | None:
    if value in METHODS:
        return None
    if value.endswith("_mtp"):
        return f"{value!r} is a deprecated alias that vLLM rewrites to 'mtp' with a warning; write method: mtp"
    near = difflib.get_close_matches(value, METHODS, n=1)
    return f"{value!r} is not one of {', '.join(map(repr, METHODS))}" + (f" (did you mean {near[0]!r}?)" if near else "")


# ---------------------------------------------------------------- inventory

CONTAINER = Map({
    "vmid": Field(Int(100, 999_999_999), required=True, doc="Proxmox container id"),
    "name": Field(Str(**NAME), doc="container name (informational)"),
    "gpus": Field(List(Int(0, 63), min_len=0, max_len=64, unique=True), default=list,
                  doc="host GPU indices passed into the container"),
    "address": Field(Str(**HOSTNAME), doc="the container's own IP or DNS name (service URLs); filled by "
                                          "`deploy discover`"),
    "runtime": Field(Map({
        "python": Field(Str(**ABS_PATH), required=True, doc="the Python that runs vLLM in the container"),
        "vllm": Field(Str(**ABS_PATH), doc="the vllm executable (default: next to python)"),
        "state_dir": Field(Str(**ABS_PATH), default=DEFAULT_STATE_DIR),
    }), doc="the container's vLLM runtime (filled by `deploy discover`; a playbook's runtime overrides it); "
            "without one `deploy status` shows `no vLLM runtime`"),
})

HOST = Map({
    "name": Field(Str(**NAME), required=True, doc="name used by playbooks and on the command line"),
    "address": Field(Str(**HOSTNAME), doc="IP or DNS name of the Proxmox host"),
    "ssh_config_alias": Field(Str(**HOSTNAME), doc="a Host alias from ~/.ssh/config, instead of address"),
    "port": Field(Int(1, 65535), default=22),
    "user": Field(Str(pattern=r"[a-z_][a-z0-9_-]{0,31}", pattern_hint="a user name"), default="root"),
    "identity_file": Field(Str(), doc="private key file; default: ssh-agent and ~/.ssh keys"),
    "known_hosts": Field(Str(), default="~/.ssh/known_hosts"),
    "accept_new_host_keys": Field(Bool(), default=False, doc="trust and record a host key seen for the first time"),
    "connect_timeout_s": Field(Float(0.1, 300), default=10.0),
    "containers": Field(List(CONTAINER, max_len=500), default=list),
})


INVENTORY = Map({"hosts": Field(List(HOST, max_len=1000), required=True)})  # cross-checks: spec.py

# ---------------------------------------------------------------- playbook

def _endpoint(value: str) -> str | None:
    u = urlsplit(value)
    if u.scheme not in ("https", "http") or not u.netloc:
        return f"{value!r} is not an http(s):// URL"
    if u.username or u.password:
        return "credentials in the URL would be in argv and the audit log; name the token in token_env instead"
    return None


def _revision(value: str) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}", value) or ".." in value or value.endswith((".", "/")):
        return f"{value!r} is not a revision: give a commit (40 hex digits), a branch or a tag"
    return None


# where the weights come from (issue 27): the same keys on `model` and `speculative.drafter`
FETCH_FIELDS = {
    "hub": Field(Str(**HUB_ID), doc="fetch from this hub repository (deploy fetch; deploy up fetches what is missing)"),
    "revision": Field(Str(validate=_revision), doc="the revision to fetch: a commit (40 hex digits), or a branch/tag "
                                                    "resolved once at fetch time, shown and recorded"),
    "token_env": Field(Str(pattern=ENV_KEY, pattern_hint="a LOCAL environment variable name"),
                       doc="name of a LOCAL environment variable holding the hub token (sent on stdin, never in argv)"),
    "endpoint": Field(Str(validate=_endpoint), doc="the hub or a mirror (default: $HF_ENDPOINT, else "
                                                    "https://huggingface.co)"),
    "source": Field(Map({"path": Field(Str(**ABS_PATH), required=True,
                                       doc="a directory on the Proxmox host with the files and deploy-manifest.json")}),
                    doc="instead of the hub: copy from a directory on the Proxmox host, verified against its manifest"),
}

DRAFTER = Map({
    "path": Field(Str(**ABS_PATH), doc="absolute path of the drafter directory in the container (what vLLM reads)"),
    "hub_id": Field(Str(**HUB_ID), doc="instead of path: a hub id; vLLM then reads the hub cache snapshot"),
    "hf_home": Field(Str(**ABS_PATH), default="/root/.cache/huggingface", doc="HF_HOME in the container"),
    "pinned_config": Field(Str(), required=True, doc="the config.json to install, relative to the playbook"),
    "sha256": Field(Str(**SHA256), required=True, doc="sha256 of the pinned config bytes"),
    **FETCH_FIELDS,
})

TARGET = Map({
    "host": Field(Str(**NAME), required=True),
    "vmid": Field(Int(100, 999_999_999), required=True),
    "gpus": Field(List(Int(0, 63), min_len=1, max_len=64, unique=True), required=True),
})

ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "power_of_two", "consistent_hash")
ROUTER = Map({
    "host": Field(Str(**NAME), required=True, doc="the Proxmox host of the router's container"),
    "vmid": Field(Int(100, 999_999_999), doc="the container the router runs in (required: nothing of ours runs "
                                             "on a Proxmox host itself)"),
    "listen": Field(Str(**HOSTNAME), default="0.0.0.0", doc="the address the router binds in its container"),
    "port": Field(Int(1, 65534), default=30000, doc="the router's port (clients use this one); its Prometheus "
                                                    "metrics are on 127.0.0.1:port+1 in the container"),
    "policy": Field(Str(choices=ROUTER_POLICIES), default="round_robin",
                    doc="vllm-router --policy: how a request picks its replica"),
    "version": Field(Str(pattern=VERSION_RE, pattern_hint="a version like 0.1.17"), default="0.1.17",
                     doc="the vllm-router release, pinned; installed in a venv in the container, checked against "
                         "its RECORD"),
    "python": Field(Str(**ABS_PATH), default="/usr/bin/python3",
                    doc="the Python the router's venv is made from (and that runs deploy's agent there)"),
    "install": _defaulted(Map({
        **_package_sources("pip"),
        "timeout_s": Field(Float(1, 7200), default=900.0, doc="the install's limit"),
    })),
    "health_check_interval_s": Field(Int(1, 3600), default=2,
                                     doc="the router checks each replica's /health this often"),
    "health_failure_threshold": Field(Int(1, 100), default=2,
                                      doc="failed checks in a row before a replica is taken out"),
    "drain_timeout_s": Field(Float(0, 3600), default=120.0,
                             doc="restart --rolling: how long to wait for a removed replica's running requests"),
    "gate_requests_per_replica": Field(Int(1, 100), default=2,
                                       doc="deploy up's gate: completions sent through the router per replica"),
})

PLAYBOOK = Map({
    "name": Field(Str(**NAME), required=True),
    "description": Field(Str(), default=""),
    "target": Field(TARGET, doc="the one container this playbook runs in (or `targets` for replicas)"),
    "targets": Field(List(TARGET, min_len=1, max_len=256),
                     doc="instead of target: replicas, one per container (deploy up brings them up in parallel, "
                         "deploy restart --rolling one at a time)"),
    "model": Field(Map({
        "path": Field(Str(**ABS_PATH), required=True, doc="target model directory in the container"),
        **FETCH_FIELDS,
    }), required=True),
    "runtime": _defaulted(Map({
        "python": Field(Str(**ABS_PATH), default=DEFAULT_PYTHON, doc="the Python that runs vLLM"),
        "vllm": Field(Str(**ABS_PATH), default="/root/ml-env/bin/vllm"),
        "state_dir": Field(Str(**ABS_PATH), default=DEFAULT_STATE_DIR),
    })),
    "serve": Field(Map({
        "host": Field(Str(**HOSTNAME), default="0.0.0.0"),
        "port": Field(Int(1, 65535), default=8000),
        "tensor_parallel_size": Field(Int(1, 64), default=1),
        "gpu_memory_utilization": Field(Float(0.05, 0.99), default=0.9),
        "max_model_len": Field(Int(16, 10_000_000)),
        "served_model_name": Field(Str(**SERVED_NAME), required=True),
        "attention_backend": Field(Str(choices=("flash_attn", "flashinfer", "triton_attn", "flex_attention"))),
        "max_num_batched_tokens": Field(Int(1, 10_000_000)),
        "extra_args": Field(List(Str(), max_len=100), default=list),
        "env": Field(FreeMap(ENV_KEY, "environment variable names are A-Z, 0-9, _"), default=dict),
        "api_key_env": Field(Str(pattern=ENV_KEY, pattern_hint="an environment variable name"),
                             doc="name of a LOCAL environment variable holding the API key (never in argv)"),
        "secret_env": Field(FreeMap(ENV_KEY, "environment variable names are A-Z, 0-9, _",
                                    value=Str(pattern=ENV_KEY, pattern_hint="a LOCAL environment variable name")),
                            default=dict, doc="secrets for vLLM's environment, by reference: NAME_IN_CONTAINER: "
                                              "LOCAL_VARIABLE; the value travels on stdin, never in argv"),
        "trust_remote_code": Field(Bool(), default=False,
                                   doc="allow code named by the drafter config (auto_map) to run, in verify and "
                                       "in vLLM (--trust-remote-code)"),
        "load_timeout_s": Field(Float(1, 7200), default=900.0),
    }), required=True),
    "speculative": Field(Map({
        "method": Field(Str(validate=_method), required=True),
        "num_speculative_tokens": Field(Int(1, 64), required=True),
        "drafter": Field(DRAFTER),
        "extra": Field(FreeMap(r"[a-z_]{1,64}", "lowercase spec-config keys", value=Str()), default=dict),
        "schedule": Field(List(List(Int(0, 4096), min_len=3, max_len=3), min_len=1, max_len=64),
                          doc="k by batch size (vLLM >= 0.27: num_speculative_tokens_per_batch_size): [[FIRST, LAST, "
                              "K], ...], inclusive batch-size ranges, the first from 1, K <= num_speculative_tokens, "
                              "0 = no drafts there (deploy tune writes it)"),
    }), required=True),
    "tune": _defaulted(Map({
        "expected_concurrency": Field(Int(1, 4096), default=1,
                                      doc="the concurrent requests this deployment usually serves: where vLLM has no "
                                          "batch-size schedule, deploy tune chooses the k that wins here"),
    }), doc="deploy tune (docs/playbooks.md#tune)"),
    "requires": _defaulted(Map({
        "vllm": Field(Str(validate=_vllm_source),
                      doc="the vLLM deploy install-vllm installs: a version, git+https://...@BRANCH, a wheel URL or a "
                          "wheel path in the container"),
        "vllm_min_version": Field(Str(**VERSION)),
        "fixes": Field(List(Str(choices=KNOWN_FIXES), unique=True), default=list),
        "install": _defaulted(Map({
            "timeout_s": Field(Float(1, 172800), default=3600.0,
                               doc="the build's limit; reaching it is 'build not finished', never success"),
            "installer": Field(Str(choices=("auto", "uv", "pip")), default="auto",
                               doc="auto: uv when the container has it, else pip"),
            "python": Field(Str(**ABS_PATH), doc="the Python the new venv is made from (default: the runtime's "
                                                 "base Python, or /usr/bin/python3 when there is no runtime yet)"),
            **_package_sources("pip/uv"),
            "heartbeat_s": Field(Float(1, 3600), default=30.0, doc="a progress line at least this often"),
            "hashes": Field(List(Str(pattern=r"sha256:[0-9a-f]{64}", pattern_hint="sha256:<64 lowercase hex digits>"),
                                 max_len=50),
                            default=list, doc="pin the vLLM artifact: pip/uv --require-hashes (then every "
                                              "dependency needs a pinned hash too: pip's rule)"),
            "allow_insecure": Field(Bool(), default=False,
                                    doc="accept plain http:// (and git+http://) sources; refused otherwise"),
        })),
    })),
    "fetch": _defaulted(Map({
        "connections": Field(Int(1, 64), default=8,
                             doc="at most this many connections at once: several files together, and a large file "
                                 "in byte ranges over several connections (a CDN caps each connection, not the "
                                 "link); 1: one stream"),
        "range_mib": Field(Int(1, 65536), default=64,
                           doc="a file larger than this many MiB comes in ranges of this size, each resumable"),
        "store": Field(Str(pattern=r"/[A-Za-z0-9._+/-]{1,400}", pattern_hint="an absolute directory on the "
                                                                             "Proxmox host (letters, digits, . _ + - /)"),
                       doc="a directory on the Proxmox host: each hub revision is fetched there once per host and "
                           "every container on it reads it read-only through a mount point "
                           "(docs/playbooks.md#store-one-copy-per-host)"),
        "mount": Field(Str(pattern=r"/[A-Za-z0-9._+/-]{1,400}", pattern_hint="an absolute path in the container"),
                       default="/models", doc="where the containers see the store (mpN: STORE,mp=MOUNT,ro=1)"),
    }), doc="how deploy fetch (and up's fetch step) downloads from the hub "
            "(docs/playbooks.md#connections-and-ranges-fetch)"),
    "gpu": _defaulted(Map({
        "free_threshold_mib": Field(Int(0, 1_000_000), default=1024),
        "free_timeout_s": Field(Float(0.5, 3600), default=60.0),
        "stop_grace_s": Field(Float(0, 3600), default=30.0),
        "clean_gpus": Field(Bool(), default=False, doc="fuser -k the container's /dev/nvidia* when stopping"),
        "nvidia_smi_timeout_s": Field(Float(0.5, 120), default=10.0),
    })),
    "supervise": _defaulted(Map({
        "restart_sec": Field(Float(0.1, 3600), default=5.0,
                             doc="systemd RestartSec: wait before restarting a crashed server"),
        "start_limit_burst": Field(Int(1, 100), default=3,
                                   doc="systemd StartLimitBurst: at most this many starts within the interval"),
        "start_limit_interval_s": Field(Float(1, 86400), default=600.0,
                                        doc="systemd StartLimitIntervalSec: the window the burst is counted in"),
    }), doc="where the container runs systemd: how vllm-PLAYBOOK.service restarts a crashed server"),
    "acceptance": _defaulted(Map({
        "min_mean_acceptance_length": Field(Float(1, 100), doc="the gate's mean acceptance length (AL) threshold; "
                                            "default 1 + 0.4 * min(k, 3): 1.4 for k=1, 1.8 for k=2, 2.2 for k>=3"),
        "min_first_position": Field(Float(0, 1), doc="acceptance at draft position 0 (default 0.5)"),
        "cliff_check": Field(Bool(), default=True, doc="fail when the per-position curve falls off a cliff (positions "
                             "from some p on all ~0): sliding layers run as full attention, or a missing window"),
        "min_drafts": Field(Int(0, 10_000_000), doc="drafts the probe must produce for a verdict (default 100); "
                            "fewer: the probe runs more rounds, up to probe.max_rounds"),
        "min_draft_acceptance": Field(Float(0, 1), doc="optional: ALSO require this draft acceptance rate (the old gate; "
                                      "the rate falls as k grows: healthy DFlash at k=15 shows 15-19 %)"),
        "probe": _defaulted(Map({
            "prompts": Field(List(Str(), min_len=1, max_len=64), doc="the probe's prompts (default: the shipped "
                             "natural-text set: chat, code, math)"),
            "prompts_file": Field(Str(), doc="a file of prompts, one per line (# comments and blank lines skipped), "
                                  "relative to the playbook"),
            "max_tokens": Field(Int(1, 8192), default=128),
            "rounds": Field(Int(1, 100), default=1),
            "max_rounds": Field(Int(1, 100), doc="more rounds while the drafts are fewer than min_drafts (default "
                                "4 x rounds), within timeout_s"),
            "timeout_s": Field(Float(1, 3600), default=120.0),
        }), skip_none=True),
        "on_low_acceptance": Field(Str(choices=("fail", "fallback")), default="fail"),
        "fallback": Field(Str(**NAME), doc="playbook to bring up instead when acceptance is too low"),
    }), skip_none=True),
    "sizing": _defaulted(Map({
        "accept_tight": Field(Bool(), default=False,
                              doc="silence the 'tight' warning of the sizing model (never a certain does-not-fit)"),
        "gpu_total_mib": Field(Int(256, 10_000_000), doc="each GPU's total memory as nvidia-smi reports it (MiB); "
                               "default: an 80 GB GPU, 81559 MiB, said to be assumed"),
        "target_config": Field(Str(), doc="a local copy of the target's config.json (or a directory with it and, "
                               "optionally, the safetensors), relative to the playbook: what `deploy size` and "
                               "`deploy plan` size the deployment from"),
    }), doc="Will it fit? (docs/playbooks.md#will-it-fit): the inputs of the sizing model beyond serve/speculative"),
    "router": Field(ROUTER, doc="with targets: vLLM Router (vllm-router) in front of the replicas, in one "
                                "container: one URL for the fleet (deploy endpoint); drained replicas during "
                                "restart --rolling. See docs/router.md"),
}, one_of=(("target", "targets"),))



SCHEMA_ID = "https://vllm-pve-deploy.invalid/schemas/%s.schema.json"  # an identifier, never fetched


def json_schema(kind: str) -> dict:
    """The JSON Schema of a playbook or the inventory, generated from the validator's own schema (one source).
    It covers shapes, types, ranges, patterns and unknown keys; cross-checks (the target in the inventory, the
    pinned config's sha256, ...) stay with `deploy plan`, which reports every problem with FILE:LINE:COL."""
    root = {"playbook": PLAYBOOK, "inventory": INVENTORY}[kind]
    title = {"playbook": "vllm-pve-deploy playbook", "inventory": "vllm-pve-deploy inventory (hosts.yaml)"}[kind]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID % kind, "title": title,
            "description": "generated by `deploy schema %s`; see docs/playbooks.md" % kind, **root.json_schema()}
