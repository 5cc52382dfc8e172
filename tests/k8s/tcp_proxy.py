"""A loopback TCP proxy whose connections the test can cut, as a load balancer or a
restarting API server would: the agent's watch is a long-lived HTTPS stream, and "the
connection dropped" has to happen to real sockets, between the real client and server.

``cut()`` resets every open connection; ``down()`` also refuses new ones (accepted and
closed at once) until ``up()``. Bytes pass through untouched (TLS ends at the API server).
"""
from __future__ import annotations

import socket
import struct
import threading


class TcpProxy:
    def __init__(self, *, target_port: int, listener: socket.socket | None = None) -> None:
        """``listener``: a listening socket made elsewhere, e.g. inside a node's network
        namespace (a socket keeps the namespace it was made in): the proxy then carries
        that namespace's connections to the API server on this one's loopback."""
        self.target = ("127.0.0.1", target_port)
        self._listener = listener or socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._accepting = True
        self._closed = False
        self.accepted = 0
        threading.Thread(target=self._accept_loop, daemon=True, name="tcp-proxy").start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed or not self._accepting:
                    _reset(client)
                    continue
                self.accepted += 1
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                # down() may have cut the open ones while this one was being connected: it
                # must not outlive the cut
                if self._closed or not self._accepting:
                    _reset(client)
                    _reset(upstream)
                    continue
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._open.discard(s)
                _reset(s)

    def cut(self) -> int:
        """Reset every open connection; returns how many sockets were cut."""
        with self._lock:
            sockets = list(self._open)
            self._open.clear()
        for s in sockets:
            _reset(s)
        return len(sockets)

    def down(self) -> None:
        with self._lock:
            self._accepting = False
        self.cut()

    def up(self) -> None:
        with self._lock:
            self._accepting = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._listener.close()
        self.cut()


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to the peer."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
