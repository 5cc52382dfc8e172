"""docs/kube2iam-chart-values.md cannot go stale: it is regenerated from both kube2iam charts'
values and renders and kiamfast's chart (tests/deploy/kube2iam_values_table.py) and compared,
and every difference it lists has its reason, every reason a difference."""
from __future__ import annotations

import pytest

import kube2iam_values_table as table


@pytest.fixture(autouse=True)
def kube2iam_source():
    if not (table.KUBE2IAM_CHART / "values.yaml").is_file():
        pytest.skip(f"needs kube2iam's source: set KUBE2IAM_SRC ({table.KUBE2IAM_CHART})")


def test_the_page_is_what_the_charts_say():
    assert table.PAGE.read_text() == table.build(), \
        "docs/kube2iam-chart-values.md is stale: python tests/deploy/kube2iam_values_table.py"


def test_every_difference_has_a_reason_and_every_reason_a_difference():
    rows = table.rows()
    assert len(rows) == len(set(rows))
    assert set(rows) == set(table.REASONS), (set(rows) ^ set(table.REASONS))


def test_the_defaults_the_issue_names_are_listed():
    # kube2iam's charts default to OnDelete, no RBAC, no tolerations, no priority class,
    # slower probes: each is a row (a value left out gets kiamfast's default, said why).
    rows = set(table.rows())
    assert {"updateStrategy", "rbac.create", "tolerations", "priorityClassName",
            "livenessProbe.initialDelaySeconds", "readinessProbe.periodSeconds",
            "image.tag", "container.readinessProbe.httpGet.path"} <= rows
