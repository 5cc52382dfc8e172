"""The JSONPatch that gives an opting-in pod the two variables and the token volume of the
container-credentials protocol.

A pod opts in with its role annotation (``--iam-role-key``) and ``kiamfast.io/container-
credentials: "true"``, on the pod or, with ``--service-account-opt-in``, on its
ServiceAccount: a ServiceAccount carrying both opts in every pod that runs as it.  The pod
is more specific, so each of the two annotations is the pod's own if it has it, else its
ServiceAccount's: a pod's own role wins over the account's, and a pod's own
``kiamfast.io/container-credentials: "false"`` opts it out of an opted-in account.  A pod
that gets its role from its account gets the role annotation added (the account's value):
the agent reads the role from the pod, as ever, and applies the same policy to it (namespace
restrictions, ``--default-role``).  Every container and initContainer then gets
``AWS_CONTAINER_CREDENTIALS_FULL_URI`` and ``AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`` and a
read-only mount of a projected service-account token with kiamfast's audience.  A container
that already sets any container-provider variable is left alone: adding only some of them
could send kiamfast's token to an endpoint the container chose.

Pure: no I/O; the account's annotations are read by the caller (`accounts.py`).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kiamfast.webhook")

OPT_IN_ANNOTATION = "kiamfast.io/container-credentials"
FULL_URI = "http://169.254.170.23/v1/credentials"
VOLUME = "kiamfast-container-credentials-token"
MOUNT_PATH = "/var/run/secrets/kiamfast.io/container-credentials"
TOKEN_FILE = "token"

# A role ARN is at most 2048 characters (IAM); the agent denies longer ones.  Bounds what a
# role annotation copied from the account adds to an answer.
MAX_ROLE = 2048

# Any of these means the container chose its own container-provider settings.
PROVIDER_VARIABLES = frozenset({
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"})


class MalformedReview(ValueError):
    """The request is not an AdmissionReview v1 for a pod we can read."""


def _annotations(pod: dict[str, Any]) -> dict[str, Any]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if not isinstance(annotations, dict):
        raise MalformedReview("metadata.annotations is not an object")
    return annotations


def decided_by_pod(pod: dict[str, Any], *, role_key: str) -> bool:
    """Whether the pod's own annotations settle its opt-in, so its account need not be read:
    its own opt-in wins, and anything but "true" is no whatever the account says; "true"
    beside a role of its own needs nothing from the account."""
    annotations = _annotations(pod)
    opt_in = annotations.get(OPT_IN_ANNOTATION)
    return opt_in is not None and (opt_in != "true" or role_key in annotations)


def effective_role(pod: dict[str, Any], *, role_key: str,
                   account: dict[str, str] | None = None) -> str | None:
    """The role the pod opts in with, None if it does not: each of the two annotations is
    the pod's own if it has it, else its ServiceAccount's (``account``)."""
    own, inherited = _annotations(pod), account or {}
    opt_in = own[OPT_IN_ANNOTATION] if OPT_IN_ANNOTATION in own \
        else inherited.get(OPT_IN_ANNOTATION)
    role = own.get(role_key) if role_key in own else inherited.get(role_key)
    return role if opt_in == "true" and role and isinstance(role, str) \
        and len(role) <= MAX_ROLE else None


def _token_volume(audience: str, expiration: int) -> dict[str, Any]:
    return {"name": VOLUME, "projected": {"sources": [{"serviceAccountToken": {
        "audience": audience, "expirationSeconds": expiration, "path": TOKEN_FILE}}]}}


def _container_patch(base: str, container: dict[str, Any], full_uri: str) -> list[dict]:
    """The operations for one container, none if it sets its own provider variables or
    already mounts something at our path."""
    env = container.get("env") or []
    mounts = container.get("volumeMounts") or []
    if not isinstance(env, list) or not isinstance(mounts, list):
        raise MalformedReview(f"{base}: env or volumeMounts is not a list")
    if any(isinstance(e, dict) and e.get("name") in PROVIDER_VARIABLES for e in env):
        return []
    if any(isinstance(m, dict) and m.get("mountPath") == MOUNT_PATH for m in mounts):
        return []
    ours_env = [{"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": full_uri},
                {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                 "value": f"{MOUNT_PATH}/{TOKEN_FILE}"}]
    ours_mount = {"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}
    return [*_append(f"{base}/env", env, ours_env),
            *_append(f"{base}/volumeMounts", mounts, [ours_mount])]


def _append(path: str, current: list[Any], items: list[Any]) -> list[dict]:
    """JSONPatch adding ``items`` to the list ``current`` at ``path``; an empty, null or
    absent one is replaced (appending to null is a patch the API server cannot apply)."""
    if not current:
        return [{"op": "add", "path": path, "value": items}]
    return [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def _role_annotation(pod: dict[str, Any], role_key: str, role: str) -> list[dict]:
    """The role annotation, unless the pod has it: the account's role, written on the pod
    for the agent (which reads only pods)."""
    annotations = _annotations(pod)
    if annotations.get(role_key) == role:
        return []
    if not annotations:
        return [{"op": "add", "path": "/metadata/annotations", "value": {role_key: role}}]
    key = role_key.replace("~", "~0").replace("/", "~1")       # RFC 6901
    return [{"op": "add", "path": f"/metadata/annotations/{key}", "value": role}]


def pod_patch(pod: dict[str, Any], *, role_key: str, audience: str, expiration: int,
              full_uri: str = FULL_URI, account: dict[str, str] | None = None) -> list[dict]:
    """The JSONPatch for ``pod``, whose ServiceAccount has the annotations ``account`` (None:
    not read, or not readable); empty if it does not opt in or nothing needs adding."""
    role = effective_role(pod, role_key=role_key, account=account)
    if role is None:
        return []
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise MalformedReview("pod has no spec")
    if not spec.get("serviceAccountName"):
        # The API server refuses a token volume then; the ServiceAccount admission plugin,
        # which runs first, sets it on every cluster that has one.
        log.warning("pod %s opts in but has no serviceAccountName: no token volume",
                    pod_name(pod))
        return []
    ops: list[dict] = []
    for kind in ("initContainers", "containers"):
        containers = spec.get(kind) or []
        if not isinstance(containers, list):
            raise MalformedReview(f"spec.{kind} is not a list")
        for i, container in enumerate(containers):
            if not isinstance(container, dict):
                raise MalformedReview(f"spec.{kind}[{i}] is not an object")
            ops += _container_patch(f"/spec/{kind}/{i}", container, full_uri)
    volumes = spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise MalformedReview("spec.volumes is not a list")
    has_volume = any(isinstance(v, dict) and v.get("name") == VOLUME for v in volumes)
    if ops and not has_volume:
        ops += _append("/spec/volumes", volumes, [_token_volume(audience, expiration)])
    if ops:
        # A pod none of whose containers takes the variables keeps IMDS by address: it
        # gets no role it did not ask for itself.
        ops = _role_annotation(pod, role_key, role) + ops
    return ops


def pod_name(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return metadata.get("name") or metadata.get("generateName", "")
