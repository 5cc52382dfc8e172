"""Handing the node from one agent to the next without a refused or dropped call.

The serving agent's supervisor listens on ``--handover-socket`` (a Unix socket only root
reaches, checked both ways: kiamfast/fdpass.py).  A new agent that finds it live asks for
the node over one connection, in ``fdpass`` frames (JSON, ``"v": 1``), in this order:

    new -> old   takeover        {pid, version}
    old -> new   sockets         {table_path, version, sockets: [{kind, host, port}]} + fds
                 (the new one checks each socket against its own configuration, starts its
                 workers paused and its control process in standby for the table lock)
    new -> old   stop-accepting  the old workers close their listening sockets, answer what
    old -> new   stopped-accepting    they hold and exit; connections wait in the backlog
    new -> old   release         the old control process exits: the table lock is free
    old -> new   released        (the new control process, blocked on it, takes it and goes
                                 on writing the same table, not wiped: the same boot)
    new -> old   done            the old agent closes everything and stays idle until SIGTERM

The new workers start accepting after ``stopped-accepting`` when addresses follow the API
server (a worker answers known pods from the table at once), after ``released`` when they
follow the container runtime (every new connection waits for a poll of the new control
process).  Either way no two control processes write the table at once (the lock), a pod's
connection is never refused (the sockets stay open in both processes throughout), and a
worker never waits on a control process that will not answer it.

If the new agent goes away before ``done`` (the connection drops, a step times out), the
old one resumes: its workers and control process start again on the sockets it still holds,
on the table as it is.  The old agent refuses (``refused``) a takeover it cannot serve now
(it is itself moving back from its second port); the new one retries.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Protocol

from kiamfast import __version__, fdpass

log = logging.getLogger("kiamfast.supervisor")

STEP_TIMEOUT = 10.0        # a message the other side sends without doing anything first
ARM_TIMEOUT = 120.0        # the new agent's children come up (the control process imports)
STOP_TIMEOUT = 30.0        # the old agent's children exit (SHUTDOWN_GRACE, STOP_GRACE)
FINISH_TIMEOUT = 60.0      # the new control process takes the lock
RETRY_FOR = 300.0          # how long a refused takeover is tried again
RETRY_EVERY = 1.0


class HandoverFailed(Exception):
    """The takeover did not happen; the old agent serves on (or resumes)."""


class Refused(HandoverFailed):
    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


# ---- the side that hands over -------------------------------------------------------------

class Handing(Protocol):
    """What the serving supervisor does at each step (handing.py)."""

    def refusal(self) -> str: ...
    def offer(self) -> tuple[str, list[dict], list[int]]: ...
    def stop_accepting(self) -> None: ...
    def release(self) -> None: ...
    def resume(self) -> None: ...
    def retire(self) -> None: ...


def hand_over(conn: socket.socket, side: Handing) -> bool:
    """One takeover request on ``conn``; True once the node is handed over (the caller is
    idle from then on), False if the caller serves on."""
    conn.settimeout(STEP_TIMEOUT)
    try:
        peer = fdpass.check_peer(conn)
        message, junk = fdpass.receive(conn)
        for sock in junk:
            sock.close()
    except fdpass.FdPassError as e:
        log.warning("handover socket: a request failed: %s", e)
        _try_send(conn, {"op": "refused", "error": str(e), "retry": False})
        return False
    if message.get("op") != "takeover":
        _try_send(conn, {"op": "refused", "error": f"expected takeover, got "
                                                   f"{message.get('op')!r}", "retry": False})
        return False
    refusal = side.refusal()
    if refusal:
        log.info("refused a takeover by pid %d: %s", peer, refusal)
        _try_send(conn, {"op": "refused", "error": refusal, "retry": True})
        return False
    log.info("pid %d (kiamfast %s) takes the node over", peer, message.get("version"))
    table_path, descriptions, fds = side.offer()
    stage = "offered"
    try:
        fdpass.send(conn, {"op": "sockets", "table_path": table_path, "version": __version__,
                           "sockets": descriptions}, fds)
        conn.settimeout(ARM_TIMEOUT)
        _expect(conn, "stop-accepting")
        side.stop_accepting()
        stage = "stopped accepting"
        fdpass.send(conn, {"op": "stopped-accepting"})
        conn.settimeout(STEP_TIMEOUT)
        _expect(conn, "release")
        side.release()
        stage = "released"
        fdpass.send(conn, {"op": "released"})
        conn.settimeout(FINISH_TIMEOUT)
        _expect(conn, "done")
    except (fdpass.FdPassError, HandoverFailed) as e:
        log.warning("the takeover by pid %d ended after '%s' (%s)", peer, stage, e)
        if stage != "offered":
            side.resume()
        return False
    side.retire()
    log.info("handed the node over to pid %d; idle until stopped", peer)
    return True


def _expect(conn: socket.socket, op: str) -> dict:
    message, junk = fdpass.receive(conn)
    for sock in junk:
        sock.close()
    if message.get("op") != op:
        raise HandoverFailed(f"expected {op}, got {message.get('op')!r} "
                             f"{message.get('error') or ''}".rstrip())
    return message


def _try_send(conn: socket.socket, message: dict) -> None:
    try:
        fdpass.send(conn, message)
    except fdpass.FdPassError:
        pass


# ---- the side that takes over ---------------------------------------------------------------

class Taking(Protocol):
    """What the new supervisor does at each step (taking.py)."""

    def arm(self, table_path: str, received: list[tuple[dict, socket.socket]]) -> None: ...
    def proceed(self) -> None: ...
    def accept_now(self, step: str) -> bool: ...
    def start_accepting(self) -> None: ...
    def await_writer(self) -> None: ...
    def listen(self) -> None: ...
    def disarm(self) -> None: ...


def live_peer(path: str) -> socket.socket | None:
    """A connection to the agent serving at ``path``; None if none does (no socket there,
    nobody listening).  A socket that is not ours is refused in one log line."""
    try:
        return fdpass.connect(path)
    except fdpass.FdPassError as e:
        log.error("handover socket %s: %s; not taking over through it", path, e)
    except OSError:
        pass
    return None


def take_over(conn: socket.socket, side: Taking) -> None:
    """The takeover over ``conn`` (from :func:`live_peer`); raises HandoverFailed (after
    :meth:`Taking.disarm`: the old agent serves on) or Refused."""
    conn.settimeout(STEP_TIMEOUT)
    armed = False
    try:
        fdpass.send(conn, {"op": "takeover", "pid": os.getpid(), "version": __version__})
        reply, socks = fdpass.receive(conn)
        if reply.get("op") == "refused":
            for sock in socks:
                sock.close()
            raise Refused(f"the serving agent refused: {reply.get('error')}",
                          retry=bool(reply.get("retry")))
        descriptions = reply.get("sockets")
        if reply.get("op") != "sockets" or not isinstance(descriptions, list) \
                or len(descriptions) != len(socks) or not isinstance(
                    reply.get("table_path"), str):
            for sock in socks:
                sock.close()
            raise HandoverFailed(f"unexpected answer {reply.get('op')!r}")
        log.info("taking the node over from kiamfast %s", reply.get("version"))
        conn.settimeout(ARM_TIMEOUT)
        armed = True
        try:
            side.arm(reply["table_path"], list(zip(descriptions, socks)))
        except Exception as e:
            _try_send(conn, {"op": "abort", "error": str(e)})
            raise HandoverFailed(str(e)) from e
        conn.settimeout(STOP_TIMEOUT)
        side.proceed()
        fdpass.send(conn, {"op": "stop-accepting"})
        _expect(conn, "stopped-accepting")
        if side.accept_now("stopped-accepting"):
            side.start_accepting()
        side.proceed()
        fdpass.send(conn, {"op": "release"})
        _expect(conn, "released")
        if side.accept_now("released"):
            side.start_accepting()
        side.await_writer()
        side.proceed()
        side.listen()      # the handover socket names us before the old agent closes its own
        fdpass.send(conn, {"op": "done"})
    except fdpass.FdPassError as e:
        if not armed:
            if isinstance(e, fdpass.PeerGone):   # busy handing over to another agent
                raise Refused(f"no answer from the serving agent ({e})", retry=True) from e
            raise HandoverFailed(str(e)) from e
        side.disarm()
        raise HandoverFailed(str(e)) from e
    except HandoverFailed:
        if armed:
            side.disarm()
        raise


def take_over_with_retries(path: str, side: Taking, *,
                           clock=time.monotonic, sleep=time.sleep) -> bool:
    """:func:`take_over` from the agent at ``path``; a refusal to retry is tried again for
    RETRY_FOR.  False if no agent serves there (nothing to take over)."""
    deadline = clock() + RETRY_FOR
    while True:
        conn = live_peer(path)
        if conn is None:
            return False
        try:
            with conn:
                take_over(conn, side)
            return True
        except Refused as e:
            if not e.retry or clock() >= deadline:
                raise
            log.info("%s; trying again", e)
        sleep(RETRY_EVERY)
