"""What goes into a container before it serves: the weights (fetch, the host's shared store), vLLM itself (install-vllm), and following those detached jobs."""
