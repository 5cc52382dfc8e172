"""The chart's injection webhook (containerCredentials.webhook), rendered by the real helm.

What a user checks: off by default; on, the objects are valid, the API server would reach the
Service's pods over TLS it can verify (the caBundle signs a certificate for the Service's DNS
name), a failure lets pods through, the webhook's pods are never the agent's, and what the
webhook injects follows the agent's own flags.
"""
from __future__ import annotations

import base64
import datetime

import kubernetes_validate
import pytest
from cryptography import x509
from test_chart import (CHART, NAMESPACE, NEWEST_VERSION, SCHEMA_VERSION, helm, of_kind, one,
                        render, values_file)

from kiamfast.container_credentials import webhook

ENABLED = {"containerCredentials": {"webhook": {"enabled": True}}}
KINDS = {"Secret", "Deployment", "Service", "MutatingWebhookConfiguration"}


def webhook_objects(objs: list[dict]) -> dict[str, dict]:
    found = {o["kind"]: o for o in objs if o["metadata"]["name"].endswith("-webhook")}
    assert set(found) == KINDS, [o["kind"] for o in objs]
    return found


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_off_by_default():
    objs = render()
    assert not of_kind(objs, "MutatingWebhookConfiguration")
    assert not of_kind(objs, "Deployment")


def test_enabled_objects_are_valid_and_lint_clean(tmp_path):
    values = values_file(tmp_path, ENABLED)
    for obj in webhook_objects(render(values)).values():
        for version in (SCHEMA_VERSION, NEWEST_VERSION):
            kubernetes_validate.validate(obj, version, strict=True)
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_api_server_reaches_the_webhook_over_tls_it_can_verify(tmp_path):
    objs = webhook_objects(render(values_file(tmp_path, ENABLED)))
    config = objs["MutatingWebhookConfiguration"]["webhooks"][0]
    service, deployment = objs["Service"], objs["Deployment"]
    assert config["clientConfig"]["service"] == {
        "name": service["metadata"]["name"], "namespace": NAMESPACE, "path": "/mutate",
        "port": 443}
    pod = deployment["spec"]["template"]
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    port = service["spec"]["ports"][0]
    assert port["port"] == 443
    container = pod["spec"]["containers"][0]
    assert {"name": port["targetPort"], "containerPort": 8443, "protocol": "TCP"} \
        in container["ports"]
    args = webhook.parse_args(container["args"][1:])
    assert container["args"][0] == "webhook"
    assert args.listen == ("0.0.0.0", 8443)

    secret = objs["Secret"]
    assert pod["spec"]["volumes"] == [{"name": "tls", "secret": {
        "secretName": secret["metadata"]["name"]}}]
    assert args.tls_cert == "/tls/tls.crt" and args.tls_key == "/tls/tls.key"
    ca = x509.load_pem_x509_certificate(base64.b64decode(config["clientConfig"]["caBundle"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert dns in names.get_values_for_type(x509.DNSName)
    assert cert.not_valid_after_utc > datetime.datetime.now(datetime.timezone.utc) \
        + datetime.timedelta(days=365)


def test_a_failing_webhook_lets_pods_through_and_only_pod_creations_are_sent(tmp_path):
    config = webhook_objects(render(values_file(tmp_path, ENABLED))
                             )["MutatingWebhookConfiguration"]["webhooks"][0]
    assert config["failurePolicy"] == "Ignore"
    assert config["sideEffects"] == "None"
    assert config["admissionReviewVersions"] == ["v1"]
    assert config["rules"] == [{"operations": ["CREATE"], "apiGroups": [""],
                                "apiVersions": ["v1"], "resources": ["pods"],
                                "scope": "Namespaced"}]


def test_the_webhook_pods_are_never_selected_as_agents(tmp_path):
    values = values_file(tmp_path, {**ENABLED, "prometheus": {"service": {"enabled": True}}})
    objs = render(values)
    labels = webhook_objects(objs)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    daemonset = one(objs, "DaemonSet")
    assert not selects(daemonset["spec"]["selector"]["matchLabels"], labels)
    metrics = next(s for s in of_kind(objs, "Service") if s["metadata"]["name"].endswith(
        "-metrics"))
    assert not selects(metrics["spec"]["selector"], labels)


@pytest.mark.parametrize("extra, expected", [
    ({}, {"audience": "kiamfast.io/container-credentials",
          "iam_role_key": "iam.amazonaws.com/role",
          "full_uri": "http://169.254.170.23/v1/credentials"}),
    ({"container-credentials-audience": "sts.example", "iam-role-key": "example.com/role",
      "container-credentials-addr": "169.254.170.23:80"},
     {"audience": "sts.example", "iam_role_key": "example.com/role",
      "full_uri": "http://169.254.170.23:80/v1/credentials"})])
def test_what_it_injects_follows_the_agents_flags(tmp_path, extra, expected):
    values = values_file(tmp_path, {**ENABLED, "extraArgs": extra, "containerCredentials": {
        "webhook": {"enabled": True, "tokenExpirationSeconds": 900}}})
    container = webhook_objects(render(values))["Deployment"]["spec"]["template"]["spec"][
        "containers"][0]
    args = vars(webhook.parse_args(container["args"][1:]))
    assert {k: args[k] for k in expected} == expected
    assert args["token_expiration"] == 900
