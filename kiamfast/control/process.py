"""The control process: the table's only writer, and the owner of every slow thing.

Data flows one way — sources (the API server: ``k8s/``; the container runtime: ``cri/``) →
mappings (who owns each address, each pod's decision: ``mappings/``) → credentials (STS:
``iam/``) → publish (the table's entries, status words and aux blobs: ``publish/``) — and
this module wires them, in one start sequence written as the list it is, each step timed
(``start: <step> after <s>``):

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
from typing import Any

from kiamfast import __version__, channel, metrics_text, milestones
from kiamfast.cpu_wait import CpuWait
from kiamfast import table as tbl
from kiamfast.config import Config
from kiamfast.control import imds_client, writer_lock
from kiamfast.iptables import runner
from kiamfast.iptables.keeper import RuleKeeper
from kiamfast.control.health import WAITING_CREDENTIALS, WAITING_RUNTIME, Health
from kiamfast.control.cri import kept_sandboxes as known_sandboxes
from kiamfast.control.cri.source import RuntimeSource
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.control.mappings import report
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.publish import metrics as control_metrics
from kiamfast.control.publish.blobs import AuxPublisher

log = logging.getLogger("kiamfast.control")

PUBLISH_INTERVAL = 2.0
HEARTBEAT_INTERVAL = 1.0
NODE_COUNT_INTERVAL = 60.0      # --sts-account-qps without --sts-fleet-nodes (jittered)
FIRST_POLL_ALONE = 1.0          # a restart: at most this long before the API and STS start


class ControlTaskFailed(Exception):
    """A task that must run for the life of the control process ended."""


class ControlProcess:
    def __init__(self, config: Config, table: tbl.Table, channels: list[socket.socket],
                 container_socks: list[socket.socket] | None = None, *,
                 sts: Any, api_config: Any) -> None:
        self.config = config
        self.sts = sts                         # iam.sts.StsClient, its build not begun
        self.api_config = api_config           # kube.config: checked by start.py
        self.table = table
        self.channels = channels
        self.container_socks = container_socks or []   # --container-credentials-addr, bound
        self.container: Any = None
        self.uninjected: Any = None
        self.api: Any = None                   # kiamfast.kube.client.Client
        self.source: Any = None                # k8s.source.ApiSource
        self.taint: Any = None                 # k8s.node.StartupTaint
        self.uninstall: Any = None             # k8s.uninstall.UninstallWatch
        self.aux = AuxPublisher(table)
        self.ready = False
        self.health = Health(metadata_addr=config.metadata_addr, host_ip=config.host_ip,
                             aux=self.aux)
        self._wake_scheduled = False
        self._stop = asyncio.Event()
        self.cpu_wait = CpuWait(supervisor_pid=os.getppid())   # the agent's own processes

    # ---- waking the workers ---------------------------------------------------------------------

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
        if self.container is not None:
            self.container.changed()

    def _on_channel(self, sock: socket.socket) -> None:
        for raw in channel.drain(sock):
            msg = channel.parse(raw)
            if msg is None:
                continue
            kind, value = msg
            if kind == channel.NEED_RUNTIME:
                self.runtime.need(value)          # the asking connection's accept time
            elif kind == channel.WANT_CREDENTIALS:
                self.manager.wanted(value)

    # ---- the start sequence ---------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        for sock in self.channels:
            loop.add_reader(sock.fileno(), self._on_channel, sock)
        self.table.set_status(ready=False, synced=False)
        if self.config.auto_discover_base_arn or self.config.auto_discover_default_role:
            self.config = await loop.run_in_executor(None, imds_client.discover_roles,
                                                     self.config)
        restarted = self._adopt()                               # 1.
        if not restarted:
            self.sts.prepare()
        tasks = [asyncio.create_task(self.manager.run(), name="credentials")]
        if self.runtime.poller is not None:                    # 2.
            self.runtime.start_netns(loop)
            tasks.append(asyncio.create_task(self.runtime.poller.run(), name="runtime"))
            if restarted:
                await self._first_poll_alone()
        self.sts.prepare()
        self._connect_api()                                     # 3.
        tasks.append(asyncio.create_task(self.source.run(), name="api-watch"))
        tasks += [asyncio.create_task(self._expire(), name="expire"),
                  asyncio.create_task(self._heartbeat(), name="heartbeat"),
                  asyncio.create_task(self.health.run(), name="health"),
                  asyncio.create_task(self._publish(), name="publish")]
        if self.config.iptables:                                # 4.
            rules = RuleKeeper(self.config)
            await loop.run_in_executor(None, rules.install)
            milestones.mark("DNAT rule installed")
            if self.config.iptables_check_interval > 0:   # put back if something deletes it
                tasks.append(asyncio.create_task(rules.run(), name="iptables"))
        tasks += self._optional_tasks()
        starting = asyncio.create_task(self._become_ready(), name="ready")   # 5.
        starting.add_done_callback(self._log_failure)
        stop = asyncio.create_task(self._stop.wait())
        # Every task runs for the life of the process: one that ends is a failure, and the
        # supervisor restarts the whole control process (the table keeps serving meanwhile).
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if t is not stop]
        for task in failed:
            self._log_failure(task)
        await self.shutdown([starting, *tasks])
        if failed:
            raise ControlTaskFailed(", ".join(t.get_name() for t in failed))

    def _adopt(self) -> bool:
        """Step 1: the credentials and addresses a previous control process left (a restart
        of this one, or of the whole agent with the same table).  True if a runtime is to
        confirm adopted owners."""
        refs: Counter = Counter()     # addresses naming each credential slot (the model counts)
        self.manager = CredentialManager.from_config(self.config, table=self.table,
                                                     sts=self.sts, notify=self.notify,
                                                     slot_refs=refs)
        self.manager.adopt(self._credential_slots())
        if self.config.kubelet_url or "kubelet-insecure" in self.config.explicit:
            log.warning("--kubelet-url and --kubelet-insecure have no effect any more: the "
                        "container runtime (--cri-endpoint) knows a pod's address first")
        self.runtime = RuntimeSource(endpoint=self.config.cri_endpoint, model=None,
                                     commit=self._commit, on_change=self.health.publish,
                                     table_runtime_mode=self.table.runtime_mode,
                                     known_file=known_sandboxes.path_for(self.table.path),
                                     address_proof=self.config.address_proof)
        self.health.runtime = self.runtime
        if self.table.runtime_mode and not self.runtime.expected:
            # Addresses a runtime decided, kept for its poll to confirm: none will come now
            # (--cri-endpoint=none), and workers would serve them as they are.
            for slot in self.table.snapshot():
                self.table.release_ip(slot["ip"], slot["pod_uid"])
        adopted = {ip["ip"]: (ip["pod_uid"], ip["pod_state"], ip["cred_slot"])
                   for ip in self.table.snapshot()}
        self.model = NodeModel(
            policy=RolePolicy.from_config(self.config), table=self.table, sink=self.manager,
            notify=self.notify, slot_refs=refs, token_only=self._token_only(),
            adopted=adopted, expect_runtime=self.runtime.expected, proof=self.runtime.netns)
        self.runtime.model = self.model
        # Until the runtime's first answer, a request from a connection newer than the last
        # applied poll waits for one, never for the API's guess.
        self.table.set_status(runtime_mode=self.model.runtime_mode)
        milestones.mark("credentials adopted")
        return self.runtime.expected and bool(adopted)

    async def _first_poll_alone(self) -> None:
        """Step 2 of a restart: the runtime's first answer before anything else imports or
        runs (bounded: an outage is the fallback's to answer, and the API's list may help)."""
        try:
            await asyncio.wait_for(self.runtime.settled.wait(), FIRST_POLL_ALONE)
        except asyncio.TimeoutError:
            pass

    def _connect_api(self) -> None:
        """Step 3: the API client (its configuration checked now: ConfigError ends the
        process with one line) and the node's pods."""
        from kiamfast.control.k8s.node import StartupTaint
        from kiamfast.control.k8s.source import ApiSource
        from kiamfast.kube.client import Client
        cfg = self.config
        self.api = Client(self.api_config)
        self.source = ApiSource(client=self.api, model=self.model, node=cfg.node or None,
                                watch_namespaces=self.model.policy.uses_namespaces)
        self.source.timings.resync = cfg.cache_resync_period
        self.source.on_error = self._api_failing
        self.taint = self.health.taint = StartupTaint(cfg.node, cfg.node_startup_taint)
        self.taint.on_change = self.health.publish
        if self.container_socks:
            self.uninjected = self._uninjected_pods()

    def _optional_tasks(self) -> list[asyncio.Task]:
        tasks = []
        if self.container_socks:
            from kiamfast.container_credentials import server as container
            self.container = self.health.container = container.from_config(
                self.config, self.container_socks, model=self.model, manager=self.manager,
                table=self.table, client=self.api)
            tasks.append(asyncio.create_task(self.container.run(),
                                             name="container-credentials"))
        if self.config.sts_account_qps > 0 and self.config.sts_fleet_nodes == 0:
            from kiamfast.control.k8s.node import follow_node_count
            tasks.append(asyncio.create_task(follow_node_count(
                self.api, self.manager, interval=NODE_COUNT_INTERVAL), name="node-count"))
        if self.config.iptables and self.config.iptables_remove_on_uninstall:
            from kiamfast.control.k8s.uninstall import UninstallWatch
            self.uninstall = UninstallWatch(self.api, pod=self.config.pod_name,
                                            namespace=self.config.pod_namespace)
            tasks.append(asyncio.create_task(self.uninstall.run(), name="uninstall-watch"))
        if self.runtime.poller is not None:
            tasks.append(asyncio.create_task(self.runtime.watch_link(
                ready=lambda: self.ready, read_node=self._read_node,
                set_ready=lambda ok: self._set_ready(ok, WAITING_RUNTIME)), name="runtime-link"))
        return tasks

    async def _become_ready(self) -> None:
        await self.source.synced.wait()
        milestones.mark("pods listed")
        if self.health.kubernetes == "connecting":
            self.health.kubernetes = "ok"
        self.health.wait_for(WAITING_RUNTIME if self.runtime.poller is not None
                             else WAITING_CREDENTIALS)
        if self.runtime.poller is not None:
            try:
                await asyncio.wait_for(self.runtime.settled.wait(),
                                       self.config.ready_prefetch_timeout)
            except asyncio.TimeoutError:
                log.warning("the container runtime has not answered yet; ready anyway "
                            "(requests wait for its first answer)")
        self.health.wait_for(WAITING_CREDENTIALS)
        self.manager.reclaim()
        deadline = time.monotonic() + self.config.ready_prefetch_timeout
        while time.monotonic() < deadline and self.manager.stats().get("keys_pending", 0):
            await asyncio.sleep(0.01)
        milestones.mark("all roles fetched" if not self.manager.stats().get("keys_pending", 0)
                        else "prefetch timed out")
        self.ready = True
        self._set_ready(True)
        self.notify()
        milestones.mark("ready")
        log.info("ready", extra={"credential_keys": self.manager.stats().get("keys_ready")})
        self.taint.on_change = self._taint_changed
        await self.taint.run(self.api)       # removes it, then keeps it removed

    def _taint_changed(self) -> None:
        milestones.mark(f"taint {self.taint.state}")
        self.health.publish()

    @staticmethod
    def _log_failure(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("control task %s failed", task.get_name(), exc_info=task.exception())
        elif task.get_name() != "ready":
            log.error("control task %s ended", task.get_name())

    def _credential_slots(self) -> list[tuple[int, int, float, list[bytes]]]:
        out = []
        for slot in range(self.table.layout["cred_capacity"]):
            try:
                out.append((slot, *self.table.read_cred(slot)))
            except tbl.TableError:     # unreadable: held until no address names it
                out.append((slot, tbl.CRED_PENDING, 0.0, []))
        return out

    def _token_only(self) -> Any:
        """Pods that ask this agent's container-credentials listener by token: the metadata
        path refuses them (container_credentials/token_only.py).  Read from the sockets
        held, not the flag: a listed address the supervisor could not listen on (IPv6
        disabled) serves nobody, so a pod sent there keeps the metadata path."""
        from kiamfast.container_credentials.token_only import predicate
        return predicate([sock.getsockname()[:2] for sock in self.container_socks])

    def _uninjected_pods(self) -> Any:
        """An Event on each pod of the node that asked for injection and was created without
        it (container_credentials/uninjected.py), posted on a thread."""
        from kiamfast.container_credentials.uninjected import UninjectedPods
        loop = asyncio.get_running_loop()
        reporter = UninjectedPods(
            role_key=self.config.iam_role_key, node=self.config.node,
            create_event=lambda body: self.api.request_sync(
                "POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events",
                body=body, timeout=10),
            run_in_thread=lambda post: loop.run_in_executor(None, post))
        self.source.on_pod = reporter.seen
        return reporter

    def _commit(self) -> None:
        self.model.commit()

    # ---- periodic work --------------------------------------------------------------------------

    async def _expire(self) -> None:
        """Namespace graces and failed credential acquires, every second."""
        while True:
            await asyncio.sleep(1.0)
            self.model.expire()
            self.model.commit()

    async def _heartbeat(self) -> None:
        while True:
            writer_lock.check_sole_writer(self.table)
            self.table.heartbeat()
            self.manager.reclaim()     # slots a restart held, once no address names them
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    def _api_failing(self, error: str) -> None:
        """The API source's state changed (its error, or "" once it answers again)."""
        self.health.kubernetes = f"unreachable: {error}" if error else "ok"
        self.health.publish()

    def _set_ready(self, ok: bool, waiting: str = "") -> None:
        """/readyz's word and what /healthz says it waits for: never 200 beside "waiting"."""
        if ok:
            self.health.wait_for("")
        self.table.set_status(ready=ok)
        if not ok:
            self.health.wait_for(waiting)

    async def _publish(self) -> None:
        """Metrics text, denials and /debug/store for the workers to serve."""
        while True:
            self.cpu_wait.poll()
            own = metrics_text.render(control_metrics.render(self._state())
                                      + self.cpu_wait.lines())
            self.aux.metrics(metrics_text.render(self.manager.metrics.lines()) + own, own)
            self.aux.denials(report.denials(self.model))
            if self.config.debug:
                self.aux.debug_store(report.debug_store(self.model))
            await asyncio.sleep(PUBLISH_INTERVAL)

    def _state(self) -> control_metrics.ControlState:
        from kiamfast.cli import build_info
        commit, built = build_info()
        return control_metrics.ControlState(
            healthy=self.health.healthy, ready=self.ready, runtime_up=self.runtime.state == "ok",
            publish_failures=self.aux.failures, version=__version__, commit=commit,
            built=built, pods=len(self.model.pods), pending_pods=self.model.pending_pods,
            watch={**self.source.stats(), **report.counters(self.model)},
            runtime=self.runtime.counters() if self.runtime.poller is not None else None,
            unproven=(len(self.model.runtime.claims) if self.runtime.poller is not None
                      else None),
            container_lines=self.container.metrics() if self.container is not None else [],
            uninjected=self.uninjected.reported if self.uninjected is not None else None)

    async def _read_node(self) -> dict[str, Any] | None:
        """This node as the API shows it, or None (no --node, or the API cannot answer:
        then nothing proves the runtime link dead)."""
        from kiamfast.control.k8s.node import read_node
        if not self.config.node:
            return None
        try:
            return await read_node(self.api, self.config.node)
        except Exception as exc:  # noqa: BLE001 - any failure: no evidence
            log.debug("cannot read node %s: %s", self.config.node, exc)
            return None

    # ---- stop -----------------------------------------------------------------------------------

    async def shutdown(self, tasks: list[asyncio.Task]) -> None:
        remove = self.config.iptables and self.config.iptables_remove_on_exit
        if self.uninstall is not None and not remove and await self.uninstall.uninstalling():
            log.info("this agent's DaemonSet is deleted: an uninstall; removing the rules")
            remove = True        # decided while its watch runs; removed once nothing keeps them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.runtime.close()
        self.manager.close()
        self.sts.close()
        if self.container is not None:
            self.container.close()
        if self.api is not None:
            await self.api.close()
        if remove:
            try:
                runner.remove_rules(self.config)
            except runner.IptablesError as e:
                log.error("could not remove the DNAT rule: %s", e)
        log.info("control process stopped")
