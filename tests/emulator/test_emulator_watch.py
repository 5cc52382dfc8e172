"""The emulator's watch protocol through the real ``kubernetes`` client and raw streams:
ordering, resume, selector transitions, 410 Gone, bookmarks, timeouts, dropped streams."""

from __future__ import annotations

import random
import threading
import time

import pytest
import urllib3
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from kiamfast.testing.apiserver import ApiServer


def _raw_watch(api, **kw):
    kw.setdefault("_request_timeout", 15)
    return api.list_pod_for_all_namespaces(watch=True, _preload_content=False, **kw)


def _rv(ev: dict) -> int:
    return int(ev["object"]["metadata"]["resourceVersion"])


def _later(delay: float, fn) -> threading.Thread:
    def run():
        time.sleep(delay)
        fn()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_watch_sees_added_modified_deleted_in_order(srv, api):
    srv.nodes.add("node-a")
    srv.nodes.add("node-b")
    rv = api.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a") \
        .metadata.resource_version

    def mutate():
        assert srv.traffic.wait_watches(1, node="node-a")
        srv.pods.create("default", "other-node", node="node-b")      # not for this watch
        srv.pods.create("default", "p", node="node-a", annotations={"a": "1"})
        srv.pods.set_ips("default", "p", ["10.0.0.5"])
        srv.pods.set_phase("default", "p", "Running")
        srv.pods.mark_terminating("default", "p")
        srv.pods.delete("default", "p")

    t = _later(0, mutate)
    w = watch.Watch()
    seen = []
    for ev in w.stream(api.list_pod_for_all_namespaces, field_selector="spec.nodeName=node-a",
                       resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=10):
        if ev["type"] == "BOOKMARK":
            continue
        pod = ev["object"]
        seen.append((ev["type"], pod.metadata.name, pod.status.pod_ip, pod.status.phase,
                     pod.metadata.deletion_timestamp is not None,
                     int(pod.metadata.resource_version)))
        if ev["type"] == "DELETED":
            w.stop()
    t.join()
    assert [s[:5] for s in seen] == [
        ("ADDED", "p", None, "Pending", False),
        ("MODIFIED", "p", "10.0.0.5", "Pending", False),
        ("MODIFIED", "p", "10.0.0.5", "Running", False),
        ("MODIFIED", "p", "10.0.0.5", "Running", True),
        ("DELETED", "p", "10.0.0.5", "Running", True),
    ]
    rvs = [s[5] for s in seen]
    assert rvs == sorted(rvs) and len(set(rvs)) == len(rvs)
    assert w.resource_version == str(rvs[-1])
    assert srv.traffic.stats()["watches_by_node"] == {"node-a": 1}


def test_watch_without_resource_version_starts_with_current_state(srv, api):
    srv.nodes.add("n")
    srv.pods.create("default", "b", node="n")
    srv.pods.create("default", "a", node="n")
    w = watch.Watch()
    events = []
    for ev in w.stream(api.list_pod_for_all_namespaces, allow_watch_bookmarks=True):
        if ev["type"] == "BOOKMARK":     # only sent once the initial state is out
            w.stop()
            continue
        events.append(ev)
    assert [(e["type"], e["object"].metadata.name) for e in events] == \
        [("ADDED", "a"), ("ADDED", "b")]


def test_send_initial_events_ends_with_annotated_bookmark(srv, api, read_events):
    srv.nodes.add("n")
    srv.pods.create("default", "a", node="n")
    resp = _raw_watch(api, send_initial_events=True, resource_version_match="NotOlderThan",
                      allow_watch_bookmarks=True)
    events = []
    for ev in read_events(resp):
        events.append(ev)
        if ev["type"] == "BOOKMARK":
            resp.close()
            break
    assert events[0]["type"] == "ADDED"
    end = events[1]
    assert end["type"] == "BOOKMARK"
    assert end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert end["object"]["metadata"]["resourceVersion"] == srv.resource_version


