"""pytest fixtures of the fake vLLM tests (helpers live in fakevllm_support.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakevllm_support import Bed  # noqa: E402


@pytest.fixture
def bed(tmp_path):
    b = Bed(str(tmp_path))
    yield b
    b.cleanup()
