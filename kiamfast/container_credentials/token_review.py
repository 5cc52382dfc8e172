"""Which pod a projected service-account token names: the API server's TokenReview, cached.

A token is first read without verifying it (`unverified_claims`), only to turn away what
the API server would refuse anyway (not a JWT, another audience, expired, not bound to a
pod) without asking it.  Those claims only ever reject: a pod is named only by a review that
the API server answered ``authenticated`` for our audience, whose user is the token's
ServiceAccount and whose extras name the bound pod.  The verdict is cached by the token's
hash until the token expires (the kubelet rotates a projected token at 80 % of its life, so
a pod brings a new token, and one review, every few minutes); whether the pod still exists
on this node is asked of the pod view on every request, never cached here.  What is kept is
what is live: an accepted verdict goes when its token expires or its pod is gone from the
view (swept each time the cache has doubled since the last sweep), a refusal after
`REJECTED_TTL`; `CACHE_SIZE` of each at most, and a verdict forgotten only costs a review.

A review can also complete unauthenticated because the API server could not check the token
right now (its own lookup of the ServiceAccount or pod failed): that is answered 503 and
never cached; only the API server's definite refusals are (`definite_refusal`).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import re
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import orjson

from kiamfast.container_credentials.review_queue import Job, QueueFull, ReviewQueue

if TYPE_CHECKING:
    from kiamfast.kube.wire import Response

log = logging.getLogger("kiamfast.container_credentials")

MAX_TOKEN_BYTES = 16384
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"
REVIEW_WAIT = 1.5              # a request waits this long for its verdict, queue included
REVIEW_TIMEOUT = 2.0           # each socket operation of the API call (its verdict is cached
                               # when it comes after its request gave up: the SDK retries)
REVIEW_THREADS = 4
MAX_PENDING_REVIEWS = 64       # reviews waiting or running, in all ...
MAX_PENDING_PER_ADDRESS = 4    # ... and for one client address
REJECTED_TTL = 60.0            # a refused token is refused again without asking
CACHE_SIZE = 4096              # verdicts of each kind at most (the least recently used go)
SWEEP_MIN = 128                # accepted verdicts past which expired and dead ones are swept
LOG_EVERY = 10.0               # one info line per kind of event this often; debug else


class TokenRejected(Exception):
    """The answer a request gets instead of credentials: HTTP status, Code, Message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def invalid(message: str) -> TokenRejected:
    return TokenRejected(400, "InvalidToken", message)


def unavailable(message: str) -> TokenRejected:
    return TokenRejected(503, "ServiceUnavailable", message)


@dataclass(frozen=True, slots=True)
class BoundPod:
    """The pod a reviewed token is bound to, and until when the token is valid."""
    namespace: str
    service_account: str
    name: str
    uid: str
    expires: float


