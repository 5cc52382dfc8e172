"""One Kubernetes resource, listed and watched for as long as the control process lives.

kube2iam's informer resynced every 30 min and dropped bookmarks; kiam kept a cluster-wide
cache in a separate server.  kiamfast lists and watches exactly what one node needs (its
pods by ``fieldSelector``, the namespaces when a policy reads them, its own Node) on the
event loop, with kiamfast's own API client (:mod:`kiamfast.kube`): raw lines parsed with
orjson, no model objects.  Protocol (reference/techniques.md B4):

* LIST (the first one with ``resourceVersion=0``, served from the API server's cache; relists
  without, for a consistent read), handed over as one batch;
* WATCH from the list's resourceVersion with ``allowWatchBookmarks=true``, a jittered
  ``timeoutSeconds`` (240-300 s) and a client inactivity timeout (a half-dead connection is
  noticed); resumed from the last event's or bookmark's resourceVersion;
* 410 Gone (an ERROR event with code 410, or HTTP 410): relist;
* errors (429, 5xx, refused or dropped connections): retry with jittered exponential
  backoff, honouring Retry-After; never give up;
* a watch that is not a stream (it ends at once with no event or bookmark, or its body is
  not watch events, e.g. a list from a proxy that drops ``watch=true``): an error, logged
  once per episode, backed off, counted as ``empty_watches`` / ``bad_watch_bodies``;
* ``resync``: a periodic relist, as a safety net.

What it must never do: stop watching, or hand over events out of order.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from kiamfast.budget import Episode, backoff
from kiamfast.kube.errors import ApiError, ApiUnavailable

log = logging.getLogger("kiamfast.watch")

LOG_EVERY = 30.0    # at most one line per outage this often

# The event types of a watch stream (watch.Event in apimachinery).
_WATCH_TYPES = frozenset(("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"))

Event = tuple[str, dict[str, Any]]


class WatchGone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class WatchNotStreaming(Exception):
    """A watch answered with something other than a live stream (``kind`` names how)."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class WatchTimings:
    watch_timeout: tuple[float, float] = (240.0, 300.0)
    inactivity: float = 120.0
    connect: float = 5.0
    list_timeout: float = 60.0
    backoff: tuple[float, float] = (0.1, 30.0)
    resync: float = 1800.0


