"""The pod and namespace watch: the control process's live view of the node.

kube2iam's informer resynced every 30 min, dropped bookmarks, and could not say "this pod
exists but has no IP yet"; kiam kept a cluster-wide cache in a separate server.  kiamfast
keeps one list + watch of the node's pods (`fieldSelector=spec.nodeName=<node>`, like the
kubelet; all pods without `--node`, like kube2iam) and, when the role policy reads namespace
annotations, one of the namespaces.  Every event goes straight into the ownership model
(`kiamfast.control.ownership`), which writes the shared table the workers answer from.

How it talks to the API server: the official `kubernetes` client supplies configuration
(kubeconfig, `--api-server`/`--api-token`, in-cluster) and transport (its urllib3 pool),
but the watch is read raw (`_preload_content=False`) and parsed line by line with orjson: no
model objects, and no `Watch(deserialize=False)`, which loses the resourceVersion and fails
on ERROR events (reference/techniques.md B4).  Protocol:

* LIST (the first one with `resourceVersion=0`, served from the API server's cache; relists
  without, for a consistent read), applied as one batch (`replace_pods`: adds and updates
  first, then removals);
* WATCH from the list's resourceVersion with `allowWatchBookmarks=true`, a jittered
  `timeoutSeconds` (240-300 s) and a client inactivity timeout (a half-dead connection is
  noticed); resumed from the last event's or bookmark's resourceVersion;
* 410 Gone (an ERROR event with code 410, or HTTP 410): relist;
* errors (429, 5xx, connection refused or dropped): retry with jittered exponential backoff
  (honouring Retry-After); never give up, never exit;
* a watch that is not a stream (it ends at once with no event or bookmark, or its body is
  not watch events, e.g. a list from a proxy that drops `watch=true`): an error, logged once
  per episode, backed off with jitter, counted as `empty_watches` / `bad_watch_bodies`;
* `--cache-resync-period`: a periodic relist-and-diff, as a safety net.

Threads: each watch blocks in its own thread on the client's socket; events are handed to
the asyncio loop with `call_soon_threadsafe` (in order), where the model is updated and the
table committed.  The model is only ever touched on the loop.

Synced = the initial lists applied (namespaces first when they matter, so no pod is judged
against a namespace not yet seen).  The control process waits for it before reporting ready.

What it must never do: stop watching, apply events out of order, or drop a pod from the
table during a relist while it is still listed.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from kiamfast.control.mappings.model import NodeModel
from kiamfast.budget import backoff

log = logging.getLogger("kiamfast.watch")


class WatchGone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class WatchError(Exception):
    """The watch stream reported an error other than 410."""

    def __init__(self, message: str, *, status: int = 0, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class WatchNotStreaming(Exception):
    """A watch answered with something other than a live stream: it ended at once with no
    event or bookmark (``kind="empty_watches"``), or its body was not watch events, e.g. a
    plain list from a proxy that drops ``watch=true`` (``kind="bad_watch_bodies"``).
    Retrying at once would hammer the API server, so this is backed off like an error."""

    def __init__(self, message: str, *, kind: str):
        super().__init__(message)
        self.kind = kind


# The event types of a watch stream (watch.Event in apimachinery).
_WATCH_TYPES = frozenset(("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"))


def make_api_client(*, kubeconfig: str = "", api_server: str = "", api_token: str = "",
                    insecure: bool = False) -> Any:
    """A `kubernetes.client.ApiClient` configured like kube2iam: `--kubeconfig` wins, then
    `--api-server` with `--api-token`, then the in-cluster service account."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    cfg = kclient.Configuration()
    if kubeconfig:
        kconfig.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    elif api_server and api_token:
        cfg.host = api_server.rstrip("/")
        # The full header value: client versions differ in how they look a prefix up.
        cfg.api_key = {"authorization": f"Bearer {api_token}"}
    else:
        kconfig.load_incluster_config(client_configuration=cfg)
    if insecure:
        cfg.verify_ssl = False
    return kclient.ApiClient(cfg)


@dataclass
class _Resource:
    name: str                       # "pods" / "namespaces"
    call: Callable[..., Any]        # the CoreV1Api list method
    field_selector: str | None


