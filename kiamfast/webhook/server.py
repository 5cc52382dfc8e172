"""The webhook's HTTPS server: the stdlib's threaded server over TLS, bounded against any pod
that reaches its Service, so that the API server's calls are still answered.

The API server calls it for pod creations and sends each review whole at once, so a thread
per connection is enough; what any pod can do to it is bounded:

* at most `MAX_CONNECTIONS` connections; a newcomer beyond them closes one that waits for a
  request's bytes (in its handshake, idle, or sending slowly; never one being answered, and
  one whose whole head has come and whose body is there unread only when no other waits):
  of the address holding the most slots, the one waiting longest;
* a whole-request deadline: the TLS handshake and the first request within
  `REQUEST_DEADLINE` of the accept, each later request within it of its first byte (a
  sender of a byte a second is cut there, whatever its reads do), an idle keep-alive
  connection closed after `IDLE_TIMEOUT`;
* a request head of at most `HEAD_LIMIT` bytes (431 beyond);
* memory: bodies over `limits.MAX_REVIEW_BYTES` refused (413) by their Content-Length, and
  every body held, parsed and answered within the byte budgets of `limits.py` (429 with
  ``Retry-After`` when they are full: the API server's client waits and retries within its
  timeout; a review whose answer could never fit is admitted unpatched, its ``warnings``
  saying why).

A refused call fails open at the API server (the chart's ``failurePolicy: Ignore``): the pod
is created uninjected and uses IMDS by address; the agent's Event
(``ContainerCredentialsNotInjected``) says so on the pod.  A renewed serving certificate
(`tls.py`) is picked up by the next connection.
"""
from __future__ import annotations

import array
import fcntl
import io
import json
import logging
import socket
import ssl
import sys
import termios
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiamfast.webhook import limits
from kiamfast.webhook.admission import answer, answer_cost, parse, unpatched
from kiamfast.webhook.tls import ServingCertificate

log = logging.getLogger("kiamfast.webhook")

MAX_REVIEW_BYTES = limits.MAX_REVIEW_BYTES
MAX_CONNECTIONS = 64
REQUEST_DEADLINE = 5.0          # the chart's timeoutSeconds: later, the API server gave up
IDLE_TIMEOUT = 10.0             # a keep-alive connection between requests
WRITE_TIMEOUT = 5.0
HEAD_LIMIT = 32 << 10           # the API server's head is ~300 bytes
ADMIT_WAIT = 1.0                # a newcomer waits this long for an evicted slot
RETRY_AFTER = "1"
LOG_EVERY = 10.0


class HeadTooLarge(Exception):
    """The request line and headers exceed `HEAD_LIMIT`."""


class _RequestReader(io.RawIOBase):
    """The connection's bytes, each read bounded by the current request's deadline (a socket
    timeout bounds one whole call since Python 3.5, so setting the time left before each read
    makes the deadline the request's, not the read's) and its head by `HEAD_LIMIT`."""

    def __init__(self, sock: ssl.SSLSocket, deadline: float) -> None:
        self.sock = sock
        self.deadline: float | None = deadline     # None: idle, waiting for a request
        self.head_left: int | None = HEAD_LIMIT    # None: reading the body
        self.requests = 0

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        if self.requests:                   # the first one's deadline runs from the accept
            self.deadline = None
        self.head_left = HEAD_LIMIT
        self.requests += 1

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)
        if self.head_left is not None:
            if self.head_left <= 0:
                raise HeadTooLarge(f"request head over {HEAD_LIMIT} bytes")
            view = view[:self.head_left]
        left = IDLE_TIMEOUT if self.deadline is None else self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not received within {REQUEST_DEADLINE:g} s")
        self.sock.settimeout(left)
        n = self.sock.recv_into(view)
        if n and self.deadline is None:
            self.deadline = time.monotonic() + REQUEST_DEADLINE
        if self.head_left is not None:
            self.head_left -= n
        return n


class _Writer(io.BufferedIOBase):
    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sock.settimeout(WRITE_TIMEOUT)     # a client that never reads is let go
        self.sock.sendall(data)
        return len(data)


