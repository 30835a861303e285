"""A small strict schema for YAML node trees: every error carries FILE:LINE:COL and the key path.

PyYAML composes the file into nodes (which keep their marks); we walk the nodes against the schema and
construct plain values, collecting *every* problem instead of stopping at the first one.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_FILE_BYTES = 1 << 20  # a playbook or inventory over 1 MiB is a mistake, not a config

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class Problems:
    def __init__(self, filename: str):
        self.filename = filename
        self.items: list[str] = []

    def add(self, node: Node | None, path: str, message: str) -> None:
        m = node.start_mark if node is not None else None
        loc = f"{self.filename}:{m.line + 1}:{m.column + 1}" if m else f"{self.filename}:1:1"
        self.items.append(f"{loc}: {path or '(top)'}: {message}")


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    tag = node.tag.rsplit(":", 1)[-1]
    return {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
            "null": "null"}.get(tag, tag)


_constructor = SafeConstructor()


def scalar_value(node: ScalarNode) -> Any:
    return _constructor.construct_object(node, deep=True)


def _is_null(node: Node) -> bool:
    """`key:`, `key: null` or `key: ~`."""
    return isinstance(node, ScalarNode) and scalar_value(node) is None


def _expected(node: Node, path: str, problems: Problems, what: str) -> None:
    """Report a node of the wrong kind ("expected a list, found a mapping"); None, the value it stands for."""
    problems.add(node, path, f"expected {what}, found {_kind(node)}")


class Type:
    nullable = False
    description = ""

    def check(self, node: Node, path: str, problems: Problems) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def json_schema(self) -> dict:  # pragma: no cover - interface
        """The JSON Schema (draft 2020-12) of what check() accepts, for editors (`deploy schema`)."""
        raise NotImplementedError


def _nullable(s: dict) -> dict:
    """s that also accepts null."""
    s = dict(s)
    t = s.get("type")
    if t is not None:
        s["type"] = (t if isinstance(t, list) else [t]) + ([] if t == "null" or "null" in (t if isinstance(t, list)
                                                                                             else [t]) else ["null"])
    if "enum" in s and None not in s["enum"]:
        s["enum"] = s["enum"] + [None]
    return s


@dataclass
class Scalar(Type):
    py: tuple = (str,)
    name: str = "a string"
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None
    pattern_hint: str = ""
    choices: tuple | None = None
    nullable: bool = False
    validate: Callable[[Any], str | None] | None = None

    def check(self, node, path, problems):
        if not isinstance(node, ScalarNode):
            return _expected(node, path, problems, self.name)
        value = scalar_value(node)
        if value is None:
            if not self.nullable:
                problems.add(node, path, f"expected {self.name}, found null")
            return None
        if isinstance(value, bool) and bool not in self.py:
            problems.add(node, path, f"expected {self.name}, found a boolean ({node.value})")
            return None
        if float in self.py and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.py):
            problems.add(node, path, f"expected {self.name}, found {_kind(node)} ({node.value!r})")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            problems.add(node, path, f"expected a finite number, found {node.value}")
            return None
        if isinstance(value, str):
            if _CONTROL.search(value) or "\n" in value:
                problems.add(node, path, "control characters or newlines are not allowed here")
                return None
            if self.pattern and not re.fullmatch(self.pattern, value):
                problems.add(node, path, f"{value!r} is not valid: {self.pattern_hint or 'must match ' + self.pattern}")
                return None
        if self.choices is not None and value not in self.choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.add(node, path, f"{value!r} is not one of {', '.join(map(repr, self.choices))}{hint}")
            return None
        if self.minimum is not None and value < self.minimum or self.maximum is not None and value > self.maximum:
            problems.add(node, path, f"{value} is out of range [{self.minimum}, {self.maximum}]")
            return None
        if self.validate and (msg := self.validate(value)):
            problems.add(node, path, msg)
            return None
        return value

    def json_schema(self) -> dict:
        types = [t for py, t in ((bool, "boolean"), (str, "string")) if py in self.py]
        types += ["number"] if float in self.py else ["integer"] if int in self.py else []
        s: dict = {"type": types[0] if len(types) == 1 else types}
        if self.pattern:
            s["pattern"] = f"^(?:{self.pattern})$"
        elif str in self.py:
            s["pattern"] = "^[^\\x00-\\x1f\\x7f]*$"  # no control characters or newlines
        if self.choices is not None:
            s["enum"] = list(self.choices)
        if self.minimum is not None:
            s["minimum"] = self.minimum
        if self.maximum is not None:
            s["maximum"] = self.maximum
        return _nullable(s) if self.nullable else s


def Str(**kw) -> Scalar:
    return Scalar(py=(str,), name="a string", **kw)


def Int(minimum=None, maximum=None, **kw) -> Scalar:
    return Scalar(py=(int,), name="an integer", minimum=minimum, maximum=maximum, **kw)


def Float(minimum=None, maximum=None, **kw) -> Scalar:
    return Scalar(py=(float, int), name="a number", minimum=minimum, maximum=maximum, **kw)


def Bool(**kw) -> Scalar:
    return Scalar(py=(bool,), name="a boolean (true/false)", **kw)


ABS_PATH = dict(pattern=r"/[^\x00]*", pattern_hint="must be an absolute path starting with /")


@dataclass
class List(Type):
    item: Type
    min_len: int = 0
    max_len: int = 1000
    unique: bool = False
    nullable: bool = False

    def check(self, node, path, problems):
        if self.nullable and _is_null(node):
            return None
        if not isinstance(node, SequenceNode):
            return _expected(node, path, problems, "a list")
        if not self.min_len <= len(node.value) <= self.max_len:
            problems.add(node, path, f"expected {self.min_len} to {self.max_len} items, found {len(node.value)}")
        out, seen = [], set()
        for i, child in enumerate(node.value):
            v = self.item.check(child, f"{path}[{i}]", problems)
            if self.unique and v is not None:
                key = repr(v)
                if key in seen:
                    problems.add(child, f"{path}[{i}]", f"duplicate value {v!r}")
                seen.add(key)
            out.append(v)
        return out

    def json_schema(self) -> dict:
        s = {"type": "array", "items": self.item.json_schema(), "minItems": self.min_len, "maxItems": self.max_len}
        if self.unique:
            s["uniqueItems"] = True
        return _nullable(s) if self.nullable else s


@dataclass
class Field:
    type: Type
    required: bool = False
    default: Any = None  # a value, or a callable that makes one (list, dict, lambda: {...}: a fresh one each time)
    doc: str = ""

    def value(self) -> Any:
        """The default, made afresh when it is a callable."""
        return self.default() if callable(self.default) else self.default

    def json_schema(self) -> dict:
        s = self.type.json_schema()
        if self.doc:
            s["description"] = self.doc
        return s


def mapping_items(node: MappingNode, path: str, problems: Problems):
    """Yield (key, key_node, value_node), reporting non-string and duplicate keys."""
    seen: dict[str, Node] = {}
    for knode, vnode in node.value:
        if not isinstance(knode, ScalarNode) or not isinstance(scalar_value(knode), (str, int)):
            problems.add(knode, path, f"keys must be plain names, found {_kind(knode)}")
            continue
        key = str(scalar_value(knode))
        if key in seen:
            first = seen[key].start_mark.line + 1
            problems.add(knode, _join(path, key), f"duplicate key (first defined on line {first})")
            continue
        seen[key] = knode
        yield key, knode, vnode


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@dataclass
class Map(Type):
    fields: dict[str, Field]
    nullable: bool = False
    cross: Callable[[dict, MappingNode, str, Problems], None] | None = None
    # groups of keys of which exactly one must be given (e.g. ("target", "targets")); each key is optional alone
    one_of: tuple = ()

    def check(self, node, path, problems):
        if self.nullable and _is_null(node):
            return None
        if not isinstance(node, MappingNode):
            return _expected(node, path, problems, "a mapping")
        out: dict[str, Any] = {}
        nodes: dict[str, Node] = {}
        for key, knode, vnode in mapping_items(node, path, problems):
            if key not in self.fields:
                near = difflib.get_close_matches(key, list(self.fields), n=1, cutoff=0.6)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                problems.add(knode, _join(path, key), f"unknown key{hint}; allowed: {', '.join(self.fields)}")
                continue
            f = self.fields[key]
            if not f.required and _is_null(vnode) and not f.type.nullable:
                continue  # an explicit null on an optional key means "the default"
            out[key] = f.type.check(vnode, _join(path, key), problems)
            nodes[key] = vnode
        for name, f in self.fields.items():
            if name not in out:
                if f.required:
                    problems.add(node, _join(path, name), "required key is missing")
                out[name] = f.value()
        for group in self.one_of:
            given = [k for k in group if k in nodes]
            if len(given) != 1:
                names = " or ".join(repr(k) for k in group)
                problems.add(nodes[given[1]] if len(given) > 1 else node, _join(path, given[1] if given else group[0]),
                             f"give exactly one of {names}, not both" if given else
                             f"required key is missing: give {names}")
        out["__nodes__"] = nodes
        out["__node__"] = node
        if self.cross:
            self.cross(out, node, path, problems)
        return out

    def defaults(self, skip_none: bool = False) -> dict:
        """What the map is when its key is left out: each optional key's default (skip_none: those that are not None)."""
        out = {}
        for name, f in self.fields.items():
            v = f.value()
            if not f.required and not (skip_none and v is None):
                out[name] = v
        return out

    def json_schema(self) -> dict:
        props, required = {}, []
        for name, f in self.fields.items():
            p = f.json_schema()
            if f.required:
                required.append(name)
            else:
                p = _nullable(p)  # an explicit null on an optional key means "the default"
                default = f.value()
                if default is not None:
                    p["default"] = default
            props[name] = p
        s = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            s["required"] = required
        for group in self.one_of:  # exactly one of these keys, with a value (not null)
            for k in group:
                props[k] = self.fields[k].json_schema()
            s.setdefault("oneOf", []).extend({"required": [k]} for k in group)
        return _nullable(s) if self.nullable else s


