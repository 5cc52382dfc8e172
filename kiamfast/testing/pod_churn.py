"""One node's pods replaced through the control process's own rooms, in one process.

What an agent keeps per pod after the pod is gone is measured here (tests/memory,
bench/memory_per_pod.py): nothing of the control process is stubbed.  The node model
(:class:`~kiamfast.control.mappings.model.NodeModel`) is fed pod objects as the API source
feeds them (ADDED/MODIFIED through ``apply_pod``, DELETED through ``delete_pod``, each
object with the next resourceVersion) and runtime views as the runtime source feeds them
(``apply_runtime``: the READY sandboxes, as the CRI client builds them); behind it the
credential manager calls STS through botocore (moto behind the fault proxy, on loopback);
both write a real table; every publish renders what the control process publishes for the
workers (metrics, denials, ``/debug/store``) into it, and each new pod's decision is read
as the token path reads it.

A replacement follows the kubelet's order on a real node, the address reused at once:

1. pod B is created (Pending, no address: scheduled), and its credentials prefetched;
2. pod A, holding address X, starts terminating;
3. the runtime's next view shows A's sandbox gone and B's READY with X;
4. the API shows A Succeeded, then deleted;
5. the API shows B Running with X.

Time is a :class:`~kiamfast.testing.sts.ManualClock` moved ``1 / rate`` per replacement, so
hours of churn (credential refreshes, release grace periods, error TTLs) pass in seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kiamfast import table as tbl
from kiamfast.control.cri.client import RuntimeView, Sandbox
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.control.iam.sts import StsClient
from kiamfast.control.mappings import report
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.publish.blobs import AuxPublisher
from kiamfast.testing.aws_env import offline
from kiamfast.testing.sts import ManualClock, StsSandbox

BASE_ARN = "arn:aws:iam::123456789012:role/"
ROLE_KEY = "iam.amazonaws.com/role"
NAMESPACE = "churn"
PUBLISH_EVERY = 2.0      # seconds of the node's time, as the control process publishes


@dataclass
class Live:
    uid: str
    name: str
    role: str
    ip: str
    sandbox: Sandbox


@dataclass
class ChurnNode:
    """The rooms of one node's control process and the pods it holds (see the module
    docstring).  Build it with :func:`churn_node`."""

    model: NodeModel
    manager: CredentialManager
    table: tbl.Table
    clock: ManualClock
    sts: StsSandbox
    roles: int
    rate: float
    aux: AuxPublisher = field(init=False)
    live: dict[str, Live] = field(default_factory=dict)   # ip -> the pod holding it
    replaced: int = 0
    _rv: int = 0
    _seq: int = 0
    _published_at: float = 0.0

    def __post_init__(self) -> None:
        self.aux = AuxPublisher(self.table)
        self._published_at = self.clock()

    # ---- what the sources feed --------------------------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def api_object(self, p: Live, *, phase: str, ip: str | None,
                   terminating: bool = False) -> dict[str, Any]:
        """The pod as the API shows it now: its next version (resourceVersion)."""
        meta: dict[str, Any] = {"uid": p.uid, "namespace": NAMESPACE, "name": p.name,
                                "resourceVersion": str(self._next_rv()),
                                "creationTimestamp": "2025-01-01T00:00:00Z",
                                "annotations": {ROLE_KEY: p.role}}
        if terminating:
            meta["deletionTimestamp"] = "2025-01-01T01:00:00Z"
        status: dict[str, Any] = {"phase": phase}
        if ip is not None:
            status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
        return {"metadata": meta, "status": status,
                "spec": {"nodeName": "churn-node", "serviceAccountName": "default"}}

    def _view(self) -> RuntimeView:
        owners = {p.ip: p.sandbox for p in self.live.values()}
        return RuntimeView(started_ns=time.monotonic_ns(),
                           sandboxes=tuple(owners.values()),
                           owners=MappingProxyType(owners), conflicts=frozenset())

    def _new(self, ip: str) -> Live:
        self._seq += 1
        n = self._seq
        uid = f"{n:08x}-{os.getpid() & 0xffff:04x}-4000-8000-{n:012x}"
        name = f"job-{n}"
        role = BASE_ARN + f"role-{n % self.roles}"
        sandbox = Sandbox(id=f"{n:064x}", pod_uid=uid, name=name, namespace=NAMESPACE,
                          ips=(ip,), annotations=MappingProxyType({ROLE_KEY: role}),
                          created_ns=time.time_ns())
        return Live(uid=uid, name=name, role=role, ip=ip, sandbox=sandbox)

    def start(self, addresses: list[str]) -> None:
        """The node's first pods, each on its address (listed, synced, in the first view)."""
        pods = [self._new(ip) for ip in addresses]
        self.model.replace_pods([], list_rv=self._next_rv())
        self.model.set_synced(True)
        for p in pods:
            self.model.apply_pod(self.api_object(p, phase="Running", ip=p.ip))
            self.live[p.ip] = p
        self.model.apply_runtime(self._view())
        self.model.commit()

    def replace(self, ip: str) -> None:
        """One replacement on ``ip`` (the module docstring's five steps; the events the
        API source reads together are committed together, as it does)."""
        m = self.model
        old = self.live[ip]
        new = self._new(ip)
        m.apply_pod(self.api_object(new, phase="Pending", ip=None))                       # 1.
        m.apply_pod(self.api_object(old, phase="Running", ip=ip, terminating=True))       # 2.
        m.commit()
        self.live[ip] = new                                                         # 3.
        m.apply_runtime(self._view())
        m.commit()
        m.apply_pod(self.api_object(old, phase="Succeeded", ip=ip, terminating=True))     # 4.
        m.delete_pod(self.api_object(old, phase="Succeeded", ip=ip, terminating=True))
        m.apply_pod(self.api_object(new, phase="Running", ip=ip))                         # 5.
        m.commit()
        m.decision(new.uid)                   # what the token path reads
        self.replaced += 1

    def add(self, ip: str) -> Live:
        """A new pod on the free address ``ip``: scheduled, its sandbox READY, Running."""
        new = self._new(ip)
        self.model.apply_pod(self.api_object(new, phase="Pending", ip=None))
        self.model.commit()
        self.live[ip] = new
        self.model.apply_runtime(self._view())
        self.model.apply_pod(self.api_object(new, phase="Running", ip=ip))
        self.model.commit()
        return new

    def stop_sandbox(self, ip: str) -> Live:
        """The runtime stops the sandbox holding ``ip`` (its next view shows it gone); the
        API is not told.  Returns the pod."""
        p = self.live.pop(ip)
        self.model.apply_runtime(self._view())
        self.model.commit()
        return p

    # ---- time passing -----------------------------------------------------------------------

    def publish(self) -> None:
        """What the control process does every couple of seconds: expire, then publish the
        texts workers serve (control/process.py's ``_expire`` and ``_publish``)."""
        self.model.expire()
        self.model.commit()
        self.manager.reclaim()
        text = "\n".join(self.manager.metrics.metric_lines()).encode()
        self.aux.metrics(text, b"")
        self.aux.denials(report.denials(self.model))
        self.aux.debug_store(report.debug_store(self.model))
        report.counters(self.model)
        self.manager.stats()

    async def run(self, count: int, *, churned: list[str]) -> None:
        """Replace ``count`` pods, round robin over the addresses ``churned``, at ``rate``
        replacements per second of the node's time."""
        for i in range(count):
            self.replace(churned[i % len(churned)])
            self.clock.advance(1.0 / self.rate)
            if self.clock() - self._published_at >= PUBLISH_EVERY:
                self._published_at = self.clock()
                self.publish()
            await asyncio.sleep(0)            # the manager's calls and timers run
            if not self.manager.settled:
                await self.manager.drain(30)

    async def settle(self, seconds: float) -> None:
        """Let ``seconds`` of the node's time pass with no replacement (timers fire)."""
        step = min(1.0, seconds)
        waited = 0.0
        while waited < seconds:
            self.clock.advance(step)
            waited += step
            for _ in range(3):
                await asyncio.sleep(0)
            await self.manager.drain(30)
        self.publish()


