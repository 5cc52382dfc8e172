"""The README's promises that can drift: its two commands, its length and first screen, its
figures (each one measured in docs/performance.md), and the table of contents of docs/."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PERFORMANCE = (ROOT / "docs" / "performance.md").read_text()


def test_readme_opens_with_the_demo_and_the_test_command():
    block = re.search(r"```sh\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands[0] == "pip install -e '.[demo]' && kiamfast demo"
    assert commands[1] == "tests/run"   # sets up what the tests need, then runs pytest
    assert os.access(ROOT / "tests" / "run", os.X_OK)


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tests/run" in ci.splitlines()


def test_the_readme_is_short_and_its_first_screen_leads_to_the_operators_pages():
    assert len(README.splitlines()) <= 200
    first_screen = "\n".join(README.splitlines()[:25])
    for page in ("install.md", "switching-from-kube2iam.md", "upgrade-and-rollback.md",
                 "troubleshooting.md"):
        assert f"(docs/{page})" in first_screen, page


def test_the_table_of_contents_lists_every_page_of_docs():
    section = README.split("## Documentation", 1)[1]
    listed = re.findall(r"^\| \[docs/([\w.-]+\.md)\]\(docs/\1\) \| .+ \|$", section, re.M)
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} | {"upgrade-and-rollback.md"}
    # kube2iam-chart-values.md is reached from switching-from-kube2iam.md, where it belongs.
    assert set(listed) == pages - {"kube2iam-chart-values.md"}


def test_every_figure_of_the_why_table_is_measured_in_the_performance_page():
    section = README.split("## Why", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 4, rows   # the races closed, one figure each
    for row in rows:
        measured = row.strip("|").split(" | ")[-1]
        figures = re.findall(r"\d[\d,.]*(?:–[\d,.]*\d)?", measured.replace("**", ""))
        assert figures, row
        for figure in figures:
            assert figure in PERFORMANCE, f"{figure} (README's Why table) is not in " \
                "docs/performance.md"
