"""Install the fake vLLM into a site-packages directory (used by the test bed for each container venv).

    install_fake_vllm(site_packages_dir, version="0.34.0", build="release",
                      missing_extension=None, no_fix_markers=False)

copies ``vllm/`` and lays it out for that version (``_version.py``, fix-marker source files, empty compiled
extension files). These are the *base* parameters; at every ``import vllm`` the package re-lays itself out
if the container faults file (``/etc/vpd-testbed/faults.json`` or ``$VPD_FAKE_VLLM_FAULTS``) sets
``vllm_version`` / ``vllm_build`` / ``missing_extension`` / ``no_fix_markers`` (and back when they are
cleared). ``sync(site_packages_dir)`` does the same without importing (call it after changing a fault if
the tool might grep the files before importing vllm).
"""

from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_PKG = os.path.join(HERE, "vllm")

import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("_vpd_fake_vllm_layout", os.path.join(SOURCE_PKG, "_layout.py"))
_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layout)

PR40898_COMMIT = _layout.PR40898_COMMIT
CONSOLE_SCRIPT = "from vllm.entrypoints.cli.main import main; main()"


def install_fake_vllm(site_packages_dir, version="0.34.0", build="release", missing_extension=None,
                      no_fix_markers=False):
    """Copy the fake vllm package into site_packages_dir/vllm and lay it out. Returns the package dir."""
    if build not in ("release", "pr40898"):
        raise ValueError(f"unknown build {build!r} (release | pr40898)")
    dest = os.path.join(os.fspath(site_packages_dir), "vllm")
    if os.path.exists(dest):
        shutil.rmtree(dest)
    shutil.copytree(SOURCE_PKG, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    base = {"version": str(version), "build": build, "missing_extension": missing_extension or None,
            "no_fix_markers": bool(no_fix_markers)}
    eff = _layout.effective_params(base, None)
    _layout.apply_layout(dest, base, eff)
    return dest


def sync(site_packages_dir, faults_path=None):
    """Apply the faults file's vllm_version/vllm_build/missing_extension/no_fix_markers to the installed files."""
    dest = os.path.join(os.fspath(site_packages_dir), "vllm")
    old = os.environ.get("VPD_FAKE_VLLM_FAULTS")
    if faults_path:
        os.environ["VPD_FAKE_VLLM_FAULTS"] = os.fspath(faults_path)
    try:
        return _layout.sync_with_faults(dest)
    finally:
        if faults_path:
            if old is None:
                os.environ.pop("VPD_FAKE_VLLM_FAULTS", None)
            else:
                os.environ["VPD_FAKE_VLLM_FAULTS"] = old


def write_console_script(bin_dir, python_exe):
    """Write bin_dir/vllm, the console script as pip would."""
    path = os.path.join(os.fspath(bin_dir), "vllm")
    with open(path, "w") as f:
        f.write(f"#!{python_exe}\nimport sys\n{CONSOLE_SCRIPT.replace('main()', 'sys.exit(main())')}\n")
    os.chmod(path, 0o755)
    return path
