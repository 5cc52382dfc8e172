"""The credential manager against moto's STS (behind the fault proxy) and a real table file.

Calls are counted by the proxy, not by the manager; what is served is read back from the
table the way a worker reads it.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import Counter

import pytest

from kiamfast import table as tbl
from kiamfast import credential_parts
from kiamfast.control.iam.keys import fnv32a
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.iam.slots import CredentialSlotsExhausted
from kiamfast.testing.sts import ManualClock

from metric_samples import Samples

HOUR = 3600.0


async def settle(mgr, clock: ManualClock | None = None, seconds: float = 0.0):
    """Advance the manual clock (if any) and let the manager finish what became due."""
    if clock is not None and seconds:
        clock.advance(seconds)
    for _ in range(3):
        await asyncio.sleep(0.01)
        await mgr.drain(timeout=20)


async def walk(mgr, clock: ManualClock, seconds: float, step: float = 30.0):
    """Advance time in steps, letting the manager act at each one."""
    done = 0.0
    while done < seconds:
        d = min(step, seconds - done)
        await settle(mgr, clock, d)
        done += d


def manual(h):
    clock = ManualClock()
    h.proxy.clock = clock.time  # STS expirations follow the manual clock
    return clock


# ---- prefetch, single flight, isolation ---------------------------------------------------------

def test_prefetch_makes_the_slot_ready_before_any_request(h):
    async def main():
        async with h.manager() as mgr:
            slot = mgr.acquire("uid-1", h.req("app", pod="web-0"))
            assert h.state(slot)[0] == tbl.CRED_PENDING
            await h.wait_state(slot, tbl.CRED_READY)
            return mgr.stats(), slot

    stats, slot = h.run(main())
    (call,) = h.proxy.assume_role_calls()
    doc = h.document(slot)
    assert doc["Code"] == "Success" and doc["AccessKeyId"] == call.access_key_id
    assert call.role_arn == h.role("app") and call.session_name == "node-1-app"
    assert call.params["DurationSeconds"] == "3600"
    assert stats["sts_success"] == 1 and stats["keys_ready"] == 1
    assert h.notified >= 2  # pending, then ready


def test_a_pod_request_is_served_through_the_table(h):
    """The worker's view: IP -> pod -> slot -> the document, by the listed name."""
    async def main():
        async with h.manager() as mgr:
            slot = mgr.acquire("uid-1", h.req("team/app"))
            h.table.claim_ip("10.0.0.7", "uid-1", tbl.POD_ROLE, cred_slot=slot)
            await h.wait_state(slot, tbl.CRED_READY)

    h.run(main())
    out = bytearray(16384)
    key = tbl.ip_key("10.0.0.7")
    for name in (b"app", b"team/app", h.role("team/app").encode()):
        status, n = h.table.lookup(key, tbl.PART_DOCUMENT, out, match=name)
        assert status == tbl.READY
        assert credential_parts.parse_response(bytes(out[:n]))[0] == 200
    status, n = h.table.lookup(key, tbl.PART_DOCUMENT, out, match=b"other")
    assert status == tbl.MISMATCH
    status, n = h.table.lookup(key, tbl.PART_LISTING, out)
    assert credential_parts.parse_response(bytes(out[:n]))[2] == b"app"


def test_one_sts_call_for_a_hundred_concurrent_users_of_a_cold_key(h):
    h.proxy.latency = 0.3

    async def main():
        async with h.manager() as mgr:
            async def pod(i):
                await asyncio.sleep(0)
                slot = mgr.acquire(f"uid-{i}", h.req("app", pod=f"web-{i}"))
                for _ in range(5):
                    mgr.wanted(slot)
                    await asyncio.sleep(0.01)
                return slot

            slots = await asyncio.gather(*(pod(i) for i in range(100)))
            await h.wait_state(slots[0], tbl.CRED_READY)
            for s in set(slots):
                mgr.wanted(s)
            await settle(mgr)
            return set(slots), mgr.stats()

    slots, stats = h.run(main())
    assert len(slots) == 1
    assert len(h.proxy.assume_role_calls()) == 1
    assert stats["cache_hits"] == 99 and stats["pods"] == 100


