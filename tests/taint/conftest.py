"""The taint tests' API server: the emulator over real HTTP."""

from __future__ import annotations

import pytest

from kiamfast.testing import apiserver


@pytest.fixture
def srv():
    server = apiserver.ApiServer().start()
    try:
        yield server
    finally:
        server.stop()
