"""The agent's link to the container runtime: finding it, and telling a broken link from an
outage of the runtime itself.

* `AutoEndpointClient` (`--cri-endpoint=auto`): the runtime's socket can be briefly absent
  when the agent starts (containerd restarting), so the default paths are looked up again
  at every poll attempt until one exists; from then on that endpoint is the runtime, and
  its absence an outage.
* `LinkMonitor`: while the runtime cannot be asked, the agent answers less (the fallback of
  `mappings/merge.py`), so a lasting outage must reach the probes.  Two cases must be told apart:
  the agent's own link is dead (a bind mount of the socket *file* keeps the dead inode after
  containerd recreated its socket: only a container restart cures it) and the runtime is
  down for the whole node (restarting every agent cures nothing, and the kubelet could not
  even restart them: it needs the runtime for that).  The kubelet tells: it checks the
  runtime itself and reports the node not Ready ("container runtime is down") once the
  runtime has failed its status check for 30 s (kubelet `runtimeState`, `maxWaitForContainer
  Runtime`).  So the link counts as broken only when the agent has not reached the runtime
  for `grace` seconds while the node's Ready condition has been True for at least as long.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any, Callable, Mapping

from kiamfast.control.cri import client

log = logging.getLogger("kiamfast.runtime")

# Longer than the kubelet takes to report a dead runtime (30 s + one 10 s status update).
LINK_GRACE = 60.0


class AutoEndpointClient:
    """A `RuntimeClient` for the first default endpoint whose socket exists, looked up again
    at every attempt until one does."""

    def __init__(self, *, make_client: Callable[[str], Any] = client.RuntimeClient,
                 resolve: Callable[[str], str | None] = client.resolve_endpoint) -> None:
        self._make_client = make_client
        self._resolve = resolve
        self._client: Any = None

    @property
    def found(self) -> bool:
        return self._client is not None

    @property
    def endpoint(self) -> str:
        return self._client.endpoint if self._client is not None else "auto"

    @property
    def stats(self) -> dict[str, int]:
        return self._client.stats if self._client is not None else {}

    def poll(self) -> Any:
        if self._client is None:
            endpoint = self._resolve("auto")
            if endpoint is None:
                raise client.RuntimeUnavailable(
                    "--cri-endpoint=auto: no runtime socket at "
                    + ", ".join(e.removeprefix("unix://") for e in client.DEFAULT_ENDPOINTS))
            log.info("container runtime socket found: %s", endpoint)
            self._client = self._make_client(endpoint)
        return self._client.poll()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _parse_time(text: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (AttributeError, ValueError):
        return None


def node_ready_since(node: Mapping[str, Any]) -> float | None:
    """When the node's Ready condition last became True (epoch seconds), or None when it is
    not True (or unreadable)."""
    for cond in (node.get("status") or {}).get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready":
            if cond.get("status") != "True":
                return None
            return _parse_time(cond.get("lastTransitionTime") or "")
    return None


class LinkMonitor:
    """Tracks how long the runtime has been unreachable and whether the kubelet reaches it
    meanwhile.  `broken` is the reason the link is dead (for /healthz), or ""."""

    def __init__(self, *, grace: float = LINK_GRACE,
                 clock: Callable[[], float] = time.time) -> None:
        self.grace = grace
        self.clock = clock
        self.outage_since: float | None = None
        self.broken = ""

    def state(self, reachable: bool) -> None:
        if reachable:
            self.outage_since, self.broken = None, ""
        elif self.outage_since is None:
            self.outage_since = self.clock()

    def outage_seconds(self) -> float:
        return 0.0 if self.outage_since is None else self.clock() - self.outage_since

    def judge(self, node: Mapping[str, Any], endpoint: str, error: str) -> str:
        """Given the node as the API shows it now, decide whether the agent's link is broken;
        returns (and keeps) the reason, or ""."""
        now = self.clock()
        ready_since = node_ready_since(node)
        if self.outage_since is None or ready_since is None:
            self.broken = ""
            return ""
        both = now - max(ready_since, self.outage_since)
        if both < self.grace:
            self.broken = ""
            return ""
        self.broken = (f"container runtime unreachable for {now - self.outage_since:.0f}s while "
                       f"the kubelet reaches it (node Ready for {now - ready_since:.0f}s): the "
                       f"agent's link to {endpoint} is broken ({error}); a restart of the "
                       f"container renews it")
        return self.broken
