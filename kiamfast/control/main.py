"""The control process: the only writer of the table, and the owner of every slow thing.

Node start, in order (docs/architecture.md): the workers already listen (the supervisor
started them first) → install the DNAT rule → start the pod + namespace watch and the
credential manager → synced → bounded prefetch → ready → remove the node's startup taint.
Until ready, workers hold requests for unknown pods (bounded) and then answer 503: a pod
never gets another identity, and never the node's role.

With a container runtime (--cri-endpoint), the runtime poller tells the ownership model
which sandbox holds each address; a worker whose caller connected after the last applied
poll asks for a new one.  The control process also answers "credentials wanted" (fetch
now), publishes the aux blobs workers serve (/metrics text, /debug/store, /healthz) and
heartbeats the table.  Nothing from outside (API server, STS, metadata service, runtime)
can end it: every task logs and retries what fails.  On SIGTERM it leaves the DNAT rule in place unless
--iptables-remove-on-exit: a pod without its agent gets a refused connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
import prometheus_client

from kiamfast import __version__, channel, logs
from kiamfast import table as tbl
from kiamfast.cli import build_info
from kiamfast.config import Config, container_credentials_addrs
from kiamfast.control import iptables, imds_client, runtime, runtime_link, taint, writer_lock
from kiamfast.control.credentials import CredentialManager
from kiamfast.control.ownership import Ownership
from kiamfast.control.pods import PodWatcher
from kiamfast.control.roles import RolePolicy
from kiamfast.control.sts import StsClient

log = logging.getLogger("kiamfast.control")

HEALTH_INTERVAL = 30.0
PUBLISH_INTERVAL = 2.0
HEARTBEAT_INTERVAL = 1.0
LINK_CHECK_INTERVAL = 5.0
NODE_COUNT_INTERVAL = 60.0   # --sts-account-qps without --sts-fleet-nodes (jittered)
# /readyz answers 503 once the runtime has been unreachable this long (a restart of
# containerd takes a few seconds; a lasting outage must show in `kubectl get ds`).
RUNTIME_UNREADY_AFTER = 15.0


class ControlTaskFailed(Exception):
    """A task that must run for the life of the control process ended."""


class ControlProcess:
    def __init__(self, config: Config, table: tbl.Table, channels: list[socket.socket],
                 container_socks: list[socket.socket] | None = None):
        self.config = config
        self.container_socks = container_socks or []   # --container-credentials-addr, bound
        self.container: Any = None
        self.table = table
        self.channels = channels
        prometheus_client.disable_created_metrics()   # no *_created series: kube2iam has none
        self.registry = prometheus_client.CollectorRegistry()
        self._wake_scheduled = False
        self._stop = asyncio.Event()
        self.watcher = None
        self.manager: CredentialManager | None = None
        self.poller: runtime.RuntimePoller | None = None
        self.runtime_state = "disabled"       # for /healthz: disabled | ok | unreachable: ...
        # Whether addresses follow the runtime: an endpoint was given or found, or the table
        # a previous control process left was decided by one (never drop its freshness
        # checks because an 'auto' socket is briefly absent).
        self.runtime_expected = False
        self.link = runtime_link.LinkMonitor()
        self.runtime_settled = asyncio.Event()  # the runtime answered, or failed, once
        self.taint_removal = taint.TaintRemoval(config.node, config.node_startup_taint)
        self.ready = False
        self.healthy = False
        self.instance_id = ""
        self.health_error = "no health check yet"
        self.publish_failures = 0

    # ---- waking the workers ------------------------------------------------------------------

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
            if kind == channel.NEED_RUNTIME and self.poller is not None:
                self.poller.need(value)          # the asking connection's accept time
            elif kind == channel.WANT_CREDENTIALS and self.manager is not None:
                self.manager.wanted(value)

    # ---- start-up ----------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        for sock in self.channels:
            loop.add_reader(sock.fileno(), self._on_channel, sock)
        self.table.set_status(ready=False, synced=False)
        if self.config.auto_discover_base_arn or self.config.auto_discover_default_role:
            self.config = await loop.run_in_executor(None, discover_roles, self.config)
        rules = None
        if self.config.iptables:
            rules = iptables.RuleKeeper(self.config)
            await loop.run_in_executor(None, rules.install)
        self.sts = StsClient.from_config(self.config)
        self.manager = CredentialManager.from_config(
            self.config, table=self.table, sts=self.sts, notify=self.notify,
            registry=self.registry, slot_in_use=lambda slot: self.model.slot_in_use(slot))
        # A restarted control process starts from what the table holds: the addresses keep
        # their slots and servable credentials stay served until the model has decided
        # again (ownership.py, "Restarts").
        self.manager.adopt(self._credential_slots())
        self.poller = self._runtime_poller()
        self.model = Ownership(policy=RolePolicy.from_config(self.config), table=self.table,
                               sink=self.manager, notify=self.notify,
                               adopted={ip["ip"]: (ip["pod_uid"], ip["pod_state"],
                                                   ip["cred_slot"])
                                        for ip in self.table.snapshot()},
                               expect_runtime=self.runtime_expected,
                               token_only=self._token_only())
        # Until the runtime's first answer, a request from a connection newer than the last
        # applied poll waits for one, never for the API's guess.
        self.table.set_status(runtime_mode=self.model.runtime_mode)
        self.watcher = PodWatcher.from_config(self.config, model=self.model)
        tasks = [
            asyncio.create_task(self.manager.run(), name="credentials"),
            asyncio.create_task(self.watcher.run(), name="pod-watch"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._health(), name="health"),
            asyncio.create_task(self._publish(), name="publish"),
        ]
        if self.container_socks:
            from kiamfast.container_credentials import server as container
            self.container = container.from_config(self.config, self.container_socks,
                                                   model=self.model, manager=self.manager,
                                                   table=self.table)
            tasks.append(asyncio.create_task(self.container.run(),
                                             name="container-credentials"))
        if self.config.sts_account_qps > 0 and self.config.sts_fleet_nodes == 0:
            from kubernetes import client as kclient
            tasks.append(asyncio.create_task(follow_node_count(
                kclient.CoreV1Api(self.watcher.api_client), self.manager), name="node-count"))
        if rules is not None and self.config.iptables_check_interval > 0:
            tasks.append(asyncio.create_task(rules.run(), name="iptables"))
        if self.poller is not None:
            tasks.append(asyncio.create_task(self.poller.run(), name="runtime"))
            tasks.append(asyncio.create_task(self._watch_runtime_link(), name="runtime-link"))
        starting = asyncio.create_task(self._become_ready(), name="ready")
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

    # ---- the container runtime -----------------------------------------------------------

    def _token_only(self) -> Callable[[Mapping[str, Any]], bool]:
        """Pods that ask this agent's container-credentials listener by token: the metadata
        path refuses them (container_credentials/token_only.py)."""
        from kiamfast.container_credentials.token_only import predicate
        addr = self.config.container_credentials_addr
        return predicate(container_credentials_addrs(addr) if addr else ())

    def _runtime_poller(self) -> runtime.RuntimePoller | None:
        if self.config.kubelet_url or "kubelet-insecure" in self.config.explicit:
            log.warning("--kubelet-url and --kubelet-insecure have no effect any more: the "
                        "container runtime (--cri-endpoint) knows a pod's address first")
        self.runtime_expected = self.table.runtime_mode   # a previous process's, if any
        if self.config.cri_endpoint.strip() == "auto":
            client: Any = runtime_link.AutoEndpointClient()
            if runtime.resolve_endpoint("auto") is not None:
                self.runtime_expected = True
            elif not self.runtime_expected:
                log.info("no container runtime socket yet (--cri-endpoint=auto): addresses "
                         "follow the API server until one appears")
        else:
            endpoint = runtime.resolve_endpoint(self.config.cri_endpoint)
            if endpoint is None:
                log.info("no container runtime endpoint (--cri-endpoint=%s): addresses "
                         "follow the API server", self.config.cri_endpoint or '""')
                self.runtime_expected = False   # the operator turned it off: no poll comes
                return None
            client = runtime.RuntimeClient(endpoint)
            self.runtime_expected = True
        self.runtime_state = "connecting"
        # backoff_max: a local socket costs nothing to retry, and an 'auto' socket that
        # appears late should be found within seconds.
        return runtime.RuntimePoller(client, on_view=self._on_view,
                                     on_state=self._on_runtime_state,
                                     on_failure=self._on_runtime_failure, backoff_max=5.0)

    def _on_view(self, view: runtime.RuntimeView) -> None:
        self.runtime_expected = True
        self.model.apply_runtime(view)
        self.model.commit()
        self.runtime_settled.set()

    def _on_runtime_failure(self, started_ns: int) -> None:
        if self.runtime_expected:     # else: an 'auto' socket not found yet (API mode)
            self.model.runtime_failed(started_ns)
            self.model.commit()
        self.runtime_settled.set()

    def _on_runtime_state(self, reachable: bool, message: str) -> None:
        if reachable:
            self.runtime_state = "ok"
        elif self.runtime_expected:
            self.runtime_state = f"unreachable: {message}"
        else:
            self.runtime_state = f"none found: {message}"
        self.link.state(reachable or not self.runtime_expected)
        if self.instance_id:
            self._publish_health()
        self.runtime_settled.set()

    async def _watch_runtime_link(self) -> None:
        """Make a lasting runtime outage visible: /readyz 503 after RUNTIME_UNREADY_AFTER;
        /healthz 500 (the liveness probe restarts the container) only when the agent's own
        link is dead: its socket path is there but refuses, while the kubelet reaches the
        runtime (runtime_link.LinkMonitor).  A socket path that is not there at all is not
        cured by a restart, so it never fails the liveness probe."""
        while True:
            await asyncio.sleep(LINK_CHECK_INTERVAL)
            outage = self.link.outage_seconds()
            self._runtime_readiness(unready=outage >= RUNTIME_UNREADY_AFTER, outage=outage)
            was = self.link.broken
            endpoint = self.poller.client.endpoint
            if outage >= self.link.grace and os.path.exists(endpoint.removeprefix("unix://")):
                node = await self._read_node()
                if node is not None:
                    self.link.judge(node, endpoint, self.poller.last_error)
            else:
                self.link.broken = ""
            if self.link.broken != was:
                if self.link.broken:
                    log.error("%s", self.link.broken)
                self._publish_health()

    def _runtime_readiness(self, *, unready: bool, outage: float) -> None:
        """/readyz follows the runtime once the agent is ready (before that it is 503)."""
        if not self.ready or unready != self.table.ready:
            return
        if unready:
            log.warning("container runtime unreachable for %.0fs: /readyz 503", outage)
        else:
            log.info("container runtime reachable again: /readyz 200")
        self.table.set_status(ready=not unready)

    async def _read_node(self) -> dict[str, Any] | None:
        """This node as the API shows it, or None (no --node, or the API cannot answer:
        then nothing proves the link dead)."""
        if not self.config.node or self.watcher is None:
            return None
        from kubernetes import client as kclient
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, taint.read_node, kclient.CoreV1Api(self.watcher.api_client),
                self.config.node, 10.0)
        except Exception as exc:
            log.debug("cannot read node %s: %s", self.config.node, exc)
            return None

    async def _become_ready(self) -> None:
        await self.watcher.wait_synced()
        if self.poller is not None:
            try:
                await asyncio.wait_for(self.runtime_settled.wait(),
                                       self.config.ready_prefetch_timeout)
            except asyncio.TimeoutError:
                log.warning("the container runtime has not answered yet; ready anyway "
                            "(requests wait for its first answer)")
        self.manager.reclaim()
        log.info("pods of node %s synced", self.config.node or "(all nodes)")
        deadline = time.monotonic() + self.config.ready_prefetch_timeout
        while time.monotonic() < deadline and not self._prefetched():
            await asyncio.sleep(0.05)
        self.ready = True
        self.table.set_status(ready=True)
        self.notify()
        log.info("ready", extra={"credential_keys": self.manager.stats().get("keys_ready")})
        await self._remove_taint()

    def _prefetched(self) -> bool:
        stats = self.manager.stats()
        return stats.get("keys_pending", 0) == 0

    async def _remove_taint(self) -> None:
        """Retried until the taint is gone (its state is in /healthz): a node whose agent
        is ready must not stay closed to pods because one PATCH failed."""
        from kubernetes import client as kclient
        await self.taint_removal.remove_until_done(kclient.CoreV1Api(self.watcher.api_client))
        if self.instance_id:
            self._publish_health()

    # ---- periodic work -----------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            writer_lock.check_sole_writer(self.table)
            self.table.heartbeat()
            self.manager.reclaim()     # slots a restart held, once no address names them
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def _health(self) -> None:
        """kube2iam's health check: the instance ID read from the metadata service."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.instance_id = await loop.run_in_executor(None, imds_client.instance_id,
                                                              self.config.metadata_addr)
                self.health_error = ""
            except imds_client.ImdsError as e:
                self.instance_id, self.health_error = "", str(e)
            self._publish_health()
            await asyncio.sleep(HEALTH_INTERVAL)

    def _publish_health(self) -> None:
        """kube2iam's /healthz body, plus where addresses come from (the runtime's state) and
        the startup taint's removal."""
        self.healthy = bool(self.instance_id) and not self.link.broken
        if self.healthy:
            health = {"hostIP": self.config.host_ip, "instanceId": self.instance_id,
                      "runtime": self.runtime_state, "taint": self.taint_removal.state}
            if self.container is not None:
                health["containerCredentials"] = self.container.health()
            body = orjson.dumps(health)
            self.table.write_aux(tbl.AUX_HEALTH, body + b"\n")
            self.table.write_aux(tbl.AUX_HEALTH_ERROR, b"")
        else:
            error = self.link.broken or self.health_error
            self.table.write_aux(tbl.AUX_HEALTH, b"")
            self.table.write_aux(tbl.AUX_HEALTH_ERROR, error.encode()[:4096])

    async def _publish(self) -> None:
        """Metrics text and /debug/store JSON for the workers to serve.  What pods write
        (roles, annotations) sizes these texts: a text that does not fit is logged and
        counted, and the smaller form is published; it never ends the process."""
        while True:
            text = prometheus_client.generate_latest(self.registry) + self._own_metrics()
            if not self._write_aux(tbl.AUX_METRICS, text, "metrics"):
                self._write_aux(tbl.AUX_METRICS, self._own_metrics(), "metrics")
            if self.table.layout["aux_count"] > tbl.AUX_DENIALS:
                if not self._write_aux(tbl.AUX_DENIALS, orjson.dumps(self.model.denials()),
                                       "denials"):
                    self._write_aux(tbl.AUX_DENIALS, b"{}", "")
            if self.config.debug and self.watcher is not None:
                store = orjson.dumps(self.model.debug_store(), option=orjson.OPT_SORT_KEYS)
                if not self._write_aux(tbl.AUX_DEBUG_STORE, store, "/debug/store"):
                    self._write_aux(tbl.AUX_DEBUG_STORE, b'{"error":"too large"}', "")
            await asyncio.sleep(PUBLISH_INTERVAL)

    def _write_aux(self, index: int, data: bytes, what: str) -> bool:
        try:
            self.table.write_aux(index, data)
            return True
        except tbl.ValueTooLarge:
            self.publish_failures += 1
            if what and (self.publish_failures in (1, 10, 100)
                         or self.publish_failures % 1000 == 0):
                log.error("%s text of %d bytes does not fit its %d-byte slot; publishing a "
                          "shorter one (%d times so far)", what, len(data),
                          self.table.layout["aux_size"], self.publish_failures)
            return False

    def _own_metrics(self) -> bytes:
        """The control process's gauges and the watch's counters, in Prometheus text."""
        commit, built = build_info()
        lines = [
            "# HELP kube2iam_healthcheck_status The healthcheck status at scrape time. A value "
            "of 1 means it is passing, 0 means it is failing.",
            "# TYPE kube2iam_healthcheck_status gauge",
            f"kube2iam_healthcheck_status {1 if self.healthy else 0}",
            "# HELP kube2iam_info Informational labels about the kube2iam process.",
            "# TYPE kube2iam_info gauge",
            f'kube2iam_info{{version="{__version__}",build_date="{built}",'
            f'commit_hash="{commit}"}} 1',
            # kube2iam's duplicate-IP API lookups (--resolve-duplicate-cache-ips): kiamfast
            # never asks the API which of two pods holds an address (the runtime, or the
            # order of the API's own writes, decides), so these stay 0.
            "# HELP kube2iam_iam_k8s_dup_req_count Total number of K8s API requests performed "
            "when duplicated pods are identified in the cache (kiamfast makes none: 0).",
            "# TYPE kube2iam_iam_k8s_dup_req_count counter",
            "kube2iam_iam_k8s_dup_req_count 0",
            "# HELP kube2iam_iam_k8s_dup_req_success_count Total number of times we "
            "successfully retrieve the pod from the K8s API (kiamfast makes no such request: 0).",
            "# TYPE kube2iam_iam_k8s_dup_req_success_count counter",
            "kube2iam_iam_k8s_dup_req_success_count 0",
            "# HELP kiamfast_ready Whether the agent is ready (synced and prefetched).",
            "# TYPE kiamfast_ready gauge",
            f"kiamfast_ready {1 if self.ready else 0}",
            "# HELP kiamfast_publish_failures_total Metrics or debug texts too large to publish.",
            "# TYPE kiamfast_publish_failures_total counter",
            f"kiamfast_publish_failures_total {self.publish_failures}",
            "# HELP kiamfast_runtime_up Whether the container runtime answers (addresses "
            "follow it); 0 = unreachable or not configured (addresses follow the API server).",
            "# TYPE kiamfast_runtime_up gauge",
            f"kiamfast_runtime_up {1 if self.runtime_state == 'ok' else 0}",
        ]
        if self.poller is not None:
            lines += ["# HELP kiamfast_runtime_total Container runtime activity by kind.",
                      "# TYPE kiamfast_runtime_total counter"]
            # the poller's attempts, and what the client saw in them (its own "polls" are
            # the poller's successful ones: named apart)
            kinds = {**{f"client_{k}" if k in self.poller.stats else k: v
                        for k, v in self.poller.client.stats.items()}, **self.poller.stats}
            lines += [f'kiamfast_runtime_total{{kind="{k}"}} {v}'
                      for k, v in sorted(kinds.items())
                      if isinstance(v, int) and not isinstance(v, bool)]
        if self.container is not None:
            lines += self.container.metrics()
        if self.watcher is not None:
            stats = self.watcher.stats()
            lines += ["# HELP kiamfast_pods Pods of this node the agent knows.",
                      "# TYPE kiamfast_pods gauge", f"kiamfast_pods {stats['pods']}",
                      "# HELP kiamfast_pending_pods Live pods still waiting for an address.",
                      "# TYPE kiamfast_pending_pods gauge",
                      f"kiamfast_pending_pods {stats['pending_pods']}",
                      "# HELP kiamfast_watch_total Watch activity by kind (events, bookmarks, "
                      "lists, relists, gone = 410, errors, empty_watches and "
                      "bad_watch_bodies = watches that were not streams).",
                      "# TYPE kiamfast_watch_total counter"]
            lines += [f'kiamfast_watch_total{{kind="{k}"}} {v}' for k, v in stats.items()
                      if isinstance(v, int) and not isinstance(v, bool)
                      and k not in ("pods", "pending_pods")]
        return ("\n".join(lines) + "\n").encode()

    # ---- stop --------------------------------------------------------------------------------

    async def shutdown(self, tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The watch first: a commit after the manager closed would ask it for a slot.
        if self.watcher is not None:
            await self.watcher.stop()
        if self.manager is not None:
            self.manager.close()
            self.sts.close()
        if self.container is not None:
            self.container.close()
        if self.config.iptables and self.config.iptables_remove_on_exit:
            try:
                iptables.remove_rules(self.config)
            except iptables.IptablesError as e:
                log.error("could not remove the DNAT rule: %s", e)
        log.info("control process stopped")


def discover_roles(config: Config) -> Config:
    """kube2iam's --auto-discover-base-arn / --auto-discover-default-role: read the node's
    own instance role from the metadata service.  Fatal if it cannot be read, as in kube2iam."""
    role_arn = imds_client.instance_role_arn(config.metadata_addr)
    base = role_arn.split(":role/")[0] + ":role/"
    if config.auto_discover_default_role:
        log.info("using the instance role %s as default role", role_arn)
        return config.replace(base_role_arn=base, default_role=role_arn)
    log.info("discovered base role ARN %s", base)
    return config.replace(base_role_arn=base)


def main(argv: list[str] | None = None) -> int:
    from kiamfast.config import config_from_json

    parser = argparse.ArgumentParser(prog="kiamfast-control")
    parser.add_argument("--table", required=True)
    parser.add_argument("--channel-fds", default="")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--container-credentials-fds", default="")
    parser.add_argument("--table-lock-fd", type=int, default=-1,
                        help="inherited descriptor of the table's lock file: held before "
                             "the table is written (control/writer_lock.py)")
    parser.add_argument("--ready-fd", type=int, default=-1,
                        help="inherited pipe: one byte once in standby for the lock")
    args = parser.parse_args(argv)
    config = config_from_json(args.config_json)
    logs.setup(log_format=config.log_format, level=config.effective_log_level)
    if args.table_lock_fd >= 0:
        writer_lock.hold(args.table_lock_fd, ready_fd=args.ready_fd)
    try:
        return _serve(config, args)
    finally:
        if args.table_lock_fd >= 0:
            writer_lock.release(args.table_lock_fd)


def _serve(config: Config, args: argparse.Namespace) -> int:
    table = tbl.Table.attach(args.table, writer=True)
    if table.repaired:
        log.warning("repaired %d slots a previous control process left half-written or "
                    "unreachable (a compaction it did not finish)",
                    table.repaired)
    channels = [socket.socket(fileno=int(fd)) for fd in args.channel_fds.split(",") if fd]
    for sock in channels:
        sock.setblocking(False)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    container_socks = [socket.socket(fileno=int(fd))
                       for fd in args.container_credentials_fds.split(",") if fd]
    for sock in container_socks:
        sock.setblocking(False)
    try:
        asyncio.run(ControlProcess(config, table, channels, container_socks).run())
    except iptables.IptablesError as e:
        log.error("cannot install the DNAT rule: %s", e)
        return 1
    except imds_client.ImdsError as e:
        log.error("cannot discover the instance role: %s", e)
        return 1
    except ControlTaskFailed as e:
        log.error("control process exiting: %s", e)
        return 1
    return 0


# ---- the fleet's node count ---------------------------------------------------------------------

def count_nodes(api: Any, timeout: float = 10.0) -> int:
    """The cluster's node count from one LIST of at most one node: the API answers with the
    number of items left (``remainingItemCount``), so the answer stays small at any size."""
    resp = api.list_node(limit=1, _preload_content=False, _request_timeout=timeout)
    body = orjson.loads(resp.data)
    meta = body.get("metadata") or {}
    left = meta.get("remainingItemCount")
    if left is None and meta.get("continue"):
        raise ValueError("the node list has more pages but no remainingItemCount")
    return len(body.get("items") or []) + int(left or 0)


async def follow_node_count(api: Any, manager: CredentialManager, *,
                            interval: float = NODE_COUNT_INTERVAL, sleep=asyncio.sleep) -> None:
    """Keep the manager's share of the fleet budget on the cluster's node count.  Until the
    first count, and while the API fails, the share stays as it is (before the first: the
    floor without a budget, the lower one)."""
    loop = asyncio.get_running_loop()
    failing = False
    while True:
        try:
            manager.set_fleet_nodes(await loop.run_in_executor(None, count_nodes, api))
            failing = False
        except Exception as exc:  # ApiException, urllib3 and socket errors alike
            if not failing:      # once per episode
                log.warning("could not count the cluster's nodes (will keep trying): %s", exc)
                failing = True
        await sleep(interval * random.uniform(0.8, 1.2))
