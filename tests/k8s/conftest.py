"""The session's real cluster control plane: one etcd and one kube-apiserver, started once.

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

import copy
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import kube
from kiamfast import table as tablemod

MARKER = "kube_apiserver: against a real kube-apiserver and etcd (bash tests/k8s/build.sh)"


def pytest_configure(config):
    # Also belongs in pyproject.toml's markers (--strict-markers); registering it here keeps
    # this directory runnable on its own.
    config.addinivalue_line("markers", MARKER)


@dataclass
class Cluster:
    directory: Path
    etcd: kube.Etcd
    apiserver: kube.ApiServer
    admin: kube.Client
    agent_kubeconfig: Path
    pki: dict[str, Path]
    start_seconds: float
    _identities: dict[str, Path] = field(default_factory=dict)

    def kubeconfig_for(self, token: str, *, name: str, server: str | None = None) -> Path:
        return kube.write_kubeconfig(self.directory / f"{name}.kubeconfig",
                                     server=server or self.apiserver.url,
                                     ca=self.apiserver.ca, token=token)

    def agent_kubeconfig_via(self, url: str) -> Path:
        """The agent's own token, aimed at another address of the same cluster (a proxy, a
        second API server)."""
        token = yaml.safe_load(self.agent_kubeconfig.read_text())["users"][0]["user"]["token"]
        return self.kubeconfig_for(token, name=f"agent-{url.rsplit(':', 1)[1]}", server=url)

    def as_user(self, token: str) -> kube.Client:
        return kube.Client(url=self.apiserver.url, ca=self.apiserver.ca, token=token)

    def identity_without(self, name: str, *, drop: list[tuple[str, str]]) -> Path:
        """A kubeconfig for ServiceAccount kube-system/<name> bound to a copy of the project's
        ClusterRole without the (resource, verb) pairs in ``drop``; every other rule as
        shipped."""
        if name in self._identities:
            return self._identities[name]
        role, binding = (copy.deepcopy(d) for d in kube.rbac_documents())
        assert role["kind"] == "ClusterRole" and binding["kind"] == "ClusterRoleBinding"
        granted = {(res, verb) for rule in role["rules"] for res in rule["resources"]
                   for verb in rule["verbs"]}
        assert set(drop) <= granted, f"the shipped role does not grant all of {drop}"
        rules = []
        for rule in role["rules"]:
            for res in rule["resources"]:   # one rule per resource, so one verb can go
                verbs = [v for v in rule["verbs"] if (res, v) not in drop]
                if verbs:
                    rules.append({**rule, "resources": [res], "verbs": verbs})
        role["metadata"] = {"name": name}
        role["rules"] = rules
        binding["metadata"] = {"name": name}
        binding["roleRef"]["name"] = name
        binding["subjects"] = [{"kind": "ServiceAccount", "name": name,
                                "namespace": "kube-system"}]
        kube.apply_rbac(self.admin, [role, binding])
        token = kube.service_account_token(self.admin, namespace="kube-system", name=name)
        kube.wait_allowed(self.as_user(token), verb=rules[0]["verbs"][0],
                          resource=rules[0]["resources"][0])
        self._identities[name] = self.kubeconfig_for(token, name=name)
        return self._identities[name]


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    reason = kube.missing_binaries()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    directory = tmp_path_factory.mktemp("kube")
    pki = kube.make_pki(directory / "pki")
    etcd = kube.Etcd(directory)
    apiserver = None
    try:
        etcd.wait_ready(20)
        apiserver = kube.ApiServer(directory=directory, etcd=etcd, pki=pki,
                                   admin_token=kube.new_admin_token())
        apiserver.wait_ready(60)
        admin = apiserver.admin
        token = kube.service_account_token(admin, namespace="kube-system", name="kiamfast")
        kube.apply_rbac(admin, kube.rbac_documents())
        # RBAC takes effect when the server's informers see the binding: wait for that.
        kube.wait_allowed(kube.Client(url=apiserver.url, ca=apiserver.ca, token=token),
                          verb="watch", resource="pods")
        agent = kube.write_kubeconfig(directory / "agent.kubeconfig", server=apiserver.url,
                                      ca=apiserver.ca, token=token)
        yield Cluster(directory=directory, etcd=etcd, apiserver=apiserver, admin=admin,
                      agent_kubeconfig=agent, pki=pki, start_seconds=time.monotonic() - started)
    finally:
        if apiserver is not None:
            apiserver.stop()
        etcd.stop()


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
