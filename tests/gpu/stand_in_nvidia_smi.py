#!/usr/bin/env python3
"""A stand-in for the real nvidia-smi (VPD_TESTBED_NVIDIA_SMI) when rehearsing gpus=real without a GPU: one
"NVIDIA TEST" GPU with constant memory, answering the queries the tool and bench/gpu/gpu_check.py make."""
import sys

VALUES = {"index": "0", "name": "NVIDIA TEST", "uuid": "GPU-00000000-0000-0000-0000-000000000000",
          "memory.used": "3", "memory.total": "81559", "memory.free": "81556", "driver_version": "580.159.04",
          "utilization.gpu": "0", "pci.bus_id": "00000000:00:00.0"}
UNITS = {"memory.used": " MiB", "memory.total": " MiB", "memory.free": " MiB", "utilization.gpu": " %"}


def main(argv):
    q = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    if "-L" in argv:
        print("GPU 0: NVIDIA TEST (UUID: %s)" % VALUES["uuid"])
        return 0
    if any(a.startswith("--query-compute-apps") for a in argv):
        return 0
    if q:
        fields = q.split(",")
        if "noheader" not in fmt:
            print(", ".join(f + (" [MiB]" if f in UNITS and "nounits" not in fmt else "") for f in fields))
        print(", ".join(VALUES.get(f, "[N/A]") + ("" if "nounits" in fmt else UNITS.get(f, "")) for f in fields))
        return 0
    print("| NVIDIA-SMI 580.159.04    Driver Version: 580.159.04    CUDA Version: 13.0 |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
