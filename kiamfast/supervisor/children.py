"""The supervisor's children: started with the interpreter the supervisor runs in, ended by
the kernel when the supervisor dies, restarted with a backoff that resets once they have run
a while."""
from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import time

log = logging.getLogger("kiamfast.supervisor")

RESTART_BACKOFF_MIN = 0.5
RESTART_BACKOFF_MAX = 10.0
HEALTHY_AFTER = 30.0          # a child that ran this long restarts with the minimum backoff
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
    restart_at: float = 0.0
    restarts: int = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, pass_fds=self.fds, preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        log.info("started %s", self.name, extra={"pid": self.proc.pid})

    def reap(self, now: float) -> None:
        """If it exited: schedule its restart (at once again after a healthy run, else the
        backoff doubles) and start it when that time has come."""
        if self.proc is None:
            if now >= self.restart_at:
                self.start()
            return
        code = self.proc.poll()
        if code is None:
            return
        ran = now - self.started
        self.backoff = RESTART_BACKOFF_MIN if ran > HEALTHY_AFTER else min(
            self.backoff * 2, RESTART_BACKOFF_MAX)
        self.restart_at = now + self.backoff
        self.restarts += 1
        self.proc = None
        log.warning("%s exited with %s after %.1fs; restarting in %.1fs", self.name, code,
                    ran, self.backoff)