@dataclass
class FreeMap(Type):
    """A mapping with caller-chosen keys (e.g. environment variables)."""

    key_pattern: str
    key_hint: str
    value: Type = field(default_factory=Str)
    nullable: bool = True

    def check(self, node, path, problems):
        if _is_null(node):
            return {}
        if not isinstance(node, MappingNode):
            return _expected(node, path, problems, "a mapping") or {}
        out = {}
        for key, knode, vnode in mapping_items(node, path, problems):
            if not re.fullmatch(self.key_pattern, key):
                problems.add(knode, _join(path, key), f"invalid key: {self.key_hint}")
                continue
            out[key] = self.value.check(vnode, _join(path, key), problems)
        return out

    def json_schema(self) -> dict:
        return _nullable({"type": "object", "patternProperties": {f"^(?:{self.key_pattern})$": self.value.json_schema()},
                          "additionalProperties": False})


def strip_nodes(value: Any) -> Any:
    """Return a copy without the __nodes__/__node__ bookkeeping (for JSON output)."""
    if isinstance(value, dict):
        return {k: strip_nodes(v) for k, v in value.items() if not k.startswith("__")}
    if isinstance(value, list):
        return [strip_nodes(v) for v in value]
    return value


_C_LOADER = getattr(yaml, "CSafeLoader", None)
# where libyaml accepts what PyYAML's own parser refuses, or reads it otherwise (found by mutating the shipped files,
# tests/unit/test_spec.py): a tab, a CR or a Unicode line break (NEL, LS, PS) or a BOM anywhere; `?`, `!` (tags) or `%`
# (directives) before a line's first `#`. Such a file is read by the pure-Python parser alone (a comment's `%` or
# `?` costs nothing: it is after the `#`).
_PY_ONLY = re.compile("[\t\r\x85\u2028\u2029\ufeff]|^[^#\n]*[?!%]", re.M)


