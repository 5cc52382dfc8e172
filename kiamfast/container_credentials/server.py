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
import http
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import orjson

from kiamfast import table as tbl
from kiamfast.container_credentials.token_review import (
    BoundPod,
    TokenRejected,
    TokenReviewer,
    precheck,
    unavailable,
)
from kiamfast.credential_parts import account_id, parse_response
from kiamfast.decisions import IdentityKind
from kiamfast.sockets import raise_fd_limit

log = logging.getLogger("kiamfast.container_credentials")

PATH = "/v1/credentials"        # what the EKS Pod Identity webhook puts in FULL_URI
MAX_HEAD = 20480                # request line + headers (a token is at most 16 KiB)
HEAD_TIMEOUT = 10.0             # a whole request head, once a connection is open or idle
WRITE_TIMEOUT = 5.0             # an answer written and not read by then ends the connection
MAX_CONNECTIONS = 512
# As the supervisor binds the sockets: asyncio listens again, with 100 unless told, and a
# burst of connections past the queue has its SYNs dropped (the client retries after 1 s).
LISTEN_BACKLOG = 2048
MAX_CONNECTIONS_PER_ADDRESS = 16
REVIEW_RATE = 2.0               # reviews per second and address, after a burst of ...
REVIEW_BURST = 10
REFUSAL_RATE = 10.0             # refused requests per second and address, after a burst of ...
REFUSAL_BURST = 50
POD_ANSWER_RATE = 50.0          # requests per second and reviewed pod, after a burst of ...
POD_ANSWER_BURST = 200          # (an SDK asks once per process and credential refresh)
COOL_DOWN = 2.0                 # past that: the address's connections closed unread this long
BUCKETS = 4096                  # addresses (or pods) whose budgets are remembered, at most
LOG_EVERY = 10.0                # one info line per kind of refusal this often; debug else


def forbidden(message: str) -> TokenRejected:
    return TokenRejected(403, "AccessDenied", message)


