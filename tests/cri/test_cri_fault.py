"""The CRI client and poller against runtime faults a real containerd cannot make on demand.

The fault double (kiamfast/testing/cri_fault.py) speaks the real runtime.v1 gRPC protocol on
a unix socket. Each fault must end in the safe outcome: a surprising sandbox owns nothing
(logged once), an address two READY sandboxes claim is owned by nobody (logged once per
episode), an error, a timeout or garbage in the list is `RuntimeUnavailable` naming the
endpoint (in one sandbox's status it only leaves that sandbox out: test_runtime_under_load),
and nothing ever escapes the poller, which reports the outage once and recovers. No root
needed.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from poller_tasks import running, stop

from kiamfast.control.cri.client import RuntimeClient, RuntimeUnavailable
from kiamfast.control.cri.poller import RuntimePoller
from kiamfast.testing.cri_fault import CriFault, fake_sandbox

ROLE = "iam.amazonaws.com/role"


def _log_lines(caplog, needle):
    return [r for r in caplog.records if needle in r.getMessage()]


# -- well-formed answers ---------------------------------------------------------------

def test_ready_sandboxes_own_their_canonical_addresses(cri_fault, client):
    pod = fake_sandbox(name="api", namespace="prod", ip="::ffff:10.1.2.3",
                       additional_ips=["fd00:0:0:0:0:0:0:0005"], annotations={ROLE: "api"})
    cri_fault.put(pod)
    view = client.poll()
    assert set(view.owners) == {"10.1.2.3", "fd00::5"}
    owner = view.owners["fd00::5"]
    assert (owner.pod_uid, owner.name, owner.namespace, owner.annotations[ROLE]) == \
        (pod.uid, "api", "prod", "api")
    assert owner.ips == ("10.1.2.3", "fd00::5") and owner.created_ns == pod.created_ns


def test_started_ns_is_taken_before_the_runtime_receives_the_list(cri_fault, client):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.0.1"))
    cri_fault.fault("ListPodSandbox", delay=0.05)
    for _ in range(3):
        view = client.poll()
        listed_at = [t for m, t in cri_fault.arrivals if m == "ListPodSandbox"][-1]
        assert view.started_ns < listed_at


def test_status_is_asked_once_per_sandbox_id(cri_fault, client):
    a, b = fake_sandbox(name="a", ip="10.0.0.1"), fake_sandbox(name="b", ip="10.0.0.2")
    cri_fault.put(a, b)
    for _ in range(5):
        client.poll()
    assert cri_fault.calls["PodSandboxStatus"] == 2 and cri_fault.calls["ListPodSandbox"] == 5
    cri_fault.remove(a.id)
    cri_fault.put(fake_sandbox(name="c", ip="10.0.0.3"))
    assert set(client.poll().owners) == {"10.0.0.2", "10.0.0.3"}
    assert cri_fault.calls["PodSandboxStatus"] == 3


def test_notready_sandbox_owns_nothing_even_if_the_runtime_still_reports_its_ip():
    # CRI-O may keep a stopped sandbox's IPs; a runtime may ignore the state filter
    with CriFault(ignore_filter=True, stopped_keep_ips=True) as crio_like:
        gone = fake_sandbox(name="gone", ip="10.0.0.7")
        live = fake_sandbox(name="live", ip="10.0.0.8")
        crio_like.put(gone, live)
        crio_like.stop_sandbox(gone.id)
        client = RuntimeClient(crio_like.endpoint)
        try:
            view = client.poll()
        finally:
            client.close()
    assert set(view.owners) == {"10.0.0.8"}
    assert crio_like.calls["PodSandboxStatus"] == 1   # a NOTREADY one is not even asked


def test_sandbox_removed_between_list_and_status_is_left_out(cri_fault, client):
    pod = fake_sandbox(name="racing", ip="10.0.0.9")
    cri_fault.put(pod)
    cri_fault.fault("PodSandboxStatus", error=grpc.StatusCode.NOT_FOUND, times=1)
    assert client.poll().owners == {}
    assert client.poll().owners["10.0.0.9"].id == pod.id   # not cached as gone: asked again


# -- malformed answers: the safe choice, logged once -----------------------------------

@pytest.mark.parametrize("sandbox, why", [
    (fake_sandbox(name="stray", ip="10.0.1.1", kubelet_labels=False), "label"),
    (fake_sandbox(name="half", ip="10.0.1.2", kubelet_labels=False,
                  labels={"io.kubernetes.pod.name": "half", "io.kubernetes.pod.namespace": "x"}),
     "io.kubernetes.pod.uid"),
    (fake_sandbox(name="hostnet", ip="10.0.1.3", host_network=True), "host network"),
    (fake_sandbox(name="garbled", ip="10.0.1.999"), "unparsable"),
    (fake_sandbox(name="bad-extra", ip="10.0.1.4", additional_ips=["fd00::zz"]), "unparsable"),
    (fake_sandbox(name="no-ip", ip=""), "no network.ip"),
], ids=["no-labels", "no-uid-label", "host-network", "bad-ip", "bad-additional-ip", "no-ip"])
def test_surprising_sandbox_owns_nothing_and_is_logged_once(cri_fault, client, caplog,
                                                             sandbox, why):
    good = fake_sandbox(name="good", ip="10.0.2.1")
    cri_fault.put(sandbox, good)
    with caplog.at_level(logging.WARNING, logger="kiamfast.runtime"):
        for _ in range(4):
            view = client.poll()
    assert set(view.owners) == {"10.0.2.1"} and [s.id for s in view.sandboxes] == [good.id]
    lines = _log_lines(caplog, sandbox.id)
    assert len(lines) == 1 and why in lines[0].getMessage(), [r.getMessage() for r in lines]
    assert client.stats["skipped_sandboxes"] == 1


def test_two_ready_sandboxes_on_one_address_own_it_nobody(cri_fault, client, caplog):
    a = fake_sandbox(name="a", ip="10.0.3.1", additional_ips=["fd00::31"])
    b = fake_sandbox(name="b", ip="::ffff:10.0.3.1")   # the same address, spelled otherwise
    cri_fault.put(a, b)
    with caplog.at_level(logging.WARNING, logger="kiamfast.runtime"):
        for _ in range(3):
            view = client.poll()
        assert view.conflicts == frozenset({"10.0.3.1"})
        assert "10.0.3.1" not in view.owners and view.owners["fd00::31"].id == a.id
        assert len(_log_lines(caplog, "10.0.3.1 claimed by 2")) == 1
        cri_fault.stop_sandbox(b.id)          # the episode ends: a owns it again
        view = client.poll()
        assert view.conflicts == frozenset() and view.owners["10.0.3.1"].id == a.id
        c = fake_sandbox(name="c", ip="10.0.3.1")
        cri_fault.put(c)                      # a second episode is logged again
        view = client.poll()
        assert "10.0.3.1" in view.conflicts and "10.0.3.1" not in view.owners
        assert len(_log_lines(caplog, "10.0.3.1 claimed by 2")) == 2
    assert client.stats["conflicts"] == 2


# -- errors in the list: RuntimeUnavailable naming the endpoint -------------------------

@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.UNIMPLEMENTED])
def test_list_errors_are_unavailable_naming_endpoint_and_error(cri_fault, client, code):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.4.1"))
    cri_fault.fault("ListPodSandbox", error=code, times=1)
    with pytest.raises(RuntimeUnavailable) as raised:
        client.poll()
    assert cri_fault.endpoint in str(raised.value) and code.name in str(raised.value)
    assert set(client.poll().owners) == {"10.0.4.1"}   # the next poll works again


def test_slow_runtime_times_out(cri_fault, client):
    cri_fault.fault("ListPodSandbox", delay=1.5, times=1)
    started = time.monotonic()
    with pytest.raises(RuntimeUnavailable, match="DEADLINE_EXCEEDED"):
        client.poll()
    assert time.monotonic() - started < 1.2   # the client's 0.5 s, not the runtime's 1.5 s


def test_garbage_list_is_unavailable_and_garbage_status_leaves_the_sandbox_out(cri_fault,
                                                                             client):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.4.2"))
    cri_fault.fault("ListPodSandbox", garbage=True, times=1)
    with pytest.raises(RuntimeUnavailable, match="ListPodSandbox"):
        client.poll()
    cri_fault.fault("PodSandboxStatus", garbage=True, times=2)   # the call and its retry
    assert client.poll().owners == {} and client.stats["status_errors"] == 1
    assert set(client.poll().owners) == {"10.0.4.2"}


def test_missing_socket_is_unavailable(tmp_path):
    endpoint = f"unix://{tmp_path}/nothing-here.sock"
    client = RuntimeClient(endpoint)
    with pytest.raises(RuntimeUnavailable) as raised:
        client.poll()
    assert endpoint in str(raised.value)
    client.close()


def test_version_names_the_runtime(cri_fault, client):
    assert client.version() == "cri-fault 1.0.0 (CRI v1)"


# -- the poller never lets a fault out ---------------------------------------------------

def test_poller_survives_every_fault_and_reports_each_outage_once(cri_fault, client, recorder,
                                                                  caplog):
    pod = fake_sandbox(name="steady", ip="10.0.5.1")
    cri_fault.put(pod)

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=0.05, backoff_min=0.05, backoff_max=0.1)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        faults = [dict(error=grpc.StatusCode.UNAVAILABLE), dict(garbage=True),
                  dict(delay=0.8), dict(error=grpc.StatusCode.INTERNAL)]
        for fault in faults:
            cri_fault.fault("ListPodSandbox", **fault)
            await recorder.until(lambda: not poller.healthy, timeout=3)
            await asyncio.sleep(0.3)   # several failed retries of the same outage
            cri_fault.clear_faults()
            await recorder.until(lambda: poller.healthy, timeout=3)
        await asyncio.to_thread(cri_fault.stop)   # the socket goes away
        await recorder.until(lambda: not poller.healthy, timeout=3)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(cri_fault.start)
        await recorder.until(lambda: poller.healthy, timeout=3)
        view = await recorder.view_after(poller, time.monotonic_ns())
        await stop(task)
        return poller, view

    with caplog.at_level(logging.WARNING, logger="kiamfast.runtime"):
        poller, view = asyncio.run(asyncio.wait_for(body(), 30))
    assert [ok for ok, _ in recorder.states] == [True] + [False, True] * 5
    assert poller.stats["outages"] == 5 and poller.stats["failed_polls"] > 5
    assert len(_log_lines(caplog, "container runtime unavailable")) == 5
    assert view.owners["10.0.5.1"].id == pod.id


def test_needs_during_a_slow_poll_are_coalesced_into_one_more_poll(cri_fault, client, recorder):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.6.1"))

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        # Slow, but well inside the client's 0.5 s deadline (a poll that times out is a
        # failure, not a slow poll).
        cri_fault.fault("ListPodSandbox", delay=0.25)
        lists_before = cri_fault.calls["ListPodSandbox"]
        first = asyncio.ensure_future(recorder.view_after(poller, time.monotonic_ns()))
        await recorder.until(lambda: cri_fault.calls["ListPodSandbox"] == lists_before + 1)
        # that poll is now in flight (held 0.25 s by the runtime)
        waits = []
        for _ in range(20):                # arrive while it runs: after its start
            waits.append(asyncio.ensure_future(
                recorder.view_after(poller, time.monotonic_ns())))
            await asyncio.sleep(0.002)
        views = await asyncio.gather(first, *waits)
        await asyncio.sleep(0.7)           # nothing else follows
        await stop(task)
        return views, cri_fault.calls["ListPodSandbox"] - lists_before

    views, lists = asyncio.run(asyncio.wait_for(body(), 15))
    assert lists == 2, lists               # the in-flight poll and exactly one more
    assert len({v.started_ns for v in views[1:]}) == 1 and views[1].started_ns > views[0].started_ns


def test_needs_during_an_outage_get_prompt_attempts_but_never_spin(cri_fault, client, recorder):
    """A connection accepted during an outage is judged by an attempt begun after it (the
    runtime may be back before the backoff ends), at most one per demand_floor."""
    failures = []

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               on_failure=failures.append, interval=30.0,
                               backoff_min=10.0, backoff_max=10.0, demand_floor=0.05)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        await asyncio.to_thread(cri_fault.stop)
        poller.need(time.monotonic_ns())
        await recorder.until(lambda: not poller.healthy)
        polls_before, began = poller.stats["polls"], time.monotonic()
        asked = time.monotonic_ns()
        poller.need(asked)
        await recorder.until(lambda: failures and failures[-1] >= asked, timeout=1.0)
        for _ in range(100):                      # 1 s of callers asking all the time
            poller.need(time.monotonic_ns())
            await asyncio.sleep(0.01)
        attempts = poller.stats["polls"] - polls_before
        window = time.monotonic() - began         # over 1 s on a busy machine
        await asyncio.to_thread(cri_fault.start)  # back before the 10 s backoff ends
        back = time.monotonic_ns()
        view = await recorder.view_after(poller, back)
        await stop(task)
        return attempts, window, view

    attempts, window, view = asyncio.run(asyncio.wait_for(body(), 10))
    assert 5 <= attempts <= window / 0.05 + 3, (attempts, window)   # prompt, and never 100
    assert view is not None and failures == sorted(failures)


def test_need_from_another_thread_is_handed_to_the_loop(cri_fault, client, recorder):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.7.1"))

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        after = time.monotonic_ns()
        await asyncio.to_thread(poller.need, after)
        await recorder.until(lambda: recorder.views[-1].started_ns >= after, timeout=3)
        await stop(task)

    asyncio.run(asyncio.wait_for(body(), 10))


def test_unchanged_sandboxes_give_the_same_owner_objects_with_a_new_start(cri_fault, client):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.8.1"))
    first, second = client.poll(), client.poll()
    assert second.started_ns > first.started_ns and second.owners is first.owners
    cri_fault.put(fake_sandbox(name="b", ip="10.0.8.2"))
    third = client.poll()
    assert third.owners is not second.owners and set(third.owners) == {"10.0.8.1", "10.0.8.2"}


def test_need_from_the_future_is_answered_once_not_polled_for_forever(cri_fault, client,
                                                                      recorder):
    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        poller.need(time.monotonic_ns() + 10 * 10**9)   # a wrong clock: 10 s ahead
        await asyncio.sleep(0.5)
        await stop(task)

    asyncio.run(asyncio.wait_for(body(), 10))
    assert len(recorder.views) == 2, len(recorder.views)


def test_sandboxes_and_views_are_immutable_and_sandboxes_hashable(cri_fault, client):
    cri_fault.put(fake_sandbox(name="a", ip="10.0.9.1", annotations={ROLE: "r"}))
    view = client.poll()
    sandbox = view.owners["10.0.9.1"]
    assert {sandbox} == set(view.sandboxes)
    with pytest.raises(TypeError):
        view.owners["10.0.9.2"] = sandbox          # type: ignore[index]
    with pytest.raises(TypeError):
        sandbox.annotations[ROLE] = "other"        # type: ignore[index]
