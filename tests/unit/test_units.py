"""Pure units: quoting, the planner, parsers of remote output, acceptance arithmetic."""

import dataclasses
import json
import os
import shlex
import subprocess

import pytest

from orchestrator.steps import plan as P
from orchestrator.core import vllm_facts as vf
from orchestrator.core.facts import parse_pct_config_gpus, parse_pct_list, parse_pct_status
from orchestrator.core.remote import pct_exec_argv, shell_join
from orchestrator.core.spec import load_inventory, load_playbook

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTILE = ["it's", 'say "hi"', "$(touch /tmp/pwned)", "`id`", "a; rm -rf /", "x && y", "line1\nline2", "*",
           "?[a]", "ünïcødé ✓", "", " lead", "trail ", "$HOME", "\\", "-n", "--", "a'b\"c"]


def test_shell_join_round_trips_through_a_real_shell():
    out = subprocess.run(["bash", "-c", shell_join(["printf", "%s\\0"] + HOSTILE)], capture_output=True, check=True)
    assert out.stdout.split(b"\0")[:-1] == [h.encode() for h in HOSTILE]
    assert shlex.split(shell_join(HOSTILE)) == HOSTILE


def test_pct_exec_argv_keeps_the_program_after_double_dash():
    assert pct_exec_argv(129, ["python3", "-", "x"]) == ["pct", "exec", "129", "--keep-env", "0", "--",
                                                         "python3", "-", "x"]
    old = pct_exec_argv(129, ["true"], keep_env=False)
    assert old[:4] == ["pct", "exec", "129", "--"] and old[4:6] == ["env", "-i"] and old[-1] == "true"


@pytest.fixture
def pbs(tmp_path):
    (tmp_path / "hosts.yaml").write_text("hosts:\n  - name: pve1\n    address: 127.77.0.1\n    containers:\n"
                                         "      - vmid: 129\n        gpus: [0, 1, 2, 3]\n")
    inv = load_inventory(str(tmp_path / "hosts.yaml"))
    return inv, load_playbook(os.path.join(REPO, "playbooks", "qwen36-dflash.yaml"), inv), \
        load_playbook(os.path.join(REPO, "playbooks", "qwen36-mtp.yaml"), inv)


def test_plan_up_order_and_commands(pbs):
    inv, dflash, mtp = pbs
    plan = P.plan_up(dflash)
    names = [s.name for s in plan]
    assert names == ["container", "lock", "current", "drafter-config", "verify", "gpu-plumbing", "stop", "gpus-free",
                     "port-free",
                     "launch", "onboot", "wait-ready", "aux-layers", "drift", "acceptance", "gate-record",  # main
                     "acceptance", "gate-record",  # the same deployment runs, never gated: gate it now
                     "stop-low", "fallback",  # on low acceptance (the playbook falls back to qwen36-mtp)
                     "stop-failed", "drift-check", "read-back", "note-failure",  # on failure
                     "unlock"]  # finally
    assert [s.phase for s in plan][-9:] == ["gate-running"] * 2 + ["on-low-acceptance"] * 2 + ["on-failure"] * 4 + \
        ["finally"]
    fb = next(s for s in plan if s.name == "fallback")
    assert [s.name for s in fb.sub] == ["current", "verify", "gpu-plumbing", "stop", "gpus-free", "port-free", "launch",
                                        "onboot", "wait-ready", "acceptance", "gate-record", "acceptance", "gate-record",
                                        "stop-failed", "note-failure"]
    assert all(s.playbook == "qwen36-mtp" for s in fb.sub)
    assert [s.name for s in P.plan_up(mtp) if s.phase == "main"] == \
        [n for n in names[:16] if n not in ("drafter-config", "drift", "aux-layers")]
    assert P.plan_up(dflash) == P.plan_up(dflash)  # pure: same input, same plan
    rows = [s.as_dict(inv, "/root/ml-env/bin/python") for s in plan]
    assert rows[0]["command"] == "pct status 129" and rows[0]["ssh"] == "ssh -p 22 root@127.77.0.1"
    assert next(r for r in rows if r["step"] == "onboot")["command"] == "pct config 129"  # a host command
    remote = [r for r in rows[1:] if r["command"] and r["step"] != "onboot"]
    assert all(r["command"].startswith("pct exec 129 --keep-env 0 -- /root/ml-env/bin/python - ") for r in remote)
    assert all(r["request"] == r["command"].split(" - ", 1)[1] for r in remote)  # the session request = the same
    assert [r["step"] for r in rows if not r["command"]] == ["aux-layers", "fallback"]  # local checks


