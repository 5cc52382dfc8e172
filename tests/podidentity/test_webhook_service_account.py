"""The opt-in by ServiceAccount (``--service-account-opt-in``), the real kube-apiserver calling
the webhook and the webhook reading ServiceAccounts from it, as the chart's ClusterRole lets
it (conftest.webhook_reader).

What a user checks: a pod of an opted-in ServiceAccount is stored with the account's role
annotation, the two variables and the token volume; a pod's own role and its own opt-out
win over its account's; a webhook that may not read ServiceAccounts admits such pods
untouched (they then get IMDS by address) and says why, once.
"""
from __future__ import annotations

import pytest
from podid import AUDIENCE, create_service_account, webhook_kubeconfig
from test_webhook_apiserver import (
    ROLE_KEY,
    create_namespace,
    create_pod,
    env_of,
    injected,
    registered_webhook,
    unique,
)

from kiamfast.webhook import patch

pytestmark = pytest.mark.kube_apiserver

OPT_IN = patch.OPT_IN_ANNOTATION
TOKEN_FILE = f"{patch.MOUNT_PATH}/{patch.TOKEN_FILE}"


def annotate_service_account(admin, ns: str, name: str, annotations: dict[str, str]) -> None:
    create_service_account(admin, ns, name)
    admin.call("PATCH", f"/api/v1/namespaces/{ns}/serviceaccounts/{name}",
               {"metadata": {"annotations": annotations}},
               content_type="application/merge-patch+json")


@pytest.fixture
def namespace(cluster):
    admin = cluster.admin
    ns = unique("webhook-sa")
    create_namespace(admin, ns, {})
    annotate_service_account(admin, ns, "opted", {ROLE_KEY: "role-sa", OPT_IN: "true"})
    annotate_service_account(admin, ns, "plain", {ROLE_KEY: "role-sa"})
    return admin, ns


def test_pods_of_an_opted_in_account_are_stored_with_its_role_and_the_injection(
        namespace, webhook_reader, tmp_path):
    admin, ns = namespace
    with registered_webhook(admin, ns, tmp_path, "--service-account-opt-in",
                            "--kubeconfig", str(webhook_reader)) as process:
        for name in ("by-account-1", "by-account-2"):
            create_pod(admin, ns, name, {}, service_account="opted")
        own_role = create_pod(admin, ns, "own-role", {ROLE_KEY: "role-own"},
                              service_account="opted")
        opted_out = create_pod(admin, ns, "opted-out", {OPT_IN: "false"},
                               service_account="opted")
        plain = create_pod(admin, ns, "plain", {}, service_account="plain")
        own_opt_in = create_pod(admin, ns, "own-opt-in", {OPT_IN: "true"},
                                service_account="plain")
        log = process.log_text()
    for name in ("by-account-1", "by-account-2"):
        pod = admin.get_pod(ns, name)
        assert pod["metadata"]["annotations"] == {ROLE_KEY: "role-sa"}
        app = pod["spec"]["containers"][0]
        assert env_of(app) == {
            "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1/credentials",
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": TOKEN_FILE}
        assert {"name": patch.VOLUME, "mountPath": patch.MOUNT_PATH,
                "readOnly": True} in app["volumeMounts"]
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == patch.VOLUME)
        assert volume["projected"]["sources"] == [{"serviceAccountToken": {
            "audience": AUDIENCE, "expirationSeconds": 600, "path": patch.TOKEN_FILE}}]
    assert injected(own_role) and own_role["metadata"]["annotations"] == {ROLE_KEY: "role-own"}
    assert not injected(opted_out)
    assert opted_out["metadata"]["annotations"] == {OPT_IN: "false"}
    assert "env" not in opted_out["spec"]["containers"][0]
    # An account with a role but no opt-in opts nobody in; a pod's own opt-in takes its role.
    assert not injected(plain) and not plain["metadata"].get("annotations")
    assert injected(own_opt_in)
    assert own_opt_in["metadata"]["annotations"] == {OPT_IN: "true", ROLE_KEY: "role-sa"}
    assert "cannot read ServiceAccounts" not in log


def test_a_webhook_that_may_not_read_accounts_admits_their_pods_untouched(
        cluster, namespace, tmp_path):
    admin, ns = namespace
    unbound = webhook_kubeconfig(cluster, unique("webhook-unbound"), rules=None)
    with registered_webhook(admin, ns, tmp_path, "--service-account-opt-in",
                            "--kubeconfig", str(unbound)) as process:
        pods = [create_pod(admin, ns, f"by-account-{i}", {}, service_account="opted")
                for i in range(3)]
        own = create_pod(admin, ns, "own", {ROLE_KEY: "role-own", OPT_IN: "true"},
                         service_account="opted")
        log = process.log_text()
    for pod in pods:
        assert not injected(pod) and not pod["metadata"].get("annotations")
        assert "env" not in pod["spec"]["containers"][0]
    assert injected(own)                  # a pod's own opt-in needs no account read
    lines = [line for line in log.splitlines() if "cannot read ServiceAccounts" in line]
    assert len(lines) == 1, log           # one line for the episode, not one per pod
    assert "403" in lines[0] and f"{ns}/opted" in lines[0]
