"""Ask the node's container runtime (CRI runtime v1 over gRPC) which pod owns which address.

The API server learns a pod's address seconds after the pod's containers are already
running (the kubelet reports it on the sync *after* the one that created the sandbox), and
it can keep showing a dead pod's address after a new sandbox got it. The runtime knows both
at once: CNI ADD gives the sandbox its address before any container starts, and a stopped
sandbox is NOTREADY. So this module asks the runtime, the way the kubelet itself does
(`GetPodStatus` takes a pod's IP only from a `SANDBOX_READY` sandbox):

* `RuntimeClient.poll()` sends `ListPodSandbox` (READY only) and then `PodSandboxStatus`
  for READY sandboxes it has not seen before, up to 8 at once (50 pods starting together on
  a slow runtime must not queue their status calls one behind the other). A sandbox's
  addresses never change, so status answers are cached by sandbox id and dropped once the
  id is no longer listed: a steady node costs one ~0.3 ms call per poll, and when the
  view's sandboxes have not changed the previous view is reused with the new start time.
  The view names the owner of every address claimed by exactly one READY sandbox; an
  address claimed by two is owned by nobody.
* `RuntimeView.started_ns` is taken *before* the list request is sent. The freshness
  argument rests on it: a view started at S reflects every sandbox stop that completed
  before S, so a connection accepted at T may be answered from a view with S >= T.
* `RuntimePoller` (`poller.py`) runs the polls on one dedicated thread (gRPC calls never touch the event
  loop), periodically and on demand (`need()`), coalescing concurrent demands into one
  follow-up poll; demand polls start at least `demand_floor` apart, so a pod opening
  connections in a loop costs the runtime at most 1/floor polls per second; an outage is
  reported once and retried with jittered backoff.

What the runtime says is treated as untrusted input: a sandbox without the kubelet's three
`io.kubernetes.pod.*` labels, a host-network sandbox, or one with no or an unparsable
address is skipped (one log line per sandbox id, never per poll) and asked again after 1 s,
doubling up to 30 s (an address can show up late; a skip must not last the sandbox's life);
two READY sandboxes claiming one address put it in `conflicts` (one log line per episode).
A `PodSandboxStatus` error is retried once within the poll (unless it timed out); if it
fails again only that sandbox is left out of the view (it owns nothing there) and it is
asked again on the next poll (one log line per episode). Any failure to get the list
(socket missing, timeout, gRPC error, runtime restarting) is `RuntimeUnavailable`.

The calls go through `kiamfast.control.cri` (unary gRPC on the unix socket with `h2`, and a
codec for the few CRI messages used): neither grpcio nor protobuf is imported, and only the
control process imports this module.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson

from kiamfast.control.cri import messages as cri
from kiamfast.control.cri.transport import GrpcError, StatusCode, UnixChannel

log = logging.getLogger("kiamfast.runtime")

DEFAULT_ENDPOINTS = ("unix:///run/containerd/containerd.sock",
                     "unix:///var/run/containerd/containerd.sock",
                     "unix:///var/run/crio/crio.sock")

POD_UID_LABEL = "io.kubernetes.pod.uid"
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"

STATUS_CONCURRENCY = 8     # PodSandboxStatus calls in flight at once within one poll
SKIP_RECHECK_FIRST = 1.0   # a skipped sandbox is asked again after this many seconds,
SKIP_RECHECK_MAX = 30.0    # doubling up to this

_SERVICE = "/runtime.v1.RuntimeService/"
_GONE = object()            # a status answered NOT_FOUND: the sandbox was removed


def resolve_endpoint(value: str) -> str | None:
    """--cri-endpoint: 'auto' -> the first of DEFAULT_ENDPOINTS whose socket exists now, else
    None; '' or 'none' -> None; a path without scheme -> unix://path; otherwise the value."""
    value = value.strip()
    if value in ("", "none"):
        return None
    if value == "auto":
        for endpoint in DEFAULT_ENDPOINTS:
            if os.path.exists(endpoint.removeprefix("unix://")):
                return endpoint
        return None
    if "://" not in value:
        return "unix://" + value
    return value


@dataclass(frozen=True, slots=True)
class Sandbox:
    id: str
    pod_uid: str
    name: str
    namespace: str
    ips: tuple[str, ...]            # canonical text: network.ip, then additional_ips
    # the kubelet copies the pod's annotations here (not hashed: a Sandbox can go in a set)
    annotations: Mapping[str, str] = field(compare=False)
    created_ns: int                 # created_at from the runtime
    netns: str = ""                 # its network namespace's path (verbose status), or ""


