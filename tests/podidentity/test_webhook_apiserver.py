"""The injection webhook called by the session's real kube-apiserver.

What a user checks: a pod created through the API that opts in comes back with the two
variables and the projected token volume; any other pod comes back as it was sent; with the
webhook down, pods are still created (failurePolicy Ignore), untouched: they then get IMDS by
address, kube2iam's contract.  The webhook configuration is cluster-wide in a server the
whole session shares, so it selects only this test's namespace and is deleted afterwards.
"""
from __future__ import annotations

import base64
import contextlib
import os
import secrets
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kube
import pytest
from podid import AUDIENCE

from kiamfast.webhook import patch

pytestmark = pytest.mark.kube_apiserver

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "deploy"))
ROLE_KEY = "iam.amazonaws.com/role"
OPTED_IN = {ROLE_KEY: "role-a", patch.OPT_IN_ANNOTATION: "true"}
CONFIGS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
TEST_LABEL = "kiamfast.io/webhook-test"


class WebhookProcess:
    """``kiamfast webhook`` as its Deployment runs it, on loopback with the test's cert."""

    def __init__(self, workdir: Path, *extra_args: str) -> None:
        self.pki = kube.make_pki(workdir / "webhook-pki")   # serving cert for 127.0.0.1
        self.port = kube.free_port()
        self.log = (workdir / "webhook.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "kiamfast", "webhook",
             "--tls-cert", str(self.pki["cert"]), "--tls-key", str(self.pki["key"]),
             "--listen", f"127.0.0.1:{self.port}", "--token-expiration", "600",
             *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})

    def wait_ready(self, timeout: float = 20.0) -> None:
        context = ssl.create_default_context(cafile=str(self.pki["ca"]))
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"webhook exited: {self.log_text()}"
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{self.port}/healthz",
                                            context=context, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"webhook not ready: {self.log_text()}"
            time.sleep(0.05)

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.log.close()


def webhook_configuration(name: str, *, port: int, ca: Path, namespace_label: str) -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "container-credentials.kiamfast.io",
            "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate",
                             "caBundle": base64.b64encode(ca.read_bytes()).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchLabels": {TEST_LABEL: namespace_label}},
            "failurePolicy": "Ignore", "sideEffects": "None", "timeoutSeconds": 5,
            "admissionReviewVersions": ["v1"]}]}


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def create_namespace(admin, name: str, labels: dict[str, str]) -> None:
    admin.call("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})


def create_pod(admin, ns: str, name: str, annotations: dict[str, str], *,
               service_account: str = "default") -> dict:
    """A pod with an initContainer and two containers, one setting its own provider URI.
    (This API server runs without the ServiceAccount admission plugin, which would set
    ``serviceAccountName`` as on any real cluster: the test sets it.)"""
    return admin.call("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"nodeName": "no-such-node", "serviceAccountName": service_account,
                 "initContainers": [{"name": "init", "image": "init:test"}],
                 "containers": [
                     {"name": "app", "image": "app:test"},
                     {"name": "own", "image": "own:test", "env": [
                         {"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                          "value": "http://127.0.0.1:9/own"}]}]}})


def injected(pod: dict) -> bool:
    return any(v["name"] == patch.VOLUME for v in pod["spec"].get("volumes", []))


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@contextlib.contextmanager
def registered_webhook(admin, ns: str, workdir: Path, *extra_args: str):
    """The webhook running and registered for namespace ``ns`` alone (labelled here); its
    configuration is deleted afterwards whatever happens."""
    admin.call("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {TEST_LABEL: ns}}},
               content_type="application/merge-patch+json")
    process = WebhookProcess(workdir, *extra_args)
    config = webhook_configuration(ns, port=process.port, ca=process.pki["ca"],
                                   namespace_label=ns)
    try:
        process.wait_ready()
        admin.call("POST", CONFIGS, config)
        wait_until_registered(admin, ns)
        yield process
    finally:
        process.stop()
        admin.request("DELETE", f"{CONFIGS}/{ns}")


@pytest.fixture
def scoped_webhook(cluster, tmp_path):
    admin = cluster.admin
    ns = unique("webhook")
    create_namespace(admin, ns, {})
    with registered_webhook(admin, ns, tmp_path) as process:
        yield admin, ns, process


def wait_until_registered(admin, ns: str, timeout: float = 20.0) -> None:
    """The API server calls a new webhook once its informer has it: create probe pods until
    one comes back injected."""
    deadline = time.monotonic() + timeout
    for attempt in range(10_000):
        pod = create_pod(admin, ns, f"probe-{attempt}", OPTED_IN)
        admin.delete_pod(ns, pod["metadata"]["name"])
        if injected(pod):
            return
        assert time.monotonic() < deadline, "the API server never called the webhook"
        time.sleep(0.1)


def test_the_api_server_stores_an_opting_in_pod_with_the_variables_and_token(scoped_webhook):
    admin, ns, _ = scoped_webhook
    create_pod(admin, ns, "opted-in", OPTED_IN)
    pod = admin.get_pod(ns, "opted-in")
    token_file = f"{patch.MOUNT_PATH}/{patch.TOKEN_FILE}"
    for c in (pod["spec"]["initContainers"][0], pod["spec"]["containers"][0]):
        assert env_of(c) == {"AWS_CONTAINER_CREDENTIALS_FULL_URI":
                             "http://169.254.170.23/v1/credentials",
                             "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": token_file}
        assert {"name": patch.VOLUME, "mountPath": patch.MOUNT_PATH,
                "readOnly": True} in c["volumeMounts"]
    own = pod["spec"]["containers"][1]
    assert env_of(own) == {"AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://127.0.0.1:9/own"}
    assert not own.get("volumeMounts")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == patch.VOLUME)
    assert volume["projected"]["sources"] == [{"serviceAccountToken": {
        "audience": AUDIENCE, "expirationSeconds": 600, "path": patch.TOKEN_FILE}}]


def test_pods_that_do_not_opt_in_or_are_elsewhere_are_stored_as_sent(scoped_webhook):
    admin, ns, _ = scoped_webhook
    plain = create_pod(admin, ns, "plain", {ROLE_KEY: "role-a"})
    assert not injected(plain)
    assert "env" not in plain["spec"]["containers"][0]
    no_account = create_pod(admin, ns, "no-account", OPTED_IN, service_account="")
    assert not injected(no_account)     # a token volume would make the API refuse the pod
    other_ns = unique("webhook-other")     # not selected by the webhook configuration
    create_namespace(admin, other_ns, {})
    assert not injected(create_pod(admin, other_ns, "opted-in", OPTED_IN))


def test_with_the_webhook_down_pods_are_still_created_untouched(scoped_webhook):
    admin, ns, process = scoped_webhook
    process.stop()
    pod = create_pod(admin, ns, "while-down", OPTED_IN)
    assert pod["metadata"]["uid"]
    assert not injected(pod)
    assert "env" not in pod["spec"]["containers"][0]

