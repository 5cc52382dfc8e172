"""bench/saturated_node.py builds the node the kubelet would and counts what it says it
counts: every call judged (its pod's own role, within 1 s), both agents measured in turn,
a version the machine cannot make said so with the reason. Never a timing."""
from __future__ import annotations

import os

import numpy as np
import pytest

import kubelet_cgroups as kc
import saturated_node as sn


def test_requests_become_the_weights_the_kubelet_and_the_kernel_give_them():
    # pkg/kubelet/cm: MilliCPUToShares, getCPUWeight; kernel: cpu.weight x 1024 / 100
    assert [kc.milli_to_shares(m) for m in (0, 1, 20, 100, 1875, 90_000)] == \
        [2, 2, 20, 102, 1920, 92160]
    assert [kc.shares_to_weight(s) for s in (2, 20, 102, 1920, 92160, 262144)] == \
        [1, 1, 4, 74, 3516, 10000]
    assert kc.kernel_weight_of_cpu_weight(1) == 10 and kc.kernel_weight_of_cpu_weight(100) == 1024
    assert kc.group_weight(20, kc.V1) == 20 and kc.group_weight(20, kc.V2) == 10
    assert kc.group_weight(None, kc.V2, shares=kc.MIN_SHARES) == 10   # BestEffort's 2 shares


def test_the_default_case_is_what_the_chart_renders():
    case = sn.chart_case()
    assert case.milli == sn.chart_cpu_request() == 20
    assert case.realtime is sn.chart_realtime() is True
    labels = [c.label for c in sn.default_cases()]
    assert len(labels) == len(set(labels))
    assert {c.agent for c in sn.default_cases()} == {"kiamfast", "kube2iam", sn.FLOOR}


def test_a_call_counts_as_failed_when_late_or_not_the_document_and_wrong_when_another_role():
    calls = [["127.0.1.10", "r0", 0.004, "ok", "K0"],
             ["127.0.1.10", "r0", 1.2, "ok", "K0"],          # answered, after the SDK gave up
             ["127.0.1.11", "r1", 0.003, "ok", "K0"],        # r0's key
             ["127.0.1.11", "r1", 1.0, "timeout", None],
             ["127.0.1.11", "r1", 0.002, "http 503", None]]
    out = sn.judge(kc.V1, sn.Case("kiamfast", 20), calls, {"K0": "r0", "K1": "r1"})
    assert (out.calls, out.failed, out.wrong) == (5, 3, 1)
    assert out.latency_ms["max"] == pytest.approx(1200.0)


def test_rounds_merge_into_one_distribution():
    a = sn.judge(kc.V1, sn.Case("kiamfast", 20), [["i", "r", 0.01, "ok", "K"]] * 10, {"K": "r"})
    b = sn.judge(kc.V1, sn.Case("kiamfast", 20), [["i", "r", 0.03, "ok", "K"]] * 10, {"K": "r"})
    a.cpu_ms_per_s, b.cpu_ms_per_s = 10.0, 30.0
    m = sn.Outcome.merged([a, b])
    assert m.calls == 20 and m.lat_us.size == 20 and m.cpu_ms_per_s == 20.0
    assert m.round_p99_ms == [pytest.approx(10.0), pytest.approx(30.0)]
    assert m.latency_ms["max"] == pytest.approx(30.0)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_quick_run_measures_both_agents_on_a_saturated_node_and_names_what_it_skipped():
    from kube2iam_harness import MISSING, kube2iam_binary
    if kube2iam_binary() is None:
        pytest.skip(MISSING)        # as tests/kube2iam; in CI (CI=true) a failure
    if os.geteuid() != 0:
        pytest.skip("needs root: cgroups")
    res = sn.run(sn.QUICK, log=lambda msg: None)
    measured = {o.version for o in res.outcomes}
    assert measured | set(res.skipped) == set(kc.VERSIONS)
    assert kc.V1 in measured and kc.V2_ON_V1 in measured
    for version, why in res.skipped.items():
        assert why == kc.unavailable(version)
    for o in res.outcomes:
        assert o.calls > 0 and o.wrong == 0, (o.version, o.case.label, o.outcomes)
        assert o.lat_us.size == o.calls and np.all(o.lat_us > 0)
        if o.case.agent == "kiamfast":
            # its own series and the bench's /proc reading are both there
            assert o.metric_delay_per_slice_ms == o.metric_delay_per_slice_ms
            assert o.run_delay_per_slice_ms == o.run_delay_per_slice_ms
        if o.case.saturated:
            assert o.workload_cpus > 0
    assert {o.case.agent for o in res.outcomes} == {"kiamfast", "kube2iam", sn.FLOOR}
    text = sn.markdown(res)
    assert "not measured" not in text       # bench/run's word for a section that broke
    assert "| kube2iam, no request (BestEffort), saturated |" in text
    assert sn.headline(res)
