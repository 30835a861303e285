"""End-to-end helpers: the real `deploy` CLI as a subprocess against the test bed (real sshd, pct, processes)."""


import pytest

from e2e_helpers import deploy_runner


@pytest.fixture
def deploy(tb, tmp_path):
    """deploy(*args, check=None, env=None, timeout=180) -> CompletedProcess (text), run from the repo root."""
    return deploy_runner(tb.inventory_path, tmp_path / "state")


@pytest.fixture
def playbooks(tmp_path):
    """A copy of playbooks/ with faster GPU timeouts; edit(name, old, new) changes one; env for deploy()."""
    from playbook_support import copy_playbooks, edit_file

    d = copy_playbooks(tmp_path / "playbooks")

    def edit(name, old, new):
        p = d / f"{name}.yaml"
        if old in p.read_text():
            edit_file(p, old, new)
        else:  # a gpu: key the playbook does not set yet
            text = p.read_text()
            p.write_text(text.replace("\ngpu:\n", f"\ngpu:\n  {new}\n", 1) if "\ngpu:\n" in text else
                         text + f"\ngpu:\n  {new}\n")

    edit.dir = d
    edit.env = {"DEPLOY_PLAYBOOKS": str(d)}
    return edit