def test_external_ids_are_isolated(h):
    async def main():
        async with h.manager() as mgr:
            a = mgr.acquire("uid-a", h.req("app", pod="a", external_id="ext-A"))
            b = mgr.acquire("uid-b", h.req("app", pod="b", external_id="ext-B"))
            c = mgr.acquire("uid-c", h.req("app", pod="c"))
            a2 = mgr.acquire("uid-a2", h.req("app", pod="a2", external_id="ext-A"))
            for s in (a, b, c):
                await h.wait_state(s, tbl.CRED_READY)
            return a, b, c, a2

    a, b, c, a2 = h.run(main())
    assert len({a, b, c}) == 3 and a2 == a
    keys = {h.document(s)["AccessKeyId"] for s in (a, b, c)}
    assert len(keys) == 3
    by_key = {call.access_key_id: call.external_id for call in h.proxy.assume_role_calls()}
    assert by_key[h.document(a)["AccessKeyId"]] == "ext-A"
    assert by_key[h.document(b)["AccessKeyId"]] == "ext-B"
    assert by_key[h.document(c)["AccessKeyId"]] is None
    assert len(h.proxy.assume_role_calls()) == 3


# ---- lifetime -----------------------------------------------------------------------------------

def test_rotation_at_half_life_and_identical_credentials_until_then(h):
    clock = manual(h)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, refresh_jitter=0.1) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            await settle(mgr)
            first = h.state(slot)
            start = clock.time()
            await walk(mgr, clock, 0.9 * 1800 - 60)  # before the earliest jittered refresh
            assert h.state(slot)[2] == first[2]      # the very same bytes
            assert len(h.proxy.assume_role_calls()) == 1
            await walk(mgr, clock, 300)               # past half-life (1800 s)
            second = h.state(slot)
            return start, first, second, mgr.stats()

    start, first, second, stats = h.run(main())
    calls = h.proxy.assume_role_calls()
    assert len(calls) == 2 and stats["refreshes"] == 1
    assert second[2] != first[2] and second[0] == tbl.CRED_READY
    assert second[1] > first[1]
    new = credential_parts.parse_response(second[2][tbl.PART_DOCUMENT])[2]
    assert calls[1].access_key_id.encode() in new


def test_nothing_is_served_with_less_than_min_lifetime_left(h):
    clock = manual(h)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            await settle(mgr)
            state, serve_until, parts = h.state(slot)
            doc = h.document(slot)
            return state, serve_until, doc

    state, serve_until, doc = h.run(main())
    expiration = dt.datetime.strptime(doc["Expiration"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=dt.timezone.utc).timestamp()
    assert state == tbl.CRED_READY
    assert abs(serve_until - (expiration - 900)) < 1.0


def test_workers_stop_serving_at_serve_until(h):
    """serve_until is enforced where workers read: here the manager's clock runs 40 min
    behind the real one, so credentials it still thinks fine have < 20 min left in real
    time, and with min_lifetime = 20 min the table reports them EXPIRED."""
    import time
    clock = ManualClock(start=time.time() - 2400)
    h.proxy.clock = clock.time

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, min_lifetime=1200) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            h.table.claim_ip("10.0.0.8", "uid-1", tbl.POD_ROLE, cred_slot=slot)
            await settle(mgr)
            return slot

    slot = h.run(main())
    state, serve_until, _ = h.state(slot)
    assert state == tbl.CRED_READY
    assert serve_until < time.time()
    status, _ = h.table.lookup(tbl.ip_key("10.0.0.8"), tbl.PART_DOCUMENT, bytearray(16384))
    assert status == tbl.EXPIRED


def test_credentials_that_arrive_too_short_are_never_published(h):
    clock = manual(h)
    h.proxy.clock = lambda: clock.time() - 3000  # STS returns 10 min of lifetime

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            await settle(mgr)
            return slot, mgr.describe(slot)

    slot, info = h.run(main())
    assert h.state(slot)[0] == tbl.CRED_ERROR
    assert info["last_error"] == "ShortLifetime"


