"""The container runtime as the node model's source: polls, their outages, and the kernel's
proof of who holds each address.

Where a runtime endpoint is configured or found (``--cri-endpoint``, default ``auto``), its
poller's views go to the model (``apply_runtime``) and each failed attempt too
(``runtime_failed``: the last view stands as far as the kernel still proves it), with the
kernel's addresses of the sandboxes' network namespaces read after each
(``netns.watch.NetnsWatch``, ``--address-proof=netns``): a sandbox owns an address only
while the kernel shows it in that sandbox's namespace; the watch's notifications between
polls reach the model as they come (``kernel_changed``).  A lasting outage is made
visible: ``/readyz`` 503 after ``RUNTIME_UNREADY_AFTER`` seconds, and ``/healthz`` 500
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
from dataclasses import dataclass
from typing import Any, Protocol

from kiamfast import metrics_text as text
from kiamfast import milestones
from kiamfast.control.cri import kept_sandboxes
from kiamfast.control.cri.client import RuntimeClient, RuntimeView, Sandbox, resolve_endpoint
from kiamfast.control.cri.link import AutoEndpointClient, LinkMonitor
from kiamfast.control.cri.poller import RuntimePoller
from kiamfast.control.netns.watch import NetnsWatch

log = logging.getLogger("kiamfast.runtime")

LINK_CHECK_INTERVAL = 5.0
# /readyz answers 503 once the runtime has been unreachable this long (a restart of
# containerd takes a few seconds; a lasting outage must show in `kubectl get ds`).
RUNTIME_UNREADY_AFTER = 15.0


class NetnsUnavailable(Exception):
    """--address-proof=netns with a runtime to ask, and the kernel's addresses cannot be
    watched: nothing could ever be proven."""


@dataclass(frozen=True, slots=True)
class RuntimeEndpoint:
    """Where the runtime is asked, decided before the node model is built (the model must
    know whether a runtime decides addresses)."""
    endpoint: str | None    # a resolved endpoint, "auto" (found once it appears), None: none
    expected: bool          # addresses follow a runtime: given, found, or the table's way


def find_runtime(endpoint: str, *, table_runtime_mode: bool) -> RuntimeEndpoint:
    """``--cri-endpoint`` resolved.  ``table_runtime_mode``: the table a previous control
    process left was decided by a runtime (never drop its freshness checks because an
    'auto' socket is briefly absent)."""
    if endpoint.strip() == "auto":
        found = resolve_endpoint("auto") is not None
        if not found and not table_runtime_mode:
            log.info("no container runtime socket yet (--cri-endpoint=auto): addresses "
                     "follow the API server until one appears")
        return RuntimeEndpoint("auto", found or table_runtime_mode)
    resolved = resolve_endpoint(endpoint)
    if resolved is None:
        log.info("no container runtime endpoint (--cri-endpoint=%s): addresses follow the "
                 "API server", endpoint or '""')
        return RuntimeEndpoint(None, False)     # the operator turned it off: no poll comes
    return RuntimeEndpoint(resolved, True)


def open_witness(found: RuntimeEndpoint, address_proof: str) -> NetnsWatch | None:
    """The kernel's witness of who holds each address, opened now (``--address-proof=netns``
    and a runtime to ask; None otherwise).  A runtime whose answers nothing can prove is a
    start that cannot work (NetnsUnavailable), unless none is found yet."""
    if address_proof != "netns" or found.endpoint is None:
        return None
    watch = NetnsWatch()
    try:
        watch.open()
    except OSError as exc:
        if found.expected:
            raise NetnsUnavailable(str(exc)) from None
        log.warning("cannot watch the addresses of pods' network namespaces (%s): if a "
                    "container runtime appears (--cri-endpoint=auto), no address will be "
                    "proven to belong to a pod", exc)
    return watch


class RuntimeSink(Protocol):
    """What the runtime's answers feed (the node model: ``mappings/model.py``)."""
    unproven_addresses: int

    def apply_runtime(self, view: RuntimeView) -> None: ...

    def runtime_failed(self, started_ns: int) -> None: ...

    def kernel_changed(self) -> None: ...


