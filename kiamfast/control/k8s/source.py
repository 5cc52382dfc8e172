"""The API server as the node model's source: this node's pods (``fieldSelector=
spec.nodeName=<node>``, as the kubelet; every pod without ``--node``, as kube2iam) and, when
the role policy reads them, the namespaces.

Each is a :class:`~kiamfast.control.k8s.watch.ResourceWatch` on the event loop; their events
go to the model as they arrive and one commit per loop iteration follows (a burst read at
once costs one).  Namespaces are listed before pods when they matter, so no pod is judged
against a namespace not yet seen (at most ``namespace_wait``: a namespace list that fails
must not keep the pods away).  Synced = the initial lists applied; the control process waits
for it before it reports ready.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kiamfast.control.k8s.watch import ResourceWatch, WatchTimings

log = logging.getLogger("kiamfast.watch")


class Model(Protocol):
    """What the source feeds (kiamfast.control.mappings.model.NodeModel)."""

    def apply_pod(self, obj: dict[str, Any]) -> None: ...
    def delete_pod(self, obj: dict[str, Any]) -> None: ...
    def replace_pods(self, items: list[dict[str, Any]], *, list_rv: int = 0) -> None: ...
    def apply_namespace(self, obj: dict[str, Any]) -> None: ...
    def replace_namespaces(self, items: list[dict[str, Any]]) -> None: ...
    def set_synced(self, synced: bool) -> None: ...
    def commit(self) -> bool: ...


class ApiSource:
    """List + watch of the node's pods (and namespaces when needed), fed into ``model``."""

    def __init__(self, *, client: Any, model: Model, node: str | None,
                 watch_namespaces: bool, timings: WatchTimings | None = None,
                 namespace_wait: float = 10.0,
                 on_pod: Callable[[dict[str, Any]], None] | None = None,
                 on_error: Callable[[str], None] = lambda error: None) -> None:
        """``on_pod``: every pod applied; ``on_error``: the watch's error, "" once it
        answers again."""
        self.model = model
        self.namespace_wait = namespace_wait
        timings = timings or WatchTimings()
        self.pods = ResourceWatch(
            client=client, name="pods", path="/api/v1/pods",
            params={"fieldSelector": f"spec.nodeName={node}"} if node else {},
            on_list=self._pods_listed, on_event=self._pod_event, timings=timings)
        self.namespaces = ResourceWatch(
            client=client, name="namespaces", path="/api/v1/namespaces",
            on_list=self._namespaces_listed, on_event=self._namespace_event, timings=timings)
        self.timings = timings
        self.watch_namespaces = watch_namespaces
        self.on_pod = on_pod
        self.on_error = on_error
        for watch in (self.pods, self.namespaces):
            watch.on_state = self._state
        self.synced = asyncio.Event()
        self.sync_seconds: float | None = None
        self._started = time.monotonic()
        self._commit_scheduled = False
        self._stopping = asyncio.Event()
        self._own_client: Any = None

    @classmethod
    def connect(cls, *, model: Model, node: str | None, kubeconfig: str = "",
                api_server: str = "", api_token: str = "", insecure: bool = False,
                namespace_wait: float = 10.0, **timings: Any) -> "ApiSource":
        """A source with a client of its own (tests and tools), closed by :meth:`stop`."""
        from kiamfast.kube.client import Client
        from kiamfast.kube.config import load_config
        client = Client(load_config(kubeconfig=kubeconfig, api_server=api_server,
                                    api_token=api_token, insecure=insecure))
        source = cls(client=client, model=model, node=node,
                     watch_namespaces=model.policy.uses_namespaces,  # type: ignore[attr-defined]
                     timings=WatchTimings(**timings), namespace_wait=namespace_wait)
        source._own_client = client
        return source

    async def wait_synced(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self.synced.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        """End :meth:`run` (its watches' connections are closed)."""
        self._stopping.set()

    async def run(self) -> None:
        """The watches, until :meth:`stop` (or cancelled)."""
        self._started = time.monotonic()
        tasks = [asyncio.create_task(self._stopping.wait(), name="stop")]
        try:
            if self.watch_namespaces:
                tasks.append(asyncio.create_task(self.namespaces.run(),
                                                 name="namespace-watch"))
                try:
                    await asyncio.wait_for(self.namespaces.listed.wait(),
                                           self.namespace_wait)
                except asyncio.TimeoutError:
                    log.warning("namespaces not listed after %.0fs; listing pods anyway",
                                self.namespace_wait)
            tasks.append(asyncio.create_task(self.pods.run(), name="pod-watch"))
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()      # a watch that ended raised: let the caller see it
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._own_client is not None:
                await self._own_client.close()

    def stats(self) -> dict[str, int]:
        """The watches' counters, summed (kiamfast_watch_total{kind})."""
        out = dict(self.pods.counters)
        for k, v in self.namespaces.counters.items():
            out[k] = out.get(k, 0) + v
        return out

    # ---- events, on the loop ------------------------------------------------------------------

    def _pods_listed(self, items: list[dict[str, Any]], list_rv: int) -> None:
        self.model.replace_pods(items, list_rv=list_rv)
        if self.on_pod is not None:
            for obj in items:
                self.on_pod(obj)
        self._check_synced()

    def _namespaces_listed(self, items: list[dict[str, Any]], list_rv: int) -> None:
        self.model.replace_namespaces(items)
        self._check_synced()

    def _pod_event(self, typ: str, obj: dict[str, Any]) -> None:
        if typ == "DELETED":
            self.model.delete_pod(obj)
        else:
            self.model.apply_pod(obj)
            if self.on_pod is not None:
                self.on_pod(obj)
        self._commit_soon()

    def _state(self, error: str) -> None:
        self.on_error(error)

    def _namespace_event(self, typ: str, obj: dict[str, Any]) -> None:
        if typ != "DELETED":     # a deleted namespace keeps its rules (the model says why)
            self.model.apply_namespace(obj)
            self._commit_soon()

    def _check_synced(self) -> None:
        if not self.synced.is_set() and self.pods.listed.is_set() and (
                not self.watch_namespaces or self.namespaces.listed.is_set()):
            self.model.set_synced(True)
            self.sync_seconds = time.monotonic() - self._started
            log.info("synced: pods listed after %.3fs", self.sync_seconds)
            self.synced.set()
        self.model.commit()

    def _commit_soon(self) -> None:
        if not self._commit_scheduled:
            self._commit_scheduled = True
            asyncio.get_running_loop().call_soon(self._commit)

    def _commit(self) -> None:
        self._commit_scheduled = False
        self.model.commit()