def test_sts_down_keeps_cached_credentials_until_serve_until_then_error(h):
    clock = manual(h)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, refresh_jitter=0.0) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            await settle(mgr)
            first = h.state(slot)
            h.proxy.add_fault("down")
            await walk(mgr, clock, 1800 + 60)              # refresh fails, keeps failing
            mid = h.state(slot)
            failed = len(h.proxy.assume_role_calls(outcome="down"))
            await walk(mgr, clock, first[1] - clock.time() - 30)  # just before serve_until
            before = h.state(slot)
            await walk(mgr, clock, 60)                     # past it
            after = h.state(slot)
            h.proxy.clear_faults()
            await walk(mgr, clock, 60)                     # STS back: recovers
            recovered = h.state(slot)
            return first, mid, failed, before, after, recovered, mgr.stats()

    first, mid, failed, before, after, recovered, stats = h.run(main())
    assert failed >= 2                                     # it kept trying
    assert mid[0] == tbl.CRED_READY and mid[2] == first[2]
    assert before[0] == tbl.CRED_READY and before[2] == first[2]
    assert after[0] == tbl.CRED_ERROR
    assert recovered[0] == tbl.CRED_READY and recovered[2] != first[2]
    assert stats["expired"] == 1


def test_transient_error_on_first_fetch_is_an_error_slot_then_recovers(h):
    h.proxy.add_fault("5xx", count=1)

    async def main():
        async with h.manager(backoff_base=0.05) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            await h.wait_state(slot, tbl.CRED_ERROR)
            await h.wait_state(slot, tbl.CRED_READY)
            return slot

    h.run(main())
    assert [c.outcome for c in h.proxy.assume_role_calls()] == ["5xx", "ok"]


# ---- permanent errors ---------------------------------------------------------------------------

def test_access_denied_is_the_imds_error_document_cached_for_error_ttl(h):
    clock = manual(h)
    arn = h.role("locked")
    h.proxy.add_fault("deny", roles=[arn])

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, error_ttl=30) as mgr:
            slot = mgr.acquire("uid-1", h.req("locked"))
            await settle(mgr)
            state = h.state(slot)
            for _ in range(50):          # workers keep asking: nothing new within error_ttl
                mgr.wanted(slot)
            await walk(mgr, clock, 29, step=1)
            within = len(h.proxy.assume_role_calls())
            await walk(mgr, clock, 2, step=1)
            after_ttl = len(h.proxy.assume_role_calls())
            h.proxy.clear_faults()
            await walk(mgr, clock, 61, step=1)
            return slot, state, within, after_ttl

    slot, state, within, after_ttl = h.run(main())
    assert state[0] == tbl.CRED_READY
    status, _, body = credential_parts.parse_response(state[2][tbl.PART_DOCUMENT])
    assert status == 200 and b'"Code":"AssumeRoleUnauthorizedAccess"' in body
    assert credential_parts.parse_response(state[2][tbl.PART_LISTING])[2] == b"locked"
    assert b"not authorized" not in body  # STS's message (node identity) is not passed on
    assert within == 1 and after_ttl == 2
    assert h.document(slot)["Code"] == "Success"


def test_zero_error_ttl_still_has_a_floor(h):
    clock = manual(h)
    h.proxy.add_fault("deny")

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, error_ttl=0) as mgr:
            slot = mgr.acquire("uid-1", h.req("app"))
            await settle(mgr)
            for _ in range(40):
                mgr.wanted(slot)
                await settle(mgr, clock, 0.1)
            return len(h.proxy.assume_role_calls())

    assert h.run(main()) == 1  # 4 s of hammering: one call


# ---- rate limit and throttling ------------------------------------------------------------------

