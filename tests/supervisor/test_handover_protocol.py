"""The handover's wire and its bad peers (kiamfast/fdpass.py, kiamfast/supervisor/handover.py).

Frames are a length, a JSON object with "v" and descriptors (SCM_RIGHTS).  Whatever a peer
sends (garbage, another protocol version, too many descriptors, a descriptor that is no
socket), the receiver closes every descriptor it got and says why; a handover socket that
is not a socket of our uid closed to others is never used; sockets handed over that do not
listen where this agent's configuration says are refused; a new agent that goes away half
way leaves the serving one serving.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading

import pytest

from agent_process import free_port
from handover_agents import idle, serving, wait_until
from kiamfast import fdpass
from kiamfast.sockets import listen_socket


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def test_a_frame_carries_json_and_descriptors():
    a, b = pair()
    held = listen_socket("127.0.0.1", 0)
    fdpass.send(a, {"op": "x", "n": 1}, [held.fileno()])
    message, [got] = fdpass.receive(b)
    assert message == {"v": 1, "op": "x", "n": 1}
    assert fdpass.listening_address(got) == held.getsockname()
    for s in (a, b, held, got):
        s.close()


@pytest.mark.parametrize("raw,why", [
    (b"\x00\x00\x00\x05hello", "not JSON"),
    (b"\x00\x00\x00\x02[]", "not a JSON object"),
    (b'\x00\x00\x00\x0b{"v":2,"a"}', "not JSON"),
    (b'\x00\x00\x00\x08{"v":22}', "protocol 22"),
    (b"\x7f\x00\x00\x00", "announced"),
    (b"\x00\x00", "closed"),
])
def test_garbage_is_refused_and_its_descriptors_closed(raw, why):
    a, b = pair()
    b.settimeout(2)
    held = listen_socket("127.0.0.1", 0)
    socket.send_fds(a, [raw], [held.fileno()])
    a.close()
    before = open_fds()
    with pytest.raises(fdpass.FdPassError, match=why):
        fdpass.receive(b)
    assert open_fds() == before          # the descriptor that came with it is closed
    b.close()
    held.close()


def test_too_many_descriptors_are_refused_and_closed():
    a, b = pair()
    b.settimeout(2)
    socks = [listen_socket("127.0.0.1", 0) for _ in range(fdpass.MAX_FDS + 2)]
    socket.send_fds(a, [b'\x00\x00\x00\x07{"v":1}'], [s.fileno() for s in socks])
    before = open_fds()
    with pytest.raises(fdpass.FdPassError, match="descriptors"):
        fdpass.receive(b)
    assert open_fds() == before
    for s in (a, b, *socks):
        s.close()


def test_a_descriptor_that_is_no_socket_is_refused():
    a, b = pair()
    b.settimeout(2)
    r, w = os.pipe()
    socket.send_fds(a, [b'\x00\x00\x00\x07{"v":1}'], [r])
    before = open_fds()
    with pytest.raises(fdpass.FdPassError, match="not a socket"):
        fdpass.receive(b)
    assert open_fds() == before
    for fd in (r, w):
        os.close(fd)
    a.close()
    b.close()


def test_a_peer_that_stalls_times_out():
    a, b = pair()
    b.settimeout(0.2)
    a.sendall(b"\x00\x00\x00\x10{")
    with pytest.raises(fdpass.FdPassError, match="timed out"):
        fdpass.receive(b)
    a.close()
    b.close()


@pytest.mark.parametrize("change,why", [
    (lambda p: os.chmod(p, 0o666), "open to group or others"),
    (lambda p: os.chown(p, 65534, 65534), "owned by uid 65534"),
])
def test_a_handover_socket_not_ours_alone_is_not_used(tmp_path, change, why):
    path = str(tmp_path / "h.sock")
    server = fdpass.listen(path)
    change(path)
    with pytest.raises(fdpass.FdPassError, match=why):
        fdpass.connect(path)
    server.close()


def test_a_symlink_is_not_a_handover_socket(tmp_path):
    real = str(tmp_path / "real.sock")
    server = fdpass.listen(real)
    os.symlink(real, tmp_path / "h.sock")
    with pytest.raises(fdpass.FdPassError, match="not a socket"):
        fdpass.connect(str(tmp_path / "h.sock"))
    server.close()


# ---- against a real agent --------------------------------------------------------------------

class FakeOldAgent(threading.Thread):
    """Listens on the node's handover socket and answers a takeover with ``answer(conn)``."""

    def __init__(self, path: str, answer) -> None:
        super().__init__(daemon=True)
        self.server = fdpass.listen(path)
        self.answer = answer
        self.seen: list[dict] = []

    def run(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(30)
            self.seen.append(fdpass.receive(conn)[0])
            self.answer(self, conn)

    def close(self) -> None:
        self.server.close()


def fails_to_take_over(node, agent) -> str:
    assert agent.proc.wait(60) == 1, agent.log()
    return agent.log()


def takeover_refused(node, answer) -> tuple[str, FakeOldAgent]:
    """A new agent asks the fake old one to hand over, gets ``answer``, and fails: its log,
    and the fake (what it saw)."""
    fake = FakeOldAgent(str(node.state / "handover.sock"), answer)
    fake.start()
    log = fails_to_take_over(node, node.agent("new"))
    fake.join(10)
    return log, fake


def offer(*, table_path: str, sock: socket.socket, port: int):
    """An answer handing over ``sock`` as the app socket of ``port`` and ``table_path``."""
    def answer(self, conn):
        fdpass.send(conn, {"op": "sockets", "table_path": table_path,
                           "sockets": [{"kind": "app", "host": "", "port": port}]},
                    [sock.fileno()])
        self.seen.append(fdpass.receive(conn)[0])
    return answer


def test_an_old_agent_speaking_garbage_is_not_followed(node):
    node.port = free_port()
    log, fake = takeover_refused(node, lambda self, conn: conn.sendall(b"\x00\x00\x00\x03abc"))
    assert "cannot take the node over" in log and "not JSON" in log
    assert fake.seen and fake.seen[0]["op"] == "takeover"
    fake.close()


def test_sockets_that_do_not_match_the_configuration_are_refused(node):
    node.port = free_port()
    other = listen_socket("127.0.0.1", 0)
    log, fake = takeover_refused(node, offer(table_path=str(node.state / "table"), sock=other,
                                             port=node.port))
    assert "refusing the handed-over sockets" in log
    assert fake.seen[-1]["op"] == "abort" and "listens on" in fake.seen[-1]["error"]
    # this agent's descriptor of the foreign socket was closed: only ours is left
    assert fdpass.listening_address(other) is not None
    other.close()
    fake.close()


def test_a_table_path_of_another_configuration_is_refused(node):
    node.port = free_port()
    held = listen_socket(None, node.port)
    log, fake = takeover_refused(node, offer(table_path="/dev/shm/elsewhere", sock=held,
                                             port=node.port))
    assert "/dev/shm/elsewhere" in log and fake.seen[-1]["op"] == "abort"
    held.close()
    fake.close()


def test_an_old_agent_survives_a_new_one_that_hangs_up_or_speaks_garbage(node):
    old = node.agent("old")
    old.wait_ready()
    workers = old.children("kiamfast.server.worker")
    path = str(node.state / "handover.sock")
    with fdpass.connect(path) as conn:            # takes the node, then vanishes
        fdpass.send(conn, {"op": "takeover", "pid": 1})
        reply, socks = fdpass.receive(conn)
        assert reply["op"] == "sockets" and len(socks) == 1
        for s in socks:
            s.close()
    wait_until(lambda: "ended after 'offered'" in old.log(), "the hang-up went unnoticed")
    with fdpass.connect(path) as conn:            # another protocol version
        conn.sendall(b"\x00\x00\x00\x08" + json.dumps({"v": 9}).encode()[:8])
        reply, _ = fdpass.receive(conn)
        assert reply["op"] == "refused" and "protocol 9" in reply["error"]
    with fdpass.connect(path) as conn:            # a well-formed frame of nonsense
        fdpass.send(conn, {"op": "give me everything"})
        assert fdpass.receive(conn)[0]["op"] == "refused"
    assert old.children("kiamfast.server.worker") == workers and serving(old)
    assert not idle(old)


def test_a_new_agent_that_cannot_use_a_live_handover_socket_stops_at_bind(node):
    old = node.agent("old")
    old.wait_ready()
    os.chmod(node.state / "handover.sock", 0o666)
    log = fails_to_take_over(node, node.agent("new"))
    assert "open to group or others; not taking over through it" in log
    assert "cannot start" in log and "in use" in log
    assert serving(old)


def test_a_stopping_worker_answers_a_connection_it_accepted_before_the_request_came(node):
    """A worker told to stop (the old agent's, at stop-accepting) may hold connections it
    accepted a moment before whose request it has not read yet: it answers them (a client
    does not retry a fresh connection closed after it sent its request)."""
    from agent_process import LISTING, POD_IP, ROLE, connections_per_worker
    agent = node.agent("agent", handover=False)
    agent.wait_ready()
    [worker] = agent.children("kiamfast.server.worker")
    s = socket.create_connection(("127.0.0.1", agent.port), timeout=5,
                                 source_address=(POD_IP, 0))
    wait_until(lambda: connections_per_worker(agent, [worker])[worker] == 1,
               "the worker never accepted the connection")
    os.kill(worker, signal.SIGTERM)
    s.sendall(f"GET {LISTING} HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n".encode())
    raw = b""
    while chunk := s.recv(4096):
        raw += chunk
        if raw.endswith(ROLE.encode()):
            break
    s.close()
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(ROLE.encode()), raw
