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
  worker: no other process on the host network can bind the port beside it and take a share
  of the pods' connections, and connections wait in the backlog while a worker restarts;
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

Where the sockets come from, first match wins (docs/architecture.md, "Handing the node
over"): none if the socket keeper (``--socket-keeper``, keeper_client.py) says this pod
handed the node over (it stays idle); an agent serving at ``--handover-socket`` (taken
over: handover.py); the keeper's (this container was restarted); binding them
here; and where another process holds ``--app-port`` and cannot hand over, the second port
(``--handover-port``, secondport.py).  Sockets that outlived the previous agent prove the
host did not reboot, so its table is served on as it is when it was written moments ago.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import time

from kiamfast import channel, fdpass, logs, milestones
from kiamfast.config import EXIT_CONFIG, Config, config_to_json
from kiamfast.container_credentials.link import LinkError
from kiamfast.server.settings import WorkerSettings
from kiamfast.sockets import ListenError
from kiamfast.supervisor import handover, keeper_client, secondport, start_errors
from kiamfast.supervisor.children import CHILD_PYTHON, RESTART_BACKOFF_MAX, Child, wait_ready
from kiamfast.supervisor.listeners import (APP, CONTAINER, METRICS, SECOND, ForeignSocket,
                                           Listener, of_kind, take)
from kiamfast.supervisor.readiness import ReadyFile, own_control_ready
from kiamfast.supervisor.statefiles import (alternate_table_path, load_token_key, lock_table,
                                            open_lock, open_table, table_layout,
                                            table_to_continue, token_key_fd, try_lock_table)
from kiamfast.table import Table

log = logging.getLogger("kiamfast.supervisor")

STOP_GRACE = 10.0
# A table its keeper's sockets outlived is served on as it is if its control process wrote
# it this recently: no staler than while the supervisor restarts a crashed control process
# (its backoff), which the workers serve through as well.
CONTINUE_WITHIN = RESTART_BACKOFF_MAX
TAKEOVER_TABLE_AGE = 60.0   # the serving agent's table: its heartbeat is seconds old at most
FIRST_POLL_WAIT = 5.0       # runtime mode: connections wait in the backlog this long at most
KEEPER_REFRESH = 2.0


def worker_settings(config: Config, *, token_key_fd: int,
                    metrics_port: int | None = None) -> WorkerSettings:
    return WorkerSettings(
        app_port=config.app_port,
        listen_host=config.listen_host or None,
        metrics_port=config.metrics_port if metrics_port is None else metrics_port,
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
        self.control: Child | None = None
        self.held: list[Listener] = []
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock_fd = self.token_key_fd = -1
        self.table: Table | None = None     # created or adopted here (writer): prepare()
        self.view: Table | None = None      # the table as this supervisor reads it
        self.table_path = config.table_path
        self.keeper = keeper_client.KeeperLink(config.socket_keeper) \
            if config.socket_keeper else None
        self.point: socket.socket | None = None     # --handover-socket, listening
        self.second: secondport.SecondPort | None = None
        self.ready_file = ReadyFile(config.ready_file)
        self.idle = False             # handed the node over: nothing to serve, nothing to restart
        self._locked_at: int | None = None   # when our control process took the lock (takeover)
        self._keeper_checked = 0.0

    # ---- what prepare() set up, as before ----------------------------------------------------

    @property
    def listeners(self) -> list[socket.socket]:
        """The workers' listening sockets (app, second, metrics)."""
        return [lst.sock for lst in self.held if lst.kind != CONTAINER]

    @property
    def container_listeners(self) -> list[socket.socket]:
        return [lst.sock for lst in of_kind(self.held, CONTAINER)]

    # ---- set-up -----------------------------------------------------------------------------

    def prepare(self, deposit: keeper_client.Deposit | None = None) -> None:
        """Get the sockets (``deposit``: the keeper's, else bound here: a running agent on
        the port stops us here, unless --handover-port), take the table lock (a previous
        agent's control process gets LOCK_WAIT to exit), then the table and key, and build
        the children."""
        cfg = self.config
        received = deposit.received if deposit is not None else []
        kinds = {d.get("kind") for d, _ in received}
        second = SECOND in kinds and APP not in kinds   # deposited before the move back
        try:
            try:
                self.held = take(self.config, received, second_port=second)
            except ListenError as e:
                if e.errno != errno.EADDRINUSE or e.port != cfg.app_port \
                        or not cfg.handover_port or received:
                    raise
                second = True
                self.held = take(self.config, [], second_port=True, skip_taken=(METRICS,
                                                                                CONTAINER))
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
        self._build_children()

    def _open_table(self, *, continuing: bool, note_path: str | None,
                    second_port: bool) -> None:
        """The table lock and the table.  Sockets from the keeper (``continuing``): the table
        they were served from, on as it is if written moments ago; else adopted or created
        (today's start).  On the second port, the old agent's lock may be held: then the
        alternate table."""
        cfg = self.config
        path = note_path if note_path in (cfg.table_path,
                                          alternate_table_path(cfg.table_path)) \
            else cfg.table_path
        if second_port and not note_path:
            fd = try_lock_table(path)
            if fd is None:
                path = alternate_table_path(path)
                log.warning("the table lock of %s is held (a kiamfast that cannot hand "
                            "over): this agent writes %s", cfg.table_path, path)
            else:
                os.close(fd)
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

    def _build_children(self) -> None:
        cfg = self.config
        for pair in self.pairs:
            for end in pair:
                end.close()
        self.pairs = [channel.socketpair() for _ in range(cfg.workers)]
        self.children = [self._worker(i) for i in range(cfg.workers)]
        control_fds = tuple(c.fileno() for c, _ in self.pairs)
        container_fds = tuple(lst.sock.fileno() for lst in of_kind(self.held, CONTAINER))
        container_args: list[str] = []
        if container_fds:
            container_args = ["--container-credentials-fds", ",".join(map(str, container_fds))]
        self.control = Child(
            name="control",
            argv=[*CHILD_PYTHON, "-m", "kiamfast.control", "--table", self.table_path,
                  "--channel-fds", ",".join(map(str, control_fds)),
                  "--table-lock-fd", str(self.lock_fd),
                  *container_args, "--config-json", config_to_json(cfg)],
            fds=(*control_fds, *container_fds, self.lock_fd))

    def _worker(self, i: int) -> Child:
        cfg = self.config
        app = of_kind(self.held, APP) or of_kind(self.held, SECOND)
        extra = of_kind(self.held, SECOND) if of_kind(self.held, APP) else []
        metrics = of_kind(self.held, METRICS)
        listen_args = ["--listen-fd", str(app[0].sock.fileno())]
        if metrics:
            listen_args += ["--metrics-listen-fd", str(metrics[0].sock.fileno())]
        if extra:
            listen_args += ["--extra-listen-fds", ",".join(str(lst.sock.fileno())
                                                           for lst in extra)]
        # a separate metrics port another process still holds: /metrics on the app port
        settings = worker_settings(cfg, token_key_fd=self.token_key_fd,
                                   metrics_port=None if metrics else cfg.app_port).to_json()
        worker_end = self.pairs[i][1]
        return Child(
            name=f"worker-{i}",
            argv=[*CHILD_PYTHON, "-m", "kiamfast.server.worker", "--table", self.table_path,
                  "--channel-fd", str(worker_end.fileno()), "--worker-index", str(i),
                  *listen_args, "--settings-json", settings,
                  "--log-format", cfg.log_format, "--log-level", cfg.effective_log_level],
            fds=(worker_end.fileno(), self.token_key_fd,
                 *(lst.sock.fileno() for lst in [*app[:1], *metrics, *extra])))

    def wait_listening(self, timeout: float = 10.0) -> bool:
        """Whether a worker answers HTTP on the app port.  The socket is bound here, so a
        connection alone proves nothing (the kernel queues it): wait for an answer."""
        lst = (of_kind(self.held, APP) or of_kind(self.held, SECOND))[0]
        host = self.config.listen_host or "127.0.0.1"
        if host in ("::", "0.0.0.0"):
            host = "127.0.0.1"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(c.proc and c.proc.poll() is not None for c in self.workers):
                return False
            try:
                with socket.create_connection((host, lst.port), timeout=0.5) as s:
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
                cfg.handover_socket, self)
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
            if not self.wait_listening():
                log.error("workers did not start listening on port %d",
                          (of_kind(self.held, APP) or of_kind(self.held, SECOND))[0].port)
                self.stop()
                return 1
            self.deposit()
        self._open_handover_point()
        return self._serve()

    def _start_children(self) -> None:
        """Every child at once.  An adopted table whose addresses wait for our control
        process's first runtime poll (statefiles: kept for it to confirm) has nothing a
        worker could answer before then: the workers start paused, so connections wait in
        the backlog for that poll rather than burn their wait budget in a worker (503)."""
        if not self._runtime_mode():
            for child in self._all_children():
                child.start()
            return
        self.control.start(tell_ready=True)     # first: its first poll is what we wait for
        for child in self.children:
            child.start(extra_argv=("--paused",), tell_ready=True)
        problem = wait_ready(self._all_children(), FIRST_POLL_WAIT, keep_open=(self.control,))
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
            self._refresh_keeper(now)
            self.ready_file.show(self.own_control_ready())
            if self._serve_takeover():
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

    def _all_children(self) -> list[Child]:
        return [*self.children, *([self.control] if self.control else [])]

    @property
    def workers(self) -> list[Child]:
        return list(self.children)

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
        for child in self._all_children():
            child.reap(now)
        return None

    def stop(self) -> None:
        """SIGTERM every child (workers finish in-flight requests), then SIGKILL stragglers."""
        if self.second is not None:
            self.second.stop()
        self.ready_file.show(False)
        live = [c.proc for c in self._all_children() if c.proc and c.proc.poll() is None]
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
        for lst in self.held:
            lst.close()
        for sock in [end for pair in self.pairs for end in pair]:
            sock.close()
        if self.point is not None:
            self.point.close()
            self.point = None
        for fd in (self.lock_fd, self.token_key_fd):
            if fd >= 0:
                os.close(fd)
        for t in {id(t): t for t in (self.table, self.view) if t is not None}.values():
            t.close()
        self.held, self.pairs, self.table, self.view = [], [], None, None
        self.lock_fd = self.token_key_fd = -1

    # ---- the socket keeper ------------------------------------------------------------------

    def deposit(self) -> None:
        if self.keeper is not None:
            self.keeper.deposit({"table_path": self.table_path}, self.held)

    def _refresh_keeper(self, now: float) -> None:
        if self.keeper is not None and now - self._keeper_checked >= KEEPER_REFRESH:
            self._keeper_checked = now
            self.keeper.refresh()

    # ---- handing over (handover.Handing) ------------------------------------------------------

    def _open_handover_point(self) -> None:
        if not self.config.handover_socket or self.point is not None:
            return
        try:
            self.point = fdpass.listen(self.config.handover_socket)
        except OSError as e:
            log.error("cannot listen on --handover-socket %s: %s; this agent cannot hand "
                      "the node over", self.config.handover_socket, e)
            return
        self.point.setblocking(False)

    def _serve_takeover(self) -> bool:
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

    def refusal(self) -> str:
        return self.second.busy() if self.second is not None else ""

    def offer(self) -> tuple[str, list[dict], list[int]]:
        return (self.table_path, [lst.description() for lst in self.held],
                [lst.sock.fileno() for lst in self.held])

    def stop_accepting(self) -> None:
        """The workers close their listening sockets, answer what they hold and exit."""
        started = time.monotonic()
        for child in self.children:
            child.stop(STOP_GRACE)
        log.info("workers stopped for the handover in %.0f ms",
                 (time.monotonic() - started) * 1000)

    def release(self) -> None:
        """The control process exits and the table lock goes with our descriptor of it."""
        self.ready_file.show(False)
        if self.control is not None and self.control.alive():
            self.control.restart = False
            self.control.proc.terminate()
        # The control process lets go of its descriptor of the lock right after its last
        # write; ours would hold the lock on.  The new control process takes it then: it
        # need not wait for ours to finish exiting (the interpreter's teardown can take a
        # second), and neither does the new agent.
        os.close(self.lock_fd)
        self.lock_fd = -1
        log.info("control process told to stop for the handover: the table lock is free "
                 "after its last write")

    def resume(self) -> None:
        """The takeover failed half-way: serve again on the sockets we still hold.  Once
        the lock was let go, the workers start at once (they serve the table as it is) and
        the new control process waits in standby until the other agent's has exited."""
        if self.control is not None and not self.control.restart:
            self.control.stop(STOP_GRACE)       # still exiting after release()
        if self.lock_fd < 0:
            self.lock_fd = open_lock(self.table_path)
            self._build_children()   # new channels, the new lock descriptor
        for child in self._all_children():
            child.restart = True
            if not child.alive():
                child.start()
        log.info("serving again")

    def retire(self) -> None:
        """Handed over: nothing of ours serves any more."""
        if self.control is not None:
            self.control.stop(STOP_GRACE)       # reap it (it let go of the lock already)
        for lst in self.held:
            lst.close()
        self.held = []
        if self.point is not None:
            self.point.close()     # the path is the new agent's now: never unlinked here
            self.point = None
        if self.keeper is not None:
            self.keeper.deposit({"handed_over": True, "table_path": self.table_path}, [])
        self.idle = True

    # ---- taking over (handover.Taking) ------------------------------------------------------

    def arm(self, table_path: str, received: list[tuple[dict, socket.socket]]) -> None:
        """The handed sockets checked against our configuration, our children up: workers
        paused, the control process in standby for the table lock."""
        cfg = self.config
        if table_path not in (cfg.table_path, alternate_table_path(cfg.table_path)):
            for _, sock in received:
                sock.close()
            raise handover.HandoverFailed(f"the serving agent writes the table {table_path}, "
                                          f"this one is configured for {cfg.table_path}")
        try:
            self.held = take(cfg, received)
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
        self._build_children()
        self.control.start(tell_ready=True)     # first: its first poll is what we wait for
        for child in self.children:
            child.start(extra_argv=("--paused",), tell_ready=True)
        problem = wait_ready(self._all_children(), handover.ARM_TIMEOUT,
                             keep_open=(self.control,))
        if problem:
            raise handover.HandoverFailed(problem)
        self.deposit()

    def proceed(self) -> None:
        """Stopped (SIGTERM) while taking over: the old agent keeps the node (it resumes when
        we hang up), rather than handing it to an agent about to go away."""
        if self.stopping:
            raise handover.HandoverFailed("stopped while taking the node over")

    def accept_now(self, step: str) -> bool:
        """When our workers start accepting: as soon as the old ones stopped if they answer
        known pods from the table at once (API mode), after the old control process let go
        if every new connection needs a runtime poll of ours."""
        return step == ("released" if self._runtime_mode() else "stopped-accepting")

    def _runtime_mode(self) -> bool:
        return self.view is not None and self.view.runtime_mode

    def start_accepting(self) -> None:
        if self._runtime_mode():
            self._await_first_poll()
        self._resume_workers()

    def _resume_workers(self) -> None:
        for child in self.children:
            if child.alive():
                os.kill(child.pid, signal.SIGUSR1)
        log.info("workers accepting")

    def _await_first_poll(self) -> None:
        """Runtime mode: a connection is answered only after a poll our control process
        begins after it, and our control process polls on demand only once it runs.  Until
        its first poll (or failed attempt) is in the table, connections wait in the backlog
        (no wait budget burns there), not in a worker (whose budget ends in 503).  A poll is
        ours if it began after our control process took the lock (it says when)."""
        deadline = time.monotonic() + FIRST_POLL_WAIT
        locked_at = self._lock_taken_at(deadline)
        while locked_at is None or max(self.view.verified_ns, self.view.failed_ns) < locked_at:
            if time.monotonic() > deadline or not self.control.alive():
                log.warning("our control process has not polled the runtime yet; accepting "
                            "anyway")
                return
            time.sleep(0.002)
        log.info("our control process polled the runtime %.0f ms after it took the lock",
                 (time.monotonic_ns() - locked_at) / 1e6)

    def _lock_taken_at(self, deadline: float) -> int | None:
        """When our control process took the table lock (CLOCK_MONOTONIC ns), from its
        ready pipe (writer_lock.hold); None if it has not said so by ``deadline``."""
        if self._locked_at is None:
            said = b""
            while len(said) < 9 and time.monotonic() < deadline:
                more = self.control.read_ready(9 - len(said), deadline - time.monotonic())
                if not more:
                    break
                said += more
            self.control.close_ready_pipe()
            if len(said) == 9 and said[:1] == b"L":
                self._locked_at = int.from_bytes(said[1:], "little")
        return self._locked_at

    def await_writer(self) -> None:
        deadline = time.monotonic() + handover.FINISH_TIMEOUT
        self._lock_taken_at(deadline)
        while not (self.view.writer_pid == self.control.pid):
            if not self.control.alive():
                raise handover.HandoverFailed("the control process exited before it held "
                                              "the table lock")
            if time.monotonic() > deadline:
                raise handover.HandoverFailed("the control process never took the table lock")
            time.sleep(0.005)
        log.info("took the node over: this agent's control process writes the table")

    def listen(self) -> None:
        self._open_handover_point()

    def disarm(self) -> None:
        """The takeover failed: stop what we started (the old agent serves on)."""
        for child in self._all_children():
            child.stop(STOP_GRACE)
        self.close()

    # ---- the second port (secondport.SecondPort) ---------------------------------------------

    def add_listener(self, lst: Listener) -> None:
        self.held.append(lst)

    def drop_listeners(self, gone: list[Listener]) -> None:
        self.held = [lst for lst in self.held if lst not in gone]

    def swap_workers(self) -> None:
        """New workers on what ``self.held`` holds now, then the old ones retire: there is
        always a worker accepting on every port a rule points to."""
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
    return Supervisor(config).run()
