"""A real kube-apiserver (tests/k8s/kube.py), the whole agent serving the container-
credentials protocol on loopback, moto's STS and the fake IMDS.

The agent runs as ServiceAccount kube-system/kiamfast-podid, bound to the project's
ClusterRole plus the API server's own ``system:auth-delegator`` (create tokenreviews), which
is what a chart enabling --container-credentials-addr must grant.  Pods are API objects
bound to the agent's node by ``nodeName`` (no kubelet: the test writes their status);
their tokens come from the TokenRequest API, bound to the pod, with the agent's audience.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))     # sdk_clients

import kube  # noqa: E402
import podid  # noqa: E402

from kiamfast.testing.loopback import LoopbackNode  # noqa: E402

AGENT_SA = "kiamfast-podid"


@pytest.fixture(scope="session")
def cluster(kube_cluster):
    """The session's real control plane (tests/conftest.py), shared with tests/k8s."""
    return kube_cluster


def agent_kubeconfig(cluster) -> Path:
    """The agent's identity: the shipped ClusterRole plus system:auth-delegator."""
    admin = cluster.admin
    token = kube.service_account_token(admin, namespace="kube-system", name=AGENT_SA)
    for role in ("kiamfast", "system:auth-delegator"):
        admin.call("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{AGENT_SA}-{role.replace(':', '-')}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA,
                          "namespace": "kube-system"}]})
    kube.wait_allowed(cluster.as_user(token), group="authentication.k8s.io",
                      resource="tokenreviews", verb="create")
    kube.wait_allowed(cluster.as_user(token), verb="watch", resource="pods")
    return cluster.kubeconfig_for(token, name=AGENT_SA)


@pytest.fixture(scope="session")
def peers(cluster):
    """The loopback node around the agent, with the real API server (node n1 there)."""
    with LoopbackNode(kubeconfig=agent_kubeconfig(cluster)) as node:
        yield node


@pytest.fixture(scope="session")
def webhook_reader(cluster, tmp_path_factory):
    """The webhook's identity as the chart grants it: the rules of the webhook's ClusterRole
    the real helm renders with the webhook on (its defaults), bound here."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
    from test_chart import render, values_file
    docs = render(values_file(tmp_path_factory.mktemp("webhook-chart"), {
        "containerCredentials": {"enabled": True, "webhook": {"enabled": True}}}))
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"
               and d["metadata"]["name"].endswith("-webhook")]
    return podid.webhook_kubeconfig(cluster, "kiamfast-webhook-reader", rules=role["rules"])
