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
