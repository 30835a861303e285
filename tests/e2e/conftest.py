"""End-to-end helpers: the real `deploy` CLI as a subprocess against the test bed (real sshd, pct, processes)."""

import os

import pytest

from e2e_helpers import REPO, deploy_runner


@pytest.fixture
def deploy(tb, tmp_path):
    """deploy(*args, check=None, env=None, timeout=180) -> CompletedProcess (text), run from the repo root."""
    return deploy_runner(tb.inventory_path, tmp_path / "state")


@pytest.fixture
def playbooks(tmp_path):
    """A copy of playbooks/ with faster GPU timeouts; edit(name, old, new) changes one; env for deploy()."""
    import shutil

    d = tmp_path / "playbooks"
    shutil.copytree(os.path.join(REPO, "playbooks"), d)

    def edit(name, old, new):
        p = d / f"{name}.yaml"
        text = p.read_text()
        if old not in text:
            text = text.replace("\ngpu:\n", f"\ngpu:\n  {new}\n", 1) if "\ngpu:\n" in text else \
                text + f"\ngpu:\n  {new}\n"
        else:
            text = text.replace(old, new, 1)
        p.write_text(text)

    edit.dir = d
    edit.env = {"DEPLOY_PLAYBOOKS": str(d)}
    return edit
