"""Object shapes, field selectors, patches and Status bodies of the API server emulator.

The emulator (``kiamfast.testing.apiserver``) must be indistinguishable from a real
Kubernetes API server for the parts kiamfast uses, down to the JSON the real ``kubernetes``
client deserializes into its pydantic models. This module holds the pure, state-free parts
of that: how a Pod, Node and Namespace look on the wire, and how a ``fieldSelector`` is parsed
and evaluated (including the ``400`` the real server answers for an unknown field label),
and how a ``Status`` error body reads. PATCH bodies are applied by ``apiserver_patch``.

It must never hold state or locks: the store (``apiserver_store``) and the HTTP layer
(``apiserver``) call these functions while holding their own locks.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import orjson

__all__ = [
    "ApiError",
    "FieldSelector",
    "KINDS",
    "make_namespace",
    "make_node",
    "make_pod",
    "now_rfc3339",
    "status_body",
]

# kind -> (plural, list kind, namespaced)
KINDS: dict[str, tuple[str, str, bool]] = {
    "Pod": ("pods", "PodList", True),
    "Node": ("nodes", "NodeList", False),
    "Namespace": ("namespaces", "NamespaceList", False),
}
PLURAL_TO_KIND = {plural: kind for kind, (plural, _l, _n) in KINDS.items()}

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """A request the emulator answers with a Kubernetes ``Status`` failure."""

    def __init__(self, code: int, message: str, *, reason: str | None = None,
                 details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "InternalError")
        self.details = details

    def body(self) -> bytes:
        return status_body(self.code, self.message, reason=self.reason, details=self.details)


def status_body(code: int, message: str, *, reason: str | None = None,
                details: dict | None = None) -> bytes:
    """The ``Status`` object the real API server sends with every failure."""
    doc: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "InternalError"),
    }
    if details:
        doc["details"] = details
    doc["code"] = code
    return orjson.dumps(doc)


def now_rfc3339(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))


# ---------------------------------------------------------------------------- objects

def make_namespace(name: str, *, uid: str, annotations: dict | None) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "uid": uid,
        "resourceVersion": "0",
        "creationTimestamp": now_rfc3339(),
        "labels": {"kubernetes.io/metadata.name": name},
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "kind": "Namespace",
        "apiVersion": "v1",
        "metadata": meta,
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }


def make_node(name: str, *, uid: str, taints: list | None, address: str) -> dict:
    ts = now_rfc3339()
    spec: dict[str, Any] = {}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": uid,
            "resourceVersion": "0",
            "creationTimestamp": ts,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
        "spec": spec,
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": address},
                {"type": "Hostname", "address": name},
            ],
            "conditions": [{
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": ts,
                "lastTransitionTime": ts,
            }],
        },
    }


def node_address(node: dict | None) -> str | None:
    if not node:
        return None
    for addr in node.get("status", {}).get("addresses", ()):
        if addr.get("type") == "InternalIP":
            return addr.get("address")
    return None


def make_pod(namespace: str, name: str, *, uid: str, node: str, annotations: dict | None,
             ips: list[str] | None, phase: str, host_network: bool,
             host_ip: str | None) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid,
        "resourceVersion": "0",
        "creationTimestamp": now_rfc3339(),
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    spec: dict[str, Any] = {
        "containers": [{
            "name": "app",
            "image": "registry.k8s.io/pause:3.10",
            "resources": {},
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File",
            "imagePullPolicy": "IfNotPresent",
        }],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "serviceAccount": "default",
        "nodeName": node,
        "schedulerName": "default-scheduler",
        "priority": 0,
        "enableServiceLinks": True,
    }
    if host_network:
        spec["hostNetwork"] = True
    status: dict[str, Any] = {"phase": phase, "qosClass": "BestEffort"}
    if host_ip:
        status["hostIP"] = host_ip
        status["hostIPs"] = [{"ip": host_ip}]
        status["startTime"] = meta["creationTimestamp"]
    set_status_ips(status, ips)
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": status}


def set_status_ips(status: dict, ips: list[str] | None) -> None:
    """``status.podIP`` is the first of ``status.podIPs``; both absent when no IP yet."""
    if ips:
        status["podIP"] = ips[0]
        status["podIPs"] = [{"ip": ip} for ip in ips]
    else:
        status.pop("podIP", None)
        status.pop("podIPs", None)


def drop_empty(obj: dict) -> dict:
    """Drop the empty ``omitempty`` fields a patch can leave (the real server never sends
    ``"taints": []`` or ``"annotations": {}``)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        for field in ("annotations", "labels", "finalizers", "ownerReferences"):
            if field in meta and not meta[field]:
                del meta[field]
    spec = obj.get("spec")
    if isinstance(spec, dict) and "taints" in spec and not spec["taints"]:
        del spec["taints"]
    return obj


