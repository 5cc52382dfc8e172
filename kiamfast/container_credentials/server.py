"""`GET /v1/credentials` with `Authorization: <projected service-account token>`.

Runs as a coroutine of the control process (docs/architecture.md, "Container credentials"):
the pod view, the role decisions and the credential slots it answers from live there.  What
keeps a hostile pod from slowing the table's writer or locking the other pods out: a
bounded request head; an answer its client has not read within `WRITE_TIMEOUT` ends the
connection; a bound on connections per address and in all, where a newcomer takes the place
of the longest idle connection of the address holding the most (idle: not making an answer,
which every budget below bounds in time); TokenReview calls
on their own few threads; a per-address budget of reviews (a cached verdict costs none); a
per-pod budget of answers (a flood of valid tokens); and a per-address budget of refusals:
past it, that address's requests are closed unread and its new connections reset as they
are accepted, for a cool-down, so a flood of bad tokens costs an accept and a reset, not a
parse, a claims check, an answer and a log line.

Order of checks, each refusing with the protocol's JSON ``{"Code", "Message"}``:
the token's own claims (400: not a JWT, wrong audience, expired, not bound to a pod) → the
pod they name is on this node (403; 503 while the agent has not synced) → the API server's
TokenReview (400 refused for good, 503 unreachable or undecided, 429 over the address's
budget) → the pod's budget of answers (429) → the role policy the metadata path applies
(403 no role or denied) → the pod's credential slot (200, or 503 while it is being
fetched).  Waits are bounded by --wait-budget.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kiamfast import metrics_text as text
from kiamfast.container_credentials.http_wire import (BadRequest, Request, error_body,
                                                      parse_head, response)
from kiamfast.container_credentials.limits import (COOL_DOWN, REFUSAL_BURST, REFUSAL_RATE,
                                                   AddressLimits, Connection)
from kiamfast.container_credentials.pod_view import (Decisions, OwnershipView, PodView, Slots,
                                                    forbidden)
from kiamfast.container_credentials.token_review import (BoundPod, SyncRequests, TokenRejected,
                                                         TokenReviewer, precheck, unavailable)
from kiamfast.sockets import raise_fd_limit

if TYPE_CHECKING:
    from kiamfast.config import Config
    from kiamfast.table import Table

log = logging.getLogger("kiamfast.container_credentials")

PATH = "/v1/credentials"        # what the EKS Pod Identity webhook puts in FULL_URI
MAX_HEAD = 20480                # request line + headers (a token is at most 16 KiB)
HEAD_TIMEOUT = 10.0             # a whole request head, once a connection is open or idle
WRITE_TIMEOUT = 5.0             # an answer written and not read by then ends the connection
# As the supervisor binds the sockets: asyncio listens again, with 100 unless told, and a
# burst of connections past the queue has its SYNs dropped (the client retries after 1 s).
LISTEN_BACKLOG = 2048
LOG_EVERY = 10.0                # one info line per kind of refusal this often; debug else


class _Gate(asyncio.StreamReaderProtocol):
    """`asyncio.start_server`'s protocol, but a connection is given a place (`Connection`)
    before any reader, writer or task is made for it, and one that gets none (its address
    cooling down, or over its share) is reset at once: a flood of reconnects then costs an
    accept and a reset (no TIME_WAIT left on the node), not a coroutine each.  The place
    is given up when the connection is lost, whoever closes it."""

    def __init__(self, limits: AddressLimits, reader: asyncio.StreamReader,
                 serve: Callable[..., Any], *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, lambda r, w: serve(r, w, self.conn), loop=loop)
        self._limits = limits
        self.conn: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        if not self._limits.cooling(address):
            self.conn = self._limits.open(address, transport)
        if self.conn is None:
            transport.abort()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self._limits.close(self.conn)
        super().connection_lost(exc)


class AnswerNotRead(Exception):
    """The client did not read an answer within `WRITE_TIMEOUT`."""


class ContainerCredentialsServer:
    """The listeners: one coroutine per connection, answers in request order.  Every socket
    (169.254.170.23 and [fd00:ec2::23], say) shares one reviewer, cache and set of limits."""

    def __init__(self, socks: Sequence[socket.socket], *,
                 reviewer: TokenReviewer, view: PodView, wait_budget: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.socks = list(socks)
        self.reviewer = reviewer
        self.view = view
        # The verdicts of pods the view no longer knows (deleted, or gone from this node)
        # are swept: what is kept is what is live.
        reviewer.alive = lambda pod: view.known(pod.uid)
        self.wait_budget = wait_budget
        self.clock = clock
        self.limits = AddressLimits()
        self.answers: dict[int, int] = {}        # HTTP status -> count
        self._changed = asyncio.Event()
        self._logged: dict[tuple[int, str], float] = {}

    # ---- the control process tells us when the table or the pod view changed --------------

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], Any], budget: float) -> Any:
        """`ready()` once it is truthy, or its last value after `budget` seconds."""
        deadline = time.monotonic() + budget
        while True:
            result = ready()
            remaining = deadline - time.monotonic()
            if result or remaining <= 0:
                return result
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    # ---- connections -----------------------------------------------------------------------

    async def run(self) -> None:
        raise_fd_limit()   # the control process did; a server run alone too
        loop = asyncio.get_running_loop()

        def gate() -> _Gate:
            return _Gate(self.limits, asyncio.StreamReader(limit=MAX_HEAD, loop=loop),
                         self._connection, loop=loop)

        servers = [await loop.create_server(gate, sock=sock, backlog=LISTEN_BACKLOG)
                   for sock in self.socks]
        try:
            await asyncio.gather(*(server.serve_forever() for server in servers))
        finally:
            for server in servers:
                server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          conn: Connection) -> None:
        transport = writer.transport
        try:
            await self._requests(conn, reader, writer)
        except AnswerNotRead:
            transport.abort()                   # its place is given up at once
            return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        conn.busy = False
        writer.close()
        if transport.get_write_buffer_size():
            # A last answer still queued: closing waits for the client to read it, and the
            # place is held until then; it gets the time any answer gets.
            asyncio.get_running_loop().call_later(WRITE_TIMEOUT, transport.abort)

    async def _requests(self, conn: Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        address = conn.address
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
                if self.limits.cooling(address):
                    return                      # closed unread, unanswered, unlogged
            except asyncio.LimitOverrunError:
                writer.write(self._error(address, 431, "HeadersTooLarge",
                                         "request head too large", keep_alive=False))
                return
            conn.busy = True                    # not evicted while its answer is made
            try:
                request = parse_head(head)
            except BadRequest as e:
                writer.write(self._error(address, 400, "BadRequest", str(e), keep_alive=False))
                return
            answer = await self.answer(request, address)
            conn.busy = False
            conn.idle_since = self.limits.clock()
            writer.write(answer)
            try:
                # A client that sends requests and never reads its answers (a pipelining
                # client with a small receive buffer) would hold the connection for ever.
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            except asyncio.TimeoutError:
                raise AnswerNotRead from None
            if not request.keep_alive:
                return

    # ---- one request -------------------------------------------------------------------------

    async def answer(self, request: Request, address: str) -> bytes:
        keep = request.keep_alive
        if request.path != PATH:
            return self._error(address, 404, "NotFound", f"no such path; use {PATH}",
                               keep_alive=keep)
        if request.method != "GET":
            return self._error(address, 405, "MethodNotAllowed", "only GET is served",
                               keep_alive=keep, extra=(("Allow", "GET"),))
        try:
            body = await self.credentials(request.headers.get("authorization", ""), address)
        except TokenRejected as e:
            extra = (("Retry-After", "1"),) if e.status == 429 else ()
            return self._error(address, e.status, e.code, e.message, keep_alive=keep,
                               extra=extra)
        self.answers[200] = self.answers.get(200, 0) + 1
        return response(200, body, keep_alive=keep)

    async def credentials(self, token: str, address: str) -> bytes:
        claimed = precheck(token, self.reviewer.audience, self.clock())
        pod = self.reviewer.cached(token)
        if pod is None:
            pod = await self._review(token, claimed, address)
        # By the reviewed pod, never by unverified claims (which would let anyone spend
        # another pod's budget): one pod's flood of valid tokens cannot take the loop.
        if not self.limits.allow_answer(pod.uid):
            raise TokenRejected(429, "TooManyRequests",
                                f"too many requests for pod {pod.namespace}/{pod.name}")
        return await self._resolve(pod)

    async def _review(self, token: str, claimed: BoundPod, address: str) -> BoundPod:
        # The unverified claims can only refuse: a token naming a pod this node does not
        # run costs no review (another node's token, or a deleted pod's).
        if not await self._until(lambda: self.view.known(claimed.uid), self.wait_budget):
            raise forbidden(f"pod {claimed.namespace}/{claimed.name} is not on this node")
        if not self.limits.allow_review(address):
            raise TokenRejected(429, "TooManyRequests", "too many new tokens from this address")
        return await self.reviewer.review(token, claimed, address=address)

    async def _resolve(self, pod: BoundPod) -> bytes:
        asked: set[int] = set()

        def attempt() -> bytes | None:
            if pod.expires <= self.clock():
                raise TokenRejected(400, "InvalidToken", "the token has expired")
            result = self.view.resolve(pod, self.clock())
            if isinstance(result, bytes):
                return result
            if result.slot >= 0 and result.slot not in asked:
                asked.add(result.slot)
                self.view.want(result.slot)   # fetch now, first in the credential queue
            last[0] = result.why
            return None

        last: list[TokenRejected] = [unavailable("not answered")]
        body = await self._until(attempt, self.wait_budget)
        if body is None:
            raise last[0]
        return body

    def _error(self, address: str, status: int, code: str, message: str, *, keep_alive: bool,
               extra: tuple[tuple[str, str], ...] = ()) -> bytes:
        self.answers[status] = self.answers.get(status, 0) + 1
        now = time.monotonic()
        # A pod waiting for its credentials (503) is not refused; anything else counts.
        if status != 503 and self.limits.refused(address):
            if now - self._logged.get((0, "cooling"), -LOG_EVERY) >= LOG_EVERY:
                self._logged[(0, "cooling")] = now
                log.info("container credentials: %s sent more than %d refused requests in a "
                         "burst (%g/s after); its connections are closed unread for %g s",
                         address, REFUSAL_BURST, REFUSAL_RATE, COOL_DOWN)
        if now - self._logged.get((status, code), -LOG_EVERY) >= LOG_EVERY:
            self._logged[(status, code)] = now
            log.info("container credentials refused to %s: %d %s: %s", address, status, code,
                     message)
        else:
            log.debug("container credentials refused to %s: %d %s: %s", address, status, code,
                      message)
        return response(status, error_body(code, message), keep_alive=keep_alive, extra=extra)

    # ---- what the control process publishes --------------------------------------------------

    def health(self) -> str:
        """For /healthz: whether reviews work (the one failure that is not a pod's own)."""
        return self.reviewer.health()

    def metric_lines(self) -> list[str]:
        counters = (
            ("kiamfast_container_credentials_total", "Container-credentials answers by HTTP "
             "status.", "counter", [(n, (("code", str(code)),))
                                    for code, n in sorted(self.answers.items())]),
            ("kiamfast_container_credentials_cooled_total", "Connections and requests closed "
             "unread: their address was past its refusals.", "counter",
             [(self.limits.cooled, ())]),
            ("kiamfast_container_credentials_connections", "Connections held now.", "gauge",
             [(self.limits.total, ())]),
            ("kiamfast_container_credentials_connections_closed_total", "Connections closed "
             "to keep the bounds: evicted = the longest idle of the address holding the "
             "most, for a newcomer; turned_away = no place.", "counter",
             [(self.limits.evicted, (("kind", "evicted"),)),
              (self.limits.turned_away, (("kind", "turned_away"),))]),
            ("kiamfast_token_reviews_total", "TokenReview activity by kind.", "counter",
             [(v, (("kind", k),)) for k, v in sorted(self.reviewer.stats.items())]),
            ("kiamfast_token_reviews_pending", "TokenReviews waiting for a thread or running "
             "now.", "gauge", [(self.reviewer.queue.queued + self.reviewer.queue.running,
                                ())]))
        lines: list[str] = []
        for name, help_text, kind, samples in counters:
            lines += text.header(name, help_text, kind)
            lines += [text.sample(name, value, labels) for value, labels in samples]
        return lines

    def close(self) -> None:
        self.reviewer.close()


def from_config(config: Config, socks: Sequence[socket.socket], *, model: Decisions,
                manager: Slots, table: Table, api: SyncRequests) -> ContainerCredentialsServer:
    """The listeners of --container-credentials-addr.  Reviews go through ``api``'s
    blocking calls, on the reviewer's own threads and connections: they never queue behind
    the pod watch's streams."""
    from kiamfast.container_credentials.token_review import token_review_call
    reviewer = TokenReviewer(token_review_call(api),
                             audience=config.container_credentials_audience)
    view = OwnershipView(model=model, manager=manager, table=table, node=config.node)
    return ContainerCredentialsServer(socks, reviewer=reviewer, view=view,
                                      wait_budget=config.wait_budget)
