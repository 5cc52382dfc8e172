"""Pods that keep asking for their credentials while the agent is restarted or handed over.

A :class:`Caller` is one client thread: every ``interval`` it asks for its role's credential
document with a ``timeout`` (the SDKs' metadata timeout is 1 s), either on a fresh
connection each time or on one keep-alive connection, and records every call.  A keep-alive
connection behaves as urllib3's pool does: before reusing it, it checks whether the server
closed it (a worker that stops closes its idle connections) and connects again if so; a
request on a reused connection that fails before any byte of an answer is sent once more on
a new one (urllib3's dropped check and Go's transport do the same), and counted apart.

It only records; what counts as right (the pod's own role, nothing refused) is the test's.
Used on loopback (tests/supervisor: a pod is a source address) and from pods' network
namespaces through the DNAT (tests/e2e, bench/handover.py: ``enter`` switches the thread
into the pod's namespace first).
"""
from __future__ import annotations

import errno
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

CREDS = "/latest/meta-data/iam/security-credentials/"


@dataclass(frozen=True)
class Call:
    at: float              # time.monotonic() when the call began
    took: float            # seconds until its answer (or failure)
    outcome: str           # "ok", "http <status>", "refused", "reset", "timeout", "eof", ...
    fresh: bool            # on a new connection (a keep-alive caller's first, or after a close)
    access_key: str | None = None
    retried: bool = False  # a reused connection failed before any answer: sent again

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(eq=False)
class Caller(threading.Thread):
    """Ask ``host:port`` (from ``source``) for ``role``'s document until :meth:`stop`."""

    host: str
    port: int
    role: str
    source: str | None = None
    keep_alive: bool = False
    interval: float = 0.05
    timeout: float = 1.0
    enter: Callable[[], None] | None = None     # run first in the thread (setns)
    name_: str = ""
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, name=self.name_ or f"caller-{self.role}", daemon=True)
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.error: BaseException | None = None

    # -- the thread ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            if self.enter is not None:
                self.enter()
            while not self._stop_event.is_set():
                call = self._one()
                with self._lock:
                    self.calls.append(call)
                self._stop_event.wait(self.interval)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e
        finally:
            self._drop()

    def stop(self) -> list[Call]:
        self._stop_event.set()
        self.join(10)
        if self.error is not None:
            raise self.error
        return self.snapshot()

    def snapshot(self) -> list[Call]:
        with self._lock:
            return list(self.calls)

    # -- one call ----------------------------------------------------------------------------

    def _one(self) -> Call:
        at = time.monotonic()
        deadline = at + self.timeout
        reused = self.keep_alive and self._sock is not None and not self._closed_by_peer()
        if not reused:
            self._drop()
        try:
            outcome, key = self._exchange(deadline)
            return Call(at, time.monotonic() - at, outcome, not reused, key)
        except _NothingBack as e:
            if reused:    # the server closed it as we sent: once more, on a new connection
                self._drop()
                try:
                    outcome, key = self._exchange(deadline)
                    return Call(at, time.monotonic() - at, outcome, True, key, retried=True)
                except _Failed as again:
                    return Call(at, time.monotonic() - at, again.outcome, True, retried=True)
            return Call(at, time.monotonic() - at, e.outcome, True)
        except _Failed as e:
            return Call(at, time.monotonic() - at, e.outcome, not reused)
        finally:
            if not self.keep_alive:
                self._drop()

    def _exchange(self, deadline: float) -> tuple[str, str | None]:
        if self._sock is None:
            self._sock = self._connect(deadline)
        sock = self._sock
        head = (f"GET {CREDS}{self.role} HTTP/1.1\r\nHost: 169.254.169.254\r\n"
                + ("" if self.keep_alive else "Connection: close\r\n") + "\r\n")
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock.sendall(head.encode())
            except socket.timeout:
                raise _Failed("timeout") from None
            except OSError as e:
                raise _NothingBack(f"send {errno.errorcode.get(e.errno, e.errno)}") from None
            status, body, close = _read_response(sock, deadline)
        except _Failed:
            self._drop()
            raise
        if close:
            self._drop()
        if status != 200:
            return f"http {status}", None
        try:
            key = json.loads(body).get("AccessKeyId")
        except ValueError:
            key = None
        return ("ok", key) if key else ("bad document", None)

    def _connect(self, deadline: float) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        try:
            if self.source:
                sock.bind((self.source, 0))
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect((self.host, self.port))
        except socket.timeout:
            sock.close()
            raise _Failed("timeout") from None
        except OSError as e:
            sock.close()
            raise _Failed("refused" if e.errno == errno.ECONNREFUSED else
                          f"connect {errno.errorcode.get(e.errno, e.errno)}") from None
        return sock

    def _closed_by_peer(self) -> bool:
        """urllib3's is_connection_dropped: readable before we asked anything = closed."""
        assert self._sock is not None
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Failed(Exception):
    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class _NothingBack(_Failed):
    """The connection ended before any byte of an answer."""


def _read_response(sock: socket.socket, deadline: float) -> tuple[int, bytes, bool]:
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                raise (_NothingBack if not data else _Failed)("eof")
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                raise _Failed("eof")
            body += chunk
    except socket.timeout:
        raise _Failed("timeout") from None
    except ConnectionResetError:
        raise (_NothingBack if not data else _Failed)("reset") from None
    except OSError as e:
        raise _Failed(f"recv {errno.errorcode.get(e.errno, e.errno)}") from None
    return status, body[:length], headers.get("connection", "").lower() == "close"


def summary(calls: list[Call]) -> dict[str, int]:
    """Outcome -> count (and "retried": calls sent twice)."""
    out: dict[str, int] = {}
    for call in calls:
        out[call.outcome] = out.get(call.outcome, 0) + 1
        if call.retried:
            out["retried"] = out.get("retried", 0) + 1
    return out


def longest_silence(calls: list[Call]) -> float:
    """The longest time between the end of one successful call and the end of the next."""
    ends = sorted(c.at + c.took for c in calls if c.ok)
    return max((b - a for a, b in zip(ends, ends[1:])), default=0.0)
