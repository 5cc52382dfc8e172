"""The API server as one room of the control process: the client, the node's pods and
namespaces (`source.ApiSource`), the node's startup taint (`node.StartupTaint`), and what
follows the cluster beside them: the node count of the STS budget, the agent's own
DaemonSet (an uninstall, `uninstall.py`), the pods created without the container
credentials they asked for (their Events).

Built at once (cheap: nothing of the API client is imported), started later: after a
restart the runtime's first poll runs before the client's modules load, so the pods it
confirms are answered within a few hundred milliseconds (docs/architecture.md, "Node start
and stop").
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiamfast import metrics_text as text
from kiamfast import milestones
from kiamfast.control.lifecycle import Tasks

if TYPE_CHECKING:
    from kiamfast.config import Config
    from kiamfast.control.iam.manager import CredentialManager
    from kiamfast.control.k8s.node import StartupTaint
    from kiamfast.control.k8s.source import ApiSource
    from kiamfast.control.k8s.uninstall import UninstallWatch
    from kiamfast.control.mappings.model import NodeModel
    from kiamfast.container_credentials.uninjected import UninjectedPods
    from kiamfast.kube.client import Client
    from kiamfast.kube.config import ClientConfig
    from kiamfast.kube.wire import Response

log = logging.getLogger("kiamfast.control")

NODE_COUNT_INTERVAL = 60.0      # --sts-account-qps without --sts-fleet-nodes (jittered)


class ApiLink:
    def __init__(self, config: Config, client_config: ClientConfig, *, model: NodeModel,
                 manager: CredentialManager, tasks: Tasks, report_uninjected: bool,
                 on_state: Callable[[], None]) -> None:
        """``on_state``: the API's state or the taint's changed (/healthz follows)."""
        self.config = config
        self.client_config = client_config
        self.model = model
        self.manager = manager
        self.tasks = tasks
        self.report_uninjected = report_uninjected
        self.on_state = on_state
        self.state = "connecting"            # /healthz: connecting | ok | unreachable: ...
        self.client: Client | None = None
        self.source: ApiSource | None = None
        self.taint: StartupTaint | None = None
        self.uninstall: UninstallWatch | None = None
        self.uninjected: UninjectedPods | None = None

    @property
    def taint_state(self) -> str:
        return self.taint.state if self.taint is not None else "pending"

    def start(self) -> None:
        """The client (its configuration was checked before the lock: start.py), the
        node's pods, and the watches beside them."""
        from kiamfast.control.k8s.node import StartupTaint, follow_node_count
        from kiamfast.control.k8s.source import ApiSource
        from kiamfast.control.k8s.watch import WatchTimings
        from kiamfast.kube.client import Client
        cfg = self.config
        self.client = client = Client(self.client_config)
        if self.report_uninjected:
            self.uninjected = self._uninjected_pods()
        self.source = ApiSource(client=client, model=self.model, node=cfg.node or None,
                                watch_namespaces=self.model.policy.uses_namespaces,
                                timings=WatchTimings(resync=cfg.cache_resync_period),
                                on_error=self._failing,
                                on_pod=self.uninjected.seen if self.uninjected else None)
        self.taint = StartupTaint(cfg.node, cfg.node_startup_taint,
                                  on_change=self._taint_changed)
        self.tasks.spawn(self.source.run(), "api-watch")
        if cfg.sts_account_qps > 0 and cfg.sts_fleet_nodes == 0:
            self.tasks.spawn(follow_node_count(client, self.manager,
                                               interval=NODE_COUNT_INTERVAL), "node-count")
        if cfg.iptables and cfg.iptables_remove_on_uninstall:
            from kiamfast.control.k8s.uninstall import UninstallWatch
            self.uninstall = UninstallWatch(client, pod=cfg.pod_name,
                                            namespace=cfg.pod_namespace)
            self.tasks.spawn(self.uninstall.run(), "uninstall-watch")

    async def stop(self) -> None:
        await self.tasks.cancel("api-watch", "node-count", "uninstall-watch")
        if self.client is not None:
            await self.client.close()

    async def synced(self) -> None:
        assert self.source is not None
        await self.source.synced.wait()
        if self.state == "connecting":
            self.state = "ok"

    async def keep_taint_removed(self) -> None:
        """Remove the node's startup taint, then keep it removed (the agent is ready)."""
        assert self.taint is not None and self.client is not None
        await self.taint.run(self.client)

    def request_sync(self, method: str, path: str, *, body: Any = None,
                     timeout: float = 30.0) -> Response:
        """A blocking call through the client (the token reviews' and the Events' threads:
        they start once this room has)."""
        assert self.client is not None, "the API link is not started"
        return self.client.request_sync(method, path, body=body, timeout=timeout)

    async def uninstalling(self) -> bool:
        """Whether this agent's DaemonSet is deleted (an uninstall): asked while the API and
        the watch still run."""
        return self.uninstall is not None and await self.uninstall.uninstalling()

    async def read_node(self) -> dict[str, Any] | None:
        """This node as the API shows it, or None (no --node, not started, or the API cannot
        answer: then nothing proves the runtime link dead)."""
        from kiamfast.control.k8s.node import read_node
        if not self.config.node or self.client is None:
            return None
        try:
            return await read_node(self.client, self.config.node)
        except Exception as exc:  # noqa: BLE001 - any failure: no evidence
            log.debug("cannot read node %s: %s", self.config.node, exc)
            return None

    def _failing(self, error: str) -> None:
        """The pod watch's state changed (its error, or "" once it answers again)."""
        self.state = f"unreachable: {error}" if error else "ok"
        self.on_state()

    def _taint_changed(self) -> None:
        assert self.taint is not None
        milestones.mark(f"taint {self.taint.state}")
        self.on_state()

    def _uninjected_pods(self) -> UninjectedPods:
        """An Event on each pod of the node that asked for injection and was created without
        it (container_credentials/uninjected.py), posted on a thread."""
        from kiamfast.container_credentials.uninjected import UninjectedPods
        loop = asyncio.get_running_loop()
        return UninjectedPods(
            role_key=self.config.iam_role_key, node=self.config.node,
            create_event=lambda body: self.request_sync(
                "POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events",
                body=body, timeout=10),
            run_in_thread=lambda post: loop.run_in_executor(None, post))

    def metric_lines(self) -> list[str]:
        """The node's pods as the agent knows them, and what its watch did."""
        from kiamfast.control.mappings import report
        if self.source is None:
            return []
        lines = text.family("kiamfast_pods", "Pods of this node the agent knows.",
                           len(self.model.pods))
        lines += text.family("kiamfast_pending_pods", "Live pods still waiting for an address.",
                            self.model.pending_pods)
        lines += text.header("kiamfast_watch_total", "Watch activity by kind (events, "
                             "bookmarks, lists, relists, gone = 410, errors, empty_watches "
                             "and bad_watch_bodies = watches that were not streams).",
                             "counter")
        lines += [text.sample("kiamfast_watch_total", v, (("kind", k),))
                  for k, v in {**self.source.stats(), **report.counters(self.model)}.items()]
        if self.uninjected is not None:
            lines += text.family("kiamfast_container_credentials_uninjected_pods_total",
                                "Pods of this node that asked for container credentials and "
                                "were created without them (an Event "
                                "ContainerCredentialsNotInjected is posted on each).",
                                self.uninjected.reported, "counter")
        return lines