@dataclass
class ResourceWatch:
    """LIST + WATCH of ``path`` (e.g. ``/api/v1/pods``), handing ``on_list(items, list_rv)`` and
    ``on_event(type, object)`` to the caller on the event loop, in order (the caller
    coalesces its commits: a burst of events read at once costs one)."""

    client: Any                                   # kiamfast.kube.client.Client
    name: str                                     # for logs and counters
    path: str
    on_list: Callable[[list[dict[str, Any]], int], None]
    on_event: Callable[[str, dict[str, Any]], None]
    params: Mapping[str, str] = field(default_factory=dict)   # e.g. a fieldSelector
    timings: WatchTimings = field(default_factory=WatchTimings)
    counters: dict[str, int] = field(default_factory=lambda: {
        "lists": 0, "relists": 0, "watches": 0, "events": 0, "bookmarks": 0, "gone": 0,
        "errors": 0, "empty_watches": 0, "bad_watch_bodies": 0})
    listed: asyncio.Event = field(default_factory=asyncio.Event)
    # Told each change between failing (the error) and answering (""): /healthz shows it.
    on_state: Callable[[str], None] = lambda error: None
    _outage: Episode = field(default_factory=lambda: Episode(every=LOG_EVERY))
    _not_streaming: int = 0                 # watches in a row that were not streams

    async def run(self) -> None:
        rv = ""
        need_list, first = True, True
        failures = 0
        next_resync = 0.0
        t = self.timings
        while True:
            try:
                if need_list:
                    rv = await self._list(initial=first)
                    self.counters["lists" if first else "relists"] += 1
                    first = need_list = False
                    failures = 0
                    next_resync = time.monotonic() + t.resync * random.uniform(0.9, 1.0)
                timeout = random.uniform(*t.watch_timeout)
                if t.resync > 0:
                    timeout = min(timeout, max(1.0, next_resync - time.monotonic()))
                rv, got = await self._watch(rv, timeout)
                self._answering()
                if got:
                    failures = 0
                if t.resync > 0 and time.monotonic() >= next_resync:
                    need_list = True
            except WatchNotStreaming as e:
                failures += 1
                self._not_streaming += 1
                self.counters[e.kind] += 1
                delay = self._delay(failures, None)
                if self._not_streaming == 1:   # once per episode; the counter has the rest
                    log.warning("%s watch: %s; backing off (%.2fs, growing), counted as "
                                "kiamfast_watch_total{kind=\"%s\"}, logged once until the "
                                "watch streams again", self.name, e, delay, e.kind)
                await asyncio.sleep(delay)
            except WatchGone:
                self.counters["gone"] += 1
                log.info("%s watch: resourceVersion %s expired (410); relisting", self.name, rv)
                need_list = True
                failures += 1      # a 410 right after a list would loop: be polite
                await asyncio.sleep(self._delay(failures, None) if failures > 1 else 0.0)
            except (ApiError, ApiUnavailable) as e:
                failures += 1
                self.counters["errors"] += 1
                if isinstance(e, ApiError) and e.status == 410:
                    self.counters["gone"] += 1
                    need_list = True
                    await asyncio.sleep(self._delay(failures, None) if failures > 1 else 0.0)
                    continue
                delay = self._delay(failures, getattr(e, "retry_after", None))
                self._failing(f"{'list' if need_list else 'watch'} failed ({e})", delay)
                await asyncio.sleep(delay)

    def _failing(self, error: str, delay: float) -> None:
        """An outage: one log line when it begins, then at most one every LOG_EVERY
        seconds (a bare agent outside a cluster must not fill its log)."""
        if self._outage.failed():
            log.warning("%s %s; retrying in %.2fs (failing for %.0fs; logged at most every "
                        "%.0fs)", self.name, error, delay, self._outage.lasted, LOG_EVERY)
        self.on_state(error)

    def _answering(self) -> None:
        lasted = self._outage.lasted
        if self._outage.recovered():
            log.info("%s: the API server answers again after %.0fs", self.name, lasted)
            self.on_state("")

    def _delay(self, failures: int, retry_after: float | None) -> float:
        base, cap = self.timings.backoff
        d = backoff(failures, base=base, cap=cap)
        return max(d, retry_after) if retry_after is not None else d

    async def _list(self, *, initial: bool) -> str:
        params = dict(self.params)
        if initial:
            params["resourceVersion"] = "0"   # served from the API server's cache
        response = await self.client.request("GET", self.path, params=params,
                                             timeout=self.timings.list_timeout)
        body = orjson.loads(response.body)
        items = body.get("items") or []
        rv = (body.get("metadata") or {}).get("resourceVersion") or ""
        log.debug("%s list: %d items at resourceVersion %s", self.name, len(items), rv)
        self._answering()
        self.listed.set()
        self.on_list(items, _int_rv(rv))
        return rv

    async def _watch(self, rv: str, timeout: float) -> tuple[str, bool]:
        """One watch request; returns (last resourceVersion, whether anything arrived)."""
        params = {**self.params, "watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(max(1, int(timeout)))}
        if rv:
            params["resourceVersion"] = rv
        got = False
        started = time.monotonic()
        self.counters["watches"] += 1
        async with self.client.stream(self.path, params=params,
                                      timeout=(self.timings.connect,
                                               self.timings.inactivity)) as stream:
            async for line in stream.lines():
                typ, obj = watch_event(line)
                if typ == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise WatchGone(obj.get("message", "Gone"))
                    raise ApiError(int(code or 0), message=f"watch ERROR: "
                                   f"{obj.get('message', '')}")
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    rv = new_rv
                if not got and self._not_streaming:
                    log.info("%s watch streaming again after %d watches that were not",
                             self.name, self._not_streaming)
                    self._not_streaming = 0
                got = True
                if typ == "BOOKMARK":    # only moves the resourceVersion resumed from
                    self.counters["bookmarks"] += 1
                else:
                    self.counters["events"] += 1
                    self.on_event(typ, obj)
        # A quiet watch runs its whole timeout; one that ends long before, having sent not
        # even a bookmark, is not a stream (a list, a proxy, a broken server).
        if not got and time.monotonic() - started < int(timeout) / 2:
            raise WatchNotStreaming("the watch ended at once with no event or bookmark",
                                    kind="empty_watches")
        return rv, got


def watch_event(line: bytes) -> Event:
    """(type, object) of one watch stream line; WatchNotStreaming if it is not an event."""
    try:
        ev = orjson.loads(line)
    except orjson.JSONDecodeError:
        ev = None
    if not isinstance(ev, dict) or ev.get("type") not in _WATCH_TYPES \
            or not isinstance(ev.get("object") or {}, dict):
        raise WatchNotStreaming(f"the body was not watch events ({_excerpt(line)})",
                                kind="bad_watch_bodies")
    return ev["type"], ev.get("object") or {}


def _int_rv(rv: str) -> int:
    try:
        return int(rv)
    except (TypeError, ValueError):
        return 0


def _excerpt(data: bytes, limit: int = 80) -> str:
    text = data.strip()[:limit].decode("utf-8", "replace")
    return repr(text + ("..." if len(data.strip()) > limit else ""))
