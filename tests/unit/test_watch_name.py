"""issue 36 item 6: a playbook name from the container's state is a name, never a workstation path."""
import os

from orchestrator import status


def test_gate_of_refuses_a_path_name(tmp_path, monkeypatch):
    opened = []
    import orchestrator.spec as spec
    monkeypatch.setattr(spec, "load_playbook", lambda n, inv, **k: opened.append(n))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cache = {}
    for bad in [str(fifo), "../x", "/dev/tty", "a/b", ["x"], 7, "X" * 70]:
        assert status.gate_of(None, bad, cache) is None
    assert opened == []


def test_gate_of_only_looks_among_the_users_playbooks(monkeypatch):
    import orchestrator.spec as spec
    opened = []
    monkeypatch.setattr(spec, "list_playbooks", lambda: ["mine"])
    monkeypatch.setattr(spec, "load_playbook", lambda n, inv, **k: opened.append(n))
    assert status.gate_of(None, "notmine", {}) is None
    assert opened == []
