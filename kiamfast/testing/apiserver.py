"""A wire-level Kubernetes API server emulator for tests, benchmarks and the demo.

Why it exists: kiamfast's correctness hangs on the list/watch protocol's edge cases (resume
from a resourceVersion, 410 Gone, bookmarks, stream timeouts, dropped streams, selector
transitions) and on the API server being late (a pod's address published seconds after its
sandbox runs). A mock of our own functions would test nothing, and a real API server
(tests/k8s) cannot produce every fault on demand; it stays for the demo and those faults. This emulator
speaks the real HTTP/JSON protocol so the unmodified ``kubernetes`` client, kiamfast's raw
watcher and curl all talk to it as they would to a real API server, while tests drive the
cluster state and inject faults from Python.

What it serves (``/api/v1``, JSON only): pods (all namespaces, per namespace, by name),
namespaces, nodes (GET, list, watch; PATCH with merge, strategic-merge and JSON patch),
``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/healthz``. There is no kubelet: the
agent learns pod addresses from the container runtime (``kiamfast.testing.cri_fault`` and a
real containerd stand in for it), not from a kubelet's ``/pods``.

What it must never do: block state changes on a slow client (watch writers run on the
connection's own thread and only drain a queue), or deliver a watch event out of order,
twice, or after a later one. Deviations from a real API server are listed in
``DEVIATIONS`` below.

Usage::

    from kiamfast.testing.apiserver import ApiServer
    with ApiServer(token="t") as srv:
        srv.nodes.add("node-a")
        srv.pods.create("default", "web-1", node="node-a", ips=["10.0.0.5"], phase="Running")
        path = srv.write_kubeconfig("/tmp/kubeconfig")
        srv.faults.drop_watches()
        assert srv.traffic.wait_watches(1, node="node-a")

``ApiServer`` itself is the lifecycle (start, stop, url, kubeconfig); a test reaches the rest
by job: the cluster's objects ``srv.namespaces``, ``srv.nodes``, ``srv.pods``
(apiserver_cluster.py), the faults it injects ``srv.faults`` (apiserver_faults.py) and what
clients did ``srv.traffic`` (apiserver_traffic.py); apiserver_http.py serves the requests.

or from a shell: ``python -m kiamfast.testing.apiserver --port 8001 --kubeconfig kc.yaml``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from typing import Any

import orjson

from kiamfast.testing.apiserver_cluster import Namespaces, Nodes, Pods
from kiamfast.testing.apiserver_faults import Faults
from kiamfast.testing.apiserver_http import Handler, HttpFrontend, Listener
from kiamfast.testing.apiserver_store import AlreadyExistsError, NotFoundError, Store
from kiamfast.testing.apiserver_traffic import Traffic

__all__ = ["AlreadyExistsError", "ApiServer", "DEVIATIONS", "NotFoundError"]

DEVIATIONS = """\
- HTTP only (no TLS); bearer-token auth only; a missing token is 401 (a real server with
  anonymous auth would answer 403 for resources).
- labelSelector is accepted and ignored; limit/continue are ignored (all items returned,
  never a continue token), which the API allows.
- A watch or NotOlderThan list with a resourceVersion newer than the server's is served
  from the current state at once (the real server waits up to ~3 s, then 504).
- Watches without timeoutSeconds never end on their own (a real server ends them after
  1800-3600 s). Bookmarks are sent every bookmark_interval s, not about once a minute.
- Strategic merge patch knows only a few merge keys (containers by name, conditions and
  addresses by type, podIPs by ip, ...); other lists, including spec.taints (atomic in
  core/v1 too), are replaced. Server-side apply is not supported (415).
- Only GET/list/watch (all kinds) and PATCH (nodes, pods, namespaces) are served over HTTP;
  creates and deletes are done from Python. pods.create auto-creates a missing namespace.
Found against a real kube-apiserver 1.34 (tests/k8s):
- Bookmarks come every bookmark_interval even when nothing changed; the real server sends
  one only when some object changed past the watch's resourceVersion (2 s before the
  deadline, or about once a minute).
- faults.compact() answers 410 to watches from before the compaction; a real server with its watch
  cache on keeps serving them from the cache (only --watch-cache=false answers 410: an
  ERROR event, reason Expired, "The resourceVersion for the provided watch is too old.").
