"""The `kiamfast` main process: creates the shared table and channels, starts the children,
restarts them when they die, and stops them cleanly on SIGTERM.

Start order is the node-start order of docs/architecture.md: the workers listen first (a pod
that asks now is held, never answered with another identity), and only then does the control
process start, install the DNAT rule, sync, prefetch and mark the agent ready.

The supervisor never touches Kubernetes, STS or a request.  If the control process dies, the
workers keep serving what the table holds until it is restarted and has rebuilt it.

What it hands the children, and why it holds it itself:

* the listening socket(s), bound once here without ``SO_REUSEPORT`` and inherited by every
  worker: no other process on the host network can bind the port and take a share of the
  pods' connections, and connections wait in the backlog while a worker restarts;
* the IMDSv2 token key, in an in-memory file (memfd) each worker inherits.  With
  ``--token-key-file`` it is loaded from (or created in) that file so tokens survive
  restarts; with ``--token-key-file ""`` it exists only in memory, new at every start;
* with ``--container-credentials-addr``, one listening socket per address, inherited by
  the control process only (it answers that protocol), so requests wait in their backlog
  while the control process restarts; with ``--container-credentials-link`` the addresses
  are first put on that link (kiamfast/container_credentials/link.py);
* the table lock (``<table>.lock``, flock), inherited by the control process: while any
  process of an agent that can write the table lives, no other supervisor touches it.

The table a previous agent left at ``--table-path`` (a restarted container, or a new pod
after an upgrade through the hostPath) is adopted if it is ours alone and of this agent's
layout: its credential slots stay, so the new control process serves them again with no
STS call; who owns which address, and every date of a runtime poll, is forgotten
(docs/architecture.md, "Node start and stop").
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time

import orjson

from kiamfast import channel, logs
from kiamfast.config import Config, container_credentials_addrs
from kiamfast.container_credentials.link import LinkError, ensure_addresses
from kiamfast.server.settings import WorkerSettings
from kiamfast.server.worker import WorkerError, listen_socket
from kiamfast.table import AUX_COUNT, AUX_SIZE, Table, TableLayoutError

log = logging.getLogger("kiamfast.supervisor")

RESTART_BACKOFF_MIN = 0.5
RESTART_BACKOFF_MAX = 10.0
HEALTHY_AFTER = 30.0          # a child that ran this long restarts with the minimum backoff
STOP_GRACE = 10.0
LOCK_WAIT = STOP_GRACE        # how long a previous agent's control process gets to exit
TOKEN_KEY_BYTES = 32
# `-P`: the children must import the kiamfast the parent imported.  `python -m` would put
# the working directory first on sys.path, and started from a source checkout a child
# would import the checkout's kiamfast, which has no compiled extensions.
CHILD_PYTHON = [sys.executable, "-P"]


def config_to_json(config: Config) -> str:
    """The control process's configuration, handed over on its command line.  Fields the
    config derived from others are left out, so the child derives them the same way."""
    doc = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)
           if f.init and f.name not in config.derived}
    doc["explicit"] = sorted(config.explicit)
    return orjson.dumps(doc).decode()


def config_from_json(text: str) -> Config:
    doc = orjson.loads(text)
    doc["explicit"] = frozenset(doc.get("explicit", ()))
    return Config(**doc)


def worker_settings(config: Config, *, token_key_fd: int) -> WorkerSettings:
    return WorkerSettings(
        app_port=config.app_port,
        listen_host=config.listen_host or None,
        metrics_port=config.metrics_port,
        metadata_addr=config.metadata_addr,
        imdsv2=config.imdsv2,
        token_key_fd=token_key_fd,
        wait_budget=config.wait_budget,
        passthrough_rate=config.passthrough_qps,
        passthrough_burst=config.passthrough_burst,
        passthrough_concurrency=config.passthrough_concurrency,
        debug=config.debug,
        host_ip=config.host_ip,
        base_role_arn=config.base_role_arn,
    )


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


def lock_table(path: str) -> int:
    """An fd holding the exclusive flock of ``<path>.lock``, taken within LOCK_WAIT.  The
    file is never replaced or removed: a new inode would be a second, free lock."""
    lock_path = f"{path}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o600)
    try:
        problem = _not_ours_alone(os.fstat(fd))
        if problem:
            raise OSError(f"table lock {lock_path} {problem}; remove it")
        _flock_within(fd, lock_path, LOCK_WAIT)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
    table = _adopt_table(config.table_path, layout)
    if table is None:
        table = Table.create(config.table_path, **layout)
    return table


def _adopt_table(path: str, layout: dict[str, int]) -> Table | None:
    """The table at ``path`` if it is ours alone and of ``layout``, with everything but its
    credentials forgotten (:func:`_forget_the_node`); else None (log a line)."""
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
    _forget_the_node(table)
    log.info("adopted the table %s: credentials kept, addresses cleared", path)
    return table


def _forget_the_node(table: Table) -> None:
    """Keep only the credential slots (the new control process adopts them by key).

    The agent was down for an unknown time, perhaps across a reboot, which restarts
    CLOCK_MONOTONIC: a poll date it left could make any new connection look covered, so
    the dates go; sandboxes or pods may have come and gone, so no address keeps an owner
    (the new control process decides every address again before a worker answers it:
    with a runtime after its first poll, without one after its first sync); and what the
    old control process published (readiness, health, metrics) is not this one's."""
    table.reset_freshness()
    table.set_status(ready=False, synced=False, pending_pods=0)   # before the addresses go
    for slot in table.snapshot():
        table.release_ip(slot["ip"], slot["pod_uid"])
    for index in range(AUX_COUNT):
        table.write_aux(index, b"")


