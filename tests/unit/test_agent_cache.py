"""The agent shipped once and cached in the container: the archive named by its sha256, kept in a 0700 directory,
checked before each use (a damaged copy is refused and replaced), old versions pruned; each exec sends only the
bootstrap; an action imports only its own modules; no import cycles. Real processes on real files, no SSH."""

import ast
import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator.agent import agent_stdin, archive
from orchestrator.agent.container import cache as agent_cache
from orchestrator.agent.container import core as agent_core

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTAINER = os.path.join(REPO, "orchestrator", "agent", "container")


def run(action, args, cache, *, inline, prefix=b""):
    stdin = prefix + agent_stdin(None, None, None, cache_dir=str(cache), inline=inline)
    p = subprocess.run([sys.executable, "-", action, json.dumps(args)], input=stdin, capture_output=True,
                       timeout=120)
    lines = [json.loads(x) for x in p.stdout.decode().splitlines() if x.startswith("{")]
    return p, lines


def result(lines):
    res = [x["result"] for x in lines if "result" in x]
    assert res, lines
    return res[-1]


def compiled(cache):
    """Wait (bounded) for this Python's compiled copy and its record; True once it checks out."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if agent_cache.check_compiled(archive.sha256(), str(cache)) == "ok":
            return True
        time.sleep(0.1)
    return False


WHERE = b"import atexit, sys\natexit.register(lambda: sys.stderr.write('FROM ' + sys.path[0] + '\\n'))\n"


def ran_from(cache, args=None):
    """Run file_sha with the bootstrap alone; what it ran from: "compiled", "zip", or "need" (asked for it)."""
    p, lines = run("file_sha", args or {"path": "/"}, cache, inline=False, prefix=WHERE)
    if p.returncode == archive.NEED_EXIT:
        return "need"
    assert p.returncode == 0 and result(lines), (p.stderr, lines)
    where = p.stderr.decode().split("FROM ", 1)[1].split()[0]
    base = agent_cache.compiled_path(archive.sha256(), str(cache))
    return {base: "compiled", str(cache / f"{archive.sha256()}.zip"): "zip"}[where]


def test_the_archive_is_cached_checked_and_replaced_when_damaged(tmp_path):
    cache = tmp_path / "state" / "vpd-agent"
    args = {"path": str(tmp_path / "nothing")}
    # not there yet: a one-shot exec without the archive asks for it, runs nothing, exits 3
    p, lines = run("file_sha", args, cache, inline=False)
    assert p.returncode == archive.NEED_EXIT and lines == [{"need": archive.sha256()}]
    # with it inline: kept as SHA.zip (0600 in a 0700 directory), then the action runs
    p, lines = run("file_sha", args, cache, inline=True)
    assert result(lines)["error"]
    kept = cache / f"{archive.sha256()}.zip"
    assert kept.read_bytes() == archive.archive()
    assert os.stat(cache).st_mode & 0o777 == 0o700 and os.stat(kept).st_mode & 0o777 == 0o600
    # this Python's compiled copy appears beside it (built off the exec's path)
    assert compiled(cache)
    # from now on the bootstrap alone is enough
    p, lines = run("file_sha", args, cache, inline=False)
    assert p.returncode == 0 and "need" not in lines[0]
    assert ran_from(cache, args) == "compiled"
    # a damaged copy (and compiled copy) is refused, asked for again, and replaced
    base = agent_cache.compiled_path(archive.sha256(), str(cache))
    for n in [kept, f"{base}.rec", f"{base}/vpd_agent/main.py",
              f"{base}/vpd_agent/__pycache__/main.{sys.implementation.cache_tag}.pyc"]:
        with open(n, "ab") as fh:
            fh.write(b"tampered")
    p, lines = run("file_sha", args, cache, inline=False)
    assert p.returncode == archive.NEED_EXIT and lines == [{"need": archive.sha256()}]
    p, lines = run("file_sha", args, cache, inline=True)
    assert p.returncode == 0 and kept.read_bytes() == archive.archive()
    assert compiled(cache)  # the damaged compiled copy is rebuilt by the exec that ran from the sources
    assert ran_from(cache, args) == "compiled"
    with open(f"{base}/vpd_agent/main.py", "rb") as fh:
        assert b"tampered" not in fh.read()


def _fresh_compiled(tmp_path):
    cache = tmp_path / "state" / "vpd-agent"
    run("file_sha", {"path": "/"}, cache, inline=True)
    assert compiled(cache) and ran_from(cache) == "compiled"
    return cache, agent_cache.compiled_path(archive.sha256(), str(cache))


def _pyc(base, mod="main"):
    return f"{base}/vpd_agent/__pycache__/{mod}.{sys.implementation.cache_tag}.pyc"


def test_a_compiled_file_whose_stat_moved_is_rehashed_before_it_is_trusted_again(tmp_path):
    """Issue 54: the compiled copy is trusted by each entry's recorded stat (no hash per exec). Same bytes, but
    ctime moved (a chmod back and forth; mtime kept): not used by BOOT, rehashed by the next compile, re-recorded."""
    cache, base = _fresh_compiled(tmp_path)
    pyc = _pyc(base)
    ino = os.stat(pyc).st_ino
    os.chmod(pyc, 0o644)
    os.chmod(pyc, 0o600)
    assert ran_from(cache) == "zip"  # refused: ran from the hash-checked archive, which re-checks the copy
    assert compiled(cache) and os.stat(pyc).st_ino == ino  # rehashed and re-recorded, not rebuilt
    assert ran_from(cache) == "compiled"


def test_a_compiled_file_changed_with_its_mtime_put_back_is_refused_and_rebuilt(tmp_path):
    """Same size, same mtime (os.utime put it back): ctime still moved, the bytes differ from the record: the
    copy is never used again, and is rebuilt from the archive."""
    cache, base = _fresh_compiled(tmp_path)
    pyc = _pyc(base, "core")
    st = os.stat(pyc)
    with open(pyc, "r+b") as fh:
        body = bytearray(fh.read())
        body[-1] ^= 0xFF
        fh.seek(0)
        fh.write(body)
    os.utime(pyc, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(pyc).st_size == st.st_size and os.stat(pyc).st_mtime_ns == st.st_mtime_ns
    assert agent_cache.check_compiled(archive.sha256(), str(cache)) is None
    assert ran_from(cache) == "zip"
    assert compiled(cache)
    assert ran_from(cache) == "compiled"
    with open(_pyc(base, "core"), "rb") as fh:
        assert fh.read() != bytes(body)


def test_a_module_planted_in_the_compiled_copy_or_a_writable_file_is_refused(tmp_path):
    """A module added beside vpd_agent (it would shadow the standard library's) moves its directory's stat: not
    used, rebuilt without it. A file made writable by others is never used, whatever its bytes."""
    cache, base = _fresh_compiled(tmp_path)
    with open(f"{base}/json.py", "w") as fh:
        fh.write("raise SystemExit('planted')\n")
    assert agent_cache.check_compiled(archive.sha256(), str(cache)) is None
    assert ran_from(cache) == "zip"
    assert compiled(cache) and not os.path.exists(f"{base}/json.py")
    os.chmod(_pyc(base), 0o666)
    assert agent_cache.check_compiled(archive.sha256(), str(cache)) is None
    assert ran_from(cache) == "zip"
    assert compiled(cache) and os.stat(_pyc(base)).st_mode & 0o777 == 0o600
    # a record others could write is not read at all
    os.chmod(f"{base}.rec", 0o622)
    assert agent_cache.check_compiled(archive.sha256(), str(cache)) is None
    assert ran_from(cache) == "zip"
    assert compiled(cache) and ran_from(cache) == "compiled"


def test_a_cache_directory_others_could_write_is_not_used(tmp_path):
    cache = tmp_path / "vpd-agent"
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    planted = cache / f"{archive.sha256()}.zip"
    planted.write_bytes(archive.archive())  # even the right bytes: the directory is not private
    p, lines = run("file_sha", {"path": "/"}, cache, inline=False)
    assert p.returncode == archive.NEED_EXIT
    p, lines = run("file_sha", {"path": "/"}, cache, inline=True)  # runs from a private temp file instead
    assert p.returncode == 0 and result(lines)["path"] == "/"
    assert os.stat(cache).st_mode & 0o777 == 0o755 and os.listdir(cache) == [planted.name]


def test_old_versions_are_pruned(tmp_path):
    cache = tmp_path / "vpd-agent"
    cache.mkdir(mode=0o700)
    now = time.time()
    for i, h in enumerate(["a" * 64, "b" * 64, "c" * 64, "d" * 64]):
        for name in (f"{h}.zip", f"{h}.cpython-399.{'e' * 64}.zip"):
            (cache / name).write_bytes(b"old")
            os.utime(cache / name, (now - 1000 + i, now - 1000 + i))
    run("file_sha", {"path": "/"}, cache, inline=True)
    left = sorted(n for n in os.listdir(cache) if n.count(".") == 1)
    assert left == sorted(["c" * 64 + ".zip", "d" * 64 + ".zip", archive.sha256() + ".zip"])  # the newest 3
    assert not any(n.startswith(("a" * 64, "b" * 64)) for n in os.listdir(cache))  # with their compiled copies


def test_status_imports_only_what_status_needs(tmp_path):
    cache = tmp_path / "vpd-agent"
    probe = (b"import atexit, sys\natexit.register(lambda: sys.stderr.write('MODS ' + ' '.join(sorted("
             b"m for m in sys.modules if m.startswith('vpd_agent'))) + '\\n'))\n")
    p, lines = run("status", {"state_dir": str(tmp_path / "st"), "nvidia_smi_timeout_s": 1}, cache, inline=True,
                   prefix=probe)
    assert "state" in result(lines)
    mods = p.stderr.decode().split("MODS ", 1)[1].split()
    for never in ("install", "runner", "doctor", "verify", "stack", "hub", "drafter", "launch", "ready", "probe"):
        assert f"vpd_agent.{never}" not in mods, mods
    assert "vpd_agent.status" in mods


def test_each_exec_sends_a_small_bootstrap_not_the_agent():
    boot = archive.cache_bootstrap("/var/lib/vllm-pve-deploy/vpd-agent")
    # < 3 KB: the record check of the compiled copy (issue 54) took it past 2 KB; it goes on the command line
    assert len(boot) < 3072 and archive.sha256().encode() in boot
    assert len(archive.archive()) > 10 * len(boot)
    assert archive.archive() == archive._build.__wrapped__()  # the same bytes for the same sources


def test_the_archive_hash_is_kept_with_its_sources_stats_and_a_record_that_lies_is_caught(tmp_path):
    """Issue 54: the archive's sha256 comes from the workstation's record while the sources' stats are unchanged
    (no zip built in a deploy that sends only the bootstrap); bytes that do not match the record are never sent:
    the record is removed and the error says so."""
    code = ("import json, sys\nfrom orchestrator.agent import archive\nprint(archive.sha256())\n"
            "try:\n    archive.archive()\nexcept Exception as e:\n    print('ERR', e)\n")
    env = dict(os.environ, DEPLOY_STATE_DIR=str(tmp_path))

    def run():
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                              ).stdout.split("\n")

    first = run()
    assert first[0] == archive.sha256() and not first[1].startswith("ERR")
    rec = json.loads((tmp_path / archive.ARCHIVE_RECORD).read_text())
    assert rec["sha256"] == archive.sha256()
    assert run()[0] == archive.sha256()  # from the record
    rec["sha256"] = "0" * 64
    (tmp_path / archive.ARCHIVE_RECORD).write_text(json.dumps(rec))
    lied = run()
    assert lied[0] == "0" * 64 and lied[1].startswith("ERR ") and "does not match its sources" in lied[1]
    assert not (tmp_path / archive.ARCHIVE_RECORD).exists()
    assert run()[0] == archive.sha256()  # computed again, recorded again


def test_the_agent_modules_import_each_other_without_cycles_and_remote_imports_no_agent():
    graph = {}
    for name in os.listdir(CONTAINER):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(CONTAINER, name)).read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[name[:-3]] = deps

    def visit(n, path):
        assert n not in path, " -> ".join(path + [n])
        for d in graph.get(n, ()):
            visit(d, path + [n])

    for n in graph:
        visit(n, [])
    remote = ast.parse(open(os.path.join(REPO, "orchestrator", "core", "remote.py")).read())
    imported = [getattr(x, "module", None) or "" for x in ast.walk(remote) if isinstance(x, ast.ImportFrom)]
    assert not [m for m in imported if "agent" in m], imported


def test_the_agents_json_codec_reads_and_writes_what_json_does():
    """Issue 54: the agent encodes and decodes JSON with `_json` (json's own C codec) without importing `json`
    (which loads `re`): the same text out, the same values in, ValueError for what json refuses."""
    import math

    code = ("import json, sys\nsys.path.insert(0, %r)\n" % os.path.dirname(CONTAINER) +
            "import container.core as c\n"
            "print(json.dumps([c.loads.__module__, c.dumps.__module__]))\n")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout) == ["container.core"] * 2, out.stderr  # not json's
    samples = [{"a": [1, 2.5, -0.0, 1e300, None, True, False, "é\u2028\x00\n\"\\"], "": {}, "k": []}, "x", 3, [],
               {"nested": [{"deep": [[[]]]}]}, 12345678901234567890, "\U0001f600"]
    for obj in samples:
        assert agent_core.dumps(obj) == json.dumps(obj)
        text = json.dumps(obj, indent=1)
        assert agent_core.loads(text) == json.loads(text) == obj
        assert agent_core.loads(" \n" + text.encode().decode() + "\r\n\t") == obj
        assert agent_core.loads(text.encode()) == obj
    assert agent_core.dumps({1: 2}) == json.dumps({1: 2})
    assert math.isinf(agent_core.loads("[Infinity]")[0]) and math.isnan(agent_core.loads("NaN"))
    for bad in ["", " ", "[1,", "[1] 2", "{'a': 1}", '"unterminated', "nul", "[1]x", "01"]:
        with pytest.raises(ValueError):
            json.loads(bad)
        with pytest.raises(ValueError):
            agent_core.loads(bad)
    with pytest.raises(TypeError):
        agent_core.dumps({"a": object()})
    with pytest.raises(ValueError):
        loop = []
        loop.append(loop)
        agent_core.dumps(loop)
