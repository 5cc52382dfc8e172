"""The `kiamfast` main process: creates the shared table and channels, starts the children,
restarts them when they die, and stops them cleanly on SIGTERM.

Start order is the node-start order of docs/architecture.md: the supervisor binds the sockets
first (from then on a pod's connection waits in the backlog, never refused, and is never
answered with another identity), then starts the workers and the control process together:
the control process installs the DNAT rule, syncs, prefetches and marks the agent ready while
the workers come up.

The supervisor never touches Kubernetes, STS or a request.  If the control process dies, the
workers keep serving what the table holds until it is restarted and has rebuilt it.

It holds what the children share (commands.py says what each gets, and why it is held
here): the listening sockets, the token key, the table lock and the channels.

The table a previous agent left at ``--table-path`` is adopted if it is safe to
(statefiles.py; docs/architecture.md, "Node start and stop").

Where the sockets come from, first match wins (docs/architecture.md, "Handing the node
over"): none if the socket keeper (``--socket-keeper``, keeper_client.py) says this pod
handed the node over (it stays idle); an agent serving at ``--handover-socket`` (taken
over: handover.py, taking.py; handed over in turn: handing.py); the keeper's (this
container was restarted); binding them here; and where another process holds
``--app-port`` and cannot hand over, the second port (``--handover-port``, secondport.py).
Sockets that outlived the previous agent prove the host did not reboot, so its table is
served on as it is when it was written moments ago.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

from kiamfast import channel, logs, milestones
from kiamfast.config import EXIT_CONFIG, Config
from kiamfast.container_credentials.link import LinkError
from kiamfast.kube.cluster import missing_cluster
from kiamfast.sockets import ListenError
from kiamfast.supervisor import commands, handover, keeper_client, secondport, start_errors
from kiamfast.supervisor.children import RESTART_BACKOFF_MAX, STOP_GRACE, Child, wait_ready
from kiamfast.supervisor.handing import HandingOver
from kiamfast.supervisor.listeners import ForeignSocket, Listeners, take, take_for_start
from kiamfast.supervisor.readiness import (ReadyFile, answers_http, await_first_poll,
                                           lock_taken_at, own_control_ready)
from kiamfast.supervisor.statefiles import (alternate_table_path, load_token_key, lock_table,
                                            open_lock, open_table, table_layout,
                                            table_path_to_start, table_to_continue,
                                            token_key_fd)
from kiamfast.supervisor.taking import TakingOver
from kiamfast.table import Table

log = logging.getLogger("kiamfast.supervisor")

# A table its keeper's sockets outlived is served on as it is if its control process wrote
# it this recently: no staler than while the supervisor restarts a crashed control process
# (its backoff), which the workers serve through as well.
CONTINUE_WITHIN = RESTART_BACKOFF_MAX
TAKEOVER_TABLE_AGE = 60.0   # the serving agent's table: its heartbeat is seconds old at most
FIRST_POLL_WAIT = 5.0       # runtime mode: connections wait in the backlog this long at most


class Supervisor:
    """The process tree: what the children share (sockets, table, lock, key, channels), the
    children themselves, their restarts and their stop.  The handover's two sides
    (handing.py, taking.py) and the second port (secondport.py) act through it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stopping = False
        self.children: list[Child] = []      # the workers
        self.control: Child | None = None
        self.listeners = Listeners()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock_fd = self.token_key_fd = -1
        self.table: Table | None = None     # created or adopted here (writer): prepare()
        self.view: Table | None = None      # the table as this supervisor reads it
        self.table_path = config.table_path
        self.keeper = keeper_client.KeeperLink(config.socket_keeper) \
            if config.socket_keeper else None
        self.handing = HandingOver(self)
        self.second: secondport.SecondPort | None = None
        self.ready_file = ReadyFile(config.ready_file)
        self._locked_at: int | None = None   # when our control process took the lock (takeover)

    # ---- set-up -----------------------------------------------------------------------------

    def prepare(self, deposit: keeper_client.Deposit | None = None) -> None:
        """Get the sockets (``deposit``: the keeper's, else bound here: a running agent on
        the port stops us here, unless --handover-port), take the table lock (a previous
        agent's control process gets LOCK_WAIT to exit), then the table and key, and build
        the children."""
        cfg = self.config
        received = deposit.received if deposit is not None else []
        try:
            self.listeners, second = take_for_start(cfg, received)
        except ListenError as e:
            raise start_errors.listen_failed(e, cfg) from None
        if second:
            self.second = secondport.SecondPort(self)
        note_path = deposit.note.get("table_path") if deposit is not None else None
        try:
            self._open_table(continuing=bool(received), note_path=note_path,
                             second_port=second)
        except OSError as e:
            raise start_errors.state_file_failed("table-path", cfg.table_path, e) from None
        try:
            key = load_token_key(cfg.token_key_file)
        except OSError as e:
            raise start_errors.state_file_failed("token-key-file", cfg.token_key_file,
                                                 e) from None
        self.token_key_fd = token_key_fd(key)
        self.build_children()

    def prepare_taken(self, table_path: str,
                      received: list[tuple[dict, socket.socket]]) -> None:
        """:meth:`prepare` for a takeover: the sockets and table the serving agent handed
        over, checked against our configuration; the lock file opened, not locked (our
        control process waits for it in standby)."""
        cfg = self.config
        if table_path not in (cfg.table_path, alternate_table_path(cfg.table_path)):
            for _, sock in received:
                sock.close()
            raise handover.HandoverFailed(f"the serving agent writes the table {table_path}, "
                                          f"this one is configured for {cfg.table_path}")
        try:
            self.listeners = Listeners(take(cfg, received))
        except (ForeignSocket, ListenError, OSError) as e:
            log.error("refusing the handed-over sockets: %s", e)
            raise
        self.table_path = table_path
        self.view, why = table_to_continue(table_path, table_layout(cfg),
                                           max_age=TAKEOVER_TABLE_AGE)
        if self.view is None:
            raise handover.HandoverFailed(f"the table {table_path} {why}")
        self.lock_fd = open_lock(table_path)
        self.token_key_fd = token_key_fd(load_token_key(cfg.token_key_file))
        self.build_children()

    def _open_table(self, *, continuing: bool, note_path: str | None,
                    second_port: bool) -> None:
        """The table lock and the table.  Sockets from the keeper (``continuing``): the table
        they were served from, on as it is if written moments ago; else adopted or created
        (today's start).  On the second port, the old agent's lock may be held: then the
        alternate table."""
        cfg = self.config
        path = table_path_to_start(cfg, note_path=note_path, second_port=second_port)
        self.table_path = path
        self.lock_fd = lock_table(path)
        if continuing:
            self.view, why = table_to_continue(path, table_layout(cfg),
                                               max_age=CONTINUE_WITHIN)
            if self.view is not None:
                log.info("serving on the table %s as it is (the sockets outlived the previous "
                         "agent, which wrote it %.1fs ago)", path, self.view.heartbeat_age)
                return
            log.info("not serving on the table %s as it is: it %s", path, why)
        self.table = open_table(cfg.replace(table_path=path))
        self.view = self.table

    def build_children(self) -> None:
        """The children, not started: new channels, the sockets, lock and key held now."""
        for pair in self.pairs:
            for end in pair:
                end.close()
        self.pairs = [channel.socketpair() for _ in range(self.config.workers)]
        self.children = [self._worker(i) for i in range(self.config.workers)]
        self.control = commands.control(self.config, listeners=self.listeners,
                                        table_path=self.table_path,
                                        channel_ends=[c for c, _ in self.pairs],
                                        lock_fd=self.lock_fd)

    def _worker(self, i: int) -> Child:
        return commands.worker(self.config, i, listeners=self.listeners,
                               table_path=self.table_path, channel_end=self.pairs[i][1],
                               token_key_fd=self.token_key_fd)

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        cfg = self.config
        deposit = keeper_client.fetch(cfg.socket_keeper) if cfg.socket_keeper else None
        if deposit is not None and deposit.note.get("handed_over"):
            # This pod's agent handed the node to another before its container restarted:
            # taking it back would leave nobody serving once this pod is deleted.
            deposit.close()
            log.warning("this pod handed the node over to another agent: idle until stopped")
            return self._idle()
        try:
            took_over = bool(cfg.handover_socket) and handover.take_over_with_retries(
                cfg.handover_socket, TakingOver(self, self.handing))
            if took_over and deposit is not None:
                deposit.close()          # the same sockets, handed over again
            elif not took_over and not self.stopping:
                self.prepare(deposit)
        except handover.HandoverFailed as e:
            log.error("cannot take the node over: %s", e)
            self.close()
            return 0 if self.stopping else 1
        except start_errors.CannotStart as e:
            log.error("cannot start: %s", e)
            self.close()
            return e.code
        except (ListenError, OSError, LinkError, ForeignSocket) as e:
            log.error("cannot start: %s", e)   # the port is taken, the key file unwritable,
            self.close()                       # no NET_ADMIN, a foreign socket
            return 1
        if self.stopping:
            self.stop()
            return 0
        if not took_over:
            if cfg.handover_port and self.second is None:
                secondport.remove_stale_rules(cfg)
            # All at once: the sockets are listening already (a pod's connection waits in the
            # backlog for the first worker, never refused), so the control process may
            # install the DNAT rule while the workers start, and its imports overlap theirs.
            self._start_children()
            if not answers_http(cfg.listen_host or "127.0.0.1", self.listeners.app.port,
                                workers=self.children, timeout=10.0):
                log.error("workers did not start listening on port %d",
                          self.listeners.app.port)
                self.stop()
                return 1
            self.deposit()
        self.handing.listen()
        return self._serve()

    def _start_children(self) -> None:
        """Every child at once.  An adopted table whose addresses wait for our control
        process's first runtime poll (statefiles: kept for it to confirm) has nothing a
        worker could answer before then: the workers start paused, so connections wait in
        the backlog for that poll rather than burn their wait budget in a worker (503)."""
        if not self.runtime_mode:
            for child in self.all_children():
                child.start()
            return
        problem = self.start_paused(FIRST_POLL_WAIT)
        if problem:
            log.warning("starting paused: %s; accepting at once", problem)
            self.control.close_ready_pipe()
            self._resume_workers()
        else:
            self.start_accepting()

    def _serve(self) -> int:
        while not self.stopping:
            code = self._reap_and_restart()
            if code is not None:
                self.stop()
                return code
            now = time.monotonic()
            if self.second is not None:
                self.second.tick(now)
                if self.second.state == "done":
                    self.second = None
            if self.keeper is not None:
                self.keeper.tick(now)
            self.ready_file.show(self.own_control_ready())
            if self.handing.serve():
                return self._idle()
            time.sleep(0.1)
        self.stop()
        return 0

    def _idle(self) -> int:
        """Handed over: hold nothing, restart nothing, never exit by ourselves until SIGTERM
        (the kubelet would restart the container, which without a keeper's note would take
        the node back)."""
        self.ready_file.show(False)
        while not self.stopping:
            time.sleep(0.2)
        log.info("stopped (idle)")
        return 0

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.stopping = True

    def all_children(self) -> list[Child]:
        return [*self.children, *([self.control] if self.control else [])]

    def own_control_ready(self) -> bool:
        if self.control is None or not self.control.alive():
            return False
        since = max(int(self.control.started * 1e9), self._locked_at or 0)
        return own_control_ready(self.view, self.control.pid, since)

    def _reap_and_restart(self) -> int | None:
        """Restart children that died; the exit code to stop with when the control process
        found the configuration unusable (it said why in one line: no restart cures that)."""
        now = time.monotonic()
        if self.control is not None and self.control.proc is not None \
                and self.control.proc.poll() == EXIT_CONFIG:
            return EXIT_CONFIG
        for child in self.all_children():
            child.reap(now)
        return None

    def stop(self) -> None:
        """SIGTERM every child (workers finish in-flight requests), then SIGKILL stragglers."""
        if self.second is not None:
            self.second.stop()
        self.ready_file.show(False)
        live = [c.proc for c in self.all_children() if c.proc and c.proc.poll() is None]
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
        self.listeners.close()
        for sock in [end for pair in self.pairs for end in pair]:
            sock.close()
        self.handing.close()
        for fd in (self.lock_fd, self.token_key_fd):
            if fd >= 0:
                os.close(fd)
        for t in {id(t): t for t in (self.table, self.view) if t is not None}.values():
            t.close()
        self.pairs, self.table, self.view = [], None, None
        self.lock_fd = self.token_key_fd = -1

    # ---- the socket keeper ------------------------------------------------------------------

    def deposit(self) -> None:
        if self.keeper is not None:
            self.keeper.deposit({"table_path": self.table_path}, list(self.listeners))

    # ---- starting to accept (a paused start, a takeover) ------------------------------------

    def start_paused(self, timeout: float) -> str:
        """The control process first (its first poll is what we wait for), then the workers
        paused (not accepting until SIGUSR1); "" once all said they are ready within
        ``timeout``, else what went wrong.  The control process's pipe stays open."""
        self.control.start(tell_ready=True)
        for child in self.children:
            child.start(extra_argv=("--paused",), tell_ready=True)
        return wait_ready(self.all_children(), timeout, keep_open=(self.control,))

    @property
    def runtime_mode(self) -> bool:
        return self.view is not None and self.view.runtime_mode

    def start_accepting(self) -> None:
        """The workers accept.  Runtime mode: a connection is answered only after a poll our
        control process begins after it, and it polls on demand only once it runs.  Until its
        first poll (or failed attempt) is in the table, connections wait in the backlog (no
        wait budget burns there), not in a worker (whose budget ends in 503).  A poll is ours
        if it began after our control process took the lock (it says when)."""
        if self.runtime_mode:
            deadline = time.monotonic() + FIRST_POLL_WAIT
            await_first_poll(self.view, self.control, self.lock_taken_at(deadline),
                             deadline=deadline)
        self._resume_workers()

    def _resume_workers(self) -> None:
        for child in self.children:
            if child.alive():
                os.kill(child.pid, signal.SIGUSR1)
        log.info("workers accepting")

    def lock_taken_at(self, deadline: float) -> int | None:
        """When our control process took the table lock (readiness.lock_taken_at)."""
        if self._locked_at is None:
            self._locked_at = lock_taken_at(self.control, deadline)
        return self._locked_at

    # ---- the second port (secondport.SecondPort) ---------------------------------------------

    def swap_workers(self) -> None:
        """New workers on what ``self.listeners`` holds now, then the old ones retire: there
        is always a worker accepting on every port a rule points to."""
        old = self.children
        self.children = [self._worker(i) for i in range(self.config.workers)]
        for child in self.children:
            child.start(tell_ready=True)
        problem = wait_ready(self.children, handover.ARM_TIMEOUT)
        if problem:
            log.error("new workers: %s", problem)
        for child in old:
            child.stop(STOP_GRACE)


def run(config: Config) -> int:
    milestones.hand_down()
    logs.setup(log_format=config.log_format, level=config.effective_log_level)
    # No cluster configured at all: say so before binding a port or starting a process (the
    # control process checks the rest of the API configuration: kube/config.py).
    problem = missing_cluster(kubeconfig=config.kubeconfig, api_server=config.api_server,
                              api_token=config.api_token, environ=os.environ)
    if problem:
        log.error("cannot start: %s", problem)
        return EXIT_CONFIG
    return Supervisor(config).run()
