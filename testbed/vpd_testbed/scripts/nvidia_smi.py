# nvidia-smi client of the test bed's GPU driver simulator (gpusim.py). Must start fast: stdlib, -SE.
# The generated script prepends HOST_SOCK = "..." (the host-level socket, used outside containers).
import json
import os
import socket
import sys


def main(host_sock):
    path = "/run/nvidia-sim.sock" if os.path.exists("/run/nvidia-sim.sock") else host_sock
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        sys.stdout.write("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                         "Make sure that the latest NVIDIA driver is installed and running.\n\n")
        return 9
    s.sendall((json.dumps({"argv": sys.argv[1:]}) + "\n").encode())
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    try:
        r = json.loads(buf)
    except ValueError:
        sys.stdout.write("Unable to determine the device handle for GPU0000:18:00.0: Unknown Error\n")
        return 15
    sys.stdout.write(r.get("out", ""))
    sys.stderr.write(r.get("err", ""))
    return r.get("rc", 0)
