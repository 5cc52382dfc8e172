"""The agent's API-facing code against a real kube-apiserver and etcd (issue 13, tier 1).

Everything the control process asks the API server is asked here of the real one, with the
agent's own ServiceAccount token and the ClusterRole from deploy/base/rbac.yaml: the node's
pods by field selector (list, then watch), bookmarks, resuming a watch after its stream ends
or its connection is cut, the 410 that etcd compaction causes and the relist after it,
namespace restrictions, and the startup taint's removal by JSON patch while another writer
edits the same taint list. Then the role is shown minimal: each verb taken away breaks
something a user would notice, except ``get`` on pods and namespaces, which nothing uses.
Last, the emulator is asked what the real server was asked where the two once disagreed.

No kubelet and no scheduler run: the test is the kubelet (it binds pods by ``nodeName`` and
writes their status through the status subresource, as the admin) and the other
controllers (it edits the Node's taints).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import urllib3
import yaml
from agent_watch import DENIED, NS_KEY, ROLE, ROLE_KEY, AgentWatch, run
from tcp_proxy import TcpProxy

from kiamfast.control.k8s.node import StartupTaint
from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config
from kiamfast.kube.errors import ApiError
from kiamfast.testing.apiserver import ApiServer as Emulator

pytestmark = pytest.mark.kube_apiserver

TAINT_KEY = "kiamfast.io/agent-not-ready"
OUR_TAINT = {"key": TAINT_KEY, "value": "true", "effect": "NoExecute"}


def uid(admin, ns, name):
    return admin.get_pod(ns, name)["metadata"]["uid"]


def running_pod(admin, ns, name, *, node, ip, role=None):
    admin.create_pod(ns, name, node=node, annotations={ROLE_KEY: role} if role else None)
    admin.set_pod_running(ns, name, ip)
    return uid(admin, ns, name)


@pytest.fixture
def proxy(kube_cluster):
    p = TcpProxy(target_port=kube_cluster.apiserver.port)
    yield p
    p.close()


# ---- list + watch ----------------------------------------------------------------------------

def test_list_then_watch_follows_this_nodes_pods_only(kube_cluster, table, unique):
    admin = kube_cluster.admin
    node, other, ns = unique("node"), unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_node(other)
    admin.create_namespace(ns)
    before = running_pod(admin, ns, "before", node=node, ip="10.244.1.1", role="app")
    running_pod(admin, ns, "elsewhere", node=other, ip="10.244.2.1", role="app")

    async def body():
        async with AgentWatch(kubeconfig=kube_cluster.agent_kubeconfig, table=table,
                              node=node) as w:
            assert w.synced and table.synced
            assert w.at("10.244.1.1") == (before, ROLE, w.slots.slot_for("app"))
            assert w.at("10.244.2.1") is None, "a pod of another node reached the table"
            # Scheduled, no address yet: the agent knows a pod is coming.
            admin.create_pod(ns, "after", node=node, annotations={ROLE_KEY: "other"})
            await w.until(lambda: table.pending_pods == 1, what="the pending pod")
            admin.set_pod_running(ns, "after", "10.244.1.2")
            await w.until(lambda: w.at("10.244.1.2") is not None, what="the new pod's address")
            assert w.at("10.244.1.2") == (uid(admin, ns, "after"), ROLE, w.slots.slot_for("other"))
            assert table.pending_pods == 0
            # A pod on the other node starting is never seen.
            running_pod(admin, ns, "elsewhere-2", node=other, ip="10.244.2.2", role="app")
            admin.set_pod_phase(ns, "before", "Succeeded")
            await w.until(lambda: w.at("10.244.1.1") is None, what="the finished pod released")
            admin.delete_pod(ns, "after")
            await w.until(lambda: w.at("10.244.1.2") is None, what="the deleted pod released")
            assert w.at("10.244.2.2") is None
            stats = w.stats()
            assert stats["lists"] == 1 and stats["relists"] == 0 and stats["gone"] == 0
            assert stats["errors"] == 0, stats
    run(body())


def test_bookmarks_arrive_and_an_ended_watch_resumes(kube_cluster, table, unique):
    """Pods change on another node only: none of it is this node's, but the server's
    bookmark (sent 2 s before a 4 s watch's deadline) carries the resourceVersion past it,
    and the agent resumes from there when the stream ends, without a relist."""
    admin = kube_cluster.admin
    node, other, ns = unique("node"), unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_node(other)
    admin.create_namespace(ns)

    async def body():
        async with AgentWatch(kubeconfig=kube_cluster.agent_kubeconfig, table=table, node=node,
                              watch_timeout=(4.0, 4.0)) as w:
            assert w.synced
            await w.until(lambda: w.stats()["watches"] >= 1, what="the watch")
            # off the loop: the agent's watch reads its stream on this loop meanwhile
            await asyncio.to_thread(running_pod, admin, ns, "elsewhere", node=other,
                                    ip="10.244.8.1")
            await w.until(lambda: w.stats()["bookmarks"] >= 1, timeout=8, what="a bookmark")
            await w.until(lambda: w.stats()["watches"] >= 2, timeout=8, what="the resume")
            assert w.stats()["events"] == 0     # nothing of this node's
            pod = running_pod(admin, ns, "p", node=node, ip="10.244.5.1", role="app")
            await w.until(lambda: w.at("10.244.5.1") is not None, what="the pod")
            assert w.at("10.244.5.1") == (pod, ROLE, w.slots.slot_for("app"))
            stats = w.stats()
            assert stats["relists"] == 0 and stats["gone"] == 0 and stats["errors"] == 0, stats
            assert stats["empty_watches"] == 0 and stats["bad_watch_bodies"] == 0, stats
    run(body())


def test_watch_resumes_after_the_connection_is_cut(kube_cluster, table, unique, proxy):
    admin = kube_cluster.admin
    node, ns = unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_namespace(ns)
    old = running_pod(admin, ns, "old", node=node, ip="10.244.3.1", role="app")
    kubeconfig = kube_cluster.agent_kubeconfig_via(proxy.url)

    async def body():
        async with AgentWatch(kubeconfig=kubeconfig, table=table, node=node) as w:
            assert w.synced
            assert w.at("10.244.3.1") == (old, ROLE, w.slots.slot_for("app"))
            await w.until(lambda: w.stats()["watches"] >= 1, what="the watch")
            proxy.down()          # the stream is reset; reconnecting fails for a while
            admin.delete_pod(ns, "old")
            new = running_pod(admin, ns, "new", node=node, ip="10.244.3.2", role="app")
            await w.until(lambda: w.stats()["errors"] >= 1, what="the cut noticed")
            await asyncio.sleep(0.5)
            assert w.at("10.244.3.1") == (old, ROLE, w.slots.slot_for("app"))  # unaware yet
            proxy.up()
            await w.until(lambda: w.at("10.244.3.2") is not None and w.at("10.244.3.1") is None,
                          timeout=15, what="the missed events")
            assert w.at("10.244.3.2") == (new, ROLE, w.slots.slot_for("app"))
            stats = w.stats()
            # Resumed from its resourceVersion: the watch cache still had the history.
            assert stats["relists"] == 0 and stats["gone"] == 0, stats
            assert stats["watches"] >= 2
    run(body())


def test_410_after_etcd_compaction_relists_and_the_table_stays_right(
        kube_cluster, uncached_apiserver, table, unique):
    """Through an API server that watches etcd directly: while the agent is cut off, a pod
    goes, another takes its address, and etcd compacts; the resumed watch gets 410."""
    admin = kube_cluster.admin
    node, ns = unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_namespace(ns)
    old = running_pod(admin, ns, "old", node=node, ip="10.244.4.1", role="app")
    stays = running_pod(admin, ns, "stays", node=node, ip="10.244.4.3", role="app")
    proxy = TcpProxy(target_port=uncached_apiserver.port)
    kubeconfig = kube_cluster.agent_kubeconfig_via(proxy.url)

    async def body():
        async with AgentWatch(kubeconfig=kubeconfig, table=table, node=node) as w:
            assert w.synced
            assert w.at("10.244.4.1") == (old, ROLE, w.slots.slot_for("app"))
            await w.until(lambda: w.stats()["watches"] >= 1, what="the watch")
            proxy.down()
            admin.delete_pod(ns, "old")
            new = running_pod(admin, ns, "new", node=node, ip="10.244.4.1", role="other")
            kube_cluster.etcd.compact()
            await w.until(lambda: w.stats()["errors"] >= 1, what="the cut noticed")
            proxy.up()
            seen_stays = []

            def converged():
                seen_stays.append(w.at("10.244.4.3"))
                return (w.at("10.244.4.1") or ("",))[0] == new

            await w.until(converged, timeout=15, what="the relist")
            assert w.at("10.244.4.1") == (new, ROLE, w.slots.slot_for("other"))
            # The pod that was there all along never left the table during the relist.
            assert set(seen_stays) == {(stays, ROLE, w.slots.slot_for("app"))}
            stats = w.stats()
            assert stats["gone"] >= 1 and stats["relists"] >= 1, stats
    try:
        run(body())
    finally:
        proxy.close()


def test_namespace_restrictions_follow_the_namespace_annotation(kube_cluster, table, unique):
    admin = kube_cluster.admin
    node, ns, late = unique("node"), unique("ns"), unique("ns")
    admin.create_node(node)
    admin.create_namespace(ns, annotations={NS_KEY: "[]"})
    pod = running_pod(admin, ns, "app", node=node, ip="10.244.6.1", role="app")

    async def body():
        async with AgentWatch(kubeconfig=kube_cluster.agent_kubeconfig, table=table, node=node,
                              policy={"namespace_restrictions": True}) as w:
            assert w.synced
            assert w.at("10.244.6.1") == (pod, DENIED, -1)
            admin.annotate_namespace(ns, {NS_KEY: '["app"]'})
            await w.until(lambda: w.at("10.244.6.1")[1] == ROLE, what="the role allowed")
            assert w.at("10.244.6.1") == (pod, ROLE, w.slots.slot_for("app"))
            admin.annotate_namespace(ns, {NS_KEY: '["other-*"]'})
            await w.until(lambda: w.at("10.244.6.1")[1] == DENIED, what="denied again")
            # A namespace created after the agent synced, and a pod in it.
            admin.create_namespace(late, annotations={NS_KEY: '["app"]'})
            late_pod = running_pod(admin, late, "p", node=node, ip="10.244.6.2", role="app")
            await w.until(lambda: w.at("10.244.6.2") is not None, what="the late pod")
            assert w.at("10.244.6.2") == (late_pod, ROLE, w.slots.slot_for("app"))
    run(body())


# ---- the startup taint ---------------------------------------------------------------------

def agent_client(kubeconfig, cls=None):
    """kiamfast's own API client, as the agent configures it from a kubeconfig."""
    return (cls or Client)(load_config(kubeconfig=str(kubeconfig)))


def taint_keys(admin, node):
    return [t["key"] for t in admin.get_node(node)["spec"].get("taints") or []]


def insert_taint(admin, node, key):
    """Another controller adding its taint at the front of the list (a JSON patch, no
    precondition): every later entry moves up one index, ours included."""
    admin.call("PATCH", f"/api/v1/nodes/{node}",
               [{"op": "add", "path": "/spec/taints/0",
                 "value": {"key": key, "value": "x", "effect": "NoSchedule"}}],
               content_type="application/json-patch+json")


def new_tainted_node(admin, node, taints):
    """Create a Node; returns its taint keys as the server stored them (its admission adds
    node.kubernetes.io/not-ready to every new Node, as it would for a kubelet's)."""
    admin.create_node(node, taints=taints)
    return taint_keys(admin, node)


class WriterBetweenReadAndPatch(Client):
    """The agent's client, with another writer's change landing on the real server right
    after each of the agent's first ``between`` reads of the Node: the interleaving in
    which a removal by index would hit the wrong taint, unless the patch tests what it
    read.  Records the status of every PATCH the server refused."""

    admin = node = None
    between = 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.patch_errors: list[int] = []

    async def request(self, method, path, **kw):
        try:
            response = await super().request(method, path, **kw)
        except ApiError as e:
            if method == "PATCH":
                self.patch_errors.append(e.status)
            raise
        if method == "GET" and path == f"/api/v1/nodes/{self.node}" and self.between:
            self.between -= 1
            insert_taint(self.admin, self.node, f"other.example/between-{self.between}")
        return response


def remove_taint(client, node, *, until_state="removed", then=None, timeout=60):
    """Run the agent's StartupTaint until ``until_state`` (then, optionally, ``then()``),
    stop it, and return it."""
    taint = StartupTaint(node, TAINT_KEY)

    async def body():
        task = asyncio.create_task(taint.run(client))
        while not taint.state.startswith(until_state):
            await asyncio.sleep(0.02)
        if then is not None:
            await then(taint)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    run(body(), timeout=timeout)
    return taint


def writer_client(kube_cluster, node, between):
    client = agent_client(kube_cluster.agent_kubeconfig, WriterBetweenReadAndPatch)
    client.admin, client.node, client.between = kube_cluster.admin, node, between
    return client


def test_taint_removal_keeps_a_change_made_between_read_and_patch(kube_cluster, unique):
    admin = kube_cluster.admin
    node = unique("node")
    before = new_tainted_node(admin, node, [{"key": "other.example/a", "effect": "NoSchedule"},
                                            OUR_TAINT])
    client = writer_client(kube_cluster, node, 2)
    taint = remove_taint(client, node)
    # Both interleaved writes made the agent's patch fail (its test op no longer matched
    # the entry at our index, which had moved); the third attempt went through.
    assert client.patch_errors == [422, 422] and taint.attempts == 3
    assert sorted(taint_keys(admin, node)) == sorted(
        [k for k in before if k != TAINT_KEY]
        + ["other.example/between-0", "other.example/between-1"])


def test_taint_removal_while_another_writer_keeps_changing_taints(kube_cluster, unique):
    """A free-running writer inserts taints at the front as fast as it can while the agent
    removes its own, three times over: every one of the writer's taints survives, ours
    never does."""
    admin = kube_cluster.admin
    node = unique("node")
    others = [k for k in new_tainted_node(admin, node, [OUR_TAINT]) if k != TAINT_KEY]
    written: list[str] = []
    conflicts = 0
    for round_ in range(3):
        client = writer_client(kube_cluster, node, 0)
        stop = threading.Event()

        def writer():
            i = 0
            while not stop.is_set() and i < 100:
                key = f"other.example/r{round_}-{i}"
                insert_taint(admin, node, key)
                written.append(key)
                i += 1

        t = threading.Thread(target=writer)
        t.start()
        try:
            time.sleep(0.05)
            remove_taint(client, node)
        finally:
            stop.set()
            t.join()
        conflicts += len(client.patch_errors)
        assert set(client.patch_errors) <= {422}, client.patch_errors
        keys = taint_keys(admin, node)
        assert TAINT_KEY not in keys
        assert sorted(keys) == sorted(others + written), "another writer's taint was lost"
        admin.call("PATCH", f"/api/v1/nodes/{node}",
                   [{"op": "add", "path": "/spec/taints/-", "value": OUR_TAINT}],
                   content_type="application/json-patch+json")
    print(f"patches that lost the race and were retried: {conflicts}")


def test_taint_removal_reports_removed(kube_cluster, unique):
    admin = kube_cluster.admin
    node = unique("node")
    before = new_tainted_node(admin, node, [OUR_TAINT,
                                            {"key": "other.example/a", "effect": "NoSchedule"}])
    taint = remove_taint(agent_client(kube_cluster.agent_kubeconfig), node)
    assert taint.state == "removed" and taint.attempts == 1
    assert taint_keys(admin, node) == [k for k in before if k != TAINT_KEY]


def test_a_taint_another_controller_puts_back_is_removed_again(kube_cluster, unique):
    """karpenter#1772, aws-ebs-csi-driver#2447: the node's registered taints re-applied
    after the agent removed its own.  The agent (its shipped role: it watches its Node by
    metadata.name) removes it again each time, keeping the other controller's taints."""
    admin = kube_cluster.admin
    node = unique("node")
    new_tainted_node(admin, node, [OUR_TAINT])

    async def put_back_twice(taint):
        for n in (1, 2):
            await asyncio.sleep(0.5)            # the node watch is established
            admin.call("PATCH", f"/api/v1/nodes/{node}", [
                {"op": "add", "path": "/spec/taints/-", "value": OUR_TAINT},
                {"op": "add", "path": "/spec/taints/-",
                 "value": {"key": f"other.example/re-{n}", "effect": "NoSchedule"}}],
                content_type="application/json-patch+json")
            deadline = time.monotonic() + 20
            while taint.state != f"removed (again {n} times)":
                assert time.monotonic() < deadline, taint.state
                await asyncio.sleep(0.05)

    taint = remove_taint(agent_client(kube_cluster.agent_kubeconfig), node, then=put_back_twice)
    keys = taint_keys(admin, node)
    assert TAINT_KEY not in keys and {"other.example/re-1", "other.example/re-2"} <= set(keys)
    assert taint.removals == 3


# ---- RBAC: the shipped role is sufficient (everything above) and minimal (below) -----------

def test_the_agent_runs_as_its_service_account_and_no_more(kube_cluster, unique):
    config = yaml.safe_load(kube_cluster.agent_kubeconfig.read_text())
    agent = kube_cluster.as_user(config["users"][0]["user"]["token"])
    review = agent.call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    assert review["status"]["userInfo"]["username"] == "system:serviceaccount:kube-system:kiamfast"
    ns = unique("ns")
    kube_cluster.admin.create_namespace(ns)
    assert agent.request("GET", "/api/v1/secrets")[0] == 403
    assert agent.request("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
        "spec": {"containers": [{"name": "c", "image": "i"}]}})[0] == 403
    assert agent.request("DELETE", "/api/v1/nodes/nonexistent")[0] == 403
    assert agent.request("GET", "/api/v1/pods?limit=1")[0] == 200


