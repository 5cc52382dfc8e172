"""Container credentials as the chart installs them, on a real kubelet node (issue 24).

The user's steps, in order, on one node for the whole module (as in test_chart_install.py),
every check STS's own answer (moto's record of which role each key was issued for):

1. ``helm install`` with ``containerCredentials.enabled`` (the agent's listeners on
   169.254.170.23:80 and [fd00:ec2::23]:80, put on its link ``kiamfast0``; ``create
   tokenreviews``) and ``containerCredentials.webhook.enabled`` (a Deployment of two pods, its
   Service, a chart-made certificate, the MutatingWebhookConfiguration), the injected token
   living 600 s (the API's minimum). The webhook's pods run as the chart's webhook
   ServiceAccount (the kubelet mounts its token where the in-cluster client reads it; no
   kubeconfig), which may get ServiceAccounts and nothing more. The pod whose token rotates
   is created right then: the rotation is waited for last, the other steps overlap the wait.
2. Two opted-in app pods (``iam.amazonaws.com/role`` + ``kiamfast.io/container-credentials:
   "true"``) created through the API server, which calls the webhook: they come back with the
   two variables and the projected token volume, the real kubelet mounts the token, and each
   app's AWS SDK for Go v2 (its default chain, whose container provider comes before IMDS)
   gets its own role from the agent by the token; so does a pod without annotations whose
   ServiceAccount carries the role and the opt-in (the webhook reads the account through
   the API and stores the pod with its role); a pod without the opt-in gets its role by
   IMDS, kube2iam's contract.
3. The webhook scaled to 0: an opted-in pod is still created (``failurePolicy: Ignore``),
   uninjected, and gets its own role by IMDS.
4. The rotation: the kubelet's token manager renews a projected token once less than 20 % of
   its life is left, minus up to 10 s of jitter (pkg/kubelet/token/token_manager.go
   ``requiresRefresh``: 470-480 s into a 600-s token), and the volume is rewritten at the
   pod's next sync (SyncPod -> WaitForAttachAndMount -> ReprocessPod -> remount), every
   ``syncFrequency`` (1 min by default, plus up to 50 % jitter; this kubelet syncs every
   10 s so the wait ends sooner). The app, fetching afresh every round, keeps its role and key:
   one more TokenReview, no more AssumeRole.
5. ``helm uninstall``: the link keeps its addresses, so the running app's next call is
   refused at once (fail closed, never IMDS), until docs/install.md's removal commands take
   the link, the DNAT rule and the state directory away.

What the control plane needs for the webhook, checked against the real components
(Kubernetes v1.34.2), and where this cluster differs from a real one:

* kube-controller-manager runs, besides test_chart_install.py's controllers, the Deployment
  and ReplicaSet controllers (the webhook is a Deployment), the EndpointSlice controller and
  the ServiceAccount controller. kube-apiserver resolves a webhook Service through
  EndpointSlices: cmd/kube-apiserver/app/server.go ``buildServiceResolver`` gives the
  admission webhooks ``NewEndpointServiceResolver`` over an EndpointSlice getter with
  ``--enable-aggregator-routing``, else ``NewClusterIPServiceResolver``. The ServiceAccount
  admission plugin refuses a pod whose ServiceAccount (``default`` unless named) does not
  exist; the ServiceAccount controller makes ``default`` in every namespace.
* The chart's API server runs with ``--enable-aggregator-routing=true``: it dials the
  webhook pod's own address (an endpoint of the Service), not the ClusterIP, which no
  kube-proxy serves here.
* A route from the host's network namespace, where the API servers run, to the node's pod
  network (10.87.0.0/24, a subnet no other test node uses) through a veth pair into the
  node's namespace, with forwarding on there: how a real control plane reaches pods. It is
  the only change to the host's network; the pair, and the route with it, go at the end.
* The webhook's ``namespaceSelector`` picks the node's namespace alone and its pods are
  created through the chart's API server: the configuration lives in the etcd the session's
  own API server shares, which has no aggregator routing (it would dial a ClusterIP), and no
  other test's pod creation may call it.
* The webhook's pods, in the pod network, reach the API server by
  ``containerCredentials.webhook.extraEnv`` ``KUBERNETES_SERVICE_HOST``/``_PORT`` (no
  kube-proxy serves the ``kubernetes`` Service): the node's address, where a TcpProxy to the
  chart's API server listens in the node's namespace; that server's certificate names the
  address too, and the pods' ``ca.crt`` trusts it (``ChartControlPlane(server_ips=...)``).
* Otherwise as in test_chart_install.py: the node's address, ``KUBERNETES_SERVICE_HOST``/
  ``_PORT`` in ``extraEnv``, ``cri.socketPath`` and ``stateDir`` in the test's directories,
  moto for STS with static keys for the agent.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import statistics
import subprocess
import time
from typing import Any

import pytest
from chart_cluster import (CHART, CONTROLLERS, NAMESPACE, ChartControlPlane, ChartNode,
                           PodNetworkRoute, chart_node, helm, kiamfast_rules, metadata_dnat,
                           missing_reason,
                           pod_network_api, print_failure_report, ready, ready_agent_pod,
                           removal_commands, state_dir, values_file)
from kubelet_node import KubePod, go_time, wait_untainted

from e2e_cluster import BASE_ARN, ROLE_KEY, assert_own_role
from kiamfast.webhook import patch
from runtime_node import wait_until

pytestmark = [pytest.mark.kubelet, pytest.mark.kube_apiserver, pytest.mark.root,
              pytest.mark.slow, pytest.mark.timeout(1800)]

RELEASE = "kf-cc"
TOKEN_SECONDS = 600
LINK = "kiamfast0"
ADDRESSES = ("169.254.170.23", "fd00:ec2::23")
SELECTOR_LABEL = "kiamfast.io/container-credentials-test"
PROVIDER_TOKEN = "CredentialsEndpointProvider"   # the Go SDK's names of its providers
PROVIDER_IMDS = "EC2RoleProvider"
CONFIGS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
WEBHOOK_CONTROLLERS = ("deployment-controller", "replicaset-controller",
                       "endpointslice-controller", "serviceaccount-controller")
NODE_IP = "10.77.0.1"   # the node's address (RuntimeNode's host_ip), on the pods' bridge
ACCOUNT = "opted-in"    # the ServiceAccount that opts its pods in (step 2)
ACCOUNT_ROLE = "by-account"


@pytest.fixture(scope="module")
def control(kube_cluster, kubelet_available, tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    plane = ChartControlPlane(kube_cluster, tmp_path_factory.mktemp("cc-control"),
                              controllers=CONTROLLERS + WEBHOOK_CONTROLLERS,
                              apiserver_args=("--enable-aggregator-routing=true",),
                              server_ips=(NODE_IP,))
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def node(kube_cluster, control, tmp_path_factory):
    with chart_node(kube_cluster, tmp_path_factory.mktemp("cc-node"), subnet="10.87.0.0/24",
                    kubelet_args=["--sync-frequency=10s"]) as chart:
        chart.admin = control.admin   # pods are created through the chart's API server
        assert chart.host_ip == NODE_IP, "the API server's certificate names NODE_IP"
        # ServiceAccount admission wants the pods' account; its controller makes it.
        wait_until(lambda: chart.admin.request(
            "GET", f"/api/v1/namespaces/{chart.name}/serviceaccounts/default")[0] == 200,
            timeout=60, interval=0.2, what="the namespace's default ServiceAccount")
        with PodNetworkRoute(chart):
            try:
                yield chart
            finally:
                # A module that failed half-way leaves no release for later modules.
                helm(control, "uninstall", RELEASE, "--namespace", NAMESPACE,
                     "--ignore-not-found", "--wait")


@pytest.fixture(scope="module")
def pod_api(node, control):
    """The chart's API server on the node's address, where the webhook's pods reach it."""
    proxy = pod_network_api(node, control)
    yield proxy
    proxy.close()


