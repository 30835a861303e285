"""vllm-pve-deploy: put vLLM with speculative decoding onto Proxmox VE GPU containers, verified end to end."""

__version__ = "0.1.0"
