"""docs/metrics.md lists every metric family the agent can export, with its type and labels:
checked against the names in the source and against the /metrics of a running agent."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "deploy"))
import test_dashboard  # noqa: E402

PAGE = (ROOT / "docs" / "metrics.md").read_text()
scrape = test_dashboard.scrape   # the fixture: a running agent's /metrics
NAME = re.compile(r"\b(?:kiamfast|kube2iam)_[a-z][a-z0-9_]*[a-z0-9]\b")


def page_rows() -> dict[str, tuple[str, set[str]]]:
    """metric -> (type, label names) from the page's tables."""
    rows = {}
    for line in PAGE.splitlines():
        m = re.match(r"\| `([a-z0-9_]+)` \| (counter|gauge|histogram|summary) \|([^|]*)\|",
                     line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = (m.group(2), set(re.findall(r"`([a-z_]+)`", m.group(3))))
    return rows


def source_names() -> set[str]:
    names = set()
    for path in (ROOT / "kiamfast").rglob("*"):
        if path.suffix in (".py", ".pyx", ".pxd"):
            names.update(NAME.findall(path.read_text()))
    return names


def test_the_page_lists_every_metric_name_of_the_source_and_no_other():
    rows = page_rows()
    assert len(rows) > 30, "the page's metric tables were not found"
    assert sorted(source_names() - set(rows)) == [], "metrics the page does not list"
    assert sorted(set(rows) - source_names()) == [], "metrics the source does not have"


def test_every_family_a_running_agent_exports_is_listed_with_its_type_and_labels(scrape):
    rows = page_rows()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", scrape, re.M))
    assert types, scrape
    for family, kind in types.items():
        assert family in rows, f"{family} is exported but not on the page"
        assert rows[family][0] == kind, (family, rows[family][0], kind)
    suffix = re.compile(r"_(bucket|sum|count)$")
    for name, labels in re.findall(r"^([a-z0-9_]+)\{([^}]*)\}", scrape, re.M):
        family = name if name in types else suffix.sub("", name)
        shown = set(re.findall(r'([a-z_]+)="', labels)) - {"le"}
        assert shown <= rows[family][1], (family, shown, rows[family][1])