def test_plan_shows_what_each_step_runs(pbs):
    """An operator reviewing the plan sees the shell each step amounts to, and the conditions as the code has them."""
    inv, dflash, _ = pbs
    text = json.dumps([s.as_dict(inv, "py") for s in P.plan_up(dflash, clean_gpus=True)])
    for needle in ("nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits",
                   "fuser -k -TERM /dev/nvidia0 /dev/nvidia1 /dev/nvidia2 /dev/nvidia3",
                   "fuser -k -KILL /dev/nvidia0", "pct list; pct config VMID", "kill -TERM -PGID",
                   "setsid env -i NO_COLOR=1 HF_HUB_OFFLINE=1 SPT_NOENV=1 CUDA_VISIBLE_DEVICES=0,1,2,3",
                   "--speculative-config", "sha256sum /root/models/Qwen3.6-27B-DFlash/config.json",
                   "vLLM processes deploy did not start"):
        assert needle in text, needle
    stop = next(s for s in P.plan_up(dflash) if s.name == "stop")
    # the `when` is the predicate the executor evaluates: its text cannot disagree with the code
    assert stop.when is P.something_to_stop and "unhealthy" in P.describe_when(stop.when)
    assert stop.when(P.RunState(foreign_vllm=True)) and not stop.when(P.RunState())
    assert next(s for s in P.plan_up(dflash, restart=True) if s.name == "stop").when is None
    # fuser only when asked (or the playbook's gpu.clean_gpus): never in the default plan
    assert "fuser -k" not in json.dumps([s.as_dict(inv, "py") for s in P.plan_up(dflash, clean_gpus=False)])


