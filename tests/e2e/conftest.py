"""Fixtures of the end-to-end tests: a node (network namespaces, emulators, STS) per test.

Every test here needs root, ``ip`` and ``iptables``; without them the whole directory is
skipped with the reason. Tests on a node with a real container runtime (``runtime_node``)
also need containerd, runc and the CNI plugins, and skip naming them and
``sh tests/cri/setup.sh``; nothing else is ever a reason to skip. When a test fails, the
agent's own output (supervisor, control process, workers) is printed with the failure, since
that is the first thing anyone debugging it needs, and for a runtime node containerd's too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns import unavailable_reason  # noqa: E402

_REASON: list[str | None] = []


def _reason() -> str | None:
    if not _REASON:
        _REASON.append(unavailable_reason())
        if _REASON[0] is None:
            from e2e_cluster import sweep_stale_runs
            sweep_stale_runs()
    return _REASON[0]


@pytest.fixture(scope="session")
def netns_available():
    """Skips (once, with the reason) when namespaces cannot be built here."""
    reason = _reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _needs_root_and_netns(netns_available):
    pass


@pytest.fixture
def node(test_failed, tmp_path, netns_available):
    """A fresh node (tainted with the startup taint), no agent yet."""
    from e2e_cluster import Node, reporting_on_failure
    with reporting_on_failure(Node(tmp_path / "node"), test_failed) as n:
        yield n


@pytest.fixture(scope="session")
def runtime_available(netns_available):
    """Skips (naming the missing tool) when a real containerd cannot run here."""
    from runtime_node import containerd_unavailable_reason
    reason = containerd_unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def runtime_node(test_failed, tmp_path, runtime_available):
    """A fresh node with its own containerd (pods are real sandboxes), no agent yet."""
    from e2e_cluster import reporting_on_failure
    from runtime_node import RuntimeNode
    with reporting_on_failure(RuntimeNode(tmp_path / "node"), test_failed) as n:
        yield n
