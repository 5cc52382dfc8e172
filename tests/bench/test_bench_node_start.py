"""bench/node_start.py, quick: kiamfast and the real kube2iam started in turns on a node whose
pods already ask.  Correctness only, never a timing: every pod is served its own role in
the end (by the role STS issued its key for), kiamfast never answers with another role, at
a start or after a restart with the table it left, and what the report is made of is there
(both agents' memory, kiamfast's milestone lines)."""

from __future__ import annotations

import pytest

import node_start
from needs import tool_mark


def test_an_answer_with_another_roles_key_is_counted_and_does_not_serve_the_pod():
    class Agent:
        name, started = "kiamfast", 100.0

    class Proxy:
        def assume_role_calls(self):
            return []

    class Cluster:
        proxy = Proxy()

        def access_keys(self):
            return {"AKIA-A": "role-a", "AKIA-B": "role-b"}

    pod = {"attempts": 3, "errors": {}, "first_answer": 100.2, "served": 101.0,
           "answers": [(100.5, "role-a", "AKIA-B"), (101.0, "role-a", "AKIA-A")]}
    other = {"attempts": 1, "errors": {}, "first_answer": 100.3, "served": 100.4,
             "answers": [(100.4, "role-b", "AKIA-UNKNOWN")]}
    run = node_start._judge(Agent(), Cluster(), {"10.0.0.1": "role-a", "10.0.0.2": "role-b"},
                            {"10.0.0.1": pod, "10.0.0.2": other}, case="start", index=0,
                            roles=2, calls_before=0)
    assert run.served_s[0] == pytest.approx(1.0)
    assert run.served_s[1] != run.served_s[1]           # never served: NaN
    assert run.wrong == 2 and run.served == 1
    assert run.every_s != run.every_s and run.first_answer_s == pytest.approx(0.2)


@pytest.fixture(scope="module")
def result():
    from kube2iam_harness import BUILD_SCRIPT, kube2iam_binary
    if kube2iam_binary() is None:
        pytest.skip(f"needs kube2iam: run {BUILD_SCRIPT.relative_to(node_start.ROOT)}")
    return node_start.run(node_start.QUICK, log=lambda *_: None)


@pytest.mark.timeout(400)
@tool_mark("nginx")  # the agents' metadata upstream (bench_agent)
def test_every_pod_gets_its_own_role_from_both_agents_and_kiamfast_never_another(result):
    (pods, roles), = node_start.QUICK.scenarios
    runs = {(r.agent, r.case): r for r in result.runs}
    assert sorted(runs) == [("kiamfast", "restart"), ("kiamfast", "start"),
                            ("kube2iam", "restart"), ("kube2iam", "start")]
    for (agent, case), r in runs.items():
        assert r.pods == pods and r.served == pods, (agent, case, r.served_s)
    assert runs["kiamfast", "start"].wrong == runs["kiamfast", "restart"].wrong == 0
    assert runs["kiamfast", "start"].sts_calls == roles     # one session per role
    assert runs["kube2iam", "start"].sts_calls >= roles     # on demand, per pod's first ask


@pytest.mark.timeout(400)
@tool_mark("nginx")
def test_the_report_has_memory_milestones_and_imports(result):
    start = next(r for r in result.runs if r.agent == "kiamfast" and r.case == "start")
    restart = next(r for r in result.runs if r.agent == "kiamfast" and r.case == "restart")
    assert {"supervisor", "control", "worker-0"} <= set(start.memory["steady"])
    assert all(m["pss"] > 0 and m["rss"] >= m["pss"] for m in start.memory["steady"].values())
    assert start.memory["table"] > 0
    k2i = next(r for r in result.runs if r.agent == "kube2iam" and r.case == "start")
    assert k2i.memory["steady"]["kube2iam"]["pss"] > 0
    assert {"table created", "worker listening", "pods listed", "first STS answer",
            "all roles fetched", "ready", "taint removed"} <= set(start.milestones)
    assert start.milestones["pods listed"] <= start.milestones["ready"]
    assert "table adopted" in restart.milestones
    assert set(result.imports) == set(node_start.IMPORTS)
    text = node_start.markdown(result)
    assert "| 12 / 4 | kiamfast |" in text and "| 12 / 4 | kube2iam |" in text
