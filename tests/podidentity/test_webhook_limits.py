"""The webhook's memory bounds (kiamfast/webhook/limits.py): the parse cost it reserves is an
upper bound of what ``json.loads`` takes (measured with tracemalloc, which sees every Python
allocation), for the densest shapes JSON has and for real pods; the budget waits, then says no.
"""
from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pytest

from kiamfast.webhook import limits

N = 200_000       # bytes of each shape


def shapes() -> dict[str, bytes]:
    env = [{"name": f"V{i}", "value": "x"} for i in range(N // 30)]
    return {
        "empty objects": b"[" + b",".join([b"{}"] * (N // 3)) + b"]",
        "empty lists": b"[" + b",".join([b"[]"] * (N // 3)) + b"]",
        "one-key objects": b"[" + b",".join([b'{"a":1}'] * (N // 8)) + b"]",
        "short strings": b"[" + b",".join([b'"ab"'] * (N // 5)) + b"]",
        "distinct short strings": json.dumps([f"s{i}" for i in range(N // 8)]).encode(),
        "distinct keys": json.dumps({f"k{i}": 0 for i in range(N // 10)}).encode(),
        "ints": b"[" + b",".join([b"123456"] * (N // 7)) + b"]",
        "big ints": b"[" + b",".join([b"1" * 30] * (N // 31)) + b"]",
        "floats": b"[" + b",".join([b"1.5"] * (N // 4)) + b"]",
        "nested": b"[" * 500 + b"]" * 500,
        "env vars of a pod": json.dumps({"request": {"object": {"spec": {"containers": [
            {"name": "c", "env": env}]}}}}).encode(),
        "long annotation": json.dumps({"a": "v" * N}).encode(),
        "astral text, escaped": json.dumps({"a": "\U0001F600" + "v" * N}).encode(),
        "astral text, raw": json.dumps({"a": "\U0001F600" + "v" * N},
                                       ensure_ascii=False).encode(),
        "escaped BMP text": json.dumps({"a": "\u00e9" * (N // 6)}).encode(),
    }


@pytest.mark.parametrize("name", sorted(shapes()))
def test_the_parse_cost_bounds_what_json_loads_takes(name):
    body = shapes()[name]
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        parsed = json.loads(body)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    del parsed
    assert len(body) + peak <= limits.parse_cost(body), (name, len(body), peak)


def test_an_ordinary_pod_costs_little():
    pod = {"metadata": {"name": "web-7d9f", "annotations": {"iam.amazonaws.com/role": "r"}},
           "spec": {"containers": [{"name": f"c{i}", "image": "registry/app:1.2.3", "env": [
               {"name": f"VAR_{j}", "value": "some value"} for j in range(20)]}
               for i in range(3)]}}
    body = json.dumps({"request": {"uid": "u", "object": pod}}).encode()
    assert limits.parse_cost(body) < limits.SMALL_COST / 16


def test_a_budget_waits_then_says_no_and_keeps_room_for_small_reservations():
    budget = limits.ByteBudget(100, small=10, keep=30)
    assert budget.reserve(70, timeout=0)
    assert not budget.fits(71) and budget.fits(100 - 30)
    assert not budget.reserve(11, timeout=0.05)   # large: must leave 30 free
    assert budget.reserve(10, timeout=0)           # small: may use the rest
    started = time.monotonic()
    assert not budget.reserve(25, timeout=0.2)
    assert time.monotonic() - started >= 0.2
    threading.Timer(0.1, budget.release, (70,)).start()
    assert budget.reserve(50, timeout=5)
    assert budget.used == 60


def answer_shapes() -> dict[str, tuple[dict, dict]]:
    """(review, settings) of the reviews whose answer costs the most per byte: many empty
    containers (two operations each), containers with env and mounts already (three each,
    paths of their own), init containers, a long --full-uri, a role from the account."""
    from kiamfast.webhook import patch
    opted = {"iam.amazonaws.com/role": "role-a", patch.OPT_IN_ANNOTATION: "true"}
    full = {"name": "c", "env": [{"name": "A", "value": "1"}],
            "volumeMounts": [{"name": "v", "mountPath": "/v"}]}
    settings = {"role_key": "iam.amazonaws.com/role",
                "audience": "kiamfast.io/container-credentials", "expiration": 600}

    def review(spec: dict, annotations: dict = opted) -> dict:
        return {"request": {"uid": "u", "operation": "CREATE", "namespace": "ns",
                            "kind": {"kind": "Pod"}, "object": {
                                "metadata": {"name": "p", "annotations": annotations},
                                "spec": {"serviceAccountName": "app", **spec}}}}
    out = {}
    for n in (1, 10, 1000, 20000):
        out[f"{n} empty containers"] = (review({"containers": [{} for _ in range(n)]}),
                                        settings)
        out[f"{n} containers with env and mounts"] = (
            review({"containers": [json.loads(json.dumps(full)) for _ in range(n)]}), settings)
    out["init containers and containers"] = (review({
        "initContainers": [{} for _ in range(5000)], "containers": [{} for _ in range(5000)]}),
        settings)
    out["a long --full-uri"] = (review({"containers": [{} for _ in range(2000)]}),
                                {**settings, "full_uri": "http://169.254.170.23/" + "v" * 500})

    class Account:                        # the ServiceAccount's role, the longest allowed
        def get(self, namespace, name):
            return {"iam.amazonaws.com/role": "r" * patch.MAX_ROLE,
                    patch.OPT_IN_ANNOTATION: "true"}
    out["a role from the account"] = (review({"containers": [{}]}, annotations={}),
                                      {**settings, "accounts": Account()})
    return out


@pytest.mark.parametrize("name", sorted(answer_shapes()))
def test_the_answer_cost_bounds_what_building_the_answer_takes(name):
    """What the server does between its reservation and its reply: the answer, its JSON and
    bytes; what `answer_cost` reserves for it bounds it (tracemalloc sees every Python
    allocation)."""
    from kiamfast.webhook import admission as webhook_review
    parsed, settings = answer_shapes()[name]
    containers, cost = webhook_review.answer_cost(parsed, **settings)
    assert containers == sum(len(parsed["request"]["object"]["spec"].get(k, []))
                             for k in ("initContainers", "containers"))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = json.dumps(webhook_review.answer(parsed, **settings)).encode()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert b'"patch"' in out
    assert peak <= cost, (name, containers, peak, cost)


def test_a_review_that_cannot_be_patched_costs_nothing_to_answer():
    from kiamfast.webhook import admission as webhook_review
    settings = {"role_key": "iam.amazonaws.com/role", "audience": "a", "expiration": 600}
    many = {"containers": [{} for _ in range(1000)]}
    for review in ({"request": {"uid": "u", "operation": "UPDATE", "kind": {"kind": "Pod"},
                                "object": {"spec": many}}},
                   {"request": {"uid": "u", "operation": "CREATE", "kind": {"kind": "Pod"},
                                "object": {"metadata": {}, "spec": many}}},     # not opted in
                   "not a review", {"request": {"uid": "u", "object": []}}):
        assert webhook_review.answer_cost(review, **settings) == (0, limits.ANSWER_FIXED)
