"""The supervisor's side of the socket keeper (``--socket-keeper``, kiamfast/socket_keeper.py).

At start the supervisor asks the keeper for what it holds: listening sockets mean this
container was restarted while the pod lived on (the kernel queued pods' connections in
their backlog meanwhile), and the note says which table they were served from and whether
this pod had already handed the node to another agent.  Whatever the supervisor serves on,
it deposits; it deposits again when the keeper's socket changes (a restarted keeper starts
empty) and when what it serves on changes.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field

from kiamfast import fdpass
from kiamfast.supervisor.listeners import Listener

log = logging.getLogger("kiamfast.supervisor")

CHECK_EVERY = 2.0    # how often the keeper's socket is looked at (a restarted keeper is empty)


@dataclass
class Deposit:
    note: dict
    received: list[tuple[dict, socket.socket]] = field(default_factory=list)

    def close(self) -> None:
        for _, sock in self.received:
            sock.close()
        self.received = []


def fetch(path: str) -> Deposit | None:
    """What the keeper at ``path`` holds; None if no keeper answers there (it may start
    after this container: the supervisor deposits once it does)."""
    try:
        with fdpass.connect(path) as conn:
            fdpass.send(conn, {"op": "get"})
            reply, socks = fdpass.receive(conn)
    except FileNotFoundError:
        return None
    except (OSError, fdpass.FdPassError) as e:
        log.warning("socket keeper %s: %s", path, e)
        return None
    descriptions = reply.get("sockets")
    if reply.get("op") != "held" or not isinstance(descriptions, list) \
            or len(descriptions) != len(socks) \
            or not all(isinstance(d, dict) for d in descriptions):
        log.warning("socket keeper %s answered %s; ignoring it", path, reply)
        for sock in socks:
            sock.close()
        return None
    note = reply.get("note") if isinstance(reply.get("note"), dict) else {}
    return Deposit(note, list(zip(descriptions, socks)))


class KeeperLink:
    """Deposits what the supervisor serves on, again whenever the keeper restarted."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.inode: int | None = None      # of the keeper socket that holds our deposit
        self.note: dict = {}
        self.listeners: list[Listener] = []
        self.checked = 0.0

    def tick(self, now: float) -> None:
        """:meth:`refresh`, at most every CHECK_EVERY seconds."""
        if now - self.checked >= CHECK_EVERY:
            self.checked = now
            self.refresh()

    def deposit(self, note: dict, listeners: list[Listener]) -> bool:
        self.note, self.listeners = note, list(listeners)
        self.inode = None
        return self.refresh()

    def refresh(self) -> bool:
        """Deposit again if the keeper's socket is not the one holding our deposit."""
        try:
            inode = os.lstat(self.path).st_ino
        except OSError:
            return False
        if inode == self.inode:
            return True
        try:
            with fdpass.connect(self.path) as conn:
                fdpass.send(conn, {"op": "put", "note": self.note,
                                   "sockets": [lst.description() for lst in self.listeners]},
                            [lst.sock.fileno() for lst in self.listeners])
                reply, socks = fdpass.receive(conn)
                for sock in socks:
                    sock.close()
        except (OSError, fdpass.FdPassError) as e:
            log.warning("cannot deposit the sockets with the keeper %s: %s", self.path, e)
            return False
        if reply.get("op") != "ok":
            log.warning("the keeper %s refused the sockets: %s", self.path, reply.get("error"))
            return False
        self.inode = inode
        log.info("deposited %d socket(s) with the keeper %s", len(self.listeners), self.path)
        return True