class PodWatcher:
    """List + watch of the node's pods (and namespaces when needed), fed into `model`.

    Run `await watcher.run()` as a task; `await watcher.wait_synced()`;
    `await watcher.stop()` at shutdown.
    """

    def __init__(
        self,
        *,
        api_client: Any,
        model: NodeModel,
        node: str | None = None,
        watch_namespaces: bool | None = None,
        resync_period: float = 1800.0,
        watch_timeout: tuple[float, float] = (240.0, 300.0),
        inactivity_timeout: float = 120.0,
        connect_timeout: float = 5.0,
        list_timeout: float = 60.0,
        backoff: tuple[float, float] = (0.1, 30.0),
        expire_interval: float = 1.0,
        namespace_wait: float = 10.0,
    ) -> None:
        from kubernetes import client as kclient

        self.api_client = api_client
        self.model = model
        self.node = node or None
        self.resync_period = resync_period
        self.watch_timeout = watch_timeout
        self.inactivity_timeout = inactivity_timeout
        self.connect_timeout = connect_timeout
        self.list_timeout = list_timeout
        self.backoff = backoff
        self.expire_interval = expire_interval
        self.namespace_wait = namespace_wait
        core = kclient.CoreV1Api(api_client)
        self._pods = _Resource("pods", core.list_pod_for_all_namespaces,
                               f"spec.nodeName={node}" if node else None)
        self._namespaces = _Resource("namespaces", core.list_namespace, None)
        if watch_namespaces is None:
            watch_namespaces = model.policy.uses_namespaces
        self.watch_namespaces = watch_namespaces
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._ns_listed = threading.Event()
        self._listed: set[str] = set()
        self._synced: asyncio.Event | None = None
        self._done: asyncio.Event | None = None
        self._threads: list[threading.Thread] = []
        self._responses: dict[str, Any] = {}
        self._resp_lock = threading.Lock()
        self.counters: dict[str, int] = {
            "lists": 0, "relists": 0, "watches": 0, "events": 0, "bookmarks": 0,
            "gone": 0, "errors": 0, "batches": 0,
            "empty_watches": 0, "bad_watch_bodies": 0,
        }
        self._not_streaming: dict[str, int] = {}   # resource -> watches in a row that were not
        self.sync_seconds: float | None = None
        # Told of every pod applied from the API, on the loop (container_credentials/
        # uninjected.py); must be cheap and never raise.
        self.on_pod: Callable[[dict[str, Any]], None] | None = None

    @classmethod
    def from_config(cls, config: Any, *, model: NodeModel, api_client: Any = None,
                    **kw: Any) -> "PodWatcher":
        """Build from `kiamfast.config.Config`: API client, node, resync."""
        if api_client is None:
            api_client = make_api_client(kubeconfig=config.kubeconfig, api_server=config.api_server,
                                         api_token=config.api_token, insecure=config.insecure)
        return cls(api_client=api_client, model=model, node=config.node or None,
                   resync_period=config.cache_resync_period, **kw)

    # ---- life cycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Start the watches and keep them going until `stop()`."""
        self._loop = asyncio.get_running_loop()
        self._synced = asyncio.Event()
        self._done = asyncio.Event()
        self._started_at = time.monotonic()
        resources = [self._pods] + ([self._namespaces] if self.watch_namespaces else [])
        if not self.watch_namespaces:
            self._ns_listed.set()
        for res in resources:
            t = threading.Thread(target=self._thread_main, args=(res,), daemon=True,
                                 name=f"kiamfast-watch-{res.name}")
            t.start()
            self._threads.append(t)
        try:
            while not self._stopping.is_set():
                try:
                    await asyncio.wait_for(self._done.wait(), self.expire_interval)
                except asyncio.TimeoutError:
                    pass
                self.model.expire()
                self.model.commit()
        finally:
            self._stopping.set()

    async def wait_synced(self, timeout: float | None = None) -> bool:
        while self._synced is None:
            await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    @property
    def synced(self) -> bool:
        return self._synced is not None and self._synced.is_set()

    async def stop(self) -> None:
        self._stopping.set()
        if self._done is not None:
            self._done.set()
        with self._resp_lock:
            responses = list(self._responses.values())
        for resp in responses:
            _shutdown(resp)
        loop = asyncio.get_running_loop()
        for t in self._threads:
            await loop.run_in_executor(None, t.join, 5.0)
        self._threads.clear()

    # ---- introspection ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["model"] = dict(self.model.counters)
        out["pods"] = len(self.model.pods)
        out["pending_pods"] = self.model.pending_pods
        out["synced"] = self.synced
        out["sync_seconds"] = self.sync_seconds
        return out

    # ---- the loop side --------------------------------------------------------------------------

    def _deliver(self, res: str, kind: str, payload: Any) -> None:
        """Runs on the loop: apply a list or a batch of watch events, then commit."""
        m = self.model
        if kind == "events":
            self.counters["batches"] += 1
            for typ, obj in payload:
                if typ == "BOOKMARK":
                    pass          # only moves the resourceVersion the watch resumes from
                elif res == "pods":
                    if typ == "DELETED":
                        m.delete_pod(obj)
                    else:
                        m.apply_pod(obj)
                        if self.on_pod is not None:
                            self.on_pod(obj)
                else:
                    if typ == "DELETED":
                        m.delete_namespace(obj)
                    else:
                        m.apply_namespace(obj)
        elif kind == "list":
            items, list_rv, _ = payload
            if res == "pods":
                m.replace_pods(items, list_rv=list_rv)
                if self.on_pod is not None:
                    for obj in items:
                        self.on_pod(obj)
            else:
                m.replace_namespaces(items)
                self._ns_listed.set()
            self._listed.add(res)
        if not m.synced and "pods" in self._listed and (
                not self.watch_namespaces or "namespaces" in self._listed):
            m.set_synced(True)
            self.sync_seconds = time.monotonic() - self._started_at
            log.info("synced: %d pods after %.3fs", len(m.pods), self.sync_seconds)
            assert self._synced is not None
            self._synced.set()
        m.commit()

    def _post(self, res: str, kind: str, payload: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, res, kind, payload)
        except RuntimeError:   # loop closed while stopping
            pass

    # ---- the thread side ----------------------------------------------------------------------

    def _thread_main(self, res: _Resource) -> None:
        rv = ""
        need_list = True
        first = True
        failures = 0
        next_resync = 0.0
        while not self._stopping.is_set():
            try:
                if need_list:
                    if res is self._pods and not self._ns_listed.is_set():
                        self._ns_listed.wait(self.namespace_wait)
                    started = self.model.clock()
                    items, rv = self._list(res, initial=first)
                    self.counters["lists" if first else "relists"] += 1
                    self._post(res.name, "list", (items, _int_rv(rv), started))
                    first = False
                    need_list = False
                    failures = 0
                    if self.resync_period > 0:
                        next_resync = (time.monotonic()
                                       + self.resync_period * random.uniform(0.9, 1.0))
                timeout = random.uniform(*self.watch_timeout)
                if self.resync_period > 0:
                    timeout = min(timeout, max(1.0, next_resync - time.monotonic()))
                rv, got = self._watch(res, rv, timeout)
                if got:
                    failures = 0
                if self.resync_period > 0 and time.monotonic() >= next_resync:
                    need_list = True
            except WatchNotStreaming as e:
                if self._stopping.is_set():
                    break
                failures += 1
                not_streaming = self._not_streaming[res.name] = \
                    self._not_streaming.get(res.name, 0) + 1
                self.counters[e.kind] += 1
                delay = self._delay(failures, None)
                if not_streaming == 1:   # once per episode; the counter has the rest
                    log.warning("%s watch: %s; backing off (%.2fs, growing), counted as "
                                "kiamfast_watch_total{kind=\"%s\"}, logged once until the "
                                "watch streams again", res.name, e, delay, e.kind)
                self._sleep(delay)
            except WatchGone:
                self.counters["gone"] += 1
                log.info("%s watch: resourceVersion %s expired (410); relisting", res.name, rv)
                need_list = True
                # A 410 right after a list would loop; the backoff below keeps it polite.
                failures += 1
                self._sleep(self._delay(failures, None) if failures > 1 else 0.0)
            except Exception as e:  # noqa: BLE001 - the watch must never stop
                if self._stopping.is_set():
                    break
                failures += 1
                self.counters["errors"] += 1
                status, retry_after = _status_of(e)
                if status == 410:
                    self.counters["gone"] += 1
                    need_list = True
                    self._sleep(self._delay(failures, None) if failures > 1 else 0.0)
                    continue
                delay = self._delay(failures, retry_after)
                log.warning("%s %s failed (%s); retrying in %.2fs", res.name,
                            "list" if need_list else "watch", _describe(e), delay)
                self._sleep(delay)

    def _delay(self, failures: int, retry_after: float | None) -> float:
        base, cap = self.backoff
        d = backoff(failures, base=base, cap=cap)
        if retry_after is not None:
            d = max(d, retry_after)
        return d

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)

    def _list(self, res: _Resource, *, initial: bool) -> tuple[list[dict[str, Any]], str]:
        kw: dict[str, Any] = {"_preload_content": False,
                              "_request_timeout": (self.connect_timeout, self.list_timeout)}
        if res.field_selector:
            kw["field_selector"] = res.field_selector
        if initial:
            kw["resource_version"] = "0"   # served from the API server's cache
        resp = res.call(**kw)
        try:
            body = orjson.loads(resp.data)
        finally:
            resp.release_conn()
        items = body.get("items") or []
        rv = (body.get("metadata") or {}).get("resourceVersion") or ""
        log.debug("%s list: %d items at resourceVersion %s", res.name, len(items), rv)
        return items, rv

    def _watch(self, res: _Resource, rv: str, timeout: float) -> tuple[str, bool]:
        """One watch request; returns (last resourceVersion, whether anything arrived)."""
        kw: dict[str, Any] = {
            "watch": True, "allow_watch_bookmarks": True, "timeout_seconds": max(1, int(timeout)),
            "_preload_content": False,
            "_request_timeout": (self.connect_timeout, self.inactivity_timeout),
        }
        if rv:
            kw["resource_version"] = rv
        if res.field_selector:
            kw["field_selector"] = res.field_selector
        resp = res.call(**kw)
        self.counters["watches"] += 1
        with self._resp_lock:
            self._responses[res.name] = resp
        got = False
        buf = b""
        started = time.monotonic()
        try:
            if self._stopping.is_set():
                return rv, got
            for chunk in resp.stream(65536):
                buf += chunk
                if b"\n" not in buf:
                    continue
                *lines, buf = buf.split(b"\n")
                batch: list[tuple[str, dict[str, Any]]] = []
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        typ, obj = _watch_event(line)
                    except WatchNotStreaming:
                        if batch:
                            self._post(res.name, "events", batch)
                        raise
                    if typ == "ERROR":
                        if batch:
                            self._post(res.name, "events", batch)
                        code = obj.get("code")
                        if code == 410:
                            raise WatchGone(obj.get("message", "Gone"))
                        raise WatchError(f"watch ERROR {code}: {obj.get('message', '')}",
                                         status=int(code or 0))
                    new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if new_rv:
                        rv = new_rv
                    if not got and self._not_streaming.get(res.name):
                        log.info("%s watch streaming again after %d watches that were not",
                                 res.name, self._not_streaming.pop(res.name))
                    got = True
                    if typ == "BOOKMARK":
                        self.counters["bookmarks"] += 1
                    else:
                        self.counters["events"] += 1
                    batch.append((typ, obj))
                if batch:
                    self._post(res.name, "events", batch)
            if buf.strip():
                raise WatchNotStreaming(f"the body was not watch events ({_excerpt(buf)})",
                                        kind="bad_watch_bodies")
            # A quiet watch runs its whole timeout; one that ends long before, having sent
            # not even a bookmark, is not a stream (a list, a proxy, a broken server).
            if not got and not self._stopping.is_set() and (
                    time.monotonic() - started < kw["timeout_seconds"] / 2):
                raise WatchNotStreaming("the watch ended at once with no event or bookmark",
                                        kind="empty_watches")
            return rv, got
        finally:
            with self._resp_lock:
                if self._responses.get(res.name) is resp:
                    del self._responses[res.name]
            resp.release_conn()


