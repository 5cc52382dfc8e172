"""A real node (issue 13, tier 2): the session's kube-apiserver, a real kubelet, a real
containerd, and pods whose app container is the AWS SDK for Go v2.

Nothing plays the kubelet here: pods are created through the API, and everything from then
on (sandbox, CNI address, app start, ``status.podIP``) is the kubelet's and the runtime's own
doing and timing. The test plays only the scheduler (a Binding, when the node may take a
pod) and the user. Every check is STS's own answer to the credentials a pod received
(GetCallerIdentity at moto names the role), plus moto's record of which role each access
key was issued for, so neither the node's role nor another pod's can pass.

The seeds of the issue: a node registered with the startup taint and pods waiting for it; a
Job-like pod that asks the instant it starts (also on a kubelet throttled to 2 API requests a
second, which reports addresses seconds late); a pod replaced so its address is reused while
the API still shows the old pod; the agent killed and restarted while pods run.
"""
from __future__ import annotations


import pytest
from kubelet_node import KubeletNode, PodIpWatch, go_time, wait_untainted

from e2e_cluster import STARTUP_TAINT, assert_own_role
from runtime_node import wait_until

pytestmark = [pytest.mark.kubelet, pytest.mark.kube_apiserver, pytest.mark.root,
              pytest.mark.slow]


def pods_asking_at_start(node: KubeletNode, prefix: str, count: int, *,
                         timeout: float = 90.0) -> list[float]:
    """``count`` pods bound at once, whose app asks first thing; each must get its own role
    (and the node's metadata service no credential request). Returns, per pod, by how many
    seconds its first call came before the API first showed its address."""
    with PodIpWatch(node) as ips:
        pods = [node.create_pod(f"{prefix}-{i}", role=f"{prefix}-{i}") for i in range(count)]
        docs = [pod.result(timeout=timeout) for pod in pods]
        wait_until(lambda: all(p.uid in ips.seen for p in pods), timeout=60,
                   what="every address in the API")
    for pod, doc in zip(pods, docs):
        assert doc["exit"] == 0, doc
        assert_own_role(pod, doc)
    assert node.imds_credential_requests() == []
    return [ips.seen[pod.uid] - go_time(doc["rounds"][0]["at"])
            for pod, doc in zip(pods, docs)]


def test_pods_wait_for_the_startup_taint_then_get_their_own_roles(kubelet_node: KubeletNode):
    node = kubelet_node
    # (The kubelet's own node.kubernetes.io/not-ready, NoSchedule, stays too: removing it is
    # the node lifecycle controller's job, and no controller-manager runs here.)
    assert STARTUP_TAINT in node.taints()
    # Bound before the agent serves: the kubelet itself refuses it (NoExecute taint), so it
    # never runs and never reaches the node's metadata service.
    early = node.create_pod("bound-too-early", role="early")
    rejected = early.finished(timeout=60)
    assert rejected["status"]["phase"] == "Failed", rejected["status"]
    assert "Taint" in rejected["status"].get("reason", "") + rejected["status"].get(
        "message", ""), rejected["status"]
    # Pods the scheduler holds back until the taint is gone.
    waiting = [node.create_pod(f"waiting-{i}", role=f"waiting-{i}", bind=False)
               for i in range(3)]
    node.start_agent()
    wait_untainted(node)
    for pod in waiting:
        node.bind(pod)
    for pod in waiting:
        doc = pod.result()
        assert doc["exit"] == 0, doc
        assert_own_role(pod, doc)
    assert node.imds_credential_requests() == []


