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
        srv.add_node("node-a")
        srv.create_pod("default", "web-1", node="node-a", ips=["10.0.0.5"], phase="Running")
        path = srv.write_kubeconfig("/tmp/kubeconfig")

or from a shell: ``python -m kiamfast.testing.apiserver --port 8001 --kubeconfig kc.yaml``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any

import orjson

from kiamfast.testing.apiserver_http import Handler, HttpFrontend, Listener
from kiamfast.testing.apiserver_objects import (
    make_namespace,
    make_node,
    make_pod,
    node_address,
    now_rfc3339,
    set_annotations,
    set_status_ips,
)
from kiamfast.testing.apiserver_store import AlreadyExistsError, NotFoundError, Store

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
  creates and deletes are done from Python. create_pod auto-creates a missing namespace.
Found against a real kube-apiserver 1.34 (tests/k8s):
- Bookmarks come every bookmark_interval even when nothing changed; the real server sends
  one only when some object changed past the watch's resourceVersion (2 s before the
  deadline, or about once a minute).
- compact() answers 410 to watches from before the compaction; a real server with its watch
  cache on keeps serving them from the cache (only --watch-cache=false answers 410: an
  ERROR event, reason Expired, "The resourceVersion for the provided watch is too old.").
- The pods/status subresource is 404 here (200 on a real server); a created node gets no
  node.kubernetes.io/not-ready taint but made-up Ready conditions and an address; error
  messages and details (422, 409, bad selectors) are worded differently; objects carry no
  managedFields or generation; there is no RBAC.
