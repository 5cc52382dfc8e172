"""A pod that keeps asking for its credentials, one new connection per request, timed.

The agent promises something about *connections*: one accepted after a sandbox stopped is
never answered with that sandbox's credentials. To check it from the pod's side, each
request must be its own connection, and the test must know when each began: a connection
opened before the stop completed may legitimately still be answered, one opened after it
must not. :class:`ConnectionProber` does just that from a thread living in the pod's
network namespace (it entered with setns before the test stops anything, so it keeps
asking even after containerd has unmounted the namespace; with the veth gone its
connections simply fail). Requests are token-less GETs of the listing and of the
credential document of one role, alternately, with a short timeout.

It only records; the test decides what was wrong.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

from netns import METADATA_IP, Netns, NetnsThread

__all__ = ["Attempt", "ConnectionProber"]

CREDS = "/latest/meta-data/iam/security-credentials/"


@dataclass(frozen=True)
class Attempt:
    """One connection: ``status`` 0 = no HTTP answer (``error`` says why)."""

    started: float            # time.monotonic() just before connect()
    ended: float
    path: str
    status: int
    body: bytes = b""
    error: str | None = None

    @property
    def access_key(self) -> str | None:
        """The AccessKeyId of a credential document answered with 200, else None."""
        if self.status != 200 or self.path == CREDS:
            return None
        try:
            return json.loads(self.body).get("AccessKeyId")
        except (ValueError, AttributeError):
            return None


def _get(path: str, *, timeout: float) -> Attempt:
    started = time.monotonic()
    conn = http.client.HTTPConnection(METADATA_IP, 80, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return Attempt(started=started, ended=time.monotonic(), path=path,
                       status=resp.status, body=body)
    except OSError as exc:
        return Attempt(started=started, ended=time.monotonic(), path=path, status=0,
                       error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


class ConnectionProber:
    """GET the listing and ``role``'s document from ``netns``, alternately, until stopped."""

    def __init__(self, netns: Netns, role: str, *, interval: float = 0.01,
                 timeout: float = 0.5) -> None:
        self.paths = (CREDS, CREDS + role)
        self.interval = interval
        self.timeout = timeout
        self.attempts: list[Attempt] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = NetnsThread(netns, self._loop, name=f"conn-probe-{netns.name}")

    def start(self) -> "ConnectionProber":
        self._thread.start()
        return self

    def _loop(self) -> None:
        turn = 0
        while not self._stop.is_set():
            attempt = _get(self.paths[turn % 2], timeout=self.timeout)
            turn += 1
            with self._lock:
                self.attempts.append(attempt)
            self._stop.wait(self.interval)

    def snapshot(self) -> list[Attempt]:
        with self._lock:
            return list(self.attempts)

    def wait_for(self, predicate, *, timeout: float) -> Attempt | None:
        """The first attempt from now on that satisfies ``predicate`` (None on timeout)."""
        seen = len(self.snapshot())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            attempts = self.snapshot()
            for a in attempts[seen:]:
                if predicate(a):
                    return a
            seen = len(attempts)
            time.sleep(0.01)
        return None

    def stop(self) -> list[Attempt]:
        self._stop.set()
        self._thread.join(10)
        if self._thread.error is not None:
            raise self._thread.error
        return self.snapshot()