@pytest.fixture
def reported(node, control, test_failed):
    """The node; its logs (kubelet, containerd, agent and webhook pods, controllers) if the
    test failed."""
    yield node
    if test_failed():
        print_failure_report(node, control)
        print(f"\n===== webhook pods' logs =====\n{webhook_logs(node)}")


@pytest.fixture(scope="module")
def rotating() -> dict[str, Any]:
    """What step 1 leaves for step 4: the pod whose token rotates, its first token's hash."""
    return {}


def opted_in(role: str) -> dict[str, str]:
    return {"iam.amazonaws.com/role": role, patch.OPT_IN_ANNOTATION: "true"}


def webhook_pods(node: ChartNode) -> list[dict[str, Any]]:
    return node.admin.call("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector="
                                  f"app.kubernetes.io/component=webhook,"
                                  f"app.kubernetes.io/instance={RELEASE}")["items"]


def webhook_logs(node: ChartNode) -> str:
    assert node.kubelet is not None
    return "\n".join(f"--- {p['metadata']['name']}:\n" + "\n".join(node.kubelet.container_log(
        NAMESPACE, p["metadata"]["name"], p["metadata"]["uid"], container="webhook")[-40:])
        for p in webhook_pods(node))


def webhook_deployment(node: ChartNode) -> str:
    """The path of the chart's webhook Deployment."""
    items = node.admin.call("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
                                   f"?labelSelector=app.kubernetes.io/instance={RELEASE}")["items"]
    names = [d["metadata"]["name"] for d in items if d["metadata"]["name"].endswith("-webhook")]
    assert len(names) == 1, names
    return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{names[0]}"


