"""Micro-benchmarks of the table's request-path operations (pytest-benchmark).

Run: python -m pytest tests/bench/test_bench_table.py --benchmark-enable
Target (issue 2): lookup + copy of a 2 KiB value under 300 ns called from Python.
"""

import time

import pytest

from kiamfast import table as T


@pytest.fixture(scope="module")
def tbl(tmp_path_factory):
    t = T.Table.create(str(tmp_path_factory.mktemp("bench") / "t"), ip_capacity=1024,
                       cred_capacity=64, value_size=16384)
    t.set_status(synced=True)     # a synced agent: unknown addresses are plain misses
    far = time.time() + 3600
    for slot in range(40):
        t.write_cred(slot, [b"role-%d" % slot, b"L", b"d" * 2048, b"e", b"i"], serve_until=far)
    for i in range(250):
        t.claim_ip(f"10.0.{i // 200}.{i % 200}", f"pod-{i}", T.POD_ROLE, i % 40)
        t.claim_ip(f"fd00::{i + 1:x}", f"pod6-{i}", T.POD_ROLE, i % 40)
    yield t
    t.close()


OUT = bytearray(16384)


def test_lookup_hit_ipv4_2k(benchmark, tbl):
    key = T.ip_key("10.0.0.77")
    status, n = benchmark(tbl.lookup, key, T.PART_DOCUMENT, OUT)
    assert (status, n) == (T.READY, 2048)


def test_lookup_hit_ipv6_2k(benchmark, tbl):
    key = T.ip_key("fd00::4d")
    status, n = benchmark(tbl.lookup, key, T.PART_DOCUMENT, OUT)
    assert (status, n) == (T.READY, 2048)


def test_lookup_hit_with_name_match(benchmark, tbl):
    key = T.ip_key("10.0.0.77")
    status, n = benchmark(tbl.lookup, key, T.PART_DOCUMENT, OUT, b"role-37")
    assert status == T.READY


def test_lookup_miss_ipv4(benchmark, tbl):
    assert benchmark(tbl.lookup, T.ip_key("10.7.7.7"), T.PART_DOCUMENT, OUT)[0] == T.MISS


def test_lookup_miss_ipv6(benchmark, tbl):
    assert benchmark(tbl.lookup, T.ip_key("fd00:7::7"), T.PART_DOCUMENT, OUT)[0] == T.MISS


def test_claim_release(benchmark, tbl):
    def churn():
        tbl.claim_ip("10.0.9.9", "bench-pod", T.POD_ROLE, 3)
        tbl.release_ip("10.0.9.9", "bench-pod")
    benchmark(churn)
    assert tbl.lookup_pod("10.0.9.9") is None


def test_write_cred_2k(benchmark, tbl):
    parts = [b"role-50", b"L", b"d" * 2048, b"e", b"i"]
    far = time.time() + 3600
    benchmark(tbl.write_cred, 50, parts, serve_until=far)
