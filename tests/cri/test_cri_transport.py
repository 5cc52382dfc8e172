"""The CRI client's gRPC transport (kiamfast/control/cri/transport.py) against real servers.

Most tests talk to a real gRPC server (grpcio's, on a unix socket, as the CRI fault double
does; containerd's own grpc-go server is in test_runtime_client.py): answers of any size,
deadlines, status codes and messages, many threads at once, a server restarted or shut down
gracefully (GOAWAY). Frames a real server never sends on demand (GOAWAY before the answer,
RST_STREAM, an answer without grpc-status, a non-gRPC peer) come from a small HTTP/2 server
built on h2's server side.
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from concurrent import futures

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest

from kiamfast.control.cri.transport import (WINDOW, GrpcError, StatusCode, UnixChannel,
                                            grpc_timeout, unix_socket_path)
from kiamfast.control.cri.client import RuntimeClient

SERVICE = "test.Transport"


class GrpcServer:
    """grpcio's server on a unix socket with a few raw-bytes methods:
    Echo (the request back), Size (an answer of int(request) bytes), Sleep (waits
    float(request) s, answers b"slept"), Fail (aborts with the code and message in the
    request, "CODE:message"), FailLate (the same after sending its headers)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.endpoint = "unix://" + path
        self.remaining: list[float] = []       # time_remaining() of each call as it arrived
        self.metadata: list[dict[str, str]] = []
        self.server: grpc.Server | None = None

    def start(self) -> GrpcServer:
        if os.path.exists(self.path):
            os.unlink(self.path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))

        def method(fn):
            def serve(request: bytes, context: grpc.ServicerContext) -> bytes:
                self.remaining.append(context.time_remaining())
                self.metadata.append(dict(context.invocation_metadata()))
                return fn(request, context)
            return grpc.unary_unary_rpc_method_handler(serve)

        def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
            code, message = request.decode().split(":", 1)
            context.abort(getattr(grpc.StatusCode, code), message)

        def fail_late(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.send_initial_metadata((("x-sent", "first"),))
            fail(request, context)

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": method(lambda req, ctx: req),
            "Size": method(lambda req, ctx: bytes(range(256)) * (int(req) // 256)
                           + b"x" * (int(req) % 256)),
            "Sleep": method(lambda req, ctx: time.sleep(float(req)) or b"slept"),
            "Fail": method(fail),
            "FailLate": method(fail_late),
        }),))
        server.add_insecure_port(self.endpoint)
        server.start()
        self.server = server
        return self

    def stop(self, grace: float | None = None) -> None:
        if self.server is not None:
            self.server.stop(grace).wait()
            self.server = None


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="kiamfast-cri-transport-") as d:
        yield d


@pytest.fixture
def server(sock_dir):
    s = GrpcServer(os.path.join(sock_dir, "grpc.sock")).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def channel(server):
    c = UnixChannel(server.endpoint)
    try:
        yield c
    finally:
        c.close()


def call(channel: UnixChannel, method: str, request: bytes = b"", timeout: float = 5.0) -> bytes:
    return channel.unary(f"/{SERVICE}/{method}", request, timeout=timeout)


# -- answers ----------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 16_385, WINDOW + 1, 3 * WINDOW + 7, 40 * 2**20],
                         ids=["empty", "one", "over-a-frame", "over-the-window",
                              "3-windows", "40MiB"])
def test_answers_of_any_size_arrive_whole(channel, size):
    """Beyond the 1 MiB window only WINDOW_UPDATEs let the server go on sending."""
    expected = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert call(channel, "Size", str(size).encode(), timeout=30) == expected
    assert call(channel, "Echo", b"after") == b"after"   # the connection is still good
    assert channel.dials == 1


def test_an_answer_over_the_limit_is_resource_exhausted(channel, monkeypatch):
    from kiamfast.control.cri import transport
    monkeypatch.setattr(transport, "MAX_MESSAGE", 100_000)
    with pytest.raises(GrpcError) as raised:
        call(channel, "Size", b"200000")
    assert raised.value.code is StatusCode.RESOURCE_EXHAUSTED
    assert call(channel, "Echo", b"next") == b"next"


