"""The test's hands for tests/podidentity: pods bound to a node, and their tokens."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import kube

AUDIENCE = "kiamfast.io/container-credentials"
BASE_ARN = "arn:aws:iam::123456789012:role/"


def create_pod(admin, ns: str, name: str, *, node: str, sa: str, ip: str,
               role: str | None = None, host_network: bool = False,
               env: dict[str, str] | None = None) -> str:
    """A pod of ServiceAccount ``sa`` bound to ``node``, Running at ``ip``, its container's
    ``env`` as given; its uid."""
    admin.call("POST", f"/api/v1/namespaces/{ns}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name,
                     "annotations": {"iam.amazonaws.com/role": role} if role else {}},
        "spec": {"nodeName": node, "serviceAccountName": sa, "hostNetwork": host_network,
                 "containers": [{"name": "app", "image": "app:test", "env": [
                     {"name": k, "value": v} for k, v in (env or {}).items()]}]}})
    admin.set_pod_running(ns, name, ip)
    return admin.get_pod(ns, name)["metadata"]["uid"]


def create_service_account(admin, ns: str, name: str) -> None:
    admin.call("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})


def pod_token(admin, ns: str, sa: str, pod: str, uid: str, *, audience: str = AUDIENCE,
              seconds: int = 600) -> str:
    """What the kubelet puts in a projected token volume: a token bound to the pod."""
    out = admin.call("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": [audience], "expirationSeconds": seconds,
                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod,
                                    "uid": uid}}})
    return out["status"]["token"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims_of(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def resigned(token: str, key_path: Path, **changes) -> str:
    """``token`` with some claims changed, signed with the key at ``key_path`` (ES256): the
    cluster's own service-account key makes a genuine token the API server would have
    issued (an expired one, a short-lived one), another key a forgery."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
    header = token.split(".")[0]
    body = {**claims_of(token), **changes}
    signing_input = f"{header}.{_b64(json.dumps(body).encode())}"
    key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing_input}.{_b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def other_key(directory: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    path = directory / "forger.key"
    path.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return path


def webhook_kubeconfig(cluster, name: str, *, rules: list[dict] | None) -> Path:
    """An identity for `kiamfast webhook --service-account-opt-in`: ServiceAccount
    kube-system/<name> bound to a ClusterRole with ``rules`` (None: bound to nothing)."""
    admin = cluster.admin
    token = kube.service_account_token(admin, namespace="kube-system", name=name)
    if rules is not None:
        kube.apply_rbac(admin, [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": name}, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": name,
                           "namespace": "kube-system"}]}])
        kube.wait_allowed(cluster.as_user(token), verb="get", resource="serviceaccounts")
    return cluster.kubeconfig_for(token, name=name)