@contextlib.asynccontextmanager
async def churn_node(*, roles: int = 5, rate: float = 20.0, session_policy: str = "node-role",
                     capacity: int = 64, ip_capacity: int = 1024,
                     **manager_args: Any) -> AsyncIterator[ChurnNode]:
    """A :class:`ChurnNode` on a fresh table with its own STS, run on the current loop."""
    clock = ManualClock()
    path = tempfile.mktemp(prefix="kiamfast-churn-", dir="/dev/shm"
                           if os.path.isdir("/dev/shm") else None)
    with offline(), StsSandbox(clock=clock) as sts_sandbox:
        table = tbl.Table.create(path, ip_capacity=ip_capacity, cred_capacity=capacity,
                                 value_size=8192, aux_count=tbl.AUX_COUNT,
                                 aux_size=1 << 18, max_workers=1)
        sts = StsClient(endpoint_url=sts_sandbox.endpoint_url, region="us-east-1",
                        max_attempts=1)
        refs: Counter = Counter()
        manager = CredentialManager(table=table, sts=sts, capacity=capacity, clock=clock,
                                    sleep=clock.sleep, node_name="churn-node",
                                    session_policy=session_policy, slot_refs=refs,
                                    **{"qps": 1000.0, "burst": 1000, **manager_args})
        runner = asyncio.create_task(manager.run())
        model = NodeModel(policy=RolePolicy(base_role_arn=BASE_ARN), table=table, sink=manager,
                          clock=clock, slot_refs=refs, expect_runtime=True)
        try:
            yield ChurnNode(model=model, manager=manager, table=table, clock=clock,
                            sts=sts_sandbox, roles=roles, rate=rate)
        finally:
            manager.close()
            await asyncio.gather(runner, return_exceptions=True)
            sts.close()
            table.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
