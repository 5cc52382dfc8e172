"""The load generator and the baselines answer what they must: correctness only, never timing.

The benchmarks' ratios are only worth something if the load really comes from many pod
addresses, every answer is checked, and the ceilings send the same bytes as the agent.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.request

import pytest

import bench_servers as bs
from benchutil import pod_addresses
from loadgen import Spec, run_load
from needs import tool_mark

REQ = b"GET /latest/meta-data/iam/security-credentials/r HTTP/1.1\r\nHost: x\r\n\r\n"


class PeerEcho:
    """A keep-alive HTTP server answering every request with the caller's source address."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()

        class Proto(asyncio.Protocol):
            def connection_made(self, t):
                self.t = t
                self.body = t.get_extra_info("peername")[0].encode()
                self.buf = b""

            def data_received(self, data):
                self.buf += data
                while b"\r\n\r\n" in self.buf:
                    _, _, self.buf = self.buf.partition(b"\r\n\r\n")
                    self.t.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(self.body), self.body))

        async def start():
            srv = await self.loop.create_server(Proto, "127.0.0.1", 0)
            self.port = srv.sockets[0].getsockname()[1]
            ready.set()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def echo():
    e = PeerEcho()
    yield e
    e.close()


def test_every_connection_comes_from_its_pod_address(echo):
    ips = pod_addresses(300)
    specs = [Spec(ip, REQ, 200, ip.encode()) for ip in ips]
    r = run_load(echo.port, specs, connections=300, processes=2, duration=0.5, warmup=0.2)
    assert r.errors == 0, r.bad
    assert r.count > 300
    assert r.connects >= 300
    assert r.latencies_us.size == r.count


def test_rotating_connections_visit_every_address(echo):
    ips = pod_addresses(260)
    specs = [Spec(ip, REQ, 200, ip.encode()) for ip in ips]
    # one slot, 2 requests per connection: it must reconnect from each address in turn
    r = run_load(echo.port, specs, connections=1, processes=1, duration=0.6, warmup=0.0,
                 per_conn=2)
    assert r.errors == 0, r.bad
    assert r.connects >= 100


def test_a_wrong_body_is_counted(echo):
    specs = [Spec("127.0.1.1", REQ, 200, b"127.0.1.2")]
    r = run_load(echo.port, specs, connections=1, duration=0.3, warmup=0.0)
    assert r.count > 0 and r.errors == r.checked >= r.count
    assert "127.0.1.1" in r.bad[0]


def test_a_missing_header_or_a_wrong_length_is_counted(echo):
    ip = "127.0.1.1"
    right = [Spec(ip, REQ, 200, length=len(ip), headers=(b"Content-Length: 9",))]
    r = run_load(echo.port, right, connections=1, duration=0.3, warmup=0.0)
    assert r.count > 0 and r.errors == 0, r.bad
    for spec in (Spec(ip, REQ, 200, length=len(ip) + 1),
                 Spec(ip, REQ, 200, headers=(b"Server: EC2ws",))):
        r = run_load(echo.port, [spec], connections=1, duration=0.3, warmup=0.0)
        assert r.count > 0 and r.errors == r.checked >= r.count, spec


def test_paced_run_keeps_to_its_rate(echo):
    specs = [Spec(ip, REQ, 200, ip.encode()) for ip in pod_addresses(50)]
    r = run_load(echo.port, specs, connections=50, duration=1.0, warmup=0.2, rate=500)
    assert r.errors == 0
    assert 250 <= r.count <= 750     # a count, not a timing: the pacing works at all


@tool_mark("nginx")
def test_nginx_baseline_sends_the_exact_body():
    body = b'{"Code" : "Success", "Token" : "a$b${x}\\\\c\\"d", "k": \'q\'}\n'
    with bs.nginx(body) as srv:
        got = urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/latest/meta-data/iam/"
                                     "security-credentials/x").read()
        assert got == body
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/latest/api/token",
                                     method="PUT")
        assert urllib.request.urlopen(req).read() == bs.TOKEN.encode()
        assert urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/latest/meta-data/"
                                      "instance-id").read() == bs.INSTANCE_ID.encode()


def test_python_baseline_sends_the_exact_response():
    resp = b"HTTP/1.1 200 OK\r\nServer: EC2ws\r\nContent-Length: 5\r\n\r\nhello"
    with bs.python_baseline(resp) as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(REQ + REQ)
            data = b""
            while len(data) < 2 * len(resp):
                data += s.recv(4096)
        assert data == resp + resp
