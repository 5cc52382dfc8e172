"""A new agent takes the node over from the serving one without a failed call (issue 33).

Two agents of one node on loopback, as two pods of a DaemonSet surge share the chart's
hostPath: the table, the token key and the handover socket.  Pods ask all along, on fresh
and keep-alive connections.  The new agent takes the listening socket over (SCM_RIGHTS: no
SO_REUSEPORT, no second bind), the old one stops accepting and then writing, and the new
control process goes on writing the same table: every call is answered with the pod's own
role, none is refused, none times out.  The old agent stays idle (no children, no restart)
until it is stopped.  If the new agent dies half-way, the old one serves on.  And across
many handovers under load, no two control processes ever write the table at once (the
writers' terms, from their own logs, never overlap).
"""
from __future__ import annotations

import os
import signal

import pytest

from handover_agents import (idle, kill_tree, overlapping, serving, start_keeper, summary,
                             wait_until, writer_terms)

pytestmark = pytest.mark.slow


def test_a_new_agent_takes_the_node_over_and_no_call_fails(node):
    old = node.agent("old")
    old.wait_ready()
    wait_until(lambda: serving(old), "the old agent never wrote its ready file")
    callers = node.callers()
    wait_until(lambda: all(c.snapshot() for c in callers), "no call made")
    old_workers = old.children("kiamfast.server.worker")

    new = node.agent("new")
    wait_until(lambda: serving(new), lambda: "the new agent never became ready:\n" + new.log())
    wait_until(lambda: idle(old), lambda: "the old agent did not go idle:\n" + old.log())
    assert not serving(old)                   # its readiness is its own, not the port's
    calls_before_end = sum(len(c.snapshot()) for c in callers)
    wait_until(lambda: sum(len(c.snapshot()) for c in callers) > calls_before_end + 20,
               "no calls after the handover")
    calls = [call for c in callers for call in c.stop()]

    assert node.wrong(calls) == [], (summary(calls), new.log())
    assert {c.fresh for c in calls} == {True, False}
    assert old.proc.poll() is None           # idle, not exited: the kubelet would restart it
    assert all(not os.path.exists(f"/proc/{pid}") or
               "kiamfast" not in open(f"/proc/{pid}/cmdline").read() for pid in old_workers)
    assert "handed the node over" in old.log()
    assert old.stop() == 0


def test_the_old_agent_serves_on_when_the_new_one_dies_before_it_stopped(node):
    old = node.agent("old")
    old.wait_ready()
    callers = node.callers()
    workers = old.children("kiamfast.server.worker")
    new = node.agent("new")
    wait_until(lambda: "started control" in new.log(), "the new agent never armed")
    kill_tree(new)
    wait_until(lambda: "ended after" in old.log(),
               lambda: "the old agent never noticed:\n" + old.log())
    calls = [call for c in callers for call in c.stop()]
    assert node.wrong(calls) == [], summary(calls)
    assert old.children("kiamfast.server.worker") == workers   # never stopped
    assert serving(old)


def test_the_old_agent_resumes_when_the_new_one_dies_after_it_let_go(node):
    old = node.agent("old")
    old.wait_ready()
    callers = node.callers(timeout=5.0)
    new = node.agent("new")
    wait_until(lambda: "standby" in new.log(), "the new control process never in standby")
    [control] = new.children("kiamfast.control")
    os.kill(control, signal.SIGSTOP)         # it will not take the lock when it is free
    wait_until(lambda: "the table lock is free" in old.log(), "the old agent never let go")
    kill_tree(new)
    wait_until(lambda: "serving again" in old.log(),
               lambda: "the old agent never resumed:\n" + old.log())
    wait_until(lambda: serving(old), lambda: "the old agent never got ready again:\n" + old.log())
    calls = [call for c in callers for call in c.stop()]
    # Waited for (the backlog holds them while the old agent starts again), never refused,
    # never another role.  Only a call the new agent's worker had accepted when it was
    # killed is lost (reset): at most one per caller.
    lost = [c for c in node.wrong(calls) if c.outcome in ("reset", "eof")]
    assert [c for c in node.wrong(calls) if c not in lost] == [], (summary(calls), old.log())
    assert len(lost) <= len(callers), summary(calls)


