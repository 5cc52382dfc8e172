"""The one small channel between the control process and the workers.

Data flows one way (control → table → worker); the only messages going back are a worker
saying "a connection accepted at this instant needs a runtime poll that began after it" or
"this credential slot is wanted but not servable".  Each worker has one AF_UNIX/SOCK_DGRAM socketpair with the control process,
created by the supervisor and inherited by both children.  Sends never block: a full socket
buffer drops the message, which is safe because every message is idempotent (a wake is
"re-check", a request is "look again").

Wire format (first byte is the kind):
  control → worker   b"W" + generation (u64 LE)
  worker  → control  b"R" + accept time of the asking connection (u64 LE, CLOCK_MONOTONIC ns)
  worker  → control  b"C" + credential slot (u32 LE)
"""

from __future__ import annotations

import socket
import struct

WAKE = b"W"
NEED_RUNTIME = b"R"
WANT_CREDENTIALS = b"C"

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def socketpair() -> tuple[socket.socket, socket.socket]:
    """(control_end, worker_end), both non-blocking and inheritable by child processes."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    for s in (a, b):
        s.setblocking(False)
        s.set_inheritable(True)
    return a, b


def send(sock: socket.socket, message: bytes) -> bool:
    """Send without blocking; False if the message was dropped (peer gone or buffer full)."""
    try:
        sock.send(message)
        return True
    except (BlockingIOError, ConnectionRefusedError, BrokenPipeError, OSError):
        return False


def wake(generation: int) -> bytes:
    return WAKE + _U64.pack(generation)


def need_runtime(accepted_ns: int) -> bytes:
    return NEED_RUNTIME + _U64.pack(accepted_ns)


def want_credentials(slot: int) -> bytes:
    return WANT_CREDENTIALS + _U32.pack(slot)


def parse(message: bytes) -> tuple[bytes, object] | None:
    """(kind, value) of a message, or None for anything malformed (ignored by receivers)."""
    if not message:
        return None
    kind, body = message[:1], message[1:]
    if kind == WAKE and len(body) == 8:
        return kind, _U64.unpack(body)[0]
    if kind == NEED_RUNTIME and len(body) == 8:
        return kind, _U64.unpack(body)[0]
    if kind == WANT_CREDENTIALS and len(body) == 4:
        return kind, _U32.unpack(body)[0]
    return None


def drain(sock: socket.socket, limit: int = 1024) -> list[bytes]:
    """Every message waiting on a non-blocking socket (at most `limit`)."""
    out = []
    for _ in range(limit):
        try:
            out.append(sock.recv(64))
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
    return out