def test_the_request_reaches_the_server_with_grpc_headers(server, channel):
    payload = bytes(range(256)) * 10
    assert call(channel, "Echo", payload) == payload
    assert server.metadata[-1]["user-agent"].startswith("kiamfast-cri")


# -- deadlines --------------------------------------------------------------------------

def test_the_deadline_is_sent_to_the_server(server, channel):
    call(channel, "Echo", b"x", timeout=3.0)
    assert 2.0 < server.remaining[-1] <= 3.0


def test_a_slow_answer_is_deadline_exceeded_at_the_clients_deadline(server, channel):
    started = time.monotonic()
    with pytest.raises(GrpcError) as raised:
        call(channel, "Sleep", b"2", timeout=0.3)
    took = time.monotonic() - started
    # grpcio's server may itself end the call at the deadline it was sent; either way the
    # caller gets DEADLINE_EXCEEDED at its own deadline, not the server's 2 s
    assert raised.value.code is StatusCode.DEADLINE_EXCEEDED and took < 1.0, took
    assert call(channel, "Echo", b"next") == b"next"


def test_the_local_timer_ends_a_call_to_a_server_that_never_answers(sock_dir):
    path = os.path.join(sock_dir, "silent.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(4)           # accepted by the kernel, never read, never answered
        channel = UnixChannel("unix://" + path)
        started = time.monotonic()
        with pytest.raises(GrpcError) as raised:
            channel.unary("/x.Y/Z", b"", timeout=0.3)
        assert raised.value.code is StatusCode.DEADLINE_EXCEEDED
        assert 0.25 < time.monotonic() - started < 1.0


@pytest.mark.parametrize("seconds, header", [(2.0, "2000000u"), (0.0005, "500000n"),
                                             (150.0, "150000m"), (0.0, "1n"),
                                             (10**9, "277777H")])
def test_grpc_timeout_header_fits_eight_digits(seconds, header):
    assert grpc_timeout(seconds) == header


# -- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["Fail", "FailLate"], ids=["trailers-only", "trailers"])
@pytest.mark.parametrize("code", ["NOT_FOUND", "UNAVAILABLE", "INTERNAL", "PERMISSION_DENIED",
                                  "DEADLINE_EXCEEDED", "UNKNOWN"])
def test_status_code_and_message_reach_the_caller(channel, method, code):
    message = "sandbox a%b: naïve — not found\tyet"   # grpc percent-encodes it on the wire
    with pytest.raises(GrpcError) as raised:
        call(channel, method, f"{code}:{message}".encode())
    assert (raised.value.code, raised.value.message) == (StatusCode[code], message)
    assert call(channel, "Echo", b"same connection") == b"same connection"
    assert channel.dials == 1   # an error status is an answer: the connection stays


def test_an_unknown_method_is_unimplemented(channel):
    with pytest.raises(GrpcError) as raised:
        channel.unary("/runtime.v1.RuntimeService/NoSuchMethod", b"", timeout=2)
    assert raised.value.code is StatusCode.UNIMPLEMENTED


def test_a_missing_socket_is_unavailable_naming_it(sock_dir):
    path = os.path.join(sock_dir, "nothing.sock")
    with pytest.raises(GrpcError) as raised:
        UnixChannel("unix://" + path).unary("/x.Y/Z", b"", timeout=1)
    assert raised.value.code is StatusCode.UNAVAILABLE and path in raised.value.message


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:10010", "127.0.0.1:10010",
                                      "dns:///runtime:10010", "unix://", "npipe:////./pipe/x"])
def test_endpoints_other_than_unix_sockets_are_refused(endpoint):
    with pytest.raises(ValueError, match="only unix:// sockets"):
        UnixChannel(endpoint)
    with pytest.raises(ValueError, match="only unix:// sockets"):
        RuntimeClient(endpoint)


def test_unix_endpoints_name_their_socket():
    assert unix_socket_path("unix:///run/containerd/containerd.sock") == \
        "/run/containerd/containerd.sock"
    assert unix_socket_path("unix:relative/cri.sock") == "relative/cri.sock"


# -- many threads, one channel --------------------------------------------------------------

