"""bench/kube2iam_speed.py counts what it says it counts: every load answered, by the right
role, for both agents. Never a timing (node start: tests/bench/test_bench_node_start.py)."""

from __future__ import annotations

import pytest

import kube2iam_speed as ks

TINY = ks.Options(rounds=1, duration=1.0, workers=(2,))


@pytest.fixture(scope="module")
def result():
    if ks.kube2iam_binary() is None:
        pytest.skip(ks.MISSING)     # as tests/kube2iam; in CI (CI=true) a failure
    return ks.run(TINY, log=lambda msg: None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_agents_served_the_pod_its_own_role_under_load_and_none_failed(result):
    paths = ["host"] + ([] if "through the DNAT" in result.skipped else ["dnat"])
    assert sorted(result.paths) == sorted(paths)
    for path in paths:
        assert result.identity[path] == {"kube2iam": "bench-role-0", "kiamfast": "bench-role-0"}
        for agent in ks.AGENTS:
            (run,) = result.paths[path][agent]
            assert run.requests > 0 and run.failed == 0, (path, agent, run)
            assert run.cpu_s_per_1k > 0, (path, agent, run)
        (run,) = result.paths[path]["kiamfast"]
        assert run.timeouts == 0, run   # kube2iam's can time out on a crowded machine
        assert set(result.idle[path]) == set(ks.AGENTS)


@pytest.mark.slow
def test_the_dnat_path_runs_as_root_and_says_why_not_otherwise(result):
    import os
    if os.geteuid() == 0:
        assert "dnat" in result.paths and not result.skipped
    else:
        assert result.skipped["through the DNAT"].startswith("not root")


@pytest.mark.slow
def test_scaling_measured_kiamfast_workers_and_kube2iam_unpinned(result):
    assert sorted(result.scaling) == ["kiamfast --workers 2", "kube2iam"]
    for label, runs in result.scaling.items():
        assert [r.failed for r in runs] == [0], label
        assert [r.requests > 0 for r in runs] == [True], label


@pytest.mark.slow
def test_rss_is_read_for_both_agents(result):
    assert set(result.rss_mib) == set(ks.AGENTS)
    assert all(v > 0 for v in result.rss_mib.values())


@pytest.mark.slow
def test_the_report_names_every_measure_and_both_agents(result):
    text = ks.markdown(result)
    for agent in ks.AGENTS:
        assert f"| (a) host address and port | {agent} |" in text
    heads = {what: value for what, value, _, _ in ks.headline(result)}
    kiamfast_counts = heads["vs kube2iam runs: wrong roles, failed or timed-out requests: "
                            "kiamfast (kube2iam)"].split(" (")[0]
    assert kiamfast_counts == "0, 0"


def _load(rps: float, cpu: float, p99: float, wrk_util: float = 1.0) -> ks.Load:
    return ks.Load(rps=rps, p50_ms=p99 / 2, p99_ms=p99, requests=int(rps), failed=0,
                   timeouts=0, cpu_s_per_1k=cpu, wrk_util=wrk_util)


def test_a_round_where_neither_the_agent_nor_wrk_had_its_core_is_machine_bound():
    starved = _load(2_000, 0.05, 100.0, wrk_util=0.1)      # agent at 10 % of its core
    saturated = _load(40_000, 0.025, 5.0, wrk_util=0.6)    # agent at 100 %
    wrk_bound = _load(10_000, 0.03, 20.0, wrk_util=0.95)   # agent at 30 %, wrk at 95 %
    assert ks.machine_bound({"kiamfast": [starved], "kube2iam": [saturated]})
    assert not ks.machine_bound({"kiamfast": [saturated], "kube2iam": [wrk_bound]})


def test_ratios_are_per_round_medians_of_kiamfast_over_kube2iam():
    runs = {"kiamfast": [_load(60_000, 0.02, 2.0), _load(50_000, 0.025, 4.0),
                         _load(10_000, 0.02, 1.0)],
            "kube2iam": [_load(10_000, 0.12, 40.0), _load(10_000, 0.10, 20.0),
                         _load(10_000, 0.10, 10.0)]}
    r = ks.ratios(runs)
    assert r["rps"] == pytest.approx(5.0)     # rounds: 6, 5, 1
    assert r["cpu"] == pytest.approx(5.0)     # rounds: 6, 4, 5
    assert r["p99"] == pytest.approx(0.1)     # rounds: 1/20, 1/5, 1/10
    assert r["marginal"] == pytest.approx(5.0)   # no idle background: the same as "cpu"


def test_the_idle_background_is_taken_out_of_the_cpu_per_request_beyond_it():
    busy = _load(1_000, 0.03, 50.0)
    busy.idle_s_per_1k = 0.01      # 10 ms/s of timers spread over 1,000 requests/s
    runs = {"kiamfast": [busy], "kube2iam": [_load(1_000, 0.12, 100.0)]}
    assert ks.ratios(runs)["cpu"] == pytest.approx(4.0)
    assert ks.ratios(runs)["marginal"] == pytest.approx(6.0)


def test_the_dnat_path_is_skipped_with_the_reason_when_not_root(monkeypatch):
    monkeypatch.setattr(ks.os, "geteuid", lambda: 1000)
    assert ks.dnat_unavailable().startswith("not root")
