"""The pod watch's cost bench (bench/watch_cost.py), small: correctness of the benchmark
itself (its timings are only printed by the script)."""
from __future__ import annotations

from watch_cost import measure, report


def test_watch_bench_small():
    r = measure(20, samples=10)
    assert r["pods_end"] == 30 and r["synced_end"]
    assert len(r["table_lat"]) == 10 and all(x > 0 for x in r["table_lat"])
    print(report([r]))
