"""Helpers for the server worker tests: a real table, a real worker, a fake IMDS, raw sockets.

The worker runs in-process on its own event loop thread (uvloop or stdlib asyncio) with a
real table file that the test fills as the control process would, and a real channel
socketpair whose control end the test holds: it sees the worker's b"I"/b"C" messages and
sends b"W" wake-ups itself. Clients are raw sockets that can bind any 127.0.0.x source
address, so one test can pose as many pods.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools

from kiamfast import channel, table
from kiamfast import credential_parts
from kiamfast.server.settings import WorkerSettings
from kiamfast.server.worker import listen_socket, serve

TOKEN_KEY = b"test-token-key-0123456789abcdef!"
ACCOUNT = "123456789012"
BASE_ARN = f"arn:aws:iam::{ACCOUNT}:role/"


# ---- HTTP over raw sockets -------------------------------------------------------------------

@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def text(self) -> str:
        return self.body.decode()


class _Collector:
    def __init__(self, head_only: bool = False) -> None:
        self.done: list[Response] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.done.append(Response(
            self.parser.get_status_code(),
            {k.decode().lower(): v.decode("latin-1") for k, v in self.headers},
            bytes(self.body), list(self.headers)))
        self.headers = []
        self.body = bytearray()


class Client:
    """A blocking HTTP/1.x client on one connection, from a chosen source address."""

    def __init__(self, port: int, *, source: str = "127.0.0.1", host: str = "127.0.0.1",
                 timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout,
                                             source_address=(source, 0))
        self.collector = _Collector()
        self.parser = httptools.HttpResponseParser(self.collector)
        self.collector.parser = self.parser
        self.closed = False

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def read(self, n: int = 1) -> list[Response]:
        """The next `n` responses (fewer if the server closes first)."""
        while len(self.collector.done) < n:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                data = b""
            if not data:
                self.closed = True
                break
            self.parser.feed_data(data)
        out, self.collector.done = self.collector.done[:n], self.collector.done[n:]
        for r in out:
            # kube2iam and real IMDS: every single response says Server: EC2ws.
            assert r.header("server") == "EC2ws", r
        return out

    def request_head(self, raw: bytes) -> Response:
        """Send a HEAD request; its answer has headers only (whatever Content-Length says)."""
        self.send(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        assert not rest, rest
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        r = Response(int(lines[0].split()[1]), headers, b"")
        assert r.header("server") == "EC2ws", r
        return r

    def request(self, raw: bytes) -> Response:
        if raw.startswith(b"HEAD "):
            return self.request_head(raw)
        self.send(raw)
        got = self.read(1)
        assert got, "connection closed without a response"
        return got[0]

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """True if the server closes the connection within `timeout` (reading nothing)."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True
        if data:
            self.parser.feed_data(data)
            return self.wait_closed(timeout)
        return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build(method: str, path: str, headers: dict[str, str] | None = None, *,
          version: str = "1.1", body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: 169.254.169.254"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def open_idle(port: int, source: str, n: int) -> list[socket.socket]:
    """`n` connections from `source` that never send anything."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
            for _ in range(n)]


def closed_by_server(s: socket.socket, timeout: float = 2.0) -> bool:
    """Did the server close the connection within `timeout` (after any answer, e.g. 408)?"""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        pass
    return False


def until(condition: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll `condition` until it is true (its value) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} never held"
        time.sleep(0.005)
    return value


class Background:
    """A request running in a thread (the test acts meanwhile)."""

    def __init__(self, server: "Server", path: str, *, source: str = "127.0.0.1",
                 method: str = "GET") -> None:
        self.result: Response | None = None
        self.elapsed: float | None = None

        def run() -> None:
            t0 = time.monotonic()
            self.result = server.get(path, source=source, method=method)
            self.elapsed = time.monotonic() - t0

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> Response:
        self.thread.join(10)
        assert self.result is not None, "no answer"
        return self.result


def wait_for_waiters(server: "Server", n: int = 1) -> None:
    until(lambda: server.waiting() >= n, what=f"{n} waiting requests")


# ---- the running worker ----------------------------------------------------------------------

class Server:
    """A worker on a background event loop, plus the control end of its channel."""

    def __init__(self, settings: WorkerSettings, table_path: str, *, loop_kind: str,
                 with_channel: bool = True, table_cls: type[table.Table] = table.Table) -> None:
        self.settings = settings
        self.loop_kind = loop_kind
        self.ctl: socket.socket | None = None
        worker_end = None
        if with_channel:
            self.ctl, worker_end = channel.socketpair()
        self.table = table_cls.attach(table_path)
        if loop_kind == "uvloop":
            import uvloop
            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        sock = listen_socket(settings.listen_host, 0, reuse_port=False)
        msock = None
        if settings.separate_metrics_port:
            msock = listen_socket(settings.listen_host, 0, reuse_port=False)
        self.ws = self.call_async(serve(settings, self.table, channel_sock=worker_end,
                                        app_sock=sock, metrics_sock=msock))
        self.port = self.ws.port
        self.metrics_port = self.ws.metrics_port if msock is not None else self.port
        self.core = self.ws.core

    def call_async(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run `fn` on the worker's loop thread and return its result."""
        async def run() -> Any:
            return fn()
        return self.call_async(run(), timeout)

    def client(self, source: str = "127.0.0.1", **kw: Any) -> Client:
        return Client(self.port, source=source, **kw)

    def get(self, path: str, *, source: str = "127.0.0.1", method: str = "GET",
            headers: dict[str, str] | None = None, version: str = "1.1") -> Response:
        with self.client(source) as c:
            return c.request(build(method, path, headers, version=version))

    def token(self, *, source: str = "127.0.0.1", ttl: int = 21600) -> str:
        r = self.get("/latest/api/token", source=source, method="PUT",
                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
        assert r.status == 200, r
        return r.text

    # -- the control end of the channel --

    def wake(self) -> None:
        assert self.ctl is not None
        channel.send(self.ctl, channel.wake(self.table.generation))

    def messages(self, timeout: float = 5.0, *, want: int = 1) -> list[tuple[bytes, object]]:
        """At least `want` parsed worker→control messages (waits up to `timeout`)."""
        assert self.ctl is not None
        out: list[tuple[bytes, object]] = []
        deadline = time.monotonic() + timeout
        while len(out) < want:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.ctl], [], [], left)[0]:
                break
            for m in channel.drain(self.ctl):
                parsed = channel.parse(m)
                if parsed is not None:
                    out.append(parsed)
        return out

    def waiting(self) -> int:
        return self.call(lambda: len(self.core.waiters))

    def counters(self) -> list[int]:
        return self.call(self.core.local_counters)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.call_async(self.ws.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            self.loop.close()
            self.table.close()
            if self.ctl is not None:
                self.ctl.close()


# ---- the table, filled as the control process would ------------------------------------------

class Pods:
    """Writes pods and credentials into the table like the control process does."""

    def __init__(self, writer: table.Table) -> None:
        self.t = writer
        self.slots: dict[str, int] = {}
        self.keys: dict[str, str] = {}

    def role_slot(self, role: str, *, state: int = table.CRED_READY, lifetime: float = 3600,
                  access_key: str | None = None, error_code: str | None = None,
                  serve_for: float | None = None) -> int:
        """Write credentials for `role` (a name under BASE_ARN or a full ARN); its slot."""
        arn = role if role.startswith("arn:") else BASE_ARN + role
        slot = self.slots.setdefault(arn, len(self.slots))
        now = time.time()
        key = access_key or f"ASIAPOD{slot:013d}"
        self.keys[arn] = key
        if error_code is not None:
            parts = credential_parts.render_error(role_arn=arn, code=error_code, last_updated=now,
                                        base_role_arn=BASE_ARN)
        elif state == table.CRED_PENDING:
            parts = []
        else:
            parts = credential_parts.render_credentials(
                role_arn=arn, access_key_id=key, secret_access_key="secret/" + key,
                session_token="session-token-" + key, expiration=now + lifetime,
                last_updated=now, base_role_arn=BASE_ARN)
        serve_until = now + (serve_for if serve_for is not None else lifetime - 900)
        self.t.write_cred(slot, parts, serve_until=serve_until, state=state)
        return slot

    def add(self, ip: str, role: str | None, *, uid: str | None = None,
            pod_state: int | None = None, **kw: Any) -> int:
        """Claim `ip` for a pod with `role` (None: no role); the credential slot or -1.
        Keyword arguments go to role_slot (e.g. ``state=table.CRED_PENDING``)."""
        uid = uid or f"uid-{ip}"
        if role is None:
            self.t.claim_ip(ip, uid, pod_state or table.POD_NO_ROLE)
            return -1
        if pod_state == table.POD_DENIED:
            self.t.claim_ip(ip, uid, table.POD_DENIED)
            return -1
        slot = self.role_slot(role, **kw)
        self.t.claim_ip(ip, uid, table.POD_ROLE, slot)
        return slot

    def ready(self, *, synced: bool = True, ready: bool = True, pending_pods: int = 0) -> None:
        self.t.set_status(synced=synced, ready=ready, pending_pods=pending_pods)
