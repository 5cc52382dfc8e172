"""The server load benchmark (bench/server_load.py) serves the right bytes: correctness only.

A short run of the benchmark; every response from the worker and the baseline is checked.
Timings are never asserted (machines are shared and noisy).
"""
from __future__ import annotations

from server_load import Options, run_benchmark


def test_server_load_correctness():
    """Short run: every response from the worker (and the baseline) is right."""
    opts = Options(duration=0.5, warmup=0.2, connections=16, pods=256, rounds=1,
                   per_conn=20, full_check_every=1, rate=2000, pin=False, wrk=False,
                   callgrind=False)
    results = run_benchmark(opts)
    for name, r in results.items():
        assert r["errors"] == 0, (name, r["bad"])
        assert r["count"] > 0, name

