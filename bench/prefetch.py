"""Prefetch and refresh cost of the credential manager, against moto's STS behind a proxy.

Two questions, answered as ratios against baselines computed in the same run:

1. **Cold node**: how long until 250 pods with 40 roles all have credentials in the table,
   with 100 ms of STS latency (injected by the fault proxy)? The ideal is what the limits
   allow: ``max(ceil(calls / concurrency) x latency, (calls - burst) / qps)``. The ratio
   measured / ideal is the manager's own overhead (scheduling, botocore, rendering, writes).
2. **Churn**: STS calls per hour on a node whose pods come and go (simulated clock, 6 h),
   against kube2iam's policy on the same pod events (a 15 min cache per role, misses filled
   at request time; pods ask at start and every 15 min, when botocore's 30 min credentials
   reach their refresh window), for kiamfast's ``node-role`` and ``pod`` session policies.

``python bench/prefetch.py`` prints the markdown tables; tests/bench/test_bench_prefetch.py
runs a small version of each and asserts correctness only, never timing.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import sys
import tempfile
import time

from kiamfast import table as tbl
from kiamfast.control.iam.keys import CredentialRequest
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.iam.sts import StsClient
from kiamfast.testing.sts import FaultProxy, ManualClock, MotoSts

from benchutil import aws_env  # static credentials, never the real metadata service

BASE = "arn:aws:iam::123456789012:role/"


@contextlib.contextmanager
def sandbox(*, clock=None, latency: float = 0.0, pool: int = 16):
    """moto + fault proxy + STS client + a table file, torn down afterwards."""
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("kiamfast.audit").setLevel(logging.WARNING)
    with aws_env(), MotoSts() as moto, \
            FaultProxy(moto.url, clock=clock, latency=latency) as proxy, \
            tempfile.TemporaryDirectory() as tmp:
        sts = StsClient(endpoint_url=proxy.url, max_attempts=1, max_pool_connections=pool)
        table = tbl.Table.create(os.path.join(tmp, "table"), ip_capacity=4096,
                                 cred_capacity=1024, value_size=8192, aux_count=1,
                                 aux_size=4096, max_workers=1)
        try:
            yield proxy, sts, table
        finally:
            sts.close()
            table.close()


# ---- 1. cold node -------------------------------------------------------------------------------

def ideal_prefetch(calls: int, *, latency: float, concurrency: int, qps: float,
                   burst: int) -> float:
    by_concurrency = math.ceil(calls / concurrency) * latency
    by_rate = max(0.0, (calls - burst) / qps) + latency
    return max(by_concurrency, by_rate)


def prefetch(pods: int, roles: int, *, latency: float, qps: float, burst: int,
             max_inflight: int) -> dict:
    async def run(proxy, sts, table) -> dict:
        done = asyncio.Event()
        mgr: CredentialManager | None = None

        def notify():
            if mgr is not None and mgr.stats()["keys_ready"] == roles:
                done.set()

        mgr = CredentialManager(table=table, sts=sts, capacity=1024, notify=notify,
                                node_name="node-1", base_role_arn=BASE, qps=qps, burst=burst,
                                max_inflight=max_inflight)
        task = asyncio.create_task(mgr.run())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        slots = {}
        for i in range(pods):
            r = CredentialRequest(role_arn=f"{BASE}role-{i % roles}", namespace="ns",
                                  pod_name=f"pod-{i}", service_account="sa")
            slots[f"uid-{i}"] = mgr.acquire(f"uid-{i}", r)
        await asyncio.wait_for(done.wait(), 120)
        elapsed = time.perf_counter() - t0
        mgr.close()
        await task
        states = {table.read_cred(s)[0] for s in slots.values()}
        return {"elapsed": elapsed, "slots": len(set(slots.values())), "states": states,
                "calls": len(proxy.assume_role_calls()), "max_inflight": proxy.max_inflight}

    with sandbox(latency=latency) as (proxy, sts, table):
        out = asyncio.run(run(proxy, sts, table))
        bare = bare_client(sts, roles, concurrency=max_inflight)
    out["ideal"] = ideal_prefetch(roles, latency=latency, concurrency=max_inflight, qps=qps,
                                  burst=burst)
    # The same calls from a bare thread pool (no manager), under the same rate limit bound:
    # what this machine, botocore and moto allow at best.
    out["baseline"] = max(bare, max(0.0, (roles - burst) / qps) + bare / math.ceil(
        roles / max_inflight))
    out["ratio"] = out["elapsed"] / out["ideal"]
    out["ratio_baseline"] = out["elapsed"] / out["baseline"]
    return out


def bare_client(sts: StsClient, calls: int, *, concurrency: int) -> float:
    """Seconds for ``calls`` AssumeRole calls from ``concurrency`` plain threads."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda i: sts.assume_role_sync(f"{BASE}bare-{i}", "bare"), range(calls)))
        return time.perf_counter() - t0


# ---- 2. churn -----------------------------------------------------------------------------------

