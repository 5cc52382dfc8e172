"""State of the API server emulator: objects, the resourceVersion, history, watchers.

This is the emulator's etcd plus watch cache. One lock guards everything; every change
bumps a single global resourceVersion (integers, across all kinds, like etcd revisions),
is recorded in a bounded history, and is fanned out to the open watches *inside* the same
critical section, so a watch never misses or reorders an event and a watch registered at
RV X gets exactly the events after X.

Objects are immutable once stored: a change builds a new dict and its orjson bytes, so
lists and watch streams serialize nothing under the lock and never see half a change.

Watch fan-out follows the real watch cache: a change is filtered per watch with the old and
the new object, so a pod that stops matching a field selector is delivered as ``DELETED``
(the previous object, with the event's resourceVersion) and one that starts matching as
``ADDED``. Pods and watches are indexed by ``spec.nodeName`` so 100 node agents each
watching their node cost one selector check per event, not a hundred.

It must never block on I/O while holding the lock: watchers only get items appended to
their queues; the HTTP layer does the writing.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Iterable

import orjson

from kiamfast.testing.apiserver_objects import KINDS, ApiError, FieldSelector

__all__ = ["AlreadyExistsError", "Event", "Expired", "NotFoundError", "Store", "Watcher",
           "bookmark_line", "error_line"]


class NotFoundError(KeyError):
    """The object the emulator was asked to change does not exist."""


class AlreadyExistsError(ValueError):
    """An object with that name already exists."""


class Expired(ApiError):
    """The requested resourceVersion fell out of the history window (410 Gone)."""

    def __init__(self, requested: int, floor: int) -> None:
        super().__init__(410, f"too old resource version: {requested} ({floor})", reason="Expired")


class Stored:
    __slots__ = ("obj", "raw")

    def __init__(self, obj: dict, raw: bytes) -> None:
        self.obj = obj
        self.raw = raw


class Event:
    """One committed change. ``old`` is the object before it (None for ADDED)."""

    __slots__ = ("rv", "kind", "type", "obj", "raw", "old", "_line", "_added", "_gone")

    def __init__(self, rv: int, kind: str, type_: str, obj: dict, raw: bytes,
                 old: dict | None) -> None:
        self.rv = rv
        self.kind = kind
        self.type = type_
        self.obj = obj
        self.raw = raw
        self.old = old
        self._line: bytes | None = None
        self._added: bytes | None = None
        self._gone: bytes | None = None

    def line(self) -> bytes:
        if self._line is None:
            self._line = b'{"type":"' + self.type.encode() + b'","object":' + self.raw + b"}\n"
        return self._line

    def added_line(self) -> bytes:
        if self._added is None:
            self._added = b'{"type":"ADDED","object":' + self.raw + b"}\n"
        return self._added

    def gone_line(self) -> bytes:
        """DELETED for a watch the object stopped matching: the previous object, new RV."""
        if self._gone is None:
            prev = dict(self.old or self.obj)
            prev["metadata"] = dict(prev["metadata"], resourceVersion=str(self.rv))
            self._gone = b'{"type":"DELETED","object":' + orjson.dumps(prev) + b"}\n"
        return self._gone

    def route(self, selector: FieldSelector | None) -> bytes | None:
        """The line a watch with ``selector`` gets for this event, or None."""
        if not selector:
            return self.line()
        if self.type == "MODIFIED":
            now = selector.matches(self.obj)
            before = self.old is not None and selector.matches(self.old)
            if now and before:
                return self.line()
            if now:
                return self.added_line()
            if before:
                return self.gone_line()
            return None
        return self.line() if selector.matches(self.obj) else None


class Item:
    """A queued watch line. ``rv`` advances the watch's position once delivered; while the
    item waits at the head of the queue a bookmark may claim ``safe_rv`` (None: no bookmark
    until it is delivered, e.g. the synthetic ADDED events of an initial state)."""

    __slots__ = ("deliver_at", "rv", "safe_rv", "line", "is_event", "is_bookmark")

    def __init__(self, deliver_at: float, rv: int | None, safe_rv: int | None,
                 line: bytes | None, *, is_event: bool = True, is_bookmark: bool = False) -> None:
        self.deliver_at = deliver_at
        self.rv = rv
        self.safe_rv = safe_rv
        self.line = line
        self.is_event = is_event
        self.is_bookmark = is_bookmark


class Watcher:
    """One open watch stream: a selector, a queue, and a condition to wake its writer."""

    __slots__ = ("kind", "selector", "node", "start_rv", "last_rv", "items", "cond",
                 "dropped", "sock", "delay")

    def __init__(self, kind: str, selector: FieldSelector | None, start_rv: int, *,
                 delay: float) -> None:
        self.kind = kind
        self.selector = selector if selector else None
        self.node = selector.node if selector else None
        self.start_rv = start_rv
        self.last_rv = start_rv
        self.items: collections.deque[Item] = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.dropped = False
        self.sock: Any = None
        self.delay = delay

    def push(self, item: Item) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify()

    def drop(self) -> None:
        with self.cond:
            self.dropped = True
            self.cond.notify()


def bookmark_line(kind: str, rv: int, *, initial_end: bool = False) -> bytes:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return orjson.dumps({"type": "BOOKMARK",
                         "object": {"kind": kind, "apiVersion": "v1", "metadata": meta}}) + b"\n"


def error_line(err: ApiError) -> bytes:
    return b'{"type":"ERROR","object":' + err.body() + b"}\n"


class Store:
    """Objects, the global resourceVersion, the event history and the open watches."""

    def __init__(self, *, history_window: int, first_rv: int = 1) -> None:
        if history_window < 0:
            raise ValueError("history_window must be >= 0")
        self.lock = threading.RLock()
        self.rv = first_rv
        self.history_window = history_window
        self.history: collections.deque[Event] = collections.deque()
        self.floor = first_rv        # every event with rv > floor is in history
        self.objs: dict[str, dict[tuple[str, str], Stored]] = {k: {} for k in KINDS}
        self.pods_by_node: dict[str, set[tuple[str, str]]] = {}
        self.watchers: dict[str, set[Watcher]] = {k: set() for k in KINDS}
        self.pod_watchers_by_node: dict[str, set[Watcher]] = {}
        self.delay = 0.0

    # ------------------------------------------------------------------ reads

    def get(self, kind: str, key: tuple[str, str]) -> Stored | None:
        with self.lock:
            return self.objs[kind].get(key)

    def copy_of(self, kind: str, key: tuple[str, str]) -> dict | None:
        st = self.get(kind, key)
        return None if st is None else orjson.loads(st.raw)

    def list(self, kind: str, selector: FieldSelector | None, *,
             exact_rv: int | None = None) -> tuple[int, list[bytes]]:
        """Items (serialized) matching ``selector``, sorted like etcd keys, and the list RV."""
        with self.lock:
            if exact_rv is not None and exact_rv != self.rv:
                return exact_rv, self._list_at(kind, selector, exact_rv)
            objs = self.objs[kind]
            if kind == "Pod" and selector is not None and selector.node is not None:
                keys: Iterable[tuple[str, str]] = self.pods_by_node.get(selector.node, ())
            else:
                keys = objs.keys()
            out = []
            for key in sorted(keys):
                st = objs[key]
                if selector is None or selector.matches(st.obj):
                    out.append(st.raw)
            return self.rv, out

    def _list_at(self, kind: str, selector: FieldSelector | None, rv: int) -> list[bytes]:
        if rv < self.floor:
            raise Expired(rv, self.floor)
        if rv > self.rv:
            raise ApiError(504, f"Too large resource version: {rv}, current: {self.rv}",
                           reason="Timeout")
        state = {k: st.obj for k, st in self.objs[kind].items()}
        for ev in reversed(self.history):
            if ev.rv <= rv:
                break
            if ev.kind != kind:
                continue
            key = _key(ev.obj)
            if ev.type == "ADDED":
                state.pop(key, None)
            else:
                state[key] = ev.old
        return [orjson.dumps(state[k]) for k in sorted(state)
                if selector is None or selector.matches(state[k])]

    # ------------------------------------------------------------------ writes

    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def _commit(self, kind: str, type_: str, obj: dict, old: dict | None) -> Event:
        rv = self._next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        raw = orjson.dumps(obj)
        key = _key(obj)
        if type_ == "DELETED":
            self.objs[kind].pop(key, None)
        else:
            self.objs[kind][key] = Stored(obj, raw)
        if kind == "Pod":
            old_node = (old or {}).get("spec", {}).get("nodeName") if old else None
            new_node = obj["spec"].get("nodeName")
            if old_node is not None and (type_ == "DELETED" or old_node != new_node):
                keys = self.pods_by_node.get(old_node)
                if keys is not None:
                    keys.discard(key)
            if type_ != "DELETED" and new_node is not None:
                self.pods_by_node.setdefault(new_node, set()).add(key)
        ev = Event(rv, kind, type_, obj, raw, old)
        self.history.append(ev)
        while len(self.history) > self.history_window:
            self.floor = self.history.popleft().rv
        self._fan_out(ev)
        return ev

    def _fan_out(self, ev: Event) -> None:
        if ev.kind == "Pod":
            nodes = {ev.obj["spec"].get("nodeName")}
            if ev.old is not None:
                nodes.add(ev.old["spec"].get("nodeName"))
            targets: list[Watcher] = list(self.watchers["Pod"])
            for node in nodes:
                targets.extend(self.pod_watchers_by_node.get(node, ()))
        else:
            targets = list(self.watchers[ev.kind])
        if not targets:
            return
        now = time.monotonic()
        for w in targets:
            if ev.rv <= w.start_rv:
                continue
            line = ev.route(w.selector)
            if line is not None:
                w.push(Item(now + w.delay, ev.rv, ev.rv - 1, line))

    def create(self, kind: str, obj: dict) -> dict:
        with self.lock:
            key = _key(obj)
            if key in self.objs[kind]:
                plural = KINDS[kind][0]
                raise AlreadyExistsError(f'{plural} "{key[1]}" already exists')
            self._commit(kind, "ADDED", obj, None)
            return orjson.loads(self.objs[kind][key].raw)

    def update(self, kind: str, key: tuple[str, str], new_obj: dict) -> tuple[dict, bool]:
        """Store ``new_obj`` (a fresh dict) as the next version; no-op changes keep the RV."""
        with self.lock:
            st = self.objs[kind].get(key)
            if st is None:
                raise NotFoundError(f'{KINDS[kind][0]} "{key[1]}" not found')
            new_obj["metadata"]["resourceVersion"] = st.obj["metadata"]["resourceVersion"]
            if new_obj == st.obj:
                return orjson.loads(st.raw), False
            self._commit(kind, "MODIFIED", new_obj, st.obj)
            return orjson.loads(self.objs[kind][key].raw), True

    def modify(self, kind: str, key: tuple[str, str], fn) -> dict:
        """Apply ``fn`` to a deep copy of the object and commit the result."""
        with self.lock:
            st = self.objs[kind].get(key)
            if st is None:
                raise NotFoundError(f'{KINDS[kind][0]} "{key[1]}" not found')
            new_obj = orjson.loads(st.raw)
            fn(new_obj)
            return self.update(kind, key, new_obj)[0]

    def delete(self, kind: str, key: tuple[str, str]) -> dict:
        with self.lock:
            st = self.objs[kind].get(key)
            if st is None:
                raise NotFoundError(f'{KINDS[kind][0]} "{key[1]}" not found')
            final = orjson.loads(st.raw)
            ev = self._commit(kind, "DELETED", final, st.obj)
            return orjson.loads(ev.raw)

    def compact(self) -> None:
        with self.lock:
            self.history.clear()
            self.floor = self.rv

    # ------------------------------------------------------------------ watches

    def register_watch(self, kind: str, selector: FieldSelector | None, *,
                       start_rv: int | None, initial: bool, initial_end_bookmark: bool) -> Watcher:
        """Open a watch. ``initial``: start with synthetic ADDED events of the current state
        (RV unset or "0", or sendInitialEvents); else replay history after ``start_rv``."""
        with self.lock:
            now = time.monotonic()
            if initial:
                w = Watcher(kind, selector, self.rv, delay=self.delay)
                _rv, raws = self.list(kind, selector)
                for raw in raws:
                    w.items.append(Item(now + w.delay, None, None,
                                        b'{"type":"ADDED","object":' + raw + b"}\n"))
                line = bookmark_line(kind, self.rv, initial_end=True) if initial_end_bookmark else None
                w.items.append(Item(now + w.delay, self.rv, None, line,
                                    is_event=False, is_bookmark=line is not None))
            else:
                if start_rv is None:
                    start_rv = self.rv
                if start_rv < self.floor:
                    raise Expired(start_rv, self.floor)
                w = Watcher(kind, selector, start_rv, delay=self.delay)
                for ev in self.history:
                    if ev.rv <= start_rv or ev.kind != kind:
                        continue
                    line = ev.route(w.selector)
                    if line is not None:
                        w.items.append(Item(now + w.delay, ev.rv, ev.rv - 1, line))
            if kind == "Pod" and w.node is not None:
                self.pod_watchers_by_node.setdefault(w.node, set()).add(w)
            else:
                self.watchers[kind].add(w)
            return w

    def unregister(self, w: Watcher) -> None:
        with self.lock:
            self.watchers[w.kind].discard(w)
            if w.node is not None:
                group = self.pod_watchers_by_node.get(w.node)
                if group is not None:
                    group.discard(w)
                    if not group:
                        del self.pod_watchers_by_node[w.node]

    def all_watchers(self) -> list[Watcher]:
        with self.lock:
            out = [w for ws in self.watchers.values() for w in ws]
            for ws in self.pod_watchers_by_node.values():
                out.extend(ws)
            return out

    def bookmark_rv(self, w: Watcher) -> int | None:
        """The highest RV a bookmark may report to ``w`` now, or None (initial state pending)."""
        with self.lock:
            with w.cond:
                if w.items:
                    safe = w.items[0].safe_rv
                    if safe is None:
                        return None
                else:
                    safe = self.rv
                return max(safe, w.last_rv)


def _key(obj: dict) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]
