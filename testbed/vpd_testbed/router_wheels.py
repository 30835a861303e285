"""The real vLLM Router for the test bed: `vllm-router` and its dependencies as wheels, downloaded once per machine
from PyPI into /var/cache/vpd-testbed/wheels/vllm-router-VERSION (about 30 MB), then copied into a container's
/root for `deploy up` (router.install.find_links, no_index: the containers have no route to PyPI).

    python -m vpd_testbed.router_wheels [VERSION]     # scripts/setup.sh runs it; prints the directory
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.1.17"


def cache_dir(version: str = VERSION) -> Path:
    base = Path(os.environ.get("VPD_LXC_CACHE") or "/var/cache/vpd-testbed")
    return base / "wheels" / f"vllm-router-{version}"


def wheelhouse(version: str = VERSION, timeout: float = 600) -> Path:
    """The directory with the wheels (downloaded first when not complete). Raises RuntimeError with pip's output."""
    d = cache_dir(version)
    done = d / ".complete"
    if done.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                        "--only-binary", ":all:", f"vllm-router=={version}", "-d", str(d)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode or not list(d.glob(f"vllm_router-{version}-*.whl")):
        raise RuntimeError(f"pip download vllm-router=={version} failed (exit {p.returncode}): {p.stdout[-2000:]}")
    done.write_text("ok\n")
    return d


if __name__ == "__main__":
    try:
        print(wheelhouse(sys.argv[1] if len(sys.argv) > 1 else VERSION))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"router wheels: {e}", file=sys.stderr)
        sys.exit(1)
