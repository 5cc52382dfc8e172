"""The node's side of the account's STS budget: throttling answers, the node's adaptive
rate, its share of the fleet's budget, and keys a pod is waiting for.

Calls are counted by the fault proxy; time is a ManualClock (the proxy's budget runs on it).
"""
from __future__ import annotations

import botocore.retries.standard
import pytest

from kiamfast import table as tbl
from kiamfast.config import Config
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.iam.schedule import node_share
from kiamfast.budget import TokenBucket
from kiamfast.control.iam.sts import StsClient, StsThrottled
from kiamfast.testing.sts import ManualClock

from metric_samples import Samples
from test_manager import manual, settle, walk

ROLE = "arn:aws:iam::123456789012:role/app"


# ---- the budget proxy answers as STS does -------------------------------------------------------

def test_the_budget_answers_stss_throttling_error_that_botocore_classifies_as_such(proxy):
    clock = ManualClock()
    proxy.clock = clock.time
    proxy.set_budget(10, burst=10)
    client = StsClient(endpoint_url=proxy.url, max_attempts=1)
    try:
        outcomes = []
        for i in range(15):      # the clock stands still: 10 fit, 5 are over the budget
            try:
                client.assume_role_sync(ROLE, f"n{i}")
                outcomes.append("ok")
            except StsThrottled as exc:
                outcomes.append(exc)
        clock.advance(0.5)       # half a second: 5 more tokens
        more = []
        for i in range(6):
            try:
                client.assume_role_sync(ROLE, f"m{i}")
                more.append("ok")
            except StsThrottled:
                more.append("throttled")
        raw = client._client
        with pytest.raises(raw.exceptions.ClientError) as info:
            raw.assume_role(RoleArn=ROLE, RoleSessionName="raw")
    finally:
        client.close()
    assert outcomes[:10] == ["ok"] * 10
    assert all(isinstance(o, StsThrottled) and o.code == "Throttling" and o.status == 400
               and o.message == "Rate exceeded" for o in outcomes[10:])
    assert more == ["ok"] * 5 + ["throttled"]
    err = info.value.response
    assert err["Error"]["Code"] == "Throttling" and err["Error"]["Type"] == "Sender"
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 400
    # botocore's own retry logic sees a throttle (it would back off and take retry quota)
    context = botocore.retries.standard.RetryContext(attempt_number=1, parsed_response=err)
    assert botocore.retries.standard.ThrottledRetryableChecker().is_retryable(context)
    assert [c.outcome for c in proxy.assume_role_calls()].count("throttle") == 7


def test_the_sts_client_sends_a_throttled_call_once(proxy):
    """botocore retrying a throttled call would bypass the node's limiter and land again on
    an account that just said slow down: the manager does all the retrying."""
    proxy.add_fault("throttle")
    client = StsClient(endpoint_url=proxy.url)     # production defaults
    try:
        with pytest.raises(StsThrottled):
            client.assume_role_sync(ROLE, "n1")
    finally:
        client.close()
    assert len(proxy.assume_role_calls()) == 1


# ---- the node's rate ----------------------------------------------------------------------------

def test_the_bucket_halves_its_rate_once_per_window_and_gets_it_back():
    clock = ManualClock(start=1000.0)
    bucket = TokenBucket(8.0, 4, clock=clock.time, sleep=clock.sleep)
    tickets = []
    for _ in range(4):
        assert bucket.try_take() == 0
        tickets.append(bucket.tickets)
    for t in tickets:              # four calls out together, all throttled: one cut
        bucket.slow_down(t)
    assert bucket.rate == 4.0
    clock.advance(1.0)
    assert bucket.try_take() == 0
    bucket.slow_down(bucket.tickets)   # a call sent after the cut: cut again
    assert bucket.rate == 2.0
    for _ in range(10):
        assert bucket.try_take() <= 1.0
        clock.advance(1.0)
        bucket.slow_down(bucket.tickets)
    assert bucket.rate == 8.0 / 16     # the floor
    bucket.speed_up()
    assert bucket.rate == 0.5 + 1.0
    for _ in range(10):
        bucket.speed_up()
    assert bucket.rate == 8.0