class _Handler(BaseHTTPRequestHandler):
    server_version = "kiamfast-webhook"
    settings: dict[str, Any] = {}
    server: "_BoundedServer"

    def setup(self) -> None:
        self.connection = self.request
        deadline = time.monotonic() + REQUEST_DEADLINE
        self.connection.settimeout(REQUEST_DEADLINE)
        self.connection.do_handshake()          # the whole handshake within the deadline
        self.reader = _RequestReader(self.connection, deadline)
        self.rfile = io.BufferedReader(self.reader)
        self.wfile = _Writer(self.connection)

    def handle_one_request(self) -> None:
        self.reader.next_request()
        self.request_version, self.requestline, self.command = "HTTP/1.1", "", ""
        try:
            super().handle_one_request()
        except HeadTooLarge as e:
            self.server.refusals.note("431", str(e), self.client_address)
            self._refuse(431, f"{e}\n", drain=MAX_REVIEW_BYTES)
        if not self.close_connection:
            self.server.connections.waiting(self.request)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/mutate":
            self.close_connection = True        # its body, if any, is not read
            self._send(404, b"not found\n", "text/plain")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0 or self.headers.get("Transfer-Encoding"):
            self._refuse(411, "Content-Length required\n", drain=0)
            return
        if length > MAX_REVIEW_BYTES:
            self.server.refusals.note("413", f"a review of {length} bytes, over "
                                      f"{MAX_REVIEW_BYTES}", self.client_address)
            self._refuse(413, "review too large\n", drain=length)
            return
        self.server.connections.head_received(self.request)
        held = length if length > limits.SMALL_BODY else 0
        if held and not self.server.bodies.reserve(held, timeout=limits.BUDGET_WAIT):
            self.server.refusals.note("429", "bodies being received at their budget",
                                      self.client_address)
            self._refuse(429, "busy, try again\n", drain=length, retry_after=True)
            return
        try:
            self._review(length)
        finally:
            if held:
                self.server.bodies.release(held)

    def _review(self, length: int) -> None:
        self.reader.head_left = None
        body = self.rfile.read(length)
        if len(body) < length:                  # the client went away, or was evicted
            self.close_connection = True
            return
        self.server.connections.answering(self.request)
        cost = limits.parse_cost(body)
        parsed = self.server.parsed
        if not parsed.fits(cost):
            self.server.refusals.note("413", f"a review of {length} bytes would take {cost} "
                                      "bytes to parse", self.client_address)
            self._refuse(413, "review too large to parse\n", drain=0)
            return
        if not parsed.reserve(cost, timeout=limits.BUDGET_WAIT):
            self.server.refusals.note("429", "reviews being parsed at their budget",
                                      self.client_address)
            self._refuse(429, "busy, try again\n", drain=0, retry_after=True)
            return
        try:
            review = parse(body)
            del body
            # What building the answer takes, reserved before it is built (a review of many
            # empty containers parses cheaply and patches dearly).
            containers, extra = answer_cost(review, **self.settings)
            if not parsed.fits(cost + extra):
                warning = (f"kiamfast: not injected: patching {containers} containers would "
                           f"take {extra >> 20} MiB, over the webhook's budget")
                self.server.refusals.note("too costly to answer", warning, self.client_address)
                self._send(200, json.dumps(unpatched(review, warning)).encode(),
                           "application/json")
                return
            if not parsed.reserve(extra, timeout=limits.BUDGET_WAIT, held=cost):
                self.server.refusals.note("429", "answers being built at their budget",
                                          self.client_address)
                self._refuse(429, "busy, try again\n", drain=0, retry_after=True)
                return
            cost += extra
            out = json.dumps(answer(review, **self.settings)).encode()
            del review
            self._send(200, out, "application/json")
        finally:
            parsed.release(cost)

    def _refuse(self, status: int, text: str, *, drain: int,
                retry_after: bool = False) -> None:
        """Answer ``status`` and close; first read and drop up to ``drain`` bytes of the
        body (64 KiB at a time, within the deadline), so that closing with unread bytes
        does not reset the connection before the client has read the answer."""
        self.close_connection = True
        headers = {"Connection": "close"}
        if retry_after:
            headers["Retry-After"] = RETRY_AFTER
        self._send(status, text.encode(), "text/plain", headers)
        self.reader.head_left = None
        try:
            while drain > 0:
                chunk = self.rfile.read1(min(drain, 65536))
                if not chunk:
                    break
                drain -= len(chunk)
        except OSError:
            pass

    def _send(self, status: int, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def log_error(self, format: str, *args: Any) -> None:
        """The stdlib's refusals (a bad request line, too many headers, a request that timed
        out) and errors, one line per kind every `LOG_EVERY` seconds."""
        self.server.refusals.note("bad request", format % args, self.client_address)


class _Refusals:
    """One warning line per kind of refusal every `LOG_EVERY` seconds, with the count since:
    a flood must not flood the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, kind: str, what: str, peer: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last, count = self._last.get(kind, (-LOG_EVERY, 0))
            if now - last < LOG_EVERY:
                self._last[kind] = (last, count + 1)
                return
            self._last[kind] = (now, 0)
        log.warning("refused %s from %s: %s%s (an admission call refused for good creates "
                    "its pod uninjected)", kind, peer[0] if peer else "?", what[:200],
                    f"; {count} more since the last line" if count else "")


class _Connections:
    """The connections holding a slot, their source addresses, and since when each has waited
    for a request's bytes (none while its request is being answered).  At the cap a
    newcomer closes a waiting connection of the address that holds the most slots, the one
    waiting longest: a pod that opens many connections loses its own first, and the API
    server's call, from an address of its own, is not cut by them however fast they come.

    A connection whose whole head has come and whose body is there, unread (`_unread`: in
    the socket's buffer), is the API server's call in flight, waiting for us
    (the body budget, a thread): the API server sends its body right behind its head.  It
    is closed only when no other connection waits.  Before, it counted as waiting until its
    body was read, and pods spread over more addresses than the API server holds
    connections could cut it.  A head whose body does not come, or trickles, is read as it
    comes and has nothing unread: waiting, as any slow sender."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._address: dict[Any, str] = {}
        self._waiting: dict[Any, float] = {}
        self._body: dict[Any, float] = {}       # whole head received (when), body coming
        # Closed for a newcomer, their threads not ended yet: no longer counted, so the
        # accept loop need not wait for them (at most `limit` of them).
        self._leaving: set[Any] = set()
        self._freed = threading.Condition()
        self.evicted = 0
        self._logged = -LOG_EVERY

    def _held(self) -> int:
        return len(self._address) - len(self._leaving)

    def admit(self, sock: Any, address: str) -> bool:
        with self._freed:
            if self._held() >= self.limit and len(self._leaving) < self.limit:
                self._evict()
            # Only while every slot is being answered (each within the request deadline).
            if not self._freed.wait_for(lambda: self._held() < self.limit, ADMIT_WAIT):
                return False
            self._address[sock] = address
            self._waiting[sock] = time.monotonic()
            return True

    def _evict(self) -> None:
        """Close the connection the rule picks among those not being answered: of the
        address holding the most, the one waiting longest; a call in flight (its whole
        head come, its body there unread) only when no other is left."""
        if not self._waiting and not self._body:
            return
        held: dict[str, int] = {}
        for sock, address in self._address.items():
            if sock not in self._leaving:
                held[address] = held.get(address, 0) + 1

        def rank(s: Any) -> tuple[int, int, float]:
            since = self._waiting.get(s)
            if since is None:
                since = self._body[s]
                if _unread(s):
                    return 1, 0, since
            return 0, -held[self._address[s]], since
        victim = min([*self._waiting, *self._body], key=rank)
        self._waiting.pop(victim, None)
        self._body.pop(victim, None)
        self._leaving.add(victim)
        self.evicted += 1
        try:            # the TCP socket under the TLS one: its reader wakes with EOF
            socket.socket.shutdown(victim, socket.SHUT_RDWR)
        except OSError:
            pass
        if time.monotonic() - self._logged >= LOG_EVERY:
            self._logged = time.monotonic()
            log.warning("%d connections held: closing the ones of the addresses holding the "
                        "most that wait longest for a request (%d so far; last from %s) to "
                        "take new ones", self.limit, self.evicted, self._address[victim])

    def head_received(self, sock: Any) -> None:
        with self._freed:
            if self._waiting.pop(sock, None) is not None:
                self._body[sock] = time.monotonic()

    def answering(self, sock: Any) -> None:
        with self._freed:
            self._waiting.pop(sock, None)
            self._body.pop(sock, None)

    def waiting(self, sock: Any) -> None:
        with self._freed:
            self._body.pop(sock, None)
            if sock in self._address and sock not in self._leaving:
                self._waiting[sock] = time.monotonic()

    def release(self, sock: Any) -> None:
        with self._freed:
            self._waiting.pop(sock, None)
            self._body.pop(sock, None)
            self._address.pop(sock, None)
            self._leaving.discard(sock)
            self._freed.notify()


def _unread(sock: Any) -> int:
    """Bytes the client sent that nobody has read yet, in the kernel's buffer (0 if the socket
    is gone).  Not the TLS layer's: it belongs to the thread reading it."""
    try:
        count = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
        return count[0]
    except (OSError, ValueError):
        return 0


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once (`_Connections`), every
    body within the budgets of `limits.py`."""

    daemon_threads = True
    request_queue_size = 128        # the listen backlog (the stdlib's 5 drops SYNs in a burst)

    def __init__(self, listen: tuple[str, int], handler: type, max_connections: int,
                 tls: ServingCertificate) -> None:
        super().__init__(listen, handler)
        self.connections = _Connections(max_connections)
        self.bodies = limits.ByteBudget(limits.BODY_BUDGET)
        self.parsed = limits.ByteBudget(limits.PARSE_BUDGET, small=limits.SMALL_COST,
                                        keep=limits.KEEP_FOR_SMALL)
        self.refusals = _Refusals()
        self.tls = tls

    def get_request(self) -> tuple[ssl.SSLSocket, Any]:
        sock, address = self.socket.accept()
        # The handshake runs in the request's thread, under its deadline, not in the accept
        # loop; each connection gets the certificate current when it was accepted.
        return self.tls.context().wrap_socket(sock, server_side=True,
                                              do_handshake_on_connect=False), address

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.admit(request, client_address[0] if client_address else ""):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that ended badly (a failed handshake, a reset, an eviction): one
        debug line, not the stdlib's traceback on stderr."""
        log.debug("connection from %s ended: %s", client_address[0] if client_address
                  else "?", sys.exc_info()[1])


def make_server(*, listen: tuple[str, int], cert: str, key: str, settings: dict[str, Any],
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    tls = ServingCertificate(cert, key)
    handler = type("Handler", (_Handler,), {"settings": settings})
    return _BoundedServer(listen, handler, max_connections, tls)
