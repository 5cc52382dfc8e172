"""Node start: when the agent says ready, every pod is served its own role at once."""

from __future__ import annotations

import node_start
from needs import tool_mark


@tool_mark("nginx")  # the agent's metadata upstream (bench_agent)
def test_ready_means_every_pod_is_served():
    res = node_start.run(pod_counts=(0, 30), reps=1, limits=("relaxed (100/s, burst 40)",),
                         log=lambda *_: None)
    rows = {r["pods"]: r for r in node_start.summarize(res)}
    assert rows[30]["served"] == 30 and rows[30]["wrong"] == 0
    assert rows[30]["calls"] == 30  # one AssumeRole per role (30 pods, 30 of the 40 roles)
    assert rows[0]["calls"] == 0
