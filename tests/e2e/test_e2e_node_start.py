"""A new node: pods and the agent start together, and no pod is ever given another identity.

kiam's and kube2iam's worst failure (DESIGN.md, problem 3): on an autoscaled node the
application pods start before the agent serves. They get errors, or reach the real metadata
service and leave with the *node's* role. kiamfast's answer: the node registers with a
startup taint; the agent listens, takes 169.254.169.254 over (DNAT), syncs, prefetches, and
only then reports ready and removes the taint. Until then every request is held briefly
and answered with the pod's own role or an error, never with another identity.

Here the pods are created in the API server at the moment the agent process starts, and
begin asking the moment the agent's DNAT rule exists (before it, they would be talking to
the node's metadata service; keeping them off the node until then is the taint's job, and
the test checks the taint is only removed when the agent is ready). STS answers slowly, so
the prefetch window during which pods ask is long enough to sample.
"""

from __future__ import annotations

import time

import pytest

from e2e_cluster import ROLE_KEY, STARTUP_TAINT, wrong_answers

pytestmark = pytest.mark.root

START_PODS = [
    # name, ip, role, namespace
    ("web", "10.77.0.40", "role-web", "default"),
    ("worker", "10.77.0.41", "role-worker", "default"),
    ("billing", "10.77.0.42", "role-billing", "billing"),
    ("plain", "10.77.0.43", None, "default"),
]


def wait_for(predicate, *, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def test_pods_starting_with_the_agent_get_their_own_role_or_an_error(node):
    assert node.taints() == [STARTUP_TAINT]
    pods = [node.add_pod(name, ip, role=role, namespace=ns, in_api=False)
            for name, ip, role, ns in START_PODS]
    probers = {p.name: p.prober(interval=0.05).start(gated=True) for p in pods}
    node.sts.proxy.latency = 0.3

    agent = node.agent().start()
    for pod in pods:  # scheduled at the same moment (the emulator has no scheduler)
        node.create_pod_object(pod)

    def rule_or_dead():
        return node.dnat_rules() or not agent.running()
    assert wait_for(rule_or_dead, timeout=30) and agent.running(), \
        "the agent never installed its DNAT rule\n" + agent.log()
    for prober in probers.values():
        prober.open_gate()

    # Until ready: whenever the taint is seen gone, /readyz (asked after) must already be 200.
    early_removal = []
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        tainted = STARTUP_TAINT in node.taints()
        ready = agent.readyz()
        if not tainted and ready != 200:
            early_removal.append(ready)
        if not tainted and ready == 200:
            ready_at = time.monotonic()
            break
        assert agent.running(), "agent exited during start\n" + agent.log()
        time.sleep(0.02)
    else:
        pytest.fail("the agent never became ready and removed the taint\n" + agent.log())
    assert early_removal == [], "taint removed before /readyz was 200"
    assert node.dnat_rules(), "ready, but the DNAT rule is gone"

    time.sleep(0.5)  # a few more answers from a ready agent
    samples = {name: prober.stop() for name, prober in probers.items()}

    for pod in pods:
        got = samples[pod.name]
        assert any(s.at < ready_at for s in got), f"{pod.name} never asked before ready"
        bad = wrong_answers(pod, got)
        assert bad == [], f"{pod.name}:\n" + "\n".join(bad[:20]) + "\n" + agent.log()
        if pod.role is None:
            assert got[-1].status == 404 and got[-1].stage == "listing", got[-1]
        else:
            assert any(s.ok for s in got), f"{pod.name} never got credentials: {got[-5:]}"
    assert node.imds_credential_requests() == []

    # A pod scheduled now (bound without an IP, then its sandbox gets one) gets its
    # credentials on its first SDK call.
    late = node.add_pod("late", "10.77.0.44", role="role-late", in_api=False)
    node.api.pods.create("default", "late", node=node.name,
                         annotations={ROLE_KEY: "role-late"})
    node.api.pods.set_ips("default", "late", [late.ip])
    node.api.pods.set_phase("default", "late", "Running")
    creds = late.botocore_credentials()
    assert "AccessKeyId" in creds, f"first SDK call failed: {creds}\n" + agent.log()
    assert node.sts.role_of(creds["AccessKeyId"]) == "role-late", creds
    assert ":assumed-role/role-late/" in creds["Arn"], creds
