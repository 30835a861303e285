"""`targets:` (replicas): validation of every target against the inventory (every problem at once, with its line),
the per-target playbooks, the JSON Schema, and the fleet summary. Nothing remote runs."""

import pytest

from orchestrator.serving import fleet as F
from orchestrator.deploy import ops
from orchestrator.core.errors import SpecError, Unreachable, UsageError
from orchestrator.core.spec import load_inventory, load_playbook
from orchestrator.core.spec_schema import json_schema
from orchestrator.steps import StepFailed
from playbook_support import ONE_TARGET as ONE, playbook_variant, playbook_work

INVENTORY = """\
hosts:
  - name: pve1
    address: 127.77.0.1
    containers:
      - {vmid: 129, gpus: [0, 1, 2, 3]}
  - name: pve2
    address: 127.77.0.2
    containers:
      - {vmid: 129, gpus: [0, 1, 2, 3], runtime: {python: /opt/vllm/bin/python}}
"""


@pytest.fixture
def work(tmp_path):
    return playbook_work(tmp_path, INVENTORY)


def fleet_file(work, name, targets_yaml, base="qwen36-mtp"):
    return playbook_variant(work / "playbooks", name, targets_yaml, base)


def load(work, path):
    return load_playbook(path, load_inventory(str(work / "hosts.yaml")))


def test_targets_give_one_playbook_per_target(work):
    path = fleet_file(work, "reps", "targets:\n  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n"
                                    "  - {host: pve2, vmid: 129, gpus: [0, 1, 2, 3]}\n")
    pb = load(work, path)
    assert pb.is_fleet and pb.where == "pve1/129, pve2/129"
    assert [(m.host, m.vmid, m.gpus) for m in pb.members] == [("pve1", 129, [0, 1, 2, 3]), ("pve2", 129, [0, 1, 2, 3])]
    # each target's runtime: the inventory's for that container, else the defaults
    assert [m.conf.runtime.python for m in pb.members] == ["/root/ml-env/bin/python", "/opt/vllm/bin/python"]
    assert [m.runtime_source for m in pb.members] == ["default", "inventory"]
    assert pb.member("pve2/129") is pb.members[1]
    with pytest.raises(UsageError) as ei:
        pb.host  # a command that acts on one container refuses, naming the targets
    assert "reps has 2 targets (pve1/129, pve2/129)" in ei.value.message
    with pytest.raises(UsageError):
        pb.member("pve3/129")


def test_a_fleet_with_a_fallback_retargets_it_per_target(work):
    path = fleet_file(work, "reps-dflash", "targets:\n  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n"
                                           "  - {host: pve2, vmid: 129, gpus: [0, 1, 2, 3]}\n", base="qwen36-dflash")
    pb = load(work, path)
    assert [(m.fallback.name, m.fallback.host, m.fallback.vmid) for m in pb.members] == [
        ("qwen36-mtp", "pve1", 129), ("qwen36-mtp", "pve2", 129)]
    assert pb.members[1].fallback.conf.runtime.python == "/opt/vllm/bin/python"


def test_a_single_target_playbook_refuses_a_replica_fallback(work):
    fleet_file(work, "qwen36-mtp", "targets:\n  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n")
    with pytest.raises(SpecError) as ei:
        load(work, str(work / "playbooks" / "qwen36-dflash.yaml"))
    assert any("acceptance.fallback: 'qwen36-mtp' has targets: (replicas), but the fallback runs on this "
               "playbook's one container" in p for p in ei.value.problems)


def test_every_target_problem_at_once_with_its_line(work):
    path = fleet_file(work, "bad", "targets:\n"
                                   "  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n"
                                   "  - {host: pve9, vmid: 129, gpus: [0, 1, 2, 3]}\n"
                                   "  - {host: pve2, vmid: 131, gpus: [0, 1, 2, 3]}\n"
                                   "  - {host: pve1, vmid: 129, gpus: [0, 1]}\n")
    with pytest.raises(SpecError) as ei:
        load(work, path)
    probs = ei.value.problems
    line = next(i for i, ln in enumerate(open(path).read().splitlines(), 1) if ln.startswith("targets:"))
    assert any(p.startswith(f"{path}:{line + 2}:") and "targets[1].host: unknown host 'pve9'" in p for p in probs)
    assert any(p.startswith(f"{path}:{line + 3}:") and "targets[2].vmid: host 'pve2' has no container 131" in p
               for p in probs)
    assert any(f"{path}:{line + 4}:" in p and "targets[3]: pve1/129 is already targets[0]" in p for p in probs)
    assert any(f"{path}:{line + 4}:" in p and "targets[3].gpus: 2 GPU(s), fewer than serve.tensor_parallel_size 4"
               in p for p in probs)
    assert len(probs) == 4