def test_storm_respects_the_rate_limit(h):
    qps, burst, inflight = 60.0, 10, 8

    async def main():
        async with h.manager(qps=qps, burst=burst, max_inflight=inflight) as mgr:
            slots = set()
            for i in range(1000):
                slots.add(mgr.acquire(f"uid-{i}", h.req(f"role-{i % 200}", pod=f"p{i}")))
            for s in slots:
                await h.wait_state(s, tbl.CRED_READY, timeout=60)
            return slots, mgr.stats()

    slots, stats = h.run(main(), timeout=120)
    assert len(slots) == 200
    calls = h.proxy.assume_role_calls()
    assert len(calls) == 200 and stats["sts_calls"] == 200
    assert h.proxy.max_inflight <= inflight
    for window in (0.5, 1.0, 2.0):
        # tokens are taken before the request leaves; in-flight calls may bunch on arrival
        assert h.proxy.max_in_window(window) <= burst + qps * window + inflight


def test_throttling_backs_off_globally_and_recovers(h):
    clock = manual(h)
    a, b = h.role("a"), h.role("b")
    h.proxy.add_fault("throttle", roles=[a], count=3)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, throttle_base=2.0,
                             throttle_max=60.0, qps=100, burst=100) as mgr:
            sa = mgr.acquire("uid-a", h.req("a"))
            await settle(mgr)
            assert len(h.proxy.assume_role_calls()) == 1
            sb = mgr.acquire("uid-b", h.req("b"))     # another key waits for the pause too
            # (no pod asks: a key a pod waits for goes on a borrowed token, test_budget.py)
            await settle(mgr, clock, 0.9)             # first pause >= 1 s
            assert len(h.proxy.assume_role_calls()) == 1
            pauses = []
            for _ in range(200):
                paused = mgr.stats()["throttle_paused_for"]
                if paused:
                    pauses.append(paused)
                await settle(mgr, clock, 0.25)
                if h.state(sa)[0] == tbl.CRED_READY and h.state(sb)[0] == tbl.CRED_READY:
                    break
            return sa, sb, mgr.stats()

    sa, sb, stats = h.run(main())
    calls = h.proxy.assume_role_calls()
    a_calls = [c for c in calls if c.role_arn == a]
    (b_call,) = [c for c in calls if c.role_arn == b]
    assert [c.outcome for c in a_calls] == ["throttle"] * 3 + ["ok"]
    assert b_call.outcome == "ok"
    assert stats["sts_throttled"] == 3 and stats["throttle_paused_for"] == 0
    # every retry of a waits for the node's pause (at least [1,2] s: base 2, equal jitter;
    # it doubles with consecutive throttles, a success in between starts it over) ...
    t = [c.clock_at for c in a_calls]
    assert all(later - earlier >= 1.0 for earlier, later in zip(t, t[1:]))
    # ... and b, queued during the first (global) pause, waited for it to end
    assert b_call.clock_at - t[0] >= 1.0


def test_wanted_slots_jump_the_prefetch_queue(h):
    clock = manual(h)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, qps=1, burst=1,
                             max_inflight=1) as mgr:
            slots = [mgr.acquire(f"uid-{i}", h.req(f"r{i}")) for i in range(10)]
            await settle(mgr)                 # r0 goes at once (the one burst token)
            mgr.wanted(slots[9])
            await walk(mgr, clock, 3, step=1)
            return [c.role_arn for c in h.proxy.assume_role_calls()]

    order = h.run(main())
    assert order[0] == h.role("r0") and order[1] == h.role("r9")
    assert order[2:] == [h.role("r1"), h.role("r2")]


# ---- release, reuse, capacity -------------------------------------------------------------------

def test_release_grace_reuse_and_free(h):
    clock = manual(h)

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, release_grace=60) as mgr:
            slot = mgr.acquire("uid-1", h.req("app", pod="web-0"))
            await settle(mgr)
            mgr.release("uid-1")
            await walk(mgr, clock, 50, step=10)
            again = mgr.acquire("uid-2", h.req("app", pod="web-0"))  # re-created pod
            await settle(mgr)
            calls_reused = len(h.proxy.assume_role_calls())
            mgr.release("uid-2")
            await walk(mgr, clock, 2 * HOUR, step=60)  # idle: no refresh, then freed
            return slot, again, calls_reused, mgr.stats()

    slot, again, calls_reused, stats = h.run(main())
    assert again == slot and calls_reused == 1
    assert len(h.proxy.assume_role_calls()) == 1
    assert h.state(slot)[0] == tbl.CRED_EMPTY
    assert stats["keys"] == 0 and stats["slots_free"] == h.capacity


