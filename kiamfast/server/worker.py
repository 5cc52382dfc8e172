"""A server worker process: sockets, event loop, signals around the Cython request path.

The supervisor starts ``--workers`` of these::

    python -P -m kiamfast.server.worker --table PATH --channel-fd FD --worker-index I \
        --listen-fd FD [--metrics-listen-fd FD] --settings-json JSON

The supervisor binds the listening socket once (``kiamfast.sockets.listen_socket``) and
every worker accepts on that same inherited socket. Started without ``--listen-fd``
(tests), a worker binds the port itself.

A worker attaches the shared table read-only, listens on its end of the channel for "the
table changed" wake-ups, and serves until SIGTERM/SIGINT, when it stops accepting, lets
outstanding answers finish (briefly) and exits.  Closing its descriptor of a listening
socket never closes the socket while another process holds one (the supervisor always
does): connections keep queueing in its backlog for whoever accepts next.

For a handover (docs/architecture.md, "Handing the node over"), ``--paused`` starts a worker
ready but not accepting until SIGUSR1, ``--ready-fd`` gets one byte once it is (paused or
listening), and ``--extra-listen-fds`` adds listening sockets served like the app port (the
second port an agent serves on while another process still holds ``--app-port``).

A worker must never import ``kubernetes`` or ``botocore`` (tests check ``sys.modules``):
it is a small, fast, read-only process, and a crash or a slow import in the control
process' libraries must never reach it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from kiamfast import milestones
from kiamfast import table as _table
from kiamfast.sockets import ListenError, listen_socket, raise_fd_limit
from kiamfast.server.settings import SettingsError, WorkerSettings
from kiamfast.server.upstream import Upstream

log = logging.getLogger("kiamfast.server")

SHUTDOWN_GRACE = 1.0  # seconds outstanding answers get after SIGTERM
# After it stops accepting, how long a worker waits before it closes connections that look
# idle: one accepted just before the stop may not have had its request read yet, and a
# client whose fresh connection is closed after it sent its request does not retry.
ACCEPTED_GRACE = 0.05


class WorkerError(Exception):
    """The worker cannot start (bad table, socket in use, bad channel fd...)."""


@dataclass
class WorkerServer:
    """A running worker inside an event loop (what tests start in-process)."""

    core: Any
    servers: list[asyncio.AbstractServer] = field(default_factory=list)   # app [, metrics]
    extra_servers: list[asyncio.AbstractServer] = field(default_factory=list)

    @property
    def all_servers(self) -> list[asyncio.AbstractServer]:
        return [*self.servers, *self.extra_servers]

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]

    @property
    def metrics_port(self) -> int:
        return self.servers[-1].sockets[0].getsockname()[1]

    async def close(self, *, grace: float = 0.0) -> None:
        """Stop accepting; with `grace`, let outstanding answers go out first."""
        for server in self.all_servers:
            server.close()
        if grace > 0:
            await asyncio.sleep(ACCEPTED_GRACE)
            self.core.drain()
            deadline = asyncio.get_running_loop().time() + grace
            while self.core.conns and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        self.core.close()
        for server in self.all_servers:
            await server.wait_closed()

    async def start_serving(self) -> None:
        """Begin accepting (a worker started paused)."""
        for server in self.all_servers:
            await server.start_serving()


async def serve(settings: WorkerSettings, table: Any, *, channel_sock: socket.socket | None = None,
                worker_index: int = 0, app_sock: socket.socket | None = None,
                metrics_sock: socket.socket | None = None,
                extra_socks: tuple[socket.socket, ...] = (),
                start_serving: bool = True) -> WorkerServer:
    """Start serving on the running loop (``start_serving=False``: ready, not accepting
    until :meth:`WorkerServer.start_serving`); sockets are opened unless given."""
    from kiamfast._server import Core  # the compiled request path

    loop = asyncio.get_running_loop()
    host, port = settings.upstream
    upstream = Upstream(host, port, timeout=settings.upstream_timeout,
                        token_ttl=settings.upstream_token_ttl)
    core = Core(settings, table, loop=loop, channel_sock=channel_sock,
                worker_index=worker_index, upstream=upstream)
    ws = WorkerServer(core)
    try:
        if app_sock is None:
            app_sock = listen_socket(settings.listen_host, settings.app_port,
                                     reuse_port=settings.reuse_port, backlog=settings.backlog)
        ws.servers.append(await loop.create_server(core.protocol, sock=app_sock,
                                                   backlog=settings.backlog,
                                                   start_serving=start_serving))
        if settings.separate_metrics_port or metrics_sock is not None:
            if metrics_sock is None:
                metrics_sock = listen_socket(settings.listen_host, settings.metrics_port or 0,
                                             reuse_port=settings.reuse_port)
            ws.servers.append(await loop.create_server(core.metrics_protocol, sock=metrics_sock,
                                                       start_serving=start_serving))
        for sock in extra_socks:
            ws.extra_servers.append(await loop.create_server(
                core.protocol, sock=sock, backlog=settings.backlog,
                start_serving=start_serving))
    except BaseException:
        core.close()
        for server in ws.all_servers:
            server.close()
        raise
    return ws


def _inherited_socket(fd: int | None, what: str) -> socket.socket | None:
    """A socket the supervisor created and passed down (`what`: for the error), if any."""
    if fd is None or fd < 0:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise WorkerError(f"{what} fd {fd} is not a socket: {e}") from e
    sock.setblocking(False)
    return sock


async def _run(settings: WorkerSettings, table_path: str, channel_fd: int | None,
               worker_index: int, *, listen_fds: tuple[int | None, int | None],
               extra_listen_fds: tuple[int, ...] = (), paused: bool = False,
               ready_fd: int | None = None) -> None:
    try:
        table = _table.Table.attach(table_path, writer=False)
    except (_table.TableError, OSError) as e:
        raise WorkerError(f"cannot attach the table: {e}") from e
    channel_sock = _inherited_socket(channel_fd, "channel")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):   # before listening: a stop is never lost
        loop.add_signal_handler(sig, stop.set)
    resume = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, resume.set)
    app_fd, metrics_fd = listen_fds
    extra = tuple(_inherited_socket(fd, "listen") or _no_socket(fd) for fd in extra_listen_fds)
    ws = await serve(settings, table, channel_sock=channel_sock, worker_index=worker_index,
                     app_sock=_inherited_socket(app_fd, "listen"),
                     metrics_sock=_inherited_socket(metrics_fd, "listen"),
                     extra_socks=extra,
                     start_serving=not paused)
    if settings.realtime:
        from kiamfast.server.realtime import RealtimeGovernor
        RealtimeGovernor().start(loop)
    if ready_fd is not None and ready_fd >= 0:
        _say_ready(ready_fd)
    if paused:
        log.info("worker ready, paused", extra={"worker": worker_index, "pid": os.getpid()})
        await _first(stop.wait(), resume.wait())
        if not stop.is_set():
            await ws.start_serving()
    if not stop.is_set():
        milestones.mark("worker listening", worker=worker_index, port=ws.port,
                        pid=os.getpid())
    await stop.wait()
    await ws.close(grace=SHUTDOWN_GRACE)
    table.close()


def _no_socket(fd: int) -> socket.socket:
    raise WorkerError(f"extra listen fd {fd} is not usable")


async def _first(*aws: Any) -> None:
    """Wait until the first of ``aws`` is done; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


