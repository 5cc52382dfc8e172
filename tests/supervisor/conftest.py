"""The loopback node the handover, second-port and socket-keeper tests share."""
from __future__ import annotations

import pytest

from handover_agents import Node


@pytest.fixture
def node(tmp_path):
    """One node's surroundings (tests/supervisor/handover_agents.py), closed after the test."""
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()