def test_role_change_moves_the_pod_to_another_slot(h):
    async def main():
        async with h.manager() as mgr:
            a = mgr.acquire("uid-1", h.req("a"))
            b = mgr.acquire("uid-1", h.req("b"))
            await h.wait_state(b, tbl.CRED_READY)
            return a, b, mgr.stats()

    a, b, stats = h.run(main())
    assert a != b and stats["pods"] == 1 and stats["idle_keys"] == 1


def test_slots_run_out_only_when_every_key_is_live(h):
    async def main():
        async with h.manager(capacity=2) as mgr:
            mgr.acquire("uid-1", h.req("a"))
            mgr.acquire("uid-2", h.req("b"))
            with pytest.raises(CredentialSlotsExhausted):
                mgr.acquire("uid-3", h.req("c"))
            mgr.release("uid-1")            # idle in grace: may be evicted
            s = mgr.acquire("uid-3", h.req("c"))
            await h.wait_state(s, tbl.CRED_READY)
            return s, mgr.stats()

    s, stats = h.run(main())
    assert s in (0, 1) and stats["evicted"] == 1


def _slots(table):
    return [(i, *table.read_cred(i)) for i in range(table.layout["cred_capacity"])]


def test_restart_with_sts_down_keeps_serving_the_exact_credentials(h):
    """A restarted control process adopts what the table holds: the pod's slot keeps its
    credentials (same access key), and STS is not asked again, even when it is down."""
    async def main():
        async with h.manager() as first:
            slot = first.acquire("uid-1", h.req("a"))
            await h.wait_state(slot, tbl.CRED_READY)
        before = h.document(slot)
        calls = len(h.proxy.assume_role_calls())
        h.proxy.add_fault("down")
        async with h.manager() as second:       # fresh manager, same table
            assert second.adopt(_slots(h.table)) == 1
            again = second.acquire("uid-1", h.req("a"))
            await asyncio.sleep(0.2)
            return slot, again, before, h.document(again), h.state(again)[0], calls, second.stats()

    slot, again, before, after, state, calls, stats = h.run(main())
    assert again == slot and state == tbl.CRED_READY
    assert after["AccessKeyId"] == before["AccessKeyId"] and after == before
    assert len(h.proxy.assume_role_calls()) == calls       # no STS call on the restart
    assert stats["keys_ready"] == 1


def test_restart_never_frees_a_slot_an_address_still_names(h):
    """The identity bug of a restart: an address left pointing at a slot that a new key
    takes over would answer with that key's credentials."""
    named: Counter = Counter()          # addresses naming each slot, as the model counts

    async def main():
        async with h.manager() as first:
            old = first.acquire("uid-a", h.req("a"))
            await h.wait_state(old, tbl.CRED_READY)
        named[old] += 1                         # 10.0.0.5 still names it
        async with h.manager(release_grace=0.05, slot_refs=named) as second:
            second.adopt(_slots(h.table))
            await asyncio.sleep(0.3)            # pod a never comes back: its grace ends
            c = second.acquire("uid-c", h.req("c"))
            await h.wait_state(c, tbl.CRED_READY)
            kept = h.state(old)
            named[old] -= 1                     # the model released the address
            await asyncio.sleep(1.5)
            return old, c, kept, h.state(old), second.stats()

    old, c, kept, cleared, stats = h.run(main())
    assert c != old
    assert kept[0] == tbl.CRED_READY            # still a's credentials while named
    assert cleared[0] == tbl.CRED_EMPTY         # freed once nothing names it


def test_restart_holds_unadoptable_slots_until_no_address_names_them(h):
    h.table.write_cred(3, [b"garbage"], serve_until=0.0, state=tbl.CRED_PENDING)
    named = Counter({3: 1})

    async def main():
        async with h.manager(slot_refs=named) as mgr:
            assert mgr.adopt(_slots(h.table)) == 0
            slots = {mgr.acquire(f"uid-{i}", h.req(f"r{i}")) for i in range(8)}
            mgr.reclaim()
            held = mgr.stats()["slots_held"]
            named[3] -= 1
            mgr.reclaim()
            return slots, held, mgr.stats()["slots_held"]

    slots, held, after = h.run(main())
    assert 3 not in slots and held == 1 and after == 0


