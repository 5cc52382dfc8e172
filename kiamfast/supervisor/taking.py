"""The new agent's side of a handover (handover.take_over calls it at each step): it sets up
on the sockets and table handed to it, starts its children paused and in standby, starts
accepting when the old agent's have stopped, and waits until its own control process writes
the table; or stops what it started if the takeover fails (docs/architecture.md, "Handing
the node over").
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Protocol

from kiamfast.supervisor import handover
from kiamfast.supervisor.children import STOP_GRACE, Child
from kiamfast.supervisor.handing import HandingOver
from kiamfast.table import Table

log = logging.getLogger("kiamfast.supervisor")


class Starting(Protocol):
    """The supervisor, as the side that takes over uses it."""
    stopping: bool
    control: Child | None
    view: Table | None

    @property
    def runtime_mode(self) -> bool: ...
    def prepare_taken(self, table_path: str,
                      received: list[tuple[dict, socket.socket]]) -> None: ...
    def start_paused(self, timeout: float) -> str: ...
    def start_accepting(self) -> None: ...
    def lock_taken_at(self, deadline: float) -> int | None: ...
    def deposit(self) -> None: ...
    def all_children(self) -> list[Child]: ...
    def close(self) -> None: ...


class TakingOver:
    def __init__(self, sup: Starting, handing: HandingOver) -> None:
        self.sup = sup
        self.handing = handing      # this agent's handover socket, once it took the node

    def arm(self, table_path: str, received: list[tuple[dict, socket.socket]]) -> None:
        """The handed sockets checked against our configuration, our children up: workers
        paused, the control process in standby for the table lock."""
        self.sup.prepare_taken(table_path, received)
        problem = self.sup.start_paused(handover.ARM_TIMEOUT)
        if problem:
            raise handover.HandoverFailed(problem)
        self.sup.deposit()

    def proceed(self) -> None:
        """Stopped (SIGTERM) while taking over: the old agent keeps the node (it resumes when
        we hang up), rather than handing it to an agent about to go away."""
        if self.sup.stopping:
            raise handover.HandoverFailed("stopped while taking the node over")

    def accept_now(self, step: str) -> bool:
        """When our workers start accepting: as soon as the old ones stopped if they answer
        known pods from the table at once (API mode), after the old control process let go
        if every new connection needs a runtime poll of ours."""
        return step == ("released" if self.sup.runtime_mode else "stopped-accepting")

    def start_accepting(self) -> None:
        self.sup.start_accepting()

    def await_writer(self) -> None:
        sup = self.sup
        deadline = time.monotonic() + handover.FINISH_TIMEOUT
        sup.lock_taken_at(deadline)
        while not (sup.view.writer_pid == sup.control.pid):
            if not sup.control.alive():
                raise handover.HandoverFailed("the control process exited before it held "
                                              "the table lock")
            if time.monotonic() > deadline:
                raise handover.HandoverFailed("the control process never took the table lock")
            time.sleep(0.005)
        log.info("took the node over: this agent's control process writes the table")

    def listen(self) -> None:
        self.handing.listen()

    def disarm(self) -> None:
        """The takeover failed: stop what we started (the old agent serves on)."""
        for child in self.sup.all_children():
            child.stop(STOP_GRACE)
        self.sup.close()
