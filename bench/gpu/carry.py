"""What the real-GPU check carries to a lent GPU machine, which reaches no package registry (issue 55).

    python bench/gpu/carry.py build [DEST]     # here (a machine that reaches the registries): build DEST (gpu-carry/)
    python bench/gpu/carry.py size [DEST]      # its size and what is in it
    python bench/gpu/carry.py setup [DEST]     # there, as root: install what that machine lacks from DEST

DEST (default `gpu-carry/` in the repository, git-ignored) holds:

- `site/`: the project's own dependencies that the GPU machine's image lacks (fabric, invoke, paramiko, decorator,
  Deprecated, tenacity, and paramiko's compiled needs bcrypt, cryptography, PyNaCl, cffi, pycparser), installed with
  `pip install --target` as CPython 3.12 manylinux x86_64 wheels, at the versions this checkout's venv runs. The
  image already has click, PyYAML, prometheus-client, transformers, safetensors, numpy, psutil, wrapt and torch.
  The check puts it on PYTHONPATH.
- `debs/`: this machine's Debian packages of the test bed's tools (openssh-server for `/usr/sbin/sshd`,
  openssh-client for `ssh`/`ssh-keygen`, psmisc for `fuser`, iproute2 for `ip`) and of the libraries they link
  (`apt-get download`). `setup` never unpacks a package into `/`: each is unpacked into a scratch folder and only
  the missing tools are copied to their places, and only the libraries whose soname the machine lacks into
  /usr/local/lib/vpd-gpu-carry (one `ld.so.conf.d` entry, then ldconfig); it adds the `sshd` privilege-separation
  user where there is none. What it did is printed, one line a thing.
- `MANIFEST.json`: what was put in, with versions and sizes.

The whole must stay within the device tool's 64 MiB (the working tree travels too): `build` refuses beyond
LIMIT_MIB and prints the size (`carries 23.4 MiB`).
"""
from __future__ import annotations

import glob
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / "gpu-carry"
LIMIT_MIB = 48.0  # of the device tool's 64 MiB a call; the rest is the working tree itself
PY_VERSION = "3.12"  # the GPU machine's python3 (/opt/torch/.venv, Python 3.12.3)
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
WHEELS = ("fabric", "invoke", "paramiko", "decorator", "Deprecated", "tenacity", "bcrypt", "cryptography", "PyNaCl",
          "cffi", "pycparser")
# the image's own: never carried (docs of the device tool, "Python packages already there")
ALREADY_THERE = ("click", "PyYAML", "prometheus_client", "transformers", "safetensors", "numpy", "psutil", "wrapt",
                 "torch")
# tool package -> {file in the package: where it goes on the GPU machine}
TOOLS = {
    "openssh-server": {"usr/sbin/sshd": "/usr/sbin/sshd"},
    "openssh-client": {"usr/bin/ssh": "/usr/bin/ssh", "usr/bin/ssh-keygen": "/usr/bin/ssh-keygen"},
    "psmisc": {"bin/fuser": "/usr/bin/fuser"},
    "iproute2": {"bin/ip": "/usr/bin/ip"},
}
LIBS = ("libaudit1", "libbpf1", "libbsd0", "libcap-ng0", "libcap2", "libcom-err2", "libcrypt1", "libelf1",
        "libgcrypt20", "libgpg-error0", "libgssapi-krb5-2", "libk5crypto3", "libkeyutils1", "libkrb5-3",
        "libkrb5support0", "liblz4-1", "liblzma5", "libmd0", "libmnl0", "libnsl2", "libpam0g", "libpcre2-8-0",
        "libselinux1", "libssl3", "libsystemd0", "libtirpc3", "libwrap0", "libzstd1", "zlib1g")
LIB_DIR = "/usr/local/lib/vpd-gpu-carry"


def say(msg):
    print("gpu-carry: " + msg, file=sys.stderr, flush=True)


class CarryError(Exception):
    pass


def size_bytes(path) -> int:
    n = 0
    for dp, _dn, fn in os.walk(path):
        for f in fn:
            try:
                n += os.lstat(os.path.join(dp, f)).st_size
            except OSError:
                pass
    return n


