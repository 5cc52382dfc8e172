"""Ask the node's kubelet which pods it runs, when a caller's address is unknown.

A container can call the metadata service before the API server has published its pod's
IP (the kubelet writes `status.podIPs` after the sandbox is up; the watch delivers it a bit
later).  kube2iam then served the default role or a 404 after a blind 2 s retry.  The kubelet
itself knows first, so when a worker reports a request from an unknown address, the control
process asks `GET <kubelet>/pods` and hands the answer to the ownership model, which only
*adds* what the watch has not said yet (ownership.py explains why a stale kubelet view can
never take an address from a newer pod).

The lookup is cheap for the kubelet and bounded for us:

* coalesced: one request in flight; addresses reported meanwhile wait for it, and only if
  one of them is still unknown afterwards is another request made;
* rate-limited: requests start at least `min_interval` apart (5/s by default);
* bounded: `timeout` (300 ms) for connect and read, so a slow kubelet never holds a worker's
  wait budget hostage;
* a short negative cache: an address the kubelet did not know is not asked about again for
  `negative_ttl` (a caller that is no pod, e.g. a hostNetwork process, costs nothing).

Authentication: a bearer token (the one the kube client uses, or the in-cluster service
account token, re-read from its file since bound tokens rotate) and TLS verification off by
default (`--kubelet-insecure`): kubelet serving certificates are usually self-signed.

What it must never do: block the event loop (the HTTP call runs in a thread), release or
re-rank anything the watch said, or retry in a tight loop against a failing kubelet.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any, Callable, Iterable

import orjson
import urllib3

log = logging.getLogger("kiamfast.kubelet")

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class KubeletError(Exception):
    """The kubelet did not answer usefully (connection, timeout, status, body)."""


def token_from_file(path: str = SERVICE_ACCOUNT_TOKEN, *,
                    ttl: float = 60.0) -> Callable[[], str | None]:
    """A token source re-reading `path` at most every `ttl` seconds (bound tokens rotate)."""
    cache: dict[str, Any] = {"at": -ttl * 2, "token": None}

    def get() -> str | None:
        now = time.monotonic()
        if now - cache["at"] > ttl:
            try:
                with open(path) as f:
                    cache["token"] = f.read().strip() or None
            except OSError:
                cache["token"] = None
            cache["at"] = now
        return cache["token"]
    return get


class KubeletClient:
    """`GET <url>/pods` with a bounded timeout, in a worker thread."""

    def __init__(
        self,
        url: str,
        *,
        token: str | Callable[[], str | None] | None = None,
        insecure: bool = True,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        timeout: float = 0.3,
    ) -> None:
        self.url = url.rstrip("/") + "/pods"
        self._token = token if callable(token) else (lambda: token)
        kw: dict[str, Any] = {"num_pools": 1, "maxsize": 2, "retries": False,
                              "timeout": urllib3.Timeout(connect=timeout, read=timeout)}
        if self.url.startswith("https:"):
            if insecure:
                kw["cert_reqs"] = ssl.CERT_NONE
                kw["assert_hostname"] = False
                urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
            else:
                kw["cert_reqs"] = ssl.CERT_REQUIRED
                if ca_file:
                    kw["ca_certs"] = ca_file
            if cert_file:
                kw["cert_file"] = cert_file
                kw["key_file"] = key_file
        self._pool = urllib3.PoolManager(**kw)

    def get_pods(self) -> list[dict[str, Any]]:
        """The pods the kubelet runs (blocking; call from a thread)."""
        headers = {"Accept": "application/json"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            r = self._pool.request("GET", self.url, headers=headers, preload_content=True)
        except urllib3.exceptions.HTTPError as e:
            raise KubeletError(f"GET {self.url}: {e}") from e
        if r.status != 200:
            raise KubeletError(f"GET {self.url}: HTTP {r.status}")
        try:
            items = orjson.loads(r.data).get("items") or []
        except (orjson.JSONDecodeError, AttributeError) as e:
            raise KubeletError(f"GET {self.url}: bad body: {e}") from e
        return [p for p in items if isinstance(p, dict)]

    def close(self) -> None:
        self._pool.clear()


class KubeletLookup:
    """Coalesced, rate-limited kubelet lookups for unknown addresses, on the event loop.

    `knows(ip)` says whether the model already has the address; `apply(pods)` hands a
    kubelet answer to the model (and commits).  Call `request(ip)` from the loop.
    """

    def __init__(
        self,
        client: KubeletClient,
        *,
        knows: Callable[[str], bool],
        apply: Callable[[list[dict[str, Any]]], Any],
        min_interval: float = 0.2,
        negative_ttl: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.knows = knows
        self.apply = apply
        self.min_interval = min_interval
        self.negative_ttl = negative_ttl
        self.clock = clock
        self._waiting: set[str] = set()
        self._negative: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_start = -1e9
        self.counters = {"requests": 0, "errors": 0, "found": 0, "not_found": 0,
                         "coalesced": 0, "suppressed": 0}

    def request(self, ips: str | Iterable[str]) -> None:
        """Addresses some worker could not find: look them up soon (never twice at once)."""
        now = self.clock()
        for ip in ([ips] if isinstance(ips, str) else ips):
            if self.knows(ip):
                continue
            until = self._negative.get(ip)
            if until is not None and now < until:
                self.counters["suppressed"] += 1
                continue
            if self._task is not None and not self._task.done():
                self.counters["coalesced"] += 1
            self._waiting.add(ip)
        if self._waiting and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            wait = self._last_start + self.min_interval - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)
            asking = self._waiting
            self._waiting = set()
            self._last_start = self.clock()
            self.counters["requests"] += 1
            try:
                pods = await loop.run_in_executor(None, self.client.get_pods)
            except KubeletError as e:
                self.counters["errors"] += 1
                log.warning("kubelet lookup failed: %s", e)
                for ip in asking:
                    self._negative[ip] = self.clock() + self.negative_ttl
                continue
            self.apply(pods)
            now = self.clock()
            for ip in asking:
                if self.knows(ip):
                    self.counters["found"] += 1
                    self._negative.pop(ip, None)
                else:
                    self.counters["not_found"] += 1
                    self._negative[ip] = now + self.negative_ttl
            # Addresses reported while this request was in flight may have been answered by
            # it; ask again only for those still unknown.
            self._waiting = {ip for ip in self._waiting if not self.knows(ip)}
            if len(self._negative) > 4096:
                self._negative = {k: v for k, v in self._negative.items() if v > now}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.client.close()