def test_target_and_targets_exactly_one(work):
    both = fleet_file(work, "both", ONE + "targets:\n  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n")
    with pytest.raises(SpecError) as ei:
        load(work, both)
    assert any("targets: give exactly one of 'target' or 'targets', not both" in p for p in ei.value.problems)
    neither = fleet_file(work, "neither", "")
    with pytest.raises(SpecError) as ei:
        load(work, neither)
    assert any("target: required key is missing: give 'target' or 'targets'" in p for p in ei.value.problems)
    empty = fleet_file(work, "empty", "targets: []\n")
    with pytest.raises(SpecError) as ei:
        load(work, empty)
    assert any("targets" in p for p in ei.value.problems)


def test_json_schema_one_of_target_or_targets():
    s = json_schema("playbook")
    assert s["oneOf"] == [{"required": ["target"]}, {"required": ["targets"]}]
    assert "target" not in s.get("required", []) and s["properties"]["targets"]["type"] == "array"
    one = {k: v for k, v in s["properties"]["target"].items() if k != "description"}
    assert s["properties"]["targets"]["items"] == one and one["required"] == ["host", "vmid", "gpus"]


def _out(where, ok, status, error=None, info=None):
    return ops.Outcome(ok, "reps", where, status, error=error, info=info or {})


class _M:
    def __init__(self, where):
        self.host, vmid = where.split("/")
        self.vmid = int(vmid)


class _PB:
    name = "reps"
    members = [_M("pve1/129"), _M("pve2/129"), _M("pve3/129")]


def test_summary_and_exit_codes():
    outs = [_out("pve1/129", True, "up", info={"acceptance": {"draft_acceptance_rate": 0.5,
                                                               "mean_acceptance_length": 2.0}, "total_s": 3.1}),
            _out("pve2/129", False, "failed", StepFailed("wait-ready", "vLLM failed to start: CUDA out of memory\nx",
                                                         where="pve2/129")),
            None]
    res = F.result(_PB, "rolling restart", outs, 0.0)
    res["rollout"] = {"new": ["pve1/129"], "failed": ["pve2/129"], "old": ["pve3/129"]}
    lines = F.render(res)
    assert lines[0].split()[:2] == ["pve1/129", "up"] and "draft acceptance 50.0%" in lines[0]
    assert lines[1].split()[:2] == ["pve2/129", "FAILED"] and lines[1].endswith("CUDA out of memory")
    assert lines[2].startswith("pve3/129       not restarted  still on the old deployment")
    assert lines[3].startswith("reps: 1 of 3 target(s) restarted; FAILED: pve2/129")
    assert "  still on the old deployment:       pve3/129" in lines
    assert F.exit_code(res) == 1
    assert [t["ok"] for t in F.as_json(res)["targets"]] == [True, False, None]
    lost = F.result(_PB, "up", [_out(w, False, "failed", Unreachable("down", where=w))
                                for w in ("pve1/129", "pve2/129", "pve3/129")], 0.0)
    assert F.exit_code(lost) == 3
    assert F.exit_code(F.result(_PB, "up", [_out(w, True, "already up") for w in ("a/1", "b/1", "c/1")], 0.0)) == 0


def test_one_parser_of_host_and_container_targets(work):
    """Inventory.named: HOST -> its containers, HOST/VMID -> that one (a usage error when the inventory has none),
    anything else None; status dials the hosts of such targets before it reads any playbook, and none otherwise."""
    from orchestrator.cli.serving import _hosts_named

    inv = load_inventory(str(work / "hosts.yaml"))
    assert [(h, c.vmid) for h, c in inv.named("pve2")] == [("pve2", 129)]
    assert [(h, c.vmid) for h, c in inv.named("pve1/129")] == [("pve1", 129)]
    assert inv.named("qwen36-dflash") is None and inv.named("pve1/x") is None
    for bad in ("pve1/130", "pve9/129"):
        with pytest.raises(UsageError, match=f"no container {bad} in inventory"):
            inv.named(bad)
    assert _hosts_named(inv, []) == ["pve1", "pve2"]
    assert _hosts_named(inv, ["pve2/129"]) == ["pve2"]
    assert _hosts_named(inv, ["pve2", "pve1/129"]) == ["pve1", "pve2"]
    assert _hosts_named(inv, ["pve2", "qwen36-dflash"]) == [] == _hosts_named(inv, ["pve1/130"])