@dataclass(frozen=True, slots=True)
class RuntimeView:
    """One observation. When its sandboxes did not change since the previous poll, the new
    view shares the previous one's `sandboxes`, `owners` and `conflicts` objects (only
    `started_ns` differs), so a consumer can skip its work with an identity check."""
    started_ns: int                  # monotonic_ns taken just before ListPodSandbox was sent
    sandboxes: tuple[Sandbox, ...]   # READY, well-formed, not host-network
    owners: Mapping[str, Sandbox]    # ip -> the only READY sandbox claiming it
    conflicts: frozenset[str]        # ips claimed by two or more READY sandboxes


class RuntimeUnavailable(Exception):
    """The runtime gave no usable answer (socket missing, unreachable, timeout, error)."""


class _Skip(Exception):
    """A sandbox the view must leave out; the message says why (logged once per id)."""


@dataclass(frozen=True, slots=True)
class _StatusFailed:
    """A PodSandboxStatus that gave no answer, after its retry: why."""
    error: str


@dataclass(frozen=True, slots=True)
class _Recheck:
    """When to ask a skipped sandbox again, and the wait that led there (doubled next time)."""
    at_ns: int
    wait: float


def canonical_ip(text: str) -> str:
    """The table's text form of an address: IPv6 compressed, IPv4-mapped IPv6 as IPv4."""
    addr = ipaddress.ip_address(text)
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.scope_id is not None:
            raise ValueError(f"scoped address {text!r}")
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
    if addr.is_unspecified:
        raise ValueError(f"unspecified address {text!r}")
    return str(addr)


def netns_path(info: Mapping[str, str]) -> str:
    """The sandbox's network namespace from a verbose status's ``info``: containerd and CRI-O
    both put the sandbox's runtime spec there as JSON (``info["info"]``: ``runtimeSpec.linux
    .namespaces``, the entry of type ``network``; CRI-O's server/sandbox_status.go
    ``createSandboxInfo``, containerd's ``SandboxInfo``); "" when it is not there."""
    raw = info.get("info")
    if not raw:
        return ""
    try:
        spec = orjson.loads(raw).get("runtimeSpec") or {}
        for ns in (spec.get("linux") or {}).get("namespaces") or ():
            if isinstance(ns, dict) and ns.get("type") == "network":
                path = ns.get("path")
                return path if isinstance(path, str) else ""
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        pass
    return ""


def sandbox_from_status(status: Any, info: Mapping[str, str] | None = None) -> Sandbox:
    """A view entry from a `PodSandboxStatus` (and its verbose ``info``), or `_Skip` naming
    what is wrong with it."""
    labels = status.labels
    missing = [k for k in (POD_UID_LABEL, POD_NAME_LABEL, POD_NAMESPACE_LABEL) if not labels.get(k)]
    if missing:
        raise _Skip(f"no {', '.join(missing)} label (not a kubelet pod)")
    if status.linux.namespaces.options.network == cri.NODE:
        raise _Skip("host network (its address is the node's)")
    raw = [status.network.ip] + [extra.ip for extra in status.network.additional_ips]
    if not raw[0]:
        raise _Skip("READY but no network.ip")
    ips: list[str] = []
    for text in raw:
        try:
            ip = canonical_ip(text)
        except ValueError as exc:
            raise _Skip(f"unparsable address {text!r}: {exc}") from None
        if ip not in ips:
            ips.append(ip)
    return Sandbox(id=status.id, pod_uid=labels[POD_UID_LABEL], name=labels[POD_NAME_LABEL],
                   namespace=labels[POD_NAMESPACE_LABEL], ips=tuple(ips),
                   annotations=MappingProxyType(dict(status.annotations)),
                   created_ns=status.created_at, netns=netns_path(info or {}))


