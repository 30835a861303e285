"""Minimal ``vllm.platforms`` of the fake vLLM: a CUDA platform with H100 GPUs."""

import os


class CudaPlatform:
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"

    def is_cuda(self):
        return True

    def is_rocm(self):
        return False

    def is_cpu(self):
        return False

    def get_device_name(self, device_id=0):
        return "NVIDIA H100 80GB HBM3"

    def get_device_capability(self, device_id=0):
        return (9, 0)

    def get_device_total_memory(self, device_id=0):
        return 81559 * 2**20

    def device_count(self):
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cvd is not None:
            return len([x for x in cvd.split(",") if x.strip()])
        dev = os.environ.get("VPD_FAKE_DEV", "/dev")
        try:
            return len([n for n in os.listdir(dev) if n.startswith("nvidia") and n[6:].isdigit()])
        except OSError:
            return 0

    def __repr__(self):
        return "CudaPlatform()"


current_platform = CudaPlatform()
