"""The Grafana dashboard (deploy/grafana/kiamfast-dashboard.json) only asks for metrics the
agent really exports.

A dashboard whose query names a metric that does not exist shows an empty panel and no
error, so the check has to be made against the agent itself: the whole agent (`python -m
kiamfast`: supervisor, worker, control process) runs on loopback with the test doubles
(emulated API server, moto STS, fake metadata service), serves one pod's credentials, and
its ``/metrics`` is scraped. Every PromQL expression in the dashboard (panels and template
variables) may name only metrics of that scrape, and group or match only on labels those
metrics carry (``instance`` and ``job`` are added by Prometheus when it scrapes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent_process import LISTING, POD_IP, ROLE, Agent, Fakes
from agent_process import http as _http

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kiamfast-dashboard.json"
TARGET_LABELS = {"instance", "job"}  # Prometheus' own, never in /metrics

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
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            found.append(f"{m.group(1)}{{{m.group(2)}!=\"\"}}" if m else query)
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