class PodView(Protocol):
    """What the answer needs of the control process: `resolve` a reviewed pod."""

    def known(self, uid: str) -> bool: ...

    def resolve(self, pod: BoundPod, now: float) -> "bytes | Wait": ...

    def want(self, slot: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Wait:
    """Not answerable yet: `why` is the answer if it stays so; `slot` to ask the manager for."""
    why: TokenRejected
    slot: int = -1


def container_document(imds_document: bytes, role_arn: str) -> bytes:
    """The container provider's JSON from the slot's IMDS document (same keys, same expiry)."""
    doc = orjson.loads(imds_document)
    if doc.get("Code") != "Success":     # STS refused the role for good
        raise forbidden(str(doc.get("Message") or "the role cannot be assumed"))
    return orjson.dumps({"AccessKeyId": doc["AccessKeyId"],
                         "SecretAccessKey": doc["SecretAccessKey"], "Token": doc["Token"],
                         "AccountId": account_id(role_arn) or "",
                         "Expiration": doc["Expiration"]})


class OwnershipView:
    """The node model's decisions (``NodeModel.decision``) and the credential slots."""

    def __init__(self, *, model: Any, manager: Any, table: Any, node: str) -> None:
        self.model = model
        self.manager = manager
        self.table = table
        self.node = node or "(all nodes)"

    def known(self, uid: str) -> bool:
        return self.model.decision(uid) is not None or not self.model.synced

    def want(self, slot: int) -> None:
        self.manager.wanted(slot)

    def resolve(self, pod: BoundPod, now: float) -> bytes | Wait:
        decision = self.model.decision(pod.uid)
        if decision is None or (decision.namespace, decision.name) != (pod.namespace,
                                                                       pod.name):
            if not self.model.synced:
                return Wait(unavailable("the agent has not synced this node's pods yet"))
            return Wait(forbidden(f"pod {pod.namespace}/{pod.name} is not on node "
                                  f"{self.node}"))
        if not decision.service_account:
            # Known from its sandbox only (the watch behind the runtime, or not synced after a
            # restart with the API server down): whose account it runs as is not known yet.
            return Wait(unavailable(f"the service account of pod {pod.namespace}/{pod.name} "
                                    "is not known yet (the agent has not had it from the "
                                    "API server)"))
        if decision.service_account != pod.service_account:
            raise forbidden(f"pod {pod.namespace}/{pod.name} does not run as service "
                            f"account {pod.service_account}")
        if decision.host_network and not decision.token_only:
            # The node's address is not its own: served only when every container asks by
            # token (the node model decides such a pod).
            raise forbidden(f"pod {pod.namespace}/{pod.name} runs on the host network and "
                            "not every container asks by token")
        if not decision.decided:
            raise forbidden(f"pod {pod.namespace}/{pod.name} is not running")
        ident = decision.identity
        if ident is None:
            return Wait(unavailable(f"the role of pod {pod.namespace}/{pod.name} is not "
                                    "decided yet"))
        if ident.kind == IdentityKind.NO_ROLE:
            raise forbidden(f"pod {pod.namespace}/{pod.name} has no role")
        if ident.kind == IdentityKind.DENIED:
            raise forbidden(ident.reason or f"pod {pod.namespace}/{pod.name} is denied")
        return self._credentials(decision, now)

    def _credentials(self, decision: Any, now: float) -> bytes | Wait:
        slot = decision.cred_slot
        pending = Wait(unavailable(f"credentials for {decision.role_arn} are not fetched "
                                   "yet"), slot)
        # The slot must hold this very key (the metadata path's rule for an adopted slot).
        if slot < 0 or not decision.holds(self.manager.role_of_slot(slot)):
            return Wait(pending.why)
        try:
            state, serve_until, parts = self.table.read_cred(slot)
        except tbl.TableError:
            return pending
        if state != tbl.CRED_READY or serve_until <= now or len(parts) <= tbl.PART_DOCUMENT:
            return pending
        _, _, body = parse_response(parts[tbl.PART_DOCUMENT])
        return container_document(body, decision.role_arn)


class Connection:
    """One connection's place: whose it is, whether an answer is being made for it (bounded
    in time by the budgets of the request path), and since when it has been idle (its
    accept, or its last answer written; an answer waiting for its client to read it is
    idle: the client's to take, never the loop's)."""
    __slots__ = ("address", "transport", "busy", "idle_since")

    def __init__(self, address: str, transport: asyncio.BaseTransport, now: float) -> None:
        self.address = address
        self.transport = transport
        self.busy = False
        self.idle_since = now


class AddressLimits:
    """Connections held, a token bucket of TokenReviews and one of refusals, per client
    address, and one of answers per pod; an address past its refusals is cooling down (its
    connections closed at once)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.connections: dict[str, set[Connection]] = {}
        self.total = 0
        self.evicted = 0                          # idle connections closed for a newcomer
        self.turned_away = 0                      # connections refused: no place for them
        # Kept across connections (a new connection must not bring a full bucket) until the
        # bucket is full again (then it is as if new), the least recently used first.
        self._reviews: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._refusals: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._answers: OrderedDict[str, tuple[float, float]] = OrderedDict()   # by pod uid
        self._cooling: OrderedDict[str, float] = OrderedDict()   # address -> until, in order
        self.cooled = 0                           # connections and requests closed unread

    def open(self, address: str, transport: asyncio.BaseTransport) -> Connection | None:
        """A place for a new connection from `address`, or None (then close it unread)."""
        mine = self.connections.get(address)
        held = len(mine) if mine else 0
        if held >= MAX_CONNECTIONS_PER_ADDRESS or (
                self.total >= MAX_CONNECTIONS and not self._make_room(held)):
            self.turned_away += 1
            return None
        conn = Connection(address, transport, self.clock())
        if mine is None:
            mine = self.connections[address] = set()
        mine.add(conn)
        self.total += 1
        return conn

    def _make_room(self, own: int) -> bool:
        """At MAX_CONNECTIONS: close an idle connection of an address holding at least two
        more than the newcomer's (`own`): of the address holding the most, the one idle
        longest, as the metadata path's workers do.  Any idle connection anywhere will do:
        an address whose connections are all being answered cannot keep a pod that holds
        none out, and nobody is left with fewer than the newcomer.  Only when every place
        is making an answer (each bounded in time) is the newcomer turned away."""
        idle = [c for conns in self.connections.values() if len(conns) >= own + 2
                for c in conns if not c.busy]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (-len(self.connections[c.address]), c.idle_since))
        self.close(victim)
        self.evicted += 1
        if victim.transport.get_write_buffer_size():
            victim.transport.abort()  # an answer it is not reading: nothing to wait for
        else:
            victim.transport.close()  # its reader sees the end, its client a FIN
        return True

    def close(self, conn: Connection) -> None:
        """Give the connection's place up (once: an evicted one gave it up already)."""
        mine = self.connections.get(conn.address)
        if mine is None or conn not in mine:
            return
        mine.discard(conn)
        self.total -= 1
        if not mine:
            del self.connections[conn.address]

    def allow_review(self, address: str) -> bool:
        return _take(self._reviews, address, self.clock(), REVIEW_RATE, REVIEW_BURST)

    def allow_answer(self, pod_uid: str) -> bool:
        """One answer for a reviewed pod (whatever address its token came from)."""
        return _take(self._answers, pod_uid, self.clock(), POD_ANSWER_RATE, POD_ANSWER_BURST)

    def refused(self, address: str) -> bool:
        """Count one refusal; True when it used up the budget and the cool-down begins."""
        now = self.clock()
        if _take(self._refusals, address, now, REFUSAL_RATE, REFUSAL_BURST):
            return False
        self._cooling.pop(address, None)
        self._cooling[address] = now + COOL_DOWN     # the latest last: the same COOL_DOWN
        while next(iter(self._cooling.values())) <= now:     # only addresses still cooling
            self._cooling.popitem(last=False)
        return True

    def cooling(self, address: str) -> bool:
        until = self._cooling.get(address)
        if until is None:
            return False
        if until > self.clock():
            self.cooled += 1
            return True
        del self._cooling[address]
        return False


def _take(buckets: OrderedDict[str, tuple[float, float]], address: str, now: float,
          rate: float, burst: int) -> bool:
    """One token from ``address``'s bucket, if it has one.  A bucket full again is dropped
    (a missing one is a full one: nothing changes), so what is kept is the keys used in the
    last ``burst / rate`` seconds; BUCKETS at most, the least recently used dropped."""
    tokens, last = buckets.get(address, (float(burst), now))
    tokens = min(float(burst), tokens + (now - last) * rate)
    allowed = tokens >= 1.0
    buckets[address] = (tokens - 1.0 if allowed else tokens, now)
    buckets.move_to_end(address)
    while len(buckets) > BUCKETS:
        buckets.popitem(last=False)
    while True:                  # least recently used first: full again, they are dropped
        tokens, last = next(iter(buckets.values()))
        if tokens + (now - last) * rate < burst:
            return allowed
        buckets.popitem(last=False)


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


class BadRequest(Exception):
    pass


class AnswerNotRead(Exception):
    """The client did not read an answer within `WRITE_TIMEOUT`."""


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """Request line and headers (names lower-cased); `BadRequest` for anything odd."""
    text = head[:-4].decode("latin-1")
    # A NUL, or a CR or LF that does not end a line, is never part of a field (RFC 9110
    # 5.5: reject): a token carrying one is refused here, without a review.
    if "\0" in text or not text.count("\r") == text.count("\n") == text.count("\r\n"):
        raise BadRequest("a NUL, CR or LF inside a request line or header")
    try:
        lines = text.split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest("unsupported HTTP version")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        name = name.lower()
        if not sep or not name or name != name.strip() or name in headers:
            raise BadRequest(f"malformed or repeated header {name!r}")
        headers[name] = value.strip()
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise BadRequest("a request body is not accepted")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return Request(method, target.partition("?")[0], headers, keep_alive)


def response(status: int, body: bytes, *, keep_alive: bool,
             extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in extra)]
    if not keep_alive:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"Code": code, "Message": message})


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

    def metrics(self) -> list[str]:
        lines = ["# HELP kiamfast_container_credentials_total Container-credentials answers "
                 "by HTTP status.",
                 "# TYPE kiamfast_container_credentials_total counter"]
        lines += [f'kiamfast_container_credentials_total{{code="{code}"}} {n}'
                  for code, n in sorted(self.answers.items())]
        lines += ["# HELP kiamfast_container_credentials_cooled_total Connections and "
                  "requests closed unread: their address was past its refusals.",
                  "# TYPE kiamfast_container_credentials_cooled_total counter",
                  f"kiamfast_container_credentials_cooled_total {self.limits.cooled}",
                  "# HELP kiamfast_container_credentials_connections Connections held now.",
                  "# TYPE kiamfast_container_credentials_connections gauge",
                  f"kiamfast_container_credentials_connections {self.limits.total}",
                  "# HELP kiamfast_container_credentials_connections_closed_total "
                  "Connections closed to keep the bounds: evicted = the longest idle of "
                  "the address holding the most, for a newcomer; turned_away = no place.",
                  "# TYPE kiamfast_container_credentials_connections_closed_total counter",
                  'kiamfast_container_credentials_connections_closed_total{kind="evicted"} '
                  f"{self.limits.evicted}",
                  'kiamfast_container_credentials_connections_closed_total'
                  f'{{kind="turned_away"}} {self.limits.turned_away}']
        lines += ["# HELP kiamfast_token_reviews_total TokenReview activity by kind.",
                  "# TYPE kiamfast_token_reviews_total counter"]
        lines += [f'kiamfast_token_reviews_total{{kind="{k}"}} {v}'
                  for k, v in sorted(self.reviewer.stats.items())]
        queue = self.reviewer.queue
        lines += ["# HELP kiamfast_token_reviews_pending TokenReviews waiting for a thread "
                  "or running now.",
                  "# TYPE kiamfast_token_reviews_pending gauge",
                  f"kiamfast_token_reviews_pending {queue.queued + queue.running}"]
        return lines

    def close(self) -> None:
        self.reviewer.close()


def from_config(config: Any, socks: Sequence[socket.socket], *, model: Any, manager: Any,
                table: Any, client: Any) -> ContainerCredentialsServer:
    """The listeners of --container-credentials-addr.  Reviews go through ``client``'s
    blocking calls, on the reviewer's own threads and connections: they never queue behind
    the pod watch's streams."""
    from kiamfast.container_credentials.token_review import token_review_call
    reviewer = TokenReviewer(token_review_call(client),
                             audience=config.container_credentials_audience)
    view = OwnershipView(model=model, manager=manager, table=table, node=config.node)
    return ContainerCredentialsServer(socks, reviewer=reviewer, view=view,
                                      wait_budget=config.wait_budget)
