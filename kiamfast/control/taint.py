"""Removing this node's startup taint once the agent is ready.

A new node registers with the taint ``kiamfast.io/agent-not-ready`` (kubelet
``--register-with-taints``, Karpenter ``startupTaints``, a managed node group's taints). No
ordinary pod tolerates it, so none can start, ask 169.254.169.254 and get the node's own role
or no credentials, before the agent on that node is serving. The agent tolerates it, starts,
installs the DNAT rule, syncs, prefetches, and then calls :func:`remove_startup_taint`.

The removal is one JSON patch on the agent's own Node: for every taint with our key, a
``test`` of the exact entry (as read) and a ``remove`` of it. Other controllers edit the same
list concurrently (the node lifecycle controller adds and removes ``node.kubernetes.io/*``
taints, Karpenter and Cilium their own); if the list changed between our read and our patch
the ``test`` fails, nothing is written, and we read again and retry. A resourceVersion
precondition would not do: the kubelet's status updates bump it every few seconds.

The control process calls :meth:`TaintRemoval.remove_until_done` once it is ready. It never
gives up: while the API server refuses (down, RBAC not applied yet, a webhook failing) the
node stays tainted and no pod can land on it, so every attempt that fails is followed by
another after a jittered exponential backoff (capped at a minute), logged once per episode
of failures. Its ``state`` is what ``/healthz`` reports: ``disabled``, ``pending`` (not
ready yet), ``retrying: <error>`` or ``removed``.

This module must never add taints, touch taints with other keys, or remove ours before the
caller decided the agent is ready. It needs ``get`` and ``patch`` on ``nodes``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from typing import Any, Awaitable, Callable

__all__ = ["TaintError", "TaintRemoval", "remove_startup_taint", "startup_taints"]

log = logging.getLogger("kiamfast.taint")

JSON_PATCH = "application/json-patch+json"
# The patch's test failed or the object changed under us: read again.
_RETRYABLE = frozenset({400, 409, 422, 429, 500, 503, 504})


class TaintError(Exception):
    """The startup taint could not be removed (node missing, no permission, persistent race)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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


def _status(exc: Exception) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _explain(exc: Exception, node_name: str, action: str) -> TaintError:
    status = _status(exc)
    if status == 404:
        return TaintError(f"node {node_name!r} not found (is --node right?)", status=status)
    if status in (401, 403):
        return TaintError(f"not allowed to {action} node {node_name!r} (the agent's "
                          f"ClusterRole needs get and patch on nodes): {exc}", status=status)
    return TaintError(f"could not {action} node {node_name!r}: {exc}", status=status)


def _describe(exc: Exception, node_name: str) -> str:
    """One line for the log and /healthz (an ApiException's text spans headers and body)."""
    status = _status(exc)
    if status == 404:
        return f"node {node_name!r} not found (is --node right?)"
    if status in (401, 403):
        return (f"HTTP {status}: not allowed to patch node {node_name!r} (the agent's "
                "ClusterRole needs get and patch on nodes)")
    if status is not None:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".rstrip()
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def read_node(api: Any, node_name: str, timeout: float) -> dict[str, Any]:
    response = api.read_node(node_name, _preload_content=False, _request_timeout=timeout)
    return json.loads(response.data)


def _remove_once(api: Any, node_name: str, taint_key: str, timeout: float) -> bool:
    """One read and one patch: True if removed, False if absent; raises the API's error."""
    matches = startup_taints(read_node(api, node_name, timeout), taint_key)
    if not matches:
        return False
    api.patch_node(node_name, removal_patch(matches), _content_type=JSON_PATCH,
                   _preload_content=False, _request_timeout=timeout)
    log.info("removed startup taint %s from node %s", taint_key, node_name)
    return True


def remove_startup_taint(api: Any, node_name: str, taint_key: str, *, attempts: int = 8,
                         timeout: float = 10.0) -> bool:
    """Remove every taint with ``taint_key`` from node ``node_name``.

    ``api`` is a ``kubernetes.client.CoreV1Api``. Returns True if this call removed the
    taint, False if it was not there (or someone else removed it first). Raises
    :class:`TaintError` if the node is missing, RBAC forbids it, or the race with other
    writers is lost ``attempts`` times in a row.
    """
    if not taint_key:
        return False
    last: Exception | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(2.0, 0.05 * (2 ** attempt)) * random.uniform(0.5, 1.0))
        try:
            node = read_node(api, node_name, timeout)
        except Exception as exc:  # ApiException, urllib3 errors
            if _status(exc) in _RETRYABLE or _status(exc) is None and attempt + 1 < attempts:
                last = exc
                continue
            raise _explain(exc, node_name, "read") from exc
        matches = startup_taints(node, taint_key)
        if not matches:
            if attempt:
                log.info("startup taint %s on node %s was removed by someone else",
                         taint_key, node_name)
            return False
        try:
            api.patch_node(node_name, removal_patch(matches), _content_type=JSON_PATCH,
                           _preload_content=False, _request_timeout=timeout)
        except Exception as exc:
            status = _status(exc)
            if status in _RETRYABLE or status is None:
                # The taint list changed between our read and our patch (test failed), or
                # a transient error: read again.
                log.debug("removing startup taint from %s: retrying after %s", node_name, exc)
                last = exc
                continue
            raise _explain(exc, node_name, "patch") from exc
        log.info("removed startup taint %s from node %s", taint_key, node_name)
        return True
    raise TaintError(f"could not remove taint {taint_key!r} from node {node_name!r} after "
                     f"{attempts} attempts: {last}", status=_status(last) if last else None)


Sleep = Callable[[float], Awaitable[None]]


class TaintRemoval:
    """The startup taint's removal, retried until done; ``state`` is for ``/healthz``."""

    FIRST_BACKOFF = 0.1   # a lost race with another controller is retried almost at once
    MAX_BACKOFF = 60.0

    def __init__(self, node_name: str, taint_key: str, *, timeout: float = 10.0,
                 sleep: Sleep = asyncio.sleep) -> None:
        self.node_name = node_name
        self.taint_key = taint_key
        self.timeout = timeout
        self._sleep = sleep
        self.attempts = 0
        self.state = "pending" if node_name and taint_key else "disabled"

    async def remove_until_done(self, api: Any) -> None:
        """Remove the taint from the node (``api``: a ``CoreV1Api``), retrying until it is
        gone or found absent. Never raises; cancel it to stop."""
        if self.state == "disabled":
            return
        loop = asyncio.get_running_loop()
        backoff = self.FIRST_BACKOFF
        failing = False
        while True:
            self.attempts += 1
            try:
                removed = await loop.run_in_executor(
                    None, _remove_once, api, self.node_name, self.taint_key, self.timeout)
            except Exception as exc:  # ApiException, urllib3 and socket errors alike
                error = _describe(exc, self.node_name)
                self.state = f"retrying: {error}"
                if not failing:  # once per episode; the state keeps the latest error
                    log.warning("could not remove startup taint %s (will keep retrying): %s",
                                self.taint_key, error)
                    failing = True
                await self._sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.MAX_BACKOFF)
                continue
            if failing:
                log.info("startup taint %s of node %s is gone after %d attempts",
                         self.taint_key, self.node_name, self.attempts)
            elif not removed:
                log.info("node %s has no startup taint %s", self.node_name, self.taint_key)
            self.state = "removed"
            return