def injected(pod: dict[str, Any]) -> bool:
    return any(v["name"] == patch.VOLUME for v in pod["spec"].get("volumes", []))


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env", [])}


def injection_works(node: ChartNode) -> bool:
    """A server-side dry run of an opted-in pod (admission runs, webhooks included;
    nothing is stored) comes back injected: the API server has the configuration and an
    endpoint of the webhook's Service."""
    status, pod = node.admin.request("POST", f"/api/v1/namespaces/{node.name}/pods?dryRun=All", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dry-run-probe", "annotations": opted_in("probe")},
        "spec": {"nodeName": node.name, "containers": [{"name": "app", "image": node.image}]}})
    return status == 201 and injected(pod)


def projected_file(node: ChartNode, uid: str, volume: str, name: str) -> bytes:
    """A file the kubelet wrote into a pod's projected volume (a tmpfs in the node's mount
    namespace; the pod's containers see this file)."""
    assert node.kubelet is not None and node.mount_ns is not None
    path = node.kubelet.root_dir / "pods" / uid / "volumes" / "kubernetes.io~projected" / volume
    return subprocess.run([*node.mount_ns.argv(), "cat", str(path / name)],
                          capture_output=True, timeout=30, check=True).stdout


def token_sha256(node: ChartNode, pod: KubePod) -> str:
    """The SHA-256 of the token the kubelet wrote into the pod's injected volume."""
    return hashlib.sha256(projected_file(node, pod.uid, patch.VOLUME,
                                         patch.TOKEN_FILE)).hexdigest()


def jwt_claims(token: bytes) -> dict[str, Any]:
    payload = token.split(b".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4)))


def allowed(node: ChartNode, user: str, verb: str, resource: str) -> bool:
    """The real RBAC authorizer's answer for ``user`` (a SubjectAccessReview)."""
    review = node.admin.call("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:serviceaccounts"],
                 "resourceAttributes": {"verb": verb, "resource": resource,
                                        "namespace": node.name}}})
    return review["status"].get("allowed", False)


