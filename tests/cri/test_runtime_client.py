"""The CRI client and poller against a real containerd with real sandboxes.

What the agent will rely on, checked where it comes from: a READY sandbox owns its
addresses under the pod identity in its labels; a stopped sandbox (or one whose pause
process died) owns nothing at once, before anyone removes it; an address host-local hands
to a new sandbox moves with it; a view started after a stop never shows the stopped owner;
status answers are asked once per sandbox, and many asked at once each land on their own
sandbox; host-network and label-less sandboxes own nothing; a killed containerd is an
outage the poller reports once and recovers from, with the sandboxes still there. And the
harness itself: a client entered into a sandbox reaches the node from the sandbox's
addresses, and a killed test run is cleaned up by the next.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from containerd import sweep_stale_runs
from poller_tasks import running, stop

from kiamfast.control.cri.client import RuntimeClient, RuntimeUnavailable, resolve_endpoint
from kiamfast.control.cri.poller import RuntimePoller

ROLE = "iam.amazonaws.com/role"


@pytest.fixture
def client(containerd):
    c = RuntimeClient(containerd.endpoint, timeout=2.0)
    try:
        yield c
    finally:
        c.close()


# -- --cri-endpoint (no runtime needed) -------------------------------------------------

def test_endpoint_none_and_empty_disable_the_runtime():
    assert resolve_endpoint("") is None
    assert resolve_endpoint("none") is None


def test_endpoint_path_without_scheme_is_a_unix_socket():
    assert resolve_endpoint("/run/k3s/containerd/containerd.sock") == \
        "unix:///run/k3s/containerd/containerd.sock"
    assert resolve_endpoint("unix:///x/y.sock") == "unix:///x/y.sock"


def test_endpoint_auto_takes_the_first_socket_that_exists(tmp_path, monkeypatch):
    present = tmp_path / "crio.sock"
    present.touch()
    monkeypatch.setattr("kiamfast.control.cri.client.DEFAULT_ENDPOINTS",
                        (f"unix://{tmp_path}/missing.sock", f"unix://{present}"))
    assert resolve_endpoint("auto") == f"unix://{present}"
    present.unlink()
    assert resolve_endpoint("auto") is None


# -- the client ------------------------------------------------------------------------

@pytest.mark.root
def test_version_names_containerd(client):
    assert client.version().startswith("containerd ")


@pytest.mark.root
def test_ready_sandbox_owns_its_addresses_as_its_pod(containerd, client):
    pod = containerd.run_sandbox("web-0", namespace="shop",
                                 annotations={ROLE: "arn:aws:iam::123456789012:role/web"})
    view = client.poll()
    assert pod.ip.startswith("10.88.0.") and pod.additional_ips[0].startswith("fd00:88::")
    for ip in (pod.ip, pod.additional_ips[0]):
        owner = view.owners[ip]
        assert (owner.id, owner.pod_uid, owner.name, owner.namespace) == \
            (pod.id, pod.uid, "web-0", "shop")
        assert owner.annotations[ROLE] == "arn:aws:iam::123456789012:role/web"
    assert view.owners[pod.ip].ips == (pod.ip, pod.additional_ips[0])
    assert [s.id for s in view.sandboxes] == [pod.id] and view.conflicts == frozenset()


@pytest.mark.root
def test_stopped_sandbox_owns_nothing_before_it_is_removed(containerd, client):
    pod = containerd.run_sandbox("stopping")
    assert pod.ip in client.poll().owners
    containerd.stop_sandbox(pod.id)
    stopped_at = time.monotonic_ns()
    view = client.poll()
    assert view.started_ns >= stopped_at
    assert pod.ip not in view.owners and pod.additional_ips[0] not in view.owners
    assert containerd.status(pod.id).state == 1   # SANDBOX_NOTREADY, still there


@pytest.mark.root
def test_sandbox_whose_pause_process_died_owns_nothing(containerd, client):
    """containerd marks it NOTREADY but keeps reporting (and reserving) its IP until
    StopPodSandbox: the state decides, not the address."""
    pod = containerd.run_sandbox("crashed")
    assert pod.ip in client.poll().owners
    os.kill(pod.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while containerd.status(pod.id).state != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert containerd.status(pod.id).network.ip == pod.ip   # still reported
    assert pod.ip not in client.poll().owners


@pytest.mark.root
def test_reused_address_moves_to_the_new_sandbox(containerd, client):
    old = containerd.run_sandbox("old", annotations={ROLE: "old-role"})
    assert client.poll().owners[old.ip].pod_uid == old.uid
    containerd.set_range(old.ip, old.ip)   # host-local can only hand out this address now
    containerd.stop_sandbox(old.id)
    assert old.ip not in client.poll().owners
    new = containerd.run_sandbox("new", annotations={ROLE: "new-role"})
    assert new.ip == old.ip
    owner = client.poll().owners[new.ip]
    assert (owner.id, owner.pod_uid, owner.annotations[ROLE]) == (new.id, new.uid, "new-role")


@pytest.mark.root
def test_view_starts_before_its_request_and_sees_changes_made_before_it(containerd, client):
    before = time.monotonic_ns()
    pod = containerd.run_sandbox("fresh")
    ran_at = time.monotonic_ns()
    view = client.poll()
    after = time.monotonic_ns()
    assert ran_at <= view.started_ns <= after and view.started_ns > before
    assert view.owners[pod.ip].id == pod.id


@pytest.mark.root
def test_status_is_asked_once_per_sandbox(containerd, client):
    first, second = containerd.run_sandbox("a"), containerd.run_sandbox("b")
    client.poll()
    assert client.stats["status_calls"] == 2
    view = client.poll()
    assert client.stats["status_calls"] == 2 and {first.ip, second.ip} <= set(view.owners)
    third = containerd.run_sandbox("c")
    assert third.ip in client.poll().owners
    assert client.stats["status_calls"] == 3
    containerd.remove_sandbox(first.id)
    view = client.poll()
    assert first.ip not in view.owners and client.stats["status_calls"] == 3


@pytest.mark.root
def test_new_sandboxes_asked_together_each_own_their_own_addresses(containerd, client):
    """One poll asks the statuses of many new sandboxes at once (several in flight): each
    answer must land on its own sandbox, as containerd gives them."""
    pods = [containerd.run_sandbox(f"batch-{i}") for i in range(12)]
    view = client.poll()
    assert {ip: (s.id, s.pod_uid, s.name) for ip, s in view.owners.items()} == \
        {ip: (p.id, p.uid, p.name) for p in pods for ip in (p.ip, *p.additional_ips)}
    assert client.stats["status_calls"] == 12 and client.stats["status_errors"] == 0


@pytest.mark.root
@pytest.mark.slow
def test_a_list_beyond_the_flow_control_window_arrives_whole(containerd, client):
    """120 sandboxes with 30 annotations of 400 bytes: containerd's ListPodSandbox answer
    is about 1.5 MiB, beyond the client's 1 MiB window, so it arrives only if the client
    hands the window back (WINDOW_UPDATE) as it reads."""
    annotations = {f"example.com/note-{k}": "n" * 400 for k in range(30)}
    labels = {f"app.example.com/label-{k}": f"value-{k}" for k in range(10)}
    pods = [containerd.run_sandbox(f"big-{i}", labels=labels,
                                   annotations={**annotations, ROLE: f"role-{i}"})
            for i in range(120)]
    view = client.poll()
    assert {ip: (s.id, s.pod_uid) for ip, s in view.owners.items()} == \
        {ip: (p.id, p.uid) for p in pods for ip in (p.ip, *p.additional_ips)}
    assert all(s.annotations[ROLE] == f"role-{s.name.removeprefix('big-')}"
               and len(s.annotations) == 31 for s in view.sandboxes)
    assert client.stats["status_errors"] == 0 and client.stats["errors"] == 0


@pytest.mark.root
def test_host_network_sandbox_owns_nothing(containerd, client, caplog):
    host = containerd.run_sandbox("node-exporter", host_network=True, annotations={ROLE: "x"})
    pod = containerd.run_sandbox("app")
    for _ in range(3):
        view = client.poll()
    assert [s.id for s in view.sandboxes] == [pod.id]
    assert all(owner.pod_uid != host.uid for owner in view.owners.values())
    assert client.stats["skipped_sandboxes"] == 1 and client.stats["status_calls"] == 2
    lines = [r for r in caplog.records if host.id in r.getMessage()]
    assert len(lines) == 1 and "host network" in lines[0].getMessage()


@pytest.mark.root
def test_sandbox_without_kubelet_labels_owns_nothing(containerd, client):
    stray = containerd.run_sandbox("not-from-kubelet", kubelet_labels=False)
    view = client.poll()
    assert stray.ip and stray.ip not in view.owners and view.sandboxes == ()
    assert client.stats["skipped_sandboxes"] == 1


@pytest.mark.root
def test_killed_containerd_is_unavailable_and_restarted_one_still_has_the_sandboxes(
        containerd, client):
    pod = containerd.run_sandbox("survivor")
    assert client.poll().owners[pod.ip].id == pod.id
    containerd.kill()
    with pytest.raises(RuntimeUnavailable) as raised:
        client.poll()
    assert containerd.endpoint in str(raised.value) and "UNAVAILABLE" in str(raised.value)
    containerd.start()
    view = client.poll()
    assert view.owners[pod.ip].id == pod.id and view.owners[pod.ip].pod_uid == pod.uid


# -- the poller ------------------------------------------------------------------------

@pytest.mark.root
def test_poller_polls_periodically(containerd, client, recorder):
    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=0.1)
        task = await running(poller)
        await asyncio.sleep(0.55)
        await stop(task)
        return poller

    poller = asyncio.run(asyncio.wait_for(body(), 10))
    assert 3 <= len(recorder.views) <= 8, len(recorder.views)   # ~6 at 0.1 s
    assert recorder.states == [(True, "")] and poller.healthy
    starts = [v.started_ns for v in recorder.views]
    assert starts == sorted(starts)


@pytest.mark.root
def test_need_is_answered_by_a_view_that_no_longer_shows_a_sandbox_stopped_before(
        containerd, client, recorder):
    """The freshness proof end to end: stop at T, need(T), the view that answers it
    (started_ns >= T) does not name the stopped sandbox as an owner."""
    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0)   # only need() makes it poll
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        for i in range(3):
            pod = await asyncio.to_thread(containerd.run_sandbox, f"short-{i}")
            seen = await recorder.view_after(poller, time.monotonic_ns())
            assert seen.owners[pod.ip].id == pod.id
            await asyncio.to_thread(containerd.stop_sandbox, pod.id)
            stopped_at = time.monotonic_ns()
            view = await recorder.view_after(poller, stopped_at)
            assert view.started_ns >= stopped_at and pod.ip not in view.owners
        await stop(task)

    asyncio.run(asyncio.wait_for(body(), 20))
    assert len(recorder.views) == 7   # the first one and one per need(): nothing periodic


@pytest.mark.root
def test_concurrent_needs_are_all_satisfied_with_few_polls(containerd, client, recorder):
    containerd.run_sandbox("busy")

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=30.0)
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        polls_before = client.stats["polls"]

        async def caller():
            await asyncio.sleep(random.random() * 0.05)
            after = time.monotonic_ns()
            view = await recorder.view_after(poller, after)
            assert view.started_ns >= after

        await asyncio.gather(*(caller() for _ in range(50)))
        await stop(task)
        return client.stats["polls"] - polls_before

    polls = asyncio.run(asyncio.wait_for(body(), 20))
    assert 1 <= polls < 50, polls   # coalesced: far fewer polls than requests


@pytest.mark.root
def test_poller_reports_a_runtime_outage_once_backs_off_and_recovers(
        containerd, client, recorder):
    pod = containerd.run_sandbox("outlives-the-outage")

    async def body():
        poller = RuntimePoller(client, on_view=recorder.on_view, on_state=recorder.on_state,
                               interval=0.1, backoff_max=1.0, rng=random.Random(7))
        task = await running(poller)
        await recorder.until(lambda: recorder.views)
        await asyncio.to_thread(containerd.kill)
        await recorder.until(lambda: not poller.healthy)
        failed_before = poller.stats["failed_polls"]
        outage_end = asyncio.get_running_loop().time() + 2.0
        while asyncio.get_running_loop().time() < outage_end:   # callers keep asking
            poller.need(time.monotonic_ns())
            await asyncio.sleep(0.01)
        failed_during = poller.stats["failed_polls"] - failed_before
        assert recorder.states[-1][0] is False and len(recorder.states) == 2
        views_before = len(recorder.views)
        await asyncio.to_thread(containerd.start)
        await recorder.until(lambda: poller.healthy, timeout=5)
        view = await recorder.view_after(poller, time.monotonic_ns())
        await stop(task)
        return poller, failed_during, views_before, view

    poller, failed_during, views_before, view = asyncio.run(asyncio.wait_for(body(), 30))
    # callers asking all the time get an attempt each demand_floor at most: about 40 in
    # 2 s at 50 ms, not 200
    assert 1 <= failed_during <= 2.0 / poller.demand_floor + 3, failed_during
    assert [ok for ok, _ in recorder.states] == [True, False, True]
    message = recorder.states[1][1]
    assert containerd.endpoint in message and "UNAVAILABLE" in message
    assert poller.stats["outages"] == 1 and poller.last_error == ""
    assert len(recorder.views) > views_before and view.owners[pod.ip].id == pod.id


# -- the harness itself: what the end-to-end tests build on -----------------------------

_PEER_SERVER = """
import socket, sys
srv = socket.socket(socket.AF_INET6)
srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
srv.bind(("::", 0)); srv.listen(4)
print(srv.getsockname()[1], flush=True)
for _ in range(2):
    conn, peer = srv.accept()
    conn.sendall(peer[0].encode()); conn.close()
