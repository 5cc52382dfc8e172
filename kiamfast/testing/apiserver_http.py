"""HTTP front end of the API server emulator: routing, lists, gets, patches and watch
streams.

Split from ``kiamfast.testing.apiserver`` (which owns the lifecycle and, by job, the
cluster's objects, the faults and the traffic counters); ``HttpFrontend`` is mixed into
``ApiServer`` and reads its store, records in its ``traffic`` and obeys its ``faults``.

The watch writer runs on the connection's own thread and only drains its watcher's queue:
it never holds the store lock while writing to a socket, so a slow or stuck client can
delay nobody but itself. A watch ends cleanly (final zero-length chunk) only on
``timeoutSeconds``; ``faults.drop_watches``/``stop`` end it abruptly, as a lost connection
would.
"""

from __future__ import annotations

import select
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson

from kiamfast.testing.apiserver_objects import (
    KINDS,
    PLURAL_TO_KIND,
    ApiError,
    FieldSelector,
    drop_empty,
)
from kiamfast.testing.apiserver_faults import Faults
from kiamfast.testing.apiserver_patch import apply_patch
from kiamfast.testing.apiserver_store import Expired, Store, Watcher, bookmark_line, error_line
from kiamfast.testing.apiserver_traffic import Traffic

__all__ = ["Handler", "HttpFrontend", "Listener"]

_VERSION = {
    "major": "1",
    "minor": "33",
    "emulationMajor": "1",
    "emulationMinor": "33",
    "gitVersion": "v1.33.0-kiamfast-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}

_API_RESOURCES = {
    "kind": "APIResourceList",
    "apiVersion": "v1",
    "groupVersion": "v1",
    "resources": [
        {"name": "namespaces", "singularName": "namespace", "namespaced": False,
         "kind": "Namespace", "verbs": ["get", "list", "patch", "watch"], "shortNames": ["ns"]},
        {"name": "nodes", "singularName": "node", "namespaced": False, "kind": "Node",
         "verbs": ["get", "list", "patch", "watch"], "shortNames": ["no"]},
        {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
         "verbs": ["get", "list", "patch", "watch"], "shortNames": ["po"],
         "categories": ["all"]},
    ],
}

_OPEN_PATHS = ("/version", "/healthz", "/livez", "/readyz")
_HTTP_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
                 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 410: "Gone",
                 415: "Unsupported Media Type", 422: "Unprocessable Entity",
                 429: "Too Many Requests", 500: "Internal Server Error",
                 503: "Service Unavailable", 504: "Gateway Timeout"}
_CHUNK_END = b"0\r\n\r\n"


def _truthy(v: str | None) -> bool:
    # As the real server's query decoding (Convert_Slice_string_To_bool): only an absent
    # parameter, "0" or "false" (any case) is false; "", "T", "yes" are true.
    return v is not None and v != "0" and v.lower() != "false"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Listener(ThreadingHTTPServer):
    """The API server's listening socket; ``owner`` (the ``ApiServer``, typed by the mixin
    that handles its requests, so this module never imports the one that imports it)."""

    daemon_threads = True
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, addr, handler, owner: HttpFrontend) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.owner = owner
        super().__init__(addr, handler)

    def handle_error(self, request, client_address) -> None:  # quiet: clients hang up
        pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kiamfast-apiserver-emulator"
    server: Listener

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

    def _dispatch(self) -> None:
        self.server.owner._serve_api(self)

    do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = do_HEAD = _dispatch


