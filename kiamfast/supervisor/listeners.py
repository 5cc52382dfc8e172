"""The listening sockets the supervisor binds once and hands down: the app port (and a
separate metrics port) to every worker, the container-credentials addresses to the control
process only.  Held here, they outlive any child: connections wait in the backlog while a
worker or the control process restarts."""
from __future__ import annotations

import socket

from kiamfast.config import Config, container_credentials_addrs
from kiamfast.container_credentials.link import ensure_addresses
from kiamfast.sockets import listen_socket


def listeners(config: Config) -> list[socket.socket]:
    """The app port's listening socket and, for a separate --metrics-port, the metrics one;
    bound here once for every worker (see the module docstring)."""
    host = config.listen_host or None
    socks = [listen_socket(host, config.app_port)]
    if config.metrics_port not in (0, config.app_port):
        socks.append(listen_socket(host, config.metrics_port))
    return socks


def container_credentials_listeners(config: Config) -> list[socket.socket]:
    """The container-credentials sockets (--container-credentials-addr), bound here like the
    app port so requests wait in their backlog while the control process restarts.  With
    --container-credentials-link the addresses are put on that link first; an IPv6 one it
    cannot hold is not listened on (`link.ensure_addresses` logs why)."""
    if not config.container_credentials_addr:
        return []
    addrs = container_credentials_addrs(config.container_credentials_addr)
    if config.container_credentials_link:
        held = set(ensure_addresses(config.container_credentials_link,
                                    list(dict.fromkeys(host for host, _ in addrs))))
        addrs = [(host, port) for host, port in addrs if host in held]
    socks: list[socket.socket] = []
    try:
        for host, port in addrs:
            socks.append(listen_socket(host, port))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks
