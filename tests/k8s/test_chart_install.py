"""The chart installed for real (issue 21): ``helm install`` of deploy/chart/kiamfast with a
kube2iam user's values file into the real kube-apiserver, the real DaemonSet controller and
scheduler placing the agent's pod, the real kubelet starting it exactly as rendered (host
network, NET_ADMIN, its ServiceAccount token, the runtime socket's directory, the xtables
lock, the startup-taint toleration, probes) from the image deploy/image/build.sh builds,
imported into the node's containerd. The agent runs only in its container; the test plays the
user (helm, pods) and nothing else.

One node for the whole module, and the steps in order, each starting where the last left
the node: a fresh node with the startup taint (and a botocore app); the node's containerd
restarted while pods are replaced on a reused address; the agent's container killed, then
stopped as the kubelet stops it for a failed liveness probe; ``helm upgrade`` to a new image
tag (a rolling update) — through each of these the agent's rules never left the node;
``helm uninstall``, then the chart's objects applied and deleted with ``kubectl apply/delete
-k``: each time the agent removes its rules itself and no call reached the node's metadata
service while they were there; finally an install with ``dnatRule.removeOnUninstall=false``,
whose rules stay after ``helm uninstall`` (a pod's call is refused) until docs/install.md's
commands remove them. Every check is STS's own answer to what a pod received, plus moto's
record of which role each key was issued for.

What differs from a real node (and why): the node is a network namespace whose address is
``10.77.0.1``; the agent reaches the API server through the node's loopback proxy, so the
values set ``KUBERNETES_SERVICE_HOST``/``PORT`` (no kube-proxy turns the ``kubernetes``
Service's address into the server's here); ``cri.socketPath`` and ``stateDir`` point at the
test's containerd and a test directory; STS is moto (``--sts-endpoint``) and the agent's own
keys are static (``aws.*``), so the node's metadata service sees no credential request at all.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import kube
import pytest
from chart_cluster import (CHART, IMAGE_REPO, NAMESPACE, ChartControlPlane, ChartNode, RuleWatch,
                           chart_node, helm, kiamfast_rules, metadata_dnat, missing_reason,
                           print_failure_report, ready_agent_pod, removal_commands, state_dir,
                           values_file)
from cri_api.v1 import api_pb2 as cri
from kubelet_node import KubePod, go_time, wait_untainted

from e2e_cluster import POD_SCRIPTS, STARTUP_TAINT, assert_own_role
from runtime_node import wait_until

pytestmark = [pytest.mark.kubelet, pytest.mark.kube_apiserver, pytest.mark.root,
              pytest.mark.slow, pytest.mark.timeout(2400)]

RELEASE = "kf-chart"


@pytest.fixture(scope="module")
def control(kube_cluster, kubelet_available, tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    plane = ChartControlPlane(kube_cluster, tmp_path_factory.mktemp("chart-control"))
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def node(kube_cluster, control, tmp_path_factory):
    with chart_node(kube_cluster, tmp_path_factory.mktemp("chart-node")) as chart:
        yield chart


@pytest.fixture
def reported(node, control, test_failed):
    """The node; its logs (kubelet, containerd, agent pods, controllers) if the test failed."""
    yield node
    if test_failed():
        print_failure_report(node, control)


def agent_container_id(pod: dict) -> str:
    return pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]


def unschedulable(pod: dict) -> bool:
    """The scheduler's verdict on ``pod``: no node may take it (yet)."""
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
               for c in pod["status"].get("conditions", []))


def rejected_by_a_late_kubelet(pod: dict) -> bool:
    """The kubelet refused the pod for a taint (its node informer lags the API's)."""
    return pod["status"].get("reason") == "TaintToleration"


def restarts(pod: dict) -> int:
    return pod["status"]["containerStatuses"][0]["restartCount"]


def runtime_link(node: ChartNode) -> tuple[str, float | None]:
    """The agent's own view of its runtime link, read inside the node's namespace: the
    /healthz ``runtime`` field and the ``kiamfast_runtime_up`` metric."""
    return node.healthz().get("runtime", ""), node.metric("kiamfast_runtime_up")


