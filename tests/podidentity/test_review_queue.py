"""The TokenReview queue's rules (kiamfast/container_credentials/review_queue.py), each review
a coroutine the test finishes by hand: bounded in all and per address, one review of an
address running at a time, the address served longest ago first, and a review nobody waits
for any more never started.  The whole agent under a slow API server and floods:
test_review_backlog.py."""
from __future__ import annotations

import asyncio

import pytest

from kiamfast.container_credentials.review_queue import QueueFull, ReviewQueue


class Reviews:
    """Reviews that run until the test ends them, in the order they started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._ends: dict[str, asyncio.Future] = {}

    def review(self, name: str):
        async def run() -> str:
            self.started.append(name)
            self._ends[name] = asyncio.get_running_loop().create_future()
            return await self._ends[name]
        return run

    def end(self, name: str) -> None:
        self._ends[name].set_result(name)


def run(body) -> None:
    asyncio.run(body())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_new_address_goes_before_the_ones_already_served_and_each_runs_one_at_a_time():
    async def body():
        q, r = ReviewQueue(threads=2, limit=64, per_address=4), Reviews()
        for i in range(4):
            q.submit("flood-a", r.review(f"a{i}"))
            q.submit("flood-b", r.review(f"b{i}"))
        await settle()
        assert r.started == ["a0", "b0"] and q.running == 2
        q.submit("pod", r.review("pod"))
        r.end("a0")
        await settle()
        assert r.started[-1] == "pod"              # before a1: flood-a was just served
        r.end("b0")
        await settle()
        assert r.started[-1] == "a1"               # served longer ago than flood-b
        r.end("pod")
        await settle()
        assert r.started[-1] == "b1"
        for name in ("a1", "b1"):
            r.end(name)
        await settle()
        assert sorted(r.started[-2:]) == ["a2", "b2"]
    run(body)


def test_an_address_holds_its_share_and_the_queue_its_bound():
    async def body():
        q, r = ReviewQueue(threads=1, limit=6, per_address=4), Reviews()
        for i in range(4):
            q.submit("flood", r.review(f"f{i}"))
        with pytest.raises(QueueFull):
            q.submit("flood", r.review("f4"))      # its share
        q.submit("pod-1", r.review("p1"))
        q.submit("pod-2", r.review("p2"))
        with pytest.raises(QueueFull):
            q.submit("pod-3", r.review("p3"))      # the bound in all
        await settle()
        assert q.queued + q.running == 6
    run(body)


def test_a_review_whose_waiters_have_gone_is_dropped_unless_it_runs():
    async def body():
        q, r = ReviewQueue(threads=1, limit=64, per_address=4), Reviews()
        running = q.submit("a", r.review("running"))
        waiting = q.submit("b", r.review("waiting"))
        await settle()
        assert not q.abandon(running)              # a thread has it: it finishes
        assert q.abandon(waiting) and waiting.future.cancelled()
        r.end("running")
        await settle()
        assert r.started == ["running"] and await running.future == "running"
        assert q.queued == q.running == 0
        q.submit("b", r.review("again"))           # room again for its address
        await settle()
        assert r.started == ["running", "again"]
    run(body)
