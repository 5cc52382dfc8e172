"""A pod that asked for container credentials but was created without them (the webhook down
or refusing): the agent's predicate and the Event it posts (kiamfast/container_credentials/
uninjected.py), on pods as the webhook leaves them.  The real API server's side:
test_uninjected_event.py."""
from __future__ import annotations

import logging

import pytest
from test_webhook_patch import OPTED_IN, ROLE_KEY, admitted, pod

from kiamfast.container_credentials import uninjected
from kiamfast.webhook import patch


def asked(obj) -> bool:
    return uninjected.asked_but_not_injected(obj, role_key=ROLE_KEY)


def test_the_names_are_the_webhooks():
    assert uninjected.OPT_IN_ANNOTATION == patch.OPT_IN_ANNOTATION
    assert uninjected.TOKEN_VOLUME == patch.VOLUME
    assert uninjected.PROVIDER_VARIABLES == patch.PROVIDER_VARIABLES


def test_an_opted_in_pod_created_without_the_webhook_asked_and_was_not_injected():
    assert asked(pod(OPTED_IN))


def test_the_same_pod_as_the_webhook_leaves_it_was_injected():
    stored = admitted(pod(OPTED_IN, initContainers=[{"name": "init", "image": "i"}]))
    assert any(v["name"] == patch.VOLUME for v in stored["spec"]["volumes"])
    assert not asked(stored)


@pytest.mark.parametrize("annotations", [
    {}, {ROLE_KEY: "role-a"}, {patch.OPT_IN_ANNOTATION: "true"},
    {ROLE_KEY: "role-a", patch.OPT_IN_ANNOTATION: "false"},
    {ROLE_KEY: "", patch.OPT_IN_ANNOTATION: "true"}])
def test_a_pod_that_did_not_opt_in_by_its_own_annotations_did_not_ask(annotations):
    assert not asked(pod(annotations))


def test_pods_the_webhook_leaves_alone_on_purpose_did_not_miss_anything():
    own = pod(OPTED_IN, containers=[{"name": "app", "image": "a", "env": [
        {"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": "http://127.0.0.1:9/own"}]}])
    assert admitted(own) == own and not asked(own)
    no_account = pod(OPTED_IN, serviceAccountName="")
    assert admitted(no_account) == no_account and not asked(no_account)


def test_finished_and_deleting_pods_need_nothing():
    done = {**pod(OPTED_IN), "status": {"phase": "Succeeded"}}
    deleting = pod(OPTED_IN)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not asked(done) and not asked(deleting)


def stored(name: str, uid: str, annotations=OPTED_IN) -> dict:
    obj = pod(annotations)
    obj["metadata"].update(name=name, uid=uid, namespace="ns")
    return obj


def test_the_event_names_the_pod_and_says_what_to_do():
    body = uninjected.event(stored("web-1", "1234"), node="node-a", now=0)
    assert body["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "web-1",
                                      "namespace": "ns", "uid": "1234"}
    assert (body["type"], body["reason"]) == ("Warning", "ContainerCredentialsNotInjected")
    assert body["metadata"] == {"name": "web-1.kiamfast-1234", "namespace": "ns"}
    assert "IMDS by address" in body["message"] and "Recreate it" in body["message"]
    assert body["firstTimestamp"] == body["lastTimestamp"] == "1970-01-01T00:00:00Z"
    long_name = uninjected.event(stored("p" * 253, "u" * 36), node="n")["metadata"]["name"]
    assert len(long_name) <= 253


class Failure(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


def test_each_pod_is_reported_once_and_a_failing_post_is_logged_once(caplog):
    posted, failures = [], []

    def create(body):
        if failures:
            raise failures.pop()
        posted.append(body["involvedObject"]["name"])
    reporter = uninjected.UninjectedPods(role_key=ROLE_KEY, node="n", create_event=create,
                                         run_in_thread=lambda post: post())
    caplog.set_level(logging.WARNING, logger="kiamfast.container_credentials")
    for _ in range(3):                         # every MODIFIED event of the pod
        reporter.seen(stored("a", "uid-a"))
    reporter.seen(stored("plain", "uid-p", annotations={ROLE_KEY: "role-a"}))
    assert posted == ["a"] and reporter.reported == 1
    failures[:] = [Failure(403), Failure(403)]
    reporter.seen(stored("b", "uid-b"))
    reporter.seen(stored("c", "uid-c"))
    assert caplog.text.count("cannot post Events") == 1
    failures[:] = [Failure(409)]               # posted by a previous control process
    reporter.seen(stored("d", "uid-d"))
    assert caplog.text.count("cannot post Events") == 1
    assert reporter.reported == 4 and posted == ["a"]


def test_a_reported_pod_once_deleting_or_finished_is_no_longer_remembered(caplog):
    """Nothing kept per pod once it goes (issue 45): 5,000 pods reported, each then seen
    deleting (or finished) as the watch shows it, leave the reporter as it was."""
    import gc
    import tracemalloc
    # The test's log capture keeps every record: no records, so that only the reporter's
    # own memory is measured.
    caplog.set_level(logging.CRITICAL, logger="kiamfast.container_credentials")
    reporter = uninjected.UninjectedPods(role_key=ROLE_KEY, node="n",
                                         create_event=lambda body: None,
                                         run_in_thread=lambda post: post())

    def churn(start: int, n: int) -> None:
        for i in range(start, start + n):
            live = stored(f"p-{i}", f"uid-{i:08d}")
            reporter.seen(live)
            if i % 2:
                live["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            else:
                live["status"] = {"phase": "Succeeded"}
            reporter.seen(live)

    tracemalloc.start(1)
    try:
        churn(0, 100)
        gc.collect()
        before = tracemalloc.take_snapshot()
        churn(100, 5000)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(s.size_diff for s in after.compare_to(before, "filename")
               if "container_credentials" in str(s.traceback))
    assert reporter.reported == 5100
    assert kept < 4096, [str(s) for s in after.compare_to(before, "lineno")[:5]]
