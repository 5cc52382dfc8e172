"""The supervisor's children: started with the interpreter the supervisor runs in, ended by
the kernel when the supervisor dies, restarted with a backoff that resets once they have run
a while."""
from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import subprocess
import sys
import time

from kiamfast.budget import backoff

log = logging.getLogger("kiamfast.supervisor")

RESTART_BACKOFF_MIN = 0.5
RESTART_BACKOFF_MAX = 10.0
HEALTHY_AFTER = 30.0          # a child that ran this long restarts with the minimum backoff
STOP_GRACE = 10.0             # SIGTERM, then SIGKILL after this long
# `-P`: the children must import the kiamfast the parent imported.  `python -m` would put
# the working directory first on sys.path, and started from a source checkout a child
# would import the checkout's kiamfast, which has no compiled extensions.
CHILD_PYTHON = [sys.executable, "-P"]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies, however it dies (a
    SIGKILLed supervisor must not leave workers holding the port, or a control process
    writing a table nobody serves)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    fds: tuple[int, ...]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    backoff: float = RESTART_BACKOFF_MIN
    failures: int = 1          # restarts since it last ran HEALTHY_AFTER (the first: 1)
    restart_at: float = 0.0
    restarts: int = 0
    ready_pipe: int = -1          # read end: one byte once the child says it is ready
    restart: bool = True          # False: a child being retired (handover, worker swap)

    def start(self, *, extra_argv: tuple[str, ...] = (), tell_ready: bool = False) -> None:
        """Start it; ``extra_argv`` for this start only (``--paused``); ``tell_ready``: it
        gets ``--ready-fd`` (a pipe :meth:`wait_ready` reads)."""
        argv, fds = [*self.argv, *extra_argv], self.fds
        write_end = -1
        if tell_ready:
            self.ready_pipe, write_end = os.pipe()
            argv += ["--ready-fd", str(write_end)]
            fds = (*fds, write_end)
        try:
            self.proc = subprocess.Popen(argv, pass_fds=fds, preexec_fn=_die_with_parent)
        finally:
            if write_end >= 0:
                os.close(write_end)
        self.started = time.monotonic()
        log.info("started %s", self.name, extra={"pid": self.proc.pid})

    def stop(self, grace: float) -> None:
        """SIGTERM, SIGKILL after ``grace``; it is not restarted."""
        self.restart = False
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close_ready_pipe(self) -> None:
        if self.ready_pipe >= 0:
            os.close(self.ready_pipe)
            self.ready_pipe = -1

    def read_ready(self, size: int, timeout: float) -> bytes:
        """Up to ``size`` more bytes the child says on its ready pipe (b"" if it closed it
        or said nothing in time)."""
        if self.ready_pipe < 0:
            return b""
        readable, _, _ = select.select([self.ready_pipe], [], [], timeout)
        return os.read(self.ready_pipe, size) if readable else b""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self, now: float) -> None:
        """If it exited: schedule its restart (at once again after a healthy run, else the
        backoff doubles) and start it when that time has come."""
        if self.proc is None:
            if now >= self.restart_at:
                self.start()
            return
        code = self.proc.poll()
        if code is None or not self.restart:
            return
        ran = now - self.started
        self.failures = 1 if ran > HEALTHY_AFTER else self.failures + 1
        self.backoff = backoff(self.failures, base=RESTART_BACKOFF_MIN,
                               cap=RESTART_BACKOFF_MAX, jitter=False)
        self.restart_at = now + self.backoff
        self.restarts += 1
        self.proc = None
        log.warning("%s exited with %s after %.1fs; restarting in %.1fs", self.name, code,
                    ran, self.backoff)


def wait_ready(children: list[Child], timeout: float, *,
               keep_open: tuple[Child, ...] = ()) -> str:
    """Wait for the ready byte of every child started with ``tell_ready``; "" when all
    said it, else what went wrong.  The pipes of ``keep_open`` stay open (more to say)."""
    waiting = {c.ready_pipe: c for c in children if c.ready_pipe >= 0}
    deadline = time.monotonic() + timeout
    try:
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return "not ready in time: " + ", ".join(c.name for c in waiting.values())
            readable, _, _ = select.select(list(waiting), [], [], min(left, 0.2))
            for fd in readable:
                child = waiting.pop(fd)
                if not os.read(fd, 1):
                    return f"{child.name} exited before it was ready"
            for fd, child in list(waiting.items()):
                if not child.alive():
                    return f"{child.name} exited before it was ready"
        return ""
    finally:
        for child in children:
            if child.ready_pipe >= 0 and child not in keep_open:
                child.close_ready_pipe()
