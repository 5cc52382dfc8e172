"""The pod watch against the API server emulator, with a real table file: the seed races."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest
from control_support import BASE, NS_KEY, ROLE_KEY, SlotSink, lookup

from kiamfast import table as tablemod
from kiamfast.control.cri.client import RuntimeView, Sandbox
from kiamfast.control.mappings.model import NodeModel
from kiamfast.control.k8s.source import ApiSource
from kiamfast.control.mappings.policy import RolePolicy
from kiamfast.testing.apiserver import ApiServer

NODE = "node-1"
ROLE, NO_ROLE, DENIED = tablemod.POD_ROLE, tablemod.POD_NO_ROLE, tablemod.POD_DENIED


@pytest.fixture
def cluster():
    srv = ApiServer(host="127.0.0.1", port=0, history_window=10_000, bookmark_interval=0.5,
                    token="test-token").start()
    srv.nodes.add(NODE)
    srv.nodes.add("node-2")
    yield srv
    srv.stop()


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Harness:
    """A model + watcher on a real table, talking to the emulator over HTTP."""

    def __init__(self, srv: ApiServer, table, *, node: str | None = NODE,
                 policy: dict | None = None, **watch_kw):
        self.srv = srv
        self.table = table
        self.sink = SlotSink()
        self.notifications = 0
        self.policy = RolePolicy(**{"base_role_arn": BASE, **(policy or {})})
        self.model = NodeModel(policy=self.policy, table=table, sink=self.sink,
                               notify=self._notify)
        watch_kw.setdefault("backoff", (0.02, 0.5))
        self.watcher = ApiSource.connect(api_server=srv.url, api_token=srv.token,
                                         model=self.model, node=node, **watch_kw)

    def _notify(self):
        self.notifications += 1

    async def __aenter__(self):
        self.task = asyncio.create_task(self.watcher.run())
        assert await self.watcher.wait_synced(10), "watcher did not sync"
        return self

    async def __aexit__(self, *exc):
        await self.watcher.stop()
        await asyncio.wait_for(self.task, 10)

    async def until(self, pred, timeout: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"timed out waiting for {what}")

    def at(self, ip):
        return lookup(self.table, ip)

    def slot(self, role, ext=None):
        return self.sink.slot_for(BASE + role, ext)


def uid_of(srv, ns, name):
    return srv.pods.get(ns, name)["metadata"]["uid"]


# ---- basics ----------------------------------------------------------------------------------

def test_sync_then_watch_keeps_the_table_current(cluster, table):
    cluster.pods.create("default", "before", node=NODE, ips=["10.1.0.1"], phase="Running",
                        annotations={ROLE_KEY: "app"})
    cluster.pods.create("default", "elsewhere", node="node-2", ips=["10.2.0.1"], phase="Running",
                        annotations={ROLE_KEY: "app"})

    async def body():
        async with Harness(cluster, table) as h:
            assert table.synced
            assert h.at("10.1.0.1") == (uid_of(cluster, "default", "before"), ROLE, h.slot("app"))
            assert h.at("10.2.0.1") is None          # another node's pod
            cluster.pods.create("default", "after", node=NODE, annotations={ROLE_KEY: "b"})
            await h.until(lambda: table.pending_pods == 1, what="pending pod")
            cluster.pods.set_ips("default", "after", ["10.1.0.2"])
            cluster.pods.set_phase("default", "after", "Running")
            await h.until(lambda: h.at("10.1.0.2") is not None, what="new pod's address")
            assert h.at("10.1.0.2")[:2] == (uid_of(cluster, "default", "after"), ROLE)
            assert table.pending_pods == 0
            cluster.pods.set_phase("default", "before", "Succeeded")
            await h.until(lambda: h.at("10.1.0.1") is None, what="terminal pod released")
            stats = h.watcher.stats()
            assert stats["lists"] >= 1 and stats["events"] >= 3
    run(body())


def test_without_node_all_pods_are_watched(cluster, table):
    cluster.pods.create("default", "elsewhere", node="node-2", ips=["10.2.0.1"], phase="Running")

    async def body():
        async with Harness(cluster, table, node=None) as h:
            assert h.at("10.2.0.1") == (uid_of(cluster, "default", "elsewhere"), NO_ROLE, -1)
    run(body())


# ---- the runtime's view beside the API's (real containerd: tests/cri, tests/e2e) -------------

def runtime_view(*sandboxes: tuple[str, str, str, str, dict]) -> RuntimeView:
    """A runtime poll showing READY sandboxes (uid, namespace, name, ip, annotations)."""
    sbs = tuple(Sandbox(id=f"sb-{uid}", pod_uid=uid, name=name, namespace=ns, ips=(ip,),
                        annotations=ann, created_ns=0) for uid, ns, name, ip, ann in sandboxes)
    return RuntimeView(started_ns=time.monotonic_ns(), sandboxes=sbs,
                       owners={sb.ips[0]: sb for sb in sbs}, conflicts=frozenset())


def test_runtime_knows_the_ip_first_and_the_pod_gets_its_own_role(cluster, table):
    """Seed race 1: the pod asks before its IP reaches the API server."""
    async def body():
        async with Harness(cluster, table, policy={"default_role": "fallback"}) as h:
            cluster.pods.create("default", "early", node=NODE, annotations={ROLE_KEY: "own"})
            uid = uid_of(cluster, "default", "early")
            await h.until(lambda: uid in h.model.pods, what="pod seen")
            h.model.apply_runtime(runtime_view((uid, "default", "early", "10.1.0.9",
                                                {ROLE_KEY: "own"})))
            h.model.commit()
            assert h.at("10.1.0.9") == (uid, ROLE, h.slot("own"))
            assert table.runtime_mode and table.verified_ns > 0
            # The API catches up: nothing changes.
            cluster.pods.set_ips("default", "early", ["10.1.0.9"])
            cluster.pods.set_phase("default", "early", "Running")
            await asyncio.sleep(0.2)
            assert h.at("10.1.0.9") == (uid, ROLE, h.slot("own"))
    run(body())


def test_runtime_wins_over_a_dead_pod_the_api_still_shows_running(cluster, table):
    """Seed race 2 with the API late: the new sandbox holds the address, not the old pod."""
    async def body():
        async with Harness(cluster, table) as h:
            cluster.pods.create("default", "old", node=NODE, ips=["10.1.0.5"], phase="Running",
                                annotations={ROLE_KEY: "old-role"})
            cluster.pods.create("default", "new", node=NODE, annotations={ROLE_KEY: "new-role"})
            old, new = uid_of(cluster, "default", "old"), uid_of(cluster, "default", "new")
            await h.until(lambda: h.at("10.1.0.5") is not None, what="old pod")
            h.model.apply_runtime(runtime_view((new, "default", "new", "10.1.0.5",
                                                {ROLE_KEY: "new-role"})))
            h.model.commit()
            assert h.at("10.1.0.5") == (new, ROLE, h.slot("new-role"))
            cluster.pods.set_phase("default", "old", "Running")   # a late event of the old pod
            await asyncio.sleep(0.2)
            assert h.at("10.1.0.5") == (new, ROLE, h.slot("new-role"))
            # Its sandbox stopped too: nobody owns the address, whatever the API says (its
            # claim makes requests wait: 503, never old's role).
            h.model.apply_runtime(runtime_view())
            h.model.commit()
            assert h.at("10.1.0.5") == (old, tablemod.POD_UNDECIDED, -1)
            assert old in h.model.pods
    run(body())


def test_runtime_outage_without_the_kernel_answers_nothing_until_the_runtime_is_back(cluster,
                                                                                     table):
    async def body():
        async with Harness(cluster, table) as h:
            cluster.pods.create("default", "p", node=NODE, ips=["10.1.0.6"], phase="Running",
                                annotations={ROLE_KEY: "r"})
            cluster.pods.create("default", "q", node=NODE, ips=["10.1.0.7"], phase="Running",
                                annotations={ROLE_KEY: "r"})
            uid_p, uid_q = uid_of(cluster, "default", "p"), uid_of(cluster, "default", "q")
            await h.until(lambda: h.at("10.1.0.7") is not None, what="pods")
            view = runtime_view((uid_q, "default", "q", "10.1.0.7", {}))   # not .6
            h.model.apply_runtime(view)
            h.model.commit()
            assert h.at("10.1.0.7") == (uid_q, ROLE, h.slot("r"))
            assert h.at("10.1.0.6") == (uid_p, tablemod.POD_UNDECIDED, -1)   # the API's claim
            h.model.runtime_failed(time.monotonic_ns())
            h.model.commit()
            # workers answer after this failed attempt: without the kernel's proof
            # (--address-proof=runtime) a stale view proves nothing, so nothing is answered
            assert table.runtime_mode and table.failed_ns > 0
            assert h.at("10.1.0.7") == (uid_q, tablemod.POD_UNDECIDED, -1)
            assert h.at("10.1.0.6") == (uid_p, tablemod.POD_UNDECIDED, -1)
            h.model.apply_runtime(dataclasses.replace(view, started_ns=time.monotonic_ns()))
            h.model.commit()
            assert h.at("10.1.0.7") == (uid_q, ROLE, h.slot("r"))
    run(body())


# ---- seed race 2: IP reuse, the old pod's delete after the new pod's add -------------------------

def test_ip_reuse_late_delete_of_old_pod_changes_nothing(cluster, table):
    async def body():
        async with Harness(cluster, table) as h:
            cluster.pods.create("default", "old", node=NODE, ips=["10.1.0.7"], phase="Running",
                                annotations={ROLE_KEY: "old-role"})
            await h.until(lambda: h.at("10.1.0.7") is not None, what="old pod")
            cluster.pods.mark_terminating("default", "old")
            cluster.pods.create("default", "new", node=NODE, ips=["10.1.0.7"], phase="Running",
                                annotations={ROLE_KEY: "new-role"})
            new_uid = uid_of(cluster, "default", "new")
            await h.until(lambda: (h.at("10.1.0.7") or ("",))[0] == new_uid, what="new owner")
            seen = []
            cluster.pods.set_annotations("default", "old", {ROLE_KEY: "old-role", "x": "1"})
            cluster.pods.delete("default", "old")
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                seen.append(h.at("10.1.0.7"))
                await asyncio.sleep(0.002)
            assert set(seen) == {(new_uid, ROLE, h.slot("new-role"))}
    run(body())


# ---- seed race 3: drops and 410s mid-churn ----------------------------------------------------------

class Sampler(threading.Thread):
    """Reads the table from another thread (as a worker would) as fast as it can."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.reader = tablemod.Table.attach(path, writer=False)
        self.stop_flag = threading.Event()
        self.observed: list[dict[str, str]] = []

    def run(self):
        while not self.stop_flag.is_set():
            self.observed.append({e["ip"]: e["pod_uid"] for e in self.reader.snapshot()})
            time.sleep(0.0005)