def _compose(text: str, loader, problems: Problems):
    """Every document's node tree, or False (a problem added) where the text uses an alias."""
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):  # aliases can expand exponentially; configs don't need them
            m = event.start_mark
            problems.items.append(f"{problems.filename}:{m.line + 1}:{m.column + 1}: (top): "
                                  "YAML aliases (*name) are not supported; write the value out")
            return False
    return list(yaml.compose_all(text, Loader=loader))


def compose_file(path, problems: Problems, digest: dict | None = None) -> Node | None:
    """Read a YAML file into a node tree, turning every way it can be unreadable into a problem. With `digest`,
    digest["sha256"] is set to the hash of exactly the bytes that were parsed (read once)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        problems.add(None, "", "file not found")
        return None
    except IsADirectoryError:
        problems.add(None, "", "is a directory, expected a YAML file")
        return None
    except OSError as e:
        problems.add(None, "", f"cannot read: {e.strerror}")
        return None
    if digest is not None:
        digest["sha256"] = hashlib.sha256(raw).hexdigest()
    if len(raw) > MAX_FILE_BYTES:
        problems.add(None, "", f"file is larger than {MAX_FILE_BYTES // 1024} KiB; refusing to parse it")
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problems.items.append(f"{problems.filename}:1:1: (top): not UTF-8 text (bad byte at offset {e.start})")
        return None
    docs = None
    if _C_LOADER is not None and not _PY_ONLY.search(text):
        # libyaml's parser, when PyYAML has it: the same events and nodes (marks with line and column) ~10-40x
        # faster than the pure-Python one (an 8-host inventory: ~20 ms of every `deploy` command; issue 54). A file
        # it refuses is read again by the pure-Python parser below, whose messages the docs and tests quote; so is
        # one with what the two are known to read differently (_PY_ONLY).
        try:
            docs = _compose(text, _C_LOADER, problems)
        except yaml.YAMLError:
            docs = None
    try:
        if docs is None:
            docs = _compose(text, yaml.SafeLoader, problems)
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark or e.context_mark
        loc = f"{problems.filename}:{m.line + 1}:{m.column + 1}" if m else f"{problems.filename}:1:1"
        problems.items.append(f"{loc}: (top): invalid YAML: {e.problem or e.context}")
        return None
    except yaml.YAMLError as e:
        problems.items.append(f"{problems.filename}:1:1: (top): invalid YAML: {e}")
        return None
    if docs is False:
        return None
    docs = [d for d in docs if d is not None]
    if not docs:
        problems.add(None, "", "file is empty; expected a mapping")
        return None
    if len(docs) > 1:
        problems.add(docs[1], "", "more than one YAML document; expected exactly one")
        return None
    return docs[0]


def node_of(value: dict, key: str) -> Node | None:
    return value.get("__nodes__", {}).get(key) or value.get("__node__")
