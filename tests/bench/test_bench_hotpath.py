"""The hot-path benchmark serves and checks the right bytes: correctness only, never timing."""

from __future__ import annotations

import agent_load as al
from needs import tool_mark


@tool_mark("nginx")  # the C ceiling and the agent's metadata upstream
def test_hot_path_every_answer_is_right_for_every_server():
    opts = al.Options(pods=256, connections=(1, 32), rounds=1, duration=0.4, warmup=0.1,
                      paced_rate=400.0, paced_duration=0.4, wrk=False)
    res = al.run(opts, log=lambda *_: None)
    assert res.checks["documents naming another role"] == 0
    assert res.checks["pods"] == 257
    for key, runs in res.closed.items():
        for r in runs:
            assert r.errors == 0, (key, r.bad)
            assert r.count > 0, key
    for key, r in res.paced.items():
        assert r.errors == 0, (key, r.bad)
    md = al.markdown(res)
    assert "× Python ceiling" in md and "kiamfast agent" in md


@tool_mark("nginx")  # the worker's metadata upstream and the C ceiling
def test_one_worker_alone_serves_every_pod_the_right_bytes():
    """``--target worker``: one server worker over a table the benchmark filled. Every answer
    of the worker and of both ceilings is checked: its body, and the worker's own headers
    (its Server, a token's TTL)."""
    opts = al.Options(target="worker", pods=256, connections=(16,), rounds=1, duration=0.5,
                      warmup=0.2, per_conn=20, paced_rate=2000.0, paced_duration=0.5,
                      wrk=False)
    res = al.run(opts, log=lambda *_: None)
    assert res.mode.startswith("one server worker")
    assert res.checks["documents naming another role"] == 0
    assert sorted(res.closed) == sorted((server, kind, 16) for server in al.SERVERS
                                        for kind in al.KINDS)
    for key, runs in res.closed.items():
        for r in runs:
            assert r.errors == 0 and r.count > 0, (key, r.bad)
    for key, r in res.paced.items():
        assert r.errors == 0 and r.count > 0, (key, r.bad)