def _say_ready(fd: int) -> None:
    """One byte on the supervisor's pipe: this worker is attached and holds its servers."""
    try:
        os.write(fd, b"w")
    except OSError:
        pass   # the supervisor stopped waiting: nothing to tell
    finally:
        os.close(fd)


def run_worker(settings: WorkerSettings, table_path: str, channel_fd: int | None,
               worker_index: int, *, listen_fd: int | None = None,
               metrics_listen_fd: int | None = None, extra_listen_fds: tuple[int, ...] = (),
               paused: bool = False, ready_fd: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT (blocking): the body of one worker process."""
    raise_fd_limit()
    body = _run(settings, table_path, channel_fd, worker_index,
                listen_fds=(listen_fd, metrics_listen_fd), extra_listen_fds=extra_listen_fds,
                paused=paused, ready_fd=ready_fd)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency
        asyncio.run(body)
        return
    uvloop.run(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiamfast-worker",
                                     description="kiamfast metadata server worker")
    parser.add_argument("--table", required=True, help="path of the shared table file")
    parser.add_argument("--channel-fd", type=int, default=-1,
                        help="inherited AF_UNIX datagram socket to the control process")
    parser.add_argument("--worker-index", type=int, default=0)
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="inherited listening socket for the app port (else: bind it)")
    parser.add_argument("--metrics-listen-fd", type=int, default=None,
                        help="inherited listening socket for a separate --metrics-port")
    parser.add_argument("--extra-listen-fds", default="",
                        help="comma-separated inherited listening sockets served like the "
                             "app port")
    parser.add_argument("--paused", action="store_true",
                        help="do not accept until SIGUSR1 (a handover's new worker)")
    parser.add_argument("--ready-fd", type=int, default=None,
                        help="inherited pipe: one byte once the worker holds its servers")
    parser.add_argument("--settings-json", required=True)
    parser.add_argument("--log-format", default="text")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    from kiamfast import logs

    logs.setup(log_format=args.log_format, level=args.log_level, process="worker")
    try:
        settings = WorkerSettings.from_json(args.settings_json)
        run_worker(settings, args.table, args.channel_fd, args.worker_index,
                   listen_fd=args.listen_fd, metrics_listen_fd=args.metrics_listen_fd,
                   extra_listen_fds=tuple(int(fd) for fd in args.extra_listen_fds.split(",")
                                          if fd),
                   paused=args.paused, ready_fd=args.ready_fd)
    except (SettingsError, WorkerError, ListenError) as e:
        log.error("worker %d cannot start: %s", args.worker_index, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
