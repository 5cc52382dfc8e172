"""Who holds an address, from the kernel: no runtime's order of a stop, partial view or
outage gives a pod another pod's role.

CRI-O tears a sandbox's network down (CNI DEL: the address back in IPAM) before it stops the
sandbox's containers and marks it stopped: for that window its status is READY on an
address the next sandbox may already hold.  These tests run the agent against a runtime on
real network namespaces, veths and host routes that stops sandboxes in CRI-O's order and in
containerd's (kiamfast/testing/netns_runtime.py), and judge every answer by STS's own
records: a pod gets its own role or nothing (404/503), never another's.

* A partial view: pod a stuck READY after its network went, pod b on a's address with a
  status that keeps failing (the view leaves b out): the view says the address is a's.
* An outage: a stopped (CRI-O: its network gone, still READY), b given a's address and not
  READY yet when the agent's last poll ran, then the agent's link to the runtime breaks
  while b becomes READY and asks.  The route witness that kept owners during outages took
  b's new route (changed before that poll) as the poll's own and answered b with a's role.
* An EKS IPv6 pod asks from its IPv4 egress address (169.254.172.0/22), which neither the
  API nor the runtime knows: its own role, and the next pod on that address its own.
"""

from __future__ import annotations

import time

import pytest

from e2e_cluster import reporting_on_failure, wrong_answers
from runtime_node import wait_until

pytestmark = pytest.mark.root

ORDERS = ("crio", "containerd")


@pytest.fixture(params=ORDERS)
def order(request):
    return request.param


@pytest.fixture
def netns_node(test_failed, tmp_path, netns_available, order):
    from netns_runtime_node import NetnsRuntimeNode
    with reporting_on_failure(NetnsRuntimeNode(tmp_path / "node", order=order),
                              test_failed) as node:
        yield node


def probe(pod, seconds: float) -> list:
    prober = pod.prober(interval=0.05).start()
    time.sleep(seconds)
    return prober.stop()


def polls(node) -> float:
    return node.metric("kiamfast_runtime_total", 'kind="polls"') or 0.0


def wait_for_polls(node, n: int = 2) -> None:
    """At least ``n`` more runtime polls applied (the agent's view is newer than now)."""
    start = polls(node)
    wait_until(lambda: polls(node) >= start + n, timeout=15, what=f"{n} more runtime polls")


def test_a_partial_view_never_gives_the_next_pod_the_old_pods_role(netns_node, order):
    node = netns_node
    agent = node.start_agent()
    old = node.add_pod("old", "10.77.0.40", role="role-old", ip_in_api=True)
    assert old.wait_credentials().ok, agent.log()
    assert node.sts.role_of(old.wait_credentials().access_key) == "role-old"

    # The kubelet stops old; CRI-O leaves it READY (a container that will not stop), its
    # address free.  new gets the address; its status keeps failing.
    node.stop(old, finish=False)
    new = node.add_pod("new", "10.77.0.40", role="role-new", ready=False)
    node.fail_status(new)
    node.set_ready(new)
    wait_for_polls(node)
    samples = probe(new, 2.5)
    assert samples, agent.log()
    assert wrong_answers(new, samples) == [], agent.log()
    assert not any(s.ok for s in samples)        # nothing proves new yet: no credentials

    # Its status answers again: new gets its own role (the API still shows old there).
    node.netns_runtime.cri.clear_faults()
    got = new.wait_credentials(timeout=20)
    assert got.ok and node.sts.role_of(got.access_key) == "role-new", agent.log()
    if order == "crio":
        node.finish_stop(old)


def test_a_runtime_outage_never_gives_the_next_pod_the_old_pods_role(netns_node, order):
    node = netns_node
    agent = node.start_agent()
    old = node.add_pod("old", "10.77.0.50", role="role-old", ip_in_api=True)
    steady = node.add_pod("steady", "10.77.0.51", role="role-steady", ip_in_api=True)
    for pod in (old, steady):
        got = pod.wait_credentials()
        assert got.ok and node.sts.role_of(got.access_key) == pod.role, agent.log()

    # old stops (CRI-O: its network goes first, the sandbox stays READY); new is scheduled
    # and gets old's address, a new veth and a new route, before it is READY; the agent's
    # polls go on and see old READY on the address, new not at all.
    node.stop(old, finish=False)
    new = node.add_pod("new", "10.77.0.50", role="role-new", ready=False)
    wait_for_polls(node)
    node.break_link()                           # the agent's link dies; the node goes on
    wait_until(lambda: node.metric("kiamfast_runtime_up") == 0, timeout=15,
               what="the agent sees the runtime unreachable")
    node.set_ready(new)
    samples = probe(new, 3.0)
    assert samples, agent.log()
    assert wrong_answers(new, samples) == [], agent.log()
    assert not any(s.ok for s in samples)
    # The pod whose namespace still holds its address keeps its role through the outage.
    kept = probe(steady, 1.5)
    assert kept and all(s.ok for s in kept), ([s for s in kept if not s.ok][:3], agent.log())
    assert wrong_answers(steady, kept) == []


@pytest.mark.parametrize("order", ["crio"])
def test_an_eks_ipv6_pod_gets_its_own_role_from_its_ipv4_egress_address(netns_node):
    """In an EKS IPv6 cluster a pod reaches 169.254.169.254 over IPv4 from its egress
    address, which is in neither its status nor the runtime's: only the kernel shows it in
    the pod's namespace.  kube2iam and kiam cannot tell such a pod; kiamfast can."""
    node = netns_node
    agent = node.start_agent()
    egress = "169.254.172.9"
    pod = node.add_pod("v6", "fd00:77::9", role="role-v6", ip_in_api=True,
                       extra=[("v4if0", egress)])
    samples = []
    wait_until(lambda: samples.append(pod.fetch()) or samples[-1].ok, timeout=20,
               what="the IPv6 pod's own credentials over IPv4")
    assert node.sts.role_of(samples[-1].access_key) == "role-v6", agent.log()
    assert wrong_answers(pod, samples) == []

    # Reused: the next pod gets the same egress address, its sandbox its own namespace.
    node.stop(pod)
    nxt = node.add_pod("next", "fd00:77::10", role="role-next", ip_in_api=True,
                       extra=[("v4if0", egress)])
    got = nxt.wait_credentials(timeout=20)
    assert got.ok and node.sts.role_of(got.access_key) == "role-next", agent.log()
    assert wrong_answers(nxt, probe(nxt, 1.0)) == []
