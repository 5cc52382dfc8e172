"""The control process: the table's only writer, and the owner of every slow thing.

Data flows one way — sources (the API server: ``api_link.py``, ``k8s/``; the container
runtime: ``cri/``) → mappings (who owns each address, each pod's decision: ``mappings/``) →
credentials (STS: ``iam/``) → publish (the table's entries, status words and aux blobs:
``publish/``).  This module builds each room once (``_build``: plain constructors, nothing
started, nothing wired later) and then runs the start as the list it is (``_steps``,
``lifecycle.py``), each step timed (``start: <step> after <s>``), stopped in reverse:

1. **What the table holds** (a restart, an upgrade): the credential slots are adopted by key
   (no STS call), the addresses a runtime decided are kept; workers answer none of them
   before a runtime poll newer than their connection.
2. **The runtime first**: its first poll confirms the adopted owners still hold their
   addresses.  When the table held such owners (a restart), that poll runs alone: the API
   client and botocore are imported after it, so those pods are answered within a few
   hundred milliseconds of the start.  On a fresh node the STS client starts building (on
   its own thread) first: it is the longest step before the first credentials.
3. **The API**: the client (its configuration was checked by ``start.py``: an unusable one
   is a one-line error and exit 78, never a retry loop), the pods' list (namespaces first
   when the policy reads them); STS calls start as pods with roles arrive.
4. **The DNAT rule** (the supervisor bound the sockets before starting anything: a pod's
   connection waits in the backlog, never refused).
5. **Ready** once synced and every key seen is fetched (bounded), then **the startup taint**
   is removed, and removed again if it comes back.

An outage (the API server, the runtime, STS, the metadata service) is never fatal: every task
logs once per episode and retries, and the reason shows in ``/healthz`` (and in ``/readyz``'s
503 while it holds the start: ``health.readiness``).  On SIGTERM the DNAT rule stays unless
``--iptables-remove-on-exit``, or ``--iptables-remove-on-uninstall`` and the pod's DaemonSet is
deleted (``k8s/uninstall.py``): a pod without its agent gets a refused connection, never the
node's role.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiamfast import __version__, channel, metrics_text, milestones
from kiamfast import table as tbl
from kiamfast.config import Config
from kiamfast.container_credentials import token_only
from kiamfast.control import imds_client, writer_lock
from kiamfast.control.api_link import ApiLink
from kiamfast.control.cri import kept_sandboxes
from kiamfast.control.cri.source import RuntimeSource, find_runtime, open_witness
from kiamfast.control.health import WAITING_CREDENTIALS, WAITING_RUNTIME, Health
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.lifecycle import Lifecycle, Step, Tasks
from kiamfast.control.mappings import report
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.control.publish.blobs import AuxPublisher
from kiamfast.control.publish.metrics import agent_lines
from kiamfast.cpu_wait import CpuWait
from kiamfast.iptables import runner
from kiamfast.iptables.keeper import RuleKeeper

if TYPE_CHECKING:
    from kiamfast.container_credentials.server import ContainerCredentialsServer
    from kiamfast.control.iam.sts import StsClient
    from kiamfast.kube.config import ClientConfig

log = logging.getLogger("kiamfast.control")

PUBLISH_INTERVAL = 2.0
HEARTBEAT_INTERVAL = 1.0
FIRST_POLL_ALONE = 1.0          # a restart: at most this long before the API and STS start


@dataclass(frozen=True, slots=True)
class Rooms:
    """The control process's parts, each built once."""
    manager: CredentialManager
    model: NodeModel
    runtime: RuntimeSource
    api: ApiLink
    container: ContainerCredentialsServer | None    # --container-credentials-addr
    health: Health
    aux: AuxPublisher
    cpu_wait: CpuWait
    restarted: bool        # the table held owners a runtime is to confirm


