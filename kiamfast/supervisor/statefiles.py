"""The agent's state on the node: the IMDSv2 token key and the shared table, with its lock.

Both live where a restarted container and the next pod of an upgrade find them (the chart's
``/run/kiamfast`` hostPath).  Nothing there is trusted unless it is a regular file of our uid
with no group or other permission bits, opened without following a symlink: a hostile pod
with the same hostPath (or anything planted in a shared ``/dev/shm``) must not hand the agent
a key or a table of its choosing.

The table a previous agent left is adopted only if it is ours alone and of the layout this
agent makes; its credential slots stay (the new control process serves them again with no
STS call), and every date of a runtime poll is forgotten.  Who owns which address stays only
where a runtime decided it and this agent asks one too: no worker answers such an address
before the new control process's first poll confirms its owner (docs/architecture.md, "A
restarted or upgraded agent adopts the table").
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
import time

from kiamfast import milestones
from kiamfast.config import Config
from kiamfast.table import AUX_COUNT, AUX_SIZE, Table, TableLayoutError, files_beside

log = logging.getLogger("kiamfast.supervisor")

TOKEN_KEY_BYTES = 32
LOCK_WAIT = 10.0              # how long a previous agent's control process gets to exit


def load_token_key(path: str) -> bytes:
    """The IMDSv2 token key all workers share: from ``path`` so tokens survive restarts, or
    (``path`` "") a new random key that lives only in memory."""
    if not path:
        return secrets.token_bytes(TOKEN_KEY_BYTES)
    return _read_own_key_file(path) or _write_new_key_file(path)


def _not_ours_alone(st: os.stat_result) -> str | None:
    """Why a file we opened is not ours alone (a regular file of our uid with no group or
    other permission bits), or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to group or others"
    return None