def test_throttling_lowers_the_nodes_rate_and_successes_raise_it(h):
    clock = manual(h)
    registry = Samples()
    h.proxy.add_fault("throttle", count=1)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, qps=8, burst=1,
                             max_inflight=1, registry=registry) as mgr:
            gauge = lambda: registry.get_sample_value("kiamfast_sts_rate_limit")  # noqa: E731
            assert gauge() == 8.0
            slots = [mgr.acquire(f"uid-{i}", h.req(f"r{i}")) for i in range(4)]
            await settle(mgr)
            after_throttle = gauge()
            await walk(mgr, clock, 30, step=0.25)
            return slots, after_throttle, gauge()

    slots, after_throttle, at_end = h.run(main())
    assert after_throttle == 4.0
    outcomes = [c.outcome for c in h.proxy.assume_role_calls()]
    assert outcomes == ["throttle"] + ["ok"] * 4
    assert at_end == 8.0          # four successes: 4 + 4 x 1
    assert all(h.state(s)[0] == tbl.CRED_READY for s in slots)


# ---- the fleet's share --------------------------------------------------------------------------

def test_the_node_share_of_the_account_budget():
    assert node_share(600, 2000, 5.0) == pytest.approx(0.3)
    assert node_share(600, 10, 5.0) == 5.0          # never more than --sts-qps
    assert node_share(0, 0, 5.0) == 5.0             # no fleet budget
    with pytest.raises(ValueError):
        node_share(600, 0, 5.0)


def test_from_config_never_throttles_the_node_below_its_share(h):
    config = Config(node="n1", host_ip="10.0.0.1", sts_account_qps=600.0,
                    sts_fleet_nodes=2000)
    mgr = CredentialManager.from_config(config, table=h.table, sts=h.sts, notify=h.notify)
    # it starts at its share (test_fleet_arrival.py), and may probe up to --sts-qps later
    assert (mgr.bucket.rate, mgr.bucket.min_rate) == (pytest.approx(0.3), pytest.approx(0.3))
    assert mgr.bucket.max_rate == 5.0
    mgr.bucket.rate = 5.0
    for ticket in range(1, 20):
        mgr.bucket.slow_down(ticket)
    assert mgr.bucket.rate == pytest.approx(0.3)
    from_api = CredentialManager.from_config(config, table=h.table, sts=h.sts,
                                             notify=h.notify, fleet_nodes=300)
    assert from_api.bucket.min_rate == pytest.approx(2.0)
    alone = CredentialManager.from_config(Config(node="n1", host_ip="10.0.0.1"),
                                          table=h.table, sts=h.sts, notify=h.notify)
    assert (alone.bucket.rate, alone.bucket.min_rate) == (5.0, 5.0 / 16)


# ---- keys a pod is waiting for ------------------------------------------------------------------

def test_a_waited_for_key_stays_first_through_a_throttle(h):
    """A pod asked for w; w's call was throttled. When the pause ends, w goes before the
    prefetches queued meanwhile, without the pod having to ask again."""
    clock = manual(h)
    w = h.role("w")
    h.proxy.add_fault("throttle", roles=[w], count=1)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, qps=2, burst=1,
                             max_inflight=1) as mgr:
            slot = mgr.acquire("uid-w", h.req("w"))
            await settle(mgr)                       # w goes at once and is throttled
            mgr.wanted(slot)                        # its pod asks during the pause
            for i in range(5):
                mgr.acquire(f"uid-{i}", h.req(f"r{i}"))
            await walk(mgr, clock, 2, step=0.1)
            return [(c.role_arn, c.outcome) for c in h.proxy.assume_role_calls()]

    calls = h.run(main())
    assert calls[:2] == [(w, "throttle"), (w, "ok")]


