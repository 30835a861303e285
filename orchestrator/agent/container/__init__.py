"""The in-container agent (stdlib only; runs on the container's own Python, 3.7 and later): one module per
concern, shipped as one zip archive and cached in the container (see cache.py and ../archive.py).

Bottom to top: core (output, request context, small helpers) <- files (safe writes through checked directory
fds), procs (/proc) <- systemd, gpus <- state (the state file, proving processes ours) <- net (loopback HTTP,
listeners) <- the actions: stop, launch, ready, probe, logs, lock, status, drafter, hub, verify + stack, doctor,
install. main.py maps each action to its module and imports only that one.
"""
