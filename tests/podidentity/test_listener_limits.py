"""The listener's defences and its review cache, with a stand-in for the API server's
TokenReview and for the pod view (the real ones are in test_container_credentials.py).

What a hostile or broken client meets: a bounded head, no bodies, a connection cap per
address, a per-address budget of new tokens (429), refusals cached, the API server's outage
reported as 503 and in /healthz's text, and claims that can refuse but never accept.
"""
from __future__ import annotations

import asyncio
import base64
import json
import socket
import time

from kiamfast.container_credentials import limits
from kiamfast.container_credentials import pod_view
from kiamfast.container_credentials import token_review
from kiamfast.container_credentials import server as srv
from kiamfast.container_credentials.token_review import POD_NAME_EXTRA, POD_UID_EXTRA, TokenReviewer

AUDIENCE = "kiamfast.io/container-credentials"
CREDS = b'{"AccessKeyId":"ASIATEST"}'


def token(name: str = "p", uid: str = "uid-p", *, exp: float | None = None) -> str:
    claims = {"aud": [AUDIENCE], "exp": int(exp or time.time() + 600),
              "kubernetes.io": {"namespace": "ns", "pod": {"name": name, "uid": uid},
                                "serviceaccount": {"name": "app", "uid": "sa-uid"}}}
    return f"{_b64json({'alg': 'ES256'})}.{_b64json(claims)}.c2ln"