def watch_without(kube_cluster, table, unique, *, drop, policy=None):
    """Run the agent's watch under the shipped role less the (resource, verb) pairs in
    ``drop``; a pod starts and its namespace allows its role after the sync. Returns
    (synced, the pod reached the table, its role was allowed, the watcher's stats)."""
    admin = kube_cluster.admin
    name = "kiamfast-no-" + "-".join(f"{verb}-{res}" for res, verb in drop)
    kubeconfig = kube_cluster.identity_without(name, drop=drop)
    node, ns = unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_namespace(ns, annotations={NS_KEY: "[]"})

    async def body():
        async with AgentWatch(kubeconfig=kubeconfig, table=table, node=node, policy=policy,
                              sync_timeout=4.0, namespace_wait=1.0) as w:
            pod = running_pod(admin, ns, "p", node=node, ip="10.244.7.1", role="app")
            admin.annotate_namespace(ns, {NS_KEY: '["app"]'})
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and (w.at("10.244.7.1") or ("", -1))[:2] != (
                    pod, ROLE):
                await asyncio.sleep(0.05)
            seen = w.at("10.244.7.1")
            return (w.synced, seen is not None and seen[0] == pod,
                    seen is not None and seen[1] == ROLE, w.stats())
    return run(body())


@pytest.mark.parametrize("resource,verb,restricted", [
    ("pods", "list", False), ("pods", "watch", False),
    ("namespaces", "list", True), ("namespaces", "watch", True)])
