"""A restarted control process never serves another identity, and keeps what is still valid.

The control process is frozen (SIGSTOP: it applies nothing) while the node goes on: a pod is
deleted and its address handed to a pod of another role, another pod appears, STS goes
down.  Then it is killed (-9) and the supervisor starts a new one, which starts from the
table the old one left.  What the pods' clients see is judged by STS's own records: once
the new process has synced, the new owner of the reused address never gets the old owner's
key (or any other), and a pod that was there all along keeps its exact credentials although
STS cannot be asked.  (While no control process runs, an agent without a container runtime
can only serve what the table holds: the address still names the old pod.  With a runtime,
new connections wait for a poll instead: tests/e2e/test_e2e_runtime.py.)

The whole agent killed (-9, as an OOM kill ends its container) and started again with the
same table file, as the restarted container or an upgrade's new pod finds it, on a node
without a runtime (with a real containerd: tests/e2e/test_e2e_runtime.py): the pod that
stayed gets its exact credentials with no STS call; an address whose pod went away
meanwhile never yields its role, not even before the new agent has synced.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from e2e_cluster import wrong_answers

pytestmark = pytest.mark.root


def test_restart_after_an_outage_with_a_reused_address(node):
    agent = node.start_agent()
    gone = node.add_pod("gone", "10.77.0.73", role="role-gone")
    assert gone.wait_credentials().ok      # first: its key has the first credential slot
    old = node.add_pod("old", "10.77.0.70", role="role-old")
    steady = node.add_pod("steady", "10.77.0.71", role="role-steady")
    first_old = old.wait_credentials()
    first_steady = steady.wait_credentials()
    assert first_old.ok and first_old.role == "role-old", f"{first_old}\n" + agent.log()
    assert first_steady.ok and first_steady.role == "role-steady"

    control = agent.wait_children(["control"])["control"]
    os.kill(control, signal.SIGSTOP)
    try:
        # The outage: old is gone, its address is newcomer's, STS is down, others come.
        for pod in (old, gone):
            node.api.pods.delete("default", pod.name)
            node.remove_pod_net(pod)
        newcomer = node.add_pod("newcomer", "10.77.0.70", role="role-new")
        extra = node.add_pod("extra", "10.77.0.72", role="role-extra")
        node.sts.proxy.add_fault("down")
    finally:
        os.kill(control, signal.SIGKILL)
        os.kill(control, signal.SIGCONT)
    agent.wait_children(["control"], not_pids=[control])
    deadline = time.monotonic() + 20      # the new process syncs and decides every address
    while agent.log(tail=10**6).count("synced:") < 2:
        assert time.monotonic() < deadline, "the new control process never synced\n" + agent.log()
        time.sleep(0.05)
    # The pod that stayed keeps its exact credentials, STS down or not.
    again = steady.fetch()
    assert again.ok and again.access_key == first_steady.access_key, f"{again}\n" + agent.log()
    assert node.sts.role_of(again.access_key) == "role-steady"

    # STS back: the newcomers get their own roles; the reused address never the old owner's.
    node.sts.proxy.clear_faults()
    for pod, role in ((newcomer, "role-new"), (extra, "role-extra")):
        got = pod.wait_credentials(timeout=30)
        assert got.ok and got.role == role, f"{pod}: {got}\n" + agent.log()
        assert node.sts.role_of(got.access_key) == role

    # A key new after the restart takes the lowest free slot: gone's, once it is freed.
    late = node.add_pod("late", "10.77.0.74", role="role-late")
    got = late.wait_credentials(timeout=30)
    assert got.ok and got.role == "role-late", f"{got}\n" + agent.log()
    # The next pod on gone's address, whose API object has not arrived: gone's old slot may
    # now hold late's key, and that address must not lead there (the identity bug of a
    # kill -9 restart).
    stranger = node.add_pod("stranger", "10.77.0.73", in_api=False)
    probers = [newcomer.prober(interval=0.05).start(), stranger.prober(interval=0.05).start()]
    time.sleep(1.0)
    samples, strangers = (p.stop() for p in probers)
    assert samples and strangers
    assert [s for s in strangers if s.ok] == [], "an address nobody owns yielded credentials"
    old_keys = {k for k, arn in node.sts.issued().items() if arn.endswith("/role-old")}
    for s in samples:
        assert s.ok and s.access_key not in old_keys and s.role == "role-new", \
            f"{s}\n" + agent.log()
    assert node.imds_credential_requests() == []


def new_keys(node, before: dict[str, str]) -> list[str]:
    """The role names of the credentials STS issued since ``before`` (an ``issued()``)."""
    return sorted(arn.rsplit("/", 1)[1] for key, arn in node.sts.issued().items()
                  if key not in before)


def test_whole_agent_killed_and_restarted_without_a_runtime(node):
    """No container runtime: the addresses follow the API server.  A pod deleted while the
    agent is down, its address given to a pod of another role: the old table's entry for it
    is never served, not even before the new agent has synced."""
    agent = node.start_agent()
    steady = node.add_pod("steady", "10.77.0.71", role="role-steady")
    leaving = node.add_pod("leaving", "10.77.0.70", role="role-leaving")
    first = steady.wait_credentials()
    assert first.ok and first.role == "role-steady", f"{first}\n" + agent.log()
    assert leaving.wait_credentials().ok
    issued = node.sts.issued()

    agent.kill()
    node.api.pods.delete("default", leaving.name)
    node.remove_pod_net(leaving)
    successor = node.add_pod("successor", "10.77.0.70", role="role-successor")
    # The new agent syncs late: early answers could only be the table's.
    node.api.faults.slow_list(3.0)
    prober = successor.prober(interval=0.02).start()
    agent.start()
    deadline = time.monotonic() + 20
    while agent.readyz() != 503:   # the new workers answer, the control process not synced
        assert time.monotonic() < deadline and agent.running(), agent.log()
        time.sleep(0.02)
    early = successor.fetch(timeout=1.0)
    node.api.faults.slow_list(0)
    agent.wait_ready()
    samples = prober.stop()

    assert early.status == 503, early
    assert wrong_answers(successor, [early, *samples], allowed_errors=(0, 503, 404)) == [], \
        wrong_answers(successor, [early, *samples], allowed_errors=(0, 503, 404))[:10]
    again = steady.fetch()
    assert again.ok and again.access_key == first.access_key, f"{again}\n" + agent.log()
    got = successor.wait_credentials()
    assert got.ok and got.role == "role-successor", got
    assert new_keys(node, issued) == ["role-successor"], agent.log()
    assert node.imds_credential_requests() == []
