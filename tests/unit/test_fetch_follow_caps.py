"""issue 36 item 2: a forged fetch that never ends and floods output is cut off with a clear error."""
from types import SimpleNamespace

import pytest

from orchestrator.provision import weights_fetch as fetch
from orchestrator.core import report


class Progress:
    def __init__(self):
        self.out = 0

    def say(self, where, msg):
        self.out += len(msg)

    detail = say


class Runner:
    def __init__(self):
        self.calls = 0

    def call(self, name, timeout=None, on_event=None, **fill):
        self.calls += 1
        assert self.calls < 500, "still following a flood"
        for _ in range(200):
            on_event({"event": "fetch", "kind": "line", "line": "x" * 100_000})
            on_event({"event": "fetch", "kind": "line", "line": "[deploy] " + "y" * 100_000})
        return {"ok": True, "done": False, "log_pos": self.calls}


def test_follow_stops_after_the_total_cap():
    ctx = SimpleNamespace(progress=Progress(), where="pve1/1")
    pb = SimpleNamespace(name="p", runtime={"state_dir": "/x"})
    r = Runner()
    with pytest.raises(Exception) as e:
        fetch._follow(ctx, r, pb, {"id": "a", "pid": 1}, 6 * 3600, "fetch")
    assert "more fetch output" in str(getattr(e.value, "message", e.value)) or "more fetch output" in repr(e.value.__dict__)
    assert ctx.progress.out <= report.FOLLOW_MAX_BYTES + 10 * report.FOLLOW_LINE_MAX
    assert r.calls < 100


class InstallRunner(Runner):
    def call(self, name, timeout=None, on_event=None, **fill):
        self.calls += 1
        assert self.calls < 500, "still following a flood"
        for i in range(200):
            on_event({"event": "install", "kind": "line", "line": "Successfully installed " + "x" * 100_000})
            on_event({"event": "install", "kind": "heartbeat", "elapsed": "odd", "phase": ["x"], "last": "z" * 10**5})
            on_event({"event": "install", "kind": "phase", "elapsed": None, "phase": "p" * 10_000})
            on_event(["not", "an", "event"])
        return {"ok": True, "done": False, "log_pos": self.calls}


def test_install_follow_stops_after_the_same_total_cap_and_ignores_odd_fields():
    """The install-vllm follow (issue 36 item 2, install part): the same total caps, then a clear error."""
    from orchestrator.provision import vllm_install as install

    r = InstallRunner()
    ctx = SimpleNamespace(progress=Progress(), where="pve1/1")
    r.ctx = ctx
    pb = SimpleNamespace(name="p", conf=SimpleNamespace(requires=SimpleNamespace(install=SimpleNamespace(
        timeout_s=6 * 3600, heartbeat_s=2))))
    with pytest.raises(install.InstallFailed) as e:
        install._follow(ctx, r, pb, {"id": "a", "pid": 1})  # the planned attach call
    assert "more install output than deploy follows" in e.value.message
    assert ctx.progress.out <= report.FOLLOW_MAX_BYTES + 10 * report.FOLLOW_LINE_MAX
    assert r.calls < 100
