"""Which pods hold a credential slot, for which role: the node model's side of the sink.

A pod whose role is decided acquires its slot from the credential sink (the credential
manager, handed in: mappings never import iam) at once, before it has an address: that
starts the prefetch.  The sink keys the slot and names the session by the pod's
:class:`~.decisions.PodDecision`, so the pod acquires again when its role, external ID or
first address changes.  A pod that loses its role, or goes, is released only after the
table stops naming its slot (``release_gone``, after the commit's writes).  An acquire that
fails (slots exhausted) leaves the pod undecided (its requests wait, then 503) and is
retried when the model expires.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from kiamfast.decisions import PodDecision, PodIdentity
from kiamfast.control.mappings.decider import PodRecord

log = logging.getLogger("kiamfast.ownership")


class CredentialSink(Protocol):
    """The credential manager as the model uses it."""

    def acquire(self, pod_uid: str, req: Any) -> int: ...
    def release(self, pod_uid: str) -> None: ...
    def role_of_slot(self, slot: int) -> tuple[str, str | None] | None: ...


class CredentialHolds:
    """Acquire, drop and release pods' credential slots (``PodRecord.cred_slot``/``cred_key``)."""

    def __init__(self, sink: CredentialSink) -> None:
        self.sink = sink
        self._gone: set[str] = set()    # pods whose slots to release after the table's writes
        self._retry: set[str] = set()   # pods whose acquire failed

    def acquire(self, pod: PodRecord, ident: PodIdentity, *, address: str | None) -> bool:
        """The pod's slot for its role; False: no slot (logged), it waits and is retried."""
        want = (ident.role_arn, ident.external_id, address)
        if pod.cred_key == want:
            return True
        try:
            # The decision is what the credential manager keys and names the session by.
            pod.cred_slot = self.sink.acquire(pod.uid, PodDecision(
                uid=pod.uid, namespace=pod.namespace, name=pod.name,
                service_account=pod.service_account, identity=ident,
                token_only=pod.token_only, host_network=pod.host_network, address=address,
                source=pod.source))
            pod.cred_key = want
            return True
        except Exception as e:   # slots exhausted: stay undecided (503), retry later
            log.error("pod %s/%s: no credential slot for %s: %s",
                      pod.namespace, pod.name, ident.role_arn, e)
            self._retry.add(pod.uid)
            return False

    def keep(self, uid: str) -> None:
        """The pod is decided again: a release still pending is not wanted any more."""
        self._gone.discard(uid)

    def drop(self, pod: PodRecord) -> None:
        """The pod needs no slot any more: released after the table stops naming it."""
        if pod.cred_key is not None:
            self._gone.add(pod.uid)
            pod.cred_key = None
            pod.cred_slot = -1

    def forget(self, pod: PodRecord) -> None:
        """The pod left the model: its slot is released after the table's writes."""
        if pod.cred_key is not None:
            self._gone.add(pod.uid)

    def release_gone(self, pod_of: Callable[[str], PodRecord | None]) -> None:
        """After the table's writes: release every slot no pod holds any more."""
        for uid in self._gone:
            pod = pod_of(uid)
            if pod is None or pod.cred_key is None:
                self.sink.release(uid)
        self._gone.clear()

    def take_retries(self) -> set[str]:
        """The pods whose acquire failed since the last call (to decide again)."""
        retry, self._retry = self._retry, set()
        return retry
