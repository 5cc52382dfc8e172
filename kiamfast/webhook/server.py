"""The webhook's HTTPS server: the stdlib's threaded server over TLS, bounded against any pod
that reaches its Service.

The API server calls it rarely (pod creations), so a thread per connection is enough; at most
`MAX_CONNECTIONS` at once, bodies over `MAX_REVIEW_BYTES` refused unread, `READ_TIMEOUT` per
read (the TLS handshake included, in the connection's own thread).  A renewed serving
certificate (`tls.py`) is picked up by the next connection.
"""
from __future__ import annotations

import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiamfast.webhook.review import review_answer
from kiamfast.webhook.tls import ServingCertificate

log = logging.getLogger("kiamfast.webhook")

MAX_REVIEW_BYTES = 4 << 20      # a pod is at most etcd's 1.5 MiB; the review wraps it once
READ_TIMEOUT = 10.0             # per read, the TLS handshake included
MAX_CONNECTIONS = 64


class _Handler(BaseHTTPRequestHandler):
    server_version = "kiamfast-webhook"
    timeout = READ_TIMEOUT
    settings: dict[str, Any] = {}

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/mutate":
            self._send(404, b"not found\n", "text/plain")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(411, b"Content-Length required\n", "text/plain")
            return
        if not 0 <= length <= MAX_REVIEW_BYTES:
            self._send(413, b"review too large\n", "text/plain")
            return
        answer = review_answer(self.rfile.read(length), **self.settings)
        self._send(200, json.dumps(answer).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: any pod can reach the
    Service, and a flood must not grow threads without bound (beyond it: closed at once)."""

    daemon_threads = True

    def __init__(self, listen: tuple[str, int], handler: type, max_connections: int,
                 tls: ServingCertificate) -> None:
        super().__init__(listen, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.tls = tls

    def get_request(self) -> tuple[ssl.SSLSocket, Any]:
        sock, address = self.socket.accept()
        # The handshake runs in the request's thread, under its timeout, not in the accept
        # loop; each connection gets the certificate current when it was accepted.
        return self.tls.context().wrap_socket(sock, server_side=True,
                                              do_handshake_on_connect=False), address

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(*, listen: tuple[str, int], cert: str, key: str, settings: dict[str, Any],
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    tls = ServingCertificate(cert, key)
    handler = type("Handler", (_Handler,), {"settings": settings})
    return _BoundedServer(listen, handler, max_connections, tls)
