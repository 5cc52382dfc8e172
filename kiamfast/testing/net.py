"""Loopback plumbing every harness shares (tests, benchmarks, the demo): a free port, waiting
for a listener, pod addresses, one HTTP request from a pod's address.

A pod on a loopback node is a source address: Linux routes all of 127/8 to ``lo``, so a
client socket bound to 127.0.x.y is that pod to the agent (which knows callers by their
TCP source address), with no root and no namespaces.
"""
from __future__ import annotations

import errno
import random
import socket
import subprocess
import time
from typing import Callable

__all__ = ["ExitedEarly", "ephemeral_range", "free_port", "http_request", "one_request",
           "pod_addresses", "split_response", "wait_port"]


class ExitedEarly(RuntimeError):
    """The process exited before it did what it was waited for."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def free_port() -> int:
    """A TCP port nothing listens on, on every local address, IPv6 included where the
    machine has it (the agent listens on ``::`` by default). Chosen below the kernel's
    ephemeral range (``ip_local_port_range``), where no connection this machine opens
    meanwhile can take it first: not another process's, and not the harness's own to that
    very port while nothing listens there yet, which Linux may connect to itself (a TCP
    self-connect; it held the port when the agent came to bind it)."""
    low, _ = ephemeral_range()
    first = 10000 if low > 11000 else 1024
    for _ in range(200):
        port = random.randrange(first, low) if low > first else 0
        if port and _bindable(port):
            return port
    with socket.socket() as s:                # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for connections and binds to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999                   # Linux's default


def _bindable(port: int) -> bool:
    """Whether ``port`` is free on every address: a dual-stack ``::`` bind (or, without
    IPv6, ``0.0.0.0``) conflicts with any socket bound to it."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind((host, port))
                return True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
    return False


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
