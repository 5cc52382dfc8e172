"""The session's real cluster control plane: one etcd and one kube-apiserver, started once
(``kube_cluster``, in tests/conftest.py: tests/podidentity shares it).

``kube`` starts them on loopback (random ports, a temp dir), creates the agent's
ServiceAccount ``kube-system/kiamfast``, applies the ClusterRole and binding exactly as
deploy/base/rbac.yaml has them, and writes a kubeconfig holding a TokenRequest token for it:
the agent's own identity, and the only one the code under test gets. Tests create their own
nodes, namespaces and pods (names unique per test) through ``kube.admin``.

``uncached_apiserver`` is a second API server on the same etcd with the watch cache off,
started only by the tests that need it. The watch cache keeps its own event history (at
least 75 s, whatever etcd compacts), so the 410 that etcd compaction causes reaches a client
only through a server that watches etcd directly (``--watch-cache=false``).

Without the binaries every test here skips, naming them and ``bash tests/k8s/build.sh``.
"""
from __future__ import annotations

import secrets

import pytest

import kube
from kiamfast import table as tablemod

MARKERS = ("kube_apiserver: against a real kube-apiserver and etcd (bash tests/k8s/build.sh)",
           "kubelet: a real kubelet starts real pods on a real containerd (as root)")


def pytest_configure(config):
    # Also in pyproject.toml's markers (--strict-markers); registering them here keeps this
    # directory runnable on its own.
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


@pytest.fixture(scope="session")
def uncached_apiserver(kube_cluster):
    """A second API server of the same cluster, watching etcd directly."""
    server = kube.ApiServer(directory=kube_cluster.directory / "uncached",
                            etcd=kube_cluster.etcd, pki=kube_cluster.pki,
                            admin_token=kube_cluster.admin.token,
                            name="kube-apiserver-uncached", watch_cache=False)
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


@pytest.fixture
def table(tmp_path):
    """A real shared-memory table file, as the supervisor creates it."""
    t = tablemod.Table.create(str(tmp_path / "kiamfast-table"), ip_capacity=1024,
                              cred_capacity=64, value_size=1024, aux_count=1, aux_size=1024,
                              max_workers=2)
    yield t
    t.close()


@pytest.fixture
def unique():
    """unique("node") -> "node-3fa2c1": names no other test of the session uses."""
    return lambda prefix: f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="session")
def kubelet_available(kube_cluster):
    """Skips, naming what is missing, when a real node cannot run here."""
    from kubelet_node import missing_reason
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    from e2e_cluster import sweep_stale_runs
    sweep_stale_runs()


@pytest.fixture
def kubelet_node(request, test_failed, tmp_path, kube_cluster, kubelet_available):
    """A node of the real cluster: kubelet + containerd in a fresh node namespace, registered
    with the startup taint; no agent yet. Indirect parameters: more kubelet flags."""
    from e2e_cluster import reporting_on_failure
    from kubelet_node import KubeletNode
    node = KubeletNode(tmp_path / "node", kube_cluster,
                       kubelet_args=getattr(request, "param", None))
    with reporting_on_failure(node, test_failed) as n:
        yield n
