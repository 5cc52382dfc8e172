"""Listening sockets handed from one process to another over a Unix stream socket.

Envoy's hot restart and HAProxy's ``-x`` do this: the kernel passes open file descriptors
with ``SCM_RIGHTS``, so the receiver holds the very socket the sender bound, backlog
included.  No ``SO_REUSEPORT`` is needed (it would let any root process on the host network
bind the port beside the agent), and while any process holds the socket, a pod's connection
waits in its backlog instead of being refused.

One message is a frame: a 4-byte big-endian length, then that many bytes of a JSON object,
with its descriptors (at most :data:`MAX_FDS`) attached to the frame's first byte.  Every
object carries ``"v"`` (:data:`PROTOCOL`); what the other keys mean is the business of the
caller (the socket keeper, the supervisors' handover).

Only our own uid may take part: :func:`listen` creates the Unix socket mode 0600 under a
random name and renames it into place, :func:`connect` refuses a path that is not a socket
of our uid with no group or other bits (as the state files are checked), and both sides
check the peer's uid with ``SO_PEERCRED``.  A leaf module: it imports nothing of kiamfast, so
the socket keeper stays a small process (no ``secrets``: it loads OpenSSL, 4 MiB).
"""
from __future__ import annotations

import json
import os
import socket
import stat
import struct

PROTOCOL = 1
MAX_FDS = 16
MAX_FRAME = 64 * 1024
DEFAULT_TIMEOUT = 5.0
_LENGTH = struct.Struct(">I")
_UCRED = struct.Struct("3i")


class FdPassError(Exception):
    """The peer broke the protocol, is not ours, or went away."""


class PeerGone(FdPassError):
    """The peer closed the connection, reset it, or said nothing in time."""


# ---- the Unix socket ------------------------------------------------------------------------

def listen(path: str, *, backlog: int = 8) -> socket.socket:
    """A Unix stream socket listening at ``path``, mode 0600, replacing whatever socket was
    there: bound under a random name in the same directory and renamed into place (atomic;
    a planted symlink is replaced, never followed)."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.urandom(6).hex()}")   # not secrets: OpenSSL
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(tmp)
        finally:
            os.umask(old)
        os.chmod(tmp, 0o600)
        sock.listen(backlog)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return sock


def not_ours(path: str) -> str | None:
    """Why ``path`` is not a Unix socket of our uid closed to group and others (lstat: a
    symlink is not followed), or None; "absent" if there is nothing there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError as e:
        return f"is unusable ({e.strerror})"
    if not stat.S_ISSOCK(st.st_mode):
        return "is not a socket"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to group or others"
    return None


def connect(path: str, *, timeout: float = DEFAULT_TIMEOUT) -> socket.socket:
    """A connection to the process listening at ``path``, checked both ways: the path (see
    :func:`not_ours`) and the peer's uid.  Raises FdPassError (a file that is not ours) or
    OSError (nobody listens: ECONNREFUSED, ENOENT)."""
    problem = not_ours(path)
    if problem == "absent":
        raise FileNotFoundError(2, "no socket", path)
    if problem:
        raise FdPassError(f"{path} {problem}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        check_peer(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (``SO_PEERCRED``, taken by the kernel
    at connect: the peer cannot lie about it)."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _UCRED.size))
    return pid, uid


def check_peer(sock: socket.socket) -> int:
    """The peer's pid; FdPassError unless it runs as our uid."""
    pid, uid = peer_uid(sock)
    if uid != os.geteuid():
        raise FdPassError(f"peer pid {pid} runs as uid {uid}, not {os.geteuid()}")
    return pid


# ---- frames ---------------------------------------------------------------------------------

def send(sock: socket.socket, message: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
    """One frame: ``message`` (a JSON object, ``"v"`` added) with ``fds`` attached."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} descriptors per message, not {len(fds)}")
    data = json.dumps({"v": PROTOCOL, **message}, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ValueError(f"message of {len(data)} bytes, at most {MAX_FRAME}")
    frame = _LENGTH.pack(len(data)) + data
    try:
        sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
        if sent < len(frame):
            sock.sendall(frame[sent:])
    except OSError as e:
        raise PeerGone(f"cannot send: {e}") from e


def receive(sock: socket.socket) -> tuple[dict, list[socket.socket]]:
    """One frame: (the JSON object, the descriptors that came with it, as sockets).

    Raises FdPassError for a closed connection, a timeout, a frame too long or not a JSON
    object, too many descriptors, a descriptor that is not a socket, or another ``"v"``;
    every descriptor received is closed first."""
    fds: list[int] = []
    try:
        head = _read(sock, _LENGTH.size, fds)
        (length,) = _LENGTH.unpack(head)
        if length > MAX_FRAME:
            raise FdPassError(f"frame of {length} bytes announced, at most {MAX_FRAME}")
        try:
            message = json.loads(_read(sock, length, fds))
        except (UnicodeDecodeError, ValueError):
            raise FdPassError("frame is not JSON") from None
        if not isinstance(message, dict):
            raise FdPassError("frame is not a JSON object")
        if message.get("v") != PROTOCOL:
            raise FdPassError(f"protocol {message.get('v')!r}, this side speaks {PROTOCOL}")
        socks = [_as_socket(fd) for fd in fds]
    except BaseException:
        for fd in fds:
            _close_fd(fd)
        raise
    return message, socks


def _read(sock: socket.socket, size: int, fds: list[int]) -> bytes:
    """Exactly ``size`` bytes; descriptors that arrive meanwhile are appended to ``fds``."""
    data = b""
    while len(data) < size:
        try:
            chunk, got, flags, _ = socket.recv_fds(sock, size - len(data), MAX_FDS,
                                                   socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:
            raise PeerGone("peer timed out") from None
        except OSError as e:
            raise PeerGone(f"cannot receive: {e}") from e
        fds.extend(got)
        if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
            raise FdPassError(f"more than {MAX_FDS} descriptors sent")
        if not chunk:
            raise PeerGone("peer closed the connection")
        data += chunk
    return data


def _as_socket(fd: int) -> socket.socket:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise FdPassError(f"descriptor {fd} is not a socket")
        return socket.socket(fileno=fd)
    except OSError as e:
        raise FdPassError(f"descriptor {fd}: {e}") from e


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---- what a listening socket is ----------------------------------------------------------

def listening_address(sock: socket.socket) -> tuple[str, int] | None:
    """(host, port) a TCP socket listens on (getsockname), or None if it is not a
    listening TCP socket."""
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
            return None
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return None
        name = sock.getsockname()
    except OSError:
        return None
    return name[0], name[1]
