"""The socket keeper holds the listening sockets while the agent's container restarts.

The whole agent (supervisor, workers, control process) is killed with SIGKILL, as an OOM
kill of its container or a kill -9 of its PID 1 ends it, while pods ask on fresh and
keep-alive connections.  With a keeper (a second container of the pod holding what the
supervisor deposited), the kernel keeps completing pods' connections into the backlog of a
socket that never closed, and the restarted agent answers them: nothing is refused, every
call is answered with the pod's own role.  Without one, the calls made while the agent is
down are refused (today's behaviour, the gap the keeper closes).
"""
from __future__ import annotations

import os
import socket
import time

import pytest

from handover_agents import kill_tree, serving, start_keeper, summary, wait_until
from kiamfast import fdpass
from kiamfast.sockets import listen_socket

pytestmark = pytest.mark.slow

DOWN = 0.5        # how long the container stays down before it is started again


@pytest.fixture
def keeper(tmp_path):
    path = tmp_path / "pod" / "keeper.sock"
    path.parent.mkdir()
    proc = start_keeper(str(path))
    try:
        yield str(path)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_killed_agent_with_a_keeper_loses_no_call(node, keeper):
    agent = node.agent("agent", handover=False, keeper=keeper)
    agent.wait_ready()
    wait_until(lambda: "deposited 1 socket" in agent.log(),
               lambda: "nothing deposited:\n" + agent.log())
    callers = node.callers(timeout=5.0)
    wait_until(lambda: all(c.snapshot() for c in callers), "no call made")

    killing = time.monotonic()
    kill_tree(agent)
    killed = time.monotonic()
    time.sleep(DOWN)
    restarted = time.monotonic()
    again = node.agent("agent-again", handover=False, keeper=keeper)
    wait_until(lambda: serving(again), lambda: "the restarted agent never ready:\n" + again.log())
    time.sleep(0.3)
    calls = [call for c in callers for call in c.stop()]

    # A call the killed worker had already accepted dies with it (SIGKILL mid-answer: a
    # reset, as from any server); every call made after that waits in the kept socket.
    in_flight = [c for c in calls if c.outcome in ("reset", "eof")
                 and c.at <= killed and c.at + c.took >= killing]
    assert len(in_flight) <= len(callers), summary(in_flight)
    assert [c for c in node.wrong(calls) if c not in in_flight] == [], (summary(calls),
                                                                       again.log())
    waited = [c for c in calls if c.at < restarted <= c.at + c.took]
    assert waited, "no call was waiting while the agent was down"
    # answered soon after the restart, from the table the killed agent left
    assert "serving on the table" in again.log()
    late = max(c.at + c.took for c in waited) - restarted
    print(f"calls waiting for the restart: {len(waited)}, last answered {late:.2f}s after it")


def test_without_a_keeper_the_calls_meanwhile_are_refused(node):
    agent = node.agent("agent", handover=False)
    agent.wait_ready()
    callers = node.callers(timeout=5.0)
    wait_until(lambda: all(c.snapshot() for c in callers), "no call made")
    kill_tree(agent)
    time.sleep(DOWN)
    again = node.agent("agent-again", handover=False)
    wait_until(lambda: serving(again), lambda: "the restarted agent never ready:\n" + again.log())
    calls = [call for c in callers for call in c.stop()]
    outcomes = summary(calls)
    assert outcomes.get("refused", 0) > 0, outcomes
    assert [c for c in calls if c.ok and node.role_of(c.access_key) != "app-role"] == []


def test_the_keeper_hands_back_what_was_deposited(keeper):
    held = listen_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    with fdpass.connect(keeper) as conn:
        fdpass.send(conn, {"op": "put", "note": {"table_path": "/t"},
                           "sockets": [{"kind": "app", "host": "127.0.0.1", "port": port}]},
                    [held.fileno()])
        assert fdpass.receive(conn)[0]["op"] == "ok"
    held.close()                       # only the keeper holds it now: still listening
    client = socket.create_connection(("127.0.0.1", port), timeout=2)
    with fdpass.connect(keeper) as conn:
        fdpass.send(conn, {"op": "get"})
        reply, socks = fdpass.receive(conn)
    assert reply["note"] == {"table_path": "/t"}
    assert reply["sockets"] == [{"kind": "app", "host": "127.0.0.1", "port": port}]
    [back] = socks
    back.settimeout(2)
    accepted, _ = back.accept()        # the connection made while only the keeper held it
    client.sendall(b"x")
    assert accepted.recv(1) == b"x"
    for s in (accepted, back, client):
        s.close()


def test_the_keeper_refuses_what_is_no_listening_socket(keeper):
    a, b = socket.socketpair()
    with fdpass.connect(keeper) as conn:
        fdpass.send(conn, {"op": "put", "sockets": [{"kind": "app"}]}, [a.fileno()])
        reply, _ = fdpass.receive(conn)
    assert reply["op"] == "error" and "not a listening TCP socket" in reply["error"]
    with fdpass.connect(keeper) as conn:
        fdpass.send(conn, {"op": "put", "sockets": []}, [b.fileno()])
        assert "description" in fdpass.receive(conn)[0]["error"]
    with fdpass.connect(keeper) as conn:
        conn.sendall(b"\x00\x00\x00\x05hello")
        assert conn.recv(100) == b""        # garbage: the keeper just hangs up
    with fdpass.connect(keeper) as conn:  # and serves the next client
        fdpass.send(conn, {"op": "get"})
        assert fdpass.receive(conn)[0] == {"v": 1, "op": "held", "note": {}, "sockets": []}
    a.close()
    b.close()


def test_the_keeper_socket_is_closed_to_other_users(keeper):
    assert os.stat(keeper).st_mode & 0o777 == 0o600
    pid = os.fork()
    if pid == 0:   # another user: the kernel refuses the connect (mode 0600)
        os.setgid(65534)
        os.setuid(65534)
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(keeper)
            os._exit(1)
        except PermissionError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

