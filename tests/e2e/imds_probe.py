"""A pod that keeps asking 169.254.169.254 for credentials, and remembers every answer.

The strongest statement the end-to-end tests make is about *every* answer a pod got while
something was going on (the agent starting, its control process killed, the API server
gone): each one was the pod's own role, or an error, and never the node's role or another
pod's. An SDK run per request is far too slow to sample that densely, so this probe speaks
the wire protocol itself, exactly as botocore does (token PUT, listing, document, a new
connection each time), from a thread that lives in the pod's network namespace (see
:class:`netns.NetnsThread`), and records each step's outcome.

It only reads; what counts as right is decided by the test from the recorded samples.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

from netns import METADATA_IP, Netns, NetnsThread

__all__ = ["Sample", "Prober", "fetch_once"]

CREDS = "/latest/meta-data/iam/security-credentials/"


@dataclass(frozen=True)
class Sample:
    """One credential fetch. ``status`` 0 = no HTTP answer (``error`` says why)."""

    at: float                 # time.monotonic() when the fetch started
    stage: str                # "token", "listing" or "document": where it ended
    status: int
    role: str | None = None   # listing body (the role name the agent announced)
    access_key: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.stage == "document" and self.status == 200 and self.access_key is not None


def _request(method: str, path: str, headers: dict[str, str], *,
             timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(METADATA_IP, 80, timeout=timeout)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def fetch_once(*, token: bool = True, timeout: float = 2.0) -> Sample:
    """One botocore-style credential fetch from the calling thread's namespace."""
    at = time.monotonic()
    headers: dict[str, str] = {}
    stage = "token"
    try:
        if token:
            status, body = _request("PUT", "/latest/api/token",
                                    {"X-aws-ec2-metadata-token-ttl-seconds": "21600"},
                                    timeout=timeout)
            if status != 200:
                return Sample(at, stage, status)
            headers["X-aws-ec2-metadata-token"] = body.decode()
        stage = "listing"
        status, body = _request("GET", CREDS, headers, timeout=timeout)
        if status != 200:
            return Sample(at, stage, status)
        role = body.decode(errors="replace")
        stage = "document"
        status, body = _request("GET", CREDS + role, headers, timeout=timeout)
        if status != 200:
            return Sample(at, stage, status, role=role)
        try:
            key = json.loads(body).get("AccessKeyId")
        except ValueError:
            key = None
        return Sample(at, stage, status, role=role, access_key=key)
    except OSError as exc:
        return Sample(at, stage, 0, error=f"{type(exc).__name__}: {exc}")


class Prober:
    """Fetch credentials from ``pod_ns`` every ``interval`` seconds until :meth:`stop`."""

    def __init__(self, pod_ns: Netns, *, interval: float = 0.02, token: bool = True,
                 label: str = "") -> None:
        self.interval = interval
        self.token = token
        self.label = label or pod_ns.name
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gate = threading.Event()
        self._thread = NetnsThread(pod_ns, self._loop, name=f"probe-{self.label}")

    def start(self, *, gated: bool = False) -> "Prober":
        """Start the thread; with ``gated`` it waits for :meth:`open_gate` before asking."""
        if not gated:
            self._gate.set()
        self._thread.start()
        return self

    def open_gate(self) -> None:
        self._gate.set()

    def _loop(self) -> None:
        while not self._gate.wait(0.05):
            if self._stop.is_set():
                return
        while not self._stop.is_set():
            sample = fetch_once(token=self.token)
            with self._lock:
                self.samples.append(sample)
            self._stop.wait(self.interval)

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._gate.set()
        self._thread.join(10)
        if self._thread.error is not None:
            raise self._thread.error
        return self.snapshot()

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def wait_for(self, predicate, *, timeout: float) -> Sample | None:
        """Wait until a new sample satisfies ``predicate``; return it (None on timeout)."""
        seen = len(self.snapshot())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            samples = self.snapshot()
            for s in samples[seen:]:
                if predicate(s):
                    return s
            seen = len(samples)
            time.sleep(0.02)
        return None
