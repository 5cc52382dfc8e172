"""The agent's listening sockets: bound once, by the process that keeps them.

``::`` dual-stack with ``IPV6_V6ONLY=0`` unless a host is configured, so IPv4 pods arrive as
``::ffff:a.b.c.d`` and IPv6 pods as themselves.  Bound without ``SO_REUSEPORT`` on purpose:
with it, any root process on the host network (a hostNetwork pod) could bind the port too and
be handed a share of every pod's credential requests; without it, the kernel refuses that
bind.  A leaf module (the supervisor imports it without the workers' event loop).
"""
from __future__ import annotations

import socket


class ListenError(Exception):
    """A socket could not be bound (the port is taken, the address is not local...);
    ``errno`` is the bind's (``errno.EADDRINUSE``: another process holds the port)."""

    def __init__(self, message: str, *, errno: int | None = None, port: int = 0) -> None:
        super().__init__(message)
        self.errno = errno
        self.port = port


def listen_socket(host: str | None, port: int, *, reuse_port: bool = False,
                  backlog: int = 2048) -> socket.socket:
    """A bound, listening, non-blocking TCP socket; ``host=None`` means dual-stack ``::``."""
    if host in (None, "", "::"):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            bind_host = "::"
        except OSError:  # no IPv6 in this kernel/namespace
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            bind_host = "0.0.0.0"
    else:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        bind_host = host
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((bind_host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {bind_host} port {port}: {e}",
                          errno=e.errno, port=port) from e
    return sock


def raise_fd_limit() -> None:
    """Every pod connection is a file descriptor (and a flood's are accepted before they are
    reset): use the hard limit, not the soft 1024.  Each process that accepts calls it."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
