"""Removing the startup taint once the agent is ready, against the API server emulator over
real HTTP (tests/k8s/test_real_apiserver.py runs it against the real kube-apiserver).

What an operator checks: after the agent is ready its node no longer carries
``kiamfast.io/agent-not-ready``, every other taint is untouched, a concurrent change to the
node's taints (another controller) neither loses that change nor leaves our taint behind,
however long the API server refuses the agent keeps trying (with backoff, saying why in its
state for /healthz), and a taint someone puts back is removed again.
"""

from __future__ import annotations

import asyncio
import logging

from taint_support import KEY, OTHER, api_client, taints, until

from kiamfast.control.k8s.node import StartupTaint
from kiamfast.kube.client import Client
from kiamfast.testing import apiserver

OURS = {"key": KEY, "value": "true", "effect": "NoExecute"}
OURS_NOSCHED = {"key": KEY, "effect": "NoSchedule"}
UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}


class RecordingSleep:
    """The injected backoff sleep: records each delay and the state shown meanwhile."""

    def __init__(self) -> None:
        self.taint: StartupTaint | None = None
        self.delays: list[float] = []
        self.states: list[str] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.states.append(self.taint.state)
        await asyncio.sleep(0)


def startup_taint(node: str, key: str = KEY) -> tuple[StartupTaint, RecordingSleep]:
    sleep = RecordingSleep()
    taint = StartupTaint(node, key, sleep=sleep)
    sleep.taint = taint
    return taint, sleep


def remove(taint: StartupTaint, client: Client, *, then=None) -> None:
    """Run the removal until it says removed (then, optionally, ``then()``), and stop it."""
    async def scenario():
        task = asyncio.create_task(taint.run(client))
        await until(lambda: taint.state.startswith("removed") or task.done())
        if then is not None:
            await then()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    asyncio.run(scenario())


def assert_backoff(delays: list[float]) -> None:
    """Jittered exponential: attempt i waits within [1/2, 1] of min(0.1 s * 2^i, 60 s)."""
    for i, delay in enumerate(delays):
        ceiling = min(StartupTaint.FIRST_BACKOFF * 2 ** i, StartupTaint.MAX_BACKOFF)
        assert ceiling / 2 <= delay <= ceiling, (i, delay)


def settled_requests(srv) -> int:
    """The server's request count once the last client's requests have all arrived."""
    import time
    count = srv.traffic.stats()["requests"]
    while True:
        time.sleep(0.2)
        now = srv.traffic.stats()["requests"]
        if now == count:
            return count
        count = now


def test_removes_only_our_taint_with_every_effect(srv, tmp_path):
    srv.nodes.add("node-a", taints=[OURS_NOSCHED, OTHER, OURS, UNREACHABLE])
    taint, sleep = startup_taint("node-a")
    assert taint.state == "pending"
    remove(taint, api_client(srv, tmp_path))
    assert taints(srv, "node-a") == [OTHER, UNREACHABLE]
    assert taint.state == "removed" and sleep.delays == []


def test_an_absent_taint_is_done_at_once_and_disabled_does_nothing(srv, tmp_path):
    srv.nodes.add("node-d", taints=[OTHER])
    taint, sleep = startup_taint("node-d")
    remove(taint, api_client(srv, tmp_path))
    assert taint.state == "removed" and taint.attempts == 1 and sleep.delays == []
    assert taints(srv, "node-d") == [OTHER]

    srv.nodes.add("node-e", taints=[OURS])
    requests_before = settled_requests(srv)
    for disabled in (StartupTaint("node-e", ""), StartupTaint("", KEY)):
        assert disabled.state == "disabled"
        asyncio.run(disabled.run(api_client(srv, tmp_path)))   # returns at once
        assert disabled.state == "disabled"
    assert srv.traffic.stats()["requests"] == requests_before
    assert taints(srv, "node-e") == [OURS]


class Racing(Client):
    """The agent's client, with another controller changing the node's taints right after
    a read of the node (``race(name)``)."""

    race = staticmethod(lambda name: None)

    async def request(self, method, path, **kw):
        response = await super().request(method, path, **kw)
        if method == "GET" and path.startswith("/api/v1/nodes/"):
            self.race(path.rsplit("/", 1)[1])
        return response


def test_a_change_between_read_and_patch_is_kept(srv, tmp_path):
    """Another controller adds a taint right after our read: our JSON patch's test fails,
    we read again, and both its taint survives and ours goes."""
    srv.nodes.add("node-f", taints=[OURS])
    reads = []

    def race(name):
        reads.append(name)
        if len(reads) == 1:   # the node lifecycle controller strikes
            srv.nodes.set_taints(name, [UNREACHABLE, OURS])

    client = api_client(srv, tmp_path, Racing)
    client.race = race
    taint, _ = startup_taint("node-f")
    remove(taint, client)
    assert len(reads) == 2
    assert taints(srv, "node-f") == [UNREACHABLE]


def test_someone_else_removing_it_first_is_not_an_error(srv, tmp_path):
    srv.nodes.add("node-g", taints=[OTHER, OURS])
    client = api_client(srv, tmp_path, Racing)
    client.race = lambda name: srv.nodes.set_taints(name, [OTHER])
    taint, sleep = startup_taint("node-g")
    remove(taint, client)
    assert taints(srv, "node-g") == [OTHER] and taint.state == "removed"