class HttpFrontend:
    """Request handling for ``ApiServer``: a mixin that uses the server's ``_store``,
    ``traffic`` (counters), ``faults`` (switches), ``token``, ``bookmark_interval`` and
    connection registry (``_conns``)."""

    _store: Store
    traffic: Traffic
    faults: Faults

    # ------------------------------------------------------------------ HTTP plumbing

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._conn_lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def _send(self, h: Handler, code: int, body: bytes, *,
              ctype: str = "application/json", headers: tuple = ()) -> None:
        head = [f"HTTP/1.1 {code} {_HTTP_REASONS.get(code, 'Error')}\r\n",
                f"Content-Type: {ctype}\r\n",
                f"Content-Length: {len(body)}\r\n",
                "Cache-Control: no-cache, private\r\n"]
        head.extend(f"{k}: {v}\r\n" for k, v in headers)
        if h.close_connection:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1")
        if h.command != "HEAD":
            data += body
        try:
            h.connection.sendall(data)
        except OSError:
            h.close_connection = True
            return
        if code >= 400:
            self.traffic.record(errors=1)
        self.traffic.record(bytes_sent=len(data))

    def _send_error(self, h: Handler, err: ApiError) -> None:
        headers: tuple = ()
        if err.code == 429:
            headers = (("Retry-After", "1"),)
        self._send(h, err.code, err.body(), headers=headers)

    @staticmethod
    def _read_body(h: Handler) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(h.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(h.rfile.read(size))
                h.rfile.readline()
        length = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(length) if length > 0 else b""

    def _fault_error(self, status: int) -> ApiError:
        self.traffic.record(faults_injected=1)
        if status == 429:
            return ApiError(429, "Too many requests, please try again later.",
                            details={"causes": [{"reason": "InjectedFault"}],
                                     "retryAfterSeconds": 1})
        if status == 500:
            return ApiError(500, "Internal error occurred: injected fault")
        return ApiError(status, f"injected fault ({status})")

    # ------------------------------------------------------------------ API requests

    def _serve_api(self, h: Handler) -> None:
        self.traffic.record(requests=1)
        body = self._read_body(h)     # always drained, so keep-alive framing stays intact
        parts = urlsplit(h.path)
        path = parts.path.rstrip("/") or "/"
        fault = self.faults.take_failure(path)
        if fault is not None:
            self._send_error(h, self._fault_error(fault))
            return
        auth = h.headers.get("Authorization")
        if self.token is not None and auth != f"Bearer {self.token}":
            if auth is not None or path not in _OPEN_PATHS:
                self._send_error(h, ApiError(401, "Unauthorized"))
                return
        try:
            params = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            self._route(h, h.command, path, params, body)
        except ApiError as err:
            self._send_error(h, err)

    def _route(self, h: Handler, method: str, path: str, params: dict, body: bytes) -> None:
        if path in ("/healthz", "/livez", "/readyz"):
            self._send(h, 200, b"ok", ctype="text/plain; charset=utf-8")
            return
        if path == "/version":
            self._send(h, 200, orjson.dumps(_VERSION))
            return
        if path == "/api":
            self._send(h, 200, orjson.dumps({
                "kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                "serverAddress": f"{self.host}:{self.port}"}]}))
            return
        if path == "/apis":
            self._send(h, 200, orjson.dumps({"kind": "APIGroupList", "apiVersion": "v1",
                                             "groups": []}))
            return
        if path == "/api/v1":
            self._send(h, 200, orjson.dumps(_API_RESOURCES))
            return
        segs = path.strip("/").split("/")
        if len(segs) < 3 or segs[0] != "api" or segs[1] != "v1":
            raise ApiError(404, "the server could not find the requested resource")
        segs = segs[2:]
        watch = False
        if segs[0] == "watch":
            watch, segs = True, segs[1:]
        namespace: str | None = None
        if len(segs) >= 3 and segs[0] == "namespaces":
            namespace, segs = segs[1], segs[2:]
        if not segs or segs[0] not in PLURAL_TO_KIND or len(segs) > 2:
            raise ApiError(404, "the server could not find the requested resource")
        kind = PLURAL_TO_KIND[segs[0]]
        namespaced = KINDS[kind][2]
        if namespaced != (namespace is not None) and not (namespaced and len(segs) == 1):
            raise ApiError(404, "the server could not find the requested resource")
        name = segs[1] if len(segs) == 2 else None
        if method == "PATCH" and name is not None and not watch:
            self._patch(h, kind, (namespace or "", name), body)
            return
        if method not in ("GET", "HEAD"):
            raise ApiError(405, f"the server does not allow this method on the requested "
                                f"resource ({method} {path})")
        selector = FieldSelector(kind, params.get("fieldSelector"),
                                 namespace=namespace if namespaced else None)
        if name is not None:
            if watch:
                selector = FieldSelector(kind, _join_sel(params.get("fieldSelector"),
                                                         f"metadata.name={name}"),
                                         namespace=namespace if namespaced else None)
            else:
                self._get(h, kind, (namespace or "", name))
                return
        if watch or _truthy(params.get("watch")):
            self._watch(h, kind, selector, params)
        else:
            self._list(h, kind, selector, params)

    def _get(self, h: Handler, kind: str, key: tuple[str, str]) -> None:
        self.traffic.record(gets=1)
        st = self._store.get(kind, key)
        if st is None:
            plural = KINDS[kind][0]
            raise ApiError(404, f'{plural} "{key[1]}" not found',
                           details={"name": key[1], "kind": plural})
        self._send(h, 200, st.raw)

    def _list(self, h: Handler, kind: str, selector: FieldSelector, params: dict) -> None:
        rv_param = params.get("resourceVersion") or ""
        match = params.get("resourceVersionMatch") or ""
        exact = None
        if match and not rv_param:
            raise ApiError(422, "resourceVersionMatch is forbidden unless resourceVersion "
                                "is provided", reason="Invalid")
        if match == "Exact":
            exact = _parse_rv(rv_param)
            if exact == 0:
                raise ApiError(422, 'resourceVersionMatch "exact" is forbidden for '
                                    'resourceVersion "0"', reason="Invalid")
        elif match not in ("", "NotOlderThan"):
            raise ApiError(422, f"resourceVersionMatch: Unsupported value: \"{match}\"",
                           reason="Invalid")
        elif rv_param:
            _parse_rv(rv_param)
        rv, items = self._store.list(kind, selector if selector else None, exact_rv=exact)
        self.traffic.record(lists=1)     # counted once the snapshot is taken
        self.traffic.record_node("lists_by_node", selector.node if kind == "Pod" else None)
        if self.faults.list_delay:
            time.sleep(self.faults.list_delay)
        self._send(h, 200, _list_body(kind, rv=rv, items=items))

    def _patch(self, h: Handler, kind: str, key: tuple[str, str], body: bytes) -> None:
        self.traffic.record(patches=1)
        ctype = h.headers.get("Content-Type") or ""
        st = self._store
        with st.lock:
            cur = st.get(kind, key)
            if cur is None:
                plural = KINDS[kind][0]
                raise ApiError(404, f'{plural} "{key[1]}" not found',
                               details={"name": key[1], "kind": plural})
            new = apply_patch(orjson.loads(cur.raw), ctype, body)
            if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
                raise ApiError(422, "patched object is not a valid object", reason="Invalid")
            want_rv = new["metadata"].get("resourceVersion")
            have_rv = cur.obj["metadata"]["resourceVersion"]
            if want_rv not in (None, have_rv):
                plural = KINDS[kind][0]
                raise ApiError(409, f'Operation cannot be fulfilled on {plural} "{key[1]}": '
                                    f'the object has been modified; please apply your changes '
                                    f'to the latest version and try again', reason="Conflict")
            for field in ("name", "namespace", "uid", "creationTimestamp"):
                if field in cur.obj["metadata"]:
                    new["metadata"][field] = cur.obj["metadata"][field]
            new["kind"], new["apiVersion"] = kind, "v1"
            drop_empty(new)
            st.update(kind, key, new)
            raw = st.get(kind, key).raw
        self._send(h, 200, raw)

    # ------------------------------------------------------------------ watch

    def _watch(self, h: Handler, kind: str, selector: FieldSelector, params: dict) -> None:
        rv_param = params.get("resourceVersion") or ""
        allow_bm = _truthy(params.get("allowWatchBookmarks"))
        timeout_s = params.get("timeoutSeconds")
        try:
            timeout = float(timeout_s) if timeout_s not in (None, "") else None
        except ValueError:
            raise ApiError(400, f"invalid timeoutSeconds: {timeout_s!r}") from None
        send_initial_p = params.get("sendInitialEvents")
        if send_initial_p not in (None, ""):
            initial = _truthy(send_initial_p)
            if initial and params.get("resourceVersionMatch") != "NotOlderThan":
                raise ApiError(422, "sendInitialEvents requires setting resourceVersionMatch "
                                    "to NotOlderThan", reason="Invalid")
            initial_end = initial
        else:
            initial = rv_param in ("", "0")
            initial_end = False
        # RV unset or "0" without initial events: start at the most recent state.
        start_rv = None if rv_param in ("", "0") else _parse_rv(rv_param)
        self.traffic.record(watches=1)
        self.traffic.record_node("watches_by_node", selector.node if kind == "Pod" else None)
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Cache-Control: no-cache, private\r\nTransfer-Encoding: chunked\r\n\r\n")
        fault = self.faults.watch_answer
        if fault is not None:   # faults.answer_watches_with: not a stream at all
            self.traffic.record(faults_injected=1)
            if fault == "list":
                rv, items = self._store.list(kind, selector if selector else None)
                self._send(h, 200, _list_body(kind, rv=rv, items=items))
            else:
                try:
                    h.connection.sendall(head + _CHUNK_END)
                    self.traffic.record(bytes_sent=len(head) + len(_CHUNK_END))
                except OSError:
                    h.close_connection = True
            return
        try:
            w = self._store.register_watch(kind, selector if selector else None,
                                           start_rv=start_rv, initial=initial,
                                           initial_end_bookmark=initial_end and allow_bm)
        except Expired as err:
            data = head + _chunk(error_line(err)) + _CHUNK_END
            self.traffic.record(watch_errors_sent=1, bytes_sent=len(data))
            try:
                h.connection.sendall(data)
            except OSError:
                h.close_connection = True
            return
        w.sock = h.connection
        self.traffic.record(watches_open=1)
        try:
            if self._stopping:
                w.dropped = True
            h.connection.sendall(head)
            self.traffic.record(bytes_sent=len(head))
            clean = self._stream(h, w, kind, allow_bm, timeout)
            if clean:
                h.connection.sendall(_CHUNK_END)
                self.traffic.record(bytes_sent=len(_CHUNK_END))
            else:
                h.close_connection = True
        except OSError:
            h.close_connection = True
        finally:
            self._store.unregister(w)
            self.traffic.record(watches_open=-1)

    def _stream(self, h: Handler, w: Watcher, kind: str, allow_bm: bool,
                timeout: float | None) -> bool:
        """Write the watch's events until timeout (True: end cleanly) or a drop/hang-up."""
        sock = h.connection
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        started = time.monotonic()
        deadline = started + timeout if timeout is not None else None
        interval = self.bookmark_interval if allow_bm and self.bookmark_interval > 0 else None
        next_bm = started + interval if interval else None
        while True:
            now = time.monotonic()
            lines: list[bytes] = []
            events = bookmarks = 0
            with w.cond:
                if not w.items and not w.dropped:
                    wake = 1.0
                    for t in (deadline, next_bm):
                        if t is not None:
                            wake = min(wake, t - now)
                    if wake > 0:
                        w.cond.wait(wake)
                elif w.items and w.items[0].deliver_at > now and not w.dropped:
                    wake = w.items[0].deliver_at - now
                    for t in (deadline, next_bm):
                        if t is not None:
                            wake = min(wake, t - now)
                    if wake > 0:
                        w.cond.wait(wake)
                now = time.monotonic()
                while w.items and w.items[0].deliver_at <= now:
                    it = w.items.popleft()
                    if it.rv is not None and it.rv > w.last_rv:
                        w.last_rv = it.rv
                    if it.line is not None:
                        lines.append(_chunk(it.line))
                        events += it.is_event
                        bookmarks += it.is_bookmark
                dropped = w.dropped
            if dropped or self._stopping:
                return False
            if lines:
                data = b"".join(lines)
                sock.sendall(data)
                self.traffic.record(bytes_sent=len(data), watch_events_sent=events,
                                    bookmarks_sent=bookmarks)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                if allow_bm:
                    self._send_bookmark(sock, w, kind)
                return True
            if next_bm is not None and now >= next_bm:
                self._send_bookmark(sock, w, kind)
                next_bm = now + interval
            if not lines and _peer_closed(sock, poller):
                return False

    def _send_bookmark(self, sock: socket.socket, w: Watcher, kind: str) -> None:
        rv = self._store.bookmark_rv(w)
        if rv is None:
            return
        data = _chunk(bookmark_line(kind, rv))
        sock.sendall(data)
        self.traffic.record(bytes_sent=len(data), bookmarks_sent=1)


def _list_body(kind: str, *, rv: int, items: list[bytes]) -> bytes:
    """A list response body from serialized items, as the API server writes it."""
    return b"".join((b'{"kind":"', KINDS[kind][1].encode(),
                     b'","apiVersion":"v1","metadata":{"resourceVersion":"',
                     str(rv).encode(), b'"},"items":[', b",".join(items), b"]}"))


def _parse_rv(value: str) -> int:
    try:
        rv = int(value)
    except ValueError:
        raise ApiError(400, f"invalid resource version: {value!r}") from None
    if rv < 0:
        raise ApiError(400, f"invalid resource version: {value!r}")
    return rv


def _join_sel(a: str | None, b: str) -> str:
    return f"{a},{b}" if a else b


def _peer_closed(sock: socket.socket, poller: select.poll) -> bool:
    """True if the client hung up (EOF or error) while we had nothing to send."""
    try:
        events = poller.poll(0)
    except OSError:
        return True
    for _fd, ev in events:
        if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
            return True
        if ev & select.POLLIN:
            try:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True
    return False
