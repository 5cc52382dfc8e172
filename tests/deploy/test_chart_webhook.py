"""The chart's injection webhook (containerCredentials.webhook), rendered by the real helm.

What a user checks: off by default; on, the objects are valid, the API server would reach the
Service's pods over TLS it can verify (the caBundle signs a certificate for the Service's DNS
name, or with certManager.enabled cert-manager issues it and its cainjector fills the
caBundle), a failure lets pods through and the webhook's pods are never the agent's.  What it
injects against what the agent serves: test_chart_container_credentials.py; cert-manager's
objects against its real CRDs: tests/k8s/test_chart_dry_run.py.
"""
from __future__ import annotations

import base64
import datetime

import kubernetes_validate
from cryptography import x509
from test_chart import (CHART, NAMESPACE, NEWEST_VERSION, SCHEMA_VERSION, helm, notes,
                        of_kind, one, render, render_error, values_file)

from kiamfast.webhook import cli as webhook_cli

ENABLED = {"containerCredentials": {"enabled": True, "webhook": {"enabled": True}}}
CERT_MANAGER = {"containerCredentials": {"enabled": True, "webhook": {
    "enabled": True, "certManager": {"enabled": True}}}}
# With serviceAccountOptIn (on by default) the webhook has an identity of its own.
IDENTITY = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
KINDS = {"Secret", "Deployment", "Service", "MutatingWebhookConfiguration"} | IDENTITY
CERT_MANAGER_KINDS = {"Certificate", "Deployment", "Service",
                      "MutatingWebhookConfiguration"} | IDENTITY


def webhook_objects(objs: list[dict], kinds: set[str] = KINDS) -> dict[str, dict]:
    found = {o["kind"]: o for o in objs if o["metadata"]["name"].endswith("-webhook")}
    assert set(found) == kinds, [o["kind"] for o in objs]
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
    args = webhook_cli.parse_args(container["args"][1:])
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


def test_the_token_expiration_is_the_values(tmp_path):
    values = values_file(tmp_path, {"containerCredentials": {
        "enabled": True, "webhook": {"enabled": True, "tokenExpirationSeconds": 900}}})
    container = webhook_objects(render(values))["Deployment"]["spec"]["template"]["spec"][
        "containers"][0]
    assert webhook_cli.parse_args(container["args"][1:]).token_expiration == 900


# ---- certManager.enabled: cert-manager issues the serving certificate ------------------------

def by_name(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in of_kind(objs, kind)}


def test_cert_manager_issues_a_certificate_for_the_service_and_injects_its_ca(tmp_path):
    objs = render(values_file(tmp_path, CERT_MANAGER))
    found = webhook_objects(objs, CERT_MANAGER_KINDS)
    assert not of_kind(objs, "Secret")            # cert-manager writes it, not helm
    certificate, service = found["Certificate"], found["Service"]
    config = found["MutatingWebhookConfiguration"]
    # The cainjector fills every webhook's caBundle from the Certificate's Secret (ca.crt).
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from":
            f"{NAMESPACE}/{certificate['metadata']['name']}"}
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    assert certificate["metadata"]["namespace"] == NAMESPACE
    dns = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert dns in certificate["spec"]["dnsNames"]
    # The pods serve the files of the Secret cert-manager writes, and reload a renewal
    # themselves: no checksum restarts them.
    pod = found["Deployment"]["spec"]["template"]
    assert pod["spec"]["volumes"] == [{"name": "tls", "secret": {
        "secretName": certificate["spec"]["secretName"]}}]
    assert "annotations" not in pod["metadata"]
    args = webhook_cli.parse_args(pod["spec"]["containers"][0]["args"][1:])
    assert (args.tls_cert, args.tls_key) == ("/tls/tls.crt", "/tls/tls.key")
    # The Secret is not the chart's own Secret's name: switching to cert-manager never has
    # helm delete the Secret cert-manager just wrote.
    assert certificate["spec"]["secretName"] != found["Service"]["metadata"]["name"]


def test_cert_manager_bootstrap_self_signed_ca_issuer_chain(tmp_path):
    objs = render(values_file(tmp_path, CERT_MANAGER))
    issuers, certificates = by_name(objs, "Issuer"), by_name(objs, "Certificate")
    serving = next(c for n, c in certificates.items() if n.endswith("-webhook"))
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    assert serving["spec"]["issuerRef"]["kind"] == "Issuer"
    ca_certificate = next(c for c in certificates.values()
                          if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"])
    assert ca_certificate["spec"]["isCA"] is True
    root = issuers[ca_certificate["spec"]["issuerRef"]["name"]]
    assert root["spec"] == {"selfSigned": {}}
    assert len(issuers) == 2 and len(certificates) == 2
    for obj in [*issuers.values(), *certificates.values()]:
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert obj["metadata"]["namespace"] == NAMESPACE


def test_cert_manager_with_an_issuer_of_ones_own_makes_only_the_certificate(tmp_path):
    ref = {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    objs = render(values_file(tmp_path, {"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "certManager": {"enabled": True, "issuerRef": ref}}}}))
    assert not of_kind(objs, "Issuer")
    (certificate,) = of_kind(objs, "Certificate")
    assert certificate["spec"]["issuerRef"] == ref


def test_cert_manager_objects_lint_clean_and_the_rest_validate(tmp_path):
    values = values_file(tmp_path, CERT_MANAGER)
    for obj in render(values):
        if obj["apiVersion"] != "cert-manager.io/v1":   # its CRDs: the real server's check
            for version in (SCHEMA_VERSION, NEWEST_VERSION):
                kubernetes_validate.validate(obj, version, strict=True)
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, "-f", str(values))
    assert result.returncode == 0, result.stdout + result.stderr


def test_cert_manager_notes_say_it_must_be_installed(tmp_path):
    text = notes(tmp_path, values_file(tmp_path, CERT_MANAGER))
    assert "Its certificate comes from cert-manager, which must be installed" in text


# ---- networkPolicy: only the API server reaches the webhook ----------------------------------

def network_policy(cidrs: list[str]) -> dict:
    return {"containerCredentials": {"enabled": True, "webhook": {
        "enabled": True, "networkPolicy": {"enabled": True, "apiServerCIDRs": cidrs}}}}


def test_no_network_policy_unless_asked(tmp_path):
    assert not of_kind(render(values_file(tmp_path, ENABLED)), "NetworkPolicy")


def test_the_network_policy_admits_the_api_server_cidrs_to_the_webhook_port_alone(tmp_path):
    cidrs = ["10.0.0.0/16", "fd00:10::/64"]
    objs = render(values_file(tmp_path, network_policy(cidrs)))
    (policy,) = of_kind(objs, "NetworkPolicy")
    for version in (SCHEMA_VERSION, NEWEST_VERSION):
        kubernetes_validate.validate(policy, version, strict=True)
    deployment = webhook_objects([o for o in objs if o["kind"] != "NetworkPolicy"])[
        "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    assert not selects(policy["spec"]["podSelector"]["matchLabels"],
                       one(objs, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{
        "from": [{"ipBlock": {"cidr": c}} for c in cidrs],
        "ports": [{"protocol": "TCP", "port": 8443}]}]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert webhook_cli.parse_args(container["args"][1:]).listen[1] == 8443


def test_a_network_policy_without_cidrs_is_refused(tmp_path):
    # An ingress rule with no sources admits every source: the opposite of what is asked.
    assert "networkPolicy.enabled needs apiServerCIDRs" in render_error(
        tmp_path, network_policy([]))
