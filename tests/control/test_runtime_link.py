"""The agent's link to the runtime: an 'auto' socket found late, and a dead link told apart
from a runtime that is down for the whole node."""
from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest

from kiamfast.control.cri.client import RuntimeUnavailable
from kiamfast.control.cri.link import AutoEndpointClient, LinkMonitor, node_ready_since


class FakeClient:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.stats = {"polls": 0}
        self.closed = False

    def poll(self) -> str:
        self.stats["polls"] += 1
        return f"view from {self.endpoint}"

    def close(self) -> None:
        self.closed = True


def test_auto_endpoint_is_looked_up_again_until_a_socket_appears():
    present: list[str] = []
    made: list[FakeClient] = []

    def make(endpoint: str) -> FakeClient:
        made.append(FakeClient(endpoint))
        return made[-1]

    client = AutoEndpointClient(make_client=make,
                                resolve=lambda value: present[0] if present else None)
    with pytest.raises(RuntimeUnavailable, match="/run/containerd/containerd.sock"):
        client.poll()
    assert not client.found and client.endpoint == "auto" and client.stats == {}
    present.append("unix:///run/containerd/containerd.sock")   # containerd is back
    assert client.poll() == "view from unix:///run/containerd/containerd.sock"
    assert client.poll() and len(made) == 1                   # found once, kept
    assert client.found and client.endpoint == present[0] and client.stats == {"polls": 2}
    client.close()
    assert made[0].closed


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(status: str, since: float) -> dict:
    return {"status": {"conditions": [
        {"type": "MemoryPressure", "status": "False", "lastTransitionTime": iso(0)},
        {"type": "Ready", "status": status, "lastTransitionTime": iso(since)}]}}


def test_node_ready_since_reads_the_ready_condition():
    assert node_ready_since(node("True", 1_000)) == 1_000
    assert node_ready_since(node("False", 1_000)) is None
    assert node_ready_since(node("Unknown", 1_000)) is None
    assert node_ready_since({}) is None
    assert node_ready_since({"status": {"conditions": [{"type": "Ready", "status": "True",
                                                         "lastTransitionTime": "garbage"}]}}) is None


class Clock:
    def __init__(self) -> None:
        self.t = 10_000.0

    def __call__(self) -> float:
        return self.t


def test_link_is_broken_only_while_the_kubelet_reaches_the_runtime_for_the_whole_grace():
    clock = Clock()
    link = LinkMonitor(grace=60, clock=clock)
    link.state(False)                                    # the agent's polls start failing
    clock.t += 30
    assert link.judge(node("True", 0), "unix:///s", "refused") == ""   # too early
    clock.t += 40
    reason = link.judge(node("True", 0), "unix:///s", "refused")
    assert "link to unix:///s is broken" in reason and link.broken == reason
    # containerd down for the whole node: the kubelet says so, a restart would cure nothing
    assert link.judge(node("False", clock.t - 30), "unix:///s", "refused") == ""
    # the kubelet has reached it again only since 10 s: not yet proof
    assert link.judge(node("True", clock.t - 10), "unix:///s", "refused") == ""
    clock.t += 60
    assert link.judge(node("True", clock.t - 70), "unix:///s", "refused")
    link.state(True)                                     # the link answers again
    assert link.broken == "" and link.outage_seconds() == 0
    assert link.judge(node("True", 0), "unix:///s", "refused") == ""


@pytest.mark.parametrize("previous_runtime_mode", [False, True])
def test_auto_without_a_socket_keeps_the_freshness_checks_a_runtime_decided(
        tmp_path, monkeypatch, previous_runtime_mode):
    """A control process started while the 'auto' socket is absent: a table a runtime
    decided (a previous process's runtime_mode) keeps its freshness checks, and a failed
    attempt is the runtime's outage; a table of an API-only agent stays API-only."""
    from kiamfast import table as tablemod
    from kiamfast.control.cri.source import RuntimeSource, find_runtime
    from kiamfast.control.mappings.model import NodeModel
    from kiamfast.control.mappings.policy import RolePolicy
    from control_support import SlotSink

    monkeypatch.setattr("kiamfast.control.cri.client.DEFAULT_ENDPOINTS",
                        (f"unix://{tmp_path}/none.sock",))
    t = tablemod.Table.create(str(tmp_path / "table"), ip_capacity=64, cred_capacity=8,
                              value_size=1024, aux_count=5, aux_size=4096, max_workers=1)
    t.set_status(runtime_mode=previous_runtime_mode)
    found = find_runtime("auto", table_runtime_mode=t.runtime_mode)
    assert found.expected is previous_runtime_mode
    model = NodeModel(policy=RolePolicy(), table=t, sink=SlotSink(),
                      expect_runtime=found.expected)
    source = RuntimeSource(found, model=model, witness=None, commit=model.commit,
                           on_change=lambda: None)
    assert source.poller is not None and isinstance(source.poller.client, AutoEndpointClient)
    assert source.expected is previous_runtime_mode

    async def first_attempt() -> None:      # the poller's own first poll, against no socket
        polling = asyncio.ensure_future(source.poller.run())
        await asyncio.wait_for(source.settled.wait(), 10)
        polling.cancel()

    before = time.monotonic_ns()
    asyncio.run(first_attempt())
    assert t.runtime_mode is previous_runtime_mode
    assert (t.failed_ns >= before) if previous_runtime_mode else (t.failed_ns == 0)
    t.close()


def test_runtime_turned_off_never_waits_for_a_poll_over_a_runtime_decided_table(tmp_path):
    """--cri-endpoint=none after an agent that used a runtime (a changed config): no poll
    will ever come, so nothing may wait for one."""
    from kiamfast import table as tablemod
    from kiamfast.control.cri.source import find_runtime

    t = tablemod.Table.create(str(tmp_path / "table"), ip_capacity=64, cred_capacity=8,
                              value_size=1024, aux_count=5, aux_size=4096, max_workers=1)
    t.set_status(runtime_mode=True)
    found = find_runtime("none", table_runtime_mode=t.runtime_mode)
    assert found.endpoint is None and found.expected is False
    t.close()
