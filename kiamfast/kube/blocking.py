"""``Client.request_sync``: the same calls on http.client, for code that runs on threads
(the webhook's ServiceAccount reads). One kept-alive connection per thread; imported only
when first used, so the asyncio control process never loads http.client."""
from __future__ import annotations

import http.client
import socket
import ssl
import threading
from typing import Any, Protocol

from kiamfast.kube import wire
from kiamfast.kube.config import ClientConfig
from kiamfast.kube.errors import ApiError, ApiTimeout, ApiUnavailable
from kiamfast.kube.wire import Params, Response


class Caller(Protocol):
    """What these calls use of ``kiamfast.kube.client.Client`` (described here, so that this
    module, which the client imports, never imports it back)."""

    config: ClientConfig
    user_agent: str

    def ssl_context_now(self) -> ssl.SSLContext | None: ...

    def _error(self, status: int, reason: str, headers: dict[str, str], body: bytes,
               authorization: str | None) -> ApiError: ...

# A kept-alive connection the server had closed while idle shows as one of these before
# any byte of the answer: the request is sent again once on a new connection.  Over TLS
# the close arrives as an EOF without close_notify (SSLEOFError; seen as the token path's
# TokenReview failing once, 503 to the pod, when the API server closed an idle connection).
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          ssl.SSLEOFError, ssl.SSLZeroReturnError)


class _Connection(http.client.HTTPConnection):
    """HTTP/1.1 to the API server, through a CONNECT proxy if configured, then TLS with the
    client's context and the configured server name."""

    def __init__(self, client: Caller, timeout: float) -> None:
        cfg = client.config
        host, port = cfg.proxy or (cfg.host, cfg.port)
        super().__init__(host, port, timeout=timeout)
        if cfg.proxy is not None:
            headers = {"Proxy-Authorization": cfg.proxy_authorization} \
                if cfg.proxy_authorization else None
            self.set_tunnel(cfg.host, cfg.port, headers=headers)
        self._client = client

    def connect(self) -> None:
        super().connect()
        cfg = self._client.config
        if cfg.scheme == "https":
            context = self._client.ssl_context_now()
            assert context is not None
            self.sock = context.wrap_socket(self.sock,
                                            server_hostname=cfg.tls_server_name or cfg.host)


class Connections:
    def __init__(self, client: Caller) -> None:
        self.client = client
        self._local = threading.local()
        self._all: list[_Connection] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *, params: Params | None, body: Any,
                content_type: str, timeout: float) -> Response:
        client = self.client
        cfg = client.config
        payload = wire.encode_body(body)
        authorization = cfg.credentials.authorization()
        headers = wire.headers(host=cfg.host_header, user_agent=client.user_agent,
                               authorization=authorization, body=payload,
                               content_type=content_type)
        url = wire.target(cfg.base_path, path, params)
        while True:
            conn: _Connection | None = getattr(self._local, "conn", None)
            reused = conn is not None
            if conn is None:
                conn = self._new(timeout)
            elif conn.sock is not None:
                conn.sock.settimeout(timeout)
            conn.timeout = timeout
            try:
                conn.request(method, url, body=payload, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
            except _STALE as e:
                self._forget(conn)
                if reused:
                    continue
                raise ApiUnavailable(f"{method} to {cfg.server}: {_describe(e)}") from None
            except (socket.timeout, TimeoutError):
                self._forget(conn)
                raise ApiTimeout(f"{method} {path}: no answer from {cfg.server} in "
                                 f"{timeout:g}s") from None
            except ssl.SSLCertVerificationError as e:
                self._forget(conn)
                raise ApiUnavailable(f"TLS to {cfg.server}: {e.verify_message} (does "
                                     f"{cfg.origin} name the right certificate "
                                     "authority?)") from None
            except (OSError, http.client.HTTPException) as e:
                self._forget(conn)
                raise ApiUnavailable(f"{method} to {cfg.server}: {_describe(e)}") from None
            if answer.will_close:
                self._forget(conn)
            else:
                self._local.conn = conn
            response_headers = {k.lower(): v for k, v in answer.getheaders()}
            if not 200 <= answer.status < 300:
                raise client._error(answer.status, answer.reason, response_headers, data,
                                    authorization)
            return Response(answer.status, answer.reason, response_headers, data)

    def _new(self, timeout: float) -> _Connection:
        conn = _Connection(self.client, timeout)
        with self._lock:
            self._all.append(conn)
        self._local.conn = conn
        return conn

    def _forget(self, conn: _Connection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _describe(e: BaseException) -> str:
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