def test_a_new_agent_stopped_while_it_takes_over_leaves_the_node_to_the_old_one(node):
    """Its pod deleted mid-takeover (SIGTERM): it does not complete a takeover only to go
    away; the old agent keeps (or resumes) serving."""
    old = node.agent("old")
    old.wait_ready()
    callers = node.callers(timeout=5.0)
    new = node.agent("new")
    wait_until(lambda: "standby" in new.log(), "the new control process never in standby")
    new.proc.send_signal(signal.SIGTERM)
    assert new.proc.wait(30) == 0, new.log()
    assert "stopped while taking the node over" in new.log()
    wait_until(lambda: serving(old) and not idle(old), lambda: old.log())
    calls = [call for c in callers for call in c.stop()]
    assert node.wrong(calls) == [], summary(calls)
    assert "handed the node over" not in old.log()


def test_a_pod_whose_container_restarts_mid_takeover_takes_the_node_again(node, tmp_path):
    """The newest agent wins: its container restarts (SIGKILL) while it takes over, the old
    agent serves on, and the restarted container, with the sockets it had deposited in its
    keeper, finds the old agent live and takes the node over again."""
    old = node.agent("old")
    old.wait_ready()
    keeper_path = str(tmp_path / "new-pod" / "keeper.sock")
    os.makedirs(os.path.dirname(keeper_path))
    keeper = start_keeper(keeper_path)
    try:
        callers = node.callers(timeout=5.0)
        new = node.agent("new", keeper=keeper_path)
        wait_until(lambda: "deposited" in new.log(), "the new agent never deposited")
        kill_tree(new)
        wait_until(lambda: "ended after" in old.log(), lambda: old.log())
        again = node.agent("new-again", keeper=keeper_path)
        wait_until(lambda: serving(again), lambda: again.log())
        wait_until(lambda: idle(old), lambda: old.log())
        calls = [call for c in callers for call in c.stop()]
    finally:
        keeper.terminate()
        keeper.wait(10)
    assert "taking the node over" in again.log()
    assert node.wrong(calls) == [], summary(calls)


def test_a_pod_that_handed_the_node_over_does_not_take_it_back_when_its_container_restarts(
        node, tmp_path):
    """Its keeper's note says so: the restarted container stays idle (taking the node back
    would leave nobody serving once the DaemonSet deletes this old pod)."""
    keeper_path = str(tmp_path / "old-pod" / "keeper.sock")
    os.makedirs(os.path.dirname(keeper_path))
    keeper = start_keeper(keeper_path)
    try:
        old = node.agent("old", keeper=keeper_path)
        old.wait_ready()
        new = node.agent("new")
        wait_until(lambda: serving(new) and idle(old), "the handover never finished")
        wait_until(lambda: "handed the node over" in old.log(), lambda: old.log())
        kill_tree(old)
        again = node.agent("old-again", keeper=keeper_path)
        wait_until(lambda: "handed the node over to another agent: idle" in again.log(),
                   lambda: again.log())
        assert idle(again) and serving(new) and not idle(new)
    finally:
        keeper.terminate()
        keeper.wait(10)


def test_across_many_handovers_under_load_one_writer_at_a_time(node):
    agents = [node.agent("agent-0")]
    agents[0].wait_ready()
    callers = node.callers(fresh=3, keep_alive=3, interval=0.005)
    for i in range(1, 6):
        agents.append(node.agent(f"agent-{i}"))
        wait_until(lambda: serving(agents[-1]), f"agent-{i} never ready:\n" + agents[-1].log())
        wait_until(lambda: idle(agents[-2]), f"agent-{i - 1} never idle")
        assert agents[-2].stop() == 0        # the DaemonSet deletes the old pod
    calls = [call for c in callers for call in c.stop()]

    terms = writer_terms(agents)
    assert len(terms) == 6, terms
    assert overlapping(terms) == []
    assert node.wrong(calls) == [], summary(calls)
    assert len(calls) > 500


def test_an_agent_in_the_middle_of_its_own_takeover_is_not_taken_over(node):
    """A third agent that comes while the second takes over waits its turn, then takes the
    node from the second: the newest agent ends up serving."""
    first = node.agent("first")
    first.wait_ready()
    callers = node.callers()
    second = node.agent("second")
    wait_until(lambda: "started control" in second.log(), "the second agent never armed")
    third = node.agent("third")
    wait_until(lambda: serving(third), lambda: "the third agent never ready:\n" + third.log())
    wait_until(lambda: idle(second) and idle(first), "the others never idle")
    calls = [call for c in callers for call in c.stop()]
    assert node.wrong(calls) == [], summary(calls)
    assert [a.name for a in (first, second, third) if serving(a)] == ["third"]


def test_a_signal_stops_an_idle_agent_at_once(node):
    old = node.agent("old")
    old.wait_ready()
    new = node.agent("new")
    wait_until(lambda: serving(new) and idle(old), "the handover never finished")
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(10) == 0
    assert serving(new)

