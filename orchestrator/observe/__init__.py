"""status, logs and monitoring (export, metrics, render)."""
