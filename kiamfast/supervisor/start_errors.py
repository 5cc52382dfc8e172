"""What the supervisor says when it cannot start, in one line naming the flag that fixes it,
and the exit code it stops with.

Two kinds, told apart by the code: what only a change of configuration cures (a state file
in a directory that is missing or read-only, a port the agent may not bind) exits with
:data:`kiamfast.config.EXIT_CONFIG` (78), like the control process's configuration errors;
what another process holds for now (the port, the table lock) exits 1: the kubelet's
restart may find it free.
"""
from __future__ import annotations

import errno as errnos
import os

from kiamfast.config import EXIT_CONFIG, Config
from kiamfast.sockets import ListenError

# The errors of a path that no restart cures (the directory is missing, read-only, ...).
_PATH_CONFIG_ERRNOS = frozenset({errnos.ENOENT, errnos.ENOTDIR, errnos.EACCES, errnos.EPERM,
                                 errnos.EROFS, errnos.EISDIR, errnos.ELOOP,
                                 errnos.ENAMETOOLONG})


class CannotStart(Exception):
    """``str()`` is the line to log; ``code`` the exit code."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


def _port_flag(config: Config, port: int) -> str:
    for flag, value in (("app-port", config.app_port), ("metrics-port", config.metrics_port),
                        ("handover-port", config.handover_port)):
        if port == value:
            return flag
    return "container-credentials-addr"


def listen_failed(e: ListenError, config: Config) -> CannotStart:
    """A port could not be bound (``e``: its bind's error)."""
    flag = _port_flag(config, e.port)
    where = f"--{flag}={e.port}" if flag != "container-credentials-addr" else \
        f"--{flag}={config.container_credentials_addr}"
    why = os.strerror(e.errno) if e.errno else str(e)
    if e.errno == errnos.EADDRINUSE:
        hint = "stop it or give this agent another --" + flag
        if flag == "app-port":
            hint += " (a kiamfast started with --handover-socket hands the port over)"
        return CannotStart(f"{where}: another process listens on port {e.port} ({why}): "
                           f"{hint}", code=1)
    if e.errno in (errnos.EACCES, errnos.EPERM):
        return CannotStart(f"{where}: not permitted to listen on port {e.port} ({why}): a "
                           "port below 1024 needs root or CAP_NET_BIND_SERVICE",
                           code=EXIT_CONFIG)
    if e.errno == errnos.EADDRNOTAVAIL:
        if flag != "container-credentials-addr":
            where = f"--listen-host={config.listen_host}"
        return CannotStart(f"{where}: {e}: not an address of this host", code=EXIT_CONFIG)
    return CannotStart(f"{where}: {e}", code=1)


def state_file_failed(flag: str, path: str, e: OSError) -> CannotStart:
    """A state file (``--table-path``, ``--token-key-file``) could not be made or used.
    ``e`` names the file it failed on (the table's lock, a temporary key file), or says
    in words what is wrong (the lock held, a file not ours alone)."""
    directory = os.path.dirname(os.path.abspath(path)) or "/"
    if e.errno in _PATH_CONFIG_ERRNOS:
        if not os.path.exists(directory):
            what = "does not exist"
        elif not os.path.isdir(directory):
            what = "is not a directory"
        elif e.errno in (errnos.EACCES, errnos.EPERM, errnos.EROFS):
            what = f"is not writable by this agent ({e.strerror})"
        else:
            what = f"cannot hold it ({e.strerror}: {e.filename})"
        if flag == "token-key-file":
            fix = f"give --{flag} a path in a writable directory, or --{flag}= for a key " \
                  "in memory only (tokens then end with the agent)"
        else:
            fix = f"give --{flag} a path in a writable directory (tmpfs: /dev/shm, or the " \
                  "chart's stateDir hostPath /run/kiamfast)"
        return CannotStart(f"--{flag}={path}: the directory {directory} {what}: {fix}",
                           code=EXIT_CONFIG)
    reason = e.strerror if e.errno and e.strerror else str(e)
    return CannotStart(f"--{flag}={path}: {reason}", code=1)
