"""Worker request counters: their layout in the table's counter row and their Prometheus text.

Every worker owns one row of u64 counters in the shared table and only ever adds to it; a
``/metrics`` scrape (answered by whichever worker the kernel picked) sums all rows with
``table.counters_sum()`` and renders them here, after the control process' own metrics
(aux blob 0). Nothing is locked, nothing is allocated per request: the hot path bumps a C
array in the worker, which is flushed into the row once a second and before every scrape.

Layout (``ROW_SIZE`` = 64 counters):

* one counter per (handler, code) pair a worker can produce (handler names follow
  kube2iam's labels where kube2iam has the route), plus one catch-all;
* a latency histogram over all requests, ``kiamfast_http_request_duration_seconds``:
  fixed buckets, sum in microseconds, count. The duration runs from the end of a request
  to its response being handed to the socket; requests answered in the same event-loop
  callback (everything served from the table without waiting) are observed as 0 s;
* a few worker event counters (waits, channel drops, connections).
"""

from __future__ import annotations

from kiamfast.server import routes

ROW_SIZE = 64

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

BUCKETS_S = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0)
HIST_BUCKET0 = OTHER + 1  # one counter per bucket (non-cumulative); +Inf = count
HIST_SUM_US = HIST_BUCKET0 + len(BUCKETS_S)
HIST_COUNT = HIST_SUM_US + 1

WAITS = HIST_COUNT + 1  # requests that waited for the table
WAIT_TIMEOUTS = WAITS + 1  # waits that ended in 503
CHANNEL_DROPS = WAIT_TIMEOUTS + 1  # messages to the control process dropped (EAGAIN)
CONNECTIONS = CHANNEL_DROPS + 1  # connections accepted
CONNECTIONS_REJECTED = CONNECTIONS + 1  # closed at once: over max_connections
CONNECTIONS_TIMED_OUT = CONNECTIONS_REJECTED + 1  # idle or slow clients closed
UPSTREAM_ERRORS = CONNECTIONS_TIMED_OUT + 1  # passthrough failures answered 503
USED = UPSTREAM_ERRORS + 1
assert USED <= ROW_SIZE, USED

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
)


def counter_index(kind: int, status: int) -> int:
    kind = COUNTED_AS.get(kind, kind)
    idx = PAIR_INDEX.get((kind, status))
    if idx is None and kind == routes.PASS:
        return PAIR_INDEX[(routes.PASS, 0)]
    return OTHER if idx is None else idx


def bucket_index(seconds: float) -> int:
    for i, bound in enumerate(BUCKETS_S):
        if seconds <= bound:
            return HIST_BUCKET0 + i
    return -1  # beyond the last bound: only in +Inf (the count)


def render(counters: list[int] | tuple[int, ...]) -> bytes:
    """Prometheus text exposition of the summed worker counters."""
    c = list(counters) + [0] * max(0, USED - len(counters))
    lines = [
        "# HELP kiamfast_http_requests_total HTTP requests answered by the server workers.",
        "# TYPE kiamfast_http_requests_total counter",
    ]
    for (kind, status), idx in PAIR_INDEX.items():
        code = str(status) if status else "other"
        lines.append(f'kiamfast_http_requests_total{{handler="{routes.NAMES[kind]}",'
                     f'code="{code}"}} {c[idx]}')
    lines.append(f'kiamfast_http_requests_total{{handler="other",code="other"}} {c[OTHER]}')
    lines += [
        "# HELP kiamfast_http_request_duration_seconds Time from the end of a request to "
        "its response (0 for answers from the table without waiting).",
        "# TYPE kiamfast_http_request_duration_seconds histogram",
    ]
    cumulative = 0
    for i, bound in enumerate(BUCKETS_S):
        cumulative += c[HIST_BUCKET0 + i]
        lines.append(f'kiamfast_http_request_duration_seconds_bucket{{le="{bound}"}} '
                     f"{cumulative}")
    lines.append(f'kiamfast_http_request_duration_seconds_bucket{{le="+Inf"}} {c[HIST_COUNT]}')
    lines.append(f"kiamfast_http_request_duration_seconds_sum {c[HIST_SUM_US] / 1e6:.6f}")
    lines.append(f"kiamfast_http_request_duration_seconds_count {c[HIST_COUNT]}")
    for idx, name, help_text in _EVENTS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {c[idx]}"]
    return ("\n".join(lines) + "\n").encode()