def runs_in_cluster_as_its_account(node: ChartNode, pod: dict[str, Any]) -> None:
    """The webhook pod runs with the chart's ServiceAccount's token, mounted by the kubelet
    where the in-cluster client reads it, and no kubeconfig; that account may get
    ServiceAccounts (the chart's ClusterRole binding) and nothing more."""
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    account = spec["serviceAccountName"]
    assert account == f"{RELEASE}-kiamfast-webhook", account
    node.admin.call("GET", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}")
    assert "--service-account-opt-in" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--kubeconfig")], container
    (mount,) = [m for m in container["volumeMounts"]
                if m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"]
    token = projected_file(node, pod["metadata"]["uid"], mount["name"], "token")
    user = f"system:serviceaccount:{NAMESPACE}:{account}"
    assert jwt_claims(token)["sub"] == user
    assert allowed(node, user, "get", "serviceaccounts")
    assert not allowed(node, user, "list", "serviceaccounts")
    assert not allowed(node, user, "get", "pods")


def link_addresses(node: ChartNode) -> list[str] | None:
    """The global addresses on the node's link ``kiamfast0`` (None: no such link)."""
    out = node.net.ns.run(["ip", "-o", "addr", "show", "dev", LINK, "scope", "global"])
    if out.returncode != 0:
        return None
    return [line.split()[3].split("/")[0] for line in out.stdout.splitlines()]


def assume_roles(node: ChartNode, role: str) -> int:
    """How many AssumeRole calls for ``role`` STS answered."""
    assert node.sts.proxy is not None
    return len(node.sts.proxy.assume_role_calls(BASE_ARN + role, outcome="ok"))


def decided_reviews(node: ChartNode) -> float:
    """TokenReviews the API server decided: a review that failed (a timeout on a loaded
    machine) or came back undecided is asked again and counted apart, not a second verdict."""
    def kind(k: str) -> float:
        return node.labelled_metric("kiamfast_token_reviews_total", kind=k)
    return kind("reviews") - kind("review_errors") - kind("undecided")


def served_by(pod: KubePod, rounds: list[dict[str, Any]], provider: str) -> None:
    """Every round got the pod's own role (STS's record) from ``provider``."""
    assert rounds, f"{pod}: no rounds"
    for r in rounds:
        assert_own_role(pod, r)
        assert r["Source"] == provider, r


def test_helm_install_serves_container_credentials_and_runs_the_webhook(reported, control,
                                                                         pod_api, rotating):
    node = reported
    node.admin.call("PATCH", f"/api/v1/namespaces/{node.name}",
                    {"metadata": {"labels": {SELECTOR_LABEL: node.name}}},
                    content_type="application/merge-patch+json")
    values = values_file(node, {"containerCredentials": {
        "enabled": True,
        "webhook": {"enabled": True, "tokenExpirationSeconds": TOKEN_SECONDS,
                    "namespaceSelector": {"matchLabels": {SELECTOR_LABEL: node.name}},
                    # No kube-proxy serves the kubernetes Service to pods here.
                    "extraEnv": {"KUBERNETES_SERVICE_HOST": NODE_IP,
                                 "KUBERNETES_SERVICE_PORT": str(pod_api.port)}}}})
    helm(control, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values))
    ready_agent_pod(node)
    wait_untainted(node, timeout=60)
    assert sorted(link_addresses(node) or []) == sorted(ADDRESSES), link_addresses(node)
    # The scheduler places the webhook's pods once the startup taint is gone.
    pods = wait_until(lambda: (p := webhook_pods(node)) and len(p) == 2
                      and all(ready(x) for x in p) and p, timeout=180, interval=0.5,
                      what="the webhook's two pods Ready")
    assert {p["spec"]["nodeName"] for p in pods} == {node.name}
    for pod in pods:
        runs_in_cluster_as_its_account(node, pod)
    wait_until(lambda: injection_works(node), timeout=60, interval=0.5,
               what="the API server calling the webhook")
    # The pod whose token step 4 watches rotate: asking every 2 s for 12 minutes (its
    # token's whole life and the uninstall after it).
    pod = node.create_pod("rotating", role="rotating", loop=360, interval=2.0, refetch=True,
                          annotations=opted_in("rotating"))
    served_by(pod, [pod.first_round(timeout=120)], PROVIDER_TOKEN)
    rotating.update(pod=pod, created=time.time(), token=token_sha256(node, pod))
    assert node.healthz().get("containerCredentials") == "ok", node.healthz()
    assert node.imds_credential_requests() == []


