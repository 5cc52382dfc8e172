"""Loopback plumbing every harness shares (tests, benchmarks, the demo): a free port, waiting
for a listener, pod addresses, one HTTP request from a pod's address.

A pod on a loopback node is a source address: Linux routes all of 127/8 to ``lo``, so a
client socket bound to 127.0.x.y is that pod to the agent (which knows callers by their
TCP source address), with no root and no namespaces.
"""
from __future__ import annotations

import socket
import subprocess
import time
from typing import Callable

__all__ = ["ExitedEarly", "free_port", "http_request", "one_request", "pod_addresses",
           "split_response", "wait_port"]


class ExitedEarly(RuntimeError):
    """The process exited before it did what it was waited for."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def free_port() -> int:
    """A TCP port nothing listens on, on 127.0.0.1 and on every other local address, IPv6
    included where the machine has it (the agent listens on ``::`` by default): bound and
    released at once, so nothing else takes it soon."""
    try:
        with socket.socket(socket.AF_INET6) as s:     # dual stack: reserves the IPv4 port too
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:                                   # no IPv6 here
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen | None = None, *, host: str = "127.0.0.1",
              timeout: float = 20.0, log: Callable[[], str] | None = None) -> None:
    """Until something accepts connections on ``host:port``. ExitedEarly when ``proc``
    exits first, RuntimeError when ``timeout`` passes; ``log()``'s text ends the message."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise ExitedEarly(f"{_name(proc)} exited with {proc.returncode} before it "
                              f"listened on {host}:{port}" + _tail(log), proc.returncode)
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listened on {host}:{port} within {timeout:g} s"
                                   + _tail(log)) from None
            time.sleep(0.02)


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return " ".join(str(a) for a in args[:3])


def _tail(log: Callable[[], str] | None) -> str:
    return f":\n{log()}" if log is not None else ""


def pod_addresses(n: int, *, start: int = 0) -> list[str]:
    """``n`` loopback pod addresses 127.0.x.y (x >= 1, 1 <= y <= 250), from the ``start``-th."""
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(start, start + n)]


def http_request(method: str, path: str, *, host: str = "169.254.169.254",
                 headers: dict[str, str] | None = None, close: bool = True) -> bytes:
    """One HTTP/1.1 request without a body, as an SDK sends it to the metadata service;
    ``close``: with ``Connection: close`` (the server ends the exchange)."""
    fields = {**(headers or {}), **({"Connection": "close"} if close else {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{lines}\r\n".encode()


def one_request(port: int, request: bytes, *, source: str | None = "127.0.0.1",
                host: str = "127.0.0.1", timeout: float = 5.0) -> bytes:
    """``request`` on a fresh connection to ``host:port`` from ``source`` (None: any
    address); everything the server sent until it closed (so ask with Connection: close)."""
    with socket.create_connection((host, port), timeout=timeout,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(request)
        parts = []
        while chunk := s.recv(65536):
            parts.append(chunk)
    return b"".join(parts)


def split_response(raw: bytes) -> tuple[int, bytes, bytes]:
    """(status, head, body) of one whole HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body
