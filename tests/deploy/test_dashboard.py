"""The Grafana dashboard (the chart's files/kiamfast-dashboard.json; deploy/grafana/ links to
it) and the alerts (files/kiamfast-alerts.yaml, docs/metrics.md's) only ask for metrics the
agent really exports, and the chart ships both (a ConfigMap for Grafana's sidecar, a
PrometheusRule).

A dashboard whose query names a metric that does not exist shows an empty panel and no
error, so the check has to be made against the agent itself: the whole agent (`python -m
kiamfast`: supervisor, worker, control process) runs on loopback with the test doubles
(emulated API server, moto STS, fake metadata service), serves one pod's credentials, and
its ``/metrics`` is scraped. Every PromQL expression in the dashboard (panels and template
variables) may name only metrics of that scrape, and group or match only on labels those
metrics carry (``instance`` and ``job`` are added by Prometheus when it scrapes, ``cluster``
by its external labels or relabeling where it watches several clusters).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from agent_process import LISTING, POD_IP, ROLE, Agent, Fakes
from agent_process import http as _http

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "chart" / "kiamfast" / "files" / "kiamfast-dashboard.json"
ALERTS = REPO / "deploy" / "chart" / "kiamfast" / "files" / "kiamfast-alerts.yaml"
METRICS_PAGE = REPO / "docs" / "metrics.md"
TARGET_LABELS = {"instance", "job", "cluster"}  # Prometheus' own, never in /metrics

# PromQL words that are not metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset", "inf", "nan"}


def http_get(port: int, path: str, *, source: str = "127.0.0.1") -> tuple[int, str]:
    status, body = _http(port, f"GET {path}", source=source)
    return status, body.decode()


@pytest.fixture(scope="module")
def scrape(tmp_path_factory) -> str:
    """/metrics of a running agent that has served credentials, health and readiness."""
    import time
    fakes = Fakes()
    agent = Agent(fakes, tmp_path_factory.mktemp("dashboard-agent"),
                  extra=["--listen-host=127.0.0.1"])
    try:
        agent.wait_ready(30)
        port = agent.port
        # What a node's pods and kubelet do: list, fetch, probe.
        assert http_get(port, LISTING, source=POD_IP) == (200, ROLE)
        assert http_get(port, LISTING + ROLE, source=POD_IP)[0] == 200
        assert http_get(port, "/healthz")[0] == 200
        # The control process publishes its metrics every few seconds: wait for the STS call
        # that fetched the role's credentials to be counted.
        deadline = time.monotonic() + 15
        while True:
            status, text = http_get(port, "/metrics")
            if status == 200 and re.search(r'^kiamfast_sts_calls_total\{result="success"\} '
                                           r'[1-9]', text, re.M):
                return text
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
    finally:
        agent.stop()
        fakes.stop()


def exported(text: str) -> dict[str, set[str]]:
    """Metric (series) name -> label names, from a Prometheus text exposition. Families
    declared by # TYPE count even without samples yet (a labelled counter nobody bumped)."""
    names: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            names.setdefault(family, set())
            for suffix in suffixes.get(kind, ()):
                if not family.endswith(suffix):
                    names.setdefault(family + suffix, set())
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s", line)
            assert m, line
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
            names.setdefault(m.group(1), set()).update(labels)
    return names


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets (rows included) and query variables."""
    found = []

    def walk(panels):
        for p in panels:
            found.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((\w+)(?:\{(.*)\})?,\s*(\w+)\)", query)
            matchers = ", ".join(filter(None, [m.group(2), f'{m.group(3)}!=""'])) if m else ""
            found.append(f"{m.group(1)}{{{matchers}}}" if m else query)
    return found


def parse(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression refers to."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    text = re.sub(r"\[[^\]]*\]", "", text)                     # ranges [5m], $__rate_interval
    labels = set()
    for body in re.findall(r"\{([^}]*)\}", text):              # matchers
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", body))
    text = re.sub(r"\{[^}]*\}", " ", text)
    for body in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                           text):
        labels |= {w.strip() for w in body.split(",") if w.strip()}
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)                         # dashboard variables
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        after = text[m.end():].lstrip()
        word = m.group(0)
        if after.startswith("(") or word.lower() in KEYWORDS or re.fullmatch(r"\d+e?", word):
            continue  # a function call, a keyword
        names.add(word)
    return names, labels


def test_the_expression_parser_finds_names_and_labels():
    names, labels = parse('histogram_quantile(0.99, sum by (le, handler) (rate('
                          'kube2iam_http_request_duration_seconds_bucket{instance=~"$x", '
                          'code!="200"}[$__rate_interval]))) / on(instance) kiamfast_ready')
    assert names == {"kube2iam_http_request_duration_seconds_bucket", "kiamfast_ready"}
    assert labels == {"le", "handler", "instance", "code"}


def test_dashboard_has_the_panels_an_operator_looks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(expressions(dashboard))
    for metric in ("kube2iam_http_request_duration_seconds_count",    # requests by code
                   "kube2iam_http_request_duration_seconds_bucket",   # p99 by handler
                   "kiamfast_sts_calls_total", "kube2iam_iam_request_duration_seconds_count",
                   "kiamfast_pods", "kiamfast_ready", "kube2iam_healthcheck_status"):
        assert metric in exprs, metric
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_expression_names_only_exported_metrics_and_labels(scrape):
    metrics = exported(scrape)
    dashboard = json.loads(DASHBOARD.read_text())
    problems = []
    for expr in expressions(dashboard):
        names, labels = parse(expr)
        assert names, expr
        for name in sorted(names - set(metrics)):
            problems.append(f"{name}: not exported by the agent (in {expr})")
        carried = set().union(*(metrics.get(n, set()) for n in names)) | TARGET_LABELS
        if any(n.endswith("_bucket") for n in names):
            carried.add("le")
        for label in sorted(labels - carried):
            problems.append(f"label {label}: on none of {sorted(names)} (in {expr})")
    assert not problems, "\n".join(problems)


def test_a_misspelled_metric_would_be_caught(scrape):
    names, _ = parse("sum(rate(kiamfast_sts_call_total[5m]))")
    assert names - set(exported(scrape)) == {"kiamfast_sts_call_total"}


# ---- the variables, and what the chart ships ------------------------------------------------

def test_cluster_job_and_instance_variables_filter_every_panel():
    dashboard = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "cluster", "job", "instance"]
    selector = 'cluster=~"$cluster", job=~"$job", instance=~"$instance"'
    panel_exprs = expressions({"panels": dashboard["panels"]})
    assert panel_exprs and all(selector in e for e in panel_exprs), panel_exprs
    # each variable narrows by the ones before it
    queries = {v["name"]: v["query"]["query"] for v in dashboard["templating"]["list"][1:]}
    assert 'cluster=~"$cluster"' in queries["job"]
    assert 'cluster=~"$cluster", job=~"$job"' in queries["instance"]
    assert (REPO / "deploy" / "grafana" / "kiamfast-dashboard.json").resolve() == DASHBOARD


def alerts() -> list[dict]:
    return yaml.safe_load(ALERTS.read_text())


def test_the_alerts_are_the_metrics_pages_and_name_only_exported_metrics(scrape):
    section = METRICS_PAGE.read_text().split("## What to alert on", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| [^|]+ \| `([^`]+)`", section, re.M)
    assert sorted(documented) == sorted(a["expr"] for a in alerts())
    # The scrape's agent runs without a container runtime: a runtime's families are taken
    # from the page's list, which tests/docs/test_metrics_page.py holds to the source.
    listed = {name: set(re.findall(r"`([a-z_]+)`", labels)) for name, labels in re.findall(
        r"^\| `([a-z0-9_]+)` \| (?:counter|gauge|histogram|summary) \|([^|]*)\|",
        METRICS_PAGE.read_text(), re.M)}
    metrics = {**listed, **exported(scrape)}
    for alert in alerts():
        names, labels = parse(alert["expr"])
        assert names and names <= set(metrics), alert["expr"]
        assert labels <= set().union(*(metrics[n] for n in names)), alert["expr"]
        assert alert["alert"].startswith("Kiamfast") and alert["for"] and \
            alert["labels"]["severity"] in ("warning", "critical")


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar_and_the_alerts(tmp_path):
    from test_chart import of_kind, one, render, values_file
    objs = render(values_file(tmp_path, {
        "grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "k8s"}}},
        "prometheus": {"rules": {"enabled": True, "labels": {"release": "kps"}}}}))
    config_map = one(objs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "k8s"}
    assert json.loads(config_map["data"]["kiamfast-dashboard.json"]) == \
        json.loads(DASHBOARD.read_text())
    rule = one(objs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"]["groups"] == [{"name": "kiamfast", "rules": alerts()}]
    # Off by default: neither.
    assert not of_kind(render(), "PrometheusRule") and not of_kind(render(), "ConfigMap")
