"""What clients did to the API server emulator: ``ApiServer.traffic``.

Counters of requests, lists, watches, events and bytes (the HTTP front end records them,
apiserver_http.py), and the watches open now, so a test can wait for a client to be
watching before it changes the cluster, and a benchmark can count what a node costs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kiamfast.testing.apiserver_store import Store

__all__ = ["Traffic"]


def _zero() -> dict[str, Any]:
    return {"requests": 0, "lists": 0, "gets": 0, "patches": 0, "watches": 0,
            "watches_open": 0, "watch_events_sent": 0, "bookmarks_sent": 0,
            "watch_errors_sent": 0, "bytes_sent": 0, "errors": 0, "faults_injected": 0,
            "lists_by_node": {}, "watches_by_node": {}}


class Traffic:
    """``api.traffic``: counters since start (``stats``, ``reset``) and open watches
    (``watch_count``, ``wait_watches``)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = _zero()

    def record(self, **deltas: int) -> None:
        """Add to counters (the front end, per request)."""
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def record_node(self, table: str, node: str | None) -> None:
        """Count one request in a per-node table (``lists_by_node``, ``watches_by_node``)."""
        if node is None:
            return
        with self._lock:
            d = self._stats[table]
            d[node] = d.get(node, 0) + 1

    def stats(self) -> dict:
        """Counters since start (or the last ``reset``); per-node dicts are copies."""
        with self._lock:
            out = dict(self._stats)
            out["lists_by_node"] = dict(out["lists_by_node"])
            out["watches_by_node"] = dict(out["watches_by_node"])
        with self._store.lock:
            out["resource_version"] = self._store.rv
        return out

    def reset(self) -> None:
        """Zero the counters (the open watches stay counted in ``watches_open``)."""
        with self._lock:
            open_now = self._stats["watches_open"]
            self._stats = _zero()
            self._stats["watches_open"] = open_now

    def watch_count(self, *, node: str | None = None, kind: str = "Pod") -> int:
        """Open watches of ``kind`` (only those selecting ``spec.nodeName=node`` if given)."""
        return sum(1 for w in self._store.all_watchers()
                   if w.kind == kind and (node is None or w.node == node))

    def wait_watches(self, n: int = 1, *, node: str | None = None, kind: str = "Pod",
                     timeout: float = 5.0) -> bool:
        """Wait until at least ``n`` matching watches are open; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.watch_count(node=node, kind=kind) >= n:
                return True
            time.sleep(0.01)
        return self.watch_count(node=node, kind=kind) >= n
