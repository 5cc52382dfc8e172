"""Unary gRPC calls over HTTP/2 on a unix socket, without grpcio.

The container runtime's socket is local and the agent makes a handful of small read-only
calls (docs/architecture.md, "Who owns an address"), so this is the smallest client that
is still correct: `h2` is the HTTP/2 state machine (framing, HPACK, flow control, header
validation), the socket is ours, and each connection carries one call at a time. A
`UnixChannel` keeps the idle connections and dials another one when every connection is
busy, so the poll's 8 concurrent PodSandboxStatus calls run on up to 8 connections, each
owned by one thread for the length of its call: no state is shared between threads but the
idle list.

Per call (gRPC's HTTP/2 protocol, PROTOCOL-HTTP2.md in the grpc repository):
* the request: HEADERS (POST, :path /<service>/<method>, content-type application/grpc,
  te: trailers, grpc-timeout) and one length-prefixed message, END_STREAM;
* the deadline is sent as grpc-timeout and kept locally too: every wait on the socket is
  bounded by what is left of it (DEADLINE_EXCEEDED, the connection is dropped);
* the answer: HEADERS (:status 200), DATA with one length-prefixed message, and trailers
  with grpc-status / grpc-message (or a trailers-only answer for an error); every DATA
  frame is acknowledged, so h2 sends WINDOW_UPDATEs and an answer of any size (up to
  MAX_MESSAGE) flows;
* a non-zero grpc-status, an HTTP error, a reset stream, a malformed answer or a transport
  failure is a `GrpcError` carrying the gRPC status code (UNAVAILABLE for a transport
  failure, as grpc does).

Connections: a connection that failed, timed out or received GOAWAY is closed and never
used again. An idle connection is checked before it is reused (a restarted runtime closed
it, or sent GOAWAY), and a call whose connection fails before the answer is complete
(closed, reset, GOAWAY) is tried once more on a new connection within its deadline: every
call this client makes is a read, safe to repeat. h2 refuses every frame after a GOAWAY
(python-hyper/h2 #1181), so a call in flight when the runtime shuts down gracefully is
not finished on the old connection: its second try finds the runtime gone (UNAVAILABLE)
or, if it only closed that connection, answers on a new one.
"""
from __future__ import annotations

import enum
import socket
import struct
import threading
import time
import urllib.parse

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

MAX_MESSAGE = 64 * 1024 * 1024    # the largest answer accepted (as the grpcio client was set)
# The receive windows offered to the runtime (HTTP/2's default is 64 KiB): a ListPodSandbox
# of hundreds of sandboxes then flows with a WINDOW_UPDATE every 512 KiB, not every 32 KiB.
WINDOW = 1024 * 1024
_USER_AGENT = "kiamfast-cri"


class StatusCode(enum.IntEnum):
    """gRPC status codes (grpc/status.proto)."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GrpcError(Exception):
    """A call that gave no answer: the status code and what the runtime or transport said."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class _ConnectionFailed(GrpcError):
    """UNAVAILABLE because the connection failed (closed, reset, GOAWAY, HTTP/2 protocol
    error) before the answer was complete: worth one more try on a new connection."""

    def __init__(self, message: str) -> None:
        super().__init__(StatusCode.UNAVAILABLE, message)


class _RuntimeStatus(GrpcError):
    """A non-OK grpc-status the runtime sent: the connection is fine and stays in use."""


# HTTP status -> gRPC code when a proxy or a non-gRPC server answers (http-grpc-status-mapping)
_HTTP_TO_GRPC = {400: StatusCode.INTERNAL, 401: StatusCode.UNAUTHENTICATED,
                 403: StatusCode.PERMISSION_DENIED, 404: StatusCode.UNIMPLEMENTED,
                 429: StatusCode.UNAVAILABLE, 502: StatusCode.UNAVAILABLE,
                 503: StatusCode.UNAVAILABLE, 504: StatusCode.UNAVAILABLE}
# RST_STREAM error code -> gRPC code (PROTOCOL-HTTP2.md, "Errors")
_RESET_TO_GRPC = {h2.errors.ErrorCodes.REFUSED_STREAM: StatusCode.UNAVAILABLE,
                  h2.errors.ErrorCodes.CANCEL: StatusCode.CANCELLED,
                  h2.errors.ErrorCodes.ENHANCE_YOUR_CALM: StatusCode.RESOURCE_EXHAUSTED,
                  h2.errors.ErrorCodes.INADEQUATE_SECURITY: StatusCode.PERMISSION_DENIED}


