"""A TokenReview that fails inside the API server is "try again", never a cached refusal.

The whole agent against the real kube-apiserver, its API traffic through a fault-injecting
proxy (review_fault_proxy.py): the pod, its token and every review are real; while the
fault is on, each review's status is replaced with what the real server answers when its
own lookup of the token's pod or ServiceAccount fails (claims.go: "service account token
has been invalidated" for any failed pod GET; the storage error's text for a failed
ServiceAccount GET), which the real server gives only for a storage read failing on an
object its informer cache lacks, not on demand.  The real server's own refusals are in
test_review_texts.py.

What a user checks: the pod gets 503 (its SDK retries) while the API server cannot check,
and its credentials as soon as it can again, not 400 "bad token" for a minute.
"""
from __future__ import annotations

import secrets

import pytest
from review_fault_proxy import ReviewFaultProxy
from test_container_credentials import Node

pytestmark = pytest.mark.kube_apiserver

FAULTS = {
    "pod lookup": "[invalid bearer token, service account token has been invalidated]",
    "service account lookup": "[invalid bearer token, etcdserver: request timed out]",
}


@pytest.fixture(scope="module")
def faulty(cluster, peers, tmp_path_factory):
    proxy = ReviewFaultProxy(target_port=cluster.apiserver.port, ca=cluster.apiserver.ca)
    via = proxy.kubeconfig(cluster, peers.kubeconfig, f"faulty-{secrets.token_hex(3)}")
    node = Node(cluster, peers, tmp_path_factory.mktemp("faulty"),
                lambda prefix: f"{prefix}-{secrets.token_hex(3)}",
                extra=(f"--kubeconfig={via}",))
    yield node, proxy
    node.agent.stop()
    proxy.close()


@pytest.mark.parametrize("lookup", list(FAULTS))
def test_a_review_that_failed_inside_the_api_server_is_503_then_served(faulty, lookup):
    node, proxy = faulty
    node.next_source()
    name = f"p-{lookup.split()[0]}"
    uid = node.pod(name, role="role-a")
    assert node.answered(node.token(name, uid))[0] == 200     # the pod is known, served
    token = node.token(name, uid, seconds=700)                 # the kubelet's next token
    proxy.fault = FAULTS[lookup]
    faulted = proxy.faulted
    try:
        for _ in range(3):
            status, body = node.ask(token)
            assert (status, body["Code"]) == (503, "ServiceUnavailable"), body
            assert "could not check" in body["Message"], body
        assert proxy.faulted == faulted + 3             # asked each time: never cached
    finally:
        proxy.fault = None
    status, body = node.ask(token)                # the API server can check again: served
    assert status == 200 and body["AccessKeyId"], body
