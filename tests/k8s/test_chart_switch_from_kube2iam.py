"""The switch from kube2iam, as its users make it (issue 34): kube2iam-chart (kube2iam's own
chart, from the read-only source beside the clone) installed with a kube2iam user's values
file and the real kube2iam (tests/tools/build_kube2iam.sh, in an image: kube2iam_image.py);
then docs/switching-from-kube2iam.md's ``helm upgrade`` of that release to kiamfast's chart, run as written
there. The real DaemonSet controller, scheduler and kubelet do the rest. Checked: the
DaemonSet is the same object (name and uid) and the only one, the kubelet runs kiamfast in
its pod, a pod on the node gets its own role through 169.254.169.254 before (kube2iam) and
after (kiamfast), and the release's Service (its cluster IP), ServiceAccount, ClusterRole,
binding and Secret are the same objects, nothing beside them. A pod asking every 0.5 s
across the switch never gets the node's own role, and the node's metadata service is never
asked for credentials: kiamfast's pod surges beside kube2iam's (the second port), and
kube2iam-chart's preStop hook, when kube2iam's pod stops, takes no rule away for good (issue
33). Before that, the same upgrade without kube2iamChart is refused by the chart (it would
start a second DaemonSet beside).

kube2iam's side of the node: the API server through the node's loopback proxy (in-cluster
client, ``KUBERNETES_SERVICE_HOST``/``PORT``), STS through ``AWS_ENDPOINT_URL`` (the node's
recording proxy in front of moto), EC2's DescribeRegions answered by an empty list on the
node's loopback (``AWS_ENDPOINT_URL_EC2``, as tests/kube2iam does), its health check
through the node's fake metadata service. The values file carries only kube2iam's value
names; kiamfast reads the same variables. The node has no startup taint: kube2iam's pods do
not tolerate it (kiamfast's do). kube2iam's charts run it privileged (with host.iptables),
so this module's API server allows privileged containers.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import kube2iam_release
import pytest
from chart_cluster import (CHART, IMAGE_REPO, NAMESPACE, SWITCH_DOC, ChartControlPlane, helm,
                           helm_binary, print_failure_report, ready_agent_pod)
from kube2iam_image import NAME as KUBE2IAM_IMAGE
from kube2iam_release import THEIR_CHART, kube2iam_values, node_particulars

from e2e_cluster import NODE_ACCESS_KEY_PREFIX, assert_own_role
from runtime_node import wait_until

pytestmark = [pytest.mark.kubelet, pytest.mark.kube_apiserver, pytest.mark.root,
              pytest.mark.slow, pytest.mark.timeout(1200)]

RELEASE = "kube2iam"
KINDS = {"DaemonSet": "/apis/apps/v1", "Service": "/api/v1", "ServiceAccount": "/api/v1",
         "Secret": "/api/v1", "ClusterRole": "/apis/rbac.authorization.k8s.io/v1",
         "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1"}


@pytest.fixture(scope="module")
def control(kube_cluster, kubelet_available, tmp_path_factory):
    with kube2iam_release.control_plane(kube_cluster,
                                        tmp_path_factory.mktemp("switch-control")) as plane:
        yield plane


@pytest.fixture(scope="module")
def node(kube_cluster, control, tmp_path_factory):
    with kube2iam_release.node(kube_cluster, tmp_path_factory.mktemp("switch-node")) as n:
        yield n


@pytest.fixture(scope="module")
def release(node, control):
    """The release is gone afterwards: the session's etcd outlives the module, and a
    DaemonSet left there would be run on the next chart module's node by its controllers."""
    yield
    kube2iam_release.uninstall(control, RELEASE)


@pytest.fixture
def reported(node, control, release, test_failed):
    """The node; its logs (kubelet, containerd, agent pods, controllers) if the test failed."""
    yield node
    if test_failed():
        print_failure_report(node, control)


def documented_switch(chart: str, values: Path) -> list[str]:
    """docs/switching-from-kube2iam.md's command for a release of ``chart``, filled in for
    this test."""
    section = SWITCH_DOC.read_text().split("## With kube2iam's Helm chart", 1)[1]
    section = section.split("\n## ", 1)[0]
    line = next(line for line in section.splitlines()
                if line.startswith("helm upgrade") and f"kube2iamChart={chart}" in line
                and line.split(f"kube2iamChart={chart}", 1)[1][:1] in ("", " "))
    fill = {"<release>": RELEASE, "<namespace>": NAMESPACE, "deploy/chart/kiamfast": str(CHART),
            "<your-values.yaml>": str(values)}
    args = [fill.get(word, word) for word in shlex.split(line)]
    assert args[0] == "helm" and not any(a.startswith("<") for a in args), args
    return args[1:]


def release_objects(node) -> dict[tuple[str, str], dict[str, Any]]:
    """The release's objects of KINDS, by (kind, name): uid and what may not change."""
    found = {}
    for kind, prefix in KINDS.items():
        plural = kind.lower() + "s"
        scope = "" if kind.startswith("Cluster") else f"/namespaces/{NAMESPACE}"
        items = node.admin.call("GET", f"{prefix}{scope}/{plural}"
                                       f"?labelSelector=app.kubernetes.io/instance={RELEASE}")
        for obj in items["items"]:
            found[(kind, obj["metadata"]["name"])] = {
                "uid": obj["metadata"]["uid"],
                "selector": obj.get("spec", {}).get("selector"),
                "clusterIP": obj.get("spec", {}).get("clusterIP")}
    return found