def _open_own_file(path: str) -> tuple[int | None, str | None]:
    """``(fd, None)`` for ``path`` if it is ours alone, opened without following a symlink;
    ``(None, None)`` if there is no file; ``(None, why)`` if it is not ours alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as e:   # ELOOP: a symlink was planted at the path
        return None, f"is unusable ({e.strerror})"
    problem = _not_ours_alone(os.fstat(fd))   # of what we opened: nothing can swap it
    if problem:
        os.close(fd)
        return None, problem
    return fd, None


def _read_own_key_file(path: str) -> bytes | None:
    """The key in ``path`` if it is ours alone and of the right size.  Else None (log a
    line)."""
    fd, problem = _open_own_file(path)
    if fd is not None:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if size == TOKEN_KEY_BYTES:
                return f.read()
            problem = f"holds {size} bytes, not {TOKEN_KEY_BYTES}"
    if problem:
        log.warning("token key file %s %s; replacing it with a new key", path, problem)
    return None


def _write_new_key_file(path: str) -> bytes:
    """A new key, written to a fresh file under a random name (O_EXCL|O_NOFOLLOW: nothing
    planted in a shared /dev/shm can be written through) and renamed over ``path``."""
    key = secrets.token_bytes(TOKEN_KEY_BYTES)
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)   # whatever the umask
            f.write(key)
        os.rename(tmp, path)               # atomic; replaces a symlink, never follows it
    except BaseException:
        os.unlink(tmp)
        raise
    return key


# ---- the table ----------------------------------------------------------------------------

def table_layout(config: Config) -> dict[str, int]:
    """The capacities of the table this configuration makes (and adopts)."""
    return {"ip_capacity": 1024, "cred_capacity": 512, "value_size": 16384,
            "aux_count": AUX_COUNT, "aux_size": AUX_SIZE,
            "max_workers": max(64, config.workers)}


def open_lock(path: str) -> int:
    """An fd of the table's lock file ``<path>.lock`` (created 0600 if missing, ours alone),
    not locked yet.  The file is never replaced or removed: a new inode would be a second,
    free lock."""
    lock_path = files_beside(path)[0]
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o600)
    problem = _not_ours_alone(os.fstat(fd))
    if problem:
        os.close(fd)
        raise OSError(f"table lock {lock_path} {problem}; remove it")
    return fd


def lock_table(path: str) -> int:
    """An fd holding the exclusive flock of ``<path>.lock``, taken within LOCK_WAIT."""
    fd = open_lock(path)
    try:
        _flock_within(fd, files_beside(path)[0], LOCK_WAIT)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_lock_table(path: str) -> int | None:
    """:func:`lock_table` without waiting: None if another process holds the lock."""
    fd = open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def alternate_table_path(path: str) -> str:
    """Where an agent keeps its table while a process it cannot hand over with (a kiamfast
    without handover) still holds the lock of ``path``: the second-port path."""
    return f"{path}-2"


def table_path_to_start(config: Config, *, note_path: str | None, second_port: bool) -> str:
    """The table to start on: the one the keeper's note names (either path of this
    configuration), else --table-path; on the second port with no note, the alternate one
    if a process that cannot hand over holds the lock of --table-path."""
    path = note_path if note_path in (config.table_path,
                                      alternate_table_path(config.table_path)) \
        else config.table_path
    if second_port and not note_path:
        fd = try_lock_table(path)
        if fd is None:
            path = alternate_table_path(path)
            log.warning("the table lock of %s is held (a kiamfast that cannot hand "
                        "over): this agent writes %s", config.table_path, path)
        else:
            os.close(fd)
    return path


def table_to_continue(path: str, layout: dict[str, int], *,
                      max_age: float) -> tuple[Table | None, str]:
    """The table at ``path``, attached read-only, if it can be served on as it is: ours
    alone, of ``layout``, and written by a control process within ``max_age`` seconds on
    this boot (its heartbeat, CLOCK_MONOTONIC); else (None, why).  Used where the sockets
    outlived the previous agent (its keeper, or a handover), so the host did not reboot."""
    fd, problem = _open_own_file(path)
    if fd is None:
        return None, problem or "is absent"
    try:
        table = Table.attach(f"/proc/self/fd/{fd}", writer=False)
    except TableLayoutError as e:
        return None, str(e)
    finally:
        os.close(fd)
    found = {name: table.layout[name] for name in layout}
    age = table.heartbeat_age
    why = ""
    if found != layout:
        why = f"has the layout {found}, this agent makes {layout}"
    elif age is None or age > max_age:
        why = "was never written" if age is None else f"was last written {age:.1f}s ago"
    if why:
        table.close()
        return None, why
    return table, ""


def _flock_within(fd: int, lock_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(f"table lock {lock_path} is held by another kiamfast (an agent "
                              "on another port with this --table-path, or a previous "
                              "agent's control process still running)") from None
            if not waiting:
                log.warning("table lock %s is held; waiting for the process holding it to "
                            "exit (at most %.0fs)", lock_path, timeout)
                waiting = True
            time.sleep(0.05)


def open_table(config: Config) -> Table:
    """The table a previous agent left at --table-path, adopted, or else a fresh one (atomic
    rename over whatever is there).  Call with the table lock held."""
    layout = table_layout(config)
    table = _adopt_table(config.table_path, layout, keep_addresses=asks_runtime(config))
    if table is None:
        table = Table.create(config.table_path, **layout)
        milestones.mark("table created")
    return table


def asks_runtime(config: Config) -> bool:
    """Whether this agent's addresses follow a container runtime (``--cri-endpoint`` not
    turned off; ``auto`` counts even before its socket appears, as the control process
    counts it when the table says a runtime decided it)."""
    return config.cri_endpoint.strip() not in ("", "none")


def _adopt_table(path: str, layout: dict[str, int], *, keep_addresses: bool) -> Table | None:
    """The table at ``path`` if it is ours alone and of ``layout``, with what the new control
    process cannot trust forgotten (:func:`_forget_the_node`); else None (log a line)."""
    fd, problem = _open_own_file(path)
    if fd is None:
        if problem:
            log.warning("table %s %s; creating a fresh one", path, problem)
        return None
    try:   # attach the very file checked above, whatever the path names by now
        table = Table.attach(f"/proc/self/fd/{fd}", writer=True)
    except TableLayoutError as e:
        log.warning("table %s: %s; creating a fresh one", path, e)
        return None
    finally:
        os.close(fd)
    found = {name: table.layout[name] for name in layout}
    if found != layout:
        log.warning("table %s has the layout %s, this agent makes %s; creating a fresh one",
                    path, found, layout)
        table.close()
        return None
    kept = _forget_the_node(table, keep_addresses=keep_addresses)
    log.info("adopted the table %s: credentials kept, %s", path,
             f"{kept} addresses kept until the runtime's first poll confirms them" if kept
             else "addresses cleared")
    milestones.mark("table adopted")
    return table


def _forget_the_node(table: Table, *, keep_addresses: bool) -> int:
    """Keep the credential slots (the new control process adopts them by key), and the
    addresses only where a runtime's poll will confirm them; returns how many were kept.

    The agent was down for an unknown time, perhaps across a reboot, which restarts
    CLOCK_MONOTONIC: a poll date it left could make any new connection look covered, so
    the dates go (every connection now waits for a poll of the new control process).
    Sandboxes or pods may have come and gone: an address a runtime decided keeps its owner
    for that poll to confirm (a sandbox of the same pod holding it) or take away, which is
    what lets those pods be answered within a few hundred milliseconds of the start, before
    the API is even asked; without a runtime nothing would check an address before a worker
    answered it, so none keeps an owner (the first sync decides).  What the old control
    process published (readiness, health, metrics) is not this one's."""
    table.reset_freshness()
    keep = keep_addresses and table.runtime_mode
    # Before any address goes: a reader meanwhile waits instead of taking a cleared address
    # for a definitive miss.
    table.set_status(ready=False, synced=False, pending_pods=0)
    slots = table.snapshot()
    if not keep:
        for slot in slots:
            table.release_ip(slot["ip"], slot["pod_uid"])
    for index in range(AUX_COUNT):
        table.write_aux(index, b"")
    return len(slots) if keep else 0


def token_key_fd(key: bytes) -> int:
    """An anonymous in-memory file holding ``key``, for the workers to inherit."""
    fd = os.memfd_create("kiamfast-token-key", os.MFD_CLOEXEC)
    os.write(fd, key)
    return fd