# ---- session names, tags, audit, metrics --------------------------------------------------------

def test_fnv32a_matches_go():
    assert fnv32a("") == 0x811C9DC5
    assert fnv32a("a") == 0xE40C292C
    assert fnv32a("foobar") == 0xBF9CF968


@pytest.mark.parametrize("policy, expect_slots, names", [
    ("node-role", 1, {"node-1-app"}),
    ("pod", 2, {"ns.web-0", "ns.web-1"}),
    ("kube2iam", 1, {f"{fnv32a('10.1.2.3'):x}-app"}),
])
def test_session_name_policies(h, policy, expect_slots, names):
    async def main():
        async with h.manager(session_policy=policy) as mgr:
            s0 = mgr.acquire("uid-0", h.req("app", pod="web-0", ip="10.1.2.3"))
            s1 = mgr.acquire("uid-1", h.req("app", pod="web-1", ip="10.1.2.4"))
            for s in {s0, s1}:
                await h.wait_state(s, tbl.CRED_READY)
            return {s0, s1}

    slots = h.run(main())
    assert len(slots) == expect_slots
    assert {c.session_name for c in h.proxy.assume_role_calls()} == names


def test_kube2iam_policy_without_an_ip_uses_the_pod_uid(h):
    async def main():
        async with h.manager(session_policy="kube2iam") as mgr:
            s = mgr.acquire("0d6f-uid", h.req("app"))
            await h.wait_state(s, tbl.CRED_READY)

    h.run(main())
    (call,) = h.proxy.assume_role_calls()
    assert call.session_name == f"{fnv32a('0d6f-uid'):x}-app"


def test_session_tags_are_sent_and_split_the_key(h):
    async def main():
        async with h.manager(session_tags=["kiamfast-namespace"]) as mgr:
            a = mgr.acquire("uid-a", h.req("app", namespace="team-a", pod="x"))
            a2 = mgr.acquire("uid-a2", h.req("app", namespace="team-a", pod="y"))
            b = mgr.acquire("uid-b", h.req("app", namespace="team-b", pod="x"))
            for s in (a, b):
                await h.wait_state(s, tbl.CRED_READY)
            return a, a2, b

    a, a2, b = h.run(main())
    assert a == a2 != b
    assert sorted(c.tags["kiamfast-namespace"] for c in h.proxy.assume_role_calls()) == [
        "team-a", "team-b"]


def test_audit_log_one_line_per_issued_credential(h, caplog):
    caplog.set_level(logging.INFO, logger="kiamfast.audit")

    async def main():
        async with h.manager() as mgr:
            s = mgr.acquire("uid-0", h.req("app", pod="web-0"))
            await h.wait_state(s, tbl.CRED_READY)
            mgr.acquire("uid-1", h.req("app", pod="web-1"))  # joins: traced too
            for _ in range(20):
                mgr.wanted(s)
            await settle(mgr)
            return s

    s = h.run(main())
    records = [r for r in caplog.records if r.name == "kiamfast.audit"]
    assert [r.audit["event"] for r in records] == ["credentials_issued", "credentials_shared"]
    key = h.document(s)["AccessKeyId"]
    secret = h.document(s)["SecretAccessKey"]
    assert all(r.audit["access_key_id"] == key for r in records)
    assert records[0].audit["pods"] == ["ns/web-0"] and records[1].audit["pods"] == ["ns/web-1"]
    assert records[0].audit["role_arn"] == h.role("app")
    assert not any(secret in r.getMessage() or secret in str(r.audit) for r in records)