def set_annotations(meta: dict, annotations: dict | None) -> None:
    if annotations:
        meta["annotations"] = dict(annotations)
    else:
        meta.pop("annotations", None)


# ---------------------------------------------------------------------------- field selectors

def _bool_str(v: Any) -> str:
    return "true" if v else "false"


_FIELDS: dict[str, dict[str, Callable[[dict], str]]] = {
    "Pod": {
        "metadata.name": lambda o: o["metadata"].get("name", ""),
        "metadata.namespace": lambda o: o["metadata"].get("namespace", ""),
        "spec.nodeName": lambda o: o.get("spec", {}).get("nodeName", ""),
        "spec.restartPolicy": lambda o: o.get("spec", {}).get("restartPolicy", ""),
        "spec.schedulerName": lambda o: o.get("spec", {}).get("schedulerName", ""),
        "spec.serviceAccountName": lambda o: o.get("spec", {}).get("serviceAccountName", ""),
        "spec.hostNetwork": lambda o: _bool_str(o.get("spec", {}).get("hostNetwork")),
        "status.phase": lambda o: o.get("status", {}).get("phase", ""),
        "status.podIP": lambda o: o.get("status", {}).get("podIP", ""),
        "status.nominatedNodeName": lambda o: o.get("status", {}).get("nominatedNodeName", ""),
    },
    "Node": {
        "metadata.name": lambda o: o["metadata"].get("name", ""),
        "spec.unschedulable": lambda o: _bool_str(o.get("spec", {}).get("unschedulable")),
    },
    "Namespace": {
        "metadata.name": lambda o: o["metadata"].get("name", ""),
        "status.phase": lambda o: o.get("status", {}).get("phase", ""),
    },
}


def _split_unescaped(s: str, sep: str) -> list[str]:
    parts, cur, i = [], [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            cur.append(s[i:i + 2])
            i += 2
            continue
        if c == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _unescape(s: str) -> str:
    return s.replace("\\,", ",").replace("\\=", "=").replace("\\\\", "\\")


class FieldSelector:
    """A parsed ``fieldSelector`` (plus the namespace implied by a namespaced URL).

    ``node`` is set when the selector pins ``spec.nodeName`` by equality: the store uses it
    to index pods and watchers by node, the way the real watch cache indexes by node name.
    """

    __slots__ = ("terms", "node", "text")

    def __init__(self, kind: str, text: str | None, *, namespace: str | None = None) -> None:
        fields = _FIELDS[kind]
        self.terms: list[tuple[Callable[[dict], str], bool, str]] = []
        self.node: str | None = None
        self.text = text or ""
        if namespace is not None:
            self.terms.append((fields.get("metadata.namespace") or _FIELDS["Pod"]["metadata.namespace"],
                               True, namespace))
        if not text:
            return
        for term in _split_unescaped(text, ","):
            if not term:
                continue
            for op in ("!=", "==", "="):
                idx = term.find(op)
                if idx >= 0:
                    break
            else:
                raise ApiError(400, f'invalid selector: "{text}"; can\'t understand "{term}"')
            key, value = term[:idx].strip(), _unescape(term[idx + len(op):].strip())
            getter = fields.get(key)
            if getter is None:
                raise ApiError(400, f'"{key}" is not a known field selector: only '
                                    f'"{", ".join(sorted(fields))}"')
            eq = op != "!="
            self.terms.append((getter, eq, value))
            if eq and key == "spec.nodeName":
                self.node = value

    def __bool__(self) -> bool:
        return bool(self.terms)

    def matches(self, obj: dict) -> bool:
        for getter, eq, value in self.terms:
            if (getter(obj) == value) != eq:
                return False
        return True
