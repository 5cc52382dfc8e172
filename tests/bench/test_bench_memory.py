"""The memory bench (bench/memory_per_pod.py), briefly: it runs, the agent answers every
steady pod with its own role while pods are replaced, and the in-process run reports what
the control process's code keeps."""
from __future__ import annotations

import memory_per_pod


def test_memory_bench_samples_the_agent_while_pods_are_replaced():
    r = memory_per_pod.run_agent(minutes=0.5, rate=10.0, steady=5, churned=5, runtime="none",
                                 every=5.0, warmup=0.0, log=lambda *_: None)
    assert len(r.samples) >= 5
    assert r.samples[-1].replaced >= 100
    assert all(min(s.pss.values()) > 0 and min(s.anon.values()) > 0
               for s in r.samples)
    assert r.answers["ok"] > 0 and r.answers["failed"] == 0 and r.answers["wrong"] == 0


def test_memory_bench_counts_what_the_control_process_keeps():
    points = memory_per_pod.run_inprocess(4_000, checkpoints=2, warmup=500,
                                          log=lambda *_: None)
    assert [p.replaced for p in points] == [2_000, 4_000]
    assert points[-1].kept_bytes < 64 * 1024, points[-1].top
