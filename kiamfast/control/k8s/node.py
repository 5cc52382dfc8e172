"""This node as the API shows it: its startup taint, its conditions, and the cluster's size.

**The startup taint.**  A new node registers with the taint ``kiamfast.io/agent-not-ready``
(kubelet ``--register-with-taints``, Karpenter ``startupTaints``, a managed node group's
taints).  No ordinary pod tolerates it, so none can start, ask 169.254.169.254 and get the
node's own role or no credentials, before the agent on that node is serving.  Once the agent
is ready, :class:`StartupTaint` removes it with one JSON patch on the agent's own Node: for
every taint with our key, a ``test`` of the exact entry (as read) and a ``remove`` of it.
Other controllers edit the same list concurrently (the node lifecycle controller adds and
removes ``node.kubernetes.io/*`` taints, Karpenter and Cilium their own); if the list changed
between our read and our patch the ``test`` fails, nothing is written, and we read again.  A
resourceVersion precondition would not do: the kubelet's status updates bump it every few
seconds.  It never gives up: while the API server refuses (down, RBAC not applied yet, a
webhook failing) the node stays tainted and no pod can land on it, so every failure is
followed by another attempt after a jittered exponential backoff (capped at a minute),
logged once per episode.

Peers met the taint coming back after removal (karpenter#1772, aws-ebs-csi-driver#2447,
aws-efs-csi-driver#1491: a controller re-applying the node's registered taints, a removal
lost to a concurrent update).  So once removed, the agent watches its Node and removes the
taint again whenever it reappears while the agent is ready.  Its ``state`` is what
``/healthz`` reports: ``disabled``, ``pending`` (not ready yet), ``retrying: <error>``,
``removed`` or ``removed (again N times)``.

This module must never add taints, touch taints with other keys, or remove ours before the
caller decided the agent is ready.  It needs ``get``, ``patch``, ``list`` and ``watch`` on
``nodes`` (the watch is of this one node, by ``fieldSelector``).
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Awaitable, Callable

import orjson

from kiamfast.budget import Episode, backoff
from kiamfast.control.k8s.watch import ResourceWatch
from kiamfast.kube.errors import ApiError, ApiUnavailable

log = logging.getLogger("kiamfast.taint")

JSON_PATCH = "application/json-patch+json"
REQUEST_TIMEOUT = 10.0

Sleep = Callable[[float], Awaitable[None]]


def startup_taints(node: dict[str, Any], taint_key: str) -> list[tuple[int, dict[str, Any]]]:
    """(index, taint) of every taint with ``taint_key`` in a Node object (raw JSON dict)."""
    taints = (node.get("spec") or {}).get("taints") or []
    return [(i, t) for i, t in enumerate(taints) if isinstance(t, dict) and
            t.get("key") == taint_key]


def removal_patch(matches: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The JSON patch removing ``matches``: tests on the original indices, then removals in
    descending index order so earlier removals do not shift later ones."""
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": f"/spec/taints/{i}", "value": taint} for i, taint in matches]
    ops += [{"op": "remove", "path": f"/spec/taints/{i}"}
            for i, _ in sorted(matches, key=lambda m: m[0], reverse=True)]
    return ops


def describe(exc: Exception, node_name: str) -> str:
    """One line for the log and /healthz, naming what to fix where it can."""
    status = getattr(exc, "status", None)
    if status == 404:
        return f"node {node_name!r} not found (is --node right?)"
    if status in (401, 403):
        return (f"HTTP {status}: not allowed to patch node {node_name!r} (the agent's "
                "ClusterRole needs get, patch, list and watch on nodes)")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


