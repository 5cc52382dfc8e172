"""Injection and serving together: a pod created through the real kube-apiserver, injected by
the webhook, gets its own role from the agent with botocore's default chain, using nothing
but what the webhook put in the pod (the variables, and a token requested with the volume's
audience and lifetime, as the kubelet does).
"""
from __future__ import annotations

import pytest
import test_container_credentials
from podid import BASE_ARN
from test_webhook_apiserver import OPTED_IN, ROLE_KEY, env_of, registered_webhook

from kiamfast.webhook import patch

pytestmark = pytest.mark.kube_apiserver

node = test_container_credentials.node      # that module's node and agent, started for this one
sdk_identity = test_container_credentials.sdk_identity


def kubelet_token(admin, pod: dict) -> str:
    """The token the kubelet writes into the injected volume: bound to the pod, with the
    volume's audience and expirationSeconds."""
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == patch.VOLUME)
    source = volume["projected"]["sources"][0]["serviceAccountToken"]
    meta = pod["metadata"]
    out = admin.call(
        "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/"
                f"{pod['spec']['serviceAccountName']}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [source["audience"]],
                     "expirationSeconds": source["expirationSeconds"],
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                        "name": meta["name"], "uid": meta["uid"]}}})
    return out["status"]["token"]


def test_an_injected_pod_gets_its_own_role_through_the_agent(node, tmp_path):
    admin = node.admin
    full_uri = f"http://127.0.0.1:{node.port}/v1/credentials"   # the agent's test address
    with registered_webhook(admin, node.ns, tmp_path, "--full-uri", full_uri):
        admin.call("POST", f"/api/v1/namespaces/{node.ns}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "injected", "annotations": OPTED_IN},
            "spec": {"nodeName": node.name, "serviceAccountName": "app",
                     "containers": [{"name": "app", "image": "app:test"}]}})
    admin.set_pod_running(node.ns, "injected", "10.250.200.1")
    pod = admin.get_pod(node.ns, "injected")
    env = env_of(pod["spec"]["containers"][0])
    assert env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] == full_uri
    # The SDK reads the file the variable names; here it lives in the test's directory.
    token_file = tmp_path / "token"
    token_file.write_text(kubelet_token(admin, pod))
    assert env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"].endswith("/" + token_file.name)
    arn = sdk_identity(node, "botocore", token_file, tmp_path)
    assert arn.startswith(f"arn:aws:sts::{BASE_ARN.split(':')[4]}:assumed-role/role-a/"), arn


def test_a_pod_of_an_opted_in_service_account_gets_the_accounts_role(node, webhook_reader,
                                                                      tmp_path):
    """The pod carries no annotation of its own: the webhook takes the role from its
    ServiceAccount; the agent applies the namespace's restrictions to it as to any role."""
    from test_webhook_service_account import annotate_service_account
    admin = node.admin
    annotate_service_account(admin, node.ns, "by-account", {
        ROLE_KEY: "role-b", patch.OPT_IN_ANNOTATION: "true"})
    annotate_service_account(admin, node.ns, "by-account-denied", {
        ROLE_KEY: "role-c", patch.OPT_IN_ANNOTATION: "true"})     # not allowed here
    full_uri = f"http://127.0.0.1:{node.port}/v1/credentials"
    with registered_webhook(admin, node.ns, tmp_path, "--full-uri", full_uri,
                            "--service-account-opt-in", "--kubeconfig", str(webhook_reader)):
        for name, account in (("sa-pod", "by-account"), ("sa-denied", "by-account-denied")):
            admin.call("POST", f"/api/v1/namespaces/{node.ns}/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                "spec": {"nodeName": node.name, "serviceAccountName": account,
                         "containers": [{"name": "app", "image": "app:test"}]}})
    admin.set_pod_running(node.ns, "sa-pod", "10.250.200.2")
    admin.set_pod_running(node.ns, "sa-denied", "10.250.200.3")
    pod = admin.get_pod(node.ns, "sa-pod")
    assert pod["metadata"]["annotations"] == {ROLE_KEY: "role-b"}
    token_file = tmp_path / "token"
    token_file.write_text(kubelet_token(admin, pod))
    arn = sdk_identity(node, "botocore", token_file, tmp_path)
    assert arn.startswith(f"arn:aws:sts::{BASE_ARN.split(':')[4]}:assumed-role/role-b/"), arn

    denied = admin.get_pod(node.ns, "sa-denied")
    assert denied["metadata"]["annotations"] == {ROLE_KEY: "role-c"}
    status, body = node.answered(kubelet_token(admin, denied))
    assert status == 403 and body["Code"] == "AccessDenied" and "role-c" in body["Message"]
