"""Where `deploy` finds playbooks and the inventory: one documented search order (docs/playbooks.md).

Playbooks (NAME -> NAME.yaml), first directory that has it:
  1. $DEPLOY_PLAYBOOKS, when set (and then only there: an explicit choice is not second-guessed)
  2. ./playbooks/
  3. the user config directory: $XDG_CONFIG_HOME/vllm-pve-deploy/playbooks/ (~/.config/...)
  4. the shipped examples (package data of the installed tool)

Inventory, first that exists:
  1. --inventory / -i PATH, or $DEPLOY_INVENTORY (and then only that file)
  2. ./hosts.yaml
  3. the user config directory: $XDG_CONFIG_HOME/vllm-pve-deploy/hosts.yaml
There is no shipped inventory to fall back on: the example connects nowhere, so an empty fallback would only
hide the real problem; the error says where it looked and what to do (`deploy init`, the test bed).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from orchestrator.core.errors import UsageError

APP = "vllm-pve-deploy"
PLAYBOOK_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
def testbed_inventory() -> str:
    """The test bed's inventory as `deploy testbed up` writes it: $VPD_TESTBED_DIR/hosts.yaml (default
    /tmp/vpd-testbed), so a fix text names the directory this shell's test bed uses (issue 53)."""
    return os.path.join(os.environ.get("VPD_TESTBED_DIR") or "/tmp/vpd-testbed", "hosts.yaml")


def testbed_hint() -> str:
    return f"for the built-in test bed: deploy testbed up && export DEPLOY_INVENTORY={testbed_inventory()}"


def user_config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / APP


def shipped_dir(package: str = "orchestrator.examples", folder: str = "playbooks") -> Path | None:
    """The installed package's examples (orchestrator.examples = the repo's playbooks/ folder), or its docs
    (orchestrator.docs = docs/)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    for p in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isdir(p):
            return Path(p)
    src = Path(__file__).resolve().parent.parent.parent / folder  # running from a source checkout
    return src if src.is_dir() else None


def _show(p: Path) -> str:
    home = os.path.expanduser("~")
    s = str(p)
    return "~" + s[len(home):] if home not in ("", "/") and s.startswith(home + os.sep) else s


def playbook_dirs() -> list[tuple[str, Path]]:
    """[(why, dir)] in search order."""
    env = os.environ.get("DEPLOY_PLAYBOOKS")
    if env:
        return [("$DEPLOY_PLAYBOOKS", Path(env))]
    dirs = [("current directory", Path("playbooks")), ("user config", user_config_dir() / "playbooks")]
    shipped = shipped_dir()
    if shipped is not None:
        dirs.append(("shipped examples", shipped))
    return dirs


def is_path(name_or_path: str) -> bool:
    return name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path


def find_playbook(name_or_path: str) -> str:
    """A playbook name -> the path of the first NAME.yaml in the search order; a path is taken as is.
    Raises UsageError naming every place it looked."""
    if is_path(name_or_path):
        return name_or_path
    looked = []
    for why, d in playbook_dirs():
        p = d / f"{name_or_path}.yaml"
        if p.is_file():
            return str(p)
        looked.append(f"{_show(p)} ({why})")
    names = list_playbooks()
    raise UsageError(
        f"no playbook named {name_or_path!r}; looked in: " + ", ".join(looked),
        fix=(f"playbooks found: {', '.join(names)}; " if names else "")
        + "deploy init copies the shipped playbooks here to edit, or set DEPLOY_PLAYBOOKS=DIR")


def list_playbooks() -> list[str]:
    """Every playbook name in the search order (the first directory that has a name wins)."""
    seen: dict[str, None] = {}
    for _why, d in playbook_dirs():
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        for e in entries:
            if e.endswith(".yaml") and PLAYBOOK_NAME.fullmatch(e[:-5]):
                seen.setdefault(e[:-5], None)
    return list(seen)


def inventory_candidates() -> list[tuple[str, Path]]:
    return [("current directory", Path("hosts.yaml")), ("user config", user_config_dir() / "hosts.yaml")]


def find_inventory(explicit: str | None) -> str:
    """-i/--inventory or $DEPLOY_INVENTORY (taken as given, even if missing: the loader says so), else the
    first existing candidate. Raises UsageError naming where it looked."""
    if explicit:
        return explicit
    for _why, p in inventory_candidates():
        if p.is_file():
            return str(p)
    looked = ", ".join(f"{_show(p)} ({why})" for why, p in inventory_candidates())
    raise UsageError(f"no inventory found; looked in: $DEPLOY_INVENTORY and -i (not set), {looked}",
                     fix="deploy init writes an example hosts.yaml here to edit; " + testbed_hint())
