"""The serving agent's side of a handover (handover.hand_over calls it at each step): it
listens on ``--handover-socket``, offers its sockets and table, stops its workers, lets its
control process go, and then retires, or resumes if the new agent goes away half-way
(docs/architecture.md, "Handing the node over").
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Protocol

from kiamfast import fdpass
from kiamfast.config import Config
from kiamfast.supervisor import handover
from kiamfast.supervisor.children import STOP_GRACE, Child
from kiamfast.supervisor.keeper_client import KeeperLink
from kiamfast.supervisor.listeners import Listeners
from kiamfast.supervisor.readiness import ReadyFile
from kiamfast.supervisor.secondport import SecondPort
from kiamfast.supervisor.statefiles import open_lock

log = logging.getLogger("kiamfast.supervisor")


class Serving(Protocol):
    """The supervisor, as the side that hands over uses it."""
    config: Config
    listeners: Listeners
    table_path: str
    lock_fd: int
    children: list[Child]
    control: Child | None
    keeper: KeeperLink | None
    second: SecondPort | None
    ready_file: ReadyFile

    def all_children(self) -> list[Child]: ...
    def build_children(self) -> None: ...


class HandingOver:
    def __init__(self, sup: Serving) -> None:
        self.sup = sup
        self.point: socket.socket | None = None     # --handover-socket, listening

    # ---- the handover socket ----------------------------------------------------------------

    def listen(self) -> None:
        """Listen on --handover-socket (once); an agent that cannot says so and serves on."""
        path = self.sup.config.handover_socket
        if not path or self.point is not None:
            return
        try:
            self.point = fdpass.listen(path)
        except OSError as e:
            log.error("cannot listen on --handover-socket %s: %s; this agent cannot hand "
                      "the node over", path, e)
            return
        self.point.setblocking(False)

    def serve(self) -> bool:
        """A takeover request, if one is waiting; True once handed over."""
        if self.point is None:
            return False
        try:
            conn, _ = self.point.accept()
        except BlockingIOError:
            return False
        with conn:
            conn.setblocking(True)
            return handover.hand_over(conn, self)

    def close(self) -> None:
        """Stop listening (the path is left as it is: it may name the new agent by now)."""
        if self.point is not None:
            self.point.close()
            self.point = None

    # ---- the steps (handover.Handing) -------------------------------------------------------

    def refusal(self) -> str:
        return self.sup.second.busy() if self.sup.second is not None else ""

    def offer(self) -> tuple[str, list[dict], list[int]]:
        return self.sup.table_path, self.sup.listeners.descriptions(), self.sup.listeners.fds()

    def stop_accepting(self) -> None:
        """The workers close their listening sockets, answer what they hold and exit."""
        started = time.monotonic()
        for child in self.sup.children:
            child.stop(STOP_GRACE)
        log.info("workers stopped for the handover in %.0f ms",
                 (time.monotonic() - started) * 1000)

    def release(self) -> None:
        """The control process exits and the table lock goes with our descriptor of it."""
        sup = self.sup
        sup.ready_file.show(False)
        if sup.control is not None and sup.control.alive():
            sup.control.restart = False
            sup.control.proc.terminate()
        # The control process lets go of its descriptor of the lock right after its last
        # write; ours would hold the lock on.  The new control process takes it then: it
        # need not wait for ours to finish exiting (the interpreter's teardown can take a
        # second), and neither does the new agent.
        os.close(sup.lock_fd)
        sup.lock_fd = -1
        log.info("control process told to stop for the handover: the table lock is free "
                 "after its last write")

    def resume(self) -> None:
        """The takeover failed half-way: serve again on the sockets we still hold.  Once
        the lock was let go, the workers start at once (they serve the table as it is) and
        the new control process waits in standby until the other agent's has exited."""
        sup = self.sup
        if sup.control is not None and not sup.control.restart:
            sup.control.stop(STOP_GRACE)       # still exiting after release()
        if sup.lock_fd < 0:
            sup.lock_fd = open_lock(sup.table_path)
            sup.build_children()   # new channels, the new lock descriptor
        for child in sup.all_children():
            child.restart = True
            if not child.alive():
                child.start()
        log.info("serving again")

    def retire(self) -> None:
        """Handed over: nothing of ours serves any more."""
        sup = self.sup
        if sup.control is not None:
            sup.control.stop(STOP_GRACE)       # reap it (it let go of the lock already)
        sup.listeners.close()
        self.close()     # the path is the new agent's now: never unlinked here
        if sup.keeper is not None:
            sup.keeper.deposit({"handed_over": True, "table_path": sup.table_path}, [])
