"""Where deploy finds playbooks and the inventory, `deploy init`, `deploy schema` and shell completion.
Real files in temporary directories and the real CLI as a subprocess; nothing remote runs."""

import json
import os
import subprocess
import sys

import jsonschema
import pytest
import yaml

from orchestrator.core.errors import UsageError
from orchestrator.core.locate import find_inventory, find_playbook, list_playbooks, shipped_dir
from orchestrator.deploy.scaffold import MODELINE, init, schema_text

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def place(tmp_path, monkeypatch):
    """An empty working directory, HOME and XDG_CONFIG_HOME of its own, no DEPLOY_* variables."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for v in ("DEPLOY_PLAYBOOKS", "DEPLOY_INVENTORY"):
        monkeypatch.delenv(v, raising=False)
    return work, home / ".config" / "vllm-pve-deploy"


def _playbook(d, name, text="name: x\n"):
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.yaml").write_text(text)
    return d / f"{name}.yaml"


def test_playbook_search_order(place, monkeypatch):
    work, user = place
    shipped = shipped_dir() / "qwen36-dflash.yaml"
    assert find_playbook("qwen36-dflash") == str(shipped)  # nothing nearer: the shipped example
    _playbook(user / "playbooks", "qwen36-dflash")
    assert find_playbook("qwen36-dflash") == str(user / "playbooks" / "qwen36-dflash.yaml")
    _playbook(work / "playbooks", "qwen36-dflash")
    assert find_playbook("qwen36-dflash") == os.path.join("playbooks", "qwen36-dflash.yaml")
    _playbook(user / "playbooks", "mine")
    assert {"qwen36-dflash", "qwen36-mtp", "mine"} <= set(list_playbooks())
    assert "hosts.example" not in list_playbooks()  # the shipped example inventory is not a playbook
    assert find_playbook("some/where.yaml") == "some/where.yaml"  # a path is taken as is
    other = tmp = work / "elsewhere"
    _playbook(tmp, "only-here")
    monkeypatch.setenv("DEPLOY_PLAYBOOKS", str(other))
    assert find_playbook("only-here") == str(other / "only-here.yaml")
    with pytest.raises(UsageError) as e:  # set means only there
        find_playbook("qwen36-dflash")
    assert "$DEPLOY_PLAYBOOKS" in e.value.message


def test_playbook_not_found_lists_where_it_looked(place):
    with pytest.raises(UsageError) as e:
        find_playbook("nope")
    msg = e.value.message
    for where in ("playbooks/nope.yaml (current directory)",
                  "~/.config/vllm-pve-deploy/playbooks/nope.yaml (user config)", "(shipped examples)"):
        assert where in msg
    assert "qwen36-dflash" in e.value.fix and "deploy init" in e.value.fix


def test_inventory_search_order(place, monkeypatch):
    work, user = place
    with pytest.raises(UsageError) as e:
        find_inventory(None)
    assert "hosts.yaml (current directory)" in e.value.message
    assert "~/.config/vllm-pve-deploy/hosts.yaml (user config)" in e.value.message
    assert "deploy init" in e.value.fix and "deploy testbed up" in e.value.fix
    user.mkdir(parents=True)
    (user / "hosts.yaml").write_text("hosts: []\n")
    assert find_inventory(None) == str(user / "hosts.yaml")
    (work / "hosts.yaml").write_text("hosts: []\n")
    assert find_inventory(None) == "hosts.yaml"
    assert find_inventory("/some/explicit.yaml") == "/some/explicit.yaml"


def _deploy(*args, cwd, env=None):
    e = dict(os.environ, NO_COLOR="1", **(env or {}))
    e.pop("DEPLOY_INVENTORY", None)
    e.pop("DEPLOY_PLAYBOOKS", None)
    e["PYTHONPATH"] = REPO
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, env=e, text=True,
                          capture_output=True, timeout=60)


def test_cli_not_found_messages(place):
    work, _ = place
    r = _deploy("plan", "qwen36-dflash", cwd=work, env={"HOME": os.environ["HOME"]})
    assert r.returncode == 2
    assert "no inventory found; looked in:" in r.stderr and "deploy init" in r.stderr
    (work / "hosts.yaml").write_text("hosts: []\n")
    r = _deploy("plan", "no-such-playbook", cwd=work, env={"HOME": os.environ["HOME"]})
    assert r.returncode == 2
    assert "no playbook named 'no-such-playbook'; looked in:" in r.stderr


def test_init_writes_refuses_and_backs_up(place):
    work, _ = place
    out = init(str(work / "site"))
    site = work / "site"
    assert sorted(os.path.relpath(p, site) for p in out["written"]) == [
        "hosts.yaml", "playbooks/drafters/qwen36-27b-dflash.config.json", "playbooks/qwen36-dflash.yaml",
        "playbooks/qwen36-mtp.yaml", "playbooks/schemas/inventory.schema.json",
        "playbooks/schemas/playbook.schema.json", "playbooks/targets/qwen36-27b.config.json"]
    assert (site / "hosts.yaml").read_text().startswith(MODELINE + "playbooks/schemas/inventory.schema.json\n")
    assert init(str(site))["written"] == []  # identical files are left alone
    (site / "hosts.yaml").write_text("hosts: []  # mine\n")
    with pytest.raises(UsageError) as e:
        init(str(site))
    assert "hosts.yaml" in e.value.message and "--force" in e.value.fix
    assert (site / "hosts.yaml").read_text() == "hosts: []  # mine\n"  # nothing replaced
    out = init(str(site), force=True)
    assert len(out["backups"]) == 1 and open(out["backups"][0]).read() == "hosts: []  # mine\n"


def test_init_then_plan_finds_the_copies(place):
    work, _ = place
    r = _deploy("init", cwd=work, env={"HOME": os.environ["HOME"]})
    assert r.returncode == 0, r.stderr
    pb = work / "playbooks" / "qwen36-dflash.yaml"
    pb.write_text(pb.read_text().replace("target:\n  host: pve1", "target:\n  host: pve9"))
    r = _deploy("plan", "qwen36-dflash", cwd=work, env={"HOME": os.environ["HOME"]})
    assert r.returncode == 2
    assert "playbooks/qwen36-dflash.yaml:" in r.stderr and "pve9" in r.stderr  # the edited copy is the one read


def test_repo_inventory_is_the_shipped_example():
    def body(text):
        return [ln for ln in text.splitlines() if not ln.startswith(MODELINE)]
    with open(os.path.join(REPO, "hosts.yaml")) as a, open(os.path.join(REPO, "playbooks", "hosts.example.yaml")) as b:
        assert body(a.read()) == body(b.read())


@pytest.mark.parametrize("kind", ["playbook", "inventory"])
def test_schema_files_are_generated(kind):
    """The committed schemas are what `deploy schema` prints now (one source: the validator's schema)."""
    with open(os.path.join(REPO, "playbooks", "schemas", f"{kind}.schema.json")) as fh:
        assert fh.read() == schema_text(kind), "run: deploy schema %s > playbooks/schemas/%s.schema.json" % (kind, kind)
    r = _deploy("schema", kind, cwd=REPO)
    assert r.returncode == 0 and r.stdout == schema_text(kind)


def _validator(kind):
    s = json.loads(schema_text(kind))
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


def test_schema_accepts_shipped_and_rejects_broken():
    pbv, invv = _validator("playbook"), _validator("inventory")
    for name in ("qwen36-dflash", "qwen36-mtp"):
        with open(os.path.join(REPO, "playbooks", f"{name}.yaml")) as fh:
            text = fh.read()
        assert text.startswith(MODELINE + "schemas/playbook.schema.json\n")
        data = yaml.safe_load(text)
        assert list(pbv.iter_errors(data)) == []
    broken = dict(data, serve=dict(data["serve"], port="eighty", colour="blue"))
    msgs = sorted(e.message for e in pbv.iter_errors(broken))
    assert any("'eighty' is not of type" in m for m in msgs)
    assert any("colour" in m for m in msgs)  # unknown keys, as the validator
    inv = yaml.safe_load("hosts:\n  - name: pve1\n    address: 127.0.0.1\n    containers:\n"
                         "      - {vmid: 129, gpus: [0, 1]}\n")
    assert list(invv.iter_errors(inv)) == []
    inv["hosts"][0]["containers"][0]["vmid"] = 5
    assert [e.message for e in invv.iter_errors(inv)] == ["5 is less than the minimum of 100"]


def test_completion_offers_playbooks_and_targets(tmp_path):
    inv = tmp_path / "hosts.yaml"
    inv.write_text("hosts:\n  - name: pve1\n    address: 127.0.0.1\n    containers:\n      - {vmid: 129}\n")

    def complete(words, cword):
        r = _deploy(cwd=REPO, env={"_DEPLOY_COMPLETE": "bash_complete", "COMP_WORDS": words,
                                   "COMP_CWORD": str(cword)})
        return [ln.split(",", 1)[1] for ln in r.stdout.splitlines()]
    assert complete("deploy up q", 2) == ["qwen36-dflash", "qwen36-mtp"]
    assert complete("deploy -i %s status p" % inv, 4) == ["pve1", "pve1/129"]
    assert "restart" in complete("deploy re", 1)
    r = _deploy(cwd=REPO, env={"_DEPLOY_COMPLETE": "bash_source"})
    assert r.returncode == 0 and "_DEPLOY_COMPLETE=bash_complete" in r.stdout


def test_testbed_hint_names_this_shells_test_bed_directory(monkeypatch):
    """Issue 53 item 14: fix texts named /tmp/vpd-testbed/hosts.yaml whatever VPD_TESTBED_DIR was."""
    from orchestrator.core.locate import testbed_hint, testbed_inventory

    monkeypatch.delenv("VPD_TESTBED_DIR", raising=False)
    assert testbed_inventory() == "/tmp/vpd-testbed/hosts.yaml"
    monkeypatch.setenv("VPD_TESTBED_DIR", "/srv/bed")
    assert testbed_inventory() == "/srv/bed/hosts.yaml" and "export DEPLOY_INVENTORY=/srv/bed/hosts.yaml" in testbed_hint()
