"""`install_vllm`: probe, start, attach, rollback. The runtime venv (the directory holding runtime.python's bin/)
becomes a symlink into ROOT.versions/, one venv per install; `start` launches the detached runner (runner.py), which
installs into a fresh venv there and switches the link (one rename) only after it verified; `attach` follows it;
the previous venv stays on disk for `rollback`. The runner and a staging venv's Python get this agent on stdin
(cache.program: the cached archive inline, then the bootstrap)."""

import stat as _stat
import json
import os
import re
import subprocess
import sys

from . import core
from .core import clean, emit, now
from .files import (
    follow_runner, lock_held,
    UnsafeDirectory, _read_json, new_runner_log, open_dir, runner_env, runner_id,
    spawn_runner, tail_file, take_runner_lock, unique_name, why_untrusted, write_json_atomic)
from .state import read_state


INSTALL_STATE = "install.json"
INSTALL_LOCK = "install.lock"
RUNTIME_FILE = "runtime.json"
INSTALL_VAR = "VLLM_PVE_DEPLOY_INSTALL"
INSTALL_FINAL = ("ok", "failed", "timeout", "killed")

INSTALL_PHASES = [  # over pip's and uv's output, first match wins
    ("install", re.compile(r"^\s*(Installing collected packages|Successfully installed|Installed \d+ packages?|"
                           r"Installing wheels|Uninstalled \d+ package)")),
    ("build", re.compile(r"^\s*(Building wheels? for|Building \S+ @|Built \S+|Running setup\.py|Installing build "
                         r"dependencies|Getting requirements to build|Preparing metadata|Building editable|"
                         r"running build|\[\d+/\d+\] )")),
    ("download", re.compile(r"^\s*(Collecting|Downloading|Obtaining|Cloning|Looking in|Processing|Resolved \d+|"
                            r"Updating |Updated |Fetched|Downloaded|Prepared \d+|Requirement already satisfied)")),
]


PHASE_LINE = re.compile(r"^\[deploy\] \S+ phase: (\w+) \(\+([0-9.]+)s\)$")


def install_phase(line):
    for name, rx in INSTALL_PHASES:
        if rx.search(line):
            return name
    return None


def _base_python():
    return getattr(sys, "_base_executable", None) or sys.executable


def runtime_paths(a):
    py = a["python"]
    bindir = os.path.dirname(py)
    root = os.path.dirname(bindir)
    if os.path.basename(bindir) != "bin" or root in ("", "/"):
        raise ValueError("runtime.python %s is not in a venv's bin/ directory: install-vllm manages a venv "
                         "(ROOT/bin/python)" % py)
    if a.get("vllm") and os.path.dirname(os.path.dirname(a["vllm"])) != root:
        raise ValueError("runtime.vllm %s is not in the venv %s of runtime.python: the venv install-vllm switches "
                         "would not be the one deploy launches" % (a["vllm"], root))
    return root, root + ".versions"


# Prefixes install-vllm never moves aside, whatever they hold (issue 22: with runtime.python /usr/bin/python3 the
# "venv root" was /usr).
SYSTEM_PREFIXES = ("/", "/usr", "/usr/local", "/opt", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/var", "/root",
                   "/home", "/srv", "/tmp", "/snap")


NOT_A_VENV_FIX = ("make a venv for vLLM and point the runtime at it: python3 -m venv /opt/vllm-venv, then set "
                  "runtime.python: /opt/vllm-venv/bin/python and runtime.vllm: /opt/vllm-venv/bin/vllm (inventory or "
                  "playbook) and run deploy install-vllm again")


class NotAVenv(ValueError):
    fix = NOT_A_VENV_FIX