def mib(n) -> str:
    return "%.1f MiB" % (n / 2**20)


def pinned() -> list:
    """name==version of each carried wheel: the version this venv runs (what the tests ran against)."""
    out = []
    for name in WHEELS:
        try:
            out.append("%s==%s" % (name, md.version(name)))
        except md.PackageNotFoundError:
            raise CarryError("%s is not installed in %s: run scripts/setup.sh first (the carried versions are this "
                             "venv's)" % (name, sys.prefix)) from None
    return out


def build(dest: Path = DEFAULT_DEST) -> dict:
    dest = Path(dest)
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-carry-", dir=str(dest.parent)))
    try:
        reqs = pinned()
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--no-compile", "--only-binary=:all:", "--python-version", PY_VERSION, "--implementation", "cp",
               "--abi", "cp" + PY_VERSION.replace(".", ""), "--abi", "abi3", "--abi", "none",
               "--target", str(tmp / "site")] + [a for p in PLATFORMS for a in ("--platform", p)] + \
              ["--platform", "any"] + reqs
        say("pip: " + " ".join(reqs))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if r.returncode:
            raise CarryError("pip install --target for Python %s failed (exit %d): %s"
                             % (PY_VERSION, r.returncode, (r.stderr or r.stdout).strip()[-1500:]))
        shutil.rmtree(tmp / "site" / "bin", ignore_errors=True)
        debs = tmp / "debs"
        debs.mkdir()
        if not shutil.which("apt-get"):
            raise CarryError("apt-get is not here: build the carry on a Debian/Ubuntu machine")
        pkgs = list(TOOLS) + list(LIBS)
        say("apt-get download: " + " ".join(pkgs))
        r = subprocess.run(["apt-get", "download", "-q"] + pkgs, cwd=str(debs), capture_output=True, text=True,
                           timeout=600, stdin=subprocess.DEVNULL)
        if r.returncode:
            raise CarryError("apt-get download failed (exit %d): %s (run `apt-get update` first?)"
                             % (r.returncode, (r.stderr or r.stdout).strip()[-1500:]))
        manifest = {"python": PY_VERSION, "wheels": reqs, "already_there": list(ALREADY_THERE),
                    "tools": {p: v for p, v in TOOLS.items()}, "libs": list(LIBS),
                    "debs": sorted(os.listdir(debs)), "built_on": os.uname().nodename}
        total = size_bytes(tmp)
        manifest["bytes"] = total
        if total > LIMIT_MIB * 2**20:
            raise CarryError("the carry is %s, over its %.0f MiB (the device tool carries 64 MiB a call, the working "
                             "tree included): carry less" % (mib(total), LIMIT_MIB))
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
        say("built %s: site %s, debs %s; carries %s" % (dest, mib(size_bytes(dest / "site")),
                                                       mib(size_bytes(dest / "debs")), mib(size_bytes(dest))))
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(dest: Path = DEFAULT_DEST) -> dict:
    """-> {"present", "bytes", "site_bytes", "debs_bytes", "manifest"} of an existing carry (nothing built)."""
    dest = Path(dest)
    if not (dest / "MANIFEST.json").exists():
        return {"present": False, "path": str(dest), "bytes": 0}
    return {"present": True, "path": str(dest), "bytes": size_bytes(dest), "site_bytes": size_bytes(dest / "site"),
            "debs_bytes": size_bytes(dest / "debs"), "manifest": json.loads((dest / "MANIFEST.json").read_text())}


# ---- there: install what is missing ---------------------------------------------------------------------------

def _sonames_missing(paths) -> list:
    """Sonames `ldd` cannot find for these executables."""
    out = []
    for p in paths:
        if not os.path.exists(p):
            continue
        r = subprocess.run(["ldd", p], capture_output=True, text=True, timeout=30)
        for ln in r.stdout.splitlines():
            if "=> not found" in ln:
                out.append(ln.split()[0])
    return sorted(set(out))


