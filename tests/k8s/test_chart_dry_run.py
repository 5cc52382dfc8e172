"""The chart's manifests, as helm renders them for a kube2iam user, are accepted by a real
kube-apiserver (server-side dry run: validation, defaulting and admission, nothing stored).

kubernetes-validate (tests/deploy) checks the schemas; the real server checks everything
else it enforces (immutable or conflicting fields, RBAC escalation rules for the
ClusterRole, admission).  The ServiceMonitor's CRD is not installed on this server, so that
one kind is left to tests/deploy/test_chart.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

from test_chart import NAMESPACE, VALUES, render  # noqa: E402

pytestmark = pytest.mark.kube_apiserver

PLURALS = {"DaemonSet": "daemonsets", "ServiceAccount": "serviceaccounts",
           "ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings",
           "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding"}


def path_of(doc: dict) -> str:
    api = doc["apiVersion"]
    base = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    plural = PLURALS[doc["kind"]]
    if doc["kind"] in CLUSTER_SCOPED:
        return f"{base}/{plural}"
    return f"{base}/namespaces/{doc['metadata'].get('namespace', NAMESPACE)}/{plural}"


@pytest.mark.parametrize("values", sorted(p.name for p in VALUES.glob("*.yaml")))
def test_rendered_chart_is_accepted_by_a_real_api_server(kube_cluster, values):
    docs = render(VALUES / values)
    accepted = []
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue
        status, body = kube_cluster.admin.request("POST", path_of(doc) + "?dryRun=All", doc)
        assert status in (200, 201), f"{values}: {doc['kind']} {doc['metadata']['name']}: " \
                                     f"{status} {body}"
        accepted.append(doc["kind"])
    # kube2iam's defaults create no RBAC (rbac.create: false); every file has the DaemonSet
    assert "DaemonSet" in accepted, accepted
