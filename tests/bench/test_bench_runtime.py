"""The runtime-path benchmarks, small: correctness only, no timing asserted.

Each runs on a real containerd when the machine has root and containerd (as CI does), else
on the CRI fault double with loopback addresses (bench/cri_node.py decides; the
assertions are the same). The metadata upstream of the agent is nginx (bench_agent).
"""

from __future__ import annotations

import churn
import runtime_first_call
import runtime_polling
from needs import tool_mark

pytestmark = tool_mark("nginx")


def test_churn_with_the_runtime_never_names_another_pods_role():
    results = churn.run(runtime="auto", slots=6, roles=4, rate=20.0, requests=20_000,
                        min_replacements=6, max_seconds=40, log=lambda *_: None)
    with_runtime, api_only = results
    t = with_runtime.tally
    assert t.requests >= 20_000
    assert with_runtime.replacements >= 6 and with_runtime.reused >= 6
    assert t.wrong == 0, t.samples
    assert t.put_fail == 0 and t.connect_fail == 0
    assert with_runtime.lost_clients == 0    # every client's requests were counted
    # The same churn without the runtime does name the previous pods' roles: the
    # measurement sees wrong answers where they happen, so the 0 above means something.
    assert api_only.replacements >= 6
    assert api_only.tally.wrong_prev > 0


def test_first_calls_succeed_and_the_hot_path_answers_both_agents():
    r = runtime_first_call.run(pods=10, established=4, rounds=1, round_seconds=1.0,
                               log=lambda *_: None)
    assert r.first.listing_ms.size == 10 and r.first.document_ms.size == 10
    assert r.first.wrong == 0 and r.first.failed == 0, r.first.samples
    for agent in ("with", "without"):
        hot = r.hot(agent)
        assert hot["requests"] > 0
        assert hot["wrong"] == 0 and hot["not_200"] == 0


def test_polling_cost_is_measured_from_real_polls():
    r = runtime_polling.run(sandboxes=12, roles=4, seconds=3.0, settle=1.0,
                            log=lambda *_: None)
    assert r.polls >= 2          # periodic polls (every 1 s) happened in the window
    assert r.cpu_with > 0 and r.cpu_without > 0
    assert r.rss_control_with > 0 and r.rss_control_without > 0
