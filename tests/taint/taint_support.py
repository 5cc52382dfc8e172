"""What the taint tests share: the taint keys and the kubernetes client the agent uses,
configured from the emulator's kubeconfig."""

from __future__ import annotations

from kubernetes import client, config

KEY = "kiamfast.io/agent-not-ready"
OTHER = {"key": "node.cilium.io/agent-not-ready", "value": "true", "effect": "NoSchedule"}


def core_api(srv, tmp_path, cls=client.CoreV1Api):
    path = srv.write_kubeconfig(tmp_path / "kubeconfig")
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    return cls(client.ApiClient(configuration))


def taints(srv, node: str) -> list[dict]:
    return srv.get_node(node).get("spec", {}).get("taints") or []