def deleted(node: ChartNode, pod: KubePod, seen: dict[str, list[dict]]) -> KubePod:
    """Delete ``pod`` through the API; ``seen`` keeps its rounds (its log goes with it)."""
    seen[pod.name] = pod.rounds()
    node.admin.delete_pod(pod.namespace, pod.name, grace=1)
    return pod


def replacement(node: ChartNode, previous: KubePod, name: str, seen: dict[str, list[dict]],
                address: str) -> KubePod:
    """Once the runtime has freed the deleted ``previous``'s address, a new pod ``name``
    (role ``name``) asking every 0.2 s, which host-local gives that address; returned once
    it has been served (a round just after a runtime restart may get nothing)."""
    wait_until(lambda: node.sandbox_ip(previous) == "", timeout=90, interval=0.2,
               what=f"{previous}'s sandbox stopped")
    seen[previous.name] = max(seen[previous.name], previous.rounds(), key=len)
    current = node.create_pod(name, role=name, loop=300, interval=0.2, refetch=True)
    wait_until(lambda: any("AccessKeyId" in r for r in current.rounds()), timeout=90,
               interval=0.2, what=f"{current} served")
    assert node.sandbox_ip(current) == address
    return current


def busy_pods_keep_their_keys_across(node: ChartNode, interrupt: Callable[[dict], None],
                                     prefix: str) -> dict:
    """Two pods asking every 0.25 s while ``interrupt(agent pod)`` ends the agent's
    container; the kubelet restarts it in the same pod, which adopts the table on the node.
    Checks every round and that the restarted agent serves the keys it had (no new STS
    call); returns the agent pod after the restart."""
    before = ready_agent_pod(node)
    busy = [node.create_pod(f"{prefix}-{i}", role=f"{prefix}-{i}", loop=120, interval=0.25,
                            refetch=True) for i in range(2)]
    keys = {pod.name: pod.first_round()["AccessKeyId"] for pod in busy}
    with RuleWatch(node) as rules:
        interrupt(before)
        after = wait_until(lambda: (p := ready_agent_pod(node)) and
                           restarts(p) > restarts(before) and p, timeout=120, interval=0.5,
                           what="the agent container restarted")
    # The DaemonSet is there: the rules stayed throughout (a restart is no uninstall).
    assert rules.missing == [] and rules.last_present is not None
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    fresh = node.create_pod(f"after-{prefix}", role=f"after-{prefix}")
    doc = fresh.result(timeout=120)
    assert doc["exit"] == 0, doc
    assert_own_role(fresh, doc)
    for pod in busy:
        rounds = pod.result(timeout=120)["rounds"]
        # While no agent listened a round may get nothing; none another identity. The
        # restarted agent serves the credentials it had: the same key, no new STS call.
        for r in rounds:
            if "AccessKeyId" in r:
                assert_own_role(pod, r)
        assert rounds[-1].get("AccessKeyId") == keys[pod.name], rounds[-1]
    assert node.imds_credential_requests() == []
    return after


def test_a_fresh_node_waits_for_the_agent_pod_then_each_app_gets_its_own_role(reported,
                                                                              control):
    node = reported
    assert STARTUP_TAINT in node.taints()
    # Application pods created before the agent: the scheduler holds them back (the
    # startup taint is NoExecute; they do not tolerate it).
    waiting = [node.create_pod(f"app-{i}", role=f"app-{i}", bind=False) for i in range(2)]
    for pod in waiting:
        wait_until(lambda p=pod: unschedulable(p.get()), timeout=60, interval=0.5,
                   what=f"the scheduler holding back {pod}")
    helm(control, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "-f", str(values_file(node)))
    agent = ready_agent_pod(node)
    wait_untainted(node, timeout=60)
    spec = agent["spec"]
    assert spec["hostNetwork"] and spec["nodeName"] == node.name, spec
    # The pod as rendered and admitted: its token volume (the agent talks to the API with
    # it), the runtime's socket directory and the xtables lock.
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts, mounts
    assert {str(node.containerd.dir), "/run/xtables.lock"} <= mounts, mounts
    assert node.agents == []   # no agent on the host: only the container
    assert metadata_dnat(node), node.dnat_rules()
    for pod in waiting:
        if rejected_by_a_late_kubelet(pod.finished(timeout=120)):
            # The scheduler saw the taint gone before the kubelet's copy of the node did
            # (seen on a loaded machine): what its ReplicaSet would do, a new pod.
            pod = node.create_pod(f"{pod.name}-again", role=pod.role, bind=False)
        doc = pod.result(timeout=120)
        assert doc["exit"] == 0, doc
        assert_own_role(pod, doc)
    assert node.imds_credential_requests() == []


