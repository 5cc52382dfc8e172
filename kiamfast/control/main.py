"""The control process: the only writer of the table, and the owner of every slow thing.

Node start, in order (docs/architecture.md): the workers already listen (the supervisor
started them first) → install the DNAT rule → start the pod + namespace watch and the
credential manager → synced → bounded prefetch → ready → remove the node's startup taint.
Until ready, workers hold requests for unknown pods (bounded) and then answer 503: a pod
never gets another identity, and never the node's role.

It also answers the workers' messages (unknown IP → ask the kubelet; credentials wanted →
fetch now), publishes the aux blobs workers serve (/metrics text, /debug/store, /healthz)
and heartbeats the table.  On SIGTERM it leaves the DNAT rule in place unless
--iptables-remove-on-exit: a pod without its agent gets a refused connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import time

import orjson
import prometheus_client

from kiamfast import __version__, channel, logs
from kiamfast import table as tbl
from kiamfast.cli import build_info
from kiamfast.config import Config
from kiamfast.control import iptables, imds_client, taint
from kiamfast.control.credentials import CredentialManager
from kiamfast.control.ownership import Ownership
from kiamfast.control.pods import PodWatcher
from kiamfast.control.roles import RolePolicy
from kiamfast.control.sts import StsClient

log = logging.getLogger("kiamfast.control")

HEALTH_INTERVAL = 30.0
PUBLISH_INTERVAL = 2.0
HEARTBEAT_INTERVAL = 1.0


class ControlTaskFailed(Exception):
    """A task that must run for the life of the control process ended."""


class ControlProcess:
    def __init__(self, config: Config, table: tbl.Table, channels: list[socket.socket]):
        self.config = config
        self.table = table
        self.channels = channels
        prometheus_client.disable_created_metrics()   # no *_created series: kube2iam has none
        self.registry = prometheus_client.CollectorRegistry()
        self._wake_scheduled = False
        self._stop = asyncio.Event()
        self.watcher = None
        self.manager: CredentialManager | None = None
        self.ready = False
        self.healthy = False

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

    def _on_channel(self, sock: socket.socket) -> None:
        for raw in channel.drain(sock):
            msg = channel.parse(raw)
            if msg is None:
                continue
            kind, value = msg
            if kind == channel.UNKNOWN_IP and self.watcher is not None:
                self.watcher.unknown_ip(value)   # the 16-byte key as sent
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
        if self.config.iptables:
            await loop.run_in_executor(None, iptables.install_rules, self.config)
        self.sts = StsClient.from_config(self.config)
        self.manager = CredentialManager.from_config(
            self.config, table=self.table, sts=self.sts, notify=self.notify,
            registry=self.registry)
        # A restarted control process: IP slots may still point at credential slots of the
        # previous one.  Keep those out of allocation until the first sync has re-claimed
        # every address, or one pod could be served another key's credentials.
        self.manager.hold_slots({ip["cred_slot"] for ip in self.table.snapshot()
                                 if ip["cred_slot"] >= 0})
        self.model = Ownership(policy=RolePolicy.from_config(self.config), table=self.table,
                               sink=self.manager, notify=self.notify)
        self.watcher = PodWatcher.from_config(self.config, model=self.model)
        tasks = [
            asyncio.create_task(self.manager.run(), name="credentials"),
            asyncio.create_task(self.watcher.run(), name="pod-watch"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._health(), name="health"),
            asyncio.create_task(self._publish(), name="publish"),
        ]
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

    async def _become_ready(self) -> None:
        await self.watcher.wait_synced()
        self.manager.release_held()
        log.info("pods of node %s synced", self.config.node or "(all nodes)")
        deadline = time.monotonic() + self.config.ready_prefetch_timeout
        while time.monotonic() < deadline and not self._prefetched():
            await asyncio.sleep(0.05)
        self.ready = True
        self.table.set_status(ready=True)
        self.notify()
        log.info("ready", extra={"credential_keys": self.manager.stats().get("keys_ready")})
        if self.config.node_startup_taint and self.config.node:
            await self._remove_taint()

    def _prefetched(self) -> bool:
        stats = self.manager.stats()
        return stats.get("keys_pending", 0) == 0

    async def _remove_taint(self) -> None:
        from kubernetes import client as kclient
        api = kclient.CoreV1Api(self.watcher.api_client)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: taint.remove_startup_taint(api, self.config.node,
                                                         self.config.node_startup_taint))
        except taint.TaintError as e:
            log.warning("could not remove the startup taint: %s", e)

    # ---- periodic work -----------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            self.table.heartbeat()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def _health(self) -> None:
        """kube2iam's health check: the instance ID read from the metadata service."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                iid = await loop.run_in_executor(None, imds_client.instance_id,
                                                 self.config.metadata_addr)
                body = orjson.dumps({"hostIP": self.config.host_ip, "instanceId": iid})
                self.table.write_aux(tbl.AUX_HEALTH, body + b"\n")
                self.table.write_aux(tbl.AUX_HEALTH_ERROR, b"")
                self.healthy = True
            except imds_client.ImdsError as e:
                self.healthy = False
                self.table.write_aux(tbl.AUX_HEALTH, b"")
                self.table.write_aux(tbl.AUX_HEALTH_ERROR, str(e).encode())
            await asyncio.sleep(HEALTH_INTERVAL)

    async def _publish(self) -> None:
        """Metrics text and /debug/store JSON for the workers to serve."""
        while True:
            text = prometheus_client.generate_latest(self.registry)
            text += self._own_metrics()
            self.table.write_aux(tbl.AUX_METRICS, text)
            if self.config.debug and self.watcher is not None:
                self.table.write_aux(tbl.AUX_DEBUG_STORE,
                                     orjson.dumps(self.model.debug_store(),
                                                  option=orjson.OPT_SORT_KEYS))
            await asyncio.sleep(PUBLISH_INTERVAL)

    def _own_metrics(self) -> bytes:
        """The control process's gauges and the watch's counters, in Prometheus text."""
        commit, built = build_info()
        lines = [
            "# HELP kube2iam_healthcheck_status Result of the last metadata health check.",
            "# TYPE kube2iam_healthcheck_status gauge",
            f"kube2iam_healthcheck_status {1 if self.healthy else 0}",
            "# HELP kube2iam_info Build information (kube2iam-compatible name).",
            "# TYPE kube2iam_info gauge",
            f'kube2iam_info{{version="{__version__}",build_date="{built}",'
            f'commit_hash="{commit}"}} 1',
            "# HELP kiamfast_ready Whether the agent is ready (synced and prefetched).",
            "# TYPE kiamfast_ready gauge",
            f"kiamfast_ready {1 if self.ready else 0}",
        ]
        if self.watcher is not None:
            stats = self.watcher.stats()
            lines += ["# HELP kiamfast_pods Pods of this node the agent knows.",
                      "# TYPE kiamfast_pods gauge", f"kiamfast_pods {stats['pods']}",
                      "# HELP kiamfast_pending_pods Live pods still waiting for an address.",
                      "# TYPE kiamfast_pending_pods gauge",
                      f"kiamfast_pending_pods {stats['pending_pods']}",
                      "# HELP kiamfast_watch_total Watch activity by kind (events, bookmarks, "
                      "lists, relists, gone = 410, errors, unknown_ips).",
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
    from kiamfast.supervisor import config_from_json

    parser = argparse.ArgumentParser(prog="kiamfast-control")
    parser.add_argument("--table", required=True)
    parser.add_argument("--channel-fds", default="")
    parser.add_argument("--config-json", required=True)
    args = parser.parse_args(argv)
    config = config_from_json(args.config_json)
    logs.setup(log_format=config.log_format, level=config.effective_log_level)
    table = tbl.Table.attach(args.table, writer=True)
    if table.repaired:
        log.warning("repaired %d slots a previous control process left half-written",
                    table.repaired)
    channels = [socket.socket(fileno=int(fd)) for fd in args.channel_fds.split(",") if fd]
    for sock in channels:
        sock.setblocking(False)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(ControlProcess(config, table, channels).run())
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
