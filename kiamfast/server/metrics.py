"""Worker request counters: their layout in the table's counter row and their Prometheus text.

Every worker owns one row of u64 counters in the shared table and only ever adds to it; a
``/metrics`` scrape (answered by whichever worker the kernel picked) sums all rows with
``table.counters_sum()`` and renders them here, after the control process' own metrics
(aux blob 0). Nothing is locked, nothing is allocated per request: the hot path bumps a C
array in the worker, which is flushed into the row once a second and before every scrape.

Layout (``ROW_SIZE`` counters):

* one counter per (route, code) pair a worker can produce, plus one catch-all:
  ``kiamfast_http_requests_total{handler,code}`` with kiamfast's own route names;
* kube2iam's histogram ``kube2iam_http_request_duration_seconds{code,method,handler}``,
  with kube2iam's buckets (1 ms, doubling, 14 buckets) and its handler labels for the
  same requests (securityCredentialsHandler, roleHandler, healthHandler,
  debugStoreHandler, and reverseProxyHandler for everything kube2iam would have proxied:
  the token PUT, iam/info, the passthrough, /readyz). Methods other than GET, PUT and HEAD
  are counted as ``OTHER``; /metrics is not timed, as in kube2iam. One series (buckets,
  sum in microseconds, count) per handler x method x code. The duration runs from the end
  of a request to its response being handed to the socket; answers from the table without
  waiting are observed in the first bucket;
* a few worker event counters (waits, channel drops, connections).
"""

from __future__ import annotations

import itertools

from kiamfast import metrics_text as text
from kiamfast.server import routes


# (route kind, status) pairs with their own counter. Passthrough codes the upstream sends
# that are not listed here land in (PASS, 0) = code "other".
_PAIRS: list[tuple[int, int]] = [
    (routes.TOKEN, 200), (routes.TOKEN, 400), (routes.TOKEN, 403), (routes.TOKEN, 405),
    (routes.LISTING, 200), (routes.LISTING, 401), (routes.LISTING, 404),
    (routes.LISTING, 500), (routes.LISTING, 503),
    (routes.DOCUMENT, 200), (routes.DOCUMENT, 401), (routes.DOCUMENT, 404),
    (routes.DOCUMENT, 500), (routes.DOCUMENT, 503),
    (routes.INFO, 200), (routes.INFO, 401), (routes.INFO, 404), (routes.INFO, 500),
    (routes.INFO, 503),
    (routes.DENY, 401), (routes.DENY, 404),
    (routes.PASS, 200), (routes.PASS, 401), (routes.PASS, 404), (routes.PASS, 503),
    (routes.PASS, 0),
    (routes.HEALTHZ, 200), (routes.HEALTHZ, 500), (routes.READYZ, 200), (routes.READYZ, 503),
    (routes.METRICS, 200), (routes.DEBUG_STORE, 200), (routes.DEBUG_STORE, 404),
    (routes.BAD, 400), (routes.BAD, 405), (routes.BAD, 408), (routes.BAD, 413),
    (routes.BAD, 414), (routes.BAD, 431), (routes.BAD, 500),
]
PAIR_INDEX: dict[tuple[int, int], int] = {pair: i for i, pair in enumerate(_PAIRS)}
OTHER = len(_PAIRS)  # anything not listed above

# Credential routes report under kube2iam's handler names; the extended variants are
# counted with their legacy twins (same handler in kube2iam terms).
COUNTED_AS = {routes.EXT_LISTING: routes.LISTING, routes.EXT_DOCUMENT: routes.DOCUMENT}

# kube2iam's HTTP histogram (its metrics/metrics.go: ExponentialBuckets(0.001, 2, 14)).
BUCKETS_S = tuple(0.001 * 2 ** i for i in range(14))
HANDLERS = ("securityCredentialsHandler", "roleHandler", "healthHandler",
            "debugStoreHandler", "reverseProxyHandler")
HANDLER_OF = {routes.LISTING: 0, routes.EXT_LISTING: 0, routes.DOCUMENT: 1,
              routes.EXT_DOCUMENT: 1, routes.HEALTHZ: 2, routes.DEBUG_STORE: 3}
NOT_TIMED = frozenset({routes.METRICS})
METHODS = ("GET", "PUT", "HEAD", "OTHER")
CODES = (200, 400, 401, 403, 404, 405, 408, 413, 414, 431, 500, 503, 0)   # 0: any other
SERIES_SIZE = len(BUCKETS_S) + 2        # buckets (non-cumulative), sum (us), count
SUM_US, COUNT = len(BUCKETS_S), len(BUCKETS_S) + 1
HIST0 = OTHER + 1
NSERIES = len(HANDLERS) * len(METHODS) * len(CODES)


def series_index(kind: int, method: int, code_slot: int) -> int:
    """First counter of the histogram series of a request, or -1 (not timed)."""
    if kind in NOT_TIMED:
        return -1
    handler = HANDLER_OF.get(kind, len(HANDLERS) - 1)
    return HIST0 + ((handler * len(METHODS) + method) * len(CODES) + code_slot) * SERIES_SIZE


def code_slot(status: int) -> int:
    """Index of a status in CODES (the last one for any code not listed)."""
    try:
        return CODES.index(status)
    except ValueError:
        return len(CODES) - 1


