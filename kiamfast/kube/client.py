"""An HTTP/1.1 client for one API server, on asyncio streams over TLS.

``request`` sends one call on a kept-alive connection (a few are kept idle, each at most
``idle_seconds``) and returns the whole answer; ``stream`` opens a connection of its own
for a watch and yields its lines as they arrive (chunked transfer encoding), each read
bounded by an inactivity timeout. ``request_sync`` is the same call for threads
(``kiamfast.kube.blocking``, on http.client, imported only when used).

Errors, for the caller to tell apart (``kiamfast.kube.errors``): a non-2xx answer is an
``ApiError`` with the ``Status``'s reason and message and ``Retry-After``; no answer is
``ApiUnavailable`` (``ApiTimeout`` when a timeout ran out). Nothing here retries an API
call: callers own backoff. The one exception is transport, not API: a kept-alive connection
that the server had closed while it was idle, found when the request gets no byte back, is
replaced by a new one once.

A 401 tells the credentials (a rotated token file is re-read, an exec plugin run again on
the next call) and drops idle connections (an exec plugin's certificate may change).
"""
from __future__ import annotations

import asyncio
import ssl
import threading
import time
from types import TracebackType
from typing import Any, AsyncIterator

from kiamfast.kube import wire
from kiamfast.kube.config import ClientConfig
from kiamfast.kube.errors import ApiError, ApiTimeout, ApiUnavailable
from kiamfast.kube.tls import ssl_context
from kiamfast.kube.wire import JSON, Params, Response

__all__ = ["Client", "Response", "Stream"]

READ_LIMIT = 1 << 16        # the longest status or header line accepted
SOCKET_READ = 1 << 16


