"""Issue 22 on the workstation side: what a hostile container answers cannot choose a secret, crash deploy, or
write to the operator's terminal. The container is faked at the agent edge (its answers are the input here)."""

import types

import pytest

from orchestrator import status


class _Redact:
    def add(self, s):
        pass


INVENTORY = """hosts:
  - name: pve1
    address: 127.0.0.1
    containers:
      - vmid: 129
        name: vllm-qwen
        gpus: [0]
"""


class _Fleet:
    redact = _Redact()

    def __init__(self, inventory):
        self.inventory = inventory

    def session(self, host):
        return None


@pytest.fixture
def inv(tmp_path, monkeypatch):
    from orchestrator.spec import load_inventory

    (tmp_path / "hosts.yaml").write_text(INVENTORY)
    monkeypatch.setenv("DEPLOY_PLAYBOOKS", str(tmp_path / "playbooks"))
    return load_inventory(str(tmp_path / "hosts.yaml"))


def test_a_forged_state_file_does_not_choose_which_local_secret_is_sent(monkeypatch, inv):
    """state.json's api_key_env named a workstation variable; a plain status sent that variable's value."""
    monkeypatch.setenv("VPD_WORKSTATION_SECRET", "ws-secret-5551234")
    sent = []

    def call(session, vmid, python, action, args, **kw):
        sent.append(kw.get("secrets"))
        return {"state": {"playbook": "evil", "api_key_env": "VPD_WORKSTATION_SECRET", "alive": True, "pid": 7,
                          "port": 8000, "served_model_name": "x"}, "models_status": 401, "health": 200,
                "memory": {"gpus": {}}}

    monkeypatch.setattr(status.agent, "call", call)
    row = status.container_row(_Fleet(inv), "pve1", 129, {"python": "/root/ml-env/bin/python"},
                               status.Sampler(persist=False), 1.0)
    assert sent == [None], sent  # one request, and no secret in it
    assert not row["healthy"] and "VPD_WORKSTATION_SECRET" not in " ".join(row["problems"])
