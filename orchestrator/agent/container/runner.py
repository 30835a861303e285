"""`install_run`: the detached install runner (its own session; stdout and stderr are the install log). A fresh
venv in ROOT.versions/, the installer (uv, or pip) with the phase read from its output, the new stack verified in
the new venv's own Python (stack_check), then the runtime link switched with one rename. install.py starts it,
follows it and rolls back."""

import os
import re
import signal
import stat as _stat
import subprocess
import sys
import time

from .core import ANSI, now
from .files import UnsafeDirectory, create_excl_path, lstat_at, open_dir, unique_name
from .install import (
    NotAVenv, _install_state, _record_switch, _save_install, install_phase, stack_check_in, venv_problem)
from .procs import proc_starttime


# pip's and uv's words for an index it could not reach (no network, no DNS, a proxy needed, a firewall)
NETWORK_ERRORS = re.compile(
    r"Failed to establish a new connection|Temporary failure in name resolution|Name or service not known|"
    r"Network is unreachable|No route to host|Connection refused|Connection timed out|ConnectTimeoutError|"
    r"Max retries exceeded|ProxyError|Could not fetch URL|dns error|error sending request|Failed to fetch|"
    r"tcp connect error|client error \(Connect\)")
OFFLINE_FIX = ("give the container a way to the index: its network and DNS (pip and uv honour HTTPS_PROXY), or "
               "requires.install.index_url: a mirror it reaches (a devpi or Artifactory proxy of PyPI); an offline "
               "(air-gapped) host installs from a wheelhouse: on a machine with access, `pip download vllm==VERSION "
               "-d wheelhouse` for the container's Python and platform, copy it into the container (root-owned, "
               "e.g. /root/wheelhouse), then requires.install: {find_links: [/root/wheelhouse], no_index: true} "
               "(docs/playbooks.md#offline-and-air-gapped-hosts), then deploy install-vllm again")


def network_failure(log_path, limit=65536):
    """The line of the install log that says the index was out of reach, or None."""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - limit))
            text = fh.read().decode("utf-8", "replace")
    except (OSError, TypeError):
        return None
    for ln in reversed(text.splitlines()):
        if NETWORK_ERRORS.search(ln):
            return ANSI.sub("", ln).strip()[:200]
    return None