def setup(dest: Path = DEFAULT_DEST, root: str = "/") -> list:
    """Install the missing tools and libraries from DEST/debs (root, disposable machines only). -> what was done."""
    dest = Path(dest)
    done = []
    debs = {}
    for f in glob.glob(str(dest / "debs" / "*.deb")):
        debs[os.path.basename(f).split("_", 1)[0]] = f
    if not debs:
        raise CarryError("no .deb files in %s/debs: build the carry first (scripts/gpu-check.sh --build-carry)" % dest)
    scratch = Path(tempfile.mkdtemp(prefix="vpd-gpu-carry-"))
    try:
        placed = []
        for pkg, files in TOOLS.items():
            missing = {src: dst for src, dst in files.items() if not os.path.exists(os.path.join(root, dst[1:]))
                       and not shutil.which(os.path.basename(dst))}
            if not missing:
                continue
            if pkg not in debs:
                raise CarryError("%s missing here and no %s .deb in %s/debs" % (", ".join(missing.values()), pkg, dest))
            sub = scratch / pkg
            subprocess.run(["dpkg-deb", "-x", debs[pkg], str(sub)], check=True, timeout=120)
            for src, dst in missing.items():
                cand = [sub / src, sub / "usr" / src]
                got = next((c for c in cand if c.exists()), None)
                if got is None:
                    raise CarryError("%s has no %s" % (debs[pkg], src))
                target = Path(root) / dst[1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(got, target)
                placed.append(str(target))
                done.append("installed %s (from %s)" % (dst, os.path.basename(debs[pkg])))
        need = _sonames_missing(placed or [os.path.join(root, d[1:]) for f in TOOLS.values() for d in f.values()])
        if need:
            libdir = Path(root) / LIB_DIR[1:]
            libdir.mkdir(parents=True, exist_ok=True)
            for pkg in LIBS:
                if pkg not in debs:
                    continue
                sub = scratch / pkg
                subprocess.run(["dpkg-deb", "-x", debs[pkg], str(sub)], check=True, timeout=120)
                for so in need:
                    for hit in list(sub.rglob(so)):
                        real = hit.resolve()
                        if not real.exists():
                            continue
                        shutil.copy2(real, libdir / real.name)
                        if real.name != so:
                            link = libdir / so
                            if link.exists() or link.is_symlink():
                                link.unlink()
                            link.symlink_to(real.name)
                        done.append("library %s (from %s) into %s" % (so, os.path.basename(debs[pkg]), LIB_DIR))
            conf = Path(root) / "etc/ld.so.conf.d/vpd-gpu-carry.conf"
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(LIB_DIR + "\n")
            subprocess.run(["ldconfig"], check=False, timeout=60)
            still = _sonames_missing(placed)
            if still:
                raise CarryError("after setup these libraries are still missing for %s: %s (add their packages to "
                                 "LIBS in bench/gpu/carry.py)" % (", ".join(placed), ", ".join(still)))
        if root == "/" and subprocess.run(["id", "sshd"], capture_output=True).returncode:
            r = subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/run/sshd", "--shell",
                                "/usr/sbin/nologin", "sshd"], capture_output=True, text=True)
            if r.returncode:  # no useradd: the line itself
                with open("/etc/passwd", "a") as f:
                    f.write("sshd:x:%d:65534::/run/sshd:/usr/sbin/nologin\n" % 997)
            done.append("user sshd (OpenSSH's privilege separation)")
        for d in done:
            say(d)
        if not done:
            say("nothing to install: the tools are here")
        return done
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("build", "size", "setup"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    dest = Path(argv[1]) if len(argv) > 1 else DEFAULT_DEST
    try:
        if argv[0] == "build":
            build(dest)
        elif argv[0] == "setup":
            setup(dest)
        else:
            d = describe(dest)
            if not d["present"]:
                say("no carry in %s: build it with scripts/gpu-check.sh --build-carry" % dest)
                return 1
            say("%s: site %s, debs %s; carries %s" % (dest, mib(d["site_bytes"]), mib(d["debs_bytes"]), mib(d["bytes"])))
        return 0
    except CarryError as e:
        say("failed: %s" % e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
