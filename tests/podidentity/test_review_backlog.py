"""A slow API server and floods of forged tokens do not take the token path from honest pods.

The whole agent against the real kube-apiserver, its API traffic through the test proxy
(review_fault_proxy.py), which spends 1 s before passing each TokenReview on: an API server
answering a review a second, however many run at once.  Three pods flood the listener with
forged tokens naming themselves (signed with another key: each one new, so each costs a
review) from their own addresses, as fast as the listener answers them, over several
connections each, while 50 honest pods get a new token each (the kubelet's rotation) and ask
with it as botocore's container provider does (2 s an attempt, 1 s between attempts).

What a user checks: every honest pod's first call with its new token is answered with its
credentials within 5 s.  Before the review queue (review_queue.py), the flood's reviews
piled up in the reviewer's thread pool without bound, and every new token waited behind
them until its request gave up.
"""
from __future__ import annotations

import secrets
import threading

import pytest
from podid import other_key, resigned
from review_fault_proxy import ReviewFaultProxy
from test_container_credentials import Node
from token_clients import like_botocore, rotations_beside_forged_floods

pytestmark = pytest.mark.kube_apiserver

HONEST = 50
ATTACKERS = 3
FLOOD_CONNECTIONS = 6           # per attacker: more than its share of pending reviews
REVIEW_DELAY = 1.0
WITHIN = 5.0
ROTATION_SPREAD = 20.0          # the honest pods' new tokens come over this many seconds


@pytest.fixture(scope="module")
def slow(cluster, peers, tmp_path_factory):
    proxy = ReviewFaultProxy(target_port=cluster.apiserver.port, ca=cluster.apiserver.ca)
    via = proxy.kubeconfig(cluster, peers.kubeconfig, f"slow-{secrets.token_hex(3)}")
    node = Node(cluster, peers, tmp_path_factory.mktemp("slow"),
                lambda prefix: f"{prefix}-{secrets.token_hex(3)}",
                extra=(f"--kubeconfig={via}",))
    yield node, proxy
    node.agent.stop()
    proxy.close()


def test_honest_pods_new_tokens_are_served_within_5_s_beside_forged_token_floods(
        slow, tmp_path):
    node, proxy = slow
    honest = []
    for i in range(HONEST):
        uid = node.pod(f"honest-{i}", role="role-a")
        node.next_source()
        honest.append((f"honest-{i}", uid, node.source))
    # Each honest pod served once, before the slow reviews: its credentials are ready, so
    # what is measured below is the review of its next token.
    first = {name: node.token(name, uid) for name, uid, _ in honest}
    warm = {}
    threads = [threading.Thread(target=lambda n=name, s=source: warm.__setitem__(
        n, like_botocore(node.port, first[n], s, within=WITHIN)))
        for name, _, source in honest]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(seconds < WITHIN for seconds, _ in warm.values()), warm
    key = other_key(tmp_path)
    attackers = []
    for i in range(ATTACKERS):
        uid = node.pod(f"forger-{i}", role="role-a")
        genuine = node.token(f"forger-{i}", uid)
        node.next_source()
        forged = [resigned(genuine, key, jti=secrets.token_hex(8)) for _ in range(400)]
        attackers.append((node.source, forged))

    proxy.review_delay = REVIEW_DELAY
    answers: dict[int, int] = {}
    try:
        got = rotations_beside_forged_floods(
            node.port, [(lambda n=name, u=uid: node.token(n, u, seconds=700), source)
                        for name, uid, source in honest], attackers,
            connections=FLOOD_CONNECTIONS, spread=ROTATION_SPREAD, within=WITHIN,
            answers=answers)
    finally:
        proxy.review_delay = 0.0
    results = {name: r for (name, _, _), r in zip(honest, got)}
    late = {name: r for name, r in results.items() if r[0] > WITHIN}
    assert len(results) == HONEST and not late, late
    assert sum(answers.values()) > 100, answers          # the floods did run throughout
    assert 200 not in answers, answers                   # and got no credentials