"""

_DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class _Fault:
    __slots__ = ("remaining", "status", "path_prefix")

    def __init__(self, n: int, status: int, path_prefix: str | None) -> None:
        self.remaining = n
        self.status = status
        self.path_prefix = path_prefix


class ApiServer(HttpFrontend):
    """An in-process Kubernetes API server emulator. See the module docstring."""

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
        self._faults: list[_Fault] = []
        self._fault_lock = threading.Lock()
        self._slow_list = 0.0
        self._watch_fault: str | None = None
        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = self._zero_stats()
        self._stopping = False
        self._node_seq = 0
        if default_namespaces:
            for ns in _DEFAULT_NAMESPACES:
                self.add_namespace(ns)

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
        self.drop_watches()
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

    # ------------------------------------------------------------------ namespaces, nodes

    def add_namespace(self, name: str, *, annotations: dict | None = None) -> dict:
        """Create the namespace, or (if it exists) set its annotations when given."""
        with self._store.lock:
            if self._store.get("Namespace", ("", name)) is not None:
                if annotations is None:
                    return self._store.copy_of("Namespace", ("", name))
                return self.set_namespace_annotations(name, annotations)
            return self._store.create("Namespace", make_namespace(
                name, uid=str(uuid.uuid4()), annotations=annotations))

    def set_namespace_annotations(self, name: str, annotations: dict | None) -> dict:
        """Replace the namespace's annotations (MODIFIED)."""
        return self._store.modify("Namespace", ("", name),
                                  lambda o: set_annotations(o["metadata"], annotations))

    def add_node(self, name: str, *, taints: list | None = None,
                 address: str | None = None) -> dict:
        """Create a Ready node (or replace an existing node's taints when given)."""
        with self._store.lock:
            if self._store.get("Node", ("", name)) is not None:
                if taints is None:
                    return self.get_node(name)
                return self.set_node_taints(name, taints)
            self._node_seq += 1
            seq = self._node_seq
            address = address or f"172.31.{(seq >> 8) & 255}.{seq & 255}"
            return self._store.create("Node", make_node(
                name, uid=str(uuid.uuid4()), taints=taints, address=address))

    def get_node(self, name: str) -> dict:
        node = self._store.copy_of("Node", ("", name))
        if node is None:
            raise NotFoundError(f'nodes "{name}" not found')
        return node

    def set_node_ready(self, name: str, status: str, *,
                       message: str = "kubelet is posting ready status") -> dict:
        """The kubelet's Ready condition: "True", "False" (e.g. "container runtime is
        down") or "Unknown"; its lastTransitionTime moves only when the status changes."""
        def fn(o: dict) -> None:
            for cond in o.setdefault("status", {}).setdefault("conditions", []):
                if cond.get("type") == "Ready":
                    now = now_rfc3339()
                    if cond.get("status") != status:
                        cond["lastTransitionTime"] = now
                    cond.update(status=status, message=message, lastHeartbeatTime=now)
        return self._store.modify("Node", ("", name), fn)

    def set_node_taints(self, name: str, taints: list | None) -> dict:
        def fn(o: dict) -> None:
            if taints:
                o.setdefault("spec", {})["taints"] = [dict(t) for t in taints]
            else:
                o.setdefault("spec", {}).pop("taints", None)
        return self._store.modify("Node", ("", name), fn)

    # ------------------------------------------------------------------ pods

    def create_pod(self, namespace: str, name: str, *, node: str,
                   annotations: dict | None = None, ips: list[str] | None = None,
                   phase: str = "Pending", host_network: bool = False,
                   uid: str | None = None) -> dict:
        """Create a pod bound to ``node`` (ADDED)."""
        st = self._store
        with st.lock:
            if st.get("Namespace", ("", namespace)) is None:
                self.add_namespace(namespace)
            node_obj = st.get("Node", ("", node))
            pod = make_pod(namespace, name, uid=uid or str(uuid.uuid4()), node=node,
                           annotations=annotations, ips=list(ips) if ips else None,
                           phase=phase, host_network=host_network,
                           host_ip=node_address(node_obj.obj if node_obj else None))
            return st.create("Pod", pod)

    def _change_pod(self, namespace: str, name: str, fn) -> None:
        self._store.modify("Pod", (namespace, name), fn)

    def set_pod_ips(self, namespace: str, name: str, ips: list[str] | None) -> None:
        """Set ``status.podIP(s)`` (MODIFIED); None or [] clears them."""
        ips = list(ips) if ips else None
        self._change_pod(namespace, name, lambda o: set_status_ips(o["status"], ips))

    def set_pod_phase(self, namespace: str, name: str, phase: str) -> None:
        self._change_pod(namespace, name, lambda o: o["status"].__setitem__("phase", phase))

    def set_pod_annotations(self, namespace: str, name: str, annotations: dict | None) -> None:
        """Replace the pod's annotations."""
        self._change_pod(namespace, name,
                         lambda o: set_annotations(o["metadata"], annotations))

    def mark_pod_terminating(self, namespace: str, name: str) -> None:
        """Set ``metadata.deletionTimestamp`` (a graceful delete has begun)."""
        ts = now_rfc3339()

        def fn(o: dict) -> None:
            o["metadata"].setdefault("deletionTimestamp", ts)
            o["metadata"].setdefault("deletionGracePeriodSeconds", 30)
        self._change_pod(namespace, name, fn)

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete the pod (DELETED)."""
        self._store.delete("Pod", (namespace, name))

    def get_pod(self, namespace: str, name: str) -> dict | None:
        return self._store.copy_of("Pod", (namespace, name))

    # ------------------------------------------------------------------ faults

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
        with self._fault_lock:
            self._faults.append(_Fault(n, status, path_prefix))

    def answer_watches_with(self, fault: str | None) -> None:
        """Answer every watch request badly until called with None (then stream again):
        ``"list"``: 200 with a plain list, as a proxy or server that ignores ``watch=true``
        would; ``"empty"``: 200 with a stream that ends at once, with no event or bookmark.
        Such requests count in ``watches`` and ``faults_injected``."""
        if fault not in (None, "list", "empty"):
            raise ValueError("fault must be 'list', 'empty' or None")
        self._watch_fault = fault

    def slow_list(self, seconds: float) -> None:
        """Answer every LIST ``seconds`` late (the snapshot is taken before the wait)."""
        self._slow_list = max(0.0, float(seconds))

    def _take_fault(self, path: str) -> int | None:
        with self._fault_lock:
            for f in self._faults:
                if f.path_prefix is not None and not path.startswith(f.path_prefix):
                    continue
                f.remaining -= 1
                if f.remaining <= 0:
                    self._faults.remove(f)
                return f.status
        return None

    # ------------------------------------------------------------------ stats

    @staticmethod
    def _zero_stats() -> dict[str, Any]:
        return {"requests": 0, "lists": 0, "gets": 0, "patches": 0, "watches": 0,
                "watches_open": 0, "watch_events_sent": 0, "bookmarks_sent": 0,
                "watch_errors_sent": 0, "bytes_sent": 0, "errors": 0, "faults_injected": 0,
                "lists_by_node": {}, "watches_by_node": {}}

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _count_node(self, table: str, node: str | None) -> None:
        if node is None:
            return
        with self._stats_lock:
            d = self._stats[table]
            d[node] = d.get(node, 0) + 1

    def stats(self) -> dict:
        """Counters since start (or the last ``reset_stats``); per-node dicts are copies."""
        with self._stats_lock:
            out = dict(self._stats)
            out["lists_by_node"] = dict(out["lists_by_node"])
            out["watches_by_node"] = dict(out["watches_by_node"])
        out["resource_version"] = int(self.resource_version)
        return out

    def reset_stats(self) -> None:
        with self._stats_lock:
            open_now = self._stats["watches_open"]
            self._stats = self._zero_stats()
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
        srv.add_node(node)
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