def test_a_pod_that_asks_the_instant_it_starts_gets_its_own_role(kubelet_node: KubeletNode):
    node = kubelet_node
    node.start_agent()
    wait_untainted(node)
    # A NoSchedule taint holds back the scheduler only: the kubelet runs these pods anyway
    # (bound by nodeName), which is why docs/install.md asks for NoExecute.
    node.admin.call("PATCH", f"/api/v1/nodes/{node.name}", {"spec": {"taints": [
        {"key": "example.com/scheduler-only", "effect": "NoSchedule"}]}},
        content_type="application/strategic-merge-patch+json")
    assert "example.com/scheduler-only" in node.taints()
    ahead = pods_asking_at_start(node, "job", 4)
    # The race is real: the kubelet reports the address on a later sync than the one that
    # starts the app, so the SDK asks while the API does not yet know the pod's address.
    assert max(ahead) > 0, ahead


@pytest.mark.parametrize("kubelet_node", [["--kube-api-qps=2", "--kube-api-burst=2"]],
                         indirect=True, ids=["kubelet-api-qps-2"])
def test_a_throttled_kubelet_reports_addresses_seconds_late_and_pods_still_get_their_roles(
        kubelet_node: KubeletNode):
    """A kubelet whose API client is throttled (busy API server, many pods starting) writes
    pod status seconds late; the agent learns each address from the runtime instead."""
    node = kubelet_node
    node.start_agent()
    wait_untainted(node)
    ahead = pods_asking_at_start(node, "late", 6, timeout=120)
    # The pods had their roles long before the API could have told anyone their address.
    assert max(ahead) > 2.0, ahead


def test_an_address_reused_while_the_api_still_shows_the_old_pod(kubelet_node: KubeletNode):
    node = kubelet_node
    node.start_agent()
    wait_untainted(node)
    address = str(node.containerd.subnet.network_address + 9)
    node.containerd.set_range(address, address)   # host-local has this one address only
    tenants = [node.create_pod("tenant-0", role="tenant-0", loop=600, interval=0.2,
                               refetch=True)]
    assert_own_role(tenants[0], tenants[0].first_round())
    seen: dict[str, list[dict]] = {}   # each tenant's rounds (its log goes with the pod)
    for n in range(1, 4):
        previous = tenants[-1]
        assert node.sandbox_ip(previous) == address
        seen[previous.name] = previous.rounds()
        # The old pod goes: the runtime frees the address while the API still has the pod
        # (Terminating, its podIP shown), and the next pod gets the same address at once.
        node.admin.delete_pod(previous.namespace, previous.name, grace=1)
        wait_until(lambda: node.sandbox_ip(previous) == "", timeout=60,
                   what=f"{previous}'s sandbox stopped")
        seen[previous.name] = max(seen[previous.name], previous.rounds(), key=len)
        current = node.create_pod(f"tenant-{n}", role=f"tenant-{n}", loop=600, interval=0.2,
                                  refetch=True)
        assert_own_role(current, current.first_round())
        tenants.append(current)
    seen[tenants[-1].name] = tenants[-1].rounds()
    for tenant in tenants:   # every round of every tenant: its own role, nothing else
        assert seen[tenant.name], tenant
        for r in seen[tenant.name]:
            assert_own_role(tenant, r)
    assert node.imds_credential_requests() == []


def test_the_agent_killed_and_restarted_while_pods_run(kubelet_node: KubeletNode):
    node = kubelet_node
    agent = node.start_agent()
    wait_untainted(node)
    pods = [node.create_pod(f"busy-{i}", role=f"busy-{i}", loop=60, interval=0.25,
                            refetch=True) for i in range(3)]
    for pod in pods:
        assert_own_role(pod, pod.first_round())
    agent.kill()
    agent.start()
    agent.wait_ready()
    fresh = node.create_pod("after-restart", role="after-restart")
    doc = fresh.result()
    assert doc["exit"] == 0, doc
    assert_own_role(fresh, doc)
    for pod in pods:
        rounds = pod.result()["rounds"]
        # While the agent was down a round may get nothing; none may get another identity,
        # and the rounds after the restart get the pod's own role again.
        for r in rounds:
            if "AccessKeyId" in r:
                assert_own_role(pod, r)
        assert "AccessKeyId" in rounds[-1], rounds[-1]
    assert node.imds_credential_requests() == []
