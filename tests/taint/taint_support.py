"""What the taint tests share: the taint keys, kiamfast's own API client configured from the
emulator's kubeconfig (as the agent is), and a way to run the taint's removal until a state."""

from __future__ import annotations

import asyncio

from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config

KEY = "kiamfast.io/agent-not-ready"
OTHER = {"key": "node.cilium.io/agent-not-ready", "value": "true", "effect": "NoSchedule"}


def api_client(srv, tmp_path, cls=Client) -> Client:
    path = srv.write_kubeconfig(tmp_path / "kubeconfig")
    return cls(load_config(kubeconfig=str(path)))


def taints(srv, node: str) -> list[dict]:
    return srv.nodes.get(node).get("spec", {}).get("taints") or []


async def until(condition, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)