def test_opted_in_apps_get_their_own_roles_by_token_and_others_by_imds(reported):
    node = reported
    answered = node.labelled_metric("kiamfast_container_credentials_total", code="200")
    # A ServiceAccount that opts its pods in, and a pod of it with no annotations: the
    # webhook reads the account in-cluster, as the chart's account, and writes its role on
    # the stored pod for the agent.
    node.admin.call("POST", f"/api/v1/namespaces/{node.name}/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": ACCOUNT, "annotations": opted_in(ACCOUNT_ROLE)}})
    by_account = dataclasses.replace(   # the role it must get: its account's
        node.create_pod("account-app", loop=3, interval=0.5, refetch=True,
                        service_account=ACCOUNT), role=ACCOUNT_ROLE)
    apps = [node.create_pod(f"token-{i}", role=f"token-{i}", loop=3, interval=0.5,
                            refetch=True, annotations=opted_in(f"token-{i}")) for i in range(2)]
    plain = node.create_pod("imds-app", role="imds-app", loop=3, interval=0.5, refetch=True)
    token_file = f"{patch.MOUNT_PATH}/{patch.TOKEN_FILE}"
    stored = by_account.get()
    assert stored["metadata"].get("annotations") == {ROLE_KEY: ACCOUNT_ROLE}, stored["metadata"]
    for app in [by_account, *apps]:
        pod = app.get()
        assert injected(pod), pod["spec"]
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == patch.VOLUME)
        assert volume["projected"]["sources"][0]["serviceAccountToken"][
            "expirationSeconds"] == TOKEN_SECONDS
        env = env_of(pod)
        assert env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] == "http://169.254.170.23/v1/credentials"
        assert env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] == token_file
        doc = app.result(timeout=120)
        assert doc["exit"] == 0, doc
        served_by(app, doc["rounds"], PROVIDER_TOKEN)
    assert not injected(plain.get()) and "AWS_CONTAINER_CREDENTIALS_FULL_URI" not in env_of(
        plain.get())
    doc = plain.result(timeout=120)
    assert doc["exit"] == 0, doc
    served_by(plain, doc["rounds"], PROVIDER_IMDS)
    # The agent counted the token answers (the rotating pod's rounds add to them).
    assert node.labelled_metric("kiamfast_container_credentials_total",
                                code="200") >= answered + 9
    assert node.imds_credential_requests() == []


def test_with_the_webhook_down_an_opted_in_pod_is_created_and_gets_its_role_by_imds(reported):
    node = reported
    node.admin.call("PATCH", webhook_deployment(node), {"spec": {"replicas": 0}},
                    content_type="application/merge-patch+json")
    wait_until(lambda: webhook_pods(node) == [], timeout=120, interval=0.5,
               what="the webhook's pods gone")
    # failurePolicy Ignore: the API server creates the pod as sent (no endpoint, or a dead
    # one, is a failed call); its SDK then finds no container variables and asks IMDS.
    pod = node.create_pod("while-down", role="while-down", loop=2, interval=0.5, refetch=True,
                          annotations=opted_in("while-down"))
    assert not injected(pod.get()) and env_of(pod.get()).keys() == {"AWS_REGION",
                                                                    "AWS_ENDPOINT_URL_STS"}
    doc = pod.result(timeout=120)
    assert doc["exit"] == 0, doc
    served_by(pod, doc["rounds"], PROVIDER_IMDS)
    assert node.imds_credential_requests() == []


