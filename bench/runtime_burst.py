"""First calls when many pods start at once on a slow runtime (issue 20, item 8).

``pods`` new sandboxes appear at once in the CRI fault double, whose every PodSandboxStatus
takes ``delay`` (a busy runtime); each new pod's first connection arrives within ``spread``
after that and calls ``RuntimePoller.need(T)`` as the control process does for a worker's
``R`` message. Measured per pod: from T to the applied view with started_ns >= T that
shows the pod's sandbox as the owner of its address (what the worker waits for before it
answers). Compare with ``--wait-budget`` (0.35 s), the Go SDK's ~0.4 s and botocore's 1 s.
Only the public surface is used (RuntimeClient(endpoint), RuntimePoller(client, on_view=,
on_state=), need()), so the same script measures an older runtime.py put first on
PYTHONPATH.

    python bench/runtime_burst.py [--pods 50] [--delay 0.03] [--spread 0.1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import numpy as np

from kiamfast.control.cri.client import RuntimeClient
from kiamfast.control.cri.poller import RuntimePoller
from kiamfast.testing.cri_fault import CriFault, fake_sandbox


class Views:
    def __init__(self) -> None:
        self.waiters: list[tuple[int, str, asyncio.Future]] = []

    def on_view(self, view) -> None:
        now = time.monotonic_ns()
        for after_ns, ip, future in self.waiters:
            if view.started_ns >= after_ns and not future.done():
                future.set_result((now, ip in view.owners))
        self.waiters = [w for w in self.waiters if not w[2].done()]

    async def first_call(self, poller: RuntimePoller, ip: str, at: float) -> tuple[float, bool]:
        """(seconds from need(T) to the view that answers it, whether it shows the pod)."""
        await asyncio.sleep(at)
        after_ns = time.monotonic_ns()
        future = asyncio.get_running_loop().create_future()
        self.waiters.append((after_ns, ip, future))
        poller.need(after_ns)
        applied_ns, shown = await asyncio.wait_for(future, 30)
        return (applied_ns - after_ns) / 1e9, shown


async def burst(runtime: CriFault, poller: RuntimePoller, views: Views, *, pods: int,
                delay: float, spread: float, rng: random.Random, round_: int
                ) -> list[tuple[float, bool]]:
    new = [fake_sandbox(name=f"burst-{round_}-{i}",
                        ip=f"10.{100 + round_}.{i // 250}.{i % 250 + 1}") for i in range(pods)]
    runtime.fault("PodSandboxStatus", delay=delay)
    runtime.put(*new)
    results = await asyncio.gather(*(views.first_call(poller, s.ip, rng.uniform(0, spread))
                                     for s in new))
    runtime.clear_faults()
    for s in new:
        runtime.remove(s.id)
    await asyncio.sleep(1.2)   # a periodic poll forgets them before the next round
    return results


async def run(*, pods: int, delay: float, spread: float, rounds: int, seed: int) -> list:
    rng = random.Random(seed)
    with CriFault() as runtime:
        runtime.put(*(fake_sandbox(name=f"steady-{i}", ip=f"10.99.0.{i + 1}") for i in range(10)))
        client = RuntimeClient(runtime.endpoint)
        views = Views()
        poller = RuntimePoller(client, on_view=views.on_view, on_state=lambda ok, why: None)
        task = asyncio.create_task(poller.run())
        await asyncio.sleep(0.5)
        results = []
        for n in range(rounds):
            results += await burst(runtime, poller, views, pods=pods, delay=delay,
                                   spread=spread, rng=rng, round_=n)
        task.cancel()
        client.close()
        return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=50)
    ap.add_argument("--delay", type=float, default=0.03, help="s per PodSandboxStatus")
    ap.add_argument("--spread", type=float, default=0.1, help="s over which connections come")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    results = asyncio.run(run(pods=args.pods, delay=args.delay, spread=args.spread,
                              rounds=args.rounds, seed=args.seed))
    ms = np.array([s for s, _ in results]) * 1e3
    missing = sum(not shown for _, shown in results)
    p50, p99 = np.percentile(ms, [50, 99])
    over = int((ms > 350).sum())
    print(f"{args.pods} pods at once x {args.rounds} rounds, PodSandboxStatus "
          f"{args.delay * 1e3:.0f} ms, connections within {args.spread * 1e3:.0f} ms: "
          f"need(T) -> view: p50 {p50:.0f} ms, "
          f"p99 {p99:.0f} ms, max {ms.max():.0f} ms; over 350 ms: {over}/{ms.size}; "
          f"view without the pod: {missing}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
