"""Credential keys and session names: which pods share one STS session, and what it is called.

Credentials are shared by every pod whose AssumeRole call would be the same:
``(role ARN, external ID, session-name policy value, session tags)``. Never the role alone:
kube2iam keyed by role only and handed one pod's external-ID session to another (#98).

Session-name policies (``--session-name-policy``):

* ``node-role`` (default): ``<node>-<role name>``; one session per role and node, pods are
  traced to access keys through the audit log (``kiamfast.audit``, one line per issued
  credential and per pod that joins one).
* ``pod``: ``<namespace>.<pod>``; one session per pod, CloudTrail names the pod, more calls.
* ``kube2iam``: ``<fnv32a hex of the pod IP>-<role name>``, kube2iam's format, one session
  per role as kube2iam (but keyed with the external ID too). Compromise: kube2iam named the
  session after whichever pod asked first, at request time; kiamfast fetches before a pod
  asks and often before it has an IP, so the name uses the address of the first user that
  has one and otherwise fnv32a of that pod's UID.  The address is what the pod's decision
  says at fetch time; it is no part of the key.

Optional session tags (``--session-tags``: names of the chosen set, or all) are sent for
ABAC and become part of the key, so tagging per pod means one session per pod.  Two sets
(``--session-tag-keys``): ``kiamfast`` (``kiamfast-namespace``, ``kiamfast-pod``,
``kiamfast-serviceaccount``, ``kiamfast-node``, ``kiamfast-cluster``) and ``eks``, EKS Pod
Identity's keys (``eks-cluster-name``, ``kubernetes-namespace``,
``kubernetes-service-account``, ``kubernetes-pod-name``, ``kubernetes-pod-uid``), transitive
as EKS sends them, so policies written for ``aws:PrincipalTag/kubernetes-namespace`` work
unchanged; the cluster tag only when a cluster name is set.  With ``eks`` every pod has its
own session, named as EKS names it: ``eks-<cluster>-<pod>-<uid prefix>``.  A tag value STS
cannot take (length, characters) is never altered or left out, since a policy condition may
rely on it: that pod's key is denied (``InvalidSessionTag``) without an STS call.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kiamfast.config import tag_value_problem
from kiamfast import credential_parts
from kiamfast.control.iam.sts import sanitize_session_name

SESSION_POLICIES = ("node-role", "pod", "kube2iam")
TAG_NAMESPACE = "kiamfast-namespace"
TAG_POD = "kiamfast-pod"
TAG_SERVICE_ACCOUNT = "kiamfast-serviceaccount"
TAG_NODE = "kiamfast-node"
TAG_CLUSTER = "kiamfast-cluster"
SESSION_TAGS = (TAG_NAMESPACE, TAG_POD, TAG_SERVICE_ACCOUNT, TAG_NODE)
# EKS Pod Identity's keys (its user guide, "List of session tags added by EKS Pod
# Identity"); eks-cluster-arn is not sent: outside EKS there is no such cluster to name.
EKS_CLUSTER = "eks-cluster-name"
EKS_TAGS = ("kubernetes-namespace", "kubernetes-service-account", "kubernetes-pod-name",
            "kubernetes-pod-uid")
TAG_KEYS = ("kiamfast", "eks")
TAGSESSION_HINT = ("session tags are sent: the role's trust policy must allow "
                   "sts:TagSession as well as sts:AssumeRole")


@dataclass(frozen=True)
class CredentialRequest:
    """What the credential manager reads of a pod (a `kiamfast.decisions.PodDecision` has the
    same attributes, and is what the node model hands it; tools and tests build these)."""
    role_arn: str
    external_id: str | None = None
    namespace: str = ""
    pod_name: str = ""
    service_account: str = ""
    pod_ip: str | None = None


@dataclass(frozen=True)
class CredentialKey:
    """Everything that makes two AssumeRole calls different. Equal keys share a slot."""
    role_arn: str
    external_id: str | None
    session: str                          # the session-name policy value
    tags: tuple[tuple[str, str], ...] = ()


def fnv32a(data: str | bytes) -> int:
    """32-bit FNV-1a (Go's hash/fnv New32a), used by kube2iam for session names."""
    h = 0x811C9DC5
    for b in data.encode() if isinstance(data, str) else data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def tag_problem(tags: Iterable[tuple[str, str]]) -> str:
    """Why STS would refuse these session tags, or "" when it takes them all."""
    for key, value in tags:
        problem = tag_value_problem(value)
        if problem:
            return f"session tag {key}={value[:64]!r}: {problem}"
    return ""


class SessionNaming:
    """The key and the RoleSessionName of a pod's request under the node's policies."""

    def __init__(self, *, node_name: str = "", session_policy: str = "node-role",
                 session_tags: bool | Iterable[str] = (), tag_keys: str = "kiamfast",
                 cluster_name: str = "") -> None:
        if session_policy not in SESSION_POLICIES:
            raise ValueError(f"session_policy must be one of {SESSION_POLICIES}")
        if tag_keys not in TAG_KEYS:
            raise ValueError(f"tag_keys must be one of {TAG_KEYS}")
        known = ((EKS_CLUSTER, *EKS_TAGS) if tag_keys == "eks"
                 else (*SESSION_TAGS, TAG_CLUSTER))
        if session_tags is True:       # all of them; the cluster's only when it has a name
            tags: tuple[str, ...] = tuple(
                t for t in known if cluster_name or t not in (EKS_CLUSTER, TAG_CLUSTER))
        elif session_tags is False or session_tags is None:
            tags = ()
        else:
            tags = tuple(session_tags)
            unknown = set(tags) - set(known)
            if unknown:
                raise ValueError(f"unknown session tags {sorted(unknown)}; one of {known}")
        self.node_name = node_name
        self.policy = session_policy
        self.tags = tags
        self.eks = tag_keys == "eks"     # EKS's session names, transitive tags
        self.cluster_name = cluster_name

    def key_for(self, req: CredentialRequest, pod_uid: str = "") -> CredentialKey:
        """The credential key of a request under this node's policies."""
        if self.eks:
            session = f"{req.pod_name}/{pod_uid}"      # one session per pod, as EKS
        elif self.policy == "node-role":
            session = self.node_name
        elif self.policy == "pod":
            session = f"{req.namespace}/{req.pod_name}"
        else:
            session = "kube2iam"
        values = {TAG_NAMESPACE: req.namespace, TAG_POD: req.pod_name,
                  TAG_SERVICE_ACCOUNT: req.service_account, TAG_NODE: self.node_name,
                  TAG_CLUSTER: self.cluster_name, EKS_CLUSTER: self.cluster_name,
                  "kubernetes-namespace": req.namespace,
                  "kubernetes-service-account": req.service_account,
                  "kubernetes-pod-name": req.pod_name, "kubernetes-pod-uid": pod_uid}
        tags = sorted((tag, values[tag]) for tag in self.tags)
        return CredentialKey(req.role_arn, req.external_id or None, session, tuple(tags))

    def session_name(self, key: CredentialKey,
                     users: Iterable[tuple[str, CredentialRequest]] = ()) -> str:
        """The RoleSessionName for a key (kube2iam's policy also looks at the users)."""
        role = credential_parts.role_name(key.role_arn)
        if self.eks:
            # EKS: eks-<cluster>-<pod>-<random>; the UID's first 8 hex digits instead, so
            # the name tells two pods of one name apart and stays the same across refreshes.
            pod, _, uid = key.session.partition("/")
            suffix = "-" + uid.replace("-", "")[:8] if uid else ""
            head = "-".join(p for p in ("eks", self.cluster_name, pod) if p)
            name = head[:64 - len(suffix)] + suffix     # sanitising keeps the length
        elif self.policy == "node-role":
            name = f"{self.node_name or 'kiamfast'}-{role}"
        elif self.policy == "pod":
            namespace, _, pod = key.session.partition("/")
            name = f"{namespace}.{pod}"
        else:
            users = list(users)
            ips = [req.pod_ip for _, req in users if req.pod_ip]
            basis = ips[0] if ips else (users[0][0] if users else key.role_arn)
            name = f"{fnv32a(basis):x}-{role}"
        return sanitize_session_name(name)
