"""What the node model reports besides its decisions: the texts workers serve and the series.

Read-only views of a :class:`~.model.NodeModel` after its last commit, for the control
process's publish loop (kiamfast/control/publish/blobs.py writes the texts into the table):
the namespace denials workers answer with kube2iam's text, kube2iam's ``/debug/store`` and
the model's counters (``kiamfast_watch_total``).  Nothing here changes the model.
"""
from __future__ import annotations

from typing import Any

from kiamfast.decisions import IdentityKind
from kiamfast.control.mappings.decider import PodRecord
from kiamfast.control.mappings.model import NodeModel
from kiamfast.table import POD_DENIED


def counters(model: NodeModel) -> dict[str, int]:
    return {**model.counts, "runtime_only_pods": model.sandbox_pods.created,
            **model.addresses.counters, "displaced": model.api.displaced}


def denials(model: NodeModel) -> dict[str, tuple[str, str]]:
    """pod uid -> (role ARN, namespace) of the pods the table denies by their namespace's
    rules: workers answer them with kube2iam's text."""
    out = {}
    for uid, state, _ in model.addresses.written.values():
        pod = _pod(model, uid) if state == POD_DENIED else None
        if (pod is not None and pod.identity is not None and pod.identity.role_arn
                and pod.identity.kind == IdentityKind.DENIED):
            out[uid] = (pod.identity.role_arn, pod.namespace)
    return out


def debug_store(model: NodeModel) -> dict[str, Any]:
    """kube2iam's /debug/store view: namespaceByIP, rolesByIP, rolesByNamespace."""
    ns_by_ip: dict[str, str] = {}
    roles_by_ip: dict[str, str] = {}
    for ip, (uid, _, _) in sorted(model.addresses.written.items()):
        pod = _pod(model, uid)
        if pod is None:
            continue
        ns_by_ip[ip] = pod.namespace
        roles_by_ip[ip] = pod.annotations.get(model.policy.role_key, "")
    return {"namespaceByIP": ns_by_ip, "rolesByIP": roles_by_ip,
            "rolesByNamespace": {n: list(r.allowed_globs)
                                 + [p.pattern for p in r.allowed_regexps]
                                 for n, r in sorted(model.namespaces.items())}}


def _pod(model: NodeModel, uid: str) -> PodRecord | None:
    return model.pods.get(uid) or model.sandbox_pods.get(uid)
