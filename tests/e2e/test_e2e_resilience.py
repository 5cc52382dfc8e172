"""The agent keeps serving through the failures a node sees, with pods asking all along.

* ``kill -9`` of the control process: the workers keep answering from the shared table; the
  supervisor starts a new control process, which takes the table over (a pod created
  after the kill gets its credentials).
* ``kill -9`` of a worker: the supervisor restarts it; with two workers, pods keep being
  answered meanwhile, also when the other worker is killed after that and only the
  restarted one is left.
* The API server goes away (connections refused, open watches cut): pods already known keep
  getting their credentials; when it comes back, new pods are seen again.
* STS goes away: credentials already fetched keep being served; a pod whose role was never
  fetched gets an error, never anybody else's role; when STS is back, it gets its own.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from e2e_cluster import wrong_answers

pytestmark = pytest.mark.root


def start_with_pods(node, specs, **agent_kwargs):
    agent = node.start_agent(**agent_kwargs)
    pods = [node.add_pod(name, ip, role=role) for name, ip, role in specs]
    for pod in pods:
        sample = pod.wait_credentials()
        assert sample.ok and sample.role == pod.role, f"{pod}: {sample}\n" + agent.log()
    return agent, pods


def test_control_process_killed_under_traffic(node):
    agent, pods = start_with_pods(node, [("a", "10.77.0.60", "role-a"),
                                         ("b", "10.77.0.61", "role-b")])
    probers = [p.prober(interval=0.03).start() for p in pods]
    time.sleep(0.3)
    control = agent.wait_children(["control"])["control"]
    os.kill(control, signal.SIGKILL)
    killed_at = time.monotonic()
    agent.wait_children(["control"], not_pids=[control])
    restarted_at = time.monotonic()

    # Only a control process that took over (watch, STS, table) can serve a new pod.
    newcomer = node.add_pod("c", "10.77.0.59", role="role-c")
    sample = newcomer.wait_credentials(timeout=30)
    assert sample.ok and sample.role == "role-c", f"{sample}\n" + agent.log()
    time.sleep(0.3)
    samples = [p.stop() for p in probers]

    for pod, got in zip(pods, samples):
        while_dead = [s for s in got if killed_at <= s.at <= restarted_at]
        assert while_dead, f"{pod.name}: no request while the control process was dead"
        failed = [s for s in got if not (s.ok and s.role == pod.role)]
        assert failed == [], f"{pod.name}: {failed[:10]}\n" + agent.log()
        assert wrong_answers(pod, got, allowed_errors=()) == []
    creds = pods[0].botocore_credentials()
    assert node.sts.role_of(creds.get("AccessKeyId")) == "role-a", creds


def test_workers_killed_one_after_the_other_are_restarted(node):
    agent, pods = start_with_pods(node, [("a", "10.77.0.62", "role-a"),
                                         ("b", "10.77.0.63", "role-b")], workers=2)
    kids = agent.wait_children(["control", "worker-0", "worker-1"])
    probers = [p.prober(interval=0.03).start() for p in pods]
    time.sleep(0.3)
    # Kill worker-0; once it is back, kill worker-1: now only the restarted worker-0 serves.
    for name in ("worker-0", "worker-1"):
        os.kill(kids[name], signal.SIGKILL)
        kids = agent.wait_children([name], not_pids=[kids[name]])
        agent.wait_listening(kids[name])
        time.sleep(0.3)
    samples = [p.stop() for p in probers]

    for pod, got in zip(pods, samples):
        # A request in flight on a killed worker may see its connection reset; nothing may
        # ever be another identity, and the other worker keeps answering.
        assert wrong_answers(pod, got, allowed_errors=(0,)) == []
        ok = [s for s in got if s.ok]
        assert len(ok) >= len(got) - 4, [s for s in got if not s.ok]
        assert got[-1].ok, got[-5:]
    for pod in pods:
        creds = pod.botocore_credentials()
        assert node.sts.role_of(creds.get("AccessKeyId")) == pod.role, creds


def test_api_server_outage_keeps_serving(node):
    agent, pods = start_with_pods(node, [("a", "10.77.0.64", "role-a"),
                                         ("b", "10.77.0.65", "role-b")])
    outage = ["INPUT", "-p", "tcp", "--dport", str(node.api.port), "-j", "REJECT",
              "--reject-with", "tcp-reset"]
    node.net.ns.run(["iptables", "-I", *outage], check=True)
    node.api.faults.drop_watches()
    try:
        probers = [p.prober(interval=0.03).start() for p in pods]
        time.sleep(2.0)
        samples = [p.stop() for p in probers]
        for pod, got in zip(pods, samples):
            failed = [s for s in got if not (s.ok and s.role == pod.role)]
            assert got and failed == [], f"{pod.name}: {failed[:10]}\n" + agent.log()
        creds = pods[0].botocore_credentials()
        assert node.sts.role_of(creds.get("AccessKeyId")) == "role-a", creds
        assert agent.running()
    finally:
        node.net.ns.run(["iptables", "-D", *outage], check=True)

    # Back: a pod created now is seen (the watch came back by itself).
    late = node.add_pod("late", "10.77.0.66", role="role-late")
    sample = late.wait_credentials(timeout=40)
    assert sample.ok and sample.role == "role-late", f"{sample}\n" + agent.log()


def test_sts_outage_serves_what_it_has(node):
    agent, pods = start_with_pods(node, [("a", "10.77.0.67", "role-a")])
    before = pods[0].fetch()
    node.sts.proxy.add_fault("down")
    try:
        newcomer = node.add_pod("newcomer", "10.77.0.68", role="role-newcomer")
        probers = [p.prober(interval=0.05).start() for p in (pods[0], newcomer)]
        time.sleep(2.0)
        kept, new = (p.stop() for p in probers)

        assert kept and all(s.ok and s.access_key == before.access_key for s in kept), \
            [s for s in kept if not s.ok][:10]
        assert wrong_answers(newcomer, new) == [], "newcomer got someone's role"
        assert not any(s.ok for s in new), "credentials out of thin air while STS is down"
        creds = pods[0].botocore_credentials(who_am_i=False)
        assert creds.get("AccessKeyId") == before.access_key, creds
    finally:
        node.sts.proxy.clear_faults()

    sample = newcomer.wait_credentials(timeout=40)
    assert sample.ok and sample.role == "role-newcomer", f"{sample}\n" + agent.log()
    assert node.sts.role_of(sample.access_key) == "role-newcomer"
