"""`deploy init` and `deploy schema`: a working directory to edit, and the JSON Schemas editors use."""

from __future__ import annotations

import json
import re
from pathlib import Path

from orchestrator.core.atomic import write_atomic
from orchestrator.core.errors import UsageError
from orchestrator.core.locate import shipped_dir
from orchestrator.core.spec_schema import json_schema

KINDS = ("playbook", "inventory")
INVENTORY_EXAMPLE = "hosts.example.yaml"  # in the shipped examples; `deploy init` writes it as hosts.yaml
MODELINE = "# yaml-language-server: $schema="


def schema_text(kind: str) -> str:
    if kind not in KINDS:
        raise UsageError(f"unknown schema {kind!r}", fix="deploy schema playbook, or deploy schema inventory")
    return json.dumps(json_schema(kind), indent=2, sort_keys=False) + "\n"


def with_modeline(text: str, schema_path: str) -> str:
    """text whose yaml-language-server modeline (first line) points at schema_path."""
    lines = text.splitlines(keepends=True)
    line = f"{MODELINE}{schema_path}\n"
    if lines and lines[0].startswith(MODELINE):
        lines[0] = line
    else:
        lines.insert(0, line)
    return "".join(lines)


def _files(src: Path) -> list[tuple[Path, str]]:
    """(relative destination, text) of everything `init` writes."""
    out = [(Path("hosts.yaml"), with_modeline((src / INVENTORY_EXAMPLE).read_text(),
                                              "playbooks/schemas/inventory.schema.json"))]
    out += [(Path("playbooks") / p.name, p.read_text()) for p in sorted(src.glob("*.yaml"))
            if p.name != INVENTORY_EXAMPLE]
    # pinned drafter configs; the targets' config.json (sizing.target_config)
    out += [(Path("playbooks") / sub / p.name, p.read_text()) for sub in ("drafters", "targets")
            for p in sorted((src / sub).glob("*.json"))]
    return out + [(Path("playbooks") / "schemas" / f"{kind}.schema.json", schema_text(kind)) for kind in KINDS]


def init(directory: str, force: bool = False) -> dict:
    """Write DIR/hosts.yaml (the inert example inventory) and DIR/playbooks/ (the shipped playbooks, pinned
    drafter configs, schemas). An existing file that differs is refused, or with force replaced after a backup
    (FILE.bak-<UTC time>-<random>); one that is already identical is left alone. Every write is read back."""
    src = shipped_dir()
    if src is None or not (src / INVENTORY_EXAMPLE).is_file():
        raise UsageError("the shipped examples are missing from this installation",
                         fix="reinstall vllm-pve-deploy (pip install --force-reinstall vllm-pve-deploy)")
    dest = Path(directory)
    files = _files(src)
    differs = [rel for rel, text in files if (dest / rel).exists() and (dest / rel).read_bytes() != text.encode()]
    if differs and not force:
        raise UsageError("would replace files that differ: " + ", ".join(str(dest / r) for r in differs),
                         fix="keep them (edit in place), use another DIR, or deploy init --force "
                             "(each replaced file is kept as FILE.bak-<UTC time>-<random>)")
    written, unchanged, backups = [], [], []
    for rel, text in files:
        target = dest / rel
        if target.exists() and target.read_bytes() == text.encode():
            unchanged.append(str(target))
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        backup = write_atomic(str(target), text, mode=0o644, keep_mode=True, backup=True)
        if backup:
            backups.append(backup)
        written.append(str(target))
    return {"directory": str(dest.resolve()), "written": written, "unchanged": unchanged, "backups": backups}


# ------------------------------------------------------------------ deploy docs: the shipped pages, offline


def doc_topics() -> dict[str, Path]:
    """{topic: page}: every shipped page (docs/*.md by its name, docs/design/x.md as design/x)."""
    d = shipped_dir("orchestrator.docs", "docs")
    return {p.relative_to(d).with_suffix("").as_posix(): p for p in sorted(d.rglob("*.md"))} if d is not None else {}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", heading.strip().lower()))


def docs_text(topic: str | None) -> str:
    """`deploy docs [TOPIC[#SECTION]]`: the list of topics, a page, or one section of it (to the next heading
    of the same level)."""
    topics = doc_topics()
    if not topic:
        return "Pages shipped with deploy (deploy docs TOPIC, or TOPIC#SECTION for one section):\n" + "".join(
            f"  {t}\n" for t in topics)
    name, _, section = topic.partition("#")
    name = name.removeprefix("docs/").removesuffix(".md")
    if name not in topics:
        raise UsageError(f"no shipped page {name!r}", fix="deploy docs lists them: " + ", ".join(topics))
    text = topics[name].read_text(encoding="utf-8")
    if not section:
        return text
    lines, start, level = text.splitlines(keepends=True), None, 0
    for i, ln in enumerate(lines):
        if ln.startswith("#"):
            n = len(ln) - len(ln.lstrip("#"))
            if start is None and _slug(ln.lstrip("#")) == section.lower():
                start, level = i, n
            elif start is not None and n <= level:
                return "".join(lines[start:i])
    if start is None:  # every heading's anchor (## to ####, not the comments of code blocks), the nearest first
        import difflib

        heads, fenced = [], False
        for ln in lines:
            if ln.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{2,4} ", ln):
                heads.append(_slug(ln.lstrip("#")))
        near = difflib.get_close_matches(section.lower(), heads, n=3, cutoff=0.5)
        raise UsageError(f"no section #{section} in {name}" + (f" (did you mean #{near[0]}?)" if near else ""),
                         fix=f"deploy docs {name}#{near[0] if near else heads[0] if heads else ''}; every section "
                             f"of {name}: " + ", ".join(heads))
    return "".join(lines[start:])
