"""The STS client benchmark (bench/sts_client.py) runs every option: correctness only.

One fresh process per option against moto's STS on loopback; each child checks its own
AssumeRole answer. Timings and memory are never asserted (machines are shared and noisy).
"""
from __future__ import annotations

from sts_client import OPTIONS, run, table


def test_every_option_builds_a_client_that_gets_credentials_and_the_table_shows_it():
    results = run(1, "bare", list(OPTIONS))
    for option in ("today", "kiamfast", "signer"):
        (row,) = results[option]
        assert row["first"] > 0 and row["botocore_modules"] > 0, option
    assert results["bare"][0]["botocore_modules"] == 0
    assert len(table(results, "bare").splitlines()) == 2 + len(OPTIONS)