def test_resume_from_resource_version_replays_only_later_events(srv, api, caught_up):
    srv.nodes.add("n")
    srv.pods.create("default", "p1", node="n")
    rv1 = srv.resource_version
    srv.pods.create("default", "p2", node="n")
    rv2 = srv.resource_version
    srv.pods.set_phase("default", "p1", "Running")
    srv.pods.delete("default", "p2")

    def replay(rv):
        events = caught_up(api.list_pod_for_all_namespaces, resource_version=rv)
        return [(e["type"], e["object"]["metadata"]["name"]) for e in events]

    assert replay(rv1) == [("ADDED", "p2"), ("MODIFIED", "p1"), ("DELETED", "p2")]
    assert replay(rv2) == [("MODIFIED", "p1"), ("DELETED", "p2")]
    assert replay(srv.resource_version) == []


def test_field_selector_transitions_are_added_and_deleted(srv, api, caught_up):
    srv.nodes.add("n")
    srv.pods.create("default", "p", node="n")
    rv = srv.resource_version
    srv.pods.set_ips("default", "p", ["10.1.1.1"])     # starts matching -> ADDED
    srv.pods.set_phase("default", "p", "Running")      # still matching -> MODIFIED
    srv.pods.set_ips("default", "p", ["10.1.1.2"])     # stops matching -> DELETED
    last = srv.resource_version
    events = caught_up(api.list_pod_for_all_namespaces, field_selector="status.podIP=10.1.1.1",
                       resource_version=rv)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    gone = events[-1]["object"]
    # The real watch cache sends the previous object with the event's resourceVersion.
    assert gone["status"]["podIP"] == "10.1.1.1"
    assert gone["metadata"]["resourceVersion"] == last


def test_too_old_resource_version_after_compact(srv, api, read_events, caught_up):
    srv.nodes.add("n")
    srv.pods.create("default", "p", node="n")
    old_rv = srv.resource_version
    srv.pods.set_phase("default", "p", "Running")
    srv.faults.compact()

    # Raw: HTTP 200, then one ERROR event carrying a 410 Status, then the stream ends.
    resp = _raw_watch(api, resource_version=old_rv)
    assert resp.status == 200
    events = list(read_events(resp))
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    status = events[0]["object"]
    assert status["kind"] == "Status" and status["code"] == 410
    assert status["reason"] == "Expired"
    assert status["message"].startswith(f"too old resource version: {old_rv} (")

    # The kubernetes client retries once from the same RV, then raises 410.
    with pytest.raises(ApiException) as exc:
        for _ in watch.Watch().stream(api.list_pod_for_all_namespaces, resource_version=old_rv):
            pass
    assert exc.value.status == 410
    # A watch from the current RV is fine.
    assert caught_up(api.list_pod_for_all_namespaces, resource_version=srv.resource_version) == []


def test_history_window_bounds_resume(api_factory, tmp_path, read_events):
    with ApiServer(history_window=3, bookmark_interval=0.2) as server:
        api = api_factory(server.write_kubeconfig(tmp_path / "kc"))
        server.nodes.add("n")
        start = server.resource_version
        for i in range(4):
            server.pods.create("default", f"p{i}", node="n")
        events = list(read_events(_raw_watch(api, resource_version=start)))
        assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410
        recent = str(int(server.resource_version) - 3)
        events = []
        for ev in read_events(_raw_watch(api, resource_version=recent)):
            events.append(ev)
            if len(events) == 3:
                break
        assert [e["object"]["metadata"]["name"] for e in events] == ["p1", "p2", "p3"]