def _b64json(doc: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


class FakeApi:
    """TokenReview as the API server answers it for tokens of `token()`."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = False
        self.authentic = True
        self.error = ""        # status.error of an unauthenticated review

    def __call__(self, tok: str, audience: str) -> dict:
        self.calls += 1
        if self.down:
            raise ConnectionRefusedError("connection refused")
        claims = json.loads(base64.urlsafe_b64decode(tok.split(".")[1] + "=="))
        pod = claims["kubernetes.io"]["pod"]
        if not self.authentic:
            return {"authenticated": False, "error": self.error}
        return {"authenticated": True, "audiences": [audience],
                "user": {"username": "system:serviceaccount:ns:app",
                         "extra": {POD_NAME_EXTRA: [pod["name"]], POD_UID_EXTRA: [pod["uid"]]}}}


class FakeView:
    def __init__(self) -> None:
        self.resolved = 0

    def known(self, uid: str) -> bool:
        return uid.startswith("uid-")

    def resolve(self, pod, now):
        self.resolved += 1
        return CREDS

    def want(self, slot: int) -> None:
        pass


class Listener:
    def __init__(self, *, wait_budget: float = 0.05) -> None:
        self.api = FakeApi()
        self.view = FakeView()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.server = srv.ContainerCredentialsServer(
            [self.sock], reviewer=TokenReviewer(self.api, audience=AUDIENCE), view=self.view,
            wait_budget=wait_budget)

    async def raw(self, data: bytes, source: str = "127.0.0.1") -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                       local_addr=(source, 0))
        writer.write(data)
        await writer.drain()
        out = await reader.read()
        writer.close()
        return out

    async def ask(self, tok: str | None, source: str = "127.0.0.1") -> tuple[int, dict, bytes]:
        auth = f"Authorization: {tok}\r\n" if tok is not None else ""
        out = await self.raw(f"GET /v1/credentials HTTP/1.1\r\nHost: x\r\n{auth}"
                             "Connection: close\r\n\r\n".encode(), source)
        assert out, "closed unanswered"
        head, _, body = out.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body), head


def serving(body, **options):
    async def main():
        listener = Listener(**options)
        task = asyncio.create_task(listener.server.run())
        try:
            await body(listener)
        finally:
            task.cancel()
            listener.server.close()
    asyncio.run(main())


def test_a_head_too_large_a_body_and_a_bad_request_line_are_refused():
    async def body(ls):
        out = await ls.raw(b"GET /v1/credentials HTTP/1.1\r\nX: " + b"a" * 30000 + b"\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 431 ")
        out = await ls.raw(b"GET /v1/credentials HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
        assert out.startswith(b"HTTP/1.1 400 ") and b'"BadRequest"' in out
        out = await ls.raw(b"GET  /v1/credentials HTTP/1.1\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400 ")
        assert ls.api.calls == 0
    serving(body)


def test_one_address_holds_at_most_its_share_of_connections():
    async def body(ls):
        held = [await asyncio.open_connection("127.0.0.1", ls.port, local_addr=("127.0.0.9", 0))
                for _ in range(limits.MAX_CONNECTIONS_PER_ADDRESS)]
        reader, writer = await asyncio.open_connection("127.0.0.1", ls.port,
                                                       local_addr=("127.0.0.9", 0))
        writer.write(b"GET /v1/credentials HTTP/1.1\r\n\r\n")
        try:                                                     # closed unanswered
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except ConnectionResetError:
            pass
        status, _, _ = await ls.ask(token(), source="127.0.0.10")  # another address is served
        assert status == 200
        for _, w in held:
            w.close()
    serving(body)


def test_new_tokens_beyond_an_addresss_budget_get_429_cached_ones_do_not():
    async def body(ls):
        first = token(uid="uid-0")
        assert (await ls.ask(first))[0] == 200
        answers = [await ls.ask(token(uid=f"uid-{i}")) for i in range(1, limits.REVIEW_BURST + 1)]
        status, doc, head = answers[-1]
        assert (status, doc["Code"]) == (429, "TooManyRequests")
        assert b"\r\nRetry-After: 1" in head
        assert all(a[0] == 200 for a in answers[:-1])
        assert (await ls.ask(first))[0] == 200                 # cached: no review needed
        assert (await ls.ask(token(uid="uid-x"), source="127.0.0.11"))[0] == 200
        assert ls.api.calls == limits.REVIEW_BURST + 1
    serving(body)


def test_claims_refuse_but_never_accept():
    async def body(ls):
        ls.api.authentic = False
        status, doc, _ = await ls.ask(token())
        assert (status, doc["Code"]) == (400, "InvalidToken") and ls.view.resolved == 0
        assert (await ls.ask(token()))[0] == 400 and ls.api.calls == 1    # refusal cached
        for bad in (None, "a.b", token(exp=time.time() - 5), token(uid="other-node")):
            assert (await ls.ask(bad))[0] in (400, 403), bad
        assert ls.api.calls == 1                                # none of those was reviewed
    serving(body)


def test_an_api_server_outage_is_503_and_shows_in_health():
    async def body(ls):
        ls.api.down = True
        status, doc, _ = await ls.ask(token())
        assert (status, doc["Code"]) == (503, "ServiceUnavailable")
        assert ls.server.health().startswith("TokenReview failing: ConnectionRefusedError")
        ls.api.down = False
        assert (await ls.ask(token()))[0] == 200           # an outage is not cached
        assert ls.server.health() == "ok"
    serving(body)


def test_an_address_past_its_refusals_is_closed_unread_for_a_cool_down_others_are_served():
    async def body(ls):
        ls.server.limits.clock = lambda: 1000.0      # no refill while the test runs (a loaded
        flood = "127.0.0.20"                         # machine took 100 ms: one more answer)
        # A flood over one keep-alive connection: answered until the budget is used, then
        # closed unread (the request after the one that used the budget gets no answer).
        reader, writer = await asyncio.open_connection("127.0.0.1", ls.port,
                                                       local_addr=(flood, 0))
        answered = 0
        for _ in range(limits.REFUSAL_BURST + 5):
            writer.write(b"GET /v1/credentials HTTP/1.1\r\nAuthorization: not-a-jwt\r\n\r\n")
            head = await asyncio.wait_for(reader.read(4096), 5)
            if not head:
                break
            assert head.startswith(b"HTTP/1.1 400 ")
            answered += 1
        writer.close()
        assert answered == limits.REFUSAL_BURST + 1
        # New connections from it are closed at once, even with a good token ...
        try:                                          # closed unanswered (or reset)
            out = await ls.raw(b"GET /v1/credentials HTTP/1.1\r\nAuthorization: " +
                               token().encode() + b"\r\n\r\n", source=flood)
        except ConnectionResetError:
            out = b""
        assert out == b""
        # ... while another address is answered, good and bad tokens alike.
        assert (await ls.ask(token(uid="uid-other"), source="127.0.0.21"))[0] == 200
        assert (await ls.ask("not-a-jwt", source="127.0.0.21"))[0] == 400
        assert ls.server.limits.cooled >= 2
        assert "kiamfast_container_credentials_cooled_total" in "\n".join(ls.server.metric_lines())
        assert ls.api.calls == 1                      # the flood cost no review
    serving(body)


def test_the_cool_down_ends_and_a_pod_waiting_for_its_credentials_is_never_cooled():
    bounds = limits.AddressLimits(clock=lambda: now[0])
    now = [0.0]
    for _ in range(limits.REFUSAL_BURST):
        assert not bounds.refused("10.0.0.1")
    assert bounds.refused("10.0.0.1") and bounds.cooling("10.0.0.1")
    assert not bounds.cooling("10.0.0.2")                 # another address: untouched
    now[0] += limits.COOL_DOWN + 0.01
    assert not bounds.cooling("10.0.0.1")                 # the cool-down is over

    async def body(ls):
        # 503 "not fetched yet", asked again and again by a pod's SDK, is not a refusal.
        ls.view.resolve = lambda pod, now: pod_view.Wait(token_review.unavailable("not yet"))
        for _ in range(limits.REFUSAL_BURST + 5):
            assert (await ls.ask(token(), source="127.0.0.22"))[0] == 503
        assert not ls.server.limits.cooling("127.0.0.22")
    serving(body)


# What kube-apiserver v1.34 puts in status.error (pkg/serviceaccount/claims.go, jwt.go; the
# real server joins them with the other authenticators' as "[invalid bearer token, ...]").
# Its authenticator could not look the pod or ServiceAccount up just now ...
UNDECIDED = [
    # the pod's lookup failed: NotFound or a storage error alike (claims.go)
    "[invalid bearer token, service account token has been invalidated]",
    # a ServiceAccount lookup that failed otherwise than NotFound: the error's own text
    "[invalid bearer token, etcdserver: request timed out]",
    "[invalid bearer token, Timeout: request did not complete within requested timeout - "
    "context deadline exceeded]",
    "[invalid bearer token, service account token is not valid yet]",   # a server's clock
    "[invalid bearer token, invalid signature, no keys found]",         # an external signer
    # a webhook token authenticator (EKS's aws-iam-authenticator) that is down
    '[invalid bearer token, Post "https://127.0.0.1:21362/authenticate": dial tcp '
    '127.0.0.1:21362: connect: connection refused]',
]
# ... or it refused the token for good.
DEFINITE = [
    "[invalid bearer token, service account token has expired]",
    '[invalid bearer token, token audiences ["sts.amazonaws.com"] is invalid for the target '
    'audiences ["kiamfast.io/container-credentials"]]',
    "[invalid bearer token, go-jose/go-jose: error in cryptographic primitive]",
    '[invalid bearer token, serviceaccounts "app" not found]',
    "[invalid bearer token, service account UID (1f) does not match claim (2e)]",
    "[invalid bearer token, service account ns/app has been deleted]",
    "[invalid bearer token, pod UID (1f) does not match service account pod ref claim (2e)]",
    "invalid bearer token",                             # nobody knew it: another issuer
    "",                                                 # nobody to ask
]


def test_a_review_the_api_server_could_not_decide_is_503_and_asked_again():
    """A review that completes unauthenticated because the API server's own lookups failed
    is not the token's fault: 503 "try again", never cached, so the pod is served as soon
    as the API server can check again.  The texts are the real server's (see
    test_review_texts.py for the ones it produces on demand)."""
    async def body(ls):
        ls.api.authentic = False
        for i, error in enumerate(UNDECIDED):
            ls.api.error = error
            tok = token(uid=f"uid-u{i}")
            for _ in range(2):
                status, doc, _ = await ls.ask(tok, source=f"127.0.3.{i + 1}")
                assert (status, doc["Code"]) == (503, "ServiceUnavailable"), (error, doc)
                assert error in doc["Message"]
            calls = ls.api.calls
            ls.api.authentic = True                    # the API server can check again
            assert (await ls.ask(tok, source=f"127.0.3.{i + 1}"))[0] == 200, error
            assert ls.api.calls == calls + 1
            ls.api.authentic = False
        assert ls.server.reviewer.stats["undecided"] == 2 * len(UNDECIDED)
        assert ls.view.resolved == len(UNDECIDED)
    serving(body)


def test_a_definite_refusal_is_400_and_cached():
    async def body(ls):
        ls.api.authentic = False
        for i, error in enumerate(DEFINITE):
            ls.api.error = error
            tok = token(uid=f"uid-d{i}")
            calls = ls.api.calls
            for _ in range(2):
                status, doc, _ = await ls.ask(tok, source=f"127.0.4.{i + 1}")
                assert (status, doc["Code"]) == (400, "InvalidToken"), (error, doc)
            assert ls.api.calls == calls + 1, error             # the second was cached
        assert ls.view.resolved == 0
    serving(body)


def test_one_pods_flood_of_valid_tokens_is_held_to_its_budget_others_are_served():
    """The pod is the reviewed one (never the unverified claims): one pod asking far
    more often than any SDK gets 429 with Retry-After past its budget, whatever address
    it asks from; another pod is answered meanwhile."""
    async def body(ls):
        ls.server.limits.clock = lambda: 1000.0      # no refill while the test runs
        tok = token(uid="uid-flood")
        reader, writer = await asyncio.open_connection("127.0.0.1", ls.port,
                                                       local_addr=("127.0.5.1", 0))
        statuses = []
        for _ in range(limits.POD_ANSWER_BURST + 5):
            writer.write(f"GET /v1/credentials HTTP/1.1\r\nAuthorization: {tok}\r\n\r\n"
                         .encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            statuses.append(int(head.split()[1]))
            if statuses[-1] == 429:
                assert b"\r\nRetry-After: 1\r\n" in head
        writer.close()
        assert statuses == [200] * limits.POD_ANSWER_BURST + [429] * 5
        # From another address too: the budget is the pod's.
        assert (await ls.ask(tok, source="127.0.5.2"))[0] == 429
        assert (await ls.ask(token(uid="uid-calm"), source="127.0.5.3"))[0] == 200
        assert ls.api.calls == 2                       # one review per token
    serving(body)


def test_at_the_cap_a_newcomer_takes_the_place_of_the_longest_idle_connection():
    """32 addresses x 16 idle connections fill every place; a pod that holds none still
    gets in, in place of the connection idle longest of an address holding the most; a
    connection whose request is being answered is never the one closed."""
    async def body(ls):
        hoarders = [f"127.0.6.{i + 1}" for i in range(limits.MAX_CONNECTIONS
                                                       // limits.MAX_CONNECTIONS_PER_ADDRESS)]
        held = {}
        for address in hoarders:
            held[address] = [await asyncio.open_connection(
                "127.0.0.1", ls.port, local_addr=(address, 0))
                for _ in range(limits.MAX_CONNECTIONS_PER_ADDRESS)]
        await until(lambda: ls.server.limits.total == limits.MAX_CONNECTIONS)
        # Every place taken: one more from a hoarder is turned away (it holds its share).
        reader, writer = await asyncio.open_connection("127.0.0.1", ls.port,
                                                       local_addr=(hoarders[0], 0))
        assert await closed_unanswered(reader, writer)
        assert ls.server.limits.evicted == 0
        # A pod holding no connection is served; the first-opened connection of a hoarder
        # went for it.
        status, _, _ = await ls.ask(token(uid="uid-new"), source="127.0.6.200")
        assert status == 200
        assert ls.server.limits.evicted == 1
        first_reader = held[hoarders[0]][0][0]
        assert await asyncio.wait_for(first_reader.read(), 5) == b""
        for conns in held.values():
            for _, w in conns:
                w.close()
    serving(body)


async def until(ready, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def closed_unanswered(reader, writer) -> bool:
    writer.write(b"GET /v1/credentials HTTP/1.1\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        return True


def test_a_client_that_never_reads_its_answers_is_let_go_within_the_write_timeout():
    """A client that pipelines requests and never reads (a small receive buffer) fills the
    socket's buffers; its connection, kept busy for ever before, is closed once an answer
    has waited `WRITE_TIMEOUT` to be read, and its place given up."""
    async def body(ls):
        ls.view.resolve = lambda pod, now: b'{"AccessKeyId":"' + b"A" * 8192 + b'"}'
        tokens = [token(uid=f"uid-unread-{i}") for i in range(8)]
        for i, tok in enumerate(tokens):        # reviewed (and cached) from addresses of their own
            assert (await ls.ask(tok, source=f"127.0.7.{i + 1}"))[0] == 200
        pipelined = b"".join(f"GET /v1/credentials HTTP/1.1\r\nAuthorization: {tok}\r\n\r\n"
                             .encode() for tok in tokens)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.bind(("127.0.7.100", 0))
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(client, ("127.0.0.1", ls.port))
        try:
            # Until the listener stops reading: it waits for its answers to be read.
            last_sent, left = time.monotonic(), memoryview(pipelined)
            while time.monotonic() - last_sent < 1.0:
                try:
                    left = left[client.send(left):] or memoryview(pipelined)   # whole requests
                    last_sent = time.monotonic()
                except BlockingIOError:
                    await asyncio.sleep(0.05)
                except ConnectionError:
                    break                     # let go already
            assert ls.server.answers.get(200, 0) > 100       # it did answer for a while
            await until(lambda: "127.0.7.100" not in ls.server.limits.connections,
                        timeout=srv.WRITE_TIMEOUT + 5)
        finally:
            client.close()
        assert (await ls.ask(tokens[0], source="127.0.7.101"))[0] == 200
    serving(body)


def test_at_the_cap_a_newcomer_takes_an_idle_place_when_the_busiest_address_is_all_busy():
    """16 connections of one address each wait for an answer (its credentials are being
    fetched) and 31 addresses hold 16 idle connections each: every place is taken, and the
    address holding the most (the first) has no idle connection.  A pod holding none still
    gets in, in place of an idle connection of another address."""
    async def body(ls):
        ls.view.resolve = lambda pod, now: (pod_view.Wait(token_review.unavailable("being fetched"))
                                            if pod.uid == "uid-slow" else CREDS)
        slow = token(uid="uid-slow")
        busy = []
        for _ in range(limits.MAX_CONNECTIONS_PER_ADDRESS):
            reader, writer = await asyncio.open_connection("127.0.0.1", ls.port,
                                                           local_addr=("127.0.8.1", 0))
            writer.write(f"GET /v1/credentials HTTP/1.1\r\nAuthorization: {slow}\r\n\r\n"
                         .encode())
            busy.append((reader, writer))
        await until(lambda: sum(c.busy for conns in ls.server.limits.connections.values()
                                for c in conns) == limits.MAX_CONNECTIONS_PER_ADDRESS)
        idle = []
        for i in range(limits.MAX_CONNECTIONS // limits.MAX_CONNECTIONS_PER_ADDRESS - 1):
            for _ in range(limits.MAX_CONNECTIONS_PER_ADDRESS):
                idle.append(await asyncio.open_connection(
                    "127.0.0.1", ls.port, local_addr=(f"127.0.9.{i + 1}", 0)))
        await until(lambda: ls.server.limits.total == limits.MAX_CONNECTIONS)
        status, _, _ = await ls.ask(token(uid="uid-newcomer"), source="127.0.8.200")
        assert status == 200
        assert ls.server.limits.evicted == 1
        # The busy ones were not cut: each gets its answer (503 once its wait is over).
        for reader, _ in busy:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 503 ")
        for _, w in busy + idle:
            w.close()
    serving(body, wait_budget=3.0)
