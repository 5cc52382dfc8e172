"""The `kiamfast` main process: creates the shared table and channels, starts the children,
restarts them when they die, and stops them cleanly on SIGTERM.

Start order is the node-start order of docs/architecture.md: the supervisor binds the sockets
first (from then on a pod's connection waits in the backlog, never refused, and is never
answered with another identity), then starts the workers and the control process together:
the control process installs the DNAT rule, syncs, prefetches and marks the agent ready while
the workers come up.

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

import logging
import os
import signal
import socket
import subprocess
import time

from kiamfast import channel, logs, milestones
from kiamfast.config import EXIT_CONFIG, Config, config_to_json
from kiamfast.container_credentials.link import LinkError
from kiamfast.server.settings import WorkerSettings
from kiamfast.sockets import ListenError
from kiamfast.supervisor.children import CHILD_PYTHON, Child
from kiamfast.supervisor.listeners import container_credentials_listeners, listeners
from kiamfast.supervisor.statefiles import (load_token_key, lock_table, open_table,
                                            token_key_fd)
from kiamfast.table import Table

log = logging.getLogger("kiamfast.supervisor")

STOP_GRACE = 10.0


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
                      *listen_args, "--settings-json", settings,
                      "--log-format", cfg.log_format, "--log-level", cfg.effective_log_level],
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
            if any(c.proc and c.proc.poll() is not None for c in self.workers):
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
        except (ListenError, OSError, LinkError) as e:   # the port is taken, the key file
            log.error("cannot start: %s", e)             # unwritable, no NET_ADMIN
            return 1
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # All at once: the sockets are listening already (a pod's connection waits in the
        # backlog for the first worker, never refused), so the control process may install
        # the DNAT rule while the workers start, and its imports overlap theirs.
        self.children.append(self.control)
        for child in self.children:
            child.start()
        if not self.wait_listening():
            log.error("workers did not start listening on port %d", self.config.app_port)
            self.stop()
            return 1
        while not self.stopping:
            code = self._reap_and_restart()
            if code is not None:
                self.stop()
                return code
            time.sleep(0.1)
        self.stop()
        return 0

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.stopping = True

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c is not self.control]

    def _reap_and_restart(self) -> int | None:
        """Restart children that died; the exit code to stop with when the control process
        found the configuration unusable (it said why in one line: no restart cures that)."""
        now = time.monotonic()
        if self.control.proc is not None and self.control.proc.poll() == EXIT_CONFIG:
            return EXIT_CONFIG
        for child in self.children:
            child.reap(now)
        return None

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
    milestones.hand_down()
    logs.setup(log_format=config.log_format, level=config.effective_log_level)
    return Supervisor(config).run()
