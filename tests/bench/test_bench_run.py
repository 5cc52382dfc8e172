"""``bench/run --quick`` writes the report docs/performance.md quotes: tables, plots, machine
facts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchutil import BENCH
from needs import tool_mark

requires_nginx = tool_mark("nginx")  # the agent benchmarks' metadata upstream


@requires_nginx
def test_run_writes_a_report_for_the_sections_asked(tmp_path):
    p = subprocess.run([str(BENCH / "run"), "--quick", "--only", "scale", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (tmp_path / "report.md").read_text()
    assert "## Summary" in text and "## Machine" in text and "cpus (nproc)" in text
    assert "Watch fan-out" in text and "STS calls per hour" in text
    assert (tmp_path / "scale_watch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    raw = json.loads((tmp_path / "results.json").read_text())
    assert raw["quick"] is True


def test_run_refuses_an_unknown_section(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH / "report.py"), "--only", "nope", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown section" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(780)   # every section, the fleet simulation's ~90 s and kube2iam's ~40 s
@requires_nginx
def test_quick_run_of_everything(tmp_path):
    p = subprocess.run([str(BENCH / "run"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=720)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (tmp_path / "report.md").read_text()
    assert "not measured" not in text
    for png in ("hotpath_latency_c1.png", "hotpath_latency_paced.png", "churn_latency.png",
                "node_start.png", "scale_watch.png"):
        assert (tmp_path / png).exists(), png
