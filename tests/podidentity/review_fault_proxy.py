"""A fault-injecting HTTP proxy in front of the real kube-apiserver, for what the real server
does only when its own storage fails or it is overloaded.

Plain HTTP on loopback in front of the API server's HTTPS (verified against the cluster's
CA).  Every request passes through (a watch streamed as it comes), but:

* while ``fault`` holds a text, a TokenReview still goes to the real server, and its answer
  comes back with ``status`` replaced by ``{"authenticated": false, "error": fault}``: what
  the real server answers when its authenticator's lookup of the token's pod or
  ServiceAccount fails (the lookups read its informer cache first, so a failing storage
  read happens only for an object the cache does not have yet: not something a test can
  bring about on demand);
* ``review_delay`` seconds are spent before each TokenReview is passed on: a slow API
  server (each review as slow, however many run at once);
* a request ``down(method, path)`` says True for is answered 503 as an API server that is
  down behind its load balancer (an open watch is ended too, by its next chunk).
"""
from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length",
              "proxy-connection", "upgrade", "te", "trailer"}


class ReviewFaultProxy:
    def __init__(self, *, target_port: int, ca: Path) -> None:
        self.fault: str | None = None
        self.review_delay = 0.0
        self.down: Callable[[str, str], bool] = lambda method, path: False
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
                if proxy.down(self.command, self.path):
                    self._unavailable()
                    return
                review = self.command == "POST" and self.path.split("?")[0] == REVIEWS
                if review and proxy.review_delay:
                    time.sleep(proxy.review_delay)
                if self.upstream is None:
                    self.upstream = http.client.HTTPSConnection("127.0.0.1", target_port,
                                                                context=context, timeout=300)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
                self.upstream.request(self.command, self.path, body=body, headers=headers)
                resp = self.upstream.getresponse()
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
                    try:
                        while data := resp.read1(65536):
                            if proxy.down(self.command, self.path):
                                raise ConnectionAbortedError("the API server went down")
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    except (http.client.HTTPException, OSError):
                        # Ended by either side (the agent's process killed, say): so is this.
                        self.close_connection = True
                        self.upstream.close()
                        self.upstream = None
                        return
                    self.wfile.write(b"0\r\n\r\n")

            def _unavailable(self) -> None:
                body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "message": "the API server is down (test proxy)",
                                   "reason": "ServiceUnavailable", "code": 503}).encode()
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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

    def kubeconfig(self, cluster, identity: Path, name: str) -> Path:
        """A kubeconfig of ``identity``'s (a kubeconfig's) token whose server is this proxy:
        the agent's own identity, its API traffic through here."""
        import yaml
        token = yaml.safe_load(identity.read_text())["users"][0]["user"]["token"]
        return cluster.kubeconfig_for(token, name=name, server=self.url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
