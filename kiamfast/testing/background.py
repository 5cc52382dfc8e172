"""The life cycle shared by the in-process HTTP test doubles (fake IMDS, STS fault proxy):
serve a stdlib server on a daemon thread, stop it, use it as a context manager."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class BackgroundServer:
    """Subclasses build their server in ``start()`` and hand it to ``_serve``."""

    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def _serve(self, server: ThreadingHTTPServer, *, name: str) -> None:
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=name,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def start(self):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
