"""Churn: pods replaced with IP reuse while their clients ask; correctness only.

The gap between the old pod's end and the new pod's IP is generous here (200 ms): a watch-
based agent can only name the previous pod's role while it has not applied the API server's
events yet, and 200 ms of lag would be a defect on any machine. bench/run measures the
tight cases (10 ms and 0 ms) and reports what it finds.
"""

from __future__ import annotations

import churn
from needs import tool_mark


@tool_mark("nginx")  # the agent's metadata upstream (bench_agent)
def test_churn_never_names_another_pods_role():
    (r,) = churn.run(slots=64, roles=8, rate=20.0, gap=0.2, requests=5000, max_seconds=60,
                     min_replacements=20, idle_samples=3, log=lambda *_: None)
    t = r.tally
    assert t.requests >= 5000
    assert r.replacements >= 20
    assert t.wrong == 0, t.samples
    assert t.wrong_other == 0  # never a role this address did not just have
    assert t.put_fail == 0 and t.connect_fail == 0
    assert r.idle_lag["n"] == 3
