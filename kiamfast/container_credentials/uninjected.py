"""Pods that asked for container credentials and were created without them: said on the pod.

The injection webhook acts only when a pod is created, and its configuration fails open
(``failurePolicy: Ignore``): a pod created while it is down, unreachable or refusing is
stored without the variables and token, and its SDK silently uses IMDS by address instead.
The webhook cannot see those pods; the agent's control process sees every pod of its node
through its watch.  So, once per pod, for a pod that opted in by its own annotations (the
role annotation and ``kiamfast.io/container-credentials: "true"``) yet carries no injected
token volume, it posts a Warning Event on the pod (reason `REASON`) and counts it.

What it cannot see: a pod opted in only through its ServiceAccount's annotations looks like
any other pod (the agent does not read ServiceAccounts).  What it must never do: block the
event loop (the Event is posted on a thread), fail the control process, or post twice for
a pod (the Event's name is derived from the pod's uid: a second create, after a restart,
is refused by the API server as already there).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("kiamfast.container_credentials")

# What the injection webhook (kiamfast/webhook/patch.py) reads and writes; the agent never
# imports the webhook, so the names are written here too and a test checks they agree.
OPT_IN_ANNOTATION = "kiamfast.io/container-credentials"
TOKEN_VOLUME = "kiamfast-container-credentials-token"
PROVIDER_VARIABLES = frozenset({
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"})
REASON = "ContainerCredentialsNotInjected"
REMEMBERED = 4096               # uids reported and still live, oldest forgotten first


def asked_but_not_injected(pod: Mapping[str, Any], *, role_key: str) -> bool:
    """Whether ``pod`` opted in by its own annotations but carries no injected token volume,
    while one of its containers would have taken it (one that sets no container-provider
    variable: the webhook leaves the others alone) and it names a ServiceAccount (without
    one the webhook adds nothing either).  A finished or deleted pod needs nothing."""
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, Mapping) or annotations.get(OPT_IN_ANNOTATION) != "true" \
            or not annotations.get(role_key) or metadata.get("deletionTimestamp"):
        return False
    spec = pod.get("spec") or {}
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") \
            or not spec.get("serviceAccountName"):
        return False
    if any(isinstance(v, Mapping) and v.get("name") == TOKEN_VOLUME
           for v in spec.get("volumes") or ()):
        return False
    containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
    return any(isinstance(c, Mapping) and not any(
        isinstance(e, Mapping) and e.get("name") in PROVIDER_VARIABLES
        for e in c.get("env") or ()) for c in containers)


def event(pod: Mapping[str, Any], *, node: str, now: float | None = None) -> dict[str, Any]:
    """The core/v1 Event (``POST /api/v1/namespaces/<ns>/events``) saying so on ``pod``."""
    metadata = pod["metadata"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None
                                                            else now))
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{metadata['name'][:200]}.kiamfast-{metadata['uid']}",
                     "namespace": metadata["namespace"]},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": metadata["name"],
                           "namespace": metadata["namespace"], "uid": metadata["uid"]},
        "reason": REASON, "type": "Warning",
        "message": "The pod asked for container credentials (its role annotation and "
                   f"{OPT_IN_ANNOTATION}: \"true\") but was created without them: the "
                   "injection webhook was down, unreachable or refused the call. It uses "
                   "IMDS by address, with the same role. Recreate it once the webhook is up "
                   "(e.g. kubectl rollout restart of its owner) to use the token.",
        "source": {"component": "kiamfast", **({"host": node} if node else {})},
        "reportingComponent": "kiamfast.io/agent", "reportingInstance": node or "kiamfast",
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


class UninjectedPods:
    """`seen(pod)` for every pod the watch applies (on the event loop): reports each pod
    that `asked_but_not_injected` once, posting its Event through ``create_event`` (blocking:
    run by ``run_in_thread``, never on the loop).  ``reported`` counts them."""

    def __init__(self, *, role_key: str, node: str,
                 create_event: Callable[[dict[str, Any]], Any],
                 run_in_thread: Callable[[Callable[[], None]], Any]) -> None:
        self.role_key, self.node = role_key, node
        self.create_event, self.run_in_thread = create_event, run_in_thread
        self._reported: OrderedDict[str, None] = OrderedDict()
        self.reported = 0
        self.failing = False

    def seen(self, pod: Mapping[str, Any]) -> None:
        metadata = pod.get("metadata") or {}
        uid = metadata.get("uid")
        if not uid:
            return
        if metadata.get("deletionTimestamp") \
                or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            self._reported.pop(uid, None)   # never reported again: nothing kept for it
            return
        if uid in self._reported or not asked_but_not_injected(pod, role_key=self.role_key):
            return
        self._reported[uid] = None
        while len(self._reported) > REMEMBERED:
            self._reported.popitem(last=False)
        self.reported += 1
        log.warning("pod %s/%s asked for container credentials but was created without "
                    "them (the injection webhook was down or refused it): it uses IMDS by "
                    "address; Event %s posted", metadata.get("namespace"),
                    metadata.get("name"), REASON)
        body = event(pod, node=self.node)
        self.run_in_thread(lambda: self._post(body))

    def _post(self, body: dict[str, Any]) -> None:
        try:
            self.create_event(body)
        except Exception as e:   # noqa: BLE001 - an Event is worth a line, never the process
            if getattr(e, "status", None) == 409:    # posted before (a restart): done
                return
            if not self.failing:
                self.failing = True
                log.warning("cannot post Events (%s: %s); pods created without container "
                            "credentials are still counted and logged, this is said once",
                            type(e).__name__, getattr(e, "status", "") or e)
            return
        self.failing = False
