"""The tests' one way to copy the shipped playbooks and to change one line of a playbook (unit and e2e)."""

import os
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_playbooks(dest):
    """A copy of the repo's playbooks/ (drafters and schemas included) at DEST -> DEST."""
    shutil.copytree(os.path.join(REPO, "playbooks"), dest)
    return dest


def edit_file(path, old, new):
    """Replace the first OLD in the file at PATH by NEW; OLD must be there (a test that edits nothing fails)."""
    with open(path) as fh:
        text = fh.read()
    assert old in text, f"{old!r} not in {path}"
    with open(path, "w") as fh:
        fh.write(text.replace(old, new, 1))
    return str(path)