def test_a_botocore_app_gets_its_own_role(reported):
    """botocore's default chain as every boto3 application runs it (the instance-metadata
    provider at 169.254.169.254), in a pod of the agent's image (its /opt/venv has
    botocore): tests/e2e's pod script, unchanged."""
    node = reported
    script = (POD_SCRIPTS / "botocore_credentials.py").read_text()
    pod = node.create_app_pod("app-botocore", role="app-botocore", app={
        "image": f"{IMAGE_REPO}:test", "command": ["/opt/venv/bin/python", "-c", script],
        "args": ["--sts-endpoint", node.sts.moto_url]})
    doc = pod.result(timeout=120)
    assert doc["exit"] == 0 and doc["method"] == "iam-role", doc
    assert_own_role(pod, doc)
    assert node.imds_credential_requests() == []


def test_containerd_restarted_while_pods_are_replaced_on_a_reused_address(reported):
    """The node's containerd goes down and comes back twice while pods are replaced on one
    address (host-local has only that one): once deleted during the outage and replaced
    when the runtime is back, once replaced right after a restart. Every round of every
    pod gets its own role or nothing (STS's record of each key decides); the agent's link
    to the runtime (the socket's directory is mounted, so the new socket shows) comes
    back by itself, in the same container."""
    node = reported
    agent = ready_agent_pod(node)
    address = str(node.containerd.subnet.network_address + 250)
    node.containerd.set_range(address, address)
    seen: dict[str, list[dict]] = {}
    try:
        tenants = [node.create_pod("reuse-0", role="reuse-0", loop=300, interval=0.2,
                                   refetch=True)]
        assert_own_role(tenants[0], tenants[0].first_round(timeout=90))
        assert node.sandbox_ip(tenants[0]) == address
        node.containerd.kill()
        wait_until(lambda: runtime_link(node)[0].startswith("unreachable")
                   and runtime_link(node)[1] == 0, timeout=60, interval=0.2,
                   what="the agent seeing the runtime down")
        gone = deleted(node, tenants[-1], seen)   # while no runtime can act on it
        node.containerd.start()
        tenants.append(replacement(node, gone, "reuse-1", seen, address))
        node.containerd.restart()
        gone = deleted(node, tenants[-1], seen)
        tenants.append(replacement(node, gone, "reuse-2", seen, address))
        wait_until(lambda: runtime_link(node) == ("ok", 1), timeout=60, interval=0.5,
                   what="the agent's runtime link back")
        seen[tenants[-1].name] = tenants[-1].rounds()
    finally:
        node.containerd.set_range(None, None)
    for tenant in tenants:   # every round of every tenant: its own role or nothing
        for r in seen[tenant.name]:
            if "AccessKeyId" in r:
                assert_own_role(tenant, r)
    now = ready_agent_pod(node)
    assert (now["metadata"]["uid"], restarts(now), agent_container_id(now)) == (
        agent["metadata"]["uid"], restarts(agent), agent_container_id(agent))
    assert node.imds_credential_requests() == []


def test_the_agent_container_killed_pods_keep_their_credentials(reported):
    node = reported

    def kill(agent: dict) -> None:
        subprocess.run(["ctr", "-a", str(node.containerd.socket), "-n", "k8s.io", "tasks",
                        "kill", "-s", "SIGKILL", agent_container_id(agent)], check=True,
                       capture_output=True, timeout=30)
    busy_pods_keep_their_keys_across(node, kill, "busy")


