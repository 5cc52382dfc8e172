"""``bench/run --quick --only webhook`` runs the real ``kiamfast webhook`` under large bodies
and slow senders and writes its figures; what is checked is counts (every scenario ran, the
oversized bodies were refused, every call of the "API server" was answered), never a timing
or a memory figure."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchutil import BENCH

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(300)
def test_the_quick_section_runs_every_scenario_and_the_api_server_is_always_answered(tmp_path):
    p = subprocess.run([str(BENCH / "run"), "--quick", "--only", "webhook",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=290)
    assert p.returncode == 0, p.stderr[-3000:]
    raw = json.loads((tmp_path / "results.json").read_text())
    (sec,) = raw["sections"].values()
    assert {"idle", "one 4 MiB body", "200 slow senders", "200 slow heads",
            "one review of 124,000 empty containers",
            "one review filling the parse and answer budgets"} <= set(sec)
    assert sec["one 4 MiB body"]["attack"] == {"413": 1}
    # Answered (unpatched, with a warning: its answer does not fit), not refused.
    assert sec["one review of 124,000 empty containers"]["attack"] == {"200": 1}
    assert sec["one review filling the parse and answer budgets"]["attack"] == {"200": 1}
    for name, outcome in sec.items():
        assert outcome["api_sent"] > 0, name
        assert outcome["api_answered"] == outcome["api_sent"], (name, outcome)