def test_serve_argv_dflash_and_mtp(pbs):
    _, dflash, mtp = pbs
    argv = P.serve_argv(dflash)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "/root/models/Qwen3.6-27B-DFlash", "num_speculative_tokens": 15}
    assert argv[argv.index("--attention-backend") + 1] == "flash_attn"
    assert "--max-num-batched-tokens" in argv
    m = P.serve_argv(mtp)
    assert json.loads(m[m.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 2}
    assert "--attention-backend" not in m
    env = P.serve_env(dflash)
    assert env == {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "SPT_NOENV": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_secrets_never_in_plan(pbs, monkeypatch):
    inv, dflash, _ = pbs
    dflash = dataclasses.replace(dflash, data=dict(dflash.data, serve=dict(dflash.data["serve"], api_key_env="MY_KEY")))
    monkeypatch.setenv("MY_KEY", "s3cr3t-value")
    text = json.dumps([s.as_dict(inv, "py") for s in P.plan_up(dflash)])
    assert "s3cr3t-value" not in text and "--api-key" not in text


def test_parse_pct_list_by_offsets():
    text = ("VMID       Status     Lock         Name                \n"
            "129        running                 vllm-qwen           \n"
            "130        stopped    backup       other               \n")
    assert parse_pct_list(text) == [{"vmid": 129, "status": "running", "lock": None, "name": "vllm-qwen"},
                                    {"vmid": 130, "status": "stopped", "lock": "backup", "name": "other"}]
    assert parse_pct_list("") == []
    assert parse_pct_status("status: running\n") == "running"
    with pytest.raises(ValueError):
        parse_pct_status("running")
    assert parse_pct_config_gpus("arch: amd64\ndev0: /dev/nvidia0\ndev1: /dev/nvidia2,gid=44\n"
                                 "lxc.mount.entry: /dev/nvidia3 dev/nvidia3 none bind,optional,create=file\n"
                                 "dev5: /dev/nvidiactl\n") == [0, 2, 3]
    # a snapshot's GPUs are not the container's (pct config prints the current config first)
    assert parse_pct_config_gpus("dev0: /dev/nvidia1\n\n[before-upgrade]\ndev0: /dev/nvidia0\n") == [1]


def metrics(drafts, tokens, accepted, per_pos, engines=("0",)):
    lines = []
    for name, val in (("vllm:spec_decode_num_drafts_total", drafts), ("vllm:spec_decode_num_draft_tokens_total", tokens),
                      ("vllm:spec_decode_num_accepted_tokens_total", accepted)):
        lines.append(f"# TYPE {name[:-6]} counter")
        for e in engines:
            lines.append(f'{name}{{engine="{e}",model_name="qwen36"}} {val}')
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
    for e in engines:
        for p, v in enumerate(per_pos):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="qwen36",'
                         f'position="{p}"}} {v}')
    return "\n".join(lines) + "\n"


def test_acceptance_from_metric_deltas_summed_over_engines():
    before = metrics(10, 150, 60, [8, 6] + [0] * 13, engines=("0", "1"))
    after = metrics(110, 1650, 720, [88, 66] + [0] * 13, engines=("0", "1"))
    a = vf.acceptance_from_metrics(before, after)
    # per engine: 100 drafts, 1500 draft tokens, 660 accepted -> summed: 200, 3000, 1320
    assert a.drafts == 200 and a.draft_tokens == 3000 and a.accepted == 1320
    assert a.draft_acceptance == pytest.approx(0.44)
    assert a.mean_acceptance_length == pytest.approx(1 + 1320 / 200)
    assert a.per_position[:2] == [pytest.approx(160 / 200), pytest.approx(120 / 200)]


def test_acceptance_absent_without_spec_metrics():
    assert vf.acceptance_from_metrics("", "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n") is None


def test_acceptance_from_log_line_with_commas():
    line = ("INFO 12-03 11:00:00 [metrics.py:1] SpecDecoding metrics: Mean acceptance length: 4.12, Accepted "
            "throughput: 10.0 tokens/s, Drafted throughput: 40.0 tokens/s, Accepted: 3106 tokens, Drafted: 11302 "
            "tokens, Per-position acceptance rate: 0.812, 0.655, 0.500, Avg Draft acceptance rate: 27.5%")
    a = vf.acceptance_from_log(["noise", line])
    assert a.source == "log" and a.draft_acceptance == pytest.approx(0.275)
    assert a.mean_acceptance_length == pytest.approx(4.12) and a.per_position == [0.812, 0.655, 0.5]


def test_expected_aux_layers():
    assert vf.expected_aux_layers([1, 16, 31, 46, 61]) == [2, 17, 32, 47, 62]


def test_agent_parses_with_old_pythons():
    """The agent runs on the container's own Python, which may be older than ours."""
    import ast

    d = os.path.join(REPO, "orchestrator", "agent", "container")
    for name in sorted(os.listdir(d)):
        if name.endswith(".py"):
            ast.parse(open(os.path.join(d, name)).read(), filename=name, feature_version=(3, 7))
    from orchestrator.agent.container.cache import BOOT

    ast.parse(BOOT, feature_version=(3, 7))


def test_the_state_directory_has_one_spelling_each_side():
    """runtime.state_dir's default: spec.py's for the tool, protocol.py's for the agent (which cannot import the
    tool's modules), and they agree; the other modules take theirs from these two."""
    from orchestrator.hosts import discover
    from orchestrator.core import spec
    from orchestrator.agent import archive
    from orchestrator.agent.container import protocol

    assert spec.DEFAULT_STATE_DIR == protocol.DEFAULT_STATE_DIR == "/var/lib/vllm-pve-deploy"
    assert discover.DEFAULT_STATE_DIR is spec.DEFAULT_STATE_DIR
    assert archive.DEFAULT_STATE_DIR is protocol.DEFAULT_STATE_DIR