def test_the_agent_container_stopped_as_for_a_failed_liveness_probe(reported):
    """What the kubelet does when the liveness probe fails: CRI StopContainer with the
    pod's grace period (SIGTERM, SIGKILL only once it ran out), then a new container in
    the same pod. (The probe itself is not waited for: at the chart's values it restarts a
    container after six failures 10 s apart, and /healthz turns 500 only after the agent's
    30-s metadata check failed or its runtime link was dead for 60 s.) The agent stops
    cleanly within the grace period and the new one serves the same keys."""
    node = reported

    def stop(agent: dict) -> None:
        grace = agent["spec"]["terminationGracePeriodSeconds"]
        node.containerd.call("StopContainer", cri.StopContainerRequest(
            container_id=agent_container_id(agent), timeout=grace), timeout=grace + 30)
    after = busy_pods_keep_their_keys_across(node, stop, "stopped")
    ended = after["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert ended["exitCode"] == 0, ended   # SIGTERM honoured, not SIGKILLed at the deadline


def test_helm_upgrade_to_a_new_tag_rolls_the_agent_and_no_pod_gets_another_role(reported,
                                                                                control):
    node = reported
    before = ready_agent_pod(node)
    new_image = f"{IMAGE_REPO}:test-2"
    subprocess.run(["ctr", "-a", str(node.containerd.socket), "-n", "k8s.io", "images", "tag",
                    "--force", f"{IMAGE_REPO}:test", new_image], check=True,
                   capture_output=True, timeout=30)
    probes = [node.create_pod(f"rolling-{i}", role=f"rolling-{i}", loop=150, interval=0.2,
                              refetch=True) for i in range(2)]
    for pod in probes:
        assert_own_role(pod, pod.first_round())
    with RuleWatch(node) as rules:
        helm(control, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE,
             "--reuse-values", "--set", "image.tag=test-2")
        after = ready_agent_pod(node, image=new_image)
        wait_until(lambda: len(node.agent_pods()) == 1, timeout=120, interval=0.5,
                   what="the old agent pod gone")
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    assert rules.missing == []     # the old pod stopped; its DaemonSet did not go
    gaps = []
    for pod in probes:
        rounds = pod.result(timeout=120)["rounds"]
        served = [go_time(r["at"]) for r in rounds if "AccessKeyId" in r]
        for r in rounds:
            if "AccessKeyId" in r:
                assert_own_role(pod, r)
        assert "AccessKeyId" in rounds[-1], rounds[-1]
        gaps.append(max(b - a for a, b in zip(served, served[1:])))
    # Measured, not asserted (a shared 2-core machine): how long a pod asking every 0.2 s
    # went without an answer while the old agent pod stopped and the new one started.
    print(f"\nupgrade answer gap: {max(gaps):.2f} s (per pod: "
          f"{', '.join(f'{g:.2f}' for g in gaps)})")
    assert node.imds_credential_requests() == []


def uninstalled_without_opening_the_path(node: ChartNode, uninstall: Callable[[], None],
                                         prefix: str) -> None:
    """A pod asking every 0.2 s while ``uninstall()`` deletes the agent's DaemonSet: the
    agent removes every rule of its own (nothing is run on the node), and no call reached
    the node's metadata service while one was in place. (After, the node is as it was
    before kiamfast: a pod's call goes to the node's service, which the fake records.)"""
    ready_agent_pod(node)
    asking = node.create_pod(f"{prefix}-asking", role=f"{prefix}-asking", loop=300,
                             interval=0.2, refetch=True)
    assert_own_role(asking, asking.first_round(timeout=90))
    assert kiamfast_rules(node)
    before = len(node.imds.requests)
    with RuleWatch(node, interval=0.05) as rules:
        uninstall()
        wait_until(lambda: node.agent_pods() == [], timeout=120, interval=0.5,
                   what="the agent pod gone")
        wait_until(lambda: rules.missing, timeout=30, interval=0.2,
                   what="the agent's rules removed")
    assert kiamfast_rules(node) == [], kiamfast_rules(node)
    # Every round answered while a rule was there: its own role or nothing; no call reached
    # the node's service then. (A round's time is the pod's wall clock, the same host's.)
    present_until = rules.last_present + time.time() - time.monotonic()
    answered = [r for r in asking.rounds() if go_time(r["at"]) <= present_until]
    assert answered, asking.rounds()
    for r in answered:
        if "AccessKeyId" in r:
            assert_own_role(asking, r)
    early = [(r.path, r.at) for r in node.imds.requests[before:]
             if "security-credentials" in r.path and r.at <= rules.last_present]
    assert early == [], (early, rules.last_present)
    node.admin.delete_pod(asking.namespace, asking.name, grace=1)


def test_helm_uninstall_removes_the_rules_and_no_pod_reached_the_node_while_they_were_there(
        reported, control):
    node = reported
    uninstalled_without_opening_the_path(
        node, lambda: helm(control, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait"),
        "helm-uninstall")
    # What stays: the state directory (a tmpfs on a real node), for docs/install.md.
    assert (state_dir(node) / "table").exists()


def test_kubectl_delete_k_removes_the_rules_too(reported, control, tmp_path):
    """The chart rendered as deploy/base is (a kustomization of its objects), applied and
    deleted with the real kubectl: ``delete -k`` deletes the ServiceAccount and the RBAC
    before the DaemonSet (kustomize lists them first), so the agent's token is refused by
    the time it stops, and the watch it opened before decides."""
    node = reported
    kubectl = kube.binary("kubectl", kube.KUBE_VERSION)
    if not kubectl.exists():
        pytest.skip(f"needs {kubectl}: bash tests/k8s/build.sh")
    rendered = helm(control, "template", "kf-kustomize", str(CHART), "--namespace", NAMESPACE,
                    "-f", str(values_file(node)))
    (tmp_path / "agent.yaml").write_text(rendered)
    (tmp_path / "kustomization.yaml").write_text("resources: [agent.yaml]\n")

    def run(*args: str) -> str:
        out = subprocess.run([str(kubectl), f"--kubeconfig={control.kubeconfig}", *args],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        return out.stdout
    run("apply", "-k", str(tmp_path))
    wait_until(lambda: ready_agent_pod(node), timeout=180, interval=0.5, what="the agent")
    deleted: list[str] = []
    uninstalled_without_opening_the_path(
        node, lambda: deleted.extend(run("delete", "-k", str(tmp_path)).splitlines()),
        "kubectl-delete")
    kinds = [line.split(" ", 1)[0] for line in deleted]   # serviceaccount "name" deleted ...
    assert kinds.index("serviceaccount") < kinds.index("daemonset.apps"), deleted


def test_with_remove_on_uninstall_off_the_rules_stay_until_the_documented_commands(
        reported, control):
    """dnatRule.removeOnUninstall=false: the rules outlive the agent (a pod's call is
    refused, never the node's role) until docs/install.md's commands remove them."""
    node = reported
    seen = len(node.imds.requests)   # the steps before: calls after their uninstalls
    helm(control, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "-f", str(values_file(node, {"dnatRule": {"removeOnUninstall": False}})))
    ready_agent_pod(node)
    helm(control, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    wait_until(lambda: node.agent_pods() == [], timeout=120, interval=0.5,
               what="the agent pod gone")
    rules = kiamfast_rules(node)
    assert metadata_dnat(node) and len(rules) == 3, rules   # DNAT, INPUT and FORWARD
    orphan = node.create_pod("no-agent", role="no-agent")
    doc = orphan.result(timeout=180)
    assert doc["exit"] != 0 and "AccessKeyId" not in doc, doc
    assert [r.path for r in node.imds.requests[seen:] if "security-credentials" in r.path] == []
    state = state_dir(node)
    assert (state / "table").exists()   # kept for a reinstall to adopt
    # docs/install.md's removal commands for the rules and the state, run on the node.
    node.net.ns.run(["sh", "-ec", removal_commands(state)[0]], check=True)
    assert kiamfast_rules(node) == []
    assert not state.exists()
