"""The agent: a small stdlib-only program that runs in the container, next to the processes and files it acts on.

Here, the tool's side of it:
- archive.py   the container side (container/, one module per concern) as one zip named by its sha256, and the
               bootstrap each exec sends: it runs the copy cached in the container or asks for it;
- call.py      one action in a process of its own (`PYTHON - ACTION ARGS_JSON`), and reading each answer into
               its typed result (protocol.py);
- session.py   one agent process for all of an operation's steps (AgentSession), above remote.py's transport.
"""

from __future__ import annotations

from orchestrator.core.errors import AgentError, ContainerNotRunning, DeployError  # noqa: F401 (re-exported)
from .call import MAX_EVENT_BYTES, MAX_EVENT_LINE, MAX_EVENTS, EventBudget  # noqa: F401
from .call import agent_argv, agent_stdin, call, interpret  # noqa: F401
from .container.protocol import PROTOCOL  # noqa: F401 (the dataclasses of protocol.py load when answers come)
from .session import SESSION_BOOT, session_for  # noqa: F401
