"""No other process can take a share of the agent's port (issue 15, port hijack).

Any root process in the host network namespace (a hostNetwork pod) that binds the agent's
port with SO_REUSEPORT would, if the agent's own sockets allowed it, be handed a share of
every pod's metadata connections.  The supervisor binds the port once without it and every
worker accepts on that socket, so the kernel refuses the foreign bind; both workers still
serve.  Which worker holds a connection is read from /proc, as `ss -tnp` would show it.
"""

from __future__ import annotations

import errno
import socket

import pytest

from agent_process import LISTING, POD_IP, ROLE, Agent, Fakes, hold_until_spread
from kiamfast.testing.net import free_port

@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    fakes = Fakes()
    metrics_port = free_port()
    agent = Agent(fakes, tmp_path_factory.mktemp("hijack"), metrics_port=metrics_port,
                  extra=["--workers=2"])
    try:
        agent.wait_ready()
        agent.metrics_port = metrics_port
        yield agent
    finally:
        agent.stop()
        fakes.stop()


def hijack(family: int, host: str, port: int) -> int:
    """Try what a hostile hostNetwork pod would: bind the port with SO_REUSEPORT.  Returns
    the errno (0 if the bind succeeded, i.e. the hijack worked)."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            s.bind((host, port))
            s.listen()
        except OSError as e:
            return e.errno
        return 0


@pytest.mark.parametrize("family,host", [
    (socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "127.0.0.1"),
], ids=["dual-stack", "any-ipv4", "loopback"])
def test_a_second_bind_of_the_app_port_is_refused(agent, family, host):
    assert hijack(family, host, agent.port) == errno.EADDRINUSE


def test_a_second_bind_of_the_metrics_port_is_refused(agent):
    assert hijack(socket.AF_INET6, "::", agent.metrics_port) == errno.EADDRINUSE
    assert hijack(socket.AF_INET, "127.0.0.1", agent.metrics_port) == errno.EADDRINUSE


def ask_for_listing(port: int) -> socket.socket:
    """A pod's keep-alive connection, answered once and left open."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(POD_IP, 0))
    s.sendall(f"GET {LISTING} HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n".encode())
    raw = b""
    while not raw.endswith(ROLE.encode()):
        chunk = s.recv(4096)
        assert chunk, raw
        raw += chunk
    assert raw.startswith(b"HTTP/1.1 200"), raw
    return s


def test_both_workers_serve_the_shared_socket(agent):
    assert len(agent.children("kiamfast.server.worker")) == 2
    held, per_worker = hold_until_spread(agent, lambda: ask_for_listing(agent.port))
    for s in held:
        s.close()
    assert sum(per_worker.values()) == len(held), per_worker
    assert len(per_worker) == 2 and all(n > 0 for n in per_worker.values()), per_worker
