"""Nothing kept per pod the node has ever seen: the control process's memory after pods are
replaced, through its real rooms in-process (kiamfast/testing/pod_churn.py: the node model
fed as the API and runtime sources feed it, the credential manager behind it calling moto's
STS through botocore, a real table, what the publish loop writes).

Memory is judged by what the control process's own code still holds after the replacements
and a quiet spell (grace periods over), compared with before them: tracemalloc's traces whose
allocating line is in kiamfast (the test doubles under kiamfast/testing, moto and botocore
left out).  Tracing costs about four times the work, so the 100,000 replacements are traced
for their first 20,000 (every structure that grows per pod grows there, those with a cap
included: 16,384 was the largest) and counted for all of them by the interpreter's live
blocks, the doubles' own records of each STS call emptied first.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import tracemalloc
import urllib.request

import pytest

from kiamfast.testing.pod_churn import churn_node

STEADY = ["10.0.1.1"]                     # a pod that stays
CHURNED = ["10.0.1.2", "10.0.1.3"]        # addresses reused by every replacement
OWN_CODE = [tracemalloc.Filter(True, "*/kiamfast/*"),
            tracemalloc.Filter(False, "*/kiamfast/testing/*")]


def retained(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> tuple[int, str]:
    """Bytes the control process's code allocated between the snapshots and still holds,
    and the largest sites (for the failure message)."""
    stats = after.filter_traces(OWN_CODE).compare_to(before.filter_traces(OWN_CODE), "lineno")
    top = "\n".join(str(s) for s in stats[:8] if s.size_diff > 0)
    return sum(s.size_diff for s in stats), top


async def traced_run(node, count: int) -> tuple[int, str]:
    """``count`` more pods replaced and a quiet spell, traced: what stays (``retained``)."""
    gc.collect()
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot()
        await node.run(count, churned=CHURNED)
        await node.settle(300)
        gc.collect()
        return retained(before, tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()


def live_blocks(node) -> int:
    """The interpreter's live blocks once the STS doubles forgot their calls."""
    node.sts.proxy.reset()
    urllib.request.urlopen(urllib.request.Request(node.sts.moto.url + "/moto-api/reset",
                                                  method="POST"), timeout=10).read()
    gc.collect()
    return sys.getallocatedblocks()


@pytest.mark.slow
def test_replacing_100000_pods_keeps_nothing_per_pod():
    async def scenario() -> None:
        async with churn_node(roles=5, rate=20.0) as node:
            node.start(STEADY + CHURNED)
            await node.run(2_000, churned=CHURNED)      # every structure at its working size
            await node.settle(300)
            blocks = live_blocks(node)
            traced, top = await traced_run(node, 20_000)
            await node.run(80_000, churned=CHURNED)
            await node.settle(300)
            grown = live_blocks(node) - blocks
            assert node.replaced == 102_000
            # Live state's own size moves by a few KiB (a refreshed key's credentials, a
            # dict that grew): under 1.6 bytes per replaced pod in all.
            assert traced < 32_000, f"{traced} bytes kept over 20,000 replaced pods:\n{top}"
            # A structure keeping one small object per pod would add 100,000 blocks.
            assert grown < 2_000, f"{grown} more live blocks after 100,000 replaced pods"

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_session_per_pod_leaves_no_key_behind():
    """--session-name-policy=pod (EKS's session tags likewise): every pod has a credential
    key of its own, fetched, then freed after the release grace.  A freed key and its
    credentials must not stay in the schedule's queue or timers."""
    async def scenario() -> None:
        async with churn_node(roles=3, rate=1.0, session_policy="pod") as node:
            node.start(STEADY + CHURNED)
            await node.run(300, churned=CHURNED)
            await node.settle(300)
            traced, top = await traced_run(node, 1_000)
            assert node.manager.stats()["sts_success"] >= 1_000     # a key per pod
            # A freed key with its credentials is about 700 bytes: a few dozen may wait in
            # a heap until it is rebuilt, never one per pod.
            assert traced < 100_000, f"{traced} bytes kept over 1,000 replaced pods:\n{top}"

    asyncio.run(scenario())