def _watch_event(line: bytes) -> tuple[str, dict[str, Any]]:
    """(type, object) of one watch stream line; WatchNotStreaming if it is not an event."""
    try:
        ev = orjson.loads(line)
    except orjson.JSONDecodeError:
        ev = None
    if not isinstance(ev, dict) or ev.get("type") not in _WATCH_TYPES \
            or not isinstance(ev.get("object") or {}, dict):
        raise WatchNotStreaming(f"the body was not watch events ({_excerpt(line)})",
                                kind="bad_watch_bodies")
    return ev["type"], ev.get("object") or {}


def _excerpt(data: bytes, limit: int = 80) -> str:
    text = data.strip()[:limit].decode("utf-8", "replace")
    return repr(text + ("..." if len(data.strip()) > limit else ""))


def _int_rv(rv: str) -> int:
    try:
        return int(rv)
    except (TypeError, ValueError):
        return 0


def _shutdown(resp: Any) -> None:
    """Unblock a thread reading `resp` (urllib3 >= 2.3 has shutdown())."""
    try:
        if hasattr(resp, "shutdown"):
            resp.shutdown()
        else:
            resp.close()
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass


def _status_of(e: BaseException) -> tuple[int, float | None]:
    status = getattr(e, "status", 0) or 0
    retry_after = None
    headers = getattr(e, "headers", None)
    if headers:
        try:
            ra = headers.get("Retry-After")
            retry_after = float(ra) if ra else None
        except (TypeError, ValueError):
            retry_after = None
    return int(status), retry_after


def _describe(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '')}".strip()
    return f"{type(e).__name__}: {e}"