def venv_problem(path):
    """None if PATH is a real venv deploy may move aside: pyvenv.cfg (a root-owned regular file), the directory
    root-owned and not writable by group/others, not a system prefix or a conda installation; else why not."""
    real = os.path.realpath(path)
    if real.rstrip("/") in SYSTEM_PREFIXES or path.rstrip("/") in SYSTEM_PREFIXES:
        return "%s is a system prefix, not a venv" % path
    if os.path.isdir(os.path.join(real, "conda-meta")):
        return "%s is a conda installation (conda-meta/), not a venv" % path
    try:
        dst = os.lstat(real)
    except OSError as e:
        return "%s: %s" % (path, e.strerror)
    if not _stat.S_ISDIR(dst.st_mode):
        return "%s is not a directory" % path
    if dst.st_uid != 0 or dst.st_mode & 0o022:
        return "%s is owned by uid %d with mode %o: a runtime deploy runs as root must be root-owned and not " \
               "writable by group or others" % (path, dst.st_uid, dst.st_mode & 0o7777)
    try:
        cst = os.lstat(os.path.join(real, "pyvenv.cfg"))
    except OSError:
        return "%s has no pyvenv.cfg: it is not a venv" % path
    if not _stat.S_ISREG(cst.st_mode) or cst.st_uid != 0:
        return "%s/pyvenv.cfg is not a root-owned regular file" % path
    return None


def runtime_info(a):
    root, store = runtime_paths(a)
    info = {"venv_root": root, "store": store, "python": a["python"], "python_exists": os.path.exists(a["python"])}
    try:
        st = os.lstat(root)
    except OSError:
        info["kind"] = "missing"
        if root.rstrip("/") in SYSTEM_PREFIXES:
            raise NotAVenv("runtime.python %s: %s is a system prefix, not a venv; install-vllm refuses it "
                           "(nothing was changed)" % (a["python"], root))
        return info
    if _stat.S_ISLNK(st.st_mode):
        info.update(kind="symlink", target=os.readlink(root), real=os.path.realpath(root))
    elif _stat.S_ISDIR(st.st_mode):
        info.update(kind="dir", real=root)
    else:
        info["kind"] = "other"
        return info
    why = venv_problem(root)
    if why:
        raise NotAVenv("runtime.python %s: %s; install-vllm manages only a venv and refuses to move it aside "
                       "(nothing was changed)" % (a["python"], why))
    return info


def _install_state(state_dir):
    return _read_json(os.path.join(state_dir, INSTALL_STATE))


def _save_install(state_dir, st):
    write_json_atomic(os.path.join(state_dir, INSTALL_STATE), st)


def install_status(state_dir, check_timeout=120):
    """install.json (plus `elapsed`, in the container's clock), with a runner that died (SIGKILL, OOM, a reboot)
    turned into status 'killed' and its staging venv checked (RECORD, import) so the report says what it left."""
    st = _install_status(state_dir, check_timeout)
    if st and st.get("t0"):
        st["elapsed"] = round((st.get("finished_at") or now()) - st["t0"], 1)
    return st


def _install_status(state_dir, check_timeout):
    st = _install_state(state_dir)
    if not st or st.get("status") != "running" or lock_held(state_dir, INSTALL_LOCK):
        return st
    st = _install_state(state_dir) or st  # it may have finished between the two reads
    if st.get("status") != "running":
        return st
    stage = st.get("stage")
    check = None
    if stage and os.path.exists(os.path.join(stage, "bin", "python")):
        check = stack_check_in(os.path.join(stage, "bin", "python"), st.get("check") or {}, check_timeout)
    st.update(status="killed", finished_at=now(), verify=check,
              message="the install process ended without a result (killed, or the container restarted) in phase "
                      "%s, %.0fs after it started; the runtime was not switched" % (st.get("phase"),
                                                                                    now() - st.get("t0", now())),
              fix="run deploy install-vllm again (a fresh venv; the incomplete one is left at %s: rm -rf it)" % stage)
    _save_install(state_dir, st)
    return st