def token_key_fd(key: bytes) -> int:
    """An anonymous in-memory file holding ``key``, for the workers to inherit."""
    fd = os.memfd_create("kiamfast-token-key", os.MFD_CLOEXEC)
    os.write(fd, key)
    return fd


def listeners(config: Config) -> list[socket.socket]:
    """The app port's listening socket and, for a separate --metrics-port, the metrics one;
    bound here once for every worker (see the module docstring)."""
    host = config.listen_host or None
    socks = [listen_socket(host, config.app_port)]
    if config.metrics_port not in (0, config.app_port):
        socks.append(listen_socket(host, config.metrics_port))
    return socks


def container_credentials_listeners(config: Config) -> list[socket.socket]:
    """The container-credentials sockets (--container-credentials-addr), bound here like the
    app port so requests wait in their backlog while the control process restarts.  With
    --container-credentials-link the addresses are put on that link first; an IPv6 one it
    cannot hold is not listened on (`link.ensure_addresses` logs why)."""
    if not config.container_credentials_addr:
        return []
    addrs = container_credentials_addrs(config.container_credentials_addr)
    if config.container_credentials_link:
        held = set(ensure_addresses(config.container_credentials_link,
                                    list(dict.fromkeys(host for host, _ in addrs))))
        addrs = [(host, port) for host, port in addrs if host in held]
    socks: list[socket.socket] = []
    try:
        for host, port in addrs:
            socks.append(listen_socket(host, port))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


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


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stopping = False
        self.children: list[Child] = []
        self.listeners: list[socket.socket] = []
        self.container_listeners: list[socket.socket] = []
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock_fd = self.token_key_fd = -1
        self.table: Table | None = None

    # ---- set-up -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Bind the port (a running agent on it stops us here), take the table lock (a
        previous agent's control process gets LOCK_WAIT to exit), then the table and key."""
        cfg = self.config
        self.listeners = listeners(cfg)
        self.container_listeners = container_credentials_listeners(cfg)   # control's only
        self.lock_fd = lock_table(cfg.table_path)
        self.table = open_table(cfg)
        self.token_key_fd = token_key_fd(load_token_key(cfg.token_key_file))
        listen_args = ["--listen-fd", str(self.listeners[0].fileno())]
        if len(self.listeners) > 1:
            listen_args += ["--metrics-listen-fd", str(self.listeners[1].fileno())]
        listen_fds = tuple(sock.fileno() for sock in self.listeners)
        self.pairs = [channel.socketpair() for _ in range(cfg.workers)]
        settings = worker_settings(cfg, token_key_fd=self.token_key_fd).to_json()
        for i, (_, worker_end) in enumerate(self.pairs):
            self.children.append(Child(
                name=f"worker-{i}",
                argv=[*CHILD_PYTHON, "-m", "kiamfast.server.worker", "--table", cfg.table_path,
                      "--channel-fd", str(worker_end.fileno()), "--worker-index", str(i),
                      *listen_args, "--settings-json", settings],
                fds=(worker_end.fileno(), self.token_key_fd, *listen_fds)))
        control_fds = tuple(c.fileno() for c, _ in self.pairs)
        container_fds = tuple(sock.fileno() for sock in self.container_listeners)
        container_args: list[str] = []
        if container_fds:
            container_args = ["--container-credentials-fds", ",".join(map(str, container_fds))]
        self.control = Child(
            name="control",
            argv=[*CHILD_PYTHON, "-m", "kiamfast.control", "--table", cfg.table_path,
                  "--channel-fds", ",".join(map(str, control_fds)),
                  *container_args, "--config-json", config_to_json(cfg)],
            fds=(*control_fds, *container_fds, self.lock_fd))

    def wait_listening(self, timeout: float = 10.0) -> bool:
        """Whether a worker answers HTTP on the app port.  The socket is bound here, so a
        connection alone proves nothing (the kernel queues it): wait for an answer."""
        host = self.config.listen_host or "127.0.0.1"
        if host in ("::", "0.0.0.0"):
            host = "127.0.0.1"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(c.proc and c.proc.poll() is not None for c in self.children):
                return False
            try:
                with socket.create_connection((host, self.config.app_port), timeout=0.5) as s:
                    s.sendall(b"GET /readyz HTTP/1.1\r\nHost: kiamfast\r\n"
                              b"Connection: close\r\n\r\n")
                    if s.recv(16).startswith(b"HTTP/1."):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.prepare()
        except (WorkerError, OSError, LinkError) as e:   # the port is taken, the key file
            log.error("cannot start: %s", e)             # unwritable, no NET_ADMIN
            return 1
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            child.start()
        if not self.wait_listening():
            log.error("workers did not start listening on port %d", self.config.app_port)
            self.stop()
            return 1
        self.control.start()
        self.children.append(self.control)
        while not self.stopping:
            self._reap_and_restart()
            time.sleep(0.1)
        self.stop()
        return 0

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.stopping = True

    def _reap_and_restart(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                if now >= child.restart_at:
                    child.start()
                continue
            code = child.proc.poll()
            if code is None:
                continue
            ran = now - child.started
            child.backoff = RESTART_BACKOFF_MIN if ran > HEALTHY_AFTER else min(
                child.backoff * 2, RESTART_BACKOFF_MAX)
            child.restart_at = now + child.backoff
            child.restarts += 1
            child.proc = None
            log.warning("%s exited with %s after %.1fs; restarting in %.1fs", child.name, code,
                        ran, child.backoff)

    def stop(self) -> None:
        """SIGTERM every child (workers finish in-flight requests), then SIGKILL stragglers."""
        live = [c.proc for c in self.children if c.proc and c.proc.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.info("stopped")

    def close(self) -> None:
        """Give back what prepare() took: the port, the channels, the table lock, the table's
        mapping, the key's memfd (how tests end a supervisor that started no children)."""
        for sock in [*self.listeners, *self.container_listeners,
                     *(end for pair in self.pairs for end in pair)]:
            sock.close()
        self.container_listeners = []
        for fd in (self.lock_fd, self.token_key_fd):
            if fd >= 0:
                os.close(fd)
        if self.table is not None:
            self.table.close()
        self.listeners, self.pairs, self.table = [], [], None
        self.lock_fd = self.token_key_fd = -1


def run(config: Config) -> int:
    logs.setup(log_format=config.log_format, level=config.effective_log_level)
    return Supervisor(config).run()
