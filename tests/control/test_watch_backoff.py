"""A watch that is not a stream must back off, not hammer the API server.

Some proxies and broken API servers answer a watch request with a plain list, or with a
stream that ends at once. A watcher that simply re-issues the watch then sends tens of
requests a second from every node (22.7/s measured from one agent before this was fixed).
Here the API server emulator answers every watch that way: the real watcher, with its
production backoff, must keep the request rate low, say so once in its log, count it in the
stats published as ``kiamfast_watch_total{kind=...}``, and pick up what it missed as soon as
watches stream again.
"""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
from control_support import BASE, SlotSink, lookup

from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.k8s.source import ApiSource
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.testing.apiserver import ApiServer

NODE = "node-1"
COUNTER = {"list": "bad_watch_bodies", "empty": "empty_watches"}


@pytest.fixture
def cluster():
    srv = ApiServer(host="127.0.0.1", port=0, bookmark_interval=0.5, token="test-token").start()
    srv.nodes.add(NODE)
    yield srv
    srv.stop()


async def until(pred, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("fault", ["list", "empty"])
def test_a_watch_that_is_not_a_stream_backs_off_and_recovers(cluster, table, caplog, fault):
    caplog.set_level(logging.INFO, logger="kiamfast.watch")
    cluster.pods.create("default", "early", node=NODE, ips=["10.1.0.1"], phase="Running",
                        annotations={"iam.amazonaws.com/role": "early"})
    model = NodeModel(policy=RolePolicy(base_role_arn=BASE), table=table, sink=SlotSink(),
                      notify=lambda: None)
    # The production defaults: no test-sized backoff.
    watcher = ApiSource.connect(api_server=cluster.url, api_token=cluster.token,
                                model=model, node=NODE)

    async def body():
        task = asyncio.create_task(watcher.run())
        try:
            assert await watcher.wait_synced(10), "watcher did not sync"
            assert await asyncio.to_thread(cluster.traffic.wait_watches, 1, node=NODE), \
                "no watch opened"
            cluster.faults.answer_watches_with(fault)
            cluster.traffic.reset()
            cluster.faults.drop_watches()   # the open watch ends; every new one gets the fault
            await asyncio.sleep(3.0)
            watches = cluster.traffic.stats()["watches"]
            # It keeps trying, politely: an immediate retry would be ~70 in 3 s.
            assert 2 <= watches <= 8, watches
            assert watcher.stats()[COUNTER[fault]] >= watches - 1, watcher.stats()
            warnings = [r for r in caplog.records
                        if r.levelno == logging.WARNING and COUNTER[fault] in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in caplog.records]

            # What happens meanwhile arrives once watches stream again.
            cluster.pods.create("default", "late", node=NODE, ips=["10.1.0.9"],
                                phase="Running", annotations={"iam.amazonaws.com/role": "late"})
            cluster.faults.answer_watches_with(None)
            await until(lambda: lookup(table, "10.1.0.9") is not None, timeout=15,
                        what="the pod created during the fault")
            assert lookup(table, "10.1.0.1") is not None
            assert any("streaming again" in r.getMessage() for r in caplog.records)
        finally:
            await watcher.stop()
            await asyncio.wait_for(task, 10)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_quiet_watch_is_not_an_error(cluster, table):
    """A watch with nothing to report (only bookmarks) is healthy: no backoff, no count."""
    model = NodeModel(policy=RolePolicy(base_role_arn=BASE), table=table, sink=SlotSink(),
                      notify=lambda: None)
    watcher = ApiSource.connect(api_server=cluster.url, api_token=cluster.token,
                                model=model, node=NODE, watch_timeout=(1.0, 1.0))

    async def body():
        task = asyncio.create_task(watcher.run())
        try:
            assert await watcher.wait_synced(10)
            await asyncio.sleep(3.5)        # about three watches run their whole timeout
            stats = watcher.stats()
            assert stats["watches"] >= 3 and stats["bookmarks"] >= 3, stats
            assert stats["empty_watches"] == stats["bad_watch_bodies"] == stats["errors"] == 0
        finally:
            await watcher.stop()
            await asyncio.wait_for(task, 10)

    asyncio.run(asyncio.wait_for(body(), 30))