def test_metrics(h):
    registry = Samples()
    h.proxy.add_fault("throttle", count=1)

    async def main():
        async with h.manager(registry=registry, throttle_base=0.05) as mgr:
            s = mgr.acquire("uid-0", h.req("app"))
            mgr.acquire("uid-1", h.req("app", pod="q"))
            await h.wait_state(s, tbl.CRED_READY)

    h.run(main())
    arn = h.role("app")
    get = registry.get_sample_value
    assert get("kube2iam_iam_request_duration_seconds_count",
               {"code": "Success", "role_arn": arn}) == 1
    assert get("kube2iam_iam_request_duration_seconds_count",
               {"code": "Throttling", "role_arn": arn}) == 1
    assert get("kiamfast_sts_calls_total", {"result": "success"}) == 1
    assert get("kiamfast_sts_calls_total", {"result": "throttled"}) == 1
    assert get("kiamfast_sts_throttled_total") == 1
    assert get("kube2iam_iam_cache_hits_total", {"role_arn": arn}) == 1
    assert get("kiamfast_sts_inflight") == 0


# ---- the safety property, under random churn ----------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_every_pod_only_ever_sees_credentials_of_its_own_key(h, seed):
    """Random acquire / release / role change / wanted / time / STS faults; after every step,
    each live pod's slot holds nothing, an error, or credentials STS issued for exactly that
    pod's role and external ID (checked against the proxy's record of the call)."""
    import random
    rng = random.Random(seed)
    clock = manual(h)
    roles = ["a", "b", "c"]
    ext_ids = [None, "x", "y"]

    async def main():
        async with h.manager(clock=clock.time, sleep=clock.sleep, capacity=6,
                             release_grace=30, backoff_base=0.5) as mgr:
            pods: dict[str, tuple[str, str | None]] = {}
            slots: dict[str, int] = {}      # the slot acquire gave each pod
            checked = 0
            for step in range(160):
                op = rng.random()
                uid = f"uid-{rng.randrange(10)}"
                if op < 0.45:
                    want = (rng.choice(roles), rng.choice(ext_ids))
                    try:
                        slots[uid] = mgr.acquire(uid, h.req(want[0], pod=uid,
                                                            external_id=want[1]))
                        pods[uid] = want
                    except CredentialSlotsExhausted:   # a pod changing key left its old one
                        pods.pop(uid, None)
                        slots.pop(uid, None)
                elif op < 0.65 and uid in pods:
                    mgr.release(uid)
                    del pods[uid]
                    del slots[uid]
                elif op < 0.75:
                    if uid in slots:
                        mgr.wanted(slots[uid])
                elif op < 0.8:
                    h.proxy.clear_faults()
                    h.proxy.add_fault(rng.choice(["5xx", "down", "deny", "throttle"]),
                                      count=rng.randrange(1, 4))
                await settle(mgr, clock, rng.choice([0.0, 1.0, 20.0, 400.0]))
                issued = {c.access_key_id: (c.role_arn, c.external_id)
                          for c in h.proxy.assume_role_calls(outcome="ok")}
                for uid, (role_name, ext) in pods.items():
                    slot = slots[uid]
                    state, _, parts = h.state(slot)
                    if state != tbl.CRED_READY:
                        continue
                    names = parts[tbl.PART_NAMES].decode().split("\n")
                    assert names[0] == role_name
                    body = credential_parts.parse_response(parts[tbl.PART_DOCUMENT])[2]
                    if b'"Code":"Success"' not in body:
                        continue  # the error document (denied)
                    key_id = h.document(slot)["AccessKeyId"]
                    assert issued[key_id] == (h.role(role_name), ext)
                    checked += 1
            return checked

    assert h.run(main(), timeout=120) > 50


def test_from_config(h):
    from kiamfast.config import Config
    cfg = Config(node="ip-10-0-0-1", base_role_arn=h.base_arn, session_name_policy="pod",
                 sts_qps=7.0, sts_burst=3, iam_role_error_ttl=42.0)
    mgr = CredentialManager.from_config(cfg, table=h.table, sts=h.sts,
                                                notify=h.notify)
    assert mgr.capacity == h.capacity and mgr.naming.policy == "pod"
    assert mgr.duration == 3600 and mgr.min_lifetime == 900
    assert (mgr.bucket.rate, mgr.bucket.burst, mgr.timing.error_ttl) == (7.0, 3, 42.0)
    assert mgr.naming.node_name == "ip-10-0-0-1"
