"""The prefetch benchmark (bench/prefetch.py) counts what it claims: correctness only.

A small cold node and a small churn simulation, against moto's STS; timings are never
asserted (machines are shared and noisy).
"""
from __future__ import annotations

from kiamfast import table as tbl
from prefetch import churn, churn_events, kube2iam_calls, prefetch


def test_prefetch_small_cold_node_fills_every_slot_with_one_call_per_role():
    out = prefetch(50, 10, latency=0.02, qps=100, burst=20, max_inflight=4)
    assert out["slots"] == 10 and out["calls"] == 10  # counted before the bare baseline
    assert out["states"] == {tbl.CRED_READY}
    assert out["max_inflight"] <= 4


def test_churn_small_never_serves_short_and_calls_no_more_than_kube2iam():
    hours = 2.0
    events = churn_events(roles=5, pods=12, hours=hours, mean_life=1200)
    out = churn(events, hours=hours, policy="node-role", step=120)
    assert out["served_short"] == 0
    assert out["stats"]["sts_success"] == out["calls"]
    assert out["calls"] <= kube2iam_calls(events, hours=hours)