def unix_socket_path(endpoint: str) -> str:
    """The socket path of a `unix://` endpoint (`unix:///abs/path` or `unix:rel/path`);
    anything else is refused with ValueError."""
    prefix = "unix://" if endpoint.startswith("unix://") else "unix:"
    if endpoint.startswith(prefix) and endpoint[len(prefix):]:
        return endpoint[len(prefix):]
    raise ValueError(f"CRI endpoint {endpoint!r}: only unix:// sockets are supported "
                     "(the container runtime's socket on the node)")


def grpc_timeout(seconds: float) -> str:
    """The grpc-timeout header: at most 8 digits, in the finest unit that fits."""
    for unit, per_second in (("n", 10**9), ("u", 10**6), ("m", 10**3), ("S", 1)):
        value = max(1, int(seconds * per_second))   # never 0: a deadline already past
        if value < 10**8:
            return f"{value}{unit}"
    return f"{min(10**8 - 1, int(seconds / 3600))}H"


class _Connection:
    """One HTTP/2 connection, one call at a time, used by one thread at a time."""

    def __init__(self, path: str, deadline: float) -> None:
        self.usable = True
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            self.sock.connect(path)
        except socket.timeout:
            self.sock.close()
            raise GrpcError(StatusCode.DEADLINE_EXCEEDED, f"connect {path}: timed out") from None
        except OSError as exc:
            self.sock.close()
            raise GrpcError(StatusCode.UNAVAILABLE, f"connect {path}: {exc}") from None
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding="utf-8"))
        # in force from the first frame on (h2 applies later changes only once acked)
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            **self.h2.local_settings, h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
            h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(WINDOW - 65535)   # the connection's window
        try:
            self._flush(deadline)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.usable = False
        self.sock.close()

    def alive(self) -> bool:
        """False if the runtime closed this idle connection or sent GOAWAY meanwhile (frames
        it sent since the last call, a PING or SETTINGS, are read and answered here)."""
        self.sock.setblocking(False)   # every other use sets its own timeout
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except BlockingIOError:
                    break   # nothing more was sent
                if not data:
                    return False
                for event in self.h2.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return False
            pending = self.h2.data_to_send()   # a PING ack, a SETTINGS ack
            if pending:
                self.sock.sendall(pending)
            return True
        except (OSError, h2.exceptions.H2Error):
            return False

    def call(self, path: str, message: bytes, deadline: float) -> bytes:
        """The answer's message bytes, or GrpcError (the connection is then closed unless
        the error is the runtime's own grpc-status)."""
        try:
            return self._call(path, message, deadline)
        except _RuntimeStatus:
            raise
        except (h2.exceptions.H2Error, UnicodeError) as exc:   # the runtime broke HTTP/2
            self.close()
            raise _ConnectionFailed(f"HTTP/2 protocol error: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _call(self, path: str, message: bytes, deadline: float) -> bytes:
        stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream, [
            (":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", "localhost"), ("te", "trailers"),
            ("content-type", "application/grpc"), ("user-agent", _USER_AGENT),
            ("grpc-timeout", grpc_timeout(deadline - time.monotonic()))])
        body = struct.pack(">BI", 0, len(message)) + message
        if len(body) > self.h2.local_flow_control_window(stream):
            raise GrpcError(StatusCode.INTERNAL, f"request of {len(body)} bytes exceeds the "
                            "runtime's flow-control window")   # never for CRI's small requests
        self.h2.send_data(stream, body, end_stream=True)
        self._flush(deadline)
        headers: dict[str, str] | None = None
        goaway = ""
        trailers: dict[str, str] = {}
        data = bytearray()
        ended = False
        while not ended:
            events = self.h2.receive_data(self._recv(deadline))
            for event in events:
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.usable = False   # and h2 accepts no frame after it
                    goaway = f"runtime sent GOAWAY ({event.error_code!r})"
                if getattr(event, "stream_id", stream) != stream:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    headers = dict(event.headers)
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    if len(data) > MAX_MESSAGE + 5:
                        raise GrpcError(StatusCode.RESOURCE_EXHAUSTED,
                                        f"answer larger than {MAX_MESSAGE} bytes")
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamReset):
                    code = _RESET_TO_GRPC.get(event.error_code, StatusCode.INTERNAL)
                    raise GrpcError(code, f"stream reset by the runtime ({event.error_code})")
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            if not self.usable and not ended:
                raise _ConnectionFailed(goaway)
            self._flush(deadline)   # WINDOW_UPDATEs, SETTINGS and PING acks
        return _answer(headers or {}, trailers, bytes(data))

    def _recv(self, deadline: float) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GrpcError(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            raise GrpcError(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except OSError as exc:
            raise _ConnectionFailed(f"connection lost: {exc}") from None
        if not data:
            raise _ConnectionFailed("connection closed by the runtime")
        return data

    def _flush(self, deadline: float) -> None:
        pending = self.h2.data_to_send()
        if not pending:
            return
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self.sock.sendall(pending)
        except socket.timeout:
            raise GrpcError(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except OSError as exc:
            raise _ConnectionFailed(f"send: {exc}") from None


def _answer(headers: dict[str, str], trailers: dict[str, str], data: bytes) -> bytes:
    """The one message of a finished unary answer, or the GrpcError it carries."""
    http_status = headers.get(":status", "")
    if http_status != "200":
        code = _HTTP_TO_GRPC.get(int(http_status) if http_status.isdigit() else 0,
                                 StatusCode.UNKNOWN)
        raise GrpcError(code, f"HTTP status {http_status or 'missing'}")
    if not headers.get("content-type", "").startswith("application/grpc"):
        raise GrpcError(StatusCode.UNKNOWN, f"content-type {headers.get('content-type')!r}")
    status = trailers or headers   # an error may come as a trailers-only answer
    raw_code = status.get("grpc-status")
    if raw_code is None:
        raise GrpcError(StatusCode.INTERNAL, "answer ended without grpc-status")
    try:
        code = StatusCode(int(raw_code))
    except ValueError:
        code = StatusCode.UNKNOWN
    if code is not StatusCode.OK:
        raise _RuntimeStatus(code, urllib.parse.unquote(status.get("grpc-message", "")))
    if len(data) < 5:
        raise GrpcError(StatusCode.INTERNAL, f"answer of {len(data)} bytes has no message")
    compressed, size = struct.unpack_from(">BI", data)
    if compressed:
        raise GrpcError(StatusCode.INTERNAL, "compressed answer (none was negotiated)")
    if size != len(data) - 5:
        raise GrpcError(StatusCode.INTERNAL, f"answer announces {size} bytes and carries "
                        f"{len(data) - 5}: not exactly one message")
    return data[5:]


class UnixChannel:
    """Unary gRPC calls to one unix socket, from any number of threads at once."""

    def __init__(self, endpoint: str, *, max_idle: int = 8) -> None:
        self.endpoint = endpoint
        self.path = unix_socket_path(endpoint)
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._generation = 0   # close() makes every connection older than it one to drop
        self.dials = 0

    def unary(self, method: str, request: bytes, *, timeout: float) -> bytes:
        """Call /<service>/<method> (e.g. "/runtime.v1.RuntimeService/Version") with the
        request's message bytes; the answer's message bytes, or GrpcError."""
        deadline = time.monotonic() + timeout
        conn, generation = self._take()
        try:
            if conn is None:
                conn = self._dial(deadline)
            try:
                answer = conn.call(method, request, deadline)
            except _ConnectionFailed:
                if time.monotonic() >= deadline:
                    raise
                conn = self._dial(deadline)   # once more, on a new connection
                answer = conn.call(method, request, deadline)
        except _RuntimeStatus:
            self._give_back(conn, generation)
            raise
        self._give_back(conn, generation)
        return answer

    def _take(self) -> tuple[_Connection | None, int]:
        """An idle connection that is still alive, or None (dial one)."""
        while True:
            with self._lock:
                generation = self._generation
                if not self._idle:
                    return None, generation
                conn = self._idle.pop()
            if conn.alive():
                return conn, generation
            conn.close()

    def _dial(self, deadline: float) -> _Connection:
        self.dials += 1
        return _Connection(self.path, deadline)

    def _give_back(self, conn: _Connection, generation: int) -> None:
        with self._lock:
            if conn.usable and generation == self._generation \
                    and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections now, the busy ones when their calls end."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
        for conn in idle:
            conn.close()