def test_without_a_watch_verb_the_agent_stops_following_the_cluster(
        kube_cluster, table, unique, resource, verb, restricted):
    policy = {"namespace_restrictions": True} if restricted else None
    synced, pod_seen, allowed, stats = watch_without(
        kube_cluster, table, unique, drop=[(resource, verb)], policy=policy)
    assert stats["errors"] >= 1, stats            # 403s, logged and retried
    if verb == "list":
        assert not synced, "synced without being allowed to list"
        assert not table.synced                   # so never ready: workers answer 503
    else:
        assert synced
        # The initial list was applied, but nothing after it: the pod started after the
        # sync (pods) or the namespace's new permission (namespaces) never arrived.
        assert not (pod_seen and allowed), stats
    if resource == "pods" and verb == "watch":
        assert not pod_seen


def test_get_on_pods_and_namespaces_is_not_used(kube_cluster, table, unique):
    """The shipped role grants get on pods and namespaces (kube2iam's role did); the agent
    never asks for one object, so without it the watch works all the same."""
    synced, pod_seen, allowed, stats = watch_without(
        kube_cluster, table, unique, drop=[("pods", "get"), ("namespaces", "get")],
        policy={"namespace_restrictions": True})
    assert synced and pod_seen and allowed and stats["errors"] == 0, stats


