"""The whole agent (`python -m kiamfast`, supervisor + worker + control) on loopback, as an
operator pokes at it: readiness, kube2iam's health and metrics, the startup taint, a clean
stop.  No root: the pod is a loopback source address (127.0.0.5)."""

import signal
import time

import orjson
import pytest

from agent_process import POD_IP, Agent, Fakes
from agent_process import http as _http

TAINT = "kiamfast.io/agent-not-ready"


def http(port: int, path: str, *, source: str = "127.0.0.1") -> tuple[int, bytes]:
    return _http(port, f"GET {path}", source=source)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    fakes = Fakes(taints=[{"key": TAINT, "value": "true", "effect": "NoExecute"}])
    agent = Agent(fakes, tmp_path_factory.mktemp("agent"),
                  extra=["--listen-host=127.0.0.1", f"--node-startup-taint={TAINT}", "--debug"])
    try:
        agent.wait_ready(30)
        yield {"port": agent.port, "api": fakes.api, "proc": agent.proc,
               "log": agent.log_path}
    finally:
        agent.stop()
        fakes.stop()


def test_ready_agent_serves_the_pod_and_has_removed_the_startup_taint(agent):
    assert http(agent["port"], "/latest/meta-data/iam/security-credentials/",
                source=POD_IP) == (200, b"app-role")
    status, body = http(agent["port"], "/latest/meta-data/iam/security-credentials/app-role",
                        source=POD_IP)
    assert status == 200 and orjson.loads(body)["Code"] == "Success"
    # The taint goes right after ready (/readyz 200 first, then the PATCH): allow it a moment.
    deadline = time.monotonic() + 10
    while any(t["key"] == TAINT for t in agent["api"].nodes.get("n1")["spec"].get("taints") or []):
        assert time.monotonic() < deadline, "the startup taint is still on the node"
        time.sleep(0.05)


def test_healthz_has_kube2iams_shape(agent):
    status, body = http(agent["port"], "/healthz")
    doc = orjson.loads(body)
    assert status == 200
    # kube2iam's two fields, plus where addresses come from (no runtime socket here), the
    # API server's state, the startup taint's and the start's (the agent is ready)
    assert set(doc) == {"hostIP", "instanceId", "runtime", "kubernetes", "taint", "readiness"}
    assert doc["hostIP"] == "127.0.0.1" and doc["instanceId"].startswith("i-")
    assert doc["runtime"] == "disabled" and doc["kubernetes"] == "ok"
    assert doc["readiness"] == "ready"
    assert doc["taint"] in ("pending", "removed")   # removed once the health check runs again


def test_debug_store_has_kube2iams_shape(agent):
    deadline = time.monotonic() + 10      # published every 2 s by the control process
    while time.monotonic() < deadline:
        status, body = http(agent["port"], "/debug/store")
        if status == 200 and body and orjson.loads(body).get("rolesByIP"):
            break
        time.sleep(0.2)
    doc = orjson.loads(body)
    assert doc["namespaceByIP"] == {POD_IP: "team"}
    assert doc["rolesByIP"] == {POD_IP: "app-role"}


def test_metrics_carry_kube2iams_names(agent):
    http(agent["port"], "/latest/meta-data/iam/security-credentials/", source=POD_IP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status, body = http(agent["port"], "/metrics")
        text = body.decode()
        if "kube2iam_iam_request_duration_seconds_count" in text:
            break
        time.sleep(0.2)
    assert status == 200
    for name in ("kube2iam_iam_request_duration_seconds_count", "kube2iam_healthcheck_status 1",
                 'kube2iam_info{version="', "kiamfast_ready 1", "kiamfast_pods 1",
                 "kiamfast_http_requests_total", 'kiamfast_watch_total{kind="lists"} 1'):
        assert name in text, name
    assert "_created" not in text


# kube2iam 0.15's metrics (its metrics/metrics.go): name -> (type, label names).
KUBE2IAM_METRICS = {
    "kube2iam_iam_request_duration_seconds": ("histogram", {"code", "role_arn"}),
    "kube2iam_iam_cache_hits": ("counter", {"role_arn"}),          # kube2iam_iam_cache_hits_total
    "kube2iam_iam_k8s_dup_req_count": ("counter", set()),
    "kube2iam_iam_k8s_dup_req_success_count": ("counter", set()),
    "kube2iam_iam_k8s_pod_not_in_pod_cache": ("counter", set()),
    "kube2iam_http_request_duration_seconds": ("histogram", {"code", "method", "handler"}),
    "kube2iam_healthcheck_status": ("gauge", set()),
    "kube2iam_info": ("gauge", {"version", "build_date", "commit_hash"}),
}


def test_metrics_carry_every_kube2iam_metric_by_name_type_and_labels(agent):
    from prometheus_client.parser import text_string_to_metric_families

    http(agent["port"], "/latest/meta-data/iam/security-credentials/", source=POD_IP)
    http(agent["port"], "/latest/meta-data/iam/security-credentials/", source="127.0.0.99")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        body = http(agent["port"], "/metrics")[1].decode()
        # the control process publishes every 2 s; a worker's rendering is up to 1 s old
        if ('code="Success",role_arn="arn:' in body
                and "kube2iam_iam_k8s_pod_not_in_pod_cache 1" in body):
            break
        time.sleep(0.2)
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name, (kind, labels) in KUBE2IAM_METRICS.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, (name, family.type)
        # A cache hit needs a second pod of the same key; kube2iam too shows none before.
        assert family.samples or name == "kube2iam_iam_cache_hits", name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    assert "kube2iam_iam_k8s_pod_not_in_pod_cache 1" in body     # the unknown 127.0.0.99
    assert ('kube2iam_http_request_duration_seconds_count{code="200",'
            'handler="securityCredentialsHandler",method="GET"} ') in body


def test_sigterm_stops_every_process_cleanly(agent):
    proc = agent["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    log = agent["log"].read_text()
    assert "control process stopped" in log
    assert "Traceback" not in log