def _agent_source():
    """This agent as a program for another interpreter's stdin (the detached runner, a staging venv's Python):
    the archive it runs from, inline, and the bootstrap (cache.py)."""
    from .cache import program

    a = core.ARCHIVE
    return program(a["sha256"], a["cache_dir"], a["path"])


def stack_check_in(python, check_args, timeout):
    """Run action stack_check in another interpreter (a staging venv's), this agent on its stdin."""
    try:
        p = subprocess.run([python, "-", "stack_check", json.dumps(check_args)], input=_agent_source(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, cwd="/")
    except subprocess.TimeoutExpired:
        return {"ok": False, "checks": [], "error": "the check did not finish within %ss" % timeout}
    except OSError as e:
        return {"ok": False, "checks": [], "error": "cannot run %s: %s" % (python, e.strerror)}
    for line in p.stdout.decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and "result" in msg:
            return msg["result"]
    err = p.stderr.decode("utf-8", "replace").strip().splitlines()
    return {"ok": False, "checks": [], "error": "%s exited %d: %s" % (python, p.returncode, err[-1] if err else "")}


def _find_uv():
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin") + ":/root/.local/bin:/root/.cargo/bin"
    import shutil

    return shutil.which("uv", path=path)


def serving_now(state_dir):
    st = read_state(state_dir)
    if st and st.get("alive"):
        return {"pid": st.get("pid"), "playbook": st.get("playbook"), "argv0": (st.get("argv") or [None])[0]}
    return None


def _pointer(state_dir):
    return _read_json(os.path.join(state_dir, RUNTIME_FILE))


def act_install_vllm(a):
    op = a["op"]
    state_dir = a["state_dir"]
    try:
        info = runtime_info(a)
    except ValueError as e:
        return {"ok": False, "message": str(e), "fix": getattr(e, "fix", None)
                or "set runtime.python and runtime.vllm to ROOT/bin/python and ROOT/bin/vllm of one venv"}
    if op == "probe":
        return {"ok": True, "runtime": info, "install": install_status(state_dir), "serving": serving_now(state_dir),
                "pointer": _pointer(state_dir), "agent_python": sys.executable}
    if op == "start":
        res = _install_start(a, info)
        if not res.get("started") or not a.get("follow_s"):
            return res
        a = dict(a, id=res["id"], log_pos=0)
    if op in ("start", "attach"):
        return _install_follow(a)
    if op == "rollback":
        return _rollback(a, info)
    return {"ok": False, "message": "unknown op %r" % op}


def _install_start(a, info):
    state_dir = a["state_dir"]
    if info["kind"] == "other":
        return {"ok": False, "message": "%s is neither a directory nor a symlink" % info["venv_root"],
                "fix": "move it away, or set runtime.python to a venv"}
    base = a.get("base_python") or _base_python()
    if not os.path.exists(base):
        return {"ok": False, "message": "the base Python %s does not exist in the container" % base,
                "fix": "set requires.install.python to a Python that exists there (e.g. /usr/bin/python3)"}
    installer = a.get("installer") or "auto"
    uv = _find_uv() if installer in ("auto", "uv") else None
    if installer == "uv" and not uv:
        return {"ok": False, "message": "requires.install.installer is uv, but no uv on PATH, ~/.local/bin or "
                                        "~/.cargo/bin in the container",
                "fix": "install uv in the container (pip install uv), or set requires.install.installer: pip"}
    why = _install_source_problem(a)
    if why:
        return {"ok": False, "message": "refusing to install from %s: deploy installs it as root and then runs it; "
                                        "nothing was changed" % why,
                "fix": "keep wheels, git repositories and find_links directories in root-owned directories that "
                       "others cannot write (e.g. chown -R root:root DIR && chmod -R go-w DIR), then retry"}
    try:
        os.close(open_dir(os.path.dirname(info["venv_root"])))
        sfd = open_dir(info["store"], 0o755)
        dfd = open_dir(state_dir, 0o700)
    except (UnsafeDirectory, OSError) as e:
        return {"ok": False, "message": "refusing to install next to %s: %s" % (info["venv_root"], e),
                "fix": "fix the directory's owner/mode as the message says"}
    try:
        lock_fd = take_runner_lock(dfd, INSTALL_LOCK)
        if lock_fd is None:
            return {"ok": True, "started": False, "install": install_status(state_dir)}
        iid = runner_id()
        label = re.sub(r"[^A-Za-z0-9._-]+", "-", a.get("label") or "vllm")[:60].strip("-.") or "vllm"
        stage_name = "%s-%s" % (iid, label)
        os.mkdir(stage_name, 0o755, dir_fd=sfd)
        logname, logfd = new_runner_log(dfd, "install", iid)
    finally:
        os.close(sfd)
        os.close(dfd)
    stage = os.path.join(info["store"], stage_name)
    st = {"id": iid, "status": "running", "phase": "starting", "spec": a.get("spec"), "req": a["req"],
          "stage": stage, "venv_root": info["venv_root"], "log": os.path.join(state_dir, logname),
          "installer": "uv" if uv else "pip", "uv": uv, "base_python": base, "started_at": now(), "t0": now(),
          "timeout_s": float(a["timeout_s"]), "check": a.get("check") or {}, "reported": False,
          "previous_real": info.get("real")}
    _save_install(state_dir, st)
    args = {"state_dir": state_dir, "id": iid, "lock_fd": lock_fd, "python": a["python"],
            "index_url": a.get("index_url"), "find_links": a.get("find_links") or [], "no_index": a.get("no_index"),
            "hashes": a.get("hashes") or []}
    try:
        proc = spawn_runner([base, "-", "install_run", json.dumps(args)], _agent_source(), logfd, lock_fd,
                            runner_env(INSTALL_VAR, iid))
    except OSError as e:
        st.update(status="failed", message="cannot start the install runner with %s: %s" % (base, e.strerror),
                  fix="set requires.install.python to a working Python in the container", finished_at=now())
        _save_install(state_dir, st)
        return {"ok": False, "message": st["message"], "fix": st["fix"]}
    finally:
        os.close(logfd)
        os.close(lock_fd)
    return {"ok": True, "started": True, "id": iid, "pid": proc.pid, "stage": stage, "log": st["log"],
            "installer": st["installer"], "base_python": base}


def _protocol_line(ln):
    """The runner's own result line ({"result": ..., "protocol": N}) at the end of the install log: internal, not
    something to show a person (issue 26)."""
    return ln.startswith('{"result"') and '"protocol"' in ln


def _install_follow(a):
    """Follow an install (events: phase changes, log lines, heartbeats every heartbeat_s without a phase) until it
    ends or follow_s passes (files.follow_runner)."""
    state_dir = a["state_dir"]
    beat = float(a.get("heartbeat_s") or 30)
    seen = {"beat": now(), "phase": None, "last": "", "n": 0}

    def on_line(ln):  # phases come from the runner's own lines in the log: in order, none missed
        if _protocol_line(ln):
            return
        seen["n"] += 1
        seen["last"] = clean(ln)
        m = PHASE_LINE.match(seen["last"])
        if m:
            seen["phase"] = m.group(1)
            emit(event="install", kind="phase", phase=seen["phase"], elapsed=float(m.group(2)))
            seen["beat"] = now()
        else:
            emit(event="install", kind="line", line=seen["last"])

    def tick(st):
        if now() - seen["beat"] >= beat:
            seen["beat"] = now()
            emit(event="install", kind="heartbeat", phase=seen["phase"], elapsed=round(now() - st.get("t0", now()), 1),
                 lines=seen["n"], last=seen["last"])

    def finish(st, pos):
        tail = [ln for ln in tail_file(st["log"], 31) if not _protocol_line(ln)][-30:] \
            if st.get("status") != "ok" and st.get("log") else []
        return {"ok": True, "done": True, "install": st, "log_pos": pos, "log_tail": tail,
                "pointer": _pointer(state_dir)}

    return follow_runner(a, "install", lambda: install_status(state_dir), lambda st: _save_install(state_dir, st),
                         INSTALL_FINAL, on_line, finish, tick)


def _install_source_problem(a):
    """A local source (wheel file, git+file repository, find_links directory, file:// index) that another user
    owns or may write: deploy would install as root what they chose."""
    from urllib.parse import urlsplit

    paths = []
    req = a.get("req") or ""
    if req.startswith("/"):
        paths.append(req)
    elif req.startswith("git+file://"):
        p = urlsplit(req[4:]).path
        paths.append(p.rsplit("@", 1)[0] if "@" in os.path.basename(p) else p)
    for v in list(a.get("find_links") or []) + [a.get("index_url") or ""]:
        if v.startswith("/"):
            paths.append(v)
        elif v.startswith("file://"):
            paths.append(urlsplit(v).path)
    for p in paths:
        why = why_untrusted(p)
        if why:
            return why
    return None


def _record_switch(state_dir, venv_root, prev, new, st=None):
    p = _pointer(state_dir) or {}
    hist = list(p.get("history") or [])[-19:]
    hist.append({"at": now(), "from": prev, "to": new, "install": (st or {}).get("id"), "spec": (st or {}).get("spec"),
                 "rollback": st is None})
    write_json_atomic(os.path.join(state_dir, RUNTIME_FILE),
                      {"venv_root": venv_root, "current": new, "previous": prev, "history": hist})


def _rollback(a, info):
    state_dir = a["state_dir"]
    p = _pointer(state_dir)
    if not p or not p.get("previous"):
        return {"ok": False, "message": "no previous vLLM runtime recorded in %s/%s: nothing to roll back to"
                                        % (state_dir, RUNTIME_FILE),
                "fix": "deploy install-vllm PLAYBOOK installs one (the one it replaces becomes the previous)"}
    if lock_held(state_dir, INSTALL_LOCK):
        return {"ok": False, "message": "an install is running (deploy install-vllm PLAYBOOK re-attaches to it)",
                "fix": "wait for it to finish, then roll back"}
    parent = os.path.dirname(info["venv_root"])
    prev_dir = os.path.join(parent, p["previous"])
    if not os.path.exists(os.path.join(prev_dir, "bin", "python")):
        return {"ok": False, "message": "the previous runtime %s is gone (no bin/python)" % prev_dir,
                "fix": "install the vLLM you want with deploy install-vllm PLAYBOOK"}
    if info.get("kind") != "symlink" or info.get("target") != p.get("current"):
        return {"ok": False, "message": "%s is %s, not the link deploy set (%s): something else changed it"
                                        % (info["venv_root"], info.get("target") or info.get("kind"), p.get("current")),
                "fix": "look at %s; deploy install-vllm PLAYBOOK installs afresh" % info["venv_root"]}
    # the previous build is whatever it was: no exact version to match, and a venv deploy did not install (the
    # original one) may have no RECORD
    chk = stack_check_in(os.path.join(prev_dir, "bin", "python"),
                         dict(a.get("check") or {}, version=None, record_required=False), 180)
    tmp = unique_name(".%s.link-" % os.path.basename(info["venv_root"]))
    pfd = open_dir(parent)
    try:
        os.symlink(p["previous"], tmp, dir_fd=pfd)
        os.rename(tmp, os.path.basename(info["venv_root"]), src_dir_fd=pfd, dst_dir_fd=pfd)
        os.fsync(pfd)
    finally:
        os.close(pfd)
    _record_switch(state_dir, info["venv_root"], p["current"], p["previous"])
    return {"ok": True, "rolled_back": True, "from": p["current"], "to": p["previous"], "verify": chk,
            "runtime": runtime_info(a)}
