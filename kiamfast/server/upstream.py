"""The passthrough to the real instance-metadata service, with the agent's own IMDSv2 token.

Paths the worker does not answer itself (placement, instance-id, the identity document...)
go upstream. Three rules make that safe (sdk-imds.md §6, §9.10):

* the pod's own token is never forwarded: the worker holds its own upstream token, fetched
  with a PUT, cached and refreshed ahead of expiry; if the upstream answers the PUT with
  403/404/405 (IMDSv1-only endpoints and mocks) the worker goes tokenless for a while;
* nothing identifying the pod is added (no ``X-Forwarded-For``, no client headers at all),
  and the path sent is the canonical one the router classified, never the raw one;
* a dead upstream costs the pod at most ``timeout`` (default 0.3 s, inside every SDK's
  budget) and then a 503, never a hang.

Each client address gets a bounded share (``PassthroughLimit``): a few requests upstream at
a time and a token bucket, 429 beyond. The node's metadata service throttles per instance,
so without it one pod's flood would also starve the agent's own health check and every
other pod's passthrough.

One TCP connection per request: passthrough is rare next to credential reads, and a fresh
connection has no stale-socket failure modes. Bodies are capped so a broken upstream cannot
make a worker buffer without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools

from kiamfast.server import responses

MAX_BODY = 1 << 20
_KEEP_HEADERS = frozenset({b"content-type", b"last-modified", b"etag", b"expires",
                           b"cache-control", b"accept-ranges"})
_FALLBACK_STATUSES = (403, 404, 405)  # token PUT answers that mean "no IMDSv2 here"


class UpstreamError(Exception):
    """The metadata service could not be reached or answered garbage."""


class PassthroughLimit:
    """Per client address: at most ``concurrency`` requests upstream at once and a token
    bucket of ``burst`` refilled at ``rate`` per second. One instance per worker."""

    _PRUNE_AT = 4096  # addresses tracked before idle, full buckets are forgotten

    def __init__(self, *, rate: float, burst: int, concurrency: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.concurrency = concurrency
        self._clock = clock
        self._buckets: dict[bytes, list[float]] = {}  # key -> [tokens, at]
        self._in_flight: dict[bytes, int] = {}

    def acquire(self, key: bytes) -> bool:
        """Take a place for one request from `key`; False: answer 429 (nothing taken)."""
        if self._in_flight.get(key, 0) >= self.concurrency:
            return False
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._PRUNE_AT:
                self._prune(now)
            bucket = self._buckets[key] = [self.burst, now]
        tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        if tokens < 1.0:
            bucket[0], bucket[1] = tokens, now
            return False
        bucket[0], bucket[1] = tokens - 1.0, now
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return True

    def release(self, key: bytes) -> None:
        n = self._in_flight.get(key, 0) - 1
        if n > 0:
            self._in_flight[key] = n
        else:
            self._in_flight.pop(key, None)

    def _prune(self, now: float) -> None:
        """Forget addresses whose bucket has refilled: they start full again anyway."""
        for key, (tokens, at) in list(self._buckets.items()):
            if key not in self._in_flight and tokens + (now - at) * self.rate >= self.burst:
                del self._buckets[key]


class _Response:
    __slots__ = ("status", "headers", "body", "done", "headers_done", "size_error")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.done = False
        self.headers_done = False
        self.size_error = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body += body
        if len(self.body) > MAX_BODY:
            self.size_error = True

    def on_message_complete(self) -> None:
        self.done = True

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


async def _exchange(host: str, port: int, request: bytes, *, head: bool) -> _Response:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        resp = _Response()
        parser = httptools.HttpResponseParser(resp)
        while not resp.done:
            data = await reader.read(65536)
            if not data:
                try:
                    parser.feed_data(b"")  # lets a close-delimited body finish
                except httptools.HttpParserError:
                    pass
                if resp.done:
                    break
                raise UpstreamError("connection closed before the response was complete")
            try:
                parser.feed_data(data)
            except httptools.HttpParserError as e:
                raise UpstreamError(f"bad response from the metadata service: {e}") from e
            if resp.size_error:
                raise UpstreamError("response from the metadata service too large")
            if head and resp.headers_done:
                break  # a HEAD answer has no body, whatever Content-Length says
        resp.status = parser.get_status_code()
        return resp
    finally:
        writer.close()


class Upstream:
    """Forward requests to ``host:port`` with the agent's own IMDSv2 token."""

    def __init__(self, host: str, port: int, *, timeout: float = 0.3,
                 token_ttl: int = 21600) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.token_ttl = token_ttl
        self._host_header = (f"[{host}]" if ":" in host else host).encode() + (
            b"" if port == 80 else b":%d" % port)
        self._token: bytes | None = None
        self._token_refresh_at = 0.0  # monotonic time to fetch a new token
        self._tokenless_until = 0.0  # monotonic time until which no PUT is tried
        self._token_task: asyncio.Future[bytes | None] | None = None

    # -- the agent's own token --------------------------------------------------------

    async def _fetch_token(self) -> bytes | None:
        request = (b"PUT /latest/api/token HTTP/1.1\r\nHost: " + self._host_header +
                   b"\r\nX-aws-ec2-metadata-token-ttl-seconds: %d\r\n"
                   b"Content-Length: 0\r\nConnection: close\r\n\r\n" % self.token_ttl)
        now = time.monotonic()
        try:
            resp = await _exchange(self.host, self.port, request, head=False)
        except (OSError, UpstreamError):
            self._tokenless_until = now + 5.0
            return None
        if resp.status == 200 and resp.body.strip():
            ttl_header = resp.header(b"x-aws-ec2-metadata-token-ttl-seconds")
            try:
                granted = int(ttl_header) if ttl_header else self.token_ttl
            except ValueError:
                granted = self.token_ttl
            granted = max(1, min(granted, self.token_ttl))
            self._token = bytes(resp.body).strip()
            # Refresh well ahead of expiry: at 5 min left, or at 80% for short TTLs.
            self._token_refresh_at = now + max(min(granted - 300, granted * 0.8), 0.5)
            return self._token
        # 403/404/405: an IMDSv1-only service. Anything else: broken for now. Either way
        # go tokenless for a while instead of paying a PUT on every request.
        self._tokenless_until = now + (60.0 if resp.status in _FALLBACK_STATUSES else 5.0)
        return None

    async def token(self) -> bytes | None:
        now = time.monotonic()
        if self._token is not None and now < self._token_refresh_at:
            return self._token
        if now < self._tokenless_until:
            return None
        if self._token_task is None or self._token_task.done():
            self._token_task = asyncio.ensure_future(self._fetch_token())
        return await asyncio.shield(self._token_task)

    def drop_token(self, token: bytes) -> None:
        if self._token == token:
            self._token = None
            self._token_refresh_at = 0.0

    # -- forwarding -------------------------------------------------------------------

    async def forward(self, method: bytes, target: bytes) -> bytes:
        """The full client response for ``method target`` (GET or HEAD) from upstream.

        Raises ``UpstreamError`` (or ``TimeoutError``) when there is nothing to forward;
        the caller answers 503.
        """
        async with asyncio.timeout(self.timeout):
            head = method == b"HEAD"
            for attempt in (1, 2):
                token = await self.token()
                request = [method, b" ", target, b" HTTP/1.1\r\nHost: ", self._host_header,
                           b"\r\nAccept: */*\r\nConnection: close\r\n"]
                if token is not None:
                    request += [b"X-aws-ec2-metadata-token: ", token, b"\r\n"]
                request.append(b"\r\n")
                try:
                    resp = await _exchange(self.host, self.port, b"".join(request), head=head)
                except OSError as e:
                    raise UpstreamError(f"metadata service unreachable: {e}") from e
                if resp.status == 401 and token is not None and attempt == 1:
                    self.drop_token(token)  # ours went stale (upstream restarted?)
                    continue
                return self._render(resp, head=head)
        raise UpstreamError("unreachable")  # pragma: no cover - loop always returns

    @staticmethod
    def _render(resp: _Response, *, head: bool) -> bytes:
        headers = tuple((k.title(), v) for k, v in resp.headers
                        if k in _KEEP_HEADERS and k not in (b"content-type", b"accept-ranges"))
        ctype = resp.header(b"content-type") or b"text/plain"
        if head:
            length_header = resp.header(b"content-length")
            try:
                length = int(length_header) if length_header else 0
            except ValueError:
                length = 0
            return responses.render(resp.status, b"", content_type=ctype, headers=headers,
                                    length=length)
        return responses.render(resp.status, bytes(resp.body), content_type=ctype,
                                headers=headers)
