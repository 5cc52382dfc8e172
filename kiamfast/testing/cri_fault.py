"""A container runtime that misbehaves on demand: CRI runtime v1 over real gRPC.

Tests of the agent's runtime path use a real containerd wherever they can (tests/cri). A
real runtime cannot be made slow, return an error, or answer nonsense when a test asks, and
it needs root; this double can and does not. It serves `runtime.v1.RuntimeService`'s
`Version`, `ListPodSandbox` and `PodSandboxStatus` on a unix socket with the generated
protobuf messages, so the client under test talks gRPC exactly as it does to containerd.
Every other method answers UNIMPLEMENTED, as an old runtime would.

A test sets the sandboxes (`put`, `stop`, `remove`) and the faults (`fault(method, ...)`):

* `delay`: the answer is held that long (a slow runtime, a timeout when above the client's);
* `error`: a gRPC status code (UNAVAILABLE, INTERNAL, ...) instead of an answer;
* `garbage`: bytes that are no valid protobuf message (the client's decoding fails);
* `gather`: each call is held until that many calls of the method have been in flight at
  once (at most 5 s): only a client that asks in parallel gets its answers in time;
* `times`: the fault applies to the next N calls only (None: until cleared);
* `sandbox_id`: the fault applies to `PodSandboxStatus` for that sandbox only.

Malformed *contents* are ordinary sandboxes built with `fake_sandbox(...)`: one without the
kubelet's labels, two READY ones claiming one address, a host-network one, an address that
does not parse. Two switches make it answer like other runtimes: `ignore_filter` (lists
every sandbox whatever the filter) and `stopped_keep_ips` (a NOTREADY sandbox still reports
its addresses, as CRI-O may). `calls` counts the requests per method, `arrivals` records
when each one arrived, and `peak` the most calls of a method in flight at once. `kiamfast
demo` can use it to show the runtime path without a real runtime.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri

__all__ = ["CriFault", "FakeSandbox", "fake_sandbox"]

SERVICE = "runtime.v1.RuntimeService"


@dataclass(frozen=True)
class FakeSandbox:
    id: str
    name: str
    namespace: str
    uid: str
    ip: str = ""
    additional_ips: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    host_network: bool = False
    created_ns: int = 0
    netns: str = ""       # its network namespace's path, in the verbose status (or none)


def fake_sandbox(*, name: str, ip: str = "", namespace: str = "default", uid: str | None = None,
                 additional_ips: Iterable[str] = (), annotations: Mapping[str, str] | None = None,
                 labels: Mapping[str, str] | None = None, kubelet_labels: bool = True,
                 host_network: bool = False, ready: bool = True,
                 netns: str = "") -> FakeSandbox:
    """A sandbox as the kubelet would create it (its three io.kubernetes.pod.* labels unless
    `kubelet_labels=False`), with a fresh random id and pod uid."""
    uid = uid or secrets.token_hex(16)
    all_labels = dict(labels or {})
    if kubelet_labels:
        all_labels.update({"io.kubernetes.pod.uid": uid, "io.kubernetes.pod.name": name,
                           "io.kubernetes.pod.namespace": namespace})
    return FakeSandbox(id=secrets.token_hex(32), name=name, namespace=namespace, uid=uid,
                       ip=ip, additional_ips=tuple(additional_ips), labels=all_labels,
                       annotations=dict(annotations or {}), ready=ready,
                       host_network=host_network, created_ns=time.time_ns(), netns=netns)


@dataclass
class _Fault:
    delay: float = 0.0
    error: grpc.StatusCode | None = None
    garbage: bool = False
    gather: int = 0
    times: int | None = None


_GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\x0f"   # a truncated varint: no message parses


def _verbose_info(sandbox: FakeSandbox) -> dict[str, str]:
    """What containerd and CRI-O put in a verbose status: the sandbox's runtime spec as JSON
    under "info", with its network namespace (none for the host's network, as theirs)."""
    namespaces = [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]
    if not sandbox.host_network:
        namespaces.append({"type": "network", "path": sandbox.netns})
    return {"info": json.dumps({"pid": 1, "runtimeSpec": {
        "ociVersion": "1.1.0", "linux": {"namespaces": namespaces}}})}


def _state(sandbox: FakeSandbox) -> int:
    return cri.SANDBOX_READY if sandbox.ready else cri.SANDBOX_NOTREADY


class CriFault:
    """The fault double's server. `with CriFault() as runtime: runtime.endpoint ...`"""

    def __init__(self, socket_path: str | None = None, *, runtime_name: str = "cri-fault",
                 ignore_filter: bool = False, stopped_keep_ips: bool = False) -> None:
        """`ignore_filter`: ListPodSandbox lists every sandbox whatever the filter asks;
        `stopped_keep_ips`: a NOTREADY sandbox still reports its addresses (CRI-O may)."""
        self._tmp = None
        if socket_path is None:
            self._tmp = tempfile.mkdtemp(prefix="kiamfast-cri-fault-")
            socket_path = os.path.join(self._tmp, "cri.sock")
        self.socket_path = socket_path
        self.endpoint = "unix://" + socket_path
        self.runtime_name = runtime_name
        self.ignore_filter = ignore_filter
        self.stopped_keep_ips = stopped_keep_ips
        self.arrivals: list[tuple[str, int]] = []   # (method, monotonic_ns when it arrived)
        self.calls: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()          # most calls of a method in flight at once
        self._in_flight: Counter[str] = Counter()
        self._lock = threading.Condition()
        self._sandboxes: dict[str, FakeSandbox] = {}
        self._faults: dict[tuple[str, str | None], _Fault] = {}
        self._server: grpc.Server | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> CriFault:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        # more threads than any client asks at once: a limit on concurrency is the client's
        server = grpc.server(ThreadPoolExecutor(max_workers=32, thread_name_prefix="cri-fault"))
        server.add_generic_rpc_handlers((self._handlers(),))
        if server.add_insecure_port(self.endpoint) == 0:
            raise OSError(f"cannot listen on {self.endpoint}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop serving and remove the socket (as a runtime that went away)."""
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            os.rmdir(self._tmp)
            self._tmp = None

    def __enter__(self) -> CriFault:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the test sets ------------------------------------------------------------

    def put(self, *sandboxes: FakeSandbox) -> None:
        with self._lock:
            for sandbox in sandboxes:
                self._sandboxes[sandbox.id] = sandbox

    def stop_sandbox(self, sandbox_id: str) -> None:
        """NOTREADY, and like containerd its network.ip is reported empty from now on."""
        self.set_ready(sandbox_id, False)

    def set_ready(self, sandbox_id: str, ready: bool) -> None:
        with self._lock:
            self._sandboxes[sandbox_id] = replace(self._sandboxes[sandbox_id], ready=ready)

    def remove(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)

    def clear(self) -> None:
        with self._lock:
            self._sandboxes.clear()

    def fault(self, method: str, *, delay: float = 0.0, error: grpc.StatusCode | None = None,
              garbage: bool = False, gather: int = 0, times: int | None = None,
              sandbox_id: str | None = None) -> None:
        """Make `method` ('ListPodSandbox', 'PodSandboxStatus', 'Version', or '*') misbehave
        (for one sandbox's PodSandboxStatus only, with `sandbox_id`)."""
        with self._lock:
            self._faults[method, sandbox_id] = _Fault(delay=delay, error=error, garbage=garbage,
                                                      gather=gather, times=times)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    # -- the gRPC service --------------------------------------------------------------

    def _handlers(self) -> grpc.GenericRpcHandler:
        def handler(method: str, *, request_type: Any, answer: Any) -> grpc.RpcMethodHandler:
            def serve(request: Any, context: grpc.ServicerContext) -> Any:
                with self._lock:
                    self.arrivals.append((method, time.monotonic_ns()))
                    self.calls[method] += 1
                    self._in_flight[method] += 1
                    self.peak[method] = max(self.peak[method], self._in_flight[method])
                    self._lock.notify_all()
                try:
                    fault = self._take_fault(method, getattr(request, "pod_sandbox_id", None))
                    if fault is not None:
                        if fault.gather:
                            with self._lock:
                                self._lock.wait_for(lambda: self.peak[method] >= fault.gather,
                                                    timeout=5.0)
                        if fault.delay:
                            time.sleep(fault.delay)
                        if fault.error is not None:
                            context.abort(fault.error, f"cri-fault: injected {fault.error.name}")
                        if fault.garbage:
                            return _GARBAGE
                    return answer(request, context)
                finally:
                    with self._lock:
                        self._in_flight[method] -= 1
            return grpc.unary_unary_rpc_method_handler(
                serve, request_deserializer=request_type.FromString,
                response_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString())

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Version": handler("Version", request_type=cri.VersionRequest,
                               answer=self._version),
            "ListPodSandbox": handler("ListPodSandbox", request_type=cri.ListPodSandboxRequest,
                                      answer=self._list),
            "PodSandboxStatus": handler("PodSandboxStatus",
                                        request_type=cri.PodSandboxStatusRequest,
                                        answer=self._status),
        })

    def _take_fault(self, method: str, sandbox_id: str | None) -> _Fault | None:
        with self._lock:
            key = next((k for k in ((method, sandbox_id), (method, None), ("*", None))
                        if k in self._faults), None)
            if key is None:
                return None
            fault = self._faults[key]
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del self._faults[key]
            return fault

    def _version(self, request: Any, context: grpc.ServicerContext) -> Any:
        return cri.VersionResponse(version="0.1.0", runtime_name=self.runtime_name,
                                   runtime_version="1.0.0", runtime_api_version="v1")

    def _list(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            sandboxes = list(self._sandboxes.values())
        f = cri.PodSandboxFilter() if self.ignore_filter else request.filter
        if f.id:
            sandboxes = [s for s in sandboxes if s.id == f.id]
        if f.HasField("state"):
            sandboxes = [s for s in sandboxes if _state(s) == f.state.state]
        if f.label_selector:
            sandboxes = [s for s in sandboxes
                         if all(s.labels.get(k) == v for k, v in f.label_selector.items())]
        return cri.ListPodSandboxResponse(items=[
            cri.PodSandbox(id=s.id, state=_state(s), created_at=s.created_ns,
                           metadata=cri.PodSandboxMetadata(name=s.name, uid=s.uid,
                                                           namespace=s.namespace),
                           labels=s.labels, annotations=s.annotations)
            for s in sandboxes])

    def _status(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self._lock:
            s = self._sandboxes.get(request.pod_sandbox_id)
        if s is None:
            context.abort(grpc.StatusCode.NOT_FOUND,   # containerd's wording
                          "an error occurred when try to find sandbox: not found "
                          + request.pod_sandbox_id)
        network = cri.PodSandboxNetworkStatus()
        if s.ready or self.stopped_keep_ips:   # containerd: no address once stopped
            network = cri.PodSandboxNetworkStatus(
                ip=s.ip, additional_ips=[cri.PodIP(ip=ip) for ip in s.additional_ips])
        mode = cri.NODE if s.host_network else cri.POD
        return cri.PodSandboxStatusResponse(status=cri.PodSandboxStatus(
            id=s.id, state=_state(s), created_at=s.created_ns, network=network,
            metadata=cri.PodSandboxMetadata(name=s.name, uid=s.uid, namespace=s.namespace),
            linux=cri.LinuxPodSandboxStatus(namespaces=cri.Namespace(
                options=cri.NamespaceOption(network=mode))),
            labels=s.labels, annotations=s.annotations),
            info=_verbose_info(s) if request.verbose else {})
