"""What the real kube-apiserver says when it does not authenticate a pod's token, and what
the agent's reviewer makes of it: a definite refusal is 400 and cached, "could not check
right now" is 503 and asked again.

Every case here is produced by the session's real kube-apiserver (no fault injected): the
texts come from its service-account authenticator (k8s.io/kubernetes pkg/serviceaccount/
claims.go and jwt.go), and the reviewer calls it through the agent's own client and
identity.  Two of its texts say "could not check" although the cause here is definite:
claims.go answers "service account token has been invalidated" for a deleted pod exactly
as for a pod lookup that failed in its storage (any error of the GET), and "invalid
signature, no keys found" for an unknown key id exactly as for an external signer's keys
it could not fetch; the agent cannot tell them apart from the text, so it answers 503 and
asks again, and its pod view refuses a deleted pod (403) once the watch has the deletion
(test_hostile_clients.py replays a deleted pod's token through the whole agent).  The
failing lookups themselves cannot be produced on demand here (the lookups read the API
server's informer cache first): test_review_fault.py injects them with a proxy.
"""
from __future__ import annotations

import asyncio
import secrets
import time

import pytest
from podid import AUDIENCE, create_service_account, other_key, pod_token, resigned

from kiamfast.container_credentials.token_review import (
    TokenRejected,
    TokenReviewer,
    bound_pod,
    token_review_call,
    unverified_claims,
)

pytestmark = pytest.mark.kube_apiserver


class Reviews:
    """The agent's reviewer against the real API server, with what each review said."""

    def __init__(self, peers) -> None:
        from kiamfast.kube.client import Client
        from kiamfast.kube.config import load_config
        call = token_review_call(Client(load_config(kubeconfig=str(peers.kubeconfig))))
        self.errors: list[str] = []

        def recorded(token: str, audience: str) -> dict:
            status = call(token, audience)
            self.errors.append(str(status.get("error") or ""))
            return status
        self.reviewer = TokenReviewer(recorded, audience=AUDIENCE)

    def outcome(self, token: str) -> tuple[int, str, str]:
        """(status, message, the API server's status.error) of one review of `token`,
        through the cache as the listener asks it."""
        async def go() -> tuple[int, str]:
            try:
                if self.reviewer.cached(token) is None:
                    await self.reviewer.review(token, bound_pod(unverified_claims(token)))
                return 200, ""
            except TokenRejected as e:
                return e.status, e.message
        before = len(self.errors)
        status, message = asyncio.run(go())
        return status, message, self.errors[-1] if len(self.errors) > before else "(cached)"


@pytest.fixture
def world(cluster, peers):
    admin = cluster.admin
    ns = f"texts-{secrets.token_hex(3)}"
    admin.create_namespace(ns)
    node = f"node-{ns}"
    admin.create_node(node)
    create_service_account(admin, ns, "app")
    reviews = Reviews(peers)
    yield admin, ns, node, reviews
    reviews.reviewer.close()


def make_pod(admin, ns: str, name: str, node: str, sa: str = "app") -> str:
    admin.call("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeName": node, "serviceAccountName": sa,
                 "containers": [{"name": "app", "image": "app:test"}]}})
    return admin.get_pod(ns, name)["metadata"]["uid"]


def wait_gone(admin, path: str) -> None:
    deadline = time.monotonic() + 10
    while admin.request("GET", path)[0] != 404:
        assert time.monotonic() < deadline, f"{path} still there"
        time.sleep(0.05)


def assert_definite(reviews: Reviews, token: str, phrase: str) -> None:
    status, message, error = reviews.outcome(token)
    assert phrase in error, error               # the real server's own words
    assert status == 400 and phrase in message, (status, message)
    assert reviews.outcome(token)[:2] == (400, message)
    assert reviews.outcome(token)[2] == "(cached)"


def assert_undecided(reviews: Reviews, token: str, phrase: str) -> None:
    for _ in range(2):                          # asked again every time: never cached
        status, message, error = reviews.outcome(token)
        assert phrase in error, error
        assert status == 503 and phrase in message, (status, message)


