"""The executor (ops: up, restart, down, verify, apply-config) and the commands built on it (compare, init)."""
