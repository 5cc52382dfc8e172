"""A node arriving with its fleet: within its share of the account's STS budget from its
first call, above it only after a calm minute, and its calls earliest deadline first.

Calls are counted and dated by the fault proxy on a ManualClock (its budget runs on it too).
"""
from __future__ import annotations

import pytest

from kiamfast import table as tbl
from kiamfast.control.iam.schedule import HEADROOM, PROBE_AFTER

from test_manager import manual, settle, walk

FLEET = {"qps": 5.0, "burst": 20, "account_qps": 600.0, "fleet_nodes": 2000}   # share 0.3/s


def _ok_calls(h) -> list:
    return [c for c in h.proxy.assume_role_calls() if c.outcome == "ok"]


def test_a_node_arriving_with_its_fleet_calls_within_its_share_from_the_first_call(h):
    """Five roles at once on a node of 2,000 sharing 600 calls/s: one call at a random
    moment within the first 1/pace seconds, then one per 1/pace (the pace: 70 % of the
    0.3/s share); before, all five went at once, the burst, and 2,000 nodes at once
    throttled each other.  A pod that asks still gets its key at once."""
    clock = manual(h)
    t0 = clock.time()
    pace = (1 - HEADROOM) * 0.3

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, **FLEET) as mgr:
            slots = [mgr.acquire(f"uid-{i}", h.req(f"r{i}")) for i in range(5)]
            await walk(mgr, clock, 12.0, step=0.1)
            paced = len(_ok_calls(h))
            waiting = [s for s in slots if h.state(s)[0] == tbl.CRED_PENDING]
            if not waiting:
                return paced, None, mgr.bucket.rate
            mgr.wanted(waiting[0])                   # its pod asks: served within the wait
            await settle(mgr)
            return paced, h.state(waiting[0])[0], mgr.bucket.rate

    paced, asked, rate = h.run(main())
    times = [c.clock_at - t0 for c in _ok_calls(h)]
    assert times[0] < 1 / pace + 0.11
    gaps = [b - a for a, b in zip(times, times[1:paced])]
    assert gaps and all(g == pytest.approx(1 / pace, abs=0.11) for g in gaps)
    assert paced == 1 + int((12.0 - times[0]) * pace + 0.02)
    assert len(times) == paced + 1 and times[-1] == pytest.approx(12.0)  # the asked-for one
    assert asked == tbl.CRED_READY
    assert rate == pytest.approx(0.3)              # successes do not raise it yet


def test_a_fleet_node_probes_above_its_share_only_after_a_calm_minute(h):
    clock = manual(h)
    h.proxy.add_fault("throttle", roles=[h.role("late")], count=1)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, **FLEET) as mgr:
            rates = []
            mgr.acquire("uid-0", h.req("early"))
            await settle(mgr)
            rates.append(mgr.bucket.rate)          # a success in the first minute
            await walk(mgr, clock, PROBE_AFTER + 1, step=5.0)
            mgr.acquire("uid-1", h.req("calm"))
            await settle(mgr)
            rates.append(mgr.bucket.rate)          # a success after a calm minute
            mgr.acquire("uid-2", h.req("late"))    # throttled: halved, the minute restarts
            await walk(mgr, clock, 5.0, step=0.1)
            rates.append(mgr.bucket.rate)          # its retry succeeded: no increase
            await walk(mgr, clock, PROBE_AFTER, step=5.0)
            mgr.acquire("uid-3", h.req("again"))
            await settle(mgr)
            rates.append(mgr.bucket.rate)
            return rates

    rates = h.run(main())
    probed = 0.3 + 5.0 / 8
    assert rates == [pytest.approx(0.3), pytest.approx(probed), pytest.approx(probed / 2),
                     pytest.approx(probed / 2 + 5.0 / 8)]
    assert [c.outcome for c in h.proxy.assume_role_calls()] == ["ok", "ok", "throttle", "ok",
                                                                "ok"]


def test_the_share_follows_the_node_count_both_ways_until_the_node_probes(h):
    async def main():
        async with h.manager(qps=5.0, burst=20, account_qps=600.0, fleet_nodes=0) as mgr:
            seen = [mgr.bucket.rate]               # no count yet: the floor without one
            mgr.set_fleet_nodes(100)               # 6/s each: capped at --sts-qps
            seen.append(mgr.bucket.rate)
            mgr.set_fleet_nodes(2000)              # more nodes joined: down to 0.3/s
            seen.append(mgr.bucket.rate)
            return seen

    assert h.run(main()) == [5.0 / 16, 5.0, pytest.approx(0.3)]


def test_calls_go_earliest_deadline_first(h):
    """a is throttled; b and c arrive during the pause, and c's pod then has an address (it
    can ask at any moment, b's cannot yet).  After the pause: c, then a (its pod came first,
    its retry keeps its place), then b."""
    clock = manual(h)
    h.proxy.add_fault("throttle", roles=[h.role("a")], count=1)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, qps=1.0, burst=1,
                             max_inflight=1) as mgr:
            mgr.acquire("uid-a", h.req("a", pod="a"))
            await settle(mgr)                      # a went and was throttled
            clock.advance(0.1)
            mgr.acquire("uid-b", h.req("b", pod="b"))
            clock.advance(0.1)
            mgr.acquire("uid-c", h.req("c", pod="c"))
            clock.advance(0.1)
            mgr.acquire("uid-c", h.req("c", pod="c", ip="10.0.0.3"))   # its sandbox is up
            await walk(mgr, clock, 10.0, step=0.05)      # the rate was halved: 0.5/s

    h.run(main())
    assert [c.role_arn.rsplit("/", 1)[1] for c in _ok_calls(h)] == ["c", "a", "b"]