def test_churn_with_drops_and_410_converges_without_a_wrong_owner(cluster, table, table_path):
    rng = random.Random(7)
    pool = [f"10.1.1.{i}" for i in range(1, 13)]

    async def body():
        async with Harness(cluster, table) as h:
            sampler = Sampler(table_path)
            sampler.start()
            owners: dict[str, list[str]] = {ip: [] for ip in pool}   # assignment order per IP
            live: dict[str, str] = {}      # name -> ip
            free = list(pool)
            n = 0
            for step in range(300):
                r = rng.random()
                if free and (r < 0.45 or not live):
                    n += 1
                    name = f"p{n}"
                    ip = free.pop(rng.randrange(len(free)))
                    cluster.pods.create("default", name, node=NODE, phase="Running", ips=[ip],
                                        annotations={ROLE_KEY: rng.choice(["a", "b"])})
                    owners[ip].append(uid_of(cluster, "default", name))
                    live[name] = ip
                elif live:
                    name = rng.choice(sorted(live))
                    ip = live.pop(name)
                    how = rng.random()
                    if how < 0.4:
                        cluster.pods.set_phase("default", name, "Succeeded")
                    elif how < 0.7:
                        cluster.pods.mark_terminating("default", name)
                        cluster.pods.delete("default", name)
                    else:
                        cluster.pods.delete("default", name)
                    free.append(ip)
                if step % 60 == 30:
                    cluster.faults.drop_watches()
                if step % 60 == 50:
                    cluster.faults.compact()
                    cluster.faults.drop_watches()
                if step % 10 == 0:
                    await asyncio.sleep(0.01)
            expected = {}
            for name, ip in live.items():
                expected[ip] = uid_of(cluster, "default", name)
            await h.until(lambda: {e["ip"]: e["pod_uid"] for e in table.snapshot()} == expected,
                          timeout=15, what="convergence")
            sampler.stop_flag.set()
            sampler.join()
            assert h.watcher.stats()["gone"] + h.watcher.stats()["relists"] >= 1
        # Every observed mapping was a real assignment, and per address owners only ever move
        # forward in assignment order (an old pod never takes an address back).
        rank = {(ip, uid): i for ip, uids in owners.items() for i, uid in enumerate(uids)}
        last: dict[str, int] = {}
        for snap in sampler.observed:
            for ip, uid in snap.items():
                assert (ip, uid) in rank, f"{ip} -> {uid} was never an assignment"
                assert rank[(ip, uid)] >= last.get(ip, -1), f"{ip} went back to {uid}"
                last[ip] = rank[(ip, uid)]
        assert len(sampler.observed) > 100
    run(body(), timeout=120)


