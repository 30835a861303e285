"""The agent protocol, shared by both sides: the dataclasses live in container/protocol.py (they travel in the
agent's archive, so the agent checks each result against its type before it leaves the container)."""

from .container.protocol import *  # noqa: F401,F403
from .container.protocol import PROTOCOL, RESULT_TYPES, AgentResult, ProtocolError  # noqa: F401
