"""``bench/run --quick --only container-credentials`` runs against a real kube-apiserver and
writes its figures; what is checked is counts (every pod answered, every flood answer the
refusal it should be), never a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchutil import BENCH

pytestmark = [pytest.mark.kube_apiserver, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))


@pytest.mark.timeout(300)
def test_the_quick_section_measures_both_paths_and_both_floods_and_no_pod_failed(tmp_path):
    import kube
    reason = kube.missing_binaries()
    if reason:
        pytest.skip(reason)
    p = subprocess.run([str(BENCH / "run"), "--quick", "--only", "container-credentials",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=290)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (tmp_path / "report.md").read_text()
    assert "not measured" not in text
    for measure in ("first call of a new token", "pod event → address served",
                    "flood with a new connection per request", "keep-alive connections"):
        assert measure in text, measure
    raw = json.loads((tmp_path / "results.json").read_text())
    (sec,) = raw["sections"].values()
    opts = sec["options"]
    assert sorted(sec["keepalive"]) == sorted(f"{path}/c{n}" for path in ("token", "imds")
                                              for n in {1, opts["connections"]})
    assert all(v["n"] > 0 and v["errors"] == 0 for v in sec["keepalive"].values()), {
        k: (v["n"], v["errors"], v["bad"]) for k, v in sec["keepalive"].items()}
    assert {k: v["n"] for k, v in sec["fresh"].items()} == {"token": opts["fresh"],
                                                            "imds": opts["fresh"]}
    assert sec["first_call"]["n"] == sec["bare_review"]["n"] == opts["first_calls"]
    phases = sec["phases"]
    assert len(phases) == 3 and phases["idle"]["event"]["n"] == opts["events"]
    for label, ph in phases.items():
        assert ph["event"]["n"] >= 1 and ph["victim_failed"] == 0, label
        assert ph["victim"]["n"] == ph["event"]["n"] * (opts["victim_calls"] // opts["events"])
        if label != "idle":      # the flood ran and got only the refusal it asked for
            assert ph["flood_requests"] > 0 and ph["flood_bad"] == 0, label
    heads = [line for line in text.splitlines()
             if line.startswith("| container credentials: failed or wrong answers")]
    assert heads and heads[0].split(" | ")[1] == "0"
    # Issue 42's attacks ran, and every other pod's call was served during each; beside the
    # slow API server every new token was answered within the bound.
    attacks = sec["attacks"]
    assert set(attacks) == {"unread", "slow API"}
    for name, at in attacks.items():
        assert at["calls_ms"] and at["failed"] == {}, name
        assert at["attack"], name                   # the attackers were answered or let go
    assert len(attacks["slow API"]["calls_ms"]) == opts["victim_calls"]
    slow = attacks["slow API"]
    assert len(slow["first_s"]) == opts["rotating"] and slow["first_failed"] == 0, slow
    assert attacks["unread"]["attack"].get("stuck", 0) > 0   # its answers went unread
    # Issue 45's share: pods replaced through the in-process token server, every answer
    # the one the pod should get (the bound on what is kept: test_token_churn_memory.py).
    churn = sec["churn"]
    assert max(int(n) for n in churn["kept"]) == opts["churn_pods"] and churn["wrong"] == 0