def test_losing_the_race_every_time_keeps_trying_and_never_takes_another_taint(srv, tmp_path):
    srv.nodes.add("node-h", taints=[OURS, OTHER])
    client = api_client(srv, tmp_path, Racing)
    # Right after every read, someone reorders the list: our entry moves.
    client.race = lambda name: srv.nodes.set_taints(name, list(reversed(taints(srv, name))))
    taint, sleep = startup_taint("node-h")

    async def scenario():
        task = asyncio.create_task(taint.run(client))
        await until(lambda: len(sleep.delays) >= 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    asyncio.run(scenario())
    assert sorted(map(str, taints(srv, "node-h"))) == sorted(map(str, [OURS, OTHER]))
    assert taint.state.startswith("retrying: HTTP 422")
    assert_backoff(sleep.delays)


def test_changes_elsewhere_in_the_list_do_not_matter(srv, tmp_path):
    srv.nodes.add("node-k", taints=[OTHER, OURS])
    client = api_client(srv, tmp_path, Racing)
    client.race = lambda name: srv.nodes.set_taints(name, [UNREACHABLE, OURS])  # 1 is ours
    taint, _ = startup_taint("node-k")
    remove(taint, client)
    assert taints(srv, "node-k") == [UNREACHABLE]


def test_refusals_are_retried_with_backoff_and_logged_once(srv, tmp_path, caplog):
    srv.nodes.add("node-a", taints=[OTHER, OURS])
    srv.faults.fail_next(10, status=500, path_prefix="/api/v1/nodes/node-a")
    taint, sleep = startup_taint("node-a")
    with caplog.at_level(logging.INFO, logger="kiamfast.taint"):
        remove(taint, api_client(srv, tmp_path))
    assert taints(srv, "node-a") == [OTHER]
    assert taint.state == "removed" and taint.attempts == 11
    assert len(sleep.delays) == 10
    assert_backoff(sleep.delays)
    assert all(s.startswith("retrying: HTTP 500") for s in sleep.states), sleep.states
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per episode
    assert "gone after 11 attempts" in caplog.text


def test_missing_rbac_is_named_and_waited_out_with_a_capped_backoff(srv, tmp_path):
    srv.nodes.add("node-b", taints=[OURS])
    srv.faults.fail_next(12, status=403, path_prefix="/api/v1/nodes/node-b")
    taint, sleep = startup_taint("node-b")
    remove(taint, api_client(srv, tmp_path))
    assert taints(srv, "node-b") == [] and taint.state == "removed"
    assert len(sleep.delays) == 12
    assert_backoff(sleep.delays)
    assert sleep.delays[-1] >= StartupTaint.MAX_BACKOFF / 2  # reached the cap
    assert "ClusterRole needs get, patch, list and watch on nodes" in sleep.states[0]


def test_a_missing_node_names_the_flag(srv, tmp_path):
    taint, sleep = startup_taint("no-such-node")

    async def scenario():
        client = api_client(srv, tmp_path)
        task = asyncio.create_task(taint.run(client))
        await until(lambda: sleep.states)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    asyncio.run(scenario())
    assert sleep.states[0] == "retrying: node 'no-such-node' not found (is --node right?)"


def test_an_api_server_that_is_down_is_waited_for(tmp_path):
    """Connection refused (no API server at all) is retried too, never raised."""
    first = apiserver.ApiServer().start()
    client = api_client(first, tmp_path)
    port = first.port
    first.stop()                                       # the API server goes away
    taint, sleep = startup_taint("node-c")
    back: list = []

    async def scenario():
        task = asyncio.create_task(taint.run(client))
        await until(lambda: len(sleep.delays) >= 3)
        srv = apiserver.ApiServer(port=port).start()   # ...and comes back
        back.append(srv)
        srv.nodes.add("node-c", taints=[OURS])
        await until(lambda: taint.state == "removed")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()

    try:
        asyncio.run(scenario())
        assert taints(back[0], "node-c") == []
    finally:
        for srv in back:
            srv.stop()
    assert sleep.states[0].startswith("retrying: ")


def test_a_taint_put_back_is_removed_again(srv, tmp_path, caplog):
    """karpenter#1772 and the CSI drivers' bugs: another controller re-applies the node's
    registered taints after the agent removed ours.  The agent watches its node and
    removes it again, each time, and says so in its state."""
    srv.nodes.add("node-r", taints=[OURS, OTHER])
    taint, _ = startup_taint("node-r")

    async def put_back_twice():
        for n in (1, 2):
            await asyncio.sleep(0.2)                   # the node watch is running
            srv.nodes.set_taints("node-r", [OTHER, OURS])
            await until(lambda: taints(srv, "node-r") == [OTHER])
            await until(lambda: taint.state == f"removed (again {n} times)")

    with caplog.at_level(logging.WARNING, logger="kiamfast.taint"):
        remove(taint, api_client(srv, tmp_path), then=put_back_twice)
    assert taints(srv, "node-r") == [OTHER]
    assert taint.removals == 3
    assert caplog.text.count("is back on node node-r") == 2
