"""The scale simulation counts what it claims to: correctness only, never timing."""

from __future__ import annotations

import scale_sim
from needs import tool_mark


def test_watch_fanout_counts_every_event_once():
    r = scale_sim.watch_fanout(nodes=6, pods_per_node=15, replace_fraction=0.5, wide_sample=2)
    assert r.replacements == 45 and r.cluster_events == 180
    # each event reaches exactly the watch of its node, and every cluster-wide watch
    assert r.node_events_total == r.cluster_events
    assert r.wide_agree and r.wide_events == r.cluster_events
    assert r.node_events * r.nodes == r.cluster_events
    # a node's list holds its own pods only; the cluster list all of them
    assert 5 < r.wide_list_bytes / r.node_list_bytes < 7
    assert r.wide_bytes > r.node_bytes * 5


def test_sts_calls_per_hour_compares_on_the_same_events():
    s = scale_sim.sts_calls_per_hour(nodes=10, roles=5, pods=12, hours=1.0, step=120.0,
                                     policies=("node-role",))
    assert s.kube2iam_per_node_hour > 0
    assert s.served_short == {"node-role": 0}
    assert 0 < s.kiamfast_per_node_hour["node-role"] <= s.kube2iam_per_node_hour


def test_floor_rss_reads_live_processes():
    floors = scale_sim.floor_rss()
    assert len(floors) == 3 and all(v > 5 * 2**20 for v in floors.values())


@tool_mark("nginx")  # the agent's metadata upstream (bench_agent)
def test_agent_footprint():
    r = scale_sim.agent_footprint(20, roles=5, events=200)
    assert r.processed, "the agent never caught up with the API server"
    assert r.events >= 200
    assert r.rss["worker"] > 0 and r.rss["control"] > 0
    assert r.control_cpu_per_1k > 0
