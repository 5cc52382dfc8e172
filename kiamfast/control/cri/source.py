"""The container runtime as the node model's source: polls, their outages, the host routes.

Where a runtime endpoint is configured or found (``--cri-endpoint``, default ``auto``), its
poller's views go to the model (``apply_runtime``) and each failed attempt too
(``runtime_failed``: the merge's fallback decides meanwhile), with the host's routes read
before each (``routes.RouteWatch``: the fallback's second witness).  A lasting outage is
made visible: ``/readyz`` 503 after ``RUNTIME_UNREADY_AFTER`` seconds, and ``/healthz`` 500
(the liveness probe restarts the container) only when the agent's own link is dead: its
socket path is there but refuses while the kubelet reaches the runtime (``link.LinkMonitor``).
A socket path that is not there at all is not cured by a restart, so it never fails the
liveness probe.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from kiamfast import milestones
from kiamfast.control.cri import link as runtime_link
from kiamfast.control.cri import client as runtime
from kiamfast.control.cri import known
from kiamfast.control.cri.poller import RuntimePoller
from kiamfast.control.cri import routes as host_routes

log = logging.getLogger("kiamfast.runtime")

LINK_CHECK_INTERVAL = 5.0
# /readyz answers 503 once the runtime has been unreachable this long (a restart of
# containerd takes a few seconds; a lasting outage must show in `kubectl get ds`).
RUNTIME_UNREADY_AFTER = 15.0


class RuntimeSource:
    """The poller, its link's health and the route witness, feeding ``model``."""

    def __init__(self, *, endpoint: str, model: Any, commit: Callable[[], None],
                 table_runtime_mode: bool, on_change: Callable[[], None],
                 known_file: str | None = None) -> None:
        """``known_file``: where the views' sandboxes are kept for the next process
        (``known.py``), read when the runtime's client is made."""
        self.model = model
        self.commit = commit               # the model's commit, then the workers' wake
        self.on_change = on_change         # /healthz follows the state
        self.state = "disabled"            # for /healthz: disabled | connecting | ok | ...
        self.link = runtime_link.LinkMonitor()
        self.settled = asyncio.Event()     # the runtime answered, or failed, once
        self.routes: host_routes.RouteWatch | None = None
        self._routes_fd = -1
        self.known_file = known_file
        self._keeping: asyncio.Future | None = None     # a save in flight
        self._to_keep: tuple[runtime.Sandbox, ...] | None = None
        # Whether addresses follow the runtime: an endpoint was given or found, or the table
        # a previous control process left was decided by one (never drop its freshness
        # checks because an 'auto' socket is briefly absent).
        self.expected = table_runtime_mode
        self.poller = self._poller(endpoint)

    def _poller(self, endpoint: str) -> RuntimePoller | None:
        if endpoint.strip() == "auto":
            client: Any = runtime_link.AutoEndpointClient(make_client=self._client)
            if runtime.resolve_endpoint("auto") is not None:
                self.expected = True
            elif not self.expected:
                log.info("no container runtime socket yet (--cri-endpoint=auto): addresses "
                         "follow the API server until one appears")
        else:
            resolved = runtime.resolve_endpoint(endpoint)
            if resolved is None:
                log.info("no container runtime endpoint (--cri-endpoint=%s): addresses "
                         "follow the API server", endpoint or '""')
                self.expected = False   # the operator turned it off: no poll comes
                return None
            client = self._client(resolved)
            self.expected = True
        self.state = "connecting"
        # backoff_max: a local socket costs nothing to retry, and an 'auto' socket that
        # appears late should be found within seconds.
        return RuntimePoller(client, on_view=self._on_view,
                                     on_state=self._on_state,
                                     on_failure=self._on_failure, backoff_max=5.0)

    def _client(self, endpoint: str) -> runtime.RuntimeClient:
        saved = known.load(self.known_file, endpoint) if self.known_file else ()
        return runtime.RuntimeClient(endpoint, known=saved)

    def _keep(self, sandboxes: tuple[runtime.Sandbox, ...]) -> None:
        """Save the view's sandboxes on a thread, the latest once the save in flight ends
        (an unchanged view shares the previous one's tuple: nothing to do)."""
        if self.known_file is None or sandboxes is self._to_keep:
            return
        self._to_keep = sandboxes
        if self._keeping is None:
            self._keeping = asyncio.get_running_loop().run_in_executor(
                None, known.save, self.known_file, self.poller.client.endpoint, sandboxes)
            self._keeping.add_done_callback(lambda _: self._kept(sandboxes))

    def _kept(self, sandboxes: tuple[runtime.Sandbox, ...]) -> None:
        self._keeping = None
        if self._to_keep is not sandboxes:
            latest, self._to_keep = self._to_keep, None
            self._keep(latest)

    # ---- running ------------------------------------------------------------------------------

    def start_routes(self, loop: asyncio.AbstractEventLoop) -> None:
        """The host's routes to pod addresses, read as notifications come (so each change is
        dated when it happened); only where there is a runtime to fall back from."""
        if self.poller is None:
            return
        watch = host_routes.RouteWatch()
        if not watch.open():
            return
        self.routes = watch
        self._routes_fd = watch.fileno()
        loop.add_reader(self._routes_fd, self._drain_routes)

    def _drain_routes(self) -> None:
        assert self.routes is not None
        self.routes.drain()
        if not self.routes.watching:   # it gave up (logged): every answer is None now
            asyncio.get_running_loop().remove_reader(self._routes_fd)

    def need(self, accepted_ns: int) -> None:
        """A worker's connection accepted at ``accepted_ns`` needs a poll begun after it."""
        if self.poller is not None:
            self.poller.need(accepted_ns)

    async def watch_link(self, *, ready: Callable[[], bool], set_ready: Callable[[bool], None],
                         read_node: Callable[[], Awaitable[dict[str, Any] | None]]) -> None:
        """/readyz and /healthz follow a lasting outage (the module docstring)."""
        assert self.poller is not None
        unready = False
        while True:
            await asyncio.sleep(LINK_CHECK_INTERVAL)
            outage = self.link.outage_seconds()
            if ready() and (outage >= RUNTIME_UNREADY_AFTER) != unready:
                unready = not unready
                if unready:
                    log.warning("container runtime unreachable for %.0fs: /readyz 503", outage)
                else:
                    log.info("container runtime reachable again: /readyz 200")
                set_ready(not unready)
            was = self.link.broken
            endpoint = self.poller.client.endpoint
            if outage >= self.link.grace and os.path.exists(endpoint.removeprefix("unix://")):
                node = await read_node()
                if node is not None:
                    self.link.judge(node, endpoint, self.poller.last_error)
            else:
                self.link.broken = ""
            if self.link.broken != was:
                if self.link.broken:
                    log.error("%s", self.link.broken)
                self.on_change()

    def close(self) -> None:
        if self.routes is not None:
            if self.routes.watching:
                asyncio.get_running_loop().remove_reader(self._routes_fd)
            self.routes.close()

    # ---- the poller's callbacks, on the loop ----------------------------------------------------

    def _on_view(self, view: runtime.RuntimeView) -> None:
        self.expected = True
        if self.routes is not None:   # re-read what changed, for the next outage
            self.routes.refresh(prune_before_ns=view.started_ns)
        self.model.apply_runtime(view)
        self.commit()
        milestones.mark("runtime answered")    # the first view only
        self.settled.set()
        self._keep(view.sandboxes)

    def _on_failure(self, started_ns: int) -> None:
        if self.expected:     # else: an 'auto' socket not found yet (API mode)
            if self.routes is not None:   # every change until after this attempt began
                self.routes.refresh()
            self.model.runtime_failed(started_ns)
            self.commit()
        self.settled.set()

    def _on_state(self, reachable: bool, message: str) -> None:
        if reachable:
            self.state = "ok"
        elif self.expected:
            self.state = f"unreachable: {message}"
        else:
            self.state = f"none found: {message}"
        self.link.state(reachable or not self.expected)
        self.on_change()
        self.settled.set()

    # ---- what the metrics read ------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The poller's attempts, and what the client saw in them (its own "polls" are the
        poller's successful ones: named apart)."""
        if self.poller is None:
            return {}
        kinds = {**{f"client_{k}" if k in self.poller.stats else k: v
                    for k, v in self.poller.client.stats.items()}, **self.poller.stats}
        return {k: v for k, v in kinds.items()
                if isinstance(v, int) and not isinstance(v, bool)}
