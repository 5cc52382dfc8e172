"""The cluster's objects in the API server emulator, changed from Python by a test:
``ApiServer.namespaces``, ``.nodes`` and ``.pods``.

Each change is one event in the emulator's store (ADDED, MODIFIED or DELETED), which every
matching watch receives in order. Over HTTP the emulator serves reads and PATCH only
(apiserver_http.py); objects are created and deleted here, as the kubelet and the
controllers of a real cluster would.
"""

from __future__ import annotations

import uuid
from typing import Callable

from kiamfast.testing.apiserver_objects import (
    make_namespace,
    make_node,
    make_pod,
    node_address,
    now_rfc3339,
    set_annotations,
    set_status_ips,
)
from kiamfast.testing.apiserver_store import NotFoundError, Store

__all__ = ["Namespaces", "Nodes", "Pods"]


class Namespaces:
    """``api.namespaces``: add a namespace, set its annotations."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def add(self, name: str, *, annotations: dict | None = None) -> dict:
        """Create the namespace, or (if it exists) set its annotations when given."""
        with self._store.lock:
            if self._store.get("Namespace", ("", name)) is not None:
                if annotations is None:
                    return self._store.copy_of("Namespace", ("", name))
                return self.set_annotations(name, annotations)
            return self._store.create("Namespace", make_namespace(
                name, uid=str(uuid.uuid4()), annotations=annotations))

    def set_annotations(self, name: str, annotations: dict | None) -> dict:
        """Replace the namespace's annotations (MODIFIED)."""
        return self._store.modify("Namespace", ("", name),
                                  lambda o: set_annotations(o["metadata"], annotations))


class Nodes:
    """``api.nodes``: add a node, read it, set its Ready condition or its taints."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._seq = 0

    def add(self, name: str, *, taints: list | None = None,
            address: str | None = None) -> dict:
        """Create a Ready node (or replace an existing node's taints when given)."""
        with self._store.lock:
            if self._store.get("Node", ("", name)) is not None:
                if taints is None:
                    return self.get(name)
                return self.set_taints(name, taints)
            self._seq += 1
            seq = self._seq
            address = address or f"172.31.{(seq >> 8) & 255}.{seq & 255}"
            return self._store.create("Node", make_node(
                name, uid=str(uuid.uuid4()), taints=taints, address=address))

    def get(self, name: str) -> dict:
        node = self._store.copy_of("Node", ("", name))
        if node is None:
            raise NotFoundError(f'nodes "{name}" not found')
        return node

    def set_ready(self, name: str, status: str, *,
                  message: str = "kubelet is posting ready status") -> dict:
        """The kubelet's Ready condition: "True", "False" (e.g. "container runtime is
        down") or "Unknown"; its lastTransitionTime moves only when the status changes."""
        def fn(o: dict) -> None:
            for cond in o.setdefault("status", {}).setdefault("conditions", []):
                if cond.get("type") == "Ready":
                    now = now_rfc3339()
                    if cond.get("status") != status:
                        cond["lastTransitionTime"] = now
                    cond.update(status=status, message=message, lastHeartbeatTime=now)
        return self._store.modify("Node", ("", name), fn)

    def set_taints(self, name: str, taints: list | None) -> dict:
        def fn(o: dict) -> None:
            if taints:
                o.setdefault("spec", {})["taints"] = [dict(t) for t in taints]
            else:
                o.setdefault("spec", {}).pop("taints", None)
        return self._store.modify("Node", ("", name), fn)


class Pods:
    """``api.pods``: create a pod bound to a node, change what its kubelet would write
    (addresses, phase), its annotations, begin or finish its deletion, read it."""

    def __init__(self, store: Store, namespaces: Namespaces) -> None:
        self._store = store
        self._namespaces = namespaces

    def create(self, namespace: str, name: str, *, node: str,
               annotations: dict | None = None, ips: list[str] | None = None,
               phase: str = "Pending", host_network: bool = False,
               uid: str | None = None) -> dict:
        """Create a pod bound to ``node`` (ADDED); a missing namespace is created first."""
        st = self._store
        with st.lock:
            if st.get("Namespace", ("", namespace)) is None:
                self._namespaces.add(namespace)
            node_obj = st.get("Node", ("", node))
            pod = make_pod(namespace, name, uid=uid or str(uuid.uuid4()), node=node,
                           annotations=annotations, ips=list(ips) if ips else None,
                           phase=phase, host_network=host_network,
                           host_ip=node_address(node_obj.obj if node_obj else None))
            return st.create("Pod", pod)

    def _change(self, namespace: str, name: str, fn: Callable[[dict], None]) -> None:
        self._store.modify("Pod", (namespace, name), fn)

    def set_ips(self, namespace: str, name: str, ips: list[str] | None) -> None:
        """Set ``status.podIP(s)`` (MODIFIED); None or [] clears them."""
        ips = list(ips) if ips else None
        self._change(namespace, name, lambda o: set_status_ips(o["status"], ips))

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        self._change(namespace, name, lambda o: o["status"].__setitem__("phase", phase))

    def set_annotations(self, namespace: str, name: str, annotations: dict | None) -> None:
        """Replace the pod's annotations."""
        self._change(namespace, name, lambda o: set_annotations(o["metadata"], annotations))

    def mark_terminating(self, namespace: str, name: str) -> None:
        """Set ``metadata.deletionTimestamp`` (a graceful delete has begun)."""
        ts = now_rfc3339()

        def fn(o: dict) -> None:
            o["metadata"].setdefault("deletionTimestamp", ts)
            o["metadata"].setdefault("deletionGracePeriodSeconds", 30)
        self._change(namespace, name, fn)

    def delete(self, namespace: str, name: str) -> None:
        """Delete the pod (DELETED)."""
        self._store.delete("Pod", (namespace, name))

    def get(self, namespace: str, name: str) -> dict | None:
        return self._store.copy_of("Pod", (namespace, name))
