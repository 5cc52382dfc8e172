"""bench/handover.py counts what it says it counts: unanswered calls, answers with another
pod's role or the node's, the longest a pod went unanswered.  Never a timing."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import handover as ho

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from steady_calls import Call  # noqa: E402


class FakeCaller:
    def __init__(self, pod, calls):
        self.pod, self.calls = pod, calls

    def stop(self):
        return self.calls


def fake_node(issued: dict[str, str], imds_requests: int = 0):
    return SimpleNamespace(
        sts=SimpleNamespace(issued=lambda: dict(issued)),   # a new dict, as the proxy gives
        imds_credential_requests=lambda: ["/latest/meta-data/iam/security-credentials/x"]
        * imds_requests)


def test_the_judge_counts_wrong_roles_the_nodes_role_and_gaps():
    a = SimpleNamespace(name="pod-a", role="role-a")
    b = SimpleNamespace(name="pod-b", role="role-b")
    issued = {"KA": "arn:aws:iam::1:role/role-a", "KB": "arn:aws:iam::1:role/role-b"}
    callers = [
        FakeCaller(a, [Call(0.0, 0.01, "ok", True, "KA"), Call(0.1, 0.01, "refused", True),
                       Call(0.2, 0.01, "ok", True, "KB"),        # b's role: wrong
                       Call(1.0, 0.01, "ok", True, "KA")]),
        FakeCaller(b, [Call(0.0, 0.01, "ok", True, "ASIANODE1"),  # the node's role
                       Call(0.5, 0.01, "http 503", True), Call(3.0, 0.01, "timeout", True)]),
    ]
    s = ho.judge(fake_node(issued, imds_requests=1), ho.Scenario("x", "y"), callers)
    assert (s.calls, s.unanswered, s.wrong, s.node_role) == (7, 3, 1, 2)
    assert s.outcomes == {"ok": 4, "refused": 1, "http 503": 1, "timeout": 1}
    # pod b: one answer on the wire at 0.01 (the node's, counted as such), then none until
    # its last call began at 3.0
    assert s.longest_gap == pytest.approx(2.99)
    assert s.wrong_calls == ["pod-a (role-a) got KB, issued for arn:aws:iam::1:role/role-b"]


def test_a_key_issued_while_the_callers_still_asked_is_not_taken_for_a_wrong_one():
    # the agent's STS call ends after the last settle, and a caller gets its key before it
    # stops: the judge must read what STS issued once every caller has stopped
    a = SimpleNamespace(name="pod-a", role="role-a")
    issued: dict[str, str] = {}

    class LateCaller(FakeCaller):
        def stop(self):
            issued["KLATE"] = "arn:aws:iam::1:role/role-a"
            return self.calls

    s = ho.judge(fake_node(issued), ho.Scenario("x", "y"),
                 [LateCaller(a, [Call(0.0, 0.01, "ok", True, "KLATE")])])
    assert (s.wrong, s.wrong_calls) == (0, [])


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_quick_run_has_every_scenario_and_no_wrong_answer():
    reason = ho.unavailable()
    if reason:
        pytest.fail(reason)
    res = ho.run(ho.QUICK, log=lambda msg: None)
    names = {(s.agent, s.name) for s in res.scenarios}
    assert {("kiamfast", "surge handover"), ("kiamfast", "container crash, keeper"),
            ("kiamfast", "rolling restart")} <= names
    for s in res.scenarios:
        assert s.calls > 0 and s.wrong == 0 and s.node_role == 0, \
            (s.agent, s.name, s.wrong_calls, s)
    rolling = next(s for s in res.scenarios if s.name == "rolling restart")
    # The gap it measures is real: calls refused while nothing listens, or reset when they
    # were queued on the old agent's socket as it closed (which one, timing decides)
    assert rolling.outcomes.get("refused", 0) + rolling.outcomes.get("reset", 0) > 0, \
        rolling.outcomes
    assert all(m.get("Pss", 0) > 0 for m in res.keeper.values()), res.keeper
    assert "nft" in res.recheck or "legacy" in res.recheck
    assert "| kiamfast | surge handover |" in ho.markdown(res)
