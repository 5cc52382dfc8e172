"""docs/install.md's "Sizing" says what the chart sets: its quoted requests, limits and the
smallest memory limit accepted are the rendered chart's own, checked here against
`helm template` (a changed default that leaves the page behind fails here)."""
from __future__ import annotations

import re
from pathlib import Path

from test_chart import render, render_error, values_file

ROOT = Path(__file__).resolve().parents[2]


def sizing() -> str:
    page = (ROOT / "docs" / "install.md").read_text()
    start = page.index("## Sizing")
    return page[start:page.index("\n## ", start + 1)]


def agent_resources(tmp_path: Path, values: dict) -> dict:
    docs = render(values_file(tmp_path, values), release="kiamfast")
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    container = next(c for c in ds["spec"]["template"]["spec"]["containers"]
                     if c["name"] != "socket-keeper")
    return container["resources"]


def mebibytes(text: str) -> int:
    return int(text.removesuffix("Mi"))


def test_the_quoted_defaults_are_the_rendered_ones(tmp_path):
    text = sizing()
    quoted = re.search(r"requests: `cpu: (\w+)`, `memory: (\w+)`", text)
    assert quoted, text
    limit = re.search(r"2 × \((\d+)Mi \+ (\d+)Mi per worker\)\*\*: (\d+)Mi with `workers: 1`, "
                      r"(\d+)Mi with\s+2", text)
    assert limit, text
    base, per_worker, one, two = (int(g) for g in limit.groups())
    for workers, quoted_limit in ((1, one), (2, two)):
        resources = agent_resources(tmp_path, {"workers": workers})
        assert resources["requests"] == {"cpu": quoted[1], "memory": quoted[2]}
        assert "cpu" not in resources["limits"]                 # "no CPU limit"
        assert mebibytes(resources["limits"]["memory"]) == quoted_limit
        assert quoted_limit == 2 * (base + per_worker * workers)


def test_the_smallest_limit_quoted_is_the_one_the_chart_accepts(tmp_path):
    text = sizing()
    floor = re.search(r"below \*\*(\d+)Mi \+ (\d+)Mi per\s+worker\*\* \((\d+)Mi with one "
                      r"worker\) is refused", text)
    assert floor, text
    base, per_worker, one = (int(g) for g in floor.groups())
    assert one == base + per_worker
    at_floor = {"resources": {"limits": {"memory": f"{one}Mi"}}}
    assert mebibytes(agent_resources(tmp_path, at_floor)["limits"]["memory"]) == one
    below = {"resources": {"limits": {"memory": f"{one - 1}Mi"}}}
    assert f"needs at least {one}Mi with 1 worker(s)" in render_error(tmp_path, below)
    kube2iam = {"resources": {"limits": {"memory": "128Mi"}}}     # the page names it refused
    assert "kube2iam's\n  `memory: 128Mi`" in text or "kube2iam's `memory: 128Mi`" in text
    assert "needs at least" in render_error(tmp_path, kube2iam)
