"""`router:` (issue 29): validation against the inventory (a container, never a Proxmox host; replicas reachable
by address; no port clash), the router's argv, the status flags, the JSON Schema. Nothing remote runs."""

import pytest

from orchestrator.serving import replica_router as R
from orchestrator.core.endpoint import router_endpoint
from orchestrator.core.errors import SpecError
from orchestrator.core.spec import load_inventory, load_playbook
from orchestrator.core.spec_schema import json_schema
from playbook_support import ONE_TARGET as ONE, playbook_variant, playbook_work

INVENTORY = """\
hosts:
  - name: pve1
    address: 127.77.0.1
    containers:
      - {vmid: 129, gpus: [0, 1, 2, 3], address: 10.0.0.11}
      - {vmid: 130, gpus: [], address: 10.0.0.10}
  - name: pve2
    address: 127.77.0.2
    containers:
      - {vmid: 129, gpus: [0, 1, 2, 3], address: 10.0.0.12}
      - {vmid: 131, gpus: [0, 1, 2, 3]}
"""

TWO = "targets:\n  - {host: pve1, vmid: 129, gpus: [0, 1, 2, 3]}\n  - {host: pve2, vmid: 129, gpus: [0, 1, 2, 3]}\n"


@pytest.fixture
def work(tmp_path):
    return playbook_work(tmp_path, INVENTORY)


def write(work, where_yaml, router_yaml, name="reps"):
    return playbook_variant(work / "playbooks", name, where_yaml, append=router_yaml)


def load(work, path):
    return load_playbook(path, load_inventory(str(work / "hosts.yaml")))


def problems(work, path):
    with pytest.raises(SpecError) as e:
        load(work, path)
    return "\n".join(e.value.problems)