class RuntimeSource:
    """The poller, its link's health and the kernel's witness, feeding ``model``."""

    def __init__(self, found: RuntimeEndpoint, *, model: RuntimeSink,
                 witness: NetnsWatch | None, commit: Callable[[], None],
                 on_change: Callable[[], None], known_file: str | None = None) -> None:
        """``witness``: the kernel proves who holds an address (``open_witness``), or None
        (--address-proof=runtime: a READY sandbox is taken at its word).  ``known_file``:
        where the views' sandboxes are kept for the next process (``kept_sandboxes.py``),
        read when the runtime's client is made."""
        self.model = model
        self.commit = commit               # the model's commit, then the workers' wake
        self.on_change = on_change         # /healthz follows the state
        self.link = LinkMonitor()
        self.settled = asyncio.Event()     # the runtime answered, or failed, once
        self.netns = witness
        self.verbose = witness is not None     # sandboxes' namespaces in their status
        self.known_file = known_file
        self._keeping: asyncio.Future | None = None     # a save in flight
        self._to_keep: tuple[Sandbox, ...] | None = None
        self.expected = found.expected     # True once a runtime answers
        self.state = "disabled"            # for /healthz: disabled | connecting | ok | ...
        self.poller: RuntimePoller | None = None
        if found.endpoint is not None:
            self.state = "connecting"
            client: RuntimeClient | AutoEndpointClient = (
                AutoEndpointClient(make_client=self._client) if found.endpoint == "auto"
                else self._client(found.endpoint))
            # backoff_max: a local socket costs nothing to retry, and an 'auto' socket that
            # appears late should be found within seconds.
            self.poller = RuntimePoller(client, on_view=self._on_view, on_state=self._on_state,
                                        on_failure=self._on_failure, backoff_max=5.0)
        self._netns_fd = -1
        self._tracked: tuple[Sandbox, ...] | None = None   # the sandboxes tracked

    @property
    def enabled(self) -> bool:
        """A runtime is asked (an endpoint given, or 'auto')."""
        return self.poller is not None

    def _client(self, endpoint: str) -> RuntimeClient:
        saved = kept_sandboxes.load(self.known_file, endpoint) if self.known_file else ()
        return RuntimeClient(endpoint, known=saved, verbose=self.verbose)

    def _keep(self, sandboxes: tuple[Sandbox, ...]) -> None:
        """Save the view's sandboxes on a thread, the latest once the save in flight ends
        (an unchanged view shares the previous one's tuple: nothing to do)."""
        if self.known_file is None or sandboxes is self._to_keep:
            return
        self._to_keep = sandboxes
        if self._keeping is None:
            self._keeping = asyncio.get_running_loop().run_in_executor(
                None, kept_sandboxes.save, self.known_file, self.poller.client.endpoint, sandboxes)
            self._keeping.add_done_callback(lambda _: self._kept(sandboxes))

    def _kept(self, sandboxes: tuple[Sandbox, ...]) -> None:
        self._keeping = None
        if self._to_keep is not sandboxes:
            latest, self._to_keep = self._to_keep, None
            self._keep(latest)

    # ---- running ------------------------------------------------------------------------------

    def start(self) -> None:
        """The kernel's notifications, applied as they come (an address leaving a sandbox's
        namespace takes its owner away at once, not at the next poll), and the polls; a
        lasting outage followed (``watch_link``)."""
        if self.netns is not None and self.netns.watching:
            self._netns_fd = self.netns.fileno()
            asyncio.get_running_loop().add_reader(self._netns_fd, self._on_netns)

    def _on_netns(self) -> None:
        assert self.netns is not None
        if self._refresh_netns():
            self.commit()
        if not self.netns.watching:    # it gave up (logged): nothing is proven any more
            asyncio.get_running_loop().remove_reader(self._netns_fd)

    def _refresh_netns(self) -> bool:
        """Read what the kernel changed; tell the model if an answer may have moved."""
        if self.netns is None:
            return False
        before = self.netns.generation
        self.netns.refresh()
        if self.netns.generation == before:
            return False
        self.model.kernel_changed()
        return True

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

    def stop(self) -> None:
        if self.netns is not None:
            if self._netns_fd >= 0 and self.netns.watching:
                asyncio.get_running_loop().remove_reader(self._netns_fd)
            self.netns.close()

    # ---- the poller's callbacks, on the loop ----------------------------------------------------

    def _on_view(self, view: RuntimeView) -> None:
        self.expected = True
        if self.netns is not None:    # the view's sandboxes' namespaces, read after the view
            if view.sandboxes is not self._tracked:    # (an unchanged view shares its tuple)
                self._tracked = view.sandboxes
                self.netns.track(view.sandboxes)
            self._refresh_netns()
        self.model.apply_runtime(view)
        self.commit()
        milestones.mark("runtime answered")    # the first view only
        self.settled.set()
        self._keep(view.sandboxes)

    def _on_failure(self, started_ns: int) -> None:
        if self.expected:     # else: an 'auto' socket not found yet (API mode)
            self._refresh_netns()   # every change until after this attempt began
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
        if self.netns is not None:
            kinds.update({f"netns_{k}": v for k, v in self.netns.counters.items()})
        return {k: v for k, v in kinds.items()
                if isinstance(v, int) and not isinstance(v, bool)}

    def metric_lines(self) -> list[str]:
        lines = text.family("kiamfast_runtime_up", "Whether the container runtime answers "
                            "(addresses follow it); 0 = unreachable or not configured "
                            "(addresses follow the API server).", int(self.state == "ok"))
        if self.poller is None:
            return lines
        lines += text.header("kiamfast_runtime_total", "Container runtime activity by kind.",
                             "counter")
        lines += [text.sample("kiamfast_runtime_total", v, (("kind", k),))
                  for k, v in sorted(self.counters().items())]
        lines += text.family("kiamfast_runtime_unproven_addresses", "Addresses a sandbox or "
                             "the API server claims that the kernel does not show in that "
                             "sandbox's network namespace: their requests wait, then get 503. "
                             "Brief while a sandbox starts or stops; lasting, the agent cannot "
                             "read the sandboxes' network namespaces "
                             "(docs/troubleshooting.md).", self.model.unproven_addresses)
        return lines