- The pods/status subresource is 404 here (200 on a real server); a created node gets no
  node.kubernetes.io/not-ready taint but made-up Ready conditions and an address; error
  messages and details (422, 409, bad selectors) are worded differently; objects carry no
  managedFields or generation; there is no RBAC.
"""

_DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class ApiServer(HttpFrontend):
    """An in-process Kubernetes API server emulator: its lifecycle, and its objects
    (``namespaces``, ``nodes``, ``pods``), ``faults`` and ``traffic`` by job. See the module
    docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 history_window: int = 10_000, bookmark_interval: float = 1.0,
                 token: str | None = "test-token", default_namespaces: bool = True) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.bookmark_interval = bookmark_interval
        self._store = Store(history_window=history_window)
        self._httpd: Listener | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        self._stopping = False
        self.namespaces = Namespaces(self._store)
        self.nodes = Nodes(self._store)
        self.pods = Pods(self._store, self.namespaces)
        self.faults = Faults(self._store)
        self.traffic = Traffic(self._store)
        if default_namespaces:
            for ns in _DEFAULT_NAMESPACES:
                self.namespaces.add(ns)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "ApiServer":
        if self._httpd is not None:
            return self
        self._httpd = Listener((self.host, self.port), Handler, self)
        self.port = self._httpd.server_address[1]
        self._spawn(self._httpd, f"apiserver-emulator:{self.port}")
        return self

    def _spawn(self, httpd: Listener, name: str) -> None:
        t = threading.Thread(target=self._accept_loop, args=(httpd,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self, httpd: Listener) -> None:
        sock = httpd.socket
        while not self._stopping:
            try:
                conn, addr = sock.accept()
            except OSError:
                break
            if self._stopping:
                conn.close()
                break
            try:
                httpd.process_request(conn, addr)
            except Exception:  # noqa: BLE001 - a thread that cannot start drops one client
                conn.close()

    def stop(self) -> None:
        """Close the listener and every connection (open watches end abruptly)."""
        self._stopping = True
        httpd = self._httpd
        if httpd is not None:
            try:
                httpd.socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            httpd.server_close()
        self.faults.drop_watches()
        with self._conn_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2)
        self._threads.clear()

    def __enter__(self) -> "ApiServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("ApiServer not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion."""
        with self._store.lock:
            return str(self._store.rv)

    def write_kubeconfig(self, path: str | os.PathLike, *, namespace: str = "default") -> str:
        """Write a kubeconfig (JSON, which is YAML) for this server; returns the path."""
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [{"name": "kiamfast-emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "kiamfast-emulator", "user": user}],
            "contexts": [{"name": "kiamfast-emulator", "context": {
                "cluster": "kiamfast-emulator", "user": "kiamfast-emulator",
                "namespace": namespace}}],
            "current-context": "kiamfast-emulator",
        }
        path = os.fspath(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        return path


def main(argv: list[str] | None = None) -> int:
    """Run the emulator in the foreground until SIGINT/SIGTERM."""
    ap = argparse.ArgumentParser(prog="python -m kiamfast.testing.apiserver",
                                 description="Kubernetes API server emulator (kiamfast tests/demo)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--kubeconfig", help="write a kubeconfig for the emulator here")
    ap.add_argument("--token", default="test-token", help="bearer token ('' disables auth)")
    ap.add_argument("--node", action="append", default=[], help="create this node (repeatable)")
    ap.add_argument("--history-window", type=int, default=10_000)
    ap.add_argument("--bookmark-interval", type=float, default=1.0)
    args = ap.parse_args(argv)
    srv = ApiServer(args.host, args.port, history_window=args.history_window,
                    bookmark_interval=args.bookmark_interval, token=args.token or None)
    srv.start()
    info: dict[str, Any] = {"url": srv.url, "token": srv.token}
    if args.kubeconfig:
        info["kubeconfig"] = srv.write_kubeconfig(args.kubeconfig)
    for node in args.node:
        srv.nodes.add(node)
    sys.stdout.write(orjson.dumps(info).decode() + "\n")
    sys.stdout.flush()
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
