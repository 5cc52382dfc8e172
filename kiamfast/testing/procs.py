"""A process tree as Linux's /proc shows it: the harnesses find the agent's children by what
they run, and end a leftover only while its pid still names the process they saw (same
start time), never a newcomer that reused the number.
"""
from __future__ import annotations

import os

__all__ = ["children", "cmdline", "descendants", "start_time"]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads' children; [] once it is gone)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        out.extend(kids)
        todo.extend(kids)
    return out


def cmdline(pid: int) -> list[str]:
    """The arguments ``pid`` runs with ([] once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (with the pid, a process' identity), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its ")".
    return int(stat.rsplit(b")", 1)[1].split()[19])
