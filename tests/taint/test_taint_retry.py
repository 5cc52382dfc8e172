"""The startup taint is removed however long the API server refuses (issue 15).

Until it is removed no application pod can land on the node, so the agent must keep trying,
with backoff, and say what is wrong in its state (for /healthz).  Against the API server
emulator over real HTTP; the backoff's sleep is injected so the test records the delays
instead of waiting them out.
"""

from __future__ import annotations

import asyncio
import logging

from kubernetes import client
from taint_support import KEY, OTHER, core_api, taints

from kiamfast.control.taint import TaintRemoval
from kiamfast.testing import apiserver

OURS = {"key": KEY, "value": "true", "effect": "NoExecute"}


class RecordingSleep:
    """The injected sleep: records each delay and the state the removal showed meanwhile."""

    def __init__(self) -> None:
        self.removal: TaintRemoval | None = None
        self.delays: list[float] = []
        self.states: list[str] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.states.append(self.removal.state)
        await asyncio.sleep(0)


def removal_for(node: str, key: str = KEY) -> tuple[TaintRemoval, RecordingSleep]:
    sleep = RecordingSleep()
    removal = TaintRemoval(node, key, sleep=sleep)
    sleep.removal = removal
    return removal, sleep


def assert_backoff(delays: list[float]) -> None:
    """Jittered exponential: attempt i waits within [1/2, 1] of min(0.1 s * 2^i, 60 s)."""
    for i, delay in enumerate(delays):
        ceiling = min(TaintRemoval.FIRST_BACKOFF * 2 ** i, TaintRemoval.MAX_BACKOFF)
        assert ceiling / 2 <= delay <= ceiling, (i, delay)


def test_patch_refused_ten_times_then_accepted(srv, tmp_path, caplog):
    srv.add_node("node-a", taints=[OTHER, OURS])
    refusals = []

    class RefusingPatches(client.CoreV1Api):
        def read_node(self, name, **kw):
            response = super().read_node(name, **kw)
            if len(refusals) < 10:  # the PATCH that follows this read fails
                refusals.append(name)
                srv.fail_next(1, status=500, path_prefix=f"/api/v1/nodes/{name}")
            return response

    removal, sleep = removal_for("node-a")
    assert removal.state == "pending"
    patches_before = srv.stats()["patches"]
    with caplog.at_level(logging.INFO, logger="kiamfast.taint"):
        asyncio.run(removal.remove_until_done(core_api(srv, tmp_path, RefusingPatches)))
    assert taints(srv, "node-a") == [OTHER]
    assert removal.state == "removed"
    assert removal.attempts == 11
    assert srv.stats()["patches"] - patches_before >= 1
    assert len(sleep.delays) == 10
    assert_backoff(sleep.delays)
    assert sum(sleep.delays) > 10 * TaintRemoval.FIRST_BACKOFF  # it did back off
    assert all(s.startswith("retrying: HTTP 500") for s in sleep.states), sleep.states
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per episode
    assert "gone after 11 attempts" in caplog.text


def test_rbac_missing_for_a_while_is_retried_with_a_capped_backoff(srv, tmp_path):
    srv.add_node("node-b", taints=[OURS])
    srv.fail_next(12, status=403, path_prefix="/api/v1/nodes/node-b")
    removal, sleep = removal_for("node-b")
    asyncio.run(removal.remove_until_done(core_api(srv, tmp_path)))
    assert taints(srv, "node-b") == []
    assert removal.state == "removed"
    assert len(sleep.delays) == 12
    assert_backoff(sleep.delays)
    assert max(sleep.delays) <= TaintRemoval.MAX_BACKOFF
    assert sleep.delays[-1] >= TaintRemoval.MAX_BACKOFF / 2  # reached the cap
    assert "ClusterRole needs get and patch on nodes" in sleep.states[0]


def test_an_api_server_that_is_down_is_waited_for(tmp_path):
    """Connection refused (no API server at all) is retried too, never raised."""
    first = apiserver.ApiServer().start()
    api = core_api(first, tmp_path)
    port = first.port
    first.stop()                                       # the API server goes away
    removal, sleep = removal_for("node-c")
    back: list = []

    async def scenario():
        task = asyncio.create_task(removal.remove_until_done(api))
        while len(sleep.delays) < 3:
            await asyncio.sleep(0.01)
        srv = apiserver.ApiServer(port=port).start()   # ...and comes back
        back.append(srv)
        srv.add_node("node-c", taints=[OURS])
        await asyncio.wait_for(task, 30)

    try:
        asyncio.run(scenario())
        assert taints(back[0], "node-c") == []
    finally:
        for srv in back:
            srv.stop()
    assert removal.state == "removed"
    assert sleep.states[0].startswith("retrying: ")


def test_absent_taint_is_done_at_once_and_disabled_does_nothing(srv, tmp_path):
    srv.add_node("node-d", taints=[OTHER])
    removal, sleep = removal_for("node-d")
    asyncio.run(removal.remove_until_done(core_api(srv, tmp_path)))
    assert removal.state == "removed" and removal.attempts == 1 and sleep.delays == []
    assert taints(srv, "node-d") == [OTHER]

    srv.add_node("node-e", taints=[OURS])
    requests_before = srv.stats()["requests"]
    for disabled in (TaintRemoval("node-e", ""), TaintRemoval("", KEY)):
        assert disabled.state == "disabled"
        asyncio.run(disabled.remove_until_done(core_api(srv, tmp_path)))
        assert disabled.state == "disabled"
    assert srv.stats()["requests"] == requests_before
    assert taints(srv, "node-e") == [OURS]
