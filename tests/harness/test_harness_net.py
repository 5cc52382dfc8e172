"""kiamfast.testing.net's free port: what every loopback node's agent, API server and
upstream listen on."""

from __future__ import annotations

import socket

from kiamfast.testing import net


def listen_as_the_agent(port: int) -> socket.socket:
    """The agent's listener: dual-stack ``::``, no SO_REUSEPORT (kiamfast/sockets.py)."""
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    s.listen()
    return s


def test_a_free_port_takes_the_agents_listener_and_no_connection_can_be_handed_it():
    low, _ = net.ephemeral_range()
    for _ in range(20):
        port = net.free_port()
        # Below the ephemeral range: the kernel hands no connect() this port, so a poll of
        # it before the agent listens cannot connect to itself and hold it.
        assert 1024 <= port < low
        listen_as_the_agent(port).close()


def test_a_port_bound_on_any_address_is_not_free(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", net.free_port()))   # IPv4 loopback only, as the fakes bind
    taken.listen()
    try:
        other = net.free_port()
        picks = iter([taken.getsockname()[1], other])
        monkeypatch.setattr(net.random, "randrange", lambda a, b: next(picks))
        assert net.free_port() == other
    finally:
        taken.close()