def test_watch_survives_api_errors(cluster, table):
    async def body():
        async with Harness(cluster, table) as h:
            cluster.faults.fail_next(4, status=500, path_prefix="/api/v1/pods")
            cluster.faults.fail_next(2, status=429, path_prefix="/api/v1/pods")
            cluster.faults.drop_watches()
            cluster.pods.create("default", "x", node=NODE, ips=["10.1.0.5"], phase="Running")
            await h.until(lambda: h.at("10.1.0.5") is not None, timeout=20, what="recovery")
            assert h.watcher.stats()["errors"] >= 1
    run(body())


def test_relist_after_410_while_disconnected(cluster, table):
    async def body():
        async with Harness(cluster, table) as h:
            cluster.pods.create("default", "a", node=NODE, ips=["10.1.0.1"], phase="Running")
            await h.until(lambda: h.at("10.1.0.1") is not None, what="a")
            cluster.faults.fail_next(3, status=503, path_prefix="/api/v1/pods")
            cluster.faults.drop_watches()
            cluster.pods.delete("default", "a")
            cluster.pods.create("default", "b", node=NODE, ips=["10.1.0.1"], phase="Running")
            cluster.faults.compact()
            b = uid_of(cluster, "default", "b")
            await h.until(lambda: (h.at("10.1.0.1") or ("",))[0] == b, timeout=20, what="relist")
            assert h.watcher.stats()["gone"] >= 1
    run(body())