def test_router_defaults_and_urls(work):
    pb = load(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n"))
    r = pb.conf.router
    assert (r.port, r.policy, r.version, r.listen, r.metrics_port) == (30000, "round_robin", "0.1.17", "0.0.0.0", 30001)
    inv = load_inventory(str(work / "hosts.yaml"))
    assert [R.replica_url(inv, pb, m) for m in pb.members] == ["http://10.0.0.11:8000", "http://10.0.0.12:8000"]
    args = R.router_argv_args(pb, ["http://10.0.0.11:8000", "http://10.0.0.12:8000"])
    assert args[:8] == ["--host", "0.0.0.0", "--port", "30000", "--worker-urls", "http://10.0.0.11:8000",
                        "http://10.0.0.12:8000", "--policy"]
    assert "--health-check-interval-secs" in args and "2" in args
    assert router_endpoint(inv, pb)["url"] == "http://10.0.0.10:30000/v1"


def test_router_refused_on_a_proxmox_host_and_without_targets(work):
    text = problems(work, write(work, TWO, "router:\n  host: pve1\n"))
    assert "router.vmid: required: the router runs in a container of host 'pve1', never on the Proxmox host" in text
    text = problems(work, write(work, ONE, "router:\n  host: pve1\n  vmid: 130\n", name="single"))
    assert "router: a router goes in front of replicas: use targets:" in text


def test_router_cross_checks(work):
    three = TWO + "  - {host: pve2, vmid: 131, gpus: [0, 1, 2, 3]}\n"
    text = problems(work, write(work, three, "router:\n  host: pve1\n  vmid: 999\n  policy: fastest\n"))
    assert "router.vmid: host 'pve1' has no container 999" in text
    assert "router.policy" in text and "fastest" in text
    # pve2/131 has no address: the router could not reach it
    assert "targets[2]: the router (in pve1/999) reaches this replica by address, and pve2/131 has none" in text
    assert "deploy discover pve2 --write" in text
    # the router in a replica's container, on the replica's port
    text = problems(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 129\n  port: 8000\n"))
    assert "router.port: 8000 (and 8001, its metrics) must not be serve.port 8000 of the replica in the same container (pve1/129)" in text


def test_router_loopback_replicas_refused(work):
    path = write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n")
    text = open(path).read().replace("  host: 0.0.0.0\n", "  host: 127.0.0.1\n", 1)
    if "  host: 127.0.0.1\n" not in text:
        text = text.replace("serve:\n", "serve:\n  host: 127.0.0.1\n", 1)
    open(path, "w").write(text)
    assert "serve.host: 127.0.0.1 listens only inside each container" in problems(work, path)


def test_router_flags_against_what_serves(work):
    pb = load(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n"))
    inv = load_inventory(str(work / "hosts.yaml"))
    view = {"running": True, "workers": [{"url": "http://10.0.0.11:8000", "healthy": True}]}
    assert R.compare(pb, inv, view, {"pve1/129", "pve2/129"}) == [
        "pve2/129 serves but is not in the router (deploy up reps adds it)"]
    view = {"running": True, "workers": [{"url": "http://10.0.0.11:8000", "healthy": False},
                                         {"url": "http://10.0.0.12:8000", "healthy": True}]}
    assert R.compare(pb, inv, view, {"pve2/129"}) == [
        "pve1/129 is in the router but does not serve (the router sees it unhealthy: it sends it nothing)"]


def test_an_open_circuit_is_flagged_although_the_router_calls_the_worker_healthy(work):
    """vllm-router #158 (issue 41): /workers says is_healthy while its circuit breaker is open and it sends that
    worker nothing; status reads the router's own gauge and says so, with what closes it."""
    pb = load(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n"))
    inv = load_inventory(str(work / "hosts.yaml"))
    view = {"running": True, "workers": [{"url": "http://10.0.0.11:8000", "healthy": True},
                                         {"url": "http://10.0.0.12:8000", "healthy": True}],
            "circuits": {"http://10.0.0.11:8000": "open", "http://10.0.0.12:8000": "closed",
                         "http://evil:1": "open"}}
    assert R.compare(pb, inv, view, {"pve1/129", "pve2/129"}) == [
        "pve1/129 serves and the router calls it healthy, but its circuit breaker is open: the router sends it "
        "nothing for up to 60 s (deploy up reps re-adds it, which closes it)"]


def test_a_router_open_to_anyone_is_warned_about_in_plan_and_up(work):
    """Issue 41: no API key and listen 0.0.0.0 (the default) -> a warning naming /add_worker and both ways to close
    it; a key, or a specific address, -> none."""
    pb = load(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n"))
    w = R.exposure_warning(pb)
    assert w.startswith("router pve1/130 listens on 0.0.0.0:30000 without an API key") and "/add_worker" in w
    assert "serve.api_key_env" in w and "router.listen" in w
    assert R.exposure_warning(load(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n  listen: 10.0.0.10\n",
                                                 name="reps2"))) is None
    keyed = write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n", name="reps3")
    text = open(keyed).read().replace("  load_timeout_s: 900", "  load_timeout_s: 900\n  api_key_env: VPD_K")
    open(keyed, "w").write(text)
    assert R.exposure_warning(load(work, keyed)) is None
    from click.testing import CliRunner
    from orchestrator.cli import main

    res = CliRunner().invoke(main, ["--inventory", str(work / "hosts.yaml"), "plan", str(work / "playbooks" / "reps.yaml")])
    assert "warning: router pve1/130 listens on 0.0.0.0:30000 without an API key" in res.output, res.output


def test_router_in_json_schema():
    s = json_schema("playbook")
    r = s["properties"]["router"]
    assert set(r["properties"]) >= {"host", "vmid", "listen", "port", "policy", "version", "install"}
    assert r["properties"]["policy"]["enum"][0] == "round_robin"


def test_a_forged_router_view_of_odd_shapes_is_read_without_a_traceback(work, monkeypatch):
    """Issue 36, Low: a worker list of non-objects, circuits of non-strings, a state that is not an object."""
    pb = load(work, write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n"))
    forged = {"installed": True, "running": True, "state": ["x"], "circuits": {"http://10.0.0.11:8000": 1, "u": "open"},
              "workers": [1, "x", None, {"url": 5}, {"url": "http://10.0.0.11:8000", "healthy": "yes"}]}
    monkeypatch.setattr(R, "call", lambda *a, **k: forged)
    v = R.view(None, pb)
    assert v["workers"] == [{"url": "http://10.0.0.11:8000", "healthy": False, "load": None}]
    assert v["circuits"] == {"u": "open"} and v["configured"] == [] and v["state"] == "no healthy replica"
    inv = load_inventory(str(work / "hosts.yaml"))
    assert R.compare(pb, inv, v, {"pve1/129"}) == ["pve1/129 serves but the router sees it unhealthy"]


def test_plain_restart_of_a_routed_fleet_warns_and_names_rolling(work):
    """Issue 53 item 13: a plain restart stops every replica at once (8 of 91 client requests failed on the test
    bed, 0 of 189 with --rolling): it says so before anything runs, and names --rolling."""
    from click.testing import CliRunner

    from orchestrator.cli import main

    path = write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n")
    inv = str(work / "hosts.yaml")
    r = CliRunner().invoke(main, ["-i", inv, "restart", path, "--dry-run"])
    text = " ".join(r.output.split())
    assert "warning: reps is served through its router: a plain restart stops every replica at once" in text, text
    assert "deploy restart reps --rolling" in text
    r = CliRunner().invoke(main, ["-i", inv, "restart", path, "--rolling", "--dry-run"])
    assert "served through its router" not in r.output


def test_plan_shows_the_router_steps_that_up_sends(work, monkeypatch):
    """Issue 51: `deploy plan` of a playbook with `router:` shows the router's steps with their exact remote
    commands, and they are the steps up sends (one declaration: replica_router.up_steps)."""
    import io
    import json
    from types import SimpleNamespace

    from click.testing import CliRunner
    from orchestrator.cli import main
    from orchestrator.core.report import Progress

    path = write(work, TWO, "router:\n  host: pve1\n  vmid: 130\n")
    res = CliRunner().invoke(main, ["--inventory", str(work / "hosts.yaml"), "--json", "plan", path])
    rows = json.loads(res.output)["router"]["steps"]
    assert [r["step"] for r in rows] == ["router-install", "router-view", "router-start", "router-wait", "router-gate"]
    assert rows[2]["when"] and rows[2]["command"].startswith("pct exec 130 --keep-env 0 -- /usr/bin/python3 - router ")
    text = CliRunner().invoke(main, ["--inventory", str(work / "hosts.yaml"), "plan", path]).output
    assert all(r["command"] in text for r in rows)

    inv, pb = load_inventory(str(work / "hosts.yaml")), load(work, path)
    workers = [R.replica_url(inv, pb, m) for m in pb.members]
    answers = {"install": {"ok": True}, "view": {"running": False}, "start": {"ok": True, "pid": 7},
               "wait": {"ready": True, "circuits": {}},
               "gate": {"ok": True, "sent": 4, "succeeded": 4, "per_replica": {u: {"requests": 2} for u in workers}}}
    sent = []

    def send(_fleet, _pb, st, on_event=None):
        sent.append(st)
        return answers[st.args["op"]]
    monkeypatch.setattr(R, "send", send)
    out = R.up(SimpleNamespace(inventory=inv), pb, Progress(stream=io.StringIO()), pb.members)
    assert out["ok"], out
    assert [st.as_dict(inv, "/usr/bin/python3")["command"] for st in sent] == [r["command"] for r in rows]
    # the router already runs with these arguments (its launcher's three words, then them): start is not sent
    argv = ["py", "-c", "L"] + R.router_argv_args(pb, workers)
    answers["view"] = {"running": True, "pid": 7, "state": {"argv": argv}}
    sent.clear()
    out = R.up(SimpleNamespace(inventory=inv), pb, Progress(stream=io.StringIO()), pb.members)
    assert out["ok"] and out["status"] == "already up", out
    assert [st.args["op"] for st in sent] == ["install", "view", "wait", "gate"]