def _b64url(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def unverified_claims(token: str) -> dict[str, Any]:
    """The JWT's payload, unverified; `TokenRejected` (400) if it is not a JWT."""
    if not token or len(token) > MAX_TOKEN_BYTES:
        raise invalid("missing or oversized Authorization token")
    parts = token.split(".")
    if len(parts) != 3:
        raise invalid("the Authorization token is not a JWT")
    try:
        claims = orjson.loads(_b64url(parts[1]))
    except (binascii.Error, ValueError):
        raise invalid("the Authorization token is not a JWT") from None
    if not isinstance(claims, dict):
        raise invalid("the Authorization token is not a JWT")
    return claims


def bound_pod(claims: dict[str, Any]) -> BoundPod:
    """The pod the token's claims name; 400 if they name none (a legacy or unbound token)."""
    k8s = claims.get("kubernetes.io")
    pod = k8s.get("pod") if isinstance(k8s, dict) else None
    sa = k8s.get("serviceaccount") if isinstance(k8s, dict) else None
    exp = claims.get("exp")
    if not (isinstance(pod, dict) and isinstance(sa, dict) and isinstance(exp, (int, float))):
        raise invalid("the token is not a service-account token bound to a pod")
    return BoundPod(namespace=str(k8s.get("namespace") or ""), service_account=str(
        sa.get("name") or ""), name=str(pod.get("name") or ""), uid=str(pod.get("uid") or ""),
        expires=float(exp))


def precheck(token: str, audience: str, now: float) -> BoundPod:
    """What can be refused without the API server (never what is accepted)."""
    claims = unverified_claims(token)
    aud = claims.get("aud")
    audiences = aud if isinstance(aud, list) else [aud]
    if audience not in audiences:
        raise invalid(f"the token is not for audience {audience!r}")
    pod = bound_pod(claims)
    if pod.expires <= now:
        raise invalid("the token has expired")
    return pod


# What kube-apiserver's service-account authenticator says when it refuses a token for
# good (k8s.io/kubernetes v1.34 pkg/serviceaccount/{jwt,claims}.go, go-jose v2): the token
# is another's, expired, forged, or its ServiceAccount or pod is gone or was replaced.  The
# same token is refused again however often it is asked.  `status.error` joins the messages
# of every authenticator that failed, e.g. "[invalid bearer token, service account token has
# expired]" from the real server, so these are searched for, not matched.
_DEFINITE = re.compile("|".join((
    r"service account token has expired",
    r"is invalid for the target audiences",                 # another audience
    r"token issuer \".*\" is invalid",
    r"go-jose/go-jose",                                     # bad signature, mangled claims
    r"service account UID \(.*\) does not match claim",    # the account was recreated
    r"service account \S+ has been deleted",
    r'serviceaccounts "[^"]*" not found',                   # its lookup: NotFound
    r"pod UID \(.*\) does not match service account pod ref claim",   # pod recreated
)))
# Everything else is "could not check right now", answered 503 and asked again next time:
# * "service account token has been invalidated": the bound pod's lookup failed, and
#   claims.go says so for a NotFound (a deleted pod) and for any other error alike (its
#   storage timing out); the pod view tells the deleted pod apart (403) once the watch
#   delivers the deletion;
# * the raw text of a ServiceAccount lookup that failed otherwise than NotFound;
# * "not valid yet" / "issued in the future": clock skew between API servers, gone soon;
# * "invalid signature, no keys found": also an external signer whose keys the API server
#   could not fetch (externaljwt keycache.go);
# * another authenticator's outage (a webhook's), anything this list does not know.
# "invalid bearer token" alone is definite: no authenticator took the token for its own
# (another issuer) and none failed (bearertoken.go gives that text when none erred).  No
# text at all is too: the API server has no token authenticator to ask.
_NOBODY_KNEW = "invalid bearer token"


def definite_refusal(error: str) -> bool:
    """Whether a review's `status.error` refuses the token for good (cacheable)."""
    return error in ("", _NOBODY_KNEW) or _DEFINITE.search(error) is not None


def verdict(status: dict[str, Any], claimed: BoundPod, audience: str) -> BoundPod:
    """The bound pod if the review's status authenticates `claimed` for `audience`; 400 if
    the API server refused the token for good, 503 if it could not check it just now."""
    if not status.get("authenticated"):
        error = str(status.get("error") or "")
        if not definite_refusal(error):
            raise unavailable("the API server could not check the token just now: "
                              + error[:200])
        raise invalid("the API server did not authenticate the token: "
                      + (error or "no reason given")[:200])
    if audience not in (status.get("audiences") or []):
        raise invalid(f"the token is not for audience {audience!r}")
    user = status.get("user") or {}
    extra = user.get("extra") or {}
    want = f"{SA_PREFIX}{claimed.namespace}:{claimed.service_account}"
    if (user.get("username") != want or extra.get(POD_NAME_EXTRA) != [claimed.name]
            or extra.get(POD_UID_EXTRA) != [claimed.uid]):
        raise invalid("the token is not bound to the pod it names")
    return claimed


class SyncRequests(Protocol):
    """The API client's blocking calls (kiamfast.kube.client.Client, or the control
    process's link that holds one)."""

    def request_sync(self, method: str, path: str, *, body: Any = None,
                     timeout: float = 30.0) -> Response: ...


def token_review_call(client: SyncRequests) -> Callable[[str, str], dict[str, Any]]:
    """A blocking TokenReview through kiamfast's API client (on the reviewer's threads, each
    with a connection of its own): (token, audience) -> status."""
    def call(token: str, audience: str) -> dict[str, Any]:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [audience]}}
        response = client.request_sync("POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                                       body=body, timeout=REVIEW_TIMEOUT)
        return orjson.loads(response.body).get("status") or {}
    return call


class TokenReviewer:
    """Reviews tokens with at most `REVIEW_THREADS` API calls at once, the rest waiting in a
    bounded queue shared by address (`review_queue.py`); verdicts cached."""

    def __init__(self, call: Callable[[str, str], dict[str, Any]], *, audience: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.call = call
        self.audience = audience
        self.clock = clock
        self.pool = ThreadPoolExecutor(max_workers=REVIEW_THREADS,
                                       thread_name_prefix="tokenreview")
        self.queue = ReviewQueue(threads=REVIEW_THREADS, limit=MAX_PENDING_REVIEWS,
                                 per_address=MAX_PENDING_PER_ADDRESS)
        self._accepted: OrderedDict[bytes, BoundPod] = OrderedDict()
        # token hash -> (until, status, code, message), oldest first: the same TTL for all
        self._rejected: OrderedDict[bytes, tuple[float, int, str, str]] = OrderedDict()
        self._inflight: dict[bytes, Job] = {}
        # Whether a reviewed pod is still one to answer for (the server's pod view): the
        # verdicts of the others are swept.
        self.alive: Callable[[BoundPod], bool] = lambda pod: True
        self._sweep_at = SWEEP_MIN
        self.stats = {"reviews": 0, "cached": 0, "review_errors": 0, "undecided": 0,
                      "queue_full": 0, "dropped": 0}
        self.last_error = ""          # the last review that failed, until one succeeds
        self._undecided_logged = -LOG_EVERY

    def cached(self, token: str) -> BoundPod | None:
        """The cached verdict for `token` (raises a cached rejection), or None: ask review()."""
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        pod = self._accepted.get(key)
        if pod is not None:
            if pod.expires > now:
                self.stats["cached"] += 1
                return pod
            del self._accepted[key]
        refused = self._rejected.get(key)
        if refused is not None:
            until, status, code, message = refused
            if until > now:
                self.stats["cached"] += 1
                # A new exception each time: re-raising one object grows its traceback by
                # the frames of every request that raises it.
                raise TokenRejected(status, code, message)
            del self._rejected[key]
        return None

    async def review(self, token: str, claimed: BoundPod, *, address: str = "",
                     wait: float = REVIEW_WAIT) -> BoundPod:
        """The API server's verdict, waited for at most ``wait`` seconds (then 503); one
        call per distinct token in flight, queued for ``address`` (429 when its share or
        the queue is full)."""
        key = hashlib.sha256(token.encode()).digest()
        job = self._inflight.get(key)
        if job is None:
            try:
                job = self.queue.submit(address, lambda: self._review(key, token, claimed))
            except QueueFull:
                self.stats["queue_full"] += 1
                raise TokenRejected(429, "TooManyRequests", "too many new tokens waiting "
                                    "for review from this address") from None
            self._inflight[key] = job
        job.waiters += 1
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), wait)
        except asyncio.TimeoutError:
            raise unavailable("the API server did not answer the TokenReview in time") \
                from None
        finally:
            job.waiters -= 1
            if not job.waiters and self.queue.abandon(job):
                del self._inflight[key]           # nobody waits: never sent
                self.stats["dropped"] += 1

    async def _review(self, key: bytes, token: str, claimed: BoundPod) -> BoundPod:
        try:
            return await self._call(key, token, claimed)
        finally:
            self._inflight.pop(key, None)

    async def _call(self, key: bytes, token: str, claimed: BoundPod) -> BoundPod:
        loop = asyncio.get_running_loop()
        self.stats["reviews"] += 1
        try:
            status = await loop.run_in_executor(self.pool, self.call, token, self.audience)
        except Exception as e:        # the API server is down or refuses us: not the pod's fault
            self.stats["review_errors"] += 1
            self.last_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("TokenReview failed: %s", self.last_error)
            raise unavailable("the agent cannot review tokens right now") from None
        self.last_error = ""
        try:
            pod = verdict(status, claimed, self.audience)
        except TokenRejected as e:
            if e.status == 503:       # asked again next time: the API server was unsure
                self.stats["undecided"] += 1
                self._log_undecided(e.message)
            else:
                self._refused(key, e)
            raise
        self._accept(key, pod)
        return pod

    def _accept(self, key: bytes, pod: BoundPod) -> None:
        self._remember(self._accepted, key, pod)
        if len(self._accepted) > self._sweep_at:
            now = self.clock()
            for k in [k for k, p in self._accepted.items()
                      if p.expires <= now or not self.alive(p)]:
                del self._accepted[k]
            self._sweep_at = max(SWEEP_MIN, 2 * len(self._accepted))

    def _refused(self, key: bytes, e: TokenRejected) -> None:
        now = self.clock()
        self._remember(self._rejected, key, (now + REJECTED_TTL, e.status, e.code, e.message))
        while next(iter(self._rejected.values()))[0] <= now:    # expired, oldest first
            self._rejected.popitem(last=False)

    def _log_undecided(self, message: str) -> None:
        now = time.monotonic()
        if now - self._undecided_logged >= LOG_EVERY:
            self._undecided_logged = now
            log.info("TokenReview undecided (answered 503, not cached): %s", message)
        else:
            log.debug("TokenReview undecided (answered 503, not cached): %s", message)

    def health(self) -> str:
        return f"TokenReview failing: {self.last_error}" if self.last_error else "ok"

    @staticmethod
    def _remember(cache: OrderedDict, key: bytes, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
