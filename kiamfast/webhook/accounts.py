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

import orjson

log = logging.getLogger("kiamfast.webhook")

READ_TIMEOUT = 2.0
TTL = 15.0
FAILED_TTL = 5.0
CACHE_SIZE = 1024

Annotations = dict[str, str]


def service_account_read(make_client: Callable[[], Any]) -> Callable[[str, str], Annotations]:
    """A blocking GET of a ServiceAccount through the kubernetes client: its annotations.
    The client is made at the first read, and again after a read that could not make it (no
    in-cluster credentials yet): that is a failed read like any other, never a webhook that
    does not start.  It must not retry (`api_client_without_retries`): urllib3 retries a GET
    three times by default, which would multiply the timeout by four."""
    from kubernetes import client as kclient
    apis: list[Any] = []

    def read(namespace: str, name: str) -> Annotations:
        if not apis:
            apis.append(kclient.CoreV1Api(make_client()))
        resp = apis[0].read_namespaced_service_account(
            name, namespace, _preload_content=False, _request_timeout=READ_TIMEOUT)
        try:
            account = orjson.loads(resp.data)
        finally:
            resp.release_conn()
        annotations = (account.get("metadata") or {}).get("annotations") or {}
        if not isinstance(annotations, dict):
            raise ValueError("metadata.annotations is not an object")
        return {k: v for k, v in annotations.items() if isinstance(v, str)}
    return read


def api_client_without_retries(*, kubeconfig: str = "") -> Any:
    """The webhook's API client: `--kubeconfig`, else in-cluster (as the agent's, which the
    webhook does not import), with urllib3's retries off so `READ_TIMEOUT` bounds a whole
    read."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    configuration = kclient.Configuration()
    if kubeconfig:
        kconfig.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        kconfig.load_incluster_config(client_configuration=configuration)
    configuration.retries = False
    return kclient.ApiClient(configuration)


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