async def read_node(client: Any, node_name: str, *,
                    timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    response = await client.request("GET", f"/api/v1/nodes/{node_name}", timeout=timeout)
    return orjson.loads(response.body)


async def count_nodes(client: Any, *, timeout: float = REQUEST_TIMEOUT) -> int:
    """The cluster's node count from one LIST of at most one node: the API answers with the
    number of items left (``remainingItemCount``), so the answer stays small at any size."""
    response = await client.request("GET", "/api/v1/nodes", params={"limit": "1"},
                                    timeout=timeout)
    body = orjson.loads(response.body)
    meta = body.get("metadata") or {}
    left = meta.get("remainingItemCount")
    if left is None and meta.get("continue"):
        raise ValueError("the node list has more pages but no remainingItemCount")
    return len(body.get("items") or []) + int(left or 0)


async def follow_node_count(client: Any, manager: Any, *, interval: float = 60.0) -> None:
    """Keep ``manager``'s share of the fleet's STS budget on the cluster's node count
    (--sts-account-qps without --sts-fleet-nodes), every ``interval`` (jittered).  Until the
    first count, and while the API fails, the share stays as it is."""
    outage = Episode()
    while True:
        try:
            manager.set_fleet_nodes(await count_nodes(client))
            outage.recovered()
        except (ApiError, ApiUnavailable, ValueError) as exc:
            if outage.failed():
                log.warning("could not count the cluster's nodes (will keep trying): %s", exc)
        await asyncio.sleep(interval * random.uniform(0.8, 1.2))


class StartupTaint:
    """The startup taint's removal once the agent is ready, retried until done, and again
    whenever the taint comes back."""

    FIRST_BACKOFF = 0.1   # a lost race with another controller is retried almost at once
    MAX_BACKOFF = 60.0

    def __init__(self, node_name: str, taint_key: str, *, sleep: Sleep = asyncio.sleep,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """``on_change``: the state changed (/healthz follows it)."""
        self.node_name = node_name
        self.taint_key = taint_key
        self._sleep = sleep
        self.attempts = 0
        self.removals = 0              # by this agent, the first one included
        self.state = "pending" if node_name and taint_key else "disabled"
        self._seen_again = asyncio.Event()
        self.on_change = on_change

    async def run(self, client: Any) -> None:
        """Remove the taint, then keep it removed (cancel to stop).  Never raises."""
        if self.state == "disabled":
            return
        await self._remove_until_done(client)
        watch = ResourceWatch(client=client, name="node", path="/api/v1/nodes",
                              params={"fieldSelector": f"metadata.name={self.node_name}"},
                              on_list=self._on_list, on_event=self._on_event)
        watcher = asyncio.create_task(watch.run(), name="node-watch")
        try:
            while True:
                await self._seen_again.wait()
                self._seen_again.clear()
                log.warning("startup taint %s is back on node %s (another controller re-added "
                            "it); removing it again", self.taint_key, self.node_name)
                await self._remove_until_done(client)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    def _on_list(self, items: list[dict[str, Any]], list_rv: int) -> None:
        for node in items:
            self._check(node)

    def _on_event(self, typ: str, node: dict[str, Any]) -> None:
        if typ != "DELETED":
            self._check(node)

    def _check(self, node: dict[str, Any]) -> None:
        if (node.get("metadata") or {}).get("name") == self.node_name and \
                startup_taints(node, self.taint_key):
            self._seen_again.set()

    async def _remove_until_done(self, client: Any) -> None:
        outage = Episode()
        failures = 0
        while True:
            self.attempts += 1
            try:
                removed = await self._remove_once(client)
            except (ApiError, ApiUnavailable) as exc:
                error = describe(exc, self.node_name)
                self._set_state(f"retrying: {error}")
                if outage.failed():   # the state keeps the latest error
                    log.warning("could not remove startup taint %s (will keep retrying): %s",
                                self.taint_key, error)
                failures += 1
                await self._sleep(backoff(failures, base=self.FIRST_BACKOFF,
                                          cap=self.MAX_BACKOFF))
                continue
            if outage.recovered():
                log.info("startup taint %s of node %s is gone after %d attempts",
                         self.taint_key, self.node_name, self.attempts)
            elif not removed and not self.removals:
                log.info("node %s has no startup taint %s", self.node_name, self.taint_key)
            again = self.removals - 1
            self._set_state("removed" if again <= 0 else f"removed (again {again} times)")
            return

    async def _remove_once(self, client: Any) -> bool:
        """One read and one patch: True if removed, False if absent.  A patch whose test
        failed (the list changed under us) is an ApiError (422), retried at once-ish."""
        matches = startup_taints(await read_node(client, self.node_name), self.taint_key)
        if not matches:
            return False
        await client.request("PATCH", f"/api/v1/nodes/{self.node_name}",
                             body=removal_patch(matches), content_type=JSON_PATCH,
                             timeout=REQUEST_TIMEOUT)
        self.removals += 1
        log.info("removed startup taint %s from node %s", self.taint_key, self.node_name)
        return True

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.on_change()
