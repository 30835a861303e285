"""Fake vLLM of the vllm-pve-deploy test bed (installed as the package ``vllm`` in a simulated container).

Import is cheap (no transformers): it re-syncs the on-disk layout with the container's faults file (version,
build, fix markers, extension files), then checks its compiled extensions like a broken build would fail.
"""

import os as _os

from vllm import _layout

_pkg_dir = _os.path.dirname(_os.path.abspath(__file__))
_build_info = _layout.sync_with_faults(_pkg_dir)

for _rel in _build_info.get("extensions", ()):
    _path = _os.path.join(_pkg_dir, _rel)
    if not _os.path.exists(_path):
        raise ImportError(f"{_path}: cannot open shared object file: No such file or directory",
                          name="vllm." + _rel.split(".")[0].replace("/", "."), path=_path)

try:
    from vllm._version import __version__, __version_tuple__, __commit_id__  # noqa: F401
except ImportError:  # pragma: no cover - source tree without install_fake_vllm()
    __version__, __version_tuple__, __commit_id__ = "0.0.0.dev0", (0, 0, 0), "unknown"

__all__ = ["__version__", "__commit_id__"]