"""

_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
    print(s.recv(100).decode())
"""


@pytest.mark.root
def test_a_client_in_a_sandbox_reaches_the_node_from_the_sandbox_address(containerd,
                                                                         node_netns):
    """What the agent relies on: a process entered into a sandbox's network namespace
    talks to the node (over the bridge) from the address the runtime reports."""
    pod = containerd.run_sandbox("client")
    server = subprocess.Popen(["nsenter", f"--net={node_netns.path}", "--", sys.executable,
                               "-c", _PEER_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        seen = [containerd.exec_in_sandbox(pod.id, [sys.executable, "-c", _CLIENT, gw, port],
                                           timeout=10).stdout.strip()
                for gw in (containerd.gateway, containerd.gateway6)]
    finally:
        server.kill()
        server.wait()
    assert seen == [f"::ffff:{pod.ip}", pod.additional_ips[0]]


_KILLED_RUN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from containerd import Containerd
runtime = Containerd(netns=sys.argv[2], subnet="10.89.0.0/24").start()
sandbox = runtime.run_sandbox("left-behind")
print(runtime.dir, sandbox.pid, runtime.bridge, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.root
def test_a_killed_run_is_cleaned_up_by_the_next(node_netns):
    """A test process SIGKILLed with containerd and a sandbox running leaves them behind;
    the next run's sweep kills them, unmounts, and removes the directory and bridge."""
    run = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(Path(__file__).parent),
                            node_netns.name], stdout=subprocess.PIPE, text=True)
    try:
        left_dir, pause_pid, bridge = run.stdout.readline().split()
    finally:
        run.kill()
        run.wait()
    left_dir, pause_pid = Path(left_dir), int(pause_pid)
    assert left_dir.exists() and _alive(pause_pid)
    assert left_dir in sweep_stale_runs()   # what every new Containerd() does first
    assert not left_dir.exists() and not _alive(pause_pid)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"{left_dir}/" not in mounts
    links = node_netns.run(["ip", "-o", "link"]).stdout
    assert bridge not in links
