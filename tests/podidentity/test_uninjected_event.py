"""Pods that asked for container credentials and were created without them, seen by the whole
agent against the session's real kube-apiserver.

What a user checks: with the webhook down (here: not there at all), a pod created with the
opt-in annotations is stored uninjected, and the agent of its node posts a Warning Event
``ContainerCredentialsNotInjected`` on it and counts it in
``kiamfast_container_credentials_uninjected_pods_total``; a pod without the annotations, or
one the webhook did inject, gets none.  The agent runs as exactly the chart's ClusterRole with
``containerCredentials.enabled`` (so the chart grants what the Event needs).
"""
from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

import kube
import pytest
from agent_process import Agent
from agent_process import http as agent_http

from kiamfast.container_credentials import uninjected
from kiamfast.testing.net import free_port

pytestmark = pytest.mark.kube_apiserver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
ROLE_KEY = "iam.amazonaws.com/role"
OPTED_IN = {ROLE_KEY: "role-a", uninjected.OPT_IN_ANNOTATION: "true"}
RBAC = "/apis/rbac.authorization.k8s.io/v1"


def chart_identity(cluster, tmp_path: Path) -> Path:
    """A kubeconfig of a ServiceAccount bound to the chart's rendered ClusterRole."""
    from test_chart import render, values_file
    admin = cluster.admin
    docs = render(values_file(tmp_path, {"containerCredentials": {"enabled": True}}))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    name = f"uninjected-{secrets.token_hex(3)}"
    role["metadata"] = {"name": name}
    admin.call("POST", f"{RBAC}/clusterroles", role)
    token = kube.service_account_token(admin, namespace="kube-system", name=name)
    admin.call("POST", f"{RBAC}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}]})
    kube.wait_allowed(cluster.as_user(token), verb="create", resource="events")
    kube.wait_allowed(cluster.as_user(token), verb="watch", resource="pods")
    return cluster.kubeconfig_for(token, name=name)


def create_pod(admin, ns: str, name: str, node: str, annotations: dict, *,
               injected: bool = False) -> str:
    container: dict = {"name": "app", "image": "app:test"}
    spec: dict = {"nodeName": node, "serviceAccountName": "default", "containers": [container]}
    if injected:          # as the webhook leaves a pod (tests/podidentity/test_webhook_*)
        container["env"] = [
            {"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI",
             "value": "http://169.254.170.23/v1/credentials"},
            {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
             "value": "/var/run/secrets/kiamfast.io/container-credentials/token"}]
        container["volumeMounts"] = [{"name": uninjected.TOKEN_VOLUME, "readOnly": True,
                                      "mountPath": "/var/run/secrets/kiamfast.io/"
                                                   "container-credentials"}]
        spec["volumes"] = [{"name": uninjected.TOKEN_VOLUME, "projected": {"sources": [
            {"serviceAccountToken": {"audience": "kiamfast.io/container-credentials",
                                     "expirationSeconds": 600, "path": "token"}}]}}]
    pod = admin.call("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations}, "spec": spec})
    return pod["metadata"]["uid"]


def events(admin, ns: str) -> list[dict]:
    return [e for e in admin.call("GET", f"/api/v1/namespaces/{ns}/events")["items"]
            if e["reason"] == uninjected.REASON]


def test_a_pod_that_asked_and_was_not_injected_gets_an_event_and_is_counted(
        cluster, peers, tmp_path):
    admin = cluster.admin
    node, ns = f"node-{secrets.token_hex(3)}", f"uninjected-{secrets.token_hex(3)}"
    admin.create_node(node)
    admin.create_namespace(ns)
    agent = Agent(peers, tmp_path, extra=[
        f"--node={node}", f"--container-credentials-addr=127.0.0.1:{free_port()}",
        f"--kubeconfig={chart_identity(cluster, tmp_path)}"])
    try:
        agent.wait_ready()
        create_pod(admin, ns, "plain", node, {ROLE_KEY: "role-a"})
        create_pod(admin, ns, "injected", node, OPTED_IN, injected=True)
        asked = create_pod(admin, ns, "asked", node, OPTED_IN)
        deadline = time.monotonic() + 30
        while not events(admin, ns):
            assert time.monotonic() < deadline, "no Event posted"
            time.sleep(0.2)
        time.sleep(1.0)                  # the other pods were seen first: nothing more comes
        (event,) = events(admin, ns)
        assert event["type"] == "Warning"
        assert event["involvedObject"]["uid"] == asked
        assert event["involvedObject"]["name"] == "asked"
        assert "IMDS by address" in event["message"]
        deadline = time.monotonic() + 10           # published every 2 s
        while b"kiamfast_container_credentials_uninjected_pods_total 1" not in \
                agent_http(agent.port, "GET /metrics")[1]:
            assert time.monotonic() < deadline, "not counted"
            time.sleep(0.2)
    finally:
        agent.stop()