class Client:
    """One API server's client; see the module docstring. ``await client.close()``."""

    def __init__(self, config: ClientConfig, *, user_agent: str = wire.USER_AGENT,
                 max_idle: int = 4, idle_seconds: float = 30.0) -> None:
        self.config = config
        self.user_agent = user_agent
        self.max_idle = max_idle
        self.idle_seconds = idle_seconds
        self._idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._ssl_lock = threading.Lock()
        self._ssl_cert: tuple[bytes, bytes] | None = None
        self._ssl = config.ssl
        self._sync: Any = None          # kiamfast.kube.blocking.Connections, when used
        self.connections_made = 0

    # ---- calls --------------------------------------------------------------------------------

    async def request(self, method: str, path: str, *, params: Params | None = None,
                      body: Any = None, content_type: str = JSON,
                      timeout: float = 30.0) -> Response:
        """One call; the answer if 2xx, else ApiError; ApiUnavailable without an answer.
        ``body``: bytes, or an object sent as JSON. ``timeout`` bounds the whole call."""
        payload = wire.encode_body(body)
        authorization = await self._authorization()
        head = self._head(method, wire.target(self.config.base_path, path, params),
                          authorization, payload, content_type)
        try:
            async with asyncio.timeout(timeout):
                response = await self._exchange(method, head + (payload or b""))
        except TimeoutError:
            raise ApiTimeout(f"{method} {path}: no answer from {self.config.server} in "
                             f"{timeout:g}s") from None
        if not 200 <= response.status < 300:
            raise self._error(response.status, response.reason, response.headers,
                              response.body, authorization)
        return response

    def stream(self, path: str, *, params: Params | None = None,
               timeout: tuple[float, float] = (10.0, 120.0)) -> "Stream":
        """A watch: ``async with client.stream(path, params=...) as s: async for line in
        s.lines()``. ``timeout``: (connect and answer, inactivity between reads)."""
        return Stream(self, path, params, timeout)

    def request_sync(self, method: str, path: str, *, params: Params | None = None,
                     body: Any = None, content_type: str = JSON,
                     timeout: float = 30.0) -> Response:
        """``request`` for a thread, on http.client; ``timeout`` bounds each socket
        operation (connect, send, each read). Thread-safe: a connection per thread."""
        if self._sync is None:
            from kiamfast.kube.blocking import Connections
            self._sync = Connections(self)
        return self._sync.request(method, path, params=params, body=body,
                                  content_type=content_type, timeout=timeout)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, _, writer in idle:
            writer.transport.abort()
        if self._sync is not None:
            self._sync.close()

    # ---- shared with Stream and the blocking client --------------------------------------------

    async def _authorization(self) -> str | None:
        credentials = self.config.credentials
        if credentials.fresh():
            return credentials.authorization()
        return await asyncio.to_thread(credentials.authorization)   # may run a command

    def _head(self, method: str, target: str, authorization: str | None,
              payload: bytes | None, content_type: str, *, keep_alive: bool = True) -> bytes:
        lines = [f"{method} {target} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in wire.headers(
            host=self.config.host_header, user_agent=self.user_agent,
            authorization=authorization, body=payload, content_type=content_type).items()]
        if not keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _error(self, status: int, reason: str, headers: dict[str, str], body: bytes,
               authorization: str | None) -> ApiError:
        if status == 401:
            self.config.credentials.rejected(authorization)
            self._drop_idle()
        return wire.api_error(status, reason, headers, body)

    def ssl_context_now(self) -> ssl.SSLContext | None:
        """The TLS context for a new connection (rebuilt when an exec plugin's certificate
        changed). May block: run an exec plugin."""
        cert = self.config.credentials.client_cert()
        if cert is None:
            return self.config.ssl
        with self._ssl_lock:
            if cert != self._ssl_cert:
                self._ssl = ssl_context(self.config, cert)
                self._ssl_cert = cert
            return self._ssl

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        cfg = self.config
        context = None
        if cfg.scheme == "https":
            if self.config.credentials.fresh():
                context = self.ssl_context_now()
            else:
                context = await asyncio.to_thread(self.ssl_context_now)
        name = cfg.tls_server_name or cfg.host
        try:
            if cfg.proxy is None:
                reader, writer = await asyncio.open_connection(
                    cfg.host, cfg.port, ssl=context, server_hostname=name if context else None,
                    limit=READ_LIMIT)
            else:
                reader, writer = await asyncio.open_connection(*cfg.proxy, limit=READ_LIMIT)
                await self._tunnel(reader, writer)
                if context is not None:
                    await writer.start_tls(context, server_hostname=name)
        except ssl.SSLCertVerificationError as e:
            raise ApiUnavailable(f"TLS to {cfg.server}: {e.verify_message} (does "
                                 f"{cfg.origin} name the right certificate authority?)") \
                from None
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            raise ApiUnavailable(f"cannot connect to {cfg.server}: {_describe(e)}") from None
        self.connections_made += 1
        return reader, writer

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        authority = f"{host}:{cfg.port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if cfg.proxy_authorization:
            lines.append(f"Proxy-Authorization: {cfg.proxy_authorization}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        status, reason, _ = await read_head(reader)
        if status != 200:
            writer.transport.abort()
            proxy_host, proxy_port = cfg.proxy or ("", 0)
            raise ApiUnavailable(f"the proxy {proxy_host}:{proxy_port} refused CONNECT "
                                 f"to {authority}: HTTP {status} {reason}")

    # ---- kept-alive connections --------------------------------------------------------------

    async def _exchange(self, method: str, data: bytes) -> Response:
        while True:
            reused = self._take_idle()
            reader, writer = reused or await self._connect()
            got_bytes = False
            try:
                writer.write(data)
                status, reason, headers = await read_head(reader)
                got_bytes = True
                body = await read_body(reader, headers, method=method, status=status)
            except BaseException as e:
                writer.transport.abort()
                if isinstance(e, (OSError, ssl.SSLError, asyncio.IncompleteReadError,
                                  asyncio.LimitOverrunError, ValueError)):
                    if reused is not None and not got_bytes and not isinstance(e, ValueError):
                        continue        # closed by the server while idle: a new connection
                    raise ApiUnavailable(f"{method} to {self.config.server}: "
                                         f"{_describe(e)}") from None
                raise
            if _keep_alive(headers) and len(self._idle) < self.max_idle:
                self._idle.append((time.monotonic(), reader, writer))
            else:
                writer.transport.abort()
            return Response(status, reason, headers, body)

    def _take_idle(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        now = time.monotonic()
        while self._idle:
            since, reader, writer = self._idle.pop()
            if now - since < self.idle_seconds and not reader.at_eof() \
                    and not writer.transport.is_closing():
                return reader, writer
            writer.transport.abort()
        return None

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for _, _, writer in idle:
            writer.transport.abort()


class Stream:
    """One watch request on a connection of its own; see ``Client.stream``."""

    def __init__(self, client: Client, path: str, params: Params | None,
                 timeout: tuple[float, float]) -> None:
        self.client = client
        self.path = path
        self.params = params
        self.connect_timeout, self.inactivity_timeout = timeout
        self.status = 0
        self.headers: dict[str, str] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._chunked = False
        self._left: int | None = None       # bytes left of a Content-Length body
        self._closed = False

    async def __aenter__(self) -> "Stream":
        client = self.client
        authorization = await client._authorization()
        head = client._head("GET", wire.target(client.config.base_path, self.path,
                                                self.params),
                            authorization, None, JSON, keep_alive=False)
        try:
            async with asyncio.timeout(self.connect_timeout):
                self._reader, self._writer = await client._connect()
                self._writer.write(head)
                status, reason, headers = await read_head(self._reader)
                if status != 200:
                    body = await read_body(self._reader, headers, method="GET", status=status)
                    raise client._error(status, reason, headers, body, authorization)
        except TimeoutError:
            self.close()
            raise ApiTimeout(f"watch {self.path}: no answer from {client.config.server} in "
                             f"{self.connect_timeout:g}s") from None
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError) as e:
            self.close()
            raise ApiUnavailable(f"watch {self.path}: {_describe(e)}") from None
        except BaseException:
            self.close()
            raise
        self.status, self.headers = status, headers
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None
        return self

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Abort the connection; a ``lines()`` waiting on it ends without an error."""
        self._closed = True
        if self._writer is not None:
            self._writer.transport.abort()

    @property
    def closed(self) -> bool:
        return self._closed

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines (without the newline; blank lines skipped) as they arrive; a last
        line without a newline too. Ends when the server ends the body or ``close()`` is
        called; raises ApiTimeout after ``inactivity_timeout`` seconds without a byte, and
        ApiUnavailable when the connection breaks before the body's end."""
        pending: list[bytes] = []
        while True:
            data = await self._read()
            if not data:
                break
            start = 0
            while (end := data.find(b"\n", start)) >= 0:
                line = data[start:end]
                if pending:
                    line = b"".join(pending) + line
                    pending.clear()
                if line.strip():
                    yield line
                start = end + 1
            if start < len(data):
                pending.append(data[start:])
        rest = b"".join(pending)
        if rest.strip():
            yield rest

    async def _read(self) -> bytes:
        """The next piece of the body; b"" at its end or once closed."""
        reader = self._reader
        if reader is None or self._closed:
            return b""
        try:
            async with asyncio.timeout(self.inactivity_timeout):
                if self._chunked:
                    return await read_chunk(reader)
                if self._left is not None:
                    if self._left <= 0:
                        return b""
                    data = await reader.read(min(self._left, SOCKET_READ))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", self._left)
                    self._left -= len(data)
                    return data
                return await reader.read(SOCKET_READ)      # until the server closes
        except TimeoutError:
            self.close()
            raise ApiTimeout(f"watch {self.path}: nothing received for "
                             f"{self.inactivity_timeout:g}s") from None
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError) as e:
            if self._closed:
                return b""
            self.close()
            raise ApiUnavailable(f"watch {self.path}: the stream broke: {_describe(e)}") \
                from None


