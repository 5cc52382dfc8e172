"""Nothing kept per pod or per token the token server has seen, once they are gone (issue 45's
share for the token path): memory flat through thousands of replaced pods.

The real listener in this process, pods replaced through it over real connections
(token_churn.py: each pod's tokens reviewed, cached, rotated, forged, replayed after its
deletion; addresses reused; 20 pods a second on the churn's own clock), every allocation
seen by tracemalloc.  What a user checks: what the process holds after 3,000 more replaced
pods is what it held before (within a few hundred bytes a pod's worth of slack for the
caches' sweeps), and every answer was the one the pod should get.  Before, the verdict
caches, the per-pod answer budgets and the per-address budgets kept up to 4,096 entries
each (about 3.5 MiB), and a cached refusal's exception grew its traceback with every
request that raised it again.
"""
from __future__ import annotations

import asyncio
import gc
import tracemalloc

from token_churn import Churn

WARM = 500
MORE = 3_000
SLACK = 128 << 10        # the sweeps' slack (SWEEP_MIN verdicts) and the allocator's noise


def test_replacing_thousands_of_pods_keeps_nothing_per_pod():
    async def scenario() -> tuple[int, list[str], Churn]:
        async with Churn() as churn:
            await churn.replace(WARM)
            gc.collect()
            before = tracemalloc.take_snapshot()
            await churn.replace(MORE)
            gc.collect()
            after = tracemalloc.take_snapshot()
        diff = after.compare_to(before, "lineno")
        growth = sum(stat.size_diff for stat in diff)
        return growth, [str(stat) for stat in diff[:12]], churn

    tracemalloc.start(1)
    try:
        growth, top, churn = asyncio.run(scenario())
    finally:
        tracemalloc.stop()
    assert churn.replaced >= MORE and churn.wrong == 0, churn.statuses
    assert growth < SLACK, "\n".join([f"{growth} bytes kept over {MORE} pods", *top])
