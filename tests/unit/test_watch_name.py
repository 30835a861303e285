"""issue 36 item 6: a playbook name from the container's state is a name, never a workstation path."""
import os

from orchestrator.observe import status_render


def test_gate_of_refuses_a_path_name(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(status_render, "load_playbook", lambda n, inv, **k: opened.append(n))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cache = {}
    for bad in [str(fifo), "../x", "/dev/tty", "a/b", ["x"], 7, "X" * 70]:
        assert status_render.gate_of(None, bad, cache) is None
    assert opened == []


def test_gate_of_only_looks_among_the_users_playbooks(monkeypatch):
    opened = []
    monkeypatch.setattr(status_render, "list_playbooks", lambda: ["mine"])
    monkeypatch.setattr(status_render, "load_playbook", lambda n, inv, **k: opened.append(n))
    assert status_render.gate_of(None, "notmine", {}) is None
    assert opened == []