def test_the_rotated_token_keeps_the_app_on_its_role_and_key(reported, rotating):
    node = reported
    pod: KubePod = rotating["pod"]
    reviews = decided_reviews(node)
    calls = assume_roles(node, "rotating")
    # Still the first token after the count was read, so the count holds no review of the
    # second one.
    assert token_sha256(node, pod) == rotating["token"], "rotated before the test looked"
    wait_until(lambda: token_sha256(node, pod) != rotating["token"],
               timeout=rotating["created"] + TOKEN_SECONDS - time.time(), interval=1.0,
               what="the kubelet rewriting the token")
    rotated = time.time()
    print(f"\ntoken rotated {rotated - rotating['created']:.0f} s after the pod was created")
    after = wait_until(lambda: (r := [x for x in pod.rounds() if go_time(x["at"]) > rotated])
                       and len(r) >= 3 and r, timeout=60, interval=0.5,
                       what="three rounds with the new token")
    rounds = pod.rounds()
    served_by(pod, rounds, PROVIDER_TOKEN)
    assert {r["AccessKeyId"] for r in rounds} == {rounds[0]["AccessKeyId"]}   # one key
    assert decided_reviews(node) == reviews + 1, [
        (k, node.labelled_metric("kiamfast_token_reviews_total", kind=k))
        for k in ("reviews", "cached", "review_errors", "undecided")]
    assert assume_roles(node, "rotating") == calls
    # Measured, not asserted: what the SDK waited for its credentials, inside the pod (each
    # round a new HTTP request; a cached round: the token's review and the key both cached).
    cached = [r["seconds"] * 1000 for r in rounds[1:]]
    print(f"first call {rounds[0]['seconds'] * 1000:.1f} ms (its TokenReview included); "
          f"cached p50 {statistics.median(cached):.1f} ms, p90 "
          f"{statistics.quantiles(cached, n=10)[-1]:.1f} ms over {len(cached)} rounds, "
          f"{len(after)} of them with the rotated token")
    assert node.imds_credential_requests() == []


def test_helm_uninstall_keeps_the_link_so_pods_fail_closed_until_it_is_removed(reported,
                                                                               control,
                                                                               rotating):
    node = reported
    pod: KubePod = rotating["pod"]
    helm(control, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    wait_until(lambda: node.agent_pods() == [], timeout=120, interval=0.5,
               what="the agent pod gone")
    gone = time.time()
    assert sorted(link_addresses(node) or []) == sorted(ADDRESSES)   # kept on purpose
    # The metadata rules went with the DaemonSet (dnatRule.removeOnUninstall, the chart's
    # default: the node as it was); the link stays. The running app's next call: refused by
    # the node (the address is local, nothing listens), not a timeout, and never an answer
    # from IMDS.
    assert kiamfast_rules(node) == [], node.dnat_rules()
    refused = wait_until(lambda: [r for r in pod.rounds() if go_time(r["at"]) > gone],
                         timeout=60, interval=0.5, what="a round after the uninstall")
    assert "AccessKeyId" not in refused[0] and "connection refused" in refused[0]["error"], \
        refused[0]
    for r in pod.rounds():
        if "AccessKeyId" in r:
            assert_own_role(pod, r)
    node.delete_pod(pod)
    assert node.imds_credential_requests() == []
    state = state_dir(node)
    for commands in removal_commands(state):   # the rule and the state, then the link
        node.net.ns.run(["sh", "-ec", commands], check=True)
    assert link_addresses(node) is None
    assert metadata_dnat(node) == [], node.dnat_rules()
    assert not state.exists()
    assert control.admin.call("GET", f"{CONFIGS}?labelSelector=app.kubernetes.io/instance="
                                     f"{RELEASE}")["items"] == []
