"""Replicas (fleet), the vLLM Router in front of them, the tunnel in the foreground."""
