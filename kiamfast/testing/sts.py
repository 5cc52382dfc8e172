"""A local STS for tests and benchmarks: moto's server plus a fault-injecting proxy in front.

kiamfast's credential manager has to be tested against a real AWS wire protocol (botocore
signs, serialises, retries and parses exactly as in production), but never against AWS.
moto's STS in server mode speaks that protocol on loopback. What moto cannot do is misbehave
on demand, and misbehaving STS is what the manager exists for, so every test talks to
:class:`FaultProxy`, a small threaded HTTP proxy that can

  * add latency to every call (``proxy.latency = 0.1``),
  * answer ``400 Throttling``, ``500 InternalFailure``, ``403 AccessDenied`` or drop the
    connection ("down"), for all calls or only some roles, for a number of calls or until
    cleared (:meth:`FaultProxy.add_fault`),
  * record every call with its parameters (RoleArn, RoleSessionName, ExternalId, Tags...),
    its arrival time and its outcome (:attr:`FaultProxy.calls`), so a test counts AssumeRole
    calls instead of trusting the code under test to count them,
  * enforce one token bucket shared by every caller, as STS's per-account, per-Region
    request quota (600/s by default on AWS, shared by AssumeRole, GetCallerIdentity and the
    other STS calls): over budget, a call gets STS's own throttling answer (HTTP 400, an
    ``ErrorResponse`` with Code ``Throttling`` and Message ``Rate exceeded``, a code in
    botocore's throttling list) without reaching moto (:meth:`FaultProxy.set_budget`),
  * rewrite the ``Expiration`` of a successful AssumeRole to ``clock() + DurationSeconds``
    when given a clock, so a test with a :class:`ManualClock` can live through hours of
    rotation in milliseconds while moto keeps using the real time.

It must never be used outside tests, and never listens anywhere but 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import heapq
import http.client
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from kiamfast.budget import TokenBucket
from kiamfast.testing.background import BackgroundServer

FAULTS = ("throttle", "5xx", "deny", "down")

_ERRORS = {
    "throttle": (400, "Sender", "Throttling", "Rate exceeded"),
    "5xx": (500, "Receiver", "InternalFailure", "An internal error occurred"),
    "deny": (403, "Sender", "AccessDenied",
             "User: arn:aws:sts::123456789012:assumed-role/node/i-0 is not authorized to "
             "perform: sts:AssumeRole on resource: {role}"),
}
_EXPIRATION = re.compile(rb"<Expiration>[^<]*</Expiration>")
_ACCESS_KEY = re.compile(rb"<AccessKeyId>([^<]*)</AccessKeyId>")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te",
        "trailer", "proxy-authorization", "proxy-authenticate"}


# ---- a clock tests can drive --------------------------------------------------------------------

class ManualClock:
    """``time()`` and an async ``sleep()`` that only move when a test calls :meth:`advance`.

    Starts at the real time (so STS expirations and the table's own real-time checks stay
    plausible) unless ``start`` is given.
    """

    def __init__(self, start: float | None = None):
        self._now = time.time() if start is None else float(start)
        self._sleepers: list[tuple[float, int, asyncio.Future]] = []
        self._seq = 0

    def time(self) -> float:
        return self._now

    __call__ = time

    async def sleep(self, delay: float) -> None:
        if delay <= 0:
            await asyncio.sleep(0)
            return
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._sleepers, (self._now + delay, self._seq, fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    @property
    def next_deadline(self) -> float | None:
        live = [d for d, _, f in self._sleepers if not f.done()]
        return min(live) if live else None


# ---- moto ---------------------------------------------------------------------------------------

class MotoSts:
    """moto's server (all services, we use STS) in a thread on 127.0.0.1, ephemeral port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer  # imported late: heavy, tests only
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.url = ""

    def start(self) -> "MotoSts":
        import logging
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> "MotoSts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- the proxy ----------------------------------------------------------------------------------

