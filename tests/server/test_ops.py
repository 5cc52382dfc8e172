"""Operational routes on the app port (kube2iam's /healthz, /debug/store, /metrics) and /readyz."""

from __future__ import annotations

import json

from kiamfast import table

from server_support import Client, build

LIST = "/latest/meta-data/iam/security-credentials/"


def test_healthz_is_the_control_process_health_blob(server, writer, imds):
    writer.write_aux(table.AUX_HEALTH, b'{"hostIP":"10.0.0.5","instanceId":"i-0abc"}')
    r = server.get("/healthz")
    assert r.status == 200
    assert r.header("Content-Type") == "application/json"
    assert json.loads(r.body) == {"hostIP": "10.0.0.5", "instanceId": "i-0abc"}
    assert r.body.endswith(b"}\n")
    assert imds.requests == []  # never asks the metadata service on the request path


def test_healthz_without_a_result_is_500_with_kube2iam_text(server, writer):
    r = server.get("/healthz")
    assert r.status == 500
    assert r.text.startswith("Error getting instance id ")
    writer.write_aux(table.AUX_HEALTH_ERROR, b"operation error ec2imds: GetMetadata, 401")
    r = server.get("/healthz")
    assert r.status == 500
    assert r.text == "Error getting instance id operation error ec2imds: GetMetadata, 401\n"


def test_healthz_needs_no_token_even_in_required_mode(make_server, pods, writer):
    writer.write_aux(table.AUX_HEALTH, b'{"hostIP":"","instanceId":"i-1"}')
    server = make_server(imdsv2="required")
    assert server.get("/healthz").status == 200


def test_readyz_follows_the_table(server, pods):
    pods.ready(ready=False)
    assert server.get("/readyz").status == 503
    pods.ready(ready=True)
    assert server.get("/readyz").status == 200


def test_readyz_says_what_the_start_waits_for(server, pods, writer):
    pods.ready(ready=False)
    assert server.get("/readyz").text == "not ready\n"        # nothing published yet
    writer.write_aux(table.AUX_HEALTH, b'{"hostIP":"","instanceId":"i-1","readiness":'
                     b'"waiting for the pods\' list from the API server"}')
    pods.ready(ready=False)                                    # a new generation
    r = server.get("/readyz")
    assert (r.status, r.text) == (503, "not ready: waiting for the pods' list from the API "
                                       "server\n")
    writer.write_aux(table.AUX_HEALTH, b'{"readiness": ["not", "a", "text"]}')
    pods.ready(ready=False)
    assert server.get("/readyz").text == "not ready\n"        # anything else: the plain 503
    pods.ready(ready=True)
    assert (server.get("/readyz").status, server.get("/readyz").text) == (200, "ok\n")


def test_debug_store_only_with_debug(make_server, pods, writer):
    writer.write_aux(table.AUX_DEBUG_STORE, b'{"rolesByIP":{}}')
    assert make_server().get("/debug/store").status == 404
    r = make_server(debug=True).get("/debug/store")
    assert (r.status, r.body) == (200, b'{"rolesByIP":{}}')


def test_metrics_counts_requests_by_handler_and_code(server, pods, writer):
    writer.write_aux(table.AUX_METRICS, b"# TYPE kube2iam_info gauge\nkube2iam_info 1")
    pods.add("127.0.0.1", "app-role")
    server.get(LIST)
    server.get(LIST + "app-role")
    server.get(LIST + "other")
    server.token()
    body = server.get("/metrics").text
    assert body.startswith("# TYPE kube2iam_info gauge\nkube2iam_info 1\n")
    assert 'kiamfast_http_requests_total{handler="securityCredentialsHandler",code="200"} 1' in body
    assert 'kiamfast_http_requests_total{handler="roleHandler",code="200"} 1' in body
    assert 'kiamfast_http_requests_total{handler="roleHandler",code="404"} 1' in body
    assert 'kiamfast_http_requests_total{handler="tokenHandler",code="200"} 1' in body
    # kube2iam's histogram, with kube2iam's handler names (the token PUT is what kube2iam
    # proxied: reverseProxyHandler)
    k2i = "kube2iam_http_request_duration_seconds_count"
    assert f'{k2i}{{code="200",handler="securityCredentialsHandler",method="GET"}} 1' in body
    assert f'{k2i}{{code="200",handler="roleHandler",method="GET"}} 1' in body
    assert f'{k2i}{{code="404",handler="roleHandler",method="GET"}} 1' in body
    assert f'{k2i}{{code="200",handler="reverseProxyHandler",method="PUT"}} 1' in body
    assert ('kube2iam_http_request_duration_seconds_bucket{code="200",handler="roleHandler",'
            'method="GET",le="0.001"} 1') in body
    assert "kiamfast_worker_connections_total 5" in body


def test_metrics_are_valid_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    server.get("/readyz")
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    assert "kiamfast_http_requests" in families
    hist = families["kube2iam_http_request_duration_seconds"]
    assert hist.type == "histogram"
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    # kube2iam's buckets: 1 ms doubling, 14 of them, then +Inf
    assert [s.labels["le"] for s in buckets[:15]] == [
        f"{0.001 * 2 ** i:g}" for i in range(14)] + ["+Inf"]
    assert {k for s in hist.samples for k in s.labels} == {"code", "method", "handler", "le"}


def test_separate_metrics_port_serves_only_metrics(make_server, pods):
    pods.add("127.0.0.1", "app-role")
    server = make_server(metrics_port=9)  # any port != app_port: a second listener
    assert server.metrics_port != server.port
    with Client(server.metrics_port) as c:
        assert c.request(build("GET", "/metrics")).status == 200
        assert c.request(build("GET", LIST)).status == 404
    assert server.get(LIST).body == b"app-role"
