"""The runtime poller on a busy node and against odd answers (issue 20, items 3, 6 and 8).

* One sandbox's PodSandboxStatus error does not fail the poll: it is retried once, then that
  sandbox is left out of the view (it owns nothing: its pod gets no credentials, never
  another's) and asked again on the next poll; logged once per episode.
* A skip verdict (no address, an address that does not parse...) is asked again after 1 s,
  doubling up to 30 s, never cached for the sandbox's life; logged once per sandbox id.
* New sandboxes' statuses are asked in parallel, at most 8 at once.
* Demand polls are at least `demand_floor` apart: a connection loop from one pod costs the
  runtime at most 1/floor polls per second, and no need is lost.

The client tests use the CRI fault double (real gRPC, no root); the floor tests a fake client
that only counts polls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from types import MappingProxyType

import grpc
import pytest

from poller_tasks import running, stop

from kiamfast.control.cri.client import RuntimeClient, RuntimeView
from kiamfast.control.cri.poller import RuntimePoller
from kiamfast.testing.cri_fault import fake_sandbox

SECOND = 10**9


class FakeClock:
    def __init__(self) -> None:
        self.ns = time.monotonic_ns()

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * SECOND)


def _lines(caplog, needle):
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


# -- one sandbox's status error ----------------------------------------------------------

def test_one_status_error_is_retried_within_the_poll(cri_fault, client):
    pod = fake_sandbox(name="flaky", ip="10.0.10.1")
    cri_fault.put(pod)
    cri_fault.fault("PodSandboxStatus", error=grpc.StatusCode.INTERNAL, times=1)
    assert client.poll().owners["10.0.10.1"].pod_uid == pod.uid
    assert cri_fault.calls["PodSandboxStatus"] == 2 and client.stats["status_errors"] == 0


def test_a_sandbox_whose_status_keeps_failing_is_left_out_and_asked_again(cri_fault, client,
                                                                          caplog):
    old = fake_sandbox(name="old", ip="10.0.11.1")
    cri_fault.put(old)
    client.poll()
    bad, fine = fake_sandbox(name="bad", ip="10.0.11.2"), fake_sandbox(name="fine", ip="10.0.11.3")
    cri_fault.put(bad, fine)
    cri_fault.fault("PodSandboxStatus", error=grpc.StatusCode.INTERNAL, sandbox_id=bad.id)
    with caplog.at_level(logging.WARNING, logger="kiamfast.runtime"):
        for _ in range(3):
            view = client.poll()
            assert {ip: s.id for ip, s in view.owners.items()} == \
                {"10.0.11.1": old.id, "10.0.11.3": fine.id}
    assert client.stats["status_errors"] == 3
    lines = _lines(caplog, bad.id)
    assert len(lines) == 1 and "INTERNAL" in lines[0], lines
    cri_fault.clear_faults()
    assert client.poll().owners["10.0.11.2"].pod_uid == bad.uid


def test_a_left_out_sandbox_does_not_give_its_address_back_to_the_previous_owner(cri_fault,
                                                                                 client):
    old = fake_sandbox(name="old", ip="10.0.12.1")
    cri_fault.put(old)
    assert client.poll().owners["10.0.12.1"].id == old.id
    cri_fault.stop_sandbox(old.id)
    new = fake_sandbox(name="new", ip="10.0.12.1")
    cri_fault.put(new)
    cri_fault.fault("PodSandboxStatus", error=grpc.StatusCode.UNAVAILABLE, sandbox_id=new.id,
                    times=2)
    assert "10.0.12.1" not in client.poll().owners
    assert client.poll().owners["10.0.12.1"].id == new.id


def test_a_status_that_timed_out_is_not_retried_within_the_poll(cri_fault, client):
    """A second wait would hold the whole poll (and every waiting first call) as long again."""
    hung = fake_sandbox(name="hung", ip="10.0.13.1")
    cri_fault.put(hung)
    cri_fault.fault("PodSandboxStatus", delay=1.0, sandbox_id=hung.id)   # the client's 0.5 s
    assert client.poll().owners == {}
    assert cri_fault.calls["PodSandboxStatus"] == 1 and client.stats["status_errors"] == 1


# -- skip verdicts are asked again --------------------------------------------------------

@pytest.mark.parametrize("first_ip", ["", "10.0.14.999"], ids=["no-ip", "bad-ip"])
def test_a_skipped_sandbox_is_asked_again_and_owns_its_address_once_it_shows_one(
        cri_fault, caplog, first_ip):
    clock = FakeClock()
    client = RuntimeClient(cri_fault.endpoint, timeout=0.5, clock_ns=clock)
    pod = fake_sandbox(name="late", ip=first_ip)
    cri_fault.put(pod)
    with caplog.at_level(logging.WARNING, logger="kiamfast.runtime"):
        assert client.poll().owners == {}
        cri_fault.put(dataclasses.replace(pod, ip="10.0.14.1"))
        clock.advance(0.5)
        assert client.poll().owners == {}          # not asked again yet
        assert cri_fault.calls["PodSandboxStatus"] == 1
        clock.advance(0.5)
        assert client.poll().owners["10.0.14.1"].pod_uid == pod.uid
    client.close()
    assert len(_lines(caplog, pod.id)) == 1


def test_skip_rechecks_back_off_to_30_s_and_are_logged_once(cri_fault, caplog):
    clock = FakeClock()
    client = RuntimeClient(cri_fault.endpoint, timeout=0.5, clock_ns=clock)
    hostnet = fake_sandbox(name="node-exporter", ip="10.0.15.1", host_network=True)
    cri_fault.put(hostnet)
    asked_at = []
    with caplog.at_level(logging.WARNING, logger="kiamfast.runtime"):
        for step in range(4 * 130):               # 130 s in steps of 0.25 s
            calls = cri_fault.calls["PodSandboxStatus"]
            assert client.poll().owners == {}
            if cri_fault.calls["PodSandboxStatus"] > calls:
                asked_at.append(step / 4)
            clock.advance(0.25)
    client.close()
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:])]
    assert gaps == [1, 2, 4, 8, 16, 30, 30, 30], asked_at
    assert len(_lines(caplog, hostnet.id)) == 1 and client.stats["skipped_sandboxes"] == 1


# -- new sandboxes' statuses in parallel ----------------------------------------------------

def test_new_sandboxes_statuses_are_asked_in_parallel_at_most_8_at_once(cri_fault, client):
    pods = [fake_sandbox(name=f"p{i}", ip=f"10.0.16.{i + 1}") for i in range(20)]
    cri_fault.put(*pods)
    # the double holds each status until 8 are in flight: one at a time misses the deadline
    cri_fault.fault("PodSandboxStatus", gather=8)
    view = client.poll()
    assert {ip: s.id for ip, s in view.owners.items()} == {p.ip: p.id for p in pods}
    assert cri_fault.peak["PodSandboxStatus"] == 8


def test_answers_arriving_out_of_order_go_to_their_own_sandbox(cri_fault, client):
    pods = [fake_sandbox(name=f"p{i}", ip=f"10.0.17.{i + 1}") for i in range(16)]
    cri_fault.put(*pods)
    for i, pod in enumerate(pods):                # the first asked answers last
        cri_fault.fault("PodSandboxStatus", delay=0.01 * (16 - i), sandbox_id=pod.id)
    view = client.poll()
    assert {ip: (s.id, s.pod_uid, s.name) for ip, s in view.owners.items()} == \
        {p.ip: (p.id, p.uid, p.name) for p in pods}


# -- a big node ----------------------------------------------------------------------------

def test_500_sandboxes_with_many_labels_and_annotations_arrive_whole(cri_fault):
    """The list is several MiB, beyond the client's 1 MiB flow-control window: it arrives
    only if the client hands the window back (WINDOW_UPDATE) as it reads."""
    labels = {f"app.example.com/label-{k}": "l" * 60 for k in range(20)}
    annotations = {f"example.com/annotation-{k}": "a" * 200 for k in range(20)}
    pods = [fake_sandbox(name=f"pod-{i}", ip=f"10.1.{i // 250}.{i % 250 + 1}",
                         labels=labels, annotations={**annotations, "i": str(i)})
            for i in range(500)]
    cri_fault.put(*pods)
    client = RuntimeClient(cri_fault.endpoint, timeout=10.0)
    try:
        view = client.poll()
    finally:
        client.close()
    assert {ip: (s.id, s.pod_uid) for ip, s in view.owners.items()} == \
        {p.ip: (p.id, p.uid) for p in pods}
    assert all(s.annotations["i"] == s.name.removeprefix("pod-")
               and len(s.annotations) == 21 for s in view.sandboxes)
    assert client.stats["status_calls"] == 500 and client.stats["status_errors"] == 0


# -- the floor between demand polls -------------------------------------------------------

class CountingClient:
    """Answers every poll at once with an empty view dated when it was asked."""
    endpoint = "fake://counting"

    def __init__(self) -> None:
        self.polls = 0

    def poll(self) -> RuntimeView:
        self.polls += 1
        return RuntimeView(started_ns=time.monotonic_ns(), sandboxes=(),
                           owners=MappingProxyType({}), conflicts=frozenset())


def test_a_connection_loop_costs_at_most_one_poll_per_floor_and_loses_no_need(recorder):
    client = CountingClient()
    floor = 0.1

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0, demand_floor=floor)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        polls_before, began = client.polls, time.monotonic()
        asks, waits = [], []
        for _ in range(1000):                     # one pod opening connections in a loop
            after = time.monotonic_ns()
            asks.append(after)
            waits.append(asyncio.ensure_future(recorder.view_after(poller, after)))
            await asyncio.sleep(0.001)
        views = await asyncio.gather(*waits)
        elapsed = time.monotonic() - began
        await stop(task)
        return asks, views, client.polls - polls_before, elapsed

    asks, views, polls, elapsed = asyncio.run(asyncio.wait_for(body(), 30))
    assert all(view.started_ns >= after for after, view in zip(asks, views))
    assert 1 <= polls <= elapsed / floor + 1, (polls, elapsed)


def test_a_demand_after_a_quiet_spell_is_polled_at_once_and_the_next_waits_for_the_floor(
        recorder):
    client = CountingClient()

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0, demand_floor=10.0)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        await recorder.view_after(poller, time.monotonic_ns(), timeout=5.0)
        with pytest.raises(TimeoutError):
            await recorder.view_after(poller, time.monotonic_ns(), timeout=0.5)
        await stop(task)
        return poller

    poller = asyncio.run(asyncio.wait_for(body(), 30))
    assert poller.stats["demand_polls"] == 1 and client.polls == 2


def test_periodic_polls_still_serve_needs_during_the_floor(recorder):
    client = CountingClient()

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=0.2, demand_floor=30.0)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        for _ in range(3):
            await recorder.view_after(poller, time.monotonic_ns(), timeout=5.0)
        await stop(task)
        return poller

    poller = asyncio.run(asyncio.wait_for(body(), 30))
    assert poller.stats["demand_polls"] == 1
