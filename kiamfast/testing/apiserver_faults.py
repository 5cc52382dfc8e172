"""The faults a test injects into the API server emulator: ``ApiServer.faults``.

Each is one thing a real API server, or a proxy in front of it, does now and then and cannot
be made to do on demand: streams cut off, history compacted, events late, requests failed,
watches answered with something that is not a stream, lists slow. The HTTP front end
(apiserver_http.py) reads the switches (``take_failure``, ``list_delay``, ``watch_answer``)
on every request.
"""

from __future__ import annotations

import socket
import threading

from kiamfast.testing.apiserver_store import Store

__all__ = ["Faults"]


class _Failure:
    __slots__ = ("remaining", "status", "path_prefix")

    def __init__(self, n: int, status: int, path_prefix: str | None) -> None:
        self.remaining = n
        self.status = status
        self.path_prefix = path_prefix


class Faults:
    """``api.faults``: cut, compact, delay, fail, mis-answer and slow down."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self.list_delay = 0.0                 # seconds every LIST waits (slow_list)
        self.watch_answer: str | None = None  # how every watch is answered instead

    def drop_watches(self) -> int:
        """Close every open watch stream abruptly (no final chunk); returns how many."""
        ws = self._store.all_watchers()
        for w in ws:
            w.drop()
            sock = w.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        return len(ws)

    def compact(self) -> None:
        """Forget all history: a watch or Exact list from any older RV gets 410."""
        self._store.compact()

    def delay_events(self, seconds: float) -> None:
        """Deliver watch events ``seconds`` after they happen (0 turns the lag off).

        Applies to events committed from now on; ordering is kept."""
        with self._store.lock:
            self._store.delay = max(0.0, float(seconds))
            for w in self._store.all_watchers():
                w.delay = self._store.delay

    def fail_next(self, n: int, *, status: int = 500, path_prefix: str | None = None) -> None:
        """The next ``n`` requests whose path starts with ``path_prefix`` fail with ``status``.

        429 carries ``Retry-After: 1``."""
        with self._lock:
            self._failures.append(_Failure(n, status, path_prefix))

    def answer_watches_with(self, fault: str | None) -> None:
        """Answer every watch request badly until called with None (then stream again):
        ``"list"``: 200 with a plain list, as a proxy or server that ignores ``watch=true``
        would; ``"empty"``: 200 with a stream that ends at once, with no event or bookmark.
        Such requests count in ``watches`` and ``faults_injected``."""
        if fault not in (None, "list", "empty"):
            raise ValueError("fault must be 'list', 'empty' or None")
        self.watch_answer = fault

    def slow_list(self, seconds: float) -> None:
        """Answer every LIST ``seconds`` late (the snapshot is taken before the wait)."""
        self.list_delay = max(0.0, float(seconds))

    def take_failure(self, path: str) -> int | None:
        """The status to fail this request with (one of ``fail_next``'s n), or None."""
        with self._lock:
            for f in self._failures:
                if f.path_prefix is not None and not path.startswith(f.path_prefix):
                    continue
                f.remaining -= 1
                if f.remaining <= 0:
                    self._failures.remove(f)
                return f.status
        return None