class RuntimeClient:
    """Synchronous CRI client; call `poll()` from one thread (the poller's)."""

    def __init__(self, endpoint: str, *, timeout: float = 2.0,
                 clock_ns: Callable[[], int] = time.monotonic_ns,
                 known: Iterable[Sandbox] = (), verbose: bool = False) -> None:
        """``known``: entries a previous process saw (``kept_sandboxes.py``), taken for the status
        answers they were made from while their ids are listed READY.  ``verbose``: ask
        for each sandbox's network namespace (the kernel's proof needs it)."""
        self.endpoint = endpoint
        self.verbose = verbose
        self.timeout = timeout
        self._clock_ns = clock_ns
        self._channel = UnixChannel(endpoint)
        self._status_pool: ThreadPoolExecutor | None = None
        # READY entries, by id (a saved one without the namespace the proof needs is asked
        # for again)
        self._cache: dict[str, Sandbox] = {s.id: s for s in known if s.netns or not verbose}
        self._skips: dict[str, _Recheck] = {}       # listed sandboxes skipped, by id
        self._failing: set[str] = set()             # ids whose status failed (logged)
        self._conflicts_logged: set[str] = set()
        self._listed_ids: tuple[str, ...] = ()      # READY ids the last view was built from
        self._uncached: list[str] = []              # the listed ids without a cached entry
        self._last_view: RuntimeView | None = None
        self.stats: dict[str, int] = {"polls": 0, "status_calls": 0, "errors": 0,
                                      "status_errors": 0, "skipped_sandboxes": 0,
                                      "conflicts": 0}

    def _reset(self) -> None:
        """Drop the idle connections after a failure: the next call dials afresh (a
        restarted runtime is a new socket)."""
        self._channel.close()

    def _rpc(self, method: str, request: Any, answer_type: type) -> Any:
        """One unary call: the decoded answer, or GrpcError / cri.DecodeError."""
        answer = self._channel.unary(_SERVICE + method, cri.encode(request),
                                     timeout=self.timeout)
        return cri.decode(answer_type, answer)

    def _call(self, method: str, request: Any, answer_type: type) -> Any:
        try:
            return self._rpc(method, request, answer_type)
        except GrpcError as exc:
            self.stats["errors"] += 1
            self._reset()
            raise RuntimeUnavailable(f"CRI endpoint {self.endpoint}: {method}: {exc}") from None
        except Exception as exc:   # e.g. an answer that does not decode: "no usable answer"
            self.stats["errors"] += 1
            self._reset()
            raise RuntimeUnavailable(
                f"CRI endpoint {self.endpoint}: {method}: {type(exc).__name__}: {exc}") from None

    def version(self) -> str:
        """Runtime name and version, for the start log line."""
        answer = self._call("Version", cri.VersionRequest(version="v1"), cri.VersionResponse)
        return f"{answer.runtime_name} {answer.runtime_version} (CRI {answer.runtime_api_version})"

    def poll(self) -> RuntimeView:
        """One observation of the node's READY sandboxes and the addresses they own."""
        ready_only = cri.PodSandboxFilter(state=cri.PodSandboxStateValue(state=cri.SANDBOX_READY))
        started_ns = self._clock_ns()   # before the request leaves: the freshness proof's S
        listed = self._call("ListPodSandbox", cri.ListPodSandboxRequest(filter=ready_only),
                            cri.ListPodSandboxRefs).items   # ids and states only
        self.stats["polls"] += 1
        # sorted: containerd lists in no stable order, and an unchanged set must be seen so
        ready_ids = tuple(sorted(item.id for item in listed if item.state == cri.SANDBOX_READY))
        changed = ready_ids != self._listed_ids
        if changed:
            self._forget_unlisted(set(ready_ids))
            self._uncached = [i for i in dict.fromkeys(ready_ids) if i not in self._cache]
        now = self._clock_ns()
        # ask the new, the failed or gone before, and the skipped whose recheck is due
        skips = self._skips
        due = [i for i in self._uncached if i not in skips or skips[i].at_ns <= now]
        if due:
            for sandbox_id, (answer, calls) in zip(due, self._statuses(due)):
                self.stats["status_calls"] += calls
                changed |= self._settle(sandbox_id, answer, now)
            self._uncached = [i for i in self._uncached if i not in self._cache]
        if not changed and self._last_view is not None:
            # nothing started or stopped since: same owners, observed at this poll's time
            return dataclasses.replace(self._last_view, started_ns=started_ns)
        sandboxes = tuple(self._cache[i] for i in ready_ids if i in self._cache)
        # together: a poll that failed half-way must not leave a list the view does not show
        self._listed_ids, self._last_view = ready_ids, self._view(started_ns, sandboxes)
        return self._last_view

    def _forget_unlisted(self, listed_ids: set[str]) -> None:
        for entries in (self._cache, self._skips):
            for stale in [k for k in entries if k not in listed_ids]:
                del entries[stale]
        self._failing &= listed_ids

    def _statuses(self, sandbox_ids: list[str]) -> list[tuple[Any, int]]:
        """`_fetch_status` of each id, STATUS_CONCURRENCY at a time, in the order asked."""
        if self._status_pool is None:
            self._status_pool = ThreadPoolExecutor(max_workers=STATUS_CONCURRENCY,
                                                   thread_name_prefix="kiamfast-cri-status")
        return list(self._status_pool.map(self._fetch_status, sandbox_ids))

    def _fetch_status(self, sandbox_id: str) -> tuple[Any, int]:
        """(answer, calls made): the status answer, _GONE (NOT_FOUND: removed since the
        list) or _StatusFailed. Runs on a pool thread: touches no state of the client. A
        failure is retried once, unless it timed out: a second wait would hold the whole
        poll, and every first call waiting for it, as long again."""
        request = cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=self.verbose)
        for calls in (1, 2):
            try:
                return self._rpc("PodSandboxStatus", request,
                                 cri.PodSandboxStatusResponse), calls
            except GrpcError as exc:
                if exc.code is StatusCode.NOT_FOUND:
                    return _GONE, calls
                failure = _StatusFailed(str(exc))
                if exc.code is StatusCode.DEADLINE_EXCEEDED:
                    break
            except Exception as exc:   # a malformed answer (cri.DecodeError), or a bug
                failure = _StatusFailed(f"{type(exc).__name__}: {exc}")
        return failure, calls

    def _settle(self, sandbox_id: str, answer: Any, now: int) -> bool:
        """Record one status answer: cache a READY sandbox's entry (True: the view changes),
        schedule a skip's recheck, or leave the sandbox out (failed, or gone or no longer
        READY: not cached, so asked again if still listed)."""
        if isinstance(answer, _StatusFailed):
            self._status_failed(sandbox_id, answer.error)
            return False
        if sandbox_id in self._failing:
            self._failing.discard(sandbox_id)
            log.info("CRI %s: sandbox %s status answered again", self.endpoint, sandbox_id)
        if answer is _GONE or answer.status.state != cri.SANDBOX_READY:
            return False
        try:
            self._cache[sandbox_id] = sandbox_from_status(answer.status, answer.info)
        except _Skip as why:
            self._skip(sandbox_id, str(why), now)
            return False
        except Exception as exc:   # a garbage answer must not stop the poll
            self._skip(sandbox_id, f"unreadable status: {type(exc).__name__}: {exc}", now)
            return False
        if self._skips.pop(sandbox_id, None) is not None:
            log.info("CRI %s: sandbox %s, skipped before, now owns %s", self.endpoint,
                     sandbox_id, ", ".join(self._cache[sandbox_id].ips))
        return True

    def _status_failed(self, sandbox_id: str, error: str) -> None:
        self.stats["status_errors"] += 1
        if sandbox_id not in self._failing:
            self._failing.add(sandbox_id)
            log.warning("CRI %s: PodSandboxStatus %s failed twice (%s): the sandbox owns "
                        "nothing until it answers; asked again every poll", self.endpoint,
                        sandbox_id, error)

    def _skip(self, sandbox_id: str, why: str, now: int) -> None:
        """Leave the sandbox out and ask again later (1 s, doubling to 30 s): logged once."""
        recheck = self._skips.get(sandbox_id)
        if recheck is None:
            self.stats["skipped_sandboxes"] += 1
            log.warning("CRI %s: sandbox %s skipped (owns no address): %s", self.endpoint,
                        sandbox_id, why)
        wait = SKIP_RECHECK_FIRST if recheck is None else min(SKIP_RECHECK_MAX, recheck.wait * 2)
        self._skips[sandbox_id] = _Recheck(at_ns=now + round(wait * 1e9), wait=wait)

    def _view(self, started_ns: int, sandboxes: tuple[Sandbox, ...]) -> RuntimeView:
        claims: dict[str, list[Sandbox]] = {}
        for sandbox in sandboxes:
            for ip in sandbox.ips:
                claims.setdefault(ip, []).append(sandbox)
        owners = {ip: claimants[0] for ip, claimants in claims.items() if len(claimants) == 1}
        conflicts = frozenset(ip for ip, claimants in claims.items() if len(claimants) > 1)
        for ip in conflicts - self._conflicts_logged:
            self.stats["conflicts"] += 1
            log.warning("CRI %s: address %s claimed by %d READY sandboxes (%s): owned by "
                        "nobody until only one claims it", self.endpoint, ip, len(claims[ip]),
                        ", ".join(f"{s.namespace}/{s.name} {s.id[:12]}" for s in claims[ip]))
        ended = self._conflicts_logged - conflicts
        if ended:
            log.info("CRI %s: address conflict over for %s", self.endpoint,
                     ", ".join(sorted(ended)))
        self._conflicts_logged = set(conflicts)
        return RuntimeView(started_ns=started_ns, sandboxes=sandboxes,
                           owners=MappingProxyType(owners), conflicts=conflicts)

    def close(self) -> None:
        self._reset()
        if self._status_pool is not None:
            self._status_pool.shutdown(wait=False, cancel_futures=True)
            self._status_pool = None