# ---- HTTP/1.1 framing ----------------------------------------------------------------------------

async def read_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    """Status, reason and headers (lower-case names) of a response; ValueError if the bytes
    are not HTTP/1.x, IncompleteReadError if the connection ends first. 1xx are skipped."""
    while True:
        line = await reader.readuntil(b"\r\n")
        parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP response: {line[:60]!r}")
        status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        headers: dict[str, str] = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep:
                raise ValueError(f"not an HTTP header: {line[:60]!r}")
            headers[name.strip().lower()] = value.strip()
        if status >= 200 or status == 101:
            return status, reason, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], *, method: str,
                    status: int) -> bytes:
    if method == "HEAD" or status in (204, 304):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while chunk := await read_chunk(reader):
            parts.append(chunk)
        return b"".join(parts)
    length = headers.get("content-length")
    if length is not None:
        return await reader.readexactly(int(length))
    return await reader.read()              # the body ends when the server closes


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk's data; b"" for the last chunk (its trailers are read and dropped)."""
    size_line = await reader.readuntil(b"\r\n")
    size = int(size_line.split(b";", 1)[0].strip(), 16)
    if size == 0:
        while await reader.readuntil(b"\r\n") != b"\r\n":
            pass
        return b""
    data = await reader.readexactly(size)
    if await reader.readexactly(2) != b"\r\n":
        raise ValueError("a chunk does not end with CRLF")
    return data


def _keep_alive(headers: dict[str, str]) -> bool:
    if "close" in headers.get("connection", "").lower():
        return False
    return "chunked" in headers.get("transfer-encoding", "").lower() \
        or "content-length" in headers


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.IncompleteReadError):
        return "the connection closed mid-answer" if e.partial or e.expected else \
            "the connection closed"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
