"""--sts-account-qps without --sts-fleet-nodes: the node's share of the fleet's STS budget
follows the cluster's node count, listed from the API (the emulator, over HTTP, through the
agent's own client)."""
from __future__ import annotations

import asyncio

import pytest

from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.k8s.node import count_nodes, follow_node_count
from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config
from kiamfast.testing.apiserver import ApiServer


class _NoTable:
    def write_cred(self, *a, **kw): raise AssertionError("no key is acquired here")
    set_cred_state = clear_cred = write_cred


async def _until(condition, timeout: float = 20.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout)


def test_the_share_follows_nodes_joining(tmp_path):
    with ApiServer(token=None) as srv:
        for i in range(3):
            srv.nodes.add(f"node-{i}")
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")

        async def main():
            api = Client(load_config(kubeconfig=str(kubeconfig)))
            assert await count_nodes(api) == 3
            mgr = CredentialManager(table=_NoTable(), sts=None, capacity=4, qps=5.0,
                                    account_qps=6.0, fleet_nodes=0)
            seen = [mgr.bucket.min_rate]             # no count yet: the floor without one
            follower = asyncio.create_task(follow_node_count(api, mgr, interval=0.05))
            try:
                await _until(lambda: mgr.bucket.min_rate == pytest.approx(2.0))
                seen.append(mgr.bucket.min_rate)
                for i in range(3, 12):               # nine more join
                    srv.nodes.add(f"node-{i}")
                await _until(lambda: mgr.bucket.min_rate == pytest.approx(0.5))
                seen.append(mgr.bucket.min_rate)
            finally:
                follower.cancel()
            return seen

        assert asyncio.run(main()) == [5.0 / 16, pytest.approx(2.0), pytest.approx(0.5)]


def test_a_count_the_api_cannot_give_changes_nothing(tmp_path):
    """The API failing keeps the share it had (the follower never ends)."""
    with ApiServer(token=None) as srv:
        srv.nodes.add("node-0")
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")

        async def main():
            api = Client(load_config(kubeconfig=str(kubeconfig)))
            mgr = CredentialManager(table=_NoTable(), sts=None, capacity=4, qps=5.0,
                                    account_qps=2.0, fleet_nodes=0)
            follower = asyncio.create_task(follow_node_count(api, mgr, interval=0.05))
            try:
                await _until(lambda: mgr.bucket.min_rate == pytest.approx(2.0))
                srv.faults.fail_next(1000, status=500, path_prefix="/api/v1/nodes")
                srv.nodes.add("node-1")
                await _until(lambda: srv.traffic.stats()["faults_injected"] >= 3)  # three lists
                return mgr.bucket.min_rate, follower.done()
            finally:
                follower.cancel()

        assert asyncio.run(main()) == (pytest.approx(2.0), False)
