"""The pods the node model knows only from the runtime: a READY sandbox the API does not show.

The watch can be behind the runtime (a pod asks before the watch delivers it), and a pod
deleted from the API by force keeps its sandbox until the kubelet stops it: either way the
processes asking from the sandbox's address are that pod's.  Such a pod is decided from the
sandbox's annotations (the kubelet copies the pod's there).  The API's record takes over as
soon as the watch shows the pod; the record goes when the runtime stops showing it.
"""
from __future__ import annotations

from collections.abc import Iterator

from kiamfast.control.mappings.decider import PodRecord
from kiamfast.control.mappings.runtime_owners import SandboxLike


class SandboxPods:
    def __init__(self, *, adopted_token_only: set[str]) -> None:
        self.records: dict[str, PodRecord] = {}
        # A sandbox carries no environment: a pod the previous process served by token only
        # stays so until the API shows its spec.
        self._adopted_token_only = adopted_token_only
        self.created = 0

    def get(self, uid: str) -> PodRecord | None:
        return self.records.get(uid)

    def show(self, sandbox: SandboxLike) -> bool:
        """The runtime shows this pod's sandbox READY and the API does not show the pod;
        True if the pod is new or its annotations changed (to decide again)."""
        pod = self.records.get(sandbox.pod_uid)
        annotations = dict(sandbox.annotations)
        if pod is None:
            self.records[sandbox.pod_uid] = PodRecord(
                uid=sandbox.pod_uid, namespace=sandbox.namespace, name=sandbox.name,
                from_api=False, phase="Running", annotations=annotations,
                token_only=sandbox.pod_uid in self._adopted_token_only)
            self.created += 1
            return True
        if pod.annotations != annotations:
            pod.annotations = annotations
            return True
        return False

    def forget(self, uid: str) -> PodRecord | None:
        """The API shows the pod now, or the runtime stopped showing it."""
        return self.records.pop(uid, None)

    def in_namespace(self, name: str) -> Iterator[str]:
        return (uid for uid, pod in self.records.items() if pod.namespace == name)
