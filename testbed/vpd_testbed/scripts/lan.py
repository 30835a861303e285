"""The test bed's network: holds its network namespace (run as `unshare --net -- python3 -SE lan.py ROOT`).

Sets up loopback and the bridge br0 in the new namespace, prints "ready" and waits until it is killed (SIGTERM /
SIGINT: exit). The namespace, the bridge and every veth pair with one end in it (the containers' eth0, the
workstation's link) disappear with this process. Stdlib only; see docs/testbed.md, "Networking".
"""
import signal
import subprocess
import sys


def main():
    for argv in (["ip", "link", "set", "lo", "up"], ["ip", "link", "add", "name", "br0", "type", "bridge"],
                 ["ip", "link", "set", "br0", "up"]):
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if r.returncode:
            sys.stdout.write("error: %s failed: %s\n" % (" ".join(argv), r.stdout.decode(errors="replace").strip()))
            return 1
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
