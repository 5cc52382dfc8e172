"""A hostile pod cannot lock the other pods out: per-address connection limits and idle
timeouts that only requests extend (issue: one pod holding keep-alive connections)."""

from __future__ import annotations

import socket
import time

from kiamfast.server import metrics

from server_support import Client, build, closed_by_server, open_idle

LIST = "/latest/meta-data/iam/security-credentials/"


def test_one_address_holding_thousands_of_idle_connections_locks_nobody_out(make_server, pods):
    pods.add("127.0.0.2", "victim-role")
    server = make_server(max_connections_per_client=64, max_connections=1000)
    hog = open_idle(server.port, "127.0.0.66", 2000)
    try:
        time.sleep(0.3)
        # Every connection beyond the hog's share was closed at once ...
        assert sum(closed_by_server(s, 0.05) for s in hog[64:70]) == 6
        # ... and the other pod is served, on new connections too.
        for _ in range(5):
            r = server.get(LIST, source="127.0.0.2")
            assert (r.status, r.body) == (200, b"victim-role")
        assert server.counters()[metrics.CLIENT_LIMIT] >= 2000 - 64
    finally:
        for s in hog:
            s.close()


def test_the_limit_is_per_address_and_frees_up_when_connections_close(make_server, pods):
    pods.add("127.0.0.3", "role")
    server = make_server(max_connections_per_client=3)
    socks = open_idle(server.port, "127.0.0.3", 3)
    extra = open_idle(server.port, "127.0.0.3", 1)[0]
    assert closed_by_server(extra)
    socks[0].close()
    time.sleep(0.2)
    with Client(server.port, source="127.0.0.3") as c:
        assert c.request(build("GET", LIST)).body == b"role"
    for s in socks[1:]:
        s.close()


def test_bytes_that_never_make_a_request_do_not_keep_a_connection(make_server, pods):
    """Idle = no whole request: a client dribbling header bytes is closed by the request
    timeout, a silent one by the idle timeout, whatever else it sends."""
    server = make_server(idle_timeout=1.0, request_timeout=1.0)
    dribbler = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    started = time.monotonic()
    dribbler.sendall(b"GET / HTTP/1.1\r\n")
    for _ in range(8):
        time.sleep(0.3)
        try:
            dribbler.sendall(b"X")
        except OSError:
            break
    assert closed_by_server(dribbler, 3.0) and closed_by_server(silent, 3.0)
    assert time.monotonic() - started < 5.0
