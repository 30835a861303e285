"""Real wheels of the fake vLLM, and a git repository that builds them (for `deploy install-vllm` on the test bed).

    make_wheel(out_dir, version="0.34.0", build="release", no_fix_markers=False, pth="") -> wheel path
    wheelhouse(dir, pth) -> {name: wheel path}     the standard set, built once per directory (cached)
    make_git_repo(dir, pth) -> dir                  branches main (0.34.0 release) and dflash-swa-support
                                                   (the PR #40898 build)

A wheel is the fake package laid out for one version/build (``build.install_fake_vllm``), its dist-info
(METADATA, WHEEL, entry_points.txt with the ``vllm`` console script) and a RECORD with every file's sha256, so
pip/uv install it like any wheel and the RECORD check can hold the result against it. ``pth``: the lines of a
``_vpd_testbed_site.pth`` shipped in the wheel, standing in for vLLM's dependencies (the test bed's
transformers) in the fresh venv an install creates.

This file is also the repository's in-tree PEP 517 build backend (stdlib only, ``build-system.requires = []``,
so pip builds it with ``--no-index``): ``vpd_build.json`` in the source tree says what to build, and a file
``/root/src/build_s`` (seconds, optional) makes the build phase take that long, printing a line every 0.2 s.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ZIP_DATE = (2026, 1, 1, 0, 0, 0)
BUILD_S_FILE = "/root/src/build_s"
BRANCH = "dflash-swa-support"
STANDARD = {  # name -> (version, build, no_fix_markers)
    "0.34.0": ("0.34.0", "release", False),
    "0.30.0": ("0.30.0", "release", False),
    "0.33.0-nofix": ("0.33.0", "release", True),  # a release whose DFlash fix markers are missing
}


def _layout(pkg_dir):
    spec = importlib.util.spec_from_file_location("_vpd_wheel_layout", os.path.join(pkg_dir, "_layout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lay_out(src_pkg, dest_site, version, build, no_fix_markers):
    """Copy the fake vllm package into dest_site/vllm laid out for this version (as build.install_fake_vllm)."""
    dest = os.path.join(dest_site, "vllm")
    shutil.copytree(src_pkg, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    lay = _layout(dest)
    base = {"version": str(version), "build": build, "missing_extension": None, "no_fix_markers": bool(no_fix_markers)}
    lay.apply_layout(dest, base, lay.effective_params(base, None))
    return lay.version_string(str(version), build)


def _dist_info(vstr):
    return {
        "METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: fake vLLM of the vllm-pve-deploy "
                    "test bed\n" % vstr,
        "WHEEL": "Wheel-Version: 1.0\nGenerator: vpd-testbed\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "entry_points.txt": "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n",
        "top_level.txt": "vllm\n",
    }


def _b64(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def _zip(out_dir, site, vstr, pth):
    name = "vllm-%s-py3-none-any.whl" % vstr
    di = "vllm-%s.dist-info" % vstr
    entries = []
    for root, dirs, files in os.walk(site):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")  # wheels ship sources; installers compile
        for f in sorted(files):
            p = os.path.join(root, f)
            entries.append((os.path.relpath(p, site).replace(os.sep, "/"), open(p, "rb").read()))
    if pth:
        entries.append(("_vpd_testbed_site.pth", pth.encode()))
    entries += [("%s/%s" % (di, k), v.encode()) for k, v in _dist_info(vstr).items()]
    record = "".join("%s,sha256=%s,%d\n" % (n, _b64(d), len(d)) for n, d in entries) + "%s/RECORD,,\n" % di
    entries.append(("%s/RECORD" % di, record.encode()))
    path = os.path.join(out_dir, name)
    tmp = path + ".tmp%d" % os.getpid()
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in entries:
            zi = zipfile.ZipInfo(n, ZIP_DATE)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, d)
    os.replace(tmp, path)
    return path


def make_wheel(out_dir, version="0.34.0", build="release", no_fix_markers=False, pth="", src_pkg=None):
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as site:
        vstr = _lay_out(src_pkg or os.path.join(HERE, "vllm"), site, version, build, no_fix_markers)
        return _zip(out_dir, site, vstr, pth)


def wheelhouse(out_dir, pth=""):
    """The standard wheels in out_dir, built once (a stamp names what was built with which .pth)."""
    stamp = os.path.join(out_dir, ".built.json")
    want = {"standard": {k: list(v) for k, v in STANDARD.items()}, "pth": pth}
    try:
        with open(stamp) as fh:
            got = json.load(fh)
        if got.get("want") == want and all(os.path.exists(p) for p in got["wheels"].values()):
            return got["wheels"]
    except (OSError, ValueError, KeyError):
        pass
    wheels = {k: make_wheel(out_dir, *v, pth=pth) for k, v in STANDARD.items()}
    with open(stamp, "w") as fh:
        json.dump({"want": want, "wheels": wheels}, fh)
    return wheels


def make_git_repo(dest, pth=""):
    """A git repository of the fake vLLM that pip/uv build from source: main builds 0.34.0, BRANCH the PR build."""
    if os.path.exists(os.path.join(dest, ".git")):
        return dest
    os.makedirs(dest, exist_ok=True)
    shutil.copytree(os.path.join(HERE, "vllm"), os.path.join(dest, "vllm"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.abspath(__file__), os.path.join(dest, "vpd_fake_backend.py"))
    with open(os.path.join(dest, "pyproject.toml"), "w") as fh:
        fh.write('[build-system]\nrequires = []\nbuild-backend = "vpd_fake_backend"\nbackend-path = ["."]\n')
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@invalid", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@invalid", GIT_AUTHOR_DATE="2026-01-01T00:00:00Z",
               GIT_COMMITTER_DATE="2026-01-01T00:00:00Z", GIT_CONFIG_GLOBAL="/dev/null", GIT_CONFIG_NOSYSTEM="1")

    def git(*args):
        subprocess.run(["git", "-C", dest] + list(args), check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)

    def config(version, build):
        with open(os.path.join(dest, "vpd_build.json"), "w") as fh:
            json.dump({"version": version, "build": build, "pth": pth}, fh)

    git("init", "-q", "-b", "main")
    config("0.34.0", "release")
    git("add", "-A")
    git("commit", "-q", "-m", "fake vLLM 0.34.0")
    git("checkout", "-q", "-b", BRANCH)
    config("0.34.0", "pr40898")
    git("commit", "-q", "-am", "DFlash sliding-window support (PR #40898)")
    git("checkout", "-q", "main")
    return dest


# ---------------------------------------------------------------- PEP 517 backend (in the git repository)


def _config():
    with open("vpd_build.json") as fh:
        return json.load(fh)


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    c = _config()
    with tempfile.TemporaryDirectory() as site:
        vstr = _lay_out(os.path.abspath("vllm"), site, c["version"], c["build"], c.get("no_fix_markers"))
    di = "vllm-%s.dist-info" % vstr
    os.makedirs(os.path.join(metadata_directory, di), exist_ok=True)
    for k, v in _dist_info(vstr).items():
        with open(os.path.join(metadata_directory, di, k), "w") as fh:
            fh.write(v)
    return di


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    c = _config()
    try:
        with open(BUILD_S_FILE) as fh:
            build_s = float(fh.read().strip() or 0)
    except (OSError, ValueError):
        build_s = 0.0
    end = time.time() + build_s
    n = 0
    while time.time() < end:  # the "compile": a long build, with output
        n += 1
        print("[%d] Building CXX object csrc/fake_%d.cu.o" % (n, n), file=sys.stderr, flush=True)
        time.sleep(0.2)
    return os.path.basename(make_wheel(wheel_directory, c["version"], c["build"], c.get("no_fix_markers"),
                                       pth=c.get("pth") or "", src_pkg=os.path.abspath("vllm")))
