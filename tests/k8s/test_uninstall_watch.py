"""How the agent tells an uninstall from an upgrade (kiamfast/control/k8s/uninstall.py),
against the real kube-apiserver: a DaemonSet and a pod that names it as its controller, as
the DaemonSet controller makes them, and the agent's own client and identity (the project's
ClusterRole, deploy/base/rbac.yaml, which names the DaemonSet ``kiamfast``).

No controller runs on this server, so a deleted DaemonSet's pod stays (the garbage collector
would delete it: that is the SIGTERM the agent answers, run on a real kubelet by
tests/k8s/test_chart_install.py), and a DaemonSet deleted in the foreground keeps its
``deletionTimestamp``: each state the agent may find at SIGTERM holds still for the test.

Each test deletes in the order users' tools do: ``helm uninstall`` the DaemonSet first and
the ServiceAccount and RBAC right after; ``kubectl delete -k`` the ServiceAccount and RBAC
first (kustomize lists them first), so the agent's token is refused before its DaemonSet is
gone.
"""
from __future__ import annotations

import asyncio
import secrets

import pytest
import yaml
from agent_watch import run

from kiamfast.control.k8s.uninstall import DELETING, GONE, PRESENT, REPLACED, UninstallWatch
from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config

pytestmark = [pytest.mark.kube_apiserver]

DAEMONSET = "kiamfast"    # the name the shipped ClusterRole lets the agent watch


def daemonset(admin, ns: str, name: str = DAEMONSET) -> dict:
    return admin.call("POST", f"/apis/apps/v1/namespaces/{ns}/daemonsets", {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}},
                              "spec": {"containers": [{"name": "agent", "image": "i"}]}}}})


def agent_pod(admin, ns: str, owner: dict | None) -> str:
    """A pod the DaemonSet controller would make for ``owner`` (no owner: a bare pod)."""
    name = f"{owner['metadata']['name'] if owner else 'bare'}-{secrets.token_hex(3)}"
    meta: dict = {"name": name}
    if owner is not None:
        meta["ownerReferences"] = [{
            "apiVersion": "apps/v1", "kind": "DaemonSet", "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    admin.call("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"containers": [{"name": "agent", "image": "i"}]}})
    return name


def delete_daemonset(admin, ns: str, *, propagation: str = "Background",
                     name: str = DAEMONSET) -> None:
    admin.call("DELETE", f"/apis/apps/v1/namespaces/{ns}/daemonsets/{name}",
               {"apiVersion": "v1", "kind": "DeleteOptions",
                "propagationPolicy": propagation})


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


class Following:
    """``async with Following(kubeconfig, ns, pod) as w``: the agent's UninstallWatch running
    on its own client until the block ends; ``w.state`` once it has read the owner."""

    def __init__(self, kubeconfig, ns: str, pod: str, *, state: str | None = PRESENT) -> None:
        self.client = Client(load_config(kubeconfig=str(kubeconfig)))
        self.watch = UninstallWatch(self.client, pod=pod, namespace=ns)
        self.first_state = state

    async def __aenter__(self) -> UninstallWatch:
        self.task = asyncio.create_task(self.watch.run())
        if self.first_state is not None:
            await until(lambda: self.watch.state == self.first_state,
                        f"the watch seeing {self.first_state}")
        return self.watch

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()


@pytest.fixture
def ns(kube_cluster, unique):
    name = unique("uninstall")
    kube_cluster.admin.create_namespace(name)
    return name


def test_an_upgrade_keeps_the_rules_and_helm_uninstall_removes_them(kube_cluster, ns):
    admin = kube_cluster.admin
    pod = agent_pod(admin, ns, daemonset(admin, ns))

    async def body():
        async with Following(kube_cluster.agent_kubeconfig, ns, pod) as w:
            # A rolling update, a restart, a deleted pod: the DaemonSet is there.
            assert await w.uninstalling() is False
            delete_daemonset(admin, ns)           # helm uninstall: background propagation
            await until(lambda: w.state == GONE, "the deletion seen")
            assert await w.uninstalling() is True
    run(body())


