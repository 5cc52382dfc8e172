"""Taking a node over from a process that cannot hand over: the second port (issue 33).

The serving agent here is a kiamfast without --handover-socket (today's agent): it holds the
app port and the table's lock and can pass neither.  The new agent, with --handover-port,
serves on the second port with a table of its own (``<table>-2``: one writer per table),
and once the old agent has let go of the app port, moves back to it: new workers on both
ports, then (after a drain) on the app port alone.  Through the DNAT rules of a real node
(tests/e2e/test_e2e_kube2iam_switch.py) pods follow the rules; here the mechanics.
"""
from __future__ import annotations

import pytest

from agent_process import LISTING, POD_IP, ROLE, free_port, http
from handover_agents import serving, wait_until

pytestmark = pytest.mark.slow


def listing(port: int) -> tuple[int, bytes]:
    try:
        return http(port, f"GET {LISTING}", source=POD_IP)
    except OSError as e:
        return 0, str(e).encode()


def test_a_new_agent_serves_beside_one_that_cannot_hand_over_then_moves_back(node):
    old = node.agent("old", handover=False)
    old.wait_ready()
    second = free_port()
    new = node.agent("new", extra=[f"--handover-port={second}"])
    wait_until(lambda: serving(new), lambda: "the new agent never ready:\n" + new.log())
    assert "cannot hand over: serving on --handover-port" in new.log()
    assert "this agent writes" in new.log() and f"{node.state / 'table'}-2" in new.log()
    assert listing(second) == (200, ROLE.encode())          # its own control, its own table
    assert listing(node.port) == (200, ROLE.encode())       # the old agent, on its own

    assert old.stop() == 0
    wait_until(lambda: "moving back to it" in new.log(), lambda: "never moved back:\n" + new.log())
    assert listing(node.port) == (200, ROLE.encode())
    wait_until(lambda: "--handover-port" in new.log() and "closed" in new.log(),
               lambda: "never closed the second port:\n" + new.log(), timeout=30)
    assert listing(node.port) == (200, ROLE.encode())
    assert listing(second)[0] == 0                          # refused: nothing listens there
    assert serving(new)


def test_a_takeover_waits_until_the_move_back_is_done(node):
    old = node.agent("old", handover=False)
    old.wait_ready()
    second = free_port()
    mover = node.agent("mover", extra=[f"--handover-port={second}"])
    wait_until(lambda: serving(mover), lambda: "the mover never ready:\n" + mover.log())
    newest = node.agent("newest", extra=[f"--handover-port={second}"])
    wait_until(lambda: "refused" in newest.log(),
               lambda: "the takeover was not refused:\n" + newest.log())
    assert not serving(newest)
    old.stop()
    wait_until(lambda: serving(newest), lambda: "the newest agent never ready:\n" + newest.log(),
               timeout=90)
    assert listing(node.port) == (200, ROLE.encode())
    wait_until(lambda: "handed the node over" in mover.log(), lambda: mover.log())


def test_without_a_second_port_the_new_agent_stops_at_bind_as_today(node):
    old = node.agent("old", handover=False)
    old.wait_ready()
    new = node.agent("new")
    assert new.proc.wait(30) == 1
    assert "cannot start" in new.log() and "in use" in new.log()
