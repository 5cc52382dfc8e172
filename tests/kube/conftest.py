"""Fixtures for kiamfast.kube's tests: the session's real API server (tests/conftest.py's
``kube_cluster`` and tests/k8s's ``uncached_apiserver`` and ``unique``, loaded from there,
not copied), the project's emulator for faults, and a small PKI for TLS tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

K8S = Path(__file__).resolve().parents[1] / "k8s"
sys.path.insert(0, str(K8S))

import kube  # noqa: E402

from kiamfast.testing.apiserver import ApiServer as Emulator  # noqa: E402

_spec = importlib.util.spec_from_file_location("k8s_fixtures", K8S / "conftest.py")
assert _spec is not None and _spec.loader is not None
_k8s = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_k8s)
unique = _k8s.unique
uncached_apiserver = _k8s.uncached_apiserver


@pytest.fixture
def emulator():
    """The project's API server emulator (plain HTTP, bearer token "test-token")."""
    with Emulator(token="test-token", bookmark_interval=3600) as server:
        yield server


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA and a certificate + key it signed (for 127.0.0.1), as PEM files."""
    return kube.make_pki(tmp_path_factory.mktemp("pki"))
