"""The emulator's REST surface as the real ``kubernetes`` client sees it: lists, gets,
field selectors, patches, auth, faults, discovery and the command line."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kiamfast.testing.apiserver import NotFoundError

ROLE = "iam.amazonaws.com/role"


def _names(pod_list) -> list[str]:
    return [f"{p.metadata.namespace}/{p.metadata.name}" for p in pod_list.items]


def test_list_pods_with_field_selectors(srv, api):
    srv.nodes.add("node-a")
    srv.nodes.add("node-b")
    srv.pods.create("default", "a1", node="node-a", ips=["10.0.0.1"], phase="Running")
    srv.pods.create("apps", "a2", node="node-a", ips=["10.0.0.2"], phase="Running")
    srv.pods.create("default", "b1", node="node-b", ips=["10.0.1.1"], phase="Running")

    assert _names(api.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a")) == \
        ["apps/a2", "default/a1"]
    assert _names(api.list_pod_for_all_namespaces(field_selector="spec.nodeName==node-b")) == \
        ["default/b1"]
    assert _names(api.list_pod_for_all_namespaces(field_selector="status.podIP=10.0.0.2")) == \
        ["apps/a2"]
    assert _names(api.list_pod_for_all_namespaces(
        field_selector="spec.nodeName=node-a,metadata.name!=a2")) == ["default/a1"]
    assert _names(api.list_namespaced_pod("default", field_selector="spec.nodeName=node-a")) == \
        ["default/a1"]
    assert _names(api.list_pod_for_all_namespaces(field_selector="metadata.name=b1")) == \
        ["default/b1"]
    assert _names(api.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-z")) == []
    # labelSelector is accepted (and ignored).
    assert len(api.list_pod_for_all_namespaces(label_selector="app=x").items) == 3

    with pytest.raises(ApiException) as exc:
        api.list_pod_for_all_namespaces(field_selector="spec.bogus=1")
    assert exc.value.status == 400


def test_objects_are_complete_and_typed(srv, api):
    srv.nodes.add("node-a")
    created = srv.pods.create("team", "web", node="node-a", ips=["10.0.0.7", "fd00::7"],
                              phase="Running", annotations={ROLE: "arn:aws:iam::1:role/web"},
                              uid="uid-web")
    hostnet = srv.pods.create("kube-system", "proxy", node="node-a", host_network=True)

    pod = api.read_namespaced_pod("web", "team")
    assert pod.metadata.uid == "uid-web" == created["metadata"]["uid"]
    assert pod.metadata.annotations == {ROLE: "arn:aws:iam::1:role/web"}
    assert pod.metadata.resource_version == created["metadata"]["resourceVersion"]
    assert pod.metadata.creation_timestamp is not None
    assert pod.metadata.deletion_timestamp is None
    assert pod.spec.node_name == "node-a"
    assert not pod.spec.host_network
    assert pod.status.phase == "Running"
    assert pod.status.pod_ip == "10.0.0.7"
    assert [i.ip for i in pod.status.pod_ips] == ["10.0.0.7", "fd00::7"]
    node_ip = srv.nodes.get("node-a")["status"]["addresses"][0]["address"]
    assert pod.status.host_ip == node_ip

    assert api.read_namespaced_pod("proxy", "kube-system").spec.host_network is True
    assert hostnet["spec"]["hostNetwork"] is True

    srv.pods.mark_terminating("team", "web")
    assert api.read_namespaced_pod("web", "team").metadata.deletion_timestamp is not None

    with pytest.raises(ApiException) as exc:
        api.read_namespaced_pod("nope", "team")
    assert exc.value.status == 404
    assert json.loads(exc.value.body)["reason"] == "NotFound"

    ns = api.read_namespace("team")
    assert ns.status.phase == "Active"
    assert {"default", "kube-system", "team"} <= {n.metadata.name for n in api.list_namespace().items}
    node = api.read_node("node-a")
    assert node.status.conditions[0].type == "Ready"


def test_python_state_api(srv):
    srv.nodes.add("n")
    assert srv.pods.get("default", "p") is None
    srv.pods.create("default", "p", node="n")
    pod = srv.pods.get("default", "p")
    assert pod["status"]["phase"] == "Pending"
    assert "podIP" not in pod["status"]
    pod["status"]["phase"] = "mutated"          # a copy: the server's state is unaffected
    assert srv.pods.get("default", "p")["status"]["phase"] == "Pending"
    srv.pods.set_phase("default", "p", "Running")
    srv.pods.set_annotations("default", "p", {ROLE: "r"})
    pod = srv.pods.get("default", "p")
    assert (pod["status"]["phase"], pod["metadata"]["annotations"]) == ("Running", {ROLE: "r"})
    srv.pods.set_annotations("default", "p", None)
    assert "annotations" not in srv.pods.get("default", "p")["metadata"]
    with pytest.raises(NotFoundError):
        srv.pods.set_phase("default", "missing", "Running")
    with pytest.raises(ValueError):
        srv.pods.create("default", "p", node="n")
    srv.pods.delete("default", "p")
    assert srv.pods.get("default", "p") is None
    with pytest.raises(KeyError):
        srv.pods.delete("default", "p")
    ns = srv.namespaces.add("ns1", annotations={"iam.amazonaws.com/permitted": ".*"})
    assert ns["metadata"]["annotations"] == {"iam.amazonaws.com/permitted": ".*"}
    ns2 = srv.namespaces.set_annotations("ns1", {"iam.amazonaws.com/permitted": "x"})
    assert int(ns2["metadata"]["resourceVersion"]) > int(ns["metadata"]["resourceVersion"])


def test_patch_node_taints_merge_strategic_and_json_patch(srv, api):
    taint = {"key": "kiamfast.io/agent-not-ready", "value": "true", "effect": "NoSchedule"}
    other = {"key": "dedicated", "value": "gpu", "effect": "NoExecute"}
    srv.nodes.add("node-a", taints=[taint, other])
    rv0 = int(srv.nodes.get("node-a")["metadata"]["resourceVersion"])

    # JSON patch (RFC 6902) guarded by a test op, as a careful client removes a taint.
    node = api.patch_node("node-a", [
        {"op": "test", "path": "/spec/taints/0/key", "value": taint["key"]},
        {"op": "remove", "path": "/spec/taints/0"},
    ])
    assert [t.key for t in node.spec.taints] == ["dedicated"]
    rv1 = int(node.metadata.resource_version)
    assert rv1 > rv0
    assert srv.nodes.get("node-a")["spec"]["taints"] == [other]

    # A failing test op changes nothing (422) and keeps the resourceVersion.
    with pytest.raises(ApiException) as exc:
        api.patch_node("node-a", [{"op": "test", "path": "/spec/taints/0/key",
                                   "value": taint["key"]},
                                  {"op": "remove", "path": "/spec/taints/0"}])
    assert exc.value.status == 422
    assert int(srv.nodes.get("node-a")["metadata"]["resourceVersion"]) == rv1

    # Strategic merge patch: spec.taints is atomic, the list is replaced.
    node = api.patch_node("node-a", {"spec": {"taints": [taint]}})
    assert [t.key for t in node.spec.taints] == [taint["key"]]

    # Merge patch with a stale resourceVersion: 409 Conflict.
    with pytest.raises(ApiException) as exc:
        api.patch_node("node-a", {"metadata": {"resourceVersion": str(rv0)},
                                  "spec": {"taints": None}},
                       _content_type="application/merge-patch+json")
    assert exc.value.status == 409

    # Merge patch removing all taints: the field disappears, like on a real server.
    node = api.patch_node("node-a", {"spec": {"taints": None}},
                          _content_type="application/merge-patch+json")
    assert node.spec.taints is None
    assert "taints" not in srv.nodes.get("node-a")["spec"]

    # A no-op patch does not bump the resourceVersion.
    rv = srv.nodes.get("node-a")["metadata"]["resourceVersion"]
    node = api.patch_node("node-a", {"spec": {"taints": None}},
                          _content_type="application/merge-patch+json")
    assert node.metadata.resource_version == rv

    with pytest.raises(ApiException) as exc:
        api.patch_node("missing", {"spec": {}})
    assert exc.value.status == 404


def test_auth_failures_are_401_status(srv, kubeconfig, tmp_path, api_factory):
    doc = json.loads(open(kubeconfig).read())
    doc["users"][0]["user"]["token"] = "wrong-token"
    bad = tmp_path / "bad-kubeconfig"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ApiException) as exc:
        api_factory(str(bad)).list_pod_for_all_namespaces()
    assert exc.value.status == 401
    assert json.loads(exc.value.body) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "Unauthorized", "reason": "Unauthorized", "code": 401}

    req = urllib.request.Request(srv.url + "/api/v1/nodes")   # no token at all
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 401
    # /version is open without a token (like the system:public-info-viewer role).
    with urllib.request.urlopen(srv.url + "/version") as resp:
        assert json.loads(resp.read())["major"] == "1"


def test_discovery_and_version(srv, api, kubeconfig):
    from kubernetes import config
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    assert client.VersionApi(client.ApiClient(cfg)).get_code().major == "1"
    resources = api.get_api_resources()
    assert {r.name for r in resources.resources} >= {"pods", "nodes", "namespaces"}
    assert client.CoreApi(client.ApiClient(cfg)).get_api_versions().versions == ["v1"]


def test_set_pod_ips_as_the_client_sees_it(srv, api):
    srv.nodes.add("node-a")
    srv.pods.create("default", "p", node="node-a")
    assert api.read_namespaced_pod("p", "default").status.pod_ip is None
    srv.pods.set_ips("default", "p", ["10.0.0.9", "fd00::9"])
    status = api.read_namespaced_pod("p", "default").status
    assert status.pod_ip == "10.0.0.9"
    assert [i.ip for i in status.pod_ips] == ["10.0.0.9", "fd00::9"]
    srv.pods.set_ips("default", "p", None)
    assert api.read_namespaced_pod("p", "default").status.pod_ip is None
    with pytest.raises(NotFoundError):
        srv.pods.set_ips("default", "missing", ["10.0.0.10"])


def test_fail_next_500_then_recovers(srv, api):
    srv.faults.fail_next(2, status=500)
    for _ in range(2):
        with pytest.raises(ApiException) as exc:
            api.list_pod_for_all_namespaces()
        assert exc.value.status == 500
        assert json.loads(exc.value.body)["reason"] == "InternalError"
    assert api.list_pod_for_all_namespaces().items == []
    assert srv.traffic.stats()["faults_injected"] == 2


def test_fail_next_429_has_retry_after_and_client_retries(srv, api):
    srv.faults.fail_next(1, status=429, path_prefix="/api/v1/nodes")
    # Other paths are not affected.
    api.list_namespace()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port)
    conn.request("GET", "/api/v1/nodes", headers={"Authorization": f"Bearer {srv.token}"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 429
    assert resp.getheader("Retry-After") == "1"
    assert body["reason"] == "TooManyRequests" and body["code"] == 429
    conn.close()

    # urllib3 under the kubernetes client honours Retry-After on 429 and retries.
    srv.faults.fail_next(1, status=429, path_prefix="/api/v1/nodes")
    before = srv.traffic.stats()["requests"]
    assert api.list_node().items == []
    stats = srv.traffic.stats()
    assert stats["requests"] - before == 2
    assert stats["faults_injected"] == 2


def test_slow_list_serves_the_snapshot_taken_at_request_time(srv, api, caught_up):
    srv.nodes.add("n")
    srv.pods.create("default", "before", node="n")
    srv.faults.slow_list(0.5)
    result = {}

    def do_list():
        result["list"] = api.list_pod_for_all_namespaces(field_selector="spec.nodeName=n")

    t = threading.Thread(target=do_list)
    t.start()
    deadline = time.monotonic() + 5
    while srv.traffic.stats()["lists"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.pods.create("default", "during", node="n")
    t.join(10)
    srv.faults.slow_list(0)
    listed = result["list"]
    assert [p.metadata.name for p in listed.items] == ["before"]
    # The change made during the slow list is exactly what a watch from its RV replays.
    events = caught_up(api.list_pod_for_all_namespaces, field_selector="spec.nodeName=n",
                       resource_version=listed.metadata.resource_version)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "during")]


def test_list_exact_resource_version(srv, api):
    srv.nodes.add("n")
    srv.pods.create("default", "p1", node="n")
    rv = api.list_pod_for_all_namespaces().metadata.resource_version
    srv.pods.create("default", "p2", node="n")
    srv.pods.set_phase("default", "p1", "Running")
    srv.pods.delete("default", "p1")

    old = api.list_pod_for_all_namespaces(resource_version=rv, resource_version_match="Exact")
    assert old.metadata.resource_version == rv
    assert [(p.metadata.name, p.status.phase) for p in old.items] == [("p1", "Pending")]
    now = api.list_pod_for_all_namespaces(resource_version=rv,
                                          resource_version_match="NotOlderThan")
    assert [p.metadata.name for p in now.items] == ["p2"]

    srv.faults.compact()
    with pytest.raises(ApiException) as exc:
        api.list_pod_for_all_namespaces(resource_version=rv, resource_version_match="Exact")
    assert exc.value.status == 410
    assert json.loads(exc.value.body)["reason"] == "Expired"


def test_command_line_runs_and_writes_kubeconfig(tmp_path, api_factory):
    kc = tmp_path / "kc.yaml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiamfast.testing.apiserver", "--port", "0",
         "--kubeconfig", str(kc), "--node", "node-x"],
        stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        info = json.loads(proc.stdout.readline())
        assert info["kubeconfig"] == str(kc)
        api = api_factory(str(kc))
        assert [n.metadata.name for n in api.list_node().items] == ["node-x"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
