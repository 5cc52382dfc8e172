"""``--ready-file``: this agent's own readiness, for an exec probe (``test -f PATH``).

During a handover two agents serve one listening socket and one table, so an HTTP probe on
the shared port may be answered by either: it cannot say whether *this* pod is ready.  The
supervisor knows: its file exists exactly while the table is marked ready by a writer that
is this supervisor's own control process (the table header names the pid of its writer).
It lives in the container's own file system (never the hostPath another pod shares), and
``test -f`` is a shell builtin: the probe starts no Python.

The supervisor also waits here for its own children: a worker that answers HTTP, and its
control process's word that it took the table lock and, in runtime mode, its first poll.
"""
from __future__ import annotations

import logging
import os
import socket
import time

from kiamfast.supervisor.children import Child

log = logging.getLogger("kiamfast.supervisor")


class ReadyFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.shown: bool | None = None

    def show(self, ready: bool) -> None:
        """Create or remove the file when readiness changes (and once at the start)."""
        if not self.path or ready == self.shown:
            return
        try:
            if ready:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
                os.write(fd, f"{os.getpid()}\n".encode())
                os.close(fd)
            else:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        except OSError as e:
            log.error("cannot %s the ready file %s: %s", "create" if ready else "remove",
                      self.path, e)
            return
        if self.shown is not None or ready:
            log.info("%s ready file %s", "created" if ready else "removed", self.path)
        self.shown = ready


def own_control_ready(view, control_pid: int | None, since_ns: int) -> bool:
    """Whether the table ``view`` is marked ready by the control process ``control_pid``,
    which became its writer at ``since_ns`` (CLOCK_MONOTONIC).

    The header names the writer from its attach on, but ``ready`` may still be the previous
    writer's (a takeover, a table served on after a crash) until the new one clears it at
    its start.  Its heartbeats come after that: one dated after ``since_ns`` (read before
    ``ready``, both published with release) proves the flag is this writer's."""
    if view is None or control_pid is None:
        return False
    try:
        if view.writer_pid != control_pid:
            return False
        age = view.heartbeat_age
        if age is None or time.monotonic_ns() - age * 1e9 <= since_ns:
            return False
        return view.ready
    except Exception:   # a closed table: not ready
        return False


def answers_http(host: str, port: int, *, workers: list[Child], timeout: float) -> bool:
    """Whether a worker answers HTTP on ``port``.  The socket is bound by the supervisor, so
    a connection alone proves nothing (the kernel queues it): wait for an answer."""
    if host in ("::", "0.0.0.0"):
        host = "127.0.0.1"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.proc and c.proc.poll() is not None for c in workers):
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: kiamfast\r\n"
                          b"Connection: close\r\n\r\n")
                if s.recv(16).startswith(b"HTTP/1."):
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def lock_taken_at(control: Child, deadline: float) -> int | None:
    """When the control process took the table lock (CLOCK_MONOTONIC ns), from its ready
    pipe (writer_lock.hold: ``L`` and 8 bytes), which is closed then; None if it has not
    said so by ``deadline``."""
    said = b""
    while len(said) < 9 and time.monotonic() < deadline:
        more = control.read_ready(9 - len(said), deadline - time.monotonic())
        if not more:
            break
        said += more
    control.close_ready_pipe()
    if len(said) == 9 and said[:1] == b"L":
        return int.from_bytes(said[1:], "little")
    return None


def await_first_poll(view, control: Child, locked_at: int | None, *, deadline: float) -> None:
    """Until ``deadline``, wait for the first runtime poll (or failed attempt) in the table
    ``view`` that began after the control process took the lock at ``locked_at``."""
    while locked_at is None or max(view.verified_ns, view.failed_ns) < locked_at:
        if time.monotonic() > deadline or not control.alive():
            log.warning("our control process has not polled the runtime yet; accepting "
                        "anyway")
            return
        time.sleep(0.002)
    log.info("our control process polled the runtime %.0f ms after it took the lock",
             (time.monotonic_ns() - locked_at) / 1e6)
