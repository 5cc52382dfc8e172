"""The start's milestones in the log, one info line each: ``start: pods listed after 0.412s``.

The seconds count from the agent's start: the supervisor's process start, read from /proc so
the interpreter's own start-up counts, and handed to its children in ``KIAMFAST_STARTED``
so every process of one agent measures from the same instant.  Both are on CLOCK_BOOTTIME,
the clock the kernel dates a process's start with (in clock ticks: 10 ms).  A process
started without the variable (a test, a worker run by hand) measures from its own start.

bench/node_start.py reads these lines to show where a start's time goes.  A leaf module:
it imports nothing of the agent's.
"""
from __future__ import annotations

import logging
import os
import time

ENV = "KIAMFAST_STARTED"

log = logging.getLogger("kiamfast.milestones")
_marked: set[str] = set()


def process_started() -> float:
    """When this process started, in CLOCK_BOOTTIME seconds (now, if /proc cannot say)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: starttime
    except (OSError, ValueError, IndexError):
        return time.clock_gettime(time.CLOCK_BOOTTIME)


def agent_started() -> float:
    """The agent's start: the supervisor's (``KIAMFAST_STARTED``), else this process's."""
    try:
        return float(os.environ[ENV])
    except (KeyError, ValueError):
        return process_started()


def hand_down() -> None:
    """The supervisor, first thing: its children measure from its start."""
    os.environ[ENV] = repr(agent_started())


def since_start() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME) - agent_started()


def mark(what: str, *, once: bool = True, **extra: object) -> None:
    """Log ``start: <what> after <seconds>s`` (with ``once``, only the first time)."""
    if once:
        if what in _marked:
            return
        _marked.add(what)
    log.info("start: %s after %.3fs", what, since_start(), extra=extra or None)