@pytest.mark.parametrize("verb", ["get", "patch"])
def test_without_get_or_patch_on_nodes_the_taint_stays(kube_cluster, unique, verb):
    admin = kube_cluster.admin
    kubeconfig = kube_cluster.identity_without(f"kiamfast-no-{verb}-nodes",
                                               drop=[("nodes", verb)])
    node = unique("node")
    before = new_tainted_node(admin, node, [OUR_TAINT])
    taint = remove_taint(agent_client(kubeconfig), node, until_state="retrying")
    assert taint.state.startswith("retrying: HTTP 403"), taint.state
    assert "needs get, patch, list and watch on nodes" in taint.state
    assert taint_keys(admin, node) == before and TAINT_KEY in before


# ---- the emulator against the real server ------------------------------------------------------

@pytest.fixture(scope="module")
def emulator():
    with Emulator(token="t") as srv:
        yield srv


@pytest.mark.parametrize("spelling", ["True", "T", "yes", "", "FALSE", "0"])
def test_the_emulator_reads_watch_booleans_as_the_real_server_does(
        kube_cluster, emulator, spelling):
    """``watch=<spelling>``: a stream or a list? The real server's answer is the reference
    (only "0" and "false", in any case, are false); the emulator must give the same one."""
    def answer(status_and_body):
        # No pod matches: a watch sends nothing for its second and ends; a list is a PodList.
        status, body = status_and_body
        assert status == 200, body
        return "list" if b'"kind":"PodList"' in body else "watch"

    def emulated():
        r = urllib3.request("GET", emulator.url + path, headers={"Authorization": "Bearer t"},
                            timeout=5)
        return r.status, r.data

    path = f"/api/v1/pods?watch={spelling}&timeoutSeconds=1&fieldSelector=spec.nodeName%3Dnone"
    with ThreadPoolExecutor(2) as pool:   # both wait out the watch's second at once
        real = pool.submit(kube_cluster.admin.request, "GET", path, raw=True)
        emu = pool.submit(emulated)
        assert answer(emu.result()) == answer(real.result())