def test_a_daemonset_deleted_in_the_foreground_is_an_uninstall(kube_cluster, ns):
    admin = kube_cluster.admin
    pod = agent_pod(admin, ns, daemonset(admin, ns))

    async def body():
        async with Following(kube_cluster.agent_kubeconfig, ns, pod) as w:
            delete_daemonset(admin, ns, propagation="Foreground")
            await until(lambda: w.state == DELETING, "the deletion seen")
            assert await w.uninstalling() is True
    run(body())
    # It waits for its pods (the garbage collector's), as it would while they stop.
    ds = admin.call("GET", f"/apis/apps/v1/namespaces/{ns}/daemonsets/{DAEMONSET}")
    assert ds["metadata"]["deletionTimestamp"] and "foregroundDeletion" in \
        ds["metadata"]["finalizers"]


def test_kubectl_delete_k_order_the_token_refused_before_the_daemonset_goes(kube_cluster,
                                                                             ns, unique):
    """The agent's own ServiceAccount and binding deleted first: every new request of the
    agent is refused (401), and what decides is the watch opened before."""
    admin = kube_cluster.admin
    account = unique("kiamfast-uninstall")
    kubeconfig = kube_cluster.identity_without(account, drop=[])
    agent = kube_cluster.as_user(
        yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"])
    pod = agent_pod(admin, ns, daemonset(admin, ns))

    async def body():
        async with Following(kubeconfig, ns, pod) as w:
            admin.call("DELETE", f"/api/v1/namespaces/kube-system/serviceaccounts/{account}")
            admin.call("DELETE", f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/"
                                 f"{account}")
            await until(lambda: agent.request("GET", f"/api/v1/namespaces/{ns}/pods/{pod}")[0]
                        == 401, "the agent's token refused")
            # Refused and nothing deleted: the DaemonSet is there as far as anyone knows.
            assert await w.uninstalling() is False
            delete_daemonset(admin, ns)
            # Asked at SIGTERM (maybe before the deletion reached the watch): the watch's
            # word, waited for briefly.
            assert await w.uninstalling() is True
            assert w.state == GONE
    run(body())


def test_a_daemonset_recreated_under_its_name_keeps_the_rules(kube_cluster, ns):
    """helm uninstall and install again: the old DaemonSet's pods are deleted, the new one's
    agent will serve the node and finds the rules in place."""
    admin = kube_cluster.admin
    pod = agent_pod(admin, ns, daemonset(admin, ns))

    async def body():
        async with Following(kube_cluster.agent_kubeconfig, ns, pod) as w:
            delete_daemonset(admin, ns)
            await until(lambda: w.state == GONE, "the deletion seen")
            daemonset(admin, ns)
            await until(lambda: w.state == REPLACED, "the new DaemonSet seen")
            assert await w.uninstalling() is False
    run(body())


def test_a_pod_no_daemonset_controls_keeps_the_rules(kube_cluster, ns):
    admin = kube_cluster.admin
    daemonset(admin, ns)
    pod = agent_pod(admin, ns, None)

    async def body():
        async with Following(kube_cluster.agent_kubeconfig, ns, pod, state=None) as w:
            await until(lambda: w.owner is None and w.state == "unknown", "the pod read")
            delete_daemonset(admin, ns)
            assert await w.uninstalling() is False
    run(body())


def test_a_pod_adopted_by_another_daemonset_keeps_the_rules(kube_cluster, ns):
    """Orphaned (``--cascade=orphan``) and adopted by a DaemonSet of another name: the one
    watched is gone, but the pod's controller now is the other one, which the agent may not
    read (the role names its own): unknown, so the rules stay."""
    admin = kube_cluster.admin
    pod = agent_pod(admin, ns, daemonset(admin, ns))
    other = daemonset(admin, ns, "kiamfast-renamed")

    async def body():
        async with Following(kube_cluster.agent_kubeconfig, ns, pod) as w:
            delete_daemonset(admin, ns)
            await until(lambda: w.state == GONE, "the deletion seen")
            admin.call("PATCH", f"/api/v1/namespaces/{ns}/pods/{pod}", {"metadata": {
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                                     "name": "kiamfast-renamed",
                                     "uid": other["metadata"]["uid"], "controller": True}]}},
                       content_type="application/merge-patch+json")
            assert await w.uninstalling() is False
    run(body())