WAITS = HIST0 + NSERIES * SERIES_SIZE  # requests that waited for the table
WAIT_TIMEOUTS = WAITS + 1  # waits that ended in 503
CHANNEL_DROPS = WAIT_TIMEOUTS + 1  # messages to the control process dropped (EAGAIN)
CONNECTIONS = CHANNEL_DROPS + 1  # connections accepted
CONNECTIONS_REJECTED = CONNECTIONS + 1  # closed at once: over max_connections
CONNECTIONS_TIMED_OUT = CONNECTIONS_REJECTED + 1  # idle or slow clients closed
UPSTREAM_ERRORS = CONNECTIONS_TIMED_OUT + 1  # passthrough failures answered 503
CLIENT_LIMIT = UPSTREAM_ERRORS + 1  # closed at once: the address had too many connections
POD_NOT_FOUND = CLIENT_LIMIT + 1  # answered 404: no pod owns the caller's address
CONNECTIONS_EVICTED = POD_NOT_FOUND + 1  # closed to make room for another address at the cap
PASSTHROUGH_LIMITED = CONNECTIONS_EVICTED + 1  # passthrough answered 429: address over its bound
WAIT_RECHECKS = PASSTHROUGH_LIMITED + 1  # waiting requests looked up again after a table change
USED = WAIT_RECHECKS + 1

_EVENTS = (
    (WAITS, "kiamfast_worker_waits_total", "Requests that waited for a table change."),
    (WAIT_TIMEOUTS, "kiamfast_worker_wait_timeouts_total",
     "Waits that ran out of budget and were answered 503."),
    (CHANNEL_DROPS, "kiamfast_worker_channel_drops_total",
     "Worker-to-control messages dropped because the channel was full."),
    (CONNECTIONS, "kiamfast_worker_connections_total", "Connections accepted."),
    (CONNECTIONS_REJECTED, "kiamfast_worker_connections_rejected_total",
     "Connections closed at once because the worker was at max_connections."),
    (CONNECTIONS_TIMED_OUT, "kiamfast_worker_connections_timed_out_total",
     "Idle or slow connections closed by the worker."),
    (UPSTREAM_ERRORS, "kiamfast_worker_upstream_errors_total",
     "Passthrough requests answered 503 because the metadata service failed."),
    (CLIENT_LIMIT, "kiamfast_worker_client_limit_total",
     "Connections closed at once because their address held the per-address maximum."),
    (CONNECTIONS_EVICTED, "kiamfast_worker_connections_evicted_total",
     "Idle connections closed at max_connections to let another address in."),
    (PASSTHROUGH_LIMITED, "kiamfast_worker_passthrough_limited_total",
     "Passthrough requests answered 429: their address was over its rate or concurrency."),
    (WAIT_RECHECKS, "kiamfast_worker_wait_rechecks_total",
     "Waiting requests looked up again after a table change."),
    # kube2iam's name (a counter without _total, as its Go client registers it): there it
    # counts lookups of an address its pod cache lacked, here answers for such addresses.
    (POD_NOT_FOUND, "kube2iam_iam_k8s_pod_not_in_pod_cache",
     "Total number of times we don't have the pod info in the cache."),
)


def counter_index(kind: int, status: int) -> int:
    kind = COUNTED_AS.get(kind, kind)
    idx = PAIR_INDEX.get((kind, status))
    if idx is None and kind == routes.PASS:
        return PAIR_INDEX[(routes.PASS, 0)]
    return OTHER if idx is None else idx


def render(counters: list[int] | tuple[int, ...]) -> bytes:
    """Prometheus text exposition of the summed worker counters."""
    c = list(counters) + [0] * max(0, USED - len(counters))
    lines = text.header("kiamfast_http_requests_total",
                        "HTTP requests answered by the server workers.", "counter")
    for (kind, status), idx in PAIR_INDEX.items():
        lines.append(text.sample("kiamfast_http_requests_total", c[idx], (
            ("handler", routes.NAMES[kind]), ("code", str(status) if status else "other"))))
    lines.append(text.sample("kiamfast_http_requests_total", c[OTHER],
                             (("handler", "other"), ("code", "other"))))
    lines += text.header("kube2iam_http_request_duration_seconds",
                         "Time taken for kube2iam to serve HTTP request.", "histogram")
    for h, handler in enumerate(HANDLERS):
        for m, method in enumerate(METHODS):
            for k, status in enumerate(CODES):
                base = HIST0 + ((h * len(METHODS) + m) * len(CODES) + k) * SERIES_SIZE
                count = c[base + COUNT]
                if not count:
                    continue     # like kube2iam: a series exists once it was observed
                cumulative = list(itertools.accumulate(c[base:base + len(BUCKETS_S)]))
                labels = (("code", str(status or "other")), ("handler", handler),
                          ("method", method))
                lines += text.histogram_samples("kube2iam_http_request_duration_seconds",
                                                labels, BUCKETS_S, cumulative,
                                                c[base + SUM_US] / 1e6, count)
    for idx, name, help_text in _EVENTS:
        lines += [*text.header(name, help_text, "counter"), text.sample(name, c[idx])]
    return text.render(lines)