# ---- seed race 4: namespace restrictions -----------------------------------------------------------

def test_namespace_restriction_changes_apply(cluster, table):
    cluster.namespaces.add("team", annotations={NS_KEY: "[]"})
    cluster.pods.create("team", "app", node=NODE, ips=["10.1.0.4"], phase="Running",
                        annotations={ROLE_KEY: "app"})

    async def body():
        async with Harness(cluster, table, policy={"namespace_restrictions": True}) as h:
            uid = uid_of(cluster, "team", "app")
            assert h.at("10.1.0.4") == (uid, DENIED, -1)
            cluster.namespaces.set_annotations("team", {NS_KEY: '["app"]'})
            await h.until(lambda: h.at("10.1.0.4")[1] == ROLE, what="allowed")
            assert h.at("10.1.0.4") == (uid, ROLE, h.slot("app"))
            cluster.namespaces.set_annotations("team", {NS_KEY: '["other-*"]'})
            await h.until(lambda: h.at("10.1.0.4")[1] == DENIED, what="denied again")
            # A pod in a namespace created after the agent synced.
            cluster.namespaces.add("late", annotations={NS_KEY: '["app"]'})
            cluster.pods.create("late", "p", node=NODE, ips=["10.1.0.8"], phase="Running",
                                annotations={ROLE_KEY: "app"})
            await h.until(lambda: h.at("10.1.0.8") is not None, what="late namespace pod")
            assert h.at("10.1.0.8")[1] == ROLE
    run(body())


def test_stop_is_prompt_with_idle_watches(cluster, table):
    async def body():
        h = Harness(cluster, table)
        await h.__aenter__()
        t0 = time.monotonic()
        await h.__aexit__(None, None, None)
        return time.monotonic() - t0
    assert run(body()) < 10