def test_concurrent_calls_each_get_their_own_answer(server, channel):
    """8 threads at once, as the poll's status calls: every answer is its own request's."""
    def worker(n: int) -> list[bool]:
        results = []
        for i in range(60):
            payload = f"{n}:{i}:".encode() * (1 + i % 50)
            results.append(call(channel, "Echo", payload) == payload)
        return results

    with futures.ThreadPoolExecutor(8) as pool:
        outcomes = [ok for results in pool.map(worker, range(8)) for ok in results]
    assert outcomes == [True] * 480
    assert 1 <= channel.dials <= 8   # at most one connection per thread at once


def test_concurrent_slow_calls_run_in_parallel(server, channel):
    with futures.ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        answers = list(pool.map(lambda _: call(channel, "Sleep", b"0.3"), range(8)))
        took = time.monotonic() - started
    assert answers == [b"slept"] * 8 and took < 1.5, took   # one at a time: 2.4 s


# -- a server that goes away ------------------------------------------------------------------

def test_a_restarted_server_is_reached_again_without_an_error(server, channel):
    assert call(channel, "Echo", b"1") == b"1"
    server.stop()
    server.start()                   # a new socket at the same path: the old connection is dead
    assert call(channel, "Echo", b"2") == b"2"
    assert channel.dials == 2


def test_a_stopped_server_is_unavailable_and_reached_once_it_is_back(server, channel):
    assert call(channel, "Echo", b"1") == b"1"
    server.stop()
    with pytest.raises(GrpcError) as raised:
        call(channel, "Echo", b"2")
    assert raised.value.code is StatusCode.UNAVAILABLE
    server.start()
    assert call(channel, "Echo", b"3") == b"3"


def test_a_graceful_shutdown_during_a_call_ends_it_unavailable_at_once(server, channel):
    """grpcio's graceful stop sends GOAWAY and would finish the call; h2 accepts no frame
    after a GOAWAY (python-hyper/h2 #1181), so the call is tried again on a new connection
    and finds the runtime gone: UNAVAILABLE, at once, not at the deadline."""
    assert call(channel, "Echo", b"warm") == b"warm"
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(_outcome(channel, "Sleep", b"0.5")))
    caller.start()
    time.sleep(0.1)
    started = time.monotonic()
    server.stop(grace=3.0)
    caller.join()
    assert isinstance(outcome[0], GrpcError) and outcome[0].code is StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 2.0
    server.start()
    assert call(channel, "Echo", b"back") == b"back"


def _outcome(channel: UnixChannel, method: str, request: bytes) -> object:
    try:
        return call(channel, method, request, timeout=5)
    except GrpcError as exc:
        return exc


def test_close_drops_idle_connections_and_the_next_call_dials(server, channel):
    call(channel, "Echo", b"1")
    channel.close()
    assert call(channel, "Echo", b"2") == b"2" and channel.dials == 2


# -- what real servers do not send on demand: an HTTP/2 server on h2 ---------------------------

class H2Server:
    """Accepts connections on a unix socket and answers each request with `answer(conn_no,
    h2conn, stream_id)`, which sends whatever frames the test wants."""

    def __init__(self, path: str, answer) -> None:
        self.path, self.answer = path, answer
        self.connections = 0
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(path)
        self.listener.listen(8)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock, self.connections),
                             daemon=True).start()

    def _serve(self, sock: socket.socket, number: int) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        with sock:
            try:
                sock.sendall(conn.data_to_send())
                while data := sock.recv(65536):
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.StreamEnded):
                            if self.answer(number, conn, event.stream_id) == "close":
                                return
                    sock.sendall(conn.data_to_send())
            except (OSError, h2.exceptions.ProtocolError):   # the client hung up, or we closed
                return

    def close(self) -> None:
        self.listener.close()


GRPC_OK = [(":status", "200"), ("content-type", "application/grpc")]


def send_answer(conn, stream_id: int, message: bytes) -> None:
    conn.send_headers(stream_id, GRPC_OK)
    conn.send_data(stream_id, b"\x00" + len(message).to_bytes(4, "big") + message)
    conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)


@pytest.fixture
def h2_server(sock_dir):
    servers = []

    def make(answer) -> tuple[H2Server, UnixChannel]:
        servers.append(H2Server(os.path.join(sock_dir, f"h2-{len(servers)}.sock"), answer))
        return servers[-1], UnixChannel("unix://" + servers[-1].path)

    yield make
    for s in servers:
        s.close()


