"""The injection webhook's memory at the chart's limit, the reviews sent by the session's real
kube-apiserver and by a pod that reaches the webhook's Service.

``kiamfast webhook`` runs as its Deployment runs it (a process of its own, TLS with the
test's certificate), registered for a namespace of the test's own.  What a user checks: no
review, whoever sends it, takes the process past the chart's memory limit (the kernel's own
peak of its resident memory, VmHWM), so the kubelet never OOM-kills it and opted-in pods
keep being injected: a review whose answer would cost more than the webhook's budget is
admitted unpatched, and the API server hands the webhook's warning saying why to the client.
Before the answer was budgeted, a 372 KB review of 124,000 empty containers took the
webhook from 25 to 355 MiB and got a 77 MiB answer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_webhook_apiserver import OPTED_IN, injected, registered_webhook, unique

from kiamfast.webhook import limits

pytestmark = pytest.mark.kube_apiserver

VALUES = Path(__file__).resolve().parents[2] / "deploy/chart/kiamfast/values.yaml"
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def chart_limit() -> int:
    """The webhook container's memory limit in the chart's defaults, in bytes."""
    text = yaml.safe_load(VALUES.read_text())["containerCredentials"]["webhook"][
        "resources"]["limits"]["memory"]
    return int(text[:-2]) * UNITS[text[-2:]]


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def pod(name: str, *, containers: list[dict], annotations: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"nodeName": "no-such-node", "serviceAccountName": "default",
                     "containers": containers}}


@pytest.fixture
def webhook(cluster, tmp_path):
    admin = cluster.admin
    ns = unique("webhook-memory")
    admin.create_namespace(ns)
    with registered_webhook(admin, ns, tmp_path) as process:
        yield admin, ns, process
    assert process.process.returncode in (0, None), process.log_text()[-3000:]


def create(admin, ns: str, body: dict, *, timeout: float = 60) -> tuple[int, dict, str]:
    """POST the pod as a client does: (status, body, the Warning header)."""
    r = admin.http.request("POST", f"{admin.url}/api/v1/namespaces/{ns}/pods",
                           body=json.dumps(body).encode(), timeout=timeout, retries=False,
                           headers={"Authorization": f"Bearer {admin.token}",
                                    "Content-Type": "application/json"})
    return r.status, json.loads(r.data), r.headers.get("Warning", "")


def test_a_pods_review_of_124000_containers_is_answered_within_the_limit(webhook):
    """Any pod that reaches the webhook's Service can send it a review (372 KB)."""
    import ssl
    import http.client
    admin, ns, process = webhook
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-flood", "operation": "CREATE", "namespace": ns,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "object": pod("flood", containers=[{}] * 124_000, annotations=OPTED_IN)}}
    body = json.dumps(review, separators=(",", ":")).encode()
    conn = http.client.HTTPSConnection("127.0.0.1", process.port, timeout=60,
                                       context=ssl.create_default_context(
                                           cafile=str(process.pki["ca"])))
    try:
        conn.request("POST", "/mutate", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        status, answer = response.status, json.loads(response.read())["response"]
    finally:
        conn.close()
    assert status == 200 and answer["allowed"] is True and "patch" not in answer
    assert "not injected" in answer["warnings"][0]
    # The API server's next pod is injected: the webhook is up and was never past its limit.
    assert injected(admin.call("POST", f"/api/v1/namespaces/{ns}/pods", pod(
        "after-flood", containers=[{"name": "app", "image": "app"}], annotations=OPTED_IN)))
    assert peak_rss(process.process.pid) < chart_limit()


def test_the_api_servers_review_of_many_containers_is_admitted_unpatched_with_why(webhook):
    """The most empty containers the API server sends whole (its review ~140 bytes each,
    its parse within the budget, its patch not): the webhook admits the pod unpatched and
    the API server hands its warning to the client (then refuses the pod itself: containers
    without names)."""
    admin, ns, process = webhook
    status, out, warning = create(admin, ns, pod("many", containers=[{}] * 6000,
                                                 annotations=OPTED_IN))
    assert status == 422 and out["reason"] == "Invalid", out      # the API server's own
    assert "kiamfast: not injected: patching 6000 containers" in warning, warning
    assert peak_rss(process.process.pid) < chart_limit()


def test_a_pod_of_a_mebibyte_annotation_is_answered_within_the_limit(webhook):
    """The API server calls the webhook before it validates: a 1 MiB annotation reaches it,
    is parsed and patched; then the API server refuses the pod itself (annotations are
    limited to 256 KiB)."""
    admin, ns, process = webhook
    big = {**OPTED_IN, "example.com/blob": "x" * (1 << 20)}
    status, out, warning = create(admin, ns, pod(
        "annotated", containers=[{"name": "app", "image": "app"}], annotations=big))
    assert status == 422 and "Too long" in out["message"], out
    assert not warning
    assert f"pod {ns}/annotated: container-credentials variables and token volume added" \
        in process.log_text()
    assert limits.parse_cost(json.dumps(big).encode()) > limits.SMALL_COST   # a large one
    assert peak_rss(process.process.pid) < chart_limit()
