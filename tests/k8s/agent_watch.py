"""The agent's own pod watch, on a real table, pointed at the real API server.

Built the way tests/control/test_pod_watch.py builds it against the emulator: the real
``ApiSource`` and ``NodeModel`` writing a real shared-memory table; only the credential
manager (STS, another component) is replaced by a sink that hands out one slot per role. The
watcher reaches the API server through a kubeconfig, the way an operator configures it,
holding the agent's ServiceAccount token, never the test's admin one.
"""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from kiamfast import table as tablemod
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.k8s.source import ApiSource
from kiamfast.control.mappings.policy import RolePolicy

BASE = "arn:aws:iam::123456789012:role/"
ROLE_KEY = "iam.amazonaws.com/role"
NS_KEY = "iam.amazonaws.com/allowed-roles"
ROLE, NO_ROLE, DENIED = tablemod.POD_ROLE, tablemod.POD_NO_ROLE, tablemod.POD_DENIED


class RoleSlots:
    """Stands in for the credential manager: one credential slot per (role, external id)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, Any], int] = {}
        self.lock = threading.Lock()

    def acquire(self, pod_uid: str, req: Any) -> int:
        with self.lock:
            return self.slots.setdefault((req.role_arn, req.external_id or None), len(self.slots))

    def release(self, pod_uid: str) -> None:
        pass

    def slot_for(self, role: str) -> int:
        return self.slots[(BASE + role, None)]


class AgentWatch:
    """``async with AgentWatch(...) as w``: a synced watcher; ``w.at(ip)`` reads the table."""

    def __init__(self, *, kubeconfig: Path, table: tablemod.Table, node: str,
                 policy: dict[str, Any] | None = None, sync_timeout: float = 15.0,
                 **watch_kw: Any) -> None:
        self.table = table
        self.slots = RoleSlots()
        self.model = NodeModel(policy=RolePolicy(**{"base_role_arn": BASE, **(policy or {})}),
                               table=table, sink=self.slots)
        watch_kw.setdefault("backoff", (0.05, 0.5))
        self.watcher = ApiSource.connect(kubeconfig=str(kubeconfig), model=self.model,
                                         node=node, **watch_kw)
        self.sync_timeout = sync_timeout
        self.synced = False

    async def __aenter__(self) -> "AgentWatch":
        self.task = asyncio.create_task(self.watcher.run())
        self.synced = await self.watcher.wait_synced(self.sync_timeout)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.watcher.stop()
        await asyncio.wait_for(self.task, 10)

    def at(self, ip: str) -> tuple[str, int, int] | None:
        """What a worker finds for ``ip``: (pod uid, pod state, credential slot) or None."""
        found = self.table.lookup_pod(tablemod.ip_key(ip))
        if found is None:
            return None
        uid, state, slot = found
        return (uid.decode() if isinstance(uid, bytes) else uid, state, slot)

    def stats(self) -> dict[str, Any]:
        return self.watcher.stats()

    async def until(self, predicate, *, what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                             f"watcher: {self.stats()}")


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))
