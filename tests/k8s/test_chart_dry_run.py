"""The chart's manifests, as helm renders them for a kube2iam user and with container
credentials on, are accepted by a real kube-apiserver (server-side dry run with strict field
validation: schemas, defaulting, admission, nothing stored).

kubernetes-validate (tests/deploy) checks the schemas; the real server checks everything
else it enforces (immutable or conflicting fields, RBAC escalation rules for the
ClusterRole, admission, unknown fields).  The ServiceMonitor's CRD is not installed on this
server, so that one kind is left to tests/deploy/test_chart.py; cert-manager's Certificate
and Issuer are checked against cert-manager's own CRDs (tests/tools/fetch_cert_manager_crds.sh),
their schemas and validation rules, installed here.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

import kube  # noqa: E402
from test_chart import NAMESPACE, VALUES, render, values_file  # noqa: E402

pytestmark = pytest.mark.kube_apiserver

REPO = Path(__file__).resolve().parents[2]
FETCH_CRDS = REPO / "tests" / "tools" / "fetch_cert_manager_crds.sh"
PLURALS = {"DaemonSet": "daemonsets", "ServiceAccount": "serviceaccounts",
           "ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings",
           "Service": "services", "Secret": "secrets", "ConfigMap": "configmaps",
           "Deployment": "deployments",
           "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
           "Certificate": "certificates", "Issuer": "issuers",
           "NetworkPolicy": "networkpolicies"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration"}
CONTAINER_CREDENTIALS = {
    "helm-ca": {"containerCredentials": {"enabled": True, "webhook": {"enabled": True}}},
    "cert-manager": {"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "certManager": {"enabled": True}}}},
    "helm-ca-network-policy": {"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "networkPolicy": {"enabled": True,
                                           "apiServerCIDRs": ["10.0.0.0/16", "fd00:10::/64"]}}}},
    "cert-manager-own-issuer": {"containerCredentials": {"enabled": True, "ipv6": False,
        "webhook": {"enabled": True, "certManager": {
            "enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer",
                                           "group": "cert-manager.io"}}}}},
}


def path_of(doc: dict) -> str:
    api = doc["apiVersion"]
    base = f"/api/{api}" if "/" not in api else f"/apis/{api}"
    plural = PLURALS[doc["kind"]]
    if doc["kind"] in CLUSTER_SCOPED:
        return f"{base}/{plural}"
    return f"{base}/namespaces/{doc['metadata'].get('namespace', NAMESPACE)}/{plural}"


def dry_run(cluster, docs: list[dict], what: str) -> list[str]:
    accepted = []
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue
        status, body = cluster.admin.request(
            "POST", path_of(doc) + "?dryRun=All&fieldValidation=Strict", doc)
        assert status in (200, 201), f"{what}: {doc['kind']} {doc['metadata']['name']}: " \
                                     f"{status} {body}"
        accepted.append(doc["kind"])
    return accepted


@pytest.mark.parametrize("values", sorted(p.name for p in VALUES.glob("*.yaml")))
def test_rendered_chart_is_accepted_by_a_real_api_server(kube_cluster, values):
    accepted = dry_run(kube_cluster, render(VALUES / values), values)
    # kube2iam's defaults create no RBAC (rbac.create: false); every file has the DaemonSet
    assert "DaemonSet" in accepted, accepted


@pytest.fixture(scope="module")
def cert_manager_crds(kube_cluster):
    """cert-manager's Certificate and Issuer CRDs, installed (once) and served.  They stay
    for the session: only definitions, no objects and no controller acting on them."""
    version = re.search(r"^CERT_MANAGER_VERSION=(\S+)$", FETCH_CRDS.read_text(), re.M).group(1)
    tools = Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")
    directory = tools / f"cert-manager-crds-{version}"
    files = sorted(directory.glob("*.yaml"))
    if len(files) != 2:
        pytest.skip(f"needs cert-manager {version}'s CRDs in {directory}: run {FETCH_CRDS}")
    admin = kube_cluster.admin
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for f in files:
        crd = yaml.safe_load(f.read_text())
        status, body = admin.request("POST", crds, crd)
        assert status in (201, 409), (f.name, status, body)
    deadline = time.monotonic() + 30
    for plural in ("certificates", "issuers"):
        while admin.request("GET", f"/apis/cert-manager.io/v1/namespaces/{NAMESPACE}/"
                                   f"{plural}")[0] != 200:
            assert time.monotonic() < deadline, f"{plural}.cert-manager.io not served"
            time.sleep(0.1)


@pytest.mark.parametrize("name", sorted(CONTAINER_CREDENTIALS))
def test_container_credentials_render_is_accepted_by_a_real_api_server(
        kube_cluster, cert_manager_crds, tmp_path, name):
    docs = render(values_file(tmp_path, CONTAINER_CREDENTIALS[name]))
    accepted = dry_run(kube_cluster, docs, name)
    expected = {"DaemonSet", "ClusterRole", "Deployment", "MutatingWebhookConfiguration"}
    expected |= {"Certificate"} if "cert-manager" in name else {"Secret"}
    expected |= {"NetworkPolicy"} if "network-policy" in name else set()
    assert expected <= set(accepted), accepted


@pytest.mark.parametrize("enabled", [False, True])
def test_the_rendered_cluster_role_lets_the_agent_review_tokens_only_when_enabled(
        kube_cluster, tmp_path, enabled):
    """The agent's own call (a TokenReview) with exactly the rendered ClusterRole bound."""
    admin = kube_cluster.admin
    docs = render(values_file(tmp_path, {"containerCredentials": {"enabled": enabled}}))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    name = f"chart-role-{secrets.token_hex(4)}"
    role["metadata"] = {"name": name}
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    admin.call("POST", f"{rbac}/clusterroles", role)
    token = kube.service_account_token(admin, namespace=NAMESPACE, name=name)
    admin.call("POST", f"{rbac}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]})
    try:
        agent = kube.Client(url=kube_cluster.apiserver.url, ca=kube_cluster.apiserver.ca,
                            token=token)
        kube.wait_allowed(agent, verb="list", resource="pods")   # the binding is in effect
        status, body = agent.request(
            "POST", "/apis/authentication.k8s.io/v1/tokenreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
             "spec": {"token": token}})
        if enabled:
            assert status == 201, body
            assert body["status"]["authenticated"] is True
        else:
            assert status == 403, body
    finally:
        admin.request("DELETE", f"{rbac}/clusterrolebindings/{name}")
        admin.request("DELETE", f"{rbac}/clusterroles/{name}")
        admin.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}")
