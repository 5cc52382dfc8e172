"""A control process restarted while the API server is down: a pod it knows only from the
container runtime is "not yet" (503), never refused (403), once TokenReview works again.

The whole agent with a container runtime (the CRI double) against the real kube-apiserver,
its API traffic through the test proxy (review_fault_proxy.py).  The pod runs and is served
by token; the API server goes down (every call answered 503) and the control process is
killed; the next one finds the pod's sandbox in the runtime, but not its API object (no
list, no watch): it does not know the pod's ServiceAccount.  TokenReview comes back before
the pod list does.  What a user checks: the pod's token is answered 503 until the agent
knows the pod from the API (its SDK retries), then 200; a 403 would tell the SDK "this is
not your role" and count as a refusal of its address.
"""
from __future__ import annotations

import os
import secrets
import signal
import time

import pytest
from podid import create_pod
from review_fault_proxy import ReviewFaultProxy
from test_container_credentials import Node

from kiamfast.testing.cri_fault import fake_sandbox
from kiamfast.testing.loopback import LoopbackNode

pytestmark = pytest.mark.kube_apiserver

REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"


@pytest.fixture(scope="module")
def restarting(cluster, peers, tmp_path_factory):
    proxy = ReviewFaultProxy(target_port=cluster.apiserver.port, ca=cluster.apiserver.ca)
    via = proxy.kubeconfig(cluster, peers.kubeconfig, f"restart-{secrets.token_hex(3)}")
    workdir = tmp_path_factory.mktemp("restart")
    (workdir / "node").mkdir()
    with LoopbackNode(kubeconfig=via, workdir=workdir / "node",
                      runtime_name="cri-fault") as loopback:
        node = Node(cluster, loopback, workdir / "agent",
                    lambda prefix: f"{prefix}-{secrets.token_hex(3)}")
        try:
            yield node, loopback.runtime, proxy
        finally:
            node.agent.stop()
            proxy.close()


def test_a_pod_known_only_from_the_runtime_after_a_restart_is_not_yet_then_served(
        restarting):
    node, runtime, proxy = restarting
    ip = "127.0.240.1"
    uid = create_pod(node.admin, node.ns, "sandboxed", node=node.name, sa="app", ip=ip,
                     role="role-a")
    runtime.put(fake_sandbox(name="sandboxed", namespace=node.ns, uid=uid, ip=ip,
                             annotations={"iam.amazonaws.com/role": "role-a"}))
    status, before = node.answered(node.token("sandboxed", uid))
    assert status == 200, before

    proxy.down = lambda method, path: True               # the API server goes down
    [control] = node.agent.children("kiamfast.control")
    statuses = runtime.calls["PodSandboxStatus"]
    os.kill(control, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while node.agent.children("kiamfast.control") in ([control], []):
        assert time.monotonic() < deadline, "no new control process"
        time.sleep(0.1)
    # The next one's first runtime poll read the sandbox (every sandbox is new to it).
    while runtime.calls["PodSandboxStatus"] == statuses:
        assert time.monotonic() < deadline, "the new control process never read the sandbox"
        time.sleep(0.1)
    time.sleep(0.5)                        # applied on its loop

    proxy.down = lambda method, path: not path.startswith(REVIEWS)   # reviews come back
    token = node.token("sandboxed", uid, seconds=700)     # a new token: reviewed again
    answers = []
    try:
        until = time.monotonic() + 4.0
        while time.monotonic() < until:
            answers.append(node.ask(token))
            time.sleep(0.2)
    finally:
        proxy.down = lambda method, path: False          # the API server is back
    assert {status for status, _ in answers} == {503}, answers
    assert any("service account" in body["Message"] for _, body in answers), answers
    status, after = node.answered(token, timeout=30)
    assert status == 200 and after["AccessKeyId"] == before["AccessKeyId"], after
