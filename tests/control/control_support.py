"""Helpers of the pod-watch tests: a credential-sink double, a clock, pod and namespace objects."""
from __future__ import annotations

import threading
from typing import Any

from kiamfast import table as tablemod

BASE = "arn:aws:iam::123456789012:role/"
ROLE_KEY = "iam.amazonaws.com/role"
EXT_KEY = "iam.amazonaws.com/external-id"
NS_KEY = "iam.amazonaws.com/allowed-roles"


class SlotSink:
    """Stands in for the credential manager (another team's component): one slot per
    (role, external id), handed out in order; remembers who holds what."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, Any], int] = {}
        self.holders: dict[str, tuple[str, Any]] = {}
        self.requests: dict[str, Any] = {}
        self.log: list[tuple[str, str]] = []
        self.fail = False
        self.lock = threading.Lock()

    def acquire(self, pod_uid: str, req: Any) -> int:
        with self.lock:
            if self.fail:
                raise RuntimeError("no credential slots left")
            key = (req.role_arn, req.external_id or None)
            slot = self.slots.setdefault(key, len(self.slots))
            self.holders[pod_uid] = key
            self.requests[pod_uid] = req
            self.log.append(("acquire", pod_uid))
            return slot

    def release(self, pod_uid: str) -> None:
        with self.lock:
            self.holders.pop(pod_uid, None)
            self.log.append(("release", pod_uid))

    def role_of_slot(self, slot: int) -> tuple[str, Any] | None:
        with self.lock:
            return next((key for key, s in self.slots.items() if s == slot), None)

    def slot_for(self, role: str, external_id: Any = None) -> int:
        return self.slots[(role, external_id)]


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Kernel:
    """The node's kernel as `kiamfast.control.netns.watch.NetnsWatch` reports it: which
    network namespace holds which address now (the real watch is tested against the real
    kernel in tests/netns).  A sandbox's namespace is named by its ``netns`` path."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}      # namespace path -> addresses configured

    def add(self, netns: str, *ips: str) -> None:
        self.held.setdefault(netns, set()).update(ips)

    def remove(self, netns: str, *ips: str) -> None:
        self.held.get(netns, set()).difference_update(ips)

    def delete(self, netns: str) -> None:
        self.held.pop(netns, None)

    def addresses_of(self, sandbox: Any) -> frozenset[str] | None:
        if sandbox.netns not in self.held:
            return None
        return frozenset(ip for ip in self.held[sandbox.netns]
                         if sum(ip in held for held in self.held.values()) == 1)


def sandbox(uid: str, *ips: str, annotations: dict[str, str] | None = None,
            netns: str | None = None, sandbox_id: str | None = None) -> Any:
    """A READY sandbox as the runtime client reports it (its namespace ``ns-<uid>``)."""
    from kiamfast.control.cri.client import Sandbox
    return Sandbox(id=sandbox_id or f"sb-{uid}", pod_uid=uid, name=f"pod-{uid}",
                   namespace="default", ips=tuple(ips), annotations=dict(annotations or {}),
                   created_ns=0, netns=netns if netns is not None else f"ns-{uid}")


def runtime_view(*sandboxes: Any, started_ns: int = 1_000) -> Any:
    from kiamfast.control.cri.client import RuntimeView
    return RuntimeView(started_ns=started_ns, sandboxes=tuple(sandboxes),
                       owners={ip: sb for sb in sandboxes for ip in sb.ips},
                       conflicts=frozenset())


def pod(uid: str, *, ns: str = "default", name: str | None = None, ips: tuple[str, ...] = (),
        phase: str = "Running", rv: int = 1, created: str = "2024-01-01T00:00:00Z",
        role: str | None = None, ext: str | None = None, terminating: bool = False,
        host_network: bool = False, node: str = "node-1",
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod object as the API server sends it (only the fields kiamfast reads, plus a few)."""
    ann = dict(annotations or {})
    if role is not None:
        ann[ROLE_KEY] = role
    if ext is not None:
        ann[EXT_KEY] = ext
    meta: dict[str, Any] = {"uid": uid, "namespace": ns, "name": name or f"pod-{uid}",
                            "resourceVersion": str(rv), "creationTimestamp": created,
                            "annotations": ann}
    if terminating:
        meta["deletionTimestamp"] = "2024-01-01T01:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if ips:
        status["podIP"] = ips[0]
        status["podIPs"] = [{"ip": ip} for ip in ips]
    return {"metadata": meta, "spec": {"nodeName": node, "hostNetwork": host_network,
                                       "serviceAccountName": "sa"}, "status": status}


def namespace(name: str, annotations: dict[str, str] | None = None, rv: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(rv),
                         "annotations": dict(annotations or {})}}


def lookup(t: tablemod.Table, ip: str):
    """What a worker would find for `ip`: (uid, state, slot) or None."""
    found = t.lookup_pod(tablemod.ip_key(ip))
    if found is None:
        return None
    uid, state, slot = found
    return (uid.decode() if isinstance(uid, bytes) else uid, state, slot)
