"""``--ready-file``: this agent's own readiness, for an exec probe (``test -f PATH``).

During a handover two agents serve one listening socket and one table, so an HTTP probe on
the shared port may be answered by either: it cannot say whether *this* pod is ready.  The
supervisor knows: its file exists exactly while the table is marked ready by a writer that
is this supervisor's own control process (the table header names the pid of its writer).
It lives in the container's own file system (never the hostPath another pod shares), and
``test -f`` is a shell builtin: the probe starts no Python.
"""
from __future__ import annotations

import logging
import os
import time

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
