"""Whether this agent is being uninstalled: the DaemonSet that owns its pod is deleted.

On exit the agent keeps its iptables rules (the DNAT rule and the backstop) so that a pod
never reaches the node's own role while its agent is away: an upgrade, a restart, a crash,
an evicted pod.  An uninstall is the one stop after which no agent comes back, and it must
leave the node as it found it (``--iptables-remove-on-uninstall``).  What tells the two
apart is the pod's controller: the garbage collector deletes a DaemonSet's pods because the
DaemonSet is gone (``helm uninstall``, ``kubectl delete``: background propagation) or being
deleted (foreground propagation: the DaemonSet carries a ``deletionTimestamp`` until its pods
are gone).  In an upgrade or a restart the DaemonSet is there.

The answer cannot be asked for only when SIGTERM comes: ``helm uninstall`` deletes the
ServiceAccount and the RBAC objects in the same breath as the DaemonSet, and
``kubectl delete -k`` before it (kustomize lists ServiceAccounts and RBAC first), so by then
the agent's token is refused.  So :meth:`UninstallWatch.run` reads the pod's controller once
at start and watches that DaemonSet by name for the process's life: a watch opened earlier
goes on streaming after its token's ServiceAccount is deleted (credentials are checked when a
request starts).  At SIGTERM :meth:`UninstallWatch.uninstalling` asks the API afresh where it
still answers (the pod's controller may have changed: a DaemonSet recreated under the same
name adopts the pods left orphaned) and falls back on what the watch last saw where it does
not.

Fail closed: True only on evidence that the owner is gone or being deleted; an agent that is
no DaemonSet's pod, a DaemonSet recreated under the same name (``helm uninstall`` and
``install`` again: its agent will serve the node, and finds the rules in place), and anything
unknown (never synced, no answer) keep the rules.  It needs ``get`` on its
own pod (the agent's ClusterRole has it for every pod) and ``get``, ``list`` and ``watch`` on
its DaemonSet (the chart grants them for that name only).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import orjson

from kiamfast.budget import Episode, backoff
from kiamfast.control.k8s.watch import ResourceWatch
from kiamfast.kube.errors import ApiError, ApiUnavailable

log = logging.getLogger("kiamfast.uninstall")

REQUEST_TIMEOUT = 10.0
ASK_TIMEOUT = 2.0       # at SIGTERM: the fresh look at the pod and its DaemonSet
WATCH_GRACE = 2.0       # at SIGTERM, without an answer: the DaemonSet's deletion may be on
                        # its way to the watch (the garbage collector saw it as early)

# What the watch last saw of the owner.
UNKNOWN, PRESENT, DELETING, GONE, REPLACED = "unknown", "present", "deleting", "gone", "replaced"

Sleep = Callable[[float], Awaitable[None]]


def controller_of(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the DaemonSet controlling ``pod`` (its controller ownerReference), or
    None when no DaemonSet does (a bare pod, an orphan, another kind of controller)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "DaemonSet" and \
                str(ref.get("apiVersion", "")).startswith("apps/"):
            return ref.get("name", ""), ref.get("uid", "")
    return None


def owner_state(daemonset: dict[str, Any] | None, uid: str) -> str:
    """The owner (of ``uid``) as one DaemonSet object of its name shows it (None: none)."""
    if daemonset is None:
        return GONE
    meta = daemonset.get("metadata") or {}
    if meta.get("uid") != uid:
        return REPLACED
    return DELETING if meta.get("deletionTimestamp") else PRESENT


class UninstallWatch:
    """The pod's owning DaemonSet, followed from start to SIGTERM; see the module docstring."""

    def __init__(self, client: Any, *, pod: str, namespace: str,
                 sleep: Sleep = asyncio.sleep) -> None:
        self.client = client
        self.pod = pod
        self.namespace = namespace
        self._sleep = sleep
        self.owner: tuple[str, str] | None = None     # (name, uid), once read
        self.state = UNKNOWN
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """Read the owner (retried until the API answers), then watch it (forever)."""
        self.owner = controller_of(await self._read_pod_until_answered())
        if self.owner is None:
            log.info("pod %s/%s has no DaemonSet controller: its rules stay when it stops",
                     self.namespace, self.pod)
            await asyncio.Event().wait()     # nothing to follow; runs for the process's life
        name, _ = self.owner
        watch = ResourceWatch(client=self.client, name="daemonset",
                              path=f"/apis/apps/v1/namespaces/{self.namespace}/daemonsets",
                              params={"fieldSelector": f"metadata.name={name}"},
                              on_list=self._on_list, on_event=self._on_event)
        await watch.run()

    async def uninstalling(self) -> bool:
        """At SIGTERM: is the owner gone or being deleted?  Asked afresh (bounded) where the
        API answers; otherwise what the watch saw, waiting briefly for a deletion on its way."""
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                answer = await self._ask()
        except (ApiError, ApiUnavailable, TimeoutError) as exc:
            log.info("cannot ask the API whether this agent is being uninstalled (%s): "
                     "going by the DaemonSet watch", exc)
            answer = None
        if answer is None:
            answer = await self._watched_deletion()
        return answer

    # ---- the watch ------------------------------------------------------------------------

    def _on_list(self, items: list[dict[str, Any]], list_rv: int) -> None:
        self._saw(items[0] if items else None)

    def _on_event(self, typ: str, daemonset: dict[str, Any]) -> None:
        self._saw(None if typ == "DELETED" else daemonset)

    def _saw(self, daemonset: dict[str, Any] | None) -> None:
        assert self.owner is not None
        state = owner_state(daemonset, self.owner[1])
        if state != self.state:
            log.info("DaemonSet %s/%s: %s", self.namespace, self.owner[0], state)
            self.state = state
            self._changed.set()

    async def _watched_deletion(self) -> bool:
        if self.state not in (GONE, DELETING) and self.owner is not None:
            try:
                async with asyncio.timeout(WATCH_GRACE):
                    while self.state not in (GONE, DELETING):
                        self._changed.clear()
                        await self._changed.wait()
            except TimeoutError:
                pass
        return self.state in (GONE, DELETING)

    # ---- asking ---------------------------------------------------------------------------

    async def _ask(self) -> bool | None:
        """The pod's controller now, and that DaemonSet now; None where the API does not say
        (then the watch decides, if it follows that same DaemonSet)."""
        owner = controller_of(await self._get(f"/api/v1/namespaces/{self.namespace}/pods/"
                                              f"{self.pod}"))
        if owner is None:
            return False
        try:
            daemonset = await self._get(f"/apis/apps/v1/namespaces/{self.namespace}/"
                                        f"daemonsets/{owner[0]}")
        except (ApiError, ApiUnavailable) as exc:
            if isinstance(exc, ApiError) and exc.status == 404:
                return True
            # The watch follows the DaemonSet the pod had at start; of another one (it was
            # adopted since) nothing is known: keep.
            return None if owner == self.owner else False
        return owner_state(daemonset, owner[1]) == DELETING

    async def _get(self, path: str) -> dict[str, Any]:
        response = await self.client.request("GET", path, timeout=REQUEST_TIMEOUT)
        return orjson.loads(response.body)

    async def _read_pod_until_answered(self) -> dict[str, Any]:
        failures = 0
        outage = Episode()
        while True:
            try:
                return await self._get(f"/api/v1/namespaces/{self.namespace}/pods/{self.pod}")
            except (ApiError, ApiUnavailable) as exc:
                failures += 1
                if outage.failed():
                    log.warning("cannot read this agent's pod %s/%s (will keep trying): %s",
                                self.namespace, self.pod, exc)
                await self._sleep(backoff(failures, base=0.5, cap=60.0))
