"""The control process's own series, beside the credential manager's: kube2iam's health and
info gauges and duplicate-lookup counters, kiamfast's readiness, pods, runtime, watch and
container-credentials series.  Rendered by :mod:`kiamfast.metrics_text` every publish; the
workers append their own counters at scrape time."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kiamfast import metrics_text as text


@dataclass
class ControlState:
    """What the control process reports at one publish."""
    healthy: bool
    ready: bool
    runtime_up: bool
    publish_failures: int
    version: str
    commit: str
    built: str
    pods: int | None = None                      # None: no API source yet
    pending_pods: int = 0
    watch: Mapping[str, int] = field(default_factory=dict)
    runtime: Mapping[str, int] | None = None     # None: no runtime configured
    unproven: int | None = None                  # addresses claimed, not proven (runtime)
    container_lines: list[str] = field(default_factory=list)
    uninjected: int | None = None                # None: no container-credentials listener


def gauge(name: str, help_text: str, value: float, kind: str = "gauge") -> list[str]:
    return [*text.header(name, help_text, kind), text.sample(name, value)]


def render(s: ControlState) -> list[str]:
    lines = gauge("kube2iam_healthcheck_status", "The healthcheck status at scrape time. A "
                  "value of 1 means it is passing, 0 means it is failing.", int(s.healthy))
    lines += text.header("kube2iam_info", "Informational labels about the kube2iam process.",
                         "gauge")
    lines.append(text.sample("kube2iam_info", 1, (("version", s.version),
                                                  ("build_date", s.built),
                                                  ("commit_hash", s.commit))))
    # kube2iam's duplicate-IP API lookups (--resolve-duplicate-cache-ips): kiamfast never asks
    # the API which of two pods holds an address (the runtime, or the order of the API's own
    # writes, decides), so these stay 0.
    lines += gauge("kube2iam_iam_k8s_dup_req_count", "Total number of K8s API requests "
                   "performed when duplicated pods are identified in the cache (kiamfast "
                   "makes none: 0).", 0, "counter")
    lines += gauge("kube2iam_iam_k8s_dup_req_success_count", "Total number of times we "
                   "successfully retrieve the pod from the K8s API (kiamfast makes no such "
                   "request: 0).", 0, "counter")
    lines += gauge("kiamfast_ready", "Whether the agent is ready (synced and prefetched).",
                   int(s.ready))
    lines += gauge("kiamfast_publish_failures_total", "Metrics or debug texts too large to "
                   "publish.", s.publish_failures, "counter")
    lines += gauge("kiamfast_runtime_up", "Whether the container runtime answers (addresses "
                   "follow it); 0 = unreachable or not configured (addresses follow the API "
                   "server).", int(s.runtime_up))
    if s.runtime is not None:
        lines += text.header("kiamfast_runtime_total", "Container runtime activity by kind.",
                             "counter")
        lines += [text.sample("kiamfast_runtime_total", v, (("kind", k),))
                  for k, v in sorted(s.runtime.items())]
    if s.unproven is not None:
        lines += gauge("kiamfast_runtime_unproven_addresses", "Addresses a sandbox or the "
                       "API server claims that the kernel does not show in that sandbox's "
                       "network namespace: their requests wait, then get 503. Brief while a "
                       "sandbox starts or stops; lasting, the agent cannot read the "
                       "sandboxes' network namespaces (docs/troubleshooting.md).",
                       s.unproven)
    lines += s.container_lines
    if s.uninjected is not None:
        lines += gauge("kiamfast_container_credentials_uninjected_pods_total", "Pods of this "
                       "node that asked for container credentials and were created without "
                       "them (an Event ContainerCredentialsNotInjected is posted on each).",
                       s.uninjected, "counter")
    if s.pods is not None:
        lines += gauge("kiamfast_pods", "Pods of this node the agent knows.", s.pods)
        lines += gauge("kiamfast_pending_pods", "Live pods still waiting for an address.",
                       s.pending_pods)
        lines += text.header("kiamfast_watch_total", "Watch activity by kind (events, "
                             "bookmarks, lists, relists, gone = 410, errors, empty_watches "
                             "and bad_watch_bodies = watches that were not streams).",
                             "counter")
        lines += [text.sample("kiamfast_watch_total", v, (("kind", k),))
                  for k, v in s.watch.items()]
    return lines
