"""The tests' one way to copy the shipped playbooks, to change one line of a playbook, and to derive a playbook
from a shipped one with other targets (unit and e2e)."""

import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_playbooks(dest):
    """A copy of the repo's playbooks/ (drafters and schemas included) at DEST -> DEST."""
    shutil.copytree(os.path.join(REPO, "playbooks"), dest)
    return dest


def playbook_work(tmp_path, inventory):
    """TMP_PATH with a copy of the playbooks (TMP_PATH/playbooks) and INVENTORY as TMP_PATH/hosts.yaml -> TMP_PATH."""
    copy_playbooks(tmp_path / "playbooks")
    (tmp_path / "hosts.yaml").write_text(inventory)
    return tmp_path


def edit_file(path, old, new):
    """Replace the first OLD in the file at PATH by NEW; OLD must be there (a test that edits nothing fails)."""
    with open(path) as fh:
        text = fh.read()
    assert old in text, f"{old!r} not in {path}"
    with open(path, "w") as fh:
        fh.write(text.replace(old, new, 1))
    return str(path)


ONE_TARGET = "target:\n  host: pve1\n  vmid: 129\n  gpus: [0, 1, 2, 3]\n"  # the shipped playbooks' one target


def playbook_variant(pbdir, name, where, base="qwen36-mtp", append=""):
    """PBDIR/NAME.yaml: the playbook BASE in PBDIR named NAME, its target (ONE_TARGET, which must be there) replaced
    by WHERE (a `target:` or `targets:` block, or ""), APPEND added at its end -> the new file's path (str)."""
    src = os.path.join(str(pbdir), f"{base}.yaml")
    with open(src) as fh:
        text = fh.read()
    assert ONE_TARGET in text, f"{ONE_TARGET!r} not in {src}"
    text = text.replace(ONE_TARGET, where).replace(f"name: {base}", f"name: {name}") + append
    path = os.path.join(str(pbdir), f"{name}.yaml")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def without_sizing(text):
    """A playbook's TEXT without its `sizing:` block (the shipped ones name targets/qwen36-27b.config.json), for a
    test that writes a sizing block of its own."""
    import re

    return re.sub(r"\nsizing:\n(?:[ #].*\n|\n(?=[ #]))*", "\n", text)