@dataclass
class StsCall:
    """One request seen by the proxy."""
    at: float                 # time.monotonic() on arrival
    wall: float               # time.time() on arrival
    action: str
    params: dict[str, str]
    outcome: str = "pending"  # ok | throttle | 5xx | deny | down | error
    access_key_id: str = ""
    clock_at: float | None = None  # the proxy's clock() on arrival, when it has one

    @property
    def role_arn(self) -> str:
        return self.params.get("RoleArn", "")

    @property
    def session_name(self) -> str:
        return self.params.get("RoleSessionName", "")

    @property
    def external_id(self) -> str | None:
        return self.params.get("ExternalId")

    @property
    def tags(self) -> dict[str, str]:
        out = {}
        i = 1
        while f"Tags.member.{i}.Key" in self.params:
            out[self.params[f"Tags.member.{i}.Key"]] = self.params.get(f"Tags.member.{i}.Value", "")
            i += 1
        return out


@dataclass
class _Fault:
    kind: str
    roles: frozenset[str] | None
    remaining: int | None
    id: int = field(default=0)


class FaultProxy(BackgroundServer):
    """Threaded HTTP/1.1 proxy to ``upstream`` that injects STS faults and records calls."""

    def __init__(self, upstream: str, *, clock: Callable[[], float] | None = None,
                 latency: float = 0.0):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.clock = clock
        self.latency = latency
        self.calls: list[StsCall] = []
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._fault_ids = 0
        self.url = ""
        self._inflight = 0
        self.max_inflight = 0
        self._budget: TokenBucket | None = None

    # -- control ----------------------------------------------------------------------------
    def add_fault(self, kind: str, *, roles: Iterable[str] | None = None,
                  count: int | None = None) -> int:
        """Make matching AssumeRole calls fail with ``kind`` (see FAULTS); returns an id."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULTS}")
        with self._lock:
            self._fault_ids += 1
            self._faults.append(_Fault(kind, frozenset(roles) if roles is not None else None,
                                       count, self._fault_ids))
            return self._fault_ids

    def set_budget(self, rate: float | None, burst: float | None = None) -> None:
        """Answer STS calls beyond ``rate`` per second (``burst`` saved up, default one
        second's worth) with STS's throttling error, on the proxy's clock; ``None``: no
        budget.  Setting a new rate starts a new bucket (a brownout's start or end)."""
        with self._lock:
            if rate is None:
                self._budget = None
                return
            self._budget = TokenBucket(rate, max(1, round(burst if burst is not None
                                                          else rate)),
                                       clock=self.clock or time.time)

    def spend_budget(self, calls: int) -> int:
        """``calls`` STS calls of the account's other callers, taken from the budget and sent
        nowhere: how many it took (the others were throttled)."""
        with self._lock:
            if self._budget is None:
                return calls
            return sum(1 for _ in range(calls) if self._budget.try_take() <= 0)

    def clear_faults(self, fault_id: int | None = None) -> None:
        with self._lock:
            self._faults = [f for f in self._faults if fault_id is not None and f.id != fault_id]

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self._faults.clear()
            self._budget = None
            self.max_inflight = 0
        self.latency = 0.0

    def assume_role_calls(self, role_arn: str | None = None,
                          outcome: str | None = None) -> list[StsCall]:
        with self._lock:
            calls = list(self.calls)
        return [c for c in calls if c.action == "AssumeRole"
                and (role_arn is None or c.role_arn == role_arn)
                and (outcome is None or c.outcome == outcome)]

    def max_in_window(self, window: float, *, outcome: str | None = None) -> int:
        """The most AssumeRole calls that arrived within any ``window`` seconds."""
        times = sorted(c.at for c in self.assume_role_calls(outcome=outcome))
        best = lo = 0
        for hi, t in enumerate(times):
            while t - times[lo] > window:
                lo += 1
            best = max(best, hi - lo + 1)
        return best

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        server.daemon_threads = True
        server.request_queue_size = 512
        server.allow_reuse_address = True
        server.server_bind()
        server.server_activate()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._serve(server, name="sts-fault-proxy")
        return self

    # -- per request (handler threads) ------------------------------------------------------
    def _pick_fault(self, call: StsCall) -> str | None:
        with self._lock:
            if self._budget is not None and self._budget.try_take() > 0:
                return "throttle"     # the account's budget: every STS action counts
            if call.action != "AssumeRole":
                return None
            for f in self._faults:
                if f.roles is not None and call.role_arn not in f.roles:
                    continue
                if f.remaining is not None:
                    if f.remaining <= 0:
                        continue
                    f.remaining -= 1
                return f.kind
        return None

    def _record(self, call: StsCall) -> None:
        with self._lock:
            self.calls.append(call)
            self._inflight += 1
            self.max_inflight = max(self.max_inflight, self._inflight)

    def _done(self) -> None:
        with self._lock:
            self._inflight -= 1


def _error_xml(kind: str, role: str) -> tuple[int, bytes]:
    status, type_, code, message = _ERRORS[kind]
    body = (f'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            f"<Error><Type>{type_}</Type><Code>{code}</Code>"
            f"<Message>{message.format(role=role)}</Message></Error>"
            f"<RequestId>00000000-0000-0000-0000-000000000000</RequestId></ErrorResponse>")
    return status, body.encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The status line and headers go out in one write, the body in another: with Nagle's
    # algorithm the body waits for the client's delayed ACK (40 ms on Linux) on every call.
    disable_nagle_algorithm = True
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        self._proxy()

    def do_GET(self) -> None:  # noqa: N802
        self._proxy()

    def _proxy(self) -> None:
        owner = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        params = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode("utf-8", "replace"),
                                                             keep_blank_values=True).items()}
        call = StsCall(at=time.monotonic(), wall=time.time(),
                       action=params.get("Action", ""), params=params,
                       clock_at=owner.clock() if owner.clock is not None else None)
        owner._record(call)
        try:
            if owner.latency > 0:
                time.sleep(owner.latency)
            fault = owner._pick_fault(call)
            if fault == "down":
                call.outcome = "down"
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            if fault is not None:
                call.outcome = fault
                status, payload = _error_xml(fault, call.role_arn)
                self._reply(status, {"Content-Type": "text/xml"}, payload)
                return
            try:
                status, headers, payload = self._forward(body)
            except OSError as exc:
                call.outcome = "error"
                self._reply(502, {"Content-Type": "text/plain"}, repr(exc).encode())
                return
            if call.action == "AssumeRole" and status == 200:
                match = _ACCESS_KEY.search(payload)
                call.access_key_id = match.group(1).decode() if match else ""
                if owner.clock is not None:
                    duration = int(params.get("DurationSeconds") or 3600)
                    exp = _dt.datetime.fromtimestamp(owner.clock() + duration, _dt.timezone.utc)
                    payload = _EXPIRATION.sub(
                        b"<Expiration>" + exp.strftime("%Y-%m-%dT%H:%M:%SZ").encode()
                        + b"</Expiration>", payload)
            call.outcome = "ok" if status == 200 else f"http{status}"
            self._reply(status, headers, payload)
        finally:
            owner._done()

    def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        up = self.owner.upstream
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            out = {k: v for k, v in resp.getheaders()
                   if k.lower() not in _HOP and k.lower() != "content-length"}
            return resp.status, out, payload
        finally:
            conn.close()

    def _reply(self, status: int, headers: dict[str, str], payload: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class StsSandbox:
    """moto + FaultProxy, started together; ``endpoint_url`` is the proxy's."""

    def __init__(self, *, clock: Callable[[], float] | None = None):
        self.moto = MotoSts()
        self.clock = clock
        self.proxy: FaultProxy | None = None

    @property
    def endpoint_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def start(self) -> "StsSandbox":
        self.moto.start()
        self.proxy = FaultProxy(self.moto.url, clock=self.clock).start()
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.moto.stop()

    def __enter__(self) -> "StsSandbox":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