def _pip_ok(base):
    """Can base's pip install into another interpreter (pip --python, pip >= 22.3)?"""
    try:
        p = subprocess.run([base, "-m", "pip", "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.match(r"pip (\d+)\.(\d+)", p.stdout.decode("utf-8", "replace"))
    return p.returncode == 0 and bool(m) and (int(m.group(1)), int(m.group(2))) >= (22, 3)


def index_opts(a):
    """The installer's index options from requires.install (index_url, find_links, no_index)."""
    return ((["--index-url", a["index_url"]] if a.get("index_url") else [])
            + [x for fl in a.get("find_links") or [] for x in ("--find-links", fl)]
            + (["--no-index"] if a.get("no_index") else []))


def act_install_run(a):
    """The detached runner (its own session; stdout/stderr are the install log): venv, install, verify, switch."""
    state_dir = a["state_dir"]
    st = _install_state(state_dir)
    if not st or st.get("id") != a["id"]:
        return {"ok": False, "message": "install.json does not describe install %s" % a["id"]}
    st.update(pid=os.getpid(), starttime=proc_starttime(os.getpid()))

    def phase(name, **kw):
        st.update(phase=name, **kw)
        _save_install(state_dir, st)
        print("[deploy] %s phase: %s (+%.1fs)" % (time.strftime("%H:%M:%S"), name, now() - st["t0"]), flush=True)

    def finish(status, message, fix=None, **kw):
        st.update(status=status, message=message, fix=fix, finished_at=now(), **kw)
        _save_install(state_dir, st)
        print("[deploy] %s: %s" % (status, message), flush=True)
        return {"ok": status == "ok"}

    stage, base, uv = st["stage"], st["base_python"], st.get("uv")
    spy = os.path.join(stage, "bin", "python")
    deadline = st["t0"] + float(st["timeout_s"])
    phase("venv")
    venv = [uv, "venv", "--python", base, stage] if uv else [base, "-m", "venv", "--without-pip", stage]
    rc, why = _run_logged(venv, deadline, None)
    if rc != 0:
        _remove_stage(stage)
        return finish("timeout" if why == "timeout" else "failed",
                      "build not finished: the time limit requires.install.timeout_s (%ss) was reached while creating "
                      "the venv" % st["timeout_s"] if why == "timeout" else
                      "creating the venv %s failed (%s)" % (stage, why),
                      fix="read the log %s in the container (its last lines are shown above)" % st["log"])
    what = [st["req"]]
    if a.get("hashes"):  # requires.install.hashes: a requirements file with the pinned hashes, --require-hashes
        rfd, _ = create_excl_path(stage, "deploy-requirements.txt")
        with os.fdopen(rfd, "w") as fh:
            fh.write("%s %s\n" % (st["req"], " ".join("--hash=%s" % h for h in a["hashes"])))
        what = ["--require-hashes", "-r", os.path.join(stage, "deploy-requirements.txt")]
    opts = index_opts(a) + what
    quiet = ["install", "--no-input", "--disable-pip-version-check", "--progress-bar", "off"]
    if uv:
        cmd = [uv, "pip", "install", "--python", spy] + opts
    elif _pip_ok(base):
        cmd = [base, "-m", "pip", "--python", spy] + quiet + opts
    else:
        rc, why = _run_logged([spy, "-m", "ensurepip", "--default-pip"], deadline, None)
        if rc != 0:
            _remove_stage(stage)
            return finish("failed", "no pip for %s: ensurepip failed (%s)" % (base, why),
                          fix="install uv in the container, or python3-venv (ensurepip), or set "
                              "requires.install.python to a Python with pip >= 22.3")
        cmd = [spy, "-m", "pip"] + quiet + opts
    st["phase"] = None
    rc, why = _run_logged(cmd, deadline, lambda p: p != st["phase"] and phase(p),
                          on_start=lambda pid: phase("download", child=pid))  # child: its own session
    if why == "timeout":
        _remove_stage(stage)
        return finish("timeout", "build not finished: the time limit requires.install.timeout_s (%ss) was reached "
                                 "in phase %s; the installer was stopped and the runtime was not switched"
                      % (st["timeout_s"], st["phase"]),
                      fix="raise requires.install.timeout_s in the playbook (a vLLM build from source can take an "
                          "hour), then deploy install-vllm again")
    if rc != 0:
        _remove_stage(stage)
        net = network_failure(st.get("log"))
        if net:  # the package index was out of reach: say so, and how an offline host installs (issue 53)
            return finish("failed", "%s exited with %s in phase %s: the container could not reach the package "
                                    "index (%s); the runtime was not switched" % ("uv" if uv else "pip", why,
                                                                                 st["phase"], net),
                          fix=OFFLINE_FIX)
        return finish("failed", "%s exited with %s in phase %s; the runtime was not switched"
                      % ("uv" if uv else "pip", why, st["phase"]),
                      fix="read the installer's error at the end of the log (shown above; all of it: %s in the "
                          "container), correct requires.vllm / requires.install, then deploy install-vllm again"
                          % st["log"])
    phase("verify")
    chk = stack_check_in(spy, st.get("check") or {}, max(30.0, min(600.0, deadline - now() + 120)))
    st["verify"] = chk
    if not chk.get("ok"):
        bad = [c for c in chk.get("checks", []) if not c["ok"] and c.get("severity", "error") == "error"]
        _remove_stage(stage)
        return finish("failed", "the new vLLM failed verification (%s); the runtime was not switched"
                      % ("; ".join("%s: %s" % (c["check"], c["reason"]) for c in bad) or chk.get("error")),
                      fix="install a vLLM that has what the playbook requires (requires.vllm, vllm_min_version, fixes)")
    phase("switch")
    try:
        prev, target = switch_runtime(st["venv_root"], stage)
    except (OSError, UnsafeDirectory) as e:
        return finish("failed", "verified, but switching %s to %s failed: %s" % (st["venv_root"], stage, e),
                      fix="check %s and its parent directory; the new venv is kept at %s" % (st["venv_root"], stage))
    _record_switch(state_dir, st["venv_root"], prev, target, st)
    return finish("ok", "vLLM %s installed in %s and verified; %s now points to it (previous: %s)"
                  % ((chk.get("stack") or {}).get("version"), stage, st["venv_root"], prev or "none"),
                  switched={"from": prev, "to": target}, version=(chk.get("stack") or {}).get("version"),
                  commit_id=(chk.get("stack") or {}).get("commit_id"))


def _remove_stage(stage):
    """Only a staging venv this install created, inside ROOT.versions/."""
    import shutil

    if stage and os.path.basename(os.path.dirname(stage)).endswith(".versions") and not os.path.islink(stage):
        shutil.rmtree(stage, ignore_errors=True)


def _run_logged(cmd, deadline, on_phase, on_start=None):
    """Run cmd in its own session, its output copied to our stdout (the log) line by line; the phase follows the
    output. At the deadline the whole session is stopped (TERM, then KILL): -> (returncode, 'exit N'|'timeout')."""
    import selectors

    print("[deploy] $ " + " ".join(cmd), flush=True)
    env = dict(os.environ, PIP_NO_INPUT="1", NO_COLOR="1", UV_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env, cwd="/")
    except OSError as e:
        return 127, "cannot run %s: %s" % (cmd[0], e.strerror)
    if on_start:
        on_start(p.pid)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    buf = b""
    timed_out = False
    while True:
        left = deadline - now()
        if left <= 0:
            timed_out = True
            break
        if not sel.select(timeout=min(left, 1.0)):
            continue
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        buf += chunk
        *done, buf = buf.split(b"\n")
        for ln in done:
            ph = install_phase(ANSI.sub("", ln.decode("utf-8", "replace")))
            if ph and on_phase:
                on_phase(ph)
    if timed_out:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except OSError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        p.wait()
        return -1, "timeout"
    rc = p.wait()
    return rc, "exit %d" % rc if rc >= 0 else "signal %d" % -rc


def switch_runtime(venv_root, target_dir):
    """Point venv_root at target_dir (a venv in venv_root.versions/) with one rename of a new symlink over it.
    A real directory there (the venv before deploy managed it) is first moved into .versions/ as original-*.
    -> (previous target or None, new target), both relative to venv_root's parent."""
    parent, name = os.path.split(venv_root.rstrip("/"))
    store = name + ".versions"
    if os.path.dirname(target_dir.rstrip("/")) != os.path.join(parent, store):
        raise ValueError("%s is not in %s" % (target_dir, os.path.join(parent, store)))
    new = store + "/" + os.path.basename(target_dir.rstrip("/"))
    pfd = open_dir(parent)
    try:
        st = lstat_at(name, pfd)
        prev = None
        if st is not None and _stat.S_ISLNK(st.st_mode):
            prev = os.readlink(name, dir_fd=pfd)
        elif st is not None and _stat.S_ISDIR(st.st_mode):
            why = venv_problem(venv_root)
            if why:
                raise NotAVenv(why)
            sfd = open_dir(os.path.join(parent, store))
            try:
                orig = "original-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                os.rename(name, orig, src_dir_fd=pfd, dst_dir_fd=sfd)
            finally:
                os.close(sfd)
            prev = store + "/" + orig
        elif st is not None:
            raise ValueError("%s is neither a directory nor a symlink" % venv_root)
        tmp = unique_name(".%s.link-" % name)
        os.symlink(new, tmp, dir_fd=pfd)
        try:
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except OSError:
            os.unlink(tmp, dir_fd=pfd)
            raise
        os.fsync(pfd)
    finally:
        os.close(pfd)
    return prev, new