def test_bookmarks_arrive_and_never_pass_undelivered_events(srv, api, read_events):
    srv.nodes.add("n")
    rv = srv.resource_version
    srv.faults.delay_events(0.6)
    resp = _raw_watch(api, resource_version=rv, allow_watch_bookmarks=True,
                      field_selector="spec.nodeName=n", timeout_seconds=10)
    assert srv.traffic.wait_watches(1, node="n")
    srv.pods.create("default", "late", node="n")
    added_rv = int(srv.resource_version)
    srv.faults.delay_events(0)
    seen = []
    for ev in read_events(resp):
        seen.append((ev["type"], _rv(ev)))
        if ev["type"] == "BOOKMARK" and _rv(ev) >= added_rv:
            resp.release_conn()
            break
    types = [t for t, _ in seen]
    assert "ADDED" in types
    added_at = types.index("ADDED")
    assert all(r < added_rv for t, r in seen[:added_at]), seen
    assert all(t == "BOOKMARK" for t in types[:added_at] + types[added_at + 1:]), seen
    assert srv.traffic.stats()["bookmarks_sent"] >= 1


def test_timeout_seconds_ends_stream_cleanly_with_a_final_bookmark(srv, api, read_events):
    srv.nodes.add("n")
    srv.pods.create("default", "p", node="n")
    rv = srv.resource_version
    resp = _raw_watch(api, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=1)
    events = list(read_events(resp))          # returns: the server ended the chunked body
    assert events and events[-1]["type"] == "BOOKMARK"
    assert _rv(events[-1]) == int(rv)
    assert srv.traffic.watch_count() == 0
    # The kubernetes client's stream with timeout_seconds ends too (no retry).
    assert list(watch.Watch().stream(api.list_pod_for_all_namespaces, resource_version=rv,
                                     timeout_seconds=1)) == []


def test_drop_watches_closes_streams_abruptly(srv, api, read_events, caught_up):
    srv.nodes.add("n")
    resp = _raw_watch(api, resource_version=srv.resource_version)
    errors = []

    def client_watch():
        try:
            for _ in watch.Watch().stream(api.list_pod_for_all_namespaces,
                                          resource_version=srv.resource_version):
                pass
        except Exception as exc:  # noqa: BLE001 - the test inspects what the client raised
            errors.append(exc)

    t = threading.Thread(target=client_watch, daemon=True)
    t.start()
    assert srv.traffic.wait_watches(2)
    assert srv.faults.drop_watches() == 2
    with pytest.raises(urllib3.exceptions.ProtocolError):
        list(read_events(resp))
    t.join(10)
    assert not t.is_alive()
    assert errors and isinstance(errors[0], urllib3.exceptions.ProtocolError)
    deadline = time.monotonic() + 5
    while srv.traffic.watch_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.traffic.watch_count() == 0
    # New watches work after a drop.
    srv.pods.create("default", "after", node="n")
    assert [e["object"]["metadata"]["name"] for e in caught_up(
        api.list_pod_for_all_namespaces, resource_version="0")] == ["after"]


def test_client_hangup_unregisters_the_watch(srv, api):
    resp = _raw_watch(api, resource_version=srv.resource_version)
    assert srv.traffic.wait_watches(1)
    resp.close()          # closes the client's socket: the server sees EOF
    deadline = time.monotonic() + 5
    while srv.traffic.watch_count() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.traffic.watch_count() == 0


def test_node_and_namespace_watches(srv, api, caught_up):
    srv.nodes.add("node-a", taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])
    rv = srv.resource_version
    api.patch_node("node-a", [{"op": "remove", "path": "/spec/taints/0"}])
    srv.namespaces.add("team", annotations={"iam.amazonaws.com/permitted": "a"})
    srv.namespaces.set_annotations("team", {"iam.amazonaws.com/permitted": "b"})

    nodes = caught_up(api.list_node, resource_version=rv)
    assert [(e["type"], "taints" in e["object"]["spec"]) for e in nodes] == [("MODIFIED", False)]
    node_w = caught_up(api.list_node, field_selector="metadata.name=node-a")
    assert [e["object"]["metadata"]["name"] for e in node_w] == ["node-a"]

    nss = caught_up(api.list_namespace, resource_version=rv)
    assert [(e["type"], e["object"]["metadata"]["annotations"]) for e in nss] == [
        ("ADDED", {"iam.amazonaws.com/permitted": "a"}),
        ("MODIFIED", {"iam.amazonaws.com/permitted": "b"}),
    ]


