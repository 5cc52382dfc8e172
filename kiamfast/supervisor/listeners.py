"""The listening sockets the supervisor binds once and hands down: the app port (and a
separate metrics port) to every worker, the container-credentials addresses to the control
process only.  Held here, they outlive any child: connections wait in the backlog while a
worker or the control process restarts.

A socket may also come from elsewhere: the socket keeper (a restarted container gets back
what it deposited) or the agent it takes the node over from.  Each comes with a description
(kind, host, port) and is used only if it is a listening TCP socket bound where this
agent's configuration says that kind listens (getsockname): anything else is closed, and
the source refused in one log line.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from dataclasses import dataclass

from kiamfast.config import Config, container_credentials_addrs
from kiamfast.container_credentials.link import ensure_addresses
from kiamfast.fdpass import listening_address
from kiamfast.sockets import ListenError, listen_socket

log = logging.getLogger("kiamfast.supervisor")

APP, METRICS, CONTAINER, SECOND = "app", "metrics", "container-credentials", "second"


class ForeignSocket(Exception):
    """A socket handed to this agent is not one its configuration listens on."""


@dataclass
class Listener:
    kind: str          # APP, METRICS, CONTAINER or SECOND (the app protocol on --handover-port)
    host: str          # as configured ("" = every address, dual-stack)
    port: int
    sock: socket.socket

    def description(self) -> dict:
        return {"kind": self.kind, "host": self.host, "port": self.port}

    def close(self) -> None:
        self.sock.close()


def wanted(config: Config, *, second_port: bool = False) -> list[tuple[str, str, int]]:
    """(kind, host, port) of every socket this configuration listens on; with
    ``second_port`` the app protocol listens on --handover-port instead of --app-port."""
    host = config.listen_host
    out = [(SECOND, host, config.handover_port) if second_port else (APP, host, config.app_port)]
    if config.metrics_port not in (0, config.app_port):
        out.append((METRICS, host, config.metrics_port))
    if config.container_credentials_addr:
        out += [(CONTAINER, h, p)
                for h, p in container_credentials_addrs(config.container_credentials_addr)]
    return out


def listeners(config: Config) -> list[socket.socket]:
    """The app port's listening socket and, for a separate --metrics-port, the metrics one;
    bound here once for every worker (see the module docstring)."""
    return [lst.sock for lst in take(config, [], container=False)]


def take(config: Config, received: list[tuple[dict, socket.socket]], *,
         second_port: bool = False, container: bool = True,
         skip_taken: tuple[str, ...] = ()) -> list[Listener]:
    """Every socket of :func:`wanted`: a received one where it matches (else ForeignSocket:
    everything received is closed), bound here where none came.  Received sockets this
    configuration has no use for are closed (one log line).  ``skip_taken``: kinds left
    out, with a warning, when another process holds their port (second-port start)."""
    pool = list(received)
    out: list[Listener] = []
    binding: list[tuple[str, str, int]] = []
    try:
        for kind, host, port in wanted(config, second_port=second_port):
            if kind == CONTAINER and not container:
                continue
            found = _pick(pool, kind, host, port)
            if found is not None:
                out.append(Listener(kind, host, port, found))
            else:
                binding.append((kind, host, port))
        for desc, sock in pool:
            log.warning("closing a handed-over %s socket this configuration does not "
                        "listen on (%s)", desc.get("kind"), listening_address(sock))
            sock.close()
        pool = []
        out += _bind(config, binding, skip_taken=skip_taken)
    except BaseException:
        for _, sock in pool:
            sock.close()
        for lst in out:
            lst.close()
        raise
    return out


def _pick(pool: list[tuple[dict, socket.socket]], kind: str, host: str,
          port: int) -> socket.socket | None:
    for i, (desc, sock) in enumerate(pool):
        if desc.get("kind") != kind or (kind == CONTAINER and
                                        (desc.get("host"), desc.get("port")) != (host, port)):
            continue
        got = listening_address(sock)
        if got is None or got[1] != port or not _same_host(host, got[0]):
            raise ForeignSocket(f"the {kind} socket handed over listens on {got}, this "
                                f"agent's configuration on {host or '*'} port {port}")
        del pool[i]
        return sock
    return None


def _same_host(configured: str, bound: str) -> bool:
    if configured in ("", "::"):
        return bound in ("::", "0.0.0.0")
    try:
        return ipaddress.ip_address(configured) == ipaddress.ip_address(bound.split("%")[0])
    except ValueError:
        return False


def _bind(config: Config, todo: list[tuple[str, str, int]], *,
          skip_taken: tuple[str, ...]) -> list[Listener]:
    out: list[Listener] = []
    container = [(h, p) for kind, h, p in todo if kind == CONTAINER]
    if container and config.container_credentials_link:
        held = set(ensure_addresses(config.container_credentials_link,
                                    list(dict.fromkeys(h for h, _ in container))))
        todo = [(k, h, p) for k, h, p in todo if k != CONTAINER or h in held]
    try:
        for kind, host, port in todo:
            try:
                out.append(Listener(kind, host, port, listen_socket(host or None, port)))
            except ListenError as e:
                if kind in skip_taken and e.errno == errno.EADDRINUSE:
                    log.warning("%s port %d is held by another process: not served until "
                                "this agent is restarted", kind, port)
                    continue
                raise
    except BaseException:
        for lst in out:
            lst.close()
        raise
    return out


def take_for_start(config: Config, received: list[tuple[dict, socket.socket]]
                   ) -> tuple[Listeners, bool]:
    """The sockets to start on (:func:`take`) and whether on the second port: the keeper's
    were (deposited before the move back), or --app-port is taken and --handover-port set
    (a separate metrics port or container-credentials address taken too is left out)."""
    kinds = {d.get("kind") for d, _ in received}
    second = SECOND in kinds and APP not in kinds
    try:
        return Listeners(take(config, received, second_port=second)), second
    except ListenError as e:
        if e.errno != errno.EADDRINUSE or e.port != config.app_port \
                or not config.handover_port or received:
            raise
    return Listeners(take(config, [], second_port=True, skip_taken=(METRICS, CONTAINER))), True


def of_kind(held: list[Listener], *kinds: str) -> list[Listener]:
    return [lst for lst in held if lst.kind in kinds]


class Listeners:
    """The listening sockets this agent holds now, whatever their source: what the workers
    and the control process inherit, what is handed over or deposited with the keeper."""

    def __init__(self, held: list[Listener] | None = None) -> None:
        self.held = list(held or [])

    def __iter__(self):
        return iter(self.held)

    def of_kind(self, *kinds: str) -> list[Listener]:
        return of_kind(self.held, *kinds)

    @property
    def app(self) -> Listener:
        """The one the app protocol listens on: --app-port, else the second port."""
        return (self.of_kind(APP) or self.of_kind(SECOND))[0]

    def descriptions(self) -> list[dict]:
        return [lst.description() for lst in self.held]

    def fds(self) -> list[int]:
        return [lst.sock.fileno() for lst in self.held]

    def add(self, lst: Listener) -> None:
        self.held.append(lst)

    def drop(self, gone: list[Listener]) -> None:
        """No longer held here (the caller closes them once no child listens on them)."""
        self.held = [lst for lst in self.held if lst not in gone]

    def close(self) -> None:
        for lst in self.held:
            lst.close()
        self.held = []
