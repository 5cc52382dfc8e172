"""A removed pod never comes back, however long ago it was removed, and the model keeps
nothing per removed pod to ensure it: a pod it does not know whose object is older than
its newest removal is a removed pod's late copy (docs/architecture.md, "Nothing kept per
pod").  It kept each removed pod's UID instead, the last 16,384 of them."""
from __future__ import annotations

import asyncio

from kiamfast import table as tbl
from kiamfast.testing.pod_churn import churn_node

CHURNED = ["10.0.1.2", "10.0.1.3"]


def owner(node, ip: str) -> str | None:
    found = node.table.lookup_pod(tbl.ip_key(ip))
    if found is None:
        return None
    uid = found[0]
    return uid.decode() if isinstance(uid, bytes) else uid


def test_a_late_copy_of_a_pod_deleted_20000_pods_ago_never_brings_it_back():
    async def scenario() -> None:
        async with churn_node(rate=20.0) as node:
            node.start(CHURNED)
            first = node.live[CHURNED[0]]
            late = node.api_object(first, phase="Running", ip=first.ip)   # then delayed
            await node.run(20_001, churned=CHURNED)
            pods = len(node.model.pods)
            node.model.apply_pod(late)
            node.model.commit()
            assert node.model.decision(first.uid) is None
            assert len(node.model.pods) == pods
            assert owner(node, first.ip) == node.live[first.ip].uid

    asyncio.run(scenario())


def test_a_pod_a_relist_no_longer_shows_stays_gone_and_newer_pods_come():
    async def scenario() -> None:
        async with churn_node() as node:
            node.start(CHURNED)
            kept = node.live[CHURNED[1]]
            gone = node.stop_sandbox(CHURNED[0])
            late = node.api_object(gone, phase="Running", ip=gone.ip)
            # The watch missed gone's delete (410): the relist shows only kept.
            listed = node.api_object(kept, phase="Running", ip=kept.ip)
            node.model.replace_pods([listed], list_rv=int(listed["metadata"]["resourceVersion"]))
            node.model.apply_pod(late)
            node.model.commit()
            assert node.model.decision(gone.uid) is None
            # A pod written after the list is new, never a late copy.
            fresh = node.add(gone.ip)
            assert node.model.decision(fresh.uid) is not None
            assert owner(node, gone.ip) == fresh.uid

    asyncio.run(scenario())
