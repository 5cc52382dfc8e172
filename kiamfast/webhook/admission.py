"""The AdmissionReview answer: always allowed, patched only for a pod creation that opts in.

The webhook only ever allows: every pod is admitted, a pod it does not understand without a
patch (it then gets IMDS by address, kube2iam's contract).  The pod's ServiceAccount is read
(`accounts.py`) only when the pod's own annotations do not decide its opt-in; a read that
fails admits the pod as if its account had no annotations.
"""
from __future__ import annotations

import base64
import json
import logging
from typing import Any

from kiamfast.webhook import limits
from kiamfast.webhook.accounts import AccountAnnotations
from kiamfast.webhook.patch import (
    FULL_URI,
    MalformedReview,
    decided_by_pod,
    effective_role,
    pod_name,
    pod_patch,
)

log = logging.getLogger("kiamfast.webhook")


def _answer(uid: str, ops: list[dict]) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response}


def containers_to_patch(review: Any, *, role_key: str,
                        accounts: AccountAnnotations | None = None, **_: Any) -> int:
    """How many containers the answer to a parsed ``review`` may patch: every container and
    init container of a pod creation that may opt in (its own annotations, or its account's
    when they are read); 0 for anything else (a review it cannot read is answered
    unpatched)."""
    try:
        request = review["request"]
        kind = request.get("kind") or {}
        if request.get("operation") != "CREATE" or kind.get("kind") != "Pod" \
                or request.get("subResource"):
            return 0
        pod = request["object"]
        if (accounts is None or decided_by_pod(pod, role_key=role_key)) \
                and effective_role(pod, role_key=role_key) is None:
            return 0
        spec = pod.get("spec") or {}
        return sum(len(spec[k]) for k in ("initContainers", "containers")
                   if isinstance(spec.get(k), list))
    except (AttributeError, KeyError, TypeError, MalformedReview):
        return 0


def answer_cost(review: Any, *, full_uri: str = FULL_URI, **settings: Any) -> tuple[int, int]:
    """(containers it may patch, an upper bound of the bytes building its answer takes)."""
    containers = containers_to_patch(review, **settings)
    return containers, limits.answer_cost(containers, full_uri)


def unpatched(review: Any, warning: str) -> dict[str, Any]:
    """The answer admitting the pod of ``review`` unchanged, ``warning`` saying why (the API
    server hands it to the client: kubectl prints it)."""
    request = review.get("request") if isinstance(review, dict) else None
    uid = request.get("uid") if isinstance(request, dict) else None
    out = _answer(uid if isinstance(uid, str) else "", [])
    out["response"]["warnings"] = [warning]
    return out


def _account(request: dict[str, Any], pod: dict[str, Any], role_key: str,
             accounts: AccountAnnotations | None) -> dict[str, str] | None:
    """The annotations of the pod's ServiceAccount when they may decide its opt-in; None
    when not needed, not enabled or not readable.  The namespace is the request's: a pod's
    own metadata.namespace may be empty at creation."""
    name = (pod.get("spec") or {}).get("serviceAccountName")
    namespace = request.get("namespace")
    if accounts is None or decided_by_pod(pod, role_key=role_key) \
            or not isinstance(name, str) or not name or not isinstance(namespace, str) \
            or not namespace:
        return None
    return accounts.get(namespace, name)


def review_answer(body: bytes, *, accounts: AccountAnnotations | None = None,
                  **settings: Any) -> dict[str, Any]:
    """The AdmissionReview answer to the request ``body``: always allowed; patched only for
    a pod creation that opts in (``accounts``: where its ServiceAccount's annotations are
    read, None to read none); a review it cannot read is logged and left unpatched."""
    return answer(parse(body), accounts=accounts, **settings)


def parse(body: bytes) -> Any:
    """The body's JSON, or the `MalformedReview` saying why it is none (`answer` admits it
    unchanged).  The caller bounds its memory (`limits.parse_cost`)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        return MalformedReview(f"not JSON: {str(e)[:200]}")


def answer(review: Any, *, accounts: AccountAnnotations | None = None,
           **settings: Any) -> dict[str, Any]:
    """The answer to a parsed review (`parse`), as `review_answer`."""
    uid = ""
    try:
        if isinstance(review, MalformedReview):
            raise review
        request = review.get("request") if isinstance(review, dict) else None
        if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
            raise MalformedReview("no request.uid")
        uid = request["uid"]
        kind = request.get("kind") or {}
        if request.get("operation") != "CREATE" or not isinstance(kind, dict) \
                or kind.get("kind") != "Pod" or request.get("subResource"):
            return _answer(uid, [])
        pod = request.get("object")
        if not isinstance(pod, dict):
            raise MalformedReview("no request.object")
        account = _account(request, pod, settings["role_key"], accounts)
        ops = pod_patch(pod, account=account, **settings)
    except Exception as e:   # whatever the shape: admit unchanged, never fail the pod
        log.warning("admission review %r not understood, pod admitted unchanged: %s", uid, e)
        return _answer(uid, [])
    if ops:
        log.info("pod %s/%s: container-credentials variables and token volume added%s",
                 request.get("namespace", ""), pod_name(pod),
                 " (opted in by its ServiceAccount's annotations)" if account else "")
    return _answer(uid, ops)
