"""A fault-injecting HTTP proxy in front of the real kube-apiserver, for the one answer the
real server gives only when its own storage fails.

Plain HTTP on loopback in front of the API server's HTTPS (verified against the cluster's
CA).  Every request passes through (a watch streamed as it comes); while ``fault`` holds a
text, a TokenReview still goes to the real server, and its answer comes back with
``status`` replaced by ``{"authenticated": false, "error": fault}``: what the real server
answers when its authenticator's lookup of the token's pod or ServiceAccount fails (the
lookups read its informer cache first, so a failing storage read happens only for an
object the cache does not have yet: not something a test can bring about on demand).
"""
from __future__ import annotations

import http.client
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length",
              "proxy-connection", "upgrade", "te", "trailer"}


class ReviewFaultProxy:
    def __init__(self, *, target_port: int, ca: Path) -> None:
        self.fault: str | None = None
        self.reviews = 0          # TokenReviews that came through
        self.faulted = 0          # ... and were answered with the fault
        proxy = self
        context = ssl.create_default_context(cafile=str(ca))

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream: http.client.HTTPSConnection | None = None

            def log_message(self, *args) -> None:     # quiet
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.upstream is None:
                    self.upstream = http.client.HTTPSConnection("127.0.0.1", target_port,
                                                                context=context, timeout=300)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
                self.upstream.request(self.command, self.path, body=body, headers=headers)
                resp = self.upstream.getresponse()
                review = self.command == "POST" and self.path.split("?")[0] == REVIEWS
                if review:
                    proxy.reviews += 1
                fault = proxy.fault
                if review and fault is not None and resp.status == 201:
                    doc = json.loads(resp.read())
                    doc["status"] = {"authenticated": False, "error": fault}
                    proxy.faulted += 1
                    self._answer(resp, json.dumps(doc).encode())
                elif resp.getheader("Content-Length") is not None:
                    self._answer(resp, resp.read())
                else:                                  # a watch: streamed, chunk by chunk
                    self._head(resp, [("Transfer-Encoding", "chunked")])
                    while data := resp.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.write(b"0\r\n\r\n")

            def _head(self, resp: http.client.HTTPResponse, extra: list) -> None:
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                for k, v in extra:
                    self.send_header(k, v)
                self.end_headers()

            def _answer(self, resp: http.client.HTTPResponse, body: bytes) -> None:
                self._head(resp, [("Content-Length", str(len(body)))])
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True,
                         name="review-fault-proxy").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
