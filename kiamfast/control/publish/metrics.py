"""The agent's own series: kube2iam's health and info gauges and duplicate-lookup counters,
kiamfast's readiness and publish failures.  Each room adds its own (``metric_lines``: the
runtime source, the API link, the credential manager, the container-credentials listener,
the CPU-wait reader), all rendered by :mod:`kiamfast.metrics_text` every publish; the
workers append their own counters at scrape time."""
from __future__ import annotations

from kiamfast import metrics_text as text


def agent_lines(*, healthy: bool, ready: bool, publish_failures: int, version: str,
                commit: str, built: str) -> list[str]:
    lines = text.family("kube2iam_healthcheck_status", "The healthcheck status at scrape "
                        "time. A value of 1 means it is passing, 0 means it is failing.",
                        int(healthy))
    lines += text.header("kube2iam_info", "Informational labels about the kube2iam process.",
                         "gauge")
    lines.append(text.sample("kube2iam_info", 1, (("version", version), ("build_date", built),
                                                  ("commit_hash", commit))))
    # kube2iam's duplicate-IP API lookups (--resolve-duplicate-cache-ips): kiamfast never asks
    # the API which of two pods holds an address (the runtime, or the order of the API's own
    # writes, decides), so these stay 0.
    lines += text.family("kube2iam_iam_k8s_dup_req_count", "Total number of K8s API requests "
                         "performed when duplicated pods are identified in the cache "
                         "(kiamfast makes none: 0).", 0, "counter")
    lines += text.family("kube2iam_iam_k8s_dup_req_success_count", "Total number of times we "
                         "successfully retrieve the pod from the K8s API (kiamfast makes no "
                         "such request: 0).", 0, "counter")
    lines += text.family("kiamfast_ready", "Whether the agent is ready (synced and "
                         "prefetched).", int(ready))
    lines += text.family("kiamfast_publish_failures_total", "Metrics or debug texts too large "
                         "to publish.", publish_failures, "counter")
    return lines