class ControlProcess:
    def __init__(self, config: Config, table: tbl.Table, channels: list[socket.socket],
                 container_socks: list[socket.socket] | None = None, *,
                 sts: StsClient, api_config: ClientConfig) -> None:
        """``sts``: its build not begun; ``api_config``: checked by start.py;
        ``container_socks``: the --container-credentials-addr listeners, bound."""
        self.config = config
        self.sts = sts
        self.api_config = api_config
        self.table = table
        self.channels = channels
        self.container_socks = container_socks or []
        self.rooms: Rooms | None = None
        self.tasks = Tasks()
        self.ready = False
        self._remove_rules = False       # decided at the stop, before the watches end
        self._wake_scheduled = False
        self._stop = asyncio.Event()

    # ---- the start ------------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.table.set_status(ready=False, synced=False)
        if self.config.auto_discover_base_arn or self.config.auto_discover_default_role:
            self.config = await loop.run_in_executor(None, imds_client.discover_roles,
                                                     self.config)
        self.rooms = rooms = self._build()
        # The workers' messages once their rooms exist (a message read before would be lost).
        for sock in self.channels:
            loop.add_reader(sock.fileno(), self._on_channel, rooms, sock)
        lifecycle = Lifecycle(self._steps(rooms))
        try:
            await lifecycle.start()
            self.tasks.spawn(self._become_ready(rooms), "ready", for_life=False)
            # A task for life that ends is a failure: the supervisor restarts the whole
            # control process (the table keeps serving meanwhile).
            await self.tasks.until_stopped_or_failed(self._stop)
        finally:
            self._remove_rules = await self._rules_to_remove(rooms)
            await self.tasks.cancel()
            await lifecycle.stop()
            for sock in self.channels:
                loop.remove_reader(sock.fileno())
            log.info("control process stopped")

    def _build(self) -> Rooms:
        """Every room, from the configuration and what the table holds (nothing runs yet)."""
        cfg, table = self.config, self.table
        refs: Counter = Counter()     # addresses naming each credential slot (the model counts)
        manager = CredentialManager.from_config(cfg, table=table, sts=self.sts,
                                                notify=self.notify, slot_refs=refs)
        manager.adopt(self._credential_slots())
        if cfg.kubelet_url or "kubelet-insecure" in cfg.explicit:
            log.warning("--kubelet-url and --kubelet-insecure have no effect any more: the "
                        "container runtime (--cri-endpoint) knows a pod's address first")
        found = find_runtime(cfg.cri_endpoint, table_runtime_mode=table.runtime_mode)
        if table.runtime_mode and not found.expected:
            # Addresses a runtime decided, kept for its poll to confirm: none will come now
            # (--cri-endpoint=none), and workers would serve them as they are.
            for slot in table.snapshot():
                table.release_ip(slot["ip"], slot["pod_uid"])
        adopted = {ip["ip"]: (ip["pod_uid"], ip["pod_state"], ip["cred_slot"])
                   for ip in table.snapshot()}
        witness = open_witness(found, cfg.address_proof)
        model = NodeModel(
            policy=RolePolicy.from_config(cfg), table=table, sink=manager, notify=self.notify,
            slot_refs=refs, token_only=self._token_only(), adopted=adopted,
            expect_runtime=found.expected, proof=witness)
        # Until the runtime's first answer, a request from a connection newer than the last
        # applied poll waits for one, never for the API's guess.
        table.set_status(runtime_mode=model.runtime_mode)
        runtime = RuntimeSource(found, model=model, witness=witness, commit=self._commit,
                                on_change=self._health_changed,
                                known_file=kept_sandboxes.path_for(table.path))
        api = ApiLink(cfg, self.api_config, model=model, manager=manager, tasks=self.tasks,
                      report_uninjected=bool(self.container_socks),
                      on_state=self._health_changed)
        container = None
        if self.container_socks:
            from kiamfast.container_credentials import server
            container = server.from_config(cfg, self.container_socks, model=model,
                                           manager=manager, table=table, api=api)
        aux = AuxPublisher(table)
        health = Health(metadata_addr=cfg.metadata_addr, host_ip=cfg.host_ip, aux=aux,
                        runtime=runtime, api=api,
                        token_reviews=container.health if container is not None else None)
        return Rooms(manager=manager, model=model, runtime=runtime, api=api,
                     container=container, health=health, aux=aux,
                     cpu_wait=CpuWait(supervisor_pid=os.getppid()),
                     restarted=found.expected and bool(adopted))

    def _steps(self, rooms: Rooms) -> list[Step]:
        cfg = self.config
        steps = [Step("credentials adopted", lambda: self._start_credentials(rooms),
                      lambda: self._stop_credentials(rooms))]
        if rooms.runtime.enabled:
            steps.append(Step("runtime started", lambda: self._start_runtime(rooms),
                              rooms.runtime.stop))
        steps += [Step("STS client started", self.sts.prepare),
                  Step("API watch started", rooms.api.start, rooms.api.stop),
                  Step("periodic work started", lambda: self._start_periodic(rooms))]
        if cfg.iptables:
            steps.append(Step("DNAT rule installed", self._install_rule, self._remove_rule))
        if rooms.container is not None:
            steps.append(Step("container credentials listening",
                              lambda: self._start_container(rooms), rooms.container.close))
        return steps

    def _start_credentials(self, rooms: Rooms) -> None:
        """Step 1: the adopted slots are kept fresh; on a fresh node the STS client starts
        building at once (on a restart, after the runtime's first poll)."""
        if not rooms.restarted:
            self.sts.prepare()
        self.tasks.spawn(rooms.manager.run(), "credentials")

    def _stop_credentials(self, rooms: Rooms) -> None:
        rooms.manager.close()
        self.sts.close()

    async def _start_runtime(self, rooms: Rooms) -> None:
        """Step 2: the polls and the kernel's notifications; on a restart the first poll
        alone, bounded (an outage is the fallback's to answer, and the API's list may
        help)."""
        runtime = rooms.runtime
        assert runtime.poller is not None
        runtime.start()
        self.tasks.spawn(runtime.poller.run(), "runtime")
        self.tasks.spawn(runtime.watch_link(
            ready=lambda: self.ready, read_node=rooms.api.read_node,
            set_ready=lambda ok: self._set_ready(ok, WAITING_RUNTIME)), "runtime-link")
        if rooms.restarted:
            try:
                await asyncio.wait_for(runtime.settled.wait(), FIRST_POLL_ALONE)
            except asyncio.TimeoutError:
                pass

    def _start_periodic(self, rooms: Rooms) -> None:
        self.tasks.spawn(self._expire(rooms.model), "expire")
        self.tasks.spawn(self._heartbeat(rooms.manager), "heartbeat")
        self.tasks.spawn(rooms.health.run(), "health")
        self.tasks.spawn(self._publish(rooms), "publish")

    async def _install_rule(self) -> None:
        """Step 4, on a thread; put back if something deletes it (--iptables-check-interval)."""
        keeper = RuleKeeper(self.config)
        await asyncio.get_running_loop().run_in_executor(None, keeper.install)
        if self.config.iptables_check_interval > 0:
            self.tasks.spawn(keeper.run(), "iptables")

    def _start_container(self, rooms: Rooms) -> None:
        assert rooms.container is not None
        self.tasks.spawn(rooms.container.run(), "container-credentials")

    async def _become_ready(self, rooms: Rooms) -> None:
        """Step 5: ready, then the startup taint removed and kept removed."""
        health, manager, runtime = rooms.health, rooms.manager, rooms.runtime
        await rooms.api.synced()
        milestones.mark("pods listed")
        health.wait_for(WAITING_RUNTIME if runtime.enabled else WAITING_CREDENTIALS)
        if runtime.enabled:
            try:
                await asyncio.wait_for(runtime.settled.wait(),
                                       self.config.ready_prefetch_timeout)
            except asyncio.TimeoutError:
                log.warning("the container runtime has not answered yet; ready anyway "
                            "(requests wait for its first answer)")
        health.wait_for(WAITING_CREDENTIALS)
        manager.reclaim()
        deadline = time.monotonic() + self.config.ready_prefetch_timeout
        while time.monotonic() < deadline and manager.stats().get("keys_pending", 0):
            await asyncio.sleep(0.01)
        milestones.mark("all roles fetched" if not manager.stats().get("keys_pending", 0)
                        else "prefetch timed out")
        self.ready = True
        self._set_ready(True)
        self.notify()
        milestones.mark("ready")
        log.info("ready", extra={"credential_keys": manager.stats().get("keys_ready")})
        await rooms.api.keep_taint_removed()

    # ---- the stop -------------------------------------------------------------------------------

    async def _rules_to_remove(self, rooms: Rooms) -> bool:
        """Whether the DNAT rule goes with this process: asked while the API link still
        runs (an uninstall is read from the agent's own DaemonSet)."""
        if not self.config.iptables:
            return False
        if self.config.iptables_remove_on_exit:
            return True
        uninstalling = await rooms.api.uninstalling()    # (no answer: False, logged)
        if uninstalling:
            log.info("this agent's DaemonSet is deleted: an uninstall; removing the rules")
        return uninstalling

    def _remove_rule(self) -> None:
        if not self._remove_rules:
            return
        try:
            runner.remove_rules(self.config)
        except runner.IptablesError as e:
            log.error("could not remove the DNAT rule: %s", e)

    # ---- waking the workers, their messages ----------------------------------------------------

    def notify(self) -> None:
        """Coalesce table commits of one loop iteration into one wake per worker."""
        if not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake_workers)

    def _wake_workers(self) -> None:
        self._wake_scheduled = False
        message = channel.wake(self.table.generation)
        for sock in self.channels:
            channel.send(sock, message)
        if self.rooms is not None and self.rooms.container is not None:
            self.rooms.container.changed()

    @staticmethod
    def _on_channel(rooms: Rooms, sock: socket.socket) -> None:
        for raw in channel.drain(sock):
            msg = channel.parse(raw)
            if msg is None:
                continue
            kind, value = msg
            if kind == channel.NEED_RUNTIME:
                rooms.runtime.need(value)          # the asking connection's accept time
            elif kind == channel.WANT_CREDENTIALS:
                rooms.manager.wanted(value)

    def _commit(self) -> None:
        assert self.rooms is not None
        self.rooms.model.commit()

    def _health_changed(self) -> None:
        if self.rooms is not None:
            self.rooms.health.publish()

    def _set_ready(self, ok: bool, waiting: str = "") -> None:
        """/readyz's word and what /healthz says it waits for: never 200 beside "waiting"."""
        assert self.rooms is not None
        if ok:
            self.rooms.health.wait_for("")
        self.table.set_status(ready=ok)
        if not ok:
            self.rooms.health.wait_for(waiting)

    # ---- what the table held, what the listeners hold --------------------------------------------

    def _credential_slots(self) -> list[tuple[int, int, float, list[bytes]]]:
        out = []
        for slot in range(self.table.layout["cred_capacity"]):
            try:
                out.append((slot, *self.table.read_cred(slot)))
            except tbl.TableError:     # unreadable: held until no address names it
                out.append((slot, tbl.CRED_PENDING, 0.0, []))
        return out

    def _token_only(self):
        """Pods that ask this agent's container-credentials listener by token: the metadata
        path refuses them (container_credentials/token_only.py).  Read from the sockets
        held, not the flag: a listed address the supervisor could not listen on (IPv6
        disabled) serves nobody, so a pod sent there keeps the metadata path."""
        return token_only.predicate([sock.getsockname()[:2] for sock in self.container_socks])

    # ---- periodic work --------------------------------------------------------------------------

    @staticmethod
    async def _expire(model: NodeModel) -> None:
        """Namespace graces and failed credential acquires, every second."""
        while True:
            await asyncio.sleep(1.0)
            model.expire()
            model.commit()

    async def _heartbeat(self, manager: CredentialManager) -> None:
        while True:
            writer_lock.check_sole_writer(self.table)
            self.table.heartbeat()
            manager.reclaim()     # slots a restart held, once no address names them
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def _publish(self, rooms: Rooms) -> None:
        """Metrics text, denials and /debug/store for the workers to serve: each room's
        series (``metric_lines``), the credential manager's first."""
        from kiamfast.cli import build_info
        commit, built = build_info()
        while True:
            rooms.cpu_wait.poll()
            lines = agent_lines(healthy=rooms.health.healthy, ready=self.ready,
                                publish_failures=rooms.aux.failures, version=__version__,
                                commit=commit, built=built)
            lines += rooms.runtime.metric_lines() + rooms.api.metric_lines()
            if rooms.container is not None:
                lines += rooms.container.metric_lines()
            own = metrics_text.render(lines + rooms.cpu_wait.metric_lines())
            rooms.aux.metrics(metrics_text.render(rooms.manager.metrics.metric_lines()) + own,
                              own)
            rooms.aux.denials(report.denials(rooms.model))
            if self.config.debug:
                rooms.aux.debug_store(report.debug_store(rooms.model))
            await asyncio.sleep(PUBLISH_INTERVAL)