def helm_error(control: ChartControlPlane, *args: str) -> str:
    """``helm <args>`` that must fail: its stderr."""
    home = control.dir / "helm"
    env = dict(os.environ, KUBECONFIG=str(control.kubeconfig),
               HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode != 0, result.stdout
    return result.stderr


def own_role_served(node, name: str, *, loop: int = 40):
    """A pod asking every 0.5 s (``loop`` times), once it got its own role (rounds before
    the agent knows its address may get nothing; none another identity)."""
    pod = node.create_pod(name, role=name, loop=loop, interval=0.5, refetch=True)
    wait_until(lambda: any("AccessKeyId" in r for r in pod.rounds()), timeout=90,
               interval=0.5, what=f"{pod} served")
    for r in pod.rounds():
        if "AccessKeyId" in r:
            assert_own_role(pod, r)
    return pod


def test_helm_upgrade_of_a_kube2iam_chart_release_updates_it_in_place(reported, control):
    node = reported
    started = time.monotonic()
    values = kube2iam_values(node)
    helm(control, "install", RELEASE, str(THEIR_CHART), "--namespace", NAMESPACE,
         "-f", str(values))
    kube2iam_pod = ready_agent_pod(node, image=KUBE2IAM_IMAGE)
    assert kube2iam_pod["spec"]["containers"][0]["name"] == "kube2iam"
    # Asks every 0.5 s for 40 s: across the switch too.
    across = own_role_served(node, "under-kube2iam", loop=80)
    assert node.metric("kiamfast_ready") is None   # kube2iam answers, not kiamfast
    before = release_objects(node)
    daemonsets = [k for k in before if k[0] == "DaemonSet"]
    assert daemonsets == [("DaemonSet", "kube2iam-kube2iam-chart")], before
    print(f"\nkube2iam-chart installed and serving: {time.monotonic() - started:.1f} s")

    # Without kube2iamChart kiamfast's chart would name its DaemonSet another way: it
    # refuses, naming the value (only helm upgrade looks at the cluster).
    message = helm_error(control, "upgrade", RELEASE, str(CHART), "--namespace",
                         NAMESPACE, "-f", str(values), "-f", str(node_particulars(node)))
    assert "DaemonSet kube-system/kube2iam-kube2iam-chart of release kube2iam" in message
    assert "set kube2iamChart=kube2iam-chart" in message
    assert release_objects(node) == before

    switched = time.monotonic()
    helm(control, *documented_switch("kube2iam-chart", values),
         "-f", str(node_particulars(node)))
    agent = ready_agent_pod(node, image=f"{IMAGE_REPO}:test")
    print(f"switched (helm upgrade to the new pod Ready): {time.monotonic() - switched:.1f}"
          " s")
    after = release_objects(node)
    # The same objects, updated in place: same names, uids, selector, cluster IP; none
    # beside them (one DaemonSet, no second Service, ServiceAccount or RBAC).
    assert after == before, (before, after)
    assert agent["metadata"]["ownerReferences"][0]["uid"] == \
        before[("DaemonSet", "kube2iam-kube2iam-chart")]["uid"]
    assert agent["metadata"]["uid"] != kube2iam_pod["metadata"]["uid"]
    assert agent["spec"]["containers"][0]["name"] == "kube2iam"   # kept, as the chart says
    assert [p["metadata"]["uid"] for p in node.agent_pods()
            if "deletionTimestamp" not in p["metadata"]] == [agent["metadata"]["uid"]]
    wait_until(lambda: node.metric("kiamfast_ready") == 1, timeout=60, interval=0.5,
               what="kiamfast serving in the DaemonSet's pod")
    own_role_served(node, "under-kiamfast")
    # kube2iam-chart's preStop hook runs when kube2iam's pod stops: kiamfast's rules stay
    # (its DNAT rule kept in place, the filter-table backstop), so no request reaches the
    # node's metadata service.
    across.finished(timeout=120)
    rounds = across.rounds()
    node_role = [r for r in rounds
                 if r.get("AccessKeyId", "").startswith(NODE_ACCESS_KEY_PREFIX)]
    for r in rounds:
        if "AccessKeyId" in r and r not in node_role:
            assert_own_role(across, r)   # never another pod's role
    print(f"a pod asking every 0.5 s across the switch: {len(rounds)} rounds, "
          f"{sum('AccessKeyId' in r for r in rounds) - len(node_role)} its own role, "
          f"{len(node_role)} the NODE's role, the rest nothing; credential requests at the "
          f"node's metadata service: {len(node.imds_credential_requests())}; metadata DNAT "
          f"rules after: {[r for r in node.dnat_rules() if '169.254.169.254' in r]}")
    print(f"install, refusal, switch and checks: {time.monotonic() - started:.1f} s")
    assert node_role == [], node_role
    assert node.imds_credential_requests() == []
