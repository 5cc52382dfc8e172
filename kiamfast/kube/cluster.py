"""Whether the agent's flags and environment name a way to the API server at all: the first
of ``load_config``'s checks (kiamfast/kube/config.py), on its own so that the supervisor can
make it before it binds a port or starts a process, without loading a client (no TLS, no
YAML: nothing the supervisor keeps in memory afterwards)."""
from __future__ import annotations

from collections.abc import Mapping

NO_CLUSTER = ("no cluster configured: give --kubeconfig, or --api-server with --api-token, "
              "or run in a pod with a ServiceAccount token")


def missing_cluster(*, kubeconfig: str, api_server: str, api_token: str,
                    environ: Mapping[str, str]) -> str:
    """"" when a cluster is configured (kube2iam's precedence: --kubeconfig, then
    --api-server with --api-token, then in-cluster), else the one line saying what to give."""
    if kubeconfig or (api_server and api_token):
        return ""
    if environ.get("KUBERNETES_SERVICE_HOST", "") and environ.get("KUBERNETES_SERVICE_PORT", ""):
        return ""
    if api_server:
        return NO_CLUSTER + " (--api-server is used only together with --api-token)"
    if api_token:
        return NO_CLUSTER + " (--api-token is used only together with --api-server)"
    return NO_CLUSTER