def test_a_live_pods_token_is_accepted(world):
    admin, ns, node, reviews = world
    uid = make_pod(admin, ns, "live", node)
    assert reviews.outcome(pod_token(admin, ns, "app", "live", uid)) == (200, "", "")


def test_refusals_for_good_are_400_and_cached(world, cluster, tmp_path):
    admin, ns, node, reviews = world
    sa_key = cluster.pki["sa_key"]
    uid = make_pod(admin, ns, "p", node)
    good = pod_token(admin, ns, "app", "p", uid)
    now = int(time.time())
    # Genuine (the cluster's own key), expired past the API server's minute of leeway.
    assert_definite(reviews, resigned(good, sa_key, iat=now - 1200, nbf=now - 1200,
                                      exp=now - 120), "service account token has expired")
    # Signed by another key under the cluster key's id.
    assert_definite(reviews, resigned(good, other_key(tmp_path)),
                    "go-jose/go-jose: error in cryptographic primitive")
    # Another issuer: no authenticator takes it for its own.
    assert_definite(reviews, resigned(good, sa_key, iss="https://issuer.example"),
                    "invalid bearer token")
    # Issued for another audience, reviewed for ours.
    assert_definite(reviews, pod_token(admin, ns, "app", "p", uid, audience="sts.amazonaws.com"),
                    "is invalid for the target audiences")

    # The pod deleted and created again under its name: the old token names the old uid.
    admin.delete_pod(ns, "p")
    wait_gone(admin, f"/api/v1/namespaces/{ns}/pods/p")
    make_pod(admin, ns, "p", node)
    assert_definite(reviews, good, "does not match service account pod ref claim")

    # The ServiceAccount deleted (NotFound), then created again (another uid).
    create_service_account(admin, ns, "gone")
    gone_uid = make_pod(admin, ns, "q", node, sa="gone")
    gone_token = pod_token(admin, ns, "gone", "q", gone_uid)
    recreated_token = pod_token(admin, ns, "gone", "q", gone_uid, seconds=700)
    admin.call("DELETE", f"/api/v1/namespaces/{ns}/serviceaccounts/gone")
    wait_gone(admin, f"/api/v1/namespaces/{ns}/serviceaccounts/gone")
    assert_definite(reviews, gone_token, 'serviceaccounts "gone" not found')
    create_service_account(admin, ns, "gone")
    assert_definite(reviews, recreated_token, "does not match claim")


def test_texts_that_may_mean_could_not_check_are_503_and_asked_again(world, cluster, tmp_path):
    admin, ns, node, reviews = world
    uid = make_pod(admin, ns, "d", node)
    token = pod_token(admin, ns, "app", "d", uid)
    assert reviews.outcome(token)[0] == 200
    # A deleted pod: the pod's GET failed (NotFound here; a storage error says the same).
    uid2 = make_pod(admin, ns, "e", node)
    deleted = pod_token(admin, ns, "app", "e", uid2)
    admin.delete_pod(ns, "e")
    wait_gone(admin, f"/api/v1/namespaces/{ns}/pods/e")
    assert_undecided(reviews, deleted, "service account token has been invalidated")
    # Not valid yet by more than the minute of leeway: another API server's clock.
    now = int(time.time())
    assert_undecided(reviews, resigned(token, cluster.pki["sa_key"], nbf=now + 300),
                     "service account token is not valid yet")
    # A key id the API server does not hold (an external signer's keys not fetched says
    # the same).
    assert_undecided(reviews, _with_kid(token, other_key(tmp_path)),
                     "invalid signature, no keys found")
    assert reviews.reviewer.stats["undecided"] == 6


def _with_kid(token: str, key_path) -> str:
    """`token` with a key id no cluster key has, signed by the key at `key_path`."""
    import base64
    import json
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    header["kid"] = "unknown-" + secrets.token_hex(4)
    head = base64.urlsafe_b64encode(json.dumps(header).encode()).rstrip(b"=").decode()
    return resigned(f"{head}.{token.split('.', 1)[1]}", key_path)
