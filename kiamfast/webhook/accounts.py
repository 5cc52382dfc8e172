"""The annotations of a pod's ServiceAccount, for the webhook's opt-in: one bounded GET per
account, cached briefly.

A ReplicaSet of 1,000 pods of one ServiceAccount costs one GET per `TTL`, not 1,000: an
answer is cached for `TTL` seconds (so an annotation changed on the ServiceAccount reaches
new pods at most that much later), and pods asking for the same account while its GET is in
flight wait for that one.  A read that fails (timeout, 403, 404, the API server down) answers
None, which the webhook treats as "this ServiceAccount opts nobody in"; the failure is cached
for `FAILED_TTL`, so a burst of pods during an outage does not wait out the timeout one by
one.  One log line when reads start failing, one when they work again.

What it must never do: block longer than about `READ_TIMEOUT` (the API server's call to the
webhook has its own timeout, 5 s in the chart), or raise.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable
from urllib.parse import quote

log = logging.getLogger("kiamfast.webhook")

READ_TIMEOUT = 2.0
TTL = 15.0
FAILED_TTL = 5.0
CACHE_SIZE = 1024

Annotations = dict[str, str]


def service_account_read(make_client: Callable[[], Any]) -> Callable[[str, str], Annotations]:
    """A blocking GET of a ServiceAccount through the agent's API client (``kiamfast.kube``,
    its thread-safe ``request_sync``): its annotations.  The client is made at the first
    read, and again after a read that could not make it (no in-cluster credentials yet):
    that is a failed read like any other, never a webhook that does not start.  One attempt,
    each socket operation bounded by `READ_TIMEOUT` (the client never retries)."""
    clients: list[Any] = []

    def read(namespace: str, name: str) -> Annotations:
        if not clients:
            clients.append(make_client())
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/serviceaccounts/" \
               f"{quote(name, safe='')}"
        account = clients[0].request_sync("GET", path, timeout=READ_TIMEOUT).json()
        annotations = (account.get("metadata") or {}).get("annotations") or {}
        if not isinstance(annotations, dict):
            raise ValueError("metadata.annotations is not an object")
        return {k: v for k, v in annotations.items() if isinstance(v, str)}
    return read


def api_client(*, kubeconfig: str = "") -> Any:
    """The webhook's API client: `--kubeconfig`, else in-cluster, as the agent's."""
    from kiamfast.kube.client import Client
    from kiamfast.kube.config import load_config
    return Client(load_config(kubeconfig=kubeconfig))


class AccountAnnotations:
    """`get(namespace, name)`: the ServiceAccount's annotations, or None if they cannot be
    read; thread-safe (the webhook serves a thread per connection)."""

    def __init__(self, read: Callable[[str, str], Annotations], *, ttl: float = TTL,
                 failed_ttl: float = FAILED_TTL, size: int = CACHE_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read = read
        self.ttl, self.failed_ttl, self.size = ttl, failed_ttl, size
        self.clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], tuple[float, Annotations | None]] = \
            OrderedDict()
        self._inflight: dict[tuple[str, str], threading.Event] = {}
        self.failing = ""             # why reads fail, until one works again
        self.reads = 0

    def get(self, namespace: str, name: str) -> Annotations | None:
        key = (namespace, name)
        while True:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None and hit[0] > self.clock():
                    return hit[1]
                pending = self._inflight.get(key)
                if pending is None:
                    pending = self._inflight[key] = threading.Event()
                    break
            # Another thread is reading this account: its answer will be in the cache.
            if not pending.wait(READ_TIMEOUT + 1.0):
                return None
        try:
            annotations = self._read(namespace, name)
            with self._lock:
                ttl = self.ttl if annotations is not None else self.failed_ttl
                self._cache[key] = (self.clock() + ttl, annotations)
                self._cache.move_to_end(key)
                while len(self._cache) > self.size:
                    self._cache.popitem(last=False)
            return annotations
        finally:
            with self._lock:
                del self._inflight[key]
            pending.set()

    def _read(self, namespace: str, name: str) -> Annotations | None:
        self.reads += 1
        try:
            annotations = self.read(namespace, name)
        except Exception as e:
            reason = f"{type(e).__name__}: {getattr(e, 'status', '') or e}"[:300]
            with self._lock:
                first, self.failing = not self.failing, reason
            if first:
                log.warning("cannot read ServiceAccounts (%s/%s: %s): pods opting in by "
                            "their ServiceAccount are admitted untouched until it works "
                            "again", namespace, name, reason)
            return None
        with self._lock:
            recovered, self.failing = bool(self.failing), ""
        if recovered:
            log.info("reading ServiceAccounts works again")
        return annotations