def churn_events(*, roles: int, pods: int, hours: float, mean_life: float,
                 seed: int = 7) -> list[tuple[float, str, str, int]]:
    """(time, "start"|"stop", pod uid, role index): a steady population of ``pods`` pods,
    each living an exponential time (mean ``mean_life``), replaced at once by a new pod of
    the same role; role popularity is skewed (Zipf-like) so some roles often have no pod."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(roles)]
    end = hours * 3600
    events = []
    uid = 0
    for _ in range(pods):
        t = 0.0
        role = rng.choices(range(roles), weights)[0]
        while t < end:
            uid += 1
            life = rng.expovariate(1 / mean_life)
            events.append((t, "start", f"uid-{uid}", role))
            if t + life < end:
                events.append((t + life, "stop", f"uid-{uid}", role))
            t += life + rng.uniform(0, 30)  # the replacement starts a little later
            role = rng.choices(range(roles), weights)[0]
    events.sort(key=lambda e: (e[0], e[1] == "start"))
    return events


def kube2iam_calls(events, *, hours: float, ttl: float = 900.0, ask_every: float = 900.0) -> int:
    """kube2iam 0.15 on the same pod events: cache by role ARN with TTL ``ttl``; a pod asks
    at start and then every ``ask_every`` seconds while alive; every miss is one call."""
    end = hours * 3600
    asks = []
    starts = {}
    for t, kind, uid, role in events:
        if kind == "start":
            starts[uid] = (t, role)
        else:
            t0, role = starts.pop(uid)
            asks.extend((a, role) for a in _ticks(t0, t, ask_every))
    for uid, (t0, role) in starts.items():
        asks.extend((a, role) for a in _ticks(t0, end, ask_every))
    asks.sort()
    cached_until: dict[int, float] = {}
    calls = 0
    for t, role in asks:
        if cached_until.get(role, -1.0) <= t:
            calls += 1
            cached_until[role] = t + ttl
    return calls


def _ticks(start: float, stop: float, every: float):
    t = start
    while t < stop:
        yield t
        t += every


def churn(events, *, hours: float, policy: str, step: float = 60.0) -> dict:
    clock = ManualClock()

    async def run(proxy, sts, table) -> dict:
        mgr = CredentialManager(table=table, sts=sts, capacity=1024, node_name="node-1",
                                base_role_arn=BASE, session_policy=policy, qps=50, burst=50,
                                clock=clock.time, sleep=clock.sleep)
        task = asyncio.create_task(mgr.run())
        start = clock.time()
        i = 0
        t = 0.0
        served_short = 0
        while t <= hours * 3600:
            while i < len(events) and events[i][0] <= t:
                _, kind, uid, role = events[i]
                if kind == "start":
                    mgr.acquire(uid, CredentialRequest(role_arn=f"{BASE}role-{role}",
                                                       namespace="ns", pod_name=uid))
                else:
                    mgr.release(uid)
                i += 1
            for _ in range(2):
                await asyncio.sleep(0.002)
                await mgr.drain(timeout=30)
            # correctness: no READY slot past its serve_until, every serve_until >= 15 min
            for slot in range(table.layout["cred_capacity"]):
                state, until, _ = table.read_cred(slot)
                if state == tbl.CRED_READY and until < clock.time():
                    served_short += 1
            clock.advance(step)
            t = clock.time() - start
        stats = mgr.stats()
        mgr.close()
        await task
        return {"calls": len(proxy.assume_role_calls()), "stats": stats,
                "served_short": served_short}

    with sandbox(clock=clock.time) as (proxy, sts, table):
        proxy.clock = clock.time
        out = asyncio.run(run(proxy, sts, table))
    out["per_hour"] = out["calls"] / hours
    return out


# ---- the report ---------------------------------------------------------------------------------

def main() -> None:
    latency = 0.1
    print("## Cold node: 250 pods, 40 roles, STS latency 100 ms\n")
    print("ideal = max(ceil(40 / in-flight) x 100 ms, (40 - burst) / qps + 100 ms); bare = "
          "the same 40 calls from a plain thread pool of the same size, no manager (bounded "
          "by the same rate formula).\n")
    print("| limits | STS calls | max in flight | time | ideal | ratio | bare | ratio to bare |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, qps, burst, inflight in (("defaults (5 qps, burst 20, 8 in flight)", 5, 20, 8),
                                        ("relaxed (100 qps, burst 40, 8 in flight)", 100, 40, 8),
                                        ("relaxed (100 qps, burst 40, 16 in flight)", 100, 40,
                                         16)):
        out = prefetch(250, 40, latency=latency, qps=qps, burst=burst, max_inflight=inflight)
        assert out["states"] == {tbl.CRED_READY} and out["calls"] == 40
        print(f"| {label} | {out['calls']} | {out['max_inflight']} | {out['elapsed']:.3f} s | "
              f"{out['ideal']:.3f} s | {out['ratio']:.2f} | {out['baseline']:.3f} s | "
              f"{out['ratio_baseline']:.2f} |")
    sys.stdout.flush()

    hours = 6.0
    print(f"\n## Churn: 250 pods, 40 roles (skewed), mean pod life 20 min, {hours:.0f} h "
          "simulated\n")
    events = churn_events(roles=40, pods=250, hours=hours, mean_life=1200)
    starts = sum(1 for e in events if e[1] == "start")
    k2i = kube2iam_calls(events, hours=hours) / hours
    print(f"{starts} pod starts ({starts / hours:.0f}/h).\n")
    print("| policy | STS calls / h | vs kube2iam (15 min cache per role) | served < 15 min |")
    print("|---|---:|---:|---:|")
    print(f"| kube2iam 0.15 model | {k2i:.1f} | 1.00 | (up to 30 min) |")
    for policy in ("node-role", "pod"):
        out = churn(events, hours=hours, policy=policy)
        print(f"| kiamfast {policy} | {out['per_hour']:.1f} | {out['per_hour'] / k2i:.2f} | "
              f"{out['served_short']} |")


if __name__ == "__main__":
    main()
