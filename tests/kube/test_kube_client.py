"""kiamfast.kube.client over real sockets: the project's API server emulator for the faults
a real server does not produce on demand (429 with Retry-After, a watch answered with a
list, a dropped or stalled stream), and a raw loopback server where only raw bytes show the
case (a stream cut mid-chunk, a kept-alive connection closed while idle)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import replace

import orjson
import pytest

import kiamfast

from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config
from kiamfast.kube.credentials import TokenFile
from kiamfast.kube.errors import ApiError, ApiTimeout, ApiUnavailable


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def client_for(emulator, tmp_path, **kw) -> Client:
    return Client(load_config(kubeconfig=emulator.write_kubeconfig(tmp_path / "kc"),
                              environ={}), **kw)


class RawServer:
    """A loopback server that hands each accepted connection to ``serve(conn)`` on a thread."""

    def __init__(self, serve) -> None:
        self.serve = serve
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.serve(conn)
            except OSError:
                pass

    def client(self) -> Client:
        return Client(load_config(api_server=f"http://127.0.0.1:{self.port}", api_token="t",
                                  environ={}))

    def close(self) -> None:
        self.sock.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return b""
        data += more
    return data


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")


@pytest.fixture
def raw():
    servers = []

    def make(serve):
        servers.append(RawServer(serve))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


# ---- requests ---------------------------------------------------------------------------------

def test_requests_reuse_one_connection_and_send_who_we_are(emulator, tmp_path):
    emulator.nodes.add("n1")

    async def body():
        client = client_for(emulator, tmp_path)
        for _ in range(3):
            node = (await client.request("GET", "/api/v1/nodes/n1")).json()
            assert node["metadata"]["name"] == "n1"
        assert client.connections_made == 1
        await client.close()
    run(body())


def test_a_429_carries_retry_after_and_is_not_retried(emulator, tmp_path):
    emulator.faults.fail_next(1, status=429)

    async def body():
        client = client_for(emulator, tmp_path)
        with pytest.raises(ApiError) as e:
            await client.request("GET", "/api/v1/pods")
        assert (e.value.status, e.value.retry_after) == (429, 1.0)
        assert e.value.reason == "TooManyRequests"
        assert emulator.traffic.stats()["requests"] == 1            # the client did not retry
        assert (await client.request("GET", "/api/v1/pods")).status == 200
        await client.close()
    run(body())


def test_a_401_rereads_the_rotated_token_file_on_the_next_call(emulator, tmp_path):
    token_path = tmp_path / "token"
    token_path.write_text("expired-token")
    config = load_config(kubeconfig=emulator.write_kubeconfig(tmp_path / "kc"), environ={})
    # The clock never moves: only the 401 can make the file be read again.
    token = TokenFile(str(token_path), what="token", check_interval=60, clock=lambda: 0.0)
    client = Client(replace(config, credentials=token))

    async def body():
        with pytest.raises(ApiError) as e:
            await client.request("GET", "/api/v1/namespaces")
        assert e.value.status == 401
        token_path.with_name("new").write_text("test-token")
        token_path.with_name("new").replace(token_path)
        assert (await client.request("GET", "/api/v1/namespaces")).status == 200
        await client.close()
    run(body())


def test_refused_and_unanswered_connections_are_unavailable(raw):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # bound, not listening: refused
    client = Client(load_config(api_server=f"http://127.0.0.1:{port}", api_token="t",
                                environ={}))
    silent = raw(lambda conn: (read_request(conn), conn.recv(1)))

    async def body():
        with pytest.raises(ApiUnavailable) as e:
            await client.request("GET", "/api/v1/pods")
        assert "cannot connect to http://127.0.0.1" in str(e.value)
        with pytest.raises(ApiTimeout) as e:
            await silent.client().request("GET", "/api/v1/pods", timeout=0.3)
        assert str(e.value).endswith("no answer from http://127.0.0.1:%d in 0.3s" % silent.port)
    run(body())


def test_a_kept_alive_connection_closed_while_idle_is_replaced_once(raw):
    def serve(conn):
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        # The next request crosses the server's close of the connection it kept: no answer.
        read_request(conn)
    server = raw(serve)

    async def body():
        client = server.client()
        for _ in range(3):
            assert (await client.request("GET", "/version")).body == b"{}"
        assert server.accepted == 3 and client.connections_made == 3
    run(body())


def test_blocking_requests(emulator, tmp_path):
    emulator.nodes.add("n1")
    client = client_for(emulator, tmp_path)
    assert client.request_sync("GET", "/api/v1/nodes/n1").json()["metadata"]["name"] == "n1"
    assert client.request_sync("GET", "/api/v1/nodes/n1").status == 200
    with pytest.raises(ApiError) as e:
        client.request_sync("GET", "/api/v1/nodes/missing")
    assert (e.value.status, e.value.reason) == (404, "NotFound")
    patched = client.request_sync("PATCH", "/api/v1/nodes/n1", body={
        "metadata": {"labels": {"a": "b"}}}, content_type="application/merge-patch+json")
    assert patched.json()["metadata"]["labels"]["a"] == "b"
    assert emulator.traffic.stats()["requests"] == 4
    run(client.close())


def test_a_blocking_tls_connection_the_server_closed_while_idle_is_replaced_once(raw, pki,
                                                                                 tmp_path):
    """The API server closes an idle kept-alive TLS connection (its idle timeout): the next
    request's write on it fails with ssl.SSLEOFError before any answer, and goes once more
    on a new connection (the token path's TokenReview answered a pod 503 here before)."""
    import ssl
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki["cert"], pki["key"])
    closed = threading.Semaphore(0)

    def serve(conn):
        tls = context.wrap_socket(conn, server_side=True)
        request = read_request(tls)
        while not request.endswith(b"{}"):     # the body too: none left unread at the close
            request += tls.recv(65536)
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        os.close(tls.detach())       # idle now: closed, as the server's idle timeout does
        closed.release()
    server = raw(serve)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(orjson.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{server.port}",
                                                "certificate-authority": str(pki["ca"])}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    client = Client(load_config(kubeconfig=str(kubeconfig), environ={}))
    for _ in range(3):
        assert client.request_sync("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                                   body={}).body == b"{}"
        assert closed.acquire(timeout=10)
        time.sleep(0.1)              # the close has reached the client's socket
    assert server.accepted == 3
    run(client.close())


def test_blocking_request_timeout_and_refusal(raw):
    silent = raw(lambda conn: (read_request(conn), conn.recv(1)))
    with pytest.raises(ApiTimeout):
        silent.client().request_sync("GET", "/version", timeout=0.3)
    silent.close()
    with pytest.raises(ApiUnavailable):
        silent.client().request_sync("GET", "/version", timeout=0.3)


# ---- watch streams ------------------------------------------------------------------------------

WATCH = {"watch": True, "allowWatchBookmarks": True}


def test_watch_stream_delivers_events_in_order(emulator, tmp_path):
    emulator.nodes.add("n1")
    rv = emulator.resource_version

    async def body():
        client = client_for(emulator, tmp_path)
        async with client.stream("/api/v1/pods", params={
                **WATCH, "resourceVersion": rv, "fieldSelector": "spec.nodeName=n1"}) as s:
            emulator.pods.create("default", "a", node="n1")
            emulator.pods.set_phase("default", "a", "Running")
            emulator.pods.delete("default", "a")
            seen = []
            async for line in s.lines():
                event = orjson.loads(line)
                seen.append((event["type"], event["object"]["metadata"]["name"]))
                if len(seen) == 3:
                    break
        assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
        await client.close()
    run(body())


def test_watch_answered_with_a_list_yields_its_body_for_the_caller_to_judge(emulator, tmp_path):
    emulator.pods.create("default", "a", node="n1")
    emulator.faults.answer_watches_with("list")

    async def body():
        client = client_for(emulator, tmp_path)
        async with client.stream("/api/v1/pods", params=WATCH) as s:
            lines = [line async for line in s.lines()]
        assert len(lines) == 1 and orjson.loads(lines[0])["kind"] == "PodList"
        emulator.faults.answer_watches_with("empty")
        async with client.stream("/api/v1/pods", params=WATCH) as s:
            assert [line async for line in s.lines()] == []
    run(body())


def test_watch_dropped_by_the_server_is_unavailable(emulator, tmp_path):
    async def body():
        client = client_for(emulator, tmp_path)
        async with client.stream("/api/v1/pods", params=WATCH) as s:
            assert emulator.traffic.wait_watches(1)
            emulator.faults.drop_watches()
            with pytest.raises(ApiUnavailable) as e:
                async for _ in s.lines():
                    pass
        assert "the stream broke" in str(e.value)
    run(body())


def test_stalled_watch_hits_the_inactivity_timeout(emulator, tmp_path):
    async def body():
        client = client_for(emulator, tmp_path)
        async with client.stream("/api/v1/pods", params=WATCH, timeout=(5, 0.5)) as s:
            with pytest.raises(ApiTimeout) as e:
                async for _ in s.lines():
                    pass
        assert str(e.value) == "watch /api/v1/pods: nothing received for 0.5s"
    run(body())


def test_watch_refused_raises_the_api_error(emulator, tmp_path):
    emulator.faults.fail_next(1, status=429, path_prefix="/api/v1/pods")

    async def body():
        client = client_for(emulator, tmp_path)
        with pytest.raises(ApiError) as e:
            async with client.stream("/api/v1/pods", params=WATCH):
                pass
        assert (e.value.status, e.value.retry_after) == (429, 1.0)
    run(body())


def test_close_from_another_task_ends_the_lines_quietly(emulator, tmp_path):
    async def body():
        client = client_for(emulator, tmp_path)
        async with client.stream("/api/v1/pods", params=WATCH) as s:
            asyncio.get_running_loop().call_later(0.2, s.close)
            assert [line async for line in s.lines()] == []
            assert s.closed
    run(body())


def test_stream_cut_mid_chunk_is_unavailable(raw):
    event = b'{"type":"ADDED","object":{"metadata":{"name":"a"}}}\n'

    def serve(conn):
        read_request(conn)
        conn.sendall(STREAM_HEAD + chunk(event) + b"%x\r\n" % 100 + event[:20])
    server = raw(serve)

    async def body():
        got = []
        async with server.client().stream("/api/v1/pods", params=WATCH) as s:
            with pytest.raises(ApiUnavailable) as e:
                async for line in s.lines():
                    got.append(line)
        assert got == [event.rstrip(b"\n")]
        assert str(e.value) == ("watch /api/v1/pods: the stream broke: the connection "
                                "closed mid-answer")
    run(body())


def test_lines_split_across_chunks_and_many_in_one(raw):
    events = [b'{"type":"ADDED","n":%d}' % i for i in range(4)]
    heads = []

    def serve(conn):
        heads.append(read_request(conn))
        conn.sendall(STREAM_HEAD)
        conn.sendall(chunk(events[0][:5]))
        conn.sendall(chunk(events[0][5:] + b"\n" + events[1] + b"\n\n" + events[2][:3]))
        conn.sendall(chunk(events[2][3:] + b"\n") + chunk(events[3]) + b"0\r\n\r\n")
    server = raw(serve)

    async def body():
        async with server.client().stream("/api/v1/pods") as s:
            # The last line has no newline: it is still handed over, for the caller to judge.
            assert [line async for line in s.lines()] == events
    run(body())
    request = heads[0].decode().split("\r\n")
    assert request[0] == "GET /api/v1/pods HTTP/1.1"
    assert {"Authorization: Bearer t", f"User-Agent: kiamfast/{kiamfast.__version__}",
            "Accept: application/json", "Connection: close"} <= set(request)
