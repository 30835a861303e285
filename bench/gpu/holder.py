"""A GPU holder for the real-GPU check (issue 55): takes MIB of GPU memory with torch (a real CUDA context), or,
where torch has no CUDA (a rehearsal), holds DEVICE open; prints `held PID HOW` and sleeps SECONDS.

    python holder.py stubborn|polite MIB DEVICE SECONDS

`stubborn` ignores SIGTERM (the holder `deploy restart --clean-gpus` must SIGKILL after its grace period)."""
import os
import signal
import sys
import time


def main(argv):
    mode, mib, device, seconds = argv[0], int(argv[1]), argv[2], float(argv[3])
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        x = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")  # noqa: F841 (held until the end)
        torch.cuda.synchronize()
        how = "cuda %d MiB" % mib
    else:
        fd = os.open(device, os.O_RDWR)  # noqa: F841
        how = "file %s (no CUDA here: a rehearsal)" % device
    print("held %d %s" % (os.getpid(), how), flush=True)
    time.sleep(seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