def test_waiting_keys_are_counted_until_servable(h):
    clock = manual(h)
    registry = Samples()
    h.proxy.add_fault("5xx", roles=[h.role("a")], count=1)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, registry=registry,
                             backoff_base=1.0) as mgr:
            gauge = lambda: registry.get_sample_value("kiamfast_sts_waiting_keys")  # noqa: E731
            a = mgr.acquire("uid-a", h.req("a"))
            b = mgr.acquire("uid-b", h.req("b"))
            await settle(mgr)                       # a failed, b is ready
            mgr.wanted(a)
            mgr.wanted(b)                           # a stale read: b is servable
            waiting = (gauge(), mgr.stats()["waiting_keys"])
            await walk(mgr, clock, 3, step=0.25)
            return a, waiting, gauge()

    a, waiting, after = h.run(main())
    assert waiting == (1.0, 1)
    assert after == 0.0 and h.state(a)[0] == tbl.CRED_READY


def test_a_key_whose_pods_are_gone_is_not_waited_for(h):
    registry = Samples()
    h.proxy.add_fault("5xx")

    async def main():
        async with h.manager(registry=registry) as mgr:
            a = mgr.acquire("uid-a", h.req("a"))
            await settle(mgr)
            mgr.wanted(a)
            waiting = registry.get_sample_value("kiamfast_sts_waiting_keys")
            mgr.release("uid-a")
            return waiting, registry.get_sample_value("kiamfast_sts_waiting_keys")

    assert h.run(main()) == (1.0, 0.0)


def test_a_key_a_pod_asks_for_goes_at_once_while_prefetch_waits_for_tokens(h):
    """b's prefetch waits for the node's next token (2 s away); b's pod asks: the worker
    holds its request for only the wait budget, so b goes now, on a borrowed token."""
    clock = manual(h)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, qps=0.5, burst=1) as mgr:
            mgr.acquire("uid-a", h.req("a"))
            b = mgr.acquire("uid-b", h.req("b"))
            await settle(mgr)                        # a took the token, b waits for one
            before = h.state(b)[0]
            mgr.wanted(b)
            await settle(mgr)                        # the clock has not moved
            return before, b, mgr.bucket.tokens

    before, b, tokens = h.run(main())
    assert before == tbl.CRED_PENDING
    assert h.state(b)[0] == tbl.CRED_READY
    assert [c.outcome for c in h.proxy.assume_role_calls()] == ["ok", "ok"]
    assert tokens == pytest.approx(-1.0)             # paid back by the next two seconds


def test_a_throttled_call_a_pod_waits_for_retries_once_within_the_wait(h):
    """w's pod asked; w's call was throttled and the node pauses (at least 0.5 s).  The
    request is held for 0.35 s: w retries once, 50-150 ms later, and the pod is served."""
    clock = manual(h)
    w = h.role("w")
    h.proxy.add_fault("throttle", roles=[w], count=1)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep) as mgr:
            slot = mgr.acquire("uid-w", h.req("w"))
            mgr.wanted(slot)                         # asked before the first call went
            await walk(mgr, clock, 0.3, step=0.05)
            return slot, mgr.stats()["throttle_paused_for"]

    slot, paused_for = h.run(main())
    assert h.state(slot)[0] == tbl.CRED_READY
    assert [c.outcome for c in h.proxy.assume_role_calls()] == ["throttle", "ok"]
    assert paused_for > 0                            # the node's prefetch still pauses


def test_a_pod_asking_again_and_again_never_takes_the_node_past_its_rate(h):
    """An app retrying every 0.4 s for a role STS keeps throttling: borrowed tokens are
    debt the rate pays back (at most a burst's worth ahead), so no herd."""
    clock = manual(h)
    h.proxy.add_fault("throttle", roles=[h.role("w")])

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, qps=1, burst=2) as mgr:
            slot = mgr.acquire("uid-w", h.req("w"))
            for _ in range(75):
                mgr.wanted(slot)
                await walk(mgr, clock, 0.4, step=0.05)

    h.run(main())
    calls = len(h.proxy.assume_role_calls())
    # 30 s at most 1/s, the burst saved up at the start and a burst's worth of debt
    assert 2 <= calls <= 30 + 2 + 2
