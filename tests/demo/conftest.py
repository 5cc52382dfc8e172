"""Fixtures shared by the demo's tests."""

import logging
import os

import pytest


@pytest.fixture(scope="module")
def sts():
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from kiamfast.testing.sts import StsSandbox

    with StsSandbox() as sandbox:
        yield sandbox
