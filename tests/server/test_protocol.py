"""HTTP/1.x handling: keep-alive, pipelining, HTTP/1.0, limits, malformed and slow clients.

Run on uvloop and on stdlib asyncio. Whatever a client sends, the worker answers the right
4xx (or nothing, for a client too slow to finish) and closes, and keeps serving everyone
else: every test ends by checking that a normal request still works.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from server_support import Client, build

LIST = "/latest/meta-data/iam/security-credentials/"


@pytest.fixture
def srv(make_server, pods, loop_kind):
    pods.add("127.0.0.1", "app-role")
    server = make_server(loop_kind=loop_kind, idle_timeout=2.0, request_timeout=1.0,
                         max_url=1024, max_header_bytes=4096, max_headers=20, max_body=1024)
    yield server
    # The worker survived whatever the test did.
    r = server.get(LIST)
    assert (r.status, r.body) == (200, b"app-role")


def raw_exchange(port, data, *, timeout=3.0):
    """Send raw bytes, read until the server closes; everything it sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out


def test_keep_alive_serves_many_requests_on_one_connection(srv):
    with Client(srv.port) as c:
        for _ in range(50):
            assert c.request(build("GET", LIST)).body == b"app-role"


def test_pipelined_batch_is_answered_in_order(srv):
    paths = [LIST, "/latest/api/token", LIST + "app-role", "/readyz", LIST + "nope"] * 10
    raw = b""
    for p in paths:
        if p.endswith("/api/token"):
            raw += build("PUT", p, {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        else:
            raw += build("GET", p)
    with Client(srv.port) as c:
        c.send(raw)
        got = c.read(len(paths))
    assert [r.status for r in got] == [200, 200, 200, 200, 404] * 10
    assert got[0].body == b"app-role"
    assert got[2].body.startswith(b'{"Code":"Success"')


def test_pipelined_passthrough_keeps_order(srv):
    raw = (build("GET", "/latest/meta-data/placement/region") + build("GET", LIST)
           + build("GET", "/latest/meta-data/instance-id") + build("GET", LIST))
    with Client(srv.port) as c:
        c.send(raw)
        got = c.read(4)
    assert [r.body for r in got] == [b"eu-west-1", b"app-role", b"i-0fa4e1a5e0000cafe",
                                     b"app-role"]


def test_request_split_into_single_bytes(srv):
    raw = build("GET", LIST, {"X-Aws-Ec2-Metadata-Token-Ttl-Seconds": "1"})
    with Client(srv.port) as c:
        for i in range(len(raw)):
            c.send(raw[i:i + 1])
        assert c.read(1)[0].body == b"app-role"


def test_http10_closes_after_the_answer(srv):
    out = raw_exchange(srv.port, b"GET " + LIST.encode() + b" HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nConnection: close\r\n" in out
    assert out.endswith(b"app-role")


def test_http10_keep_alive_is_echoed_and_honoured(srv):
    with Client(srv.port) as c:
        for _ in range(3):
            r = c.request(build("GET", LIST, {"Connection": "keep-alive"}, version="1.0"))
            assert r.body == b"app-role"
            assert r.header("Connection") == "keep-alive"


def test_http11_connection_close_is_honoured(srv):
    out = raw_exchange(srv.port, build("GET", LIST, {"Connection": "close"})
                       + build("GET", LIST))  # the second request must be ignored
    assert out.count(b"HTTP/1.1 ") == 1
    assert b"\r\nConnection: close\r\n" in out


def test_header_names_are_case_insensitive(srv):
    token = srv.token()
    for name in ("x-aws-ec2-metadata-token", "X-AWS-EC2-METADATA-TOKEN", "X-aWs-Ec2-MeTaDaTa-ToKeN"):
        r = srv.get(LIST, headers={name: token})
        assert r.status == 200, name
        assert r.header("X-Aws-Ec2-Metadata-Token-Ttl-Seconds") is not None
    assert srv.get(LIST, headers={"X-AWS-EC2-METADATA-TOKEN": "bad"}).status == 401


@pytest.mark.parametrize("data,status", [
    (b"THIS IS NOT HTTP\r\n\r\n", 405),  # "THIS" is a well-formed, unknown method
    (b"GET / HTTP/9.9\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # a TLS ClientHello
    (b"GET /latest/meta-data/ HTTP/1.1\r\nBad Header\r\n\r\n", 400),
    (b"GET /a b HTTP/1.1\r\n\r\n", 400),
    (b"BREW /latest HTTP/1.1\r\n\r\n", 405),
    (b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n", 400),
    (b"GET * HTTP/1.1\r\n\r\n", 400),
])
def test_malformed_requests_get_4xx_and_a_close(srv, data, status):
    out = raw_exchange(srv.port, data)
    assert out.startswith(b"HTTP/1.1 %d " % status), out[:80]
    assert b"Server: EC2ws" in out


def test_too_long_request_target_is_414(srv):
    out = raw_exchange(srv.port, b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 414 ")


def test_too_many_headers_is_431(srv):
    headers = {f"X-H{i}": "v" for i in range(50)}
    out = raw_exchange(srv.port, build("GET", LIST, headers))
    assert out.startswith(b"HTTP/1.1 431 ")


def test_too_large_header_is_431(srv):
    out = raw_exchange(srv.port, build("GET", LIST, {"X-Big": "v" * 8000}))
    assert out.startswith(b"HTTP/1.1 431 ")


def test_endless_header_is_cut_off(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nX-Endless: ")
        out = b""
        try:
            for _ in range(200):
                s.sendall(b"v" * 4096)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    assert out.startswith(b"HTTP/1.1 431 ") or out == b""


def test_too_large_body_is_413(srv):
    out = raw_exchange(srv.port, build("POST", LIST, body=b"x" * 5000))
    assert out.startswith(b"HTTP/1.1 413 ")


def test_too_large_chunked_body_is_413(srv):
    chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
    out = raw_exchange(srv.port, b"POST " + LIST.encode() + b" HTTP/1.1\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 3 + b"0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413 ")


def test_small_body_is_accepted_and_ignored(srv):
    with Client(srv.port) as c:
        r = c.request(build("POST", LIST, body=b"hello"))
        assert r.body == b"app-role"
        assert c.request(build("GET", LIST)).body == b"app-role"


def test_answers_before_a_malformed_request_are_still_sent(srv):
    out = raw_exchange(srv.port, build("GET", LIST) + b"GARBAGE\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK")
    assert b"HTTP/1.1 400 " in out or b"HTTP/1.1 405 " in out


def test_slow_client_gets_408_and_is_closed(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finishes
        t0 = time.monotonic()
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - t0 < 9


def test_idle_connection_is_closed(srv):
    with Client(srv.port, timeout=10) as c:
        assert c.request(build("GET", LIST)).status == 200
        assert c.wait_closed(timeout=8)


def test_client_closing_mid_request_is_harmless(srv):
    for cut in (5, 20, 40):
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(build("GET", LIST)[:cut])


def test_half_closed_client_still_gets_its_answers(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(build("GET", LIST) + build("GET", "/latest/meta-data/instance-id"))
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.endswith(b"i-0fa4e1a5e0000cafe")


def test_many_concurrent_connections(srv, pods):
    for i in range(2, 202):
        pods.add(f"127.0.1.{i}", f"role-{i % 40}")
    clients = [Client(srv.port, source=f"127.0.1.{i}") for i in range(2, 202)]
    try:
        for c in clients:
            c.send(build("GET", LIST))
        for i, c in zip(range(2, 202), clients):
            assert c.read(1)[0].body == f"role-{i % 40}".encode()
    finally:
        for c in clients:
            c.close()


def test_many_threads_hammering(srv):
    errors = []

    def worker():
        try:
            with Client(srv.port) as c:
                for _ in range(30):
                    if c.request(build("GET", LIST)).body != b"app-role":
                        errors.append("wrong body")
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []


def test_huge_pipelined_burst_with_a_slow_reader(srv):
    """5000 pipelined requests while the client is slow to read: the worker stops reading
    when its write buffer fills, and every answer still arrives, in order."""
    n = 5000
    raw = b"".join(build("GET", LIST if i % 2 else "/readyz") for i in range(n))
    with Client(srv.port, timeout=30) as c:
        sender = threading.Thread(target=c.send, args=(raw,))
        sender.start()
        time.sleep(0.3)  # let the buffers fill up before reading anything
        got = c.read(n)
        sender.join(30)
    assert len(got) == n
    assert all(r.body == (b"app-role" if i % 2 else b"ok\n") for i, r in enumerate(got))