def test_namespaced_watch_only_sees_its_namespace(srv, api, caught_up):
    srv.nodes.add("n")
    rv = srv.resource_version
    srv.pods.create("a", "p", node="n")
    srv.pods.create("b", "p", node="n")
    events = caught_up(lambda **kw: api.list_namespaced_pod("b", **kw), resource_version=rv)
    assert [(e["object"]["metadata"]["namespace"]) for e in events] == ["b"]


def test_concurrent_mutations_keep_every_watch_consistent(srv, api, read_events):
    nodes = ["n0", "n1", "n2"]
    for n in nodes:
        srv.nodes.add(n)
    start = srv.resource_version
    selectors = ["spec.nodeName=n0", "spec.nodeName=n1", "", "status.phase=Running"]
    results: dict[str, dict] = {}
    failures: list[BaseException] = []
    done = threading.Event()

    def watcher(sel: str) -> None:
        try:
            state: dict = {}
            last = 0
            kw = {"field_selector": sel} if sel else {}
            resp = _raw_watch(api, resource_version=start, allow_watch_bookmarks=True, **kw)
            for ev in read_events(resp):
                rv = _rv(ev)
                if ev["type"] == "BOOKMARK":
                    assert rv >= last
                    if done.is_set() and rv >= int(srv.resource_version):
                        resp.release_conn()
                        break
                    continue
                assert rv > last, "events out of order"
                last = rv
                key = (ev["object"]["metadata"]["namespace"], ev["object"]["metadata"]["name"])
                if ev["type"] == "DELETED":
                    assert key in state
                    del state[key]
                else:
                    assert (ev["type"] == "ADDED") == (key not in state)
                    state[key] = ev["object"]["metadata"]["resourceVersion"]
            results[sel] = state
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    def mutator(seed: int) -> None:
        rnd = random.Random(seed)
        for i in range(60):
            name = f"m{seed}-{i % 12}"
            if srv.pods.get("default", name) is None:
                srv.pods.create("default", name, node=rnd.choice(nodes))
            else:
                op = rnd.random()
                if op < 0.4:
                    srv.pods.set_phase("default", name, rnd.choice(["Pending", "Running"]))
                elif op < 0.7:
                    srv.pods.set_ips("default", name, [f"10.{seed}.0.{i}"])
                else:
                    srv.pods.delete("default", name)

    watchers = [threading.Thread(target=watcher, args=(s,), daemon=True) for s in selectors]
    for t in watchers:
        t.start()
    assert srv.traffic.wait_watches(len(selectors))
    mutators = [threading.Thread(target=mutator, args=(s,)) for s in range(4)]
    for t in mutators:
        t.start()
    for t in mutators:
        t.join()
    done.set()
    for t in watchers:
        t.join(15)
    assert not failures, failures
    for sel in selectors:
        listed = api.list_pod_for_all_namespaces(**({"field_selector": sel} if sel else {}))
        expected = {(p.metadata.namespace, p.metadata.name): p.metadata.resource_version
                    for p in listed.items}
        assert results[sel] == expected, sel


def test_per_node_lists_at_scale(srv, api):
    n_nodes, per_node = 20, 110
    for n in range(n_nodes):
        srv.nodes.add(f"node-{n}")
        for i in range(per_node):
            srv.pods.create(f"ns{i % 7}", f"pod-{n}-{i}", node=f"node-{n}",
                            ips=[f"10.{n}.{i // 250}.{i % 250}"], phase="Running")
    for n in (0, n_nodes - 1):
        items = api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName=node-{n}", _preload_content=False)
        import json
        doc = json.loads(items.data)
        assert len(doc["items"]) == per_node
        assert {p["spec"]["nodeName"] for p in doc["items"]} == {f"node-{n}"}
    stats = srv.traffic.stats()
    assert stats["lists_by_node"] == {"node-0": 1, f"node-{n_nodes - 1}": 1}
    assert stats["resource_version"] >= n_nodes * (per_node + 1)
