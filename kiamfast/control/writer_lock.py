"""One writer of the table at any moment: the control process holds its lock before it writes.

The supervisor hands the control process a descriptor of the table's lock file
(``<table>.lock``, ``--table-lock-fd``).  Started by a supervisor that took the lock itself
(a fresh start, a restart of the control process) it is already held through that very
descriptor, and :func:`hold` returns at once.  Started by a supervisor that is taking the
node over from another agent, the other agent's control process still writes the table:
this one comes up in *standby* (its imports, its configuration), says so on ``--ready-fd``,
and blocks in ``flock`` until the other has exited, and only then attaches the table as its
writer, without wiping it (the same boot: every date in it is still valid).

:func:`check_sole_writer` is the run-time witness: the table header names the pid of the
process that attached it as writer last, and a control process that finds another pid
there is not the only writer any more; it says so and exits rather than write on.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time

log = logging.getLogger("kiamfast.control")


class NotSoleWriter(Exception):
    """Another process attached the table as its writer."""


def hold(lock_fd: int, *, ready_fd: int | None = None) -> None:
    """Block until this process holds the exclusive lock of ``lock_fd``.  On ``ready_fd``
    (the supervisor's pipe) it first writes ``c``: everything before the lock is done; then,
    holding the lock, ``L`` and the CLOCK_MONOTONIC ns it got it at (8 bytes, little
    endian): a runtime poll dated later is this process's, not the previous writer's."""
    tell = ready_fd is not None and ready_fd >= 0
    if tell:
        _write(ready_fd, b"c")
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("standby: waiting for the table lock (the agent handing the node over "
                 "still writes the table)")
        started = time.monotonic()
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        log.info("holding the table lock after %.3fs in standby", time.monotonic() - started)
    held = time.monotonic_ns()
    if tell:
        _write(ready_fd, b"L" + held.to_bytes(8, "little"))
        os.close(ready_fd)
    # The evidence tests/supervisor/test_handover.py checks: from here until this process
    # lets go of the lock, nobody else may write the table.
    log.info("table writer from %d", held, extra={"pid": os.getpid()})


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass   # the supervisor stopped listening: nothing to tell


def check_sole_writer(table) -> None:
    """Raise NotSoleWriter if the table names another writer than this process."""
    pid = table.writer_pid
    if pid != os.getpid():
        raise NotSoleWriter(f"the table names pid {pid} as its writer, not this process "
                            f"({os.getpid()}): another process attached it as writer")


def release(lock_fd: int) -> None:
    """After the last write: say so, and let go of our descriptor of the lock at once (the
    lock is free as soon as the supervisor has let go of its own too), not only when the
    interpreter has finished exiting: a standby successor is waiting for it."""
    log.info("table writer until %d", time.monotonic_ns(), extra={"pid": os.getpid()})
    try:
        os.close(lock_fd)
    except OSError:
        pass
