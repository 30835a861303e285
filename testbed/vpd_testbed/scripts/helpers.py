"""Host-level helper processes of the test bed's faults (stdlib only, run with python3 -SE).

    helpers.py ssh_drop HOSTDIR SECONDS   cut every SSH connection to the host SECONDS after it opened
"""
import os
import signal
import sys
import time


def _stat(pid):
    with open("/proc/%d/stat" % pid) as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[1]), int(rest[19])  # ppid, starttime (clock ticks since boot)


def _children(pid):
    out = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def ssh_drop(hostdir, seconds):
    hz = os.sysconf("SC_CLK_TCK")
    while True:
        try:
            listener = int(open(os.path.join(hostdir, "sshd.pid")).read().split()[0])
        except (OSError, ValueError, IndexError):
            listener = None
        if listener:
            with open("/proc/uptime") as f:
                now = float(f.read().split()[0])
            for conn in _children(listener):
                try:
                    _, start = _stat(conn)
                except (OSError, ValueError, IndexError):
                    continue
                if now - start / hz >= seconds:
                    # the connection's sshd processes (monitor + privsep child): the TCP connection closes,
                    # the session's commands lose their streams, as when the network drops
                    victims = [conn] + [c for c in _children(conn) if _comm(c).startswith("sshd")]
                    for v in victims:
                        try:
                            os.kill(v, signal.SIGKILL)
                        except OSError:
                            pass
        time.sleep(0.05)


def main():
    if sys.argv[1] == "ssh_drop":
        ssh_drop(sys.argv[2], float(sys.argv[3]))


if __name__ == "__main__":
    main()