def test_goaway_before_the_answer_is_retried_on_a_new_connection(h2_server):
    def answer(number, conn, stream_id):
        if number == 1:   # the first connection is going away without serving the call
            conn.close_connection(last_stream_id=0)
        else:
            send_answer(conn, stream_id, b"from the second")

    server, channel = h2_server(answer)
    assert channel.unary("/x.Y/Z", b"", timeout=2) == b"from the second"
    assert server.connections == 2


def test_a_connection_closed_before_the_answer_is_retried_once(h2_server):
    def answer(number, conn, stream_id):
        if number < 3:
            return "close"

    server, channel = h2_server(answer)
    with pytest.raises(GrpcError) as raised:
        channel.unary("/x.Y/Z", b"", timeout=2)
    assert raised.value.code is StatusCode.UNAVAILABLE and server.connections == 2


@pytest.mark.parametrize("error, code", [
    (h2.errors.ErrorCodes.REFUSED_STREAM, StatusCode.UNAVAILABLE),
    (h2.errors.ErrorCodes.CANCEL, StatusCode.CANCELLED),
    (h2.errors.ErrorCodes.INTERNAL_ERROR, StatusCode.INTERNAL),
])
def test_a_reset_stream_is_an_error_with_grpcs_code(h2_server, error, code):
    server, channel = h2_server(lambda number, conn, stream_id:
                                conn.reset_stream(stream_id, error_code=error))
    with pytest.raises(GrpcError) as raised:
        channel.unary("/x.Y/Z", b"", timeout=2)
    assert raised.value.code is code


@pytest.mark.parametrize("frames, code, why", [
    ([("headers", GRPC_OK), ("data", b"\x00\x00\x00\x00\x01A"), ("end", [])],
     StatusCode.INTERNAL, "without grpc-status"),
    ([("headers", [(":status", "503")]), ("end", [("grpc-status", "0")])],
     StatusCode.UNAVAILABLE, "HTTP status 503"),
    ([("headers", [(":status", "200"), ("content-type", "text/html")]),
      ("end", [("grpc-status", "0")])], StatusCode.UNKNOWN, "content-type"),
    ([("headers", GRPC_OK), ("data", b"\x01\x00\x00\x00\x01A"), ("end", [("grpc-status", "0")])],
     StatusCode.INTERNAL, "compressed"),
    ([("headers", GRPC_OK), ("data", b"\x00\x00\x00\x00\x01AB"), ("end", [("grpc-status", "0")])],
     StatusCode.INTERNAL, "not exactly one message"),
    ([("headers", GRPC_OK), ("end", [("grpc-status", "0")])],
     StatusCode.INTERNAL, "no message"),
    ([("headers", GRPC_OK), ("end", [("grpc-status", "99"), ("grpc-message", "odd")])],
     StatusCode.UNKNOWN, "odd"),
], ids=["no-grpc-status", "http-503", "not-grpc", "compressed", "two-messages",
        "no-message", "unknown-code"])
def test_malformed_answers_are_errors_with_a_code(h2_server, frames, code, why):
    def answer(number, conn, stream_id):
        for kind, value in frames:
            if kind == "headers":
                conn.send_headers(stream_id, value)
            elif kind == "data":
                conn.send_data(stream_id, value)
            elif value:
                conn.send_headers(stream_id, value, end_stream=True)
            else:
                conn.end_stream(stream_id)

    server, channel = h2_server(answer)
    with pytest.raises(GrpcError, match=why) as raised:
        channel.unary("/x.Y/Z", b"", timeout=2)
    assert raised.value.code is code


def test_a_peer_that_does_not_speak_http2_is_unavailable(sock_dir):
    path = os.path.join(sock_dir, "http1.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(4)

        def serve() -> None:
            for _ in range(2):   # the call and its second try
                conn, _ = listener.accept()
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        threading.Thread(target=serve, daemon=True).start()
        with pytest.raises(GrpcError) as raised:
            UnixChannel("unix://" + path).unary("/x.Y/Z", b"", timeout=2)
    # an HTTP/2 protocol error, or a broken pipe when the peer closed first
    assert raised.value.code is StatusCode.UNAVAILABLE
