"""Which pods take their credentials by token only, so the metadata path must refuse them.

A pod whose every container has `AWS_CONTAINER_CREDENTIALS_FULL_URI` pointing at this
agent's container-credentials listener, and a token file, asks by token (the SDKs try the
container provider before IMDS).  Serving it by address as well would keep its identity
within reach of the address races the token path exists to avoid: some SDKs (Java's
default chain) go on to IMDS when the container provider fails, and whoever holds its
address next would ask as it.  So for such a pod the metadata path answers as for a denied
pod, and its credentials are served by token only.

Read from the pod spec's `env` only (`envFrom` ConfigMaps are not in the pod object): a
container that does not visibly point here keeps the whole pod on kube2iam's contract, the
status quo, never a new owner.  A pod created while the webhook was down has no variables,
so it keeps IMDS by address too.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

FULL_URI = "AWS_CONTAINER_CREDENTIALS_FULL_URI"
TOKEN_FILE = "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"


def _endpoint(uri: str) -> tuple[str, int] | None:
    """(canonical ip, port) of an http:// URI naming an address, else None."""
    try:
        parts = urlsplit(uri)
        if parts.scheme != "http" or parts.hostname is None:
            return None
        return str(ipaddress.ip_address(parts.hostname)), parts.port or 80
    except ValueError:
        return None


def _env(container: Any) -> dict[str, str]:
    if not isinstance(container, Mapping):
        return {}
    return {e["name"]: e.get("value") or "" for e in container.get("env") or ()
            if isinstance(e, Mapping) and isinstance(e.get("name"), str)}


def predicate(listen: Iterable[tuple[str, int]]) -> Callable[[Mapping[str, Any]], bool]:
    """`spec -> bool`: does every container of the pod ask this agent's listener by token?
    Without a listener, nothing is token-only."""
    served = {(str(ipaddress.ip_address(host)), port) for host, port in listen}
    if not served:          # every pod event asks: answer without looking at its spec
        return lambda spec: False
    # A listener on every address (0.0.0.0, ::) is asked at any address with its port.
    any_address = {port for host, port in served if ipaddress.ip_address(host).is_unspecified}

    def ours(uri: str) -> bool:
        endpoint = _endpoint(uri)
        return endpoint is not None and (endpoint in served or endpoint[1] in any_address)

    def token_only(spec: Mapping[str, Any]) -> bool:
        containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
        if not containers:
            return False
        for container in containers:
            env = _env(container)
            if not env.get(TOKEN_FILE) or not ours(env.get(FULL_URI, "")):
                return False
        return True

    return token_only
